package kvindex

import (
	"context"
	"fmt"
	"math/bits"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvroute/kvroute/events"
)

// specTruth scans the table: per backend id, the speculative memberships live now, and those
// expired but still in the table.
func specTruth(m *MemoryIndex) (live, expired [MaxMemoryBackends]int) {
	c := m.clock()
	retired := m.reg.retired.Load()
	for si := range m.shards {
		sh := &m.shards[si]
		sh.mu.Lock()
		t := sh.tab.Load()
		for _, b := range t.blocks(0) {
			v := b.load()
			for x := v.spec &^ retired; x != 0; x &= x - 1 {
				if c.specLive(&v) {
					live[bits.TrailingZeros64(x)]++
				} else {
					expired[bits.TrailingZeros64(x)]++
				}
			}
		}
		sh.mu.Unlock()
	}
	return live, expired
}

// checkSpecQueues verifies, on a quiet index, the invariant Stats relies on: every speculative
// membership of a live backend has a queued entry no later than its block's expiry; and the
// queues' own invariants (runs cover the FIFO, their expiries never decrease, late is a heap).
func checkSpecQueues(t testing.TB, m *MemoryIndex) {
	t.Helper()
	for name, bs := range m.reg.active() {
		bs.specMu.Lock()
		q := &bs.spec
		first := map[uint64]uint32{} // soonest queued expiry per block (flag bits cleared, as v.h)
		note := func(h uint64, exp uint32) {
			h &^= flagMask
			if e, ok := first[h]; !ok || before(exp, e) {
				first[h] = exp
			}
		}
		i := 0
		for r := range q.runs.n {
			run := *q.runs.at(r)
			if run.n == 0 {
				t.Errorf("%s: empty run %d", name, r)
			}
			if r > 0 && before(run.exp, q.runs.at(r-1).exp) {
				t.Errorf("%s: run %d expires before run %d", name, r, r-1)
			}
			for range run.n {
				note(*q.keys.at(i), run.exp)
				i++
			}
		}
		if i != q.keys.n {
			t.Errorf("%s: runs cover %d keys of %d", name, i, q.keys.n)
		}
		for j, e := range q.late {
			if j > 0 && before(e.exp, q.late[(j-1)/2].exp) {
				t.Errorf("%s: late[%d] before its parent", name, j)
			}
			note(e.h, e.exp)
		}
		d := bs.specDue.Load()
		if exp, ok := q.next(); ok != (d != 0) || ok && uint32(d) != exp {
			t.Errorf("%s: specDue %x, queue's next %d %v", name, d, exp, ok)
		}
		bs.specMu.Unlock()
		bit := uint64(1) << bs.id
		for si := range m.shards {
			sh := &m.shards[si]
			sh.mu.Lock()
			tb := sh.tab.Load()
			for w, b := range tb.blocks(0) {
				v := b.load()
				if v.spec&bit == 0 {
					continue
				}
				h := fullKey(w, b)
				if e, ok := first[h]; !ok || before(v.specExp(), e) {
					t.Errorf("%s: block %x speculative until %d, queued %d %v", name, h, v.specExp(), e, ok)
				}
			}
			sh.mu.Unlock()
		}
	}
}

