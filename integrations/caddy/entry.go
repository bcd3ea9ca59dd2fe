package kvroutecaddy

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/respcache"
)

// routers holds every live entry, keyed by its handler's configuration (Handler.poolKey), so that
// a config reload that keeps the kvroute settings keeps the Router and its state.
var routers = caddy.NewUsagePool()

// entry is what a handler's configuration builds: the Router and what feeds it. Entries are
// shared by every handler with the same configuration, across reloads, and closed by Destruct
// when the last one is cleaned up. Its methods are safe for concurrent use.
type entry struct {
	id     string // a short digest of the key, for logs and the admin endpoint
	cfg    *config.Config
	kvOn   bool
	router routerAPI
	// consumers feed the KV index from the engines' events.
	consumers []config.EventConsumer
	// cache is the response cache, nil when off; cached its middleware around serveCached.
	cache       *respcache.Cache
	cached      http.Handler
	tokenizer   *engineTokenizer // nil unless the tokenizer is engine
	closeStores func() error

	// backends holds each backend's health as last handed to the Router (syncHealth); the map is
	// read-only after newEntry.
	backends    map[string]*backendState
	healthMu    sync.Mutex  // serialises syncHealth's updates
	noPolicy    atomic.Bool // warnNoPolicy has logged
	foreignPool atomic.Bool // warnForeignPool has logged
}

// routerAPI is what the module uses of its *kvroute.DefaultRouter: an interface, so that the tests
// can watch the decisions.
type routerAPI interface {
	kvroute.Router
	SetHealthy(name string, healthy bool) error
	Stats(ctx context.Context) (kvroute.Stats, error)
	Close() error
}

// backendState is one backend's health as the Router has it.
type backendState struct {
	healthy atomic.Bool
}

// poolKey is the handler's configuration as JSON: handlers whose kvroute settings are equal share
// one entry. The response headers' switch, which the Router does not see, is left out.
func (h *Handler) poolKey() (string, error) {
	k := *h
	k.DisableResponseHeaders = false
	b, err := json.Marshal(k)
	if err != nil {
		return "", fmt.Errorf("kvroute: %w", err)
	}
	return "kvroute:" + string(b), nil
}

// newEntry builds the entry of h's configuration: the kvroute configuration's stores (response
// cache, KV index), the Router, the tokenizer and the event consumers, which it starts.
func newEntry(h *Handler, key string, log *slog.Logger) (*entry, error) {
	cfg, err := h.config()
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256([]byte(key))
	e := &entry{id: hex.EncodeToString(sum[:6]), cfg: cfg, kvOn: cfg.KVCacheIndex.Enabled,
		backends: make(map[string]*backendState, len(cfg.Backends))}
	for _, b := range cfg.Backends {
		s := new(backendState)
		s.healthy.Store(true)
		e.backends[b.Name] = s
	}
	o := config.Options{Logger: log}
	cache, index, closeStores, err := cfg.NewStores(o)
	if err != nil {
		return nil, err
	}
	e.cache, e.closeStores = cache, closeStores
	var tok prefixkey.Tokenizer
	if e.kvOn && cfg.KVCacheIndex.Tokenizer == config.TokenizerEngine {
		if e.tokenizer, err = newEngineTokenizer(cfg, e); err != nil {
			return nil, errors.Join(err, e.Destruct())
		}
		tok = e.tokenizer
	}
	rcfg, err := cfg.RouterConfig(o)
	if err != nil {
		return nil, errors.Join(err, e.Destruct())
	}
	rcfg.KV = cfg.KVConfig(index, tok)
	router, err := kvroute.New(rcfg)
	if err != nil {
		return nil, errors.Join(err, e.Destruct())
	}
	e.router = router
	if e.consumers, err = cfg.NewEventConsumers(index, o); err != nil {
		return nil, errors.Join(err, e.Destruct())
	}
	for _, c := range e.consumers {
		// Connect mode: Start does not wait for the engines, and ctx only bounds it.
		if err := c.Start(context.Background()); err != nil {
			return nil, errors.Join(err, e.Destruct())
		}
	}
	if cache != nil {
		e.cached = cache.Middleware(http.HandlerFunc(serveCached))
	}
	return e, nil
}

// Destruct closes the event consumers, the Router, the stores and the tokenizer's connections.
// Caddy's UsagePool calls it when the last handler using the entry is cleaned up.
func (e *entry) Destruct() error {
	var errs []error
	for _, c := range e.consumers {
		errs = append(errs, c.Close())
	}
	if e.router != nil {
		errs = append(errs, e.router.Close())
	}
	if e.closeStores != nil {
		errs = append(errs, e.closeStores())
	}
	if e.tokenizer != nil {
		e.tokenizer.client.CloseIdleConnections()
	}
	return errors.Join(errs...)
}

