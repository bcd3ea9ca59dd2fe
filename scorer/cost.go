package scorer

import (
	"fmt"
	"math"
)

// DefaultPrefillWeight is CostConfig.PrefillWeight when left 0 (Dynamo's --kv-overlap-score-weight
// default).
const DefaultPrefillWeight = 1.0

// CostConfig configures a Cost. Its zero value means PrefillWeight 1.0.
type CostConfig struct {
	// PrefillWeight weighs prefill work against decode load (Dynamo's overlap_score_weight):
	// higher values favour cache reuse (better time to first token), lower ones even decode load
	// (better inter-token latency). Range: finite and ≥ 0; 0 means DefaultPrefillWeight.
	PrefillWeight float64
	// LoadOnly drops the prefill term: cost = decode blocks alone, pure load balancing that
	// ignores the prefix cache (Dynamo's weight 0). PrefillWeight must then be left 0.
	LoadOnly bool
	// Sequences configures the Cost's tracker of active sequences (Cost.Sequences), whose
	// per-backend loads fill the Candidate.Active* fields the cost reads.
	Sequences ActiveConfig
}

// Cost is Dynamo's KV router cost function, in blocks. For candidate c of request r:
//
//	prefill_blocks = max(r.Blocks − c.CachedBlocks, 0) + c.ActivePrefillBlocks
//	decode_blocks  = c.ActiveDecodeBlocks + r.Blocks
//	cost           = PrefillWeight·prefill_blocks + decode_blocks
//	score          = −cost
//
// so the cheapest backend scores highest; unhealthy candidates score -Inf. The Active* fields come
// from an Active tracker (Active.Fill). Scores are in blocks, not in [0, 1]: use Softmax with
// Normalize, or a temperature in blocks, to sample among them.
//
// A Cost's weights are immutable once built and its tracker is safe for concurrent use: a Cost is
// safe for concurrent use. Score allocates nothing when out is
// large enough.
type Cost struct {
	prefillWeight float64
	active        *Active
}

var (
	_ BackendScorer   = (*Cost)(nil)
	_ SequenceTracker = (*Cost)(nil)
)

// NewCost validates cfg, applies its defaults and returns the scorer. The error wraps
// ErrInvalidConfig when PrefillWeight is negative or not finite, or set together with LoadOnly.
func NewCost(cfg CostConfig) (*Cost, error) {
	w := cfg.PrefillWeight
	if !(w >= 0) || math.IsInf(w, 1) {
		return nil, fmt.Errorf("%w: PrefillWeight = %v, want a finite value ≥ 0", ErrInvalidConfig, w)
	}
	switch {
	case cfg.LoadOnly && w != 0:
		return nil, fmt.Errorf("%w: PrefillWeight = %v with LoadOnly, want 0", ErrInvalidConfig, w)
	case cfg.LoadOnly:
		w = 0
	case w == 0:
		w = DefaultPrefillWeight
	}
	active, err := NewActive(cfg.Sequences)
	if err != nil {
		return nil, err
	}
	return &Cost{prefillWeight: w, active: active}, nil
}

// Sequences returns the Cost's tracker of active sequences (SequenceTracker): a kvroute Router
// fills its candidates from it and records its decisions there. Safe for concurrent use.
func (c *Cost) Sequences() *Active { return c.active }

// Config returns the weights in effect, defaults applied (Sequences is left zero). Safe for
// concurrent use.
func (c *Cost) Config() CostConfig {
	if c.prefillWeight == 0 {
		return CostConfig{LoadOnly: true}
	}
	return CostConfig{PrefillWeight: c.prefillWeight}
}

// Score writes −cost per candidate into out and returns out[:len(cands)] (a new slice only when
// cap(out) < len(cands)); higher (cheaper) is better, unhealthy candidates score -Inf. Negative
// counts in the request or candidates count as 0. Safe for concurrent use; allocates nothing when
// out is large enough.
func (c *Cost) Score(req Request, cands []Candidate, out []float64) []float64 {
	out = fit(out, len(cands))
	blocks := max(req.Blocks, 0)
	for i := range cands {
		cd := &cands[i]
		if !cd.Healthy {
			out[i] = math.Inf(-1)
			continue
		}
		prefill := max(blocks-max(cd.CachedBlocks, 0), 0) + max(cd.ActivePrefillBlocks, 0)
		decode := max(cd.ActiveDecodeBlocks, 0) + blocks
		out[i] = -(c.prefillWeight*float64(prefill) + float64(decode))
	}
	return out
}
