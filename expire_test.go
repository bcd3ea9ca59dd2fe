package kvroute

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/telemetry"
)

// slotsInFlight returns the slots in flight per backend, from Stats, and their sum.
func slotsInFlight(t testing.TB, r *DefaultRouter) (map[string]int, int) {
	t.Helper()
	out, sum := map[string]int{}, 0
	for _, b := range statsOf(t, r).Backends {
		out[b.Name] = b.InFlight
		sum += b.InFlight
	}
	return out, sum
}

// expiredMetric returns telemetry.MetricDecisionsExpired's value as reader collects it.
func expiredMetric(t *testing.T, reader *sdkmetric.ManualReader) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == telemetry.MetricDecisionsExpired {
				sum := m.Data.(metricdata.Sum[int64])
				require.True(t, sum.IsMonotonic)
				require.Len(t, sum.DataPoints, 1)
				return sum.DataPoints[0].Value
			}
		}
	}
	t.Fatalf("no %s", telemetry.MetricDecisionsExpired)
	return 0
}

// Issue 28: 30 decisions whose Done never came kept 13/4/13 slots in flight for good, and tier 4's
// prefill backlog and active sequences with them. Config.MaxDecisionAge reclaims all of it once
// they are that old, counts them (Stats, the metric), logs each once with its backend and age,
// leaves a younger decision alone, and a late Done changes nothing.
func TestForgottenDecisionsExpire(t *testing.T) {
	clock := newStepClock()
	var logs testenv.LogBuffer
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer func() { _ = mp.Shutdown(context.Background()) }()
	ix := newMemIndex(t)
	sc, active := tracked(t)
	r := newRouter(t, Config{Backends: backends(3), Now: clock.Now, MaxDecisionAge: time.Minute,
		MeterProvider: mp, Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		KV: &KVConfig{Index: ix, Speculation: SpeculationOff, Scorer: sc}})
	ctx := context.Background()
	backlog := func() (sum int64) {
		for _, st := range r.set.Load().list {
			sum += st.backlog.Load()
		}
		return sum
	}
	activeSum := func() (sum int) {
		for _, b := range []string{"vllm-1", "vllm-2", "vllm-3"} {
			pre, dec := active.Load(b)
			sum += pre + dec
		}
		return sum
	}

	var forgotten []*Decision
	for i := range 30 {
		toks := promptTokens(100+i, 8*16)
		if i%3 == 0 {
			storeBlocks(t, ix, fmt.Sprintf("vllm-%d", i%3+1), toks, 6, events.TierGPU)
		}
		d, err := r.Route(ctx, tokReq(fmt.Sprintf("forgotten %d", i), toks))
		require.NoError(t, err)
		forgotten = append(forgotten, d) // and no Done: the caller's bug
		clock.advance(100 * time.Millisecond)
	}
	_, sum := slotsInFlight(t, r)
	require.Equal(t, 30, sum)
	require.Positive(t, backlog())
	require.Positive(t, activeSum())

	// 59 s after the first: nothing has expired; a new decision, with no tokens (tier 1, no
	// backlog), is live.
	clock.advance(59*time.Second - 3*time.Second)
	live, err := r.Route(ctx, chatReq("live", "q"))
	require.NoError(t, err)
	_, sum = slotsInFlight(t, r)
	assert.Equal(t, 31, sum)
	assert.Zero(t, statsOf(t, r).Decisions.Expired)

	// Past a minute for every forgotten one: all 30 are reclaimed, the live one stays.
	clock.advance(4 * time.Second)
	loads, sum := slotsInFlight(t, r)
	assert.Equal(t, 1, sum, "%v", loads)
	assert.Equal(t, 1, loads[live.Backend])
	assert.Zero(t, backlog(), "tier 4's prefill backlog is released")
	assert.Zero(t, activeSum(), "tier 4's active sequences are released")
	st := statsOf(t, r)
	assert.Equal(t, uint64(30), st.Decisions.Expired)
	assert.Equal(t, uint64(31), st.Decisions.Total(), "expired decisions stay counted under their reasons")
	assert.Equal(t, int64(30), expiredMetric(t, reader))
	assert.Equal(t, 30, strings.Count(logs.String(), "level=WARN"), "one line per decision: %s", logs.String())
	assert.Contains(t, logs.String(), "backend=vllm-")
	assert.Contains(t, logs.String(), "age=1m0")
	for _, b := range st.Backends {
		assert.Zero(t, b.Latency, "an expired decision records no latency on %s", b.Name)
		assert.Equal(t, 1.0, b.SuccessRate, b.Name)
	}

	// A late Done (even a failure) on an expired decision does nothing more.
	for _, d := range forgotten {
		d.FirstToken()
		d.Done(Outcome{Err: errors.New("late")})
	}
	loads, sum = slotsInFlight(t, r)
	assert.Equal(t, 1, sum, "%v", loads)
	st = statsOf(t, r)
	for _, b := range st.Backends {
		assert.Equal(t, 1.0, b.SuccessRate, b.Name)
	}
	assert.Equal(t, uint64(30), st.Decisions.Expired)

	// The live decision ends normally, and is never counted as expired.
	live.Done(Outcome{})
	clock.advance(time.Hour)
	_, sum = slotsInFlight(t, r)
	assert.Zero(t, sum)
	assert.Equal(t, uint64(30), statsOf(t, r).Decisions.Expired)
	assert.Equal(t, int64(30), expiredMetric(t, reader))
	assert.Equal(t, 30, strings.Count(logs.String(), "level=WARN"))
}

