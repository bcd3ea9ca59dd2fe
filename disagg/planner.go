package disagg

import (
	"fmt"
	"math"
	"net/http"
	"sync"

	"github.com/kvroute/kvroute/scorer"
)

// Candidate is what the Planner knows of one backend for one request: a snapshot, read-only. The
// caller fills it from its backend set (name, role, weight, health, storage), from its load
// accounting (phases in flight) and from a KV index lookup (the request's cached prefix on the
// backend).
type Candidate struct {
	Name string
	Role Role
	// Weight is the backend's relative capacity within its pool; 0 (or any value that is not a
	// positive finite number) means 1.
	Weight float64
	// Healthy backends may be chosen. Health is the recent success rate in [0, 1] used by the
	// scorer (set 1 when unknown).
	Healthy bool
	Health  float64
	// PrefillLoad and DecodeLoad are the request phases in flight on the backend: prefills on a
	// prefill backend, decodes on a decode backend. A unified backend's load is their sum.
	PrefillLoad int
	DecodeLoad  int
	// CachedTokens is the longest consecutive prefix of the prompt the backend holds, on any tier
	// (kvindex Match.Tokens); WeightedBlocks the same prefix in blocks, weighted by tier (Match.WeightedBlocks);
	// Tier the slowest tier among its blocks (Match.Tier). A prefix on TierStorage is readable by
	// every backend whose storage is at the same location.
	CachedTokens   int
	WeightedBlocks float64
	Tier           Tier
	// StoredTokens is the longest consecutive prefix of the prompt the backend holds in its
	// external storage (kvindex Match.StoredTokens), whether or not it also holds it on a faster
	// tier: a prefill backend keeps a prompt on its GPU and writes it to storage. That prefix is
	// readable by every backend whose storage is at the same location, as is CachedTokens when
	// Tier is TierStorage; 0 means none (or unknown).
	StoredTokens int
	// Storage is the backend's external storage; nil means Config.DefaultStorage.
	Storage *ExternalStorage
}

// Input is one request as the Planner sees it.
type Input struct {
	// Candidates are the backends of every role (unhealthy ones included: a prefix they wrote to
	// shared storage is still there).
	Candidates []Candidate
	// PromptTokens and PromptBlocks are the prompt's length in tokens and in full blocks; 0 means
	// unknown. Without PromptTokens the conditional thresholds cannot be evaluated: any reusable
	// prefix then means fast_decode and none means prefill_then_decode.
	PromptTokens int
	PromptBlocks int
	// TieBreak rotates the order in which equally good backends are considered, so that ties do
	// not always go to the first candidate. Passing a hash of the prompt's prefix keeps requests
	// that share a prefix together when loads are equal.
	TieBreak uint64
}

// Plan is the Planner's answer for one request.
type Plan struct {
	Path   Path   `json:"path"`
	Reason Reason `json:"reason"`
	// Prefill is the prefill backend for prefill_then_decode, "" for the other paths.
	Prefill string `json:"prefill_backend,omitempty"`
	// Decode is the backend that generates the tokens: a decode backend, or for the unified and
	// fallback paths the unified backend that serves the whole request.
	Decode string `json:"decode_backend"`
	// ExpectedCachedTokens is how much of the prompt the backend that processes it (the prefill
	// backend for prefill_then_decode, else Decode) is expected to reuse instead of computing, from
	// its own memory or from storage; UncachedTokens is what is left to compute (0 when the prompt's
	// length is unknown).
	ExpectedCachedTokens int `json:"expected_cached_tokens"`
	UncachedTokens       int `json:"uncached_tokens"`
	// Storage is where the KV tensors transit (prefill_then_decode: the prefill backend's storage)
	// or are loaded from (storage_hit: the decode backend's); zero otherwise. Its credentials are
	// redacted when printed or marshalled.
	Storage ExternalStorage `json:"storage"`
}

