package config

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/rueidis"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/events/zmqevents"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/kvindex/redisindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/redisstore"
	"github.com/kvroute/kvroute/respcache/s3store"
	"github.com/kvroute/kvroute/scorer"
)

// Options carries what the builders pass to the library values they build besides the
// configuration itself. The zero value is valid.
type Options struct {
	// MeterProvider receives the metrics of the values built; nil means no metrics.
	MeterProvider metric.MeterProvider
	// TracerProvider receives the spans of the Router and the response cache; nil means none.
	TracerProvider trace.TracerProvider
	// Logger receives their logs, each value's with a "component" attribute (redis, s3,
	// kv-events); nil discards them.
	Logger *slog.Logger
}

func (o Options) logger() *slog.Logger {
	if o.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return o.Logger
}

// ParseStrategy maps a selection_strategy value (snake_case or kvroute's CamelCase) to the
// Router's Strategy; "" gives the default (""). ok is false for any other value. It is a pure
// function, safe for concurrent use.
func ParseStrategy(s string) (strategy kvroute.Strategy, ok bool) {
	norm := strings.ToLower(strings.NewReplacer("_", "", "-", "", " ", "").Replace(s))
	switch norm {
	case "":
		return "", true
	case "prefixawarehash", "prefixaware":
		return kvroute.StrategyPrefixAwareHash, true
	case "roundrobin":
		return kvroute.StrategyRoundRobin, true
	case "leastloaded", "leastconnections":
		return kvroute.StrategyLeastLoaded, true
	case "random":
		return kvroute.StrategyRandom, true
	case "leastlatency":
		return kvroute.StrategyLeastLatency, true
	}
	return "", false
}

// RouterConfig maps the configuration onto the Router's: the backends (name, weight, role and
// external storage), prefix_routing, selection_strategy, max_decision_age (0 becomes the library's
// negative "off"), o.MeterProvider, o.TracerProvider and o.Logger (component "router"), and, when
// disaggregated_serving is enabled, Disagg (see DisaggConfig). KV is left nil: tier 4 needs an
// index and a tokenizer the caller builds and closes, so set it with KVConfig
// (NewKVIndex builds the index). A selection_strategy Validate would reject maps to the default.
//
// The error is DisaggConfig's. c must be valid (Parse, Load, or ApplyDefaults then Validate);
// RouterConfig panics when its defaults were not applied. It only reads c.
func (c *Config) RouterConfig(o Options) (kvroute.Config, error) {
	c.mustHaveDefaults("RouterConfig")
	strategy, _ := ParseStrategy(c.SelectionStrategy)
	rcfg := kvroute.Config{
		DisablePrefixRouting: !*c.PrefixRouting.Enabled,
		MaxPrefixLength:      c.PrefixRouting.MaxPrefixLength,
		LoadFactorEpsilon:    c.PrefixRouting.LoadFactorEpsilon,
		VirtualNodes:         c.PrefixRouting.VirtualNodes,
		Strategy:             strategy,
		MeterProvider:        o.MeterProvider,
		TracerProvider:       o.TracerProvider,
		MaxDecisionAge:       time.Duration(*c.MaxDecisionAge),
		Logger:               o.logger().With("component", "router"),
	}
	if rcfg.MaxDecisionAge == 0 {
		rcfg.MaxDecisionAge = -1 // the YAML's "off"
	}
	if c.Replicas.Enabled {
		rcfg.PeerMaxAge = time.Duration(c.Replicas.PeerMaxAge)
		rcfg.PeerDelay = time.Duration(c.Replicas.PeerDelay)
	}
	if c.EngineMetrics.Enabled {
		rcfg.EngineLoadMaxAge = time.Duration(c.EngineMetrics.MaxAge)
	}
	for _, b := range c.Backends {
		rb := kvroute.Backend{Name: b.Name, Weight: b.Weight, Role: b.ParsedRole()}
		if b.ExternalStorage != nil {
			st := b.ExternalStorage.Location()
			rb.Storage = &st
		}
		rcfg.Backends = append(rcfg.Backends, rb)
	}
	dc, err := c.DisaggConfig()
	if err != nil {
		return kvroute.Config{}, err
	}
	rcfg.Disagg = dc
	return rcfg, nil
}

