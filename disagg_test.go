package kvroute

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/kvroute/kvroute/chwbl"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/telemetry"
)

var dgStore = disagg.ExternalStorage{Endpoint: "http://kv-store:8080", Namespace: "inference/kv-cache",
	AccessKey: "AK-dg-91", SecretKey: "SK-dg-77"}

// dgFleet is the disaggregated fleet of kvroute's example config: two prefill, three decode (weight 2) and one unified
// backend.
func dgFleet() []Backend {
	return []Backend{
		{Name: "prefill-1", Role: disagg.RolePrefill},
		{Name: "prefill-2", Role: disagg.RolePrefill},
		{Name: "decode-1", Role: disagg.RoleDecode, Weight: 2},
		{Name: "decode-2", Role: disagg.RoleDecode, Weight: 2},
		{Name: "decode-3", Role: disagg.RoleDecode, Weight: 2},
		{Name: "unified-fallback"},
	}
}

func dgIndex(t testing.TB) *kvindex.MemoryIndex {
	t.Helper()
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: "llama-3-8b"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = ix.Close() })
	return ix
}

func dgRouter(t testing.TB, ix kvindex.KvCacheIndex, dc disagg.Config, mut ...func(*Config)) *DefaultRouter {
	t.Helper()
	if dc.DefaultStorage.IsZero() {
		dc.DefaultStorage = dgStore
	}
	cfg := Config{Backends: dgFleet(), Disagg: &dc}
	if ix != nil {
		cfg.KV = &KVConfig{Index: ix}
	}
	for _, m := range mut {
		m(&cfg)
	}
	return newRouter(t, cfg)
}

func dgTokens(seed, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32((seed*104729 + i*2246822519) % 128000)
	}
	return out
}

// dgHold makes backend hold the first nBlocks blocks of tokens on tier, as an engine's event says.
func dgHold(t testing.TB, ix kvindex.KvCacheIndex, backend string, tokens []uint32, nBlocks int, tier events.Tier) {
	t.Helper()
	hashes := make([]uint64, nBlocks)
	for i := range hashes {
		hashes[i] = uint64(7000 + i)
	}
	require.NoError(t, ix.Apply(context.Background(), backend, &events.Batch{Model: "llama-3-8b", Events: []events.Event{{
		Kind: events.KindBlockStored, BlockHashes: hashes, TokenIDs: tokens[:nBlocks*16], BlockSize: 16, Tier: tier}}}))
}

func dgReq(tokens []uint32) *prefixkey.Request {
	r := chatReq("You are a disaggregated assistant.", "q")
	r.TokenIDs = tokens
	return r
}

// dgLoads returns every backend's slots in flight, by name, over the three rings.
func dgLoads(r *DefaultRouter) map[string]int {
	out := map[string]int{}
	for _, ring := range []*chwbl.Ring{r.ring, r.dis.prefill, r.dis.decode} {
		for _, l := range ring.Loads(nil) {
			out[l.Name] += l.InFlight
		}
	}
	return out
}

// dgBusy holds n decode slots on backend until the test ends.
func dgBusy(t *testing.T, r *DefaultRouter, backend string, n int) {
	for range n {
		var h chwbl.Handle
		require.NoError(t, r.dis.decode.AcquireBackend(&h, backend))
		t.Cleanup(func() { h.Release() })
	}
}

