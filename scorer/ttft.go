package scorer

import (
	"fmt"
	"math"
	"time"
)

// Defaults of ExpectedTTFTConfig.
const (
	// DefaultAttentionCost is the attention cost a prompt token adds per token of context before
	// it, as a fraction of the cost of a token without context (see PrefillWork). For a dense
	// transformer the ratio of attention to weight FLOPs per token and context token is
	// d_model·layers/parameters: 1.6e-5 for Llama-3-8B (4096·32/8.0e9), 9.4e-6 for
	// Llama-3-70B (8192·80/70.6e9). Attention kernels run below the matrix multiplications'
	// efficiency, which raises the ratio in time; 2e-5 covers the 8B class.
	DefaultAttentionCost = 2e-5
	// DefaultCacheWeight is ExpectedTTFTConfig.CacheWeight when zero.
	DefaultCacheWeight = 6.0
	// DefaultHotShare and DefaultHotDiscount are ExpectedTTFTConfig.HotShare and HotDiscount
	// when zero.
	DefaultHotShare    = 1.1
	DefaultHotDiscount = 5.0
	// MaxAttentionCost bounds AttentionCost (and kvroute.KVConfig.AttentionCost): at 0.01 a
	// 100-token prompt's attention already costs as much as the rest of its prefill.
	MaxAttentionCost = 0.01
	// DefaultWaitLimit and DefaultWaitPenalty are ExpectedTTFTConfig.WaitLimit and WaitPenalty
	// when zero.
	DefaultWaitLimit   = 10 * time.Second
	DefaultWaitPenalty = 3.0
)

// maxPendingWork caps a candidate's PendingPrefillWork, so that an unbounded value still ranks
// the candidate last rather than out of the comparison.
const maxPendingWork = 1e18

// PrefillWork returns the prefill work of a prompt of tokens tokens of which the first cached are
// cached, in token-equivalents (the cost of one token without context):
//
//	work = (tokens − cached) + attentionCost·(tokens² − cached²)
//
// The linear term is the weights' work on every token not cached; the quadratic one the
// attention of each such token over the context before it, which is why the last 10,000 tokens
// of a 100,000-token prompt take far longer than a 10,000-token prompt. cached is clamped to
// [0, tokens], a negative tokens counts as 0, and a negative or NaN attentionCost as 0;
// attentionCost must be finite. It is a pure function.
func PrefillWork(tokens, cached int, attentionCost float64) float64 {
	n := float64(max(tokens, 0))
	c := float64(min(max(cached, 0), max(tokens, 0)))
	if !(attentionCost > 0) {
		return n - c
	}
	return n - c + attentionCost*(n*n-c*c)
}

// ExpectedTTFTConfig configures an ExpectedTTFT. Its zero value means the defaults.
type ExpectedTTFTConfig struct {
	// CacheWeight weighs the request's own prefill work against its wait: a backend's cost is its
	// expected time to first token plus CacheWeight times the prefill work the request would
	// add there. The first term alone sends a request wherever it starts soonest and throws
	// cache hits away whenever the holder is busy; the second is what a cache miss costs the
	// rest of the fleet (the recomputed prefix delays every request queued behind it). A prompt
	// the holder has cached whole stays there while the work queued ahead of it is under
	// 1 + CacheWeight times the prefill it saves (its own wait counts once, the fleet's
	// compute CacheWeight times): seven times with the default 6, unless that queue is longer
	// than WaitLimit, past which it weighs more (see WaitLimit). Range: finite and ≥ 0; 0
	// means DefaultCacheWeight.
	CacheWeight float64
	// AttentionCost is PrefillWork's attentionCost, which a kvroute Router also computes
	// Candidate.PendingPrefillWork with (it takes it through AttentionCost when
	// KVConfig.AttentionCost is 0, and refuses a KVConfig that names another). Range [0,
	// MaxAttentionCost]; 0 means DefaultAttentionCost; negative means none (work is tokens).
	AttentionCost float64
	// HotShare and HotDiscount spread load that cache affinity piles up: a backend receiving
	// more than HotShare times its fair share of the recent requests (Candidate.RecentShare, by
	// weight) has the cached part of every prompt counted only at 1 − HotDiscount·(RecentShare −
	// HotShare) (never below 0). The prefixes it holds then draw fewer new requests, whose
	// families (a shared system prompt, conversations begun there) warm copies on other backends
	// instead of piling onto it, while a backend near its share keeps its hits. The share is per
	// backend, not per prefix: give backends of unequal speed their weights, or a fast backend
	// that takes more than its weight's share loses the value of its cache. HotShare ≥ 1 (0 means
	// DefaultHotShare); HotDiscount ≥ 0 (0 means DefaultHotDiscount; negative turns the
	// spreading off).
	HotShare    float64
	HotDiscount float64
	// WaitLimit and WaitPenalty keep a request from a long queue on the backend that holds its
	// prompt: when the prefill queued on a candidate would keep the request waiting longer than
	// WaitLimit (Candidate.PendingPrefillWork over Candidate.PrefillRate; only candidates whose
	// rate is known), the work beyond the limit counts 1 + WaitPenalty times in its cost. Below
	// the limit CacheWeight's trade stands; past it a long wait weighs more than the compute a
	// hit saves the fleet, which is what a TTFT tail is made of. WaitLimit 0 means
	// DefaultWaitLimit (10 s), negative turns the limit off; WaitPenalty finite and ≥ 0, 0 means
	// DefaultWaitPenalty (3).
	WaitLimit   time.Duration
	WaitPenalty float64
}

