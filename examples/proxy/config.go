package main

import (
	"errors"
	"fmt"
	"math"
	"net"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/examples/proxy/internal/yamlconf"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/scorer"
)

// Config is the proxy's YAML configuration, in the seeds' configuration
// schema with a few additions that the seeds leave open: the server's limits,
// admin authentication, ZMQ event sources and the tokenizer. Every section is optional; the zero
// value of a field means its documented default (applied by applyDefaults). Values may reference
// environment variables as ${NAME} or ${NAME:-default}; an unset variable without a default is an
// error naming the field.
type Config struct {
	// Server is where the proxy listens and its request limits.
	Server ServerConfig `yaml:"server"`
	// Admin protects the /admin endpoints.
	Admin AdminConfig `yaml:"admin"`
	// SelectionStrategy chooses a backend for requests without a prefix key: round_robin (default),
	// least_loaded, random or least_latency. The seeds' CamelCase names (RoundRobin, LeastLatency,
	// …) are accepted, and PrefixAwareHash means prefix routing with the default fallback.
	SelectionStrategy string `yaml:"selection_strategy"`
	// PrefixRouting is tier 1: prefix-aware consistent hashing with bounded loads.
	PrefixRouting PrefixRoutingConfig `yaml:"prefix_routing"`
	// ResponseCache is tiers 2 and 3: the response cache and its store.
	ResponseCache ResponseCacheConfig `yaml:"response_cache"`
	// KVCacheIndex is tier 4: KV-cache-aware routing from the engines' KV events.
	KVCacheIndex KVCacheIndexConfig `yaml:"kv_cache_index"`
	// Backends are the model servers. At least one is required.
	Backends []BackendConfig `yaml:"backends"`
	// HealthChecks probe every backend's health endpoint.
	HealthChecks HealthCheckConfig `yaml:"health_checks"`
	// CircuitBreaker takes a backend out of rotation after consecutive upstream failures.
	CircuitBreaker CircuitBreakerConfig `yaml:"circuit_breaker"`
	// DisaggregatedServing runs prefill and decode on separate backends (roles prefill and
	// decode), with unified backends as the fallback.
	DisaggregatedServing DisaggregatedConfig `yaml:"disaggregated_serving"`
}

// ServerConfig is the server section.
type ServerConfig struct {
	// BindAddress is the listening address (default 127.0.0.1). Host is the seeds' name for it;
	// set at most one of them.
	BindAddress string `yaml:"bind_address"`
	Host        string `yaml:"host"`
	// Port is the listening port (default 8080; 0 picks a free port).
	Port *int `yaml:"port"`
	// MaxBodyBytes caps a request body; larger bodies get 413 (default 8 MiB).
	MaxBodyBytes int64 `yaml:"max_body_bytes"`
	// ShutdownTimeout bounds the drain of requests in flight on SIGTERM/SIGINT (default 30s).
	ShutdownTimeout Duration `yaml:"shutdown_timeout"`
	// ReadHeaderTimeout bounds reading a request's headers (default 10s).
	ReadHeaderTimeout Duration `yaml:"read_header_timeout"`
	// ReadTimeout bounds reading a whole request, headers and body (default 60s): a client that
	// trickles its body is cut off.
	ReadTimeout Duration `yaml:"read_timeout"`
	// UpstreamDialTimeout bounds connecting to a backend (default 5s).
	UpstreamDialTimeout Duration `yaml:"upstream_dial_timeout"`
}

// AdminConfig is the admin section.
type AdminConfig struct {
	// AuthToken, when set, is required as "Authorization: Bearer <token>" on every /admin
	// endpoint (401 otherwise). It is never logged.
	AuthToken Secret `yaml:"auth_token"`
}