func TestRouteDisaggPaths(t *testing.T) {
	long := dgTokens(1, 64*16+5) // 1029 tokens, 64 full blocks
	tests := []struct {
		name    string
		cfg     disagg.Config
		tokens  []uint32
		setup   func(t *testing.T, r *DefaultRouter, ix *kvindex.MemoryIndex)
		path    disagg.Path
		reason  disagg.Reason
		prefill string
		decode  string
		cached  int
	}{
		{
			name: "gpu hit on a decode backend", tokens: long,
			setup: func(t *testing.T, r *DefaultRouter, ix *kvindex.MemoryIndex) {
				dgHold(t, ix, "decode-2", long, 64, events.TierGPU)
				dgHold(t, ix, "decode-1", long, 20, events.TierGPU)
			},
			path: disagg.PathFastDecode, reason: disagg.ReasonLocalHit, decode: "decode-2", cached: 1024,
		},
		{
			name: "storage hit: least-loaded decode backend", tokens: long,
			setup: func(t *testing.T, r *DefaultRouter, ix *kvindex.MemoryIndex) {
				dgHold(t, ix, "prefill-1", long, 64, events.TierStorage)
				dgBusy(t, r, "decode-1", 1)
				dgBusy(t, r, "decode-2", 1)
			},
			path: disagg.PathFastDecode, reason: disagg.ReasonStorageHit, decode: "decode-3", cached: 1024,
		},
		{
			name: "no cache: prefill by overlap, decode by load", tokens: long,
			setup: func(t *testing.T, r *DefaultRouter, ix *kvindex.MemoryIndex) {
				dgHold(t, ix, "prefill-2", long, 40, events.TierGPU)
				dgHold(t, ix, "decode-1", long, 16, events.TierGPU) // a short hit earns no credit
				dgBusy(t, r, "decode-1", 1)
				dgBusy(t, r, "decode-3", 1)
			},
			path: disagg.PathPrefillThenDecode, reason: disagg.ReasonCacheMiss, prefill: "prefill-2", decode: "decode-2", cached: 640,
		},
		{
			name: "short prompt skips the remote prefill", tokens: dgTokens(2, 100),
			setup: func(t *testing.T, r *DefaultRouter, ix *kvindex.MemoryIndex) {
				dgBusy(t, r, "decode-1", 1)
				dgBusy(t, r, "decode-2", 1)
			},
			path: disagg.PathFastDecode, reason: disagg.ReasonShortPrompt, decode: "decode-3",
		},
		{
			name: "decode pool down: fallback to unified", tokens: long,
			setup: func(t *testing.T, r *DefaultRouter, ix *kvindex.MemoryIndex) {
				for _, n := range []string{"decode-1", "decode-2", "decode-3"} {
					require.NoError(t, r.SetHealthy(n, false))
				}
			},
			path: disagg.PathFallback, reason: disagg.ReasonPoolUnavailable, decode: "unified-fallback",
		},
		{
			name: "prefill pool down and a prefill needed: fallback", tokens: long,
			setup: func(t *testing.T, r *DefaultRouter, ix *kvindex.MemoryIndex) {
				require.NoError(t, r.SetHealthy("prefill-1", false))
				require.NoError(t, r.SetHealthy("prefill-2", false))
			},
			path: disagg.PathFallback, reason: disagg.ReasonPoolUnavailable, decode: "unified-fallback",
		},
		{
			name: "disabled: unified", cfg: disagg.Config{Disabled: true}, tokens: long,
			path: disagg.PathUnified, reason: disagg.ReasonDisabled, decode: "unified-fallback",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ix := dgIndex(t)
			r := dgRouter(t, ix, tt.cfg, func(c *Config) { c.KV.Speculation = SpeculationOff })
			if tt.setup != nil {
				tt.setup(t, r, ix)
			}
			d, err := r.Disagg().Route(context.Background(), dgReq(tt.tokens))
			require.NoError(t, err)
			defer d.Done(Outcome{})
			assert.Equal(t, tt.path, d.Plan.Path)
			assert.Equal(t, tt.reason, d.Plan.Reason)
			assert.Equal(t, tt.prefill, d.Plan.Prefill)
			assert.Equal(t, tt.decode, d.Plan.Decode)
			assert.Equal(t, tt.cached, d.Plan.ExpectedCachedTokens)
			unified := tt.path == disagg.PathFallback || tt.path == disagg.PathUnified
			assert.Equal(t, unified, d.Unified != nil)

			h := http.Header{}
			d.Plan.SetHeaders(h)
			assert.Equal(t, tt.path.String(), h.Get(disagg.HeaderRoutingPath))
			assert.Equal(t, tt.decode, h.Get(disagg.HeaderDecodeBackend))
			assert.Equal(t, tt.prefill, h.Get(disagg.HeaderPrefillBackend))

			st := statsOf(t, r).Disagg
			assert.Equal(t, uint64(1), st.Path(tt.path))
			assert.Equal(t, uint64(1), st.Total)
		})
	}
}

