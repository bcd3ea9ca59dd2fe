package zmqevents

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events"
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

var _ events.LossReporter = (*lossSink)(nil)

// startLossConsumer starts a consumer of one publisher with a replay buffer into a lossSink,
// checking every 20 ms, and waits until batches 0 and 1 are applied.
func startLossConsumer(t *testing.T) (*FakePublisher, *lossSink, *Consumer) {
	t.Helper()
	pub := NewFakePublisher(t, FakePublisherConfig{Replay: true})
	sink := newLossSink()
	c := startZMQ(t, Config{Sink: sink, LossCheckInterval: 20 * time.Millisecond,
		Endpoints: []Endpoint{{Backend: "a", Endpoint: pub.Endpoint, ReplayEndpoint: pub.ReplayEndpoint}}})
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
	startZMQ(t, Config{Sink: sink, LossCheckInterval: -1,
		Endpoints: []Endpoint{{Backend: "a", Endpoint: pub.Endpoint, ReplayEndpoint: pub.ReplayEndpoint}}})
	time.Sleep(100 * time.Millisecond)
	assert.Zero(t, sink.askCount())
	assert.Zero(t, sink.Clears("a"))
}