// ExpectedTTFT is kvroute's default tier-4 scorer: the backend with the lowest expected time to
// first token, counting what a cache miss costs the fleet. For candidate c of request r, in
// token-equivalents of prefill work (PrefillWork):
//
//	own(c)  = PrefillWork(r.Tokens, cached(c), AttentionCost)
//	over(c) = max(0, c.PendingPrefillWork − WaitLimit·c.PrefillRate)   (0 when the rate is unknown)
//	cost(c) = (c.PendingPrefillWork + own(c) + WaitPenalty·over(c)) / c.Weight + CacheWeight·own(c)
//	score   = −cost
//
// where cached(c) is c.CachedTokens weighed by its tiers (times c.Overlap/c.CachedBlocks when
// below 1: blocks on CPU or storage must be loaded back), and discounted when c receives more
// than HotShare times its fair share of the recent requests (see HotDiscount). The first term is the request's expected
// time to first token there (the prefill queued ahead of it, then its own), the second the
// compute its prefix costs the fleet; over(c) is the queue beyond what the request should wait
// for a hit (see WaitLimit). Unhealthy candidates score -Inf. When r.Tokens is 0 (a
// request known only by prefix entries), the prompt is taken as long as the best candidate's
// cached prefix.
//
// An ExpectedTTFT is immutable once built: safe for concurrent use. Score allocates nothing when
// out is large enough.
type ExpectedTTFT struct {
	cacheWeight, attention, hotShare, hotDiscount float64
	waitLimit, waitPenalty                        float64 // waitLimit in seconds, 0: off
}

var (
	_ BackendScorer   = (*ExpectedTTFT)(nil)
	_ AttentionCoster = (*ExpectedTTFT)(nil)
)

// NewExpectedTTFT validates cfg, applies its defaults and returns the scorer. The error wraps
// ErrInvalidConfig for a value out of its range.
func NewExpectedTTFT(cfg ExpectedTTFTConfig) (*ExpectedTTFT, error) {
	e := &ExpectedTTFT{cacheWeight: cfg.CacheWeight, attention: cfg.AttentionCost, hotShare: cfg.HotShare,
		hotDiscount: cfg.HotDiscount, waitPenalty: cfg.WaitPenalty}
	switch {
	case math.IsNaN(e.cacheWeight) || math.IsInf(e.cacheWeight, 0) || e.cacheWeight < 0:
		return nil, fmt.Errorf("%w: CacheWeight = %v, want a finite value > 0", ErrInvalidConfig, cfg.CacheWeight)
	case math.IsNaN(e.attention) || e.attention > MaxAttentionCost:
		return nil, fmt.Errorf("%w: AttentionCost = %v, want at most %v", ErrInvalidConfig, cfg.AttentionCost, MaxAttentionCost)
	case math.IsNaN(e.hotShare) || math.IsInf(e.hotShare, 0) || (e.hotShare != 0 && e.hotShare < 1):
		return nil, fmt.Errorf("%w: HotShare = %v, want a finite value ≥ 1", ErrInvalidConfig, cfg.HotShare)
	case math.IsNaN(e.hotDiscount) || math.IsInf(e.hotDiscount, 0):
		return nil, fmt.Errorf("%w: HotDiscount = %v, want a finite value", ErrInvalidConfig, cfg.HotDiscount)
	case math.IsNaN(e.waitPenalty) || math.IsInf(e.waitPenalty, 0) || e.waitPenalty < 0:
		return nil, fmt.Errorf("%w: WaitPenalty = %v, want a finite value ≥ 0", ErrInvalidConfig, cfg.WaitPenalty)
	}
	switch {
	case cfg.WaitLimit == 0:
		e.waitLimit = DefaultWaitLimit.Seconds()
	case cfg.WaitLimit > 0:
		e.waitLimit = cfg.WaitLimit.Seconds()
	}
	if e.waitPenalty == 0 {
		e.waitPenalty = DefaultWaitPenalty
	}
	if e.cacheWeight == 0 {
		e.cacheWeight = DefaultCacheWeight
	}
	switch {
	case e.attention == 0:
		e.attention = DefaultAttentionCost
	case e.attention < 0:
		e.attention = 0
	}
	if e.hotShare == 0 {
		e.hotShare = DefaultHotShare
	}
	switch {
	case e.hotDiscount == 0:
		e.hotDiscount = DefaultHotDiscount
	case e.hotDiscount < 0:
		e.hotDiscount = 0
	}
	return e, nil
}

