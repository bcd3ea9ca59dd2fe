package kvroute

import (
	"context"
	"fmt"
	"math"

	"github.com/kvroute/kvroute/chwbl"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/scorer"
)

// This file holds the Router's read-only introspection: Probe (kvroute's POST
// /admin/route/probe).

// ProbeResult is what DefaultRouter.Probe found: the decision Route would make for a request now,
// and what each backend weighed in it. Its JSON encoding is the body of kvroute's POST
// /admin/route/probe.
type ProbeResult struct {
	// Backend and Reason are the choice Route would make. Backend is "" when no backend is
	// healthy (Reason none), and with StrategyRandom for a request without a prefix key (Route
	// draws it at random).
	Backend string `json:"backend"`
	Reason  Reason `json:"reason"`
	// Why says in a sentence what decided.
	Why string `json:"why"`
	// RoutingTier is the routing tier that decides: 4 (the KV index and the scorer), 1 (the CHWBL ring
	// or the selection strategy), or 0 when none can.
	RoutingTier int `json:"tier"`
	// PrefixKey is the request's prefix key (lowercase hex), "" without one; RingOwner is the
	// backend owning it on the ring whatever its load (chwbl.Ring.Owner), asked when tier 1
	// decides.
	PrefixKey string `json:"prefix_key,omitempty"`
	RingOwner string `json:"ring_owner,omitempty"`
	// ExpectedCachedTokens is Decision.ExpectedCachedTokens: the chosen backend's cached tokens
	// when tier 4 decides.
	ExpectedCachedTokens int `json:"expected_cached_tokens"`
	// KV is tier 4's part; nil when tier 4 is off.
	KV *ProbeKV `json:"kv,omitempty"`
	// Backends lists every backend of the ring (Route's candidates), in the order they were added.
	Backends []ProbeBackend `json:"backends"`
}

// ProbeKV is what tier 4 saw of a probed request.
type ProbeKV struct {
	// PromptTokens and Blocks are the request's tokens and block keys (0 without token IDs and
	// tokenizer); PrefixEntries says that the index was asked by prefix entry instead
	// (KVConfig.UsePrefixEntries).
	PromptTokens  int  `json:"prompt_tokens"`
	Blocks        int  `json:"blocks"`
	PrefixEntries bool `json:"prefix_entries,omitempty"`
	// BestOverlapRatio is the best backend's tier-weighted overlap as a fraction of the request (1 for
	// any prefix entry); ThresholdMet says whether it reaches MinOverlapThreshold, which makes
	// the scorer decide.
	BestOverlapRatio    float64 `json:"best_overlap"`
	MinOverlapThreshold float64 `json:"min_overlap_threshold"`
	ThresholdMet        bool    `json:"threshold_met"`
	// Skewed says that the imbalance guard (KVConfig.Guard) found the fleet skewed; it is asked
	// only when the threshold is met.
	Skewed bool `json:"skewed,omitempty"`
	// HandedOff says why tier 4 would leave the request to tier 1, "" when it decides:
	// no_block_keys, no_healthy_backend, lookup_error, below_threshold (RingFallback or prefix
	// entries), score_error or all_at_bound. Error is the index's, tokenizer's or scorer's error.
	HandedOff string `json:"handed_off,omitempty"`
	Error     string `json:"error,omitempty"`
}

// ProbeBackend is one backend as Probe saw it.
type ProbeBackend struct {
	Backend              string  `json:"backend"`
	Healthy              bool    `json:"healthy"`
	Weight               float64 `json:"weight"`
	InFlight             int     `json:"in_flight"`
	PendingPrefillTokens int     `json:"pending_prefill_tokens"`
	// PendingPrefillWork, RecentShare and PrefillRate are scorer.Candidate's (tier 4's estimate
	// of the prefill work ahead of a new request there, router replicas' unseen work included
	// (Config.PeerDelay), the backend's share of the recent
	// decisions over its fair share, and its prefill rate learned from first tokens, in
	// token-equivalents per second); 0 with tier 4 off or while unknown.
	PendingPrefillWork float64 `json:"pending_prefill_work,omitempty"`
	RecentShare        float64 `json:"recent_share,omitempty"`
	PrefillRate        float64 `json:"prefill_rate,omitempty"`
	// CachedBlocks, CachedTokens and WeightedBlocks (tier-weighted blocks) are the index's answer for
	// the request; CacheTier the slowest tier among the cached blocks (kvindex.Match.Tier), "" when it
	// holds none. Unhealthy backends are not looked up.
	CachedBlocks   int     `json:"cached_blocks"`
	CachedTokens   int     `json:"cached_tokens"`
	CacheTier      string  `json:"tier,omitempty"`
	WeightedBlocks float64 `json:"overlap"`
	// Score is the scorer's, when it was asked; nil otherwise and for a score that rules the
	// backend out (not finite). PrefillWork is the least-work rule's measure (the prefill work
	// pending on the backend plus the request's own there, per unit of weight), when that rule
	// decides.
	Score       *float64 `json:"score,omitempty"`
	PrefillWork *float64 `json:"prefill_work,omitempty"`
	// RingBound is the ring's load bound for the backend (chwbl.Ring.Bound) and KVBound tier 4's
	// (KVConfig.LoadFactorEpsilon; 0 with tier 4 off); a backend at a bound takes no request by
	// that rule until its in-flight count drops below it.
	RingBound   int  `json:"ring_bound"`
	AtRingBound bool `json:"at_ring_bound"`
	KVBound     int  `json:"kv_bound,omitempty"`
	AtKVBound   bool `json:"at_kv_bound,omitempty"`
}