// TestRouteDisaggStoredPrefix: a prefill engine keeps a prompt on its GPU and writes it to
// external storage (BlockStored on GPU, then on STORAGE, for the same blocks). The index still
// reports the prefix on GPU, but its StoredTokens make it a storage hit for the decode backend
// that shares that storage, as soon as the whole prefix is written.
func TestRouteDisaggStoredPrefix(t *testing.T) {
	elsewhere := disagg.ExternalStorage{Endpoint: "http://other-store:8080", Namespace: "kv"}
	ix := dgIndex(t)
	r := dgRouter(t, ix, disagg.Config{}, func(c *Config) {
		c.KV.Speculation = SpeculationOff
		for i := range c.Backends {
			if n := c.Backends[i].Name; n == "decode-1" || n == "decode-2" {
				c.Backends[i].Storage = &elsewhere
			}
		}
	})
	long := dgTokens(9, 64*16+5) // 64 full blocks
	route := func(what string) *DisaggDecision {
		t.Helper()
		d, err := r.Disagg().Route(context.Background(), dgReq(long))
		require.NoError(t, err, what)
		d.Done(Outcome{})
		return d
	}

	dgHold(t, ix, "prefill-1", long, 64, events.TierGPU)
	d := route("on GPU only")
	assert.Equal(t, disagg.PathPrefillThenDecode, d.Plan.Path, "on GPU only")
	assert.Equal(t, "prefill-1", d.Plan.Prefill, "on GPU only")
	assert.Equal(t, "decode-3", d.Plan.Decode, "on GPU only: the one decode backend reading prefill-1's storage")
	assert.Equal(t, 1024, d.Plan.ExpectedCachedTokens, "on GPU only")

	dgHold(t, ix, "prefill-1", long, 20, events.TierStorage)
	d = route("20 blocks written")
	assert.Equal(t, disagg.PathPrefillThenDecode, d.Plan.Path, "20 blocks written: 709 tokens left is not short")

	dgHold(t, ix, "prefill-1", long, 64, events.TierStorage)
	d = route("64 blocks written")
	assert.Equal(t, disagg.PathFastDecode, d.Plan.Path, "64 blocks written")
	assert.Equal(t, disagg.ReasonStorageHit, d.Plan.Reason, "64 blocks written")
	assert.Equal(t, "decode-3", d.Plan.Decode, "64 blocks written: the decode backend sharing the storage")
	assert.Equal(t, "", d.Plan.Prefill, "64 blocks written")
	assert.Equal(t, 1024, d.Plan.ExpectedCachedTokens, "64 blocks written")
	assert.Equal(t, 5, d.Plan.UncachedTokens, "64 blocks written")
	assert.True(t, d.Plan.Storage.SameLocation(dgStore), "64 blocks written: storage %v", d.Plan.Storage)

	m, err := ix.Lookup(context.Background(), prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot("llama-3-8b", ""), long, 16, nil),
		[]string{"prefill-1"}, make([]kvindex.Match, 1))
	require.NoError(t, err)
	assert.Equal(t, kvindex.Match{Backend: "prefill-1", Blocks: 64, Tokens: 1024, WeightedBlocks: 64, Tier: events.TierGPU,
		StoredBlocks: 64, StoredTokens: 1024}, m[0], "the index still says GPU")
}

