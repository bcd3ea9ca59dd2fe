package kvroute

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvroute/kvroute/chwbl"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/scorer"
	"github.com/kvroute/kvroute/telemetry"
)

// DefaultMinOverlapThreshold is kvroute's min_overlap_threshold: the best backend must hold at
// least this fraction of the request's blocks (tier-weighted) for KV-aware routing to take over
// from the CHWBL choice.
const DefaultMinOverlapThreshold = 0.3

// Tier 4's default KVConfig.LoadFactorEpsilon, which depends on the Scorer.
const (
	// DefaultKVLoadFactorEpsilon is the default under any scorer but scorer.ExpectedTTFT
	// (scorer.NewComposite's, scorer.NewCost's, a third party's, one that wraps an ExpectedTTFT
	// included): a backend tier 4 chooses may carry up to twice the fleet's mean in-flight
	// requests (per unit of weight).
	DefaultKVLoadFactorEpsilon = 1.0
	// DefaultKVLoadFactorEpsilonExpectedTTFT is the default under scorer.ExpectedTTFT, kvroute's
	// default scorer, which prices the prefill queued on each backend itself: the count bound is
	// then a safety net (up to six times the mean; it never binds on a backend carrying a sixth or
	// more of the fleet's weight, so never with six equal backends or fewer), because a tighter
	// one turns away cache hits whose holder would answer sooner.
	DefaultKVLoadFactorEpsilonExpectedTTFT = 5.0
)

// Speculation says whether the Router records predicted index entries for its own decisions.
type Speculation uint8

const (
	// SpeculationAuto, the zero value, is SpeculationOn when the index implements
	// kvindex.Speculator and SpeculationOff when it does not.
	SpeculationAuto Speculation = iota
	// SpeculationOn inserts predicted entries for the chosen backend with the index's short
	// speculative TTL (2 s): requests arriving before the engine's KV events see where the prefix
	// is going. A confirming BlockStored makes them real.
	SpeculationOn
	// SpeculationOff records nothing.
	SpeculationOff
	// SpeculationApproximate is for fleets without KV events: routing decisions are the index's
	// only source, with kvindex.DefaultApproximateTTL (120 s) unless SpeculativeTTL says otherwise.
	SpeculationApproximate
)

