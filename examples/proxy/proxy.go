package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/apierror"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/health"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/telemetry"
)

// Response headers the proxy adds to every routed response.
const (
	// HeaderBackend names the backend that answered.
	HeaderBackend = "X-Kvroute-Backend"
	// HeaderRoute is the routing decision's label (kvroute.Reason): prefix_hash, overflow,
	// fallback, strategy, kv_aware, load_bound, imbalance or least_work.
	HeaderRoute = "X-Kvroute-Route"
	// HeaderCachedTokens is how many of the prompt's tokens the chosen backend holds according to
	// the KV index; set when the KV index took part in the decision (kvroute.Reason.FromKVIndex).
	HeaderCachedTokens = "X-Kvroute-Cached-Tokens"
	// HeaderRetriedFrom names the backend whose failure made the proxy retry the request.
	HeaderRetriedFrom = "X-Kvroute-Retried-From"
)

type ctxKey int

const (
	parsedKey ctxKey = iota
	attemptKey
)

// parsedRequest is a request body that passed the proxy's checks, with its parsed form.
type parsedRequest struct {
	format prefixkey.Format
	req    *prefixkey.Request
	body   []byte
}

// lease is the Router's hold on a backend for one request: *kvroute.Decision or
// *kvroute.DisaggDecision.
type lease interface {
	FirstToken()
	Done(kvroute.Outcome)
}

// upstream is where one attempt goes and how its response is labelled.
type upstream struct {
	backend string
	route   string       // X-Kvroute-Route
	cached  string       // X-Kvroute-Cached-Tokens, when set
	plan    *disagg.Plan // the routing-path headers, when disaggregation is on
	lease   lease
	body    []byte // the request body to send
	// headerTimeout, when positive, bounds the wait for the backend's response headers (not the
	// body: streams may be long): kv_transfer_timeout after a remote prefill.
	headerTimeout time.Duration
	requestID     string // X-Request-Id to send, when set (the two phases share one)
}

// attempt is one forwarding of a request to one backend. It is also the context of the upstream
// call: the client's values and, for attemptKey, the attempt itself; for a stream (or a decode
// attempt) with a cancellation of its own (cancel), so that the call can outlive the client's
// context (see proxyTo). The attempt's parts live in one allocation: its ResponseWriter, its body
// reader, its response header values.
type attempt struct {
	// Context answers Done, Err and context.Cause: the client's context, or for a stream a
	// cancelCtx parented on nothing.
	context.Context
	client context.Context         // the client request's: values, and the cancellation that cancel follows
	cancel context.CancelCauseFunc // nil when Context is client

	lease     lease
	target    *url.URL
	stream    bool
	canRetry  bool   // a failure before the response may be retried elsewhere
	requestID string // X-Request-Id to set, when not empty
	body      []byte // the upstream request's body
	status    int    // the upstream's status, 0 before its response
	refused   bool   // the upstream declined the request for lack of capacity (health.Classify)
	err       error  // the transport's (or ModifyResponse's) error, before anything was written
	// headers is headersWaiting until the response headers arrive (headersArrived) or the header
	// timeout fires (headersTimedOut), whichever comes first.
	headers atomic.Int32

	w       attemptWriter
	grace   atomic.Pointer[time.Timer] // the stream-end grace timer, once the client has left
	bodyR   bytes.Reader
	reqBody io.ReadCloser // bodyR, as net/http recognises an in-memory body
	hdrs    [3]string     // the values of X-Kvroute-Backend, X-Kvroute-Route and X-Kvroute-Cached-Tokens
	plan    *disagg.Plan  // the routing-path headers, when set
	retried string        // X-Kvroute-Retried-From, when set
	span    trace.Span    // the attempt's upstream span, when tracing
}

// Value returns the attempt for attemptKey, and the client context's values otherwise (but for
// the attempt's own cancellation, which its embedded context answers).
func (a *attempt) Value(key any) any {
	if key == attemptKey {
		return a
	}
	if v := a.Context.Value(key); v != nil || a.cancel == nil {
		return v
	}
	return a.client.Value(key)
}

