package config

import (
	"fmt"
	"slices"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/scorer"
)

// ptr returns a pointer to v.
func ptr[T any](v T) *T { return &v }

// ApplyDefaults fills every unset field with its default. It is idempotent. Parse and Load call
// it; call it yourself on a Config built or changed in Go, before Validate and the builders
// (RouterConfig, NewResponseCache, NewKVIndex, KVConfig, NewEventConsumers), which read the
// defaulted pointer fields. It modifies c: not safe for concurrent use with other access to c.
func (c *Config) ApplyDefaults() {
	s := &c.Server
	if s.BindAddress == "" {
		s.BindAddress = s.Host
	}
	if s.BindAddress == "" {
		s.BindAddress = DefaultBindAddress
	}
	if s.Port == nil {
		s.Port = ptr(DefaultPort)
	}
	if s.MaxBodyBytes == 0 {
		s.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if s.MaxInflightBodyBytes == 0 {
		s.MaxInflightBodyBytes = max(DefaultMaxInflightBody, s.MaxBodyBytes)
	}
	if s.ShutdownTimeout == 0 {
		s.ShutdownTimeout = Duration(DefaultShutdownTimeout)
	}
	if s.ReadHeaderTimeout == 0 {
		s.ReadHeaderTimeout = Duration(DefaultReadHeaderTimeout)
	}
	if s.ReadTimeout == 0 {
		s.ReadTimeout = Duration(DefaultReadTimeout)
	}
	if s.BodyIdleTimeout == 0 {
		s.BodyIdleTimeout = Duration(DefaultBodyIdleTimeout)
	}
	if s.MaxClientBodyBytes == 0 {
		s.MaxClientBodyBytes = max(s.MaxInflightBodyBytes/2, s.MaxBodyBytes)
	}
	if s.UpstreamDialTimeout == 0 {
		s.UpstreamDialTimeout = Duration(DefaultUpstreamDialTimeout)
	}
	if s.MemoryLimit == "" {
		s.MemoryLimit = MemoryLimitAuto
	}
	if c.PrefixRouting.Enabled == nil {
		c.PrefixRouting.Enabled = ptr(true)
	}
	if c.MaxDecisionAge == nil {
		c.MaxDecisionAge = ptr(Duration(kvroute.DefaultMaxDecisionAge))
	}

	rc := &c.ResponseCache
	if rc.Backend == "" {
		rc.Backend = "memory"
	}
	if rc.CacheStreaming == nil {
		rc.CacheStreaming = ptr(true)
	}
	if rc.Redis.FallbackToMemory == nil {
		rc.Redis.FallbackToMemory = ptr(true)
	}
	if rc.L1.Type == "" {
		rc.L1.Type = "memory"
	}
	if rc.Tiered.PromoteOnHit == nil {
		rc.Tiered.PromoteOnHit = ptr(true)
	}

	kv := &c.KVCacheIndex
	if kv.Backend == "" {
		kv.Backend = "memory"
	}
	if kv.MaxEntries == 0 {
		kv.MaxEntries = kvindex.DefaultMaxPrefixEntries
	}
	if kv.EntryTTLSeconds == 0 {
		kv.EntryTTLSeconds = int(kvindex.DefaultEntryTTL / time.Second)
	}
	if kv.BlockSize == 0 {
		kv.BlockSize = kvindex.DefaultBlockSize
	}
	if kv.TokenizeTimeout == 0 {
		kv.TokenizeTimeout = Duration(DefaultTokenizeTimeout)
	}
	if kv.Tokenizer == "" || kv.Tokenizer == "auto" {
		kv.Tokenizer = defaultTokenizer(kv.EventSources)
	}
	if kv.Speculation == "" {
		kv.Speculation = "speculate"
		if len(kv.EventSources) == 0 {
			kv.Speculation = "approximate"
		}
	}
	sc := &kv.Scoring
	// The scorer follows the settings the configuration gave: the composite's weights select it,
	// as they did before expected_ttft became the default. Which scorer-specific settings the
	// defaults fill is recorded before they are filled: Validate rejects the configuration's own
	// with the scorer they do not tune.
	scorerOwn := []*float64{sc.OverlapWeight, sc.LoadWeight, sc.HealthWeight, sc.CacheWeight}
	if sc.Scorer == "" {
		sc.Scorer = ScorerExpectedTTFT
		if slices.ContainsFunc(scorerOwn[:3], func(w *float64) bool { return w != nil }) {
			sc.Scorer = ScorerKVOverlap
		}
	}
	for i, p := range scorerOwn {
		if p == nil {
			sc.defaulted |= 1 << i
		}
	}
	// Unset weights take their defaults; the sum of the three is then checked by validate. Each
	// scorer's settings get theirs whatever the scorer: the weights also weigh disaggregated
	// serving's candidates.
	for _, w := range []struct {
		p **float64
		v float64
	}{{&sc.OverlapWeight, scorer.DefaultOverlapWeight}, {&sc.LoadWeight, scorer.DefaultLoadWeight},
		{&sc.HealthWeight, scorer.DefaultHealthWeight}, {&sc.CacheWeight, scorer.DefaultCacheWeight},
		{&sc.AttentionCost, scorer.DefaultAttentionCost},
		{&sc.GPUTierWeight, kvindex.DefaultTierWeights()[0]}, {&sc.CPUTierWeight, kvindex.DefaultTierWeights()[1]},
		{&sc.StorageTierWeight, kvindex.DefaultTierWeights()[2]}} {
		if *w.p == nil {
			*w.p = ptr(w.v)
		}
	}
	if sc.MinOverlapThreshold == 0 {
		sc.MinOverlapThreshold = 0.3
	}
	if sc.LoadFactorEpsilon == 0 {
		sc.LoadFactorEpsilon = kvroute.DefaultKVLoadFactorEpsilonExpectedTTFT
		if sc.Scorer == ScorerKVOverlap {
			sc.LoadFactorEpsilon = kvroute.DefaultKVLoadFactorEpsilon
		}
	}
	if kv.StorageOffloading.TreatEvictionAsOffload == nil {
		kv.StorageOffloading.TreatEvictionAsOffload = ptr(true)
	}
	for i := range kv.EventSources {
		es := &kv.EventSources[i]
		if es.Model == "" {
			if b := c.Backend(es.BackendName); b != nil {
				es.Model = b.ModelName()
			}
		}
	}

	for i := range c.Backends {
		if c.Backends[i].Weight == 0 {
			c.Backends[i].Weight = 1
		}
	}

	ds := &c.DisaggregatedServing
	if ds.PrefillTimeout == 0 {
		ds.PrefillTimeout = Duration(disagg.DefaultPrefillTimeout)
	}
	if ds.KVTransferTimeout == 0 {
		ds.KVTransferTimeout = Duration(disagg.DefaultKVTransferTimeout)
	}
	if ds.FallbackToUnified == nil {
		ds.FallbackToUnified = ptr(true)
	}
	cd := &ds.Conditional
	if cd.Enabled == nil {
		cd.Enabled = ptr(true)
	}
	if cd.MaxUncachedTokens == nil {
		cd.MaxUncachedTokens = ptr(disagg.DefaultMaxUncachedTokens)
	}
	if cd.MaxUncachedRatio == nil {
		cd.MaxUncachedRatio = ptr(disagg.DefaultMaxUncachedRatio)
	}

	h := &c.HealthChecks
	if h.Enabled == nil {
		h.Enabled = ptr(true)
	}
	if h.Interval == 0 {
		h.Interval = Duration(DefaultHealthInterval)
	}
	if h.Timeout == 0 {
		h.Timeout = Duration(DefaultHealthTimeout)
	}
	if h.UnhealthyThreshold == 0 {
		h.UnhealthyThreshold = DefaultUnhealthyThreshold
	}
	if h.HealthyThreshold == 0 {
		h.HealthyThreshold = DefaultHealthyThreshold
	}
	if h.Path == "" {
		h.Path = DefaultHealthPath
	}
	cb := &c.CircuitBreaker
	if cb.Enabled == nil {
		cb.Enabled = ptr(true)
	}
	if cb.FailureThreshold == 0 {
		cb.FailureThreshold = DefaultFailureThreshold
	}
	if cb.RecoveryTimeout == 0 {
		cb.RecoveryTimeout = Duration(DefaultRecoveryTimeout)
	}
	tr := &c.Tracing
	if tr.Exporter == "" {
		tr.Exporter = TracingOTLP
	}
	if tr.Endpoint == "" {
		tr.Endpoint = DefaultTracingEndpoint
	}
	if tr.SampleRatio == 0 {
		tr.SampleRatio = 1
	}
	em := &c.EngineMetrics
	if em.Path == "" {
		em.Path = DefaultEngineMetricsPath
	}
	if em.Interval == 0 {
		em.Interval = Duration(2 * time.Second)
	}
	if em.Timeout == 0 {
		em.Timeout = Duration(min(time.Second, time.Duration(em.Interval)/2))
	}
	if em.MaxAge == 0 {
		em.MaxAge = 5 * em.Interval
	}
	rp := &c.Replicas
	if rp.NATSURL == "" {
		rp.NATSURL = DefaultNATSURL
	}
	if rp.Group == "" {
		rp.Group = DefaultReplicaGroup
	}
	if rp.Heartbeat == 0 {
		rp.Heartbeat = Duration(time.Second)
	}
	if rp.PeerTimeout == 0 {
		rp.PeerTimeout = 3 * rp.Heartbeat
	}
	if rp.PeerMaxAge == 0 {
		rp.PeerMaxAge = Duration(kvroute.DefaultPeerMaxAge)
	}
	if rp.PeerDelay == 0 {
		rp.PeerDelay = Duration(kvroute.DefaultPeerDelay)
	}
	el := &rp.EventLog
	if el.Stream == "" {
		el.Stream = DefaultEventStream
	}
	if el.MaxAge == 0 {
		el.MaxAge = Duration(time.Hour)
	}
	if el.Bucket == "" {
		el.Bucket = DefaultSnapshotBucket
	}
	if el.SnapshotInterval == 0 {
		el.SnapshotInterval = Duration(DefaultSnapshotInterval)
	}
	c.EndpointPicker.applyDefaults()
}

// defaultTokenizer picks the tokenizer for a set of event sources: block events (ZMQ) need the
// engines' own tokens, prefix events (SSE) need none, and without events the router's own
// decisions feed an approximate index keyed by estimated tokens.
func defaultTokenizer(sources []EventSourceConfig) string {
	if len(sources) == 0 {
		return TokenizerEstimate
	}
	for _, s := range sources {
		if IsZMQEndpoint(s.Endpoint) {
			return TokenizerEngine
		}
	}
	return TokenizerNone
}

// undefaulted returns the path of the first field that ApplyDefaults sets and that is still
// nil (or, for kv_cache_index.scoring.scorer, empty), or "" when the defaults have been applied.
func (c *Config) undefaulted() string {
	sc := &c.KVCacheIndex.Scoring
	cd := &c.DisaggregatedServing.Conditional
	for _, f := range []struct {
		path string
		set  bool
	}{
		{"server.port", c.Server.Port != nil},
		{"prefix_routing.enabled", c.PrefixRouting.Enabled != nil},
		{"max_decision_age", c.MaxDecisionAge != nil},
		{"response_cache.cache_streaming", c.ResponseCache.CacheStreaming != nil},
		{"response_cache.redis.fallback_to_memory", c.ResponseCache.Redis.FallbackToMemory != nil},
		{"response_cache.tiered.promote_on_hit", c.ResponseCache.Tiered.PromoteOnHit != nil},
		{"kv_cache_index.scoring.scorer", sc.Scorer != ""},
		{"kv_cache_index.scoring.overlap_weight", sc.OverlapWeight != nil},
		{"kv_cache_index.scoring.load_weight", sc.LoadWeight != nil},
		{"kv_cache_index.scoring.health_weight", sc.HealthWeight != nil},
		{"kv_cache_index.scoring.cache_weight", sc.CacheWeight != nil},
		{"kv_cache_index.scoring.attention_cost", sc.AttentionCost != nil},
		{"kv_cache_index.scoring.gpu_tier_weight", sc.GPUTierWeight != nil},
		{"kv_cache_index.scoring.cpu_tier_weight", sc.CPUTierWeight != nil},
		{"kv_cache_index.scoring.storage_tier_weight", sc.StorageTierWeight != nil},
		{"kv_cache_index.storage_offloading.treat_eviction_as_offload", c.KVCacheIndex.StorageOffloading.TreatEvictionAsOffload != nil},
		{"health_checks.enabled", c.HealthChecks.Enabled != nil},
		{"circuit_breaker.enabled", c.CircuitBreaker.Enabled != nil},
		{"disaggregated_serving.fallback_to_unified", c.DisaggregatedServing.FallbackToUnified != nil},
		{"disaggregated_serving.conditional.enabled", cd.Enabled != nil},
		{"disaggregated_serving.conditional.max_uncached_tokens", cd.MaxUncachedTokens != nil},
		{"disaggregated_serving.conditional.max_uncached_ratio", cd.MaxUncachedRatio != nil},
		{"endpoint_picker.metrics_address", c.EndpointPicker.MetricsAddress != nil},
	} {
		if !f.set {
			return f.path
		}
	}
	return ""
}

// mustHaveDefaults panics, naming the method, when c's defaults were not applied: calling a
// builder on such a Config is a programmer error.
func (c *Config) mustHaveDefaults(method string) {
	if p := c.undefaulted(); p != "" {
		panic(fmt.Sprintf("config: Config.%s called before ApplyDefaults (%s is unset)", method, p))
	}
}
