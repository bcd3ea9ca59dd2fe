package config

import (
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvroute/kvroute/config/internal/yamlconf"
	"github.com/kvroute/kvroute/disagg"
)

// Config is the proxy's YAML configuration (the reference gateway, examples/proxy), in kvroute's
// configuration schema, with the reference gateway's own additions: the server's limits,
// admin authentication, ZMQ event sources and the tokenizer. Every section is optional; the zero
// value of a field means its documented default (applied by ApplyDefaults). Values may reference
// environment variables as ${NAME} or ${NAME:-default}; an unset variable without a default is an
// error naming the field.
//
// A Config is plain data: Parse and Load return one with defaults applied and validated, and its
// methods only read it, so a Config that nobody modifies is safe for concurrent use.
type Config struct {
	// Server is where the proxy listens and its request limits.
	Server ServerConfig `yaml:"server"`
	// Admin protects the /admin endpoints.
	Admin AdminConfig `yaml:"admin"`
	// SelectionStrategy chooses a backend for requests without a prefix key: round_robin (default),
	// least_loaded, random or least_latency; or prefix_aware_hash, which names prefix routing
	// itself (kvroute.StrategyPrefixAwareHash: requests without a prefix key go round robin) and
	// needs prefix_routing.enabled. kvroute's CamelCase names (RoundRobin, LeastLatency,
	// PrefixAwareHash, …) are accepted.
	SelectionStrategy string `yaml:"selection_strategy"`
	// MaxDecisionAge is the Router's safety net for a request whose end it was never told (a
	// gateway bug, a goroutine that died): after this long its in-flight slot is reclaimed,
	// counted in kvroute_decisions_expired_total and logged (default 30m, far above any LLM
	// request; 0 turns the net off; at most 1d). kvroute.Config.MaxDecisionAge.
	MaxDecisionAge *Duration `yaml:"max_decision_age"`
	// PrefixRouting is tier 1: prefix-aware consistent hashing with bounded loads.
	PrefixRouting PrefixRoutingConfig `yaml:"prefix_routing"`
	// ResponseCache is tiers 2 and 3: the response cache and its store.
	ResponseCache ResponseCacheConfig `yaml:"response_cache"`
	// KVCacheIndex is tier 4: KV-cache-aware routing from the engines' KV events.
	KVCacheIndex KVCacheIndexConfig `yaml:"kv_cache_index"`
	// Backends are the model servers. At least one is required, unless
	// endpoint_picker.discovery.dns_name is set: the endpoint picker then finds them in DNS.
	Backends []BackendConfig `yaml:"backends"`
	// HealthChecks probe every backend's health endpoint.
	HealthChecks HealthCheckConfig `yaml:"health_checks"`
	// CircuitBreaker takes a backend out of rotation after consecutive upstream failures.
	CircuitBreaker CircuitBreakerConfig `yaml:"circuit_breaker"`
	// DisaggregatedServing runs prefill and decode on separate backends (roles prefill and
	// decode), with unified backends as the fallback.
	DisaggregatedServing DisaggregatedConfig `yaml:"disaggregated_serving"`
	// Tracing exports OpenTelemetry spans of each request (default off).
	Tracing TracingConfig `yaml:"tracing"`
	// EngineMetrics reads each backend's load from its engine's Prometheus endpoint (default off).
	EngineMetrics EngineMetricsConfig `yaml:"engine_metrics"`
	// Replicas shares load and KV-cache knowledge with the gateway's other replicas over NATS
	// (default off: this gateway routes alone).
	Replicas ReplicasConfig `yaml:"replicas"`
	// EndpointPicker configures kvroute-epp, the endpoint picker for Envoy's external processing
	// (Gateway API Inference Extension): its listeners, failure mode and DNS endpoint discovery.
	// The reference proxy ignores it.
	EndpointPicker EndpointPickerConfig `yaml:"endpoint_picker"`
	// LogLevel is the least level logged: debug, info (default), warn or error. The proxy's -v
	// flag forces debug.
	LogLevel string `yaml:"log_level"`
}

