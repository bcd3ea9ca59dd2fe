package zmqevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/events/internal/eventstest"
	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/telemetry"
)

const (
	waitFor = 10 * time.Second
	tick    = 5 * time.Millisecond
)

// startZMQ creates and starts a consumer with test-friendly timings; Close runs at cleanup.
func startZMQ(t *testing.T, cfg Config) *Consumer {
	t.Helper()
	if cfg.InitialBackoff == 0 {
		cfg.InitialBackoff = 10 * time.Millisecond
	}
	if cfg.MaxBackoff == 0 {
		cfg.MaxBackoff = 100 * time.Millisecond
	}
	if cfg.DialTimeout == 0 {
		cfg.DialTimeout = 2 * time.Second
	}
	c, err := New(cfg)
	require.NoError(t, err)
	require.NoError(t, c.Start(context.Background()))
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	return c
}

func stored(hash uint64) []any {
	return StoredEvent([]uint64{hash}, -1, make([]uint32, 16), 16, "GPU")
}

func TestParseTopic(t *testing.T) {
	for _, tc := range []struct {
		topic, pod, model string
		ok                bool
	}{
		{"kv@pod-a@meta-llama/Llama-3.1-8B", "pod-a", "meta-llama/Llama-3.1-8B", true},
		{"kv@pod-a", "pod-a", "", true},
		{"kv@pod-a@", "pod-a", "", true},
		{"kv@pod-a@org/model@rev", "pod-a", "org/model@rev", true},
		{"kv@@model", "", "", false},
		{"", "", "", false},
		{"kv", "", "", false},
		{"kv-events", "", "", false},
		{"KV@pod@m", "", "", false},
	} {
		t.Run(tc.topic, func(t *testing.T) {
			pod, model, ok := ParseTopic(tc.topic)
			assert.Equal(t, tc.ok, ok)
			assert.Equal(t, tc.pod, pod)
			assert.Equal(t, tc.model, model)
		})
	}
}

func TestNewConfig(t *testing.T) {
	sink := eventstest.NewRecordingSink()
	ep := []Endpoint{{Backend: "a", Endpoint: "tcp://127.0.0.1:5557"}}
	for _, tc := range []struct {
		name string
		cfg  Config
		ok   bool
	}{
		{"connect", Config{Sink: sink, Endpoints: ep}, true},
		{"connect ipc", Config{Sink: sink, Endpoints: []Endpoint{{Backend: "a", Endpoint: "ipc:///tmp/kv.sock"}}}, true},
		{"connect with replay", Config{Sink: sink, Endpoints: []Endpoint{{Backend: "a", Endpoint: "tcp://h:1", ReplayEndpoint: "tcp://h:2"}}}, true},
		{"dp ranks share a backend", Config{Sink: sink, Endpoints: []Endpoint{{Backend: "a", Endpoint: "tcp://h:5557"}, {Backend: "a", Endpoint: "tcp://h:5558"}}}, true},
		{"bind", Config{Sink: sink, Bind: "tcp://*:5557", TopicBackend: map[string]string{"": "a"}}, true},
		{"bind free port", Config{Sink: sink, Bind: "tcp://127.0.0.1:0"}, true},
		{"no sink", Config{Endpoints: ep}, false},
		{"neither mode", Config{Sink: sink}, false},
		{"both modes", Config{Sink: sink, Endpoints: ep, Bind: "tcp://*:5557"}, false},
		{"no backend", Config{Sink: sink, Endpoints: []Endpoint{{Endpoint: "tcp://h:1"}}}, false},
		{"connect to star", Config{Sink: sink, Endpoints: []Endpoint{{Backend: "a", Endpoint: "tcp://*:5557"}}}, false},
		{"no port", Config{Sink: sink, Endpoints: []Endpoint{{Backend: "a", Endpoint: "tcp://h"}}}, false},
		{"port 0", Config{Sink: sink, Endpoints: []Endpoint{{Backend: "a", Endpoint: "tcp://h:0"}}}, false},
		{"bad scheme", Config{Sink: sink, Endpoints: []Endpoint{{Backend: "a", Endpoint: "http://h:1"}}}, false},
		{"bad replay", Config{Sink: sink, Endpoints: []Endpoint{{Backend: "a", Endpoint: "tcp://h:1", ReplayEndpoint: "h:2"}}}, false},
		{"duplicate", Config{Sink: sink, Endpoints: append(ep, ep...)}, false},
		{"bind options in connect mode", Config{Sink: sink, Endpoints: ep, DefaultBackend: "a"}, false},
		{"empty topic backend", Config{Sink: sink, Bind: "tcp://*:1", TopicBackend: map[string]string{"t": ""}}, false},
		{"negative queue", Config{Sink: sink, Endpoints: ep, QueueSize: -1}, false},
		{"catch-up disabled", Config{Sink: sink, Endpoints: ep, CatchUpBatches: -1}, true},
		{"negative catch-up timeout", Config{Sink: sink, Endpoints: ep, CatchUpTimeout: -time.Second}, false},
		{"backoff inverted", Config{Sink: sink, Endpoints: ep, InitialBackoff: time.Second, MaxBackoff: time.Millisecond}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := New(tc.cfg)
			if !tc.ok {
				require.ErrorIs(t, err, events.ErrInvalidConfig)
				return
			}
			require.NoError(t, err)
			require.NoError(t, c.Close())
		})
	}
}

func TestZMQConnectMode(t *testing.T) {
	for _, tc := range []struct {
		name      string
		topic     string
		subscribe string
		model     string // Endpoint.Model
		firstSeq  uint64
		wantModel string
	}{
		{"default topic from 0", "", "", "", 0, ""},
		{"llm-d topic names the model", "kv@pod-a@meta-llama/Llama-3.1-8B", "kv@", "", 0, "meta-llama/Llama-3.1-8B"},
		{"configured model wins", "kv@pod-a@m", "", "configured", 1, "configured"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pub := NewFakePublisher(t, FakePublisherConfig{Topic: tc.topic, FirstSeq: tc.firstSeq})
			sink := eventstest.NewRecordingSink()
			c := startZMQ(t, Config{Sink: sink, Topic: tc.subscribe,
				Endpoints: []Endpoint{{Backend: "vllm-0", Endpoint: pub.Endpoint, Model: tc.model}}})
			pub.WaitSubscribed()
			for i := range 5 {
				pub.Publish(stored(uint64(100+i)), RemovedEvent([]uint64{uint64(100 + i)}, "cpu"))
			}
			require.Eventually(t, func() bool { return len(sink.Applied("vllm-0")) == 5 }, waitFor, tick)
			for i, b := range sink.Applied("vllm-0") {
				assert.Equal(t, tc.firstSeq+uint64(i), b.Seq)
				assert.Equal(t, tc.wantModel, b.Model)
				assert.Equal(t, []events.Kind{events.KindBlockStored, events.KindBlockRemoved}, b.Kinds)
				assert.Equal(t, [][]uint64{{uint64(100 + i)}, {uint64(100 + i)}}, b.Hashes)
			}
			assert.Zero(t, sink.Clears("vllm-0"))
			st := eventstest.StatusOf(t, c, "vllm-0")
			assert.True(t, st.Connection.Connected)
			assert.Equal(t, events.StateConnected, st.Connection.State)
			assert.Equal(t, events.Stats{Received: 10, Processed: 10}, st.Events)
			assert.Equal(t, uint64(5), st.Sequence.Batches)
			assert.Equal(t, tc.firstSeq+4, st.Sequence.LastSeq)
			assert.Zero(t, st.Sequence.Gaps)
			assert.False(t, st.Connection.LastEventAt.IsZero())
			assert.Equal(t, "zmq", st.Transport)
			assert.Equal(t, pub.Endpoint, st.Endpoint)
		})
	}
}

