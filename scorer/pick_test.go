package scorer

import (
	"math"
	"testing"
)

func TestPickBest(t *testing.T) {
	inf, nan := math.Inf(1), math.NaN()
	idle := Candidate{Healthy: true}
	busy := Candidate{InFlight: 3, Healthy: true}
	tests := []struct {
		name   string
		scores []float64
		cands  []Candidate
		want   int
	}{
		{name: "empty", want: -1},
		{name: "none finite", scores: []float64{-inf, nan, inf}, want: -1},
		{name: "argmax", scores: []float64{0.1, 0.9, 0.5}, want: 1},
		{name: "skips non-finite", scores: []float64{nan, -inf, inf, -7}, want: 3},
		{name: "negative scores", scores: []float64{-18, -10, -11}, want: 1},
		{name: "tie to lower load", scores: []float64{0.5, 0.5}, cands: []Candidate{busy, idle}, want: 1},
		{name: "tie to lower weighted load", scores: []float64{0.5, 0.5}, cands: []Candidate{{InFlight: 2, Weight: 1}, {InFlight: 3, Weight: 2}}, want: 1},
		{name: "tie at equal load to lower index", scores: []float64{0.2, 0.5, 0.5}, cands: []Candidate{idle, busy, busy}, want: 1},
		{name: "tie without cands to lower index", scores: []float64{0.5, 0.5}, want: 0},
		{name: "short cands", scores: []float64{0.5, 0.5, 0.5}, cands: []Candidate{busy, busy}, want: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := PickBest(tt.scores, tt.cands); got != tt.want {
				t.Errorf("PickBest = %d, want %d", got, tt.want)
			}
		})
	}
}

// sweep picks with n evenly spaced rnd values in (0, 1) and counts the picks per index.
func sweep(sm Softmax, scores []float64, n int) []int {
	counts := make([]int, len(scores)+1)
	for k := range n {
		u := (float64(k) + 0.5) / float64(n)
		i := sm.Pick(scores, func() float64 { return u })
		counts[i+1]++ // index -1 lands in counts[0]
	}
	return counts[1:]
}

func TestSoftmaxDistribution(t *testing.T) {
	inf := math.Inf(1)
	e := math.E
	tests := []struct {
		name   string
		sm     Softmax
		scores []float64
		want   []float64 // probabilities
	}{
		{name: "ln2 apart at T=1", sm: Softmax{Temperature: 1}, scores: []float64{0, math.Ln2}, want: []float64{1.0 / 3, 2.0 / 3}},
		{name: "temperature scales", sm: Softmax{Temperature: 0.5}, scores: []float64{0, math.Ln2 / 2}, want: []float64{1.0 / 3, 2.0 / 3}},
		{name: "non-finite never", sm: Softmax{Temperature: 1}, scores: []float64{-inf, 0, math.NaN(), 0, inf}, want: []float64{0, 0.5, 0, 0.5, 0}},
		{name: "normalized by spread", sm: Softmax{Temperature: 1, Normalize: true}, scores: []float64{-100, 0}, want: []float64{1 / (1 + e), e / (1 + e)}},
		{name: "normalized cost scale", sm: Softmax{Temperature: 1, Normalize: true}, scores: []float64{-18, -10, -11},
			want: func() []float64 {
				w := []float64{math.Exp(-8.0 / 8), 1, math.Exp(-1.0 / 8)}
				s := w[0] + w[1] + w[2]
				return []float64{w[0] / s, w[1] / s, w[2] / s}
			}()},
		{name: "equal scores uniform", sm: Softmax{Temperature: 1, Normalize: true}, scores: []float64{3, 3, 3, 3}, want: []float64{0.25, 0.25, 0.25, 0.25}},
		{name: "infinite temperature uniform", sm: Softmax{Temperature: inf}, scores: []float64{0, 100, -inf}, want: []float64{0.5, 0.5, 0}},
		{name: "tiny temperature among the best", sm: Softmax{Temperature: 1e-300}, scores: []float64{0.9, 0.1, 0.9}, want: []float64{0.5, 0, 0.5}},
	}
	const n = 30000
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			counts := sweep(tt.sm, tt.scores, n)
			for i, p := range tt.want {
				if got := float64(counts[i]) / n; math.Abs(got-p) > 2.0/n {
					t.Errorf("P(%d) = %v, want %v (counts %v)", i, got, p, counts)
				}
			}
		})
	}
}

