package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strconv"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/prefixkey"
)

// Response headers the proxy adds to every routed response.
const (
	// HeaderBackend names the backend that answered.
	HeaderBackend = "X-Kvroute-Backend"
	// HeaderRoute is the routing decision's label: prefix_hash, overflow, fallback, kv_aware or
	// imbalance.
	HeaderRoute = "X-Kvroute-Route"
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

// attempt is one forwarding of a request to one backend.
type attempt struct {
	d        *kvroute.Decision
	target   *url.URL
	stream   bool
	canRetry bool  // a failure before the response may be retried elsewhere
	status   int   // the upstream's status, 0 before its response
	err      error // the transport's (or ModifyResponse's) error, before anything was written
}

// errRetryStatus marks an upstream answer that the proxy retries on another backend (502, 503 or
// 504 on a first attempt: the backend cannot serve now, and nothing reached the client).
type errRetryStatus struct{ code int }

// Error says which status the upstream answered.
func (e *errRetryStatus) Error() string { return "upstream answered " + strconv.Itoa(e.code) }

func retryableStatus(code int) bool {
	return code == http.StatusBadGateway || code == http.StatusServiceUnavailable || code == http.StatusGatewayTimeout
}

// errUpstreamAborted is the outcome of a response whose upstream failed mid-body.
var errUpstreamAborted = errors.New("upstream response aborted")

// newReverseProxy returns the ReverseProxy every request goes through: its target comes from the
// request's attempt; errors before the response are recorded in the attempt for the caller to
// retry or answer, not written.
func (s *server) newReverseProxy() *httputil.ReverseProxy {
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			a := pr.In.Context().Value(attemptKey).(*attempt)
			pr.SetURL(a.target)
			pr.SetXForwarded()
			// Identity bodies: cacheable and streamed as they come.
			pr.Out.Header.Del("Accept-Encoding")
		},
		Transport:     s.transport,
		FlushInterval: -1,
		ErrorLog:      slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
		ModifyResponse: func(res *http.Response) error {
			a := res.Request.Context().Value(attemptKey).(*attempt)
			a.status = res.StatusCode
			if a.canRetry && retryableStatus(res.StatusCode) {
				return &errRetryStatus{code: res.StatusCode}
			}
			return nil
		},
		ErrorHandler: func(_ http.ResponseWriter, r *http.Request, err error) {
			r.Context().Value(attemptKey).(*attempt).err = err
		},
	}
}

// llmHandler serves one LLM API endpoint: body checks (413, 400), then the response cache, then
// forward.
func (s *server) llmHandler(format prefixkey.Format, endpoint string) http.Handler {
	var inner http.Handler = http.HandlerFunc(s.forward)
	if s.cache != nil {
		inner = s.cache.Middleware(inner)
	}
	endpointAttr := attribute.String("endpoint", endpoint)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		sw := &statusWriter{ResponseWriter: w}
		defer func() {
			code := sw.status
			if code == 0 {
				code = http.StatusOK
			}
			ctx := context.WithoutCancel(r.Context())
			s.tel.requests.Add(ctx, 1, metric.WithAttributes(endpointAttr, attribute.Int("code", code)))
			s.tel.duration.Record(ctx, time.Since(start).Seconds(), metric.WithAttributes(endpointAttr))
		}()

		limit := s.cfg.Server.MaxBodyBytes
		if r.ContentLength > limit {
			writeAPIError(sw, format, http.StatusRequestEntityTooLarge, "request_too_large", "",
				"request body is "+strconv.FormatInt(r.ContentLength, 10)+" bytes; the limit is "+strconv.FormatInt(limit, 10))
			return
		}
		body, err := io.ReadAll(http.MaxBytesReader(sw, r.Body, limit))
		if err != nil {
			if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
				writeAPIError(sw, format, http.StatusRequestEntityTooLarge, "request_too_large", "",
					"request body exceeds the limit of "+strconv.FormatInt(limit, 10)+" bytes")
				return
			}
			writeAPIError(sw, format, http.StatusBadRequest, "invalid_request_error", "", "cannot read the request body: "+err.Error())
			return
		}
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
			writeAPIError(sw, format, http.StatusBadRequest, "invalid_request_error", param, msg)
			return
		}
		if format == prefixkey.FormatAnthropicMessages && s.cfg.PrefixRouting.AnthropicCacheControlInjection {
			if nb, err := prefixkey.InjectAnthropicCacheControl(body); err == nil {
				body = nb
			}
		}
		pr := &parsedRequest{format: format, req: req, body: body}
		r = r.WithContext(context.WithValue(r.Context(), parsedKey, pr))
		setBody(r, body)
		inner.ServeHTTP(sw, r)
	})
}

// setBody makes r's body (and GetBody) yield body.
func setBody(r *http.Request, body []byte) {
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
}