func TestZMQTopicFilter(t *testing.T) {
	pub := NewFakePublisher(t, FakePublisherConfig{Topic: "kv@pod-a@m"})
	sink := eventstest.NewRecordingSink()
	c := startZMQ(t, Config{Sink: sink, Topic: "kv@pod-a",
		Endpoints: []Endpoint{{Backend: "a", Endpoint: pub.Endpoint}}})
	pub.WaitSubscribed()
	// A message on another topic never reaches the sink (the PUB filters, and so do we).
	pub.SendFrames([]byte("other"), seqFrame(7), EncodeFakeBatch(nil, stored(1)))
	pub.Publish(stored(2))
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 1 }, waitFor, tick)
	assert.Equal(t, [][]uint64{{2}}, sink.Applied("a")[0].Hashes)
	assert.Zero(t, eventstest.StatusOf(t, c, "a").Events.Malformed)
}

func TestZMQBindMode(t *testing.T) {
	sink := eventstest.NewRecordingSink()
	c := startZMQ(t, Config{Sink: sink, Bind: "tcp://127.0.0.1:0", Model: "default-model",
		TopicBackend: map[string]string{"engine-c": "vllm-c"}})
	addr := "tcp://" + c.Addr().String()
	pubs := map[string]*FakePublisher{}
	for _, topic := range []string{"kv@pod-a@llama", "kv@pod-b", "engine-c", "unknown"} {
		pubs[topic] = NewFakePublisher(t, FakePublisherConfig{Topic: topic, Connect: addr})
		pubs[topic].WaitSubscribed()
	}
	for i := range 3 {
		for _, p := range pubs {
			p.Publish(stored(uint64(i)))
		}
	}
	for _, tc := range []struct{ backend, model string }{
		{"pod-a", "llama"},
		{"pod-b", "default-model"},
		{"vllm-c", "default-model"},
	} {
		t.Run(tc.backend, func(t *testing.T) {
			require.Eventually(t, func() bool { return len(sink.Applied(tc.backend)) == 3 }, waitFor, tick)
			for i, b := range sink.Applied(tc.backend) {
				assert.Equal(t, uint64(i), b.Seq)
				assert.Equal(t, tc.model, b.Model)
			}
			st := eventstest.StatusOf(t, c, tc.backend)
			assert.True(t, st.Connection.Connected)
			assert.Equal(t, uint64(3), st.Events.Processed)
			assert.Equal(t, addr, st.Endpoint)
		})
	}
	// "unknown" maps to no backend: counted on the listener, never applied.
	require.Eventually(t, func() bool {
		ls, ok := c.Listener()
		return ok && ls.Messages.Unplaced == 3 && ls.Messages.Received == 3+9
	}, waitFor, tick)
	ls, _ := c.Listener()
	assert.True(t, ls.Connection.Connected)
	assert.Contains(t, ls.LastError, "maps to no backend")
	assert.Len(t, c.Status(), 3)

	// A publisher that goes away marks its backend disconnected; when it comes back the
	// reconnection is counted.
	pubs["kv@pod-b"].Stop()
	require.Eventually(t, func() bool { return !eventstest.StatusOf(t, c, "pod-b").Connection.Connected }, waitFor, tick)
	assert.Equal(t, events.StateDisconnected, eventstest.StatusOf(t, c, "pod-b").Connection.State)
	pubs["kv@pod-b"].Restart()
	pubs["kv@pod-b"].WaitSubscribed()
	pubs["kv@pod-b"].Publish(stored(9))
	require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "pod-b").Connection.Connected }, waitFor, tick)
	assert.Equal(t, uint64(1), eventstest.StatusOf(t, c, "pod-b").Connection.ReconnectCount)
	// Its sequence went back to 0: the backend was reset.
	require.Eventually(t, func() bool { return sink.Clears("pod-b") == 1 }, waitFor, tick)
}

func TestZMQBindModeDPRanks(t *testing.T) {
	// Two data-parallel ranks of one engine connect with the same topic and independent
	// sequences; old engines do not name the rank in the batch, and then only the connection
	// tells them apart.
	r0, r1 := 0, 1
	for _, tc := range []struct {
		name   string
		r0, r1 *int
	}{
		{"ranks named", &r0, &r1},
		{"ranks not named", nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sink := eventstest.NewRecordingSink()
			c := startZMQ(t, Config{Sink: sink, Bind: "tcp://127.0.0.1:0", DefaultBackend: "solo"})
			addr := "tcp://" + c.Addr().String()
			p0 := NewFakePublisher(t, FakePublisherConfig{Connect: addr, Rank: tc.r0})
			p1 := NewFakePublisher(t, FakePublisherConfig{Connect: addr, Rank: tc.r1, FirstSeq: 100})
			p0.WaitSubscribed()
			p1.WaitSubscribed()
			for i := range 4 {
				p0.Publish(stored(uint64(i)))
				p1.Publish(stored(uint64(1000 + i)))
			}
			require.Eventually(t, func() bool { return len(sink.Applied("solo")) == 8 }, waitFor, tick)
			assert.Zero(t, sink.Clears("solo"), "interleaved ranks are neither gaps nor restarts")
			assert.Zero(t, eventstest.StatusOf(t, c, "solo").Sequence.Gaps)

			// Rank 1 goes away: the backend is cleared; rank 0 keeps its sequence.
			p1.Stop()
			require.Eventually(t, func() bool { return sink.Clears("solo") == 1 }, waitFor, tick)
			assert.True(t, eventstest.StatusOf(t, c, "solo").Connection.Connected, "rank 0 is still connected")
			p0.Publish(stored(4))
			require.Eventually(t, func() bool { return len(sink.Applied("solo")) == 9 }, waitFor, tick)
			assert.Equal(t, 1, sink.Clears("solo"))
		})
	}
}

func TestZMQGapReplay(t *testing.T) {
	pub := NewFakePublisher(t, FakePublisherConfig{Topic: "kv@p@m", Replay: true})
	sink := eventstest.NewRecordingSink()
	c := startZMQ(t, Config{Sink: sink,
		Endpoints: []Endpoint{{Backend: "a", Endpoint: pub.Endpoint, ReplayEndpoint: pub.ReplayEndpoint}}})
	pub.WaitSubscribed()
	pub.Publish(stored(0))
	pub.Lose(stored(1))
	pub.Lose(stored(2), stored(22))
	pub.Publish(stored(3))
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 4 }, waitFor, tick)
	assert.Equal(t, []int64{0, 1, 2, 3}, sink.Seqs("a"), "the hole is filled in order, without a reset")
	assert.Equal(t, [][]uint64{{2}, {22}}, sink.Applied("a")[2].Hashes)
	for _, b := range sink.Applied("a") {
		assert.Equal(t, "m", b.Model)
	}
	st := eventstest.StatusOf(t, c, "a")
	assert.Equal(t, uint64(1), st.Sequence.Gaps)
	assert.Equal(t, uint64(1), st.Sequence.Replays)
	assert.Zero(t, st.Sequence.Resets)
	assert.Equal(t, uint64(5), st.Events.Processed)
	assert.Equal(t, 1, pub.Replays())
}