// The same on the wall clock, with a short age: routing that overflowed because of the forgotten
// decisions recovers to 0 in flight, without any Done.
func TestForgottenDecisionsExpireWallClock(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(3), MaxDecisionAge: 50 * time.Millisecond})
	ctx := context.Background()
	for i := range 30 {
		_, err := r.Route(ctx, chatReq("the same system prompt", fmt.Sprint(i)))
		require.NoError(t, err)
	}
	_, sum := slotsInFlight(t, r)
	require.Equal(t, 30, sum)
	require.Positive(t, statsOf(t, r).Decisions.Overflow, "the leak made routing overflow")
	require.Eventually(t, func() bool {
		_, sum := slotsInFlight(t, r)
		return sum == 0
	}, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, uint64(30), statsOf(t, r).Decisions.Expired)
}

// DisaggRouter's decisions hold slots on the prefill and decode pools: they are reclaimed too, and
// so is the unified path's Route decision.
func TestForgottenDisaggDecisionsExpire(t *testing.T) {
	clock := newStepClock()
	ix := dgIndex(t)
	r := dgRouter(t, ix, disagg.Config{}, func(c *Config) { c.Now, c.MaxDecisionAge = clock.Now, 10*time.Minute })
	ctx := context.Background()
	pd, err := r.Disagg().Route(ctx, dgReq(dgTokens(4, 80*16)))
	require.NoError(t, err)
	require.Equal(t, disagg.PathPrefillThenDecode, pd.Plan.Path)
	for _, b := range []string{"decode-1", "decode-2", "decode-3"} { // to the unified fallback
		require.NoError(t, r.SetHealthy(b, false))
	}
	uni, err := r.Disagg().Route(ctx, dgReq(dgTokens(5, 80*16)))
	require.NoError(t, err)
	require.NotNil(t, uni.Unified, "%+v", uni.Plan)
	for _, b := range []string{"decode-1", "decode-2", "decode-3"} {
		require.NoError(t, r.SetHealthy(b, true))
	}
	half, err := r.Disagg().Route(ctx, dgReq(dgTokens(6, 80*16)))
	require.NoError(t, err)
	require.Equal(t, disagg.PathPrefillThenDecode, half.Plan.Path)
	half.PrefillDone(Outcome{}) // its prefill ended; its decode is forgotten
	loads := dgLoads(r)
	require.Equal(t, 1, loads[pd.Plan.Prefill])
	require.Equal(t, 1, loads[uni.Plan.Decode])

	clock.advance(9 * time.Minute)
	young, err := r.Disagg().Route(ctx, dgReq(dgTokens(7, 80*16)))
	require.NoError(t, err)
	clock.advance(2 * time.Minute)
	assert.Equal(t, uint64(3), statsOf(t, r).Decisions.Expired)
	loads = dgLoads(r)
	total := 0
	for _, n := range loads {
		total += n
	}
	want := 1
	if young.Plan.Prefill != "" {
		want = 2
	}
	assert.Equal(t, want, total, "only the young decision's slots: %v", loads)

	pd.PrefillDone(Outcome{Err: errors.New("late")})
	pd.Done(Outcome{Err: errors.New("late")})
	uni.Done(Outcome{Err: errors.New("late")})
	half.Done(Outcome{Err: errors.New("late")})
	_, err = pd.PrefillFailed(ctx, errors.New("late"))
	assert.Error(t, err, "an expired decision has no prefill phase left")
	young.Done(Outcome{})
	for name, n := range dgLoads(r) {
		assert.Zero(t, n, name)
	}
	for _, b := range statsOf(t, r).Backends {
		assert.Equal(t, 1.0, b.SuccessRate, "late outcomes are not recorded: %s", b.Name)
	}
	assert.Equal(t, uint64(3), statsOf(t, r).Decisions.Expired)
}