// DisaggConfig maps disaggregated_serving onto the Router's disaggregation; it returns nil (and
// no error) when disaggregated_serving is not enabled. Prefill and unified backends are scored
// with kv_cache_index.scoring's weights (the composite scorer) when tier 4 is on, whatever
// kv_cache_index.scoring.scorer is: see the comment in the body. A conditional threshold of 0 (the
// YAML's "test off") becomes the library's negative value, since the library's 0 means its
// default.
//
// The error, prefixed "disaggregated_serving: ", is scorer.NewComposite's for weights it
// rejects (Validate rejects them first). DisaggConfig panics when c's defaults were not applied.
// It only reads c.
func (c *Config) DisaggConfig() (*disagg.Config, error) {
	c.mustHaveDefaults("DisaggConfig")
	ds := c.DisaggregatedServing
	if !ds.Enabled {
		return nil, nil
	}
	cd := ds.Conditional
	dc := &disagg.Config{
		PrefillTimeout:     time.Duration(ds.PrefillTimeout),
		KVTransferTimeout:  time.Duration(ds.KVTransferTimeout),
		DisableFallback:    !*ds.FallbackToUnified,
		DefaultStorage:     ds.DefaultExternalStorage.Location(),
		DisableConditional: !*cd.Enabled,
		// 0 turns a test off in the YAML; the library spells that with a negative value (its 0
		// means the default).
		MaxUncachedTokens: *cd.MaxUncachedTokens,
		MaxUncachedRatio:  *cd.MaxUncachedRatio,
	}
	if dc.MaxUncachedTokens == 0 {
		dc.MaxUncachedTokens = -1
	}
	if dc.MaxUncachedRatio == 0 {
		dc.MaxUncachedRatio = -1
	}
	if c.KVCacheIndex.Enabled {
		// The composite, even with scorer expected_ttft: the planner's candidates carry their
		// in-flight counts (prefill load for the prefill pool), not the prefill work queued on
		// them that ExpectedTTFT ranks by, so ExpectedTTFT would see idle backends everywhere and
		// ignore load. The weights are then their defaults (Validate rejects weights of one's own
		// with expected_ttft).
		comp, err := scorer.NewComposite(c.compositeConfig())
		if err != nil {
			return nil, fmt.Errorf("disaggregated_serving: %w", err)
		}
		dc.Scorer = comp
	}
	return dc, nil
}

// compositeConfig is kv_cache_index.scoring as the composite scorer's configuration.
func (c *Config) compositeConfig() scorer.CompositeConfig {
	sc := c.KVCacheIndex.Scoring
	return scorer.CompositeConfig{OverlapWeight: *sc.OverlapWeight, LoadWeight: *sc.LoadWeight,
		HealthWeight: *sc.HealthWeight, MinOverlapThreshold: sc.MinOverlapThreshold}
}

// defaultModel is the model of the first backend: the model of KV events that name none.
func (c *Config) defaultModel() string {
	if len(c.Backends) > 0 {
		return c.Backends[0].ModelName()
	}
	return ""
}

// NewResponseCache builds response_cache (tiers 2 and 3): its store (memory, redis, or tiered:
// an L1 of memory or redis in front of an S3 L2) and the respcache.Cache over it, with
// server.max_body_bytes as the cache's MaxBodyBytes. The cache's tenants are
// respcache.HeaderTenant(tenant_header) when tenant_header is set, none with
// shared_across_tenants, and otherwise the library's default, respcache.CredentialTenant;
// assume_greedy_default maps to respcache.Config.AssumeGreedyDefault.
//
// Return values:
//   - (cache, closeAll, nil): closeAll closes everything built (the cache's metrics, then the S3
//     and Redis stores), in the reverse order of construction, and joins their errors; call it
//     once the cache is no longer used. It may be called more than once.
//   - (nil, closeAll, nil): response_cache is not enabled; closeAll does nothing.
//   - (nil, nil, err): building failed; whatever was built before the failure has been closed.
//     The error names the section (response_cache, response_cache.redis with its URL redacted,
//     response_cache.l1, response_cache.l2, response_cache.tiered) and wraps the library's
//     (respcache.ErrInvalidConfig for values out of range).
//
// Building a Redis store dials it only within redisstore.New's own limits (an unreachable
// Redis starts in fallback unless fallback_to_memory is false); building the S3 L2 checks the
// bucket. NewResponseCache starts no goroutine of its own; the stores' background work is
// theirs and ends with closeAll. c must be valid; NewResponseCache panics when its defaults were
// not applied. It only reads c.
func (c *Config) NewResponseCache(o Options) (cache *respcache.Cache, closeAll func() error, err error) {
	c.mustHaveDefaults("NewResponseCache")
	return c.newResponseCache(o, nil)
}

