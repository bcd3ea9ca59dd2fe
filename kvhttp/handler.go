package kvhttp

import (
	"context"
	"errors"
	"log"
	"net/http"
	"net/http/httputil"
	"net/url"
	"path"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/apierror"
	"github.com/kvroute/kvroute/prefixkey"
)

// Response headers of a forwarded request. The backend's own headers of these names are replaced.
const (
	// HeaderBackend names the backend that answered (Target.Backend).
	HeaderBackend = "X-Kvroute-Backend"
	// HeaderRoute is the routing decision's label (Target.Route; kvroute.Reason for a Decision):
	// prefix_hash, overflow, fallback, strategy, kv_aware, load_bound, imbalance, least_work, custom.
	HeaderRoute = "X-Kvroute-Route"
	// HeaderCachedTokens is how many of the prompt's tokens the chosen backend holds according to
	// the KV index, set when the index took part in the decision (kvroute.Reason.FromKVIndex). What
	// the engine then reports having reused is the answer's usage (Result.CachedTokens).
	HeaderCachedTokens = "X-Kvroute-Cached-Tokens"
	// HeaderRetriedFrom names the backends whose failure before answering sent the request on to
	// the one that answered, comma-separated in order.
	HeaderRetriedFrom = "X-Kvroute-Retried-From"
)

// Lease is what an attempt reports to: FirstToken when the first byte of a 2xx answer's body
// goes to the client, Done once when the attempt ends. *kvroute.Decision and
// *kvroute.DisaggDecision are Leases. A nil Lease is none.
type Lease interface {
	FirstToken()
	Done(kvroute.Outcome)
}

var (
	_ Lease = (*kvroute.Decision)(nil)
	_ Lease = (*kvroute.DisaggDecision)(nil)
)

// Target is where one attempt of a request goes and how its answer is labelled. Forward reads it
// and Handler.Attempt may change its Header and RequestHeader before the attempt; nothing else
// changes it.
type Target struct {
	// Backend is the backend's name: X-Kvroute-Backend, error messages, and the key of
	// Handler.Backends.
	Backend string
	// URL is the backend's base URL; nil means Handler.Backends[Backend]. The request's path and
	// query are joined to it (httputil.ProxyRequest.SetURL).
	URL *url.URL
	// Lease hears the attempt's FirstToken and Done; nil means none.
	Lease Lease
	// Route is X-Kvroute-Route; "" sets none.
	Route string
	// Header holds more response headers, set over the backend's on the answer and on the
	// Handler's own error answers; a name with no values deletes the backend's header of that name.
	Header http.Header
	// Body is the request body sent to the backend; nil means the client's (Request.Body).
	Body []byte
	// RequestHeader holds headers set on the upstream request over the client's (a request id,
	// a trace context).
	RequestHeader http.Header
	// HeaderTimeout, when positive, bounds the wait for the backend's response headers, not its
	// body (a stream may last long): ErrHeaderTimeout then ends the attempt.
	HeaderTimeout time.Duration
	// Retry, when set, chooses where the request goes when this attempt fails before anything
	// reached the client (the failure is cause) and the Handler's Retries allow one more attempt:
	// the next Target, or an error that Forward answers as it answers Route's (ErrNoBackend:
	// 502). It is called before this Target's Lease is ended, so that it may hand the lease on
	// (kvroute.DisaggDecision.DecodeFailed); the Lease's Done follows, with the attempt's Outcome.
	// nil means no retry: the backend's answer, a refusal included, goes to the client.
	Retry func(ctx context.Context, cause error) (*Target, error)
}

// NewTarget returns the Target of a Decision: its backend, the Decision as Lease, its reason as
// X-Kvroute-Route, and X-Kvroute-Cached-Tokens when the KV index took part in it.
func NewTarget(d *kvroute.Decision) *Target {
	t := &Target{Backend: d.Backend, Lease: d, Route: d.Reason.String()}
	if d.Reason.FromKVIndex() {
		t.Header = http.Header{HeaderCachedTokens: {strconv.Itoa(d.ExpectedCachedTokens)}}
	}
	return t
}

