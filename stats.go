package kvroute

import (
	"context"
	"math"
	"time"

	"github.com/kvroute/kvroute/chwbl"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/scorer"
)

// Stats is a snapshot of a DefaultRouter (DefaultRouter.Stats): its decisions by reason, its
// backends, tier 4's lookups and its index's own statistics, what it knows of its peers, and
// disaggregated serving's requests. Its counters count from New on and never go down: a
// monitoring system computes rates from the differences between two snapshots. Package admin
// turns it into the JSON bodies of kvroute's admin endpoints.
type Stats struct {
	// Decisions counts Route's decisions by reason.
	Decisions DecisionCounts
	// Backends lists every backend: the unified ones (Route's) in the order they were added,
	// then the prefill ones and the decode ones (DisaggRouter.Route's), each pool in that order.
	Backends []BackendStats
	// UniquePrefixes estimates how many distinct prefix keys Route has seen (HyperLogLog, ±1.6 %).
	UniquePrefixes uint64

	// Tier 4's counters, zero when it is off (Config.KV nil). Lookups counts Route's KV index
	// lookups and LookupErrors those that failed; TokenizeErrors the requests
	// KVConfig.Tokenizer failed to tokenize; ScoreErrors the scorer's answers refused
	// (scorer.ScoreSafely); NoBlockKeys the requests tier 4 could not look up, having neither
	// block keys nor a prefix entry to ask for. The requests LookupErrors, ScoreErrors and
	// NoBlockKeys count are among Decisions.HandedOff.
	Lookups        uint64
	LookupErrors   uint64
	TokenizeErrors uint64
	ScoreErrors    uint64
	NoBlockKeys    uint64
	// Index is the KV index's own statistics; nil when tier 4 is off or when the index reports
	// none (it has no Stats method as kvindex.KvCacheIndex declares it). When its Stats failed
	// (DefaultRouter.Stats then returns the error), Index is what it returned with the error: a
	// remote index's own counters, say, without what it could not read from its store.
	Index *kvindex.Stats

	// Tier 4's settings in effect that its KVConfig may leave to the Router; zero when tier 4 is
	// off. Scorer names the scorer that ranks the candidates: "expected_ttft"
	// (scorer.ExpectedTTFT, the default), "kv_overlap" (scorer.Composite), "cost" (scorer.Cost) or "custom" (any other implementation).
	// AttentionCost is the prefill cost model's attention term (0: prefill work counts tokens
	// alone), BlockSize the index's block size in tokens, SpeculativeTTL the lifetime of the
	// index entries speculation records (0: speculation off), LoadFactorEpsilon the ε of tier 4's
	// bound on its choices (KVConfig.LoadFactorEpsilon, its default filled by the scorer).
	Scorer            string
	AttentionCost     float64
	BlockSize         int
	SpeculativeTTL    time.Duration
	LoadFactorEpsilon float64

	// Peers is what the Router knows of its peers and of engine-reported load.
	Peers PeerStats
	// Disagg counts DisaggRouter.Route's requests by routing path and reason; nil without
	// Config.Disagg.
	Disagg *disagg.Stats
}

// DecisionCounts counts the Router's decisions by Reason (see Reason for the labels) since New.
// Route makes one decision per request, so the reasons' counts sum to Total; a request
// DisaggRouter.Route serves on the unified or fallback path is one of Route's.
type DecisionCounts struct {
	// Tier 1: the CHWBL ring (PrefixHash, Overflow), the selection strategy for a request
	// without a prefix key (Fallback), or with prefix routing off (Strategy).
	PrefixHash uint64
	Overflow   uint64
	Fallback   uint64
	Strategy   uint64
	// Tier 4: the KV index and the scorer.
	KVAware   uint64
	LoadBound uint64
	Imbalance uint64
	LeastWork uint64
	// HandedOff counts the requests tier 4 looked at and left to tier 1: no block keys, an index,
	// tokenizer or scorer error, every candidate at tier 4's bound, or too little cached with
	// KVConfig.RingFallback or prefix entries. Each is counted again under the tier-1 reason
	// that decided it.
	HandedOff uint64
	// Expired counts the decisions (Route's and DisaggRouter.Route's) whose Done had not come
	// after Config.MaxDecisionAge, whose slots the Router reclaimed: a caller's bug to look for.
	// They are counted under their reasons too.
	Expired uint64
}

// Total returns the number of decisions: the sum of the reasons' counts (HandedOff aside, whose
// requests tier 1 decided).
func (c DecisionCounts) Total() uint64 {
	return c.PrefixHash + c.Overflow + c.Fallback + c.Strategy + c.KVAware + c.LoadBound + c.Imbalance + c.LeastWork
}

