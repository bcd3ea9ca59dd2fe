package kvroute

import (
	"context"
	"fmt"

	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/prefixkey"
)

// DisaggProbeResult is what DisaggRouter.Probe found: the plan DisaggRouter.Route would make for a
// request now, and what each backend weighed in it. Its JSON encoding is the body of kvroute's
// POST /admin/route/probe with disaggregated serving on.
type DisaggProbeResult struct {
	// Plan is the plan Route would follow: path, reason, prefill and decode backends (Decode is
	// the unified backend on the unified and fallback paths), expected cached and uncached tokens,
	// storage (credentials redacted). Its Path is zero and Decode "" when Route would find no
	// backend (Error says why).
	disagg.Plan
	// Why says in a sentence what decided.
	Why string `json:"why"`
	// PrefixKey is the request's prefix key (lowercase hex), "" without one.
	PrefixKey string `json:"prefix_key,omitempty"`
	// PromptTokens and PromptBlocks are the request's length in tokens and in full blocks (0 when
	// unknown: no token IDs and no tokenizer, or tier 4 off for the blocks).
	PromptTokens int `json:"prompt_tokens"`
	PromptBlocks int `json:"prompt_blocks"`
	// LookupError is the KV index's (or tokenizer's) error: Route then plans without cache facts,
	// as the probe did.
	LookupError string `json:"lookup_error,omitempty"`
	// Error is why Route would return ErrNoBackend, "" otherwise.
	Error string `json:"error,omitempty"`
	// Unified is DefaultRouter.Probe's answer for the unified and fallback paths: how Route's tiers
	// choose among the unified backends. nil on the other paths.
	Unified *ProbeResult `json:"unified,omitempty"`
	// Backends lists every backend as the planner saw it: the unified ones, then the prefill and
	// the decode pools, each in the order they were added. Empty without Config.Disagg.
	Backends []DisaggProbeBackend `json:"backends"`
}

// DisaggProbeBackend is one backend as DisaggRouter.Probe saw it (a disagg.Candidate).
type DisaggProbeBackend struct {
	Backend string      `json:"backend"`
	Role    disagg.Role `json:"role"`
	Healthy bool        `json:"healthy"`
	Weight  float64     `json:"weight"`
	// InFlight is the phases in flight: prefills on a prefill backend, decodes on a decode
	// backend, requests on a unified one.
	InFlight int `json:"in_flight"`
	// CachedTokens is the longest prefix of the prompt the backend holds by the index, Tier the
	// slowest tier among its blocks ("" when it holds none), StoredTokens the prefix it holds in
	// its external storage.
	CachedTokens int    `json:"cached_tokens"`
	Tier         string `json:"tier,omitempty"`
	StoredTokens int    `json:"stored_tokens"`
}

// Probe reports the plan Route would make for req now, and what each backend weighed in it,
// without making it: it takes no slot, records no speculation, counts no request or metric, and
// moves no rotation. It runs Route's steps on the same state — the prefix key, the request's
// tokens and block keys (asking KVConfig.Tokenizer when the request has no token IDs), the KV
// index's answer for every backend, the pools' loads, health and storage, then the planner — and,
// for the unified and fallback paths, DefaultRouter.Probe over the unified backends, so that with
// nothing else routed meanwhile Route then follows the plan Probe names. Route may still re-plan
// when a concurrent request takes the last slot under a pool's bound first. Without Config.Disagg
// the answer is the unified path (reason disabled) and DefaultRouter.Probe's choice.
//
// The error is ErrNilRequest for a nil req, or ctx.Err() when ctx has ended; ctx bounds the
// index's and the tokenizer's calls, whose failures are reported in LookupError rather than
// returned. A fleet without a healthy backend is no error: Error says why. Safe for concurrent
// use.
func (dr *DisaggRouter) Probe(ctx context.Context, req *prefixkey.Request) (DisaggProbeResult, error) {
	r := dr.r
	if req == nil {
		return DisaggProbeResult{}, ErrNilRequest
	}
	if err := ctx.Err(); err != nil {
		return DisaggProbeResult{}, err
	}
	res := DisaggProbeResult{Backends: []DisaggProbeBackend{}}
	if r.dis == nil {
		// Route's unified path: Route itself, with its own turn of the rotation.
		err := r.probeUnified(ctx, req, disagg.Plan{Path: disagg.PathUnified, Reason: disagg.ReasonDisabled}, nil, 0, &res)
		return res, err
	}
	t := r.dis
	s := t.scratch.Get().(*scratchD)
	defer t.scratch.Put(s)
	d := &DisaggDecision{router: r, req: req}
	if !r.cfg.DisablePrefixRouting {
		d.PrefixKey, d.HasPrefixKey = req.PrefixKey(r.cfg.MaxPrefixLength)
	}
	if d.HasPrefixKey {
		res.PrefixKey = d.PrefixKey.String()
	}
	in := disagg.Input{TieBreak: d.PrefixKey.Uint64()}
	ahead := uint64(0) // the turns of the round robin Route takes before the unified path's
	if !d.HasPrefixKey {
		in.TieBreak, ahead = r.rr.Load()+1, 1
	}
	tokens, err := r.requestTokens(ctx, req)
	if err != nil {
		res.LookupError = "tokenize: " + err.Error()
	}
	s.keys = s.keys[:0]
	if r.kv != nil {
		s.keys = req.BlockKeysOf(s.keys, tokens, r.kv.cfg.BlockSize)
	}
	in.PromptTokens, in.PromptBlocks = len(tokens), len(s.keys)
	res.PromptTokens, res.PromptBlocks = in.PromptTokens, in.PromptBlocks
	r.disaggCandidates(ctx, d, s, false)
	if _, err := r.disaggLookup(ctx, d.PrefixKey, d.HasPrefixKey, s, false); err != nil {
		res.LookupError = err.Error()
	}
	if err := ctx.Err(); err != nil {
		return DisaggProbeResult{}, err
	}
	for i := range s.cands {
		c := &s.cands[i]
		b := DisaggProbeBackend{Backend: c.Name, Role: c.Role, Healthy: c.Healthy, Weight: c.Weight,
			InFlight: c.PrefillLoad + c.DecodeLoad, CachedTokens: c.CachedTokens, StoredTokens: c.StoredTokens}
		if c.CachedTokens > 0 {
			b.Tier = c.Tier.String()
		}
		res.Backends = append(res.Backends, b)
	}
	in.Candidates = s.cands
	plan, err := t.planner.Plan(in)
	if err != nil {
		res.Error = fmt.Errorf("%w: %w", ErrNoBackend, err).Error()
		res.Why = "no path the configuration allows has a healthy backend"
		return res, nil
	}
	if plan.Path == disagg.PathUnified || plan.Path == disagg.PathFallback {
		return res, r.probeUnified(ctx, req, plan, s.cands, ahead, &res)
	}
	res.Plan = plan
	res.Why = dr.why(plan, in)
	return res, nil
}