// newResponseCache is NewResponseCache; a non-nil client is the Redis store's (never closed here).
func (c *Config) newResponseCache(o Options, client rueidis.Client) (cache *respcache.Cache, closeAll func() error, err error) {
	if !c.ResponseCache.Enabled {
		return nil, func() error { return nil }, nil
	}
	var closers []func() error
	closeBuilt := func() error {
		var errs []error
		for i := len(closers) - 1; i >= 0; i-- {
			if err := closers[i](); err != nil {
				errs = append(errs, err)
			}
		}
		return errors.Join(errs...)
	}
	defer func() {
		if err != nil {
			_ = closeBuilt()
		}
	}()

	rc := c.ResponseCache
	ttl := time.Duration(rc.TTL)
	var store respcache.CacheStore
	switch rc.Backend {
	case "memory":
		m, err := respcache.NewMemory(respcache.MemoryConfig{Capacity: rc.Capacity, DefaultTTL: ttl})
		if err != nil {
			return nil, nil, fmt.Errorf("response_cache: %w", err)
		}
		store = m
	case "redis":
		r, err := c.newRedisStore(o, client)
		if err != nil {
			return nil, nil, err
		}
		closers = append(closers, r.Close)
		store = r
	case "tiered":
		var l1 respcache.CacheStore
		if rc.L1.Type == "redis" {
			r, err := c.newRedisStore(o, client)
			if err != nil {
				return nil, nil, err
			}
			closers = append(closers, r.Close)
			l1 = r
		} else {
			m, err := respcache.NewMemory(respcache.MemoryConfig{Capacity: rc.Capacity, DefaultTTL: ttl})
			if err != nil {
				return nil, nil, fmt.Errorf("response_cache.l1: %w", err)
			}
			l1 = m
		}
		l2c := rc.L2
		s3, err := s3store.New(s3store.Config{
			Endpoint: l2c.Endpoint, Bucket: l2c.Bucket, KeyPrefix: l2c.KeyPrefix, Region: l2c.Region,
			AccessKey: string(l2c.AccessKey), SecretKey: string(l2c.SecretKey), DefaultTTL: ttl,
			TTLOverride: time.Duration(l2c.TTLOverride), MeterProvider: o.MeterProvider,
			Logger: o.logger().With("component", "s3"),
		})
		if err != nil {
			return nil, nil, fmt.Errorf("response_cache.l2: %w", err)
		}
		closers = append(closers, s3.Close)
		t, err := respcache.NewTiered(respcache.TieredConfig{L1: l1, L2: s3, L1MaxValueSize: rc.L1.MaxValueSize,
			DisablePromotion: !*rc.Tiered.PromoteOnHit, L1PromotionTTL: time.Duration(rc.Tiered.L1PromotionTTL),
			L2TTL: time.Duration(l2c.TTLOverride)})
		if err != nil {
			return nil, nil, fmt.Errorf("response_cache.tiered: %w", err)
		}
		store = t
	default:
		return nil, nil, fmt.Errorf("response_cache.backend: %q is not one of memory, redis, tiered", rc.Backend)
	}
	var tenant func(*http.Request) string // nil: respcache.CredentialTenant
	if rc.TenantHeader != "" {
		if !isToken(rc.TenantHeader) {
			return nil, nil, fmt.Errorf("response_cache.tenant_header: %q is not a valid header name", rc.TenantHeader)
		}
		tenant = respcache.HeaderTenant(rc.TenantHeader)
	}
	cache, err = respcache.New(respcache.Config{
		Store: store, TTL: ttl, MaxResponseSize: rc.MaxResponseSize, MaxStreamBufferSize: rc.MaxStreamBufferSize,
		DisableStreaming: !*rc.CacheStreaming, AssumeGreedyDefault: rc.AssumeGreedyDefault,
		Tenant: tenant, SharedAcrossTenants: rc.SharedAcrossTenants,
		MaxBodyBytes: c.Server.MaxBodyBytes, MeterProvider: o.MeterProvider, TracerProvider: o.TracerProvider,
	})
	if err != nil {
		return nil, nil, fmt.Errorf("response_cache: %w", err)
	}
	closers = append(closers, cache.Close)
	return cache, closeBuilt, nil
}

