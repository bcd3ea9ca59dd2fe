package kvroutecaddy

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/respcache"
)

// stateKey is the context key of a routed request's *request.
type stateKey struct{}

// Variables the handler sets for each attempt, for logs and other handlers:
// {http.vars.kvroute_backend} and {http.vars.kvroute_route}.
const (
	VarBackend = "kvroute_backend"
	VarRoute   = "kvroute_route"
)

// statusPlaceholder is reverse_proxy's placeholder of the status its upstream answered; the policy
// reads it to learn why an attempt was retried (see request.selectUpstream).
const statusPlaceholder = "http.reverse_proxy.status_code"

// Outcomes' errors.
var (
	// errNoAnswer is the failure of an attempt whose upstream did not answer: a connection or
	// transport error, or a time-out.
	errNoAnswer = errors.New("kvroute: the upstream did not answer")
	// errBrokeOff is the failure of an answer that broke off before its end.
	errBrokeOff = errors.New("kvroute: the upstream's answer broke off")
)

// statusError is the failure of an attempt its upstream answered with a 5xx status.
type statusError int

func (e statusError) Error() string {
	return "kvroute: the upstream answered " + strconv.Itoa(int(e))
}

// withParsed hands the response cache the body the handler already read and parsed.
var withParsed = respcache.WithParsedRequest

// request is one routed request's state: its parsed body, the decision in force, and the
// attempts reverse_proxy made. Its fields are read and written on the request's goroutine only:
// the handler's ServeHTTP, the policy's Select and the writer's WriteHeader and Write run there
// (reverse_proxy's retry loop and its copy of the answer are synchronous). Flush, which Caddy
// may call from a timer, reads none of them after the first write.
type request struct {
	h      *Handler
	entry  *entry
	format prefixkey.Format
	req    *prefixkey.Request
	body   []byte
	next   caddyhttp.Handler
	err    error // serve's error, when the response cache's middleware called it

	d       *kvroute.Decision // the decision in force: nil when none holds a slot
	backend string            // the current attempt's upstream; "" before it or when Select found none
	route   string            // HeaderRoute of the current attempt
	selects int               // the policy's Select calls
	tried   []string          // the upstreams of the failed attempts, in order
	w       respWriter
}

// serveCached is the handler the response cache's middleware wraps: serve for the request in
// its context.
func serveCached(w http.ResponseWriter, r *http.Request) {
	st := r.Context().Value(stateKey{}).(*request)
	st.err = st.serve(w, r)
}

// serve routes the request and passes it to next (the reverse_proxy), then ends the decision
// with the outcome of the attempt that answered, also when next panics (reverse_proxy aborts an
// answer that broke off with http.ErrAbortHandler).
func (st *request) serve(w http.ResponseWriter, r *http.Request) (err error) {
	d, err := st.entry.router.Route(r.Context(), st.req)
	if err != nil {
		return routeError(w, r, st.format, err)
	}
	st.d, st.route = d, d.Reason.String()
	st.w = respWriter{ResponseWriter: w, st: st}
	returned := false
	defer func() { st.finish(returned, err, r.Context().Err() != nil) }()
	err = st.next.ServeHTTP(&st.w, r)
	returned = true
	return err
}

// finish ends the decision in force, once the request has ended.
func (st *request) finish(returned bool, err error, clientGone bool) {
	d := st.d
	st.d = nil
	if d == nil {
		return
	}
	if st.selects == 0 {
		// No lb_policy kvroute saw the request: where it went is unknown.
		st.entry.warnNoPolicy(st.h.logger)
		d.Done(kvroute.Outcome{NotSent: true})
		return
	}
	d.Done(st.outcome(returned, err, clientGone))
}

// outcome is the Outcome of the request's last attempt: returned is false when next panicked
// (the answer broke off), err is next's error, clientGone whether the client's context ended.
func (st *request) outcome(returned bool, err error, clientGone bool) kvroute.Outcome {
	status := st.w.status
	switch {
	case st.backend == "": // the last Select found no upstream: nothing went to the decided backend
		return kvroute.Outcome{NotSent: true}
	case !returned: // the answer broke off: the upstream failed, or the client left
		if clientGone {
			return kvroute.Outcome{NotSent: true}
		}
		return kvroute.Outcome{Err: errBrokeOff}
	case status == 499, status == 0 && clientGone: // the client left before the answer
		return kvroute.Outcome{NotSent: true}
	case status == 0 && err != nil: // no answer: reverse_proxy's 502 or 504
		return kvroute.Outcome{Err: errors.Join(errNoAnswer, err)}
	}
	return statusOutcome(status)
}

// statusOutcome is the Outcome of an answer with status code.
func statusOutcome(code int) kvroute.Outcome {
	switch {
	case code == http.StatusTooManyRequests, code == http.StatusServiceUnavailable:
		return kvroute.Outcome{Refused: true}
	case code >= 500:
		return kvroute.Outcome{Err: statusError(code)}
	}
	return kvroute.Outcome{}
}

// selectUpstream is the policy's choice for this request among pool. A second call means
// reverse_proxy retries: the previous attempt failed before anything reached the client.
func (st *request) selectUpstream(pool reverseproxy.UpstreamPool, r *http.Request, w http.ResponseWriter,
	fallback reverseproxy.Selector) *reverseproxy.Upstream {
	st.entry.syncHealth(pool)
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if st.backend != "" {
		// The attempt on st.backend failed: a transport error, or an answer lb_retry_match sent
		// back (whose status reverse_proxy left in the placeholder, deleted before each attempt).
		o := kvroute.Outcome{Err: errNoAnswer}
		if repl != nil {
			if code, ok := statusOf(repl); ok {
				o = statusOutcome(code)
			}
		}
		st.tried = append(st.tried, st.backend)
		if st.d != nil {
			st.d.Done(o)
			st.d = nil
		}
		st.backend = ""
		setBody(r, st.body) // the failed attempt may have read some of it
	}
	if repl != nil {
		repl.Delete(statusPlaceholder)
	}
	st.selects++
	ctx := r.Context()
	if !st.entry.knowsAny(pool) {
		// A reverse_proxy whose upstreams are none of the Router's backends: no decision can fit.
		st.entry.warnForeignPool(st.h.logger)
		if st.d != nil {
			st.d.Done(kvroute.Outcome{NotSent: true})
			st.d = nil
		}
		return st.fallback(pool, r, w, fallback)
	}
	if st.d != nil {
		if u := st.available(pool, st.d.Backend); u != nil {
			return st.use(ctx, u, st.route)
		}
		// The decided upstream is down in Caddy's eyes (or full): the request goes elsewhere.
		st.d.Done(kvroute.Outcome{NotSent: true})
		st.d = nil
	}
	if d, u := st.routeAvoiding(ctx, pool); u != nil {
		st.d = d
		return st.use(ctx, u, d.Reason.String())
	}
	return st.fallback(pool, r, w, fallback)
}

// fallback has the fallback policy choose among the upstreams of pool no attempt failed on.
func (st *request) fallback(pool reverseproxy.UpstreamPool, r *http.Request, w http.ResponseWriter,
	fallback reverseproxy.Selector) *reverseproxy.Upstream {
	u := fallback.Select(st.untried(pool), r, w)
	if u == nil {
		return nil
	}
	return st.use(r.Context(), u, RouteFallbackPolicy)
}

// statusOf reads the status reverse_proxy's last answer had.
func statusOf(repl *caddy.Replacer) (int, bool) {
	v, ok := repl.Get(statusPlaceholder)
	if !ok {
		return 0, false
	}
	code, ok := v.(int)
	return code, ok
}

// use records u as the current attempt's upstream.
func (st *request) use(ctx context.Context, u *reverseproxy.Upstream, route string) *reverseproxy.Upstream {
	st.backend, st.route = u.Dial, route
	caddyhttp.SetVar(ctx, VarBackend, u.Dial)
	caddyhttp.SetVar(ctx, VarRoute, route)
	return u
}

// available returns the upstream of pool named backend when Caddy can send it the request (it is
// healthy and not full) and no attempt on it failed yet; nil otherwise.
func (st *request) available(pool reverseproxy.UpstreamPool, backend string) *reverseproxy.Upstream {
	for _, u := range pool {
		if u.Dial != backend {
			continue
		}
		if u.Available() && !slices.Contains(st.tried, backend) {
			return u
		}
		return nil
	}
	return nil
}

