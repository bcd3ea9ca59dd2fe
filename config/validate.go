package config

import (
	"errors"
	"fmt"
	"math"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/scorer"
)

// fieldErrors collects validation errors, each prefixed by its field path.
type fieldErrors []error

func (fe *fieldErrors) add(path, format string, args ...any) {
	*fe = append(*fe, fmt.Errorf("%s: %s", path, fmt.Sprintf(format, args...)))
}

// Validate checks ranges and cross-field rules; the error joins one line per problem, each
// starting with the field path (errors.Join: unwrap it into the individual problems with
// interface{ Unwrap() []error }). nil means c is valid. c must have its defaults applied
// (ApplyDefaults). Validate only reads c.
func (c *Config) Validate() error {
	if p := c.undefaulted(); p != "" {
		return fmt.Errorf("%s: unset: call ApplyDefaults before Validate", p)
	}
	var fe fieldErrors
	s := c.Server
	if s.Host != "" && s.BindAddress != s.Host {
		fe.add("server", "set bind_address or host, not both")
	}
	if p := *s.Port; p < 0 || p > 65535 {
		fe.add("server.port", "%d is not in [0, 65535]", p)
	}
	if s.MaxBodyBytes < 1 {
		fe.add("server.max_body_bytes", "%d must be positive", s.MaxBodyBytes)
	}
	if s.MaxInflightBodyBytes < s.MaxBodyBytes {
		fe.add("server.max_inflight_body_bytes", "%d is below server.max_body_bytes (%d)", s.MaxInflightBodyBytes, s.MaxBodyBytes)
	}
	if m := s.MaxClientBodyBytes; m != -1 && m < s.MaxBodyBytes {
		fe.add("server.max_client_body_bytes", "%d is below server.max_body_bytes (%d); -1 lifts the bound", m, s.MaxBodyBytes)
	}
	if _, _, err := ParseMemoryLimit(s.MemoryLimit); err != nil {
		fe.add("server.memory_limit", "%v", err)
	}
	for path, d := range map[string]Duration{"server.shutdown_timeout": s.ShutdownTimeout,
		"server.read_header_timeout": s.ReadHeaderTimeout, "server.read_timeout": s.ReadTimeout, "server.upstream_dial_timeout": s.UpstreamDialTimeout,
		"server.body_idle_timeout": s.BodyIdleTimeout} {
		if d < 0 {
			fe.add(path, "must not be negative")
		}
	}
	if a := time.Duration(*c.MaxDecisionAge); a > 24*time.Hour {
		fe.add("max_decision_age", "%v is above 1d (0 turns the net off)", *c.MaxDecisionAge)
	}
	if msg := adminTokenProblem(string(c.Admin.AuthToken)); msg != "" {
		fe.add("admin.auth_token", "%s", msg)
	}
	if _, ok := parseLevel(c.LogLevel); !ok {
		fe.add("log_level", "%q is not one of debug, info, warn, error", c.LogLevel)
	}
	if s := c.SelectionStrategy; s != "" {
		switch st, ok := ParseStrategy(s); {
		case !ok:
			fe.add("selection_strategy", "%q is not one of round_robin, least_loaded, random, least_latency, prefix_aware_hash", s)
		case st == kvroute.StrategyPrefixAwareHash && c.PrefixRouting.Enabled != nil && !*c.PrefixRouting.Enabled:
			fe.add("selection_strategy", "prefix_aware_hash routes by prefix key: it needs prefix_routing.enabled")
		}
	}

	pr := c.PrefixRouting
	if pr.MaxPrefixLength != 0 && (pr.MaxPrefixLength < 1 || pr.MaxPrefixLength > 1<<20) {
		fe.add("prefix_routing.max_prefix_length", "%d is not in [1, 1048576]", pr.MaxPrefixLength)
	}
	if e := pr.LoadFactorEpsilon; e != 0 && (math.IsNaN(e) || e < 0.01 || e > 10) {
		fe.add("prefix_routing.load_factor_epsilon", "%v is not in [0.01, 10]", e)
	}
	if pr.VirtualNodes < 0 || pr.VirtualNodes > 10000 {
		fe.add("prefix_routing.virtual_nodes", "%d is not in [1, 10000]", pr.VirtualNodes)
	}

	c.validateBackends(&fe)
	if c.ResponseCache.Enabled {
		c.validateResponseCache(&fe)
	}
	if c.KVCacheIndex.Enabled {
		c.validateKV(&fe)
	}

	h := c.HealthChecks
	if h.Interval < Duration(10*time.Millisecond) {
		fe.add("health_checks.interval", "%v is shorter than 10ms", h.Interval)
	}
	if h.Timeout <= 0 {
		fe.add("health_checks.timeout", "must be positive")
	}
	if h.UnhealthyThreshold < 1 {
		fe.add("health_checks.unhealthy_threshold", "%d must be at least 1", h.UnhealthyThreshold)
	}
	if h.HealthyThreshold < 1 {
		fe.add("health_checks.healthy_threshold", "%d must be at least 1", h.HealthyThreshold)
	}
	if !strings.HasPrefix(h.Path, "/") {
		fe.add("health_checks.path", "%q must start with /", h.Path)
	}
	cb := c.CircuitBreaker
	if cb.FailureThreshold < 1 {
		fe.add("circuit_breaker.failure_threshold", "%d must be at least 1", cb.FailureThreshold)
	}
	if cb.RecoveryTimeout <= 0 {
		fe.add("circuit_breaker.recovery_timeout", "must be positive")
	}
	c.validateDisagg(&fe)
	if tr := c.Tracing; tr.Enabled {
		if tr.Exporter != TracingOTLP && tr.Exporter != TracingStdout {
			fe.add("tracing.exporter", "%q is not one of otlp, stdout", tr.Exporter)
		}
		if err := checkHTTPURL(tr.Endpoint); tr.Exporter == TracingOTLP && err != nil {
			fe.add("tracing.endpoint", "%v", err)
		}
		if r := tr.SampleRatio; math.IsNaN(r) || r <= 0 || r > 1 {
			fe.add("tracing.sample_ratio", "%v is not in (0, 1]", r)
		}
	}
	c.validateReplicas(&fe)
	c.validateEndpointPicker(&fe)
	return errors.Join(fe...)
}