func TestZMQGapReset(t *testing.T) {
	for _, tc := range []struct {
		name   string
		replay bool
		keep   int
		fail   bool // replay endpoint configured but nothing listens
	}{
		{name: "no replay endpoint"},
		{name: "publisher no longer holds the batches", replay: true, keep: 1},
		{name: "replay endpoint down", fail: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pub := NewFakePublisher(t, FakePublisherConfig{Replay: tc.replay, ReplayKeep: tc.keep})
			ep := Endpoint{Backend: "a", Endpoint: pub.Endpoint, ReplayEndpoint: pub.ReplayEndpoint}
			if tc.fail {
				ep.ReplayEndpoint = fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
			}
			sink := eventstest.NewRecordingSink()
			c := startZMQ(t, Config{Sink: sink, Endpoints: []Endpoint{ep}, ReplayTimeout: time.Second})
			pub.WaitSubscribed()
			pub.Publish(stored(0))
			pub.Lose(stored(1))
			pub.Lose(stored(2))
			pub.Publish(stored(3))
			require.Eventually(t, func() bool { return len(sink.Applied("a")) >= 2 }, waitFor, tick)
			// The backend is cleared before batch 3 is applied; nothing of 1 or 2 is applied.
			assert.Equal(t, []int64{0, -1, 3}, sink.Seqs("a"))
			st := eventstest.StatusOf(t, c, "a")
			assert.Equal(t, uint64(1), st.Sequence.Gaps)
			assert.Equal(t, uint64(1), st.Sequence.Resets)
			assert.Zero(t, st.Sequence.Replays)
			if tc.replay || tc.fail {
				assert.Equal(t, uint64(1), st.Sequence.ReplayFailures)
				assert.Contains(t, st.LastError, "replay")
			}
			// The chain is re-baselined: the next batch is in order.
			pub.Publish(stored(4))
			require.Eventually(t, func() bool { return len(sink.Applied("a")) == 3 }, waitFor, tick)
			assert.Equal(t, 1, sink.Clears("a"))
		})
	}
}

func TestZMQPublisherRestart(t *testing.T) {
	pub := NewFakePublisher(t, FakePublisherConfig{Topic: "kv@p@m", Replay: true})
	sink := eventstest.NewRecordingSink()
	c := startZMQ(t, Config{Sink: sink,
		Endpoints: []Endpoint{{Backend: "a", Endpoint: pub.Endpoint, ReplayEndpoint: pub.ReplayEndpoint}}})
	pub.WaitSubscribed()
	for i := range 3 {
		pub.Publish(stored(uint64(i)))
	}
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 3 }, waitFor, tick)

	// The engine restarts on the same ports; its sequence starts over at 0.
	pub.Restart()
	require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Connection.ReconnectCount >= 1 }, waitFor, tick)
	pub.WaitSubscribed() // the consumer reconnected on its own
	pub.Publish(stored(100))
	require.Eventually(t, func() bool { return sink.Clears("a") == 1 }, waitFor, tick)
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 4 }, waitFor, tick)
	assert.Equal(t, []int64{0, 1, 2, -1, 0}, sink.Seqs("a"))
	st := eventstest.StatusOf(t, c, "a")
	assert.True(t, st.Connection.Connected)
	assert.Equal(t, uint64(1), st.Sequence.Resets)
	assert.Zero(t, pub.Replays(), "a restart is not replayed")
}

func TestZMQReconnectResets(t *testing.T) {
	// An engine that comes back lost what it published while we were away, and a restarted one
	// lost its cache: the backend is cleared when the connection is lost, whatever the sequence
	// says next. The first batch on the new connection starts a new chain (no gap): with
	// catch-up, what the engine published since it came back is requested from its replay
	// buffer first; without, the chain simply starts there.
	for _, tc := range []struct {
		name string
		lose int // batches published (and lost) before the first one we see
		seq  uint64
	}{
		{"sequence ahead", 2, 2},
		{"sequence continues ours by chance", 0, 0},
	} {
		for _, catchUp := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/catch-up=%v", tc.name, catchUp), func(t *testing.T) {
				pub := NewFakePublisher(t, FakePublisherConfig{Replay: true})
				sink := eventstest.NewRecordingSink()
				cfg := Config{Sink: sink,
					Endpoints: []Endpoint{{Backend: "a", Endpoint: pub.Endpoint, ReplayEndpoint: pub.ReplayEndpoint}}}
				if !catchUp {
					cfg.CatchUpBatches = -1
				}
				c := startZMQ(t, cfg)
				pub.WaitSubscribed()
				pub.Publish(stored(0))
				require.Eventually(t, func() bool { return len(sink.Applied("a")) == 1 }, waitFor, tick)
				pub.Restart()
				require.Eventually(t, func() bool { return sink.Clears("a") == 1 }, waitFor, tick, "cleared when the connection is lost")
				pub.WaitSubscribed()
				for range tc.lose {
					pub.Lose(stored(9))
				}
				if tc.seq == 0 {
					pub.ResetSeq(1) // the new life continues the old sequence: 1 = last+1
				}
				live := pub.Publish(stored(3))
				want := []int64{0, -1, int64(live)}
				if catchUp {
					want = []int64{0, -1}
					for s := range tc.lose {
						want = append(want, int64(s))
					}
					want = append(want, int64(live))
				}
				require.Eventually(t, func() bool { return len(sink.Seqs("a")) == len(want) }, waitFor, tick)
				assert.Equal(t, want, sink.Seqs("a"))
				assert.Equal(t, btoi(catchUp), pub.Replays(), "one catch-up request, no gap replay")
				st := eventstest.StatusOf(t, c, "a")
				assert.Zero(t, st.Sequence.Gaps)
				assert.Equal(t, uint64(1), st.Sequence.Resets)
				assert.Equal(t, uint64(btoi(catchUp)), st.Sequence.CatchUps)
				assert.Equal(t, uint64(btoi(catchUp)*tc.lose), st.Sequence.CaughtUpBatches)
			})
		}
	}
}

// publishHistory publishes n batches, storing hashes 100, 101, …, that no subscriber receives
// (as those a PUB drops before any subscription reaches it) and the replay responder keeps; it
// returns their sequence numbers. (Publishing them before the consumer starts would not do: the
// zmq4 PUB may still deliver what it queued before the subscription arrived.)
func publishHistory(pub *FakePublisher, n int) []int64 {
	var seqs []int64
	for i := range n {
		seqs = append(seqs, int64(pub.Lose(stored(uint64(100+i)))))
	}
	return seqs
}