// Result is how one attempt ended, as Handler.Attempt's end function hears it.
type Result struct {
	// Status is the backend's status code; 0 when no answer came.
	Status int
	// Err is the attempt's failure: the transport's error (a connection error, a timeout,
	// ErrHeaderTimeout), *StatusError for an answer that counts as a failure or that was retried,
	// ErrAborted for an answer that broke off, the client's context error when the client left,
	// Handler.Attempt's own error; nil for an answer relayed whole.
	Err error
	// Outcome is what the attempt's Lease is told.
	Outcome kvroute.Outcome
	// CachedTokens is the prompt tokens the backend reported reusing from its cache, in its
	// answer's usage (OpenAI and vLLM: prompt_tokens_details.cached_tokens; Anthropic:
	// cache_read_input_tokens); -1 when the answer, or a 2xx answer's part that went out, had none.
	CachedTokens int
}

// StatusError is an attempt's failure by the backend's answer: a 5xx relayed to the client, or a
// failure or refusal that Forward retried on another backend.
type StatusError struct {
	Code int // the backend's status code
	// Refused reports an answer that declined the request for lack of capacity (429, 503, a 500
	// that says so; health.AnswerRefused): load, not ill health.
	Refused bool
}

// Error says which status the backend answered.
func (e *StatusError) Error() string {
	return "backend answered " + strconv.Itoa(e.Code) + " " + http.StatusText(e.Code)
}

var (
	// ErrAborted is the failure of an answer that broke off: the backend failed in the middle of
	// the body (the client's response is cut short).
	ErrAborted = errors.New("kvhttp: the backend's answer broke off")
	// ErrHeaderTimeout is the failure of an attempt whose response headers did not come within
	// Target.HeaderTimeout. It reports itself as a timeout (a Timeout method that returns true).
	ErrHeaderTimeout error = timeoutError("kvhttp: no response headers within the header timeout")
)

// timeoutError is an error that reports itself as a timeout.
type timeoutError string

func (e timeoutError) Error() string { return string(e) }
func (e timeoutError) Timeout() bool { return true }

// Handler serves the LLM endpoints on kvroute: ServeHTTP reads the request (ReadRequest), routes
// it and forwards it (Forward); see the package documentation for the lifecycle. Router and
// Backends are all it needs; every other field is optional and its zero value a documented
// default. A Handler is safe for concurrent use; its fields must not change after its first
// request, and it must not be copied then.
type Handler struct {
	// Router routes each request (Route, when set, instead).
	Router kvroute.Router
	// Backends maps the Router's backend names to their base URLs.
	Backends map[string]*url.URL
	// Transport carries the requests to the backends; nil means a NewTransport(0) of the
	// Handler's own, made at its first request, whose idle connections close after 90 s unused.
	Transport http.RoundTripper
	// MaxBodyBytes caps a request body; 0 means DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// ReadTimeout bounds the reading of a request body, from ReadRequest's call; 0 means
	// DefaultReadTimeout, negative none (the http.Server's ReadTimeout then governs alone).
	ReadTimeout time.Duration
	// Retries is the most attempts a request may make after its first, each on another backend
	// and only before anything reached the client; 0 means DefaultRetries (1), negative none.
	Retries int
	// BodyIdleTimeout bounds the time a request body may go without a byte arriving, however much
	// of ReadTimeout is left: the client then gets 408 and the connection is closed. 0 means
	// DefaultBodyIdleTimeout, negative none. Like ReadTimeout it needs a ResponseWriter that sets
	// read deadlines (http.ResponseController).
	BodyIdleTimeout time.Duration
	// BodyBudget, when set, bounds the body bytes held by the requests in flight (see
	// ReadRequest and Budget); nil means no bound beyond MaxBodyBytes per request.
	BodyBudget *Budget
	// MaxClientBodyBytes bounds the bytes that the bodies of one client (ClientKey) hold in
	// BodyBudget at once; a body that would go over waits up to a second for room, then gets 503.
	// 0 means half the budget's size, negative no bound; it is never below one body of
	// MaxBodyBytes (or the budget's size, when smaller). Behind a load balancer or another proxy
	// all clients share its address: set ClientKey to read the client's own from the header it
	// sets, or lift the bound (negative).
	MaxClientBodyBytes int64
	// ClientKey names the client of a request for MaxClientBodyBytes; nil means the host of its
	// RemoteAddr (the peer's IP address).
	ClientKey func(r *http.Request) string
	// ErrorLog receives the ReverseProxy's errors and Route's unexpected ones; nil means the log
	// package's standard logger.
	ErrorLog *log.Logger

	// Route, when set, routes instead of Router: it returns the request's first Target, or an
	// error that Forward answers (ErrNoBackend: 503 no_healthy_backend; the client's context
	// ended: nothing; an apierror.Error: itself; anything else: 500), or nil and nil when it
	// answered the client itself. Without it, Forward calls Router.Route and retries, when
	// Backends has more than one backend, on the Router's next choice that is not the failed
	// backend.
	Route func(w http.ResponseWriter, r *http.Request, req *Request) (*Target, error)
	// Attempt, when set, is called before each attempt with the client's request and the
	// attempt's Target, whose Header and RequestHeader it may change. An error refuses the
	// attempt: it is not sent, its Lease hears Outcome{NotSent: true}, and the error is its
	// failure (retried as any other, else answered: an apierror.Error as itself, anything else
	// 502). Otherwise end, when not nil, is called once with the attempt's Result when it ends,
	// before its Lease's Done.
	Attempt func(r *http.Request, t *Target) (end func(Result), err error)

	once    sync.Once
	rp      *httputil.ReverseProxy
	watches sync.Pool // *idleWatch whose timer is stopped (watchIdle)
}