// forward tokenizes, routes and proxies one request; a backend that fails before answering is
// replaced once by another.
func (s *server) forward(w http.ResponseWriter, r *http.Request) {
	pr := r.Context().Value(parsedKey).(*parsedRequest)
	ctx := r.Context()
	// Tokenization, when configured, happens inside Route (KVConfig.Tokenizer): only when tier 4
	// runs, with its failures counted in the Router's KV stats.
	d, err := s.router.Route(ctx, pr.req)
	if err != nil {
		s.routeError(w, pr, err)
		return
	}
	retry, err := s.proxyTo(w, r, pr, d, "")
	if !retry {
		return
	}
	failed := d.Backend
	d.Done(kvroute.Outcome{Err: err})
	s.health.observeRequest(failed, true, err)
	s.tel.upstreamErrors.Add(context.WithoutCancel(ctx), 1, metric.WithAttributes(attribute.String("backend", failed), attribute.String("kind", errKind(err))))
	s.tel.retries.Add(context.WithoutCancel(ctx), 1, metric.WithAttributes(attribute.String("backend", failed)))
	s.log.Warn("upstream failed before answering; retrying on another backend", "backend", failed, "err", err)

	d2, err2 := s.routeAvoiding(ctx, pr.req, failed, err)
	if err2 != nil {
		if errors.Is(err2, kvroute.ErrNoBackend) {
			writeAPIError(w, pr.format, http.StatusBadGateway, "upstream_error", "",
				"backend "+failed+" failed ("+err.Error()+") and no other healthy backend is available")
			return
		}
		s.routeError(w, pr, err2)
		return
	}
	if retry, err := s.proxyTo(w, r, pr, d2, failed); retry {
		// Not retried twice: answer with the second failure.
		d2.Done(kvroute.Outcome{Err: err})
		s.health.observeRequest(d2.Backend, true, err)
		s.tel.upstreamErrors.Add(context.WithoutCancel(ctx), 1, metric.WithAttributes(attribute.String("backend", d2.Backend), attribute.String("kind", errKind(err))))
		s.log.Warn("upstream failed on retry", "backend", d2.Backend, "err", err)
		writeAPIError(w, pr.format, http.StatusBadGateway, "upstream_error", "",
			"backends "+failed+" and "+d2.Backend+" failed: "+err.Error())
	}
}

// routeError answers a Route error.
func (s *server) routeError(w http.ResponseWriter, pr *parsedRequest, err error) {
	switch {
	case errors.Is(err, kvroute.ErrNoBackend):
		writeAPIError(w, pr.format, http.StatusServiceUnavailable, "no_healthy_backend", "", "no healthy backend is available")
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		// The client is gone; nobody reads an answer.
	default:
		s.log.Error("route failed", "err", err)
		writeAPIError(w, pr.format, http.StatusInternalServerError, "internal_error", "", "routing failed")
	}
}