// newRedisStore builds the store of response_cache.redis, on client when it is not nil (which the
// store never closes); the caller closes the store.
func (c *Config) newRedisStore(o Options, client rueidis.Client) (*redisstore.Store, error) {
	r := c.ResponseCache.Redis
	sc := redisstore.Config{KeyPrefix: r.KeyPrefix, CommandTimeout: time.Duration(r.CommandTimeoutMS) * time.Millisecond,
		DefaultTTL: time.Duration(c.ResponseCache.TTL), ClientSideCaching: r.ClientCache,
		ClientCacheTTL:  time.Duration(r.ClientCacheTTLSeconds) * time.Second,
		DisableFallback: !*r.FallbackToMemory, FallbackCapacity: r.FallbackCapacity,
		FallbackTTL:   time.Duration(r.FallbackTTLSeconds) * time.Second,
		MeterProvider: o.MeterProvider, Logger: o.logger().With("component", "redis"),
	}
	var st *redisstore.Store
	var err error
	if client != nil {
		st, err = redisstore.NewWithClient(client, sc)
	} else {
		st, err = redisstore.New(c.redisConnection(sc))
	}
	if err != nil {
		return nil, fmt.Errorf("response_cache.redis (%s): %w", RedactURL(c.redisURL()), err)
	}
	return st, nil
}

// redisConnection returns sc with response_cache.redis's connection settings: those of a client
// of the store's own (redisstore.New, redisstore.ClientOption).
func (c *Config) redisConnection(sc redisstore.Config) redisstore.Config {
	r := c.ResponseCache.Redis
	sc.URL, sc.TLS, sc.Username, sc.Password = string(r.URL), r.TLS, r.Username, string(r.Password)
	sc.PoolSize, sc.ConnectTimeout = r.PoolSize, time.Duration(r.ConnectTimeoutMS)*time.Millisecond
	sc.CommandTimeout = time.Duration(r.CommandTimeoutMS) * time.Millisecond
	sc.ClientSideCaching, sc.ClientCacheBytes = r.ClientCache, r.ClientCacheBytes
	return sc
}

// redisURL is response_cache.redis.url in force: redisstore.DefaultURL when unset.
func (c *Config) redisURL() string {
	if u := c.ResponseCache.Redis.URL; u != "" {
		return string(u)
	}
	return redisstore.DefaultURL
}

// kvRedisURL is the URL of the KV index's Redis: kv_cache_index.redis.url, else
// response_cache.redis.url.
func (c *Config) kvRedisURL() string {
	if u := c.KVCacheIndex.Redis.URL; u != "" {
		return string(u)
	}
	return string(c.ResponseCache.Redis.URL)
}

// onRedis reports whether the response cache's store is on Redis (backend redis, or tiered with
// l1.type redis).
func (rc *ResponseCacheConfig) onRedis() bool {
	return rc.Backend == "redis" || (rc.Backend == "tiered" && rc.L1.Type == "redis")
}

// SharesRedis reports whether NewStores gives the response cache and the KV index one Redis
// client: both are enabled on Redis, and the index's URL is the response cache's (unset, or
// equal to response_cache.redis.url in force). It only reads c.
func (c *Config) SharesRedis() bool {
	rc, kc := &c.ResponseCache, &c.KVCacheIndex
	return rc.Enabled && rc.onRedis() && kc.Enabled && kc.Backend == "redis" &&
		(kc.Redis.URL == "" || string(kc.Redis.URL) == c.redisURL())
}