// A negative MaxDecisionAge turns the net off; above 24 hours is refused.
func TestMaxDecisionAgeConfig(t *testing.T) {
	clock := newStepClock()
	r := newRouter(t, Config{Backends: backends(2), Now: clock.Now, MaxDecisionAge: -1})
	_, err := r.Route(context.Background(), chatReq("s", "u"))
	require.NoError(t, err)
	clock.advance(48 * time.Hour)
	_, sum := slotsInFlight(t, r)
	assert.Equal(t, 1, sum)
	assert.Zero(t, statsOf(t, r).Decisions.Expired)

	def := newRouter(t, Config{Backends: backends(2), Now: clock.Now})
	_, err = def.Route(context.Background(), chatReq("s", "u"))
	require.NoError(t, err)
	clock.advance(DefaultMaxDecisionAge - time.Second)
	_, sum = slotsInFlight(t, def)
	assert.Equal(t, 1, sum, "the default is 30 minutes")
	clock.advance(2 * time.Second)
	_, sum = slotsInFlight(t, def)
	assert.Zero(t, sum)

	_, err = New(Config{MaxDecisionAge: 25 * time.Hour})
	assert.ErrorIs(t, err, ErrInvalidConfig)
}

// Done, FirstToken and the sweep race on many goroutines: every slot ends released exactly once
// (the ring's counts never go below zero and end at zero).
func TestDecisionExpiryRaces(t *testing.T) {
	ix := newMemIndex(t)
	r := newRouter(t, Config{Backends: backends(4), MaxDecisionAge: time.Millisecond,
		KV: &KVConfig{Index: ix, Speculation: SpeculationOff}})
	var wg sync.WaitGroup
	var routed atomic.Int64
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx := context.Background()
			for i := range 300 {
				d, err := r.Route(ctx, tokReq(fmt.Sprint("s", g, i%7), promptTokens(g*1000+i, 4*16)))
				if err != nil {
					t.Error(err)
					return
				}
				routed.Add(1)
				switch i % 3 {
				case 0: // forgotten
				case 1:
					d.FirstToken()
					d.Done(Outcome{})
				default:
					go d.Done(Outcome{Err: errors.New("x")})
				}
			}
		}()
	}
	wg.Wait()
	require.Eventually(t, func() bool {
		_, sum := slotsInFlight(t, r)
		return sum == 0
	}, 10*time.Second, 5*time.Millisecond)
	for _, st := range r.set.Load().list {
		assert.Zero(t, st.backlog.Load(), st.name)
	}
	st := statsOf(t, r)
	assert.GreaterOrEqual(t, st.Decisions.Expired, uint64(400), "every forgotten decision expires")
	assert.LessOrEqual(t, st.Decisions.Expired, uint64(routed.Load()))
}

// tickClock is a Config.Now that moves forward by step at every call (so that the decisions of a
// test spread over the live queues as on a wall clock), and by advance.
type tickClock struct {
	mu   sync.Mutex
	now  time.Time
	step time.Duration
}

func (c *tickClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(c.step)
	return c.now
}