// ServerConfig is the server section.
type ServerConfig struct {
	// BindAddress is the listening address (default 127.0.0.1). Host is kvroute's name for it;
	// set at most one of them.
	BindAddress string `yaml:"bind_address"`
	Host        string `yaml:"host"`
	// Port is the listening port (default 8080; 0 picks a free port).
	Port *int `yaml:"port"`
	// MaxBodyBytes caps a request body; larger bodies get 413 (default 8 MiB).
	MaxBodyBytes int64 `yaml:"max_body_bytes"`
	// MaxInflightBodyBytes caps the request bodies held at once across all requests (default 128
	// MiB, at least max_body_bytes). A request that would go over waits up to a second for room,
	// then gets 503 with Retry-After: a burst of large prompts cannot take the process's memory.
	MaxInflightBodyBytes int64 `yaml:"max_inflight_body_bytes"`
	// ShutdownTimeout bounds the drain of requests in flight on SIGTERM/SIGINT (default 30s).
	ShutdownTimeout Duration `yaml:"shutdown_timeout"`
	// ReadHeaderTimeout bounds reading a request's headers (default 10s).
	ReadHeaderTimeout Duration `yaml:"read_header_timeout"`
	// ReadTimeout bounds reading a whole request, headers and body (default 60s): a client that
	// trickles its body is cut off.
	ReadTimeout Duration `yaml:"read_timeout"`
	// BodyIdleTimeout bounds the time a request body may go without a byte arriving (default
	// 10s), however much of read_timeout is left: a stalled body gets 408 and a closed connection.
	BodyIdleTimeout Duration `yaml:"body_idle_timeout"`
	// MaxClientBodyBytes caps the request bodies one client address holds at once within
	// max_inflight_body_bytes (default half of it; at least max_body_bytes; -1: no bound). Behind
	// a load balancer every client has the balancer's address: set -1 there.
	MaxClientBodyBytes int64 `yaml:"max_client_body_bytes"`
	// UpstreamDialTimeout bounds connecting to a backend (default 5s).
	UpstreamDialTimeout Duration `yaml:"upstream_dial_timeout"`
	// MemoryLimit is the soft memory limit of the gateway's Go runtime (runtime/debug's
	// SetMemoryLimit, what GOMEMLIMIT sets): the garbage collector works harder as the heap nears
	// it, rather than letting it grow to twice what is live. A byte count (536870912) or a size
	// with a binary unit (512MiB, 1.5GiB; B, KiB, MiB, GiB, TiB), "off" or 0 for none, or "auto"
	// (the default): 90 % of the memory limit of the process's cgroup when it has one, else twice
	// max_inflight_body_bytes plus 256 MiB. See ParseMemoryLimit. A GOMEMLIMIT environment
	// variable takes precedence over it.
	MemoryLimit string `yaml:"memory_limit"`
}

