package config

import (
	"log/slog"
	"strings"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/kvindex/redisindex"
	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/redisstore"
)

// LogAttrs summarises the configuration in force for a log line: which tiers are on and their
// main settings, each with the value the builders apply (a setting left unset prints its
// default: response_cache.ttl=5m, response_cache.redis.url=redis://127.0.0.1:6379), secrets
// redacted (Secret values print as "xxxxx", URLs through RedactURL). c must have its defaults
// applied. It only reads c.
func (c *Config) LogAttrs() []slog.Attr {
	c.mustHaveDefaults("LogAttrs")
	strategy, _ := ParseStrategy(c.SelectionStrategy)
	if strategy == "" {
		strategy = kvroute.DefaultStrategy
	}
	attrs := []slog.Attr{
		slog.Int("backends", len(c.Backends)),
		slog.Bool("prefix_routing", *c.PrefixRouting.Enabled),
		slog.String("selection_strategy", string(strategy)),
		slog.Bool("response_cache", c.ResponseCache.Enabled),
		slog.Bool("kv_cache_index", c.KVCacheIndex.Enabled),
		slog.Bool("health_checks", *c.HealthChecks.Enabled),
		slog.Bool("circuit_breaker", *c.CircuitBreaker.Enabled),
		slog.Bool("admin_auth", c.Admin.AuthToken != ""),
		slog.String("log_level", c.Level().String()),
	}
	if rc := &c.ResponseCache; rc.Enabled {
		attrs = append(attrs, slog.String("response_cache.backend", rc.Backend),
			slog.String("response_cache.ttl", Duration(orDefault(time.Duration(rc.TTL), respcache.DefaultTTL)).String()))
		if rc.Backend == "memory" || (rc.Backend == "tiered" && rc.L1.Type == "memory") {
			attrs = append(attrs, slog.Int("response_cache.capacity", orDefault(rc.Capacity, respcache.DefaultCapacity)))
		}
		if r := rc.Redis; rc.onRedis() {
			attrs = append(attrs, slog.String("response_cache.redis.url", RedactURL(c.redisURL())),
				slog.Any("response_cache.redis.password", r.Password),
				slog.String("response_cache.redis.key_prefix", orDefault(r.KeyPrefix, redisstore.DefaultKeyPrefix)),
				slog.Bool("response_cache.redis.client_cache", r.ClientCache))
			if r.ClientCache {
				attrs = append(attrs, slog.String("response_cache.redis.client_cache_ttl",
					Duration(orDefault(time.Duration(r.ClientCacheTTLSeconds)*time.Second, redisstore.DefaultClientCacheTTL)).String()),
					slog.Int("response_cache.redis.client_cache_bytes", orDefault(r.ClientCacheBytes, redisstore.DefaultClientCacheBytes)))
			}
		}
		if rc.Backend == "tiered" {
			attrs = append(attrs, slog.String("response_cache.l2.endpoint", rc.L2.Endpoint), slog.String("response_cache.l2.bucket", rc.L2.Bucket),
				slog.Any("response_cache.l2.access_key", rc.L2.AccessKey), slog.Any("response_cache.l2.secret_key", rc.L2.SecretKey))
		}
	}
	if kc := &c.KVCacheIndex; kc.Enabled {
		attrs = append(attrs, slog.String("kv_cache_index.backend", kc.Backend), slog.String("kv_cache_index.tokenizer", kc.Tokenizer),
			slog.String("kv_cache_index.speculation", kc.Speculation), slog.Int("kv_cache_index.event_sources", len(kc.EventSources)),
			slog.String("kv_cache_index.scoring.scorer", kc.Scoring.Scorer))
		if kc.Scoring.Scorer == ScorerExpectedTTFT {
			attrs = append(attrs, slog.Float64("kv_cache_index.scoring.cache_weight", *kc.Scoring.CacheWeight))
		}
		attrs = append(attrs, slog.Float64("kv_cache_index.scoring.attention_cost", *kc.Scoring.AttentionCost),
			slog.Float64("kv_cache_index.scoring.load_factor_epsilon", kc.Scoring.LoadFactorEpsilon))
		if kc.Backend == "redis" {
			attrs = append(attrs, slog.String("kv_cache_index.redis.url", RedactURL(c.kvRedisURL())),
				slog.String("kv_cache_index.redis.key_prefix", orDefault(kc.Redis.KeyPrefix, redisindex.DefaultKeyPrefix)),
				slog.Bool("kv_cache_index.redis.shares_response_cache_client", c.SharesRedis()))
		}
	}
	if ds := c.DisaggregatedServing; ds.Enabled {
		attrs = append(attrs, slog.String("disaggregated_serving.prefill_timeout", ds.PrefillTimeout.String()),
			slog.String("disaggregated_serving.kv_transfer_timeout", ds.KVTransferTimeout.String()),
			slog.Bool("disaggregated_serving.fallback_to_unified", *ds.FallbackToUnified),
			slog.Bool("disaggregated_serving.conditional", *ds.Conditional.Enabled),
			slog.Any("disaggregated_serving.default_external_storage", ds.DefaultExternalStorage.Location()))
	}
	if em := c.EngineMetrics; em.Enabled {
		attrs = append(attrs, slog.Bool("engine_metrics", true), slog.String("engine_metrics.interval", em.Interval.String()),
			slog.String("engine_metrics.max_age", em.MaxAge.String()))
	}
	if rp := c.Replicas; rp.Enabled {
		attrs = append(attrs, slog.Bool("replicas", true), slog.String("replicas.nats_url", redactURLs(string(rp.NATSURL))),
			slog.String("replicas.group", rp.Group), slog.Bool("replicas.event_log", rp.EventLog.Enabled))
	}
	if d := c.EndpointPicker.Discovery; d.Enabled() {
		attrs = append(attrs, slog.String("endpoint_picker.discovery.dns_name", d.DNSName),
			slog.Int("endpoint_picker.discovery.port", d.Port), slog.String("endpoint_picker.discovery.interval", d.Interval.String()))
	}
	return attrs
}

