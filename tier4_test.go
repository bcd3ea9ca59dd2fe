package kvroute

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/scorer"
)

const testModel = "llama-3-8b"

// promptTokens returns n deterministic tokens; seed varies the sequence.
func promptTokens(seed, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32((seed*7919 + i*2654435761) % 128256)
	}
	return out
}

// storeBlocks makes backend hold the first nBlocks full blocks of tokens, as a vLLM BlockStored
// event would say it (engine hashes are arbitrary; the index re-keys from the tokens).
func storeBlocks(t testing.TB, ix kvindex.KvCacheIndex, backend string, tokens []uint32, nBlocks int, tier events.Tier) {
	t.Helper()
	hashes := make([]uint64, nBlocks)
	for i := range hashes {
		hashes[i] = uint64(1000 + i)
	}
	b := &events.Batch{Model: testModel, Events: []events.Event{{
		Kind: events.KindBlockStored, BlockHashes: hashes, TokenIDs: tokens[:nBlocks*16], BlockSize: 16, Tier: tier,
	}}}
	require.NoError(t, ix.Apply(context.Background(), backend, b))
}

func newMemIndex(t testing.TB) *kvindex.MemoryIndex {
	t.Helper()
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: testModel})
	require.NoError(t, err)
	t.Cleanup(func() { _ = ix.Close() })
	return ix
}

func tokReq(system string, tokens []uint32) *prefixkey.Request {
	r := chatReq(system, "question")
	r.Model = testModel
	r.TokenIDs = tokens
	return r
}

func TestKVAwareRoutesToHolder(t *testing.T) {
	ix := newMemIndex(t)
	r := newRouter(t, Config{Backends: backends(4), KV: &KVConfig{Index: ix, Speculation: SpeculationOff}})
	toks := promptTokens(1, 32*16+5)
	storeBlocks(t, ix, "vllm-3", toks, 32, events.TierGPU)
	storeBlocks(t, ix, "vllm-1", toks, 8, events.TierGPU)

	d, err := r.Route(context.Background(), tokReq("system A", toks))
	require.NoError(t, err)
	defer d.Done(Outcome{})
	assert.Equal(t, "vllm-3", d.Backend)
	assert.Equal(t, ReasonKVAware, d.Reason)
	assert.Equal(t, 32*16, d.ExpectedCachedTokens)
	require.Len(t, d.Overlaps, 4)
	got := map[string]int{}
	for _, o := range d.Overlaps {
		got[o.Backend] = o.CachedBlocks
	}
	assert.Equal(t, map[string]int{"vllm-1": 8, "vllm-2": 0, "vllm-3": 32, "vllm-4": 0}, got)

	st := statsOf(t, r)
	assert.Equal(t, DecisionCounts{KVAware: 1}, st.Decisions)
	assert.Equal(t, uint64(1), st.Lookups)
	assert.Zero(t, st.LookupErrors)
	require.NotNil(t, st.Index, "the memory index reports its stats")
	assert.Equal(t, "memory", st.Index.Backend)
	assert.Positive(t, st.Index.Blocks)
}

func TestKVBelowThresholdRingFallback(t *testing.T) {
	ix := newMemIndex(t)
	r := newRouter(t, Config{Backends: backends(4), KV: &KVConfig{Index: ix, Speculation: SpeculationOff, RingFallback: true}})
	toks := promptTokens(2, 40*16)
	storeBlocks(t, ix, "vllm-2", toks, 4, events.TierGPU) // 10 % < 30 %
	d, err := r.Route(context.Background(), tokReq("system B", toks))
	require.NoError(t, err)
	defer d.Done(Outcome{})
	assert.Equal(t, ReasonPrefixHash, d.Reason)
	assert.Nil(t, d.Overlaps)
	st := statsOf(t, r)
	assert.Equal(t, DecisionCounts{PrefixHash: 1, HandedOff: 1}, st.Decisions)
	assert.Equal(t, uint64(1), st.Decisions.Total(), "a hand-off is not a decision of its own")
}

