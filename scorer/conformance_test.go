package scorer_test

import (
	"errors"
	"testing"

	"github.com/kvroute/kvroute/scorer"
	"github.com/kvroute/kvroute/scorer/scorertest"
)

func TestCompositeConformance(t *testing.T) {
	scorertest.Run(t, func(t *testing.T) scorer.BackendScorer {
		c, err := scorer.NewComposite(scorer.CompositeConfig{})
		if err != nil {
			t.Fatal(err)
		}
		return c
	})
}

func TestCostConformance(t *testing.T) {
	scorertest.Run(t, func(t *testing.T) scorer.BackendScorer {
		c, err := scorer.NewCost(scorer.CostConfig{})
		if err != nil {
			t.Fatal(err)
		}
		return c
	})
}

func TestExpectedTTFTConformance(t *testing.T) {
	scorertest.Run(t, func(t *testing.T) scorer.BackendScorer {
		e, err := scorer.NewExpectedTTFT(scorer.ExpectedTTFTConfig{})
		if err != nil {
			t.Fatal(err)
		}
		return e
	})
}

// ScoreSafely turns a scorer's wrong answer or panic into ErrBadScores.
func TestScoreSafely(t *testing.T) {
	cands := []scorer.Candidate{{Backend: "a", Healthy: true}, {Backend: "b", Healthy: true}}
	for name, s := range map[string]scorer.BackendScorer{
		"short": scorer.Func(func(_ scorer.Request, _ []scorer.Candidate, out []float64) []float64 { return out[:1] }),
		"long":  scorer.Func(func(_ scorer.Request, _ []scorer.Candidate, _ []float64) []float64 { return make([]float64, 3) }),
		"panic": scorer.Func(func(_ scorer.Request, _ []scorer.Candidate, out []float64) []float64 { return out[:5] }),
	} {
		if _, err := scorer.ScoreSafely(s, scorer.Request{}, cands, nil); !errors.Is(err, scorer.ErrBadScores) {
			t.Errorf("%s: %v, want ErrBadScores", name, err)
		}
	}
	ok := scorer.Func(func(_ scorer.Request, cands []scorer.Candidate, out []float64) []float64 {
		for i := range cands {
			out[i] = float64(i)
		}
		return out[:len(cands)]
	})
	got, err := scorer.ScoreSafely(ok, scorer.Request{}, cands, nil)
	if err != nil || len(got) != 2 || got[1] != 1 {
		t.Errorf("%v %v", got, err)
	}
}