// PrefixRoutingConfig is the prefix_routing section (tier 1).
type PrefixRoutingConfig struct {
	// Enabled turns prefix routing on (default true).
	Enabled *bool `yaml:"enabled"`
	// MaxPrefixLength is the number of prompt bytes hashed into the prefix key (default 1024).
	MaxPrefixLength int `yaml:"max_prefix_length"`
	// LoadFactorEpsilon is CHWBL's ε: a backend takes at most (1+ε)×average load (default 0.25,
	// range 0.01 to 10).
	LoadFactorEpsilon float64 `yaml:"load_factor_epsilon"`
	// VirtualNodes per backend on the hash ring (default 150).
	VirtualNodes int `yaml:"virtual_nodes"`
	// AnthropicCacheControlInjection adds cache_control markers to Anthropic system prompts.
	AnthropicCacheControlInjection bool `yaml:"anthropic_cache_control_injection"`
}

// ResponseCacheConfig is the response_cache section (tiers 2 and 3).
type ResponseCacheConfig struct {
	// Enabled turns the response cache on (default false).
	Enabled bool `yaml:"enabled"`
	// Backend is memory (default), redis or tiered.
	Backend string `yaml:"backend"`
	// Capacity is the in-memory store's entry capacity (default 1000).
	Capacity int `yaml:"capacity"`
	// TTL of a cached response (default 5m).
	TTL Duration `yaml:"ttl"`
	// MaxResponseSize is the largest cached response body (default 1 MiB).
	MaxResponseSize int `yaml:"max_response_size"`
	// MaxStreamBufferSize is the largest cached streamed response (default 10 MiB).
	MaxStreamBufferSize int `yaml:"max_stream_buffer_size"`
	// CacheStreaming caches streamed responses and replays them as SSE (default true).
	CacheStreaming *bool `yaml:"cache_streaming"`
	// Redis is the Redis/Valkey connection (backend redis, or l1.type redis).
	Redis RedisConfig `yaml:"redis"`
	// L1 and L2 are the tiers of backend tiered; Tiered their promotion settings.
	L1     L1Config     `yaml:"l1"`
	L2     L2Config     `yaml:"l2"`
	Tiered TieredConfig `yaml:"tiered"`
}

// RedisConfig is response_cache.redis.
type RedisConfig struct {
	// URL is redis://[user:password@]host:port[/db] or rediss:// (default redis://127.0.0.1:6379).
	URL Secret `yaml:"url"`
	// TLS forces TLS with a redis:// URL.
	TLS bool `yaml:"tls"`
	// Username and Password override the URL's credentials.
	Username string `yaml:"username"`
	Password Secret `yaml:"password"`
	// PoolSize is the connection pool size (default 8).
	PoolSize int `yaml:"pool_size"`
	// KeyPrefix namespaces the keys (default "kvroute:resp:"); no glob characters.
	KeyPrefix string `yaml:"key_prefix"`
	// ConnectTimeoutMS and CommandTimeoutMS bound a connection attempt (default 3000) and each
	// command (default 1000).
	ConnectTimeoutMS int `yaml:"connect_timeout_ms"`
	CommandTimeoutMS int `yaml:"command_timeout_ms"`
	// FallbackCapacity and FallbackTTLSeconds size the in-memory fallback used while Redis is
	// unreachable (defaults 1000 and 300).
	FallbackCapacity   int `yaml:"fallback_capacity"`
	FallbackTTLSeconds int `yaml:"fallback_ttl_seconds"`
	// FallbackToMemory serves from memory while Redis is unreachable (default true).
	FallbackToMemory *bool `yaml:"fallback_to_memory"`
}

// L1Config is response_cache.l1.
type L1Config struct {
	// Type is memory (default) or redis (response_cache.redis).
	Type string `yaml:"type"`
	// MaxValueSize: larger values go to L2 only (default 1 MiB).
	MaxValueSize int `yaml:"max_value_size"`
}

