package kvroute

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/scorer"
)

// routerState is everything of a Router that routing changes and Probe must not.
type routerState struct {
	Stats   Stats
	Backlog map[string]int64
	TieTurn uint64
	RR      uint64
	Active  int
}

func stateOf(t *testing.T, r *DefaultRouter) routerState {
	t.Helper()
	s := routerState{Stats: statsOf(t, r), Backlog: map[string]int64{}, RR: r.rr.Load()}
	for name, st := range r.set.Load().byName {
		s.Backlog[name] = st.backlog.Load()
	}
	if r.kv != nil {
		// The index counts the lookups it answers, the probe's among them (kvindex.Stats.Lookups);
		// the Router's own lookup counter (Stats.Lookups) must not move.
		if s.Stats.Index != nil {
			s.Stats.Index.Lookups = 0
		}
		s.TieTurn = r.kv.tieTurn.Load()
		if r.kv.active != nil {
			s.Active = r.kv.active.Len()
		}
	}
	return s
}

// lockstep probes and then routes each request of reqs, holding every decision: each probe
// leaves the Router as it found it and names the backend and reason Route then picks. It
// returns the probes.
func lockstep(t *testing.T, r *DefaultRouter, reqs ...*prefixkey.Request) []ProbeResult {
	t.Helper()
	ctx := context.Background()
	var out []ProbeResult
	for i, req := range reqs {
		before := stateOf(t, r)
		p, err := r.Probe(ctx, req)
		require.NoError(t, err)
		require.Equal(t, before, stateOf(t, r), "request %d: Probe changed the Router", i)
		_, err = json.Marshal(p)
		require.NoError(t, err, "the probe's JSON")
		d, err := r.Route(ctx, req)
		require.NoError(t, err)
		t.Cleanup(func() { d.Done(Outcome{}) })
		require.Equal(t, d.Backend, p.Backend, "request %d: probe %+v", i, p)
		require.Equal(t, d.Reason, p.Reason, "request %d: %s", i, p.Why)
		require.Equal(t, d.ExpectedCachedTokens, p.ExpectedCachedTokens, "request %d", i)
		out = append(out, p)
	}
	return out
}

func repeat(req *prefixkey.Request, n int) []*prefixkey.Request {
	out := make([]*prefixkey.Request, n)
	for i := range out {
		out[i] = req
	}
	return out
}

func probeBackend(t *testing.T, p ProbeResult, name string) ProbeBackend {
	t.Helper()
	for _, b := range p.Backends {
		if b.Backend == name {
			return b
		}
	}
	t.Fatalf("no backend %q in the probe", name)
	return ProbeBackend{}
}

// Tier 4: the holder of a prompt takes it (kv_aware) until it reaches tier 4's bound, then the
// best-scored other backend (load_bound); every probe foretells the decision, speculation on,
// and changes nothing (no speculative entry, slot, backlog, active sequence or count).
func TestProbeTier4KVAwareThenLoadBound(t *testing.T) {
	ix := newMemIndex(t)
	sc, _ := tracked(t)
	r := newRouter(t, Config{Backends: backends(4), KV: &KVConfig{Index: ix, LoadFactorEpsilon: 0.25, Scorer: sc}})
	toks := promptTokens(11, 16*16+3)
	storeBlocks(t, ix, "vllm-2", toks, 16, events.TierCPU)
	probes := lockstep(t, r, repeat(tokReq("hot", toks), 8)...)

	first := probes[0]
	assert.Equal(t, 4, first.RoutingTier)
	assert.Equal(t, ReasonKVAware, first.Reason)
	require.NotNil(t, first.KV)
	assert.Equal(t, 16, first.KV.Blocks)
	assert.Equal(t, 16*16+3, first.KV.PromptTokens)
	assert.True(t, first.KV.ThresholdMet)
	assert.InDelta(t, 0.8, first.KV.BestOverlapRatio, 1e-9, "16 CPU blocks of 16, weighted 0.8")
	holder := probeBackend(t, first, "vllm-2")
	assert.Equal(t, 16, holder.CachedBlocks)
	assert.Equal(t, 256, holder.CachedTokens)
	assert.Equal(t, "cpu", holder.CacheTier)
	require.NotNil(t, holder.Score)
	assert.Equal(t, 0, probeBackend(t, first, "vllm-1").CachedBlocks)
	assert.Empty(t, probeBackend(t, first, "vllm-1").CacheTier)
	assert.Positive(t, holder.KVBound)

	reasons := map[Reason]int{}
	for _, p := range probes {
		reasons[p.Reason]++
	}
	require.Positive(t, reasons[ReasonLoadBound], "the bound must have sent some requests elsewhere: %v", reasons)
	for _, p := range probes {
		if p.Reason == ReasonLoadBound {
			assert.True(t, probeBackend(t, p, "vllm-2").AtKVBound, "load_bound while the holder is under its bound: %s", p.Why)
		}
	}
}