// Below the threshold the backend with the least prefill work ahead of the request takes it: the
// one holding a little of it when all are idle, then, while that one still prefills, an idle one;
// FirstToken and Done take a request's tokens off its backend's backlog.
func TestKVBelowThresholdLeastWork(t *testing.T) {
	ix := newMemIndex(t)
	r := newRouter(t, Config{Backends: backends(4), KV: &KVConfig{Index: ix, Speculation: SpeculationOff}})
	ctx := context.Background()
	backlog := func(name string) int64 { return r.set.Load().byName[name].backlog.Load() }
	toks := promptTokens(2, 40*16)
	storeBlocks(t, ix, "vllm-2", toks, 4, events.TierGPU) // 10 % < 30 %

	d1, err := r.Route(ctx, tokReq("system B", toks))
	require.NoError(t, err)
	assert.Equal(t, ReasonLeastWork, d1.Reason)
	assert.Equal(t, "vllm-2", d1.Backend, "idle fleet: the backend that must compute the least")
	assert.Equal(t, 4*16, d1.ExpectedCachedTokens)
	assert.Equal(t, int64(36*16), backlog("vllm-2"))

	other := promptTokens(7, 40*16) // cached nowhere
	d2, err := r.Route(ctx, tokReq("system C", other))
	require.NoError(t, err)
	assert.Equal(t, ReasonLeastWork, d2.Reason)
	assert.NotEqual(t, "vllm-2", d2.Backend, "vllm-2 still has 576 tokens to prefill")
	assert.Equal(t, int64(40*16), backlog(d2.Backend))

	d1.FirstToken()
	d1.FirstToken()
	assert.Equal(t, int64(0), backlog("vllm-2"), "the first token ends the prefill, once")
	d1.Done(Outcome{})
	d2.Done(Outcome{})
	assert.Equal(t, int64(0), backlog(d2.Backend), "Done ends a prefill whose first token was never reported")

	// One vocabulary: tier 4 chose both, so the stats count them as least_work, as the header
	// does, and nothing as handed off.
	assert.Equal(t, DecisionCounts{LeastWork: 2}, statsOf(t, r).Decisions)
}

// A cold fleet (empty index, equal load) shares new prefixes: equal candidates are taken in
// turn, not always the first.
func TestKVColdFleetSpreadsTies(t *testing.T) {
	ix := newMemIndex(t)
	r := newRouter(t, Config{Backends: backends(4), KV: &KVConfig{Index: ix, Speculation: SpeculationOff}})
	ctx := context.Background()
	got := map[string]int{}
	for i := range 40 {
		d, err := r.Route(ctx, tokReq(fmt.Sprint("system ", i), promptTokens(100+i, 8*16)))
		require.NoError(t, err)
		assert.Equal(t, ReasonLeastWork, d.Reason)
		got[d.Backend]++
		d.Done(Outcome{}) // equal load again before the next
	}
	assert.Len(t, got, 4, "every engine takes new prefixes: %v", got)
	for b, n := range got {
		assert.Equal(t, 10, n, "backend %s", b)
	}
}

// A third party's scorer that answers with the wrong number of scores, or panics, costs a
// fallback decision, counted, never the process.
func TestKVFaultyScorerFallsBack(t *testing.T) {
	for name, sc := range map[string]scorer.Func{
		"short": func(_ scorer.Request, _ []scorer.Candidate, out []float64) []float64 { return out[:1] },
		"panic": func(_ scorer.Request, c []scorer.Candidate, out []float64) []float64 { return out[:len(c)+1] },
	} {
		t.Run(name, func(t *testing.T) {
			ix := newMemIndex(t)
			r := newRouter(t, Config{Backends: backends(4), KV: &KVConfig{Index: ix, Speculation: SpeculationOff, Scorer: sc}})
			toks := promptTokens(3, 40*16)
			storeBlocks(t, ix, "vllm-2", toks, 40, events.TierGPU)
			d, err := r.Route(context.Background(), tokReq("system F", toks))
			require.NoError(t, err)
			assert.NotEqual(t, ReasonKVAware, d.Reason)
			d.Done(Outcome{})
			st := statsOf(t, r)
			assert.Equal(t, uint64(1), st.ScoreErrors)
			assert.Equal(t, uint64(1), st.Decisions.HandedOff)
		})
	}
}