func TestRouteDisaggNoBackend(t *testing.T) {
	r := dgRouter(t, dgIndex(t), disagg.Config{DisableFallback: true})
	for _, n := range []string{"decode-1", "decode-2", "decode-3"} {
		require.NoError(t, r.SetHealthy(n, false))
	}
	d, err := r.Disagg().Route(context.Background(), dgReq(dgTokens(3, 2000)))
	assert.Nil(t, d)
	assert.ErrorIs(t, err, ErrNoBackend)
	assert.ErrorIs(t, err, disagg.ErrNoBackend)
	assert.Equal(t, uint64(1), statsOf(t, r).Disagg.NoBackend)
	for name, n := range dgLoads(r) {
		assert.Zero(t, n, name)
	}
	_, err = r.Disagg().Route(context.Background(), nil)
	assert.ErrorIs(t, err, ErrNilRequest)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = r.Disagg().Route(ctx, dgReq(nil))
	assert.ErrorIs(t, err, context.Canceled)
}

func TestRouteDisaggPhases(t *testing.T) {
	ix := dgIndex(t)
	r := dgRouter(t, ix, disagg.Config{})
	ctx := context.Background()
	toks := dgTokens(4, 80*16)
	d, err := r.Disagg().Route(ctx, dgReq(toks))
	require.NoError(t, err)
	require.Equal(t, disagg.PathPrefillThenDecode, d.Plan.Path)
	loads := dgLoads(r)
	assert.Equal(t, 1, loads[d.Plan.Prefill])
	assert.Equal(t, 1, loads[d.Plan.Decode])

	// Before the prefill is done nobody holds the prompt: a twin request is no hit anywhere.
	twin, err := r.Disagg().Route(ctx, dgReq(toks))
	require.NoError(t, err)
	assert.Equal(t, disagg.PathPrefillThenDecode, twin.Plan.Path, "%+v", twin.Plan)
	assert.Zero(t, twin.Plan.ExpectedCachedTokens)
	twin.Done(Outcome{}) // ends both phases; no prefill done, no speculation

	d.PrefillDone(Outcome{})
	d.PrefillDone(Outcome{Err: errors.New("late")}) // idempotent: no second release or outcome
	loads = dgLoads(r)
	assert.Zero(t, loads[d.Plan.Prefill])
	assert.Equal(t, 1, loads[d.Plan.Decode])
	d.Done(Outcome{})
	d.Done(Outcome{})
	for name, n := range dgLoads(r) {
		assert.Zero(t, n, name)
	}
	for _, b := range statsOf(t, r).Backends {
		assert.Equal(t, 1.0, b.SuccessRate, b.Name)
	}

	// Speculation told the index where the prompt went: the same prompt is now a local hit on
	// that decode backend.
	again, err := r.Disagg().Route(ctx, dgReq(toks))
	require.NoError(t, err)
	defer again.Done(Outcome{})
	assert.Equal(t, disagg.PathFastDecode, again.Plan.Path)
	assert.Equal(t, disagg.ReasonLocalHit, again.Plan.Reason)
	assert.Equal(t, d.Plan.Decode, again.Plan.Decode)
	again.PrefillDone(Outcome{}) // no prefill phase: a no-op
	_, err = again.PrefillFailed(ctx, errors.New("x"))
	assert.Error(t, err)
	assert.Equal(t, 1, dgLoads(r)[again.Plan.Decode])
}