// KVConfig turns on tier 4, precise KV-aware routing. Index is required; everything else has a
// default.
type KVConfig struct {
	// Index is the KV-block index fed by the engines' KV events (or by speculation alone in
	// Approximate mode). Routing needs only its Lookup; an index of one's own may implement less
	// than kvindex.KvCacheIndex: kvindex.Speculator is required unless Speculation is
	// SpeculationOff, kvindex.PrefixLookuper when UsePrefixEntries is set, and kvindex.Statser
	// backs Stats.Index (nil without it). kvindex.MemoryIndex and redisindex.Index implement all
	// of it. The Router never clears or dumps the index: the caller who built it does.
	Index kvindex.Lookuper
	// BlockSize is the index's block size in tokens; 0 means the index's own when it reports one
	// (kvindex.BlockSizer, as kvindex.MemoryIndex and redisindex.Index do), else
	// kvindex.DefaultBlockSize. A value that differs from the index's own is a configuration
	// error: lookups would never match.
	BlockSize int
	// Tokenizer supplies token IDs for requests that carry none; nil means only requests with
	// TokenIDs get block keys. Its errors and time-outs route the request without block keys.
	Tokenizer prefixkey.Tokenizer
	// Scorer ranks candidates. It is asked only when some backend holds at least
	// MinOverlapThreshold of the request: below it the backend with the least prefill work
	// takes the request (least_work), or tier 1 with RingFallback. nil means kvroute's default,
	// scorer.ExpectedTTFT with this AttentionCost (the backend with the earliest expected first
	// token, counting the compute a cache miss costs the fleet). The composite overlap, load and
	// health scorer is scorer.NewComposite's; the Dynamo-style cost is scorer.NewCost's, whose
	// tracker of active sequences (scorer.SequenceTracker) the Router keeps up to date.
	Scorer scorer.BackendScorer
	// AttentionCost is the prefill cost model's attention term (scorer.PrefillWork): the cost a
	// prompt token adds per token of context before it, relative to a token without context,
	// a property of the model the engines serve. The Router measures the prefill work queued on
	// each backend with it (scorer.Candidate.PendingPrefillWork, least_work's choice). 0 means
	// the Scorer's own when it reports one (scorer.AttentionCoster, as scorer.ExpectedTTFT does),
	// else scorer.DefaultAttentionCost (2e-5, a dense 8B-class model); negative means none (work
	// is tokens); at most scorer.MaxAttentionCost. A value that differs from the Scorer's own is
	// a configuration error: the two would measure work in different units.
	AttentionCost float64
	// MinOverlapThreshold: 0 means DefaultMinOverlapThreshold. Valid: (0, 1].
	MinOverlapThreshold float64
	// LoadFactorEpsilon bounds tier 4's choices (kv_aware and least_work) as CHWBL's
	// load_factor_epsilon bounds the ring's: the chosen backend takes the request only while its
	// in-flight requests plus one stay within ceil((1+LoadFactorEpsilon)·(T+1)·weight/W); when the
	// best-scored backend is at that bound the next best is tried. Valid 0.01 to 10. 0 means
	// DefaultKVLoadFactorEpsilonExpectedTTFT (5) when the Scorer is a *scorer.ExpectedTTFT
	// (nil included), else DefaultKVLoadFactorEpsilon (1.0). Tier 4's bound is looser than the
	// ring's 0.25 because its choice is worth more than an even spread: the backend that holds
	// the prompt's KV cache saves its prefill, and sending the request elsewhere computes (and
	// caches) the prefix a second time. A count of requests says nothing of their length: the
	// expected-TTFT scorer weighs the prefill queued on each backend against what the hit saves,
	// and under it a tighter bound turned away hits whose holder would have answered sooner (in
	// kvroute's whole-trace replay, BENCHMARKS.md, 1.0 instead of 5 cost 1–5 points of hit ratio
	// and most points' TTFT p99). The default keeps the bound as a safety net. What the scorer
	// does not see is decoding: a prefill leaves its backend's queue at the first token, so a hot
	// prefix whose requests decode long answers can gather many decoding sequences on its holder,
	// held back only by the scorer's hot-prefix spreading (scorer.ExpectedTTFTConfig.HotShare).
	// For long-output workloads on small fleets set 1 to 2. Scorers that do not price the
	// queue keep twice the mean, which spreads a prefix everyone wants once its holder carries
	// that much. Set it to Config.LoadFactorEpsilon for the ring's bound.
	LoadFactorEpsilon float64
	// UsePrefixEntries looks up prefix-granular entries (kvroute's SSE events) when a request has
	// no block keys.
	UsePrefixEntries bool
	// Speculation mode and its TTL (0 means the mode's default).
	Speculation    Speculation
	SpeculativeTTL time.Duration

	// Tuning: the defaults are what kvroute's routing-quality replay measures best; these two
	// restore older behaviours.

	// Guard hands the decision to the least-loaded backend when the fleet is skewed; the zero
	// Guard never fires.
	Guard scorer.Guard
	// RingFallback sends a request whose best overlap is below MinOverlapThreshold to tier 1 (the
	// CHWBL ring, by prefix key), as kvroute's design has it. By default such a request goes instead
	// to the backend with the least prefill work ahead of it (ReasonLeastWork): the prefill work
	// (scorer.PrefillWork) of the requests routed to it whose first token has not come, less the
	// progress estimated on the first of them, plus this request's own there (see
	// scorer.Candidate.PendingPrefillWork). The ring's bound counts requests, not their length, so
	// on traces whose prompts range from hundreds to a hundred thousand tokens it lets long
	// prompts queue behind each other (BENCHMARKS.md, routing quality); speculation already
	// gives the stickiness the ring would.
	RingFallback bool
}

// Overlap is what the Router saw of one backend for a KV-aware decision.
type Overlap struct {
	Backend        string  `json:"backend"`
	CachedBlocks   int     `json:"cached_blocks"`
	CachedTokens   int     `json:"cached_tokens"`
	WeightedBlocks float64 `json:"overlap"` // tier-weighted blocks
	Score          float64 `json:"score"`
}