func TestZMQCatchUp(t *testing.T) {
	// A router that subscribes to an engine that has been publishing for a while (a router
	// restart, a new engine, the PUB's slow-joiner loss) learns from the engine's replay buffer
	// what it cached before: the batches before the first live one are applied first, in order,
	// each once.
	for _, tc := range []struct {
		name     string
		history  int    // batches published before the subscription
		first    uint64 // the publisher's first sequence number
		keep     int    // FakePublisherConfig.ReplayKeep (0: 10,000)
		batches  int    // Config.CatchUpBatches (0: the default)
		wantFrom int    // index in the history of the first batch caught up
	}{
		{name: "whole history", history: 30},
		{name: "from seq 1", history: 30, first: 1},
		{name: "window shorter than the history", history: 30, batches: 8, wantFrom: 22},
		// The buffer holds 26..30 (30 is the live batch): the replay starts later than asked.
		{name: "replay buffer shorter than the window", history: 30, keep: 5, wantFrom: 26},
		{name: "nothing before the first batch", history: 0, first: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pub := NewFakePublisher(t, FakePublisherConfig{Topic: "kv@p@m", Replay: true, ReplayKeep: tc.keep, FirstSeq: tc.first})
			history := publishHistory(pub, tc.history)
			sink := eventstest.NewRecordingSink()
			c := startZMQ(t, Config{Sink: sink, CatchUpBatches: tc.batches,
				Endpoints: []Endpoint{{Backend: "a", Endpoint: pub.Endpoint, ReplayEndpoint: pub.ReplayEndpoint}}})
			pub.WaitSubscribed()
			live := pub.Publish(stored(1))
			want := append(history[tc.wantFrom:], int64(live))
			require.Eventually(t, func() bool { return len(sink.Seqs("a")) >= len(want) }, waitFor, tick)
			assert.Equal(t, want, sink.Seqs("a"), "caught up in order, each batch once, then the live batch")
			for i, b := range sink.Applied("a")[:len(want)-1] {
				assert.Equal(t, [][]uint64{{uint64(100 + tc.wantFrom + i)}}, b.Hashes)
				assert.Equal(t, "m", b.Model)
			}
			st := eventstest.StatusOf(t, c, "a")
			assert.Equal(t, uint64(1), st.Sequence.CatchUps)
			assert.Equal(t, uint64(len(want)-1), st.Sequence.CaughtUpBatches)
			assert.Zero(t, st.Sequence.CatchUpFailures)
			assert.Zero(t, st.Sequence.Gaps)
			assert.Zero(t, st.Sequence.Replays, "a catch-up is not a gap replay")
			assert.Zero(t, sink.Clears("a"))
			assert.Equal(t, events.Stats{Received: uint64(len(want)), Processed: uint64(len(want))}, st.Events)

			// The chain goes on from the live batch: no second request.
			next := pub.Publish(stored(2))
			require.Eventually(t, func() bool { return len(sink.Seqs("a")) == len(want)+1 }, waitFor, tick)
			assert.Equal(t, int64(next), sink.Seqs("a")[len(want)])
			assert.Equal(t, 1, pub.Replays())
			assert.Equal(t, uint64(1), eventstest.StatusOf(t, c, "a").Sequence.CatchUps)
		})
	}
}

func TestZMQCatchUpFails(t *testing.T) {
	// A catch-up that breaks after applying some batches may have applied stores whose later
	// removals it never saw: the backend is reset and the live batch is the baseline. One that
	// applied nothing leaves nothing stale: the live batch is the baseline, without a reset.
	const history = 20
	for _, tc := range []struct {
		name    string
		fault   string
		at      uint64
		down    bool // nothing listens on the replay endpoint
		applied int  // batches caught up before the failure
		err     string
	}{
		{name: "hole", fault: "hole", at: 10, applied: 10, err: "no longer holds batch 10"},
		{name: "malformed batch", fault: "corrupt", at: 10, applied: 10, err: "replayed batch 10"},
		{name: "answer ends early", fault: "end", at: 10, applied: 10, err: "no longer holds batch 10"},
		{name: "replay socket closes", fault: "close", at: 10, applied: 10, err: "catch-up"},
		{name: "replay stalls", fault: "stall", at: 10, applied: 10, err: "no answer in"},
		{name: "first batch malformed", fault: "corrupt", at: 0, err: "replayed batch 0"},
		{name: "replay endpoint down", down: true, err: "catch-up 0..19"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pub := NewFakePublisher(t, FakePublisherConfig{Replay: true, ReplayFault: tc.fault, ReplayFaultAt: tc.at})
			seqs := publishHistory(pub, history)
			ep := Endpoint{Backend: "a", Endpoint: pub.Endpoint, ReplayEndpoint: pub.ReplayEndpoint}
			if tc.down {
				ep.ReplayEndpoint = fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
			}
			sink := eventstest.NewRecordingSink()
			c := startZMQ(t, Config{Sink: sink, Endpoints: []Endpoint{ep}, CatchUpTimeout: 300 * time.Millisecond})
			pub.WaitSubscribed()
			live := pub.Publish(stored(1))
			want := []int64{int64(live)}
			if tc.applied > 0 {
				want = append(append(seqs[:tc.applied:tc.applied], -1), int64(live))
			}
			require.Eventually(t, func() bool { return len(sink.Seqs("a")) >= len(want) }, waitFor, tick)
			assert.Equal(t, want, sink.Seqs("a"))
			st := eventstest.StatusOf(t, c, "a")
			assert.Equal(t, uint64(1), st.Sequence.CatchUpFailures)
			assert.Zero(t, st.Sequence.CatchUps)
			assert.Zero(t, st.Sequence.CaughtUpBatches)
			assert.Equal(t, uint64(btoi(tc.applied > 0)), st.Sequence.Resets)
			assert.Contains(t, st.LastError, "catch-up")
			assert.Contains(t, st.LastError, tc.err)

			// The live batch is the chain's baseline: the next batch is in order.
			next := pub.Publish(stored(2))
			require.Eventually(t, func() bool { return len(sink.Seqs("a")) == len(want)+1 }, waitFor, tick)
			assert.Equal(t, int64(next), sink.Seqs("a")[len(want)])
			assert.Equal(t, btoi(tc.applied > 0), sink.Clears("a"))
			assert.Zero(t, eventstest.StatusOf(t, c, "a").Sequence.Gaps)
		})
	}
}

func TestZMQCatchUpDisabled(t *testing.T) {
	// Without a replay endpoint, with CatchUpBatches < 0, and in bind mode (publishers have no
	// replay endpoint there), the first batch is the baseline, as before catch-up existed.
	for _, tc := range []struct {
		name   string
		replay bool
		bind   bool
	}{
		{name: "no replay endpoint"},
		{name: "CatchUpBatches < 0", replay: true},
		{name: "bind mode", bind: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sink := eventstest.NewRecordingSink()
			var pub *FakePublisher
			var c *Consumer
			if tc.bind {
				c = startZMQ(t, Config{Sink: sink, Bind: "tcp://127.0.0.1:0", DefaultBackend: "a"})
				pub = NewFakePublisher(t, FakePublisherConfig{Connect: "tcp://" + c.Addr().String(), Replay: true, FirstSeq: 5})
			} else {
				pub = NewFakePublisher(t, FakePublisherConfig{Replay: true})
				publishHistory(pub, 5)
				cfg := Config{Sink: sink, Endpoints: []Endpoint{{Backend: "a", Endpoint: pub.Endpoint}}}
				if tc.replay {
					cfg.Endpoints[0].ReplayEndpoint, cfg.CatchUpBatches = pub.ReplayEndpoint, -1
				}
				c = startZMQ(t, cfg)
			}
			pub.WaitSubscribed()
			pub.Publish(stored(1))
			pub.Publish(stored(2))
			require.Eventually(t, func() bool { return len(sink.Seqs("a")) == 2 }, waitFor, tick)
			assert.Equal(t, []int64{5, 6}, sink.Seqs("a"))
			assert.Zero(t, pub.Replays())
			st := eventstest.StatusOf(t, c, "a")
			assert.Zero(t, st.Sequence.CatchUps)
			assert.Zero(t, st.Sequence.CatchUpFailures)
			assert.Zero(t, st.Sequence.Resets)
		})
	}
}