// probeUnified completes res for a unified or fallback plan with DefaultRouter.Probe's choice
// among the unified backends, as Route's unified path takes it (unifiedDecision); ahead is the
// number of round-robin turns Route takes before it.
func (r *DefaultRouter) probeUnified(ctx context.Context, req *prefixkey.Request, plan disagg.Plan, cands []disagg.Candidate,
	ahead uint64, res *DisaggProbeResult) error {
	u, err := r.probe(ctx, req, ahead)
	if err != nil {
		return err
	}
	res.Unified = &u
	if u.Backend == "" && u.Reason == 0 { // Probe's "no backend is healthy"
		res.Error = ErrNoBackend.Error() + ": no unified backend is healthy"
		res.Why = "a unified backend would serve the request, but none is healthy"
		return nil
	}
	plan.Prefill, plan.Decode = "", u.Backend
	plan.ExpectedCachedTokens, plan.UncachedTokens, plan.Storage = u.ExpectedCachedTokens, 0, disagg.ExternalStorage{}
	for i := range cands {
		if cands[i].Name == u.Backend {
			plan.ExpectedCachedTokens = cands[i].CachedTokens
		}
	}
	res.Plan = plan
	switch plan.Reason {
	case disagg.ReasonDisabled:
		res.Why = "disaggregation is off: " + u.Why
	case disagg.ReasonNoPools:
		res.Why = "no prefill or decode backend: " + u.Why
	default:
		res.Why = "a pool the request needs has no healthy backend, so a unified backend serves it whole: " + u.Why
	}
	return nil
}

// why says in a sentence why the planner chose plan, a fast_decode or prefill_then_decode one.
func (dr *DisaggRouter) why(plan disagg.Plan, in disagg.Input) string {
	c := dr.r.dis.planner.Config()
	short := fmt.Sprintf("at most max_uncached_tokens (%d) or max_uncached_ratio (%g) of the prompt", c.MaxUncachedTokens, c.MaxUncachedRatio)
	switch {
	case c.DisableConditional:
		short = "conditional disaggregation is off, and any reusable prefix skips the remote prefill"
	case in.PromptTokens <= 0:
		short = "the prompt's length is unknown, and any reusable prefix skips the remote prefill"
	}
	switch plan.Reason {
	case disagg.ReasonLocalHit:
		return fmt.Sprintf("%s holds %d tokens of the prompt in its own memory; the %d left to compute are short enough (%s)",
			plan.Decode, plan.ExpectedCachedTokens, plan.UncachedTokens, short)
	case disagg.ReasonStorageHit:
		return fmt.Sprintf("%s can load %d tokens of the prompt from storage; the %d left to compute are short enough (%s)",
			plan.Decode, plan.ExpectedCachedTokens, plan.UncachedTokens, short)
	case disagg.ReasonShortPrompt:
		return fmt.Sprintf("no decode backend can reuse any of the prompt, but its %d tokens are short enough for %s to compute (%s)",
			plan.UncachedTokens, plan.Decode, short)
	case disagg.ReasonCacheMiss:
		held := ""
		if plan.ExpectedCachedTokens > 0 {
			held = fmt.Sprintf(" (holding %d tokens of it already)", plan.ExpectedCachedTokens)
		}
		return fmt.Sprintf("no decode backend can reuse enough of the prompt: %s computes it%s and writes its KV to storage, where %s loads it",
			plan.Prefill, held, plan.Decode)
	}
	return ""
}