// A prompt shorter than one block has no block keys: nothing to look up, and the backend with
// the least prefill work takes it, not the ring; its tokens count on that backend's backlog.
func TestKVShortPromptLeastWork(t *testing.T) {
	ix := newMemIndex(t)
	r := newRouter(t, Config{Backends: backends(3), KV: &KVConfig{Index: ix, Speculation: SpeculationOff}})
	ctx := context.Background()
	backlog := func(name string) int64 { return r.set.Load().byName[name].backlog.Load() }
	long, err := r.Route(ctx, tokReq("system L", promptTokens(3, 64*16)))
	require.NoError(t, err)
	defer long.Done(Outcome{})
	seen := map[string]bool{long.Backend: true}
	for i := range 2 {
		d, err := r.Route(ctx, tokReq("system S", promptTokens(10+i, 9)))
		require.NoError(t, err)
		defer d.Done(Outcome{})
		assert.Equal(t, ReasonLeastWork, d.Reason)
		assert.False(t, seen[d.Backend], "short prompt %d went to %s, which already has prefill work", i, d.Backend)
		seen[d.Backend] = true
		assert.Equal(t, int64(9), backlog(d.Backend))
	}
	st := statsOf(t, r)
	assert.Equal(t, uint64(1), st.Lookups, "short prompts are not looked up")
	assert.Zero(t, st.NoBlockKeys)

	// RingFallback keeps the ring-first behaviour: the ring takes what tier 4 cannot look up.
	r2 := newRouter(t, Config{Backends: backends(3), KV: &KVConfig{Index: newMemIndex(t), RingFallback: true}})
	d, err := r2.Route(ctx, tokReq("system S", promptTokens(10, 9)))
	require.NoError(t, err)
	defer d.Done(Outcome{})
	assert.Equal(t, ReasonPrefixHash, d.Reason)
}

func TestKVTierWeightsPreferGPU(t *testing.T) {
	ix := newMemIndex(t)
	r := newRouter(t, Config{Backends: backends(3), KV: &KVConfig{Index: ix, Speculation: SpeculationOff}})
	toks := promptTokens(3, 20*16)
	storeBlocks(t, ix, "vllm-1", toks, 20, events.TierStorage)
	storeBlocks(t, ix, "vllm-2", toks, 20, events.TierGPU)
	d, err := r.Route(context.Background(), tokReq("system C", toks))
	require.NoError(t, err)
	defer d.Done(Outcome{})
	assert.Equal(t, "vllm-2", d.Backend)
}

func TestKVRespectsLoadBound(t *testing.T) {
	// Tier 4's bound is ceil((1+ε)·T·w/W) with its own ε (by default 5 under the expected-TTFT
	// scorer, 1 under the composite); 0.25 is the ring's.
	for _, tc := range []struct {
		eps, want float64
		composite bool
	}{{0, DefaultKVLoadFactorEpsilonExpectedTTFT, false}, {0, DefaultKVLoadFactorEpsilon, true}, {0.25, 0.25, false}, {3, 3, false}} {
		t.Run(fmt.Sprint(tc.eps, tc.composite), func(t *testing.T) {
			ix := newMemIndex(t)
			// The hot-prefix spreading off: the bound alone limits the holder here.
			var sc scorer.BackendScorer
			var err error
			if tc.composite {
				sc, err = scorer.NewComposite(scorer.CompositeConfig{})
			} else {
				sc, err = scorer.NewExpectedTTFT(scorer.ExpectedTTFTConfig{HotDiscount: -1})
			}
			require.NoError(t, err)
			r := newRouter(t, Config{Backends: backends(4), KV: &KVConfig{Index: ix, Speculation: SpeculationOff, LoadFactorEpsilon: tc.eps, Scorer: sc}})
			toks := promptTokens(4, 16*16)
			storeBlocks(t, ix, "vllm-1", toks, 16, events.TierGPU)
			ctx := context.Background()
			var held []*Decision
			for range 40 {
				d, err := r.Route(ctx, tokReq("hot", toks))
				require.NoError(t, err)
				held = append(held, d)
				// The bound now, with this request counted, is what it was checked against or more.
				bound := int(math.Ceil((1 + tc.want) * float64(len(held)) / 4))
				for _, l := range statsOf(t, r).Backends {
					assert.LessOrEqual(t, l.InFlight, bound, "%s at %d in flight, bound %d", l.Name, l.InFlight, bound)
				}
			}
			byBackend := map[string]int{}
			for _, d := range held {
				byBackend[d.Backend]++
				d.Done(Outcome{})
			}
			// The holder takes its bounded share, (1+ε)/4 of the requests, and no more.
			share := int((1 + tc.want) * 40 / 4)
			if share < 40 {
				assert.Less(t, byBackend["vllm-1"], 40, "a hot prefix must not pile onto one backend")
			}
			assert.GreaterOrEqual(t, byBackend["vllm-1"], min(share, 40)-1, "the holder takes its bounded share")
			assert.Equal(t, tc.want, r.kv.eps)
			assert.Equal(t, tc.want, statsOf(t, r).LoadFactorEpsilon, "Stats reports the bound in effect")
		})
	}
	_, err := New(Config{Backends: backends(2), KV: &KVConfig{Index: newMemIndex(t), LoadFactorEpsilon: 11}})
	assert.ErrorIs(t, err, ErrInvalidConfig)
	_, err = New(Config{Backends: backends(2), KV: &KVConfig{Index: newMemIndex(t), LoadFactorEpsilon: math.NaN()}})
	assert.ErrorIs(t, err, ErrInvalidConfig)
}

