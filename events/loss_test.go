package events_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/events/internal/eventstest"
)

// TestCountingSinkForwardsLoss: CountingSink reports what the sink behind it reports, and no loss
// for a sink that cannot lose anything.
func TestCountingSinkForwardsLoss(t *testing.T) {
	ctx := context.Background()
	sink := eventstest.NewLossSink()
	sink.Lose("a")
	cs := events.NewCountingSink(sink)
	lost, err := cs.BackendLost(ctx, "a")
	require.NoError(t, err)
	assert.True(t, lost)
	lost, err = cs.BackendLost(ctx, "b")
	require.NoError(t, err)
	assert.False(t, lost)
	lost, err = events.NewCountingSink(eventstest.NewRecordingSink()).BackendLost(ctx, "a")
	require.NoError(t, err)
	assert.False(t, lost)
}

// TestSummarySequenceBeforeFirstBatch: a ZMQ source's summary carries its sequence block, zero,
// before any batch has arrived, rather than leaving it out.
func TestSummarySequenceBeforeFirstBatch(t *testing.T) {
	sum := events.SummarizeBackends([]string{"a"}, []events.SourceStatus{{Backend: "a", Transport: "zmq", Endpoint: "tcp://h:1"}}, nil, nil)
	b, err := json.Marshal(sum)
	require.NoError(t, err)
	assert.Contains(t, string(b), `"sequence":{"batches":0,"last_seq":0,"gaps":0,"replays":0,"replay_failures":0,"catch_ups":0,`)
}