type tier4 struct {
	cfg       KVConfig
	scorer    scorer.BackendScorer
	prefix    kvindex.PrefixLookuper // cfg.Index's, or nil
	spec      kvindex.Speculator     // cfg.Index's, or nil (then Speculation is SpeculationOff)
	stats     kvindex.Statser        // cfg.Index's, or nil
	active    *scorer.Active         // the scorer's tracker of active sequences (scorer.SequenceTracker), or nil
	threshold float64
	eps       float64 // LoadFactorEpsilon, defaulted
	attn      float64 // AttentionCost, defaulted (0: none)
	specTTL   time.Duration
	scratch   sync.Pool // *scratch4
	nextID    atomic.Uint64
	tieTurn   atomic.Uint64 // rotates the start of acquireLowest's scan, so that ties share load
	scoreErrs atomic.Uint64 // the scorer's answers refused by scorer.ScoreSafely

	handedOff              atomic.Uint64 // requests tier 4 left to tier 1 (DecisionCounts.HandedOff)
	lookups, lookupErrs    atomic.Uint64
	tokenizeErrs, noTokens atomic.Uint64
}

// scratch4 is the per-call working memory of the tier-4 path, pooled so that Route allocates
// nothing for it.
type scratch4 struct {
	keys    []uint64
	names   []string
	matches []kvindex.Match
	cands   []scorer.Candidate
	scores  []float64
	loads   []chwbl.Load
	work    []float64
	avoid   []string // the backends Route must not choose (WithAvoid), nil for none
	order   []int    // spreadUnseen's scratch
	byName  []int    // with tieShare: the candidates' indices in the order of their names
	ntok    int      // the request's prompt tokens (0: not tokenized)
	looked  bool     // matches holds an index answer for names
	// tie is how acquireHighest breaks ties among the best candidates, unseenN the peer
	// decisions expected unseen (unseen.go).
	tie     tieMode
	unseenN float64
}

func newTier4(cfg KVConfig) (*tier4, error) {
	if cfg.Index == nil {
		return nil, fmt.Errorf("%w: KV.Index is nil", ErrInvalidConfig)
	}
	if bs, ok := cfg.Index.(kvindex.BlockSizer); ok {
		switch own := bs.BlockSize(); {
		case cfg.BlockSize == 0:
			cfg.BlockSize = own
		case cfg.BlockSize != own:
			return nil, fmt.Errorf("%w: KV.BlockSize %d differs from the index's block size %d", ErrInvalidConfig, cfg.BlockSize, own)
		}
	}
	if cfg.BlockSize == 0 {
		cfg.BlockSize = kvindex.DefaultBlockSize
	}
	if cfg.BlockSize < 1 {
		return nil, fmt.Errorf("%w: KV.BlockSize %d", ErrInvalidConfig, cfg.BlockSize)
	}
	if _, speculates := cfg.Index.(kvindex.Speculator); cfg.Speculation == SpeculationAuto {
		cfg.Speculation = SpeculationOff
		if speculates {
			cfg.Speculation = SpeculationOn
		}
	}
	t := &tier4{cfg: cfg, scorer: cfg.Scorer, threshold: cfg.MinOverlapThreshold}
	t.prefix, _ = cfg.Index.(kvindex.PrefixLookuper)
	t.spec, _ = cfg.Index.(kvindex.Speculator)
	t.stats, _ = cfg.Index.(kvindex.Statser)
	if cfg.UsePrefixEntries && t.prefix == nil {
		return nil, fmt.Errorf("%w: KV.UsePrefixEntries needs an index that implements kvindex.PrefixLookuper", ErrInvalidConfig)
	}
	if t.threshold == 0 {
		t.threshold = DefaultMinOverlapThreshold
	}
	if math.IsNaN(t.threshold) || t.threshold < 0 || t.threshold > 1 {
		return nil, fmt.Errorf("%w: min_overlap_threshold %v not in (0, 1]", ErrInvalidConfig, cfg.MinOverlapThreshold)
	}
	t.eps = cfg.LoadFactorEpsilon
	if math.IsNaN(t.eps) || t.eps != 0 && (t.eps < 0.01 || t.eps > 10) {
		return nil, fmt.Errorf("%w: KV load_factor_epsilon %v not in [0.01, 10]", ErrInvalidConfig, cfg.LoadFactorEpsilon)
	}
	own, hasOwn := t.scorer.(scorer.AttentionCoster)
	switch t.attn = cfg.AttentionCost; {
	case math.IsNaN(t.attn) || t.attn > scorer.MaxAttentionCost:
		return nil, fmt.Errorf("%w: KV attention_cost %v not at most %v", ErrInvalidConfig, cfg.AttentionCost, scorer.MaxAttentionCost)
	case t.attn == 0 && hasOwn:
		t.attn = own.AttentionCost()
	case t.attn == 0:
		t.attn = scorer.DefaultAttentionCost
	case t.attn < 0:
		t.attn = 0
	}
	if hasOwn && cfg.AttentionCost != 0 && max(own.AttentionCost(), 0) != t.attn {
		// Its own work and the queued work the Router hands it must be in the same units.
		return nil, fmt.Errorf("%w: the KV scorer's attention cost %v differs from KV attention_cost %v", ErrInvalidConfig, own.AttentionCost(), t.attn)
	}
	if t.scorer == nil {
		attn := t.attn
		if attn == 0 {
			attn = -1 // none
		}
		var err error
		if t.scorer, err = scorer.NewExpectedTTFT(scorer.ExpectedTTFTConfig{AttentionCost: attn}); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
		}
	}
	if t.eps == 0 {
		t.eps = DefaultKVLoadFactorEpsilon
		if _, ok := t.scorer.(*scorer.ExpectedTTFT); ok {
			t.eps = DefaultKVLoadFactorEpsilonExpectedTTFT
		}
	}
	if st, ok := t.scorer.(scorer.SequenceTracker); ok {
		t.active = st.Sequences()
	}
	switch cfg.Speculation {
	case SpeculationOn:
		t.specTTL = kvindex.DefaultSpeculativeTTL
	case SpeculationApproximate:
		t.specTTL = kvindex.DefaultApproximateTTL
	case SpeculationOff:
	default:
		return nil, fmt.Errorf("%w: speculation mode %d", ErrInvalidConfig, cfg.Speculation)
	}
	if cfg.SpeculativeTTL > 0 && cfg.Speculation != SpeculationOff {
		t.specTTL = cfg.SpeculativeTTL
	}
	if cfg.Speculation != SpeculationOff && t.spec == nil {
		return nil, fmt.Errorf("%w: speculation %s needs an index that implements kvindex.Speculator; KV.Index does not", ErrInvalidConfig, cfg.Speculation)
	}
	t.scratch.New = func() any { return &scratch4{} }
	return t, nil
}