// A request whose holder is at tier 4's bound goes to a backend holding none of it: the decision
// says load_bound, not kv_aware, and carries what the chosen backend holds (0), while requests the
// holder takes say kv_aware with its cached tokens.
func TestKVLoadBoundLabel(t *testing.T) {
	ix := newMemIndex(t)
	r := newRouter(t, Config{Backends: backends(4), KV: &KVConfig{Index: ix, Speculation: SpeculationOff, LoadFactorEpsilon: 0.25}})
	toks := promptTokens(5, 16*16)
	storeBlocks(t, ix, "vllm-1", toks, 16, events.TierGPU)
	ctx := context.Background()
	byReason := map[Reason]int{}
	var held []*Decision
	for range 12 {
		d, err := r.Route(ctx, tokReq("hot", toks))
		require.NoError(t, err)
		held = append(held, d)
		byReason[d.Reason]++
		switch d.Backend {
		case "vllm-1":
			assert.Equal(t, ReasonKVAware, d.Reason)
			assert.Equal(t, 16*16, d.ExpectedCachedTokens)
		default:
			assert.Equal(t, ReasonLoadBound, d.Reason, "%s holds none of the prompt", d.Backend)
			assert.Equal(t, 0, d.ExpectedCachedTokens)
		}
	}
	for _, d := range held {
		d.Done(Outcome{})
	}
	require.Positive(t, byReason[ReasonLoadBound], "the bound must have sent some requests elsewhere")
	st := statsOf(t, r)
	assert.Equal(t, uint64(byReason[ReasonKVAware]), st.Decisions.KVAware)
	assert.Equal(t, uint64(byReason[ReasonLoadBound]), st.Decisions.LoadBound)
	assert.Equal(t, uint64(12), st.Decisions.Total())
	assert.Zero(t, st.Decisions.HandedOff)
	assert.Equal(t, "load_bound", ReasonLoadBound.String())
}

func TestKVSpeculationThenApproximate(t *testing.T) {
	for _, mode := range []Speculation{SpeculationOn, SpeculationApproximate} {
		t.Run(mode.String(), func(t *testing.T) {
			ix := newMemIndex(t)
			r := newRouter(t, Config{Backends: backends(8), KV: &KVConfig{Index: ix, Speculation: mode}})
			ctx := context.Background()
			toks := promptTokens(5, 24*16)
			first, err := r.Route(ctx, tokReq("", toks)) // no system prompt: anchored on the message
			require.NoError(t, err)
			first.Done(Outcome{})
			assert.Equal(t, ReasonLeastWork, first.Reason, "empty index: least prefill work decides")
			// A request with the same tokens but another anchor text would hash elsewhere on the
			// ring; the speculative entries send it to the same backend.
			other := tokReq("a different system prompt", toks)
			d, err := r.Route(ctx, other)
			require.NoError(t, err)
			defer d.Done(Outcome{})
			assert.Equal(t, ReasonKVAware, d.Reason)
			assert.Equal(t, first.Backend, d.Backend)
		})
	}
	t.Run("off", func(t *testing.T) {
		ix := newMemIndex(t)
		r := newRouter(t, Config{Backends: backends(8), KV: &KVConfig{Index: ix, Speculation: SpeculationOff}})
		toks := promptTokens(6, 24*16)
		first, err := r.Route(context.Background(), tokReq("", toks))
		require.NoError(t, err)
		first.Done(Outcome{})
		d, err := r.Route(context.Background(), tokReq("a different system prompt", toks))
		require.NoError(t, err)
		d.Done(Outcome{})
		assert.NotEqual(t, ReasonKVAware, d.Reason)
	})
}