// clientGone runs when the client's context ends: it cancels the upstream call, at once or, when
// a stream's terminal event has already gone out, after streamEndGrace.
func (a *attempt) clientGone() {
	if a.w.ended.Load() {
		a.grace.Store(time.AfterFunc(streamEndGrace, func() { a.cancel(context.Canceled) }))
		return
	}
	a.cancel(context.Cause(a.client))
}

// setHeaders sets the proxy's own response headers in h.
func (a *attempt) setHeaders(h http.Header) {
	h[HeaderBackend] = a.hdrs[0:1:1]
	h[HeaderRoute] = a.hdrs[1:2:2]
	if a.hdrs[2] != "" {
		h[HeaderCachedTokens] = a.hdrs[2:3:3]
	} else {
		h.Del(HeaderCachedTokens)
	}
	if a.plan != nil {
		a.plan.SetHeaders(h)
	}
	if a.retried != "" {
		h.Set(HeaderRetriedFrom, a.retried)
	}
}

// getBody returns a new reader of the request body (http.Request.GetBody).
func (a *attempt) getBody() (io.ReadCloser, error) {
	return io.NopCloser(bytes.NewReader(a.body)), nil
}

// States of attempt.headers.
const (
	headersWaiting int32 = iota
	headersArrived
	headersTimedOut
)

// errKVTransferTimeout is the failure of a decode attempt whose backend did not answer within
// kv_transfer_timeout after the remote prefill.
var errKVTransferTimeout error = timeoutError("no response headers within kv_transfer_timeout")

// timeoutError is an error that reports itself as a timeout (errKind).
type timeoutError string

func (e timeoutError) Error() string { return string(e) }
func (e timeoutError) Timeout() bool { return true }

// errRetryStatus marks an upstream answer that the proxy retries on another backend on a first
// attempt, before anything reached the client: one that health.Classify finds failed or refused.
type errRetryStatus struct {
	code int
	ans  health.Answer
}

// Error says which status the upstream answered.
func (e *errRetryStatus) Error() string {
	return "upstream answered " + strconv.Itoa(e.code) + " (" + e.ans.String() + ")"
}

// refusal reports whether err is a backend's refusal for lack of room (health.AnswerRefused).
func refusal(err error) bool {
	e, ok := errors.AsType[*errRetryStatus](err)
	return ok && e.ans == health.AnswerRefused
}

// errCircuitOpen is the failure of an attempt whose backend's circuit breaker refused it: open, or
// half-open with its trial requests taken.
var errCircuitOpen = errors.New("circuit breaker open")

// errUpstreamAborted is the outcome of a response whose upstream failed mid-body.
var errUpstreamAborted = errors.New("upstream response aborted")

// copyBuffers lends ReverseProxy the buffers it copies response bodies through.
var copyBuffers httputil.BufferPool = &bufferPool{}

// bufferPool is an httputil.BufferPool of 32 KiB buffers (ReverseProxy's own size). It pools
// pointers to the buffers' arrays: a pointer to a slice would be an allocation per Put.
type bufferPool struct{ p sync.Pool }

// copyBufferSize is the size of bufferPool's buffers.
const copyBufferSize = 32 << 10

// Get returns a buffer of 32 KiB.
func (b *bufferPool) Get() []byte {
	if v, ok := b.p.Get().(*[copyBufferSize]byte); ok {
		return v[:]
	}
	return make([]byte, copyBufferSize)
}

// Put takes a buffer back for another response.
func (b *bufferPool) Put(buf []byte) {
	if cap(buf) < copyBufferSize {
		return
	}
	b.p.Put((*[copyBufferSize]byte)(buf[:copyBufferSize]))
}