// routeKV runs tier 4 for a request with the caller's scratch s; it leaves the request's block
// keys in s.keys. It returns true when it took a slot into d (kv_aware, load_bound, imbalance or
// least_work); false when the request must go the tier-1 way (no block keys, an index or scorer
// error, every candidate at tier 4's bound, or too little cached with RingFallback or prefix
// entries), in which case d is untouched. Its steps: blockKeys, lookup, candidates, then
// chooseLeastWork or chooseScored.
func (r *DefaultRouter) routeKV(ctx context.Context, req *prefixkey.Request, d *Decision, s *scratch4) bool {
	t := r.kv
	tokens := r.blockKeys(ctx, req, s)
	usePrefix := len(s.keys) == 0 && t.cfg.UsePrefixEntries && d.HasPrefixKey
	// A prompt shorter than one block: no engine can hold any of it, so there is nothing to look
	// up, and the backend with the least prefill work takes it rather than the ring.
	short := len(s.keys) == 0 && len(tokens) > 0 && !usePrefix && !t.cfg.RingFallback
	if len(s.keys) == 0 && !usePrefix && !short {
		t.noTokens.Add(1)
		return false
	}
	set := r.set.Load()
	if !r.lookup(ctx, d, s, usePrefix, short) {
		return false
	}
	r.candidates(s, set, d.at)
	sreq := scorer.Request{Blocks: len(s.keys), Tokens: len(tokens)}

	// Best overlap as a fraction of the request (for prefix entries: of the best backend's).
	best := 0.0
	for i := range s.cands {
		best = math.Max(best, s.cands[i].WeightedBlocks)
	}
	ratio := 0.0
	switch {
	case sreq.Blocks > 0:
		ratio = best / float64(sreq.Blocks)
	case best > 0:
		ratio = 1
	}
	r.metrics.recordOverlap(ctx, ratio)
	r.traceOverlap(ctx, ratio)
	if !t.holdsEnough(best, sreq.Blocks) {
		if t.cfg.RingFallback || usePrefix {
			return false
		}
		return r.chooseLeastWork(ctx, d, s)
	}
	return r.chooseScored(ctx, d, s, sreq)
}

