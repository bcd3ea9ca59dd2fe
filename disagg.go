package kvroute

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvroute/kvroute/chwbl"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/telemetry"
)

// disaggAttempts bounds how often DisaggRouter.Route re-plans when a concurrent request took the last
// slot under a pool's bound between the snapshot and the acquisition; the last attempt takes its
// slots regardless of the bound.
const disaggAttempts = 3

// errNoPrefillPhase is returned by PrefillFailed on a decision without a prefill phase in flight;
// errNoDecodePhase by DecodeFailed on a decision without a decode phase in flight on a decode
// backend.
var (
	errNoPrefillPhase = errors.New("kvroute: the decision has no prefill phase in flight")
	errNoDecodePhase  = errors.New("kvroute: the decision has no decode phase in flight on a decode backend")
)

// disaggState is the Router's disaggregation: the planner and one CHWBL ring per pool, whose
// in-flight counts are the prefill and decode loads (the unified backends stay on Router.ring).
type disaggState struct {
	planner  *disagg.Planner
	prefill  *chwbl.Ring
	decode   *chwbl.Ring
	counters disagg.Counters
	metrics  *disaggMetrics
	scratch  sync.Pool // *scratchD
}

// scratchD is one DisaggRouter.Route call's working memory, pooled.
type scratchD struct {
	keys    []uint64
	names   []string
	matches []kvindex.Match
	cands   []disagg.Candidate
	loads   []chwbl.Load
}

func newDisaggState(cfg disagg.Config, rc Config) (*disaggState, error) {
	p, err := disagg.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	ringCfg := chwbl.Config{VirtualNodes: rc.VirtualNodes, LoadFactorEpsilon: p.Config().LoadFactorEpsilon}
	t := &disaggState{planner: p}
	if t.prefill, err = chwbl.New(ringCfg); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	if t.decode, err = chwbl.New(ringCfg); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	t.scratch.New = func() any { return &scratchD{} }
	return t, nil
}

// ringOf returns the ring that holds backends of role: the Router's ring for unified backends,
// the pool's ring for prefill and decode backends (only called for roles AddBackend accepted).
func (r *DefaultRouter) ringOf(role disagg.Role) *chwbl.Ring {
	switch {
	case r.dis != nil && role == disagg.RolePrefill:
		return r.dis.prefill
	case r.dis != nil && role == disagg.RoleDecode:
		return r.dis.decode
	}
	return r.ring
}

// DisaggRouter is the prefill/decode side of a DefaultRouter (DefaultRouter.Disagg): it routes a
// request to a path (fast_decode, prefill_then_decode, unified) and its backends, over the same
// backends, health and KV index as the DefaultRouter's Route. It is a type of its own so that a gateway without disaggregation
// never meets it.
type DisaggRouter struct{ r *DefaultRouter }

// Disagg returns the Router's prefill/decode side. Without Config.Disagg its Route sends every
// request down the unified path (reason disabled), and Stats.Disagg is nil.
func (r *DefaultRouter) Disagg() *DisaggRouter { return &r.disaggSide }

// Config returns the disaggregation configuration in force, defaults applied (the timeouts a
// gateway applies to the two phases among them), and false when disaggregation is off.
func (dr *DisaggRouter) Config() (disagg.Config, bool) {
	r := dr.r
	if r.dis == nil {
		return disagg.Config{}, false
	}
	return r.dis.planner.Config(), true
}