// validateReplicas checks engine_metrics and replicas.
func (c *Config) validateReplicas(fe *fieldErrors) {
	if em := c.EngineMetrics; em.Enabled {
		if !strings.HasPrefix(em.Path, "/") {
			fe.add("engine_metrics.path", "%q must start with /", em.Path)
		}
		if time.Duration(em.Interval) < 100*time.Millisecond {
			fe.add("engine_metrics.interval", "%v is below 100ms", time.Duration(em.Interval))
		}
		if em.Timeout <= 0 || em.Timeout >= em.Interval {
			fe.add("engine_metrics.timeout", "%v must be positive and less than interval", time.Duration(em.Timeout))
		}
		if em.MaxAge < em.Interval || time.Duration(em.MaxAge) > time.Hour {
			fe.add("engine_metrics.max_age", "%v must be at least interval and at most 1h", time.Duration(em.MaxAge))
		}
		for i, b := range c.Backends {
			if b.MetricsURL != "" {
				if err := checkHTTPURL(b.MetricsURL); err != nil {
					fe.add(fmt.Sprintf("backends[%d].metrics_url", i), "%v", err)
				}
			}
		}
	}
	rp := c.Replicas
	if !rp.Enabled {
		if rp.EventLog.Enabled {
			fe.add("replicas.event_log.enabled", "needs replicas.enabled")
		}
		return
	}
	for _, u := range strings.Split(string(rp.NATSURL), ",") {
		if pu, err := url.Parse(strings.TrimSpace(u)); err != nil || pu.Host == "" ||
			(pu.Scheme != "nats" && pu.Scheme != "tls" && pu.Scheme != "ws" && pu.Scheme != "wss") {
			fe.add("replicas.nats_url", "%q is not a nats://, tls://, ws:// or wss:// URL", RedactURL(strings.TrimSpace(u)))
		}
	}
	if !natsToken(rp.Group) {
		fe.add("replicas.group", "%q must be letters, digits, - and _ (1 to 64)", rp.Group)
	}
	if rp.ReplicaID != "" && !natsToken(rp.ReplicaID) {
		fe.add("replicas.replica_id", "%q must be letters, digits, - and _ (1 to 64)", rp.ReplicaID)
	}
	if time.Duration(rp.Heartbeat) < 50*time.Millisecond {
		fe.add("replicas.heartbeat", "%v is below 50ms", time.Duration(rp.Heartbeat))
	}
	if rp.PeerTimeout < 2*rp.Heartbeat {
		fe.add("replicas.peer_timeout", "%v must be at least 2 heartbeats", time.Duration(rp.PeerTimeout))
	}
	if rp.PeerMaxAge <= 0 || time.Duration(rp.PeerMaxAge) > 24*time.Hour {
		fe.add("replicas.peer_max_age", "%v is not in (0, 24h]", time.Duration(rp.PeerMaxAge))
	}
	if rp.PeerDelay <= 0 || time.Duration(rp.PeerDelay) > time.Minute {
		fe.add("replicas.peer_delay", "%v is not in (0, 1m]", time.Duration(rp.PeerDelay))
	}
	if el := rp.EventLog; el.Enabled {
		if !c.KVCacheIndex.Enabled {
			fe.add("replicas.event_log.enabled", "needs kv_cache_index.enabled")
		}
		if !natsToken(el.Stream) {
			fe.add("replicas.event_log.stream", "%q must be letters, digits, - and _ (1 to 64)", el.Stream)
		}
		if !natsToken(el.Bucket) {
			fe.add("replicas.event_log.bucket", "%q must be letters, digits, - and _ (1 to 64)", el.Bucket)
		}
		if time.Duration(el.MaxAge) < time.Minute {
			fe.add("replicas.event_log.max_age", "%v is below 1m", time.Duration(el.MaxAge))
		}
		if time.Duration(el.SnapshotInterval) < time.Second {
			fe.add("replicas.event_log.snapshot_interval", "%v is below 1s", time.Duration(el.SnapshotInterval))
		}
	}
}