func TestZMQCatchUpDPRanks(t *testing.T) {
	// Two data-parallel ranks share a connection and topic (a relay in between), each with its
	// own sequence, but one replay endpoint, which belongs to rank 0 (vLLM: one replay socket
	// per rank; its answer names no topic, only each batch its rank). Each rank's chain catches
	// up on its own first batch; rank 1's request is answered with rank 0's batches, which the
	// consumer refuses before applying any: rank 1 starts from its live batch, without a reset.
	r0, r1 := 0, 1
	pub := NewFakePublisher(t, FakePublisherConfig{Topic: "kv@p@m", Replay: true, Rank: &r0})
	history := publishHistory(pub, 6)
	sink := eventstest.NewRecordingSink()
	c := startZMQ(t, Config{Sink: sink,
		Endpoints: []Endpoint{{Backend: "a", Endpoint: pub.Endpoint, ReplayEndpoint: pub.ReplayEndpoint}}})
	pub.WaitSubscribed()
	live0 := pub.Publish(stored(1))
	require.Eventually(t, func() bool { return len(sink.Seqs("a")) == 7 }, waitFor, tick)
	assert.Equal(t, append(history, int64(live0)), sink.Seqs("a"))

	pub.SendFrames([]byte("kv@p@m"), seqFrame(3), EncodeFakeBatch(&r1, stored(1003))) // rank 1's first batch
	pub.SendFrames([]byte("kv@p@m"), seqFrame(4), EncodeFakeBatch(&r1, stored(1004)))
	live1 := pub.Publish(stored(2)) // rank 0 goes on
	require.Eventually(t, func() bool { return len(sink.Seqs("a")) == 10 }, waitFor, tick)
	assert.Equal(t, append(history, int64(live0), 3, 4, int64(live1)), sink.Seqs("a"))
	assert.Equal(t, [][]uint64{{1003}}, sink.Applied("a")[7].Hashes)
	assert.Zero(t, sink.Clears("a"))
	st := eventstest.StatusOf(t, c, "a")
	assert.Equal(t, uint64(1), st.Sequence.CatchUps)
	assert.Equal(t, uint64(6), st.Sequence.CaughtUpBatches)
	assert.Equal(t, uint64(1), st.Sequence.CatchUpFailures)
	assert.Contains(t, st.LastError, "data-parallel rank 0, not 1")
	assert.Zero(t, st.Sequence.Gaps)
	assert.Equal(t, 2, pub.Replays())
}

func TestZMQSequenceWentBack(t *testing.T) {
	// A publisher whose sequence goes back on the same connection (a relay in between, or an
	// engine restarted behind a forwarder) restarted: reset and re-baseline.
	pub := NewFakePublisher(t, FakePublisherConfig{Topic: "kv@p@m", FirstSeq: 1})
	sink := eventstest.NewRecordingSink()
	c := startZMQ(t, Config{Sink: sink, Endpoints: []Endpoint{{Backend: "a", Endpoint: pub.Endpoint}}})
	pub.WaitSubscribed()
	for i := range 3 {
		pub.Publish(stored(uint64(i)))
	}
	pub.ResetSeq(1)
	pub.Publish(stored(10))
	pub.Publish(stored(11))
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 5 }, waitFor, tick)
	assert.Equal(t, []int64{1, 2, 3, -1, 1, 2}, sink.Seqs("a"))
	st := eventstest.StatusOf(t, c, "a")
	assert.Equal(t, uint64(1), st.Sequence.Resets)
	assert.Zero(t, st.Sequence.Gaps)
	assert.Zero(t, st.Connection.ReconnectCount)
}

func TestZMQEngineDownAtStart(t *testing.T) {
	port := testenv.FreePort(t)
	sink := eventstest.NewRecordingSink()
	c := startZMQ(t, Config{Sink: sink,
		Endpoints: []Endpoint{{Backend: "a", Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", port)}}})
	require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Connection.ReconnectCount >= 2 }, waitFor, tick)
	st := eventstest.StatusOf(t, c, "a")
	assert.False(t, st.Connection.Connected)
	assert.NotEmpty(t, st.LastError)

	pub := NewFakePublisher(t, FakePublisherConfig{Port: port})
	pub.WaitSubscribed()
	pub.Publish(stored(1))
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 1 }, waitFor, tick)
	assert.True(t, eventstest.StatusOf(t, c, "a").Connection.Connected)
}

func TestZMQMalformed(t *testing.T) {
	pub := NewFakePublisher(t, FakePublisherConfig{})
	sink := eventstest.NewRecordingSink()
	c := startZMQ(t, Config{Sink: sink, Endpoints: []Endpoint{{Backend: "a", Endpoint: pub.Endpoint}}})
	pub.WaitSubscribed()
	pub.Publish(stored(0))
	pub.SendFrames([]byte(""), []byte{1, 2, 3}, EncodeFakeBatch(nil, stored(1))) // short seq frame
	pub.SendFrames([]byte(""), seqFrame(1))                                      // two frames
	pub.PublishRaw([]byte{0xc1, 0xff, 0x00})                                     // seq 1: not msgpack
	pub.Publish(stored(2), []any{"FutureEvent", 1}, stored(3))                   // seq 2: one event skipped
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 2 }, waitFor, tick)
	// Batch 1 was lost to the decoder: a gap, and without replay a reset.
	assert.Equal(t, []int64{0, -1, 2}, sink.Seqs("a"))
	assert.Equal(t, []events.Kind{events.KindBlockStored, events.KindBlockStored}, sink.Applied("a")[1].Kinds)
	st := eventstest.StatusOf(t, c, "a")
	assert.Equal(t, uint64(4), st.Events.Malformed, "2 bad framings, 1 bad payload, 1 skipped event")
	assert.Equal(t, uint64(4), st.Events.Received)
	assert.Equal(t, uint64(3), st.Events.Processed)
	assert.Equal(t, uint64(1), st.Events.Dropped)
	assert.True(t, st.Connection.Connected, "malformed input does not drop the connection")
	assert.NotEmpty(t, st.LastError)
}

func TestZMQQueueOverflow(t *testing.T) {
	for _, tc := range []struct {
		name   string
		replay bool
	}{
		{"replayed", true},
		{"reset", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pub := NewFakePublisher(t, FakePublisherConfig{Replay: tc.replay})
			sink := eventstest.NewRecordingSink()
			ep := Endpoint{Backend: "a", Endpoint: pub.Endpoint}
			if tc.replay {
				ep.ReplayEndpoint = pub.ReplayEndpoint
			}
			c := startZMQ(t, Config{Sink: sink, QueueSize: 2, Endpoints: []Endpoint{ep}})
			pub.WaitSubscribed()
			entered := sink.Block()
			pub.Publish(stored(0))
			<-entered // the worker holds batch 0; the queue takes 2 more; the rest overflow
			for i := 1; i <= 8; i++ {
				pub.Publish(stored(uint64(i)))
			}
			// Batches is counted before the batch is queued or dropped, Dropped after: wait
			// for the last drop.
			require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Events.Dropped >= 6 }, waitFor, tick)
			st := eventstest.StatusOf(t, c, "a")
			assert.Equal(t, uint64(9), st.Sequence.Batches)
			assert.Equal(t, uint64(6), st.Sequence.QueueOverflows)
			assert.Equal(t, uint64(6), st.Events.Dropped)
			assert.Empty(t, sink.Applied("a"))
			sink.Unblock()
			// The dropped batches 3..8 were the last ones published: the worker repairs the
			// hole once it has applied 0..2, without waiting for the publisher's next batch.
			// (The counters are updated after the sink returns: wait for them.)
			if tc.replay {
				require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Sequence.Replays == 1 }, waitFor, tick)
				assert.Equal(t, []int64{0, 1, 2, 3, 4, 5, 6, 7, 8}, sink.Seqs("a"))
			} else {
				require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Sequence.Resets == 1 }, waitFor, tick)
				assert.Equal(t, []int64{0, 1, 2, -1}, sink.Seqs("a"))
			}
			assert.Equal(t, uint64(1), eventstest.StatusOf(t, c, "a").Sequence.Gaps)

			// The chain continues after the hole: the next batch is in order.
			pub.Publish(stored(9))
			if tc.replay {
				require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Events.Processed == 10 }, waitFor, tick)
				assert.Equal(t, []int64{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, sink.Seqs("a"))
			} else {
				require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Events.Processed == 4 }, waitFor, tick)
				assert.Equal(t, []int64{0, 1, 2, -1, 9}, sink.Seqs("a"))
			}
			st = eventstest.StatusOf(t, c, "a")
			assert.Equal(t, uint64(1), st.Sequence.Gaps)
			if tc.replay { // replayed batches are received (and processed) a second time
				assert.Equal(t, events.Stats{Received: 16, Processed: 10, Dropped: 6}, st.Events)
				assert.Zero(t, sink.Clears("a"))
			} else {
				assert.Equal(t, events.Stats{Received: 10, Processed: 4, Dropped: 6}, st.Events)
				assert.Equal(t, 1, sink.Clears("a"))
			}
		})
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

