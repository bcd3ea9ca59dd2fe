package costscore

import (
	"errors"
	"fmt"
	"math"

	"github.com/kvroute/kvroute/scorer"
)

// Defaults of Config.
const (
	DefaultQueueWeight  = 1.0
	DefaultRequestCost  = 256.0
	DefaultErrorPenalty = 2048.0
)

// ErrInvalidConfig is wrapped by New's errors.
var ErrInvalidConfig = errors.New("costscore: invalid config")

// Config weighs the terms of the score. The zero value means the defaults. Every field must be
// finite and ≥ 0; 0 means its default.
type Config struct {
	// QueueWeight is the score lost per token queued on the backend: 1 makes a token of queue as
	// costly as a token of prefill (DefaultQueueWeight).
	QueueWeight float64
	// RequestCost is the tokens of queue each request in flight stands for besides its prefill
	// backlog (DefaultRequestCost).
	RequestCost float64
	// ErrorPenalty is the score, in tokens, a backend loses at a success rate of 0
	// (DefaultErrorPenalty); it loses (1 − Health) of it.
	ErrorPenalty float64
}

// Scorer is the cached-minus-queue scorer. It is immutable once built: safe for concurrent use.
// Make one with New; the zero Scorer weighs nothing but the cache.
type Scorer struct {
	cfg Config
}

var _ scorer.BackendScorer = (*Scorer)(nil)

// New validates cfg, applies its defaults and returns the Scorer. The error wraps
// ErrInvalidConfig when a field is negative, NaN or infinite.
func New(cfg Config) (*Scorer, error) {
	for _, f := range []struct {
		name string
		v    *float64
		def  float64
	}{
		{"QueueWeight", &cfg.QueueWeight, DefaultQueueWeight},
		{"RequestCost", &cfg.RequestCost, DefaultRequestCost},
		{"ErrorPenalty", &cfg.ErrorPenalty, DefaultErrorPenalty},
	} {
		if !(*f.v >= 0) || math.IsInf(*f.v, 1) {
			return nil, fmt.Errorf("%w: %s = %v, want a finite value ≥ 0", ErrInvalidConfig, f.name, *f.v)
		}
		if *f.v == 0 {
			*f.v = f.def
		}
	}
	return &Scorer{cfg: cfg}, nil
}

// Config returns the configuration in effect, defaults applied.
func (s *Scorer) Config() Config { return s.cfg }

// Score implements scorer.BackendScorer: it writes each candidate's score (see the package doc)
// into out and returns out[:len(cands)], a new slice only when cap(out) < len(cands). Higher is
// better; unhealthy candidates score -Inf; negative counts count as 0 and a health outside [0, 1]
// is clamped, so that every healthy score is finite. req is not needed: the cached prefix is the
// candidate's. Safe for concurrent use; allocates nothing when out is large enough.
func (s *Scorer) Score(_ scorer.Request, cands []scorer.Candidate, out []float64) []float64 {
	if cap(out) < len(cands) {
		out = make([]float64, len(cands))
	}
	out = out[:len(cands)]
	for i := range cands {
		c := &cands[i]
		if !c.Healthy {
			out[i] = math.Inf(-1)
			continue
		}
		cached := 0.0
		if c.CachedBlocks > 0 && c.CachedTokens > 0 && c.WeightedBlocks > 0 {
			cached = float64(c.CachedTokens) * min(c.WeightedBlocks/float64(c.CachedBlocks), 1)
		}
		w := c.Weight
		if !(w > 0) || math.IsInf(w, 1) {
			w = 1
		}
		queue := (float64(max(c.PendingPrefillTokens, 0)) + s.cfg.RequestCost*float64(max(c.InFlight, 0))) / w
		health := c.Health
		if !(health >= 0) {
			health = 0
		}
		health = min(health, 1)
		out[i] = cached - s.cfg.QueueWeight*queue - s.cfg.ErrorPenalty*(1-health)
	}
	return out
}