// NewStores builds response_cache and kv_cache_index together, as NewResponseCache and NewKVIndex
// build them one by one, with one Redis client per server: when SharesRedis, it creates one
// rueidis client from response_cache.redis's connection settings (url, tls, username, password,
// pool_size, connect_timeout_ms, command_timeout_ms, and client_cache with client_cache_bytes:
// the options of redisstore.ClientOption) and hands it to both (redisstore.NewWithClient,
// redisindex.NewWithClient). Client-side caching is an option of the client: with client_cache
// the shared client has it, and uses one connection to the server; the index's commands are
// not cached. Otherwise each builds a client of its own, as alone.
//
// A shared client to a single server that cannot be reached is not an error (unless
// response_cache.redis.fallback_to_memory is false): it dials again on each later command, the
// store serves from its in-memory fallback until its health check finds Redis, and the index
// fails fast meanwhile, as with their own clients.
//
// Return values:
//   - (cache, index, closeAll, nil): cache is nil when response_cache is off, index when
//     kv_cache_index is off. closeAll closes the cache (and its stores), then the index, then the
//     shared client, and joins their errors; call it once the handler, the Router and the event
//     consumers that use them are closed. It may be called more than once.
//   - (nil, nil, nil, err): the error of NewResponseCache or NewKVIndex, or, prefixed
//     "response_cache.redis (<URL, password redacted>): ", of the shared client; whatever was
//     built before the failure has been closed.
//
// NewStores panics when c's defaults were not applied. It only reads c.
func (c *Config) NewStores(o Options) (cache *respcache.Cache, index kvindex.KvCacheIndex, closeAll func() error, err error) {
	c.mustHaveDefaults("NewStores")
	var client rueidis.Client
	if c.SharesRedis() {
		if client, err = c.newSharedRedisClient(); err != nil {
			return nil, nil, nil, err
		}
	}
	closeClient := func() error {
		if client != nil {
			client.Close()
		}
		return nil
	}
	cache, closeCache, err := c.newResponseCache(o, client)
	if err != nil {
		_ = closeClient()
		return nil, nil, nil, err
	}
	index, closeIndex, err := c.newKVIndex(client)
	if err != nil {
		_ = closeCache()
		_ = closeClient()
		return nil, nil, nil, err
	}
	var once sync.Once
	return cache, index, func() error {
		var err error
		once.Do(func() { err = errors.Join(closeCache(), closeIndex(), closeClient()) })
		return err
	}, nil
}

// newSharedRedisClient creates the client NewStores shares: redisstore.ClientOption's options for
// response_cache.redis. An unreachable single server gets a client that dials on each command.
func (c *Config) newSharedRedisClient() (rueidis.Client, error) {
	wrap := func(err error) error {
		return fmt.Errorf("response_cache.redis (%s): %w", RedactURL(c.redisURL()), err)
	}
	opt, err := redisstore.ClientOption(c.redisConnection(redisstore.Config{}))
	if err != nil {
		return nil, wrap(err)
	}
	client, err := rueidis.NewClient(opt)
	if err == nil {
		return client, nil
	}
	if _, isRedis := rueidis.IsRedisErr(err); isRedis || len(opt.InitAddress) != 1 || opt.Sentinel.MasterSet != "" ||
		!*c.ResponseCache.Redis.FallbackToMemory {
		return nil, wrap(fmt.Errorf("%w: %w", respcache.ErrUnavailable, err))
	}
	// A single-server client dials again on each command after a failed start. Its constructor
	// dials once more: make that attempt fail at once, so that the start costs one timeout.
	var built atomic.Bool
	dial := opt.DialCtxFn
	opt.ForceSingleClient = true
	opt.DialCtxFn = func(ctx context.Context, addr string, d *net.Dialer, tc *tls.Config) (net.Conn, error) {
		switch {
		case !built.Load():
			return nil, err
		case dial != nil:
			return dial(ctx, addr, d, tc)
		case tc != nil:
			return (&tls.Dialer{NetDialer: d, Config: tc}).DialContext(ctx, "tcp", addr)
		}
		return d.DialContext(ctx, "tcp", addr)
	}
	client, err2 := rueidis.NewClient(opt)
	built.Store(true)
	if client == nil {
		return nil, wrap(fmt.Errorf("%w: %w", respcache.ErrUnavailable, errors.Join(err, err2)))
	}
	return client, nil
}

