package respcache

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvroute/kvroute/prefixkey"
)

// DefaultMaxBodyBytes is the default Config.MaxBodyBytes: request bodies larger than 8 MiB are
// forwarded untouched (X-Cache: BYPASS).
const DefaultMaxBodyBytes = 8 << 20

// maxEntryBody bounds MaxResponseSize and MaxStreamBufferSize: an entry stores its body length in
// 32 bits.
const maxEntryBody = 1<<31 - 1

// HeaderXCache is the response header that tells the cache disposition of every response passing
// through the middleware: "HIT", "MISS" or "BYPASS".
const HeaderXCache = "X-Cache"

// Values of the X-Cache header.
const (
	XCacheHit    = "HIT"
	XCacheMiss   = "MISS"
	XCacheBypass = "BYPASS"
)

// Config configures a Cache. The zero value is valid: an in-process MemoryStore with its defaults,
// DefaultTTL, kvroute's size limits, streaming responses cached, only an explicit temperature 0
// cached, coalescing on, the default OpenAI/Anthropic parser, tenants told apart by their
// credentials (CredentialTenant), DefaultMaxBodyBytes, no metrics, no spans.
type Config struct {
	// Store holds the serialized responses. Nil means NewMemory(MemoryConfig{DefaultTTL: TTL, Now:
	// Now}): DefaultCapacity entries in this process.
	Store CacheStore

	// TTL is the time-to-live of each stored response. 0 means DefaultTTL (5m); negative is invalid.
	TTL time.Duration

	// MaxResponseSize bounds the body of a non-streaming response that may be stored. 0 means
	// DefaultMaxResponseSize (1 MiB); negative or above 2 GiB − 1 is invalid.
	MaxResponseSize int

	// MaxStreamBufferSize bounds the recorded copy of a streaming (SSE) response: past it the
	// recording stops and the stream, still relayed to the client in full, is not stored. 0 means
	// DefaultMaxStreamBufferSize (10 MiB); negative or above 2 GiB − 1 is invalid.
	MaxStreamBufferSize int

	// DisableStreaming makes streaming requests ("stream": true) ineligible (X-Cache: BYPASS).
	// By default they are cached: recorded while they stream and replayed as SSE on a hit.
	DisableStreaming bool

	// AssumeGreedyDefault makes requests without a temperature eligible, as if they had asked for
	// temperature 0 (Policy.AssumeGreedyDefault). By default they are not (X-Cache: BYPASS): OpenAI
	// and Anthropic both default an absent temperature to 1. Set it only for a fleet whose engines
	// decode greedily by default.
	AssumeGreedyDefault bool

	// DisableCoalescing turns request coalescing off: by default concurrent identical eligible
	// requests share one call to the wrapped handler (see the Cache doc).
	DisableCoalescing bool

	// Parse turns a request's URL path and body into a prefixkey.Request. An error, or a nil
	// Request, means the request is not cacheable (X-Cache: BYPASS; the body is forwarded intact and
	// the wrapped handler answers it). Nil means DefaultParse. It must be safe for concurrent use.
	Parse func(path string, body []byte) (*prefixkey.Request, error)

	// Tenant names the tenant of a request; it goes into the cache key (and so into the
	// coalescing of concurrent requests), so that tenants never share entries: a cached response
	// is only ever served to a request of the tenant that made it. Its result replaces any
	// Request.Tenant that Parse set; "" is the one anonymous tenant. It must be safe for concurrent
	// use and must not read the request body.
	//
	// Nil means CredentialTenant: a digest of the request's Authorization, X-Api-Key and api-key
	// headers, requests with none of them sharing the anonymous tenant. HeaderTenant names the
	// tenant by a header that an authenticating gateway sets instead.
	Tenant func(*http.Request) string

	// SharedAcrossTenants turns tenant isolation off: with it every caller, whatever its
	// credentials, shares every entry. Only for a cache behind a single trusted client, or whose
	// callers may all see each other's responses. Setting both it and Tenant is invalid.
	SharedAcrossTenants bool

	// MaxBodyBytes bounds how much of a request body the middleware reads to parse it. A larger
	// body is forwarded intact (X-Cache: BYPASS). 0 means DefaultMaxBodyBytes; negative is invalid.
	MaxBodyBytes int64

	// Headers lists response headers stored and replayed besides Content-Type and
	// Content-Language (which always are). Set-Cookie and hop-by-hop headers are never stored.
	Headers []string

	// MeterProvider receives the Cache's metrics (see the Metric* constants). Nil means no metrics.
	MeterProvider metric.MeterProvider

	// TracerProvider receives the Cache's spans (telemetry.SpanResponseCacheLookup). Nil means none.
	TracerProvider trace.TracerProvider

	// Now is the clock handed to the default MemoryStore. Nil means time.Now.
	Now func() time.Time
}

