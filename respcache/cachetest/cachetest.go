// Package cachetest is a conformance suite for respcache.CacheStore implementations, in the manner of
// testing/slogtest and testing/fstest: every store in kvroute runs it, and so can a user's own.
//
// Run checks the contract any store must keep; RunOptions adds expiry checks, which need either a
// clock the suite can move (Options.Advance, with a Clock wired into the store) or, for stores whose
// TTL is enforced by a server (Redis), one real-time wait of about 1.2 s (Options.RealTimeTTL):
//
//	func TestMemoryConformance(t *testing.T) {
//		clk := cachetest.NewClock(time.Time{})
//		cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
//			s, err := respcache.NewMemory(respcache.MemoryConfig{Now: clk.Now})
//			if err != nil {
//				t.Fatal(err)
//			}
//			return s
//		}, cachetest.Options{Advance: clk.Advance})
//	}
//
// The factory is called once per subtest and must return an empty store that shares no entries with
// the stores of other subtests (a remote store: a fresh key prefix or bucket folder per call). It
// may register t.Cleanup to close the store. Subtests run one after another, never in parallel, so
// one Clock may serve every store a factory makes.
//
// The suite holds a store to the respcache.CacheStore contract:
//
//   - "miss": Get of an absent key is (nil, false, nil); Delete of an absent key is nil.
//   - "set_get": a Set value reads back equal; the slice Get returns belongs to the caller (changing
//     it changes no later Get) and the slice given to Set is not retained.
//   - "overwrite": a second Set of a key replaces the value (shorter and longer).
//   - "delete": Delete makes the key a miss and leaves other keys alone.
//   - "clear": Clear returns the number of entries it removed, or -1 when the store cannot count,
//     empties the store, and the store stays usable.
//   - "empty": an empty value is a hit of length 0; the empty key either round-trips or its Set
//     fails (then its Get is a miss or an error).
//   - "binary": all 256 byte values, and a large value (1 MiB by default), round-trip.
//   - "ttl": with Options.Advance: an entry lives until its TTL and is a miss after it; ttl ≤ 0 means
//     the store's default TTL (checked to expire when Options.DefaultTTL is set); a Set refreshes the
//     TTL. With Options.RealTimeTTL instead: one entry with a 1 s TTL is a hit at once and a miss
//     1.2 s later. Skipped when neither is set. A store that keeps expiry in metadata and treats an
//     expired entry as a miss (S3) passes: only Get's answer is checked, not the entry's removal.
//   - "concurrent": goroutines mixing Get, Set and Delete on a few keys; a hit must return a value
//     that was Set for that key (run it with -race).
//   - "cancelled_context": with a cancelled ctx every method returns within 5 s, does not panic,
//     and either works or returns an error wrapping context.Canceled; Stats still answers.
//   - "stats": Backend is non-empty; counters are not negative; Entries, when not -1, counts the live
//     entries of a fresh store; Hits and Misses, when the store counts them, count at least the hits
//     and misses the subtest made.
package cachetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/kvroute/kvroute/respcache"
)

// Options tunes RunOptions for a store. The zero value runs every subtest except "ttl".
type Options struct {
	// Advance, when non-nil, moves the clock of every store the factory makes forward by d; the "ttl"
	// subtest then checks expiry without sleeping. Wire a Clock's Now into the store and pass its
	// Advance here. It is called from the test goroutine only.
	Advance func(d time.Duration)

	// RealTimeTTL, used when Advance is nil, checks expiry with one real wait: an entry Set with a 1 s
	// TTL must be a hit at once and a miss 1.2 s later. For stores whose TTL runs on a server's clock
	// (Redis SET PX/EX).
	RealTimeTTL bool

	// DefaultTTL, when > 0 and Advance is set, is the TTL the store applies to a Set with ttl ≤ 0;
	// the suite checks such an entry lives until then and expires after. When 0 the suite only checks
	// that such an entry is stored.
	DefaultTTL time.Duration

	// LargeValueSize is the size of the "large value" case; 0 means 1 MiB.
	LargeValueSize int

	// Goroutines and OpsPerGoroutine size the "concurrent" subtest; 0 means 8 goroutines of 100
	// operations each (4 of 25 under testing.Short).
	Goroutines      int
	OpsPerGoroutine int
}