// L2Config is response_cache.l2: an S3-compatible bucket.
type L2Config struct {
	// Type must be s3.
	Type string `yaml:"type"`
	// Endpoint is the S3 URL (http or https); Bucket a pre-created bucket.
	Endpoint string `yaml:"endpoint"`
	Bucket   string `yaml:"bucket"`
	// KeyPrefix within the bucket (default "response-cache/"); Region (default us-east-1).
	KeyPrefix string `yaml:"key_prefix"`
	Region    string `yaml:"region"`
	// AccessKey and SecretKey are the credentials (use ${ENV}); redacted in logs.
	AccessKey Secret `yaml:"access_key"`
	SecretKey Secret `yaml:"secret_key"`
	// TTLOverride, when set, is the TTL of every L2 entry (e.g. "7d").
	TTLOverride Duration `yaml:"ttl_override"`
}

// TieredConfig is response_cache.tiered.
type TieredConfig struct {
	// PromoteOnHit copies L2 hits into L1 (default true).
	PromoteOnHit *bool `yaml:"promote_on_hit"`
	// L1PromotionTTL is the L1 TTL of a promoted entry (default 5m).
	L1PromotionTTL Duration `yaml:"l1_promotion_ttl"`
}

// KVCacheIndexConfig is the kv_cache_index section (tier 4).
type KVCacheIndexConfig struct {
	// Enabled turns KV-aware routing on (default false).
	Enabled bool `yaml:"enabled"`
	// Backend is memory (default) or redis (shares response_cache.redis.url unless Redis.URL is
	// set).
	Backend string `yaml:"backend"`
	// MaxEntries is the most prefix entries tracked (default 100000, range 100 to 10,000,000).
	MaxEntries int `yaml:"max_entries"`
	// EntryTTLSeconds is how long an entry lives after its last event (default 600, range 1 to
	// 86400).
	EntryTTLSeconds int `yaml:"entry_ttl_seconds"`
	// BlockSize is the engines' KV block size in tokens (default 16).
	BlockSize int `yaml:"block_size"`
	// Tokenizer supplies token IDs for block keys: engine (the backends' /tokenize, precise),
	// estimate (byte-based pseudo tokens, for approximate routing without events) or none. The
	// default is engine when some event source is ZMQ, none when all are SSE (prefix-granular),
	// and estimate when there are no event sources.
	Tokenizer string `yaml:"tokenizer"`
	// TokenizeTimeout bounds one /tokenize call (default 100ms).
	TokenizeTimeout Duration `yaml:"tokenize_timeout"`
	// Speculation records predicted entries after each decision: speculate (default with event
	// sources), approximate (default without: routing decisions are the only source) or off.
	Speculation string `yaml:"speculation"`
	// ApproximateCapacityBlocks caps each backend's predicted blocks in approximate mode (the
	// engines' KV cache size in blocks); 0 means no cap.
	ApproximateCapacityBlocks int `yaml:"approximate_capacity_blocks"`
	// Redis is the index's own Redis settings (backend redis).
	Redis KVRedisConfig `yaml:"redis"`
	// Scoring weighs overlap, load and health; they must sum to 1.0.
	Scoring ScoringConfig `yaml:"scoring"`
	// StorageOffloading tracks the storage tier of prefix entries.
	StorageOffloading StorageOffloadingConfig `yaml:"storage_offloading"`
	// EventSources are the engines' KV-event streams.
	EventSources []EventSourceConfig `yaml:"event_sources"`
}

// KVRedisConfig is kv_cache_index.redis.
type KVRedisConfig struct {
	// URL of the index's Redis (default: response_cache.redis.url).
	URL Secret `yaml:"url"`
	// KeyPrefix of the index's keys (default "kvroute:kvidx:").
	KeyPrefix string `yaml:"key_prefix"`
}

