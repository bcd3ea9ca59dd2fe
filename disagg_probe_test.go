package kvroute

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

// dgState is what DisaggRouter.Route changes and Probe must not: every backend's slots, the
// disaggregation and tier-1 stats, the index's speculative entries and the rotations.
func dgState(t *testing.T, r *DefaultRouter, ix *kvindex.MemoryIndex) string {
	t.Helper()
	done, cancel := context.WithCancel(context.Background())
	cancel() // the Router's own counters, not the index's stats (compared below)
	rs, _ := r.Stats(done)
	rs.Index = nil
	st := map[string]any{"loads": dgLoads(r), "stats": rs, "rr": r.rr.Load()}
	if ix != nil {
		is, err := ix.Stats(context.Background())
		require.NoError(t, err)
		st["speculative"] = is.SpeculativeCount
	}
	if r.kv != nil {
		st["tie"] = r.kv.tieTurn.Load()
	}
	b, err := json.Marshal(st)
	require.NoError(t, err)
	return string(b)
}

// DisaggRouter.Probe names the plan Route then follows, on every path, and changes nothing.
func TestDisaggProbe(t *testing.T) {
	long := dgTokens(1, 64*16+5) // 1029 tokens, 64 full blocks
	keyless := &prefixkey.Request{Model: "llama-3-8b", TokenIDs: long}
	for _, tt := range []struct {
		name    string
		cfg     disagg.Config
		noIndex bool // tier 4 off: tier 1 chooses among the unified backends
		req     *prefixkey.Request
		setup   func(t *testing.T, r *DefaultRouter, ix *kvindex.MemoryIndex)
		path    disagg.Path
		reason  disagg.Reason
	}{
		{
			name: "local hit", req: dgReq(long),
			setup: func(t *testing.T, r *DefaultRouter, ix *kvindex.MemoryIndex) {
				dgHold(t, ix, "decode-2", long, 64, events.TierGPU)
			},
			path: disagg.PathFastDecode, reason: disagg.ReasonLocalHit,
		},
		{
			name: "storage hit", req: dgReq(long),
			setup: func(t *testing.T, r *DefaultRouter, ix *kvindex.MemoryIndex) {
				dgHold(t, ix, "prefill-1", long, 64, events.TierStorage)
				dgBusy(t, r, "decode-1", 1)
			},
			path: disagg.PathFastDecode, reason: disagg.ReasonStorageHit,
		},
		{
			name: "cache miss", req: dgReq(long),
			setup: func(t *testing.T, r *DefaultRouter, ix *kvindex.MemoryIndex) {
				dgHold(t, ix, "prefill-2", long, 40, events.TierGPU)
				dgBusy(t, r, "decode-3", 1)
			},
			path: disagg.PathPrefillThenDecode, reason: disagg.ReasonCacheMiss,
		},
		{name: "short prompt", req: dgReq(dgTokens(2, 100)), path: disagg.PathFastDecode, reason: disagg.ReasonShortPrompt},
		{name: "keyless", req: keyless, path: disagg.PathPrefillThenDecode, reason: disagg.ReasonCacheMiss},
		{
			name: "decode pool down", req: dgReq(long),
			setup: func(t *testing.T, r *DefaultRouter, ix *kvindex.MemoryIndex) {
				for _, n := range []string{"decode-1", "decode-2", "decode-3"} {
					require.NoError(t, r.SetHealthy(n, false))
				}
			},
			path: disagg.PathFallback, reason: disagg.ReasonPoolUnavailable,
		},
		{
			// Route takes a turn of the round robin for the plan's tie-break, then the unified
			// path's round robin takes the next: the probe predicts the second.
			name: "decode pool down, keyless, round robin", req: keyless, noIndex: true,
			setup: func(t *testing.T, r *DefaultRouter, ix *kvindex.MemoryIndex) {
				require.NoError(t, r.AddBackend(Backend{Name: "unified-2"}))
				for _, n := range []string{"decode-1", "decode-2", "decode-3"} {
					require.NoError(t, r.SetHealthy(n, false))
				}
			},
			path: disagg.PathFallback, reason: disagg.ReasonPoolUnavailable,
		},
		{name: "disabled", cfg: disagg.Config{Disabled: true}, req: dgReq(long), path: disagg.PathUnified, reason: disagg.ReasonDisabled},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var ix *kvindex.MemoryIndex
			var kix kvindex.KvCacheIndex // nil, not a nil *MemoryIndex, without an index
			if !tt.noIndex {
				ix = dgIndex(t)
				kix = ix
			}
			r := dgRouter(t, kix, tt.cfg) // speculation on: the probe must not speculate
			if tt.setup != nil {
				tt.setup(t, r, ix)
			}
			ctx := context.Background()
			// Each round's Route moves the rotations and speculates (a cache miss is a local hit
			// next time): the probe follows.
			for round := range 3 {
				before := dgState(t, r, ix)
				res, err := r.Disagg().Probe(ctx, tt.req)
				require.NoError(t, err)
				require.Equal(t, before, dgState(t, r, ix), "the probe changed the state")
				if round == 0 {
					assert.Equal(t, tt.path, res.Path)
					assert.Equal(t, tt.reason, res.Reason)
				}
				assert.NotEmpty(t, res.Why)
				assert.Empty(t, res.Error)
				assert.Len(t, res.Backends, len(r.set.Load().byName))
				unified := res.Path == disagg.PathUnified || res.Path == disagg.PathFallback
				assert.Equal(t, unified, res.Unified != nil)

				d, err := r.Disagg().Route(ctx, tt.req)
				require.NoError(t, err)
				assert.Equal(t, d.Plan, res.Plan, "round %d: Route's plan, probed %s", round, res.Why)
				d.PrefillDone(Outcome{})
				d.Done(Outcome{})
			}
		})
	}
}

