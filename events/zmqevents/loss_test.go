package zmqevents

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events/internal/eventstest"
)

// startLossConsumer starts a consumer of one publisher with a replay buffer into a LossSink,
// checking every 20 ms, and waits until batches 0 and 1 are applied.
func startLossConsumer(t *testing.T) (*FakePublisher, *eventstest.LossSink, *Consumer) {
	t.Helper()
	sink := eventstest.NewLossSink()
	pub, c := startTwoBatches(t, Config{Sink: sink, LossCheckInterval: 20 * time.Millisecond}, sink.RecordingSink)
	return pub, sink, c
}

// TestZMQHealsLostBackendWithoutBatches: the sink loses a backend whose engine publishes nothing
// more (a Redis restart between two bursts): the worker clears it and catches up from the replay
// buffer on its own, without waiting for a batch that may never come.
func TestZMQHealsLostBackendWithoutBatches(t *testing.T) {
	pub, sink, c := startLossConsumer(t)
	sink.Lose("a")
	require.Eventually(t, func() bool { return len(sink.Seqs("a")) == 5 }, waitFor, tick)
	assert.Equal(t, []int64{0, 1, -1, 0, 1}, sink.Seqs("a"), "cleared, then caught up through the last batch")
	// The worker counts the catch-up once its batches are applied: wait for the counts too.
	require.Eventually(t, func() bool {
		return eventstest.StatusOf(t, c, "a").Sequence.CaughtUpBatches == 2
	}, waitFor, tick)
	st := eventstest.StatusOf(t, c, "a")
	assert.Equal(t, uint64(1), st.Sequence.CatchUps)
	assert.Equal(t, uint64(2), st.Sequence.CaughtUpBatches)
	assert.Equal(t, uint64(1), st.Sequence.Resets)

	pub.Publish(stored(2)) // in order: no further clear or catch-up
	require.Eventually(t, func() bool { return len(sink.Seqs("a")) == 6 }, waitFor, tick)
	assert.Equal(t, []int64{0, 1, -1, 0, 1, 2}, sink.Seqs("a"))
	assert.Equal(t, uint64(1), eventstest.StatusOf(t, c, "a").Sequence.CatchUps)
}

// TestZMQHealRetriesAStoppedCatchUp: the sink refuses a batch of the healing catch-up (it fails
// again right after its restart); the backend is cleared, the loss is no longer reported, and the
// engine publishes nothing more: the worker heals again at its next check instead of leaving the
// backend empty until the engine's next batch.
func TestZMQHealRetriesAStoppedCatchUp(t *testing.T) {
	_, sink, c := startLossConsumer(t)
	sink.FailApplies(1, eventstest.ErrSinkDown)
	sink.Lose("a")
	require.Eventually(t, func() bool { return len(sink.Seqs("a")) >= 7 }, waitFor, tick, "healed again")
	// Cleared, the catch-up's first batch refused, cleared again; at the next check healed again:
	// cleared and caught up.
	require.Equal(t, []int64{0, 1, -1, -1, -1, 0, 1}, sink.Seqs("a"))
	require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Sequence.CatchUps >= 1 }, waitFor, tick)
}

// TestZMQHealsPendingClearWithoutBatches: a batch the sink refused (it was down) leaves a clear
// pending; once the sink is back, the next check performs it and catches up, though the engine
// publishes nothing more.
func TestZMQHealsPendingClearWithoutBatches(t *testing.T) {
	pub, sink, c := startLossConsumer(t)
	sink.SetFail(eventstest.ErrSinkDown)
	pub.Publish(stored(2))
	require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Events.Dropped == 1 }, waitFor, tick)
	sink.SetFail(nil)
	require.Eventually(t, func() bool { return len(sink.Seqs("a")) == 6 }, waitFor, tick)
	assert.Equal(t, []int64{0, 1, -1, 0, 1, 2}, sink.Seqs("a"), "cleared, then caught up through the refused batch")
	// Counted once the caught-up batches are applied.
	require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Sequence.CatchUps == 1 }, waitFor, tick)
}

// TestZMQLossChecksOff: a negative LossCheckInterval never asks the sink.
func TestZMQLossChecksOff(t *testing.T) {
	pub := NewFakePublisher(t, FakePublisherConfig{Replay: true})
	sink := eventstest.NewLossSink()
	sink.Lose("a")
	startZMQ(t, Config{Sink: sink, LossCheckInterval: -1,
		Endpoints: []Endpoint{{Backend: "a", Endpoint: pub.Endpoint, ReplayEndpoint: pub.ReplayEndpoint}}})
	time.Sleep(100 * time.Millisecond)
	assert.Zero(t, sink.Asks())
	assert.Zero(t, sink.Clears("a"))
}