// routeAvoiding routes req again, to any backend but failed: decisions that land on failed are
// held (raising its load, so that the ring overflows and the strategies move on) until another
// backend comes up, then released with cause. It returns ErrNoBackend when no other backend takes
// the request.
func (s *server) routeAvoiding(ctx context.Context, req *prefixkey.Request, failed string, cause error) (*kvroute.Decision, error) {
	var held []*kvroute.Decision
	defer func() {
		for _, h := range held {
			h.Done(kvroute.Outcome{Err: cause})
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

// proxyTo forwards one attempt to d's backend. It returns retry true, with the failure, when the
// backend failed before anything was written to the client, this was the first attempt
// (retriedFrom "") and another backend is in rotation: the caller then owns d. Otherwise it has
// answered the client and released d.
func (s *server) proxyTo(w http.ResponseWriter, r *http.Request, pr *parsedRequest, d *kvroute.Decision, retriedFrom string) (retry bool, err error) {
	// Only a first attempt is retried, and only when another backend could take it: with one
	// backend in rotation its own answer (a 503, say) is more useful to the client than ours.
	canRetry := retriedFrom == "" && s.health.healthyCount() > 1
	a := &attempt{d: d, target: s.backends[d.Backend], stream: pr.req.Params.Stream, canRetry: canRetry}
	aw := &attemptWriter{ResponseWriter: w, a: a}
	h := w.Header()
	h.Set(HeaderBackend, d.Backend)
	h.Set(HeaderRoute, d.Reason.String())
	if retriedFrom != "" {
		h.Set(HeaderRetriedFrom, retriedFrom)
	}
	// The upstream call follows the client's cancellation, except that a stream whose terminal
	// event has already gone out is let finish: SDK clients close the connection as soon as they
	// read "data: [DONE]", and cancelling the upstream read then would abort a complete response
	// (which the response cache would then not store).
	upCtx, cancelUp := context.WithCancelCause(context.WithoutCancel(r.Context()))
	defer cancelUp(nil)
	var grace atomic.Pointer[time.Timer]
	stopAfter := context.AfterFunc(r.Context(), func() {
		if aw.ended.Load() {
			grace.Store(time.AfterFunc(streamEndGrace, func() { cancelUp(context.Canceled) }))
			return
		}
		cancelUp(context.Cause(r.Context()))
	})
	defer func() {
		if !stopAfter() {
			if t := grace.Load(); t != nil {
				t.Stop()
			}
		}
	}()
	out := r.WithContext(context.WithValue(upCtx, attemptKey, a))
	setBody(out, pr.body)

	completed := false
	defer func() {
		if completed {
			return
		}
		// ReverseProxy aborts (panics with http.ErrAbortHandler) when the copy of the body fails:
		// the upstream died mid-response, or the client left.
		if aw.writeErr != nil || r.Context().Err() != nil {
			d.Done(kvroute.Outcome{})
			return
		}
		d.Done(kvroute.Outcome{Err: errUpstreamAborted})
		s.health.observeRequest(d.Backend, true, errUpstreamAborted)
		s.tel.upstreamErrors.Add(context.WithoutCancel(r.Context()), 1, metric.WithAttributes(attribute.String("backend", d.Backend), attribute.String("kind", "aborted")))
	}()
	s.rp.ServeHTTP(aw, out)
	completed = true

	if a.err != nil && !aw.wroteHeader {
		if r.Context().Err() != nil { // the client left before the answer
			d.Done(kvroute.Outcome{})
			return false, a.err
		}
		if a.canRetry {
			return true, a.err
		}
		d.Done(kvroute.Outcome{Err: a.err})
		s.health.observeRequest(d.Backend, true, a.err)
		s.tel.upstreamErrors.Add(context.WithoutCancel(r.Context()), 1, metric.WithAttributes(attribute.String("backend", d.Backend), attribute.String("kind", errKind(a.err))))
		writeAPIError(w, pr.format, http.StatusBadGateway, "upstream_error", "", "backend "+d.Backend+" failed: "+a.err.Error())
		return false, a.err
	}
	var outcome error
	if a.status >= 500 {
		outcome = &statusError{code: a.status}
		s.tel.upstreamErrors.Add(context.WithoutCancel(r.Context()), 1, metric.WithAttributes(attribute.String("backend", d.Backend), attribute.String("kind", "status_5xx")))
	}
	d.Done(kvroute.Outcome{Err: outcome})
	s.health.observeRequest(d.Backend, outcome != nil, outcome)
	return false, nil
}

// errKind classifies an upstream error for metrics.
func errKind(err error) string {
	if _, ok := errors.AsType[*errRetryStatus](err); ok {
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
	firstByte   bool
	writeErr    error
	tail        []byte      // the last bytes written, to spot a stream's terminal event
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

// noteStream keeps the tail of a stream and marks it ended at its terminal event.
func (w *attemptWriter) noteStream(p []byte) {
	if w.ended.Load() {
		return
	}
	w.tail = append(w.tail, p...)
	if bytes.Contains(w.tail, openAIDone) || bytes.Contains(w.tail, anthropicFinal) {
		w.ended.Store(true)
	}
	if keep := len(anthropicFinal); len(w.tail) > keep {
		w.tail = append(w.tail[:0], w.tail[len(w.tail)-keep:]...)
	}
}

// WriteHeader implements http.ResponseWriter.
func (w *attemptWriter) WriteHeader(code int) {
	if code >= 200 {
		w.wroteHeader = true
	}
	w.ResponseWriter.WriteHeader(code)
}

// Write implements http.ResponseWriter.
func (w *attemptWriter) Write(p []byte) (int, error) {
	w.wroteHeader = true
	if !w.firstByte && len(p) > 0 {
		w.firstByte = true
		if w.a.stream {
			w.a.d.FirstToken()
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

// writeAPIError answers with an error body in the endpoint's API style: OpenAI's
// {"error":{"message","type","param","code"}} or Anthropic's {"type":"error","error":{"type",
// "message"}}. kind is the error's code: invalid_request_error, request_too_large,
// no_healthy_backend, upstream_error, internal_error.
func writeAPIError(w http.ResponseWriter, format prefixkey.Format, status int, kind, param, msg string) {
	h := w.Header()
	h.Del("Content-Length")
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	var body any
	if format == prefixkey.FormatAnthropicMessages {
		typ := "invalid_request_error"
		switch {
		case status == http.StatusRequestEntityTooLarge:
			typ = "request_too_large"
		case status == http.StatusServiceUnavailable:
			typ = "overloaded_error"
		case status >= 500:
			typ = "api_error"
		}
		body = map[string]any{"type": "error", "error": map[string]any{"type": typ, "message": msg}}
	} else {
		typ := "invalid_request_error"
		if status >= 500 {
			typ = "server_error"
		}
		var p, c any
		if param != "" {
			p = param
		}
		if kind != "invalid_request_error" {
			c = kind
		}
		body = map[string]any{"error": map[string]any{"message": msg, "type": typ, "param": p, "code": c}}
	}
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(body)
}