func (h *Handler) maxBodyBytes() int64 {
	if h.MaxBodyBytes > 0 {
		return h.MaxBodyBytes
	}
	return DefaultMaxBodyBytes
}

func (h *Handler) readTimeout() time.Duration {
	if h.ReadTimeout == 0 {
		return DefaultReadTimeout
	}
	return h.ReadTimeout
}

func (h *Handler) bodyIdleTimeout() time.Duration {
	if h.BodyIdleTimeout == 0 {
		return DefaultBodyIdleTimeout
	}
	return h.BodyIdleTimeout
}

func (h *Handler) retries() int {
	switch {
	case h.Retries == 0:
		return DefaultRetries
	case h.Retries < 0:
		return 0
	}
	return h.Retries
}

// ServeHTTP reads the request (ReadRequest), routes it and forwards it (Forward). A path with dot
// or empty segments (encoded or not: "/v1/%2e%2e/…") is answered 400 before anything is read; a
// path that is no LLM endpoint is answered 404, unless Route is set.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if p := r.URL.Path; p == "" || p[0] != '/' || path.Clean(p) != p {
		// Dot segments, encoded or not, and empty segments would reach the backend as written; a
		// proxy in front of the engine that normalises them would take the request elsewhere.
		apierror.Error{Status: http.StatusBadRequest, Code: "invalid_path",
			Message: "the request path has dot or empty segments"}.Write(w, prefixkey.FormatOfPath(p))
		return
	}
	if h.Route == nil && prefixkey.FormatOfPath(r.URL.Path) == 0 {
		apierror.Error{Status: http.StatusNotFound, Code: "not_found",
			Message: r.URL.Path + " is not an LLM endpoint (chat/completions, completions, messages)"}.Write(w, 0)
		return
	}
	req, err := h.ReadRequest(w, r)
	if err != nil {
		return
	}
	defer req.Release()
	h.Forward(w, r, req)
}

// Forward routes req, read from r, and forwards it to the chosen backend, retrying on another
// one before anything reached the client when the Target allows it, and answers the client; it
// ends every Lease it was given once. It returns when the answer is over. Safe for concurrent
// use.
func (h *Handler) Forward(w http.ResponseWriter, r *http.Request, req *Request) {
	h.once.Do(h.init)
	ctx := r.Context()
	var t *Target
	var err error
	if h.Route != nil {
		t, err = h.Route(w, r, req)
	} else {
		t, err = h.route(ctx, req)
	}
	if t == nil {
		if err != nil {
			h.routeError(w, req.Format, err)
		}
		return
	}
	var failed []string
	for n := 0; ; n++ {
		f := h.attempt(w, r, req, t, failed, n < h.retries() && t.Retry != nil)
		if f == nil {
			return
		}
		next, err := t.Retry(ctx, f.cause)
		lease(t).Done(f.outcome)
		failed = append(failed, t.Backend)
		if next == nil {
			switch {
			case err == nil: // the Retry contract: not reached
				err = errors.New("kvhttp: Retry returned no target")
			case errors.Is(err, kvroute.ErrNoBackend):
				apierror.Error{Status: http.StatusBadGateway, Code: "upstream_error",
					Message: "backend " + t.Backend + " failed (" + f.cause.Error() + ") and no other healthy backend is available"}.Write(w, req.Format)
				return
			}
			h.routeError(w, req.Format, err)
			return
		}
		t = next
	}
}

