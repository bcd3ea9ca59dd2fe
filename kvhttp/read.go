package kvhttp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
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

	budget  *Budget
	held    int64        // bytes held in budget
	client  string       // the client the body's bytes count to (Handler.ClientKey)
	charged int64        // bytes of held counted to client
	body    restoredBody // the http.Request's Body once read
}

// Release gives back the bytes the request holds against Handler.BodyBudget. Call it once the
// body is no longer used (Forward has returned); later calls do nothing. A no-op without a
// budget. Not safe for concurrent use.
func (r *Request) Release() {
	if r.budget != nil {
		r.budget.release(r.held, r.client, r.charged)
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
	// DefaultBodyIdleTimeout is Handler.BodyIdleTimeout's default.
	DefaultBodyIdleTimeout = 10 * time.Second
)

// budgetWait bounds the wait of a request for room in its Budget.
const budgetWait = time.Second

// A body over parseEstimateFrom bytes is also charged what its parsed Request will hold against
// the Budget before it is parsed (prefixkey.EstimateParseCost: the decoded copy of its escaped
// text, a few hundred bytes per JSON object).
const parseEstimateFrom = 64 << 10

// errBodyIdle is readBody's error when no byte of the body came within Handler.BodyIdleTimeout.
var errBodyIdle = fmt.Errorf("kvhttp: the request body made no progress: %w", os.ErrDeadlineExceeded)

// A body's buffer, and what it holds against the Budget, grows as its bytes arrive: bodyChunk
// first (or the whole body when it announces less), then doubling, up to its length. A body that
// announces at most smallBody bytes is small: it may use the Budget's reserve.
const (
	bodyChunk = 16 << 10
	smallBody = 64 << 10
)

// ReadRequest reads r's body and parses it by the format of r's path (prefixkey.FormatOfPath;
// a path of no LLM endpoint is read, not parsed). It reads at most h.MaxBodyBytes: a body that
// announces more is refused before any of it is read, and one that sends more is cut there. The
// whole body must arrive within h.ReadTimeout of the call, and no more than h.BodyIdleTimeout may
// pass without a byte of it: read deadlines set through http.ResponseController (when the
// ResponseWriter supports them). The body's buffer grows as its bytes arrive (16 KiB first, then
// doubling), so that a body announced and never sent costs little. With h.BodyBudget, each growth
// is held against the budget before it is made (see Budget for the reserve of small bodies and
// the bound of one client, h.MaxClientBodyBytes), and so, for a large body, is what parsing it
// costs, until Request.Release; a growth that finds no room within a second refuses the request
// and gives back what it held.
//
// It returns the request, with r.Body set to read the body again from memory, or an error after
// it has answered the client in the style of the endpoint's API (package apierror): 413
// request_too_large, 408 request_timeout (both closing the connection, whose unread bytes would
// otherwise be drained), 503 overloaded with Retry-After: 1 and the connection closed (the
// budget, or the client's bound), 400 invalid_request_error (a malformed body, with the field at
// fault as param, or a body that could not be read). Safe for concurrent use.
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
	if r.Body == nil { // a client's request, not a server's
		r.Body = http.NoBody
	}
	var deadline time.Time
	if t := h.readTimeout(); t > 0 {
		deadline = time.Now().Add(t)
		_ = http.NewResponseController(w).SetReadDeadline(deadline)
	}
	hb := h.heldBody(r, req, limit)
	// A body that announces its length is read up to that length and no further (heldBody.read),
	// which the check above keeps within the limit: only one of unknown length needs cutting.
	body := r.Body
	if r.ContentLength < 0 {
		body = http.MaxBytesReader(w, r.Body, limit)
	}
	watch := h.watchIdle(w, deadline)
	buf, err := hb.read(r.Context(), body, watch)
	if h.stopWatch(watch, err == nil) && errors.Is(err, os.ErrDeadlineExceeded) {
		err = errBodyIdle
	}
	if err != nil {
		req.Release()
		if errors.Is(err, errBudget) || errors.Is(err, errClientBudget) {
			w.Header().Set("Connection", "close") // the rest of the body is not read
		}
		return err
	}
	req.Body = buf
	n := req.held
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
	case errors.Is(err, errClientBudget):
		w.Header().Set("Retry-After", "1")
		apierror.Error{Status: http.StatusServiceUnavailable, Code: "overloaded",
			Message: "the gateway is holding too many request bodies from this client; retry shortly"}.Write(w, format)
	case errors.Is(err, errBodyIdle):
		w.Header().Set("Connection", "close")
		apierror.Error{Status: http.StatusRequestTimeout, Code: "request_timeout",
			Message: "the request body stalled: no bytes of it arrived within the body idle timeout"}.Write(w, format)
	case errors.Is(err, os.ErrDeadlineExceeded):
		w.Header().Set("Connection", "close")
		apierror.Error{Status: http.StatusRequestTimeout, Code: "request_timeout",
			Message: "the request body did not arrive in time"}.Write(w, format)
	default:
		apierror.Error{Status: http.StatusBadRequest, Code: "invalid_request_error",
			Message: "cannot read the request body: " + err.Error()}.Write(w, format)
	}
}