// AttentionCost returns the attention cost PrefillWork is computed with (0: none); it makes
// ExpectedTTFT an AttentionCoster. Safe for concurrent use.
func (e *ExpectedTTFT) AttentionCost() float64 { return e.attention }

// Config returns the configuration in effect, defaults applied (an AttentionCost, HotDiscount or
// WaitLimit turned off reads as -1). Safe for concurrent use.
func (e *ExpectedTTFT) Config() ExpectedTTFTConfig {
	cfg := ExpectedTTFTConfig{CacheWeight: e.cacheWeight, AttentionCost: e.attention, HotShare: e.hotShare,
		HotDiscount: e.hotDiscount, WaitLimit: time.Duration(e.waitLimit * float64(time.Second)), WaitPenalty: e.waitPenalty}
	if cfg.WaitLimit == 0 {
		cfg.WaitLimit = -1
	}
	if cfg.AttentionCost == 0 {
		cfg.AttentionCost = -1
	}
	if cfg.HotDiscount == 0 {
		cfg.HotDiscount = -1
	}
	return cfg
}

// Score writes −cost per candidate into out and returns out[:len(cands)] (a new slice only when
// cap(out) < len(cands)); higher (an earlier expected first token, at less compute) is better,
// unhealthy candidates score -Inf. Safe for concurrent use; allocates nothing when out is large
// enough.
func (e *ExpectedTTFT) Score(req Request, cands []Candidate, out []float64) []float64 {
	out = fit(out, len(cands))
	n := req.Tokens
	if n <= 0 {
		for i := range cands {
			if cands[i].Healthy {
				n = max(n, cands[i].CachedTokens)
			}
		}
	}
	for i := range cands {
		c := &cands[i]
		if !c.Healthy {
			out[i] = math.Inf(-1)
			continue
		}
		cached := float64(min(max(c.CachedTokens, 0), n))
		if c.CachedBlocks > 0 && c.WeightedBlocks >= 0 && c.WeightedBlocks < float64(c.CachedBlocks) {
			// Blocks on a slower tier (CPU, storage) weigh less in Overlap: they must be loaded
			// back, so the prefix is worth less than one in GPU memory.
			cached *= c.WeightedBlocks / float64(c.CachedBlocks)
		}
		if hot := c.RecentShare - e.hotShare; e.hotDiscount > 0 && hot > 0 {
			cached *= max(1-e.hotDiscount*hot, 0)
		}
		own := PrefillWork(n, int(cached), e.attention)
		pending := min(c.PendingPrefillWork, maxPendingWork)
		if !(pending > 0) { // NaN or negative: nothing known
			pending = 0
		}
		if rate := c.PrefillRate; e.waitLimit > 0 && rate > 0 && !math.IsInf(rate, 1) {
			// Work past the wait limit counts 1 + waitPenalty times (NaN rates fail rate > 0).
			pending += e.waitPenalty * max(pending-e.waitLimit*rate, 0)
		}
		w := c.Weight
		if !(w > 0) || math.IsInf(w, 1) {
			w = 1
		}
		// Finite for every healthy candidate, even with an absurdly small weight.
		out[i] = max(-((pending+own)/w + e.cacheWeight*own), -math.MaxFloat64)
	}
	return out
}
