package config

import (
	"log/slog"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/respcache"
)

// LogAttrs summarises the configuration in force for a log line: which tiers are on and their
// main settings, secrets redacted (Secret values print as "xxxxx", URLs through RedactURL). c
// must have its defaults applied. It only reads c.
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
	}
	if rc := c.ResponseCache; rc.Enabled {
		ttl := time.Duration(rc.TTL)
		if ttl <= 0 {
			ttl = respcache.DefaultTTL // what the cache applies
		}
		attrs = append(attrs, slog.String("response_cache.backend", rc.Backend), slog.String("response_cache.ttl", ttl.String()))
		if rc.Backend == "redis" || (rc.Backend == "tiered" && rc.L1.Type == "redis") {
			attrs = append(attrs, slog.String("response_cache.redis.url", RedactURL(string(rc.Redis.URL))),
				slog.Any("response_cache.redis.password", rc.Redis.Password))
		}
		if rc.Backend == "tiered" {
			attrs = append(attrs, slog.String("response_cache.l2.endpoint", rc.L2.Endpoint), slog.String("response_cache.l2.bucket", rc.L2.Bucket),
				slog.Any("response_cache.l2.access_key", rc.L2.AccessKey), slog.Any("response_cache.l2.secret_key", rc.L2.SecretKey))
		}
	}
	if kc := c.KVCacheIndex; kc.Enabled {
		attrs = append(attrs, slog.String("kv_cache_index.backend", kc.Backend), slog.String("kv_cache_index.tokenizer", kc.Tokenizer),
			slog.String("kv_cache_index.speculation", kc.Speculation), slog.Int("kv_cache_index.event_sources", len(kc.EventSources)))
	}
	if ds := c.DisaggregatedServing; ds.Enabled {
		attrs = append(attrs, slog.String("disaggregated_serving.prefill_timeout", ds.PrefillTimeout.String()),
			slog.String("disaggregated_serving.kv_transfer_timeout", ds.KVTransferTimeout.String()),
			slog.Bool("disaggregated_serving.fallback_to_unified", *ds.FallbackToUnified),
			slog.Bool("disaggregated_serving.conditional", *ds.Conditional.Enabled),
			slog.Any("disaggregated_serving.default_external_storage", ds.DefaultExternalStorage.Location()))
	}
	return attrs
}

// BackendLogAttrs describes backend b of c for a log line: name, URL (redacted), weight and
// model, and with disaggregated serving its role and storage location. It only reads c and b.
func (c *Config) BackendLogAttrs(b *BackendConfig) []slog.Attr {
	attrs := []slog.Attr{slog.String("name", b.Name), slog.String("url", RedactURL(b.URL)), slog.Float64("weight", b.Weight),
		slog.String("model", b.ModelName())}
	if c.DisaggregatedServing.Enabled {
		attrs = append(attrs, slog.String("role", b.ParsedRole().String()), slog.Any("external_storage", c.StorageOf(b)))
	}
	return attrs
}