// A decode backend that fails before answering: its slots are released, the failure counts
// against it, and the request goes to a unified backend (fallback, decode_failed); the unified
// path itself has no decode phase to fail this way.
func TestRouteDisaggDecodeFailed(t *testing.T) {
	for _, fallback := range []bool{true, false} {
		t.Run(fmt.Sprintf("fallback=%v", fallback), func(t *testing.T) {
			r := dgRouter(t, dgIndex(t), disagg.Config{DisableFallback: !fallback})
			ctx := context.Background()
			d, err := r.Disagg().Route(ctx, dgReq(dgTokens(6, 3000)))
			require.NoError(t, err)
			require.Equal(t, disagg.PathPrefillThenDecode, d.Plan.Path)
			d.PrefillDone(Outcome{})
			cause := errors.New("connection refused")
			fb, err := d.DecodeFailed(ctx, cause)
			if !fallback {
				assert.Nil(t, fb)
				assert.ErrorIs(t, err, ErrNoBackend)
				assert.ErrorIs(t, err, cause)
			} else {
				require.NoError(t, err)
				assert.Equal(t, disagg.PathFallback, fb.Plan.Path)
				assert.Equal(t, disagg.ReasonDecodeFailed, fb.Plan.Reason)
				assert.Equal(t, "unified-fallback", fb.Plan.Decode)
				assert.Equal(t, 1, dgLoads(r)["unified-fallback"])
				_, err = fb.DecodeFailed(ctx, cause)
				assert.Error(t, err, "a unified decision has no decode phase")
				fb.Done(Outcome{})
			}
			_, err = d.DecodeFailed(ctx, cause)
			assert.Error(t, err, "only once")
			d.Done(Outcome{}) // already released: no effect
			for name, n := range dgLoads(r) {
				assert.Zero(t, n, name)
			}
			st := statsOf(t, r)
			assert.Equal(t, uint64(1), st.Disagg.DecodeFailures)
			if fallback {
				assert.Equal(t, uint64(1), st.Disagg.Reasons.DecodeFailed)
			}
			for _, b := range st.Backends {
				if b.Name == d.Plan.Decode {
					assert.Less(t, b.SuccessRate, 1.0, "the failure counts against the decode backend")
				} else if b.Role != disagg.RoleUnified {
					assert.Equal(t, 1.0, b.SuccessRate, b.Name)
				}
			}
		})
	}
}

func TestRouteDisaggPrefillFailed(t *testing.T) {
	for _, fallback := range []bool{true, false} {
		t.Run(fmt.Sprintf("fallback=%v", fallback), func(t *testing.T) {
			r := dgRouter(t, dgIndex(t), disagg.Config{DisableFallback: !fallback})
			ctx := context.Background()
			d, err := r.Disagg().Route(ctx, dgReq(dgTokens(5, 3000)))
			require.NoError(t, err)
			require.Equal(t, disagg.PathPrefillThenDecode, d.Plan.Path)
			cause := errors.New("prefill timed out")
			fb, err := d.PrefillFailed(ctx, cause)
			if !fallback {
				assert.Nil(t, fb)
				assert.ErrorIs(t, err, ErrNoBackend)
				assert.ErrorIs(t, err, cause)
			} else {
				require.NoError(t, err)
				assert.Equal(t, disagg.PathFallback, fb.Plan.Path)
				assert.Equal(t, disagg.ReasonPrefillFailed, fb.Plan.Reason)
				assert.Equal(t, "unified-fallback", fb.Plan.Decode)
				assert.Empty(t, fb.Plan.Prefill)
				assert.Equal(t, 1, dgLoads(r)["unified-fallback"])
				h := http.Header{}
				d.Plan.SetHeaders(h)
				fb.Plan.SetHeaders(h)
				assert.Empty(t, h.Get(disagg.HeaderPrefillBackend))
				fb.Done(Outcome{})
			}
			d.Done(Outcome{}) // already released: no effect
			_, err = d.PrefillFailed(ctx, cause)
			assert.Error(t, err) // only once
			for name, n := range dgLoads(r) {
				assert.Zero(t, n, name)
			}
			st := statsOf(t, r)
			assert.Equal(t, uint64(1), st.Disagg.PrefillFailures)
			for _, b := range st.Backends {
				if b.Name == d.Plan.Prefill {
					assert.Less(t, b.SuccessRate, 1.0, "the failure counts against the prefill backend")
				} else if b.Role != disagg.RoleUnified {
					assert.Equal(t, 1.0, b.SuccessRate, b.Name)
				}
			}
		})
	}
}

