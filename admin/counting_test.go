package admin_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/admin"
	"github.com/kvroute/kvroute/events"
)

// recordingSink refuses batches of the backend named fail.
type recordingSink struct {
	fail    string
	applied int
	cleared []string
}

func (s *recordingSink) Apply(_ context.Context, backend string, _ *events.Batch) error {
	if backend == s.fail {
		return errors.New("refused")
	}
	s.applied++
	return nil
}

func (s *recordingSink) ClearBackend(_ context.Context, backend string) error {
	s.cleared = append(s.cleared, backend)
	return nil
}

func TestCountingSink(t *testing.T) {
	next := &recordingSink{fail: "bad"}
	s := admin.NewCountingSink(next)
	ctx := context.Background()
	require.NoError(t, s.Apply(ctx, "a", &events.Batch{Events: []events.Event{
		{Kind: events.KindBlockStored, BlockHashes: []uint64{1, 2, 3}},
		{Kind: events.KindBlockRemoved, BlockHashes: []uint64{1}},
		{Kind: events.KindAllBlocksCleared},
	}}))
	require.NoError(t, s.Apply(ctx, "b", &events.Batch{Events: []events.Event{
		{Kind: events.KindPrefix, PrefixOp: events.PrefixCreated},
		{Kind: events.KindPrefix, PrefixOp: events.PrefixReloaded},
		{Kind: events.KindPrefix, PrefixOp: events.PrefixEvicted},
	}}))
	require.Error(t, s.Apply(ctx, "bad", &events.Batch{Events: []events.Event{{Kind: events.KindBlockStored, BlockHashes: []uint64{9}}}}))
	require.NoError(t, s.ClearBackend(ctx, "b"))

	assert.Equal(t, map[string]admin.MutationCounts{
		"a":   {Created: 3, Evicted: 1, Cleared: 1},
		"b":   {Created: 2, Evicted: 1, Cleared: 1},
		"bad": {ApplyErrors: 1},
	}, s.Counts())
	assert.Equal(t, 2, next.applied)
	assert.Equal(t, []string{"b"}, next.cleared)
}

func TestSummarizeBackends(t *testing.T) {
	t1, t2 := time.Date(2026, 1, 1, 0, 0, 1, 0, time.UTC), time.Date(2026, 1, 1, 0, 0, 2, 0, time.UTC)
	sources := []events.SourceStatus{
		{Backend: "a", Transport: "zmq", Endpoint: "tcp://a:5557",
			Connection: events.ConnectionStatus{Connected: false, State: "reconnecting", ReconnectCount: 2, LastEventAt: t2},
			Events:     events.Stats{Received: 10, Processed: 9, Dropped: 1, Malformed: 1}},
		{Backend: "a", Transport: "zmq", Endpoint: "tcp://a:5558",
			Connection: events.ConnectionStatus{Connected: true, State: "connected", ReconnectCount: 1, LastEventAt: t1},
			Events:     events.Stats{Received: 5, Processed: 5}, Sequence: events.SequenceStats{Resets: 1}},
		{Backend: "phantom", Transport: "sse", Endpoint: "http://p/v1/kv_events"},
	}
	counts := map[string]admin.MutationCounts{"a": {Created: 7, Evicted: 2}, "z": {Created: 1}, "y": {Created: 1}}
	got := admin.SummarizeBackends([]string{"b", "a"}, sources, counts, map[string]int{"a": 4})

	names := []string{}
	for _, b := range got {
		names = append(names, b.Backend)
	}
	assert.Equal(t, []string{"b", "a", "phantom", "y", "z"}, names)
	a := got[1]
	assert.Equal(t, admin.BackendConnection{Connected: true, ReconnectCount: 3, LastEventAt: t2}, a.Connection)
	assert.Equal(t, admin.BackendEvents{Received: 15, Processed: 14, Dropped: 1, Malformed: 1, IndexCreated: 7, IndexEvicted: 2, Resets: 1}, a.Events)
	assert.Equal(t, 4, a.IndexEntries)
	require.Len(t, a.Sources, 2)
	assert.Equal(t, "reconnecting", a.Sources[0].Status)
	assert.Empty(t, got[0].Sources)

	assert.NotNil(t, admin.SummarizeBackends(nil, nil, nil, nil), "an empty summary encodes as [], not null")
}

// lossySink is a recordingSink that reports the backends in lost as lost.
type lossySink struct {
	recordingSink
	lost map[string]bool
}

func (s *lossySink) BackendLost(_ context.Context, backend string) (bool, error) {
	return s.lost[backend], nil
}

// CountingSink reports what the sink behind it reports, and no loss for a sink that cannot lose
// anything.
func TestCountingSinkForwardsLoss(t *testing.T) {
	ctx := context.Background()
	cs := admin.NewCountingSink(&lossySink{lost: map[string]bool{"a": true}})
	lost, err := cs.BackendLost(ctx, "a")
	require.NoError(t, err)
	assert.True(t, lost)
	lost, err = cs.BackendLost(ctx, "b")
	require.NoError(t, err)
	assert.False(t, lost)
	lost, err = admin.NewCountingSink(&recordingSink{}).BackendLost(ctx, "a")
	require.NoError(t, err)
	assert.False(t, lost)
}

// A ZMQ source's summary carries its sequence block, zero, before any batch has arrived, rather
// than leaving it out.
func TestSummarySequenceBeforeFirstBatch(t *testing.T) {
	sum := admin.SummarizeBackends([]string{"a"}, []events.SourceStatus{{Backend: "a", Transport: "zmq", Endpoint: "tcp://h:1"}}, nil, nil)
	b, err := json.Marshal(sum)
	require.NoError(t, err)
	assert.Contains(t, string(b), `"sequence":{"batches":0,"last_seq":0,"gaps":0,"replays":0,"replay_failures":0,"catch_ups":0,`)
}