// failingIndex is an index whose every call fails, as a remote index does when its server is down.
type failingIndex struct{ kvindex.KvCacheIndex }

var errDown = errors.New("index down")

func (failingIndex) Lookup(context.Context, []uint64, []string, []kvindex.Match) ([]kvindex.Match, error) {
	return nil, errDown
}
func (failingIndex) Speculate(context.Context, string, []uint64, time.Duration) error { return errDown }

func TestKVIndexFailureFallsBack(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(3), KV: &KVConfig{Index: failingIndex{}}})
	for i := range 20 {
		d, err := r.Route(context.Background(), tokReq(fmt.Sprintf("s%d", i), promptTokens(i, 64)))
		require.NoError(t, err)
		assert.Contains(t, []Reason{ReasonPrefixHash, ReasonOverflow}, d.Reason)
		d.Done(Outcome{})
	}
	r.kv.lookups.Load()
	assert.Equal(t, uint64(20), r.kv.lookupErrs.Load())
}

func TestKVTokenizer(t *testing.T) {
	ix := newMemIndex(t)
	toks := promptTokens(7, 10*16)
	var calls int
	tok := prefixkey.TokenizerFunc(func(_ context.Context, req *prefixkey.Request) ([]uint32, error) {
		calls++
		if req.System == "broken" {
			return nil, errors.New("tokenizer timeout")
		}
		return toks, nil
	})
	r := newRouter(t, Config{Backends: backends(3), KV: &KVConfig{Index: ix, Tokenizer: tok, Speculation: SpeculationOff}})
	storeBlocks(t, ix, "vllm-2", toks, 10, events.TierGPU)
	req := chatReq("tokenize me", "u")
	req.Model = testModel
	d, err := r.Route(context.Background(), req)
	require.NoError(t, err)
	d.Done(Outcome{})
	assert.Equal(t, "vllm-2", d.Backend)
	assert.Equal(t, ReasonKVAware, d.Reason)

	d, err = r.Route(context.Background(), chatReq("broken", "u"))
	require.NoError(t, err)
	d.Done(Outcome{})
	assert.Equal(t, ReasonPrefixHash, d.Reason)
	assert.Equal(t, 2, calls)
	st := statsOf(t, r)
	assert.Equal(t, uint64(1), st.TokenizeErrors)

	// Callers that have tokens skip the tokenizer.
	d, err = r.Route(context.Background(), tokReq("x", toks))
	require.NoError(t, err)
	d.Done(Outcome{})
	assert.Equal(t, 2, calls)
}

func TestKVUnhealthyHolderSkipped(t *testing.T) {
	ix := newMemIndex(t)
	r := newRouter(t, Config{Backends: backends(3), KV: &KVConfig{Index: ix, Speculation: SpeculationOff}})
	toks := promptTokens(8, 16*16)
	storeBlocks(t, ix, "vllm-1", toks, 16, events.TierGPU)
	storeBlocks(t, ix, "vllm-3", toks, 12, events.TierGPU)
	require.NoError(t, r.SetHealthy("vllm-1", false))
	d, err := r.Route(context.Background(), tokReq("s", toks))
	require.NoError(t, err)
	defer d.Done(Outcome{})
	assert.Equal(t, "vllm-3", d.Backend)
	assert.Len(t, d.Overlaps, 2)
}

func TestKVImbalanceGuard(t *testing.T) {
	ix := newMemIndex(t)
	r := newRouter(t, Config{Backends: backends(3), LoadFactorEpsilon: 10, KV: &KVConfig{
		Index: ix, Speculation: SpeculationOff, Guard: scorer.Guard{MaxSpread: 3},
	}})
	toks := promptTokens(9, 16*16)
	storeBlocks(t, ix, "vllm-1", toks, 16, events.TierGPU)
	ctx := context.Background()
	var held []*Decision
	var sawGuard bool
	for range 12 {
		d, err := r.Route(ctx, tokReq("s", toks))
		require.NoError(t, err)
		held = append(held, d)
		if d.Reason == ReasonImbalance {
			sawGuard = true
			assert.NotEqual(t, "vllm-1", d.Backend)
		}
	}
	assert.True(t, sawGuard, "the guard must take over once vllm-1 runs 3 ahead")
	for _, d := range held {
		d.Done(Outcome{})
	}
}

