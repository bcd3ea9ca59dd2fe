package kvroute

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/scorer"
)

// statsFailing is a KV index whose Stats fails (a remote index that cannot reach its store): it
// returns its own counters with the error.
type statsFailing struct{ *kvindex.MemoryIndex }

var errStatsDown = errors.New("index stats: connection refused")

func (statsFailing) Stats(context.Context) (kvindex.Stats, error) {
	return kvindex.Stats{Backend: "remote", Lookups: 1}, errStatsDown
}

// noStats is a KV index that reports no stats: it lacks the Stats method.
type noStats struct{ ix *kvindex.MemoryIndex }

func (n noStats) Lookup(ctx context.Context, keys []uint64, cands []string, out []kvindex.Match) ([]kvindex.Match, error) {
	return n.ix.Lookup(ctx, keys, cands, out)
}

// One snapshot for every tier: which parts are filled depends on what the Router has (tier 4,
// an index that reports stats, disaggregation), and an index that fails its stats leaves only
// Index empty.
func TestStatsSnapshot(t *testing.T) {
	toks := promptTokens(21, 8*16)
	for _, tc := range []struct {
		name     string
		kv       func(ix *kvindex.MemoryIndex) *KVConfig
		disagg   bool
		wantErr  error
		tier4    bool
		hasIndex bool
	}{
		{name: "tier 1 only"},
		{name: "tier 4", tier4: true, hasIndex: true,
			kv: func(ix *kvindex.MemoryIndex) *KVConfig { return &KVConfig{Index: ix} }},
		{name: "tier 4, index without stats", tier4: true,
			kv: func(ix *kvindex.MemoryIndex) *KVConfig {
				return &KVConfig{Index: noStats{ix}, Speculation: SpeculationOff}
			}},
		{name: "tier 4, index stats fail", tier4: true, hasIndex: true, wantErr: errStatsDown,
			kv: func(ix *kvindex.MemoryIndex) *KVConfig { return &KVConfig{Index: statsFailing{ix}} }},
		{name: "disaggregation", disagg: true},
		{name: "disaggregation and tier 4", disagg: true, tier4: true, hasIndex: true,
			kv: func(ix *kvindex.MemoryIndex) *KVConfig { return &KVConfig{Index: ix} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ix := newMemIndex(t)
			storeBlocks(t, ix, "vllm-2", toks, 8, events.TierGPU)
			cfg := Config{Backends: backends(2)}
			if tc.kv != nil {
				cfg.KV = tc.kv(ix)
			}
			if tc.disagg {
				cfg.Backends = append(cfg.Backends, Backend{Name: "prefill-1", Role: disagg.RolePrefill},
					Backend{Name: "decode-1", Role: disagg.RoleDecode})
				cfg.Disagg = &disagg.Config{DefaultStorage: dgStore}
			}
			r := newRouter(t, cfg)
			ctx := context.Background()
			d, err := r.Route(ctx, tokReq("snapshot", toks))
			require.NoError(t, err)
			d.Done(Outcome{Latency: time.Millisecond})
			if tc.disagg {
				dd, err := r.Disagg().Route(ctx, dgReq(dgTokens(3, 4000)))
				require.NoError(t, err)
				dd.PrefillDone(Outcome{})
				dd.Done(Outcome{})
			}

			st, err := r.Stats(ctx)
			if tc.wantErr != nil {
				require.ErrorIs(t, err, tc.wantErr)
			} else {
				require.NoError(t, err)
			}
			// Whatever the index said, the rest is there.
			assert.Equal(t, uint64(1), st.Decisions.Total())
			assert.Equal(t, uint64(1), st.UniquePrefixes)
			require.Len(t, backendsOf(st, disagg.RoleUnified), 2)
			assert.Equal(t, []string{"vllm-1", "vllm-2"}, []string{st.Backends[0].Name, st.Backends[1].Name})

			if tc.tier4 {
				assert.Equal(t, DecisionCounts{KVAware: 1}, st.Decisions)
				assert.Equal(t, "vllm-2", d.Backend)
				assert.Equal(t, uint64(1), st.Lookups)
				assert.Equal(t, "expected_ttft", st.Scorer)
				assert.Equal(t, scorer.DefaultAttentionCost, st.AttentionCost)
				assert.Equal(t, kvindex.DefaultBlockSize, st.BlockSize)
			} else {
				assert.Equal(t, DecisionCounts{PrefixHash: 1}, st.Decisions)
				assert.Zero(t, st.Lookups)
				assert.Empty(t, st.Scorer)
				assert.Zero(t, st.AttentionCost)
				assert.Zero(t, st.BlockSize)
				assert.Zero(t, st.SpeculativeTTL)
			}
			switch {
			case tc.wantErr != nil:
				require.NotNil(t, st.Index, "what the index returned with its error")
				assert.Equal(t, kvindex.Stats{Backend: "remote", Lookups: 1}, *st.Index)
			case tc.hasIndex:
				require.NotNil(t, st.Index)
				assert.Equal(t, "memory", st.Index.Backend)
				assert.Positive(t, st.Index.Blocks)
			default:
				assert.Nil(t, st.Index)
			}
			if tc.disagg {
				require.NotNil(t, st.Disagg)
				assert.Equal(t, uint64(1), st.Disagg.Total)
				assert.Len(t, backendsOf(st, disagg.RolePrefill), 1)
				assert.Len(t, backendsOf(st, disagg.RoleDecode), 1)
			} else {
				assert.Nil(t, st.Disagg)
				assert.Len(t, st.Backends, 2)
			}
		})
	}
}

