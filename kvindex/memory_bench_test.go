package kvindex

import (
	"context"
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/prefixkey"
)

// The benchmark fleet: 16 backends holding chains of 512 blocks (8,192 tokens of 16-token
// blocks), as a prefix-affine router places requests:
//
//   - chains come in groups of 8 that share their first 64 blocks (a system prompt); the other
//     448 blocks are the chain's own;
//   - chain c is held by 1 + c%4 backends (1–4, 2.5 on average), consecutive from backend 5c mod
//     16, so that a group's shared prefix is held by the union of its chains' holders (about
//     8 backends);
//   - every holder learns its chain through vLLM-style BlockStored events of 16 blocks, chained
//     by engine hashes that are distinct per backend (engines with distinct hash seeds) or, in the
//     benchmarks that say so, the same on every backend (vLLM engines started with one
//     PYTHONHASHSEED, whose engine-hash entries the index shares between backends).
//
// That is about 1,220 memberships per chain over 456 blocks: 2.68 memberships per block (the
// benchmarks report the memberships they built, and BenchmarkMemoryPerMembership the ratio).
const (
	fleetBackends     = 16
	fleetChainBlocks  = 512
	fleetSharedBlocks = 64
	fleetGroup        = 8
	fleetEventBlocks  = 16
	fleetModel        = "bench-model"
)

type fleet struct {
	ix          *MemoryIndex
	names       []string
	requests    [][]uint64 // block keys of sample chains, each fully held by its holders
	memberships int
	blocks      int
	sharedHash  bool // every backend reports the same engine hash for a block
}

// chainTokens fills dst with chain c's tokens: the group's shared prefix, then its own.
func chainTokens(dst []uint32, c int) []uint32 {
	dst = dst[:0]
	g := uint64(c/fleetGroup) + 1
	x := g * 0x9e3779b97f4a7c15
	for i := 0; i < fleetSharedBlocks*16; i++ {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		dst = append(dst, uint32(x%128000))
	}
	x = uint64(c+1)*0xbf58476d1ce4e5b9 + 7
	for i := fleetSharedBlocks * 16; i < fleetChainBlocks*16; i++ {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		dst = append(dst, uint32(x%128000))
	}
	return dst
}

// engineHash is backend b's engine hash for block i of chain c (shared-prefix blocks are the
// group's, so that two chains of a group name them alike on one backend). Pass b = 0 for engines
// that hash alike.
func engineHash(b, c, i int) uint64 {
	if i < fleetSharedBlocks {
		c = -(c/fleetGroup + 1)
	}
	return mix(uint64(b)<<56 ^ uint64(uint32(c))<<20 ^ uint64(i) ^ 0x5555)
}

// buildFleet loads about memberships memberships into a new index, from engines whose hashes are
// distinct per backend.
func buildFleet(tb testing.TB, memberships int, cfg MemoryConfig) *fleet {
	return buildFleetHashes(tb, memberships, cfg, false)
}

// buildFleetHashes is buildFleet from engines that hash alike (sharedHash) or not.
func buildFleetHashes(tb testing.TB, memberships int, cfg MemoryConfig, sharedHash bool) *fleet {
	tb.Helper()
	if cfg.MaxEntries == 0 {
		cfg.MaxEntries = memberships // blocks ≤ memberships: never evicts
	}
	cfg.DefaultModel = fleetModel
	cfg.SweepInterval = -1
	ix, err := NewMemory(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	f := &fleet{ix: ix, sharedHash: sharedHash}
	for i := range fleetBackends {
		f.names = append(f.names, fmt.Sprintf("vllm-%02d", i))
	}
	ctx := context.Background()
	toks := make([]uint32, 0, fleetChainBlocks*16)
	hs := make([]uint64, fleetEventBlocks)
	batch := &events.Batch{Model: fleetModel, Events: make([]events.Event, 1)}
	for c := 0; ; c++ {
		if c%8 == 0 {
			s, _ := ix.Stats(ctx)
			if s.Entries >= memberships {
				f.memberships, f.blocks = s.Entries, s.Blocks
				break
			}
		}
		toks = chainTokens(toks, c)
		holders := 1 + c%4
		for h := range holders {
			b := (5*c + h) % fleetBackends
			hb := b
			if sharedHash {
				hb = 0
			}
			for blk := 0; blk < fleetChainBlocks; blk += fleetEventBlocks {
				for i := range hs {
					hs[i] = engineHash(hb, c, blk+i)
				}
				ev := events.Event{Kind: events.KindBlockStored, BlockHashes: hs,
					TokenIDs: toks[blk*16 : (blk+fleetEventBlocks)*16], BlockSize: 16}
				if blk > 0 {
					ev.Parent, ev.HasParent = engineHash(hb, c, blk-1), true
				}
				batch.Events[0] = ev
				if err := ix.Apply(ctx, f.names[b], batch); err != nil {
					tb.Fatal(err)
				}
			}
		}
		if len(f.requests) < 64 && c%7 == 0 {
			f.requests = append(f.requests, prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot(fleetModel, ""), toks, 16, nil))
		}
	}
	return f
}