// untried returns the upstreams of pool no attempt failed on, or pool when every one did.
func (st *request) untried(pool reverseproxy.UpstreamPool) reverseproxy.UpstreamPool {
	if len(st.tried) == 0 {
		return pool
	}
	out := make(reverseproxy.UpstreamPool, 0, len(pool))
	for _, u := range pool {
		if !slices.Contains(st.tried, u.Dial) {
			out = append(out, u)
		}
	}
	if len(out) == 0 {
		return pool
	}
	return out
}

// routeAvoiding routes the request to an upstream of pool that is available and untried: Route
// is asked with those that are not (every backend an attempt failed on, every upstream Caddy
// holds down or full) avoided (kvroute.WithAvoid), and, for a decision that still lands on one
// that does not fit (a backend outside pool, or a Router that ignores the avoidance), again with
// that backend avoided too, the decision held meanwhile (raising its backend's load, so that a
// Router ignoring avoidance overflows its ring) and released as never sent. It returns nil, nil
// when no decision fits within 2·len(pool)+2 tries, or Route fails.
func (st *request) routeAvoiding(ctx context.Context, pool reverseproxy.UpstreamPool) (*kvroute.Decision, *reverseproxy.Upstream) {
	avoid := slices.Clone(st.tried)
	for _, u := range pool {
		if !u.Available() && !slices.Contains(avoid, u.Dial) {
			avoid = append(avoid, u.Dial)
		}
	}
	var held []*kvroute.Decision
	defer func() {
		for _, h := range held {
			h.Done(kvroute.Outcome{NotSent: true})
		}
	}()
	for range 2*len(pool) + 2 {
		d, err := st.entry.router.Route(kvroute.WithAvoid(ctx, avoid...), st.req)
		if err != nil {
			return nil, nil
		}
		if u := st.available(pool, d.Backend); u != nil {
			return d, u
		}
		held = append(held, d)
		if !slices.Contains(avoid, d.Backend) {
			avoid = append(avoid, d.Backend)
		}
	}
	return nil, nil
}

// setHeaders sets the X-Kvroute-* headers of the current attempt in h.
func (st *request) setHeaders(h http.Header) {
	if st.h.DisableResponseHeaders || st.backend == "" {
		return
	}
	h.Set(HeaderBackend, st.backend)
	h.Set(HeaderRoute, st.route)
	if st.d != nil && st.d.Reason.FromKVIndex() {
		h.Set(HeaderCachedTokens, strconv.Itoa(st.d.ExpectedCachedTokens))
	} else {
		h.Del(HeaderCachedTokens)
	}
	if n := len(st.tried); n > 0 {
		h.Set(HeaderRetriedFrom, st.tried[n-1])
	}
}

// respWriter is the ResponseWriter reverse_proxy writes the answer to: it records the status,
// sets the X-Kvroute-* headers, and calls FirstToken at the first body byte of a 2xx answer.
// Flush and Unwrap pass through, so that streamed answers (SSE) are flushed as they come.
type respWriter struct {
	http.ResponseWriter
	st        *request
	status    int // the final status written, 0 before
	firstByte bool
}

// WriteHeader records a final status (informational ones pass through) and sets the headers.
func (w *respWriter) WriteHeader(code int) {
	if w.status == 0 && (code >= 200 || code == http.StatusSwitchingProtocols) {
		w.status = code
		w.st.setHeaders(w.ResponseWriter.Header())
	}
	w.ResponseWriter.WriteHeader(code)
}

// Write writes p, calling FirstToken first when p holds the first body bytes of a 2xx answer.
func (w *respWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	if !w.firstByte && len(p) > 0 && w.status >= 200 && w.status < 300 {
		w.firstByte = true
		if d := w.st.d; d != nil {
			d.FirstToken()
		}
	}
	return w.ResponseWriter.Write(p)
}

// Flush sends what was written to the client.
func (w *respWriter) Flush() { _ = w.FlushError() }

// FlushError sends what was written to the client and returns the error of doing so
// (http.ResponseController prefers it to Flush).
func (w *respWriter) FlushError() error {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	return http.NewResponseController(w.ResponseWriter).Flush()
}

// Unwrap returns the wrapped ResponseWriter, for http.ResponseController.
func (w *respWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
