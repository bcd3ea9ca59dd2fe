package events

import (
	"context"
	"encoding/json"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// lossSink is a RecordingSink that can lose a backend, as a Redis index whose server restarted
// empty: BackendLost reports it until the next ClearBackend.
type lossSink struct {
	*RecordingSink
	mu   sync.Mutex
	lost map[string]bool
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

var _ LossReporter = (*lossSink)(nil)

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
