package zmqevents

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/events/internal/eventstest"
	"github.com/kvroute/kvroute/telemetry"
)

// A bound address without a host binds loopback; every interface takes "*" or 0.0.0.0, and is
// logged at Warn with the trust model.
func TestZMQBindDefaultsToLoopback(t *testing.T) {
	for _, tc := range []struct {
		bind     string
		loopback bool
	}{
		{"tcp://:0", true},
		{"tcp://127.0.0.1:0", true},
		{"tcp://*:0", false},
		{"tcp://0.0.0.0:0", false},
	} {
		t.Run(tc.bind, func(t *testing.T) {
			logs := &eventstest.LockedBuffer{}
			c := startZMQ(t, Config{Sink: eventstest.NewRecordingSink(), Bind: tc.bind, DefaultBackend: "a",
				Logger: slog.New(slog.NewTextHandler(logs, nil))})
			ip := c.Addr().(*net.TCPAddr).IP
			warned := logs.Count("bound on every interface")
			if tc.loopback {
				assert.True(t, ip.IsLoopback(), "bound %v", ip)
				assert.Zero(t, warned)
			} else {
				assert.True(t, ip.IsUnspecified(), "bound %v", ip)
				assert.Equal(t, 1, warned, "the trust model is logged once")
			}
			ls, _ := c.Listener()
			assert.Equal(t, tc.bind, ls.Endpoint)
			assert.Equal(t, "tcp://"+c.Addr().String(), ls.Bound)
		})
	}
}

// The attack of issue 28: 2,000 frames with random sequence numbers sent to a bound address
// reset the backend at every frame. The backend's reset budget lets MaxResetsPerMinute of them
// through; the rest are counted as limited, on the source and in the metrics. The budget refills
// with time.
func TestZMQResetBudget(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	var clock atomic.Int64
	clock.Store(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	now := func() time.Time { return time.Unix(0, clock.Load()) }
	sink := eventstest.NewRecordingSink()
	c := startZMQ(t, Config{Sink: sink, Bind: "tcp://127.0.0.1:0", DefaultBackend: "a", Now: now, MeterProvider: mp})
	pub := NewFakePublisher(t, FakePublisherConfig{Topic: "x", Connect: "tcp://" + c.Addr().String()})
	pub.WaitSubscribed()
	const frames = 2000
	rng := rand.New(rand.NewPCG(28, 2000))
	payload := EncodeFakeBatch(nil, stored(1))
	for range frames {
		pub.SendFrames([]byte("x"), seqFrame(rng.Uint64()>>1), payload)
	}
	drained := func(want uint64) func() bool {
		return func() bool {
			st, ok := eventstest.FindStatus(c, "a") // none until the first frame is processed
			return ok && st.Sequence.Batches == want && st.Events.Processed+st.Events.Dropped == st.Events.Received
		}
	}
	require.Eventually(t, drained(frames), 4*waitFor, tick)
	st := eventstest.StatusOf(t, c, "a")
	assert.Equal(t, uint64(DefaultMaxResetsPerMinute), st.Sequence.Resets, "resets beyond the budget")
	assert.Equal(t, DefaultMaxResetsPerMinute, sink.Clears("a"))
	// Every frame but the first breaks the sequence. Frames that overflowed the backend's queue
	// (a fast run outpaces the worker) are lost as one gap per chain instead of one reset each:
	// they count among the frames that were not reset.
	assert.GreaterOrEqual(t, st.Sequence.ResetsLimited+st.Sequence.QueueOverflows, uint64(frames-1-DefaultMaxResetsPerMinute),
		"resets limited %d, queue overflows %d", st.Sequence.ResetsLimited, st.Sequence.QueueOverflows)
	got := eventstest.CollectInt64(t, reader)
	assert.Equal(t, int64(st.Sequence.ResetsLimited), got[telemetry.MetricConsumerResetsLimited+",backend=a"])
	assert.Equal(t, int64(DefaultMaxResetsPerMinute), got[telemetry.MetricConsumerResets+",backend=a"])

	// A minute later the budget is full again.
	clock.Add(int64(time.Minute))
	pub.SendFrames([]byte("x"), seqFrame(0), payload) // went back: a reset
	require.Eventually(t, drained(frames+1), waitFor, tick)
	assert.Equal(t, uint64(DefaultMaxResetsPerMinute+1), eventstest.StatusOf(t, c, "a").Sequence.Resets)
}

// A negative budget lets every reset through: the attack above resets at every frame.
func TestZMQResetBudgetDisabled(t *testing.T) {
	sink := eventstest.NewRecordingSink()
	c := startZMQ(t, Config{Sink: sink, Bind: "tcp://127.0.0.1:0", DefaultBackend: "a", MaxResetsPerMinute: -1})
	pub := NewFakePublisher(t, FakePublisherConfig{Topic: "x", Connect: "tcp://" + c.Addr().String()})
	pub.WaitSubscribed()
	payload := EncodeFakeBatch(nil, stored(1))
	for i := range 50 {
		pub.SendFrames([]byte("x"), seqFrame(uint64(100-2*i)), payload) // every one goes back
	}
	require.Eventually(t, func() bool { return len(c.Status()) == 1 && c.Status()[0].Sequence.Batches == 50 }, waitFor, tick, "%+v %+v", c.Status(), c.Listeners())
	require.Eventually(t, func() bool { return sink.Clears("a") == 49 }, waitFor, tick)
	assert.Zero(t, eventstest.StatusOf(t, c, "a").Sequence.ResetsLimited)
}

// The reproduction of issue 28: an engine whose topic (kv@10.0.0.7:8000@m) names no backend the
// bound address accepts. Its messages are unplaced: counted on the listener, by status and
// metric, with the malformed ones apart and the placed ones.
func TestZMQBindListenerMessages(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	sink := eventstest.NewRecordingSink()
	c := startZMQ(t, Config{Sink: sink, Bind: "tcp://127.0.0.1:0", Backends: []string{"a"}, MeterProvider: mp})
	addr := "tcp://" + c.Addr().String()
	stray := NewFakePublisher(t, FakePublisherConfig{Topic: "kv@10.0.0.7:8000@m", Connect: addr})
	known := NewFakePublisher(t, FakePublisherConfig{Topic: "kv@a@m", Connect: addr})
	stray.WaitSubscribed()
	known.WaitSubscribed()
	for i := range 3 {
		stray.Publish(stored(uint64(i)))
	}
	stray.SendFrames([]byte("kv@10.0.0.7:8000@m"), []byte{1, 2}, nil) // a seq of 2 bytes
	known.Publish(stored(9))
	want := events.ListenerMessages{Received: 5, Placed: 1, Unplaced: 3, Malformed: 1}
	require.Eventually(t, func() bool { ls, _ := c.Listener(); return ls.Messages == want }, waitFor, tick)
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 1 }, waitFor, tick)
	assert.Empty(t, sink.Applied("10.0.0.7:8000"))
	ls := c.Listeners()
	require.Len(t, ls, 1)
	assert.Equal(t, "zmq", ls[0].Transport)
	assert.NotEmpty(t, ls[0].LastError)

	got := eventstest.CollectInt64(t, reader)
	for outcome, n := range map[string]int64{"placed": 1, "unplaced": 3, "malformed": 1} {
		key := telemetry.MetricConsumerListenerMessages + ",endpoint=tcp://127.0.0.1:0,outcome=" + outcome
		assert.Equal(t, n, got[key], key)
	}
	// The backend's own source counts the placed message's event only.
	assert.Equal(t, uint64(1), eventstest.StatusOf(t, c, "a").Events.Received)
}