// syncHealth hands the Router Caddy's view of the upstreams' health (its active and passive
// health checks): a backend Caddy holds down gets no new decisions until Caddy holds it up.
func (e *entry) syncHealth(pool reverseproxy.UpstreamPool) {
	changed := false
	for _, u := range pool {
		if s := e.backends[u.Dial]; s != nil && s.healthy.Load() != u.Healthy() {
			changed = true
			break
		}
	}
	if !changed {
		return
	}
	e.healthMu.Lock()
	defer e.healthMu.Unlock()
	for _, u := range pool {
		s := e.backends[u.Dial]
		if s == nil {
			continue
		}
		if h := u.Healthy(); s.healthy.Load() != h {
			s.healthy.Store(h)
			_ = e.router.SetHealthy(u.Dial, h) // the backend exists: it was built from cfg
		}
	}
}

// knowsAny reports whether some upstream of pool is one of the Router's backends.
func (e *entry) knowsAny(pool reverseproxy.UpstreamPool) bool {
	for _, u := range pool {
		if e.backends[u.Dial] != nil {
			return true
		}
	}
	return false
}

// warnForeignPool logs, once per entry, that lb_policy kvroute met upstreams that are none of the
// Router's backends.
func (e *entry) warnForeignPool(log *zap.Logger) {
	if e.foreignPool.CompareAndSwap(false, true) {
		log.Warn("lb_policy kvroute: none of the reverse_proxy's upstreams is a kvroute backend; " +
			"the fallback policy chooses (list the same upstreams in kvroute, as host:port)")
	}
}

// warnNoPolicy logs, once per entry, that a routed request reached no lb_policy kvroute.
func (e *entry) warnNoPolicy(log *zap.Logger) {
	if e.noPolicy.CompareAndSwap(false, true) {
		log.Warn("kvroute routed a request that no reverse_proxy with lb_policy kvroute then proxied; " +
			"its decision is released unused (set lb_policy kvroute on the reverse_proxy after kvroute)")
	}
}

// config maps h onto kvroute's configuration schema, applies its defaults and validates it.
// Redis URLs have their Caddy placeholders ({env.NAME}) replaced.
func (h *Handler) config() (*config.Config, error) {
	if len(h.Backends) == 0 {
		return nil, errors.New("kvroute: no backends: list the reverse_proxy upstreams")
	}
	repl := caddy.NewReplacer()
	c := &config.Config{SelectionStrategy: h.SelectionStrategy}
	c.Server.MaxBodyBytes = h.MaxBodySize
	if h.MaxBodySize > config.DefaultMaxInflightBody {
		c.Server.MaxInflightBodyBytes = h.MaxBodySize
	}
	off := false
	c.HealthChecks.Enabled = &off // Caddy's health checks apply (syncHealth)
	c.CircuitBreaker.Enabled = &off
	seen := make(map[string]bool, len(h.Backends))
	for i, b := range h.Backends {
		addr, err := DialAddress(b.Address)
		if err != nil {
			return nil, fmt.Errorf("kvroute: backends[%d]: %w", i, err)
		}
		if seen[addr] {
			return nil, fmt.Errorf("kvroute: backends[%d]: %s is listed twice", i, addr)
		}
		seen[addr] = true
		u := b.URL
		if u == "" {
			u = "http://" + addr
		}
		c.Backends = append(c.Backends, config.BackendConfig{Name: addr, URL: u, Weight: b.Weight, Model: b.Model})
		if b.ZMQEndpoint != "" {
			c.KVCacheIndex.EventSources = append(c.KVCacheIndex.EventSources, config.EventSourceConfig{
				BackendName: addr, Endpoint: b.ZMQEndpoint, ReplayEndpoint: b.ZMQReplayEndpoint, Model: b.Model})
		} else if b.ZMQReplayEndpoint != "" {
			return nil, fmt.Errorf("kvroute: backends[%d]: zmq_replay_endpoint without zmq_endpoint", i)
		}
	}
	if p := h.PrefixRouting; p != nil {
		on := !p.Disabled
		c.PrefixRouting = config.PrefixRoutingConfig{Enabled: &on, MaxPrefixLength: p.MaxPrefixLength,
			LoadFactorEpsilon: p.LoadFactorEpsilon, VirtualNodes: p.VirtualNodes}
	}
	kv := &c.KVCacheIndex
	kv.Enabled = h.KVIndex != nil || len(kv.EventSources) > 0
	if x := h.KVIndex; x != nil {
		kv.Backend, kv.BlockSize, kv.MaxEntries, kv.Speculation = x.Backend, x.BlockSize, x.MaxEntries, x.Speculation
		kv.Redis.URL = config.Secret(repl.ReplaceAll(x.RedisURL, ""))
		kv.EntryTTLSeconds = int(time.Duration(x.EntryTTL) / time.Second)
		if x.EntryTTL > 0 && kv.EntryTTLSeconds == 0 {
			kv.EntryTTLSeconds = 1
		}
		kv.Scoring.MinOverlapThreshold, kv.Scoring.LoadFactorEpsilon = x.MinOverlapThreshold, x.LoadFactorEpsilon
	}
	if t := h.Tokenizer; t != nil {
		if !kv.Enabled {
			return nil, errors.New("kvroute: tokenizer: only tier 4 uses a tokenizer (set kv_index, or a backend's zmq endpoint)")
		}
		kv.Tokenizer, kv.TokenizeTimeout = t.Mode, config.Duration(t.Timeout)
	}
	if rc := h.ResponseCache; rc != nil {
		r := &c.ResponseCache
		r.Enabled, r.Backend, r.Capacity, r.MaxResponseSize, r.TenantHeader = true, rc.Backend, rc.Capacity, rc.MaxResponseSize, rc.TenantHeader
		r.TTL = config.Duration(rc.TTL)
		r.Redis.URL = config.Secret(repl.ReplaceAll(rc.RedisURL, ""))
	}
	c.ApplyDefaults()
	if err := c.Validate(); err != nil {
		// The fields are named by kvroute's YAML schema (kv_cache_index.scoring.min_overlap_threshold).
		return nil, fmt.Errorf("kvroute: invalid settings (named as in kvroute's YAML schema):\n%w", err)
	}
	return c, nil
}