// Header names for the routing path and the backends that served the request: kvroute's
// routing-path headers with kvroute's prefix.
const (
	HeaderRoutingPath    = "X-Kvroute-Routing-Path"
	HeaderPrefillBackend = "X-Kvroute-Prefill-Backend"
	HeaderDecodeBackend  = "X-Kvroute-Decode-Backend"
)

// SetHeaders sets the routing-path headers on h: HeaderRoutingPath to the path, HeaderDecodeBackend
// to Decode, and HeaderPrefillBackend to Prefill when there is one (it is deleted otherwise, so that
// a response re-planned after a failed prefill does not name the failed backend). Not safe for
// concurrent use on the same h (http.Header is a map).
func (p Plan) SetHeaders(h http.Header) {
	h.Set(HeaderRoutingPath, p.Path.String())
	if p.Prefill != "" {
		h.Set(HeaderPrefillBackend, p.Prefill)
	} else {
		h.Del(HeaderPrefillBackend)
	}
	if p.Decode != "" {
		h.Set(HeaderDecodeBackend, p.Decode)
	} else {
		h.Del(HeaderDecodeBackend)
	}
}

// Planner chooses, per request, the routing path and its backends. It is immutable once built and
// safe for concurrent use; Plan keeps no state between calls (its scratch memory is pooled), so
// the same Input always gives the same Plan.
type Planner struct {
	cfg     Config
	scratch sync.Pool // *scratch
}

// scratch is one Plan call's working memory.
type scratch struct {
	pool    []int // candidate indexes of the pool being chosen from
	decodes []int // the eligible decode backends, while the prefill pool is chosen
	stored  []int // candidates holding a prefix on their storage tier (see storedOf)
	reuse   []int // per pool entry: tokens a decode backend can reuse
	local   []bool
	cands   []scorer.Candidate
	scores  []float64
}

// New validates cfg, applies its defaults and returns a Planner. The error wraps ErrInvalidConfig.
func New(cfg Config) (*Planner, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	p := &Planner{cfg: cfg}
	p.scratch.New = func() any { return &scratch{} }
	return p, nil
}

// Config returns the configuration in force, defaults applied. Safe for concurrent use.
func (p *Planner) Config() Config { return p.cfg }

// Plan chooses the path and backends for one request. It is pure (the result depends on in alone)
// and safe for concurrent use. A non-nil error wraps ErrNoBackend (the Plan is then zero); the
// error also names the pool that was missing. The rules, in order:
//
//  1. Disabled: unified, the best healthy unified backend (reason disabled).
//  2. No prefill or decode backend at all: unified (reason no_pools).
//  3. No healthy decode backend: fallback (reason pool_unavailable).
//  4. Among the healthy decode backends under their pool's load bound, the one that can reuse the
//     longest prefix wins: held in its own memory (GPU or CPU tier), or in the storage of any
//     backend whose storage is at its location (the longer of its StoredTokens and, when its Tier
//     is TierStorage, its CachedTokens); at equal length its own memory beats storage, then
//     the lower decode load (relative to weight) wins. If the part it cannot reuse is short
//     (conditional disaggregation, see Config) — or with conditional disaggregation off, if it can
//     reuse anything — the path is fast_decode (reason local_hit, storage_hit, or short_prompt when
//     nothing is reused).
//  5. Otherwise prefill_then_decode (reason cache_miss): the prefill backend is the Scorer's best
//     among the healthy prefill backends under their bound, scored on their own cached prefix and
//     their prefill load only; the decode backend is the least decode-loaded one under its bound
//     whose storage is at the prefill backend's location, with no credit for cached prefix (it
//     loads the whole KV). No healthy prefill backend, or none paired with a decode backend:
//     fallback (reason pool_unavailable).
//
// Fallback chooses the best healthy unified backend; with Config.DisableFallback, or when no
// unified backend is healthy, Plan returns ErrNoBackend instead. When every healthy backend of a
// pool is at its bound, the bound is ignored for that pool.
func (p *Planner) Plan(in Input) (Plan, error) {
	if p.cfg.Disabled {
		return p.unified(in, PathUnified, ReasonDisabled)
	}
	pools := false
	for i := range in.Candidates {
		if r := in.Candidates[i].Role; r == RolePrefill || r == RoleDecode {
			pools = true
			break
		}
	}
	if !pools {
		return p.unified(in, PathUnified, ReasonNoPools)
	}
	s := p.scratch.Get().(*scratch)
	defer p.scratch.Put(s)

	s.pool = p.eligible(s.pool[:0], in.Candidates, RoleDecode)
	if len(s.pool) == 0 {
		return p.fallback(in, ReasonPoolUnavailable, "no healthy decode backend")
	}
	plan, ok := p.fastDecode(in, s)
	if ok {
		return plan, nil
	}
	return p.prefillThenDecode(in, s)
}