func (c *tickClock) advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// liveEntries returns how many entries r's live queues hold, how many of those are of decisions
// that have not ended, and the largest capacity of a queue.
func liveEntries(r *DefaultRouter) (entries, live, maxCap int) {
	for i := range r.live.shards {
		s := &r.live.shards[i]
		s.mu.Lock()
		for _, e := range s.ents[s.head:] {
			entries++
			if !e.node.ended.Load() {
				live++
			}
		}
		maxCap = max(maxCap, cap(s.ents))
		s.mu.Unlock()
	}
	return entries, live, maxCap
}

// Done leaves its decision's entry in a live queue for Route to drop later: the queues hold a
// bounded number of entries however many decisions ended, grow while many are live at once,
// shrink back once they have ended, and never drop the entry of a decision still live.
func TestLiveQueuesStayBounded(t *testing.T) {
	clock := &tickClock{now: time.Unix(1_800_000_000, 0), step: 1013 * time.Nanosecond}
	r := newRouter(t, Config{Backends: backends(4), Now: clock.Now, MaxDecisionAge: time.Minute})
	ctx := context.Background()
	req := chatReq("bounded", "u")
	route := func() *Decision {
		d, err := r.Route(ctx, req)
		require.NoError(t, err)
		return d
	}
	for range 20_000 {
		route().Done(Outcome{})
	}
	entries, live, maxCap := liveEntries(r)
	assert.Zero(t, live)
	assert.LessOrEqual(t, entries, liveShards*liveMinCap)
	assert.Equal(t, liveMinCap, maxCap, "one decision live at a time fits the smallest queues")

	held := make([]*Decision, 0, 2000)
	for i := range 20_000 {
		d := route()
		if i%10 == 0 {
			held = append(held, d) // live until below
		} else {
			d.Done(Outcome{})
		}
	}
	entries, live, maxCap = liveEntries(r)
	assert.Equal(t, len(held), live, "every live decision keeps its entry")
	assert.LessOrEqual(t, entries, 4*len(held)+liveShards*liveMinCap)
	assert.Greater(t, maxCap, liveMinCap)

	for _, d := range held {
		d.Done(Outcome{})
	}
	for range 20_000 {
		route().Done(Outcome{})
	}
	entries, live, maxCap = liveEntries(r)
	assert.Zero(t, live)
	assert.LessOrEqual(t, entries, liveShards*liveMinCap)
	assert.Equal(t, liveMinCap, maxCap, "the queues shrink back once the decisions have ended")
	_, sum := slotsInFlight(t, r)
	assert.Zero(t, sum)
	assert.Zero(t, statsOf(t, r).Decisions.Expired)
}

// A forgotten decision stays among the live ones through the many compactions of its queue that
// the decisions routed after it cause, and is reclaimed once it is old enough; those that ended
// are not.
func TestForgottenDecisionSurvivesCompaction(t *testing.T) {
	clock := &tickClock{now: time.Unix(1_800_000_000, 0), step: 1013 * time.Nanosecond}
	r := newRouter(t, Config{Backends: backends(4), Now: clock.Now, MaxDecisionAge: time.Minute})
	ctx := context.Background()
	var forgotten []*Decision
	for i := range 50_000 {
		d, err := r.Route(ctx, chatReq("compaction", fmt.Sprint(i%100)))
		require.NoError(t, err)
		if i%5_000 == 0 {
			forgotten = append(forgotten, d)
			continue
		}
		d.Done(Outcome{})
	}
	_, live, _ := liveEntries(r)
	require.Equal(t, len(forgotten), live)
	_, sum := slotsInFlight(t, r)
	require.Equal(t, len(forgotten), sum)

	clock.advance(time.Minute)
	_, sum = slotsInFlight(t, r)
	assert.Zero(t, sum)
	assert.Equal(t, uint64(len(forgotten)), statsOf(t, r).Decisions.Expired)
	entries, _, _ := liveEntries(r)
	assert.LessOrEqual(t, entries, liveShards*liveMinCap)
}

// Route's one allocation in tier 1 is its Decision: it stays within the 176-byte size class (a
// bigger Decision costs every request a bigger allocation and its zeroing).
func TestDecisionSize(t *testing.T) {
	assert.LessOrEqual(t, unsafe.Sizeof(Decision{}), uintptr(176))
}
