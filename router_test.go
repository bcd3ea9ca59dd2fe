package kvroute

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/prefixkey"
)

func backends(n int) []Backend {
	out := make([]Backend, n)
	for i := range out {
		out[i] = Backend{Name: fmt.Sprintf("vllm-%d", i+1)}
	}
	return out
}

func chatReq(system, user string) *prefixkey.Request {
	r := &prefixkey.Request{Format: prefixkey.FormatOpenAIChat, Model: "llama-3-8b"}
	if system != "" {
		r.System, r.HasSystem = system, true
	}
	if user != "" {
		r.Messages = []prefixkey.Message{{Role: "user", Text: user}}
	}
	return r
}

func newRouter(t testing.TB, cfg Config) *DefaultRouter {
	t.Helper()
	r, err := New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	return r
}

// statsOf is r.Stats, which must not fail.
func statsOf(t testing.TB, r *DefaultRouter) Stats {
	t.Helper()
	s, err := r.Stats(context.Background())
	require.NoError(t, err)
	return s
}

// backendsOf returns the backends of st with role.
func backendsOf(st Stats, role disagg.Role) []BackendStats {
	var out []BackendStats
	for _, b := range st.Backends {
		if b.Role == role {
			out = append(out, b)
		}
	}
	return out
}

func TestRoutePrefixSticky(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(8)})
	ctx := context.Background()
	first, err := r.Route(ctx, chatReq("You are a helpful assistant for ACME.", "hi"))
	require.NoError(t, err)
	assert.Equal(t, ReasonPrefixHash, first.Reason)
	assert.True(t, first.HasPrefixKey)
	first.Done(Outcome{})
	for i := range 50 {
		d, err := r.Route(ctx, chatReq("You are a helpful assistant for ACME.", fmt.Sprintf("question %d", i)))
		require.NoError(t, err)
		assert.Equal(t, first.Backend, d.Backend, "same system prompt must stick to one backend")
		assert.Equal(t, first.PrefixKey, d.PrefixKey)
		d.Done(Outcome{})
	}
	// Different prefixes spread over the fleet.
	seen := map[string]bool{}
	for i := range 400 {
		d, err := r.Route(ctx, chatReq(fmt.Sprintf("system prompt %d", i), "hi"))
		require.NoError(t, err)
		seen[d.Backend] = true
		d.Done(Outcome{})
	}
	assert.Len(t, seen, 8)
}

func TestRouteFirstMessageAnchor(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(4)})
	ctx := context.Background()
	a, err := r.Route(ctx, chatReq("", "Summarise this document: lorem ipsum"))
	require.NoError(t, err)
	assert.Equal(t, ReasonPrefixHash, a.Reason)
	b, err := r.Route(ctx, chatReq("Summarise this document: lorem ipsum", ""))
	require.NoError(t, err)
	assert.NotEqual(t, a.PrefixKey, b.PrefixKey, "S and M tags must give different keys for the same text")
}

func TestRouteFallbackRoundRobin(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(3)})
	ctx := context.Background()
	counts := map[string]int{}
	for range 30 {
		d, err := r.Route(ctx, &prefixkey.Request{Model: "m"}) // no anchor: fallback
		require.NoError(t, err)
		assert.Equal(t, ReasonFallback, d.Reason)
		assert.False(t, d.HasPrefixKey)
		counts[d.Backend]++
		d.Done(Outcome{})
	}
	assert.Equal(t, map[string]int{"vllm-1": 10, "vllm-2": 10, "vllm-3": 10}, counts)
}

func TestRouteDisabledPrefixRouting(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(2), DisablePrefixRouting: true})
	d, err := r.Route(context.Background(), chatReq("sys", "hi"))
	require.NoError(t, err)
	assert.Equal(t, ReasonStrategy, d.Reason, "nothing fell back: the strategy is the policy")
	assert.Equal(t, "strategy", d.Reason.String())
	assert.False(t, d.HasPrefixKey)
	st := statsOf(t, r)
	assert.Equal(t, uint64(1), st.Decisions.Strategy)
	assert.Zero(t, st.Decisions.Fallback)
	assert.Zero(t, st.UniquePrefixes, "no prefix key with prefix routing off")
}