// newReverseProxy returns the ReverseProxy every request goes through: its target comes from the
// request's attempt; errors before the response are recorded in the attempt for the caller to
// retry or answer, not written.
func (s *server) newReverseProxy() *httputil.ReverseProxy {
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			a := pr.In.Context().Value(attemptKey).(*attempt)
			pr.SetURL(a.target)
			pr.SetXForwarded()
			// ReverseProxy wraps the body in a reader net/http does not know to be in memory, which
			// makes the transport send the headers and the body in two writes; the body is ours and
			// in memory, so hand the transport a reader it recognises: one write per request.
			if pr.Out.Body != nil {
				a.bodyR.Reset(a.body)
				pr.Out.Body, pr.Out.ContentLength, pr.Out.GetBody = a.reqBody, int64(len(a.body)), a.getBody
			}
			// Identity bodies: cacheable and streamed as they come. The body is already read, so
			// the backend's own 100 Continue would reach the client as a second one.
			pr.Out.Header.Del("Accept-Encoding")
			pr.Out.Header.Del("Expect")
			if a.requestID != "" {
				pr.Out.Header.Set(headerRequestID, a.requestID)
			}
			if a.span != nil { // the backend continues the attempt's trace
				propagation.TraceContext{}.Inject(trace.ContextWithSpan(pr.Out.Context(), a.span), propagation.HeaderCarrier(pr.Out.Header))
			}
		},
		Transport: s.transport,
		// Without a pool ReverseProxy allocates a 32 KiB copy buffer per response: 73 % of the
		// bytes the proxy allocated under load, and with them a share of its GC work.
		BufferPool: copyBuffers,
		// FlushInterval 0: ReverseProxy flushes streams (text/event-stream, or no
		// Content-Length) after every write by itself, and writes a response of known length
		// with its headers in one go. -1 would also flush a plain JSON answer's headers apart
		// from its body, from a timer goroutine: two writes and a goroutine per request.
		ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
		ModifyResponse: func(res *http.Response) error {
			a := res.Request.Context().Value(attemptKey).(*attempt)
			if !a.headers.CompareAndSwap(headersWaiting, headersArrived) && a.headers.Load() == headersTimedOut {
				return errKVTransferTimeout
			}
			a.status = res.StatusCode
			if ans := health.Classify(res); ans != health.AnswerServed {
				a.refused = ans == health.AnswerRefused
				if a.canRetry {
					return &errRetryStatus{code: res.StatusCode, ans: ans}
				}
			}
			// The proxy's headers go with the final answer (ReverseProxy copies them over;
			// informational answers before it are relayed as the backend sent them), replacing
			// any the backend sent under the same names.
			a.setHeaders(res.Header)
			return nil
		},
		ErrorHandler: func(_ http.ResponseWriter, r *http.Request, err error) {
			a := r.Context().Value(attemptKey).(*attempt)
			a.err = err
		},
	}
}

// llmHandler serves one LLM API endpoint: body checks (413, 400), then the response cache, then
// forward.
func (s *server) llmHandler(format prefixkey.Format, endpoint string) http.Handler {
	// The response cache sits between the checks and forward: the parsed request reaches forward
	// through the request's context then. Without it the checks call forward themselves.
	var cached http.Handler
	if s.cache != nil {
		cached = s.cache.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			s.forward(w, r, r.Context().Value(parsedKey).(*parsedRequest))
		}))
	}
	m := s.tel.forEndpoint(endpoint)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.tracer != nil { // the request's span, continuing the client's W3C trace context
			ctx := propagation.TraceContext{}.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
			ctx, span := s.tracer.Start(ctx, "kvroute.proxy "+endpoint, trace.WithSpanKind(trace.SpanKindServer))
			defer span.End()
			r = r.WithContext(ctx)
		}
		start := time.Now()
		sw := &statusWriter{ResponseWriter: w}
		defer func() {
			code := sw.status
			if code == 0 {
				code = http.StatusOK
			}
			m.record(r.Context(), code, time.Since(start))
		}()

		body, release, err := s.readBody(sw, r)
		if err != nil {
			s.bodyError(sw, format, err)
			return
		}
		defer release()
		req, err := prefixkey.Parse(format, body)
		if err != nil {
			param, msg := "", err.Error()
			if fe, ok := errors.AsType[*prefixkey.FieldError](err); ok {
				param = fe.Field
				msg = "malformed request: " + fe.Reason
				if fe.Field != "" {
					msg = "malformed request: " + fe.Field + ": " + fe.Reason
				}
			}
			apierror.Error{Status: http.StatusBadRequest, Code: "invalid_request_error", Param: param, Message: msg}.Write(sw, format)
			return
		}
		if format == prefixkey.FormatAnthropicMessages && s.cfg.PrefixRouting.AnthropicCacheControlInjection {
			if nb, err := prefixkey.InjectAnthropicCacheControl(body); err == nil {
				body = nb
			}
		}
		pr := &parsedRequest{format: format, req: req, body: body}
		if cached == nil {
			s.forward(sw, r, pr)
			return
		}
		// The cache reads the parsed request from the context instead of parsing the body again.
		ctx := respcache.WithParsedRequest(context.WithValue(r.Context(), parsedKey, pr), body, req)
		cached.ServeHTTP(sw, r.WithContext(ctx))
	})
}