// DialAddress returns the address reverse_proxy dials for an upstream written as s: "host:port"
// as is; a URL (http://host:port) without its scheme, and with the scheme's default port when it
// names none. It is what the policy matches upstreams against (reverseproxy.Upstream.Dial).
func DialAddress(s string) (string, error) {
	if s == "" {
		return "", errors.New("empty address")
	}
	if strings.Contains(s, "://") {
		u, err := url.Parse(s)
		if err != nil {
			return "", err
		}
		if u.Path != "" && u.Path != "/" || u.RawQuery != "" {
			return "", fmt.Errorf("%q: an upstream address has no path or query", s)
		}
		host, port := u.Hostname(), u.Port()
		if port == "" {
			switch u.Scheme {
			case "http":
				port = "80"
			case "https":
				port = "443"
			default:
				return "", fmt.Errorf("%q: scheme %q: want http or https", s, u.Scheme)
			}
		}
		return net.JoinHostPort(host, port), nil
	}
	if _, _, err := net.SplitHostPort(s); err != nil {
		return "", fmt.Errorf("%q: want host:port (%w)", s, err)
	}
	return s, nil
}

// engineTokenizer tokenizes through the backends' /tokenize (vLLM's), so that block keys match
// the engines' KV events: it asks the first backend, in configuration order, that serves the
// request's model and that Caddy holds healthy (a stable choice keeps that backend's tokenizer
// cache warm), and the next one when that one fails (an engine that refuses with 503 while it is
// full still has its KV cache worth routing to). Backends serving one model must share its
// tokenizer, as replicas do. Safe for concurrent use.
type engineTokenizer struct {
	cfg    *config.Config
	e      *entry
	names  []string
	byName map[string]*prefixkey.EngineTokenizer
	client *http.Client
}

// errNoTokenizer is Tokenize's error when no healthy backend serves the request's model.
var errNoTokenizer = errors.New("kvroute: no healthy backend to tokenize with")

func newEngineTokenizer(cfg *config.Config, e *entry) (*engineTokenizer, error) {
	t := &engineTokenizer{cfg: cfg, e: e, byName: make(map[string]*prefixkey.EngineTokenizer, len(cfg.Backends)),
		client: &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()}}
	for _, b := range cfg.Backends {
		et, err := prefixkey.NewEngineTokenizer(prefixkey.EngineTokenizerConfig{BaseURL: b.URL,
			Timeout: time.Duration(cfg.KVCacheIndex.TokenizeTimeout), Client: t.client})
		if err != nil {
			return nil, fmt.Errorf("kvroute: tokenizer of backend %s: %w", b.Name, err)
		}
		t.names = append(t.names, b.Name)
		t.byName[b.Name] = et
	}
	return t, nil
}

// Tokenize implements prefixkey.Tokenizer.
func (t *engineTokenizer) Tokenize(ctx context.Context, r *prefixkey.Request) ([]uint32, error) {
	err := errNoTokenizer
	for _, name := range t.names {
		if !t.e.backends[name].healthy.Load() || !t.cfg.Backend(name).Serves(r.Model) {
			continue
		}
		var tokens []uint32
		if tokens, err = t.byName[name].Tokenize(ctx, r); err == nil || ctx.Err() != nil {
			return tokens, err
		}
	}
	return nil, err
}

// Interface guards.
var (
	_ caddy.Destructor    = (*entry)(nil)
	_ prefixkey.Tokenizer = (*engineTokenizer)(nil)
)