func TestStrategyLeastLoaded(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(3), Strategy: StrategyLeastLoaded})
	ctx := context.Background()
	// Hold slots: vllm-1 ×2 and vllm-2 ×1 through forced prefix routing is not available, so fill via
	// fallback requests and check that each new one goes to a least-loaded backend.
	var held []*Decision
	for range 9 {
		d, err := r.Route(ctx, &prefixkey.Request{Model: "m"})
		require.NoError(t, err)
		held = append(held, d)
	}
	for _, l := range statsOf(t, r).Backends {
		assert.Equal(t, 3, l.InFlight, l.Name)
	}
	// Free two on one backend: the next two requests must go there.
	target := held[0].Backend
	freed := 0
	for _, d := range held {
		if d.Backend == target && freed < 2 {
			d.Done(Outcome{})
			freed++
		}
	}
	for range 2 {
		d, err := r.Route(ctx, &prefixkey.Request{Model: "m"})
		require.NoError(t, err)
		assert.Equal(t, target, d.Backend)
	}
}

// StrategyPrefixAwareHash (kvroute's PrefixAwareHash) names tier 1 itself: a request with a prefix
// key goes to its owner on the ring, as under the default strategy; one without a key goes round
// robin. It routes by prefix key, so New refuses it with prefix routing off.
func TestStrategyPrefixAwareHash(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(3), Strategy: StrategyPrefixAwareHash})
	def := newRouter(t, Config{Backends: backends(3)})
	ctx := context.Background()
	for i := range 20 {
		req := chatReq(fmt.Sprintf("system %d", i), "u")
		d, err := r.Route(ctx, req)
		require.NoError(t, err)
		want, err := def.Route(ctx, req)
		require.NoError(t, err)
		assert.Equal(t, ReasonPrefixHash, d.Reason)
		assert.Equal(t, want.Backend, d.Backend, "the ring's owner, as under the default strategy")
		d.Done(Outcome{})
		want.Done(Outcome{})
	}
	counts := map[string]int{}
	for range 30 {
		d, err := r.Route(ctx, &prefixkey.Request{Model: "m"}) // no anchor: round robin
		require.NoError(t, err)
		assert.Equal(t, ReasonFallback, d.Reason)
		counts[d.Backend]++
		d.Done(Outcome{})
	}
	assert.Equal(t, map[string]int{"vllm-1": 10, "vllm-2": 10, "vllm-3": 10}, counts)
	assert.Equal(t, uint64(30), statsOf(t, r).Decisions.Fallback)

	_, err := New(Config{Strategy: StrategyPrefixAwareHash, DisablePrefixRouting: true})
	require.ErrorIs(t, err, ErrInvalidConfig)
	assert.ErrorContains(t, err, "prefix_aware_hash")
}

func TestStrategyRandomSkipsUnhealthy(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(4), Strategy: StrategyRandom})
	require.NoError(t, r.SetHealthy("vllm-2", false))
	require.NoError(t, r.SetHealthy("vllm-4", false))
	seen := map[string]int{}
	for range 400 {
		d, err := r.Route(context.Background(), &prefixkey.Request{Model: "m"})
		require.NoError(t, err)
		seen[d.Backend]++
		d.Done(Outcome{})
	}
	assert.Zero(t, seen["vllm-2"])
	assert.Zero(t, seen["vllm-4"])
	assert.Greater(t, seen["vllm-1"], 100)
	assert.Greater(t, seen["vllm-3"], 100)
}

func TestStrategyLeastLatency(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(3), Strategy: StrategyLeastLatency})
	ctx := context.Background()
	lat := map[string]time.Duration{"vllm-1": 80 * time.Millisecond, "vllm-2": 20 * time.Millisecond, "vllm-3": 50 * time.Millisecond}
	// Unobserved backends are tried first: the first three requests visit all three.
	seen := map[string]bool{}
	for range 3 {
		d, err := r.Route(ctx, &prefixkey.Request{Model: "m"})
		require.NoError(t, err)
		seen[d.Backend] = true
		d.Done(Outcome{Latency: lat[d.Backend]})
	}
	assert.Len(t, seen, 3)
	for range 20 {
		d, err := r.Route(ctx, &prefixkey.Request{Model: "m"})
		require.NoError(t, err)
		assert.Equal(t, "vllm-2", d.Backend)
		d.Done(Outcome{Latency: lat[d.Backend]})
	}
}