// blockKeys puts the request's block keys in s.keys (none when it has no tokens) and returns its
// tokens: the caller's, or the tokenizer's (a failure is counted and leaves none).
func (r *DefaultRouter) blockKeys(ctx context.Context, req *prefixkey.Request, s *scratch4) []uint32 {
	tokens, err := r.requestTokens(ctx, req)
	if err != nil {
		r.kv.tokenizeErrs.Add(1)
	}
	s.ntok, s.looked = len(tokens), false
	s.keys = req.BlockKeysOf(s.keys[:0], tokens, r.kv.cfg.BlockSize)
	return tokens
}

// requestTokens returns the request's prompt tokens: its own (TokenIDs, else PromptTokens), or
// KVConfig.Tokenizer's (nil and the error when it fails), or nil.
func (r *DefaultRouter) requestTokens(ctx context.Context, req *prefixkey.Request) ([]uint32, error) {
	if req.TokenIDs != nil {
		return req.TokenIDs, nil
	}
	if req.PromptTokens != nil {
		return req.PromptTokens, nil
	}
	if r.kv == nil || r.kv.cfg.Tokenizer == nil {
		return nil, nil
	}
	tokens, err := r.tokenize(ctx, req)
	if err != nil {
		return nil, err
	}
	return tokens, nil
}

// lookup fills s.loads, s.names (the healthy backends not in s.avoid) and s.matches (what the index holds of the
// request on each: by block keys, by prefix entry with usePrefix, nothing for a short prompt). It
// returns false when no backend is healthy or the index failed (counted).
func (r *DefaultRouter) lookup(ctx context.Context, d *Decision, s *scratch4, usePrefix, short bool) bool {
	t := r.kv
	s.loads = r.ring.Loads(s.loads[:0])
	s.names = s.names[:0]
	for i := range s.loads {
		if s.loads[i].Healthy && !slices.Contains(s.avoid, s.loads[i].Name) {
			s.names = append(s.names, s.loads[i].Name)
		}
	}
	if len(s.names) == 0 {
		return false
	}
	if cap(s.matches) < len(s.names) {
		s.matches = make([]kvindex.Match, len(s.names))
	}
	if short {
		s.matches = s.matches[:len(s.names)]
		clear(s.matches)
		return true
	}
	start := r.cfg.Now()
	lctx, span := r.startSpan(ctx, telemetry.SpanKVLookup)
	var err error
	if usePrefix {
		s.matches, err = t.prefix.LookupPrefix(lctx, d.PrefixKey.String(), s.names, s.matches[:len(s.names)])
	} else {
		s.matches, err = t.cfg.Index.Lookup(lctx, s.keys, s.names, s.matches[:len(s.names)])
	}
	r.endLookup(span, s, err)
	r.metrics.recordLookup(ctx, r.cfg.Now().Sub(start))
	t.lookups.Add(1)
	if err != nil {
		t.lookupErrs.Add(1)
		return false
	}
	s.looked = true
	return true
}