// Cache is the response cache's HTTP layer: Middleware serves repeated deterministic LLM requests
// from a CacheStore, streams included. All methods are safe for concurrent use. A Cache starts no
// goroutine; Close only unregisters its metric callback. Make one with New.
//
// # Disposition
//
// Every response that passes through the middleware carries X-Cache, set before its first byte:
//   - BYPASS: the request is not a POST, its path or body does not parse, its body is over
//     MaxBodyBytes, or it is ineligible (temperature other than 0, temperature absent without
//     AssumeGreedyDefault, n > 1, streaming with DisableStreaming);
//     the request goes to the wrapped handler untouched and nothing is stored;
//   - HIT: the response comes from the store, or from a concurrent identical request (coalescing);
//     the wrapped handler is not called;
//   - MISS: the wrapped handler answers; a copy is recorded and stored when the response is a 200
//     within the size limits, not content-encoded, and, for a stream, complete (the terminal SSE
//     event seen: OpenAI "data: [DONE]", Anthropic "event: message_stop"). A stream whose
//     terminal event was recorded is complete and stored even if the client then leaves (the SDKs
//     close the connection on reading it) and the handler ends with a write error, a cancelled
//     context or a panic such as http.ErrAbortHandler; what it writes after that point, once nobody
//     listens, is not recorded. A stream whose client left before the terminal event is not stored.
//
// # Coalescing
//
// Concurrent eligible requests with the same key — the same tenant included, so a request never
// receives another tenant's response — make one call to the wrapped handler (the leader's); the
// others wait, attached to that call:
//   - a non-streaming response is shared when the leader's handler returns, if it is storable;
//   - a streaming (SSE) response is followed live: each waiter writes what has been recorded so
//     far and then every piece as the leader's handler writes it, flushing after each, so waiters
//     see tokens as soon as the leader's client does. A request arriving while the stream is still
//     being recorded joins it the same way.
//
// Waiters fall back to calling the wrapped handler themselves (X-Cache: MISS) when the response
// turns out not to be shareable before they wrote anything: a status other than 200, a
// content-encoded response, a non-streaming body over MaxResponseSize, a leader whose handler
// panicked before the stream started, or a stream that outgrew MaxStreamBufferSize before they
// joined. A waiter already following a stream keeps following it to its end, past
// MaxStreamBufferSize too (the pieces are then relayed without being stored, and each is released
// once every follower has written it); it ends as the leader's stream ends, cleanly or not, and when
// the leader's handler panicked it aborts its own response with http.ErrAbortHandler, as
// httputil.ReverseProxy does when its upstream fails mid-body.
//
// A waiter whose request context ends leaves at once, having written nothing if it had not started
// (the client is gone), without affecting the leader or the other waiters. Conversely, the leader's
// handler runs under a context that keeps its values but is not cancelled by the leader's client
// leaving while waiters are attached: the call goes on for them (the leader's writes then go
// nowhere) and is cancelled when the last waiter leaves.
type Cache struct {
	store       CacheStore
	ttl         atomic.Int64 // time.Duration: SetTTL changes it while requests are served
	policy      Policy
	maxResp     int
	maxStream   int
	parse       func(string, []byte) (*prefixkey.Request, error)
	tenant      func(*http.Request) string
	maxBody     int64
	coalesce    bool
	keepHeaders []string // canonical names of the response headers stored

	gen          atomic.Uint64 // bumped by Invalidate: responses recorded across it are not kept
	settled      atomic.Uint64 // bumped after each stored response (see serveCoalesced)
	defaultParse bool

	mu      sync.Mutex
	flights map[Key]*flight

	counters *cacheCounters // apart from the Cache: the metric callback keeps them (cacheMetrics)
	metrics  *cacheMetrics
	tracer   trace.Tracer // nil when tracing is off (Config.TracerProvider)
}

