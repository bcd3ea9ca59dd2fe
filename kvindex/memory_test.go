package kvindex

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/prefixkey"
)

const testModel = "test-model"

// testClock is a fake clock for tests.
type testClock struct {
	mu sync.Mutex
	t  time.Time
}

func newTestClock() *testClock { return &testClock{t: time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)} }

func (c *testClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *testClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// newTestIndex returns an index with a fake clock and no sweep goroutine (tests sweep by hand).
func newTestIndex(t testing.TB, cfg MemoryConfig) (*MemoryIndex, *testClock) {
	t.Helper()
	clk := newTestClock()
	if cfg.Now == nil {
		cfg.Now = clk.Now
	}
	if cfg.SweepInterval == 0 {
		cfg.SweepInterval = -1
	}
	if cfg.DefaultModel == "" {
		cfg.DefaultModel = testModel
	}
	m, err := NewMemory(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Close() })
	return m, clk
}

// testTokens returns n deterministic tokens.
func testTokens(seed, n int) []uint32 {
	r := rand.New(rand.NewPCG(uint64(seed), 7))
	out := make([]uint32, n)
	for i := range out {
		out[i] = r.Uint32N(128000)
	}
	return out
}

func testKeys(toks []uint32) []uint64 {
	return prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot(testModel, ""), toks, DefaultBlockSize, nil)
}

// storeChain makes backend hold the 16-token blocks of toks, engine hashes base+i, in events of
// at most 16 blocks, each chained to the previous one.
func storeChain(t testing.TB, m *MemoryIndex, backend string, toks []uint32, base uint64, tier events.Tier) {
	t.Helper()
	n := len(toks) / 16
	for start := 0; start < n; start += 16 {
		end := min(start+16, n)
		hs := make([]uint64, end-start)
		for i := range hs {
			hs[i] = base + uint64(start+i)
		}
		ev := events.Event{Kind: events.KindBlockStored, BlockHashes: hs, TokenIDs: toks[start*16 : end*16], BlockSize: 16, Tier: tier}
		if start > 0 {
			ev.Parent, ev.HasParent = base+uint64(start-1), true
		}
		if err := m.Apply(context.Background(), backend, &events.Batch{Model: testModel, Events: []events.Event{ev}}); err != nil {
			t.Fatal(err)
		}
	}
}

func blocksOf(t testing.TB, m *MemoryIndex, keys []uint64, names ...string) []int {
	t.Helper()
	out := make([]Match, len(names))
	res, err := m.Lookup(context.Background(), keys, names, out)
	if err != nil {
		t.Fatal(err)
	}
	got := make([]int, len(res))
	for i, r := range res {
		got[i] = r.Blocks
	}
	return got
}