// candidates builds s.cands, in the order of s.names, from the index's matches and the
// backends' loads, health, prefill backlogs, recent shares and (with a scorer.SequenceTracker scorer) active
// sequences, at now (nanoseconds since the Router's epoch: Route's start, read once).
func (r *DefaultRouter) candidates(s *scratch4, set *backendSet, now int64) {
	s.cands = s.cands[:0]
	li := 0
	for i := range s.matches {
		for li < len(s.loads) && s.loads[li].Name != s.names[i] {
			li++
		}
		l := s.loads[li]
		c := scorer.Candidate{
			Backend:        l.Name,
			CachedBlocks:   s.matches[i].Blocks,
			CachedTokens:   s.matches[i].Tokens,
			WeightedBlocks: s.matches[i].WeightedBlocks,
			InFlight:       l.InFlight + l.External,
			Weight:         l.Weight,
			Healthy:        true,
			Health:         1,
		}
		if st := set.byName[l.Name]; st != nil {
			c.Health = st.success.load()
			c.PendingPrefillTokens = int(max(st.backlog.Load(), 0))
			c.PendingPrefillWork = st.prefill.pending(now)
			c.PrefillRate = st.prefill.rate.load() * float64(time.Second)
			c.RecentShare = st.recent.load() // a logarithm until recentShares
		}
		s.cands = append(s.cands, c)
	}
	recentShares(s.cands, now)
	if r.kv.active != nil {
		r.kv.active.Fill(s.cands)
	}
	s.tie, s.byName, s.unseenN = tieUsual, s.byName[:0], 0
	u, n := r.unseenPeerWork(now)
	if u, n = capUnseen(u, n, len(s.cands)); u > 0 {
		s.unseenN = n
		s.order = spreadUnseen(s.cands, u, s.order)
		switch k := int(r.peers.share.Load() >> 32); {
		case n < 1: // less than one peer decision unseen: the view is as good as fresh
		case k > 1 && len(s.cands) >= 2*k:
			s.tie, s.byName = tieShare, sortedByName(s.cands, s.byName)
		default: // no name, or a share of one backend or none, which leaves nothing to choose by load
			s.tie = tieHash
		}
	}
}

// minRecentPerBackend is how many recent decisions (decayed, see backendState.noteDecision) per
// candidate, on average, recentShares needs before it reports shares: a first few decisions
// would otherwise make their backend look hot.
const minRecentPerBackend = 4

// recentShares turns the candidates' RecentShare, which hold their backends' logarithmic decayed
// decision counts (backendState.recent, 0 for none), into their shares of the candidates'
// decisions over their shares of the candidates' weight, at now (nanoseconds since the Router's
// epoch). It sets them all to 0 (unknown) while the candidates have had fewer than
// minRecentPerBackend recent decisions on average.
func recentShares(cands []scorer.Candidate, now int64) {
	top := math.Inf(-1)
	for i := range cands {
		if v := cands[i].RecentShare; v != 0 {
			top = max(top, v)
		}
	}
	if math.IsInf(top, -1) {
		return
	}
	sum, weights := 0.0, 0.0
	for i := range cands {
		c := &cands[i]
		if c.RecentShare != 0 {
			c.RecentShare = math.Exp(c.RecentShare - top) // the count relative to the largest
			sum += c.RecentShare
		}
		weights += weightOf(c.Weight)
	}
	// sum·e^(top−1) is Σ e^(tᵢ/recentWindow) over the candidates' decisions (noteDecision);
	// over e^(now/recentWindow), their decayed count.
	if total := sum * math.Exp(top-1-float64(now)/float64(recentWindow)); total < minRecentPerBackend*float64(len(cands)) {
		for i := range cands {
			cands[i].RecentShare = 0
		}
		return
	}
	for i := range cands {
		cands[i].RecentShare *= weights / (sum * weightOf(cands[i].Weight))
	}
}

// weightOf is a candidate's weight, 1 unless a positive finite number.
func weightOf(w float64) float64 {
	if w > 0 && !math.IsInf(w, 1) {
		return w
	}
	return 1
}

// chooseLeastWork takes, for a request no backend holds enough of, a slot on the backend with the
// least prefill work ahead of it (least_work); false when every backend is at tier 4's bound.
func (r *DefaultRouter) chooseLeastWork(ctx context.Context, d *Decision, s *scratch4) bool {
	i := r.acquireLeastWork(s, d)
	if i < 0 { // every backend at tier 4's bound: the CHWBL walk decides
		return false
	}
	d.Reason = ReasonLeastWork
	d.ExpectedCachedTokens = s.cands[i].CachedTokens
	r.afterKVChoice(ctx, s, d, s.cands[i])
	return true
}