// New returns a Cache configured by cfg. It returns an error wrapping ErrInvalidConfig when a field
// is out of range, or the error of building the default store or the metric instruments.
func New(cfg Config) (*Cache, error) {
	switch {
	case cfg.TTL < 0:
		return nil, fmt.Errorf("%w: TTL %v < 0", ErrInvalidConfig, cfg.TTL)
	case cfg.MaxResponseSize < 0 || cfg.MaxResponseSize > maxEntryBody:
		return nil, fmt.Errorf("%w: max response size %d out of [0, %d]", ErrInvalidConfig, cfg.MaxResponseSize, maxEntryBody)
	case cfg.MaxStreamBufferSize < 0 || cfg.MaxStreamBufferSize > maxEntryBody:
		return nil, fmt.Errorf("%w: max stream buffer size %d out of [0, %d]", ErrInvalidConfig, cfg.MaxStreamBufferSize, maxEntryBody)
	case cfg.MaxBodyBytes < 0:
		return nil, fmt.Errorf("%w: max body bytes %d < 0", ErrInvalidConfig, cfg.MaxBodyBytes)
	case cfg.SharedAcrossTenants && cfg.Tenant != nil:
		return nil, fmt.Errorf("%w: Tenant set with SharedAcrossTenants", ErrInvalidConfig)
	}
	if cfg.Tenant == nil && !cfg.SharedAcrossTenants {
		cfg.Tenant = CredentialTenant
	}
	if cfg.TTL == 0 {
		cfg.TTL = DefaultTTL
	}
	if cfg.MaxResponseSize == 0 {
		cfg.MaxResponseSize = DefaultMaxResponseSize
	}
	if cfg.MaxStreamBufferSize == 0 {
		cfg.MaxStreamBufferSize = DefaultMaxStreamBufferSize
	}
	if cfg.MaxBodyBytes == 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	defaultParse := cfg.Parse == nil
	if defaultParse {
		cfg.Parse = DefaultParse
	}
	if cfg.Store == nil {
		s, err := NewMemory(MemoryConfig{DefaultTTL: cfg.TTL, Now: cfg.Now})
		if err != nil {
			return nil, err
		}
		cfg.Store = s
	}
	keep := []string{"Content-Type", "Content-Language"}
	for _, h := range cfg.Headers {
		h = http.CanonicalHeaderKey(strings.TrimSpace(h))
		switch h {
		case "", "Set-Cookie", "Content-Length", "Content-Encoding", "Transfer-Encoding", "Connection",
			"Keep-Alive", "Trailer", "Upgrade", "Te", "Proxy-Connection", "Proxy-Authenticate", HeaderXCache:
			return nil, fmt.Errorf("%w: header %q cannot be stored", ErrInvalidConfig, h)
		}
		keep = append(keep, h)
	}
	c := &Cache{
		store: cfg.Store,
		policy: Policy{
			CacheStreaming:      !cfg.DisableStreaming,
			AssumeGreedyDefault: cfg.AssumeGreedyDefault,
			MaxResponseSize:     cfg.MaxResponseSize,
			MaxStreamBufferSize: cfg.MaxStreamBufferSize,
		},
		maxResp:      cfg.MaxResponseSize,
		maxStream:    cfg.MaxStreamBufferSize,
		parse:        cfg.Parse,
		tenant:       cfg.Tenant,
		maxBody:      cfg.MaxBodyBytes,
		coalesce:     !cfg.DisableCoalescing,
		defaultParse: defaultParse,
		keepHeaders:  keep,
		flights:      make(map[Key]*flight),
		counters:     &cacheCounters{},
		tracer:       newTracer(cfg.TracerProvider),
	}
	c.ttl.Store(int64(cfg.TTL))
	m, err := newCacheMetrics(cfg.MeterProvider, c)
	if err != nil {
		return nil, err
	}
	c.metrics = m
	return c, nil
}

// SetTTL changes the time-to-live of the responses stored from now on (Config.TTL: 0 means
// DefaultTTL); responses already stored keep theirs. It returns an error wrapping ErrInvalidConfig
// for a negative ttl. It is safe for concurrent use with serving, e.g. on a configuration reload.
func (c *Cache) SetTTL(ttl time.Duration) error {
	if ttl < 0 {
		return fmt.Errorf("%w: TTL %v < 0", ErrInvalidConfig, ttl)
	}
	if ttl == 0 {
		ttl = DefaultTTL
	}
	c.ttl.Store(int64(ttl))
	return nil
}

// TTL returns the time-to-live of the responses stored from now on. It is safe for concurrent use.
func (c *Cache) TTL() time.Duration { return time.Duration(c.ttl.Load()) }

// DefaultParse is the parser of Config.Parse when none is given. It picks the format by the
// suffix of the URL path: "/v1/chat/completions" → OpenAI chat, "/v1/completions" → OpenAI
// completions, "/v1/messages" → Anthropic messages; any other path returns ErrUnknownPath.
// It is safe for concurrent use.
func DefaultParse(path string, body []byte) (*prefixkey.Request, error) {
	f := prefixkey.FormatOfPath(path)
	if f == 0 {
		return nil, ErrUnknownPath
	}
	return prefixkey.Parse(f, body)
}

// ErrUnknownPath is returned by DefaultParse for a URL path it does not know.
var ErrUnknownPath = errors.New("respcache: not an LLM API path")

// KeyFor returns the store key of r's response: KeyOf(r) as hex, the form Invalidate takes. Set
// r.Tenant as the Cache's tenant function would (CredentialTenant of the client's request unless
// Config says otherwise), or the key is another tenant's. It is safe for concurrent use.
func KeyFor(r *prefixkey.Request) string { return KeyOf(r).String() }