// checkConsistency verifies the table invariants (ordered runs, every word at or after its home,
// bodies naming their words' fingerprints) and that the counters match the table's bits.
func checkConsistency(t testing.TB, m *MemoryIndex) {
	t.Helper()
	var members, specs [MaxMemoryBackends]int64
	blocks := 0
	retired := m.reg.retired.Load()
	for si := range m.shards {
		sh := &m.shards[si]
		sh.mu.Lock()
		tb := sh.tab.Load()
		prev := uint64(0)
		live := 0
		for p := range uint64(len(tb.keys)) {
			w := tb.keys[p].Load()
			if w == 0 {
				prev = 0
				continue
			}
			live++
			if tb.home(w) > p {
				t.Errorf("shard %d: word at %d before its home %d", si, p, tb.home(w))
			}
			if prev != 0 && w <= prev {
				t.Errorf("shard %d: run not sorted at %d", si, p)
			}
			prev = w
			b := tb.body(w)
			v := b.load()
			if !b.live() {
				t.Errorf("shard %d: word %x names a free body", si, w)
			}
			if pos, _ := tb.find(fullKey(w, b)); pos != int(p) {
				t.Errorf("shard %d: find(%x) = %d, want %d", si, fullKey(w, b), pos, p)
			}
			for x := (v.confirmed() | v.spec) &^ retired; x != 0; x &= x - 1 {
				members[bits.TrailingZeros64(x)]++
			}
			for x := v.spec &^ retired; x != 0; x &= x - 1 {
				specs[bits.TrailingZeros64(x)]++
			}
		}
		if live != sh.count || int64(live) != sh.blocks.Load() {
			t.Errorf("shard %d: %d live words, count %d, blocks %d", si, live, sh.count, sh.blocks.Load())
		}
		// Every cold part is either free or named by exactly one live body that needs it.
		colds := map[uint64]bool{}
		for _, ci := range sh.coldFree {
			colds[uint64(ci)] = true
		}
		if len(colds) != len(sh.coldFree) {
			t.Errorf("shard %d: a cold part freed twice", si)
		}
		for w, b := range tb.blocks(0) {
			v := b.load()
			ci, has := b.coldIndex()
			if _, needs := v.layout(); has != needs {
				t.Errorf("shard %d: block %x has a cold part: %v, needs one: %v", si, fullKey(w, b), has, needs)
			}
			if !has {
				continue
			}
			if colds[ci] || ci >= uint64(sh.coldUsed) {
				t.Errorf("shard %d: block %x names cold part %d, free or shared or past %d", si, fullKey(w, b), ci, sh.coldUsed)
			}
			colds[ci] = true
		}
		if len(colds) != int(sh.coldUsed) {
			t.Errorf("shard %d: %d cold parts accounted for, %d handed out", si, len(colds), sh.coldUsed)
		}
		blocks += live
		sh.mu.Unlock()
	}
	// The shared engine-hash map: group entries of two holders or more, and no mapping of an id
	// neither live nor retired (a free id's next backend must not inherit one).
	var known uint64 = retired
	for _, bs := range m.reg.active() {
		known |= 1 << bs.id
	}
	for i := range m.engines.shards {
		s := &m.engines.shards[i]
		s.mu.Lock()
		for _, e := range s.own.slots {
			if id := e.h & 0xff; e.h != 0 && (id == 0 || id > MaxMemoryBackends || known&(1<<(id-1)) == 0) {
				t.Errorf("shared map: own entry %x of id %d, not live nor retired", e.h, int(id)-1)
			}
		}
		for _, g := range s.group.slots {
			if g.tag != 0 && (bits.OnesCount64(g.holders) < 2 || g.holders&^known != 0) {
				t.Errorf("shared map: group entry %x holders %x (live or retired: %x)", g.tag, g.holders, known)
			}
		}
		s.mu.Unlock()
	}
	for _, bs := range m.reg.active() {
		if got, want := m.ids[bs.id].members.Load(), members[bs.id]; got != want {
			t.Errorf("backend %s: members counter %d, table %d", bs.name, got, want)
		}
		if got, want := m.ids[bs.id].specs.Load(), specs[bs.id]; got != want {
			t.Errorf("backend %s: specs counter %d, table %d", bs.name, got, want)
		}
	}
}