func TestUnhealthyAndNoBackend(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(2)})
	ctx := context.Background()
	require.NoError(t, r.SetHealthy("vllm-1", false))
	for i := range 50 {
		d, err := r.Route(ctx, chatReq(fmt.Sprintf("p%d", i), "x"))
		require.NoError(t, err)
		assert.Equal(t, "vllm-2", d.Backend)
		d.Done(Outcome{})
	}
	require.NoError(t, r.SetHealthy("vllm-2", false))
	_, err := r.Route(ctx, chatReq("p", "x"))
	assert.ErrorIs(t, err, ErrNoBackend)
	_, err = r.Route(ctx, &prefixkey.Request{Model: "m"})
	assert.ErrorIs(t, err, ErrNoBackend)
	require.NoError(t, r.SetHealthy("vllm-1", true))
	d, err := r.Route(ctx, chatReq("p", "x"))
	require.NoError(t, err)
	assert.Equal(t, "vllm-1", d.Backend)

	assert.ErrorIs(t, r.SetHealthy("nope", true), ErrUnknownBackend)
	assert.ErrorIs(t, r.RemoveBackend("nope"), ErrUnknownBackend)
	assert.ErrorIs(t, r.AddBackend(Backend{Name: "vllm-1"}), ErrDuplicateBackend)
	assert.ErrorIs(t, r.AddBackend(Backend{Name: ""}), ErrInvalidConfig)
	assert.ErrorIs(t, r.AddBackend(Backend{Name: "w", Weight: -1}), ErrInvalidConfig)
}

func TestRouteEmptyRouterAndBadArgs(t *testing.T) {
	r := newRouter(t, Config{})
	_, err := r.Route(context.Background(), chatReq("s", "u"))
	assert.ErrorIs(t, err, ErrNoBackend)
	_, err = r.Route(context.Background(), nil)
	assert.ErrorIs(t, err, ErrNilRequest)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = r.Route(ctx, chatReq("s", "u"))
	assert.ErrorIs(t, err, context.Canceled)
}

func TestDoneReleasesOnceAndRecordsHealth(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(1)})
	d, err := r.Route(context.Background(), chatReq("s", "u"))
	require.NoError(t, err)
	assert.Equal(t, 1, statsOf(t, r).Backends[0].InFlight)
	d.Done(Outcome{Err: errors.New("upstream 500")})
	d.Done(Outcome{Err: errors.New("upstream 500")})
	d.Done(Outcome{})
	st := statsOf(t, r).Backends[0]
	assert.Equal(t, 0, st.InFlight)
	assert.InDelta(t, 1-ewmaWeight, st.SuccessRate, 1e-9, "one failure recorded once")
	var nilDecision *Decision
	nilDecision.Done(Outcome{}) // no panic
}

func TestRemoveBackendWithInFlight(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(3)})
	ctx := context.Background()
	var held []*Decision
	for i := range 30 {
		d, err := r.Route(ctx, chatReq(fmt.Sprintf("p%d", i), "u"))
		require.NoError(t, err)
		held = append(held, d)
	}
	require.NoError(t, r.RemoveBackend("vllm-2"))
	for _, d := range held {
		d.Done(Outcome{})
		d.Done(Outcome{})
	}
	total := 0
	for _, l := range statsOf(t, r).Backends {
		assert.NotEqual(t, "vllm-2", l.Name)
		total += l.InFlight
	}
	assert.Zero(t, total)
	for i := range 100 {
		d, err := r.Route(ctx, chatReq(fmt.Sprintf("p%d", i), "u"))
		require.NoError(t, err)
		assert.NotEqual(t, "vllm-2", d.Backend)
		d.Done(Outcome{})
	}
	require.NoError(t, r.AddBackend(Backend{Name: "vllm-2"}))
}

func TestOverflowUnderHotPrefix(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(4)})
	ctx := context.Background()
	var held []*Decision
	for range 40 {
		d, err := r.Route(ctx, chatReq("one hot system prompt", "u"))
		require.NoError(t, err)
		held = append(held, d)
	}
	s := statsOf(t, r)
	assert.Equal(t, uint64(40), s.Decisions.Total())
	assert.Positive(t, s.Decisions.Overflow)
	assert.Equal(t, uint64(40), s.Decisions.PrefixHash+s.Decisions.Overflow)
	// ceil(1.25·(T+1)/4) caps every backend: with 40 in flight none holds more than ceil(1.25·40/4) = 13.
	inFlight := 0
	for _, l := range s.Backends {
		assert.LessOrEqual(t, l.InFlight, int(math.Ceil(1.25*40/4)), l.Name)
		inFlight += l.InFlight
	}
	assert.Equal(t, 40, inFlight)
	for _, d := range held {
		d.Done(Outcome{})
	}
}