// DisaggDecision is the outcome of DisaggRouter.Route: its Plan (path, reason, prefill and decode
// backends, expected cached tokens, storage) and the in-flight slots it holds — a prefill slot on
// Prefill until PrefillDone (or Done), a decode slot on Decode until Done. For the unified and
// fallback paths, Unified is the Route decision that holds the slot on the unified backend (Decode
// names it). Every method is safe for concurrent use and idempotent; the exported fields are
// read-only for the caller.
type DisaggDecision struct {
	// Plan is the planner's answer: path, reason, backends, cached and uncached tokens, storage.
	Plan         disagg.Plan
	PrefixKey    prefixkey.Key
	HasPrefixKey bool
	// Unified is non-nil for the unified and fallback paths: the tier-1/tier-4 decision over the
	// unified backends, whose slot Done releases.
	Unified *Decision

	router     *DefaultRouter
	req        *prefixkey.Request
	prefill    chwbl.Handle
	decode     chwbl.Handle
	pst, dst   *backendState
	start      time.Time
	prefillEnd atomic.Int64 // UnixNano of PrefillDone, 0 before
	specKeys   []uint64     // block keys PrefillDone speculates for Decode (prefill_then_decode)
	live       liveNode     // its mark among the Router's live decisions: ended once nothing is left to reclaim (Config.MaxDecisionAge)
}

// Route chooses the routing path and backends for req and takes the slots of the phases it
// needs: a prefill slot on the prefill backend (prefill_then_decode) and a decode slot on the decode
// backend, each on its pool's CHWBL ring, under the pool's load bound. It looks the request's block
// keys up in tier 4's index (when Config.KV is set) for every backend, builds one
// disagg.Candidate per backend (role, weight, health, prefill or decode phases in flight, cached
// prefix and its tier, the prefix it has written to storage, storage) and follows
// disagg.Planner.Plan; speculative index entries then
// record that the chosen prefill and decode backends will hold the prompt. The unified and
// fallback paths are routed by Route (tiers 1 and 4 over the unified backends), whose pick
// becomes Decode. Without Config.Disagg every request takes that unified path (reason disabled).
//
// It returns a non-nil decision and a nil error, or nil and: ErrNilRequest; ctx.Err() when ctx
// ended before the choice; an error wrapping ErrNoBackend (and disagg.ErrNoBackend) when no path
// the configuration allows has a healthy backend. ctx also bounds the tokenizer and a remote
// index. The caller must call Done when the request ends (it is mandatory: defer it right after a
// successful Route), and PrefillDone or PrefillFailed when a prefill phase ends. A decision whose
// Done never comes is reclaimed after Config.MaxDecisionAge, as Route's are. With Config.TracerProvider, each call is one telemetry.SpanRoute span, child of ctx's,
// whatever the path. Safe for concurrent use.
func (dr *DisaggRouter) Route(ctx context.Context, req *prefixkey.Request) (*DisaggDecision, error) {
	if dr.r.tracer != nil {
		return dr.routeTraced(ctx, req)
	}
	return dr.route(ctx, req)
}