// Tier 4's least-work rule with ties: the rotation that spreads a cold fleet's new prompts is
// foretold, not moved; the backlog each decision adds shows in the next probe.
func TestProbeTier4LeastWorkTies(t *testing.T) {
	ix := newMemIndex(t)
	r := newRouter(t, Config{Backends: backends(3), KV: &KVConfig{Index: ix}})
	var reqs []*prefixkey.Request
	for i := range 7 {
		reqs = append(reqs, tokReq(fmt.Sprint("cold ", i), promptTokens(100+i, 8*16)))
	}
	reqs = append(reqs, tokReq("short", promptTokens(200, 5))) // shorter than a block
	probes := lockstep(t, r, reqs...)
	for _, p := range probes {
		assert.Equal(t, ReasonLeastWork, p.Reason, p.Why)
		assert.False(t, p.KV.ThresholdMet)
		for _, b := range p.Backends {
			require.NotNil(t, b.PrefillWork, "least_work reports every backend's work")
		}
	}
	assert.Equal(t, 8*16, probeBackend(t, probes[1], probes[0].Backend).PendingPrefillTokens,
		"the first decision's prompt is on its backend's backlog")
	assert.Contains(t, probes[7].Why, "shorter than one block")
}

// The imbalance guard: a skewed fleet sends a cached prompt to the least-loaded backend.
func TestProbeTier4Imbalance(t *testing.T) {
	ix := newMemIndex(t)
	r := newRouter(t, Config{Backends: backends(3), KV: &KVConfig{Index: ix, Speculation: SpeculationOff,
		Guard: scorer.Guard{MaxSpread: 2}, LoadFactorEpsilon: 10}})
	toks := promptTokens(12, 8*16)
	storeBlocks(t, ix, "vllm-1", toks, 8, events.TierGPU)
	probes := lockstep(t, r, repeat(tokReq("hot", toks), 5)...)
	var skewed bool
	for _, p := range probes {
		if p.Reason == ReasonImbalance {
			skewed = true
			assert.True(t, p.KV.Skewed)
		}
	}
	assert.True(t, skewed, "the guard must have fired once vllm-1 ran 3 ahead")
}