// ScoringConfig is kv_cache_index.scoring.
type ScoringConfig struct {
	// OverlapWeight, LoadWeight and HealthWeight (defaults 0.6, 0.3, 0.1) must sum to 1.0.
	OverlapWeight *float64 `yaml:"overlap_weight"`
	LoadWeight    *float64 `yaml:"load_weight"`
	HealthWeight  *float64 `yaml:"health_weight"`
	// MinOverlapThreshold is the fraction of a request a backend must hold for KV-aware routing
	// to take over (default 0.3, range (0, 1]).
	MinOverlapThreshold float64 `yaml:"min_overlap_threshold"`
	// LoadFactorEpsilon bounds KV-aware choices as prefix_routing.load_factor_epsilon bounds the
	// ring's: a backend tier 4 picks may carry up to (1+ε) times the mean in-flight requests
	// (default 1.0, range [0.01, 10]; kvroute.KVConfig.LoadFactorEpsilon).
	LoadFactorEpsilon float64 `yaml:"load_factor_epsilon"`
	// GPUTierWeight, CPUTierWeight and StorageTierWeight multiply the overlap of blocks held on
	// each tier (defaults 1.0, 0.8, 0.6; range [0, 1]).
	GPUTierWeight     *float64 `yaml:"gpu_tier_weight"`
	CPUTierWeight     *float64 `yaml:"cpu_tier_weight"`
	StorageTierWeight *float64 `yaml:"storage_tier_weight"`
}

// StorageOffloadingConfig is kv_cache_index.storage_offloading.
type StorageOffloadingConfig struct {
	// Enabled tracks the storage tier (default false).
	Enabled bool `yaml:"enabled"`
	// TreatEvictionAsOffload moves evicted prefixes to the storage tier (default true).
	TreatEvictionAsOffload *bool `yaml:"treat_eviction_as_offload"`
}

// EventSourceConfig is one entry of kv_cache_index.event_sources.
type EventSourceConfig struct {
	// BackendName is the backend the events belong to (required, except for a bound ZMQ
	// endpoint, where it is the default for topics that name no known backend).
	BackendName string `yaml:"backend_name"`
	// Endpoint is an SSE URL (http://vllm-1:8000/v1/kv_events) or a ZMQ endpoint
	// (tcp://vllm-1:5557 to connect to an engine's PUB socket; with Bind, the address engines
	// connect to, e.g. tcp://0.0.0.0:5557).
	Endpoint string `yaml:"endpoint"`
	// ReplayEndpoint is the engine's ZMQ replay socket (connect mode), used to fill sequence gaps
	// and, on each new connection, to catch up on the engine's last 10,000 batches, so the index
	// learns what the engine cached before the proxy subscribed.
	ReplayEndpoint string `yaml:"replay_endpoint"`
	// Bind makes the proxy bind Endpoint (centralized mode): engines connect to it and their
	// messages are placed by topic (kv@<pod>@<model>: <pod> is the backend name, or TopicBackends).
	Bind bool `yaml:"bind"`
	// TopicBackends maps exact topics to backend names (bind mode).
	TopicBackends map[string]string `yaml:"topic_backends"`
	// Model roots the events' block keys when they name none (default: the backend's model).
	Model string `yaml:"model"`
	// ReconnectIntervalMS is the first reconnection delay (default 1000 for SSE, 100 for ZMQ).
	ReconnectIntervalMS int `yaml:"reconnect_interval_ms"`
}

// BackendConfig is one entry of backends.
type BackendConfig struct {
	// Name identifies the backend in routing, stats and event sources (required, unique).
	Name string `yaml:"name"`
	// URL is the backend's HTTP root, e.g. http://vllm-1:8000 (required).
	URL string `yaml:"url"`
	// Weight is the backend's relative capacity (default 1).
	Weight float64 `yaml:"weight"`
	// Model (or the seeds' Models list) names the model the backend serves: the default model of
	// its KV events, and the backends the engine tokenizer may ask for a request's model.
	Model  string   `yaml:"model"`
	Models []string `yaml:"models"`
	// Role is prefill, decode or unified (default): what the backend does in disaggregated
	// serving. Prefill and decode need disaggregated_serving.enabled.
	Role string `yaml:"role"`
	// ExternalStorage is where the backend's KV tensors transit (default:
	// disaggregated_serving.default_external_storage). A prefill and a decode backend are paired
	// only when their storage is at the same location (endpoint, bucket and kv_namespace).
	ExternalStorage *ExternalStorageConfig `yaml:"external_storage"`
}