// chooseScored takes, for a request some backend holds enough of, a slot on the best-scored
// backend under tier 4's bound, or on the least-loaded one when the imbalance guard finds the fleet
// skewed; false when the scorer failed (counted) or every backend is at its bound.
func (r *DefaultRouter) chooseScored(ctx context.Context, d *Decision, s *scratch4, sreq scorer.Request) bool {
	t := r.kv
	if cap(s.scores) < len(s.cands) {
		s.scores = make([]float64, len(s.cands))
	}
	var err error
	if s.scores, err = scorer.ScoreSafely(t.scorer, sreq, s.cands, s.scores); err != nil {
		// A faulty scorer (a third party's) costs a fallback decision, not the request.
		t.scoreErrs.Add(1)
		return false
	}
	reason := ReasonKVAware
	taken := -1
	if t.cfg.Guard.Skewed(s.cands) {
		if i := t.cfg.Guard.LeastLoaded(s.cands); i >= 0 {
			if r.ring.AcquireBackend(&d.handle, s.cands[i].Backend) == nil {
				taken, reason = i, ReasonImbalance
			}
		}
	}
	if taken < 0 {
		taken = r.acquireBest(s, d)
	}
	if taken < 0 { // every scored backend at tier 4's bound: the CHWBL walk decides
		return false
	}
	// Label the decision by what chose the backend used: its own cached prefix (kv_aware), or load
	// that sent the request past the backends holding enough of it (load_bound).
	if reason == ReasonKVAware && !t.holdsEnough(s.cands[taken].WeightedBlocks, sreq.Blocks) {
		reason = ReasonLoadBound
	}
	d.Reason = reason
	d.ExpectedCachedTokens = s.cands[taken].CachedTokens
	d.Overlaps = make([]Overlap, len(s.cands))
	for i := range s.cands {
		d.Overlaps[i] = Overlap{Backend: s.cands[i].Backend, CachedBlocks: s.cands[i].CachedBlocks,
			CachedTokens: s.cands[i].CachedTokens, WeightedBlocks: s.cands[i].WeightedBlocks, Score: s.scores[i]}
	}
	r.afterKVChoice(ctx, s, d, s.cands[taken])
	return true
}

// holdsEnough reports whether a backend whose tier-weighted overlap is overlap holds enough of a
// request of blocks blocks to route by it: some of it, and at least the threshold's share (for
// prefix entries, blocks is 0: any overlap is enough).
func (t *tier4) holdsEnough(overlap float64, blocks int) bool {
	if overlap <= 0 {
		return false
	}
	return blocks == 0 || overlap/float64(blocks) >= t.threshold
}

// acquireBest tries the scored candidates best first and takes a slot on the first one under
// tier 4's bound (LoadFactorEpsilon). It returns the candidate's index, or -1 when all are at their bound.
func (r *DefaultRouter) acquireBest(s *scratch4, d *Decision) int {
	s.work = append(s.work[:0], s.scores...)
	return r.acquireHighest(s, d)
}

// acquireLeastWork takes a slot, under tier 4's bound, on the candidate with the least prefill
// work per unit of weight: the work pending there plus the request's own there (scorer.PrefillWork
// of its tokens, with what the backend holds of them cached); ties go to the less loaded. It
// returns the candidate's index, or -1 when all are at their bound.
func (r *DefaultRouter) acquireLeastWork(s *scratch4, d *Decision) int {
	r.kv.leastWorkScores(s)
	return r.acquireHighest(s, d)
}

// leastWorkScores fills s.work, for acquireHighest (or Probe), with each candidate's prefill work
// per unit of weight, negated: the least work scores highest.
func (t *tier4) leastWorkScores(s *scratch4) {
	s.work = s.work[:0]
	for i := range s.cands {
		c := &s.cands[i]
		own := scorer.PrefillWork(s.ntok, c.CachedTokens, t.attn)
		s.work = append(s.work, -(c.PendingPrefillWork+own)/weightOf(c.Weight))
	}
}

// acquireHighest tries the candidates by decreasing s.work with scorer.PickBestFrom (ties to the
// less loaded, and among equals to the next in a rotation, so that a cold fleet shares new
// prefixes) and takes a slot on the first one under tier 4's bound (LoadFactorEpsilon); one that
// is at its bound is ruled out (-Inf) and the next best tried. It returns the candidate's index,
// or -1 when all are at their bound. Repeated picks rather than a sort: the first try nearly
// always succeeds.
func (r *DefaultRouter) acquireHighest(s *scratch4, d *Decision) int {
	turn := r.tieStart(s, r.kv.tieTurn.Add(1))
	for {
		i := r.breakTie(s, scorer.PickBestFrom(s.work, s.cands, turn), turn)
		if i < 0 {
			return -1
		}
		if ok, _ := r.ring.TryAcquireBackendWithin(&d.handle, s.cands[i].Backend, r.kv.eps); ok {
			return i
		}
		s.work[i] = math.Inf(-1)
	}
}