// natsToken reports whether s is usable as one token of a NATS subject and as a stream or bucket
// name: 1 to 64 letters, digits, - and _.
func natsToken(s string) bool {
	if len(s) == 0 || len(s) > 64 {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_') {
			return false
		}
	}
	return true
}

func (c *Config) validateBackends(fe *fieldErrors) {
	if len(c.Backends) == 0 && !c.EndpointPicker.Discovery.Enabled() {
		fe.add("backends", "at least one backend is required (or endpoint_picker.discovery.dns_name, to find them in DNS)")
	}
	seen := map[string]int{}
	for i, b := range c.Backends {
		p := fmt.Sprintf("backends[%d]", i)
		if b.Name == "" {
			fe.add(p+".name", "is required")
		} else if j, dup := seen[b.Name]; dup {
			fe.add(p+".name", "%q is already the name of backends[%d]", b.Name, j)
		} else {
			seen[b.Name] = i
		}
		if err := checkHTTPURL(b.URL); err != nil {
			fe.add(p+".url", "%v", err)
		}
		if b.Weight < 0 || math.IsNaN(b.Weight) || math.IsInf(b.Weight, 0) {
			fe.add(p+".weight", "%v must be positive", b.Weight)
		}
		if b.Model != "" && len(b.Models) > 0 {
			fe.add(p, "set model or models, not both")
		}
	}
}

// validateDisagg checks disaggregated_serving and the backends' roles and storage.
func (c *Config) validateDisagg(fe *fieldErrors) {
	ds := c.DisaggregatedServing
	if ds.DefaultExternalStorage != nil {
		ds.DefaultExternalStorage.validate(fe, "disaggregated_serving.default_external_storage")
	}
	cd := ds.Conditional
	if n := *cd.MaxUncachedTokens; n < 0 {
		fe.add("disaggregated_serving.conditional.max_uncached_tokens", "%d must not be negative", n)
	}
	if r := *cd.MaxUncachedRatio; math.IsNaN(r) || r < 0 || r > 1 {
		fe.add("disaggregated_serving.conditional.max_uncached_ratio", "%v is not in [0, 1]", r)
	}
	var prefill, decode []int
	for i, b := range c.Backends {
		p := fmt.Sprintf("backends[%d]", i)
		if b.ExternalStorage != nil {
			b.ExternalStorage.validate(fe, p+".external_storage")
		}
		role, err := disagg.ParseRole(b.Role)
		if err != nil {
			fe.add(p+".role", "%q is not one of prefill, decode, unified", b.Role)
			continue
		}
		if role == disagg.RoleUnified {
			continue
		}
		if !ds.Enabled {
			fe.add(p+".role", "%q needs disaggregated_serving.enabled: true", b.Role)
			continue
		}
		if role == disagg.RolePrefill {
			prefill = append(prefill, i)
		} else {
			decode = append(decode, i)
		}
	}
	if len(prefill) > 0 && len(decode) == 0 {
		fe.add("backends", "%d backend(s) with role prefill but none with role decode: a prefill needs a decode backend to hand its KV to", len(prefill))
		return
	}
	// A prefill backend that shares storage with no decode backend could never be chosen.
	for _, i := range prefill {
		ps := c.StorageOf(&c.Backends[i])
		paired := false
		for _, j := range decode {
			if ps.SameLocation(c.StorageOf(&c.Backends[j])) {
				paired = true
				break
			}
		}
		if !paired {
			fe.add(fmt.Sprintf("backends[%d].external_storage", i), "prefill backend %q shares its storage (%s) with no decode backend",
				c.Backends[i].Name, ps)
		}
	}
}

