package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/metric"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/health"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/scorer"
)

// server is the proxy: the Router and everything around it. newServer builds it without
// starting anything that talks to the network but the stores' own clients; start starts the
// event consumers and the health probes; Close releases everything. Its handler is safe for
// concurrent use.
type server struct {
	cfg     *Config
	log     *slog.Logger
	tel     *telemetry
	router  *kvroute.DefaultRouter
	index   kvindex.KvCacheIndex // nil when tier 4 is off
	sink    *events.CountingSink // nil when tier 4 is off
	cons    []eventConsumer
	cache   *respcache.Cache // nil when the response cache is off
	health  *health.Monitor
	tok     prefixkey.Tokenizer // nil: requests are routed without block keys
	tokMode string

	backends  map[string]*url.URL
	transport *http.Transport // carries every request to the backends
	rp        *httputil.ReverseProxy
	handler   http.Handler
	draining  atomic.Bool
	passNext  atomic.Uint64 // turns of the passed-through requests over the backends

	closers []func() error // run in reverse order by Close
	started atomic.Bool
	closed  atomic.Bool
}

// parseStrategy maps a selection_strategy value (snake_case or the seeds' CamelCase) to the
// Router's Strategy; "" and prefix_aware_hash give the default fallback.
func parseStrategy(s string) (kvroute.Strategy, bool) {
	norm := strings.ToLower(strings.NewReplacer("_", "", "-", "", " ", "").Replace(s))
	switch norm {
	case "", "prefixawarehash", "prefixaware":
		return "", true
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

// newServer builds the proxy from a validated configuration.
func newServer(cfg *Config, log *slog.Logger) (s *server, err error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s = &server{cfg: cfg, log: log, backends: map[string]*url.URL{}}
	defer func() {
		if err != nil {
			_ = s.Close()
		}
	}()

	for _, b := range cfg.Backends {
		u, err := url.Parse(b.URL)
		if err != nil {
			return nil, fmt.Errorf("backend %s: %w", b.Name, err)
		}
		s.backends[b.Name] = u
	}

	if s.tel, err = newTelemetry(); err != nil {
		return nil, err
	}
	s.closers = append(s.closers, s.tel.Close)
	mp := s.tel.provider

	dialer := &net.Dialer{Timeout: time.Duration(cfg.Server.UpstreamDialTimeout), KeepAlive: 30 * time.Second}
	s.transport = &http.Transport{
		DialContext:           dialer.DialContext,
		MaxIdleConns:          512,
		MaxIdleConnsPerHost:   128,
		IdleConnTimeout:       90 * time.Second,
		ExpectContinueTimeout: time.Second,
		// Identity bodies from the backends: cacheable, and streamed without a decompressor's
		// buffering.
		DisableCompression: true,
	}
	s.closers = append(s.closers, func() error { s.transport.CloseIdleConnections(); return nil })

	strategy, _ := parseStrategy(cfg.SelectionStrategy)
	rcfg := kvroute.Config{
		DisablePrefixRouting:           !*cfg.PrefixRouting.Enabled,
		MaxPrefixLength:                cfg.PrefixRouting.MaxPrefixLength,
		Epsilon:                        cfg.PrefixRouting.LoadFactorEpsilon,
		VirtualNodes:                   cfg.PrefixRouting.VirtualNodes,
		Strategy:                       strategy,
		AnthropicCacheControlInjection: cfg.PrefixRouting.AnthropicCacheControlInjection,
		MeterProvider:                  mp,
	}
	for _, b := range cfg.Backends {
		rb := kvroute.Backend{Name: b.Name, Weight: b.Weight, Role: b.role()}
		if b.ExternalStorage != nil {
			st := b.ExternalStorage.location()
			rb.Storage = &st
		}
		rcfg.Backends = append(rcfg.Backends, rb)
	}
	if cfg.KVCacheIndex.Enabled {
		if rcfg.KV, err = s.buildKV(mp); err != nil {
			return nil, err
		}
	}
	if cfg.DisaggregatedServing.Enabled {
		if rcfg.Disagg, err = disaggConfig(cfg); err != nil {
			return nil, err
		}
	}
	if s.router, err = kvroute.New(rcfg); err != nil {
		return nil, fmt.Errorf("router: %w", err)
	}
	s.closers = append(s.closers, s.router.Close)

	if cfg.ResponseCache.Enabled {
		if err := s.buildCache(mp); err != nil {
			return nil, err
		}
	}

	if s.health, err = newHealth(cfg, s.router, s.transport, log.With("component", "health")); err != nil {
		return nil, err
	}
	s.closers = append(s.closers, func() error { s.health.Close(); return nil })
	if err := s.tel.observeHealth(s.health); err != nil {
		return nil, err
	}
	s.handler = s.routes()
	return s, nil
}

// disaggConfig maps disaggregated_serving onto the Router's disaggregation. Prefill and unified
// backends are scored with kv_cache_index.scoring's weights when tier 4 is on.
func disaggConfig(cfg *Config) (*disagg.Config, error) {
	ds := cfg.DisaggregatedServing
	cd := ds.Conditional
	dc := &disagg.Config{
		PrefillTimeout:     time.Duration(ds.PrefillTimeout),
		KVTransferTimeout:  time.Duration(ds.KVTransferTimeout),
		DisableFallback:    !*ds.FallbackToUnified,
		DefaultStorage:     ds.DefaultExternalStorage.location(),
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
	if cfg.KVCacheIndex.Enabled {
		sc := cfg.KVCacheIndex.Scoring
		comp, err := scorer.NewComposite(scorer.CompositeConfig{OverlapWeight: *sc.OverlapWeight, LoadWeight: *sc.LoadWeight,
			HealthWeight: *sc.HealthWeight, MinOverlapThreshold: sc.MinOverlapThreshold})
		if err != nil {
			return nil, fmt.Errorf("disaggregated_serving: %w", err)
		}
		dc.Scorer = comp
	}
	return dc, nil
}

// buildKV builds tier 4: the index, its event consumers and the tokenizer.
func (s *server) buildKV(mp metric.MeterProvider) (*kvroute.KVConfig, error) {
	cfg := s.cfg
	kc := cfg.KVCacheIndex
	sc := kc.Scoring
	tiers := kvindex.TierWeights{*sc.GPUTierWeight, *sc.CPUTierWeight, *sc.StorageTierWeight}
	ttl := time.Duration(kc.EntryTTLSeconds) * time.Second
	defaultModel := ""
	if len(cfg.Backends) > 0 {
		defaultModel = cfg.Backends[0].model()
	}
	switch kc.Backend {
	case "redis":
		u := kc.Redis.URL
		if u == "" {
			u = cfg.ResponseCache.Redis.URL
		}
		ix, err := kvindex.NewRedis(kvindex.RedisConfig{
			URL: string(u), KeyPrefix: kc.Redis.KeyPrefix, BlockSize: kc.BlockSize, DefaultModel: defaultModel,
			EntryTTL: ttl, TierWeights: tiers, StorageOffloading: kc.StorageOffloading.Enabled,
			TreatEvictionAsOffload: *kc.StorageOffloading.TreatEvictionAsOffload,
		})
		if err != nil {
			return nil, fmt.Errorf("kv_cache_index (redis %s): %w", redactURL(string(u)), err)
		}
		s.index = ix
		s.closers = append(s.closers, ix.Close)
	default:
		ix, err := kvindex.NewMemory(kvindex.MemoryConfig{
			BlockSize: kc.BlockSize, DefaultModel: defaultModel, MaxPrefixEntries: kc.MaxEntries, EntryTTL: ttl,
			TierWeights: tiers, StorageOffloading: kc.StorageOffloading.Enabled,
			TreatEvictionAsOffload:    *kc.StorageOffloading.TreatEvictionAsOffload,
			ApproximateCapacityBlocks: kc.ApproximateCapacityBlocks,
		})
		if err != nil {
			return nil, fmt.Errorf("kv_cache_index: %w", err)
		}
		s.index = ix
		s.closers = append(s.closers, ix.Close)
	}
	s.sink = events.NewCountingSink(s.index)
	if reg, err := s.tel.observeIndexMutations(s.sink); err != nil {
		return nil, err
	} else {
		s.closers = append(s.closers, reg.Unregister)
	}
	cons, err := newEventConsumers(cfg, s.sink, mp, s.log)
	if err != nil {
		return nil, err
	}
	s.cons = cons
	for _, c := range cons {
		s.closers = append(s.closers, c.Close)
	}

	s.tokMode = kc.Tokenizer
	switch kc.Tokenizer {
	case tokenizerEngine:
		t, err := newEngineTokenizer(cfg, s, time.Duration(kc.TokenizeTimeout))
		if err != nil {
			return nil, err
		}
		s.tok = t
	case tokenizerEstimate:
		s.tok = prefixkey.EstimateTokenizer{}
	}

	spec := kvroute.SpeculateShort
	switch kc.Speculation {
	case "approximate":
		spec = kvroute.Approximate
	case "off":
		spec = kvroute.SpeculateOff
	}
	usePrefix := false
	for _, es := range kc.EventSources {
		if !isZMQEndpoint(es.Endpoint) {
			usePrefix = true
		}
	}
	return &kvroute.KVConfig{
		Index:     s.index,
		BlockSize: kc.BlockSize,
		Tokenizer: s.tok,
		Weights: scorer.CompositeConfig{OverlapWeight: *sc.OverlapWeight, LoadWeight: *sc.LoadWeight,
			HealthWeight: *sc.HealthWeight, MinOverlapThreshold: sc.MinOverlapThreshold},
		MinOverlapThreshold: sc.MinOverlapThreshold,
		LoadFactorEpsilon:   sc.LoadFactorEpsilon,
		UsePrefixEntries:    usePrefix,
		Speculation:         spec,
	}, nil
}

// buildCache builds the response cache and its store.
func (s *server) buildCache(mp metric.MeterProvider) error {
	rc := s.cfg.ResponseCache
	ttl := time.Duration(rc.TTL)
	var store respcache.CacheStore
	switch rc.Backend {
	case "memory":
		m, err := respcache.NewMemory(respcache.MemoryConfig{Capacity: rc.Capacity, DefaultTTL: ttl})
		if err != nil {
			return fmt.Errorf("response_cache: %w", err)
		}
		store = m
	case "redis":
		r, err := s.newRedisStore(mp)
		if err != nil {
			return err
		}
		store = r
	case "tiered":
		var l1 respcache.CacheStore
		if rc.L1.Type == "redis" {
			r, err := s.newRedisStore(mp)
			if err != nil {
				return err
			}
			l1 = r
		} else {
			m, err := respcache.NewMemory(respcache.MemoryConfig{Capacity: rc.Capacity, DefaultTTL: ttl})
			if err != nil {
				return fmt.Errorf("response_cache.l1: %w", err)
			}
			l1 = m
		}
		l2c := rc.L2
		s3, err := respcache.NewS3(respcache.S3Config{
			Endpoint: l2c.Endpoint, Bucket: l2c.Bucket, KeyPrefix: l2c.KeyPrefix, Region: l2c.Region,
			AccessKey: string(l2c.AccessKey), SecretKey: string(l2c.SecretKey), DefaultTTL: ttl,
			TTLOverride: time.Duration(l2c.TTLOverride), MeterProvider: mp, Logger: s.log.With("component", "s3"),
		})
		if err != nil {
			return fmt.Errorf("response_cache.l2: %w", err)
		}
		s.closers = append(s.closers, s3.Close)
		t, err := respcache.NewTiered(respcache.TieredConfig{L1: l1, L2: s3, L1MaxValueSize: rc.L1.MaxValueSize,
			DisablePromotion: !*rc.Tiered.PromoteOnHit, L1PromotionTTL: time.Duration(rc.Tiered.L1PromotionTTL),
			L2TTL: time.Duration(l2c.TTLOverride)})
		if err != nil {
			return fmt.Errorf("response_cache.tiered: %w", err)
		}
		store = t
	}
	c, err := respcache.New(respcache.Config{
		Store: store, TTL: ttl, MaxResponseSize: rc.MaxResponseSize, MaxStreamBufferSize: rc.MaxStreamBufferSize,
		DisableStreaming: !*rc.CacheStreaming, MaxBodyBytes: s.cfg.Server.MaxBodyBytes, MeterProvider: mp,
	})
	if err != nil {
		return fmt.Errorf("response_cache: %w", err)
	}
	s.cache = c
	s.closers = append(s.closers, c.Close)
	return nil
}

func (s *server) newRedisStore(mp metric.MeterProvider) (*respcache.RedisStore, error) {
	r := s.cfg.ResponseCache.Redis
	st, err := respcache.NewRedis(respcache.RedisConfig{
		URL: string(r.URL), TLS: r.TLS, Username: r.Username, Password: string(r.Password), KeyPrefix: r.KeyPrefix,
		PoolSize: r.PoolSize, ConnectTimeout: time.Duration(r.ConnectTimeoutMS) * time.Millisecond,
		CommandTimeout: time.Duration(r.CommandTimeoutMS) * time.Millisecond, DefaultTTL: time.Duration(s.cfg.ResponseCache.TTL),
		DisableFallback: !*r.FallbackToMemory, FallbackCapacity: r.FallbackCapacity,
		FallbackTTL:   time.Duration(r.FallbackTTLSeconds) * time.Second,
		MeterProvider: mp, Logger: s.log.With("component", "redis"),
	})
	if err != nil {
		return nil, fmt.Errorf("response_cache.redis (%s): %w", redactURL(string(r.URL)), err)
	}
	s.closers = append(s.closers, st.Close)
	return st, nil
}

// newHealth builds the health probes and circuit breakers of health_checks and circuit_breaker,
// which take backends in and out of the Router's rotation.
func newHealth(cfg *Config, router health.Target, tr http.RoundTripper, log *slog.Logger) (*health.Monitor, error) {
	hc, cb := cfg.HealthChecks, cfg.CircuitBreaker
	hcfg := health.Config{
		Target: router,
		Client: &http.Client{Transport: tr},
		Probe: health.ProbeConfig{Disabled: !*hc.Enabled, Interval: time.Duration(hc.Interval), Timeout: time.Duration(hc.Timeout),
			UnhealthyThreshold: hc.UnhealthyThreshold, HealthyThreshold: hc.HealthyThreshold, Path: hc.Path},
		Breaker: health.BreakerConfig{Disabled: !*cb.Enabled, FailureThreshold: cb.FailureThreshold,
			RecoveryTimeout: time.Duration(cb.RecoveryTimeout)},
		Logger: log,
	}
	for _, b := range cfg.Backends {
		hcfg.Backends = append(hcfg.Backends, health.Backend{Name: b.Name, URL: b.URL})
	}
	m, err := health.New(hcfg)
	if err != nil {
		return nil, fmt.Errorf("health_checks: %w", err)
	}
	return m, nil
}

// start starts the KV-event consumers and the health probes. ctx bounds the consumers' binds.
func (s *server) start(ctx context.Context) error {
	if !s.started.CompareAndSwap(false, true) {
		return errors.New("proxy already started")
	}
	for _, c := range s.cons {
		if err := c.Start(ctx); err != nil {
			return fmt.Errorf("kv events: %w", err)
		}
	}
	s.health.Start()
	return nil
}

// httpClient returns a client over the proxy's upstream transport.
func (s *server) httpClient() *http.Client { return &http.Client{Transport: s.transport} }

// Handler returns the proxy's HTTP handler.
func (s *server) Handler() http.Handler { return s.handler }

// Close stops everything newServer and start started, in reverse order. Idempotent.
func (s *server) Close() error {
	if !s.closed.CompareAndSwap(false, true) {
		return nil
	}
	var errs []error
	for i := len(s.closers) - 1; i >= 0; i-- {
		if err := s.closers[i](); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// logConfig logs the configuration in force, secrets redacted.
func (s *server) logConfig() {
	cfg := s.cfg
	strategy, _ := parseStrategy(cfg.SelectionStrategy)
	if strategy == "" {
		strategy = kvroute.DefaultStrategy
	}
	attrs := []any{
		"backends", len(cfg.Backends),
		"prefix_routing", *cfg.PrefixRouting.Enabled,
		"selection_strategy", string(strategy),
		"response_cache", cfg.ResponseCache.Enabled,
		"kv_cache_index", cfg.KVCacheIndex.Enabled,
		"health_checks", *cfg.HealthChecks.Enabled,
		"circuit_breaker", *cfg.CircuitBreaker.Enabled,
		"admin_auth", cfg.Admin.AuthToken != "",
	}
	if cfg.ResponseCache.Enabled {
		rc := cfg.ResponseCache
		attrs = append(attrs, "response_cache.backend", rc.Backend, "response_cache.ttl", rc.TTL.String())
		if rc.Backend == "redis" || (rc.Backend == "tiered" && rc.L1.Type == "redis") {
			attrs = append(attrs, "response_cache.redis.url", redactURL(string(rc.Redis.URL)),
				"response_cache.redis.password", rc.Redis.Password)
		}
		if rc.Backend == "tiered" {
			attrs = append(attrs, "response_cache.l2.endpoint", rc.L2.Endpoint, "response_cache.l2.bucket", rc.L2.Bucket,
				"response_cache.l2.access_key", rc.L2.AccessKey, "response_cache.l2.secret_key", rc.L2.SecretKey)
		}
	}
	if cfg.KVCacheIndex.Enabled {
		attrs = append(attrs, "kv_cache_index.backend", cfg.KVCacheIndex.Backend,
			"kv_cache_index.tokenizer", s.tokMode, "kv_cache_index.speculation", cfg.KVCacheIndex.Speculation,
			"kv_cache_index.event_sources", len(cfg.KVCacheIndex.EventSources))
	}
	if ds := cfg.DisaggregatedServing; ds.Enabled {
		attrs = append(attrs, "disaggregated_serving.prefill_timeout", ds.PrefillTimeout.String(),
			"disaggregated_serving.kv_transfer_timeout", ds.KVTransferTimeout.String(),
			"disaggregated_serving.fallback_to_unified", *ds.FallbackToUnified,
			"disaggregated_serving.conditional", *ds.Conditional.Enabled,
			"disaggregated_serving.default_external_storage", ds.DefaultExternalStorage.location())
	}
	s.log.Info("configuration", attrs...)
	for _, b := range cfg.Backends {
		attrs := []any{"name", b.Name, "url", redactURL(b.URL), "weight", b.Weight, "model", b.model()}
		if cfg.DisaggregatedServing.Enabled {
			attrs = append(attrs, "role", b.role().String(), "external_storage", cfg.storageOf(&b))
		}
		s.log.Info("backend", attrs...)
	}
}