func specStats(t testing.TB, m *MemoryIndex) Stats {
	t.Helper()
	s, err := m.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func speculate(t testing.TB, m *MemoryIndex, backend string, keys []uint64, ttl time.Duration) {
	t.Helper()
	if err := m.Speculate(context.Background(), backend, keys, ttl); err != nil {
		t.Fatal(err)
	}
}

// TestSpeculativeStatsLive: with no sweep, Stats counts only the speculative entries live at the
// call (issue #17: it used to count them until the next sweep, 30 s after a 2 s TTL).
func TestSpeculativeStatsLive(t *testing.T) {
	const n = 40
	ttl := DefaultSpeculativeTTL
	tick := time.Duration(1) << tickShift
	keys := testKeys(testTokens(1, n*16))

	t.Run("expired", func(t *testing.T) {
		m, clk := newTestIndex(t, MemoryConfig{})
		speculate(t, m, "a", keys, 0)
		if s := specStats(t, m); s.SpeculativeCount != n || s.PerBackend["a"] != n || s.Blocks != n {
			t.Errorf("speculated: SpeculativeCount %d, PerBackend %v, Blocks %d; want %d each", s.SpeculativeCount, s.PerBackend, s.Blocks, n)
		}
		clk.Advance(ttl - 2*tick)
		if s := specStats(t, m); s.SpeculativeCount != n {
			t.Errorf("just before the TTL: SpeculativeCount %d, want %d", s.SpeculativeCount, n)
		}
		clk.Advance(3 * tick)
		s := specStats(t, m)
		if s.SpeculativeCount != 0 || s.PerBackend["a"] != 0 || s.Entries != 0 || s.Blocks != 0 {
			t.Errorf("past the TTL: SpeculativeCount %d, PerBackend %v, Entries %d, Blocks %d; want 0",
				s.SpeculativeCount, s.PerBackend, s.Entries, s.Blocks)
		}
		if s.Expired != n {
			t.Errorf("Expired %d, want %d", s.Expired, n)
		}
		checkConsistency(t, m)
		checkSpecQueues(t, m)
	})

	t.Run("extended", func(t *testing.T) {
		m, clk := newTestIndex(t, MemoryConfig{})
		speculate(t, m, "a", keys, 0)
		clk.Advance(ttl / 2)
		speculate(t, m, "a", keys[:n/2], 0) // half extended by another request
		clk.Advance(ttl/2 + tick)
		if s := specStats(t, m); s.SpeculativeCount != n/2 || s.PerBackend["a"] != n/2 {
			t.Errorf("after the first TTL: SpeculativeCount %d, PerBackend %v; want %d", s.SpeculativeCount, s.PerBackend, n/2)
		}
		if got := blocksOf(t, m, keys, "a"); got[0] != n/2 {
			t.Errorf("after the first TTL: %d blocks, want %d", got[0], n/2)
		}
		clk.Advance(ttl / 2)
		if s := specStats(t, m); s.SpeculativeCount != 0 || s.PerBackend["a"] != 0 {
			t.Errorf("after the extension's TTL: SpeculativeCount %d, PerBackend %v; want 0", s.SpeculativeCount, s.PerBackend)
		}
		checkConsistency(t, m)
		checkSpecQueues(t, m)
	})

	t.Run("extended_repeatedly", func(t *testing.T) {
		// A hot prefix re-speculated every TTL/4 for 10 TTLs: counted throughout, once.
		m, clk := newTestIndex(t, MemoryConfig{})
		for range 40 {
			speculate(t, m, "a", keys, 0)
			clk.Advance(ttl / 4)
			if s := specStats(t, m); s.SpeculativeCount != n {
				t.Fatalf("SpeculativeCount %d, want %d", s.SpeculativeCount, n)
			}
			checkSpecQueues(t, m)
		}
		clk.Advance(ttl)
		if s := specStats(t, m); s.SpeculativeCount != 0 || s.Blocks != 0 {
			t.Errorf("after the last TTL: SpeculativeCount %d, Blocks %d; want 0", s.SpeculativeCount, s.Blocks)
		}
		bs := m.reg.lookup("a")
		if bs.spec.len() != 0 || bs.spec.bytes() > minShrink*(16+8+8) {
			t.Errorf("queue: %d entries, %d bytes; want 0, little", bs.spec.len(), bs.spec.bytes())
		}
	})

	t.Run("confirmed", func(t *testing.T) {
		m, clk := newTestIndex(t, MemoryConfig{})
		toks := testTokens(1, n*16)
		speculate(t, m, "a", keys, 0)
		storeChain(t, m, "a", toks[:n/2*16], 0, events.TierGPU) // the engine stored the first half
		if s := specStats(t, m); s.SpeculativeCount != n/2 || s.PerBackend["a"] != n {
			t.Errorf("half confirmed: SpeculativeCount %d, PerBackend %v; want %d, %d", s.SpeculativeCount, s.PerBackend, n/2, n)
		}
		clk.Advance(ttl + tick)
		s := specStats(t, m)
		if s.SpeculativeCount != 0 || s.PerBackend["a"] != n/2 || s.Blocks != n/2 || s.Expired != n/2 {
			t.Errorf("past the TTL: SpeculativeCount %d, PerBackend %v, Blocks %d, Expired %d; want 0, %d, %d, %d",
				s.SpeculativeCount, s.PerBackend, s.Blocks, s.Expired, n/2, n/2, n/2)
		}
		if got := blocksOf(t, m, keys, "a"); got[0] != n/2 {
			t.Errorf("confirmed blocks: %d, want %d", got[0], n/2)
		}
		checkConsistency(t, m)
		checkSpecQueues(t, m)
	})

	t.Run("backends_share_blocks", func(t *testing.T) {
		// One expiry per block: b's later speculation keeps a's alive (as lookups see it).
		m, clk := newTestIndex(t, MemoryConfig{})
		speculate(t, m, "a", keys, 0)
		speculate(t, m, "c", keys[:n/4], 0)
		clk.Advance(ttl / 2)
		speculate(t, m, "b", keys[:n/2], 0)
		if s := specStats(t, m); s.SpeculativeCount != n+n/2+n/4 || s.Blocks != n {
			t.Errorf("speculated: SpeculativeCount %d, Blocks %d; want %d, %d", s.SpeculativeCount, s.Blocks, n+n/2+n/4, n)
		}
		clk.Advance(ttl/2 + tick)
		s := specStats(t, m)
		want := map[string]int{"a": n / 2, "b": n / 2, "c": n / 4}
		for name, w := range want {
			if s.PerBackend[name] != w {
				t.Errorf("after a's TTL: PerBackend[%s] %d, want %d", name, s.PerBackend[name], w)
			}
		}
		if got := blocksOf(t, m, keys, "a", "b", "c"); !slices.Equal(got, []int{n / 2, n / 2, n / 4}) {
			t.Errorf("after a's TTL: lookups %v, want [%d %d %d]", got, n/2, n/2, n/4)
		}
		clk.Advance(ttl / 2)
		if s := specStats(t, m); s.SpeculativeCount != 0 || s.Entries != 0 || s.Blocks != 0 {
			t.Errorf("after b's TTL: SpeculativeCount %d, Entries %d, Blocks %d; want 0", s.SpeculativeCount, s.Entries, s.Blocks)
		}
		checkConsistency(t, m)
		checkSpecQueues(t, m)
	})

	t.Run("mixed_ttls", func(t *testing.T) {
		// A shorter TTL after a longer one (queued out of order), and a sole speculator
		// shortening its own entries' expiry (which leaves a hole: lookups are exact here).
		m, clk := newTestIndex(t, MemoryConfig{LookupStride: 1})
		other := testKeys(testTokens(2, n*16))
		speculate(t, m, "a", keys[:n/2], 10*time.Second)
		speculate(t, m, "a", keys[n/2:], time.Second)
		speculate(t, m, "b", other, 10*time.Second)
		speculate(t, m, "b", other[:n/4], time.Second)
		checkSpecQueues(t, m)
		clk.Advance(time.Second + tick)
		s := specStats(t, m)
		if s.PerBackend["a"] != n/2 || s.PerBackend["b"] != n-n/4 {
			t.Errorf("after 1 s: PerBackend %v, want a:%d b:%d", s.PerBackend, n/2, n-n/4)
		}
		if got := blocksOf(t, m, keys, "a"); got[0] != n/2 {
			t.Errorf("after 1 s: a's lookup %d, want %d", got[0], n/2)
		}
		if got := blocksOf(t, m, other, "b"); got[0] != 0 {
			t.Errorf("after 1 s: b's lookup %d, want 0", got[0])
		}
		clk.Advance(9 * time.Second)
		if s := specStats(t, m); s.SpeculativeCount != 0 || s.Blocks != 0 {
			t.Errorf("after 10 s: SpeculativeCount %d, Blocks %d; want 0", s.SpeculativeCount, s.Blocks)
		}
		checkConsistency(t, m)
		checkSpecQueues(t, m)
	})

	t.Run("sweep", func(t *testing.T) {
		// A backend that stops speculating: the sweep empties its queue (and the counters).
		m, clk := newTestIndex(t, MemoryConfig{})
		speculate(t, m, "a", keys, 0)
		clk.Advance(ttl + tick)
		m.sweep()
		bs := m.reg.lookup("a")
		if specs := m.ids[bs.id].specs.Load(); specs != 0 {
			t.Errorf("after the sweep: specs counter %d, want 0", specs)
		}
		if n := bs.spec.len(); n != 0 || bs.specDue.Load() != 0 {
			t.Errorf("after the sweep: %d entries queued, specDue %x; want none", n, bs.specDue.Load())
		}
	})

	t.Run("confirmed_compacted", func(t *testing.T) {
		// Confirmed entries stay queued until due, or until the sweep compacts the queue.
		const big = 2 * specCompactSlack
		m, _ := newTestIndex(t, MemoryConfig{})
		toks := testTokens(3, big*16)
		speculate(t, m, "a", testKeys(toks), 0)
		storeChain(t, m, "a", toks, 0, events.TierGPU)
		bs := m.reg.lookup("a")
		if n := bs.spec.len(); n != big {
			t.Fatalf("%d entries queued, want %d", n, big)
		}
		m.sweep()
		if n := bs.spec.len(); n != 0 {
			t.Errorf("after the sweep: %d entries queued, want 0", n)
		}
		if s := specStats(t, m); s.SpeculativeCount != 0 || s.PerBackend["a"] != big {
			t.Errorf("SpeculativeCount %d, PerBackend %v; want 0, %d", s.SpeculativeCount, s.PerBackend, big)
		}
		checkConsistency(t, m)
	})

	t.Run("cleared", func(t *testing.T) {
		m, clk := newTestIndex(t, MemoryConfig{})
		ctx := context.Background()
		speculate(t, m, "a", keys, 0)
		speculate(t, m, "b", keys, 0)
		if err := m.ClearBackend(ctx, "a"); err != nil {
			t.Fatal(err)
		}
		if _, err := m.Clear(ctx); err != nil {
			t.Fatal(err)
		}
		speculate(t, m, "b", keys[:n/2], 0)
		clk.Advance(ttl / 2)
		if s := specStats(t, m); s.SpeculativeCount != n/2 || s.PerBackend["b"] != n/2 {
			t.Errorf("after Clear: SpeculativeCount %d, PerBackend %v; want %d", s.SpeculativeCount, s.PerBackend, n/2)
		}
		clk.Advance(ttl/2 + tick)
		if s := specStats(t, m); s.SpeculativeCount != 0 || s.Blocks != 0 {
			t.Errorf("past the TTL: SpeculativeCount %d, Blocks %d; want 0", s.SpeculativeCount, s.Blocks)
		}
		checkConsistency(t, m)
		checkSpecQueues(t, m)
	})
}

// TestSpeculateExpiresAsItGoes: Speculate itself (no Stats, no sweep) keeps a backend's
// speculative counters, its queue and the table within a constant of the live speculative
// entries, speculating continuously for many TTLs: new blocks only, and a hot prefix extended
// by every request plus new blocks.
func TestSpeculateExpiresAsItGoes(t *testing.T) {
	const perCall = 24
	ttl := DefaultSpeculativeTTL
	for _, hot := range []int{0, 8} {
		t.Run(fmt.Sprintf("hot=%d", hot), func(t *testing.T) {
			m, clk := newTestIndex(t, MemoryConfig{})
			r := rand.New(rand.NewPCG(3, 4))
			prefix := make([]uint64, hot)
			for i := range prefix {
				prefix[i] = r.Uint64()
			}
			keys := make([]uint64, 0, hot+perCall)
			maxLive := 0
			for call := range 2000 { // 40 TTLs
				clk.Advance(ttl / 50)
				keys = append(keys[:0], prefix...)
				for range perCall {
					keys = append(keys, r.Uint64())
				}
				speculate(t, m, "a", keys, 0)
				if call%50 != 49 {
					continue
				}
				bs := m.reg.lookup("a")
				live, _ := specTruth(m)
				maxLive = max(maxLive, live[bs.id])
				specs := int(m.ids[bs.id].specs.Load())
				blocks := 0
				for i := range m.shards {
					blocks += int(m.shards[i].blocks.Load())
				}
				bs.specMu.Lock()
				qlen, qbytes := bs.spec.len(), bs.spec.bytes()
				bs.specMu.Unlock()
				const slack = 2 * (perCall + specExpireSlack)
				if specs > live[bs.id]+slack || qlen > live[bs.id]+slack || blocks > live[bs.id]+slack {
					t.Fatalf("call %d: %d live speculative entries; counter %d, queue %d, table %d blocks (slack %d)",
						call, live[bs.id], specs, qlen, blocks, slack)
				}
				if qbytes > int64(16*(qlen+64)) {
					t.Fatalf("call %d: queue of %d entries takes %d bytes", call, qlen, qbytes)
				}
			}
			if want := 50 * perCall; maxLive < want*9/10 || maxLive > want+hot+perCall {
				t.Errorf("at most %d live entries, want about %d", maxLive, want+hot)
			}
			checkConsistency(t, m)
			checkSpecQueues(t, m)
		})
	}
}

// TestSpecQueueOrder drives a specQueue with entries mostly in order of expiry, some out of order,
// across the tick counter's wrap, against a reference multiset: pops come soonest first.
func TestSpecQueueOrder(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	var q specQueue
	var ref []specEntry
	now := uint32(1<<32 - 5000)
	popMin := func() {
		h, exp, ok := q.pop()
		if !ok {
			t.Fatalf("pop of a queue of %d: empty", len(ref))
		}
		i := slices.IndexFunc(ref, func(e specEntry) bool { return e.h == h && e.exp == exp })
		if i < 0 {
			t.Fatalf("popped %d@%d, not queued", h, exp)
		}
		for _, e := range ref {
			if before(e.exp, exp) {
				t.Fatalf("popped %d@%d before %d@%d", h, exp, e.h, e.exp)
			}
		}
		ref = slices.Delete(ref, i, i+1)
	}
	for step := range 20000 {
		now += uint32(r.IntN(3))
		switch x := r.IntN(100); {
		case x < 55:
			exp := now + 500
			if r.IntN(10) == 0 {
				exp = now + uint32(r.IntN(500)) // out of order
			}
			for range 1 + r.IntN(4) {
				h := r.Uint64()
				q.push(h, exp)
				ref = append(ref, specEntry{h, exp})
			}
		case x < 98:
			if len(ref) > 0 {
				popMin()
			}
		default:
			q.retain(func(h uint64) bool { return h%3 != 0 })
			ref = slices.DeleteFunc(ref, func(e specEntry) bool { return e.h%3 == 0 })
		}
		if q.len() != len(ref) {
			t.Fatalf("step %d: len %d, want %d", step, q.len(), len(ref))
		}
	}
	for len(ref) > 0 {
		popMin()
	}
	if _, _, ok := q.pop(); ok {
		t.Error("pop of an empty queue")
	}
	q.shrink()
	if q.bytes() > minShrink*(16+8+8) {
		t.Errorf("empty queue keeps %d bytes", q.bytes())
	}
}

// TestSpeculateAllocs: Speculate allocates nothing in its steady state (the queue's buffers
// reused), new blocks or held ones.
func TestSpeculateAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates")
	}
	m, clk := newTestIndex(t, MemoryConfig{})
	ctx := context.Background()
	reqs := make([][]uint64, 64)
	for i := range reqs {
		reqs[i] = make([]uint64, 256)
		for j := range reqs[i] {
			reqs[i][j] = uint64(i)<<32 | uint64(j) + 1
		}
	}
	i := 0
	run := func() {
		clk.Advance(DefaultSpeculativeTTL / 16)
		_ = m.Speculate(ctx, "a", reqs[i%len(reqs)], 0)
		i++
	}
	for range 3 * len(reqs) {
		run()
	}
	if n := testing.AllocsPerRun(200, run); n != 0 {
		t.Errorf("Speculate of new blocks: %v allocs, want 0", n)
	}
}