// HealthCheckConfig is the health_checks section.
type HealthCheckConfig struct {
	// Enabled probes the backends (default true).
	Enabled *bool `yaml:"enabled"`
	// Interval between probes (default 10s) and Timeout of one probe (default 5s).
	Interval Duration `yaml:"interval"`
	Timeout  Duration `yaml:"timeout"`
	// UnhealthyThreshold consecutive failed probes mark a backend down (default 3);
	// HealthyThreshold consecutive good ones bring it back (default 2).
	UnhealthyThreshold int `yaml:"unhealthy_threshold"`
	HealthyThreshold   int `yaml:"healthy_threshold"`
	// Path probed with GET (default /health); any 2xx is healthy.
	Path string `yaml:"path"`
}

// CircuitBreakerConfig is the circuit_breaker section.
type CircuitBreakerConfig struct {
	// Enabled turns the breaker on (default true).
	Enabled *bool `yaml:"enabled"`
	// FailureThreshold consecutive upstream failures (connection errors and 5xx) open the
	// circuit (default 5).
	FailureThreshold int `yaml:"failure_threshold"`
	// RecoveryTimeout after which an open circuit lets traffic through again, half-open: the next
	// outcome closes or re-opens it (default 30s).
	RecoveryTimeout Duration `yaml:"recovery_timeout"`
}

// DisaggregatedConfig is the disaggregated_serving section: prefill/decode disaggregation.
type DisaggregatedConfig struct {
	// Enabled turns disaggregation on (default false); backends with role prefill or decode need
	// it.
	Enabled bool `yaml:"enabled"`
	// PrefillTimeout bounds the remote prefill request (default 60s).
	PrefillTimeout Duration `yaml:"prefill_timeout"`
	// KVTransferTimeout bounds the wait for a decode backend's response headers after a remote
	// prefill: the decode engine loads the KV tensors before it answers (default 15s).
	KVTransferTimeout Duration `yaml:"kv_transfer_timeout"`
	// FallbackToUnified sends a request to a unified backend when the prefill or decode pool has
	// no healthy backend or its prefill failed (default true).
	FallbackToUnified *bool `yaml:"fallback_to_unified"`
	// DefaultExternalStorage is the storage of every backend without external_storage.
	DefaultExternalStorage *ExternalStorageConfig `yaml:"default_external_storage"`
	// Conditional skips the remote prefill when the decode backend's uncached part of the prompt
	// is short.
	Conditional ConditionalConfig `yaml:"conditional"`
}

// ExternalStorageConfig is external_storage (per backend) and
// disaggregated_serving.default_external_storage: where KV tensors transit between prefill and
// decode backends. The proxy does not read the storage itself (the engines do); it uses the
// location to pair backends and shows it, credentials redacted, in the stats.
type ExternalStorageConfig struct {
	// Endpoint is the storage's URL, e.g. http://kv-store:8080 (required).
	Endpoint string `yaml:"endpoint"`
	// KVNamespace is the key prefix of the KV tensors, e.g. inference/kv-cache.
	KVNamespace string `yaml:"kv_namespace"`
	// Credentials is an opaque credential (optional with anonymous access); redacted in logs.
	Credentials Secret `yaml:"credentials"`
	// Bucket, for S3-compatible storage, is part of the location: endpoint/bucket.
	Bucket string `yaml:"bucket"`
	// AccessKey and SecretKey are S3-style credentials; redacted in logs.
	AccessKey Secret `yaml:"access_key"`
	SecretKey Secret `yaml:"secret_key"`
}

