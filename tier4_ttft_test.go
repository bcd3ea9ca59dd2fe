package kvroute

import (
	"context"
	"fmt"
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
		scorer    func() scorer.BackendScorer
		leaves    bool
		wantScore string
	}{
		{"expected_ttft", func() scorer.BackendScorer { return nil }, true, "expected_ttft"},
		{"kv_overlap", func() scorer.BackendScorer {
			c, err := scorer.NewComposite(scorer.CompositeConfig{OverlapWeight: 0.6, LoadWeight: 0.3, HealthWeight: 0.1})
			require.NoError(t, err)
			return c
		}, false, "kv_overlap"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clock := newStepClock()
			ix := newMemIndex(t)
			r := newRouter(t, Config{Backends: backends(2), Now: clock.Now,
				KV: &KVConfig{Index: ix, Speculation: SpeculationOff, Scorer: tc.scorer()}})
			ctx := context.Background()
			st := statsOf(t, r)
			assert.Equal(t, tc.wantScore, st.Scorer)
			assert.Equal(t, scorer.DefaultAttentionCost, st.AttentionCost)

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

// The work queued on a backend shrinks with time at the prefill rate its first tokens showed,
// once three have; the credit never passes the first request's own work, so that work queued
// behind a request that reports no first token (a stalled engine, a response without one) stays
// counted. The tokens queued are not estimated.
func TestKVPendingWorkProgress(t *testing.T) {
	clock := newStepClock()
	r := newRouter(t, Config{Backends: backends(1), Now: clock.Now,
		KV: &KVConfig{Index: newMemIndex(t), Speculation: SpeculationOff}})
	ctx := context.Background()
	name := backends(1)[0].Name
	work := func(n int) float64 { return scorer.PrefillWork(n, 0, scorer.DefaultAttentionCost) }
	route := func(seed, n int) *Decision {
		d, err := r.Route(ctx, tokReq(fmt.Sprint("p", seed), promptTokens(seed, n)))
		require.NoError(t, err)
		return d
	}
	probe := promptTokens(99, 64)

	// Three 10,000-token prefills of a second each: 12,000 token-equivalents per second. No
	// progress is credited before the third.
	for i := range 3 {
		d := route(i, 10_000)
		clock.advance(time.Second)
		if i < 2 {
			assert.InDelta(t, work(10_000), probeOf(t, r, probe, name).PendingPrefillWork, 1, "prefill %d", i)
		}
		d.FirstToken()
		d.Done(Outcome{})
	}
	assert.InDelta(t, work(10_000), r.set.Load().byName[name].prefill.rate.load()*1e9, 1)

	first := route(10, 100_000) // 300,000 token-equivalents
	clock.advance(10 * time.Second)
	b := probeOf(t, r, probe, name)
	assert.InDelta(t, work(100_000)-10*work(10_000), b.PendingPrefillWork, 1)
	assert.Equal(t, 100_000, b.PendingPrefillTokens)
	second := route(11, 100_000)
	clock.advance(time.Minute)
	assert.InDelta(t, work(100_000), probeOf(t, r, probe, name).PendingPrefillWork, 1,
		"the first request is credited whole, the second not at all until the first's first token")
	first.FirstToken() // a slow sample: it lowers the rate
	rate := r.set.Load().byName[name].prefill.rate.load() * 1e9
	assert.Less(t, rate, work(10_000))
	clock.advance(5 * time.Second)
	assert.InDelta(t, work(100_000)-5*rate, probeOf(t, r, probe, name).PendingPrefillWork, 1)
	// A prefill that ends without a first token (an error) teaches no rate but leaves the queue.
	second.Done(Outcome{Err: context.DeadlineExceeded})
	b = probeOf(t, r, probe, name)
	assert.Zero(t, b.PendingPrefillWork)
	assert.Zero(t, b.PendingPrefillTokens)
	first.Done(Outcome{})
}

// Prefills that end together share the busy time that produced them (an engine prefilling a
// batch), and a first token that comes at once (an engine's error) moves the rate by at most
// maxRateStep: neither makes the backend look idle.
func TestKVPrefillRateRobust(t *testing.T) {
	clock := newStepClock()
	r := newRouter(t, Config{Backends: backends(1), Now: clock.Now,
		KV: &KVConfig{Index: newMemIndex(t), Speculation: SpeculationOff}})
	ctx := context.Background()
	q := &r.set.Load().byName[backends(1)[0].Name].prefill
	w := scorer.PrefillWork(10_000, 0, scorer.DefaultAttentionCost)
	batch := make([]*Decision, 8)
	for i := range batch {
		d, err := r.Route(ctx, tokReq(fmt.Sprint("b", i), promptTokens(i, 10_000)))
		require.NoError(t, err)
		batch[i] = d
	}
	clock.advance(4 * time.Second) // eight prefills in four seconds: 2w per second
	for _, d := range batch {
		d.FirstToken()
		clock.advance(time.Millisecond)
		d.Done(Outcome{})
	}
	rate := q.rate.load() * 1e9
	assert.GreaterOrEqual(t, rate, w/2, "a batch's first tokens share its busy time")
	assert.LessOrEqual(t, rate, 2*w, "the batch prefilled 2w per second")

	d, err := r.Route(ctx, tokReq("refused", promptTokens(20, 100_000)))
	require.NoError(t, err)
	clock.advance(2 * time.Millisecond)
	d.FirstToken()
	d.Done(Outcome{})
	assert.LessOrEqual(t, q.rate.load()*1e9, maxRateStep*rate)
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
	// PeerDelay off: the peers' unseen work (TestUnseenPeerWork) would fill the idle backends.
	r := newRouter(t, Config{Backends: backends(2), Now: clock.Now, PeerDelay: -1,
		KV: &KVConfig{Index: newMemIndex(t), Speculation: SpeculationOff}})
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
	r := newRouter(t, Config{Backends: backends(1), KV: &KVConfig{Index: newMemIndex(t), AttentionCost: -1, Speculation: SpeculationOff}})
	assert.Zero(t, statsOf(t, r).AttentionCost)
	toks := promptTokens(4, 50_000)
	d, err := r.Route(context.Background(), tokReq("linear", toks))
	require.NoError(t, err)
	assert.Equal(t, 50_000.0, probeOf(t, r, toks, d.Backend).PendingPrefillWork)
	d.Done(Outcome{})
}

// An ExpectedTTFT given as KVConfig.Scorer measures work as the Router does: KVConfig takes its
// attention cost, or must name the same one.
func TestKVScorerAttentionMustMatch(t *testing.T) {
	sc, err := scorer.NewExpectedTTFT(scorer.ExpectedTTFTConfig{AttentionCost: 4e-5})
	require.NoError(t, err)
	_, err = New(Config{Backends: backends(1), KV: &KVConfig{Index: newMemIndex(t), Scorer: sc, AttentionCost: 2e-5}})
	assert.ErrorIs(t, err, ErrInvalidConfig)
	_, err = New(Config{Backends: backends(1), KV: &KVConfig{Index: newMemIndex(t), Scorer: sc, AttentionCost: -1}})
	assert.ErrorIs(t, err, ErrInvalidConfig, "none against the scorer's 4e-5")
	_, err = New(Config{Backends: backends(1), KV: &KVConfig{Index: newMemIndex(t), Scorer: sc, AttentionCost: 4e-5}})
	assert.NoError(t, err)
	linear, err := scorer.NewExpectedTTFT(scorer.ExpectedTTFTConfig{AttentionCost: -1})
	require.NoError(t, err)
	_, err = New(Config{Backends: backends(1), KV: &KVConfig{Index: newMemIndex(t), Scorer: linear, AttentionCost: -1}})
	assert.NoError(t, err)
}

// A hit waits for its holder while the holder's queue is short, and goes to an idle backend once
// the queue would keep it past the scorer's wait limit: the Router hands the scorer the rate the
// holder's first tokens showed (Probe's prefill_rate), and the limit is in time.
func TestKVWaitLimitSendsHitsPastALongQueue(t *testing.T) {
	clock := newStepClock()
	ix := newMemIndex(t)
	// The hot-prefix spreading off: the holder takes every request here, and its share must not
	// be what sends the hit away.
	sc, err := scorer.NewExpectedTTFT(scorer.ExpectedTTFTConfig{HotDiscount: -1})
	require.NoError(t, err)
	r := newRouter(t, Config{Backends: backends(2), Now: clock.Now, KV: &KVConfig{Index: ix, Speculation: SpeculationOff, Scorer: sc}})
	ctx := context.Background()
	holder := backends(2)[0].Name
	// Teach the holder its rate: 10,000-token prefills of a second each, three of them on it.
	for i, onHolder := 0, 0; onHolder < 3; i++ {
		require.Less(t, i, 20)
		d, err := r.Route(ctx, tokReq(fmt.Sprint("warm", i), promptTokens(30+i, 10_000)))
		require.NoError(t, err)
		clock.advance(time.Second)
		d.FirstToken()
		d.Done(Outcome{})
		if d.Backend == holder {
			onHolder++
		}
	}
	hot := promptTokens(7, 38_000)
	storeBlocks(t, ix, holder, hot, 2375, events.TierGPU)
	rate := probeOf(t, r, hot, holder).PrefillRate
	require.Greater(t, rate, 0.0, "the holder's rate is known")

	// Queue cold prompts on the holder until its queue is well past the wait limit (under
	// CacheWeight's trade alone the hit would wait for up to seven times the 66,880 it saves,
	// 468,160); until the limit the hot prompt goes to its holder.
	var queued []*Decision
	defer func() {
		for _, d := range queued {
			d.Done(Outcome{})
		}
	}()
	limit := scorer.DefaultWaitLimit.Seconds() * rate
	for i := 0; probeOf(t, r, hot, holder).PendingPrefillWork <= limit*2.5; i++ {
		require.Less(t, i, 100)
		b := probeOf(t, r, hot, holder)
		d, err := r.Route(ctx, tokReq("hot", hot))
		require.NoError(t, err)
		d.Done(Outcome{NotSent: true})
		if b.PendingPrefillWork < limit {
			assert.Equal(t, holder, d.Backend, "a queue of %.0f work (limit %.0f) is worth waiting for", b.PendingPrefillWork, limit)
		}
		// A cold prompt, kept on the holder by a retry's avoidance of the other backend.
		dc, err := r.Route(WithAvoid(ctx, backends(2)[1].Name), tokReq(fmt.Sprint("cold", i), promptTokens(100+i, 20_000)))
		require.NoError(t, err)
		require.Equal(t, holder, dc.Backend)
		queued = append(queued, dc)
	}
	d, err := r.Route(ctx, tokReq("hot", hot))
	require.NoError(t, err)
	defer d.Done(Outcome{})
	assert.NotEqual(t, holder, d.Backend, "%.0f work queued, far past the wait limit: the idle backend answers sooner",
		probeOf(t, r, hot, holder).PendingPrefillWork)
}
