package kvroute

import (
	"context"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/scorer"
)

// stepClock is a settable clock for Config.Now.
type stepClock struct {
	mu  sync.Mutex
	now time.Time
}

func newStepClock() *stepClock { return &stepClock{now: time.Unix(1_800_000_000, 0)} }

func (c *stepClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *stepClock) advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// probeOf returns what Probe saw of backend for a request of tokens.
func probeOf(t *testing.T, r *DefaultRouter, tokens []uint32, backend string) ProbeBackend {
	t.Helper()
	res, err := r.Probe(context.Background(), tokReq("probe", tokens))
	require.NoError(t, err)
	return probeBackend(t, res, backend)
}

// A prompt cached whole on a backend that has a long cold prefill queued goes to an idle backend
// (load_bound: its expected first token there comes far sooner), and back to its holder once that
// prefill has ended. The composite scorer keeps it on the holder, behind the queue: the tail that
// issue 21 measured.
func TestKVQueuedHolderLosesToIdleBackend(t *testing.T) {
	for _, tc := range []struct {
		name      string
		weights   scorer.CompositeConfig
		leaves    bool
		wantScore string
	}{
		{"expected_ttft", scorer.CompositeConfig{}, true, "expected_ttft"},
		{"kv_overlap", scorer.CompositeConfig{OverlapWeight: 0.6, LoadWeight: 0.3, HealthWeight: 0.1}, false, "kv_overlap"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clock := newStepClock()
			ix := newMemIndex(t)
			r := newRouter(t, Config{Backends: backends(2), Now: clock.Now,
				KV: &KVConfig{Index: ix, Speculation: SpeculateOff, Weights: tc.weights}})
			ctx := context.Background()
			st, err := r.KVStats(ctx)
			require.NoError(t, err)
			assert.Equal(t, tc.wantScore, st.Config.Scorer)
			assert.Equal(t, scorer.DefaultAttentionCost, st.Config.AttentionCost)

			// A cold 100,000-token prompt: 300,000 token-equivalents of prefill on its backend.
			long := promptTokens(7, 100_000)
			dq, err := r.Route(ctx, tokReq("long", long))
			require.NoError(t, err)
			require.Equal(t, ReasonLeastWork, dq.Reason)
			holder := dq.Backend
			assert.InDelta(t, scorer.PrefillWork(100_000, 0, scorer.DefaultAttentionCost),
				probeOf(t, r, long, holder).PendingPrefillWork, 1)

			// The same backend holds a 20,000-token prompt whole; cold elsewhere it costs 28,000.
			short := promptTokens(8, 20_000)
			storeBlocks(t, ix, holder, short, 1250, events.TierGPU)
			d, err := r.Route(ctx, tokReq("short", short))
			require.NoError(t, err)
			if tc.leaves {
				assert.NotEqual(t, holder, d.Backend, "a whole hit waits behind 300,000 token-equivalents")
				assert.Equal(t, ReasonLoadBound, d.Reason)
				assert.Zero(t, d.ExpectedCachedTokens)
			} else {
				assert.Equal(t, holder, d.Backend)
				assert.Equal(t, ReasonKVAware, d.Reason)
			}
			d.Done(Outcome{})

			// The long prefill ends: the holder is idle, and the hit goes there.
			clock.advance(20 * time.Second)
			dq.FirstToken()
			assert.Zero(t, probeOf(t, r, long, holder).PendingPrefillWork)
			d, err = r.Route(ctx, tokReq("short", short))
			require.NoError(t, err)
			assert.Equal(t, holder, d.Backend)
			assert.Equal(t, ReasonKVAware, d.Reason)
			assert.Equal(t, 20_000, d.ExpectedCachedTokens)
			d.Done(Outcome{})
			dq.Done(Outcome{})
		})
	}
}

// The work queued on a backend shrinks with time at the prefill rate its first tokens showed, and
// never below 0; the tokens queued do not (they are what the backend reports, not an estimate).
func TestKVPendingWorkProgress(t *testing.T) {
	clock := newStepClock()
	r := newRouter(t, Config{Backends: backends(1), Now: clock.Now,
		KV: &KVConfig{Index: newMemIndex(t), Speculation: SpeculateOff}})
	ctx := context.Background()
	name := backends(1)[0].Name
	work := func(n int) float64 { return scorer.PrefillWork(n, 0, scorer.DefaultAttentionCost) }

	// No rate is known before the first prefill ends: nothing is subtracted.
	first := promptTokens(1, 10_000)
	d1, err := r.Route(ctx, tokReq("first", first))
	require.NoError(t, err)
	clock.advance(time.Second)
	b := probeOf(t, r, first, name)
	assert.InDelta(t, work(10_000), b.PendingPrefillWork, 1)
	assert.Equal(t, 10_000, b.PendingPrefillTokens)
	d1.FirstToken() // 12,000 token-equivalents in one second
	assert.Zero(t, probeOf(t, r, first, name).PendingPrefillWork)

	long := promptTokens(2, 100_000)
	d2, err := r.Route(ctx, tokReq("long", long))
	require.NoError(t, err)
	assert.InDelta(t, work(100_000), probeOf(t, r, long, name).PendingPrefillWork, 1)
	clock.advance(10 * time.Second)
	b = probeOf(t, r, long, name)
	assert.InDelta(t, work(100_000)-10*work(10_000), b.PendingPrefillWork, 1)
	assert.Equal(t, 100_000, b.PendingPrefillTokens)
	clock.advance(time.Minute)
	assert.Zero(t, probeOf(t, r, long, name).PendingPrefillWork, "never below 0")
	// A prefill that ends without a first token (an error) teaches no rate but ends the queue.
	d2.Done(Outcome{Err: context.DeadlineExceeded})
	b = probeOf(t, r, long, name)
	assert.Zero(t, b.PendingPrefillWork)
	assert.Zero(t, b.PendingPrefillTokens)
}