// NewKVIndex builds the index of kv_cache_index (tier 4): a kvindex.MemoryIndex (backend
// memory) or a redisindex.Index (backend redis, on kv_cache_index.redis.url or, when that is
// empty, response_cache.redis.url). Its block size, entry TTL, tier weights and storage
// offloading come from kv_cache_index, and the model of events that name none is the first
// backend's.
//
// Return values:
//   - (index, closeIndex, nil): closeIndex closes the index (its sweeper or Redis client); call
//     it once the Router and the event consumers that use the index are closed.
//   - (nil, closeIndex, nil): kv_cache_index is not enabled; closeIndex does nothing.
//   - (nil, nil, err): the library rejected the configuration; the error is prefixed
//     "kv_cache_index: " or "kv_cache_index (redis <URL, password redacted>): ".
//
// NewKVIndex panics when c's defaults were not applied. It only reads c.
func (c *Config) NewKVIndex() (index kvindex.KvCacheIndex, closeIndex func() error, err error) {
	c.mustHaveDefaults("NewKVIndex")
	return c.newKVIndex(nil)
}

// newKVIndex is NewKVIndex; a non-nil client is the Redis index's (never closed here).
func (c *Config) newKVIndex(client rueidis.Client) (index kvindex.KvCacheIndex, closeIndex func() error, err error) {
	kc := c.KVCacheIndex
	if !kc.Enabled {
		return nil, func() error { return nil }, nil
	}
	sc := kc.Scoring
	tiers := kvindex.TierWeights{*sc.GPUTierWeight, *sc.CPUTierWeight, *sc.StorageTierWeight}
	ttl := time.Duration(kc.EntryTTLSeconds) * time.Second
	switch kc.Backend {
	case "redis":
		icfg := redisindex.Config{KeyPrefix: kc.Redis.KeyPrefix, BlockSize: kc.BlockSize, DefaultModel: c.defaultModel(),
			EntryTTL: ttl, TierWeights: tiers, StorageOffloading: kc.StorageOffloading.Enabled,
			TreatEvictionAsOffload: *kc.StorageOffloading.TreatEvictionAsOffload,
		}
		var ix *redisindex.Index
		if client != nil {
			ix, err = redisindex.NewWithClient(client, icfg)
		} else {
			icfg.URL = c.kvRedisURL()
			ix, err = redisindex.New(icfg)
		}
		if err != nil {
			return nil, nil, fmt.Errorf("kv_cache_index (redis %s): %w", RedactURL(c.kvRedisURL()), err)
		}
		return ix, ix.Close, nil
	default:
		ix, err := kvindex.NewMemory(kvindex.MemoryConfig{
			BlockSize: kc.BlockSize, DefaultModel: c.defaultModel(), MaxPrefixEntries: kc.MaxEntries, EntryTTL: ttl,
			TierWeights: tiers, StorageOffloading: kc.StorageOffloading.Enabled,
			TreatEvictionAsOffload:    *kc.StorageOffloading.TreatEvictionAsOffload,
			ApproximateCapacityBlocks: kc.ApproximateCapacityBlocks,
		})
		if err != nil {
			return nil, nil, fmt.Errorf("kv_cache_index: %w", err)
		}
		return ix, ix.Close, nil
	}
}