// AdminConfig is the admin section.
type AdminConfig struct {
	// AuthToken, when set, is required as "Authorization: Bearer <token>" on every /admin
	// endpoint (401 otherwise). It is never logged. Without it, /admin answers loopback clients
	// only (403 to others). A token of whitespace only, with whitespace around it or with a
	// control character is invalid: no request could send it.
	AuthToken Secret `yaml:"auth_token"`
	// ProtectMetrics puts GET /metrics behind the same check as /admin (default false: any client
	// may scrape it).
	ProtectMetrics bool `yaml:"protect_metrics"`
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
	// AssumeGreedyDefault caches requests without a temperature as if they asked for temperature 0
	// (default false: only an explicit temperature 0 is cached, since OpenAI and Anthropic default
	// an absent temperature to 1). Set it only for a fleet whose engines decode greedily by default.
	AssumeGreedyDefault bool `yaml:"assume_greedy_default"`
	// TenantHeader names the request header that identifies the caller's tenant, typically set by
	// an authenticating gateway in front of the proxy (e.g. X-Tenant-Id); requests carrying the
	// same value share cached responses, requests without it share one anonymous tenant. Default
	// "": the tenant is a SHA-256 digest of the caller's Authorization, x-api-key and api-key
	// (Azure OpenAI's) headers, so that a response is only ever served to the credential that
	// paid for it.
	TenantHeader string `yaml:"tenant_header"`
	// SharedAcrossTenants lets every caller, whatever its credential, share every cached response
	// (default false). Only for a proxy serving a single trusted client; excludes tenant_header.
	SharedAcrossTenants bool `yaml:"shared_across_tenants"`
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
	// ClientCache serves repeated hits from a local copy (server-assisted client-side caching,
	// RESP3 CLIENT TRACKING, Redis 6+; default false): Redis invalidates the copy when the key
	// changes, and the client then uses one connection per server. When the KV index shares this
	// client (kv_cache_index.redis.url unset or equal), the setting applies to the shared client;
	// the index reads with uncached commands, so only response-cache reads are cached.
	ClientCache bool `yaml:"client_cache"`
	// ClientCacheTTLSeconds bounds how long a local copy is served (default 60);
	// ClientCacheBytes is the local cache size per connection (default 32 MiB).
	ClientCacheTTLSeconds int `yaml:"client_cache_ttl_seconds"`
	ClientCacheBytes      int `yaml:"client_cache_bytes"`
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
	// Backend is memory (default) or redis (on response_cache.redis.url unless Redis.URL is set;
	// on the response cache's server, it shares the response cache's Redis client: see
	// Config.NewStores).
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
	// TokenizeCacheBytes bounds the token IDs each backend's tokenizer keeps of recent prompts
	// (4 bytes a token; 0: 64 MiB, prefixkey.DefaultTokenizeCacheBytes; -1: no bound beyond
	// its 4,096 entries).
	TokenizeCacheBytes int64 `yaml:"tokenize_cache_bytes"`
	// Speculation records predicted entries after each decision: speculate (default with event
	// sources), approximate (default without: routing decisions are the only source) or off.
	Speculation string `yaml:"speculation"`
	// ApproximateCapacityBlocks caps each backend's predicted blocks in approximate mode (the
	// engines' KV cache size in blocks); 0 means no cap.
	ApproximateCapacityBlocks int `yaml:"approximate_capacity_blocks"`
	// Redis is the index's own Redis settings (backend redis).
	Redis KVRedisConfig `yaml:"redis"`
	// Scoring chooses and tunes the scorer that ranks the backends holding part of a request.
	Scoring ScoringConfig `yaml:"scoring"`
	// StorageOffloading tracks the storage tier of prefix entries.
	StorageOffloading StorageOffloadingConfig `yaml:"storage_offloading"`
	// EventSources are the engines' KV-event streams.
	EventSources []EventSourceConfig `yaml:"event_sources"`
}

// KVRedisConfig is kv_cache_index.redis.
type KVRedisConfig struct {
	// URL of the index's Redis (default: response_cache.redis.url). Unset or equal to
	// response_cache.redis.url (with a response cache on Redis), the index uses the response
	// cache's client, with its tls, username and password: one client per server.
	URL Secret `yaml:"url"`
	// KeyPrefix of the index's keys (default "kvroute:kvidx:").
	KeyPrefix string `yaml:"key_prefix"`
}