// heldBody is a body being read: its size, and the bounds on what it may hold of a Budget.
type heldBody struct {
	req   *Request
	size  int64 // the bytes it announces, or -1
	total int64 // the most it may have: size, or the limit
	ceil  int64 // how high the Budget's use may go for it: its size, or less for a large body
	limit int64 // the most its client may hold, 0 for no bound
	most  int64 // the most it holds: total, ceil or limit, whichever is least
}

// heldBody returns the heldBody of r, of at most limit bytes, for req, whose bytes it counts to
// the client of r.
func (h *Handler) heldBody(r *http.Request, req *Request, limit int64) heldBody {
	hb := heldBody{req: req, size: r.ContentLength, total: r.ContentLength}
	if hb.total < 0 { // no Content-Length (HTTP/2, chunked): as large as allowed
		hb.total = limit
	}
	b := req.budget
	if b == nil {
		return hb
	}
	req.client = h.clientKey(r)
	one := min(limit, b.size) // a body of MaxBodyBytes always fits, alone
	hb.ceil = b.size
	if hb.size < 0 || hb.size > smallBody {
		hb.ceil = max(b.size-b.size/4, one)
	}
	hb.most = min(hb.total, hb.ceil)
	switch {
	case h.MaxClientBodyBytes == 0:
		hb.limit = max(b.size/2, one)
	case h.MaxClientBodyBytes > 0:
		hb.limit = max(h.MaxClientBodyBytes, one)
	}
	if hb.limit > 0 {
		hb.most = min(hb.most, hb.limit)
	}
	return hb
}

// clientKey is r's client: ClientKey's, or the host of r.RemoteAddr.
func (h *Handler) clientKey(r *http.Request) string {
	if h.ClientKey != nil {
		return h.ClientKey(r)
	}
	if host, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		return host
	}
	return r.RemoteAddr
}

// read reads body into a buffer that grows as the bytes arrive, each growth held first, telling
// watch of every progress.
func (hb *heldBody) read(ctx context.Context, body io.Reader, watch *idleWatch) ([]byte, error) {
	buf := []byte{}
	for {
		if len(buf) == cap(buf) {
			switch {
			case int64(len(buf)) == hb.size:
				return buf, nil
			case int64(len(buf)) == hb.total: // no Content-Length, and at the limit: is there more?
				var one [1]byte
				if n, err := body.Read(one[:]); n > 0 || err != io.EOF {
					if err == nil || err == io.EOF {
						err = &http.MaxBytesError{Limit: hb.total}
					}
					return nil, err
				}
				return buf, nil
			}
			next := min(max(2*int64(cap(buf)), bodyChunk), hb.total)
			if err := hb.hold(ctx, next, watch); err != nil {
				return nil, err
			}
			nb := make([]byte, len(buf), next)
			copy(nb, buf)
			buf = nb
		}
		n, err := body.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if n > 0 {
			watch.progress()
		}
		switch {
		case err == io.EOF:
			return buf, nil
		case err != nil:
			return nil, err
		}
	}
}

