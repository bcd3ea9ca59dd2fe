package respcache

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeClock is a manual clock for MemoryConfig.Now.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

func newTestMemory(t testing.TB, cfg MemoryConfig) *MemoryStore {
	t.Helper()
	s, err := NewMemory(cfg)
	if err != nil {
		t.Fatalf("NewMemory(%+v) = %v", cfg, err)
	}
	return s
}

// keys returns the keys of the store's single shard from most to least recently used.
func (s *MemoryStore) keys() []string {
	var out []string
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for e := sh.root.next; e != &sh.root; e = e.next {
			out = append(out, e.key)
		}
		sh.mu.Unlock()
	}
	return out
}

func TestNewMemoryConfig(t *testing.T) {
	for _, tc := range []struct {
		name    string
		cfg     MemoryConfig
		wantErr bool
	}{
		{"zero value", MemoryConfig{}, false},
		{"all set", MemoryConfig{Capacity: 10, MaxBytes: 1 << 20, DefaultTTL: time.Second, Now: time.Now, Shards: 2}, false},
		{"negative capacity", MemoryConfig{Capacity: -1}, true},
		{"negative max bytes", MemoryConfig{MaxBytes: -1}, true},
		{"negative ttl", MemoryConfig{DefaultTTL: -time.Second}, true},
		{"negative shards", MemoryConfig{Shards: -1}, true},
		{"more shards than capacity", MemoryConfig{Capacity: 2, Shards: 3}, true},
		{"shards up to capacity", MemoryConfig{Capacity: 3, Shards: 3}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := NewMemory(tc.cfg)
			if tc.wantErr {
				if !errors.Is(err, ErrInvalidConfig) || s != nil {
					t.Fatalf("NewMemory = (%v, %v), want (nil, ErrInvalidConfig)", s, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			want := tc.cfg.Capacity
			if want == 0 {
				want = DefaultCapacity
			}
			total := 0
			for i := range s.shards {
				total += s.shards[i].capacity
			}
			if st := s.Stats(context.Background()); st.Capacity != want || total != want || st.Backend != "memory" {
				t.Fatalf("Stats = %+v, shard capacities sum to %d; want capacity %d", st, total, want)
			}
		})
	}
}

func TestMemoryLRU(t *testing.T) {
	ctx := context.Background()
	type op struct {
		do  string // "set", "get", "del"
		key string
	}
	for _, tc := range []struct {
		name      string
		ops       []op
		wantOrder []string // most recent first
		evictions uint64
	}{
		{"fills up", []op{{"set", "a"}, {"set", "b"}, {"set", "c"}}, []string{"c", "b", "a"}, 0},
		{"evicts least recent", []op{{"set", "a"}, {"set", "b"}, {"set", "c"}, {"set", "d"}}, []string{"d", "c", "b"}, 1},
		{"get refreshes", []op{{"set", "a"}, {"set", "b"}, {"set", "c"}, {"get", "a"}, {"set", "d"}}, []string{"d", "a", "c"}, 1},
		{"overwrite refreshes", []op{{"set", "a"}, {"set", "b"}, {"set", "c"}, {"set", "a"}, {"set", "d"}}, []string{"d", "a", "c"}, 1},
		{"delete frees a slot", []op{{"set", "a"}, {"set", "b"}, {"set", "c"}, {"del", "b"}, {"set", "d"}}, []string{"d", "c", "a"}, 0},
		{"miss changes nothing", []op{{"set", "a"}, {"set", "b"}, {"get", "z"}}, []string{"b", "a"}, 0},
		{"many", []op{{"set", "a"}, {"set", "b"}, {"set", "c"}, {"set", "d"}, {"set", "e"}, {"get", "c"}}, []string{"c", "e", "d"}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newTestMemory(t, MemoryConfig{Capacity: 3})
			for _, o := range tc.ops {
				switch o.do {
				case "set":
					if err := s.Set(ctx, o.key, []byte(o.key), 0); err != nil {
						t.Fatal(err)
					}
				case "get":
					_, _, _ = s.Get(ctx, o.key)
				case "del":
					_ = s.Delete(ctx, o.key)
				}
			}
			if got := s.keys(); strings.Join(got, ",") != strings.Join(tc.wantOrder, ",") {
				t.Errorf("order = %v, want %v", got, tc.wantOrder)
			}
			if st := s.Stats(ctx); st.Evictions != tc.evictions || st.Entries != len(tc.wantOrder) {
				t.Errorf("Stats = %+v, want %d evictions, %d entries", st, tc.evictions, len(tc.wantOrder))
			}
		})
	}
}

func TestMemoryMaxBytes(t *testing.T) {
	ctx := context.Background()
	val := func(n int) []byte { return []byte(strings.Repeat("v", n)) }
	// Each entry: 1-byte key + value + entryOverhead.
	size := func(n int) int64 { return int64(1+n) + entryOverhead }
	t.Run("evicts until under budget", func(t *testing.T) {
		s := newTestMemory(t, MemoryConfig{MaxBytes: 3 * size(100)})
		for _, k := range []string{"a", "b", "c"} {
			if err := s.Set(ctx, k, val(100), 0); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.Set(ctx, "d", val(250), 0); err != nil { // needs two slots' bytes
			t.Fatal(err)
		}
		if got := s.keys(); strings.Join(got, ",") != "d,c" {
			t.Errorf("keys = %v, want [d c]", got)
		}
		st := s.Stats(ctx)
		if st.SizeBytes != size(250)+size(100) || st.Evictions != 2 {
			t.Errorf("Stats = %+v, want size %d, 2 evictions", st, size(250)+size(100))
		}
	})
	t.Run("overwrite accounts the difference", func(t *testing.T) {
		s := newTestMemory(t, MemoryConfig{MaxBytes: 10 * size(100)})
		_ = s.Set(ctx, "a", val(100), 0)
		_ = s.Set(ctx, "a", val(40), 0)
		if st := s.Stats(ctx); st.SizeBytes != size(40) || st.Entries != 1 {
			t.Errorf("Stats = %+v, want size %d", st, size(40))
		}
	})
	t.Run("too large", func(t *testing.T) {
		s := newTestMemory(t, MemoryConfig{MaxBytes: size(100)})
		if err := s.Set(ctx, "a", val(100), 0); err != nil {
			t.Fatalf("an entry of exactly the budget: %v", err)
		}
		err := s.Set(ctx, "a", val(101), 0)
		if !errors.Is(err, ErrTooLarge) {
			t.Fatalf("Set(over budget) = %v, want ErrTooLarge", err)
		}
		if _, ok, _ := s.Get(ctx, "a"); ok {
			t.Error("the key's old value survived a rejected Set")
		}
		if st := s.Stats(ctx); st.SizeBytes != 0 || st.Entries != 0 {
			t.Errorf("Stats = %+v, want empty", st)
		}
	})
	t.Run("no budget", func(t *testing.T) {
		s := newTestMemory(t, MemoryConfig{})
		if err := s.Set(ctx, "a", val(4<<20), 0); err != nil {
			t.Fatal(err)
		}
	})
}

func TestMemoryTTL(t *testing.T) {
	ctx := context.Background()
	t.Run("expired entries are misses removed lazily", func(t *testing.T) {
		clk := newFakeClock()
		s := newTestMemory(t, MemoryConfig{Now: clk.Now})
		_ = s.Set(ctx, "a", []byte("a"), time.Second)
		_ = s.Set(ctx, "b", []byte("b"), time.Minute)
		clk.Advance(time.Second)
		if st := s.Stats(ctx); st.Entries != 2 {
			t.Fatalf("Entries = %d before the lazy removal, want 2", st.Entries)
		}
		if v, ok, err := s.Get(ctx, "a"); ok || v != nil || err != nil {
			t.Fatalf("Get(expired) = (%q, %v, %v)", v, ok, err)
		}
		st := s.Stats(ctx)
		if st.Entries != 1 || st.Misses != 1 || st.Evictions != 0 {
			t.Fatalf("Stats = %+v, want 1 entry, 1 miss, no eviction", st)
		}
	})
	t.Run("set into a full store removes expired entries first", func(t *testing.T) {
		clk := newFakeClock()
		s := newTestMemory(t, MemoryConfig{Capacity: 3, Now: clk.Now})
		_ = s.Set(ctx, "old1", nil, time.Second)
		_ = s.Set(ctx, "live", nil, time.Hour)
		_ = s.Set(ctx, "old2", nil, time.Second)
		_, _, _ = s.Get(ctx, "live") // order: live, old2, old1
		clk.Advance(2 * time.Second)
		_ = s.Set(ctx, "new", nil, time.Hour)
		if got := s.keys(); strings.Join(got, ",") != "new,live" {
			t.Errorf("keys = %v, want [new live]", got)
		}
		if st := s.Stats(ctx); st.Evictions != 0 {
			t.Errorf("Evictions = %d, want 0: removing expired entries is not evicting", st.Evictions)
		}
	})
	t.Run("default ttl", func(t *testing.T) {
		clk := newFakeClock()
		s := newTestMemory(t, MemoryConfig{Now: clk.Now, DefaultTTL: time.Minute})
		_ = s.Set(ctx, "a", nil, 0)
		_ = s.Set(ctx, "b", nil, -1)
		clk.Advance(time.Minute - 1)
		if _, ok, _ := s.Get(ctx, "a"); !ok {
			t.Fatal("entry expired before the default TTL")
		}
		clk.Advance(1)
		for _, k := range []string{"a", "b"} {
			if _, ok, _ := s.Get(ctx, k); ok {
				t.Fatalf("%s alive at the default TTL", k)
			}
		}
	})
	t.Run("huge ttl does not overflow", func(t *testing.T) {
		clk := newFakeClock()
		s := newTestMemory(t, MemoryConfig{Now: clk.Now})
		_ = s.Set(ctx, "a", []byte("x"), time.Duration(1<<63-1))
		clk.Advance(24 * time.Hour)
		if _, ok, _ := s.Get(ctx, "a"); !ok {
			t.Fatal("entry with the largest TTL expired")
		}
	})
}

func TestMemoryStats(t *testing.T) {
	ctx := context.Background()
	s := newTestMemory(t, MemoryConfig{Capacity: 2})
	_ = s.Set(ctx, "ab", []byte("xyz"), 0)
	_, _, _ = s.Get(ctx, "ab")
	_, _, _ = s.Get(ctx, "ab")
	_, _, _ = s.Get(ctx, "zz")
	_ = s.Set(ctx, "b", nil, 0)
	_ = s.Set(ctx, "c", nil, 0)
	want := StoreStats{Backend: "memory", Entries: 2, Capacity: 2, SizeBytes: 2 * (1 + entryOverhead), Evictions: 1, Hits: 2, Misses: 1}
	if got := s.Stats(ctx); got.Backend != want.Backend || got.Entries != want.Entries || got.Capacity != want.Capacity ||
		got.SizeBytes != want.SizeBytes || got.Evictions != want.Evictions || got.Hits != want.Hits || got.Misses != want.Misses {
		t.Fatalf("Stats = %+v, want %+v", got, want)
	}
	if n, _ := s.Clear(ctx); n != 2 {
		t.Fatalf("Clear = %d, want 2", n)
	}
	if got := s.Stats(ctx); got.Entries != 0 || got.SizeBytes != 0 || got.Hits != 2 {
		t.Fatalf("Stats after Clear = %+v: want empty, counters kept", got)
	}
}

func TestMemoryShards(t *testing.T) {
	ctx := context.Background()
	// The shard hash is seeded per process, so shard sizes vary from run to run: 250 per shard
	// leaves room for any imbalance that is not a bug (100 ± 9 expected), so nothing is evicted.
	s := newTestMemory(t, MemoryConfig{Capacity: 2000, Shards: 8})
	for i := range 800 {
		_ = s.Set(ctx, strconv.Itoa(i), []byte{byte(i)}, 0)
	}
	for i := range s.shards {
		if n := len(s.shards[i].m); n < 50 || n > 150 { // beyond ±5 standard deviations
			t.Errorf("shard %d holds %d of 800 keys", i, n)
		}
	}
	for i := range 800 {
		if v, ok, _ := s.Get(ctx, strconv.Itoa(i)); !ok || v[0] != byte(i) {
			t.Fatalf("key %d: (%v, %v)", i, v, ok)
		}
	}
	if st := s.Stats(ctx); st.Entries != 800 || st.Hits != 800 {
		t.Fatalf("Stats = %+v", st)
	}
}

func TestMemoryGetAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates")
	}
	ctx := context.Background()
	for _, shards := range []int{1, 8} {
		s := newTestMemory(t, MemoryConfig{Shards: shards})
		k := KeyOf(benchRequest(1 << 10)).String()
		_ = s.Set(ctx, k, make([]byte, 2048), 0)
		if n := testing.AllocsPerRun(100, func() { _, _, _ = s.Get(ctx, k) }); n != 1 {
			t.Errorf("shards=%d: Get hit allocates %v times, want 1 (the returned copy)", shards, n)
		}
		if n := testing.AllocsPerRun(100, func() { _, _, _ = s.Get(ctx, "absent") }); n != 0 {
			t.Errorf("shards=%d: Get miss allocates %v times, want 0", shards, n)
		}
	}
}
