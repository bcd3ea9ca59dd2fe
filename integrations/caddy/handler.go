package kvroutecaddy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/apierror"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/prefixkey"
)

func init() {
	caddy.RegisterModule(Handler{})
	caddy.RegisterModule(Policy{})
	caddy.RegisterModule(AdminAPI{})
	httpcaddyfile.RegisterHandlerDirective("kvroute", parseHandlerCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("kvroute", httpcaddyfile.Before, "reverse_proxy")
}

// Response headers the handler adds to every routed answer (unless disable_response_headers):
// the names and values of kvroute's reference proxy.
const (
	// HeaderBackend names the backend that answered (the upstream's dial address).
	HeaderBackend = "X-Kvroute-Backend"
	// HeaderRoute is the decision's reason (kvroute.Reason: prefix_hash, kv_aware, …), or
	// RouteFallbackPolicy when Caddy's fallback policy chose the upstream.
	HeaderRoute = "X-Kvroute-Route"
	// HeaderCachedTokens is the prompt tokens the backend holds by the KV index, when the index
	// took part in the decision.
	HeaderCachedTokens = "X-Kvroute-Cached-Tokens"
	// HeaderRetriedFrom names the upstream whose failure made reverse_proxy retry the request.
	HeaderRetriedFrom = "X-Kvroute-Retried-From"
)

// RouteFallbackPolicy is HeaderRoute's value, and the kvroute.route variable's, for an attempt
// whose upstream the policy's fallback chose: no decision of the Router fitted an available
// upstream.
const RouteFallbackPolicy = "fallback_policy"

// Handler is the http.handlers.kvroute module: it parses each LLM request and routes it with a
// kvroute Router, for the reverse_proxy that follows (lb_policy kvroute) to send it where the
// Router decided. See the package documentation for the decision's lifecycle.
//
// Its zero value is not usable: Caddy provisions it (Provision) and releases it (Cleanup).
// ServeHTTP is safe for concurrent use.
type Handler struct {
	// Backends are the engines, each named by the address reverse_proxy dials for it ("host:port",
	// as in its upstreams; a scheme, as in http://host:port, is dropped). At least one.
	Backends []Backend `json:"backends,omitempty"`
	// MaxBodySize caps a request body, in bytes: a larger one gets 413. 0 means
	// config.DefaultMaxBodyBytes (8 MiB).
	MaxBodySize int64 `json:"max_body_size,omitempty"`
	// SelectionStrategy chooses for requests without a prefix key: round_robin (default),
	// least_loaded, random or least_latency.
	SelectionStrategy string `json:"selection_strategy,omitempty"`
	// PrefixRouting tunes tier 1 (on by default).
	PrefixRouting *PrefixRouting `json:"prefix_routing,omitempty"`
	// KVIndex turns tier 4 on with these settings; a backend with a ZMQ endpoint turns it on
	// with the defaults (an in-memory index).
	KVIndex *KVIndex `json:"kv_index,omitempty"`
	// Tokenizer supplies tier 4's token IDs; nil means kvroute's default: the engines' /tokenize
	// with ZMQ events, estimated tokens without events.
	Tokenizer *Tokenizer `json:"tokenizer,omitempty"`
	// ResponseCache turns the response cache (tiers 2 and 3) on with these settings.
	ResponseCache *ResponseCache `json:"response_cache,omitempty"`
	// DisableResponseHeaders leaves out the X-Kvroute-* response headers.
	DisableResponseHeaders bool `json:"disable_response_headers,omitempty"`

	key     string // the pool key: the configuration's JSON
	entry   *entry
	maxBody int64
	logger  *zap.Logger
}

// Backend is one engine: a reverse_proxy upstream.
type Backend struct {
	// Address is the upstream's dial address, "host:port" (required).
	Address string `json:"address"`
	// Weight is its relative capacity (0 means 1).
	Weight float64 `json:"weight,omitempty"`
	// Model is the model it serves; "" serves any. The engine tokenizer asks only backends that
	// serve the request's model, and the KV events' block keys are rooted in it.
	Model string `json:"model,omitempty"`
	// URL is the engine's HTTP root for /tokenize; "" means http://Address.
	URL string `json:"url,omitempty"`
	// ZMQEndpoint is the engine's KV-events PUB socket (vLLM's --kv-events-config endpoint,
	// e.g. tcp://10.0.0.1:5557); setting it turns tier 4 on. ZMQReplayEndpoint is its replay
	// socket, which fills sequence gaps and catches up on what the engine cached before Caddy
	// subscribed.
	ZMQEndpoint       string `json:"zmq_endpoint,omitempty"`
	ZMQReplayEndpoint string `json:"zmq_replay_endpoint,omitempty"`
}

// PrefixRouting is tier 1's settings (kvroute's prefix_routing); zero values mean kvroute's
// defaults.
type PrefixRouting struct {
	// Disabled turns tier 1 off: requests tier 4 does not route go through selection_strategy.
	Disabled bool `json:"disabled,omitempty"`
	// MaxPrefixLength is the prompt bytes hashed into the prefix key (default 1024).
	MaxPrefixLength int `json:"max_prefix_length,omitempty"`
	// LoadFactorEpsilon is CHWBL's ε (default 0.25).
	LoadFactorEpsilon float64 `json:"load_factor_epsilon,omitempty"`
	// VirtualNodes per backend on the ring (default 150).
	VirtualNodes int `json:"virtual_nodes,omitempty"`
}

// KVIndex is tier 4's settings (kvroute's kv_cache_index); zero values mean kvroute's defaults.
type KVIndex struct {
	// Backend is memory (default) or redis.
	Backend string `json:"backend,omitempty"`
	// RedisURL is the Redis index's server (backend redis), redis://[user:password@]host:port[/db];
	// Caddy placeholders such as {env.REDIS_URL} are replaced at provisioning. Default: the
	// response cache's Redis, else redis://127.0.0.1:6379.
	RedisURL string `json:"redis_url,omitempty"`
	// BlockSize is the engines' KV block size in tokens (default 16).
	BlockSize int `json:"block_size,omitempty"`
	// MaxEntries is the most prefix entries tracked (default 100000).
	MaxEntries int `json:"max_entries,omitempty"`
	// EntryTTL is how long an entry lives after its last event (default 10m; whole seconds).
	EntryTTL caddy.Duration `json:"entry_ttl,omitempty"`
	// MinOverlapThreshold is the fraction of a request a backend must hold for tier 4 to take
	// over (default 0.3).
	MinOverlapThreshold float64 `json:"min_overlap_threshold,omitempty"`
	// LoadFactorEpsilon bounds tier 4's choices (default 5 under the expected-TTFT scorer:
	// kvroute.DefaultKVLoadFactorEpsilonExpectedTTFT).
	LoadFactorEpsilon float64 `json:"load_factor_epsilon,omitempty"`
	// Speculation is speculate (default with events), approximate (default without) or off.
	Speculation string `json:"speculation,omitempty"`
}

// Tokenizer is tier 4's tokenizer (kvroute's kv_cache_index.tokenizer).
type Tokenizer struct {
	// Mode is engine (the backends' /tokenize: the first healthy backend serving the request's
	// model, in configuration order, then the next when it fails), estimate (pseudo tokens from
	// the prompt's bytes) or none.
	Mode string `json:"mode,omitempty"`
	// Timeout bounds one /tokenize call (default 100ms).
	Timeout caddy.Duration `json:"timeout,omitempty"`
}

// ResponseCache is the response cache's settings (kvroute's response_cache); zero values mean
// kvroute's defaults. Only requests with an explicit temperature 0 are cached.
type ResponseCache struct {
	// Backend is memory (default) or redis.
	Backend string `json:"backend,omitempty"`
	// RedisURL is the Redis server (backend redis); placeholders are replaced at provisioning.
	// Default redis://127.0.0.1:6379.
	RedisURL string `json:"redis_url,omitempty"`
	// Capacity is the in-memory store's entries (default 1000).
	Capacity int `json:"capacity,omitempty"`
	// TTL of a cached response (default 5m).
	TTL caddy.Duration `json:"ttl,omitempty"`
	// MaxResponseSize is the largest cached response body in bytes (default 1 MiB).
	MaxResponseSize int `json:"max_response_size,omitempty"`
	// TenantHeader names the request header that identifies the caller's tenant; "" means a
	// digest of the caller's credential (Authorization, X-Api-Key, api-key).
	TenantHeader string `json:"tenant_header,omitempty"`
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.kvroute",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision builds the handler's Router, or takes the one a previous configuration with the
// same kvroute settings built (see "Reloads" in the package documentation).
func (h *Handler) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	h.maxBody = h.MaxBodySize
	if h.maxBody <= 0 {
		h.maxBody = config.DefaultMaxBodyBytes
	}
	key, err := h.poolKey()
	if err != nil {
		return err
	}
	v, loaded, err := routers.LoadOrNew(key, func() (caddy.Destructor, error) {
		return newEntry(h, key, ctx.Slogger())
	})
	if err != nil {
		return fmt.Errorf("kvroute: %w", err)
	}
	h.key, h.entry = key, v.(*entry)
	if loaded {
		h.logger.Info("kvroute router reused", zap.String("router", h.entry.id),
			zap.Int("backends", len(h.Backends)))
	} else {
		h.logger.Info("kvroute router built", zap.String("router", h.entry.id),
			zap.Int("backends", len(h.Backends)), zap.Bool("kv_index", h.entry.kvOn),
			zap.Bool("response_cache", h.entry.cache != nil))
	}
	return nil
}

// Cleanup drops the handler's reference to its Router; the last reference closes it.
func (h *Handler) Cleanup() error {
	if h.key == "" {
		return nil
	}
	_, err := routers.Delete(h.key)
	h.key, h.entry = "", nil
	return err
}

// ServeHTTP routes a POST to an LLM endpoint (/v1/chat/completions, /v1/completions,
// /v1/messages) and passes it on to next; any other request passes on untouched.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	format := prefixkey.FormatOfPath(r.URL.Path)
	if format == 0 || r.Method != http.MethodPost {
		return next.ServeHTTP(w, r)
	}
	body, err := readBody(r, h.maxBody)
	if err != nil {
		switch {
		case errors.Is(err, errTooLarge):
			w.Header().Set("Connection", "close")
			apierror.Error{Status: http.StatusRequestEntityTooLarge, Code: "request_too_large",
				Message: "the request body is over " + strconv.FormatInt(h.maxBody, 10) + " bytes"}.Write(w, format)
		case r.Context().Err() != nil:
			// The client is gone; nobody reads an answer.
		default:
			apierror.Error{Status: http.StatusBadRequest, Code: "invalid_request_error",
				Message: "cannot read the request body: " + err.Error()}.Write(w, format)
		}
		return nil
	}
	req, err := prefixkey.Parse(format, body)
	if err != nil {
		e := apierror.Error{Status: http.StatusBadRequest, Code: "invalid_request_error", Message: err.Error()}
		if fe, ok := errors.AsType[*prefixkey.FieldError](err); ok {
			e.Param = fe.Field
		}
		e.Write(w, format)
		return nil
	}
	st := &request{h: h, entry: h.entry, format: format, req: req, body: body, next: next}
	r = r.WithContext(context.WithValue(r.Context(), stateKey{}, st))
	setBody(r, body)
	if st.entry.cached != nil {
		st.entry.cached.ServeHTTP(w, r.WithContext(withParsed(r.Context(), body, req)))
		return st.err
	}
	return st.serve(w, r)
}