// Fallback plans a request whose remote prefill failed (or whose disaggregated phases failed
// otherwise): the best healthy unified backend, path fallback, reason prefill_failed. It returns
// ErrNoBackend when fallback to unified is off or no unified backend is healthy. Pure and safe for
// concurrent use.
func (p *Planner) Fallback(in Input) (Plan, error) {
	return p.fallback(in, ReasonPrefillFailed, "the prefill failed")
}

// DecodeFallback is Fallback for a request whose decode backend failed before answering: reason
// decode_failed.
func (p *Planner) DecodeFallback(in Input) (Plan, error) {
	return p.fallback(in, ReasonDecodeFailed, "the decode failed")
}

func (p *Planner) fallback(in Input, why Reason, what string) (Plan, error) {
	if p.cfg.DisableFallback {
		return Plan{}, fmt.Errorf("%w: %s and fallback to unified is off", ErrNoBackend, what)
	}
	plan, err := p.unified(in, PathFallback, why)
	if err != nil {
		return Plan{}, fmt.Errorf("%w (%s)", err, what)
	}
	return plan, nil
}

// unified picks the Scorer's best healthy unified backend (load: prefill + decode).
func (p *Planner) unified(in Input, path Path, why Reason) (Plan, error) {
	s := p.scratch.Get().(*scratch)
	defer p.scratch.Put(s)
	s.pool = p.eligible(s.pool[:0], in.Candidates, RoleUnified)
	if len(s.pool) == 0 {
		return Plan{}, fmt.Errorf("%w: no healthy unified backend", ErrNoBackend)
	}
	i := p.best(in, s, func(c *Candidate) int { return c.PrefillLoad + c.DecodeLoad })
	c := &in.Candidates[i]
	return Plan{Path: path, Reason: why, Decode: c.Name, ExpectedCachedTokens: c.CachedTokens,
		UncachedTokens: uncached(in.PromptTokens, c.CachedTokens)}, nil
}

// fastDecode applies rule 4 to the decode backends in s.pool. It returns false when the request
// needs a remote prefill.
func (p *Planner) fastDecode(in Input, s *scratch) (Plan, bool) {
	cands := in.Candidates
	s.stored = s.stored[:0]
	for bi := range cands {
		if storedOf(&cands[bi]) > 0 {
			s.stored = append(s.stored, bi)
		}
	}
	s.reuse, s.local = s.reuse[:0], s.local[:0]
	for _, di := range s.pool {
		d := &cands[di]
		local := 0
		if localTier(d.Tier) {
			local = max(d.CachedTokens, 0)
		}
		stored := 0
		for _, bi := range s.stored {
			b := &cands[bi]
			if n := storedOf(b); n > stored && (bi == di || p.reachable(b, d)) {
				stored = n
			}
		}
		s.reuse = append(s.reuse, max(local, stored))
		s.local = append(s.local, local > 0 && local >= stored)
	}
	n := len(s.pool)
	start := int(in.TieBreak % uint64(n))
	best := -1
	for k := range n {
		j := (start + k) % n
		if best < 0 {
			best = j
			continue
		}
		switch {
		case s.reuse[j] != s.reuse[best]:
			if s.reuse[j] > s.reuse[best] {
				best = j
			}
		case s.local[j] != s.local[best]:
			if s.local[j] {
				best = j
			}
		case loadRatio(cands[s.pool[j]].DecodeLoad, cands[s.pool[j]].Weight) < loadRatio(cands[s.pool[best]].DecodeLoad, cands[s.pool[best]].Weight):
			best = j
		}
	}
	d := &cands[s.pool[best]]
	reuse := s.reuse[best]
	var skip bool
	switch {
	case in.PromptTokens <= 0 || p.cfg.DisableConditional:
		skip = reuse > 0
	default:
		skip = p.short(uncached(in.PromptTokens, reuse), in.PromptTokens)
	}
	if !skip {
		return Plan{}, false
	}
	plan := Plan{Path: PathFastDecode, Decode: d.Name, ExpectedCachedTokens: reuse, UncachedTokens: uncached(in.PromptTokens, reuse)}
	switch {
	case reuse == 0:
		plan.Reason = ReasonShortPrompt
	case s.local[best]:
		plan.Reason = ReasonLocalHit
	default:
		plan.Reason = ReasonStorageHit
		plan.Storage = p.storageOf(d)
	}
	return plan, true
}