// latencyHist is a per-iteration timing histogram with 8 ns buckets up to 1 ms, allocated once.
type latencyHist struct {
	buckets []uint32
	over    int
	n       int
}

func newLatencyHist() *latencyHist { return &latencyHist{buckets: make([]uint32, 1<<17)} }

func (h *latencyHist) add(d time.Duration) {
	i := int(d >> 3)
	if i >= len(h.buckets) {
		h.over++
	} else {
		h.buckets[i]++
	}
	h.n++
}

// quantile returns the q-quantile in ns (bucket upper bound).
func (h *latencyHist) quantile(q float64) float64 {
	want := int(q * float64(h.n))
	seen := 0
	for i, c := range h.buckets {
		seen += int(c)
		if seen > want {
			return float64((i + 1) << 3)
		}
	}
	return float64(len(h.buckets) << 3)
}

// BenchmarkLookup measures Lookup of a 512-block (8,192-token) request among 16 candidate
// backends, against an index holding the given number of (block, backend) memberships, exact
// (stride=1) and as a jump search (stride=16, MemoryConfig.LookupStride). Requests are stored
// chains: their holders match all 512 blocks, so an exact lookup probes every block. p50-ns and
// p99-ns are quantiles of per-iteration timings (which include two clock reads, ~40 ns).
func BenchmarkLookup(b *testing.B) {
	for _, n := range []int{10_000, 100_000, 1_000_000, 10_000_000} {
		var f *fleet
		for _, stride := range []int{1, 16} {
			b.Run(fmt.Sprintf("backends=16/blocks=512/memberships=%d/stride=%d", n, stride), func(b *testing.B) {
				if n > 1_000_000 && testing.Short() {
					b.Skip("-short")
				}
				if f == nil {
					f = buildFleet(b, n, MemoryConfig{})
					runtime.GC() // not during the measurement
				}
				f.ix.cfg.LookupStride = stride
				ctx := context.Background()
				out := make([]Match, len(f.names))
				h := newLatencyHist()
				matched := 0
				b.ReportAllocs()
				b.ResetTimer()
				cpu0 := cpuClock()
				for i := 0; b.Loop(); i++ {
					req := f.requests[i%len(f.requests)]
					t0 := time.Now()
					res, _ := f.ix.Lookup(ctx, req, f.names, out)
					h.add(time.Since(t0))
					matched += res[0].Blocks
				}
				b.StopTimer()
				if cpu0 > 0 {
					b.ReportMetric(float64(cpuClock()-cpu0)/float64(b.N), "cpu-ns/op")
				}
				b.ReportMetric(h.quantile(0.5), "p50-ns")
				b.ReportMetric(h.quantile(0.99), "p99-ns")
				b.ReportMetric(float64(f.memberships), "memberships")
				if matched < 0 {
					b.Fatal(matched)
				}
			})
		}
		if f != nil {
			f.ix.Close()
		}
	}
}

// BenchmarkLookupParallel is BenchmarkLookup (1M memberships) from all Ps at once.
func BenchmarkLookupParallel(b *testing.B) {
	f := buildFleet(b, 1_000_000, MemoryConfig{})
	defer f.ix.Close()
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		out := make([]Match, len(f.names))
		i := 0
		for pb.Next() {
			_, _ = f.ix.Lookup(ctx, f.requests[i%len(f.requests)], f.names, out)
			i++
		}
	})
}