func TestZMQLostLastBatch(t *testing.T) {
	// The last batch a publisher sends before going quiet cannot be decoded: the hole is acted
	// on at once, not when (if ever) the publisher sends again.
	for _, tc := range []struct {
		name   string
		replay bool
	}{
		{"no replay endpoint", false},
		{"replayed batch undecodable too", true}, // replay tried, then the backend is reset
	} {
		t.Run(tc.name, func(t *testing.T) {
			pub := NewFakePublisher(t, FakePublisherConfig{Replay: tc.replay})
			ep := Endpoint{Backend: "a", Endpoint: pub.Endpoint}
			if tc.replay {
				ep.ReplayEndpoint = pub.ReplayEndpoint
			}
			sink := eventstest.NewRecordingSink()
			c := startZMQ(t, Config{Sink: sink, Endpoints: []Endpoint{ep}})
			pub.WaitSubscribed()
			pub.Publish(stored(0))
			pub.PublishRaw([]byte{0xc1}) // seq 1: not msgpack
			require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Sequence.Resets == 1 }, waitFor, tick)
			assert.Equal(t, []int64{0, -1}, sink.Seqs("a"))
			st := eventstest.StatusOf(t, c, "a")
			assert.Equal(t, uint64(1), st.Sequence.Gaps)
			assert.Equal(t, uint64(1), st.Sequence.Resets)
			assert.Equal(t, btoi(tc.replay), pub.Replays())

			pub.Publish(stored(2)) // in order after the hole: no second gap
			require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Events.Processed == 2 }, waitFor, tick)
			assert.Equal(t, []int64{0, -1, 2}, sink.Seqs("a"))
			assert.Equal(t, uint64(1), eventstest.StatusOf(t, c, "a").Sequence.Gaps)
		})
	}
}

func TestZMQSinkFailureResetsBackend(t *testing.T) {
	pub := NewFakePublisher(t, FakePublisherConfig{})
	sink := eventstest.NewRecordingSink()
	c := startZMQ(t, Config{Sink: sink, Endpoints: []Endpoint{{Backend: "a", Endpoint: pub.Endpoint}}})
	pub.WaitSubscribed()
	pub.Publish(stored(0))
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 1 }, waitFor, tick)
	sink.SetFail(eventstest.ErrSinkDown)
	pub.Publish(stored(1))
	require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Events.Dropped == 1 }, waitFor, tick)
	assert.Contains(t, eventstest.StatusOf(t, c, "a").LastError, "sink down")
	sink.SetFail(nil)
	pub.Publish(stored(2))
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 2 }, waitFor, tick)
	assert.Equal(t, []int64{0, -1, 2}, sink.Seqs("a"), "the backend is cleared before the next batch")
}

// startWithTwoBatches starts a consumer of one publisher with a replay endpoint (backend "a")
// and waits until the publisher's batches 0 and 1 are applied.
func startWithTwoBatches(t *testing.T) (*FakePublisher, *eventstest.RecordingSink, *Consumer) {
	t.Helper()
	sink := eventstest.NewRecordingSink()
	pub, c := startTwoBatches(t, Config{Sink: sink}, sink)
	return pub, sink, c
}

// startTwoBatches starts a consumer of cfg (its Endpoints set to one publisher with a replay
// endpoint, backend "a") and waits until rec, what cfg.Sink records, holds the publisher's batches
// 0 and 1.
func startTwoBatches(t *testing.T, cfg Config, rec *eventstest.RecordingSink) (*FakePublisher, *Consumer) {
	t.Helper()
	return startTwoBatchesOf(t, cfg, rec, true)
}

// startTwoBatchesOf is startTwoBatches with a publisher that has a replay endpoint or not.
func startTwoBatchesOf(t *testing.T, cfg Config, rec *eventstest.RecordingSink, replay bool) (*FakePublisher, *Consumer) {
	t.Helper()
	pub := NewFakePublisher(t, FakePublisherConfig{Replay: replay})
	cfg.Endpoints = []Endpoint{{Backend: "a", Endpoint: pub.Endpoint, ReplayEndpoint: pub.ReplayEndpoint}}
	c := startZMQ(t, cfg)
	pub.WaitSubscribed()
	pub.Publish(stored(0))
	pub.Publish(stored(1))
	require.Eventually(t, func() bool { return len(rec.Applied("a")) == 2 }, waitFor, tick)
	return pub, c
}

// TestZMQSinkFailureCatchesUp: after a sink outage the backend is cleared, and the chain then
// catches up again from the replay buffer, so the sink relearns what the engine holds instead of
// starting from the next batch; while the sink is still down nothing is replayed.
func TestZMQSinkFailureCatchesUp(t *testing.T) {
	pub, sink, c := startWithTwoBatches(t)
	replays := pub.Replays()
	sink.SetFail(eventstest.ErrSinkDown)
	pub.Publish(stored(2))
	pub.Publish(stored(3)) // the clear before it fails too: no replay yet
	require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Events.Dropped == 2 }, waitFor, tick)
	assert.Equal(t, replays, pub.Replays(), "nothing is replayed into a sink that is down")
	sink.SetFail(nil)
	pub.Publish(stored(4))
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 7 }, waitFor, tick)
	assert.Equal(t, []int64{0, 1, -1, 0, 1, 2, 3, 4}, sink.Seqs("a"), "cleared, caught up, then the live batch")
	st := eventstest.StatusOf(t, c, "a")
	assert.Equal(t, uint64(1), st.Sequence.CatchUps)
	assert.Equal(t, uint64(4), st.Sequence.CaughtUpBatches)
	assert.Equal(t, uint64(1), st.Sequence.Resets)

	pub.Publish(stored(5)) // in order: no further catch-up
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 8 }, waitFor, tick)
	assert.Equal(t, uint64(1), eventstest.StatusOf(t, c, "a").Sequence.CatchUps)
}