// prefillThenDecode applies rule 5; s.pool holds the eligible decode backends.
func (p *Planner) prefillThenDecode(in Input, s *scratch) (Plan, error) {
	cands := in.Candidates
	s.decodes = append(s.decodes[:0], s.pool...) // s.pool is reused for the prefill pool
	decodes := s.decodes
	s.pool = p.eligible(s.pool[:0], cands, RolePrefill)
	// Keep the prefill backends some decode backend can read from.
	kept := s.pool[:0]
	for _, pi := range s.pool {
		for _, di := range decodes {
			if p.pairable(&cands[pi], &cands[di]) {
				kept = append(kept, pi)
				break
			}
		}
	}
	s.pool = kept
	if len(s.pool) == 0 {
		return p.fallback(in, ReasonPoolUnavailable, "no healthy prefill backend shares storage with a decode backend")
	}
	pi := p.best(in, s, func(c *Candidate) int { return c.PrefillLoad })
	pc := &cands[pi]
	n := len(decodes)
	start := int(in.TieBreak % uint64(n))
	di := -1
	for k := range n {
		j := decodes[(start+k)%n]
		if !p.pairable(pc, &cands[j]) {
			continue
		}
		if di < 0 || loadRatio(cands[j].DecodeLoad, cands[j].Weight) < loadRatio(cands[di].DecodeLoad, cands[di].Weight) {
			di = j
		}
	}
	return Plan{Path: PathPrefillThenDecode, Reason: ReasonCacheMiss, Prefill: pc.Name, Decode: cands[di].Name,
		ExpectedCachedTokens: max(pc.CachedTokens, 0), UncachedTokens: uncached(in.PromptTokens, pc.CachedTokens),
		Storage: p.storageOf(pc)}, nil
}

// best scores the candidates in s.pool with the Scorer (in-flight: load(c)) and returns the
// winner's index in in.Candidates.
func (p *Planner) best(in Input, s *scratch, load func(*Candidate) int) int {
	s.cands = s.cands[:0]
	for _, i := range s.pool {
		c := &in.Candidates[i]
		s.cands = append(s.cands, scorer.Candidate{Backend: c.Name, CachedBlocks: 0, CachedTokens: c.CachedTokens,
			WeightedBlocks: c.WeightedBlocks, InFlight: load(c), Weight: c.Weight, Healthy: true, Health: c.Health})
	}
	// Ties go to the first candidate at or after TieBreak, so that equal backends share load.
	n := len(s.cands)
	start := int(in.TieBreak % uint64(n))
	k := -1
	var err error
	s.scores, err = scorer.ScoreSafely(p.cfg.Scorer, scorer.Request{Blocks: max(in.PromptBlocks, 0), Tokens: max(in.PromptTokens, 0)}, s.cands, s.scores)
	if err == nil {
		k = scorer.PickBestFrom(s.scores, s.cands, start)
	}
	if k < 0 { // a custom scorer ruled every candidate out, or failed: the least loaded one
		k = start
		for j := range s.cands {
			if loadRatio(s.cands[j].InFlight, s.cands[j].Weight) < loadRatio(s.cands[k].InFlight, s.cands[k].Weight) {
				k = j
			}
		}
	}
	return s.pool[k]
}