func TestDisaggProbeEdges(t *testing.T) {
	ctx := context.Background()
	t.Run("without Config.Disagg", func(t *testing.T) {
		r := newRouter(t, Config{Backends: backends(3)})
		req := chatReq("s", "u")
		res, err := r.Disagg().Probe(ctx, req)
		require.NoError(t, err)
		d, err := r.Disagg().Route(ctx, req)
		require.NoError(t, err)
		defer d.Done(Outcome{})
		assert.Equal(t, d.Plan, res.Plan)
		assert.Equal(t, disagg.ReasonDisabled, res.Reason)
		require.NotNil(t, res.Unified)
		assert.Equal(t, ReasonPrefixHash, res.Unified.Reason)
		assert.Empty(t, res.Backends)
	})
	t.Run("no backend", func(t *testing.T) {
		r := dgRouter(t, nil, disagg.Config{DisableFallback: true})
		for _, n := range []string{"decode-1", "decode-2", "decode-3"} {
			require.NoError(t, r.SetHealthy(n, false))
		}
		req := dgReq(dgTokens(3, 100))
		res, err := r.Disagg().Probe(ctx, req)
		require.NoError(t, err, "no backend is an answer, not an error")
		assert.Zero(t, res.Path)
		assert.Empty(t, res.Decode)
		assert.Contains(t, res.Error, "no healthy")
		_, err = r.Disagg().Route(ctx, req)
		require.ErrorIs(t, err, ErrNoBackend)
	})
	t.Run("no healthy unified backend", func(t *testing.T) {
		r := dgRouter(t, nil, disagg.Config{Disabled: true})
		require.NoError(t, r.SetHealthy("unified-fallback", false))
		res, err := r.Disagg().Probe(ctx, dgReq(dgTokens(3, 100)))
		require.NoError(t, err)
		assert.Empty(t, res.Decode)
		assert.NotEmpty(t, res.Error)
	})
	t.Run("nil request and ended context", func(t *testing.T) {
		r := dgRouter(t, nil, disagg.Config{})
		_, err := r.Disagg().Probe(ctx, nil)
		require.ErrorIs(t, err, ErrNilRequest)
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		_, err = r.Disagg().Probe(cctx, dgReq(dgTokens(3, 100)))
		require.ErrorIs(t, err, context.Canceled)
	})
	t.Run("JSON", func(t *testing.T) {
		ix := dgIndex(t)
		r := dgRouter(t, ix, disagg.Config{})
		long := dgTokens(1, 64*16+5)
		dgHold(t, ix, "decode-2", long, 64, events.TierGPU)
		res, err := r.Disagg().Probe(ctx, dgReq(long))
		require.NoError(t, err)
		b, err := json.Marshal(res)
		require.NoError(t, err)
		var got map[string]any
		require.NoError(t, json.Unmarshal(b, &got))
		assert.Equal(t, "fast_decode", got["path"])
		assert.Equal(t, "local_hit", got["reason"])
		assert.Equal(t, "decode-2", got["decode_backend"])
		assert.Equal(t, 1024.0, got["expected_cached_tokens"])
		assert.NotContains(t, string(b), dgStore.SecretKey)
		assert.Len(t, got["backends"], 6)
	})
}