// ScoringConfig is kv_cache_index.scoring.
type ScoringConfig struct {
	// Scorer ranks the backends once one holds min_overlap_threshold of a request:
	// expected_ttft (scorer.ExpectedTTFT: the backend with the earliest expected first token,
	// counting the compute a cache miss costs the fleet; tuned by cache_weight) or kv_overlap
	// (scorer.Composite: overlap, load and health weighed by overlap_weight, load_weight and
	// health_weight). Default: kv_overlap when any of those three weights is set, so that a
	// configuration that tuned them keeps the scorer they tune; otherwise expected_ttft. Each
	// scorer's own settings are errors with the other one.
	Scorer string `yaml:"scorer"`
	// OverlapWeight, LoadWeight and HealthWeight (defaults 0.6, 0.3, 0.1) must sum to 1.0. They
	// tune kv_overlap only: setting one selects it when scorer is unset, and is an error with
	// scorer expected_ttft. The defaults also weigh disaggregated serving's prefill and unified
	// candidates, whatever the scorer (see Config.DisaggConfig).
	OverlapWeight *float64 `yaml:"overlap_weight"`
	LoadWeight    *float64 `yaml:"load_weight"`
	HealthWeight  *float64 `yaml:"health_weight"`
	// CacheWeight is expected_ttft's weight of the prefill a request adds against its wait
	// (scorer.ExpectedTTFTConfig.CacheWeight): a backend holding the whole prompt keeps it while
	// the work queued on it is under 1 + cache_weight times the prefill it saves (default 6,
	// finite and > 0). Only with scorer expected_ttft.
	CacheWeight *float64 `yaml:"cache_weight"`
	// AttentionCost is the prefill cost model's attention term (kvroute.KVConfig.AttentionCost):
	// the cost a prompt token adds per token of context before it, relative to a token without
	// context. Both scorers use it, since the Router measures the prefill work queued on each
	// backend with it (expected_ttft's queue, and the least_work choice below
	// min_overlap_threshold). Default 2e-5 (scorer.DefaultAttentionCost: a dense 8B-class
	// model), range [0, 0.01]; 0 means no attention term (prefill work counts tokens alone).
	AttentionCost *float64 `yaml:"attention_cost"`
	// MinOverlapThreshold is the fraction of a request a backend must hold for KV-aware routing
	// to take over (default 0.3, range (0, 1]).
	MinOverlapThreshold float64 `yaml:"min_overlap_threshold"`
	// LoadFactorEpsilon bounds KV-aware choices as prefix_routing.load_factor_epsilon bounds the
	// ring's: a backend tier 4 picks may carry up to (1+ε) times the mean in-flight requests
	// (range [0.01, 10]; kvroute.KVConfig.LoadFactorEpsilon). Default 5 under expected_ttft,
	// which weighs the prefill queued on each backend itself (the bound is a safety net), 1.0
	// under kv_overlap.
	LoadFactorEpsilon float64 `yaml:"load_factor_epsilon"`
	// GPUTierWeight, CPUTierWeight and StorageTierWeight multiply the overlap of blocks held on
	// each tier (defaults 1.0, 0.8, 0.6; range [0, 1]).
	GPUTierWeight     *float64 `yaml:"gpu_tier_weight"`
	CPUTierWeight     *float64 `yaml:"cpu_tier_weight"`
	StorageTierWeight *float64 `yaml:"storage_tier_weight"`

	// defaulted records which scorer-specific settings (scoringOverlap…scoringCache) ApplyDefaults
	// filled, the others being the configuration's own: Validate rejects those with the scorer
	// they do not tune. Bits are only ever added, so that ApplyDefaults stays idempotent.
	defaulted scoringKeys
}

// scoringKeys is a set of ScoringConfig's scorer-specific settings.
type scoringKeys uint8

// The scorer-specific settings of ScoringConfig, in the order of scoringKeyNames.
const (
	scoringOverlap scoringKeys = 1 << iota
	scoringLoad
	scoringHealth
	scoringCache
)

// scoringKeyNames are the YAML names of scoringOverlap, scoringLoad, scoringHealth and
// scoringCache.
var scoringKeyNames = [...]string{"overlap_weight", "load_weight", "health_weight", "cache_weight"}

// Scorers of kv_cache_index.scoring.scorer.
const (
	// ScorerExpectedTTFT ranks backends by expected time to first token (scorer.ExpectedTTFT).
	ScorerExpectedTTFT = "expected_ttft"
	// ScorerKVOverlap weighs overlap, load and health (scorer.Composite).
	ScorerKVOverlap = "kv_overlap"
)

// StorageOffloadingConfig is kv_cache_index.storage_offloading.
type StorageOffloadingConfig struct {
	// Enabled tracks the storage tier (default false).
	Enabled bool `yaml:"enabled"`
	// TreatEvictionAsOffload moves evicted prefixes to the storage tier (default true).
	TreatEvictionAsOffload *bool `yaml:"treat_eviction_as_offload"`
}