// Probe reports the decision Route would make for req now, and what each backend weighed in it,
// without making it: it takes no in-flight slot, records no speculation, adds no prefill backlog
// or active sequence, counts no decision or metric, and does not move the rotations that break
// ties (round robin, tier 4's), whose next turn it predicts. It runs the same steps as Route on
// the same state — the prefix key, the request's tokens and block keys (asking
// KVConfig.Tokenizer when the request has no token IDs), the KV index's answer, the candidates'
// loads and backlogs, the scorer (asked as Route asks it) and the imbalance guard, the load
// bounds, then the ring or the selection strategy — so that, with nothing else routed meanwhile,
// Route then picks the backend Probe names. Under concurrent traffic its answer is stale as soon
// as it returns, and the loads it reports are read in separate steps.
//
// The KV index sees an ordinary Lookup and the tokenizer an ordinary Tokenize (which they may
// count in stats of their own, as kvindex.Stats.Lookups does). The error is
// ErrNilRequest for a nil req, or ctx.Err() when ctx has ended; ctx bounds the index's and the
// tokenizer's calls, whose failures are reported in ProbeKV (as Route falls back on them) rather
// than returned. A fleet without a healthy backend is no error: Backend is "". Safe for
// concurrent use.
func (r *DefaultRouter) Probe(ctx context.Context, req *prefixkey.Request) (ProbeResult, error) {
	return r.probe(ctx, req, 0)
}

// probe is Probe for a Route that comes ahead turns of the round robin after the next one
// (DisaggRouter.Route takes one before its unified path).
func (r *DefaultRouter) probe(ctx context.Context, req *prefixkey.Request, ahead uint64) (ProbeResult, error) {
	if req == nil {
		return ProbeResult{}, ErrNilRequest
	}
	if err := ctx.Err(); err != nil {
		return ProbeResult{}, err
	}
	var res ProbeResult
	var pk prefixkey.Key
	hasKey := false
	if !r.cfg.DisablePrefixRouting {
		pk, hasKey = req.PrefixKey(r.cfg.MaxPrefixLength)
	}
	if hasKey {
		res.PrefixKey = pk.String()
	}
	set := r.set.Load()
	loads := r.ring.Loads(nil)
	res.Backends = make([]ProbeBackend, len(loads))
	for i, l := range loads {
		b := &res.Backends[i]
		b.Backend, b.Healthy, b.Weight, b.InFlight = l.Name, l.Healthy, l.Weight, l.InFlight
		b.RingBound = r.ring.Bound(l.Weight)
		b.AtRingBound = l.Healthy && l.InFlight >= b.RingBound
		if r.kv != nil {
			b.KVBound = r.ring.BoundWithin(l.Weight, r.kv.eps)
			b.AtKVBound = l.Healthy && l.InFlight >= b.KVBound
		}
		if st := set.byName[l.Name]; st != nil {
			b.PendingPrefillTokens = int(max(st.backlog.Load(), 0))
		}
	}
	if r.kv != nil && r.probeKV(ctx, req, pk, hasKey, set, loads, &res) {
		res.RoutingTier = 4
		return res, nil
	}
	r.probeTier1(pk, hasKey, set, ahead, &res)
	return res, nil
}

