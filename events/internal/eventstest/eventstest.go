// Package eventstest holds the test support that the tests of package events and of its
// transports (zmqevents) share: a Sink that records what it is given and can be made to block,
// fail or lose a backend; a check that a closed consumer leaves no goroutine behind; and small
// helpers to read a consumer's status, metrics and logs.
//
// Package events' own tests that use it are in package events_test: a test in package events
// cannot import a package that imports events.
//
//	sink := eventstest.NewRecordingSink()
//	c := start(t, Config{Sink: sink, ...})
//	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 2 }, waitFor, tick)
//	assert.Equal(t, uint64(2), eventstest.StatusOf(t, c, "a").Events.Processed)
package eventstest

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/internal/testenv"
)

// StatusOf returns c's status of backend, or fails t when c has none.
func StatusOf(t testing.TB, c interface{ Status() []events.SourceStatus }, backend string) events.SourceStatus {
	t.Helper()
	for _, s := range c.Status() {
		if s.Backend == backend {
			return s
		}
	}
	t.Fatalf("no status for backend %q in %+v", backend, c.Status())
	return events.SourceStatus{}
}

// FindStatus is StatusOf without failing: ok is false while c has no status for backend. Use it
// in conditions polled by another goroutine (require.Eventually), where StatusOf's t.Fatalf would
// end the poller, not the test.
func FindStatus(c interface{ Status() []events.SourceStatus }, backend string) (events.SourceStatus, bool) {
	for _, s := range c.Status() {
		if s.Backend == backend {
			return s, true
		}
	}
	return events.SourceStatus{}, false
}

// RecordingSink is a Sink that records what it receives. Block makes Apply wait until Unblock;
// Fail makes Apply and ClearBackend fail, FailApplies only the next Applies, FailClears only the
// next clears. Safe for concurrent use.
type RecordingSink struct {
	mu        sync.Mutex
	applied   []RecordedBatch
	clears    map[string]int
	fail      error
	failNext  int // Applies still to fail with failApply
	failApply error
	failClear int // ClearBackend calls still to fail with failApply
	block     chan struct{}
	entered   chan struct{}
}

// RecordedBatch is a copy of an applied batch.
type RecordedBatch struct {
	Backend string
	Model   string
	Seq     uint64
	Kinds   []events.Kind
	Hashes  [][]uint64
	Prefix  []string // PrefixOp:hash:tokens of prefix events
}

// NewRecordingSink returns an empty sink.
func NewRecordingSink() *RecordingSink {
	return &RecordingSink{clears: make(map[string]int)}
}

// Apply records b.
func (s *RecordingSink) Apply(ctx context.Context, backend string, b *events.Batch) error {
	s.mu.Lock()
	block, entered, fail := s.block, s.entered, s.fail
	if fail == nil && s.failNext > 0 {
		s.failNext--
		fail = s.failApply
	}
	s.mu.Unlock()
	if block != nil {
		select {
		case entered <- struct{}{}:
		default:
		}
		select {
		case <-block:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if fail != nil {
		return fail
	}
	rb := RecordedBatch{Backend: backend, Model: b.Model, Seq: b.Seq}
	for _, ev := range b.Events {
		rb.Kinds = append(rb.Kinds, ev.Kind)
		rb.Hashes = append(rb.Hashes, slices.Clone(ev.BlockHashes))
		if ev.Kind == events.KindPrefix {
			rb.Prefix = append(rb.Prefix, fmt.Sprintf("%s:%s:%d", ev.PrefixOp, ev.PrefixHash, ev.TokenCount))
		}
	}
	s.mu.Lock()
	s.applied = append(s.applied, rb)
	s.mu.Unlock()
	return nil
}

// FailApplies makes the next n Applies fail with err (ClearBackend still succeeds), as a store
// that lost what it held and says so on the next write.
func (s *RecordingSink) FailApplies(n int, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failNext, s.failApply = n, err
}

// FailClears makes the next n ClearBackend calls fail with err (Apply still succeeds), as a store
// that refuses every call for a while after a connection failure and then takes them again.
func (s *RecordingSink) FailClears(n int, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failClear, s.failApply = n, err
}

// ClearBackend records a clear.
func (s *RecordingSink) ClearBackend(_ context.Context, backend string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fail != nil {
		return s.fail
	}
	if s.failClear > 0 {
		s.failClear--
		return s.failApply
	}
	s.clears[backend]++
	s.applied = append(s.applied, RecordedBatch{Backend: backend, Seq: ^uint64(0)}) // a marker
	return nil
}

// Block makes Apply wait until Unblock; Entered receives when an Apply starts waiting.
func (s *RecordingSink) Block() (entered <-chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.block, s.entered = make(chan struct{}), make(chan struct{}, 1)
	return s.entered
}

// Unblock releases blocked and future Apply calls.
func (s *RecordingSink) Unblock() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.block != nil {
		close(s.block)
		s.block = nil
	}
}

// SetFail makes Apply and ClearBackend return err (nil: succeed again).
func (s *RecordingSink) SetFail(err error) {
	s.mu.Lock()
	s.fail = err
	s.mu.Unlock()
}

// Clears returns how many times backend was cleared.
func (s *RecordingSink) Clears(backend string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.clears[backend]
}

// Applied returns the applied batches of backend (all backends for ""), clears excluded.
func (s *RecordingSink) Applied(backend string) []RecordedBatch {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []RecordedBatch
	for _, b := range s.applied {
		if (backend == "" || b.Backend == backend) && b.Seq != ^uint64(0) {
			out = append(out, b)
		}
	}
	return out
}

// Seqs returns the sequence numbers of backend's applied batches, with -1 for each clear.
func (s *RecordingSink) Seqs(backend string) []int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []int64
	for _, b := range s.applied {
		if b.Backend == backend {
			out = append(out, int64(b.Seq))
		}
	}
	return out
}

