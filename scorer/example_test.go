package scorer_test

import (
	"context"
	"fmt"

	"github.com/kvroute/kvroute/scorer"
)

// A KV-aware decision: fall back to consistent hashing when no backend holds enough of the
// request, hand over to the least-loaded backend when the fleet is skewed, else pick the best
// composite score.
func ExampleComposite() {
	comp, err := scorer.NewComposite(scorer.CompositeConfig{}) // 0.6 / 0.3 / 0.1, threshold 0.3
	if err != nil {
		panic(err)
	}
	guard := scorer.Guard{MaxSpread: 8, MaxRatio: 1.5}
	req := scorer.Request{Blocks: 100}
	cands := []scorer.Candidate{
		{Backend: "pod-a", CachedBlocks: 80, WeightedBlocks: 80, InFlight: 4, Weight: 1, Healthy: true, Health: 1},
		{Backend: "pod-b", CachedBlocks: 10, WeightedBlocks: 10, InFlight: 1, Weight: 1, Healthy: true, Health: 1},
		{Backend: "pod-c", CachedBlocks: 90, WeightedBlocks: 90, InFlight: 0, Weight: 1, Healthy: false},
	}
	if !comp.Active(req, cands) {
		fmt.Println("fallback: consistent hashing")
		return
	}
	if guard.Skewed(cands) {
		fmt.Println("imbalance:", cands[guard.LeastLoaded(cands)].Backend)
		return
	}
	scores := comp.Score(req, cands, make([]float64, len(cands)))
	best := scorer.PickBest(scores, cands)
	fmt.Printf("kv_aware: %s (best overlap %.2f, score %.2f)\n", cands[best].Backend, comp.BestOverlapRatio(req, cands), scores[best])
	// Output: kv_aware: pod-a (best overlap 0.80, score 0.58)
}

// Dynamo-style routing: the Active tracker feeds each backend's in-flight blocks to the Cost
// scorer, and the request's lifecycle updates it.
func ExampleCost() {
	cost, _ := scorer.NewCost(scorer.CostConfig{}) // PrefillWeight 1
	active, _ := scorer.NewActive(scorer.ActiveConfig{})

	// Two requests already running on pod-a, sharing their first two blocks.
	active.Add(1, "pod-a", []uint64{11, 12, 13, 14}, 0)
	active.Add(2, "pod-a", []uint64{11, 12, 15, 16}, 2)
	active.FirstToken(1)

	req := scorer.Request{Blocks: 4}
	cands := []scorer.Candidate{
		{Backend: "pod-a", CachedBlocks: 4, Healthy: true},
		{Backend: "pod-b", CachedBlocks: 0, Healthy: true},
	}
	active.Fill(cands)
	scores := cost.Score(req, cands, make([]float64, len(cands)))
	for i, c := range cands {
		fmt.Printf("%s: prefill %d, decode %d, cost %.0f\n", c.Backend, c.ActivePrefillBlocks, c.ActiveDecodeBlocks, -scores[i])
	}
	fmt.Println("chosen:", cands[scorer.PickBest(scores, cands)].Backend)

	active.Done(1)
	active.Done(2)
	p, d := active.Load("pod-a")
	fmt.Println("after Done:", p, d)
	// Output:
	// pod-a: prefill 2, decode 6, cost 12
	// pod-b: prefill 0, decode 0, cost 8
	// chosen: pod-b
	// after Done: 0 0
}

// Softmax sampling spreads requests among near-equal backends; temperature 0 is the argmax.
func ExampleSoftmax() {
	scores := []float64{0.80, 0.78, 0.20}
	u := 0.9 // a fixed "random" number, for the example's output
	rnd := func() float64 { return u }
	fmt.Println(scorer.Softmax{}.Pick(scores, rnd))
	fmt.Println(scorer.Softmax{Temperature: 0.05}.Pick(scores, rnd))
	// Output:
	// 0
	// 1
}

// The prepare phase: concurrent requests for one prefix share one remote index query, and later
// ones within the TTL reuse its answer.
func ExamplePrepareCache() {
	cache, _ := scorer.NewPrepareCache[[]string](scorer.PrepareConfig{}) // TTL 100 ms
	queries := 0
	query := func(ctx context.Context) ([]string, error) {
		queries++ // e.g. a Redis ZREVRANGEBYSCORE under ctx's deadline
		return []string{"pod-a", "pod-b"}, nil
	}
	for range 3 {
		backends, err := cache.Get(context.Background(), 0x9f2c, query)
		fmt.Println(backends, err)
	}
	fmt.Println("queries:", queries)
	// Output:
	// [pod-a pod-b] <nil>
	// [pod-a pod-b] <nil>
	// [pod-a pod-b] <nil>
	// queries: 1
}

// Expected time to first token: pod-a holds the whole prompt, pod-b nothing. Behind a short queue
// pod-a keeps the request, since its cache saves the whole prefill; behind a long queue of prefill
// work the idle pod-b takes it, even counting what the cache miss costs the fleet (CacheWeight,
// 6 by default, times the prefill pod-b must do).
func ExampleExpectedTTFT() {
	ttft, err := scorer.NewExpectedTTFT(scorer.ExpectedTTFTConfig{}) // CacheWeight 6, AttentionCost 2e-5
	if err != nil {
		panic(err)
	}
	req := scorer.Request{Blocks: 512, Tokens: 8192}
	fmt.Printf("prefill of the whole prompt: %.0f\n", scorer.PrefillWork(req.Tokens, 0, scorer.DefaultAttentionCost))
	for _, queued := range []float64{30_000, 120_000} {
		cands := []scorer.Candidate{
			{Backend: "pod-a", CachedBlocks: 512, CachedTokens: 8192, WeightedBlocks: 512, PendingPrefillWork: queued, Weight: 1, Healthy: true},
			{Backend: "pod-b", Weight: 1, Healthy: true},
		}
		scores := ttft.Score(req, cands, make([]float64, len(cands)))
		fmt.Printf("pod-a queue %.0f: cost pod-a %.0f, pod-b %.0f: %s\n", queued, -scores[0], -scores[1],
			cands[scorer.PickBest(scores, cands)].Backend)
	}
	// Output:
	// prefill of the whole prompt: 9534
	// pod-a queue 30000: cost pod-a 30000, pod-b 66739: pod-a
	// pod-a queue 120000: cost pod-a 120000, pod-b 66739: pod-b
}