// Run runs the suite's store-independent subtests against the stores newStore makes: every subtest
// of RunOptions with a zero Options, so "ttl" is skipped. It calls t.Run for each subtest and
// reports failures through t.
func Run(t *testing.T, newStore func(t *testing.T) respcache.CacheStore) {
	t.Helper()
	RunOptions(t, newStore, Options{})
}

// RunOptions runs the whole suite (see the package doc) against the stores newStore makes, one
// fresh store per subtest, with the expiry checks opts allows. Subtests run sequentially.
func RunOptions(t *testing.T, newStore func(t *testing.T) respcache.CacheStore, opts Options) {
	t.Helper()
	if opts.LargeValueSize <= 0 {
		opts.LargeValueSize = 1 << 20
	}
	if opts.Goroutines <= 0 {
		opts.Goroutines = 8
		if testing.Short() {
			opts.Goroutines = 4
		}
	}
	if opts.OpsPerGoroutine <= 0 {
		opts.OpsPerGoroutine = 100
		if testing.Short() {
			opts.OpsPerGoroutine = 25
		}
	}
	s := suite{newStore: newStore, opts: opts}
	for _, tc := range []struct {
		name string
		run  func(*testing.T)
	}{
		{"miss", s.miss},
		{"set_get", s.setGet},
		{"overwrite", s.overwrite},
		{"delete", s.delete},
		{"clear", s.clear},
		{"empty", s.empty},
		{"binary", s.binary},
		{"ttl", s.ttl},
		{"concurrent", s.concurrent},
		{"cancelled_context", s.cancelled},
		{"stats", s.stats},
	} {
		t.Run(tc.name, tc.run)
	}
}

// Clock is a manual clock for stores with an injectable time source (a Now func() time.Time field):
// Now returns the current instant, Advance moves it. It is safe for concurrent use. The zero value
// starts at 2026-01-01T00:00:00Z.
type Clock struct {
	mu  sync.Mutex
	now time.Time
}

// NewClock returns a Clock at start (2026-01-01T00:00:00Z when start is the zero Time).
func NewClock(start time.Time) *Clock {
	c := &Clock{}
	if !start.IsZero() {
		c.now = start
	}
	return c
}

// Now returns the clock's current instant.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.now.IsZero() {
		c.now = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	}
	return c.now
}

// Advance moves the clock forward by d (backward when d < 0).
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.now.IsZero() {
		c.now = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	}
	c.now = c.now.Add(d)
}

type suite struct {
	newStore func(t *testing.T) respcache.CacheStore
	opts     Options
}

const ttlLong = time.Hour

// key returns a realistic store key: 64 hex digits, distinct per name.
func key(name string) string {
	const hexdigits = "0123456789abcdef"
	var b [64]byte
	h := uint64(14695981039346656037)
	for i := 0; i < len(name); i++ {
		h ^= uint64(name[i])
		h *= 1099511628211
	}
	for i := range b {
		h ^= h >> 29
		h *= 0xbf58476d1ce4e5b9
		b[i] = hexdigits[(h>>59)&0xf]
	}
	return string(b[:])
}

func mustSet(t *testing.T, s respcache.CacheStore, k string, v []byte, ttl time.Duration) {
	t.Helper()
	if err := s.Set(context.Background(), k, v, ttl); err != nil {
		t.Fatalf("Set(%.12q, %d bytes, %v) = %v, want nil", k, len(v), ttl, err)
	}
}

