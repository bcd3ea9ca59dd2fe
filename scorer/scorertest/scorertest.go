// Package scorertest is a conformance suite for implementations of scorer.BackendScorer, in the
// manner of testing/slogtest: call Run from a test with a constructor for your scorer.
//
//	func TestMyScorer(t *testing.T) {
//		scorertest.Run(t, func(t *testing.T) scorer.BackendScorer { return myscorer.New() })
//	}
//
// What the suite requires, beyond the method's documented contract:
//
//   - one score per candidate, written into out when it is long enough, in the candidates' order;
//   - unhealthy candidates score -Inf; healthy ones a finite number (never NaN or +Inf);
//   - the candidates are left as they came;
//   - the same input gives the same scores, and Score is safe for concurrent use;
//   - a candidate that holds more of the request, all else equal, scores at least as high, and a
//     more loaded one, all else equal, no higher: kvroute's routing relies on both directions;
//   - no candidates: no scores, no panic.
//
// kvroute calls every scorer through scorer.ScoreSafely, so a scorer that breaks these rules
// costs fallback decisions rather than the process; the suite tells you before production does.
package scorertest

import (
	"math"
	"slices"
	"sync"
	"testing"

	"github.com/kvroute/kvroute/scorer"
)

// Run runs the suite against the scorers newScorer returns (one per subtest).
func Run(t *testing.T, newScorer func(t *testing.T) scorer.BackendScorer) {
	t.Helper()
	req := scorer.Request{Blocks: 64, Tokens: 64 * 16}
	fleet := func() []scorer.Candidate {
		return []scorer.Candidate{
			{Backend: "a", CachedBlocks: 48, CachedTokens: 48 * 16, WeightedBlocks: 48, InFlight: 2, Weight: 1, Healthy: true, Health: 1},
			{Backend: "b", CachedBlocks: 8, CachedTokens: 8 * 16, WeightedBlocks: 8, InFlight: 0, Weight: 1, Healthy: true, Health: 1},
			{Backend: "c", InFlight: 1, Weight: 2, Healthy: true, Health: 0.5},
			{Backend: "d", CachedBlocks: 64, CachedTokens: 64 * 16, WeightedBlocks: 64, Weight: 1, Healthy: false},
		}
	}

	t.Run("one finite score per healthy candidate, -Inf for unhealthy", func(t *testing.T) {
		s := newScorer(t)
		cands := fleet()
		out := make([]float64, len(cands))
		got := s.Score(req, cands, out)
		if len(got) != len(cands) {
			t.Fatalf("%d scores for %d candidates", len(got), len(cands))
		}
		if &got[0] != &out[0] {
			t.Errorf("the scores were not written into out, which was long enough")
		}
		for i, c := range cands {
			switch v := got[i]; {
			case !c.Healthy && !math.IsInf(v, -1):
				t.Errorf("unhealthy %s scored %v, want -Inf", c.Backend, v)
			case c.Healthy && (math.IsNaN(v) || math.IsInf(v, 0)):
				t.Errorf("healthy %s scored %v, want a finite score", c.Backend, v)
			}
		}
	})

	t.Run("candidates left as they came", func(t *testing.T) {
		s := newScorer(t)
		cands := fleet()
		_ = s.Score(req, cands, make([]float64, len(cands)))
		if !slices.Equal(cands, fleet()) {
			t.Errorf("Score changed its candidates: %+v", cands)
		}
	})

	t.Run("more cached scores at least as high", func(t *testing.T) {
		s := newScorer(t)
		for _, blocks := range []int{0, 1, 16, 63} {
			less := scorer.Candidate{Backend: "x", CachedBlocks: blocks, CachedTokens: blocks * 16, WeightedBlocks: float64(blocks),
				InFlight: 1, Weight: 1, Healthy: true, Health: 1}
			more := less
			more.Backend, more.CachedBlocks, more.CachedTokens, more.WeightedBlocks = "y", blocks+1, (blocks+1)*16, float64(blocks+1)
			got := s.Score(req, []scorer.Candidate{less, more}, make([]float64, 2))
			if got[1] < got[0] {
				t.Errorf("%d cached blocks scored %v, %d scored %v", blocks+1, got[1], blocks, got[0])
			}
		}
	})

	t.Run("more load scores no higher", func(t *testing.T) {
		s := newScorer(t)
		for _, n := range []int{0, 1, 8} {
			idle := scorer.Candidate{Backend: "x", CachedBlocks: 16, CachedTokens: 256, WeightedBlocks: 16, InFlight: n, Weight: 1, Healthy: true, Health: 1}
			busy := idle
			busy.Backend, busy.InFlight, busy.PendingPrefillTokens = "y", n+4, 4096
			got := s.Score(req, []scorer.Candidate{idle, busy}, make([]float64, 2))
			if got[1] > got[0] {
				t.Errorf("%d in flight scored %v, %d scored %v", n+4, got[1], n, got[0])
			}
		}
	})

	t.Run("deterministic and safe for concurrent use", func(t *testing.T) {
		s := newScorer(t)
		want := slices.Clone(s.Score(req, fleet(), make([]float64, 4)))
		var wg sync.WaitGroup
		errs := make(chan []float64, 8)
		for range 8 {
			wg.Go(func() {
				for range 200 {
					got := s.Score(req, fleet(), make([]float64, 4))
					if !slices.Equal(got, want) {
						errs <- slices.Clone(got)
						return
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for got := range errs {
			t.Errorf("scores %v, earlier %v", got, want)
		}
	})

	t.Run("no candidates", func(t *testing.T) {
		s := newScorer(t)
		if got := s.Score(req, nil, nil); len(got) != 0 {
			t.Errorf("%d scores for no candidates", len(got))
		}
	})
}
