package scorer

import (
	"math"
	"math/rand/v2"
)

// PickBest returns the index of the highest finite score, or -1 when no score is finite (NaN and
// ±Inf are never picked, so unhealthy candidates at -Inf are skipped). Among equal scores it picks
// the candidate with the lower weighted load InFlight/Weight, then the lower index: the choice is
// deterministic. cands is parallel to scores and only breaks ties; it may be nil or shorter, and
// then ties the load cannot break go to the lower index.
//
// Safe for concurrent use (it reads its arguments only); does not allocate.
func PickBest(scores []float64, cands []Candidate) int { return PickBestFrom(scores, cands, 0) }

// PickBestFrom is PickBest, but ties that the load cannot break go to the first index at or after
// start (modulo len(scores)) rather than to the lowest: a caller that moves start on each call
// spreads equal candidates over the fleet. kvroute's router and disaggregation planner pick so.
func PickBestFrom(scores []float64, cands []Candidate, start int) int {
	n := len(scores)
	if n == 0 {
		return -1
	}
	start %= n
	if start < 0 {
		start += n
	}
	best := -1
	for j := range n {
		i := start + j
		if i >= n {
			i -= n
		}
		s := scores[i]
		if math.IsNaN(s) || math.IsInf(s, 0) {
			continue
		}
		switch {
		case best < 0 || s > scores[best]:
			best = i
		case s == scores[best] && i < len(cands) && best < len(cands) && loadOf(&cands[i]) < loadOf(&cands[best]):
			best = i
		}
	}
	return best
}

// Softmax samples an index with probability proportional to exp((s − max)/Temperature) over the
// finite scores s (max being the largest of them); non-finite scores have probability 0. It is
// Dynamo's --router-temperature.
//
// Ranges. Temperature ≤ 0 (or NaN) means deterministic: Pick returns the lowest index of the
// highest finite score, like PickBest without candidates. As Temperature → 0+ the distribution
// tends to uniform over the highest scores; as it → +Inf, to uniform over all finite scores.
// Temperature is in the units of the scores: Composite scores lie in [0, 1], so 0.01–0.1 is a
// useful range there; Cost scores are in blocks. With Normalize set, scores are first divided by
// their spread (max − min of the finite scores), as Dynamo normalises its cost logits, so that
// Temperature is unitless: at 1 the best and the worst candidate differ by a factor e.
//
// A Softmax is a plain value: safe for concurrent use when rnd is.
type Softmax struct {
	Temperature float64
	Normalize   bool
}

// Pick returns the sampled index, or -1 when no score is finite. rnd returns uniform numbers in
// [0, 1) (values outside are clamped); nil means math/rand/v2's Float64. It is called at most once,
// and not at all when Temperature ≤ 0. Safe for concurrent use when rnd is; does not allocate.
func (sm Softmax) Pick(scores []float64, rnd func() float64) int {
	t := sm.Temperature
	if !(t > 0) {
		return PickBest(scores, nil)
	}
	hi, lo, n := math.Inf(-1), math.Inf(1), 0
	for _, s := range scores {
		if finite(s) {
			hi, lo, n = max(hi, s), min(lo, s), n+1
		}
	}
	if n == 0 {
		return -1
	}
	if n == 1 {
		return PickBest(scores, nil) // nothing to sample; rnd is not called
	}
	scale := t
	if sm.Normalize && hi > lo {
		scale = t * (hi - lo)
	}
	sum := 0.0
	for _, s := range scores {
		if finite(s) {
			sum += softWeight(s, hi, scale)
		}
	}
	if rnd == nil {
		rnd = rand.Float64
	}
	u := rnd()
	if !(u > 0) { // < 0 or NaN
		u = 0
	} else if u >= 1 {
		u = math.Nextafter(1, 0)
	}
	u *= sum
	last := -1
	acc := 0.0
	for i, s := range scores {
		if !finite(s) {
			continue
		}
		w := softWeight(s, hi, scale)
		if w == 0 {
			continue
		}
		acc += w
		last = i
		if u < acc {
			return i
		}
	}
	return last // rounding left u at the very top
}

// softWeight is exp((s − hi)/scale), or 1 for every score when scale is +Inf (uniform).
func softWeight(s, hi, scale float64) float64 {
	if math.IsInf(scale, 1) {
		return 1
	}
	return math.Exp((s - hi) / scale)
}

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }
