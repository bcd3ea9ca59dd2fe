package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/apierror"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/health"
	"github.com/kvroute/kvroute/kvhttp"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/telemetry"
)

// The request's lifecycle (body checks, ReverseProxy, first token, retry before the first byte,
// Done with the true Outcome, client disconnects, the X-Kvroute-* headers) is package kvhttp's;
// this file plugs the proxy's parts into it: the response cache between the body checks and the
// routing, the Router (and disaggregation, disagg.go) as kvhttp.Handler.Route, the circuit
// breakers, upstream spans and metrics as kvhttp.Handler.Attempt.

// Response headers the proxy adds to every routed response (kvhttp's).
const (
	HeaderBackend      = kvhttp.HeaderBackend
	HeaderRoute        = kvhttp.HeaderRoute
	HeaderCachedTokens = kvhttp.HeaderCachedTokens
	HeaderRetriedFrom  = kvhttp.HeaderRetriedFrom
)

type ctxKey int

// parsedKey is the context key of the *kvhttp.Request the response cache passes on to Forward.
const parsedKey ctxKey = iota

// newKVHTTP returns a kvhttp.Handler over the proxy's transport, body limits and budget, its
// routing by route, and s.attempt on every attempt. The http.Server's read_timeout bounds the
// bodies, server.body_idle_timeout their pauses, server.max_client_body_bytes what one client
// address holds of the budget (-1: no bound).
func (s *server) newKVHTTP(route func(http.ResponseWriter, *http.Request, *kvhttp.Request) (*kvhttp.Target, error)) *kvhttp.Handler {
	return &kvhttp.Handler{Backends: s.backends, Transport: s.transport, MaxBodyBytes: s.cfg.Server.MaxBodyBytes,
		ReadTimeout: -1, BodyIdleTimeout: time.Duration(s.cfg.Server.BodyIdleTimeout),
		BodyBudget: s.bodies, MaxClientBodyBytes: s.cfg.Server.MaxClientBodyBytes,
		ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelDebug), Route: route, Attempt: s.attempt}
}

// llmHandler serves one LLM API endpoint: body checks (413, 400), then the response cache, then
// Forward.
func (s *server) llmHandler(endpoint string) http.Handler {
	// The response cache sits between the checks and Forward: the read request reaches Forward
	// through the request's context then. Without it the checks call Forward themselves.
	var cached http.Handler
	if s.cache != nil {
		cached = s.cache.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			s.llm.Forward(w, r, r.Context().Value(parsedKey).(*kvhttp.Request))
		}))
	}
	m := s.tel.forEndpoint(endpoint)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The duration's exemplars come from the request's span; without tracing there is none,
		// and the SDK need not look for one through the request's contexts.
		mctx := context.Background()
		if s.tracer != nil { // the request's span, continuing the client's W3C trace context
			ctx := propagation.TraceContext{}.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
			ctx, span := s.tracer.Start(ctx, "kvroute.proxy "+endpoint, trace.WithSpanKind(trace.SpanKindServer))
			defer span.End()
			r, mctx = r.WithContext(ctx), ctx
		}
		start := time.Now()
		sw := &statusWriter{ResponseWriter: w}
		defer func() {
			code := sw.status
			if code == 0 {
				code = http.StatusOK
			}
			m.record(mctx, code, time.Since(start))
		}()
		req, err := s.llm.ReadRequest(sw, r)
		if err != nil {
			return
		}
		defer req.Release()
		if req.Format == prefixkey.FormatAnthropicMessages && s.cfg.PrefixRouting.AnthropicCacheControlInjection {
			if nb, err := prefixkey.InjectAnthropicCacheControl(req.Body); err == nil {
				req.Body = nb
			}
		}
		if cached == nil {
			s.llm.Forward(sw, r, req)
			return
		}
		// The cache reads the parsed request from the context instead of parsing the body again.
		ctx := respcache.WithParsedRequest(context.WithValue(r.Context(), parsedKey, req), req.Body, req.Parsed)
		cached.ServeHTTP(sw, r.WithContext(ctx))
	})
}

// route routes one request (kvhttp.Handler.Route): Router.Route, tokenizing inside when tier 4
// needs it, or with disaggregation on, routeDisagg.
func (s *server) route(w http.ResponseWriter, r *http.Request, req *kvhttp.Request) (*kvhttp.Target, error) {
	if s.disaggregated() {
		return s.routeDisagg(w, r, req)
	}
	d, tk, err := s.routeAdmitted(r.Context(), func(ctx context.Context) (*kvroute.Decision, error) {
		return s.router.Route(ctx, req.Parsed)
	})
	if err != nil {
		return nil, s.routeError(w, req.Format, err)
	}
	// A failed attempt is retried only when another backend could take it: with one backend in
	// rotation its own answer (a 503, say) is more useful to the client than ours.
	return s.retryElsewhere(req, admitted(req, d, nil, tk), s.health.HealthyCount() > 1, nil), nil
}

// routeAdmitted routes with route and asks the chosen backend's circuit breaker to admit the
// request. When the breaker refuses (open, or half-open with its trial slots taken), the decision
// is released as never sent and the Router asked again with that backend avoided
// (kvroute.WithAvoid), so that a refusal, which sends nothing, costs the request none of its
// attempts. It returns the decision and the breaker's ticket for attempt (see admitted), route's
// error, or an error wrapping kvroute.ErrNoBackend when every backend the Router offers refuses.
func (s *server) routeAdmitted(ctx context.Context, route func(context.Context) (*kvroute.Decision, error)) (*kvroute.Decision, health.Ticket, error) {
	for range len(s.cfg.Backends) + 1 {
		d, err := route(ctx)
		if err != nil {
			return nil, health.Ticket{}, err
		}
		if tk, ok := s.health.Admit(d.Backend); ok {
			return d, tk, nil
		}
		d.Done(kvroute.Outcome{NotSent: true})
		ctx = kvroute.WithAvoid(ctx, d.Backend)
	}
	return nil, health.Ticket{}, fmt.Errorf("%w: every circuit breaker refused the request", kvroute.ErrNoBackend)
}

// admitted returns the Target of d for req (target) with the circuit-breaker ticket its routing
// took (routeAdmitted): attempt uses it rather than asking the breaker again. The ticket rides
// on the Target's Lease, which cancels it should the Target never be attempted.
func admitted(req *kvhttp.Request, d *kvroute.Decision, plan *disagg.Plan, tk health.Ticket) *kvhttp.Target {
	t := planTarget(d, plan)
	t.Lease = &ticketLease{Lease: d, tk: tk, held: true, quiet: !req.Parsed.Params.Stream}
	return t
}

// ticketLease is a Target's Lease carrying its breaker ticket until attempt takes it; with quiet
// it does not hear FirstToken, as lease's noFirstToken.
type ticketLease struct {
	kvhttp.Lease
	tk    health.Ticket
	held  bool // tk not yet taken
	quiet bool
}

// take returns the ticket, once.
func (l *ticketLease) take() (health.Ticket, bool) {
	tk, ok := l.tk, l.held
	l.tk, l.held = health.Ticket{}, false
	return tk, ok
}

// FirstToken implements kvhttp.Lease.
func (l *ticketLease) FirstToken() {
	if !l.quiet {
		l.Lease.FirstToken()
	}
}

// Done implements kvhttp.Lease: a ticket attempt never took is cancelled.
func (l *ticketLease) Done(o kvroute.Outcome) {
	if tk, ok := l.take(); ok {
		tk.Cancel()
	}
	l.Lease.Done(o)
}

// target is the Target of d for req, whose Lease is lease(req, d); plan, when set, adds the
// routing-path headers.
func (s *server) target(req *kvhttp.Request, d *kvroute.Decision, plan *disagg.Plan) *kvhttp.Target {
	t := planTarget(d, plan)
	t.Lease = lease(req, d)
	return t
}

// planTarget is kvhttp.NewTarget(d) with, when plan is set, the routing-path headers.
func planTarget(d *kvroute.Decision, plan *disagg.Plan) *kvhttp.Target {
	t := kvhttp.NewTarget(d)
	if plan != nil {
		plan.Decode = d.Backend
		t.Header = planHeader(t.Header, plan)
	}
	return t
}

// retryElsewhere lets t, when ok, be retried on the Router's choice avoiding t's backend and
// failed, the backends that already failed the request (kvhttp.Handler.Retries bounds the
// attempts), and whose circuit breaker admits it (routeAdmitted).
func (s *server) retryElsewhere(req *kvhttp.Request, t *kvhttp.Target, ok bool, failed []string) *kvhttp.Target {
	if ok {
		t.Retry = func(ctx context.Context, cause error) (*kvhttp.Target, error) {
			s.retrying(ctx, t.Backend, cause)
			d, tk, err := s.routeAdmitted(kvroute.WithAvoid(ctx, failed...), func(ctx context.Context) (*kvroute.Decision, error) {
				return kvhttp.RouteAvoiding(ctx, s.router, req.Parsed, t.Backend, 2*len(s.cfg.Backends)+2)
			})
			if err != nil {
				return nil, err
			}
			return s.retryElsewhere(req, admitted(req, d, nil, tk), true, append(failed[:len(failed):len(failed)], t.Backend)), nil
		}
	}
	return t
}

// lease is the Lease of d for req: d itself for a stream; for a plain answer, d without
// FirstToken, whose first byte comes with its last, after the decode, and would teach tier 4 a
// prefill rate far below the engine's (Done ends the prefill without teaching one).
func lease(req *kvhttp.Request, d kvhttp.Lease) kvhttp.Lease {
	if req.Parsed.Params.Stream {
		return d
	}
	return noFirstToken{d}
}