// Every slot taken is given back, whatever the mix of outcomes, while health flaps.
func TestRouteDisaggLoadReturnsToZero(t *testing.T) {
	ix := dgIndex(t)
	r := dgRouter(t, ix, disagg.Config{})
	ctx := context.Background()
	prompts := make([][]uint32, 12)
	for i := range prompts {
		prompts[i] = dgTokens(100+i, 16*(5+i*9))
		if i%3 == 0 {
			dgHold(t, ix, "decode-1", prompts[i], len(prompts[i])/16, events.TierGPU)
		}
		if i%4 == 1 {
			dgHold(t, ix, "prefill-2", prompts[i], len(prompts[i])/16, events.TierStorage)
		}
	}
	stop := make(chan struct{})
	var flapper sync.WaitGroup
	flapper.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				_ = r.SetHealthy("decode-2", true)
				_ = r.SetHealthy("prefill-1", true)
				return
			default:
			}
			_ = r.SetHealthy("decode-2", i%2 == 0)
			_ = r.SetHealthy("prefill-1", i%3 != 0)
		}
	})
	var wg sync.WaitGroup
	var routed, failed sync.Map
	for g := range 16 {
		wg.Go(func() {
			rnd := rand.New(rand.NewPCG(uint64(g), 1))
			for i := range 150 {
				d, err := r.Disagg().Route(ctx, dgReq(prompts[rnd.IntN(len(prompts))]))
				if err != nil {
					failed.Store(fmt.Sprint(g, i), err)
					continue
				}
				routed.Store(d.Plan.Path, true)
				switch rnd.IntN(5) {
				case 0: // the normal two-phase flow
					d.PrefillDone(Outcome{})
					d.Done(Outcome{})
				case 1: // prefill fails: the fallback serves
					if fb, err := d.PrefillFailed(ctx, errors.New("boom")); err == nil {
						fb.Done(Outcome{})
					}
					d.Done(Outcome{})
				case 2: // Done without PrefillDone, twice, from two goroutines
					var both sync.WaitGroup
					both.Go(func() { d.Done(Outcome{Err: errors.New("decode failed")}) })
					both.Go(func() { d.Done(Outcome{}) })
					both.Wait()
				case 3: // phases reported concurrently
					var both sync.WaitGroup
					both.Go(func() { d.PrefillDone(Outcome{}) })
					both.Go(func() { d.Done(Outcome{}) })
					both.Wait()
				default:
					d.FirstToken()
					d.Done(Outcome{})
					d.PrefillDone(Outcome{})
				}
			}
		})
	}
	wg.Wait()
	close(stop)
	flapper.Wait()
	failed.Range(func(k, v any) bool {
		t.Errorf("request %v: %v", k, v)
		return true
	})
	for name, n := range dgLoads(r) {
		assert.Zero(t, n, name)
	}
	for _, p := range []disagg.Path{disagg.PathFastDecode, disagg.PathPrefillThenDecode} {
		_, ok := routed.Load(p)
		assert.True(t, ok, "no request took %v", p)
	}
	st := statsOf(t, r).Disagg
	assert.Equal(t, uint64(16*150), st.FastDecode+st.PrefillThenDecode+st.Fallback-st.Reasons.PrefillFailed)
}

