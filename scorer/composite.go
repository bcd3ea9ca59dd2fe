package scorer

import (
	"errors"
	"fmt"
	"math"
)

// ErrInvalidConfig is wrapped by every error a constructor of this package returns for a
// configuration it cannot accept (weights that do not sum to 1, a value out of its range).
var ErrInvalidConfig = errors.New("scorer: invalid config")

// Defaults of CompositeConfig, from kvroute's kv_overlap scorer.
const (
	DefaultOverlapWeight       = 0.6
	DefaultLoadWeight          = 0.3
	DefaultHealthWeight        = 0.1
	DefaultMinOverlapThreshold = 0.3
	// DefaultPrefillTokensPerRequest is CompositeConfig.PrefillTokensPerRequest when zero.
	DefaultPrefillTokensPerRequest = 1024
)

// weightSumTolerance is how far from 1.0 the three composite weights may sum.
const weightSumTolerance = 1e-9

// CompositeConfig configures a Composite. Its zero value means the defaults: weights 0.6/0.3/0.1
// and a minimum overlap of 0.3.
type CompositeConfig struct {
	// OverlapWeight, LoadWeight and HealthWeight weigh the three signals. When all three are 0 the
	// defaults (DefaultOverlapWeight, DefaultLoadWeight, DefaultHealthWeight) apply; otherwise each
	// must be ≥ 0 and they must sum to 1.0 (within 1e-9).
	OverlapWeight float64
	LoadWeight    float64
	HealthWeight  float64
	// MinOverlapThreshold is the best overlap ratio (see Composite) below which Composite.Active
	// reports false and the caller should route by its fallback (the consistent-hash ring) instead.
	// Range (0, 1]; 0 means DefaultMinOverlapThreshold (0.3). To go KV-aware on any overlap at
	// all, set a tiny positive value such as 1e-9: Active also requires a best overlap > 0.
	MinOverlapThreshold float64
	// PrefillTokensPerRequest is how many pending prefill tokens (Candidate.PendingPrefillTokens)
	// weigh in the load as much as one request in flight: a backend with a long prompt still to
	// prefill is busier than its request count says, and the next request waits for that prompt.
	// 0 means DefaultPrefillTokensPerRequest (1024, chosen with the trace replay of
	// benchmarks/replay: 256 to 4,096 give the same picture); negative ignores pending tokens,
	// which is kvroute's load ratio of in-flight requests alone.
	PrefillTokensPerRequest int
}

// Composite is kvroute's KvOverlapScorer: a weighted sum of cache overlap, spare capacity and
// health. For candidate c of request r:
//
//	score = OverlapWeight·overlap_ratio + LoadWeight·(1 − load_ratio) + HealthWeight·health
//
//	overlap_ratio = c.Overlap / r.Blocks                       (r.Blocks > 0)
//	              = c.Overlap / max Overlap over healthy cands (r.Blocks == 0; 0 when that max is 0)
//	load_ratio    = load(c) / max over healthy cands of load  (0 when all idle)
//	load(c)       = (c.InFlight + c.PendingPrefillTokens/PrefillTokensPerRequest) / c.Weight
//	health        = c.Health
//
// each clamped to [0, 1]; unhealthy candidates score -Inf. Scores of healthy candidates lie in
// [0, 1]. See the package documentation for why overlap_ratio is a fraction of the request and not
// of the best backend.
//
// A Composite is immutable once built: safe for concurrent use. Its methods allocate nothing when
// out is large enough.
type Composite struct {
	ow, lw, hw float64
	minOverlap float64
	perTok     float64 // 1/PrefillTokensPerRequest; 0 ignores pending prefill tokens
	tokPerReq  int
}

var _ BackendScorer = (*Composite)(nil)

// NewComposite validates cfg, applies its defaults and returns the scorer. The error wraps
// ErrInvalidConfig when a weight is negative or not finite, the weights do not sum to 1.0, or
// MinOverlapThreshold is outside (0, 1] (0 itself means the default).
func NewComposite(cfg CompositeConfig) (*Composite, error) {
	ow, lw, hw := cfg.OverlapWeight, cfg.LoadWeight, cfg.HealthWeight
	if ow == 0 && lw == 0 && hw == 0 {
		ow, lw, hw = DefaultOverlapWeight, DefaultLoadWeight, DefaultHealthWeight
	}
	for _, w := range [...]struct {
		name string
		v    float64
	}{{"OverlapWeight", ow}, {"LoadWeight", lw}, {"HealthWeight", hw}} {
		if !(w.v >= 0) || math.IsInf(w.v, 1) {
			return nil, fmt.Errorf("%w: %s = %v, want a finite value ≥ 0", ErrInvalidConfig, w.name, w.v)
		}
	}
	if sum := ow + lw + hw; math.Abs(sum-1) > weightSumTolerance {
		return nil, fmt.Errorf("%w: OverlapWeight + LoadWeight + HealthWeight = %v, want 1.0", ErrInvalidConfig, sum)
	}
	t := cfg.MinOverlapThreshold
	if t == 0 {
		t = DefaultMinOverlapThreshold
	}
	if !(t > 0 && t <= 1) {
		return nil, fmt.Errorf("%w: MinOverlapThreshold = %v, want (0, 1]", ErrInvalidConfig, cfg.MinOverlapThreshold)
	}
	c := &Composite{ow: ow, lw: lw, hw: hw, minOverlap: t, tokPerReq: cfg.PrefillTokensPerRequest}
	if c.tokPerReq == 0 {
		c.tokPerReq = DefaultPrefillTokensPerRequest
	}
	if c.tokPerReq > 0 {
		c.perTok = 1 / float64(c.tokPerReq)
	}
	return c, nil
}