// parsedKey is the context key of WithParsedRequest's value.
type parsedKey struct{}

type parsed struct {
	body []byte
	req  *prefixkey.Request
}

// WithParsedRequest returns a copy of ctx that hands the middleware a request body its caller has
// already read and parsed: req must be what Config.Parse makes of body (the middleware sets its
// Tenant). The middleware then neither reads nor parses the body again: a gateway that parses
// each request for routing anyway saves the second pass. A body over the cache's MaxBodyBytes is
// passed through as usual.
func WithParsedRequest(ctx context.Context, body []byte, req *prefixkey.Request) context.Context {
	return context.WithValue(ctx, parsedKey{}, &parsed{body: body, req: req})
}

// Middleware returns a handler that serves eligible requests from the cache and passes the others
// to next (see the Cache doc for the dispositions). next is called without any lock held, at most
// once per request, with the request body restored byte for byte.
func (c *Cache) Middleware(next http.Handler) http.Handler {
	return &cacheHandler{c: c, next: next}
}

type cacheHandler struct {
	c    *Cache
	next http.Handler
}

// ServeHTTP serves r: BYPASS, HIT, or MISS through next (see the Cache doc).
func (m *cacheHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	c := m.c
	if r.Method != http.MethodPost {
		c.bypass(w, r, m.next)
		return
	}
	if c.defaultParse && prefixkey.FormatOfPath(r.URL.Path) == 0 {
		c.bypass(w, r, m.next) // not an LLM API path: do not even read the body
		return
	}
	var (
		body []byte
		req  *prefixkey.Request
		err  error
	)
	if pre, _ := r.Context().Value(parsedKey{}).(*parsed); pre != nil && int64(len(pre.body)) <= c.maxBody {
		body, req = pre.body, pre.req
	} else {
		var ok bool
		if body, ok = c.readBody(r); !ok {
			c.bypass(w, r, m.next)
			return
		}
		req, err = c.parse(r.URL.Path, body)
	}
	if err != nil || req == nil {
		restoreBody(r, body)
		c.bypass(w, r, m.next)
		return
	}
	if ok, _ := c.policy.Request(req); !ok {
		restoreBody(r, body)
		c.bypass(w, r, m.next)
		return
	}
	if c.tenant != nil {
		req.Tenant = c.tenant(r)
	}
	key := KeyOf(req)
	skey := key.String()
	settled := c.settled.Load()
	if e := c.lookup(r.Context(), skey); e != nil {
		c.counters.result(dispHit)
		c.replay(w, e)
		return
	}
	restoreBody(r, body)
	if c.coalesce {
		c.serveCoalesced(w, r, m.next, key, skey, settled)
		return
	}
	c.counters.result(dispMiss)
	c.fill(w, r, m.next, skey, nil)
}

// bypass forwards r to next with X-Cache: BYPASS and stores nothing.
func (c *Cache) bypass(w http.ResponseWriter, r *http.Request, next http.Handler) {
	c.counters.result(dispSkip)
	setXCache(w.Header(), XCacheBypass)
	rw := &recorder{w: w, xcache: XCacheBypass}
	next.ServeHTTP(rw, r)
}

// readBody reads r's body up to MaxBodyBytes. ok is false when the body is larger or cannot be
// read; r.Body then yields the same bytes (and the same read error) as it would have.
func (c *Cache) readBody(r *http.Request) (body []byte, ok bool) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, true
	}
	if r.ContentLength > c.maxBody {
		return nil, false
	}
	n := r.ContentLength
	if n < 0 {
		n = 512
	}
	// +1: room to see io.EOF without growing; a declared length is trusted up to 1 MiB only.
	buf := make([]byte, 0, min(n, 1<<20)+1)
	for {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		k, err := r.Body.Read(buf[len(buf):min(cap(buf), int(c.maxBody)+1)])
		buf = buf[:len(buf)+k]
		if int64(len(buf)) > c.maxBody {
			r.Body = &prefixedBody{Reader: io.MultiReader(bytes.NewReader(buf), r.Body), orig: r.Body}
			return nil, false
		}
		if err == io.EOF {
			return buf, true
		}
		if err != nil {
			r.Body = &prefixedBody{Reader: io.MultiReader(bytes.NewReader(buf), errReader{err}), orig: r.Body}
			return nil, false
		}
	}
}

// prefixedBody replays what readBody consumed, then the rest; Close closes the original body.
type prefixedBody struct {
	io.Reader
	orig io.ReadCloser
}

// Close closes the original body.
func (b *prefixedBody) Close() error { return b.orig.Close() }