func TestDisaggBackendsStayOffTheUnifiedRing(t *testing.T) {
	r := dgRouter(t, nil, disagg.Config{}, func(c *Config) {
		c.Backends = append(c.Backends, Backend{Name: "unified-2"})
		c.Strategy = StrategyRoundRobin
	})
	ctx := context.Background()
	for i := range 60 {
		req := chatReq(fmt.Sprintf("system %d", i), "u")
		if i%3 == 0 {
			req = &prefixkey.Request{Model: "m"} // no prefix key: the strategy decides
		}
		d, err := r.Route(ctx, req)
		require.NoError(t, err)
		assert.Contains(t, []string{"unified-fallback", "unified-2"}, d.Backend)
		d.Done(Outcome{})
	}
	// Membership changes go to the right ring.
	require.NoError(t, r.RemoveBackend("decode-3"))
	require.NoError(t, r.AddBackend(Backend{Name: "decode-4", Role: disagg.RoleDecode}))
	assert.ErrorIs(t, r.AddBackend(Backend{Name: "decode-4", Role: disagg.RoleDecode}), ErrDuplicateBackend)
	assert.ErrorIs(t, r.SetHealthy("decode-3", false), ErrUnknownBackend)
	require.NoError(t, r.SetHealthy("decode-4", false))
	st := statsOf(t, r)
	assert.Len(t, backendsOf(st, disagg.RolePrefill), 2)
	assert.Len(t, backendsOf(st, disagg.RoleDecode), 3)
	assert.Len(t, backendsOf(st, disagg.RoleUnified), 2)
	assert.Len(t, st.Backends, 7)

	// A decode slot held across its backend's removal is released once, harmlessly.
	d, err := r.Disagg().Route(ctx, dgReq(dgTokens(9, 100)))
	require.NoError(t, err)
	require.NoError(t, r.RemoveBackend(d.Plan.Decode))
	d.Done(Outcome{})
	for name, n := range dgLoads(r) {
		assert.Zero(t, n, name)
	}
}

func TestDisaggNeedsConfig(t *testing.T) {
	_, err := New(Config{Backends: []Backend{{Name: "p", Role: disagg.RolePrefill}}})
	assert.ErrorIs(t, err, ErrInvalidConfig)
	_, err = New(Config{Backends: []Backend{{Name: "p", Role: disagg.Role(9)}}, Disagg: &disagg.Config{}})
	assert.ErrorIs(t, err, ErrInvalidConfig)
	_, err = New(Config{Disagg: &disagg.Config{MaxUncachedRatio: 2}})
	assert.ErrorIs(t, err, ErrInvalidConfig)

	// Without Config.Disagg, Disagg().Route is Route with a unified label.
	r := newRouter(t, Config{Backends: backends(2)})
	d, err := r.Disagg().Route(context.Background(), chatReq("s", "u"))
	require.NoError(t, err)
	assert.Equal(t, disagg.PathUnified, d.Plan.Path)
	assert.Equal(t, disagg.ReasonDisabled, d.Plan.Reason)
	require.NotNil(t, d.Unified)
	assert.Equal(t, d.Unified.Backend, d.Plan.Decode)
	inflight, _ := r.ring.InFlight(d.Plan.Decode)
	assert.Equal(t, 1, inflight)
	d.Done(Outcome{})
	inflight, _ = r.ring.InFlight(d.Plan.Decode)
	assert.Zero(t, inflight)
	st := statsOf(t, r)
	assert.Nil(t, st.Disagg)
	assert.Equal(t, uint64(1), st.Decisions.Total(), "the unified path is one of Route's decisions")
	_, ok := r.Disagg().Config()
	assert.False(t, ok)
}