// Config returns the configuration in effect, defaults applied. Safe for concurrent use.
func (c *Composite) Config() CompositeConfig {
	return CompositeConfig{OverlapWeight: c.ow, LoadWeight: c.lw, HealthWeight: c.hw, MinOverlapThreshold: c.minOverlap,
		PrefillTokensPerRequest: c.tokPerReq}
}

// Score writes one score per candidate into out and returns out[:len(cands)] (a new slice only
// when cap(out) < len(cands)). Healthy candidates score in [0, 1], higher is better; unhealthy ones
// -Inf. Safe for concurrent use; allocates nothing when out is large enough.
func (c *Composite) Score(req Request, cands []Candidate, out []float64) []float64 {
	out = fit(out, len(cands))
	// Pass 1: each healthy candidate's weighted load, kept in out, and their maximum.
	maxLoad := 0.0
	for i := range cands {
		if cands[i].Healthy {
			out[i] = workOf(&cands[i], c.perTok)
			maxLoad = max(maxLoad, out[i])
		}
	}
	invLoad := 0.0 // all idle: every load ratio is 0
	if maxLoad > 0 {
		invLoad = 1 / maxLoad
	}
	invDenom := 0.0 // nothing held: every overlap ratio is 0
	if d := overlapDenom(req, cands); d > 0 {
		invDenom = 1 / d
	}
	// Pass 2: the scores.
	for i := range cands {
		cd := &cands[i]
		if !cd.Healthy {
			out[i] = math.Inf(-1)
			continue
		}
		out[i] = c.ow*clamp01(cd.WeightedBlocks*invDenom) + c.lw*(1-clamp01(out[i]*invLoad)) + c.hw*clamp01(cd.Health)
	}
	return out
}

// BestOverlapRatio returns the largest overlap_ratio (see Composite) among the healthy candidates, in
// [0, 1]; 0 when there is none or none holds any of the request. Safe for concurrent use; does not
// allocate.
func (c *Composite) BestOverlapRatio(req Request, cands []Candidate) float64 {
	denom := overlapDenom(req, cands)
	best := 0.0
	for i := range cands {
		if cands[i].Healthy {
			best = max(best, ratio(cands[i].WeightedBlocks, denom))
		}
	}
	return best
}

// Active reports whether KV-aware selection should decide this request: the best overlap ratio
// (BestOverlapRatio) is > 0 and ≥ MinOverlapThreshold. When it returns false the caller routes by its
// fallback (the consistent-hash ring's pick), as kvroute's pipeline does below the threshold.
// Safe for concurrent use; does not allocate.
func (c *Composite) Active(req Request, cands []Candidate) bool {
	best := c.BestOverlapRatio(req, cands)
	return best > 0 && best >= c.minOverlap
}

// overlapDenom is the divisor of overlap_ratio: the request's block count when known, else the
// largest overlap among healthy candidates (kvroute's normalisation); 0 means "no overlap".
func overlapDenom(req Request, cands []Candidate) float64 {
	if req.Blocks > 0 {
		return float64(req.Blocks)
	}
	m := 0.0
	for i := range cands {
		if o := cands[i].WeightedBlocks; cands[i].Healthy && o > m && !math.IsInf(o, 1) {
			m = o
		}
	}
	return m
}

// ratio returns v/denom clamped to [0, 1]; 0 when denom is 0 or v is NaN.
func ratio(v, denom float64) float64 {
	if !(denom > 0) {
		return 0
	}
	return clamp01(v / denom)
}

// clamp01 clamps v to [0, 1]; NaN becomes 0.
func clamp01(v float64) float64 {
	switch {
	case v >= 1:
		return 1
	case v > 0:
		return v
	default: // ≤ 0 or NaN
		return 0
	}
}

// workOf returns a candidate's weighted load counting its pending prefill tokens, perTok requests
// per token: (InFlight + perTok·PendingPrefillTokens)/Weight.
func workOf(c *Candidate, perTok float64) float64 {
	n := float64(max(c.InFlight, 0)) + perTok*float64(max(c.PendingPrefillTokens, 0))
	if w := c.Weight; w > 0 && !math.IsInf(w, 1) {
		return n / w
	}
	return n
}

// loadOf returns a candidate's weighted load InFlight/Weight; a Weight that is not a positive
// finite number counts as 1, a negative InFlight as 0.
func loadOf(c *Candidate) float64 {
	n := float64(max(c.InFlight, 0))
	if w := c.Weight; w > 0 && !math.IsInf(w, 1) {
		return n / w
	}
	return n
}

// fit returns out resliced to n, or a new slice when out is too small.
func fit(out []float64, n int) []float64 {
	if cap(out) < n {
		return make([]float64, n)
	}
	return out[:n]
}