// Stats counts from New on and never goes down (there is no reset: a monitoring system takes
// differences); the unique-prefix estimate counts distinct prefix keys.
func TestStatsCounters(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(2)})
	route := func(n int) {
		for i := range n {
			d, err := r.Route(context.Background(), chatReq(fmt.Sprintf("p%d", i%25), "u"))
			require.NoError(t, err)
			d.Done(Outcome{Latency: 20 * time.Millisecond})
		}
	}
	route(100)
	s := statsOf(t, r)
	assert.Equal(t, DecisionCounts{PrefixHash: 100}, s.Decisions)
	assert.Equal(t, uint64(100), s.Decisions.Total())
	assert.Equal(t, uint64(25), s.UniquePrefixes)
	require.Len(t, s.Backends, 2)
	decisions := uint64(0)
	for _, b := range s.Backends {
		assert.Equal(t, disagg.RoleUnified, b.Role)
		assert.True(t, b.Healthy)
		assert.Equal(t, 1.0, b.Weight)
		assert.Zero(t, b.InFlight)
		assert.Equal(t, 1.0, b.SuccessRate)
		assert.Equal(t, 20*time.Millisecond, b.Latency, b.Name)
		assert.Nil(t, b.Engine)
		decisions += b.Decisions
	}
	assert.Equal(t, uint64(100), decisions)
	assert.Nil(t, s.Index, "tier 4 off")
	assert.Nil(t, s.Disagg, "disaggregation off")
	assert.Zero(t, s.Lookups)
	assert.Empty(t, s.Scorer)
	assert.Zero(t, s.BlockSize)

	route(10)
	later := statsOf(t, r)
	assert.Equal(t, uint64(110), later.Decisions.Total())
	assert.Equal(t, uint64(25), later.UniquePrefixes)
}

func TestConfigValidation(t *testing.T) {
	for name, cfg := range map[string]Config{
		"epsilon too small": {LoadFactorEpsilon: 0.001},
		"epsilon too big":   {LoadFactorEpsilon: 11},
		"epsilon NaN":       {LoadFactorEpsilon: math.NaN()},
		"prefix length":     {MaxPrefixLength: -1},
		"strategy":          {Strategy: "fastest"},
		"vnodes":            {VirtualNodes: -5},
		"duplicate backend": {Backends: []Backend{{Name: "a"}, {Name: "a"}}},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := New(cfg)
			assert.Error(t, err)
		})
	}
}

func TestTwoRoutersIndependent(t *testing.T) {
	a := newRouter(t, Config{Backends: backends(2)})
	b := newRouter(t, Config{Backends: backends(2), Strategy: StrategyLeastLoaded})
	for range 10 {
		d, err := a.Route(context.Background(), chatReq("s", "u"))
		require.NoError(t, err)
		defer d.Done(Outcome{})
	}
	require.NoError(t, a.SetHealthy("vllm-1", false))
	require.NoError(t, a.RemoveBackend("vllm-2"))
	sb := statsOf(t, b)
	assert.Zero(t, sb.Decisions.Total())
	assert.Zero(t, sb.UniquePrefixes)
	for _, l := range sb.Backends {
		assert.True(t, l.Healthy)
		assert.Zero(t, l.InFlight)
	}
	assert.Len(t, sb.Backends, 2)
	d, err := b.Route(context.Background(), chatReq("s", "u"))
	require.NoError(t, err)
	d.Done(Outcome{})
}

