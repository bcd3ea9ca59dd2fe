package scorer

// Guard detects a skewed fleet, where cache affinity has piled requests onto a few backends, so
// that the caller can hand the decision to the least-loaded backend (SGLang's cache-aware router
// does the same with its balance_abs_threshold and balance_rel_threshold). Loads are weighted,
// InFlight/Weight, over the healthy candidates only; with uniform weights they are in-flight
// counts.
//
// The zero Guard never reports skew. A Guard is a plain value: safe for concurrent use.
type Guard struct {
	// MaxSpread is the absolute bound: skewed when max − min load > MaxSpread. 0 disables it;
	// negative values count as 0.
	MaxSpread int
	// MaxRatio is the relative bound: skewed when max load > MaxRatio × mean load. 0 disables it;
	// negative values and NaN count as 0. Since max ≥ mean always, useful values are > 1
	// (1.5: the busiest backend carries half again the average).
	MaxRatio float64
}

// Skewed reports whether the healthy candidates' loads exceed the guard's bounds. With one bound
// set, that bound decides; with both set, both must be exceeded (the spread keeps small absolute
// differences, such as 3 against 1, from tripping the ratio). Fewer than two healthy candidates
// are never skewed. Safe for concurrent use; does not allocate.
func (g Guard) Skewed(cands []Candidate) bool {
	spreadOn, ratioOn := g.MaxSpread > 0, g.MaxRatio > 0
	if !spreadOn && !ratioOn {
		return false
	}
	n := 0
	var lo, hi, sum float64
	for i := range cands {
		if !cands[i].Healthy {
			continue
		}
		l := loadOf(&cands[i])
		if n == 0 {
			lo, hi = l, l
		}
		lo, hi, sum, n = min(lo, l), max(hi, l), sum+l, n+1
	}
	if n < 2 {
		return false
	}
	spreadOver := hi-lo > float64(g.MaxSpread)
	ratioOver := sum > 0 && hi > g.MaxRatio*sum/float64(n)
	switch {
	case spreadOn && ratioOn:
		return spreadOver && ratioOver
	case spreadOn:
		return spreadOver
	default:
		return ratioOver
	}
}

// LeastLoaded returns the index of the healthy candidate with the lowest weighted load
// InFlight/Weight, ties to the higher Health, then to the lower index; -1 when no candidate is
// healthy. Safe for concurrent use; does not allocate.
func (g Guard) LeastLoaded(cands []Candidate) int {
	best := -1
	var bestLoad float64
	for i := range cands {
		c := &cands[i]
		if !c.Healthy {
			continue
		}
		l := loadOf(c)
		if best < 0 || l < bestLoad || (l == bestLoad && c.Health > cands[best].Health) {
			best, bestLoad = i, l
		}
	}
	return best
}