// bodyBudgetWait bounds the wait of a request for room under server.max_inflight_body_bytes.
const bodyBudgetWait = time.Second

// errBodyBudget is readBody's error when the bodies in flight leave no room for one more.
var errBodyBudget = errors.New("too many request bytes in flight")

// readBody reads r's body, at most server.max_body_bytes (beyond it, the error is an
// *http.MaxBytesError, and the server closes the connection after the answer; a body that
// announces more is refused before any of it is read). The body's size is held against
// server.max_inflight_body_bytes until release is called (errBodyBudget when no room came within
// bodyBudgetWait). On error there is nothing to release.
func (s *server) readBody(w http.ResponseWriter, r *http.Request) (body []byte, release func(), err error) {
	limit := s.cfg.Server.MaxBodyBytes
	if r.ContentLength > limit {
		return nil, nil, &http.MaxBytesError{Limit: limit}
	}
	n := r.ContentLength
	if n < 0 { // no Content-Length (HTTP/2): room for the largest body
		n = limit
	}
	if !s.bodies.TryAcquire(n) { // the common case takes no timer
		ctx, cancel := context.WithTimeout(r.Context(), bodyBudgetWait)
		err = s.bodies.Acquire(ctx, n)
		cancel()
		if err != nil {
			return nil, nil, errBodyBudget
		}
	}
	release = func() { s.bodies.Release(n) }
	buf := bytes.NewBuffer(make([]byte, 0, n+bytes.MinRead))
	if _, err := buf.ReadFrom(http.MaxBytesReader(w, r.Body, limit)); err != nil {
		release()
		return nil, nil, err
	}
	body = buf.Bytes()
	// Parsing costs memory per JSON object as well as per byte: a body of many tiny messages
	// takes about ten times its size once parsed. Hold that too before parsing a large body.
	if len(body) > parseEstimateFrom {
		if extra := int64(bytes.Count(body, []byte{'{'}))*parseCostPerObject - n; extra > 0 {
			ctx, cancel := context.WithTimeout(r.Context(), bodyBudgetWait)
			err = s.bodies.Acquire(ctx, min(extra, s.cfg.Server.MaxInflightBodyBytes-n))
			cancel()
			if err != nil {
				release()
				return nil, nil, errBodyBudget
			}
			held := n + min(extra, s.cfg.Server.MaxInflightBodyBytes-n)
			release = func() { s.bodies.Release(held) }
		}
	}
	return body, release, nil
}

// A body over parseEstimateFrom bytes is charged parseCostPerObject bytes per JSON object against
// server.max_inflight_body_bytes before it is parsed (when that is more than its size): what
// prefixkey.Parse allocates for a message or content part of a few bytes.
const (
	parseEstimateFrom  = 64 << 10
	parseCostPerObject = 384
)