// errReader fails every Read with err: the read error readBody met, replayed for next.
type errReader struct{ err error }

// Read returns the error.
func (e errReader) Read([]byte) (int, error) { return 0, e.err }

// restoreBody gives r a body that yields body again, with GetBody for the transport's retries.
func restoreBody(r *http.Request, body []byte) {
	if r.Body == nil || r.Body == http.NoBody {
		return
	}
	r.Body = &prefixedBody{Reader: bytes.NewReader(body), orig: r.Body}
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
}

// get returns the stored entry under key, or nil on a miss, a store error or a corrupt entry
// (both counted, and traced).
func (c *Cache) get(ctx context.Context, key string) *storedResponse {
	v, ok, err := c.store.Get(ctx, key)
	if err != nil {
		if ctx.Err() == nil { // the client leaving is not the store's failure
			c.counters.storeError(seGet)
		}
		c.traceError(ctx, err)
		return nil
	}
	if !ok {
		return nil
	}
	e, err := decodeEntry(v)
	if err != nil {
		c.counters.storeError(seCorrupt)
		c.traceError(ctx, err)
		return nil
	}
	return e
}

// xcacheValues are the values of X-Cache, shared (read-only; capped so that an append copies):
// setting the header allocates nothing.
var xcacheValues = [...][]string{{XCacheHit}, {XCacheMiss}, {XCacheBypass}}

// setXCache sets X-Cache to v in h, as h.Set would.
func setXCache(h http.Header, v string) {
	for _, vs := range xcacheValues {
		if vs[0] == v {
			h[HeaderXCache] = vs[:1:1]
			return
		}
	}
	h.Set(HeaderXCache, v)
}

// noCache is the Cache-Control of a replayed stream, shared (read-only; capped so that an append
// copies).
var noCache = []string{"no-cache"}

// replay writes a stored (or shared) response with X-Cache: HIT.
func (c *Cache) replay(w http.ResponseWriter, e *storedResponse) {
	h := w.Header()
	e.setHeaders(h)
	setXCache(h, XCacheHit)
	if e.stream {
		h.Del("Content-Length")
		if _, ok := h["Cache-Control"]; !ok {
			h["Cache-Control"] = noCache[:1:1] // as a live event stream is served
		}
		w.WriteHeader(e.status)
		replayStream(w, e.body)
		return
	}
	h.Set("Content-Length", strconv.Itoa(len(e.body)))
	w.WriteHeader(e.status)
	_, _ = w.Write(e.body)
}

// fill calls next with a recording ResponseWriter (X-Cache: MISS) and stores the response when it
// is storable. fl, when not nil, is the flight this request leads: it receives the recording as it
// grows and the outcome.
func (c *Cache) fill(w http.ResponseWriter, r *http.Request, next http.Handler, key string, fl *flight) {
	gen := c.gen.Load()
	setXCache(w.Header(), XCacheMiss)
	rec := &recorder{w: w, xcache: XCacheMiss, c: c, fl: fl, capture: true, ctx: r.Context()}
	completed := false
	defer func() {
		if completed {
			return
		}
		// next panicked. A stream whose terminal event was already recorded is complete all the
		// same: httputil.ReverseProxy, for one, aborts with http.ErrAbortHandler when the client
		// leaves right after reading "data: [DONE]" and the upstream read is cancelled. Store it
		// and let followers end cleanly; otherwise waiters that have not started fall back and
		// followers abort. The panic goes on once this returns.
		var value []byte
		var e *storedResponse
		if rec.streamComplete() {
			value, e = rec.result()
		}
		if fl != nil {
			fl.finish(e, e == nil)
		}
		if value != nil {
			c.keep(w, r, key, value, gen, rec.clientGone)
		}
	}()
	next.ServeHTTP(rec, r)
	completed = true
	value, e := rec.result()
	if fl != nil {
		fl.finish(e, false)
	}
	if value != nil {
		c.keep(w, r, key, value, gen, rec.clientGone)
	}
}

// keep stores value, the envelope of a complete response recorded by fill since generation gen,
// under key. clientGone skips the flush to a client known to be gone.
func (c *Cache) keep(w http.ResponseWriter, r *http.Request, key string, value []byte, gen uint64, clientGone bool) {
	if c.gen.Load() != gen {
		return // invalidated while recording
	}
	// The response is complete for the client; push out what is buffered before the store
	// round-trip, so that a slow store does not delay the client.
	if !clientGone {
		_ = http.NewResponseController(w).Flush()
	}
	ctx := context.WithoutCancel(r.Context())
	if err := c.store.Set(ctx, key, value, c.TTL()); err != nil {
		c.counters.storeError(seSet)
		return
	}
	if c.gen.Load() != gen {
		// Invalidate ran during the Set: it may have cleared before the value landed.
		if err := c.store.Delete(ctx, key); err != nil {
			c.counters.storeError(seDelete)
		}
		return
	}
	c.settled.Add(1)
}

