package disagg

import (
	"fmt"
	"testing"
)

// BenchmarkPlan measures one Plan over fleets of growing size (a third prefill, the rest decode,
// one unified), for the three paths the caches decide between.
func BenchmarkPlan(b *testing.B) {
	for _, n := range []int{6, 24, 64} {
		for _, path := range []string{"fast_decode", "storage_hit", "prefill_then_decode"} {
			b.Run(fmt.Sprintf("backends=%d/path=%s", n, path), func(b *testing.B) {
				p, _ := New(Config{DefaultStorage: storeA})
				cands := []Candidate{uni("u", 0)}
				for i := range n - 1 {
					if i%3 == 0 {
						cands = append(cands, pre(fmt.Sprint("p", i), i%4, 0, TierGPU))
					} else {
						cands = append(cands, dec(fmt.Sprint("d", i), i%5, 0, TierGPU))
					}
				}
				switch path {
				case "fast_decode":
					cands[2].CachedTokens, cands[2].WeightedBlocks = 4000, 250
				case "storage_hit":
					cands[1].CachedTokens, cands[1].WeightedBlocks, cands[1].Tier = 4000, 150, TierStorage
				}
				input := Input{Candidates: cands, PromptTokens: 4096, PromptBlocks: 256}
				b.ReportAllocs()
				for b.Loop() {
					plan, _ := p.Plan(input)
					if plan.Path == 0 {
						b.Fatal("no plan")
					}
				}
			})
		}
	}
}