func TestConcurrentRouteAndMembership(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(8), Strategy: StrategyLeastLoaded})
	ctx := context.Background()
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 2000 {
				req := chatReq(fmt.Sprintf("p%d", (g*i)%37), "u")
				if i%5 == 0 {
					req = &prefixkey.Request{Model: "m"}
				}
				d, err := r.Route(ctx, req)
				if errors.Is(err, ErrNoBackend) {
					continue
				}
				if !assert.NoError(t, err) {
					return
				}
				d.Done(Outcome{})
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := range 200 {
			name := fmt.Sprintf("extra-%d", i%4)
			_ = r.AddBackend(Backend{Name: name, Weight: 2})
			_ = r.SetHealthy("vllm-3", i%2 == 0)
			_ = r.RemoveBackend(name)
		}
	}()
	wg.Wait()
	for _, l := range statsOf(t, r).Backends {
		assert.Zero(t, l.InFlight, l.Name)
	}
}

func TestRouteAllocs(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(16)})
	req := chatReq("You are a helpful assistant.", "hi")
	ctx := context.Background()
	allocs := testing.AllocsPerRun(1000, func() {
		d, _ := r.Route(ctx, req)
		d.Done(Outcome{})
	})
	assert.LessOrEqual(t, allocs, 2.0)
}

func TestHyperLogLogEstimate(t *testing.T) {
	for _, n := range []int{0, 10, 1000, 100000} {
		var h hyperLogLog
		for i := range n {
			k := prefixkey.ComputeKey("m", 'S', fmt.Sprint(i), 0)
			h.add(k.Uint64())
			h.add(k.Uint64()) // duplicates do not count
		}
		got := float64(h.estimate())
		assert.InDelta(t, float64(n), got, math.Max(1, 0.05*float64(n)), "n=%d", n)
	}
}

// inFlight returns the in-flight requests of backend name in r's stats.
func inFlight(r *DefaultRouter, name string) int {
	st, _ := r.Stats(context.Background())
	for _, l := range st.Backends {
		if l.Name == name {
			return l.InFlight
		}
	}
	return -1
}

// A refusal (an engine out of room) is load, not ill health: the refused request's slot stays on
// the backend for RefusalHold, so the next requests go elsewhere, and the backend's success rate
// does not move.
func TestDoneRefusedHoldsSlot(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(2), Strategy: StrategyLeastLoaded, RefusalHold: time.Hour / 60})
	ctx := context.Background()
	req := &prefixkey.Request{Model: "m"} // no prefix key: least_loaded chooses
	d, err := r.Route(ctx, req)
	require.NoError(t, err)
	refused := d.Backend
	d.Done(Outcome{Refused: true})
	d.Done(Outcome{}) // only the first Done counts
	assert.Equal(t, 1, inFlight(r, refused), "the refused request still weighs on its backend")
	for range 3 {
		d2, err := r.Route(ctx, req)
		require.NoError(t, err)
		assert.NotEqual(t, refused, d2.Backend, "the backend that refused is busier than the other")
		d2.Done(Outcome{})
	}
	for _, l := range statsOf(t, r).Backends {
		if l.Name == refused {
			assert.Equal(t, uint64(1), l.Refusals)
			assert.Equal(t, 1.0, l.SuccessRate, "a refusal is not a failure")
		}
	}

	r2 := newRouter(t, Config{Backends: backends(2), RefusalHold: 20 * time.Millisecond})
	d, err = r2.Route(ctx, req)
	require.NoError(t, err)
	d.Done(Outcome{Refused: true})
	require.Eventually(t, func() bool { return inFlight(r2, d.Backend) == 0 }, 5*time.Second, 5*time.Millisecond,
		"the slot is released after RefusalHold")

	r3 := newRouter(t, Config{Backends: backends(2), RefusalHold: -1})
	d, err = r3.Route(ctx, req)
	require.NoError(t, err)
	d.Done(Outcome{Refused: true})
	assert.Equal(t, 0, inFlight(r3, d.Backend), "a negative RefusalHold releases at once")

	// A request the gateway never sent records nothing: no latency, no failure, no success.
	d, err = r3.Route(ctx, req)
	require.NoError(t, err)
	d.Done(Outcome{NotSent: true, Err: errors.New("not sent")})
	for _, l := range statsOf(t, r3).Backends {
		assert.Zero(t, l.InFlight)
		assert.Zero(t, l.Latency, "%s: a request never sent has no latency", l.Name)
		assert.Equal(t, 1.0, l.SuccessRate)
	}

	_, err = New(Config{RefusalHold: 2 * time.Minute})
	assert.ErrorIs(t, err, ErrInvalidConfig)
}