// A prefix every request shares stays on its holder while the holder's share of decisions is
// fair, and spreads to other backends once it takes more than HotShare of them; with the
// spreading off it piles onto the holder.
func TestKVHotPrefixSpreads(t *testing.T) {
	for _, tc := range []struct {
		name    string
		scorer  scorer.ExpectedTTFTConfig
		maxHeld int
	}{
		{"default", scorer.ExpectedTTFTConfig{}, 70}, // a fair share is 50
		{"spreading off", scorer.ExpectedTTFTConfig{HotDiscount: -1}, 200},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sc, err := scorer.NewExpectedTTFT(tc.scorer)
			require.NoError(t, err)
			clock := newStepClock()
			ix := newMemIndex(t)
			r := newRouter(t, Config{Backends: backends(4), Now: clock.Now,
				KV: &KVConfig{Index: ix, Scorer: sc}})
			ctx := context.Background()
			hot := promptTokens(9, 4000)
			holder := backends(4)[0].Name
			storeBlocks(t, ix, holder, hot, 250, events.TierGPU)
			byBackend := map[string]int{}
			for i := range 200 {
				d, err := r.Route(ctx, tokReq("hot", hot))
				require.NoError(t, err)
				byBackend[d.Backend]++
				if i < 16 {
					assert.Equal(t, holder, d.Backend, "too few decisions yet for shares: the holder takes request %d", i)
				}
				d.FirstToken()
				d.Done(Outcome{})
				clock.advance(100 * time.Millisecond)
			}
			assert.LessOrEqual(t, byBackend[holder], tc.maxHeld, "%v", byBackend)
			if tc.maxHeld == 200 {
				assert.Equal(t, 200, byBackend[holder], "%v", byBackend)
			} else {
				b := probeOf(t, r, hot, holder)
				assert.Greater(t, b.RecentShare, 1.0)
				assert.Less(t, b.RecentShare, 2.0)
			}
		})
	}
}

// A peer's decision puts its prefill work on the backend: its uncached tokens at their place in
// a prompt as long as its block keys.
func TestKVPeerDecisionWork(t *testing.T) {
	clock := newStepClock()
	r := newRouter(t, Config{Backends: backends(2), Now: clock.Now,
		KV: &KVConfig{Index: newMemIndex(t), Speculation: SpeculateOff}})
	name := backends(2)[1].Name
	keys := make([]uint64, 100)
	for i := range keys {
		keys[i] = uint64(i + 1)
	}
	r.ApplyPeerEvent("replica-b", PeerEvent{Kind: PeerRouted, ID: 1, Backend: name, BlockKeys: keys, CachedBlocks: 60, PrefillTokens: 640})
	probe := promptTokens(3, 64)
	b := probeOf(t, r, probe, name)
	assert.Equal(t, 640, b.PendingPrefillTokens)
	assert.InDelta(t, math.Ceil(scorer.PrefillWork(1600, 960, scorer.DefaultAttentionCost)), b.PendingPrefillWork, 1e-9)
	r.ApplyPeerEvent("replica-b", PeerEvent{Kind: PeerFirstToken, ID: 1, Backend: name})
	b = probeOf(t, r, probe, name)
	assert.Zero(t, b.PendingPrefillTokens)
	assert.Zero(t, b.PendingPrefillWork)
}

// KVConfig.AttentionCost: a negative value counts tokens alone, NaN and values above
// scorer.MaxAttentionCost are refused.
func TestKVAttentionCost(t *testing.T) {
	for _, bad := range []float64{math.NaN(), scorer.MaxAttentionCost * 2, math.Inf(1)} {
		_, err := New(Config{Backends: backends(1), KV: &KVConfig{Index: newMemIndex(t), AttentionCost: bad}})
		assert.ErrorIs(t, err, ErrInvalidConfig, "%v", bad)
	}
	r := newRouter(t, Config{Backends: backends(1), KV: &KVConfig{Index: newMemIndex(t), AttentionCost: -1, Speculation: SpeculateOff}})
	st, err := r.KVStats(context.Background())
	require.NoError(t, err)
	assert.Zero(t, st.Config.AttentionCost)
	toks := promptTokens(4, 50_000)
	d, err := r.Route(context.Background(), tokReq("linear", toks))
	require.NoError(t, err)
	assert.Equal(t, 50_000.0, probeOf(t, r, toks, d.Backend).PendingPrefillWork)
	d.Done(Outcome{})
}
