package kvhttp

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/kvroute/kvroute/apierror"
	"github.com/kvroute/kvroute/prefixkey"
)

// Request is an LLM request read by ReadRequest: its body and, for the LLM endpoints, its parsed
// form. Forward reads it and never changes it; a caller may replace Body before Forward (an
// Anthropic body with a cache_control breakpoint injected, say).
type Request struct {
	// Format is the endpoint's format (prefixkey.FormatOfPath of the URL path); 0 for another
	// endpoint.
	Format prefixkey.Format
	// Parsed is the parsed body; nil when Format is 0.
	Parsed *prefixkey.Request
	// Body is the body as the client sent it.
	Body []byte

	budget *Budget
	held   int64
	body   restoredBody // the http.Request's Body once read
}

// Release gives back the bytes the request holds against Handler.BodyBudget. Call it once the
// body is no longer used (Forward has returned); later calls do nothing. A no-op without a
// budget. Not safe for concurrent use.
func (r *Request) Release() {
	if r.budget != nil {
		r.budget.Release(r.held)
		r.budget = nil
	}
}

// restoredBody is an http.Request's body read again from memory.
type restoredBody struct{ bytes.Reader }

// Close implements io.Closer.
func (*restoredBody) Close() error { return nil }

// Defaults of the zero Handler.
const (
	// DefaultMaxBodyBytes is Handler.MaxBodyBytes's default: 8 MiB.
	DefaultMaxBodyBytes = 8 << 20
	// DefaultReadTimeout is Handler.ReadTimeout's default.
	DefaultReadTimeout = time.Minute
	// DefaultRetries is Handler.Retries's default: an attempt that failed before anything reached
	// the client is tried once more, on another backend.
	DefaultRetries = 1
)

// budgetWait bounds the wait of a request for room in its Budget.
const budgetWait = time.Second

// A body over parseEstimateFrom bytes is also charged what its parsed Request will hold against
// the Budget before it is parsed (prefixkey.EstimateParseCost: the decoded copy of its escaped
// text, a few hundred bytes per JSON object).
const parseEstimateFrom = 64 << 10

// errBudget is readBody's error when the Budget left no room within budgetWait.
var errBudget = errors.New("kvhttp: too many request bytes in flight")

// ReadRequest reads r's body and parses it by the format of r's path (prefixkey.FormatOfPath;
// a path of no LLM endpoint is read, not parsed). It reads at most h.MaxBodyBytes: a body that
// announces more is refused before any of it is read, and one that sends more is cut there. The
// whole body must arrive within h.ReadTimeout of the call, a read deadline set through
// http.ResponseController (when the ResponseWriter supports one). With h.BodyBudget, the body's
// bytes (its Content-Length, or MaxBodyBytes without one), and for a large body what parsing it
// costs, are held against the budget until Request.Release; a request that finds no room within
// a second is refused.
//
// It returns the request, with r.Body set to read the body again from memory, or an error after
// it has answered the client in the style of the endpoint's API (package apierror): 413
// request_too_large, 408 request_timeout (both closing the connection, whose unread bytes would
// otherwise be drained), 503 overloaded with Retry-After: 1 (the budget), 400
// invalid_request_error (a malformed body, with the field at fault as param, or a body that could
// not be read). Safe for concurrent use.
func (h *Handler) ReadRequest(w http.ResponseWriter, r *http.Request) (*Request, error) {
	format := prefixkey.FormatOfPath(r.URL.Path)
	req := &Request{Format: format, budget: h.BodyBudget}
	if err := h.readBody(w, r, req); err != nil {
		readError(w, format, err)
		return nil, err
	}
	if format != 0 {
		parsed, err := prefixkey.Parse(format, req.Body)
		if err != nil {
			req.Release()
			param, msg := "", err.Error()
			if fe, ok := errors.AsType[*prefixkey.FieldError](err); ok {
				param, msg = fe.Field, "malformed request: "+fe.Reason
				if fe.Field != "" {
					msg = "malformed request: " + fe.Field + ": " + fe.Reason
				}
			}
			apierror.Error{Status: http.StatusBadRequest, Code: "invalid_request_error", Param: param, Message: msg}.Write(w, format)
			return nil, err
		}
		req.Parsed = parsed
	}
	req.body.Reset(req.Body)
	r.Body, r.ContentLength = &req.body, int64(len(req.Body))
	return req, nil
}