// hold holds what a buffer of size bytes needs beyond what the body holds, up to its most. The
// wait for room does not count against the body's idle timeout.
func (hb *heldBody) hold(ctx context.Context, size int64, watch *idleWatch) error {
	req := hb.req
	b := req.budget
	if b == nil || min(size, hb.most) <= req.charged {
		return nil
	}
	g := grant{n: min(size, hb.most) - req.charged, ceil: hb.ceil, client: req.client, limit: hb.limit, counted: true}
	watch.pause()
	err := b.grantWithin(ctx, g)
	watch.resume()
	if err != nil {
		return err
	}
	req.held += g.n
	req.charged += g.n
	return nil
}

// idleWatch cuts a body that makes no progress for idle: it sets the connection's read deadline
// in the past, which fails the pending Read. Its methods do nothing on a nil idleWatch. A Handler
// keeps the idleWatches whose timer was stopped before it fired, to watch other bodies with.
type idleWatch struct {
	idle    time.Duration
	w       http.ResponseWriter // whose connection's read deadline is set (http.ResponseController)
	restore time.Time           // the read deadline to set again when the cut came after the body's end
	timer   *time.Timer

	mu                   sync.Mutex
	last                 time.Time // the last progress
	paused, stopped, cut bool
}

// watchIdle starts the idleWatch of a body read through w, whose read deadline is deadline;
// nil when h.BodyIdleTimeout is negative. Give it back with stopWatch.
func (h *Handler) watchIdle(w http.ResponseWriter, deadline time.Time) *idleWatch {
	d := h.bodyIdleTimeout()
	if d <= 0 {
		return nil
	}
	wt, _ := h.watches.Get().(*idleWatch)
	if wt == nil {
		wt = &idleWatch{}
	}
	wt.mu.Lock()
	defer wt.mu.Unlock()
	wt.idle, wt.w, wt.restore, wt.last = d, w, deadline, time.Now()
	wt.paused, wt.stopped, wt.cut = false, false, false
	if wt.timer == nil {
		wt.timer = time.AfterFunc(d, wt.check)
	} else {
		wt.timer.Reset(d)
	}
	return wt
}

// stopWatch stops wt and reports whether it cut the body (idleWatch.stop). A watch whose timer
// never fired goes back to h for another body; one whose timer fired may still be running it,
// and is left to the garbage collector.
func (h *Handler) stopWatch(wt *idleWatch, ok bool) bool {
	if wt == nil {
		return false
	}
	cut, reuse := wt.stop(ok)
	if reuse {
		h.watches.Put(wt)
	}
	return cut
}

// check, on the timer, cuts the body when it made no progress for idle, or sets the timer again.
func (wt *idleWatch) check() {
	wt.mu.Lock()
	defer wt.mu.Unlock()
	if wt.stopped || wt.paused {
		return
	}
	if left := wt.idle - time.Since(wt.last); left > 0 {
		wt.timer.Reset(left)
		return
	}
	wt.cut = true
	_ = http.NewResponseController(wt.w).SetReadDeadline(time.Unix(1, 0))
}

func (wt *idleWatch) progress() {
	if wt != nil {
		wt.mu.Lock()
		wt.last = time.Now()
		wt.mu.Unlock()
	}
}

func (wt *idleWatch) pause() {
	if wt != nil {
		wt.mu.Lock()
		wt.paused = true
		wt.mu.Unlock()
	}
}

// resume counts the idle time from now again, after a pause.
func (wt *idleWatch) resume() {
	if wt != nil {
		wt.mu.Lock()
		wt.paused, wt.last = false, time.Now()
		wt.timer.Reset(wt.idle)
		wt.mu.Unlock()
	}
}

// stop stops the watch and reports whether it cut the body, and whether its timer was stopped
// before it fired (the watch may then serve another body). When the body was read whole (ok)
// after all, the read deadline is set back.
func (wt *idleWatch) stop(ok bool) (cut, reuse bool) {
	wt.mu.Lock()
	defer wt.mu.Unlock()
	wt.stopped = true
	reuse = wt.timer.Stop()
	if wt.cut && ok {
		_ = http.NewResponseController(wt.w).SetReadDeadline(wt.restore)
	}
	cut = wt.cut
	wt.w = nil // the ResponseWriter is not kept past its request
	return cut, reuse && !cut
}