// ConditionalConfig is disaggregated_serving.conditional: conditional disaggregation. The remote
// prefill is skipped (the decode backend computes the rest itself) when the part of the prompt the
// best decode backend cannot reuse is at most MaxUncachedTokens tokens or at most
// MaxUncachedRatio of the prompt.
type ConditionalConfig struct {
	// Enabled turns conditional disaggregation on (default true). Off, any reusable prefix on a
	// decode backend means fast_decode and none means a remote prefill.
	Enabled *bool `yaml:"enabled"`
	// MaxUncachedTokens (default 512) and MaxUncachedRatio (default 0.1, at most 1) are the
	// thresholds; 0 turns that test off.
	MaxUncachedTokens *int     `yaml:"max_uncached_tokens"`
	MaxUncachedRatio  *float64 `yaml:"max_uncached_ratio"`
}

// Defaults of the proxy's own settings (the library packages' defaults apply to the rest).
const (
	DefaultBindAddress         = "127.0.0.1"
	DefaultPort                = 8080
	DefaultMaxBodyBytes        = 8 << 20
	DefaultShutdownTimeout     = 30 * time.Second
	DefaultReadHeaderTimeout   = 10 * time.Second
	DefaultReadTimeout         = 60 * time.Second
	DefaultUpstreamDialTimeout = 5 * time.Second
	DefaultTokenizeTimeout     = 100 * time.Millisecond
	DefaultHealthInterval      = 10 * time.Second
	DefaultHealthTimeout       = 5 * time.Second
	DefaultUnhealthyThreshold  = 3
	DefaultHealthyThreshold    = 2
	DefaultHealthPath          = "/health"
	DefaultFailureThreshold    = 5
	DefaultRecoveryTimeout     = 30 * time.Second
)

// Tokenizer modes of kv_cache_index.tokenizer.
const (
	tokenizerEngine   = "engine"
	tokenizerEstimate = "estimate"
	tokenizerNone     = "none"
)

// loadConfig reads, expands and validates the YAML file at path.
func loadConfig(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	cfg, err := parseConfig(data, os.LookupEnv)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return cfg, nil
}

// parseConfig decodes data strictly (unknown fields are errors), expanding ${ENV} references
// with lookup, then applies defaults and validates. Every error names the field path.
func parseConfig(data []byte, lookup func(string) (string, bool)) (*Config, error) {
	cfg := &Config{}
	if err := yamlconf.Decode(data, cfg, lookup); err != nil {
		return nil, err
	}
	cfg.applyDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return cfg, nil
}

// ptr returns a pointer to v.
func ptr[T any](v T) *T { return &v }