// readBody reads r's body into req.Body, holding its bytes against req.budget (req.held) when
// there is one. On error nothing is held.
func (h *Handler) readBody(w http.ResponseWriter, r *http.Request, req *Request) error {
	limit := h.maxBodyBytes()
	if r.ContentLength > limit {
		return &http.MaxBytesError{Limit: limit}
	}
	n := r.ContentLength
	if n < 0 { // no Content-Length (HTTP/2, chunked): room for the largest body
		n = limit
	}
	if r.Body == nil { // a client's request, not a server's
		r.Body = http.NoBody
	}
	if b := req.budget; b != nil {
		if !b.TryAcquire(n) && !b.acquireWithin(r.Context(), n) {
			req.budget = nil
			return errBudget
		}
		req.held = n
	}
	if t := h.readTimeout(); t > 0 {
		_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(t))
	}
	buf := bytes.NewBuffer(make([]byte, 0, n+bytes.MinRead))
	if _, err := buf.ReadFrom(http.MaxBytesReader(w, r.Body, limit)); err != nil {
		req.Release()
		return err
	}
	req.Body = buf.Bytes()
	// The parsed Request is held beside the body: its escaped text decoded, a Message or Part
	// per JSON object. Hold that too before parsing a large body.
	if b := req.budget; b != nil && req.Format != 0 && len(req.Body) > parseEstimateFrom {
		if extra := prefixkey.EstimateParseCost(req.Body); extra > 0 {
			extra = min(extra, b.size-n)
			if !b.TryAcquire(extra) && !b.acquireWithin(r.Context(), extra) {
				req.Release()
				return errBudget
			}
			req.held += extra
		}
	}
	return nil
}

// readError answers a readBody error.
func readError(w http.ResponseWriter, format prefixkey.Format, err error) {
	if mb, ok := errors.AsType[*http.MaxBytesError](err); ok {
		// The rest of the body is not read: close the connection rather than let net/http
		// drain up to 256 KiB of it before the answer goes out.
		w.Header().Set("Connection", "close")
		apierror.Error{Status: http.StatusRequestEntityTooLarge, Code: "request_too_large",
			Message: "request body exceeds the limit of " + strconv.FormatInt(mb.Limit, 10) + " bytes"}.Write(w, format)
		return
	}
	switch {
	case errors.Is(err, errBudget):
		w.Header().Set("Retry-After", "1")
		apierror.Error{Status: http.StatusServiceUnavailable, Code: "overloaded",
			Message: "the gateway is holding too many request bodies; retry shortly"}.Write(w, format)
	case errors.Is(err, os.ErrDeadlineExceeded):
		w.Header().Set("Connection", "close")
		apierror.Error{Status: http.StatusRequestTimeout, Code: "request_timeout",
			Message: "the request body did not arrive in time"}.Write(w, format)
	default:
		apierror.Error{Status: http.StatusBadRequest, Code: "invalid_request_error",
			Message: "cannot read the request body: " + err.Error()}.Write(w, format)
	}
}

// Budget bounds the bytes of the request bodies that Handlers hold at once, read or being
// parsed: a weighted semaphore, first come first served. Share one among the Handlers it should
// bound together (those of a gateway's generations across a configuration reload, say). Safe for
// concurrent use.
type Budget struct {
	size    int64
	mu      sync.Mutex
	used    int64
	waiters []*budgetWaiter // in arrival order
}

// budgetWaiter is one Acquire waiting for room.
type budgetWaiter struct {
	n     int64
	ready chan struct{} // closed once its bytes are held
}

// NewBudget returns a Budget of size bytes (at least 1).
func NewBudget(size int64) *Budget { return &Budget{size: max(size, 1)} }

// TryAcquire holds n bytes and reports true when they are free now and nobody waits before it;
// otherwise it holds nothing and reports false. n above the budget's size counts as its size.
func (b *Budget) TryAcquire(n int64) bool {
	n = min(max(n, 0), b.size)
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.waiters) == 0 && b.used+n <= b.size {
		b.used += n
		return true
	}
	return false
}

// Acquire holds n bytes, waiting for them after the requests that came first, until ctx ends:
// then it holds nothing and returns ctx.Err(). n above the budget's size counts as its size.
func (b *Budget) Acquire(ctx context.Context, n int64) error {
	n = min(max(n, 0), b.size)
	b.mu.Lock()
	if len(b.waiters) == 0 && b.used+n <= b.size {
		b.used += n
		b.mu.Unlock()
		return nil
	}
	wt := &budgetWaiter{n: n, ready: make(chan struct{})}
	b.waiters = append(b.waiters, wt)
	b.mu.Unlock()
	select {
	case <-wt.ready:
		return nil
	case <-ctx.Done():
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	select {
	case <-wt.ready: // served meanwhile: give it back
		b.used -= n
	default:
		for i, x := range b.waiters {
			if x == wt {
				b.waiters = append(b.waiters[:i], b.waiters[i+1:]...)
				break
			}
		}
	}
	b.wake()
	return ctx.Err()
}

// acquireWithin is Acquire bounded by budgetWait, reporting success.
func (b *Budget) acquireWithin(ctx context.Context, n int64) bool {
	ctx, cancel := context.WithTimeout(ctx, budgetWait)
	defer cancel()
	return b.Acquire(ctx, n) == nil
}

// Release gives back n bytes held by TryAcquire or Acquire (n above the budget's size counts as
// its size). Releasing more than is held is a programmer error: it panics.
func (b *Budget) Release(n int64) {
	n = min(max(n, 0), b.size)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.used -= n; b.used < 0 {
		panic("kvhttp: Budget released more than held")
	}
	b.wake()
}

// wake serves the waiters in order while their bytes fit. b.mu is held.
func (b *Budget) wake() {
	for len(b.waiters) > 0 {
		wt := b.waiters[0]
		if b.used+wt.n > b.size {
			return
		}
		b.used += wt.n
		b.waiters = b.waiters[1:]
		close(wt.ready)
	}
}