// errTooLarge is readBody's error for a body over the limit.
var errTooLarge = errors.New("request body too large")

// readBody reads r's body, at most limit bytes.
func readBody(r *http.Request, limit int64) ([]byte, error) {
	if r.ContentLength > limit {
		return nil, errTooLarge
	}
	if r.Body == nil {
		return nil, nil
	}
	n := r.ContentLength
	if n < 0 {
		n = 512
	}
	buf := bytes.NewBuffer(make([]byte, 0, n+1))
	if _, err := buf.ReadFrom(io.LimitReader(r.Body, limit+1)); err != nil {
		return nil, err
	}
	if int64(buf.Len()) > limit {
		return nil, errTooLarge
	}
	return buf.Bytes(), nil
}

// setBody gives r body as its request body, for every attempt of the proxy.
func setBody(r *http.Request, body []byte) {
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	r.TransferEncoding = nil
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
}

// routeError answers a Route error in the API's style.
func routeError(w http.ResponseWriter, r *http.Request, format prefixkey.Format, err error) error {
	switch {
	case errors.Is(err, kvroute.ErrNoBackend):
		w.Header().Set("Retry-After", "1")
		apierror.Error{Status: http.StatusServiceUnavailable, Code: "no_healthy_backend",
			Message: "no healthy backend is available"}.Write(w, format)
	case r.Context().Err() != nil:
		// The client is gone; nobody reads an answer.
	default:
		apierror.Error{Status: http.StatusInternalServerError, Code: "internal_error",
			Message: "routing failed"}.Write(w, format)
	}
	return nil
}

// parseHandlerCaddyfile sets up the handler from the kvroute directive.
func parseHandlerCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	m := new(Handler)
	err := m.UnmarshalCaddyfile(h.Dispenser)
	return m, err
}

// Interface guards.
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