// applyDefaults fills every unset field with its default. It is idempotent.
func (c *Config) applyDefaults() {
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
	if s.ShutdownTimeout == 0 {
		s.ShutdownTimeout = Duration(DefaultShutdownTimeout)
	}
	if s.ReadHeaderTimeout == 0 {
		s.ReadHeaderTimeout = Duration(DefaultReadHeaderTimeout)
	}
	if s.ReadTimeout == 0 {
		s.ReadTimeout = Duration(DefaultReadTimeout)
	}
	if s.UpstreamDialTimeout == 0 {
		s.UpstreamDialTimeout = Duration(DefaultUpstreamDialTimeout)
	}
	if c.PrefixRouting.Enabled == nil {
		c.PrefixRouting.Enabled = ptr(true)
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
	// Unset weights take their defaults; the sum of the three is then checked by validate.
	for _, w := range []struct {
		p **float64
		v float64
	}{{&sc.OverlapWeight, scorer.DefaultOverlapWeight}, {&sc.LoadWeight, scorer.DefaultLoadWeight},
		{&sc.HealthWeight, scorer.DefaultHealthWeight},
		{&sc.GPUTierWeight, kvindex.DefaultTierWeights[0]}, {&sc.CPUTierWeight, kvindex.DefaultTierWeights[1]},
		{&sc.StorageTierWeight, kvindex.DefaultTierWeights[2]}} {
		if *w.p == nil {
			*w.p = ptr(w.v)
		}
	}
	if sc.MinOverlapThreshold == 0 {
		sc.MinOverlapThreshold = 0.3
	}
	if sc.LoadFactorEpsilon == 0 {
		sc.LoadFactorEpsilon = kvroute.DefaultKVLoadFactorEpsilon
	}
	if kv.StorageOffloading.TreatEvictionAsOffload == nil {
		kv.StorageOffloading.TreatEvictionAsOffload = ptr(true)
	}
	for i := range kv.EventSources {
		es := &kv.EventSources[i]
		if es.Model == "" {
			if b := c.backend(es.BackendName); b != nil {
				es.Model = b.model()
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
}

// defaultTokenizer picks the tokenizer for a set of event sources: block events (ZMQ) need the
// engines' own tokens, prefix events (SSE) need none, and without events the router's own
// decisions feed an approximate index keyed by estimated tokens.
func defaultTokenizer(sources []EventSourceConfig) string {
	if len(sources) == 0 {
		return tokenizerEstimate
	}
	for _, s := range sources {
		if isZMQEndpoint(s.Endpoint) {
			return tokenizerEngine
		}
	}
	return tokenizerNone
}

// model returns the backend's model: Model, else the first of Models, else "".
func (b *BackendConfig) model() string {
	if b.Model != "" {
		return b.Model
	}
	if len(b.Models) > 0 {
		return b.Models[0]
	}
	return ""
}

// serves reports whether the backend serves model; a backend that declares no model serves any.
func (b *BackendConfig) serves(model string) bool {
	if b.Model == "" && len(b.Models) == 0 {
		return true
	}
	return b.Model == model || slices.Contains(b.Models, model)
}

// backend returns the backend named name, or nil.
func (c *Config) backend(name string) *BackendConfig {
	for i := range c.Backends {
		if c.Backends[i].Name == name {
			return &c.Backends[i]
		}
	}
	return nil
}

// addr returns the listening address host:port.
func (c *Config) addr() string {
	return net.JoinHostPort(c.Server.BindAddress, strconv.Itoa(*c.Server.Port))
}

// fieldErrors collects validation errors, each prefixed by its field path.
type fieldErrors []error

func (fe *fieldErrors) add(path, format string, args ...any) {
	*fe = append(*fe, fmt.Errorf("%s: %s", path, fmt.Sprintf(format, args...)))
}

// validate checks ranges and cross-field rules; the error joins one line per problem, each
// starting with the field path.
func (c *Config) validate() error {
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
	for path, d := range map[string]Duration{"server.shutdown_timeout": s.ShutdownTimeout,
		"server.read_header_timeout": s.ReadHeaderTimeout, "server.read_timeout": s.ReadTimeout, "server.upstream_dial_timeout": s.UpstreamDialTimeout} {
		if d < 0 {
			fe.add(path, "must not be negative")
		}
	}
	if s := c.SelectionStrategy; s != "" {
		if _, ok := parseStrategy(s); !ok {
			fe.add("selection_strategy", "%q is not one of round_robin, least_loaded, random, least_latency, prefix_aware_hash", s)
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
	return errors.Join(fe...)
}

func (c *Config) validateBackends(fe *fieldErrors) {
	if len(c.Backends) == 0 {
		fe.add("backends", "at least one backend is required")
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
		ps := c.storageOf(&c.Backends[i])
		paired := false
		for _, j := range decode {
			if ps.SameLocation(c.storageOf(&c.Backends[j])) {
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

// location returns the storage as the Router sees it: the bucket, when set, joins the endpoint
// (path-style, http://host:port/bucket) so that two buckets on one endpoint are two locations.
func (s *ExternalStorageConfig) location() disagg.ExternalStorage {
	if s == nil {
		return disagg.ExternalStorage{}
	}
	ep := s.Endpoint
	if s.Bucket != "" {
		ep = strings.TrimRight(ep, "/") + "/" + s.Bucket
	}
	return disagg.ExternalStorage{Endpoint: ep, Namespace: s.KVNamespace, Credentials: string(s.Credentials),
		AccessKey: string(s.AccessKey), SecretKey: string(s.SecretKey)}
}

// storageOf returns b's storage location: its own, else the default (zero when neither is set).
func (c *Config) storageOf(b *BackendConfig) disagg.ExternalStorage {
	if b.ExternalStorage != nil {
		return b.ExternalStorage.location()
	}
	return c.DisaggregatedServing.DefaultExternalStorage.location()
}

// role returns b's parsed role (unified for an invalid one: validate reports it).
func (b *BackendConfig) role() disagg.Role {
	r, _ := disagg.ParseRole(b.Role)
	return r
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
			"fallback_ttl_seconds": r.FallbackTTLSeconds} {
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
	case tokenizerEngine, tokenizerEstimate, tokenizerNone:
	default:
		fe.add("kv_cache_index.tokenizer", "%q is not one of auto, engine, estimate, none", kv.Tokenizer)
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

	binds := 0
	perBackend := map[string]int{}
	for i, es := range kv.EventSources {
		p := fmt.Sprintf("kv_cache_index.event_sources[%d]", i)
		if es.ReconnectIntervalMS < 0 {
			fe.add(p+".reconnect_interval_ms", "%d must not be negative", es.ReconnectIntervalMS)
		}
		if es.Bind {
			binds++
			if binds > 1 {
				fe.add(p+".bind", "only one bound ZMQ endpoint is supported")
			}
			if !isZMQEndpoint(es.Endpoint) {
				fe.add(p+".endpoint", "%q: a bound endpoint must be tcp://host:port", es.Endpoint)
			}
			if es.ReplayEndpoint != "" {
				fe.add(p+".replay_endpoint", "is not supported with bind (engines' replay endpoints are per engine)")
			}
			if es.BackendName != "" && c.backend(es.BackendName) == nil {
				fe.add(p+".backend_name", "%q is not a configured backend", es.BackendName)
			}
			for topic, b := range es.TopicBackends {
				if c.backend(b) == nil {
					fe.add(p+".topic_backends."+topic, "%q is not a configured backend", b)
				}
			}
			continue
		}
		if es.BackendName == "" {
			fe.add(p+".backend_name", "is required")
		} else if c.backend(es.BackendName) == nil {
			fe.add(p+".backend_name", "%q is not a configured backend", es.BackendName)
		}
		if len(es.TopicBackends) > 0 {
			fe.add(p+".topic_backends", "applies to a bound endpoint only (bind: true)")
		}
		switch {
		case isZMQEndpoint(es.Endpoint):
			if es.ReplayEndpoint != "" && !isZMQEndpoint(es.ReplayEndpoint) {
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
			// One SSE stream per backend: the consumer keys its sources by backend.
			perBackend[es.BackendName]++
			if perBackend[es.BackendName] > 1 {
				fe.add(p+".backend_name", "%q already has an SSE event source", es.BackendName)
			}
		}
	}
}

// isZMQEndpoint reports whether s is a tcp:// or ipc:// endpoint.
func isZMQEndpoint(s string) bool {
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

// redactURL returns u with any password replaced by "xxxxx"; an unparsable URL is fully
// redacted.
func redactURL(u string) string {
	p, err := url.Parse(u)
	if err != nil {
		return "[REDACTED]"
	}
	return p.Redacted()
}

// Secret is a configuration string that is never printed (see yamlconf.Secret).
type Secret = yamlconf.Secret

// Duration is a duration read from YAML, days allowed (see yamlconf.Duration).
type Duration = yamlconf.Duration
