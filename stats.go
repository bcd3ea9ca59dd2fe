package kvroute

import (
	"strconv"

	"github.com/kvroute/kvroute/chwbl"
)

// PrefixRoutingStats is the content of kvroute's GET /admin/prefix-routing/stats; its JSON encoding
// is that endpoint's body.
type PrefixRoutingStats struct {
	Enabled             bool                  `json:"enabled"`
	Config              PrefixRoutingConfig   `json:"config"`
	RoutingDecisions    RoutingDecisionCounts `json:"routing_decisions"`
	BackendDistribution []BackendLoad         `json:"backend_distribution"`
	UniquePrefixes      uint64                `json:"unique_prefixes"` // HyperLogLog estimate, ±1.6 %
}

// PrefixRoutingConfig is the tier-1 configuration as the stats endpoint reports it.
type PrefixRoutingConfig struct {
	MaxPrefixLength                int     `json:"max_prefix_length"`
	LoadFactorEpsilon              float64 `json:"load_factor_epsilon"`
	VirtualNodes                   int     `json:"virtual_nodes"`
	AnthropicCacheControlInjection bool    `json:"anthropic_cache_control_injection"`
	SelectionStrategy              string  `json:"selection_strategy"`
}

// RoutingDecisionCounts counts decisions by reason (labels as Reason documents them) since the
// Router was built. OverflowRate is
// overflow/total formatted with four decimals, as kvroute's admin endpoint shows it.
type RoutingDecisionCounts struct {
	Total        uint64 `json:"total"`
	PrefixHash   uint64 `json:"prefix_hash"`
	Overflow     uint64 `json:"overflow"`
	Fallback     uint64 `json:"fallback"`
	KVAware      uint64 `json:"kv_aware,omitempty"`   // tier 4 chose
	Imbalance    uint64 `json:"imbalance,omitempty"`  // tier 4's imbalance guard chose
	LeastWork    uint64 `json:"least_work,omitempty"` // tier 4 found too little cached: least prefill work chose
	LoadBound    uint64 `json:"load_bound,omitempty"` // tier 4: load sent it past the backends holding enough of it
	Strategy     uint64 `json:"strategy,omitempty"`   // prefix routing off: the selection strategy chose
	OverflowRate string `json:"overflow_rate"`
}

// BackendLoad is one backend's line in the stats: its in-flight requests, health and observed
// averages.
type BackendLoad struct {
	Backend          string  `json:"backend"`
	InFlightRequests int     `json:"in_flight_requests"`
	Healthy          bool    `json:"healthy"`
	Weight           float64 `json:"weight"`
	Decisions        uint64  `json:"decisions"`
	LatencyEWMAMs    float64 `json:"latency_ewma_ms"`
	SuccessRate      float64 `json:"success_rate"`
	Refusals         uint64  `json:"refusals"` // requests it declined for lack of capacity (Outcome.Refused)
	// ExternalLoad is the load no handle of this Router holds (see "Router replicas" in the
	// package documentation): other replicas' requests, or its engine's beyond this Router's.
	ExternalLoad int `json:"external_load"`
	// Engine is its latest engine-reported load still counted (ReportEngineLoad), nil when none.
	Engine *EngineLoad `json:"engine,omitempty"`
}

// Stats returns a snapshot of the Router's tier-1 statistics. Safe for concurrent use; the counters
// are read one by one, so a snapshot taken under load may be off by the decisions made while it was
// taken.
func (r *DefaultRouter) Stats() PrefixRoutingStats {
	s := PrefixRoutingStats{
		Enabled: !r.cfg.DisablePrefixRouting,
		Config: PrefixRoutingConfig{
			MaxPrefixLength:                r.cfg.MaxPrefixLength,
			LoadFactorEpsilon:              r.cfg.LoadFactorEpsilon,
			VirtualNodes:                   r.cfg.VirtualNodes,
			AnthropicCacheControlInjection: r.cfg.AnthropicCacheControlInjection,
			SelectionStrategy:              string(r.cfg.Strategy),
		},
		UniquePrefixes: r.prefix.estimate(),
	}
	d := &s.RoutingDecisions
	d.PrefixHash = r.counts[ReasonPrefixHash].Load()
	d.Overflow = r.counts[ReasonOverflow].Load()
	d.Fallback = r.counts[ReasonFallback].Load()
	d.KVAware = r.counts[ReasonKVAware].Load()
	d.Imbalance = r.counts[ReasonImbalance].Load()
	d.LeastWork = r.counts[ReasonLeastWork].Load()
	d.LoadBound = r.counts[ReasonLoadBound].Load()
	d.Strategy = r.counts[ReasonStrategy].Load()
	d.Total = d.PrefixHash + d.Overflow + d.Fallback + d.KVAware + d.Imbalance + d.LeastWork + d.LoadBound + d.Strategy
	rate := 0.0
	if d.Total > 0 {
		rate = float64(d.Overflow) / float64(d.Total)
	}
	d.OverflowRate = strconv.FormatFloat(rate, 'f', 4, 64)

	set := r.set.Load()
	loads := r.ring.Loads(make([]chwbl.Load, 0, len(set.list)))
	s.BackendDistribution = make([]BackendLoad, 0, len(loads))
	for _, l := range loads {
		bl := BackendLoad{Backend: l.Name, InFlightRequests: l.InFlight, Healthy: l.Healthy, Weight: l.Weight, SuccessRate: 1,
			ExternalLoad: l.External}
		if st := set.byName[l.Name]; st != nil {
			bl.Decisions = st.decisions.Load()
			bl.LatencyEWMAMs = st.latencyNs.load() / 1e6
			bl.SuccessRate = st.success.load()
			bl.Refusals = st.refusals.Load()
			if e, ok := r.engineLoad(st); ok {
				bl.Engine = &e
			}
		}
		s.BackendDistribution = append(s.BackendDistribution, bl)
	}
	return s
}

// ResetStats zeroes the decision counters (those of DisaggStats too) and the unique-prefix estimate.
// Safe for concurrent use.
func (r *DefaultRouter) ResetStats() {
	for i := range r.counts {
		r.counts[i].Store(0)
	}
	r.prefix.reset()
	if r.dis != nil {
		r.dis.counters.Reset()
	}
}