// probeKV runs tier 4's steps for Probe; it reports whether tier 4 decides, and fills res.KV, the
// backends' cached prefixes and scores, and, when it decides, the choice.
func (r *DefaultRouter) probeKV(ctx context.Context, req *prefixkey.Request, pk prefixkey.Key, hasKey bool,
	set *backendSet, loads []chwbl.Load, res *ProbeResult) bool {
	t := r.kv
	kv := &ProbeKV{MinOverlapThreshold: t.threshold}
	res.KV = kv
	s := &scratch4{loads: loads}
	tokens, err := r.requestTokens(ctx, req)
	if err != nil {
		kv.Error = "tokenize: " + err.Error()
	}
	s.keys = req.BlockKeysOf(nil, tokens, t.cfg.BlockSize)
	s.ntok = len(tokens)
	kv.PromptTokens, kv.Blocks = len(tokens), len(s.keys)
	usePrefix := len(s.keys) == 0 && t.cfg.UsePrefixEntries && hasKey
	short := len(s.keys) == 0 && len(tokens) > 0 && !usePrefix && !t.cfg.RingFallback
	kv.PrefixEntries = usePrefix
	if len(s.keys) == 0 && !usePrefix && !short {
		kv.HandedOff = "no_block_keys"
		return false
	}
	for _, l := range loads {
		if l.Healthy {
			s.names = append(s.names, l.Name)
		}
	}
	if len(s.names) == 0 {
		kv.HandedOff = "no_healthy_backend"
		return false
	}
	s.matches = make([]kvindex.Match, len(s.names))
	if !short {
		var err error
		if usePrefix {
			s.matches, err = t.prefix.LookupPrefix(ctx, pk.String(), s.names, s.matches)
		} else {
			s.matches, err = t.cfg.Index.Lookup(ctx, s.keys, s.names, s.matches)
		}
		if err != nil {
			kv.HandedOff, kv.Error = "lookup_error", err.Error()
			return false
		}
	}
	r.candidates(s, set, r.since(r.cfg.Now()))
	// Backends are the ring's members in order, and the candidates its healthy ones, in order.
	pos := make([]*ProbeBackend, len(s.cands))
	for i, j := 0, 0; i < len(s.cands) && j < len(res.Backends); j++ {
		if res.Backends[j].Backend == s.cands[i].Backend {
			b := &res.Backends[j]
			b.CachedBlocks, b.CachedTokens, b.WeightedBlocks = s.cands[i].CachedBlocks, s.cands[i].CachedTokens, s.cands[i].WeightedBlocks
			b.PendingPrefillWork, b.RecentShare, b.PrefillRate = s.cands[i].PendingPrefillWork, s.cands[i].RecentShare, s.cands[i].PrefillRate
			if s.matches[i].Blocks > 0 || s.matches[i].Tokens > 0 {
				b.CacheTier = s.matches[i].Tier.String()
			}
			pos[i] = b
			i++
		}
	}
	sreq := scorer.Request{Blocks: len(s.keys), Tokens: len(tokens)}
	best := 0.0
	for i := range s.cands {
		best = math.Max(best, s.cands[i].WeightedBlocks)
	}
	switch {
	case sreq.Blocks > 0:
		kv.BestOverlapRatio = best / float64(sreq.Blocks)
	case best > 0:
		kv.BestOverlapRatio = 1
	}
	kv.ThresholdMet = t.holdsEnough(best, sreq.Blocks)
	choose := func(i int, reason Reason, why string) bool {
		res.Backend, res.Reason, res.Why = s.cands[i].Backend, reason, why
		res.ExpectedCachedTokens = s.cands[i].CachedTokens
		return true
	}
	if !kv.ThresholdMet {
		if t.cfg.RingFallback || usePrefix {
			kv.HandedOff = "below_threshold"
			return false
		}
		t.leastWorkScores(s)
		for i := range s.cands {
			w := -s.work[i]
			pos[i].PrefillWork = &w
		}
		i := r.probePick(s, pos)
		if i < 0 {
			kv.HandedOff = "all_at_bound"
			return false
		}
		why := fmt.Sprintf("no backend holds %s of the request (the best %s): %s has the least prefill work ahead of it among the backends under tier 4's bound",
			percent(t.threshold), percent(kv.BestOverlapRatio), s.cands[i].Backend)
		if short {
			why = "the prompt is shorter than one block: " + s.cands[i].Backend + " has the least prefill work ahead of it among the backends under tier 4's bound"
		}
		return choose(i, ReasonLeastWork, why)
	}
	scores, err := scorer.ScoreSafely(t.scorer, sreq, s.cands, nil)
	if err != nil {
		kv.HandedOff, kv.Error = "score_error", err.Error()
		return false
	}
	for i, v := range scores {
		if !math.IsInf(v, 0) && !math.IsNaN(v) {
			pos[i].Score = &scores[i]
		}
	}
	if t.cfg.Guard.Skewed(s.cands) {
		kv.Skewed = true
		if i := t.cfg.Guard.LeastLoaded(s.cands); i >= 0 {
			return choose(i, ReasonImbalance, "the imbalance guard finds the fleet skewed: the least-loaded backend, "+s.cands[i].Backend+", takes it")
		}
	}
	s.work = append(s.work[:0], scores...)
	i := r.probePick(s, pos)
	if i < 0 {
		kv.HandedOff = "all_at_bound"
		return false
	}
	share := percent(s.cands[i].WeightedBlocks / float64(max(sreq.Blocks, 1)))
	if !t.holdsEnough(s.cands[i].WeightedBlocks, sreq.Blocks) {
		return choose(i, ReasonLoadBound, fmt.Sprintf("some backend holds %s of the request, but %s, holding %s, scores best among the backends under tier 4's bound",
			percent(t.threshold), s.cands[i].Backend, share))
	}
	return choose(i, ReasonKVAware, fmt.Sprintf("%s holds %s of the request (threshold %s) and scores best among the backends under tier 4's bound",
		s.cands[i].Backend, share, percent(t.threshold)))
}