// noFirstToken is a Lease that does not hear FirstToken.
type noFirstToken struct{ kvhttp.Lease }

func (noFirstToken) FirstToken() {}

// disaggregated reports whether requests go through Router.Disagg().Route (routeDisagg) rather
// than Router.Route: POST /admin/route/probe follows the same choice.
func (s *server) disaggregated() bool { return s.cfg.DisaggregatedServing.Enabled }

// retrying logs and counts an attempt on backend that failed with cause before answering, which
// the proxy is about to retry on another backend.
func (s *server) retrying(ctx context.Context, backend string, cause error) {
	s.tel.retry(ctx, backend)
	lvl := slog.LevelWarn
	if se, ok := errors.AsType[*kvhttp.StatusError](cause); ok && se.Refused { // an engine out of room: routine under load
		lvl = slog.LevelInfo
	}
	s.log.Log(ctx, lvl, "upstream did not answer; retrying on another backend", "backend", backend, "err", cause)
}

// routeError answers a Route error that kvhttp does not answer as the proxy does: no backend,
// 503 with Retry-After. It returns the error for kvhttp to answer otherwise (nil when answered).
func (s *server) routeError(w http.ResponseWriter, format prefixkey.Format, err error) error {
	switch {
	case errors.Is(err, kvroute.ErrNoBackend):
		s.unavailable(w, format, "no healthy backend is available")
		return nil
	case !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded):
		s.log.Error("route failed", "err", err)
	}
	return err
}

// attempt admits one attempt on t's backend through its circuit breaker, or takes the admission
// its routing already obtained (routeAdmitted; an open breaker refuses it: 503 with Retry-After,
// or another backend), starts its upstream span, whose trace context
// the backend gets, and on its end records the outcome in the breaker (refusals and clients that
// left count for nothing), the upstream error metrics and the span.
func (s *server) attempt(r *http.Request, t *kvhttp.Target) (func(kvhttp.Result), error) {
	var tk health.Ticket
	ok := false
	if l, has := t.Lease.(*ticketLease); has {
		tk, ok = l.take()
	}
	if !ok {
		tk, ok = s.health.Admit(t.Backend)
	}
	if !ok {
		if t.Header == nil {
			t.Header = http.Header{}
		}
		t.Header.Set("Retry-After", s.retryAfter())
		return nil, apierror.Error{Status: http.StatusServiceUnavailable, Code: "no_healthy_backend",
			Message: "backend " + t.Backend + " is not taking requests (circuit breaker)"}
	}
	var span trace.Span
	if s.tracer != nil {
		var ctx context.Context
		ctx, span = s.tracer.Start(r.Context(), "upstream", trace.WithSpanKind(trace.SpanKindClient),
			trace.WithAttributes(attribute.String(telemetry.AttrBackend, t.Backend)))
		if t.RequestHeader == nil {
			t.RequestHeader = http.Header{}
		}
		propagation.TraceContext{}.Inject(ctx, propagation.HeaderCarrier(t.RequestHeader))
	}
	return func(res kvhttp.Result) {
		o := res.Outcome
		if o.NotSent || o.Refused { // refusals never count toward the circuit breaker
			tk.Cancel()
		} else {
			tk.Done(o.Err)
		}
		if kind := upstreamKind(res); kind != "" {
			s.tel.upstreamError(r.Context(), t.Backend, kind)
		}
		if span != nil {
			endSpan(span, res)
		}
	}, nil
}

// upstreamKind classifies an attempt's failure for metrics: refused, aborted, status_5xx, timeout
// or connect; "" for a success or a client that left.
func upstreamKind(res kvhttp.Result) string {
	switch {
	case res.Outcome.NotSent:
		return ""
	case res.Outcome.Refused:
		return "refused"
	case errors.Is(res.Err, kvhttp.ErrAborted):
		return "aborted"
	case res.Status >= 500:
		return "status_5xx"
	case res.Err == nil:
		return ""
	}
	return errKind(res.Err)
}

// errKind classifies a transport error for metrics: timeout or connect.
func errKind(err error) string {
	if te, ok := errors.AsType[interface {
		error
		Timeout() bool
	}](err); ok && te.Timeout() {
		return "timeout"
	}
	return "connect"
}

// endSpan ends an attempt's upstream span with the backend's status code, and status Error when
// the attempt failed (but for a client that left during the answer).
func endSpan(span trace.Span, res kvhttp.Result) {
	if res.Status != 0 {
		span.SetAttributes(attribute.Int("http.response.status_code", res.Status))
	}
	if res.Err != nil && !(res.Outcome.NotSent && res.Status != 0) {
		span.SetStatus(codes.Error, res.Err.Error())
	}
	span.End()
}

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