// TestSpeculateConcurrentExpiry runs speculation with different TTLs on shared blocks,
// confirmations, Stats, sweeps, ClearBackend and Clear at once, the clock advancing; once
// quiet, the queues cover every speculative membership and, past every TTL, Stats counts none.
// Run it with -race.
func TestSpeculateConcurrentExpiry(t *testing.T) {
	m, clk := newTestIndex(t, MemoryConfig{MaxEntries: 4096, MaxBackends: 5, ApproximateCapacityBlocks: 300})
	ctx := context.Background()
	chains := make([][]uint32, 6)
	keys := make([][]uint64, len(chains))
	for i := range chains {
		chains[i] = testTokens(100+i, 48*16)
		keys[i] = testKeys(chains[i])
	}
	names := []string{"a", "b", "c", "d"}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 3 {
		wg.Go(func() { // speculation, two goroutines per backend
			r := rand.New(rand.NewPCG(uint64(w), 9))
			for {
				select {
				case <-stop:
					return
				default:
				}
				ks := keys[r.IntN(len(keys))]
				lo := r.IntN(len(ks))
				ttl := time.Duration(r.IntN(3)) * time.Second // 0: SpeculativeTTL
				_ = m.Speculate(ctx, names[r.IntN(len(names))], ks[lo:], ttl)
			}
		})
	}
	wg.Go(func() { // confirmations by d
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			storeChain(t, m, "d", chains[i%len(chains)][:16*16], uint64(i%3)<<16, events.TierGPU)
		}
	})
	wg.Go(func() { // clock, stats, sweeps, clears
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			clk.Advance(50 * time.Millisecond)
			_, _ = m.Stats(ctx)
			switch {
			case i%40 == 0:
				m.sweep()
			case i%97 == 0:
				_ = m.ClearBackend(ctx, names[i%3])
			case i%211 == 0:
				_, _ = m.Clear(ctx)
			}
			time.Sleep(100 * time.Microsecond)
		}
	})
	time.Sleep(300 * time.Millisecond)
	close(stop)
	wg.Wait()
	checkConsistency(t, m)
	checkSpecQueues(t, m)
	s := specStats(t, m)
	live, expired := specTruth(m)
	n, x := 0, 0
	for _, bs := range m.reg.active() {
		n += live[bs.id]
		x += expired[bs.id]
	}
	if s.SpeculativeCount != n || x != 0 {
		t.Errorf("SpeculativeCount %d; the table holds %d live and %d expired speculative entries", s.SpeculativeCount, n, x)
	}
	clk.Advance(3 * time.Second)
	if s := specStats(t, m); s.SpeculativeCount != 0 {
		t.Errorf("past every TTL: SpeculativeCount %d, want 0", s.SpeculativeCount)
	}
	checkConsistency(t, m)
	checkSpecQueues(t, m)
}