// BenchmarkIngest measures Apply of BlockStored events of 16 blocks of 16 tokens from 16 backends
// in turn, one goroutine, every event's content new (its blocks are new keys), chained to the
// backend's previous event in chains of 64 events. Scenarios:
//
//   - fill: MaxEntries far above what the run stores: inserts into a growing table.
//   - flood: MaxEntries 65,536, exceeded all the time: every insert pays its share of eviction,
//     and of pruning the engine maps of the blocks evicted (no BlockRemoved arrives).
//   - steady: each engine holds at most 4,096 blocks and, like vLLM, announces its evictions: a
//     batch carries the new event's BlockStored and a BlockRemoved of the engine's oldest 16
//     blocks. Block operations = stored + removed.
//
// blocks/s is block operations per second of wall time; blocks/cpu-s per second of process CPU
// time (which includes the garbage collector's), steadier on a shared machine.
func BenchmarkIngest(b *testing.B) {
	for _, sc := range []struct {
		name       string
		maxEntries int
		engineCap  int // blocks per engine; 0 = no BlockRemoved
	}{
		{"fill", 1 << 26, 0},
		{"flood", 1 << 16, 0},
		{"steady", 1 << 20, 4096},
	} {
		b.Run(fmt.Sprintf("events=16blocks/%s", sc.name), func(b *testing.B) {
			ix, err := NewMemory(MemoryConfig{MaxEntries: sc.maxEntries, SweepInterval: -1, DefaultModel: fleetModel})
			if err != nil {
				b.Fatal(err)
			}
			defer ix.Close()
			ctx := context.Background()
			toks := chainTokens(nil, 1)
			names := make([]string, fleetBackends)
			for i := range names {
				names[i] = fmt.Sprintf("vllm-%02d", i)
			}
			const eb = fleetEventBlocks
			hs := make([]uint64, eb)
			rm := make([]uint64, eb)
			buf := make([]uint32, eb*16)
			batch := &events.Batch{Model: fleetModel, Events: make([]events.Event, 0, 2)}
			var seq [fleetBackends]uint64
			held := uint64(sc.engineCap / eb) // events an engine holds
			b.ReportAllocs()
			b.ResetTimer()
			n := 0
			cpu0 := cpuClock()
			for i := 0; b.Loop(); i++ {
				be := i % fleetBackends
				s := seq[be]
				for j := range hs {
					hs[j] = s*eb + uint64(j) + 1
				}
				off := (i * eb * 16) % (len(toks) - eb*16)
				copy(buf, toks[off:off+eb*16])
				buf[0] = uint32(i) // every event's content is new: its blocks are new blocks
				ev := events.Event{Kind: events.KindBlockStored, BlockHashes: hs, TokenIDs: buf, BlockSize: 16}
				if s%64 != 0 {
					ev.Parent, ev.HasParent = s*eb, true
				}
				batch.Events = append(batch.Events[:0], ev)
				n += eb
				if held > 0 && s >= held {
					// Evict the oldest event (tail first, as vLLM frees blocks).
					old := s - held
					for j := range rm {
						rm[j] = old*eb + uint64(eb-j)
					}
					batch.Events = append(batch.Events, events.Event{Kind: events.KindBlockRemoved, BlockHashes: rm})
					n += eb
				}
				_ = ix.Apply(ctx, names[be], batch)
				seq[be]++
			}
			b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "blocks/s")
			if cpu0 > 0 {
				b.ReportMetric(float64(n)/(cpuClock()-cpu0).Seconds(), "blocks/cpu-s")
			}
		})
	}
}

// BenchmarkMemoryPerMembership builds the benchmark fleet and reports the heap it takes per
// (block, backend) membership: runtime.MemStats.HeapAlloc after runtime.GC(), minus the same
// before the index was built, over Stats().Entries. The tokens used to build it are not kept.
// hashes=per-engine is a fleet of engines with distinct hash seeds, each backend's engine hashes
// its own; hashes=shared one of engines that hash alike (vLLM with one PYTHONHASHSEED), whose
// backends move to the shared engine-hash map and share one entry per block. emapB/membership is
// the engine-hash maps' part (the backends' own and the shared one), load the block table's probe
// arrays' fill. Run with -benchtime=1x; the 10M cases need about 1 GB.
func BenchmarkMemoryPerMembership(b *testing.B) {
	for _, n := range []int{1_000_000, 10_000_000} {
		for _, hashes := range []string{"per-engine", "shared"} {
			b.Run(fmt.Sprintf("memberships=%d/hashes=%s", n, hashes), func(b *testing.B) {
				if n > 1_000_000 && testing.Short() {
					b.Skip("-short")
				}
				for b.Loop() {
					var before, after runtime.MemStats
					runtime.GC()
					runtime.ReadMemStats(&before)
					f := buildFleetHashes(b, n, MemoryConfig{}, hashes == "shared")
					f.requests = nil
					runtime.GC()
					runtime.ReadMemStats(&after)
					s, _ := f.ix.Stats(context.Background())
					em := f.ix.engines.bytes()
					shared := 0
					for _, bs := range f.ix.reg.active() {
						em += bs.em.bytes()
						if bs.shared {
							shared++
						}
					}
					var slots int64
					for i := range f.ix.shards {
						slots += int64(f.ix.shards[i].tab.Load().n)
					}
					heap := float64(after.HeapAlloc) - float64(before.HeapAlloc)
					b.ReportMetric(heap/float64(s.Entries), "B/membership")
					b.ReportMetric(float64(s.MemoryBytes)/float64(s.Entries), "statsB/membership")
					b.ReportMetric(float64(em)/float64(s.Entries), "emapB/membership")
					b.ReportMetric(float64(s.Entries)/float64(s.Blocks), "memberships/block")
					b.ReportMetric(float64(s.Blocks)/float64(slots), "load")
					b.ReportMetric(float64(s.Entries), "memberships")
					b.ReportMetric(float64(shared), "shared-backends")
					runtime.KeepAlive(f)
					f.ix.Close()
				}
			})
		}
	}
}

