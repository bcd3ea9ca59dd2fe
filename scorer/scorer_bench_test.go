package scorer

import (
	"context"
	"strconv"
	"testing"
	"time"
)

// benchCandidates returns n candidates (every eleventh unhealthy) of varied overlap (of a
// blocks-long request), load, queued prefill work, share of the recent decisions and health.
func benchCandidates(n, blocks int) []Candidate {
	c := make([]Candidate, n)
	for i := range c {
		cached := (i * 7) % (blocks + 1)
		c[i] = Candidate{
			Backend:             "pod-" + strconv.Itoa(i),
			CachedBlocks:        cached,
			CachedTokens:        cached * 16,
			WeightedBlocks:      float64(cached) * 0.9,
			InFlight:            i % 5,
			Weight:              1,
			Healthy:             i%11 != 10,
			Health:              0.95,
			ActivePrefillBlocks: (i * 3) % 17,
			ActiveDecodeBlocks:  (i * 13) % 101,
			PendingPrefillWork:  float64((i * 977) % 4096),
			RecentShare:         0.5 + 0.25*float64(i%5),
		}
	}
	return c
}

func BenchmarkCompositeScore(b *testing.B) {
	c, _ := NewComposite(CompositeConfig{})
	benchScore(b, c)
}

func BenchmarkCostScore(b *testing.B) {
	c, _ := NewCost(CostConfig{})
	benchScore(b, c)
}

func BenchmarkExpectedTTFT(b *testing.B) {
	e, _ := NewExpectedTTFT(ExpectedTTFTConfig{})
	benchScore(b, e)
}

// benchScore measures s scoring 16 and 64 candidates for a 512-block request.
func benchScore(b *testing.B, s BackendScorer) {
	for _, n := range []int{16, 64} {
		b.Run("backends="+strconv.Itoa(n), func(b *testing.B) {
			cands := benchCandidates(n, 512)
			req := Request{Blocks: 512, Tokens: 512 * 16}
			out := make([]float64, n)
			b.ReportAllocs()
			for b.Loop() {
				out = s.Score(req, cands, out)
			}
		})
	}
}

func BenchmarkPick(b *testing.B) {
	cands := benchCandidates(64, 512)
	c, _ := NewComposite(CompositeConfig{})
	scores := c.Score(Request{Blocks: 512}, cands, nil)
	b.Run("best/backends=64", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_ = PickBest(scores, cands)
		}
	})
	b.Run("softmax/backends=64", func(b *testing.B) {
		sm := Softmax{Temperature: 0.05}
		rnd := func() float64 { return 0.37 }
		b.ReportAllocs()
		for b.Loop() {
			_ = sm.Pick(scores, rnd)
		}
	})
}

// BenchmarkActiveAddDone registers and frees 512-block requests on one of 16 backends; "shared"
// requests share their first 256 blocks with those still running.
func BenchmarkActiveAddDone(b *testing.B) {
	const blocks, backends, live = 512, 16, 32
	names := make([]string, backends)
	for i := range names {
		names[i] = "pod-" + strconv.Itoa(i)
	}
	for _, shared := range []bool{false, true} {
		b.Run("blocks=512/shared="+strconv.FormatBool(shared), func(b *testing.B) {
			a, _ := NewActive(ActiveConfig{})
			keys := make([]uint64, blocks)
			b.ReportAllocs()
			var id uint64
			for b.Loop() {
				id++
				start := 0
				if shared {
					start = blocks / 2
				}
				for i := range keys {
					if i < start {
						keys[i] = uint64(i) + 1
					} else {
						keys[i] = id<<20 | uint64(i)
					}
				}
				a.Add(id, names[id%backends], keys, start)
				a.FirstToken(id)
				if id > live {
					a.Done(id - live) // keep live requests running
				}
			}
		})
	}
}

func BenchmarkActiveFill(b *testing.B) {
	a, _ := NewActive(ActiveConfig{})
	cands := benchCandidates(16, 512)
	keys := make([]uint64, 512)
	for i := range 64 {
		for k := range keys {
			keys[k] = uint64(i)<<20 | uint64(k)
		}
		a.Add(uint64(i), cands[i%16].Backend, keys, 0)
	}
	b.ReportAllocs()
	for b.Loop() {
		a.Fill(cands)
	}
}

func BenchmarkPrepareCacheHit(b *testing.B) {
	c, _ := NewPrepareCache[[]float64](PrepareConfig{TTL: time.Hour})
	ctx := context.Background()
	fetch := func(context.Context) ([]float64, error) { return make([]float64, 16), nil }
	for k := range uint64(1024) {
		_, _ = c.Get(ctx, k, fetch)
	}
	b.Run("serial", func(b *testing.B) {
		b.ReportAllocs()
		var k uint64
		for b.Loop() {
			k++
			_, _ = c.Get(ctx, k%1024, fetch)
		}
	})
	b.Run("parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			var k uint64
			for pb.Next() {
				k += 7
				_, _ = c.Get(ctx, k%1024, fetch)
			}
		})
	})
}