func TestKVActiveSequences(t *testing.T) {
	ix := newMemIndex(t)
	sc, active := tracked(t)
	r := newRouter(t, Config{Backends: backends(2), KV: &KVConfig{Index: ix, Speculation: SpeculationOff, Scorer: sc}})
	toks := promptTokens(10, 16*16)
	storeBlocks(t, ix, "vllm-2", toks, 8, events.TierGPU)
	d, err := r.Route(context.Background(), tokReq("s", toks))
	require.NoError(t, err)
	require.Equal(t, ReasonKVAware, d.Reason)
	pre, dec := active.Load("vllm-2")
	assert.Equal(t, 8, pre, "uncached blocks are prefill load until the first token")
	assert.Equal(t, 16, dec)
	d.FirstToken()
	pre, _ = active.Load("vllm-2")
	assert.Zero(t, pre)
	d.Done(Outcome{})
	d.Done(Outcome{})
	pre, dec = active.Load("vllm-2")
	assert.Zero(t, pre+dec)
}

func TestKVStatsAndConfig(t *testing.T) {
	ix := newMemIndex(t)
	r := newRouter(t, Config{Backends: backends(2), KV: &KVConfig{Index: ix}})
	toks := promptTokens(11, 4*16)
	storeBlocks(t, ix, "vllm-1", toks, 4, events.TierGPU)
	st := statsOf(t, r)
	require.NotNil(t, st.Index)
	assert.Equal(t, 4, st.Index.Blocks, "the index's own stats")
	assert.Equal(t, kvindex.DefaultSpeculativeTTL, st.SpeculativeTTL, "speculation on, with its default TTL")
	assert.Equal(t, 16, st.BlockSize)
	assert.Equal(t, "expected_ttft", st.Scorer)

	for name, kv := range map[string]*KVConfig{
		"no index":    {},
		"threshold":   {Index: ix, MinOverlapThreshold: 1.5},
		"block size":  {Index: ix, BlockSize: -1},
		"attention":   {Index: ix, AttentionCost: 1},
		"speculation": {Index: ix, Speculation: 9},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := New(Config{KV: kv})
			assert.ErrorIs(t, err, ErrInvalidConfig)
		})
	}
	off := newRouter(t, Config{})
	st = statsOf(t, off)
	assert.Nil(t, st.Index, "tier 4 off")
	assert.Empty(t, st.Scorer)
	assert.Zero(t, st.BlockSize)
	assert.Zero(t, st.SpeculativeTTL)
}

// A request with an image whose place in the tokens the caller did not give (no MultiModal spans)
// has no block keys: its tokens alone cannot tell it from the same prompt with another image, so
// tier 4 must not call the holder of that other prompt a hit. Route, Probe and the P/D planner
// build their keys through prefixkey.Request.BlockKeysOf.
func TestKVUnplacedMediaHasNoBlockKeys(t *testing.T) {
	ix := newMemIndex(t)
	r := newRouter(t, Config{Backends: backends(4), KV: &KVConfig{Index: ix, Speculation: SpeculationOff}})
	toks := promptTokens(6, 32*16)
	storeBlocks(t, ix, "vllm-3", toks, 32, events.TierGPU)
	ctx := context.Background()

	plain := tokReq("system A", toks)
	d, err := r.Route(ctx, plain)
	require.NoError(t, err)
	d.Done(Outcome{})
	require.Equal(t, ReasonKVAware, d.Reason, "the same tokens without media are a hit")

	withImage := tokReq("system A", toks)
	withImage.Media = []prefixkey.Media{{Kind: prefixkey.MediaImage, Hash: 42}}
	p, err := r.Probe(ctx, withImage)
	require.NoError(t, err)
	assert.Zero(t, p.KV.Blocks, "probe: no block keys for unplaced media")
	d, err = r.Route(ctx, withImage)
	require.NoError(t, err)
	d.Done(Outcome{})
	assert.NotEqual(t, ReasonKVAware, d.Reason, "an unplaced image must not be a hit on the text-only holder")
	assert.Zero(t, d.ExpectedCachedTokens)
}