// benchClock is a clock that benchmarks advance by hand.
type benchClock struct{ ns atomic.Int64 }

func (c *benchClock) Now() time.Time          { return time.Unix(0, c.ns.Load()) }
func (c *benchClock) Advance(d time.Duration) { c.ns.Add(int64(d)) }

// BenchmarkSpeculate measures Speculate of a 512-block request on one of 16 backends in turn,
// the clock advancing SpeculativeTTL/64 per call (so that about 64 requests' speculation, 4 per
// backend, is live at a time), and the sweep running every DefaultSweepInterval of that clock
// (its time included). Scenarios:
//
//   - held: the backend holds every block (confirmed by events): a lock-free read per key.
//   - new: every key is new to the index and never confirmed (approximate mode): a shard lock
//     per key, and as many earlier entries expire.
//   - extend: the keys are the backend's live speculative entries (approximate mode, a hot
//     prefix): each call extends them.
//   - capped: new keys, ApproximateCapacityBlocks 1,024: each call drops about as many of the
//     backend's oldest speculative blocks as it adds.
//
// ns/key is per key of the request; spec-entries the SpeculativeCount at the end (Stats), and
// blocks the table's blocks.
func BenchmarkSpeculate(b *testing.B) {
	for _, sc := range []string{"held", "new", "extend", "capped"} {
		b.Run(fmt.Sprintf("backends=16/blocks=512/%s", sc), func(b *testing.B) {
			clk := &benchClock{}
			cfg := MemoryConfig{DefaultModel: fleetModel, SweepInterval: -1, Now: clk.Now, MaxEntries: 1 << 20,
				EntryTTL: MaxTTL} // "held" stays held however long the run
			if sc == "capped" {
				cfg.ApproximateCapacityBlocks = 1024
			}
			ix, err := NewMemory(cfg)
			if err != nil {
				b.Fatal(err)
			}
			defer ix.Close()
			ctx := context.Background()
			names := make([]string, fleetBackends)
			for i := range names {
				names[i] = fmt.Sprintf("vllm-%02d", i)
			}
			var reqs [][]uint64
			switch sc {
			case "held":
				toks := make([]uint32, 0, fleetChainBlocks*16)
				hs := make([]uint64, fleetEventBlocks)
				batch := &events.Batch{Model: fleetModel, Events: make([]events.Event, 1)}
				for be := range fleetBackends {
					toks = chainTokens(toks, be)
					for blk := 0; blk < fleetChainBlocks; blk += fleetEventBlocks {
						for i := range hs {
							hs[i] = engineHash(be, be, blk+i)
						}
						ev := events.Event{Kind: events.KindBlockStored, BlockHashes: hs,
							TokenIDs: toks[blk*16 : (blk+fleetEventBlocks)*16], BlockSize: 16}
						if blk > 0 {
							ev.Parent, ev.HasParent = engineHash(be, be, blk-1), true
						}
						batch.Events[0] = ev
						if err := ix.Apply(ctx, names[be], batch); err != nil {
							b.Fatal(err)
						}
					}
					reqs = append(reqs, prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot(fleetModel, ""), toks, 16, nil))
				}
			case "extend":
				for be := range fleetBackends {
					reqs = append(reqs, prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot(fleetModel, ""), chainTokens(nil, be), 16, nil))
					if err := ix.Speculate(ctx, names[be], reqs[be], 0); err != nil {
						b.Fatal(err)
					}
				}
			}
			fresh := make([]uint64, fleetChainBlocks)
			step := DefaultSpeculativeTTL / 64
			sweepEvery := int(DefaultSweepInterval / step)
			b.ReportAllocs()
			b.ResetTimer()
			cpu0 := cpuClock()
			for i := 0; b.Loop(); i++ {
				clk.Advance(step)
				keys := fresh
				if reqs != nil {
					keys = reqs[i%len(reqs)]
				} else {
					for j := range fresh {
						fresh[j] = uint64(i)<<20 | uint64(j)
					}
				}
				if err := ix.Speculate(ctx, names[i%fleetBackends], keys, 0); err != nil {
					b.Fatal(err)
				}
				if i%sweepEvery == sweepEvery-1 {
					ix.sweep()
				}
			}
			b.StopTimer()
			if cpu0 > 0 {
				b.ReportMetric(float64(cpuClock()-cpu0)/float64(b.N), "cpu-ns/op")
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*fleetChainBlocks), "ns/key")
			s, _ := ix.Stats(ctx)
			b.ReportMetric(float64(s.SpeculativeCount), "spec-entries")
			b.ReportMetric(float64(s.Blocks), "blocks")
		})
	}
}