// ctx bounds the index's stats call alone: a context that ends during the call is the index's
// error, and one already done skips the call, the rest of the snapshot filled in either way.
func TestStatsContext(t *testing.T) {
	ix := &ctxStats{MemoryIndex: newMemIndex(t)}
	r := newRouter(t, Config{Backends: backends(2), KV: &KVConfig{Index: ix}})
	d, err := r.Route(context.Background(), tokReq("ctx", promptTokens(5, 64)))
	require.NoError(t, err)
	defer d.Done(Outcome{})

	ctx, cancel := context.WithCancel(context.Background())
	ix.during = cancel
	st, err := r.Stats(ctx)
	require.ErrorIs(t, err, context.Canceled)
	assert.Equal(t, &kvindex.Stats{Backend: "partial"}, st.Index, "what the index returned with its error")
	assert.Equal(t, 1, ix.calls)

	st, err = r.Stats(ctx)
	require.ErrorIs(t, err, context.Canceled)
	assert.Nil(t, st.Index)
	assert.Equal(t, 1, ix.calls, "a done context skips the index")
	assert.Len(t, st.Backends, 2)
	assert.Equal(t, uint64(1), st.Decisions.Total())
	assert.Equal(t, "expected_ttft", st.Scorer)
}

// ctxStats is a KV index whose Stats honours its context, as a remote one does; during, when set,
// runs in the call (cancels its context, say).
type ctxStats struct {
	*kvindex.MemoryIndex
	during func()
	calls  int
}

func (c *ctxStats) Stats(ctx context.Context) (kvindex.Stats, error) {
	c.calls++
	if c.during != nil {
		c.during()
	}
	if err := ctx.Err(); err != nil {
		return kvindex.Stats{Backend: "partial"}, err
	}
	return c.MemoryIndex.Stats(ctx)
}

// Stats' backend lines carry what the Router observed of each backend: refusals, the latency
// average, engine-reported load and the external load it implies.
func TestStatsBackends(t *testing.T) {
	r := newRouter(t, Config{Backends: []Backend{{Name: "a", Weight: 2}, {Name: "b"}}, RefusalHold: -1})
	ctx := context.Background()
	outcomes := []Outcome{{Refused: true}, {Latency: time.Second}, {Latency: 2 * time.Second},
		{Latency: 3 * time.Second, Err: errors.New("backend failed")}}
	for _, o := range outcomes {
		d, err := r.Route(ctx, chatReq("stats backends", "q"))
		require.NoError(t, err)
		d.Done(o)
	}
	d, err := r.Route(ctx, chatReq("stats backends", "q"))
	require.NoError(t, err)
	defer d.Done(Outcome{})
	require.NoError(t, r.ReportEngineLoad(d.Backend, EngineLoad{Running: 4, Waiting: 1, KVCacheUsage: 0.25}))
	other := map[string]string{"a": "b", "b": "a"}[d.Backend]
	require.NoError(t, r.SetHealthy(other, false))

	st := statsOf(t, r)
	require.Len(t, st.Backends, 2)
	assert.Equal(t, []string{"a", "b"}, []string{st.Backends[0].Name, st.Backends[1].Name}, "in the order they were added")
	assert.Equal(t, 2.0, st.Backends[0].Weight)
	for _, b := range st.Backends {
		if b.Name == other {
			assert.Zero(t, b.Decisions, b.Name)
			assert.False(t, b.Healthy)
			assert.Nil(t, b.Engine)
			continue
		}
		assert.Equal(t, uint64(5), b.Decisions)
		assert.Equal(t, 1, b.InFlight)
		assert.Equal(t, uint64(1), b.Refusals)
		assert.True(t, b.Healthy)
		// 1 s, then 2 s and 3 s folded in with weight 0.1: 1.1 s, then 1.29 s.
		assert.InDelta(t, 1.29, b.Latency.Seconds(), 1e-9)
		assert.InDelta(t, 0.9, b.SuccessRate, 1e-9, "two successes, then a failure")
		require.NotNil(t, b.Engine)
		assert.Equal(t, 4, b.Engine.Running)
		assert.Equal(t, 4, b.ExternalLoad, "the engine's five requests less this Router's one")
	}
	assert.Equal(t, uint64(1), st.Peers.EngineReports)
}