func TestSoftmaxDeterministic(t *testing.T) {
	inf := math.Inf(1)
	noRnd := func() float64 { panic("rnd called") }
	tests := []struct {
		name   string
		sm     Softmax
		scores []float64
		want   int
	}{
		{name: "zero temperature is argmax", scores: []float64{0.1, 0.9, 0.9}, want: 1},
		{name: "negative temperature is argmax", sm: Softmax{Temperature: -1}, scores: []float64{0.1, 0.9}, want: 1},
		{name: "NaN temperature is argmax", sm: Softmax{Temperature: math.NaN()}, scores: []float64{0.9, 0.1}, want: 0},
		{name: "none finite", sm: Softmax{Temperature: 1}, scores: []float64{-inf, math.NaN()}, want: -1},
		{name: "empty", sm: Softmax{Temperature: 1}, want: -1},
		{name: "single finite", sm: Softmax{Temperature: 1}, scores: []float64{-inf, 2, -inf}, want: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.sm.Pick(tt.scores, noRnd); got != tt.want {
				t.Errorf("Pick = %d, want %d", got, tt.want)
			}
		})
	}
}

func TestSoftmaxRndClamped(t *testing.T) {
	sm := Softmax{Temperature: 1}
	scores := []float64{0, 0, math.Inf(-1)}
	for _, tt := range []struct {
		name string
		u    float64
		want int
	}{
		{"below zero", -3, 0},
		{"NaN", math.NaN(), 0},
		{"one", 1, 1},
		{"above one", 7, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := sm.Pick(scores, func() float64 { return tt.u }); got != tt.want {
				t.Errorf("Pick = %d, want %d", got, tt.want)
			}
		})
	}
	t.Run("nil rnd", func(t *testing.T) {
		for range 100 {
			if got := sm.Pick(scores, nil); got != 0 && got != 1 {
				t.Fatalf("Pick = %d", got)
			}
		}
	})
}

func TestPickAllocs(t *testing.T) {
	scores := make([]float64, 64)
	for i := range scores {
		scores[i] = float64(i%7) / 7
	}
	cands := benchCandidates(64, 16)
	sm := Softmax{Temperature: 0.1}
	rnd := func() float64 { return 0.42 }
	assertNoAllocs(t, func() { _ = PickBest(scores, cands) })
	assertNoAllocs(t, func() { _ = sm.Pick(scores, rnd) })
}

func TestPickBestFrom(t *testing.T) {
	inf := math.Inf(1)
	scores := []float64{1, 3, 3, 3, -inf, inf, math.NaN()}
	cands := []Candidate{{}, {InFlight: 1}, {}, {}, {}, {}, {}}
	for _, tc := range []struct{ start, want int }{{0, 2}, {2, 2}, {3, 3}, {4, 2}, {-1, 2}, {9, 2}} {
		if got := PickBestFrom(scores, cands, tc.start); got != tc.want {
			t.Errorf("start %d: picked %d, want %d", tc.start, got, tc.want)
		}
	}
	if got := PickBestFrom(scores, nil, 3); got != 3 {
		t.Errorf("without candidates, start 3: picked %d, want 3 (ties in rotation order)", got)
	}
	if got := PickBestFrom([]float64{math.NaN(), inf}, nil, 0); got != -1 {
		t.Errorf("no finite score: %d", got)
	}
	if got := PickBestFrom(nil, nil, 5); got != -1 {
		t.Errorf("no scores: %d", got)
	}
}