var _ events.Sink = (*RecordingSink)(nil)

// ErrSinkDown is a sink failure for tests.
var ErrSinkDown = errors.New("sink down")

// LossSink is a RecordingSink that can lose a backend, as a Redis index whose server restarted
// empty: BackendLost reports it until the next ClearBackend. Safe for concurrent use.
type LossSink struct {
	*RecordingSink
	mu   sync.Mutex
	lost map[string]bool
	asks int
}

// NewLossSink returns an empty sink that has lost nothing.
func NewLossSink() *LossSink {
	return &LossSink{RecordingSink: NewRecordingSink(), lost: map[string]bool{}}
}

// Lose makes BackendLost report backend lost until its next ClearBackend.
func (s *LossSink) Lose(backend string) {
	s.mu.Lock()
	s.lost[backend] = true
	s.mu.Unlock()
}

// BackendLost reports whether backend was lost (Lose) and not cleared since; it counts the asks.
func (s *LossSink) BackendLost(_ context.Context, backend string) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.asks++
	return s.lost[backend], nil
}

// ClearBackend records a clear, as RecordingSink's does, and ends backend's loss.
func (s *LossSink) ClearBackend(ctx context.Context, backend string) error {
	if err := s.RecordingSink.ClearBackend(ctx, backend); err != nil {
		return err
	}
	s.mu.Lock()
	delete(s.lost, backend)
	s.mu.Unlock()
	return nil
}

// Asks returns how many times BackendLost was called.
func (s *LossSink) Asks() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.asks
}

var _ events.LossReporter = (*LossSink)(nil)

// CheckGoroutines returns a function that waits (bounded) until the number of goroutines is
// back to what it was when CheckGoroutines was called, and fails the test otherwise. Goroutines
// whose stack ignore reports true are not counted (nil: all are).
func CheckGoroutines(t testing.TB, ignore func(stack string) bool) func() {
	t.Helper()
	before, _ := countGoroutines(ignore)
	return func() {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		n, dump := countGoroutines(ignore)
		for n > before && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
			n, dump = countGoroutines(ignore)
		}
		if n > before {
			t.Fatalf("goroutines: %d before, %d after Close\n%s", before, n, dump)
		}
	}
}

// countGoroutines counts the goroutines that ignore does not ignore and returns their stacks.
func countGoroutines(ignore func(stack string) bool) (int, string) {
	buf := make([]byte, 4<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var kept []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if ignore == nil || !ignore(g) {
			kept = append(kept, g)
		}
	}
	return len(kept), strings.Join(kept, "\n\n")
}

// CollectInt64 returns every int64 data point reader holds, keyed "name,attr=value,…". It fails
// t when the reader fails or holds a scope other than "github.com/kvroute/kvroute/events", and reports a sum that is
// not monotonic.
func CollectInt64(t testing.TB, reader sdkmetric.Reader) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatalf("collect metrics: %v", err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		if sm.Scope.Name != "github.com/kvroute/kvroute/events" {
			t.Fatalf("metric scope %q, want %q", sm.Scope.Name, "github.com/kvroute/kvroute/events")
		}
		for _, m := range sm.Metrics {
			var points []metricdata.DataPoint[int64]
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				if !d.IsMonotonic {
					t.Errorf("%s: a sum that is not monotonic", m.Name)
				}
				points = d.DataPoints
			case metricdata.Gauge[int64]:
				points = d.DataPoints
			}
			for _, p := range points {
				key := m.Name
				for _, kv := range p.Attributes.ToSlice() {
					key += fmt.Sprintf(",%s=%s", kv.Key, kv.Value.AsString())
				}
				got[key] = p.Value
			}
		}
	}
	return got
}

// LockedBuffer is a log destination safe for concurrent writers.
type LockedBuffer = testenv.LogBuffer