// tieStart is where acquireHighest's scan for the best starts, given the rotation's next turn:
// the turn, or, when the replicas' ties are broken apart (tieHash, tieShare), a hash of the
// request's last block key and length. Replicas of one fleet whose views are alike then break
// ties by the request, not by counters that may move in step, so that the different requests of
// a burst spread over the tied backends.
func (r *DefaultRouter) tieStart(s *scratch4, turn uint64) int {
	n := uint64(max(len(s.work), 1))
	if s.tie != tieUsual && len(s.keys) > 0 {
		h := s.keys[len(s.keys)-1] ^ uint64(s.ntok)*0x9e3779b97f4a7c15
		h ^= h >> 29
		h *= 0xbf58476d1ce4e5b9
		h ^= h >> 32
		return int(h % n)
	}
	return int(turn % n)
}

// addBacklog puts the request's prompt tokens that d's backend does not hold (by the index's
// answer) on that backend's prefill backlog, until the decision's FirstToken or Done.
func (r *DefaultRouter) addBacklog(d *Decision, s *scratch4) {
	if s.ntok == 0 || d.state == nil {
		return
	}
	cached := 0
	if s.looked {
		for i, name := range s.names {
			if name == d.Backend {
				cached = s.matches[i].Tokens
				break
			}
		}
	}
	if n := int64(s.ntok - cached); n > 0 {
		p := &kvPrefill{}
		p.tokens.Store(n)
		d.prefill = p
		d.state.backlog.Add(n)
		w := int64(math.Ceil(scorer.PrefillWork(s.ntok, cached, r.kv.attn)))
		d.state.prefill.add(&p.node, w, d.at)
	}
}

// afterKVChoice records speculation and active-sequence accounting for a KV-aware decision.
func (r *DefaultRouter) afterKVChoice(ctx context.Context, s *scratch4, d *Decision, c scorer.Candidate) {
	t := r.kv
	if t.specTTL > 0 && len(s.keys) > 0 {
		_ = t.spec.Speculate(ctx, d.handle.Backend(), s.keys, t.specTTL)
	}
	if t.active != nil && len(s.keys) > 0 {
		d.activeID = t.nextID.Add(1)
		t.active.Add(d.activeID, d.handle.Backend(), s.keys, c.CachedBlocks)
	}
}

// speculateTier1 records predicted entries for a decision tier 1 made while tier 4 is on, with
// the block keys routeKV computed, so that the index learns where a prefix went even before the
// engine's events (and, in Approximate mode, at all).
func (r *DefaultRouter) speculateTier1(ctx context.Context, d *Decision, s *scratch4) {
	if t := r.kv; t.specTTL > 0 && len(s.keys) > 0 {
		_ = t.spec.Speculate(ctx, d.handle.Backend(), s.keys, t.specTTL)
	}
}

// String returns the mode's name in kvroute's configuration (kv_cache_index.speculation):
// "auto", "speculate", "off" or "approximate".
func (s Speculation) String() string {
	switch s {
	case SpeculationAuto:
		return "auto"
	case SpeculationOn:
		return "speculate"
	case SpeculationOff:
		return "off"
	case SpeculationApproximate:
		return "approximate"
	default:
		return fmt.Sprintf("speculation(%d)", uint8(s))
	}
}

// MarshalText implements encoding.TextMarshaler with String's names.
func (s Speculation) MarshalText() ([]byte, error) {
	if s > SpeculationApproximate {
		return nil, fmt.Errorf("kvroute: unknown speculation mode %d", uint8(s))
	}
	return []byte(s.String()), nil
}

// UnmarshalText implements encoding.TextUnmarshaler: it accepts String's names ("" is auto).
func (s *Speculation) UnmarshalText(b []byte) error {
	for m := SpeculationAuto; m <= SpeculationApproximate; m++ {
		if string(b) == m.String() {
			*s = m
			return nil
		}
	}
	if len(b) == 0 {
		*s = SpeculationAuto
		return nil
	}
	return fmt.Errorf("kvroute: speculation %q is not one of auto, speculate, off, approximate", b)
}
