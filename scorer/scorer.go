package scorer

import (
	"errors"
	"fmt"
)

// Candidate is what a scorer knows of one backend for one request: a snapshot, read-only.
type Candidate struct {
	Backend string
	// CachedBlocks and CachedTokens: the longest consecutive prefix of the request the backend
	// holds; WeightedBlocks is the same prefix weighted by tier (kvindex.Match.WeightedBlocks).
	CachedBlocks   int
	CachedTokens   int
	WeightedBlocks float64
	// InFlight is the number of requests routed to the backend and not yet done; Weight its
	// relative capacity (1 when unset).
	InFlight int
	Weight   float64
	// Healthy backends may be chosen; Health is their recent success rate in [0, 1].
	Healthy bool
	Health  float64
	// ActivePrefillBlocks and ActiveDecodeBlocks are the backend's active-sequence load in blocks
	// (see Active): blocks still being prefilled, and blocks held by running sequences.
	ActivePrefillBlocks int
	ActiveDecodeBlocks  int
	// PendingPrefillTokens is the prefill work queued on the backend: the prompt tokens, not
	// cached there, of the requests routed to it that have not produced a first token (0 when
	// the router does not know prompt lengths).
	PendingPrefillTokens int
	// PendingPrefillWork is the router's estimate of the prefill work still ahead of a new
	// request on the backend, in token-equivalents (PrefillWork of each request routed there
	// whose first token has not come, with the router's attention cost), less the progress it
	// estimates on the first of them since it began (at the prefill rate the backend's first
	// tokens showed, never more than that request's own work). 0 when nothing is queued or the
	// router does not know prompt lengths.
	PendingPrefillWork float64
	// RecentShare is the backend's share of the router's recent decisions (decayed over a few
	// minutes) over its share of the fleet's weight: 1 is its fair share, 2 twice that; 0 when
	// unknown (kvroute's Router reports it once the fleet has had a few recent decisions per
	// backend).
	RecentShare float64
	// PrefillRate is the backend's prefill rate as the router measured it from first tokens, in
	// token-equivalents of PendingPrefillWork per second; 0 when unknown (kvroute's Router
	// reports it once a few of the backend's prefills have ended).
	PrefillRate float64
}

// Request is what a scorer knows of the request itself.
type Request struct {
	// Blocks and Tokens: the request's prompt length in full blocks and in tokens (0 when the
	// prompt was not tokenized).
	Blocks int
	Tokens int
}

// BackendScorer scores candidates for one request. Score writes one score per candidate into
// out (len(out) ≥ len(cands)) and returns out[:len(cands)]; higher is better, and unhealthy
// candidates score -Inf (never chosen). Implementations are safe for concurrent use and allocate
// nothing per call.
type BackendScorer interface {
	Score(req Request, cands []Candidate, out []float64) []float64
}

// Func adapts a function to BackendScorer.
type Func func(req Request, cands []Candidate, out []float64) []float64

// Score calls f.
func (f Func) Score(req Request, cands []Candidate, out []float64) []float64 {
	return f(req, cands, out)
}

var _ BackendScorer = Func(nil)

// AttentionCoster is implemented by a scorer that measures prefill work with PrefillWork: its
// attention cost (0: none, work is tokens). A kvroute Router measures the prefill work queued on
// each backend (Candidate.PendingPrefillWork) with the same cost, so that the scorer compares
// like with like; ExpectedTTFT implements it.
type AttentionCoster interface {
	AttentionCost() float64
}

// SequenceTracker is implemented by a scorer that reads the Candidate.Active* fields: a kvroute
// Router fills them from the tracker Sequences returns and records there each request its tier
// 4 places; Cost implements it.
type SequenceTracker interface {
	Sequences() *Active
}

// ErrBadScores is returned by ScoreSafely when a scorer returned another number of scores than
// candidates, or panicked.
var ErrBadScores = errors.New("scorer: the scorer returned no score per candidate")

// ScoreSafely calls s.Score with out sized to len(cands) (grown when too small) and checks its
// answer: it returns the scores, or ErrBadScores (wrapped with what went wrong) when the scorer
// returned another number of scores than candidates or panicked. kvroute calls every scorer,
// its own and third parties', through it, so that a faulty scorer costs a fallback decision,
// never the process. It is safe for concurrent use when s is.
func ScoreSafely(s BackendScorer, req Request, cands []Candidate, out []float64) (scores []float64, err error) {
	if cap(out) < len(cands) {
		out = make([]float64, len(cands))
	}
	out = out[:len(cands)]
	defer func() {
		if p := recover(); p != nil {
			scores, err = nil, fmt.Errorf("%w: it panicked: %v", ErrBadScores, p)
		}
	}()
	scores = s.Score(req, cands, out)
	if len(scores) != len(cands) {
		return nil, fmt.Errorf("%w: %d scores for %d candidates", ErrBadScores, len(scores), len(cands))
	}
	return scores, nil
}