// probePick is acquireHighest without the acquisition: the best of s.work whose backend is under
// tier 4's bound, with the tie-break turn the next Route would use; -1 when all are at it.
func (r *DefaultRouter) probePick(s *scratch4, pos []*ProbeBackend) int {
	turn := r.tieStart(s, r.kv.tieTurn.Load()+1)
	for {
		i := r.breakTie(s, scorer.PickBestFrom(s.work, s.cands, turn), turn)
		if i < 0 {
			return -1
		}
		if !pos[i].AtKVBound {
			return i
		}
		s.work[i] = math.Inf(-1)
	}
}

// probeTier1 fills res with the ring's choice (a request with a prefix key) or the selection
// strategy's, as Route's tier 1 would make it, ahead turns of the round robin after the next one.
func (r *DefaultRouter) probeTier1(pk prefixkey.Key, hasKey bool, set *backendSet, ahead uint64, res *ProbeResult) {
	left := ""
	if res.KV != nil {
		left = "tier 4 leaves it (" + res.KV.HandedOff + "): "
	}
	if hasKey {
		h := pk.Uint64()
		owner, err := r.ring.Owner(h)
		name, why, err2 := r.ring.Candidate(h)
		if err != nil || err2 != nil {
			res.Why = left + "no backend is healthy"
			return
		}
		res.RoutingTier, res.RingOwner, res.Backend = 1, owner, name
		if why == chwbl.ReasonOverflow {
			res.Reason = ReasonOverflow
			res.Why = left + "the prefix key's owner on the ring, " + owner + ", is at its load bound: the next backend clockwise under its bound, " + name + ", takes it"
			return
		}
		res.Reason = ReasonPrefixHash
		res.Why = left + name + " owns the prefix key on the ring and is under its load bound"
		return
	}
	res.Reason = ReasonFallback
	if r.cfg.DisablePrefixRouting {
		res.Reason = ReasonStrategy
	}
	n := len(set.list)
	var pick *backendState
	if n > 0 {
		start := int((r.rr.Load() + 1 + ahead) % uint64(n))
		switch r.cfg.Strategy {
		case StrategyRandom:
			res.RoutingTier = 1
			res.Why = left + "no prefix key: the random strategy draws a healthy backend"
			return
		case StrategyLeastLoaded:
			pick = r.leastLoaded(set, start, nil, nil)
		case StrategyLeastLatency:
			pick = r.leastLatency(set, start, nil)
		default:
			pick = nthHealthy(set.list, start, nil)
		}
	}
	if pick == nil {
		res.Reason = 0
		res.Why = left + "no backend is healthy"
		return
	}
	res.RoutingTier, res.Backend = 1, pick.name
	res.Why = left + "no prefix key: the " + string(r.cfg.Strategy) + " strategy chooses"
	if r.cfg.Strategy == StrategyPrefixAwareHash {
		res.Why = left + "no prefix key: the prefix_aware_hash strategy goes round robin"
	}
}

// UnmarshalText implements encoding.TextUnmarshaler with String's labels ("none" is the zero
// Reason), so that a client decodes what MarshalText encodes, such as a ProbeResult.
func (r *Reason) UnmarshalText(b []byte) error {
	for x := range numReasons {
		if x.String() == string(b) {
			*r = x
			return nil
		}
	}
	return fmt.Errorf("kvroute: unknown routing reason %q", b)
}

// percent formats a fraction as a percentage.
func percent(f float64) string { return fmt.Sprintf("%.0f%%", 100*f) }