// bodyError answers a readBody error: 413 over the limit, 408 (and a closed connection) for a
// body that did not arrive within server.read_timeout, 503 when the bodies in flight leave no
// room, 400 otherwise.
func (s *server) bodyError(w http.ResponseWriter, format prefixkey.Format, err error) {
	if mb, ok := errors.AsType[*http.MaxBytesError](err); ok {
		// The rest of the body is not read: close the connection rather than let net/http
		// drain up to 256 KiB of it before the answer goes out.
		w.Header().Set("Connection", "close")
		apierror.Error{Status: http.StatusRequestEntityTooLarge, Code: "request_too_large", Message: "request body exceeds the limit of " + strconv.FormatInt(mb.Limit, 10) + " bytes"}.Write(w, format)

		return
	}
	switch {
	case errors.Is(err, errBodyBudget):
		w.Header().Set("Retry-After", "1")
		apierror.Error{Status: http.StatusServiceUnavailable, Code: "overloaded", Message: "the proxy is holding too many request bodies; retry shortly"}.Write(w, format)
	case errors.Is(err, os.ErrDeadlineExceeded):
		w.Header().Set("Connection", "close")
		apierror.Error{Status: http.StatusRequestTimeout, Code: "request_timeout", Message: "the request body did not arrive within server.read_timeout"}.Write(w, format)
	default:
		apierror.Error{Status: http.StatusBadRequest, Code: "invalid_request_error", Message: "cannot read the request body: " + err.Error()}.Write(w, format)
	}
}

// forward tokenizes, routes and proxies one request, pr; a backend that fails before answering
// is replaced once by another. With disaggregation on, forwardDisagg runs the request instead.
func (s *server) forward(w http.ResponseWriter, r *http.Request, pr *parsedRequest) {
	if s.disaggregated() {
		s.forwardDisagg(w, r, pr)
		return
	}
	ctx := r.Context()
	// Tokenization, when configured, happens inside Route (KVConfig.Tokenizer): only when tier 4
	// runs, with its failures counted in the Router's KV stats.
	d, err := s.router.Route(ctx, pr.req)
	if err != nil {
		s.routeError(w, pr, err)
		return
	}
	// Only a first attempt is retried, and only when another backend could take it: with one
	// backend in rotation its own answer (a 503, say) is more useful to the client than ours.
	up := &upstream{backend: d.Backend, route: d.Reason.String(), cached: cachedTokens(d), lease: d, body: pr.body}
	retry, err := s.proxyTo(w, r, pr, up, "", s.health.HealthyCount() > 1)
	if !retry {
		return
	}
	s.failedBeforeAnswer(ctx, up, err)
	d2, err2 := s.routeAvoiding(ctx, pr.req, up.backend)
	s.retryOn(w, r, pr, up.backend, err, d2, err2, nil)
}

// disaggregated reports whether requests go through Router.Disagg().Route (forwardDisagg) rather
// than Router.Route: POST /admin/route/probe follows the same choice.
func (s *server) disaggregated() bool { return s.cfg.DisaggregatedServing.Enabled }

// cachedTokens is X-Kvroute-Cached-Tokens for d: its backend's cached prompt tokens when the KV
// index took part in the decision, else "".
func cachedTokens(d *kvroute.Decision) string {
	if !d.Reason.FromKVIndex() {
		return ""
	}
	return strconv.Itoa(d.ExpectedCachedTokens)
}

// failedBeforeAnswer records the failure of an attempt that the proxy is about to retry (its
// circuit breaker already has it): it releases its lease with the error and counts it in the
// metrics. A backend whose circuit refused the attempt is not blamed.
func (s *server) failedBeforeAnswer(ctx context.Context, up *upstream, err error) {
	switch {
	case errors.Is(err, errCircuitOpen):
		up.lease.Done(kvroute.Outcome{NotSent: true})
	case refusal(err):
		up.lease.Done(kvroute.Outcome{Refused: true})
	default:
		up.lease.Done(kvroute.Outcome{Err: err})
	}
	if !errors.Is(err, errCircuitOpen) {
		s.tel.upstreamError(ctx, up.backend, errKind(err))
	}
	s.tel.retry(ctx, up.backend)
	lvl := slog.LevelWarn
	if refusal(err) { // an engine out of room: routine under load
		lvl = slog.LevelInfo
	}
	s.log.Log(ctx, lvl, "upstream did not answer; retrying on another backend", "backend", up.backend, "err", err)
}

