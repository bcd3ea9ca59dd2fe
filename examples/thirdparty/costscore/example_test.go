package costscore_test

import (
	"fmt"

	"github.com/kvroute/kvroute/scorer"

	"example.com/thirdparty/costscore"
)

// A warm but busy backend against a cold idle one: the queue in front of the warm one costs more
// than the 512 tokens of prefill it would save.
func Example() {
	s, err := costscore.New(costscore.Config{})
	if err != nil {
		panic(err)
	}
	cands := []scorer.Candidate{
		{Backend: "warm", CachedBlocks: 32, CachedTokens: 512, WeightedBlocks: 32, InFlight: 2, PendingPrefillTokens: 300,
			Weight: 1, Healthy: true, Health: 1},
		{Backend: "cold", Weight: 1, Healthy: true, Health: 1},
	}
	scores := s.Score(scorer.Request{Blocks: 32, Tokens: 512}, cands, make([]float64, len(cands)))
	for i, c := range cands {
		fmt.Printf("%s: %v\n", c.Backend, scores[i])
	}
	fmt.Println("best:", cands[scorer.PickBest(scores, cands)].Backend)
	// Output:
	// warm: -300
	// cold: 0
	// best: cold
}