// With disaggregation on, Stats counts DisaggRouter.Route's requests by path and reason and lists
// the pool backends after the unified ones, each with its phases in flight; the Router keeps its
// own copy of a backend's storage.
func TestDisaggStats(t *testing.T) {
	own := disagg.ExternalStorage{Endpoint: "http://own:9000", Namespace: "kv", Credentials: "cred-own-33"}
	r := dgRouter(t, nil, disagg.Config{}, func(c *Config) {
		c.Backends[0].Storage = &own
	})
	own.Endpoint = "http://changed" // the Router keeps its own copy
	assert.Equal(t, "http://own:9000", r.set.Load().byName[r.cfg.Backends[0].Name].storage.Endpoint)
	d, err := r.Disagg().Route(context.Background(), dgReq(dgTokens(6, 5000)))
	require.NoError(t, err)
	require.Equal(t, disagg.PathPrefillThenDecode, d.Plan.Path)
	st := statsOf(t, r)
	require.NotNil(t, st.Disagg)
	assert.Equal(t, uint64(1), st.Disagg.PrefillThenDecode)
	assert.Equal(t, uint64(1), st.Disagg.Total)
	assert.Zero(t, st.Decisions.Total(), "the pools' phases are not Route's decisions")
	roles := []disagg.Role{}
	for _, b := range st.Backends {
		if len(roles) == 0 || roles[len(roles)-1] != b.Role {
			roles = append(roles, b.Role)
		}
		want := 0
		if b.Name == d.Plan.Prefill || b.Name == d.Plan.Decode {
			want = 1
		}
		assert.Equal(t, want, b.InFlight, b.Name)
		assert.Equal(t, uint64(want), b.Decisions, b.Name)
	}
	assert.Equal(t, []disagg.Role{disagg.RoleUnified, disagg.RolePrefill, disagg.RoleDecode}, roles, "unified, then prefill, then decode")
	d.PrefillDone(Outcome{})
	d.Done(Outcome{})
	for _, b := range statsOf(t, r).Backends {
		assert.Zero(t, b.InFlight, b.Name)
	}
	cfg, ok := r.Disagg().Config()
	assert.True(t, ok)
	assert.Equal(t, disagg.DefaultKVTransferTimeout, cfg.KVTransferTimeout)
}

func TestDisaggMetrics(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer func() { _ = mp.Shutdown(context.Background()) }()
	ix := dgIndex(t)
	r := dgRouter(t, ix, disagg.Config{}, func(c *Config) { c.MeterProvider = mp })
	ctx := context.Background()
	held, err := r.Disagg().Route(ctx, dgReq(dgTokens(7, 3000)))
	require.NoError(t, err)
	short, err := r.Disagg().Route(ctx, dgReq(dgTokens(8, 50)))
	require.NoError(t, err)
	short.Done(Outcome{})
	fb, err := held.PrefillFailed(ctx, errors.New("x"))
	require.NoError(t, err)
	defer fb.Done(Outcome{})
	pinned, err := r.Disagg().Route(ctx, dgReq(dgTokens(10, 3000)))
	require.NoError(t, err)
	defer pinned.Done(Outcome{})

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	got := map[string]metricdata.Aggregation{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			got[m.Name] = m.Data
		}
	}
	byPath := map[string]int64{}
	for _, dp := range got[telemetry.MetricDisaggRequests].(metricdata.Sum[int64]).DataPoints {
		p, _ := dp.Attributes.Value("path")
		why, _ := dp.Attributes.Value("reason")
		byPath[p.AsString()+"/"+why.AsString()] += dp.Value
	}
	assert.Equal(t, map[string]int64{"prefill_then_decode/cache_miss": 2, "fast_decode/short_prompt": 1, "fallback/prefill_failed": 1}, byPath)
	fails := got[telemetry.MetricDisaggPrefillFailures].(metricdata.Sum[int64]).DataPoints
	require.Len(t, fails, 1)
	assert.Equal(t, int64(1), fails[0].Value)
	inflight := map[string]int64{}
	for _, dp := range got[telemetry.MetricDisaggInFlight].(metricdata.Gauge[int64]).DataPoints {
		b, _ := dp.Attributes.Value("backend")
		ph, _ := dp.Attributes.Value("phase")
		inflight[ph.AsString()+"/"+b.AsString()] = dp.Value
	}
	assert.Len(t, inflight, 5)
	assert.Equal(t, int64(1), inflight["prefill/"+pinned.Plan.Prefill])
	assert.Equal(t, int64(1), inflight["decode/"+pinned.Plan.Decode])
	require.NoError(t, r.Close())
	require.NoError(t, r.Close())
}