// validate checks one external storage section at path.
func (s *ExternalStorageConfig) validate(fe *fieldErrors, path string) {
	if err := checkHTTPURL(s.Endpoint); err != nil {
		fe.add(path+".endpoint", "%v", err)
	}
	if strings.ContainsAny(s.Bucket, "/?#") {
		fe.add(path+".bucket", "%q must be a bucket name (no /, ? or #)", s.Bucket)
	}
	if (s.AccessKey == "") != (s.SecretKey == "") {
		fe.add(path, "set both access_key and secret_key, or neither")
	}
}

func (c *Config) validateResponseCache(fe *fieldErrors) {
	rc := c.ResponseCache
	switch rc.Backend {
	case "memory", "redis", "tiered":
	default:
		fe.add("response_cache.backend", "%q is not one of memory, redis, tiered", rc.Backend)
	}
	if rc.Capacity < 0 {
		fe.add("response_cache.capacity", "%d must not be negative", rc.Capacity)
	}
	if rc.TTL < 0 {
		fe.add("response_cache.ttl", "must not be negative")
	}
	if rc.MaxResponseSize < 0 {
		fe.add("response_cache.max_response_size", "%d must not be negative", rc.MaxResponseSize)
	}
	if rc.MaxStreamBufferSize < 0 {
		fe.add("response_cache.max_stream_buffer_size", "%d must not be negative", rc.MaxStreamBufferSize)
	}
	if rc.TenantHeader != "" {
		if !isToken(rc.TenantHeader) {
			fe.add("response_cache.tenant_header", "%q is not a valid header name", rc.TenantHeader)
		} else if rc.SharedAcrossTenants {
			fe.add("response_cache.tenant_header", "set it or shared_across_tenants, not both")
		}
	}
	usesRedis := rc.Backend == "redis" || (rc.Backend == "tiered" && rc.L1.Type == "redis")
	if usesRedis {
		r := rc.Redis
		if r.URL != "" {
			if err := checkRedisURL(string(r.URL)); err != nil {
				fe.add("response_cache.redis.url", "%v", err)
			}
		}
		if strings.ContainsAny(r.KeyPrefix, `*?[]\`) {
			fe.add("response_cache.redis.key_prefix", "%q must not contain glob characters", r.KeyPrefix)
		}
		for path, v := range map[string]int{"pool_size": r.PoolSize, "connect_timeout_ms": r.ConnectTimeoutMS,
			"command_timeout_ms": r.CommandTimeoutMS, "fallback_capacity": r.FallbackCapacity,
			"fallback_ttl_seconds": r.FallbackTTLSeconds, "client_cache_ttl_seconds": r.ClientCacheTTLSeconds,
			"client_cache_bytes": r.ClientCacheBytes} {
			if v < 0 {
				fe.add("response_cache.redis."+path, "%d must not be negative", v)
			}
		}
	}
	if rc.Backend == "tiered" {
		switch rc.L1.Type {
		case "memory", "redis":
		default:
			fe.add("response_cache.l1.type", "%q is not one of memory, redis", rc.L1.Type)
		}
		if rc.L1.MaxValueSize < 0 {
			fe.add("response_cache.l1.max_value_size", "%d must not be negative", rc.L1.MaxValueSize)
		}
		l2 := rc.L2
		if l2.Type != "s3" {
			fe.add("response_cache.l2.type", "%q: must be s3", l2.Type)
		}
		if err := checkHTTPURL(l2.Endpoint); err != nil {
			fe.add("response_cache.l2.endpoint", "%v", err)
		}
		if l2.Bucket == "" {
			fe.add("response_cache.l2.bucket", "is required")
		}
		if (l2.AccessKey == "") != (l2.SecretKey == "") {
			fe.add("response_cache.l2", "set both access_key and secret_key, or neither")
		}
		if l2.TTLOverride < 0 {
			fe.add("response_cache.l2.ttl_override", "must not be negative")
		}
		if rc.Tiered.L1PromotionTTL < 0 {
			fe.add("response_cache.tiered.l1_promotion_ttl", "must not be negative")
		}
	}
}

func (c *Config) validateKV(fe *fieldErrors) {
	kv := c.KVCacheIndex
	switch kv.Backend {
	case "memory":
		if len(c.Backends) > kvindex.MaxMemoryBackends {
			fe.add("kv_cache_index.backend", "the memory index tracks at most %d backends (%d configured); use redis",
				kvindex.MaxMemoryBackends, len(c.Backends))
		}
	case "redis":
		u := kv.Redis.URL
		if u == "" {
			u = c.ResponseCache.Redis.URL
		}
		if u == "" {
			fe.add("kv_cache_index.redis.url", "is required with backend redis (or set response_cache.redis.url)")
		} else if err := checkRedisURL(string(u)); err != nil {
			fe.add("kv_cache_index.redis.url", "%v", err)
		}
		if strings.ContainsAny(kv.Redis.KeyPrefix, `*?[]\`) {
			fe.add("kv_cache_index.redis.key_prefix", "%q must not contain glob characters", kv.Redis.KeyPrefix)
		}
	default:
		fe.add("kv_cache_index.backend", "%q is not one of memory, redis", kv.Backend)
	}
	if kv.MaxEntries < 100 || kv.MaxEntries > 10_000_000 {
		fe.add("kv_cache_index.max_entries", "%d is not in [100, 10000000]", kv.MaxEntries)
	}
	if kv.EntryTTLSeconds < 1 || kv.EntryTTLSeconds > 86400 {
		fe.add("kv_cache_index.entry_ttl_seconds", "%d is not in [1, 86400]", kv.EntryTTLSeconds)
	}
	if kv.BlockSize < 1 || kv.BlockSize > 4096 {
		fe.add("kv_cache_index.block_size", "%d is not in [1, 4096]", kv.BlockSize)
	}
	switch kv.Tokenizer {
	case TokenizerEngine, TokenizerEstimate, TokenizerNone:
	default:
		fe.add("kv_cache_index.tokenizer", "%q is not one of auto, engine, estimate, none", kv.Tokenizer)
	}
	if kv.TokenizeCacheBytes < -1 {
		fe.add("kv_cache_index.tokenize_cache_bytes", "%d: want a size in bytes, 0 for the default or -1 for no bound", kv.TokenizeCacheBytes)
	}
	if kv.TokenizeTimeout < 0 {
		fe.add("kv_cache_index.tokenize_timeout", "must not be negative")
	}
	switch kv.Speculation {
	case "speculate", "approximate", "off":
	default:
		fe.add("kv_cache_index.speculation", "%q is not one of speculate, approximate, off", kv.Speculation)
	}
	if kv.ApproximateCapacityBlocks < 0 {
		fe.add("kv_cache_index.approximate_capacity_blocks", "%d must not be negative", kv.ApproximateCapacityBlocks)
	}

	sc := kv.Scoring
	// Each scorer's own settings are errors with the other: they would silently do nothing.
	own := func(k scoringKeys) bool { return sc.defaulted&k == 0 }
	switch sc.Scorer {
	case ScorerExpectedTTFT:
		for i, k := range []scoringKeys{scoringOverlap, scoringLoad, scoringHealth} {
			if own(k) {
				fe.add("kv_cache_index.scoring."+scoringKeyNames[i], "tunes scorer %s only, and scorer is %s: remove it, or set scorer: %s",
					ScorerKVOverlap, ScorerExpectedTTFT, ScorerKVOverlap)
			}
		}
	case ScorerKVOverlap:
		if own(scoringCache) {
			fe.add("kv_cache_index.scoring.cache_weight", "tunes scorer %s only, and scorer is %s (set, or chosen by overlap_weight, "+
				"load_weight or health_weight): remove it, or set scorer: %s and remove the weights", ScorerExpectedTTFT, ScorerKVOverlap,
				ScorerExpectedTTFT)
		}
	default:
		fe.add("kv_cache_index.scoring.scorer", "%q is not one of %s, %s", sc.Scorer, ScorerExpectedTTFT, ScorerKVOverlap)
	}
	if w := *sc.CacheWeight; !(w > 0) || math.IsInf(w, 1) {
		fe.add("kv_cache_index.scoring.cache_weight", "%v must be finite and > 0", w)
	}
	if a := *sc.AttentionCost; math.IsNaN(a) || a < 0 || a > scorer.MaxAttentionCost {
		fe.add("kv_cache_index.scoring.attention_cost", "%v is not in [0, %v]", a, scorer.MaxAttentionCost)
	}
	ws := []float64{*sc.OverlapWeight, *sc.LoadWeight, *sc.HealthWeight}
	sum := 0.0
	for i, w := range ws {
		if w < 0 || math.IsNaN(w) {
			fe.add("kv_cache_index.scoring."+[]string{"overlap_weight", "load_weight", "health_weight"}[i], "%v must not be negative", w)
		}
		sum += w
	}
	if math.Abs(sum-1) > 1e-9 {
		fe.add("kv_cache_index.scoring", "weights sum to %s, must be 1.0", strconv.FormatFloat(math.Round(sum*1e6)/1e6, 'f', -1, 64))
	}
	if t := sc.MinOverlapThreshold; math.IsNaN(t) || t <= 0 || t > 1 {
		fe.add("kv_cache_index.scoring.min_overlap_threshold", "%v is not in (0, 1]", t)
	}
	if e := sc.LoadFactorEpsilon; math.IsNaN(e) || e < 0.01 || e > 10 {
		fe.add("kv_cache_index.scoring.load_factor_epsilon", "%v is not in [0.01, 10]", e)
	}
	for name, w := range map[string]float64{"gpu_tier_weight": *sc.GPUTierWeight, "cpu_tier_weight": *sc.CPUTierWeight,
		"storage_tier_weight": *sc.StorageTierWeight} {
		if math.IsNaN(w) || w < 0 || w > 1 {
			fe.add("kv_cache_index.scoring."+name, "%v is not in [0, 1]", w)
		}
	}

	c.validateEventSources(fe)
}

// eventConsumer names the consumer NewEventConsumers builds for an event source: one for the SSE
// sources, one for the connect-mode ZMQ sources, one for the bound ZMQ endpoints.
type eventConsumer int

const (
	consumerSSE eventConsumer = iota
	consumerZMQ
	consumerBind
)

func (k eventConsumer) String() string {
	return [...]string{"an SSE source", "a connect-mode ZMQ source", "a bound ZMQ endpoint"}[k]
}

func consumerOf(es *EventSourceConfig) eventConsumer {
	switch {
	case es.Bind:
		return consumerBind
	case IsZMQEndpoint(es.Endpoint):
		return consumerZMQ
	}
	return consumerSSE
}

// validateEventSources checks kv_cache_index.event_sources. Beyond each entry's own fields:
//
//   - A backend gets its events through one consumer. Each consumer has one worker per backend
//     that applies the backend's batches in order, clears it when a sequence breaks and repairs
//     its sequences; a second consumer feeding the same backend would clear what the first
//     applied and miss the first's clears (and the sink would see two goroutines for one
//     backend). So a backend may have one SSE source, or any number of connect-mode ZMQ sources
//     (its data-parallel ranks), or any number of bound endpoints naming it (backend_name or
//     topic_backends: one per rank), but not two of these kinds.
//   - Two bound endpoints may not bind overlapping addresses (same port, and the same host or
//     either a wildcard one; the same ipc path).
//   - A bound endpoint without backend_name places a kv@<pod>@<model> topic on <pod> only when
//     no SSE or connect-mode source feeds it (see podBackends); if that leaves no backend, the
//     endpoint could place nothing and is rejected.
func (c *Config) validateEventSources(fe *fieldErrors) {
	type feeder struct {
		kind eventConsumer
		idx  int
	}
	fed := map[string]feeder{} // backend → the first source that feeds it
	claim := func(path, backend string, kind eventConsumer, i int) {
		if c.Backend(backend) == nil {
			fe.add(path, "%q is not a configured backend", backend)
			return
		}
		f, ok := fed[backend]
		switch {
		case !ok:
			fed[backend] = feeder{kind, i}
		case kind == consumerSSE && f.kind == consumerSSE:
			// The SSE consumer keys its streams by backend.
			fe.add(path, "%q already has an SSE event source (event_sources[%d])", backend, f.idx)
		case f.kind != kind:
			fe.add(path, "%q already gets its events from event_sources[%d] (%s), and this is %s: a backend's events must all come "+
				"through one consumer (the SSE sources, the connect-mode ZMQ sources and the bound ZMQ endpoints have one each), "+
				"or each would clear the backend and repair its sequences without the other's knowledge",
				backend, f.idx, f.kind, kind)
		}
	}
	type boundAddr struct {
		idx                 int
		network, host, port string
	}
	var bound []boundAddr
	for i := range c.KVCacheIndex.EventSources {
		es := &c.KVCacheIndex.EventSources[i]
		p := fmt.Sprintf("kv_cache_index.event_sources[%d]", i)
		if es.ReconnectIntervalMS < 0 {
			fe.add(p+".reconnect_interval_ms", "%d must not be negative", es.ReconnectIntervalMS)
		}
		if es.Bind {
			if !IsZMQEndpoint(es.Endpoint) {
				fe.add(p+".endpoint", "%q: a bound endpoint must be tcp://host:port", es.Endpoint)
			} else if network, host, port, ok := splitBindAddr(es.Endpoint); ok {
				for _, b := range bound {
					if b.network == network && b.port == port && (network == "ipc" || b.host == host || isAnyHost(b.host) || isAnyHost(host)) {
						fe.add(p+".endpoint", "%q overlaps the address event_sources[%d] binds (%q): give each bound endpoint "+
							"its own port (one socket per address; several engines may connect to one)",
							es.Endpoint, b.idx, c.KVCacheIndex.EventSources[b.idx].Endpoint)
						break
					}
				}
				bound = append(bound, boundAddr{i, network, host, port})
			}
			if es.ReplayEndpoint != "" {
				fe.add(p+".replay_endpoint", "is not supported with bind (engines' replay endpoints are per engine)")
			}
			if es.BackendName != "" {
				claim(p+".backend_name", es.BackendName, consumerBind, i)
			}
			for topic, b := range es.TopicBackends {
				claim(p+".topic_backends."+topic, b, consumerBind, i)
			}
			continue
		}
		if es.BackendName == "" {
			fe.add(p+".backend_name", "is required")
		} else {
			claim(p+".backend_name", es.BackendName, consumerOf(es), i)
		}
		if len(es.TopicBackends) > 0 {
			fe.add(p+".topic_backends", "applies to a bound endpoint only (bind: true)")
		}
		switch {
		case IsZMQEndpoint(es.Endpoint):
			if es.ReplayEndpoint != "" && !IsZMQEndpoint(es.ReplayEndpoint) {
				fe.add(p+".replay_endpoint", "%q is not tcp://host:port", es.ReplayEndpoint)
			}
		case strings.HasPrefix(es.Endpoint, "ws://") || strings.HasPrefix(es.Endpoint, "wss://"):
			fe.add(p+".endpoint", "%q: WebSocket event streams are not supported; use the http(s) SSE URL or a tcp:// ZMQ endpoint", es.Endpoint)
		default:
			if err := checkHTTPURL(es.Endpoint); err != nil {
				fe.add(p+".endpoint", "%v (want an http(s) SSE URL or a tcp:// ZMQ endpoint)", err)
			}
			if es.ReplayEndpoint != "" {
				fe.add(p+".replay_endpoint", "applies to ZMQ endpoints only")
			}
		}
	}
	if pods := c.podBackends(); len(pods) == 0 {
		for i, es := range c.KVCacheIndex.EventSources {
			if es.Bind && es.BackendName == "" && len(es.TopicBackends) == 0 {
				fe.add(fmt.Sprintf("kv_cache_index.event_sources[%d].backend_name", i), "is required here: every backend gets its "+
					"events from an SSE or connect-mode source, so no kv@<pod>@<model> topic could name a backend of this bound endpoint")
			}
		}
	}
}

// podBackends are the backends the <pod> of a kv@<pod>@<model> topic may name on a bound
// endpoint: the configured backends that no SSE or connect-mode source feeds (their events come
// through another consumer), in configuration order.
func (c *Config) podBackends() []string {
	other := map[string]bool{}
	for i := range c.KVCacheIndex.EventSources {
		if es := &c.KVCacheIndex.EventSources[i]; !es.Bind {
			other[es.BackendName] = true
		}
	}
	var out []string
	for _, b := range c.Backends {
		if !other[b.Name] {
			out = append(out, b.Name)
		}
	}
	return out
}

// splitBindAddr splits a bound endpoint into its network ("tcp" or "ipc"), host and port (ipc:
// the path as port, no host); ok is false when it has no fixed address (port 0 or * picks a
// free one) or cannot be parsed.
func splitBindAddr(ep string) (network, host, port string, ok bool) {
	if path, found := strings.CutPrefix(ep, "ipc://"); found {
		return "ipc", "", path, path != ""
	}
	host, port, err := net.SplitHostPort(strings.TrimPrefix(ep, "tcp://"))
	if err != nil || port == "" || port == "*" {
		return "", "", "", false
	}
	n, err := strconv.ParseUint(port, 10, 16)
	if err != nil || n == 0 {
		return "", "", "", false
	}
	return "tcp", host, strconv.FormatUint(n, 10), true
}

// isAnyHost reports whether a bind host means every interface.
func isAnyHost(h string) bool {
	return h == "" || h == "*" || h == "0.0.0.0" || h == "::"
}

// IsZMQEndpoint reports whether s is a tcp:// or ipc:// endpoint.
func IsZMQEndpoint(s string) bool {
	return strings.HasPrefix(s, "tcp://") || strings.HasPrefix(s, "ipc://")
}

// checkHTTPURL checks that s is an absolute http or https URL with a host.
func checkHTTPURL(s string) error {
	if s == "" {
		return errors.New("is required")
	}
	u, err := url.Parse(s)
	if err != nil {
		return fmt.Errorf("%q is not a URL", s)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return fmt.Errorf("%q: scheme must be http or https", s)
	}
	if u.Host == "" {
		return fmt.Errorf("%q has no host", s)
	}
	return nil
}

// checkRedisURL checks the scheme of a Redis URL (without echoing it: it may hold a password).
func checkRedisURL(s string) error {
	u, err := url.Parse(s)
	if err != nil {
		return errors.New("is not a URL")
	}
	switch u.Scheme {
	case "redis", "rediss", "valkey", "valkeys", "unix":
		return nil
	}
	return fmt.Errorf("scheme %q is not one of redis, rediss, valkey, valkeys, unix", u.Scheme)
}

// RedactURL returns u with any password replaced by "xxxxx"; an unparsable URL is fully
// redacted.
func RedactURL(u string) string {
	p, err := url.Parse(u)
	if err != nil {
		return "[REDACTED]"
	}
	return p.Redacted()
}

// isToken reports whether s is an RFC 9110 token, the syntax of a header field name: one or more
// letters, digits and !#$%&'*+-.^_`|~.
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' ||
			strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}

// adminTokenProblem says what is wrong with an admin.auth_token, "" when nothing is. The admin
// guard compares the token with the Authorization header's credentials, which HTTP trims of
// surrounding whitespace and cannot carry control characters: a token made of spaces, or with
// spaces around it, or with a control character, could never be matched, and would lock every
// operator out of /admin (on a reload as at start).
func adminTokenProblem(tok string) string {
	switch {
	case tok == "":
		return ""
	case strings.TrimSpace(tok) == "":
		return "is only whitespace: no request could send it (leave it empty for loopback-only access)"
	case strings.TrimSpace(tok) != tok:
		return "begins or ends with whitespace, which HTTP strips from the Authorization header: no request could match it"
	case strings.ContainsFunc(tok, func(r rune) bool { return r < 0x20 || r == 0x7f }):
		return "contains a control character, which no Authorization header can carry"
	}
	return ""
}
