package events

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// lossSink is a RecordingSink that can lose a backend, as a Redis index whose server restarted
// empty: BackendLost reports it until the next ClearBackend.
type lossSink struct {
	*RecordingSink
	mu   sync.Mutex
	lost map[string]bool
	asks int
}

func newLossSink() *lossSink {
	return &lossSink{RecordingSink: NewRecordingSink(), lost: map[string]bool{}}
}

func (s *lossSink) lose(backend string) {
	s.mu.Lock()
	s.lost[backend] = true
	s.mu.Unlock()
}

func (s *lossSink) BackendLost(_ context.Context, backend string) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.asks++
	return s.lost[backend], nil
}

func (s *lossSink) ClearBackend(ctx context.Context, backend string) error {
	if err := s.RecordingSink.ClearBackend(ctx, backend); err != nil {
		return err
	}
	s.mu.Lock()
	delete(s.lost, backend)
	s.mu.Unlock()
	return nil
}

func (s *lossSink) askCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.asks
}

var _ LossReporter = (*lossSink)(nil)

// startLossConsumer starts a consumer of one publisher with a replay buffer into a lossSink,
// checking every 20 ms, and waits until batches 0 and 1 are applied.
func startLossConsumer(t *testing.T) (*FakePublisher, *lossSink, *ZMQConsumer) {
	t.Helper()
	pub := NewFakePublisher(t, FakePublisherConfig{Replay: true})
	sink := newLossSink()
	c := startZMQ(t, ZMQConfig{Sink: sink, LossCheckInterval: 20 * time.Millisecond,
		Endpoints: []ZMQEndpoint{{Backend: "a", Endpoint: pub.Endpoint, ReplayEndpoint: pub.ReplayEndpoint}}})
	pub.WaitSubscribed()
	pub.Publish(stored(0))
	pub.Publish(stored(1))
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 2 }, waitFor, tick)
	return pub, sink, c
}

// TestZMQHealsLostBackendWithoutBatches: the sink loses a backend whose engine publishes nothing
// more (a Redis restart between two bursts): the worker clears it and catches up from the replay
// buffer on its own, without waiting for a batch that may never come.
func TestZMQHealsLostBackendWithoutBatches(t *testing.T) {
	pub, sink, c := startLossConsumer(t)
	sink.lose("a")
	require.Eventually(t, func() bool { return len(sink.Seqs("a")) == 5 }, waitFor, tick)
	assert.Equal(t, []int64{0, 1, -1, 0, 1}, sink.Seqs("a"), "cleared, then caught up through the last batch")
	st := statusOf(t, c, "a")
	assert.Equal(t, uint64(1), st.Sequence.CatchUps)
	assert.Equal(t, uint64(2), st.Sequence.CaughtUpBatches)
	assert.Equal(t, uint64(1), st.Sequence.Resets)

	pub.Publish(stored(2)) // in order: no further clear or catch-up
	require.Eventually(t, func() bool { return len(sink.Seqs("a")) == 6 }, waitFor, tick)
	assert.Equal(t, []int64{0, 1, -1, 0, 1, 2}, sink.Seqs("a"))
	assert.Equal(t, uint64(1), statusOf(t, c, "a").Sequence.CatchUps)
}

// TestZMQHealsPendingClearWithoutBatches: a batch the sink refused (it was down) leaves a clear
// pending; once the sink is back, the next check performs it and catches up, though the engine
// publishes nothing more.
func TestZMQHealsPendingClearWithoutBatches(t *testing.T) {
	pub, sink, c := startLossConsumer(t)
	sink.SetFail(errSinkDown)
	pub.Publish(stored(2))
	require.Eventually(t, func() bool { return statusOf(t, c, "a").Events.Dropped == 1 }, waitFor, tick)
	sink.SetFail(nil)
	require.Eventually(t, func() bool { return len(sink.Seqs("a")) == 6 }, waitFor, tick)
	assert.Equal(t, []int64{0, 1, -1, 0, 1, 2}, sink.Seqs("a"), "cleared, then caught up through the refused batch")
	assert.Equal(t, uint64(1), statusOf(t, c, "a").Sequence.CatchUps)
}

// TestZMQLossChecksOff: a negative LossCheckInterval never asks the sink.
func TestZMQLossChecksOff(t *testing.T) {
	pub := NewFakePublisher(t, FakePublisherConfig{Replay: true})
	sink := newLossSink()
	sink.lose("a")
	startZMQ(t, ZMQConfig{Sink: sink, LossCheckInterval: -1,
		Endpoints: []ZMQEndpoint{{Backend: "a", Endpoint: pub.Endpoint, ReplayEndpoint: pub.ReplayEndpoint}}})
	time.Sleep(100 * time.Millisecond)
	assert.Zero(t, sink.askCount())
	assert.Zero(t, sink.Clears("a"))
}

// TestCountingSinkForwardsLoss: CountingSink reports what the sink behind it reports, and no loss
// for a sink that cannot lose anything.
func TestCountingSinkForwardsLoss(t *testing.T) {
	ctx := context.Background()
	sink := newLossSink()
	sink.lose("a")
	cs := NewCountingSink(sink)
	lost, err := cs.BackendLost(ctx, "a")
	require.NoError(t, err)
	assert.True(t, lost)
	lost, err = cs.BackendLost(ctx, "b")
	require.NoError(t, err)
	assert.False(t, lost)
	lost, err = NewCountingSink(NewRecordingSink()).BackendLost(ctx, "a")
	require.NoError(t, err)
	assert.False(t, lost)
	lost, err = LossReporterFunc(func(context.Context, string) (bool, error) { return true, nil }).BackendLost(ctx, "x")
	assert.True(t, lost && err == nil)
	lost, err = NeverLost{}.BackendLost(ctx, "x")
	assert.False(t, lost || err != nil)
}

// TestSummarySequenceBeforeFirstBatch: a ZMQ source's summary carries its sequence block, zero,
// before any batch has arrived, rather than leaving it out.
func TestSummarySequenceBeforeFirstBatch(t *testing.T) {
	sum := SummarizeBackends([]string{"a"}, []SourceStatus{{Backend: "a", Transport: "zmq", Endpoint: "tcp://h:1"}}, nil, nil)
	b, err := json.Marshal(sum)
	require.NoError(t, err)
	assert.Contains(t, string(b), `"sequence":{"batches":0,"last_seq":0,"gaps":0,"replays":0,"replay_failures":0,"catch_ups":0,`)
}