func TestMemoryConfigValidation(t *testing.T) {
	tests := []struct {
		name string
		cfg  MemoryConfig
		ok   bool
	}{
		{"zero value", MemoryConfig{}, true},
		{"all set", MemoryConfig{BlockSize: 32, MaxEntries: 1000, EntryTTL: time.Minute, SweepInterval: -1,
			SpeculativeTTL: time.Second, ApproximateCapacityBlocks: 10, MaxBackends: 8, MaxPrefixEntries: 100,
			LookupStride: 16, TierWeights: TierWeights{1, 0.5, 0.25}}, true},
		{"negative block size", MemoryConfig{BlockSize: -1}, false},
		{"negative max entries", MemoryConfig{MaxEntries: -5}, false},
		{"too many entries", MemoryConfig{MaxEntries: 1 << 40}, false},
		{"negative TTL", MemoryConfig{EntryTTL: -time.Second}, false},
		{"TTL too long", MemoryConfig{EntryTTL: MaxTTL + time.Hour}, false},
		{"negative speculative TTL", MemoryConfig{SpeculativeTTL: -1}, false},
		{"negative approximate capacity", MemoryConfig{ApproximateCapacityBlocks: -1}, false},
		{"65 backends", MemoryConfig{MaxBackends: 65}, false},
		{"negative backends", MemoryConfig{MaxBackends: -1}, false},
		{"negative prefix entries", MemoryConfig{MaxPrefixEntries: -1}, false},
		{"negative stride", MemoryConfig{LookupStride: -1}, false},
		{"weight above 1", MemoryConfig{TierWeights: TierWeights{1.5, 0.8, 0.6}}, false},
		{"negative weight", MemoryConfig{TierWeights: TierWeights{1, -0.1, 0.6}}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.SweepInterval = min(tc.cfg.SweepInterval, -1)
			m, err := NewMemory(tc.cfg)
			if tc.ok {
				if err != nil {
					t.Fatalf("NewMemory: %v", err)
				}
				_ = m.Close()
				return
			}
			if !errors.Is(err, ErrInvalidConfig) {
				t.Fatalf("NewMemory = %v, want an error wrapping ErrInvalidConfig", err)
			}
		})
	}
	m, err := NewMemory(MemoryConfig{SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	c := m.cfg
	if c.BlockSize != DefaultBlockSize || c.MaxEntries != DefaultMaxEntries || c.EntryTTL != DefaultEntryTTL ||
		c.SpeculativeTTL != DefaultSpeculativeTTL || c.TierWeights != DefaultTierWeights() ||
		c.MaxBackends != DefaultMaxBackends || c.MaxPrefixEntries != DefaultMaxPrefixEntries {
		t.Errorf("defaults not applied: %+v", c)
	}
}

// TestTableRandomOps drives one backend's memberships through random stores and removals,
// across resizes, evictions and shrinks, against a reference set.
func TestTableRandomOps(t *testing.T) {
	for _, maxEntries := range []int{64, 5000, 1 << 16} {
		t.Run(fmt.Sprintf("maxentries=%d", maxEntries), func(t *testing.T) {
			m, _ := newTestIndex(t, MemoryConfig{MaxEntries: maxEntries})
			bs := m.acquire("a")
			defer bs.life.RUnlock()
			r := rand.New(rand.NewPCG(1, 2))
			ref := map[uint64]bool{}
			keys := make([]uint64, 3000)
			for i := range keys {
				keys[i] = r.Uint64()
			}
			keys[0] = 0 // the key that mixes to the empty marker's neighbourhood
			for step := range 20000 {
				k := keys[r.IntN(len(keys))]
				c := m.clock()
				h := mix(k)
				sh := m.lockShard(h, &c)
				if r.IntN(3) > 0 {
					m.addConfirmed(sh, h, 0, bs.id, events.TierGPU, 0, c)
					ref[k] = true
				} else {
					m.removeTier(sh, h, bs.id, events.TierGPU, c)
					delete(ref, k)
				}
				sh.mu.Unlock()
				if step%2000 == 1999 {
					checkConsistency(t, m)
					m.sweep()
				}
			}
			checkConsistency(t, m)
			// Evictions may have dropped some: the table holds a subset of ref, within its limit.
			held := 0
			for k := range ref {
				if _, ok := m.shardOf(mix(k)).read(mix(k)); ok {
					held++
				}
			}
			s, _ := m.Stats(context.Background())
			if s.Blocks != held || s.Blocks > maxEntries {
				t.Errorf("Blocks %d, found %d of %d stored, MaxEntries %d", s.Blocks, held, len(ref), maxEntries)
			}
			if maxEntries >= len(keys) && held != len(ref) {
				t.Errorf("no eviction expected: %d of %d held", held, len(ref))
			}
		})
	}
}

// TestBodyLayouts drives blocks through every layout of their bodies (GPU holders only,
// speculative holders only, a cold part for the other tiers and for speculative holders beside
// confirmed ones) by random stores, removals and speculations of three backends, against a
// reference, across sweeps that compact the cold parts.
func TestBodyLayouts(t *testing.T) {
	for _, maxEntries := range []int{1000, 1 << 16} {
		t.Run(fmt.Sprintf("maxentries=%d", maxEntries), func(t *testing.T) {
			m, _ := newTestIndex(t, MemoryConfig{MaxEntries: maxEntries, SpeculativeTTL: time.Hour})
			var ids [3]uint8
			for i := range ids {
				bs := m.acquire(fmt.Sprintf("b%d", i))
				defer bs.life.RUnlock()
				ids[i] = bs.id
			}
			r := rand.New(rand.NewPCG(9, 10))
			type block struct {
				tiers         [events.NumTiers]uint64
				spec, parentH uint64
			}
			ref := map[uint64]*block{}
			keys := make([]uint64, 400)
			for i := range keys {
				keys[i] = mix(r.Uint64())
			}
			for step := range 30000 {
				h := keys[r.IntN(len(keys))]
				parent := keys[r.IntN(len(keys))]
				if r.IntN(4) == 0 {
					parent = 0
				}
				id := ids[r.IntN(len(ids))]
				bit := uint64(1) << id
				tier := events.Tier(r.IntN(int(events.NumTiers)))
				c := m.clock()
				sh := m.lockShard(h, &c)
				b := ref[h]
				switch op := r.IntN(10); {
				case op < 4:
					m.addConfirmed(sh, h, parent, id, tier, 0, c)
					if b == nil {
						b = &block{parentH: parent}
						ref[h] = b
					} else if parent != 0 {
						b.parentH = parent
					}
					b.tiers[tier] |= bit
					b.spec &^= bit
				case op < 7:
					m.removeTier(sh, h, id, tier, c)
					if b != nil {
						b.tiers[tier] &^= bit
					}
				case op < 9:
					m.speculate(sh, h, parent, id, c.now+1000, c)
					switch {
					case b == nil:
						ref[h] = &block{spec: bit, parentH: parent}
					case (b.tiers[0]|b.tiers[1]|b.tiers[2])&bit == 0:
						b.spec |= bit
						if b.parentH == 0 {
							b.parentH = parent
						}
					}
				default:
					m.unspeculate(sh, h, id)
					if b != nil {
						b.spec &^= bit
					}
				}
				if b := ref[h]; b != nil && b.tiers[0]|b.tiers[1]|b.tiers[2]|b.spec == 0 {
					delete(ref, h)
				}
				sh.mu.Unlock()
				if step%3000 == 2999 {
					checkConsistency(t, m)
					m.sweep()
					checkConsistency(t, m)
				}
			}
			for _, h := range keys {
				v, ok := m.shardOf(h).read(h)
				b := ref[h]
				if ok != (b != nil) {
					t.Fatalf("block %x: present %v, want %v", h, ok, b != nil)
				}
				if ok && (v.tiers != b.tiers || v.spec != b.spec || v.parent != b.parentH) {
					t.Errorf("block %x: tiers %x spec %x parent %x; want %x %x %x", h, v.tiers, v.spec, v.parent,
						b.tiers, b.spec, b.parentH)
				}
			}
		})
	}
}

func TestEngineMapRandomOps(t *testing.T) {
	var e engineMap
	ref := map[uint64]uint64{}
	r := rand.New(rand.NewPCG(3, 4))
	hs := make([]uint64, 5000)
	for i := range hs {
		hs[i] = mix(uint64(i) + 1)
	}
	for step := range 50000 {
		h := hs[r.IntN(len(hs))]
		switch r.IntN(4) {
		case 0:
			if got := e.del(h); got != (ref[h] != 0) {
				t.Fatalf("step %d: del = %v", step, got)
			}
			delete(ref, h)
		default:
			v := r.Uint64() | 1
			e.put(h, v)
			ref[h] = v
		}
		if step%5000 == 0 {
			e.retain(func(_, key uint64) bool { return key%3 != 0 })
			for h, v := range ref {
				if v%3 == 0 {
					delete(ref, h)
				}
			}
		}
	}
	if e.count != len(ref) {
		t.Fatalf("count %d, want %d", e.count, len(ref))
	}
	for _, h := range hs {
		got, ok := e.get(h)
		if want, in := ref[h]; ok != in || got != want {
			t.Fatalf("get(%x) = %d, %v; want %d, %v", h, got, ok, want, in)
		}
	}
}

func TestKthLargest(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for range 200 {
		n := 1 + r.IntN(300)
		a := make([]uint32, n)
		for i := range a {
			a[i] = r.Uint32N(50)
		}
		k := 1 + r.IntN(n)
		sorted := slices.Clone(a)
		slices.Sort(sorted)
		if got, want := kthLargest(a, k), sorted[n-k]; got != want {
			t.Fatalf("kthLargest(k=%d) = %d, want %d", k, got, want)
		}
	}
}

// TestLookupJumpMatchesExact checks that the jump search (LookupStride) agrees with the exact scan
// when holdings are prefixes, as engines' evictions leave them, including tier changes along a
// chain that only slow down, and copies of a prefix on the storage tier (Match.StoredBlocks), some
// followed by blocks on storage only.
func TestLookupJumpMatchesExact(t *testing.T) {
	m, _ := newTestIndex(t, MemoryConfig{})
	r := rand.New(rand.NewPCG(7, 8))
	names := []string{"a", "b", "c", "d", "e"}
	chains := make([][]uint32, 6)
	for i := range chains {
		chains[i] = testTokens(100+i, (50+r.IntN(150))*16)
	}
	for i, toks := range chains {
		for j, name := range names {
			n := r.IntN(len(toks)/16 + 1) // a prefix of the chain
			if n == 0 {
				continue
			}
			base := uint64(i*10000 + j*1000)
			storeChain(t, m, name, toks[:n*16], base, events.TierGPU)
			if cpu := r.IntN(n + 1); cpu < n && r.IntN(2) == 0 {
				// Offloaded tail: the last n-cpu blocks move to CPU.
				storeChain(t, m, name, toks[:n*16], base, events.TierCPU)
				hs := make([]uint64, 0, n-cpu)
				for b := cpu; b < n; b++ {
					hs = append(hs, base+uint64(b))
				}
				if err := m.Apply(context.Background(), name, &events.Batch{Events: []events.Event{{
					Kind: events.KindBlockRemoved, BlockHashes: hs, Tier: events.TierGPU}}}); err != nil {
					t.Fatal(err)
				}
			}
			if r.IntN(3) == 0 {
				continue // nothing on storage
			}
			stored := r.IntN(n + 1)
			if stored == n && n < len(toks)/16 && r.IntN(2) == 0 {
				// The whole prefix written to storage, followed by blocks on storage only.
				stored = n + 1 + r.IntN(len(toks)/16-n)
			}
			if stored > 0 {
				storeChain(t, m, name, toks[:stored*16], base, events.TierStorage)
			}
		}
	}
	storing := 0 // lookups in which some candidate holds a stored prefix
	longer := 0  // of them, where one's stored prefix is shorter than its match
	ctx := context.Background()
	exact := make([]Match, len(names))
	jump := make([]Match, len(names))
	for _, toks := range chains {
		keys := testKeys(toks)
		for _, n := range []int{1, 7, 16, 17, 33, len(keys)} {
			n = min(n, len(keys))
			for _, stride := range []int{4, 16, 32} {
				m.cfg.LookupStride = 1
				if _, err := m.Lookup(ctx, keys[:n], names, exact); err != nil {
					t.Fatal(err)
				}
				m.cfg.LookupStride = stride
				if _, err := m.Lookup(ctx, keys[:n], names, jump); err != nil {
					t.Fatal(err)
				}
				if !slices.Equal(exact, jump) {
					t.Fatalf("stride %d, %d keys: jump %v, exact %v", stride, n, jump, exact)
				}
				for i, x := range exact {
					if x.StoredBlocks > x.Blocks || x.StoredTokens != 16*x.StoredBlocks {
						t.Fatalf("%d keys, %s: stored prefix %+v exceeds the match", n, names[i], x)
					}
					if x.StoredBlocks > 0 {
						storing++
						if x.StoredBlocks < x.Blocks {
							longer++
						}
					}
				}
			}
		}
	}
	if storing == 0 || longer == 0 {
		t.Fatalf("the random holdings exercise no stored prefix (%d) or none shorter than its match (%d)", storing, longer)
	}
	m.cfg.LookupStride = 1

	// A hole strictly between two probes is what the jump search cannot see.
	toks := testTokens(200, 64*16)
	keys := testKeys(toks)
	storeChain(t, m, "h", toks, 50000, events.TierGPU)
	if err := m.Apply(ctx, "h", &events.Batch{Events: []events.Event{{
		Kind: events.KindBlockRemoved, BlockHashes: []uint64{50000 + 5}}}}); err != nil {
		t.Fatal(err)
	}
	if got := blocksOf(t, m, keys, "h"); got[0] != 5 {
		t.Errorf("exact lookup over a hole at 5: %d blocks", got[0])
	}
	m.cfg.LookupStride = 16
	if got := blocksOf(t, m, keys, "h"); got[0] != 64 {
		t.Errorf("jump lookup over a hole at 5: %d blocks (the documented approximation says 64)", got[0])
	}

	// But a window refined for a tier change shows its hole, on the storage tier too: GPU and
	// storage copies of 64 blocks, blocks 20.. freed from GPU, block 25 from both.
	storeChain(t, m, "s", toks, 60000, events.TierGPU)
	storeChain(t, m, "s", toks, 60000, events.TierStorage)
	var freed []uint64
	for b := 20; b < 64; b++ {
		freed = append(freed, 60000+uint64(b))
	}
	if err := m.Apply(ctx, "s", &events.Batch{Events: []events.Event{
		{Kind: events.KindBlockRemoved, BlockHashes: freed, Tier: events.TierGPU},
		{Kind: events.KindBlockRemoved, BlockHashes: []uint64{60025}, Tier: events.TierStorage},
	}}); err != nil {
		t.Fatal(err)
	}
	for _, stride := range []int{1, 16} {
		m.cfg.LookupStride = stride
		got := make([]Match, 1)
		if _, err := m.Lookup(ctx, keys, []string{"s"}, got); err != nil {
			t.Fatal(err)
		}
		if got[0].Blocks != 25 || got[0].StoredBlocks != 25 || got[0].Tier != events.TierStorage {
			t.Errorf("stride %d, hole at 25 after a tier change at 20: %+v, want 25 blocks, 25 stored, on storage", stride, got[0])
		}
	}
	m.cfg.LookupStride = 1
}

// TestFloodBounded floods the index with 10× MaxEntries blocks from 8 backends, no removals: the
// table stays within MaxEntries and the memory stops growing (dangling engine-map entries are
// pruned).
func TestFloodBounded(t *testing.T) {
	const maxEntries = 4096
	m, _ := newTestIndex(t, MemoryConfig{MaxEntries: maxEntries})
	ctx := context.Background()
	flood := func(round int) Stats {
		for i := range 8 {
			toks := testTokens(round*100+i, 10*maxEntries/8*16)
			storeChain(t, m, fmt.Sprintf("b%d", i), toks, uint64(round)<<32|uint64(i)<<24, events.TierGPU)
		}
		s, _ := m.Stats(ctx)
		return s
	}
	first := flood(1)
	second := flood(2)
	for i, s := range []Stats{first, second} {
		if s.Blocks > maxEntries {
			t.Errorf("round %d: %d blocks > MaxEntries %d", i+1, s.Blocks, maxEntries)
		}
		if s.Evictions == 0 {
			t.Errorf("round %d: no evictions", i+1)
		}
	}
	// Bound: the table (≤ 8 B × probe slots + 56 B × bodies) and 8 engine maps of at most a few
	// times their live size plus the pruning floor.
	bound := int64(maxEntries*(8*2+bodyBytes*2) + 8*(4*minPrune)*16*2)
	if second.MemoryBytes > bound || second.MemoryBytes > first.MemoryBytes*3/2 {
		t.Errorf("MemoryBytes after 10× and 20× MaxEntries: %d, %d (bound %d)", first.MemoryBytes, second.MemoryBytes, bound)
	}
	checkConsistency(t, m)
	// The latest chain's tail is still there: eviction takes the oldest.
	toks := testTokens(2*100+7, 10*maxEntries/8*16)
	keys := testKeys(toks)
	if got := blocksOf(t, m, keys[len(keys)-8:], "b7"); got[0] != 8 {
		t.Errorf("newest blocks evicted: %v", got)
	}
}

// TestEvidenceRefresh: a hot prefix that the engine keeps without re-announcing stays fresh while
// its continuations are stored; an idle chain expires.
func TestEvidenceRefresh(t *testing.T) {
	m, clk := newTestIndex(t, MemoryConfig{EntryTTL: time.Minute})
	ctx := context.Background()
	prefix := testTokens(1, 64*16)
	storeChain(t, m, "a", prefix, 0, events.TierGPU) // blocks 0..63, hashes 0..63
	idle := testTokens(2, 8*16)
	storeChain(t, m, "a", idle, 5000, events.TierGPU) // another chain, never continued
	clk.Advance(40 * time.Second)
	// A continuation of the prefix: a child of block 63.
	more := testTokens(3, 4*16)
	ev := events.Event{Kind: events.KindBlockStored, BlockHashes: []uint64{100, 101, 102, 103},
		TokenIDs: more, BlockSize: 16, Parent: 63, HasParent: true}
	if err := m.Apply(ctx, "a", &events.Batch{Model: testModel, Events: []events.Event{ev}}); err != nil {
		t.Fatal(err)
	}
	clk.Advance(40 * time.Second) // 80 s after the prefix was stored, 40 s after its continuation
	m.sweep()
	all := testKeys(append(slices.Clone(prefix), more...))
	if got := blocksOf(t, m, all, "a"); got[0] != 68 {
		t.Errorf("refreshed chain: %d blocks, want 68", got[0])
	}
	if got := blocksOf(t, m, testKeys(idle), "a"); got[0] != 0 {
		t.Errorf("idle chain: %d blocks, want 0 (expired)", got[0])
	}
	clk.Advance(time.Minute + 2*time.Second)
	if got := blocksOf(t, m, all, "a"); got[0] != 0 {
		t.Errorf("after a TTL without events: %d blocks, want 0", got[0])
	}
	checkConsistency(t, m)
}

// TestClearBackendReclaim: ClearBackend retires the id at once; the sweep frees it; a new backend
// beyond MaxBackends reclaims synchronously.
func TestClearBackendReclaim(t *testing.T) {
	m, _ := newTestIndex(t, MemoryConfig{MaxBackends: 2})
	ctx := context.Background()
	toks := testTokens(1, 8*16)
	keys := testKeys(toks)
	storeChain(t, m, "a", toks, 0, events.TierGPU)
	storeChain(t, m, "b", toks[:4*16], 0, events.TierGPU)
	storeChain(t, m, "c", toks, 0, events.TierGPU) // no id left: dropped
	s, _ := m.Stats(ctx)
	if s.Dropped["too_many_backends"] == 0 || s.PerBackend["c"] != 0 {
		t.Errorf("third backend of 2: %+v", s)
	}
	if err := m.ClearBackend(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if got := blocksOf(t, m, keys, "a", "b"); got[0] != 0 || got[1] != 4 {
		t.Errorf("after ClearBackend(a): %v", got)
	}
	// c takes a's id: the registration reclaims it synchronously.
	storeChain(t, m, "c", toks[:2*16], 0, events.TierGPU)
	if got := blocksOf(t, m, keys, "a", "b", "c"); got[0] != 0 || got[1] != 4 || got[2] != 2 {
		t.Errorf("after c reused a's id: %v", got)
	}
	s, _ = m.Stats(ctx)
	if s.Blocks != 4 || s.Entries != 6 {
		t.Errorf("after reclaim: Blocks %d (want 4), Entries %d (want 6)", s.Blocks, s.Entries)
	}
	checkConsistency(t, m)
}

func TestIdleBackendReleased(t *testing.T) {
	m, clk := newTestIndex(t, MemoryConfig{EntryTTL: time.Minute})
	ctx := context.Background()
	toks := testTokens(1, 4*16)
	storeChain(t, m, "gone", testTokens(2, 4*16), 0, events.TierGPU) // its own blocks: stamps are per block
	storeChain(t, m, "stays", toks, 0, events.TierGPU)
	clk.Advance(45 * time.Second)
	storeChain(t, m, "stays", toks, 0, events.TierGPU)
	clk.Advance(30 * time.Second)
	m.sweep() // "gone" expires: it holds nothing
	m.sweep() // and, idle for a TTL, gives its id back
	s, _ := m.Stats(ctx)
	if _, ok := s.PerBackend["gone"]; ok {
		t.Errorf("idle empty backend still registered: %v", s.PerBackend)
	}
	if s.PerBackend["stays"] != 4 {
		t.Errorf("active backend: %v", s.PerBackend)
	}
}

func TestApproximateCapacity(t *testing.T) {
	m, _ := newTestIndex(t, MemoryConfig{ApproximateCapacityBlocks: 8})
	ctx := context.Background()
	reqs := make([][]uint64, 3)
	for i := range reqs {
		reqs[i] = testKeys(testTokens(10+i, 4*16))
		if err := m.Speculate(ctx, "a", reqs[i], DefaultApproximateTTL); err != nil {
			t.Fatal(err)
		}
	}
	want := []int{0, 4, 4} // 12 speculative blocks, cap 8: the first request's go first
	for i, keys := range reqs {
		if got := blocksOf(t, m, keys, "a"); got[0] != want[i] {
			t.Errorf("request %d: %d blocks, want %d", i, got[0], want[i])
		}
	}
	s, _ := m.Stats(ctx)
	if s.SpeculativeCount != 8 {
		t.Errorf("SpeculativeCount %d, want 8", s.SpeculativeCount)
	}
	// Re-speculating held keys changes nothing; confirmed blocks leave the speculative count.
	if err := m.Speculate(ctx, "a", reqs[2], 0); err != nil {
		t.Fatal(err)
	}
	checkConsistency(t, m)
}

func TestPrefixEntriesEvicted(t *testing.T) {
	m, clk := newTestIndex(t, MemoryConfig{MaxPrefixEntries: 10})
	ctx := context.Background()
	for i := range 25 {
		clk.Advance(time.Second)
		ev := events.Event{Kind: events.KindPrefix, PrefixOp: events.PrefixCreated, PrefixHash: fmt.Sprintf("p%02d", i), TokenCount: 64}
		if err := m.Apply(ctx, "a", &events.Batch{Events: []events.Event{ev}}); err != nil {
			t.Fatal(err)
		}
	}
	s, _ := m.Stats(ctx)
	if s.PrefixCount > 10 || s.PrefixCount < 9 {
		t.Errorf("PrefixCount %d, want ≤ 10", s.PrefixCount)
	}
	out := make([]Match, 1)
	if res, _ := m.LookupPrefix(ctx, "p24", []string{"a"}, out); res[0].Tokens != 64 {
		t.Errorf("newest prefix evicted: %+v", res[0])
	}
	if res, _ := m.LookupPrefix(ctx, "p00", []string{"a"}, out); res[0].Tokens != 0 {
		t.Errorf("oldest prefix kept: %+v", res[0])
	}
}

func TestCloseIdempotent(t *testing.T) {
	m, err := NewMemory(MemoryConfig{SweepInterval: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Millisecond) // let the sweep run
	for range 2 {
		if err := m.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
	}
	ctx := context.Background()
	out := make([]Match, 1)
	checks := []struct {
		name string
		err  error
	}{
		{"Apply", m.Apply(ctx, "a", &events.Batch{Events: []events.Event{{Kind: events.KindAllBlocksCleared}}})},
		{"ClearBackend", m.ClearBackend(ctx, "a")},
		{"Speculate", m.Speculate(ctx, "a", []uint64{1}, 0)},
	}
	_, err = m.Lookup(ctx, []uint64{1}, []string{"a"}, out)
	checks = append(checks, struct {
		name string
		err  error
	}{"Lookup", err})
	_, err = m.Clear(ctx)
	checks = append(checks, struct {
		name string
		err  error
	}{"Clear", err})
	for _, c := range checks {
		if !errors.Is(c.err, ErrClosed) {
			t.Errorf("%s after Close: %v, want ErrClosed", c.name, c.err)
		}
	}
	if _, err := m.Stats(ctx); err != nil {
		t.Errorf("Stats after Close: %v", err)
	}
}

func TestLookupAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates")
	}
	m, _ := newTestIndex(t, MemoryConfig{})
	toks := testTokens(1, 512*16)
	keys := testKeys(toks)
	names := make([]string, 16)
	for i := range names {
		names[i] = fmt.Sprintf("b%d", i)
		storeChain(t, m, names[i], toks[:(i+1)*32*16], uint64(i)<<20, events.Tier(i%3))
	}
	ctx := context.Background()
	out := make([]Match, len(names))
	pe := events.Event{Kind: events.KindPrefix, PrefixOp: events.PrefixCreated, PrefixHash: "abcd", TokenCount: 64}
	if err := m.Apply(ctx, "b0", &events.Batch{Events: []events.Event{pe}}); err != nil {
		t.Fatal(err)
	}
	for _, stride := range []int{1, 16} {
		m.cfg.LookupStride = stride
		if n := testing.AllocsPerRun(100, func() { _, _ = m.Lookup(ctx, keys, names, out) }); n != 0 {
			t.Errorf("Lookup (stride %d): %v allocs, want 0", stride, n)
		}
	}
	if n := testing.AllocsPerRun(100, func() { _, _ = m.LookupPrefix(ctx, "abcd", names, out) }); n != 0 {
		t.Errorf("LookupPrefix: %v allocs, want 0", n)
	}
	if n := testing.AllocsPerRun(100, func() { _ = m.Speculate(ctx, "b15", keys, 0) }); n != 0 {
		t.Errorf("Speculate of held keys: %v allocs, want 0", n)
	}
}

// TestConcurrentStress runs writers, readers, speculation, clears and sweeps at once on a small
// table (resizes, evictions, id reuse), with the backends' own engine-hash maps and with the
// shared one; run it with -race.
func TestConcurrentStress(t *testing.T) {
	for _, shared := range []bool{false, true} {
		t.Run(fmt.Sprintf("shared_engines=%v", shared), func(t *testing.T) { concurrentStress(t, shared) })
	}
}

func concurrentStress(t *testing.T, shared bool) {
	m, clk := newTestIndex(t, MemoryConfig{MaxEntries: 2048, MaxBackends: 6, EntryTTL: time.Minute})
	m.reg.shareAll = shared
	ctx := context.Background()
	chains := make([][]uint32, 8)
	for i := range chains {
		chains[i] = testTokens(i, 64*16)
	}
	names := []string{"a", "b", "c", "d", "e", "f", "g"}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() { // writers, one goroutine per backend as the Sink contract says
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				name := names[w]
				storeChain(t, m, name, chains[(w+i)%len(chains)], uint64(i%5)<<16, events.Tier(i%2))
				if i%7 == 0 {
					_ = m.Apply(ctx, name, &events.Batch{Events: []events.Event{{Kind: events.KindBlockRemoved,
						BlockHashes: []uint64{3, 4, 5}}}})
				}
				if i%23 == 0 {
					_ = m.ClearBackend(ctx, name)
				}
			}
		}()
	}
	for r := range 2 {
		wg.Add(1)
		go func() { // readers
			defer wg.Done()
			out := make([]Match, len(names))
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				keys := testKeys(chains[(r+i)%len(chains)])
				res, err := m.Lookup(ctx, keys, names, out)
				if err != nil {
					t.Error(err)
					return
				}
				for _, x := range res {
					if x.Blocks < 0 || x.Blocks > len(keys) || x.WeightedBlocks > float64(x.Blocks)+1e-9 {
						t.Errorf("impossible match %+v", x)
						return
					}
				}
			}
		}()
	}
	wg.Add(1)
	go func() { // speculation by late backends, sweeps, clock, stats
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			_ = m.Speculate(ctx, names[4+i%3], testKeys(chains[i%len(chains)])[:16], time.Second)
			if i%10 == 0 {
				clk.Advance(time.Second)
				m.sweep()
				_, _ = m.Stats(ctx)
			}
			if i%50 == 0 {
				_, _ = m.Clear(ctx)
			}
		}
	}()
	time.Sleep(300 * time.Millisecond)
	close(stop)
	wg.Wait()
	checkConsistency(t, m)
}