func wantHit(t *testing.T, s respcache.CacheStore, k string, want []byte) []byte {
	t.Helper()
	got, ok, err := s.Get(context.Background(), k)
	if err != nil || !ok {
		t.Fatalf("Get(%.12q) = (%d bytes, %v, %v), want a hit", k, len(got), ok, err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("Get(%.12q) = %s, want %s", k, describe(got), describe(want))
	}
	return got
}

func wantMiss(t *testing.T, s respcache.CacheStore, k string) {
	t.Helper()
	got, ok, err := s.Get(context.Background(), k)
	if err != nil || ok || got != nil {
		t.Fatalf("Get(%.12q) = (%s, %v, %v), want (nil, false, nil)", k, describe(got), ok, err)
	}
}

func describe(b []byte) string {
	if b == nil {
		return "nil"
	}
	if len(b) <= 32 {
		return strconv.Quote(string(b))
	}
	return fmt.Sprintf("%d bytes %q…", len(b), b[:16])
}

func (s suite) miss(t *testing.T) {
	st := s.newStore(t)
	wantMiss(t, st, key("absent"))
	if err := st.Delete(context.Background(), key("absent")); err != nil {
		t.Fatalf("Delete(absent) = %v, want nil", err)
	}
	wantMiss(t, st, key("absent"))
}

func (s suite) setGet(t *testing.T) {
	st := s.newStore(t)
	k := key("set_get")
	in := []byte(`{"id":"chatcmpl-1","choices":[{"message":{"content":"hello"}}]}`)
	want := bytes.Clone(in)
	mustSet(t, st, k, in, ttlLong)
	for i := range in { // the store must not keep the caller's slice
		in[i] = 'x'
	}
	got := wantHit(t, st, k, want)
	for i := range got { // the returned slice is the caller's
		got[i] = 'y'
	}
	wantHit(t, st, k, want)
	wantMiss(t, st, key("set_get_other"))
}

func (s suite) overwrite(t *testing.T) {
	st := s.newStore(t)
	k := key("overwrite")
	for _, v := range []string{"first value", "2nd", "a third, longer value than the others", ""} {
		mustSet(t, st, k, []byte(v), ttlLong)
		wantHit(t, st, k, []byte(v))
	}
}

func (s suite) delete(t *testing.T) {
	st := s.newStore(t)
	a, b := key("delete_a"), key("delete_b")
	mustSet(t, st, a, []byte("A"), ttlLong)
	mustSet(t, st, b, []byte("B"), ttlLong)
	if err := st.Delete(context.Background(), a); err != nil {
		t.Fatalf("Delete = %v, want nil", err)
	}
	wantMiss(t, st, a)
	wantHit(t, st, b, []byte("B"))
	if err := st.Delete(context.Background(), a); err != nil {
		t.Fatalf("second Delete = %v, want nil", err)
	}
	mustSet(t, st, a, []byte("A2"), ttlLong)
	wantHit(t, st, a, []byte("A2"))
}

func (s suite) clear(t *testing.T) {
	st := s.newStore(t)
	ctx := context.Background()
	if n, err := st.Clear(ctx); err != nil || (n != 0 && n != -1) {
		t.Fatalf("Clear(empty store) = (%d, %v), want (0 or -1, nil)", n, err)
	}
	const count = 5
	for i := range count {
		mustSet(t, st, key("clear"+strconv.Itoa(i)), []byte("v"+strconv.Itoa(i)), ttlLong)
	}
	n, err := st.Clear(ctx)
	if err != nil || (n != count && n != -1) {
		t.Fatalf("Clear = (%d, %v), want (%d or -1, nil)", n, err, count)
	}
	for i := range count {
		wantMiss(t, st, key("clear"+strconv.Itoa(i)))
	}
	mustSet(t, st, key("after_clear"), []byte("again"), ttlLong)
	wantHit(t, st, key("after_clear"), []byte("again"))
}

func (s suite) empty(t *testing.T) {
	st := s.newStore(t)
	ctx := context.Background()
	t.Run("value", func(t *testing.T) {
		k := key("empty_value")
		for _, v := range [][]byte{{}, nil} {
			mustSet(t, st, k, v, ttlLong)
			got, ok, err := st.Get(ctx, k)
			if err != nil || !ok || len(got) != 0 {
				t.Fatalf("Get(empty value) = (%s, %v, %v), want a hit of length 0", describe(got), ok, err)
			}
		}
	})
	t.Run("key", func(t *testing.T) {
		if err := st.Set(ctx, "", []byte("under the empty key"), ttlLong); err != nil {
			// Rejecting the empty key is allowed; it must then not be found.
			got, ok, gerr := st.Get(ctx, "")
			if ok {
				t.Fatalf("Set(\"\") = %v but Get(\"\") = (%s, true, %v)", err, describe(got), gerr)
			}
			return
		}
		wantHit(t, st, "", []byte("under the empty key"))
		wantMiss(t, st, key("not the empty key"))
		if err := st.Delete(ctx, ""); err != nil {
			t.Fatalf("Delete(\"\") = %v, want nil", err)
		}
		wantMiss(t, st, "")
	})
}

func (s suite) binary(t *testing.T) {
	st := s.newStore(t)
	t.Run("all_bytes", func(t *testing.T) {
		v := make([]byte, 512)
		for i := range v {
			v[i] = byte(i)
		}
		mustSet(t, st, key("binary"), v, ttlLong)
		wantHit(t, st, key("binary"), v)
	})
	t.Run("large", func(t *testing.T) {
		v := make([]byte, s.opts.LargeValueSize)
		x := uint32(2463534242)
		for i := range v {
			x ^= x << 13
			x ^= x >> 17
			x ^= x << 5
			v[i] = byte(x)
		}
		mustSet(t, st, key("large"), v, ttlLong)
		wantHit(t, st, key("large"), v)
	})
}

func (s suite) ttl(t *testing.T) {
	switch {
	case s.opts.Advance != nil:
		s.ttlFake(t)
	case s.opts.RealTimeTTL:
		s.ttlReal(t)
	default:
		t.Skip("cachetest: no Options.Advance and no Options.RealTimeTTL: expiry not checked")
	}
}

func (s suite) ttlFake(t *testing.T) {
	advance := s.opts.Advance
	t.Run("expires", func(t *testing.T) {
		st := s.newStore(t)
		k := key("ttl")
		mustSet(t, st, k, []byte("v"), time.Minute)
		advance(59 * time.Second)
		wantHit(t, st, k, []byte("v"))
		advance(2 * time.Second)
		wantMiss(t, st, k)
		mustSet(t, st, k, []byte("v2"), time.Minute) // an expired key can be set again
		wantHit(t, st, k, []byte("v2"))
	})
	t.Run("per_entry", func(t *testing.T) {
		st := s.newStore(t)
		short, long := key("ttl_short"), key("ttl_long")
		mustSet(t, st, short, []byte("s"), 10*time.Second)
		mustSet(t, st, long, []byte("l"), 10*time.Minute)
		advance(11 * time.Second)
		wantMiss(t, st, short)
		wantHit(t, st, long, []byte("l"))
	})
	t.Run("set_refreshes", func(t *testing.T) {
		st := s.newStore(t)
		k := key("ttl_refresh")
		mustSet(t, st, k, []byte("v1"), time.Minute)
		advance(50 * time.Second)
		mustSet(t, st, k, []byte("v2"), time.Minute)
		advance(50 * time.Second)
		wantHit(t, st, k, []byte("v2"))
		advance(11 * time.Second)
		wantMiss(t, st, k)
	})
	t.Run("default", func(t *testing.T) {
		st := s.newStore(t)
		for _, ttl := range []time.Duration{0, -time.Second} {
			k := key("ttl_default" + ttl.String())
			mustSet(t, st, k, []byte("d"), ttl)
			wantHit(t, st, k, []byte("d"))
		}
		if d := s.opts.DefaultTTL; d > 0 {
			advance(d - time.Second)
			wantHit(t, st, key("ttl_default0s"), []byte("d"))
			advance(2 * time.Second)
			wantMiss(t, st, key("ttl_default0s"))
			wantMiss(t, st, key("ttl_default-1s"))
		}
	})
}

func (s suite) ttlReal(t *testing.T) {
	st := s.newStore(t)
	k, long := key("ttl_real"), key("ttl_real_long")
	mustSet(t, st, long, []byte("l"), ttlLong)
	mustSet(t, st, k, []byte("v"), time.Second)
	wantHit(t, st, k, []byte("v"))
	time.Sleep(1200 * time.Millisecond)
	wantMiss(t, st, k)
	wantHit(t, st, long, []byte("l"))
}

func (s suite) concurrent(t *testing.T) {
	st := s.newStore(t)
	const keys = 8
	var wg sync.WaitGroup
	errc := make(chan error, s.opts.Goroutines)
	for g := range s.opts.Goroutines {
		wg.Go(func() {
			ctx := context.Background()
			for i := range s.opts.OpsPerGoroutine {
				name := "concurrent" + strconv.Itoa((g+i)%keys)
				k := key(name)
				switch (g*7 + i) % 5 {
				case 0, 1:
					v := []byte(name + "/" + strconv.Itoa(g) + "/" + strconv.Itoa(i))
					if err := st.Set(ctx, k, v, ttlLong); err != nil {
						errc <- fmt.Errorf("concurrent Set: %w", err)
						return
					}
				case 2:
					if err := st.Delete(ctx, k); err != nil {
						errc <- fmt.Errorf("concurrent Delete: %w", err)
						return
					}
				default:
					got, ok, err := st.Get(ctx, k)
					if err != nil {
						errc <- fmt.Errorf("concurrent Get: %w", err)
						return
					}
					if ok && !bytes.HasPrefix(got, []byte(name+"/")) {
						errc <- fmt.Errorf("concurrent Get(%s) = %q: not a value Set for that key", name, got)
						return
					}
					if ok && len(got) > 0 {
						got[0] = 0 // the caller owns it: writing must not race with the store
					}
				}
			}
		})
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Error(err)
	}
	mustSet(t, st, key("after"), []byte("ok"), ttlLong)
	wantHit(t, st, key("after"), []byte("ok"))
}

func (s suite) cancelled(t *testing.T) {
	st := s.newStore(t)
	mustSet(t, st, key("present"), []byte("p"), ttlLong)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	check := func(op string, err error) {
		t.Helper()
		if err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("%s with a cancelled ctx = %v, want nil or an error wrapping context.Canceled", op, err)
		}
	}
	for _, tc := range []struct {
		op  string
		run func() error
	}{
		{"Get(present)", func() error {
			v, ok, err := st.Get(ctx, key("present"))
			if err == nil && ok && string(v) != "p" {
				return fmt.Errorf("wrong value %q", v)
			}
			if err != nil && (ok || v != nil) {
				return fmt.Errorf("(%q, %v, %w): an error with a value", v, ok, err)
			}
			return err
		}},
		{"Get(absent)", func() error {
			v, ok, err := st.Get(ctx, key("absent"))
			if ok || v != nil {
				return fmt.Errorf("(%q, %v, %v): a hit on an absent key", v, ok, err)
			}
			return err
		}},
		{"Set", func() error { return st.Set(ctx, key("cancelled_set"), []byte("c"), ttlLong) }},
		{"Delete", func() error { return st.Delete(ctx, key("cancelled_set")) }},
		{"Stats", func() error {
			if ss := st.Stats(ctx); ss.Backend == "" {
				return errors.New("empty Backend")
			}
			return nil
		}},
		{"Clear", func() error {
			n, err := st.Clear(ctx)
			if err == nil && n < -1 {
				return fmt.Errorf("count %d", n)
			}
			return err
		}},
	} {
		done := make(chan error, 1)
		go func() {
			defer func() {
				if r := recover(); r != nil {
					done <- fmt.Errorf("panic: %v", r)
				}
			}()
			done <- tc.run()
		}()
		select {
		case err := <-done:
			check(tc.op, err)
		case <-time.After(5 * time.Second):
			t.Fatalf("%s with a cancelled ctx did not return within 5s", tc.op)
		}
	}
	// The store still works with a live context.
	mustSet(t, st, key("after"), []byte("ok"), ttlLong)
	wantHit(t, st, key("after"), []byte("ok"))
}