// retryOn sends the request, whose first attempt on failed ended in cause, to d2 (the Router's
// second decision, or its error err2). plan, when set, labels the retry's routing path. The
// retry is not retried: its failure is answered with 502.
func (s *server) retryOn(w http.ResponseWriter, r *http.Request, pr *parsedRequest, failed string, cause error,
	d2 *kvroute.Decision, err2 error, plan *disagg.Plan) {
	if err2 != nil {
		if errors.Is(err2, kvroute.ErrNoBackend) {
			apierror.Error{Status: http.StatusBadGateway, Code: "upstream_error", Message: "backend " + failed + " failed (" + cause.Error() + ") and no other healthy backend is available"}.Write(w, pr.format)

			return
		}
		s.routeError(w, pr, err2)
		return
	}
	up := &upstream{backend: d2.Backend, route: d2.Reason.String(), cached: cachedTokens(d2), plan: plan, lease: d2, body: pr.body}
	if plan != nil {
		plan.Decode = d2.Backend
	}
	_, _ = s.proxyTo(w, r, pr, up, failed, false)
}

// routeError answers a Route error.
func (s *server) routeError(w http.ResponseWriter, pr *parsedRequest, err error) {
	switch {
	case errors.Is(err, kvroute.ErrNoBackend):
		s.unavailable(w, pr.format, "no healthy backend is available")
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		// The client is gone; nobody reads an answer.
	default:
		s.log.Error("route failed", "err", err)
		apierror.Error{Status: http.StatusInternalServerError, Code: "internal_error", Message: "routing failed"}.Write(w, pr.format)
	}
}

// routeAvoiding routes req again, to any backend but failed: decisions that land on failed are
// held (raising its load, so that the ring overflows and the strategies move on) until another
// backend comes up, then released as never sent. It returns ErrNoBackend when no other backend takes
// the request.
func (s *server) routeAvoiding(ctx context.Context, req *prefixkey.Request, failed string) (*kvroute.Decision, error) {
	var held []*kvroute.Decision
	defer func() {
		for _, h := range held {
			h.Done(kvroute.Outcome{NotSent: true})
		}
	}()
	for range 2*len(s.cfg.Backends) + 2 {
		d, err := s.router.Route(ctx, req)
		if err != nil {
			return nil, err
		}
		if d.Backend != failed {
			return d, nil
		}
		held = append(held, d)
	}
	return nil, kvroute.ErrNoBackend
}