// EventSourceConfig is one entry of kv_cache_index.event_sources.
//
// A backend gets its events through one consumer (see Config.NewEventConsumers): from one SSE
// source, or from connect-mode ZMQ sources (one per data-parallel rank), or from bound ZMQ
// endpoints, never from two of these kinds, since each consumer clears a backend and repairs
// its sequences on its own. Validate rejects a backend named by sources of two kinds.
type EventSourceConfig struct {
	// BackendName is the backend the events belong to (required, except for a bound ZMQ
	// endpoint, where it takes every topic TopicBackends does not map: the backend of the
	// engine that connects to this endpoint).
	BackendName string `yaml:"backend_name"`
	// Endpoint is an SSE URL (http://vllm-1:8000/v1/kv_events) or a ZMQ endpoint
	// (tcp://vllm-1:5557 to connect to an engine's PUB socket; with Bind, the address engines
	// connect to, e.g. tcp://0.0.0.0:5557). Bound endpoints need addresses that do not overlap:
	// distinct ports (or the same port on distinct hosts, none of them 0.0.0.0 or *).
	Endpoint string `yaml:"endpoint"`
	// ReplayEndpoint is the engine's ZMQ replay socket (connect mode), used to fill sequence gaps
	// and, on each new connection, to catch up on the engine's last 10,000 batches, so the index
	// learns what the engine cached before the proxy subscribed.
	ReplayEndpoint string `yaml:"replay_endpoint"`
	// Bind makes the proxy bind Endpoint (centralized mode): engines connect to it, and their
	// messages are placed by topic: TopicBackends[topic], else BackendName, else the <pod> of a
	// kv@<pod>@<model> topic (llm-d's form; <pod> is often host:port) when <pod> is the name of
	// a configured backend that no SSE or connect-mode source feeds. Any other topic is counted,
	// warned about and dropped, never indexed under an invented name. Several entries may bind:
	// one endpoint per engine (with its BackendName; the way to tell engines apart that keep
	// vLLM's default topic ""), one per data-parallel rank (vLLM adds the rank to the port it
	// connects to), or one per group of engines.
	Bind bool `yaml:"bind"`
	// TopicBackends maps exact topics to backend names (bind mode), e.g. {"": vllm-1} for
	// vLLM's default topic or {"kv@10.0.0.7:8000@llama": vllm-1} for a pod that is no backend
	// name.
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
	// Model (or kvroute's Models list) names the model the backend serves: the default model of
	// its KV events, and the backends the engine tokenizer may ask for a request's model.
	Model  string   `yaml:"model"`
	Models []string `yaml:"models"`
	// Role is prefill, decode or unified (default): what the backend does in disaggregated
	// serving. Prefill and decode need disaggregated_serving.enabled.
	Role string `yaml:"role"`
	// MetricsURL is the engine's Prometheus endpoint for engine_metrics (default: URL +
	// engine_metrics.path).
	MetricsURL string `yaml:"metrics_url"`
	// ExternalStorage is where the backend's KV tensors transit (default:
	// disaggregated_serving.default_external_storage). A prefill and a decode backend are paired
	// only when their storage is at the same location (endpoint, bucket and kv_namespace).
	ExternalStorage *ExternalStorageConfig `yaml:"external_storage"`
}

// TracingConfig is the tracing section: an OpenTelemetry span for each LLM request, with the
// library's (route, tokenize, KV-index lookup, response-cache lookup) and one per upstream attempt
// as children; the W3C trace context (traceparent) continues the client's trace and goes on to the
// backends.
type TracingConfig struct {
	// Enabled turns tracing on (default false).
	Enabled bool `yaml:"enabled"`
	// Exporter is otlp (default: OTLP over HTTP) or stdout (spans as JSON on standard output).
	Exporter string `yaml:"exporter"`
	// Endpoint is the OTLP/HTTP traces URL (default http://localhost:4318/v1/traces).
	Endpoint string `yaml:"endpoint"`
	// SampleRatio is the share of the traces started here that are recorded, in (0, 1] (default
	// 1); a request that arrives with a traceparent follows its caller's sampling decision.
	SampleRatio float64 `yaml:"sample_ratio"`
}

// EngineMetricsConfig is the engine_metrics section: the engines' own load (vLLM's
// num_requests_running and num_requests_waiting, SGLang's num_running_reqs and num_queue_reqs),
// scraped from their Prometheus endpoints, blended with the gateway's own in-flight counts: the
// engines count every replica's requests. A failing or stale scrape falls back to the local
// counts.
type EngineMetricsConfig struct {
	// Enabled scrapes every backend (default false).
	Enabled bool `yaml:"enabled"`
	// Path is the metrics path under each backend's URL (default /metrics); a backend's
	// metrics_url overrides it.
	Path string `yaml:"path"`
	// Interval between two scrapes of one backend (default 2s; at least 100ms).
	Interval Duration `yaml:"interval"`
	// Timeout of one scrape (default 1s; less than interval).
	Timeout Duration `yaml:"timeout"`
	// MaxAge is how long a scraped load counts without a newer one (default 5 intervals).
	MaxAge Duration `yaml:"max_age"`
}

// DefaultEngineMetricsPath is engine_metrics.path's default.
const DefaultEngineMetricsPath = "/metrics"

