package events

// Test helpers: a recording Sink, a goroutine-leak check, and what the tests wait with.

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
)

const (
	waitFor = 10 * time.Second
	tick    = 5 * time.Millisecond
)

func statusOf(t *testing.T, c interface{ Status() []SourceStatus }, backend string) SourceStatus {
	t.Helper()
	for _, s := range c.Status() {
		if s.Backend == backend {
			return s
		}
	}
	t.Fatalf("no status for backend %q in %+v", backend, c.Status())
	return SourceStatus{}
}

// RecordingSink is a Sink that records what it receives. Block makes Apply wait until Unblock;
// Fail makes Apply and ClearBackend fail, FailApplies only the next Applies. Safe for concurrent
// use.
type RecordingSink struct {
	mu        sync.Mutex
	applied   []RecordedBatch
	clears    map[string]int
	fail      error
	failNext  int // Applies still to fail with failApply
	failApply error
	block     chan struct{}
	entered   chan struct{}
}

// RecordedBatch is a copy of an applied batch.
type RecordedBatch struct {
	Backend string
	Model   string
	Seq     uint64
	Kinds   []Kind
	Hashes  [][]uint64
	Prefix  []string // PrefixOp:hash:tokens of prefix events
}

// NewRecordingSink returns an empty sink.
func NewRecordingSink() *RecordingSink {
	return &RecordingSink{clears: make(map[string]int)}
}

// Apply records b.
func (s *RecordingSink) Apply(ctx context.Context, backend string, b *Batch) error {
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
		if ev.Kind == KindPrefix {
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

// ClearBackend records a clear.
func (s *RecordingSink) ClearBackend(_ context.Context, backend string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fail != nil {
		return s.fail
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

var _ Sink = (*RecordingSink)(nil)

// errSinkDown is a sink failure for tests.
var errSinkDown = errors.New("sink down")

// CheckGoroutines returns a function that waits (bounded) until the number of goroutines is
// back to what it was when CheckGoroutines was called, and fails the test otherwise.
func CheckGoroutines(t testing.TB) func() {
	t.Helper()
	before, _ := countGoroutines()
	return func() {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		n, dump := countGoroutines()
		for n > before && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
			n, dump = countGoroutines()
		}
		if n > before {
			t.Fatalf("goroutines: %d before, %d after Close\n%s", before, n, dump)
		}
	}
}

// countGoroutines counts the goroutines and returns their stacks.
func countGoroutines() (int, string) {
	buf := make([]byte, 4<<20)
	buf = buf[:runtime.Stack(buf, true)]
	return strings.Count(string(buf), "\n\n") + 1, string(buf)
}