// proxyTo forwards one attempt to up.backend. It returns retry true, with the failure, when the
// backend failed before anything was written to the client and canRetry is set: the caller then
// owns up.lease. Otherwise it has answered the client and released up.lease.
func (s *server) proxyTo(w http.ResponseWriter, r *http.Request, pr *parsedRequest, up *upstream, retriedFrom string, canRetry bool) (retry bool, err error) {
	d := up.lease
	// The circuit breaker admits the attempt, or the backend takes no requests now.
	tk, admitted := s.health.Admit(up.backend)
	if !admitted {
		if canRetry {
			return true, errCircuitOpen
		}
		d.Done(kvroute.Outcome{NotSent: true})
		s.unavailable(w, pr.format, "backend "+up.backend+" is not taking requests (circuit breaker)")
		return false, errCircuitOpen
	}
	a := &attempt{Context: r.Context(), client: r.Context(), lease: d, target: s.backends[up.backend],
		stream: pr.req.Params.Stream, canRetry: canRetry, requestID: up.requestID, body: up.body}
	a.w = attemptWriter{ResponseWriter: w, a: a}
	aw := &a.w
	a.hdrs, a.plan, a.retried = [3]string{up.backend, up.route, up.cached}, up.plan, retriedFrom
	if s.tracer != nil { // the attempt's span: Rewrite sends its trace context to the backend
		_, a.span = s.tracer.Start(r.Context(), "upstream", trace.WithSpanKind(trace.SpanKindClient),
			trace.WithAttributes(attribute.String(telemetry.AttrBackend, up.backend)))
		defer a.endSpan()
	}
	// The upstream call follows the client's cancellation, except that a stream whose terminal
	// event has already gone out is let finish: SDK clients close the connection as soon as they
	// read "data: [DONE]", and cancelling the upstream read then would abort a complete response
	// (which the response cache would then not store). A stream's context (and a decode
	// attempt's, which kv_transfer_timeout may cancel) is then the attempt's own, with a
	// cancellation that follows the client's (clientGone); a plain answer's is the client's.
	if a.stream || up.headerTimeout > 0 {
		ctx, cancel := context.WithCancelCause(context.Background())
		defer cancel(nil)
		a.Context, a.cancel = ctx, cancel
		stopAfter := context.AfterFunc(r.Context(), a.clientGone)
		defer func() {
			if !stopAfter() {
				if t := a.grace.Load(); t != nil {
					t.Stop()
				}
			}
		}()
	}
	if up.headerTimeout > 0 {
		t := time.AfterFunc(up.headerTimeout, func() {
			if a.headers.CompareAndSwap(headersWaiting, headersTimedOut) {
				a.cancel(errKVTransferTimeout)
			}
		})
		defer t.Stop()
	}
	// ReverseProxy copies the request; Rewrite gives the copy the body again, in a reader that
	// net/http knows to be in memory.
	out := r.WithContext(a)
	a.bodyR.Reset(up.body)
	a.reqBody = io.NopCloser(&a.bodyR)
	out.Body, out.ContentLength, out.GetBody = a.reqBody, int64(len(up.body)), nil

	completed := false
	defer func() {
		if completed {
			return
		}
		// ReverseProxy aborts (panics with http.ErrAbortHandler) when the copy of the body fails:
		// the upstream died mid-response, or the client left.
		if aw.writeErr != nil || r.Context().Err() != nil {
			d.Done(kvroute.Outcome{})
			tk.Cancel()
			return
		}
		d.Done(kvroute.Outcome{Err: errUpstreamAborted})
		tk.Done(errUpstreamAborted)
		s.tel.upstreamError(r.Context(), up.backend, "aborted")
	}()
	s.rp.ServeHTTP(aw, out)
	completed = true
	if a.err != nil && a.headers.Load() == headersTimedOut {
		a.err = errKVTransferTimeout
	}

	if a.err != nil && !aw.wroteHeader {
		if r.Context().Err() != nil { // the client left before the answer
			d.Done(kvroute.Outcome{})
			tk.Cancel()
			return false, a.err
		}
		if refusal(a.err) { // room, not health: the circuit breaker does not count it
			tk.Cancel()
		} else {
			tk.Done(a.err)
		}
		if a.canRetry {
			return true, a.err
		}
		d.Done(kvroute.Outcome{Err: a.err})
		s.tel.upstreamError(r.Context(), up.backend, errKind(a.err))
		msg := "backend " + up.backend + " failed: " + a.err.Error()
		if retriedFrom != "" {
			msg = "backends " + retriedFrom + " and " + up.backend + " failed: " + a.err.Error()
		}
		a.setHeaders(w.Header())
		apierror.Error{Status: http.StatusBadGateway, Code: "upstream_error", Message: msg}.Write(w, pr.format)
		return false, a.err
	}
	var outcome error
	switch {
	case a.refused: // relayed as the engine sent it: room, not health
		s.tel.upstreamError(r.Context(), up.backend, "refused")
	case a.status >= 500:
		outcome = &statusError{code: a.status}
		s.tel.upstreamError(r.Context(), up.backend, "status_5xx")
	}
	d.Done(kvroute.Outcome{Err: outcome, Refused: a.refused})
	if a.refused { // refusals never count toward the circuit breaker
		tk.Cancel()
	} else {
		tk.Done(outcome)
	}
	return false, nil
}

// errKind classifies an upstream error for metrics.
func errKind(err error) string {
	if e, ok := errors.AsType[*errRetryStatus](err); ok {
		if e.ans == health.AnswerRefused {
			return "refused"
		}
		return "status_5xx"
	}
	if ne, ok := errors.AsType[interface {
		error
		Timeout() bool
	}](err); ok && ne.Timeout() {
		return "timeout"
	}
	return "connect"
}