// ReplicasConfig is the replicas section: several gateways in front of one fleet share what each
// routes (its requests in flight, their prefill and KV blocks) over NATS, and, with event_log, the
// engines' KV events through a JetStream stream with periodic index snapshots, so that a new or
// restarted replica starts with the fleet's index instead of an empty one.
type ReplicasConfig struct {
	// Enabled shares this replica's decisions with the others (default false).
	Enabled bool `yaml:"enabled"`
	// NATSURL is the NATS server (default nats://127.0.0.1:4222); several comma-separated URLs
	// name a cluster. It may carry credentials (a secret: never logged).
	NATSURL Secret `yaml:"nats_url"`
	// Group names the fleet: replicas of one group share with each other only (default
	// "default"; letters, digits, - and _).
	Group string `yaml:"group"`
	// ReplicaID names this replica among the group's (default: host name, process id and a random
	// suffix). It must differ between replicas.
	ReplicaID string `yaml:"replica_id"`
	// Heartbeat is how often a replica says it is alive (default 1s); a replica not heard from
	// for peer_timeout (default 3 heartbeats) is forgotten, with its requests.
	Heartbeat   Duration `yaml:"heartbeat"`
	PeerTimeout Duration `yaml:"peer_timeout"`
	// PeerMaxAge drops a peer's request whose end never arrived after this long (default 5m; set
	// it above your longest request).
	PeerMaxAge Duration `yaml:"peer_max_age"`
	// PeerDelay is how late a peer's decision reaches this replica (default 5ms, natsync's
	// batching; at most 1m): tier 4 counts the work the peers route in twice that time, unseen,
	// on the least-busy backends, and breaks ties apart from the other replicas
	// (kvroute.Config.PeerDelay). Set it to natsync's batching plus the network's one-way delay.
	PeerDelay Duration `yaml:"peer_delay"`
	// EventLog keeps the engines' KV events in a JetStream stream (needs kv_cache_index.enabled).
	EventLog EventLogConfig `yaml:"event_log"`
}

// EventLogConfig is replicas.event_log.
type EventLogConfig struct {
	// Enabled feeds the index from the stream, after restoring the fleet's latest snapshot, and
	// publishes into the stream the KV events of this replica's event_sources, if it has any
	// (default false). One replica with the event sources (or one bridge per group of engines)
	// and the others without is the recommended topology: each engine's events then have one
	// publisher, whose view of its losses is the log's.
	Enabled bool `yaml:"enabled"`
	// Stream is the JetStream stream (default KVROUTE_KV_EVENTS); MaxAge how long it keeps events
	// (default 1h).
	Stream string   `yaml:"stream"`
	MaxAge Duration `yaml:"max_age"`
	// Bucket is the JetStream object store of the index snapshots (default KVROUTE_KV_SNAPSHOTS);
	// SnapshotInterval how often this replica writes one (default 1m).
	Bucket           string   `yaml:"bucket"`
	SnapshotInterval Duration `yaml:"snapshot_interval"`
	// ResetOnStart purges the stream and deletes the snapshots when the gateway starts, for an
	// operator starting over (default false).
	ResetOnStart bool `yaml:"reset_on_start"`
}

// Defaults of the replicas section.
const (
	DefaultNATSURL          = "nats://127.0.0.1:4222"
	DefaultReplicaGroup     = "default"
	DefaultEventStream      = "KVROUTE_KV_EVENTS"
	DefaultSnapshotBucket   = "KVROUTE_KV_SNAPSHOTS"
	DefaultSnapshotInterval = time.Minute
)

// Exporters of tracing.exporter.
const (
	TracingOTLP   = "otlp"
	TracingStdout = "stdout"
)

// DefaultTracingEndpoint is tracing.endpoint's default: an OpenTelemetry Collector on this host.
const DefaultTracingEndpoint = "http://localhost:4318/v1/traces"

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