// BackendStats is one backend's line in Stats: its load, health and observed averages.
type BackendStats struct {
	Name    string
	Role    disagg.Role
	Healthy bool
	Weight  float64
	// InFlight counts the slots this Router holds on the backend: Route's requests on a unified
	// backend, prefill phases on a prefill backend, decode phases on a decode backend.
	InFlight int
	// ExternalLoad is the load no handle of this Router holds (see "Router replicas" in the
	// package documentation): other replicas' requests, or its engine's beyond this Router's.
	ExternalLoad int
	// Decisions counts the decisions (for a pool backend, the phases) that chose it.
	Decisions uint64
	// Latency is the moving average of its requests' latency, 0 before the first ended;
	// SuccessRate that of their success, in [0, 1], 1 before the first ended.
	Latency     time.Duration
	SuccessRate float64
	// Refusals counts the requests it declined for lack of capacity (Outcome.Refused).
	Refusals uint64
	// Engine is its latest engine-reported load still counted (ReportEngineLoad), nil when none.
	Engine *EngineLoad
}

// Stats returns a snapshot of the Router. ctx bounds the KV index's Stats call, which a remote
// index answers over the network (kvindex/redisindex runs a script on its server); nothing else
// in it waits on I/O. The error is the index's: the snapshot is then complete but for Index,
// which holds what the index returned with it. A ctx already done skips the index's call: Stats
// returns the rest, Index nil, and ctx.Err() — the way to read the Router's own counters alone,
// at no cost to the index. An index that reports no statistics, and tier 4 off, are no error
// (Index is nil). Safe for concurrent use; the counters are read one by one, so a snapshot taken
// under load may be off by the decisions made while it was taken. It first reclaims the decisions
// older than Config.MaxDecisionAge, so that their slots are not shown in flight.
func (r *DefaultRouter) Stats(ctx context.Context) (Stats, error) {
	r.expireDecisions(r.cfg.Now())
	s := Stats{UniquePrefixes: r.prefix.estimate(), Peers: r.peerStats()}
	d := &s.Decisions
	d.PrefixHash = r.counts[ReasonPrefixHash].Load()
	d.Overflow = r.counts[ReasonOverflow].Load()
	d.Fallback = r.counts[ReasonFallback].Load()
	d.Strategy = r.counts[ReasonStrategy].Load()
	d.KVAware = r.counts[ReasonKVAware].Load()
	d.LoadBound = r.counts[ReasonLoadBound].Load()
	d.Imbalance = r.counts[ReasonImbalance].Load()
	d.LeastWork = r.counts[ReasonLeastWork].Load()
	d.Expired = r.live.expired.Load()

	set := r.set.Load()
	s.Backends = make([]BackendStats, 0, len(set.list)+len(set.pd))
	s.Backends = r.appendBackends(s.Backends, set, r.ring, disagg.RoleUnified)
	if t := r.dis; t != nil {
		s.Backends = r.appendBackends(s.Backends, set, t.prefill, disagg.RolePrefill)
		s.Backends = r.appendBackends(s.Backends, set, t.decode, disagg.RoleDecode)
		ds := t.counters.Snapshot()
		s.Disagg = &ds
	}

	t := r.kv
	if t == nil {
		return s, nil
	}
	d.HandedOff = t.handedOff.Load()
	s.Lookups, s.LookupErrors = t.lookups.Load(), t.lookupErrs.Load()
	s.TokenizeErrors, s.ScoreErrors, s.NoBlockKeys = t.tokenizeErrs.Load(), t.scoreErrs.Load(), t.noTokens.Load()
	s.Scorer, s.AttentionCost, s.BlockSize, s.SpeculativeTTL = scorerName(t.scorer), t.attn, t.cfg.BlockSize, t.specTTL
	s.LoadFactorEpsilon = t.eps
	if t.stats == nil {
		return s, nil
	}
	if err := ctx.Err(); err != nil {
		return s, err
	}
	is, err := t.stats.Stats(ctx)
	s.Index = &is
	return s, err
}

// appendBackends appends the stats of ring's members, backends of role, to dst.
func (r *DefaultRouter) appendBackends(dst []BackendStats, set *backendSet, ring *chwbl.Ring, role disagg.Role) []BackendStats {
	for _, l := range ring.Loads(nil) {
		b := BackendStats{Name: l.Name, Role: role, Healthy: l.Healthy, Weight: l.Weight, InFlight: l.InFlight,
			ExternalLoad: l.External, SuccessRate: 1}
		if st := set.byName[l.Name]; st != nil {
			b.Decisions = st.decisions.Load()
			b.Latency = time.Duration(math.Round(st.latencyNs.load()))
			b.SuccessRate = st.success.load()
			b.Refusals = st.refusals.Load()
			if e, ok := r.engineLoad(st); ok {
				b.Engine = &e
			}
		}
		dst = append(dst, b)
	}
	return dst
}

// scorerName is Stats.Scorer for s.
func scorerName(s scorer.BackendScorer) string {
	switch s.(type) {
	case *scorer.ExpectedTTFT:
		return "expected_ttft"
	case *scorer.Composite:
		return "kv_overlap"
	case *scorer.Cost:
		return "cost"
	}
	return "custom"
}