// KVConfig maps kv_cache_index onto the Router's tier 4 over index (normally NewKVIndex's,
// possibly wrapped) and tok: the scorer, attention_cost, min_overlap_threshold,
// load_factor_epsilon, block_size, speculation, and UsePrefixEntries when some event source is
// SSE (prefix-granular events). With scorer expected_ttft, Scorer is a scorer.ExpectedTTFT of
// cache_weight and attention_cost and Weights is zero; with kv_overlap, Scorer is nil and
// Weights are the scoring weights (the Router builds the composite). AttentionCost is
// attention_cost, its 0 ("no attention term") the library's negative value (its 0 means its
// default). It returns nil when kv_cache_index is not enabled, so that
//
//	rcfg.KV = cfg.KVConfig(index, tok)
//
// is right either way.
//
// tok is the tokenizer of mode engine: the engines' /tokenize client is the gateway's (kvroute
// ships none), and nil then means only requests that carry token IDs get block keys. With mode
// estimate a nil tok means prefixkey.EstimateTokenizer; with mode none tok is ignored and
// requests get no block keys.
//
// c should be valid: a cache_weight Validate rejects leaves Scorer nil (the Router's default,
// ExpectedTTFT with its default cache weight). LoadFactorEpsilon is set, its default chosen for
// the configured scorer: a gateway that replaces Scorer should set it to 0 (the Router then
// picks the default for the scorer it is given) or to its own value. KVConfig panics when c's
// defaults were not applied. It only reads c.
func (c *Config) KVConfig(index kvindex.KvCacheIndex, tok prefixkey.Tokenizer) *kvroute.KVConfig {
	c.mustHaveDefaults("KVConfig")
	kc := c.KVCacheIndex
	if !kc.Enabled {
		return nil
	}
	switch kc.Tokenizer {
	case TokenizerEstimate:
		if tok == nil {
			tok = prefixkey.EstimateTokenizer{}
		}
	case TokenizerNone:
		tok = nil
	}
	var spec kvroute.Speculation
	_ = spec.UnmarshalText([]byte(kc.Speculation)) // validated: speculate, approximate or off
	usePrefix := false
	for _, es := range kc.EventSources {
		if !IsZMQEndpoint(es.Endpoint) {
			usePrefix = true
		}
	}
	sc := kc.Scoring
	kcfg := &kvroute.KVConfig{
		Index:               index,
		BlockSize:           kc.BlockSize,
		Tokenizer:           tok,
		AttentionCost:       *sc.AttentionCost,
		MinOverlapThreshold: sc.MinOverlapThreshold,
		LoadFactorEpsilon:   sc.LoadFactorEpsilon,
		UsePrefixEntries:    usePrefix,
		Speculation:         spec,
	}
	if kcfg.AttentionCost == 0 { // the YAML's "no attention term"; the library's 0 is its default
		kcfg.AttentionCost = -1
	}
	// Validate has checked the weights and the cache weight: the constructors cannot fail here.
	if sc.Scorer == ScorerKVOverlap {
		if s, err := scorer.NewComposite(c.compositeConfig()); err == nil {
			kcfg.Scorer = s
		}
	} else if s, err := scorer.NewExpectedTTFT(scorer.ExpectedTTFTConfig{CacheWeight: *sc.CacheWeight,
		AttentionCost: kcfg.AttentionCost}); err == nil {
		kcfg.Scorer = s
	}
	return kcfg
}

// EventConsumer is an events transport built by NewEventConsumers: an *events.SSEConsumer or a
// *zmqevents.Consumer (type-assert for the latter's Addrs, e.g. the addresses binds to port 0
// got, and Listeners, the bound sockets' status).
// Start starts its goroutines (a bound ZMQ consumer binds then; ctx bounds that); Status
// reports each source; Close stops it and waits for its goroutines, and is idempotent. All
// methods are safe for concurrent use.
type EventConsumer interface {
	Start(ctx context.Context) error
	Status() []events.SourceStatus
	Close() error
}

var (
	_ EventConsumer = (*events.SSEConsumer)(nil)
	_ EventConsumer = (*zmqevents.Consumer)(nil)
)