func (s suite) stats(t *testing.T) {
	st := s.newStore(t)
	ctx := context.Background()
	check := func(when string, want int) respcache.StoreStats {
		t.Helper()
		got := st.Stats(ctx)
		if got.Backend == "" {
			t.Errorf("%s: Stats().Backend is empty", when)
		}
		if got.Entries < -1 || got.Capacity < 0 || got.SizeBytes < 0 {
			t.Errorf("%s: Stats() = %+v: negative fields", when, got)
		}
		if got.Entries != -1 && got.Entries != want {
			t.Errorf("%s: Stats().Entries = %d, want %d (or -1 when unknown)", when, got.Entries, want)
		}
		return got
	}
	check("fresh store", 0)
	for i := range 3 {
		mustSet(t, st, key("stats"+strconv.Itoa(i)), []byte("value"), ttlLong)
	}
	wantHit(t, st, key("stats0"), []byte("value"))
	wantMiss(t, st, key("stats_absent"))
	got := check("after 3 Sets", 3)
	if got.Hits+got.Misses > 0 && (got.Hits < 1 || got.Misses < 1) {
		t.Errorf("Stats() = hits %d, misses %d after one hit and one miss", got.Hits, got.Misses)
	}
	if err := st.Delete(ctx, key("stats1")); err != nil {
		t.Fatal(err)
	}
	check("after a Delete", 2)
}