// recorder is the ResponseWriter the wrapped handler gets: it sets X-Cache when the header is
// written, passes every Write and Flush straight through and, when capturing, records a copy of a
// 200 response into an entry envelope up to the size limit. It implements http.Flusher and
// Unwrap (for http.ResponseController). It is used by one handler goroutine.
type recorder struct {
	w       http.ResponseWriter
	xcache  string
	c       *Cache          // nil when not capturing
	fl      *flight         // the flight this request leads, or nil
	capture bool            // record 200 responses
	ctx     context.Context // the handler's request context, when capturing

	wroteHeader bool
	status      int
	stream      bool  // the response is SSE
	record      bool  // still recording
	limit       int   // body bytes that may be recorded
	declared    int64 // Content-Length, or -1
	buf         []byte
	bodyAt      int      // envelope prefix length: the body starts at buf[bodyAt]
	hdr         []string // the stored headers, name/value pairs, as the envelope holds them
	sse         sseScanner
	clientGone  bool // the client's connection failed while waiters depended on the flight
	// sealed: the client's connection failed, or the handler's context ended, after the stream's
	// terminal event was recorded. The recording is complete and kept as it is; later writes are
	// neither recorded nor relayed.
	sealed bool
}

// Header returns the underlying writer's header map.
func (rw *recorder) Header() http.Header { return rw.w.Header() }

// Unwrap returns the underlying ResponseWriter, for http.ResponseController.
func (rw *recorder) Unwrap() http.ResponseWriter { return rw.w }

// WriteHeader sets X-Cache, decides whether to record, and passes the header on.
func (rw *recorder) WriteHeader(code int) {
	if rw.wroteHeader {
		rw.w.WriteHeader(code) // superfluous: let the server report it
		return
	}
	if code >= 100 && code < 200 && code != http.StatusSwitchingProtocols {
		rw.w.WriteHeader(code) // informational: the final header comes later
		return
	}
	rw.wroteHeader = true
	rw.status = code
	h := rw.w.Header()
	setXCache(h, rw.xcache)
	if rw.capture {
		rw.startRecording(code, h)
	}
	if !rw.clientGone {
		rw.w.WriteHeader(code)
	}
}

func (rw *recorder) startRecording(code int, h http.Header) {
	c := rw.c
	rw.stream = isEventStream(h.Get("Content-Type"))
	rw.limit = c.maxResp
	if rw.stream {
		rw.limit = c.maxStream
	}
	rw.declared = -1
	if cl := h.Get("Content-Length"); cl != "" {
		if n, err := strconv.ParseInt(cl, 10, 64); err == nil {
			rw.declared = n
		}
	}
	enc := h.Get("Content-Encoding")
	rw.record = code == http.StatusOK && (enc == "" || strings.EqualFold(enc, "identity")) &&
		rw.declared <= int64(rw.limit)
	if !rw.record {
		if rw.fl != nil {
			rw.fl.fail()
		}
		return
	}
	hdr := selectHeaders(h, c.keepHeaders)
	rw.hdr = hdr[:2*min(len(hdr)/2, maxEntryHdrs)] // those the envelope keeps
	size := rw.declared
	if size < 0 {
		size = 1024
	}
	rw.buf = appendEntryPrefix(make([]byte, 0, int(size)+entryPrefixSize(hdr)+crcSize), code, rw.stream, hdr)
	rw.bodyAt = len(rw.buf)
	if rw.fl != nil {
		rw.fl.publishHeader(code, hdr, rw.stream)
	}
}

// Write passes p to the client, then records it.
func (rw *recorder) Write(p []byte) (int, error) {
	if !rw.wroteHeader {
		rw.WriteHeader(http.StatusOK)
	}
	// Whether the stream was complete before p: a write that fails while carrying the terminal
	// event does not count (the client left before the end), nor does one that starts after the
	// handler's context ended (nobody is listening any more). Once the stream is complete and
	// nobody listens, the recording is sealed as it is: what the handler writes afterwards (say,
	// keep-alive comments while it waits for the upstream) reached no client and is not stored.
	complete := rw.streamComplete()
	late := !rw.sealed && rw.record && rw.stream && rw.ctx != nil && rw.ctx.Err() != nil
	if late && complete {
		rw.sealed = true
	}
	n, err := len(p), error(nil)
	if !rw.clientGone {
		n, err = rw.w.Write(p)
	}
	if rw.capture {
		rw.capturePiece(p)
		if late && !complete && rw.streamComplete() {
			rw.stopRecording()
		}
	}
	if err != nil && rw.fl != nil && rw.fl.shieldLeader() {
		// The leader's client is gone but waiters follow this call: keep it going for them.
		rw.clientGone = true
		return len(p), nil
	}
	if err != nil {
		if complete {
			// The client left after the terminal event (SDKs close the connection as soon as
			// they read it): the recording is complete, keep it whatever the handler does next.
			rw.sealed = true
		} else {
			rw.stopRecording()
		}
	}
	return n, err
}