// TestZMQCatchUpIntoFailingSink: the sink takes the clear but fails the first replayed batch (a
// store that lost its state and says so on the next write). The catch-up stops there and is not
// counted; the backend is cleared before the next batch, which catches up again.
func TestZMQCatchUpIntoFailingSink(t *testing.T) {
	pub, sink, c := startWithTwoBatches(t)
	sink.SetFail(eventstest.ErrSinkDown)
	pub.Publish(stored(2))
	require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Events.Dropped == 1 }, waitFor, tick)
	sink.SetFail(nil)
	sink.FailApplies(1, eventstest.ErrSinkDown)
	pub.Publish(stored(3)) // cleared, then the catch-up's first batch fails: it stops
	require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Events.Dropped == 2 }, waitFor, tick)
	st := eventstest.StatusOf(t, c, "a")
	assert.Zero(t, st.Sequence.CatchUps, "a catch-up the sink did not take is not counted")
	assert.Zero(t, st.Sequence.CatchUpFailures, "nor is it the publisher's failure")
	pub.Publish(stored(4))
	require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Sequence.CatchUps == 1 }, waitFor, tick)
	require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Events.Processed >= 7 }, waitFor, tick)
	seqs := sink.Seqs("a")
	assert.Equal(t, []int64{-1, 3, 0, 1, 2, 3, 4}, seqs[len(seqs)-7:],
		"batch 3 after the clear its stopped catch-up left to do, then a whole catch-up before batch 4")
}

// TestZMQClearFailed: a sink fails the clear owed after its outage and takes the very next call
// (a store leaving its backoff). With a publisher that can replay, the batch is dropped with the
// failed clear (its own Apply must not clear without the catch-up) and the next one clears and
// catches up; without one there is no catch-up to wait for, and the batch is applied once its own
// Apply gets the clear through. Either way one reset and no gap.
func TestZMQClearFailed(t *testing.T) {
	for _, tc := range []struct {
		name     string
		replay   bool
		want     []int64
		catchUps uint64
	}{
		{"with replay", true, []int64{0, 1, -1, 0, 1, 2, 3, 4}, 1},
		{"without replay", false, []int64{0, 1, -1, 3, 4}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sink := eventstest.NewRecordingSink()
			pub, c := startTwoBatchesOf(t, Config{Sink: sink}, sink, tc.replay)
			sink.SetFail(eventstest.ErrSinkDown)
			pub.Publish(stored(2))
			require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Events.Dropped == 1 }, waitFor, tick)
			sink.SetFail(nil)
			sink.FailClears(1, eventstest.ErrSinkDown)
			pub.Publish(stored(3))
			if tc.replay {
				require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Events.Dropped == 2 }, waitFor, tick)
				assert.Equal(t, []int64{0, 1}, sink.Seqs("a"), "neither cleared nor applied")
			}
			pub.Publish(stored(4))
			require.Eventually(t, func() bool { return len(sink.Applied("a")) == len(tc.want)-1 }, waitFor, tick)
			assert.Equal(t, tc.want, sink.Seqs("a"))
			st := eventstest.StatusOf(t, c, "a")
			assert.Equal(t, uint64(1), st.Sequence.Resets)
			assert.Zero(t, st.Sequence.Gaps)
			assert.Equal(t, tc.catchUps, st.Sequence.CatchUps)
		})
	}
}

// TestZMQResetCatchesUpOtherChains: two publishers feed one backend (two data-parallel ranks,
// each on its own connection); when one connection is lost the backend is cleared, and the
// other publisher's chain catches up from its replay buffer on its next batch, so the sink does
// not stay blind to what that rank holds.
func TestZMQResetCatchesUpOtherChains(t *testing.T) {
	r0, r1 := 0, 1
	p0 := NewFakePublisher(t, FakePublisherConfig{Replay: true, Rank: &r0})
	p1 := NewFakePublisher(t, FakePublisherConfig{Replay: true, Rank: &r1})
	sink := eventstest.NewRecordingSink()
	c := startZMQ(t, Config{Sink: sink, Endpoints: []Endpoint{
		{Backend: "a", Endpoint: p0.Endpoint, ReplayEndpoint: p0.ReplayEndpoint},
		{Backend: "a", Endpoint: p1.Endpoint, ReplayEndpoint: p1.ReplayEndpoint}}})
	p0.WaitSubscribed()
	p1.WaitSubscribed()
	p0.Publish(stored(0))
	p1.Publish(stored(1000))
	p1.Publish(stored(1001))
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 3 }, waitFor, tick)
	p0.Restart()
	require.Eventually(t, func() bool { return sink.Clears("a") == 1 }, waitFor, tick, "cleared when p0's connection is lost")
	p1.Publish(stored(1002))
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 6 }, waitFor, tick)
	var hashes []uint64
	for _, b := range sink.Applied("a")[3:] {
		hashes = append(hashes, b.Hashes[0]...)
	}
	assert.Equal(t, []uint64{1000, 1001, 1002}, hashes, "p1 caught up after the clear, then its live batch")
	var catchUps uint64
	for _, st := range c.Status() {
		catchUps += st.Sequence.CatchUps
	}
	assert.Equal(t, uint64(1), catchUps)
}

func TestZMQCloseStopsEverything(t *testing.T) {
	for _, mode := range []string{"connect", "bind"} {
		t.Run(mode, func(t *testing.T) {
			pub := NewFakePublisher(t, FakePublisherConfig{Replay: true})
			down := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t)) // an engine that is down
			check := CheckGoroutines(t)
			sink := eventstest.NewRecordingSink()
			cfg := Config{Sink: sink, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond}
			if mode == "connect" {
				cfg.Endpoints = []Endpoint{
					{Backend: "a", Endpoint: pub.Endpoint, ReplayEndpoint: pub.ReplayEndpoint},
					{Backend: "b", Endpoint: down},
				}
			} else {
				cfg.Bind, cfg.DefaultBackend = "tcp://127.0.0.1:0", "a"
			}
			c, err := New(cfg)
			require.NoError(t, err)
			require.NoError(t, c.Start(context.Background()))
			require.ErrorIs(t, c.Start(context.Background()), events.ErrStarted)
			if mode == "bind" {
				pub2 := NewFakePublisher(t, FakePublisherConfig{Connect: "tcp://" + c.Addr().String()})
				pub = pub2
			}
			pub.WaitSubscribed()
			entered := sink.Block() // Close must also end a worker stuck in the sink
			pub.Publish(stored(0))
			<-entered
			pub.Publish(stored(1))

			closed := make(chan error, 1)
			go func() { closed <- c.Close() }()
			select {
			case err := <-closed:
				require.NoError(t, err)
			case <-time.After(waitFor):
				t.Fatal("Close did not return")
			}
			require.NoError(t, c.Close(), "Close is idempotent")
			require.ErrorIs(t, c.Start(context.Background()), events.ErrClosed)
			for _, st := range c.Status() {
				assert.Equal(t, events.StateClosed, st.Connection.State)
			}
			pub.Close()
			check()
		})
	}
}

func TestZMQBindError(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	c, err := New(Config{Sink: eventstest.NewRecordingSink(), Bind: "tcp://" + ln.Addr().String()})
	require.NoError(t, err)
	defer c.Close()
	require.Error(t, c.Start(context.Background()))
	ls, ok := c.Listener()
	require.True(t, ok)
	assert.False(t, ls.Connection.Connected)
	assert.NotEmpty(t, ls.LastError)

	// Once the port is free, Start can be retried.
	require.NoError(t, ln.Close())
	require.NoError(t, c.Start(context.Background()))
	ls, _ = c.Listener()
	assert.True(t, ls.Connection.Connected)
	require.ErrorIs(t, c.Start(context.Background()), events.ErrStarted)
}

