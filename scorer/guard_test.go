package scorer

import (
	"math"
	"testing"
)

func loads(inFlight ...int) []Candidate {
	c := make([]Candidate, len(inFlight))
	for i, n := range inFlight {
		c[i] = Candidate{InFlight: n, Healthy: true, Health: 1}
	}
	return c
}

func TestGuardSkewed(t *testing.T) {
	withSick := loads(10, 0, 6)
	withSick[1].Healthy = false
	weighted := loads(10, 5)
	weighted[0].Weight = 2
	tests := []struct {
		name  string
		g     Guard
		cands []Candidate
		want  bool
	}{
		{name: "zero guard never", cands: loads(100, 0), want: false},
		{name: "negative bounds never", g: Guard{MaxSpread: -1, MaxRatio: math.NaN()}, cands: loads(100, 0), want: false},
		{name: "spread over", g: Guard{MaxSpread: 4}, cands: loads(5, 0, 2), want: true},
		{name: "spread at bound", g: Guard{MaxSpread: 5}, cands: loads(5, 0, 2), want: false},
		{name: "ratio over", g: Guard{MaxRatio: 1.5}, cands: loads(8, 2, 2), want: true}, // mean 4, max 8
		{name: "ratio at bound", g: Guard{MaxRatio: 2}, cands: loads(8, 2, 2), want: false},
		{name: "all idle", g: Guard{MaxRatio: 1.1}, cands: loads(0, 0), want: false},
		{name: "both: spread alone is not enough", g: Guard{MaxSpread: 4, MaxRatio: 3}, cands: loads(10, 4, 4), want: false},
		{name: "both: ratio alone is not enough", g: Guard{MaxSpread: 4, MaxRatio: 1.5}, cands: loads(4, 1), want: false},
		{name: "both over", g: Guard{MaxSpread: 4, MaxRatio: 1.5}, cands: loads(12, 2, 1), want: true},
		{name: "unhealthy ignored", g: Guard{MaxSpread: 5}, cands: withSick, want: false},
		{name: "one healthy never", g: Guard{MaxSpread: 1}, cands: []Candidate{{InFlight: 9, Healthy: true}, {InFlight: 0}}, want: false},
		{name: "weighted loads equal", g: Guard{MaxSpread: 1}, cands: weighted, want: false},
		{name: "no candidates", g: Guard{MaxSpread: 1}, want: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.g.Skewed(tt.cands); got != tt.want {
				t.Errorf("Skewed = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestGuardLeastLoaded(t *testing.T) {
	sick := loads(5, 0, 3)
	sick[1].Healthy = false
	healthTie := loads(2, 2, 2)
	healthTie[0].Health, healthTie[1].Health, healthTie[2].Health = 0.5, 0.9, 0.9
	weighted := loads(4, 3)
	weighted[0].Weight = 2
	tests := []struct {
		name  string
		cands []Candidate
		want  int
	}{
		{name: "none", want: -1},
		{name: "all unhealthy", cands: []Candidate{{InFlight: 1}}, want: -1},
		{name: "lowest", cands: loads(5, 1, 3), want: 1},
		{name: "unhealthy skipped", cands: sick, want: 2},
		{name: "tie to health then index", cands: healthTie, want: 1},
		{name: "weighted", cands: weighted, want: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := (Guard{}).LeastLoaded(tt.cands); got != tt.want {
				t.Errorf("LeastLoaded = %d, want %d", got, tt.want)
			}
		})
	}
}

func TestGuardAllocs(t *testing.T) {
	g := Guard{MaxSpread: 8, MaxRatio: 1.5}
	cands := benchCandidates(64, 16)
	assertNoAllocs(t, func() { _ = g.Skewed(cands) })
	assertNoAllocs(t, func() { _ = g.LeastLoaded(cands) })
}