// route is Route without its span; its unified paths run Route's steps without a span of their own.
func (dr *DisaggRouter) route(ctx context.Context, req *prefixkey.Request) (*DisaggDecision, error) {
	r := dr.r
	if req == nil {
		return nil, ErrNilRequest
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if r.dis == nil {
		u, err := r.route(ctx, req)
		return r.unifiedDecision(ctx, req, disagg.Plan{Path: disagg.PathUnified, Reason: disagg.ReasonDisabled}, nil, u, err)
	}
	t := r.dis
	s := t.scratch.Get().(*scratchD)
	defer t.scratch.Put(s)
	d := &DisaggDecision{router: r, req: req, start: r.cfg.Now()}
	r.expireDecisions(d.start)
	if !r.cfg.DisablePrefixRouting {
		d.PrefixKey, d.HasPrefixKey = req.PrefixKey(r.cfg.MaxPrefixLength)
	}
	in := disagg.Input{TieBreak: d.PrefixKey.Uint64()}
	if !d.HasPrefixKey {
		in.TieBreak = r.rr.Add(1)
	}
	in.PromptTokens = r.disaggKeys(ctx, req, s)
	in.PromptBlocks = len(s.keys)
	for attempt := 1; ; attempt++ {
		r.disaggCandidates(ctx, d, s, true)
		in.Candidates = s.cands
		plan, err := t.planner.Plan(in)
		if err != nil {
			t.counters.RecordNoBackend()
			t.metrics.recordNoBackend(ctx)
			return nil, fmt.Errorf("%w: %w", ErrNoBackend, err)
		}
		if plan.Path == disagg.PathUnified || plan.Path == disagg.PathFallback {
			u, err := r.route(ctx, req)
			return r.unifiedDecision(ctx, req, plan, s.cands, u, err)
		}
		if r.takeSlots(d, plan, attempt >= disaggAttempts) {
			d.Plan = plan
			break
		}
		if attempt > disaggAttempts { // the chosen backends keep leaving the pools
			t.counters.RecordNoBackend()
			t.metrics.recordNoBackend(ctx)
			return nil, fmt.Errorf("%w: the planned backends left their pools", ErrNoBackend)
		}
	}
	set := r.set.Load()
	d.dst = set.byName[d.Plan.Decode]
	if d.Plan.Prefill != "" {
		d.pst = set.byName[d.Plan.Prefill]
	}
	for _, st := range [...]*backendState{d.pst, d.dst} {
		if st != nil {
			st.decisions.Add(1)
		}
	}
	if k := r.kv; k != nil && k.specTTL > 0 && len(s.keys) > 0 {
		if d.Plan.Prefill != "" {
			// The prompt's KV exists only once the prefill has computed it and written it to
			// storage, on its way to the decode backend: PrefillDone speculates for both. Doing it
			// now would send a twin request arriving meanwhile, as a local or storage hit, to a
			// decode backend that would find nothing and compute the whole prompt itself.
			d.specKeys = append([]uint64(nil), s.keys...)
		} else {
			_ = k.spec.Speculate(ctx, d.Plan.Decode, s.keys, k.specTTL)
		}
	}
	t.counters.Record(d.Plan)
	t.metrics.recordPlan(ctx, d.Plan)
	r.live.track(&d.live, d, r.since(d.start))
	return d, nil
}

// takeSlots takes the plan's decode slot and, for prefill_then_decode, its prefill slot, each
// under its pool's bound unless force. It returns false (holding nothing) when a slot was refused.
func (r *DefaultRouter) takeSlots(d *DisaggDecision, plan disagg.Plan, force bool) bool {
	take := func(ring *chwbl.Ring, h *chwbl.Handle, name string) bool {
		if force {
			return ring.AcquireBackend(h, name) == nil
		}
		ok, err := ring.TryAcquireBackend(h, name)
		return ok && err == nil
	}
	if !take(r.dis.decode, &d.decode, plan.Decode) {
		return false
	}
	if plan.Prefill != "" && !take(r.dis.prefill, &d.prefill, plan.Prefill) {
		d.decode.Release()
		return false
	}
	return true
}

// routeUnified serves a unified or fallback plan through Route and wraps its decision. cands, when
// given, supply the expected cached tokens of Route's pick.
func (r *DefaultRouter) routeUnified(ctx context.Context, req *prefixkey.Request, plan disagg.Plan, cands []disagg.Candidate) (*DisaggDecision, error) {
	u, err := r.Route(ctx, req)
	return r.unifiedDecision(ctx, req, plan, cands, u, err)
}

// unifiedDecision wraps Route's decision u (or its error) for a unified or fallback plan.
func (r *DefaultRouter) unifiedDecision(ctx context.Context, req *prefixkey.Request, plan disagg.Plan, cands []disagg.Candidate,
	u *Decision, err error) (*DisaggDecision, error) {
	if err != nil {
		if r.dis != nil && errors.Is(err, ErrNoBackend) {
			r.dis.counters.RecordNoBackend()
			r.dis.metrics.recordNoBackend(ctx)
		}
		return nil, err
	}
	plan.Prefill, plan.Decode = "", u.Backend
	plan.ExpectedCachedTokens, plan.UncachedTokens, plan.Storage = u.ExpectedCachedTokens, 0, disagg.ExternalStorage{}
	for i := range cands {
		if cands[i].Name == u.Backend {
			plan.ExpectedCachedTokens = cands[i].CachedTokens
		}
	}
	d := &DisaggDecision{Plan: plan, PrefixKey: u.PrefixKey, HasPrefixKey: u.HasPrefixKey, Unified: u, router: r, req: req, start: r.timeAt(u.at)}
	if r.dis != nil {
		r.dis.counters.Record(plan)
		r.dis.metrics.recordPlan(ctx, plan)
	}
	return d, nil
}

// disaggKeys leaves the request's block keys in s.keys (when tier 4 is on) and returns the prompt's
// length in tokens (0 when unknown).
func (r *DefaultRouter) disaggKeys(ctx context.Context, req *prefixkey.Request, s *scratchD) int {
	s.keys = s.keys[:0]
	tokens, _ := r.requestTokens(ctx, req) // a tokenizer failure leaves the request keyless
	if r.kv != nil {
		s.keys = req.BlockKeysOf(s.keys, tokens, r.kv.cfg.BlockSize)
	}
	return len(tokens)
}

// disaggCandidates fills s.cands with every backend: the unified ones from the Router's ring,
// the prefill and decode ones from their pools' rings, each (with lookup) with its cached prefix
// from the index. The backends ctx avoids (WithAvoid) are candidates marked unhealthy.
func (r *DefaultRouter) disaggCandidates(ctx context.Context, d *DisaggDecision, s *scratchD, lookup bool) {
	set := r.set.Load()
	s.loads = r.ring.Loads(s.loads[:0])
	nUnified := len(s.loads)
	s.loads = r.dis.prefill.Loads(s.loads)
	nPrefill := len(s.loads) - nUnified
	s.loads = r.dis.decode.Loads(s.loads)
	s.cands, s.names = s.cands[:0], s.names[:0]
	avoid := Avoided(ctx)
	for i, l := range s.loads {
		c := disagg.Candidate{Name: l.Name, Weight: l.Weight, Healthy: l.Healthy && !slices.Contains(avoid, l.Name), Health: 1}
		switch {
		case i < nUnified:
			c.Role, c.DecodeLoad = disagg.RoleUnified, l.InFlight
		case i < nUnified+nPrefill:
			c.Role, c.PrefillLoad = disagg.RolePrefill, l.InFlight
		default:
			c.Role, c.DecodeLoad = disagg.RoleDecode, l.InFlight
		}
		if st := set.byName[l.Name]; st != nil {
			c.Health, c.Storage = st.success.load(), st.storage
		}
		s.cands = append(s.cands, c)
		s.names = append(s.names, l.Name)
	}
	if lookup {
		_, _ = r.disaggLookup(ctx, d.PrefixKey, d.HasPrefixKey, s, true)
	}
}

// disaggLookup asks the KV index what each backend of s.names holds of the request (by block key,
// or by prefix entry for a request without block keys under KVConfig.UsePrefixEntries) and fills
// s.cands' cache facts. It reports whether the index was asked (not with tier 4 off or nothing to
// look up) and its error, which leaves the candidates without cache facts: every path stays
// available. With record (Route) the lookup is a telemetry.SpanKVLookup span and a latency metric, and the
// best overlap goes on ctx's telemetry.SpanRoute span; without, it records nothing.
func (r *DefaultRouter) disaggLookup(ctx context.Context, pk prefixkey.Key, hasKey bool, s *scratchD, record bool) (bool, error) {
	k := r.kv
	usePrefix := k != nil && len(s.keys) == 0 && k.cfg.UsePrefixEntries && hasKey
	if k == nil || (len(s.keys) == 0 && !usePrefix) || len(s.names) == 0 {
		return false, nil
	}
	if cap(s.matches) < len(s.names) {
		s.matches = make([]kvindex.Match, len(s.names))
	}
	var start time.Time
	lctx, span := ctx, trace.Span(noop.Span{})
	if record {
		start = r.cfg.Now()
		lctx, span = r.startSpan(ctx, telemetry.SpanKVLookup)
	}
	var err error
	if usePrefix {
		s.matches, err = k.prefix.LookupPrefix(lctx, pk.String(), s.names, s.matches[:len(s.names)])
	} else {
		s.matches, err = k.cfg.Index.Lookup(lctx, s.keys, s.names, s.matches[:len(s.names)])
	}
	if record {
		r.endLookupOf(span, len(s.keys), len(s.names), err)
		r.metrics.recordLookup(ctx, r.cfg.Now().Sub(start))
	}
	if err != nil {
		return true, err
	}
	best := 0.0
	for i := range s.matches {
		m := &s.matches[i]
		c := &s.cands[i]
		c.CachedTokens, c.WeightedBlocks, c.StoredTokens = m.Tokens, m.WeightedBlocks, m.StoredTokens
		c.Tier = min(m.Tier, disagg.TierStorage) // an index's unknown tier counts as storage
		if c.Healthy {
			best = max(best, c.WeightedBlocks)
		}
	}
	if record {
		ratio := 0.0
		switch {
		case len(s.keys) > 0:
			ratio = best / float64(len(s.keys))
		case best > 0:
			ratio = 1
		}
		r.traceOverlap(ctx, ratio)
	}
	return true, nil
}

// PrefillDone ends the prefill phase: it releases the prefill slot and records o against the
// prefill backend (latency and success, as Decision.Done does). Only the first call (of
// PrefillDone, PrefillFailed and Done) releases the slot; a no-op for decisions without a prefill
// phase and for a nil decision. Safe for concurrent use.
//
// A successful prefill (o.Err nil) also records speculative index entries for the prefill backend,
// which holds the prompt's KV and has written it to storage, and for the decode backend, which is
// about to load it; they use a background context, bounded by the index.
func (d *DisaggDecision) PrefillDone(o Outcome) {
	if d.endPrefill(o) && o.Err == nil && d.specKeys != nil {
		if k := d.router.kv; k != nil {
			_ = k.spec.Speculate(context.Background(), d.Plan.Prefill, d.specKeys, k.specTTL)
			_ = k.spec.Speculate(context.Background(), d.Plan.Decode, d.specKeys, k.specTTL)
		}
		d.specKeys = nil
	}
}

// endPrefill releases the prefill slot and records o; it reports whether this call released it.
func (d *DisaggDecision) endPrefill(o Outcome) bool {
	if d == nil || !d.prefill.Release() {
		return false
	}
	now := d.router.cfg.Now()
	d.prefillEnd.Store(now.UnixNano())
	if d.pst != nil {
		lat := o.Latency
		if lat <= 0 {
			lat = now.Sub(d.start)
		}
		d.pst.observe(lat, o.Err == nil)
	}
	return true
}

// FirstToken tells the Router the request's first token arrived; for the unified and fallback paths
// it is Decision.FirstToken, for the others a no-op (their prefill load ends with PrefillDone).
func (d *DisaggDecision) FirstToken() {
	if d != nil && d.Unified != nil {
		d.Unified.FirstToken()
	}
}

// Done ends the request: it releases the decode slot (or the unified decision's slot) and records
// o against that backend; a prefill slot still held is released without an outcome. Only the first
// call has an effect, and none once Config.MaxDecisionAge has reclaimed the decision; a nil
// decision is a no-op. Safe for concurrent use.
func (d *DisaggDecision) Done(o Outcome) {
	if d == nil {
		return
	}
	if d.Unified != nil {
		d.Unified.Done(o)
		return
	}
	d.router.live.untrack(&d.live)
	d.prefill.Release()
	if o.Refused {
		if !d.decode.Held() {
			return
		}
		if d.dst != nil {
			d.dst.refusals.Add(1)
		}
		d.router.holdRefused(&d.decode)
		return
	}
	if !d.decode.Release() || d.dst == nil || o.NotSent {
		return
	}
	lat := o.Latency
	if lat <= 0 {
		from := d.start
		if ns := d.prefillEnd.Load(); ns != 0 {
			from = time.Unix(0, ns)
		}
		lat = d.router.cfg.Now().Sub(from)
	}
	d.dst.observe(lat, o.Err == nil)
}

// PrefillFailed reports that the remote prefill failed with cause: it releases the prefill slot
// (recording the failure against the prefill backend) and the decode slot (recording nothing: the
// decode phase never ran), counts the failure, and re-routes the request to a unified backend with
// Route. The new decision has path fallback and reason prefill_failed; the caller forwards the
// whole request to its Decode and calls its Done, not this decision's.
//
// It returns an error wrapping ErrNoBackend and cause when fallback to unified is off or no unified
// backend is healthy (both slots are released all the same), ctx.Err() when ctx has ended, and an
// error (releasing nothing) when the decision has no prefill phase in flight. Safe for concurrent
// use; only the first of PrefillDone, PrefillFailed and Done releases the prefill slot.
func (d *DisaggDecision) PrefillFailed(ctx context.Context, cause error) (*DisaggDecision, error) {
	if !d.endPrefill(Outcome{Err: cause}) {
		return nil, errNoPrefillPhase
	}
	r := d.router
	r.live.untrack(&d.live)
	d.decode.Release()
	t := r.dis
	t.counters.RecordPrefillFailure()
	t.metrics.recordPrefillFailure(ctx)
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s := t.scratch.Get().(*scratchD)
	defer t.scratch.Put(s)
	r.disaggCandidates(ctx, d, s, false)
	plan, err := t.planner.Fallback(disagg.Input{Candidates: s.cands})
	if err != nil {
		t.counters.RecordNoBackend()
		t.metrics.recordNoBackend(ctx)
		return nil, fmt.Errorf("%w: prefill on %q failed (%w): %w", ErrNoBackend, d.Plan.Prefill, cause, err)
	}
	return r.routeUnified(ctx, d.req, plan, nil)
}

// DecodeFailed reports that the decode backend failed before answering, with cause: it releases
// the decision's slots (recording the failure against the decode backend), counts the failure, and
// re-routes the request to a unified backend with Route. The new decision has path fallback and
// reason decode_failed; the caller forwards the whole request, as the client sent it, to its
// Decode and calls its Done, not this decision's.
//
// It returns an error wrapping ErrNoBackend and cause when fallback to unified is off or no
// unified backend is healthy (the slots are released all the same), ctx.Err() when ctx has ended,
// and an error (releasing nothing) for a decision without a decode phase in flight on a decode
// backend: the unified and fallback paths (retry those with Route) and a decision already done.
// Safe for concurrent use.
func (d *DisaggDecision) DecodeFailed(ctx context.Context, cause error) (*DisaggDecision, error) {
	if d == nil || d.Unified != nil {
		return nil, errNoDecodePhase
	}
	d.router.live.untrack(&d.live)
	d.prefill.Release()
	if !d.decode.Release() {
		return nil, errNoDecodePhase
	}
	r := d.router
	if d.dst != nil {
		d.dst.observe(r.cfg.Now().Sub(d.start), false)
	}
	t := r.dis
	t.counters.RecordDecodeFailure()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s := t.scratch.Get().(*scratchD)
	defer t.scratch.Put(s)
	r.disaggCandidates(ctx, d, s, false)
	plan, err := t.planner.DecodeFallback(disagg.Input{Candidates: s.cands})
	if err != nil {
		t.counters.RecordNoBackend()
		t.metrics.recordNoBackend(ctx)
		return nil, fmt.Errorf("%w: decode on %q failed (%w): %w", ErrNoBackend, d.Plan.Decode, cause, err)
	}
	return r.routeUnified(ctx, d.req, plan, nil)
}