// redactURLs redacts each URL of a comma-separated list.
func redactURLs(list string) string {
	parts := strings.Split(list, ",")
	for i, u := range parts {
		parts[i] = RedactURL(strings.TrimSpace(u))
	}
	return strings.Join(parts, ",")
}

// orDefault returns v, or def when v is the zero value (or negative: Validate reports that).
func orDefault[T int | float64 | time.Duration | string](v, def T) T {
	var zero T
	if v == zero || v < zero {
		return def
	}
	return v
}

// Level returns log_level as a slog.Level: info when unset (or invalid: Validate reports it).
// It only reads c.
func (c *Config) Level() slog.Level {
	l, _ := parseLevel(c.LogLevel)
	return l
}

// parseLevel parses a log_level: "" (info) or a slog level name (debug, info, warn, error,
// case-insensitively).
func parseLevel(s string) (slog.Level, bool) {
	var l slog.Level
	if s == "" {
		return slog.LevelInfo, true
	}
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return slog.LevelInfo, false
	}
	return l, true
}

// BackendLogAttrs describes backend b of c for a log line: name, URL (redacted), weight and
// model, and with disaggregated serving its role and storage location. It only reads c and b.
func (c *Config) BackendLogAttrs(b *BackendConfig) []slog.Attr {
	attrs := []slog.Attr{slog.String("name", b.Name), slog.String("url", RedactURL(b.URL)), slog.Float64("weight", orDefault(b.Weight, 1)),
		slog.String("model", b.ModelName())}
	if c.DisaggregatedServing.Enabled {
		attrs = append(attrs, slog.String("role", b.ParsedRole().String()), slog.Any("external_storage", c.StorageOf(b)))
	}
	return attrs
}