// eligible appends the indexes of the healthy candidates of role that are under their pool's load
// bound; when none is, every healthy one.
func (p *Planner) eligible(dst []int, cands []Candidate, role Role) []int {
	load := func(c *Candidate) int {
		switch role {
		case RolePrefill:
			return max(c.PrefillLoad, 0)
		case RoleDecode:
			return max(c.DecodeLoad, 0)
		default:
			return max(c.PrefillLoad, 0) + max(c.DecodeLoad, 0)
		}
	}
	total, weights := 0, 0.0
	for i := range cands {
		if c := &cands[i]; c.Role == role && c.Healthy {
			total += load(c)
			weights += weightOf(c.Weight)
		}
	}
	if weights == 0 {
		return dst
	}
	factor := (1 + p.cfg.LoadFactorEpsilon) * float64(total+1) / weights
	n := len(dst)
	for i := range cands {
		if c := &cands[i]; c.Role == role && c.Healthy && load(c) < boundOf(factor*weightOf(c.Weight)) {
			dst = append(dst, i)
		}
	}
	if len(dst) == n { // unreachable with exact arithmetic (the bounds sum to more than total)
		for i := range cands {
			if c := &cands[i]; c.Role == role && c.Healthy {
				dst = append(dst, i)
			}
		}
	}
	return dst
}

// short reports whether an uncached part of u tokens of a t-token prompt is short enough for a
// decode backend to compute itself.
func (p *Planner) short(u, t int) bool {
	if p.cfg.MaxUncachedTokens >= 0 && u <= p.cfg.MaxUncachedTokens {
		return true
	}
	return p.cfg.MaxUncachedRatio >= 0 && float64(u) <= p.cfg.MaxUncachedRatio*float64(t)
}

func (p *Planner) storageOf(c *Candidate) ExternalStorage {
	if c.Storage != nil {
		return *c.Storage
	}
	return p.cfg.DefaultStorage
}

// storedOf returns the length of the prefix c holds in its external storage: StoredTokens, or
// CachedTokens when the whole cached prefix is on the storage tier, whichever is longer.
func storedOf(c *Candidate) int {
	n := max(c.StoredTokens, 0)
	if c.Tier == TierStorage {
		n = max(n, c.CachedTokens)
	}
	return n
}

// reachable reports whether d can read the prefix b holds on its storage tier: both have storage,
// at the same location.
func (p *Planner) reachable(b, d *Candidate) bool {
	sb := p.storageOf(b)
	return !sb.IsZero() && sb.SameLocation(p.storageOf(d))
}

// pairable reports whether decode backend d can read what prefill backend pb writes: their storage
// is at the same location, or neither has storage (the engines transfer KV directly).
func (p *Planner) pairable(pb, d *Candidate) bool {
	return p.storageOf(pb).SameLocation(p.storageOf(d))
}

// boundTolerance is subtracted (relatively) before rounding a bound up, so that float rounding of
// an exact product does not add a slot (as in package chwbl).
const boundTolerance = 1e-9

// boundOf returns ceil(x) with a relative tolerance, at least 1.
func boundOf(x float64) int {
	b := math.Ceil(x - x*boundTolerance)
	if !(b >= 1) {
		return 1
	}
	if b > math.MaxInt32 {
		return math.MaxInt32
	}
	return int(b)
}

func weightOf(w float64) float64 {
	if w > 0 && !math.IsInf(w, 1) {
		return w
	}
	return 1
}

func loadRatio(load int, w float64) float64 { return float64(max(load, 0)) / weightOf(w) }

func uncached(total, cached int) int {
	if total <= 0 {
		return 0
	}
	return max(total-max(cached, 0), 0)
}
