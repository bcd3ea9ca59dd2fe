package scorer

import (
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

// fakeClock is a manually advanced clock, safe for concurrent use.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Unix(1_700_000_000, 0)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

type load struct{ prefill, decode int }

func loadOfBackend(a *Active, backend string) load {
	p, d := a.Load(backend)
	return load{p, d}
}

func TestNewActive(t *testing.T) {
	if _, err := NewActive(ActiveConfig{MaxAge: -time.Second}); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("negative MaxAge: err = %v, want ErrInvalidConfig", err)
	}
	a, err := NewActive(ActiveConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if a.age() != DefaultMaxAge {
		t.Errorf("MaxAge = %v, want %v", a.age(), DefaultMaxAge)
	}
}

func TestActiveLifecycle(t *testing.T) {
	type op struct {
		kind    string // add, first, done
		id      uint64
		backend string
		keys    []uint64
		cached  int
	}
	type step struct {
		op   op
		want map[string]load
		n    int // Len after the op
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{
			name: "shared prefix counted once",
			steps: []step{
				{op{"add", 1, "a", []uint64{1, 2, 3}, 0}, map[string]load{"a": {3, 3}}, 1},
				{op{"add", 2, "a", []uint64{1, 2, 4}, 2}, map[string]load{"a": {4, 4}}, 2},
				{op{"first", 1, "", nil, 0}, map[string]load{"a": {1, 4}}, 2},
				{op{"first", 1, "", nil, 0}, map[string]load{"a": {1, 4}}, 2},
				{op{"done", 1, "", nil, 0}, map[string]load{"a": {1, 3}}, 1},
				{op{"done", 1, "", nil, 0}, map[string]load{"a": {1, 3}}, 1},
				{op{"done", 2, "", nil, 0}, map[string]load{"a": {0, 0}}, 0},
			},
		},
		{
			name: "backends are separate",
			steps: []step{
				{op{"add", 1, "a", []uint64{1, 2}, 1}, map[string]load{"a": {1, 2}, "b": {0, 0}}, 1},
				{op{"add", 2, "b", []uint64{1, 2}, 0}, map[string]load{"a": {1, 2}, "b": {2, 2}}, 2},
				{op{"done", 2, "", nil, 0}, map[string]load{"a": {1, 2}, "b": {0, 0}}, 1},
			},
		},
		{
			name: "re-adding an id replaces it",
			steps: []step{
				{op{"add", 7, "a", []uint64{1, 2, 3}, 0}, map[string]load{"a": {3, 3}}, 1},
				{op{"add", 7, "b", []uint64{9}, 0}, map[string]load{"a": {0, 0}, "b": {1, 1}}, 1},
				{op{"done", 7, "", nil, 0}, map[string]load{"a": {0, 0}, "b": {0, 0}}, 0},
			},
		},
		{
			name: "cached blocks clamped",
			steps: []step{
				{op{"add", 1, "a", []uint64{1, 2}, 5}, map[string]load{"a": {0, 2}}, 1},
				{op{"add", 2, "a", []uint64{3, 4}, -1}, map[string]load{"a": {2, 4}}, 2},
			},
		},
		{
			name: "duplicate keys within a request",
			steps: []step{
				{op{"add", 1, "a", []uint64{5, 5, 6}, 0}, map[string]load{"a": {3, 2}}, 1},
				{op{"done", 1, "", nil, 0}, map[string]load{"a": {0, 0}}, 0},
			},
		},
		{
			name: "unknown ids are no-ops",
			steps: []step{
				{op{"first", 9, "", nil, 0}, map[string]load{"a": {0, 0}}, 0},
				{op{"done", 9, "", nil, 0}, map[string]load{"a": {0, 0}}, 0},
				{op{"add", 1, "a", nil, 0}, map[string]load{"a": {0, 0}}, 1},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var a Active // the zero value is ready
			for i, s := range tt.steps {
				switch s.op.kind {
				case "add":
					a.Add(s.op.id, s.op.backend, s.op.keys, s.op.cached)
				case "first":
					a.FirstToken(s.op.id)
				case "done":
					a.Done(s.op.id)
				}
				for b, want := range s.want {
					if got := loadOfBackend(&a, b); got != want {
						t.Errorf("step %d (%s %d): Load(%q) = %+v, want %+v", i, s.op.kind, s.op.id, b, got, want)
					}
				}
				if got := a.Len(); got != s.n {
					t.Errorf("step %d: Len = %d, want %d", i, got, s.n)
				}
			}
		})
	}
}

func TestActiveCopiesKeys(t *testing.T) {
	var a Active
	keys := []uint64{1, 2, 3}
	a.Add(1, "a", keys, 0)
	keys[0], keys[1], keys[2] = 7, 8, 9 // the caller reuses its buffer
	a.Add(2, "a", keys, 0)
	if got := loadOfBackend(&a, "a"); got != (load{6, 6}) {
		t.Fatalf("Load = %+v, want {6 6}", got)
	}
	a.Done(1)
	a.Done(2)
	if got := loadOfBackend(&a, "a"); got != (load{}) {
		t.Fatalf("Load after Done = %+v, want zero", got)
	}
}

func TestActiveFill(t *testing.T) {
	var a Active
	a.Add(1, "a", []uint64{1, 2, 3}, 1)
	a.Add(2, "b", []uint64{1}, 0)
	a.FirstToken(2)
	cands := []Candidate{
		{Backend: "a"},
		{Backend: "b"},
		{Backend: "c", ActivePrefillBlocks: 5, ActiveDecodeBlocks: 5}, // stale values are reset
	}
	a.Fill(cands)
	want := [][2]int{{2, 3}, {0, 1}, {0, 0}}
	for i, c := range cands {
		if got := [2]int{c.ActivePrefillBlocks, c.ActiveDecodeBlocks}; got != want[i] {
			t.Errorf("cands[%d] = %v, want %v", i, got, want[i])
		}
	}
}

func TestActiveExpiry(t *testing.T) {
	clk := newFakeClock()
	a, err := NewActive(ActiveConfig{MaxAge: time.Minute, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	a.Add(1, "a", []uint64{1, 2}, 0) // never done
	clk.Advance(30 * time.Second)
	a.Add(2, "a", []uint64{1, 3}, 0)
	a.Add(3, "gone", []uint64{4}, 0)
	a.Done(3)
	clk.Advance(31 * time.Second) // 1 is 61 s old, 2 is 31 s old
	if got := loadOfBackend(a, "a"); got != (load{4, 3}) {
		t.Fatalf("before sweep: Load = %+v, want {4 3} (the sweep runs in Add only)", got)
	}
	a.Add(4, "b", nil, 0)
	if got := loadOfBackend(a, "a"); got != (load{2, 2}) {
		t.Errorf("after sweep: Load = %+v, want {2 2}", got)
	}
	if a.Expired() != 1 || a.Len() != 2 {
		t.Errorf("Expired, Len = %d, %d, want 1, 2", a.Expired(), a.Len())
	}
	a.Done(1) // expired already: no-op
	if got := loadOfBackend(a, "a"); got != (load{2, 2}) {
		t.Errorf("Done of an expired id changed Load: %+v", got)
	}
	a.mu.Lock()
	_, kept := a.backends["gone"]
	a.mu.Unlock()
	if kept {
		t.Error("idle backend not forgotten after MaxAge")
	}
	clk.Advance(2 * time.Minute)
	a.Add(5, "b", nil, 0)
	if a.Expired() != 3 || a.Len() != 1 {
		t.Errorf("Expired, Len = %d, %d, want 3, 1", a.Expired(), a.Len())
	}
	if got := loadOfBackend(a, "a"); got != (load{}) {
		t.Errorf("Load = %+v, want zero", got)
	}
}

func TestActiveConcurrent(t *testing.T) {
	var a Active
	const goroutines, ops = 8, 2000
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 1))
			keys := make([]uint64, 0, 64)
			for i := range ops {
				id := uint64(g)<<32 | uint64(i)
				keys = keys[:0]
				for k := range r.IntN(64) {
					keys = append(keys, uint64(r.IntN(4))<<8|uint64(k)) // shared prefixes
				}
				backend := [...]string{"a", "b", "c"}[r.IntN(3)]
				a.Add(id, backend, keys, r.IntN(len(keys)+1))
				if r.IntN(2) == 0 {
					a.FirstToken(id)
				}
				cands := []Candidate{{Backend: "a"}, {Backend: "b"}}
				a.Fill(cands)
				if cands[0].ActivePrefillBlocks < 0 || cands[0].ActiveDecodeBlocks < 0 {
					t.Errorf("negative load %+v", cands[0])
				}
				a.Done(id)
			}
		})
	}
	wg.Wait()
	for _, b := range []string{"a", "b", "c"} {
		if got := loadOfBackend(&a, b); got != (load{}) {
			t.Errorf("Load(%q) = %+v after all Done, want zero", b, got)
		}
	}
	if a.Len() != 0 {
		t.Errorf("Len = %d, want 0", a.Len())
	}
}

func TestActiveAllocs(t *testing.T) {
	var a Active
	keys := make([]uint64, 512)
	for i := range keys {
		keys[i] = uint64(i) * 0x9E3779B97F4A7C15
	}
	a.Add(1, "warm", keys, 0)
	a.Add(2, "warm", keys, 0)
	a.Done(1)
	a.Done(2)
	id := uint64(10)
	assertNoAllocs(t, func() {
		id++
		a.Add(id, "warm", keys, 100)
		a.FirstToken(id)
		a.Done(id)
	})
	cands := benchCandidates(16, 64)
	cands[0].Backend = "warm"
	assertNoAllocs(t, func() { a.Fill(cands) })
}