// attemptWriter is the ResponseWriter of one attempt: it notes whether the response started,
// tells the Decision when the first byte of a stream goes out (its prefill is over), and keeps
// the client's write error. It supports Flush and http.ResponseController through Unwrap.
type attemptWriter struct {
	http.ResponseWriter
	a           *attempt
	wroteHeader bool
	status      int // the status written, 0 before WriteHeader (an implicit 200)
	firstByte   bool
	writeErr    error
	tail        [streamTail]byte // the last bytes written (ntail of them), to spot a terminal event
	ntail       int
	ended       atomic.Bool // a stream's terminal event was written
}

// streamEndGrace bounds how long an upstream stream whose terminal event was already relayed may
// take to end after the client left.
const streamEndGrace = 2 * time.Second

// Terminal events of the OpenAI and Anthropic streams.
var (
	openAIDone     = []byte("data: [DONE]")
	anthropicFinal = []byte("event: message_stop")
)

// streamTail is the most bytes of a terminal event that can precede the write that ends it.
const streamTail = len("event: message_stop") - 1

// noteStream marks the stream ended at its terminal event, which p holds, or which begins in the
// previous writes' last bytes and ends in p.
func (w *attemptWriter) noteStream(p []byte) {
	if w.ended.Load() {
		return
	}
	var buf [2 * streamTail]byte
	seam := append(append(buf[:0], w.tail[:w.ntail]...), p[:min(len(p), streamTail)]...)
	if terminal(p) || terminal(seam) {
		w.ended.Store(true)
		return
	}
	if len(p) >= streamTail {
		w.ntail = copy(w.tail[:], p[len(p)-streamTail:])
		return
	}
	keep := min(w.ntail, streamTail-len(p))
	copy(w.tail[:], w.tail[w.ntail-keep:w.ntail])
	w.ntail = keep + copy(w.tail[keep:], p)
}

// terminal reports whether b holds a terminal event.
func terminal(b []byte) bool {
	return bytes.Contains(b, openAIDone) || bytes.Contains(b, anthropicFinal)
}

// WriteHeader implements http.ResponseWriter.
func (w *attemptWriter) WriteHeader(code int) {
	if code >= 200 && !w.wroteHeader {
		w.wroteHeader, w.status = true, code
	}
	w.ResponseWriter.WriteHeader(code)
}

// Write implements http.ResponseWriter.
func (w *attemptWriter) Write(p []byte) (int, error) {
	w.wroteHeader = true
	if !w.firstByte && len(p) > 0 {
		w.firstByte = true
		// Only a streamed success's first byte is a first token: an engine's error comes at once
		// and would teach tier 4 a prefill rate far above the engine's.
		if w.a.stream && w.status < 300 {
			w.a.lease.FirstToken()
		}
	}
	n, err := w.ResponseWriter.Write(p)
	if err != nil && w.writeErr == nil {
		w.writeErr = err
	}
	if w.a.stream {
		w.noteStream(p[:n])
	}
	return n, err
}

// Flush implements http.Flusher.
func (w *attemptWriter) Flush() { _ = http.NewResponseController(w.ResponseWriter).Flush() }

// FlushError flushes, reporting the error (http.ResponseController uses it).
func (w *attemptWriter) FlushError() error {
	return http.NewResponseController(w.ResponseWriter).Flush()
}

// Unwrap returns the wrapped ResponseWriter.
func (w *attemptWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// statusWriter records the status code of a response, for metrics.
type statusWriter struct {
	http.ResponseWriter
	status int
}

// WriteHeader implements http.ResponseWriter.
func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 && code >= 200 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

// Write implements http.ResponseWriter.
func (w *statusWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(p)
}

// Flush implements http.Flusher.
func (w *statusWriter) Flush() { _ = http.NewResponseController(w.ResponseWriter).Flush() }

// FlushError flushes, reporting the error.
func (w *statusWriter) FlushError() error {
	return http.NewResponseController(w.ResponseWriter).Flush()
}

// Unwrap returns the wrapped ResponseWriter.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// statusError is a non-2xx HTTP answer.
type statusError struct{ code int }

// Error returns "HTTP <code> <text>".
func (e *statusError) Error() string {
	return "HTTP " + strconv.Itoa(e.code) + " " + http.StatusText(e.code)
}