// Defaults of the gateway's own settings (the library packages' defaults apply to the rest).
const (
	DefaultBindAddress         = "127.0.0.1"
	DefaultPort                = 8080
	DefaultMaxBodyBytes        = 8 << 20
	DefaultMaxInflightBody     = 128 << 20
	DefaultShutdownTimeout     = 30 * time.Second
	DefaultReadHeaderTimeout   = 10 * time.Second
	DefaultReadTimeout         = 60 * time.Second
	DefaultBodyIdleTimeout     = 10 * time.Second
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

// Tokenizer modes of kv_cache_index.tokenizer. The YAML also accepts "auto" (and ""), which
// ApplyDefaults replaces with the mode the event sources call for (see
// KVCacheIndexConfig.Tokenizer).
const (
	// TokenizerEngine asks the backends' /tokenize for a request's token IDs (precise block keys).
	TokenizerEngine = "engine"
	// TokenizerEstimate derives pseudo tokens from the prompt bytes (prefixkey.EstimateTokenizer).
	TokenizerEstimate = "estimate"
	// TokenizerNone gives requests no block keys (prefix-granular SSE events need none).
	TokenizerNone = "none"
)

// Load reads the YAML file at path, expands its ${NAME} references from the process environment
// (os.LookupEnv), applies the defaults and validates it. Errors reading the file are returned as
// is; the others are prefixed by path and name the field. Load is safe for concurrent use.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	cfg, err := Parse(data, os.LookupEnv)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return cfg, nil
}

// Parse decodes data strictly (unknown fields are errors), expanding ${ENV} references
// with lookup, then applies defaults and validates. Every error names the field path.
// A nil lookup expands nothing: every reference is then unset, and one without a default is an
// error. The result is a fresh Config the caller owns. Parse never reads the environment itself
// and is safe for concurrent use (provided lookup is).
func Parse(data []byte, lookup func(string) (string, bool)) (*Config, error) {
	if lookup == nil {
		lookup = func(string) (string, bool) { return "", false }
	}
	cfg := &Config{}
	if err := yamlconf.Decode(data, cfg, lookup); err != nil {
		return nil, err
	}
	cfg.ApplyDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return cfg, nil
}

// ModelName returns the backend's model: Model, else the first of Models, else "".
func (b *BackendConfig) ModelName() string {
	if b.Model != "" {
		return b.Model
	}
	if len(b.Models) > 0 {
		return b.Models[0]
	}
	return ""
}

// Serves reports whether the backend serves model; a backend that declares no model serves any.
func (b *BackendConfig) Serves(model string) bool {
	if b.Model == "" && len(b.Models) == 0 {
		return true
	}
	return b.Model == model || slices.Contains(b.Models, model)
}

// Backend returns the backend named name (a pointer into c.Backends), or nil.
func (c *Config) Backend(name string) *BackendConfig {
	for i := range c.Backends {
		if c.Backends[i].Name == name {
			return &c.Backends[i]
		}
	}
	return nil
}

// Addr returns the listening address host:port (server.bind_address and server.port). It needs
// the defaults applied (ApplyDefaults; Parse and Load do it).
func (c *Config) Addr() string {
	return net.JoinHostPort(c.Server.BindAddress, strconv.Itoa(*c.Server.Port))
}

// Location returns the storage as the Router sees it: the bucket, when set, joins the endpoint
// (path-style, http://host:port/bucket) so that two buckets on one endpoint are two locations.
// A nil s is the zero location (no storage).
func (s *ExternalStorageConfig) Location() disagg.ExternalStorage {
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

// StorageOf returns b's storage location: its own, else the default (zero when neither is set).
func (c *Config) StorageOf(b *BackendConfig) disagg.ExternalStorage {
	if b.ExternalStorage != nil {
		return b.ExternalStorage.Location()
	}
	return c.DisaggregatedServing.DefaultExternalStorage.Location()
}

// ParsedRole returns b's parsed role (unified for an invalid one: Validate reports it).
func (b *BackendConfig) ParsedRole() disagg.Role {
	r, _ := disagg.ParseRole(b.Role)
	return r
}

// Secret is a configuration string that is never printed: String, GoString, LogValue and
// MarshalText (hence fmt, slog and JSON) show "[REDACTED]" (or "" when empty). Use string(s) for
// the value.
type Secret = yamlconf.Secret

// Duration is a time.Duration read from YAML as Go duration text ("90s", "5m", "1h30m") with a
// days unit added ("7d", "1d12h"), or as a bare integer number of seconds. Its String is compact
// ("5m", "24h", "7d").
type Duration = yamlconf.Duration

// ParseDuration parses the Duration text forms: Go duration text ("90s", "5m", "1h30m") with a
// leading days unit ("7d", "1d12h", "0.5d"), or a bare number of seconds ("300"). Negative
// durations are errors.
func ParseDuration(s string) (Duration, error) { return yamlconf.ParseDuration(s) }