// Tier 1: the prefix key's owner takes the requests until it is at the ring's bound, then the
// ring overflows clockwise; the owner stays what it was. Without a prefix key, the strategy's
// rotation is foretold.
func TestProbeTier1(t *testing.T) {
	t.Run("ring", func(t *testing.T) {
		r := newRouter(t, Config{Backends: backends(4)})
		probes := lockstep(t, r, repeat(chatReq("system prompt", "hello"), 9)...)
		owner := probes[0].RingOwner
		require.NotEmpty(t, owner)
		assert.Equal(t, owner, probes[0].Backend)
		assert.Equal(t, ReasonPrefixHash, probes[0].Reason)
		assert.Equal(t, 1, probes[0].RoutingTier)
		assert.Nil(t, probes[0].KV)
		overflow := 0
		for _, p := range probes {
			assert.Equal(t, owner, p.RingOwner)
			assert.NotEmpty(t, p.PrefixKey)
			if p.Reason == ReasonOverflow {
				overflow++
				assert.True(t, probeBackend(t, p, owner).AtRingBound, p.Why)
				assert.NotEqual(t, owner, p.Backend)
			}
		}
		assert.Positive(t, overflow, "the owner must have reached the ring's bound")
	})
	for _, strategy := range []Strategy{StrategyRoundRobin, StrategyLeastLoaded, StrategyLeastLatency} {
		t.Run(string(strategy), func(t *testing.T) {
			r := newRouter(t, Config{Backends: backends(3), Strategy: strategy})
			probes := lockstep(t, r, repeat(&prefixkey.Request{Model: "m"}, 7)...)
			assert.Equal(t, ReasonFallback, probes[0].Reason)
			assert.Empty(t, probes[0].PrefixKey)
		})
	}
	t.Run("random", func(t *testing.T) {
		r := newRouter(t, Config{Backends: backends(3), Strategy: StrategyRandom})
		p, err := r.Probe(context.Background(), &prefixkey.Request{Model: "m"})
		require.NoError(t, err)
		assert.Equal(t, ReasonFallback, p.Reason)
		assert.Empty(t, p.Backend, "a random draw cannot be foretold")
	})
	t.Run("disabled", func(t *testing.T) {
		r := newRouter(t, Config{Backends: backends(2), DisablePrefixRouting: true})
		probes := lockstep(t, r, repeat(chatReq("sys", "hi"), 3)...)
		assert.Equal(t, ReasonStrategy, probes[0].Reason)
	})
}

// Tier 4 on, but the request has no tokens: tier 4 hands it to the ring, and says why.
func TestProbeTier4HandsOff(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(3), KV: &KVConfig{Index: newMemIndex(t)}})
	probes := lockstep(t, r, chatReq("system", "no tokens"))
	assert.Equal(t, ReasonPrefixHash, probes[0].Reason)
	require.NotNil(t, probes[0].KV)
	assert.Equal(t, "no_block_keys", probes[0].KV.HandedOff)
	assert.Contains(t, probes[0].Why, "tier 4 leaves it")

	failing := newRouter(t, Config{Backends: backends(3), KV: &KVConfig{Index: lookupOnly{failingIndex{}}, Speculation: SpeculationOff}})
	probes = lockstep(t, failing, tokReq("x", promptTokens(1, 64)))
	assert.Equal(t, "lookup_error", probes[0].KV.HandedOff)
	assert.NotEmpty(t, probes[0].KV.Error)
}

func TestProbeEdgeCases(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(2)})
	_, err := r.Probe(context.Background(), nil)
	assert.ErrorIs(t, err, ErrNilRequest)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = r.Probe(ctx, chatReq("a", "b"))
	assert.ErrorIs(t, err, context.Canceled)

	for _, n := range []string{"vllm-1", "vllm-2"} {
		require.NoError(t, r.SetHealthy(n, false))
	}
	p, err := r.Probe(context.Background(), chatReq("a", "b"))
	require.NoError(t, err)
	assert.Empty(t, p.Backend)
	assert.Equal(t, 0, p.RoutingTier)
	assert.Len(t, p.Backends, 2)
	assert.False(t, p.Backends[0].Healthy)
	_, err = r.Route(context.Background(), chatReq("a", "b"))
	assert.ErrorIs(t, err, ErrNoBackend)

	b, err := json.Marshal(ProbeResult{Reason: ReasonKVAware})
	require.NoError(t, err)
	assert.Contains(t, string(b), `"reason":"kv_aware"`)
}

// lookupOnly is an index that implements nothing but Lookup.
type lookupOnly struct{ kvindex.Lookuper }

func TestReasonTextRoundTrip(t *testing.T) {
	for _, r := range append([]Reason{0}, allReasons[:]...) {
		b, err := r.MarshalText()
		require.NoError(t, err)
		var back Reason
		require.NoError(t, back.UnmarshalText(b))
		assert.Equal(t, r, back)
	}
	var r Reason
	assert.Error(t, r.UnmarshalText([]byte("teleport")))
}
