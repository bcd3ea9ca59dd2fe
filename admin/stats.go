package admin

import (
	"strconv"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

// This file holds the JSON bodies of kvroute's stats endpoints and the functions that build them
// from a kvroute.Stats snapshot and what only the gateway knows: its configuration as it reports
// it, and its KV event sources. The keys and formats are the endpoints' (kvroute's documented
// admin names, some values formatted as strings), not the library's Go types.

// PrefixRoutingStats is the body of GET /admin/prefix-routing/stats: tier 1's configuration,
// decisions by reason and the unified backends' load.
type PrefixRoutingStats struct {
	Enabled             bool                `json:"enabled"`
	Config              PrefixRoutingConfig `json:"config"`
	RoutingDecisions    RoutingDecisions    `json:"routing_decisions"`
	BackendDistribution []BackendLoad       `json:"backend_distribution"`
	UniquePrefixes      uint64              `json:"unique_prefixes"` // HyperLogLog estimate, ±1.6 %
}

// PrefixRoutingConfig is tier 1's configuration as the gateway reports it, defaults filled in.
type PrefixRoutingConfig struct {
	MaxPrefixLength                int     `json:"max_prefix_length"`
	LoadFactorEpsilon              float64 `json:"load_factor_epsilon"`
	VirtualNodes                   int     `json:"virtual_nodes"`
	AnthropicCacheControlInjection bool    `json:"anthropic_cache_control_injection"`
	SelectionStrategy              string  `json:"selection_strategy"`
}

// RoutingDecisions counts the Router's decisions by reason (kvroute.Reason's labels); the tier-4
// reasons are left out while zero. OverflowRate is overflow/total with four decimals.
type RoutingDecisions struct {
	Total        uint64 `json:"total"`
	PrefixHash   uint64 `json:"prefix_hash"`
	Overflow     uint64 `json:"overflow"`
	Fallback     uint64 `json:"fallback"`
	KVAware      uint64 `json:"kv_aware,omitempty"`
	Imbalance    uint64 `json:"imbalance,omitempty"`
	LeastWork    uint64 `json:"least_work,omitempty"`
	LoadBound    uint64 `json:"load_bound,omitempty"`
	Strategy     uint64 `json:"strategy,omitempty"`
	OverflowRate string `json:"overflow_rate"`
	// Expired counts the decisions whose end never came within max_decision_age, whose slots
	// the Router reclaimed (kvroute.DecisionCounts.Expired; counted under their reasons too);
	// left out while zero.
	Expired uint64 `json:"expired,omitempty"`
}

// BackendLoad is one unified backend's line in PrefixRoutingStats (kvroute.BackendStats).
type BackendLoad struct {
	Backend          string  `json:"backend"`
	InFlightRequests int     `json:"in_flight_requests"`
	Healthy          bool    `json:"healthy"`
	Weight           float64 `json:"weight"`
	Decisions        uint64  `json:"decisions"`
	LatencyEWMAMs    float64 `json:"latency_ewma_ms"`
	SuccessRate      float64 `json:"success_rate"`
	Refusals         uint64  `json:"refusals"`
	ExternalLoad     int     `json:"external_load"`
	// Engine is the backend's engine-reported load still counted, absent when none.
	Engine *kvroute.EngineLoad `json:"engine,omitempty"`
}

// NewPrefixRoutingStats builds the body of GET /admin/prefix-routing/stats from st, whether tier 1
// is enabled (prefix routing on) and cfg, the gateway's configuration of it.
func NewPrefixRoutingStats(st kvroute.Stats, enabled bool, cfg PrefixRoutingConfig) PrefixRoutingStats {
	d := st.Decisions
	s := PrefixRoutingStats{
		Enabled: enabled,
		Config:  cfg,
		RoutingDecisions: RoutingDecisions{
			Total: d.Total(), PrefixHash: d.PrefixHash, Overflow: d.Overflow, Fallback: d.Fallback,
			KVAware: d.KVAware, Imbalance: d.Imbalance, LeastWork: d.LeastWork, LoadBound: d.LoadBound, Strategy: d.Strategy,
			Expired: d.Expired,
		},
		BackendDistribution: make([]BackendLoad, 0, len(st.Backends)),
		UniquePrefixes:      st.UniquePrefixes,
	}
	rate := 0.0
	if t := s.RoutingDecisions.Total; t > 0 {
		rate = float64(d.Overflow) / float64(t)
	}
	s.RoutingDecisions.OverflowRate = strconv.FormatFloat(rate, 'f', 4, 64)
	for _, b := range st.Backends {
		if b.Role != disagg.RoleUnified {
			continue
		}
		s.BackendDistribution = append(s.BackendDistribution, BackendLoad{
			Backend: b.Name, InFlightRequests: b.InFlight, Healthy: b.Healthy, Weight: b.Weight,
			Decisions: b.Decisions, LatencyEWMAMs: milliseconds(b.Latency), SuccessRate: b.SuccessRate,
			Refusals: b.Refusals, ExternalLoad: b.ExternalLoad, Engine: b.Engine,
		})
	}
	return s
}

// milliseconds returns d in milliseconds.
func milliseconds(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// KVIndexStats is the body of GET /admin/kv-index/stats: tier 4's configuration, the KV index's
// own statistics, the event sources, and tier 4's decisions and counters.
type KVIndexStats struct {
	Enabled      bool          `json:"enabled"`
	Config       KVIndexConfig `json:"config"`
	Index        kvindex.Stats `json:"index"`
	EventSources []EventSource `json:"event_sources"`
	// EventListeners are the addresses the gateway binds for engines' events (ZMQ bind mode),
	// with the messages each received, placed on a backend or dropped (unplaced, malformed): a
	// dropped message belongs to no backend, so no event source counts it. Set by the gateway;
	// absent without bound addresses.
	EventListeners   []events.ListenerStatus `json:"event_listeners,omitempty"`
	RoutingDecisions KVRoutingDecisions      `json:"routing_decisions"`
	// Lookups counts the Router's KV index lookups (kvroute.Stats.Lookups; the key names the
	// lookups' latency samples), OverlapScores those answered (and so scored).
	Lookups        uint64 `json:"query_latency_count"`
	OverlapScores  uint64 `json:"overlap_score_count"`
	LookupErrors   uint64 `json:"lookup_errors"`
	TokenizeErrors uint64 `json:"tokenize_errors"`
	NoBlockKeys    uint64 `json:"requests_without_block_keys"`
	// Tokenizer is the gateway's tokenizer's statistics (one that calls the engines), set by the
	// gateway; absent otherwise.
	Tokenizer *prefixkey.TokenizerStats `json:"tokenizer_stats,omitempty"`
	// IndexError is the error of the index's stats call, absent when none.
	IndexError string `json:"index_error,omitempty"`
}

// KVIndexConfig is tier 4's configuration as the endpoint reports it. NewKVIndexStats fills
// Backend (the index's kind, from its stats), BlockSize, SpeculativeTTLSeconds, Scorer,
// AttentionCost and LoadFactorEpsilon (here and in Scoring) from the Router's settings in effect;
// the gateway gives the rest.
type KVIndexConfig struct {
	Backend               string  `json:"backend"`
	BlockSize             int     `json:"block_size"`
	MinOverlapThreshold   float64 `json:"min_overlap_threshold"`
	LoadFactorEpsilon     float64 `json:"load_factor_epsilon"`
	Speculation           string  `json:"speculation"` // speculate, approximate or off
	SpeculativeTTLSeconds float64 `json:"speculative_ttl_seconds"`
	Scorer                string  `json:"scorer"` // kvroute.Stats.Scorer
	AttentionCost         float64 `json:"attention_cost"`
	MaxEntries            int     `json:"max_entries"`
	EntryTTLSeconds       int     `json:"entry_ttl_seconds"`
	EventSourcesCount     int     `json:"event_sources_count"`
	Tokenizer             string  `json:"tokenizer"`
	Scoring               Scoring `json:"scoring"`
}

// Scoring is the "scoring" section of KVIndexConfig. The composite scorer's weights
// (OverlapWeight, LoadWeight, HealthWeight) show only while it ranks tier 4's candidates:
// NewKVIndexStats drops them under any other scorer, whose decisions they take no part in.
type Scoring struct {
	OverlapWeight       *float64 `json:"overlap_weight,omitempty"`
	LoadWeight          *float64 `json:"load_weight,omitempty"`
	HealthWeight        *float64 `json:"health_weight,omitempty"`
	MinOverlapThreshold float64  `json:"min_overlap_threshold"`
	LoadFactorEpsilon   float64  `json:"load_factor_epsilon"`
	GPUTierWeight       float64  `json:"gpu_tier_weight"`
	CPUTierWeight       float64  `json:"cpu_tier_weight"`
	StorageTierWeight   float64  `json:"storage_tier_weight"`
}

// EventSource is one entry of KVIndexStats.EventSources: an event source's status
// (events.SourceStatus) in a flat form.
type EventSource struct {
	BackendName    string    `json:"backend_name"`
	Transport      string    `json:"transport"`
	Endpoint       string    `json:"endpoint"`
	Status         string    `json:"status"`
	Connected      bool      `json:"connected"`
	EventsReceived uint64    `json:"events_received"`
	EventsDropped  uint64    `json:"events_dropped"`
	LastEventAt    time.Time `json:"last_event_at,omitzero"`
	ReconnectCount uint64    `json:"reconnect_count"`
	SequenceGaps   uint64    `json:"sequence_gaps"`
	// ResetsLimited counts the resets of the backend the source asked for beyond the backend's
	// reset budget, not made (events.SequenceStats.ResetsLimited).
	ResetsLimited uint64 `json:"resets_limited"`
	LastError     string `json:"last_error,omitempty"`
}

// KVRoutingDecisions counts the requests tier 4 looked at by outcome: kv_aware, load_bound,
// imbalance and least_work when it chose, fallback when it left the request to tier 1
// (kvroute.DecisionCounts.HandedOff). Total is their sum.
type KVRoutingDecisions struct {
	KVAware   uint64 `json:"kv_aware"`
	LoadBound uint64 `json:"load_bound"`
	Imbalance uint64 `json:"imbalance"`
	LeastWork uint64 `json:"least_work"`
	Fallback  uint64 `json:"fallback"`
	Total     uint64 `json:"total"`
}

// NewKVIndexStats builds the body of GET /admin/kv-index/stats for a Router with tier 4 on from
// st, indexErr (the error DefaultRouter.Stats returned, nil for none), cfg (the gateway's
// configuration of tier 4; see KVIndexConfig for the fields taken from st instead) and the
// gateway's event sources. It leaves Tokenizer for the gateway to set.
func NewKVIndexStats(st kvroute.Stats, indexErr error, cfg KVIndexConfig, sources []events.SourceStatus) KVIndexStats {
	cfg.Backend, cfg.BlockSize, cfg.Scorer, cfg.AttentionCost = "", st.BlockSize, st.Scorer, st.AttentionCost
	cfg.SpeculativeTTLSeconds = st.SpeculativeTTL.Seconds()
	cfg.LoadFactorEpsilon, cfg.Scoring.LoadFactorEpsilon = st.LoadFactorEpsilon, st.LoadFactorEpsilon
	if st.Scorer != "kv_overlap" {
		cfg.Scoring.OverlapWeight, cfg.Scoring.LoadWeight, cfg.Scoring.HealthWeight = nil, nil, nil
	}
	d := st.Decisions
	s := KVIndexStats{
		Enabled:      true,
		EventSources: make([]EventSource, 0, len(sources)),
		RoutingDecisions: KVRoutingDecisions{KVAware: d.KVAware, LoadBound: d.LoadBound, Imbalance: d.Imbalance,
			LeastWork: d.LeastWork, Fallback: d.HandedOff},
		Lookups:        st.Lookups,
		OverlapScores:  st.Lookups - st.LookupErrors,
		LookupErrors:   st.LookupErrors,
		TokenizeErrors: st.TokenizeErrors,
		NoBlockKeys:    st.NoBlockKeys,
	}
	rd := &s.RoutingDecisions
	rd.Total = rd.KVAware + rd.LoadBound + rd.Imbalance + rd.LeastWork + rd.Fallback
	if st.Index != nil {
		s.Index = *st.Index
		cfg.Backend = st.Index.Backend
	}
	s.Config = cfg
	if indexErr != nil {
		s.IndexError = indexErr.Error()
	}
	for _, ss := range sources {
		s.EventSources = append(s.EventSources, EventSource{
			BackendName: ss.Backend, Transport: ss.Transport, Endpoint: ss.Endpoint, Status: string(ss.Connection.State),
			Connected: ss.Connection.Connected, EventsReceived: ss.Events.Received, EventsDropped: ss.Events.Dropped,
			LastEventAt: ss.Connection.LastEventAt, ReconnectCount: ss.Connection.ReconnectCount,
			SequenceGaps: ss.Sequence.Gaps, ResetsLimited: ss.Sequence.ResetsLimited, LastError: ss.LastError,
		})
	}
	return s
}

// DisaggStats is the body of GET /admin/disaggregation/stats: the configuration (credentials
// redacted), the requests by path and reason, and each prefill and decode backend's phases in
// flight.
type DisaggStats struct {
	Enabled  bool         `json:"enabled"`
	Config   DisaggConfig `json:"config"`
	Requests disagg.Stats `json:"requests"`
	// The number of backends in each pool.
	PrefillBackends int                 `json:"prefill_backends"`
	DecodeBackends  int                 `json:"decode_backends"`
	UnifiedBackends int                 `json:"unified_backends"`
	Backends        []DisaggBackendLoad `json:"backends"`
}

// DisaggConfig is the disaggregation configuration (disagg.Config) in the configuration file's
// names and formats; DefaultStorage's credentials are redacted when encoded.
type DisaggConfig struct {
	PrefillTimeout    string                 `json:"prefill_timeout"`     // time.Duration's String
	KVTransferTimeout string                 `json:"kv_transfer_timeout"` // time.Duration's String
	FallbackToUnified bool                   `json:"fallback_to_unified"`
	Conditional       bool                   `json:"conditional_disaggregation"`
	MaxUncachedTokens int                    `json:"max_uncached_tokens"`
	MaxUncachedRatio  float64                `json:"max_uncached_ratio"`
	LoadFactorEpsilon float64                `json:"load_factor_epsilon"`
	DefaultStorage    disagg.ExternalStorage `json:"default_external_storage"`
}

// DisaggBackendLoad is one prefill or decode backend's line in DisaggStats. Storage is absent
// when the backend uses the default; its credentials are redacted when encoded.
type DisaggBackendLoad struct {
	Backend          string                  `json:"backend"`
	Role             disagg.Role             `json:"role"`
	Healthy          bool                    `json:"healthy"`
	Weight           float64                 `json:"weight"`
	PrefillsInFlight int                     `json:"prefills_in_flight"`
	DecodesInFlight  int                     `json:"decodes_in_flight"`
	Decisions        uint64                  `json:"decisions"`
	SuccessRate      float64                 `json:"success_rate"`
	Refusals         uint64                  `json:"refusals"`
	Storage          *disagg.ExternalStorage `json:"external_storage,omitempty"`
}

// NewDisaggStats builds the body of GET /admin/disaggregation/stats from st, cfg (the
// disaggregation configuration in force: DisaggRouter.Config) and storage, the external storage
// of the backends that have their own (by name; the others use cfg.DefaultStorage). It is the
// zero DisaggStats when st has no disaggregation (st.Disagg nil).
func NewDisaggStats(st kvroute.Stats, cfg disagg.Config, storage map[string]*disagg.ExternalStorage) DisaggStats {
	if st.Disagg == nil {
		return DisaggStats{}
	}
	s := DisaggStats{Enabled: !cfg.Disabled, Requests: *st.Disagg, Config: DisaggConfig{
		PrefillTimeout: cfg.PrefillTimeout.String(), KVTransferTimeout: cfg.KVTransferTimeout.String(),
		FallbackToUnified: !cfg.DisableFallback, Conditional: !cfg.DisableConditional,
		MaxUncachedTokens: cfg.MaxUncachedTokens, MaxUncachedRatio: cfg.MaxUncachedRatio,
		LoadFactorEpsilon: cfg.LoadFactorEpsilon, DefaultStorage: cfg.DefaultStorage,
	}}
	for _, b := range st.Backends {
		bl := DisaggBackendLoad{Backend: b.Name, Role: b.Role, Healthy: b.Healthy, Weight: b.Weight,
			Decisions: b.Decisions, SuccessRate: b.SuccessRate, Refusals: b.Refusals, Storage: storage[b.Name]}
		switch b.Role {
		case disagg.RoleUnified:
			s.UnifiedBackends++
			continue
		case disagg.RolePrefill:
			bl.PrefillsInFlight = b.InFlight
			s.PrefillBackends++
		case disagg.RoleDecode:
			bl.DecodesInFlight = b.InFlight
			s.DecodeBackends++
		}
		s.Backends = append(s.Backends, bl)
	}
	return s
}

// PeerStats is the "peers" section of GET /admin/replicas/stats: what the Router knows of its
// peers and of engine-reported load (kvroute.PeerStats).
type PeerStats struct {
	Peers         int    `json:"peers"`
	InFlight      int    `json:"in_flight"`
	Applied       uint64 `json:"applied"`
	Ignored       uint64 `json:"ignored"`
	Expired       uint64 `json:"expired"`
	Forgot        uint64 `json:"forgot"`
	EngineReports uint64 `json:"engine_reports"`
	EngineStale   uint64 `json:"engine_stale"`
}

// NewPeerStats returns p as the "peers" section of GET /admin/replicas/stats.
func NewPeerStats(p kvroute.PeerStats) PeerStats {
	return PeerStats(p)
}