// streamComplete reports whether a stream is being recorded and its terminal event was recorded,
// with no error event: the recording is then complete, whatever the handler writes afterwards.
func (rw *recorder) streamComplete() bool {
	return rw.record && rw.stream && rw.wroteHeader && rw.sse.complete()
}

func (rw *recorder) capturePiece(p []byte) {
	if rw.sealed {
		return
	}
	if !rw.record {
		if rw.fl != nil && rw.wroteHeader {
			rw.fl.relay(p) // past the cap: followers still get it
		}
		return
	}
	if len(rw.buf)-rw.bodyAt+len(p) > rw.limit {
		rw.stopRecording()
		if rw.fl != nil {
			rw.fl.relay(p)
		}
		return
	}
	if need := len(rw.buf) + len(p); need > cap(rw.buf) {
		// Double (append grows large slices by only 1.25×), but never past what may be stored.
		nb := make([]byte, len(rw.buf), min(max(2*cap(rw.buf), need), rw.bodyAt+rw.limit+crcSize))
		copy(nb, rw.buf)
		rw.buf = nb
	}
	rw.buf = append(rw.buf, p...)
	if rw.stream {
		rw.sse.feed(p)
	}
	if rw.fl != nil {
		rw.fl.recorded(rw.buf[rw.bodyAt:], len(p))
	}
}

// stopRecording drops the recording: the response will not be stored.
func (rw *recorder) stopRecording() {
	if !rw.record {
		return
	}
	rw.record = false
	rw.buf = nil
	if rw.fl != nil {
		rw.fl.overflow()
	}
}

// Flush passes a flush on to the client.
func (rw *recorder) Flush() { _ = rw.FlushError() }

// FlushError passes a flush on to the client and returns its error (http.ResponseController
// prefers it to Flush).
func (rw *recorder) FlushError() error {
	if !rw.wroteHeader {
		rw.WriteHeader(http.StatusOK)
	}
	if rw.clientGone {
		return nil
	}
	var err error
	if f, ok := rw.w.(interface{ FlushError() error }); ok {
		err = f.FlushError()
	} else if f, ok := rw.w.(http.Flusher); ok {
		f.Flush()
	} else {
		err = http.NewResponseController(rw.w).Flush()
	}
	if err != nil && rw.fl != nil && rw.fl.shieldLeader() {
		rw.clientGone = true
		return nil
	}
	return err
}

// result returns the finished envelope and its decoded entry when the response is storable, or
// (nil, nil).
func (rw *recorder) result() ([]byte, *storedResponse) {
	if !rw.record || !rw.wroteHeader {
		return nil, nil
	}
	size := len(rw.buf) - rw.bodyAt
	if rw.declared >= 0 && int64(size) != rw.declared {
		return nil, nil // the handler wrote less (or more) than it announced
	}
	if rw.stream && !rw.sse.complete() {
		return nil, nil
	}
	if !rw.c.policy.Response(rw.status, size, rw.stream) {
		return nil, nil
	}
	v := finishEntry(rw.buf, rw.bodyAt)
	// What decodeEntry would make of v, without reading it again.
	return v, &storedResponse{status: rw.status, stream: rw.stream, header: rw.hdr, body: v[rw.bodyAt : len(v)-crcSize]}
}

// isEventStream reports whether a Content-Type is text/event-stream.
func isEventStream(ct string) bool {
	if i := strings.IndexByte(ct, ';'); i >= 0 {
		ct = ct[:i]
	}
	return strings.EqualFold(strings.TrimSpace(ct), "text/event-stream")
}

// selectHeaders returns the stored headers of h as name, value pairs in keep's order.
func selectHeaders(h http.Header, keep []string) []string {
	var out []string
	for _, name := range keep {
		for _, v := range h[name] {
			out = append(out, name, v)
		}
	}
	return out
}