// route is Forward's routing without Handler.Route: Router.Route, and a retry on its next choice
// when there is another backend.
func (h *Handler) route(ctx context.Context, req *Request) (*Target, error) {
	if req.Parsed == nil {
		return nil, apierror.Error{Status: http.StatusNotFound, Code: "not_found", Message: "not an LLM endpoint"}
	}
	d, err := h.Router.Route(ctx, req.Parsed)
	if err != nil {
		return nil, err
	}
	return h.withRetry(req, NewTarget(d)), nil
}

// withRetry sets t.Retry, when there is another backend, to route req again with Router to any
// backend but t's and those that failed it before (failed).
func (h *Handler) withRetry(req *Request, t *Target, failed ...string) *Target {
	if len(h.Backends) > 1 {
		t.Retry = func(ctx context.Context, _ error) (*Target, error) {
			if len(failed) > 0 {
				ctx = kvroute.WithAvoid(ctx, failed...)
			}
			d, err := RouteAvoiding(ctx, h.Router, req.Parsed, t.Backend, 2*len(h.Backends)+2)
			if err != nil {
				return nil, err
			}
			return h.withRetry(req, NewTarget(d), append(failed[:len(failed):len(failed)], t.Backend)...), nil
		}
	}
	return t
}

// RouteAvoiding routes req with router to any backend but failed and those ctx already avoids
// (kvroute.WithAvoid: a retry after several failures lists them all): it calls Route once with
// kvroute.WithAvoid(ctx, failed), which the default Router honours in every tier, so the retry
// lands elsewhere even when the failed backend holds the request's KV cache. For a Router that
// ignores the avoidance (one of your own), it keeps a fallback: it calls Route up to tries times
// in all (at least once), holding the decisions that land on an avoided backend (their in-flight
// slots raise its load, so that a bounded-load ring overflows and the selection strategies move
// on) and releasing them, as never sent, when it returns. It returns the first decision on a
// backend not avoided, or Route's error, or an error wrapping kvroute.ErrNoBackend when every
// healthy backend is avoided or every try chose an avoided one. Safe for concurrent use when
// router is.
func RouteAvoiding(ctx context.Context, router kvroute.Router, req *prefixkey.Request, failed string, tries int) (*kvroute.Decision, error) {
	if failed != "" {
		ctx = kvroute.WithAvoid(ctx, failed)
	}
	avoid := kvroute.Avoided(ctx)
	var held []*kvroute.Decision
	defer func() {
		for _, d := range held {
			d.Done(kvroute.Outcome{NotSent: true})
		}
	}()
tries:
	for range max(tries, 1) {
		d, err := router.Route(ctx, req)
		if err != nil {
			return nil, err
		}
		for _, name := range avoid {
			if d.Backend == name {
				held = append(held, d)
				continue tries
			}
		}
		return d, nil
	}
	return nil, kvroute.ErrNoBackend
}

// routeError answers an error of Route or Target.Retry.
func (h *Handler) routeError(w http.ResponseWriter, format prefixkey.Format, err error) {
	if ae, ok := errors.AsType[apierror.Error](err); ok {
		ae.Write(w, format)
		return
	}
	switch {
	case errors.Is(err, kvroute.ErrNoBackend):
		apierror.Error{Status: http.StatusServiceUnavailable, Code: "no_healthy_backend", Message: "no healthy backend is available"}.Write(w, format)
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		// The client is gone; nobody reads an answer.
	default:
		h.logf("kvhttp: routing failed: %v", err)
		apierror.Error{Status: http.StatusInternalServerError, Code: "internal_error", Message: "routing failed"}.Write(w, format)
	}
}

func (h *Handler) logf(format string, args ...any) {
	if h.ErrorLog != nil {
		h.ErrorLog.Printf(format, args...)
	} else {
		log.Printf(format, args...)
	}
}

// failedMessage is the message of a 502 after the attempts on failed and then backend failed.
func failedMessage(failed []string, backend string, err error) string {
	if len(failed) == 0 {
		return "backend " + backend + " failed: " + err.Error()
	}
	return "backends " + strings.Join(failed, ", ") + " and " + backend + " failed: " + err.Error()
}

// lease returns t's Lease, or one that does nothing.
func lease(t *Target) Lease {
	if t.Lease == nil {
		return noLease{}
	}
	return t.Lease
}

// noLease is the Lease of a Target without one.
type noLease struct{}

func (noLease) FirstToken()          {}
func (noLease) Done(kvroute.Outcome) {}