// NewEventConsumers builds the consumers of kv_cache_index.event_sources, all applying to sink:
// one SSE consumer for the http(s) sources, one ZMQ consumer connecting to the tcp:// sources,
// and one ZMQ consumer binding every bind: true endpoint (one zmqevents.Listener each, in
// configuration order), in that order, each present only when some source needs it. The first
// reconnection delay of each transport is the least reconnect_interval_ms of its sources (the
// library's default when none is set), and its largest delay is at least the library's default
// maximum. SSE streams clear their backend on reconnection (events sent while a stream was down
// are lost).
//
// Each bound endpoint places its messages by its own rules: topic_backends, else its
// backend_name, else the <pod> of a kv@<pod>@<model> topic when <pod> is a configured backend
// that no SSE or connect-mode source feeds (Validate makes sure that every backend gets its
// events through one consumer); its model defaults to its backend's, else the first backend's.
// All the bound endpoints share one consumer, so a backend may be fed through several (one per
// data-parallel rank) in order.
//
// It returns nil and no error when kv_cache_index is not enabled or has no event sources.
// Nothing is started: call Start on each consumer, and Close on each when done (before closing
// the sink). The error names the transport (kv_cache_index.event_sources (SSE), (ZMQ) or (ZMQ
// bind)) and wraps the library's; the consumers built before the failure have been closed.
// NewEventConsumers only reads c; c should be valid.
func (c *Config) NewEventConsumers(sink events.Sink, o Options) ([]EventConsumer, error) {
	if !c.KVCacheIndex.Enabled {
		return nil, nil
	}
	var (
		sse          []events.SSESource
		zmq          []zmqevents.Endpoint
		sseBackoff   time.Duration
		zmqBackoff   time.Duration
		out          []EventConsumer
		listeners    []zmqevents.Listener
		pods         = c.podBackends()
		minBackoffOf = func(cur time.Duration, ms int) time.Duration {
			if ms <= 0 {
				return cur
			}
			d := time.Duration(ms) * time.Millisecond
			if cur == 0 || d < cur {
				return d
			}
			return cur
		}
	)
	for i := range c.KVCacheIndex.EventSources {
		es := &c.KVCacheIndex.EventSources[i]
		switch {
		case es.Bind:
			if es.BackendName == "" && len(pods) == 0 {
				// An empty Backends would accept any pod: refuse rather than invent backends.
				return nil, fmt.Errorf("kv_cache_index.event_sources (ZMQ bind): event_sources[%d] has no backend_name "+
					"and every backend gets its events from another source", i)
			}
			model := es.Model
			if model == "" {
				model = c.defaultModel()
			}
			listeners = append(listeners, zmqevents.Listener{Bind: es.Endpoint, TopicBackend: es.TopicBackends,
				DefaultBackend: es.BackendName, Backends: pods, Model: model})
		case IsZMQEndpoint(es.Endpoint):
			zmq = append(zmq, zmqevents.Endpoint{Backend: es.BackendName, Endpoint: es.Endpoint,
				ReplayEndpoint: es.ReplayEndpoint, Model: es.Model})
			zmqBackoff = minBackoffOf(zmqBackoff, es.ReconnectIntervalMS)
		default:
			sse = append(sse, events.SSESource{Backend: es.BackendName, URL: es.Endpoint, Model: es.Model})
			sseBackoff = minBackoffOf(sseBackoff, es.ReconnectIntervalMS)
		}
	}
	closeAll := func() {
		for i := len(out) - 1; i >= 0; i-- {
			_ = out[i].Close()
		}
	}
	logger := o.logger().With("component", "kv-events")
	if len(sse) > 0 {
		sc, err := events.NewSSEConsumer(events.SSEConfig{Sink: sink, Sources: sse, InitialBackoff: sseBackoff,
			MaxBackoff: max(sseBackoff, events.DefaultSSEMaxBackoff), ClearOnReconnect: true,
			MeterProvider: o.MeterProvider, Logger: logger})
		if err != nil {
			return nil, fmt.Errorf("kv_cache_index.event_sources (SSE): %w", err)
		}
		out = append(out, sc)
	}
	if len(zmq) > 0 {
		zc, err := zmqevents.New(zmqevents.Config{Sink: sink, Endpoints: zmq, InitialBackoff: zmqBackoff,
			MaxBackoff: max(zmqBackoff, zmqevents.DefaultMaxBackoff), MeterProvider: o.MeterProvider, Logger: logger})
		if err != nil {
			closeAll()
			return nil, fmt.Errorf("kv_cache_index.event_sources (ZMQ): %w", err)
		}
		out = append(out, zc)
	}
	if len(listeners) > 0 {
		zc, err := zmqevents.New(zmqevents.Config{Sink: sink, Listeners: listeners,
			MeterProvider: o.MeterProvider, Logger: logger})
		if err != nil {
			closeAll()
			return nil, fmt.Errorf("kv_cache_index.event_sources (ZMQ bind): %w", err)
		}
		out = append(out, zc)
	}
	return out, nil
}