// Entry envelope. A stored response is one binary value, version 1:
//
//	offset  size  field
//	0       4     magic "KVRC"
//	4       1     version: 1
//	5       1     flags: bit 0 set for an SSE stream (replayed event by event)
//	6       2     HTTP status, big endian
//	8       2     header count H, big endian
//	10      …     H headers: uvarint name length, name (canonical), uvarint value length, value
//	…       4     body length B, big endian
//	…       B     body: the bytes the wrapped handler wrote, unchanged
//	…       4     CRC-32C (Castagnoli) of every byte before it, big endian
//
// A value that is not exactly this (short, bad magic, unknown version, lengths that overrun, a CRC
// mismatch, trailing bytes) is corrupt: the middleware counts it and treats it as a miss. The body
// length field sits before the body so that the recorder can write the prefix before the first
// body byte and append the body as it streams, with no copy at the end.
const (
	entryMagic    = "KVRC"
	entryVersion  = 1
	entryFixed    = 10 // magic, version, flags, status, header count
	crcSize       = 4
	flagStream    = 1
	bodyLenSize   = 4
	maxEntryHdrs  = 1<<16 - 1
	entryMinBytes = entryFixed + bodyLenSize + crcSize
)

var entryCRCTable = crc32.MakeTable(crc32.Castagnoli)

// errCorruptEntry is returned by decodeEntry for a value that is not a valid envelope.
var errCorruptEntry = errors.New("respcache: corrupt cache entry")

// storedResponse is a decoded entry. body and the header strings may alias the stored value.
type storedResponse struct {
	status int
	stream bool
	header []string // name, value pairs
	body   []byte
}

// setHeaders sets e's headers in h: a stored name replaces whatever h held under it; several
// values of one name (stored next to each other) are all kept.
func (e *storedResponse) setHeaders(h http.Header) {
	for i := 0; i+1 < len(e.header); i += 2 {
		name := e.header[i]
		if i > 0 && e.header[i-2] == name {
			h[name] = append(h[name], e.header[i+1])
		} else {
			h[name] = []string{e.header[i+1]}
		}
	}
}

func entryPrefixSize(hdr []string) int {
	n := entryFixed + bodyLenSize
	for _, s := range hdr {
		n += binary.MaxVarintLen32 + len(s)
	}
	return n
}

// appendEntryPrefix appends everything up to and including the body length field (left zero).
func appendEntryPrefix(b []byte, status int, stream bool, hdr []string) []byte {
	b = append(b, entryMagic...)
	b = append(b, entryVersion)
	var flags byte
	if stream {
		flags |= flagStream
	}
	b = append(b, flags)
	b = binary.BigEndian.AppendUint16(b, uint16(status))
	n := min(len(hdr)/2, maxEntryHdrs)
	b = binary.BigEndian.AppendUint16(b, uint16(n))
	for _, s := range hdr[:2*n] {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	return append(b, 0, 0, 0, 0)
}

// finishEntry fills in the body length of an envelope whose body starts at bodyAt and appends the
// CRC.
func finishEntry(b []byte, bodyAt int) []byte {
	binary.BigEndian.PutUint32(b[bodyAt-bodyLenSize:], uint32(len(b)-bodyAt))
	return binary.BigEndian.AppendUint32(b, crc32.Checksum(b, entryCRCTable))
}

// encodeEntry returns e's envelope.
func encodeEntry(e *storedResponse) []byte {
	b := appendEntryPrefix(make([]byte, 0, entryPrefixSize(e.header)+len(e.body)+crcSize), e.status, e.stream, e.header)
	at := len(b)
	b = append(b, e.body...)
	return finishEntry(b, at)
}

// decodeEntry parses an envelope. The entry aliases v (its body and header strings point into it),
// so v must not be written afterwards. It never panics; any malformation is errCorruptEntry.
func decodeEntry(v []byte) (*storedResponse, error) {
	if len(v) < entryMinBytes || string(v[:4]) != entryMagic || v[4] != entryVersion {
		return nil, errCorruptEntry
	}
	data := v[:len(v)-crcSize]
	if crc32.Checksum(data, entryCRCTable) != binary.BigEndian.Uint32(v[len(v)-crcSize:]) {
		return nil, errCorruptEntry
	}
	e := &storedResponse{stream: v[5]&flagStream != 0, status: int(binary.BigEndian.Uint16(v[6:]))}
	n := int(binary.BigEndian.Uint16(v[8:]))
	p := data[entryFixed:]
	if n > 0 {
		if n > len(p)/2 { // each string takes at least one byte
			return nil, errCorruptEntry
		}
		e.header = make([]string, 2*n)
		for i := range e.header {
			l, k := binary.Uvarint(p)
			if k <= 0 || l > uint64(len(p)-k) {
				return nil, errCorruptEntry
			}
			e.header[i] = unsafe.String(unsafe.SliceData(p[k:]), int(l)) // v is never written
			p = p[k+int(l):]
		}
	}
	if len(p) < bodyLenSize {
		return nil, errCorruptEntry
	}
	bl := binary.BigEndian.Uint32(p)
	p = p[bodyLenSize:]
	if uint64(bl) != uint64(len(p)) {
		return nil, errCorruptEntry
	}
	e.body = p
	return e, nil
}