func TestZMQOversizedFrameDisconnects(t *testing.T) {
	// A peer announcing a frame larger than MaxMessageSize is dropped before the codec
	// allocates it; the consumer keeps serving others.
	sink := eventstest.NewRecordingSink()
	c := startZMQ(t, Config{Sink: sink, Bind: "tcp://127.0.0.1:0", DefaultBackend: "a", MaxMessageSize: 1 << 10})
	raw, err := net.Dial("tcp", c.Addr().String())
	require.NoError(t, err)
	defer raw.Close()
	zc, err := zmq4.Open(raw, null.Security(), zmq4.Pub, nil, false, nil)
	require.NoError(t, err)
	_ = zc
	hdr := []byte{0x02, 0, 0, 0, 0x7f, 0xff, 0xff, 0xff, 0xff} // long frame, 512 GiB
	_, err = raw.Write(hdr)
	require.NoError(t, err)
	require.NoError(t, raw.SetReadDeadline(time.Now().Add(waitFor)))
	buf := make([]byte, 64)
	for {
		if _, err = raw.Read(buf); err != nil {
			break
		}
	}
	var ne net.Error
	require.False(t, errors.As(err, &ne) && ne.Timeout(), "the consumer did not close the connection")
	require.Eventually(t, func() bool {
		ls, _ := c.Listener()
		return strings.Contains(ls.LastError, "MaxMessageSize")
	}, waitFor, tick)

	pub := NewFakePublisher(t, FakePublisherConfig{Connect: "tcp://" + c.Addr().String()})
	pub.WaitSubscribed()
	pub.Publish(stored(1))
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 1 }, waitFor, tick)
}

func TestFrameGuard(t *testing.T) {
	greeting := make([]byte, zmtpGreetingLen)
	frame := func(flags byte, size int) []byte {
		if flags&0x02 != 0 {
			b := []byte{flags, 0, 0, 0, 0, 0, 0, 0, 0}
			binary.BigEndian.PutUint64(b[1:], uint64(size))
			return append(b, make([]byte, size)...)
		}
		return append([]byte{flags, byte(size)}, make([]byte, size)...)
	}
	cat := func(parts ...[]byte) []byte {
		var out []byte
		for _, p := range parts {
			out = append(out, p...)
		}
		return out
	}
	for _, tc := range []struct {
		name   string
		stream []byte
		ok     bool
	}{
		{"short frames", cat(greeting, frame(0, 10), frame(0x04, 20)), true},
		{"long frame at the cap", cat(greeting, frame(0x02, 100)), true},
		{"greeting bytes are not frames", cat(greeting[:10], greeting[10:], frame(0, 0)), true},
		{"long frame over the cap", cat(greeting, frame(0x02, 101)), false},
		{"multipart message over the cap", cat(greeting, frame(0x01, 60), frame(0x00, 60)), false},
		{"two messages under the cap each", cat(greeting, frame(0x01, 40), frame(0x00, 40), frame(0x00, 90)), true},
		{"endless empty frames", cat(greeting, bytes.Repeat(frame(0x01, 0), zmtpMaxFrames+1)), false},
		{"many empty messages", cat(greeting, bytes.Repeat(frame(0x00, 0), 3*zmtpMaxFrames)), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, chunk := range []int{1, 3, 1 << 20} { // the same stream read in different chunkings
				g := &frameGuard{max: 100, greeting: zmtpGreetingLen}
				var err error
				for s := tc.stream; len(s) > 0 && err == nil; {
					n := min(chunk, len(s))
					err = g.scan(s[:n])
					s = s[n:]
				}
				if tc.ok {
					assert.NoError(t, err, "chunk %d", chunk)
				} else {
					assert.ErrorIs(t, err, errFrameTooLarge, "chunk %d", chunk)
				}
			}
		})
	}
}

func TestZMQMetrics(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	pub := NewFakePublisher(t, FakePublisherConfig{})
	sink := eventstest.NewRecordingSink()
	c := startZMQ(t, Config{Sink: sink, MeterProvider: mp, Endpoints: []Endpoint{{Backend: "a", Endpoint: pub.Endpoint}}})
	pub.WaitSubscribed()
	pub.Publish(stored(1), stored(2))
	require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Events.Processed == 2 }, waitFor, tick)

	got := eventstest.CollectInt64(t, reader)
	for key, want := range map[string]int64{
		telemetry.MetricEventReceived + ",backend=a":                                          2,
		telemetry.MetricEventProcessed + ",backend=a":                                         2,
		telemetry.MetricEventDropped + ",backend=a":                                           0,
		telemetry.MetricConsumerReconnects + ",backend=a":                                     0,
		telemetry.MetricConsumerGaps + ",backend=a":                                           0,
		telemetry.MetricConsumerConnected + ",backend=a":                                      1,
		telemetry.MetricEventSourceStatus + ",backend=a,status=connected":                     1,
		telemetry.MetricEventSourceStatus + ",backend=a,status=disconnected":                  0,
		telemetry.MetricEventSourceStatus + ",backend=a,status=" + string(events.StateClosed): 0,
	} {
		assert.Equal(t, want, got[key], key)
		assert.Contains(t, got, key)
	}
}

// In bind mode an event source's own backend takes every topic topic_backends does not map, even
// a kv@<pod>@<model> one; without it, a pod that is not a known backend is dropped, counted and
// logged, never indexed under an invented name.
func TestZMQBindTopicsNeverInventBackends(t *testing.T) {
	sink := eventstest.NewRecordingSink()
	c := startZMQ(t, Config{Sink: sink, Bind: "tcp://127.0.0.1:0", DefaultBackend: "vllm-0"})
	p := NewFakePublisher(t, FakePublisherConfig{Topic: "kv@10.0.0.7:8000@llama", Connect: "tcp://" + c.Addr().String()})
	p.WaitSubscribed()
	p.Publish(stored(0))
	require.Eventually(t, func() bool { return len(sink.Applied("vllm-0")) == 1 }, waitFor, tick)
	assert.Empty(t, sink.Applied("10.0.0.7:8000"), "the pod of the topic became a backend")
	assert.Equal(t, "llama", sink.Applied("vllm-0")[0].Model, "the topic still names the model")

	sink2 := eventstest.NewRecordingSink()
	c2 := startZMQ(t, Config{Sink: sink2, Bind: "tcp://127.0.0.1:0", Backends: []string{"pod-a"}})
	addr := "tcp://" + c2.Addr().String()
	known := NewFakePublisher(t, FakePublisherConfig{Topic: "kv@pod-a@m", Connect: addr})
	unknown := NewFakePublisher(t, FakePublisherConfig{Topic: "kv@10.0.0.9:8000@m", Connect: addr})
	known.WaitSubscribed()
	unknown.WaitSubscribed()
	known.Publish(stored(0))
	unknown.Publish(stored(0))
	require.Eventually(t, func() bool { return len(sink2.Applied("pod-a")) == 1 }, waitFor, tick)
	require.Eventually(t, func() bool {
		ls, ok := c2.Listener()
		return ok && ls.Messages.Unplaced == 1
	}, waitFor, tick)
	assert.Empty(t, sink2.Applied("10.0.0.9:8000"))
	assert.Len(t, c2.Status(), 1, "no status for an invented backend")
}
