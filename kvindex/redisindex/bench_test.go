package redisindex

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
)

// reportLatency reports the p50 and p99 of lat (one sample per op) as custom metrics.
func reportLatency(b *testing.B, lat []time.Duration) {
	if len(lat) == 0 {
		return
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "p99-ns")
}

// BenchmarkLookup measures one Lookup round trip (HMGET of the ids, GET of the epoch and MGET of
// the block strings, pipelined; the walk runs in Go) against REDIS_ADDR over loopback. The index
// is preloaded with 3,000 background chains of 32 blocks, each held by 2 of the 16 backends (192k
// memberships), plus the request's own 512-block chain, which backend i holds the first 32·(i+1)
// blocks of: the walk goes the whole 512 blocks, dropping one candidate every 32. ns/op and
// p50-ns are the latency a Route() would wait; "ping" is the bare loopback round trip for
// comparison.
//
//	REDIS_ADDR=127.0.0.1:6379 go test ./kvindex/redisindex -run '^$' -bench . -benchtime 2s
func BenchmarkLookup(b *testing.B) {
	f := newRedisFixture(b, Config{})
	ctx := context.Background()
	const backends = 16
	names := make([]string, backends)
	for i := range names {
		names[i] = fmt.Sprintf("vllm-%02d", i)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	// Background chains, applied 25 events per batch.
	const chains, chainBlocks, holders = 3000, 32, 2
	perBackend := make([][]events.Event, backends)
	for c := 0; c < chains; c++ {
		toks := redisTokens(1_000+c, chainBlocks*16)
		for h := 0; h < holders; h++ {
			be := rng.IntN(backends)
			perBackend[be] = append(perBackend[be], redisStored(redisHashes(uint64(c)<<20, chainBlocks), 0, false, toks, 16, events.TierGPU))
		}
	}
	for be, evs := range perBackend {
		for len(evs) > 0 {
			n := min(25, len(evs))
			redisApply(b, f.idx, names[be], evs[:n]...)
			evs = evs[n:]
		}
	}
	// The request's chain.
	tokens := redisTokens(7, 512*16)
	keys := redisReqKeys(tokens, 16)
	for i, name := range names {
		for e := 0; e <= i; e++ {
			base := uint64(1)<<40 | uint64(e*32)
			redisApply(b, f.idx, name, redisStored(redisHashes(base, 32), base-1, e > 0, tokens[e*512:(e+1)*512], 16, events.TierGPU))
		}
	}
	if s, err := f.idx.Stats(ctx); err == nil {
		b.Logf("preloaded: %d entries, %d blocks", s.Entries, s.Blocks)
	}
	out := make([]kvindex.Match, backends)
	if _, err := f.idx.Lookup(ctx, keys, names, out); err != nil { // loads the script
		b.Fatal(err)
	}
	if out[backends-1].Blocks != 512 || out[0].Blocks != 32 {
		b.Fatalf("preload: %+v", out)
	}

	for _, tc := range []struct {
		blocks, backends int
	}{{512, 16}, {32, 16}, {512, 4}} {
		b.Run(fmt.Sprintf("blocks=%d/backends=%d", tc.blocks, tc.backends), func(b *testing.B) {
			ks, cands := keys[:tc.blocks], names[len(names)-tc.backends:]
			lat := make([]time.Duration, 0, b.N)
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				t0 := time.Now()
				if _, err := f.idx.Lookup(ctx, ks, cands, out); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(t0))
			}
			b.StopTimer()
			reportLatency(b, lat)
		})
	}
	b.Run("blocks=512/backends=16/parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			out := make([]kvindex.Match, backends)
			for pb.Next() {
				if _, err := f.idx.Lookup(ctx, keys, names, out); err != nil {
					b.Error(err)
					return
				}
			}
		})
	})
	b.Run("ping", func(b *testing.B) {
		lat := make([]time.Duration, 0, b.N)
		b.ReportAllocs()
		for range b.N {
			t0 := time.Now()
			if err := f.client.Do(ctx, f.client.B().Ping().Build()).Error(); err != nil {
				b.Fatal(err)
			}
			lat = append(lat, time.Since(t0))
		}
		b.StopTimer()
		reportLatency(b, lat)
	})
}

// BenchmarkApply measures Apply of chained BlockStored batches (4 events × 16 blocks, each
// event's parent the previous one's last block, so no read round trip) for one backend: one
// pipelined round trip of about 2 commands per block. blocks/s is the write throughput of one
// consumer; several backends' consumers run in parallel.
//
//	REDIS_ADDR=127.0.0.1:6379 go test ./kvindex/redisindex -run '^$' -bench 'BenchmarkApply' -benchtime 2s
func BenchmarkApply(b *testing.B) {
	f := newRedisFixture(b, Config{})
	ctx := context.Background()
	const events4, perEvent = 4, 16
	const perBatch = events4 * perEvent
	tokens := redisTokens(3, perBatch*16)
	b.Run(fmt.Sprintf("blocks_per_batch=%d", perBatch), func(b *testing.B) {
		backend := fmt.Sprintf("apply-%d", b.N)
		batch := &events.Batch{Model: redisTestModel, Events: make([]events.Event, events4)}
		hashes := make([]uint64, perBatch)
		var next uint64 = 1
		lat := make([]time.Duration, 0, b.N)
		b.ReportAllocs()
		b.ResetTimer()
		for i := range b.N {
			for j := range hashes {
				hashes[j] = next
				next++
			}
			for e := range events4 {
				ev := redisStored(hashes[e*perEvent:(e+1)*perEvent], hashes[e*perEvent]-1, i > 0 || e > 0,
					tokens[e*perEvent*16:(e+1)*perEvent*16], 16, events.TierGPU)
				batch.Events[e] = ev
			}
			// Tokens repeat, so the chain's keys are new only through their parents: still a new
			// key per block, as in a real stream.
			t0 := time.Now()
			if err := f.idx.Apply(ctx, backend, batch); err != nil {
				b.Fatal(err)
			}
			lat = append(lat, time.Since(t0))
		}
		b.StopTimer()
		b.ReportMetric(float64(b.N*perBatch)/b.Elapsed().Seconds(), "blocks/s")
		reportLatency(b, lat)
	})
}
