package kvhttp

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/apierror"
	"github.com/kvroute/kvroute/health"
)

// attemptKey is the context key under which an attempt finds itself.
type attemptKey struct{}

// attempt is one forwarding of a request to one backend. It is also the context of the upstream
// call: the client's values and, for attemptKey, the attempt itself; for a stream (or an attempt
// with a header timeout) with a cancellation of its own (cancel), so that the call can outlive
// the client's context (see Handler.attempt). Its parts live in one allocation: its
// ResponseWriter, its body reader, its header values.
type attempt struct {
	// Context answers Done, Err and context.Cause: the client's context, or for a stream a
	// cancelCtx parented on nothing.
	context.Context
	client context.Context         // the client request's: values, and the cancellation that cancel follows
	cancel context.CancelCauseFunc // nil when Context is client

	t        *Target
	url      *url.URL // t.URL, or the Handler's URL of t.Backend
	lease    Lease
	stream   bool
	canRetry bool   // a failure before the response may be retried elsewhere
	retried  string // X-Kvroute-Retried-From, when set
	body     []byte // the upstream request's body
	status   int    // the backend's status, 0 before its response
	refused  bool   // the backend declined the request for lack of capacity (health.Classify)
	err      error  // the transport's (or ModifyResponse's) error, before anything was written
	// headers is headersWaiting until the response headers arrive (headersArrived) or the header
	// timeout fires (headersTimedOut), whichever comes first.
	headers atomic.Int32

	w       writer
	grace   atomic.Pointer[time.Timer] // the stream-end grace timer, once the client has left
	bodyR   bytes.Reader
	reqBody io.ReadCloser // bodyR, as net/http recognises an in-memory body
	hdrs    [2]string     // the values of X-Kvroute-Backend and X-Kvroute-Route
}

// States of attempt.headers.
const (
	headersWaiting int32 = iota
	headersArrived
	headersTimedOut
)

// streamEndGrace bounds how long an upstream stream whose terminal event was already relayed may
// take to end after the client left.
const streamEndGrace = 2 * time.Second

// Value returns the attempt for attemptKey, and the client context's values otherwise (but for
// the attempt's own cancellation, which its embedded context answers).
func (a *attempt) Value(key any) any {
	if key == (attemptKey{}) {
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

// setHeaders sets the attempt's response headers in h: X-Kvroute-Backend, -Route, Target.Header
// and X-Kvroute-Retried-From; a backend's X-Kvroute-Cached-Tokens goes unless the Target sets it.
func (a *attempt) setHeaders(h http.Header) {
	t := a.t
	a.hdrs = [2]string{t.Backend, t.Route}
	h[HeaderBackend] = a.hdrs[0:1:1]
	if t.Route != "" {
		h[HeaderRoute] = a.hdrs[1:2:2]
	}
	h.Del(HeaderCachedTokens)
	for k, v := range t.Header {
		if len(v) == 0 {
			h.Del(k)
		} else {
			h[k] = v
		}
	}
	if a.retried != "" {
		h.Set(HeaderRetriedFrom, a.retried)
	}
}

// getBody returns a new reader of the request body (http.Request.GetBody).
func (a *attempt) getBody() (io.ReadCloser, error) {
	return io.NopCloser(bytes.NewReader(a.body)), nil
}

// failure is an attempt that failed before anything reached the client and may be retried: its
// cause and the Outcome its Lease is to hear.
type failure struct {
	cause   error
	outcome kvroute.Outcome
}

// init builds the Handler's ReverseProxy.
func (h *Handler) init() {
	tr := h.Transport
	if tr == nil {
		tr = NewTransport(0)
	}
	h.rp = &httputil.ReverseProxy{
		Rewrite:   rewrite,
		Transport: tr,
		// Without a pool ReverseProxy allocates a 32 KiB copy buffer per response.
		BufferPool: &bufferPool{},
		// FlushInterval 0: ReverseProxy flushes streams (text/event-stream, or no Content-Length)
		// after every write by itself, and writes a response of known length with its headers in
		// one go. -1 would also flush a plain JSON answer's headers apart from its body, from a
		// timer goroutine: two writes and a goroutine per request.
		ErrorLog:       h.ErrorLog,
		ModifyResponse: modifyResponse,
		ErrorHandler: func(_ http.ResponseWriter, r *http.Request, err error) {
			r.Context().Value(attemptKey{}).(*attempt).err = err
		},
	}
}

// rewrite points the upstream request at the attempt's backend.
func rewrite(pr *httputil.ProxyRequest) {
	a := pr.In.Context().Value(attemptKey{}).(*attempt)
	pr.SetURL(a.url)
	pr.SetXForwarded()
	// ReverseProxy wraps the body in a reader net/http does not know to be in memory, which makes
	// the transport send the headers and the body in two writes; the body is in memory, so hand
	// the transport a reader it recognises: one write per request.
	if pr.Out.Body != nil {
		a.bodyR.Reset(a.body)
		pr.Out.Body, pr.Out.ContentLength, pr.Out.GetBody = a.reqBody, int64(len(a.body)), a.getBody
	}
	// Identity bodies: readable (usage) and cacheable, streamed as they come. The body is already
	// read, so the backend's own 100 Continue would reach the client as a second one.
	pr.Out.Header.Del("Accept-Encoding")
	pr.Out.Header.Del("Expect")
	for k, v := range a.t.RequestHeader {
		pr.Out.Header[k] = v
	}
}

// modifyResponse classifies the backend's answer: a failure or refusal that may be retried
// becomes an error (ErrorHandler then keeps it), any other answer gets the attempt's headers.
func modifyResponse(res *http.Response) error {
	a := res.Request.Context().Value(attemptKey{}).(*attempt)
	if !a.headers.CompareAndSwap(headersWaiting, headersArrived) && a.headers.Load() == headersTimedOut {
		return ErrHeaderTimeout
	}
	a.status = res.StatusCode
	if ans := health.Classify(res); ans != health.AnswerServed {
		a.refused = ans == health.AnswerRefused
		if a.canRetry {
			return &StatusError{Code: res.StatusCode, Refused: a.refused}
		}
	}
	// The headers go with the final answer (ReverseProxy copies them over; informational answers
	// before it are relayed as the backend sent them), replacing any the backend sent under the
	// same names.
	a.setHeaders(res.Header)
	return nil
}

// attempt forwards req to t's backend. It returns a failure when the backend failed before
// anything was written to the client and canRetry is set: the caller then owns t's Lease.
// Otherwise it has answered the client (or the client left) and ended the Lease.
func (h *Handler) attempt(w http.ResponseWriter, r *http.Request, req *Request, t *Target, failed []string, canRetry bool) *failure {
	l := lease(t)
	var end func(Result)
	if h.Attempt != nil {
		var err error
		if end, err = h.Attempt(r, t); err != nil {
			if canRetry {
				return &failure{cause: err, outcome: kvroute.Outcome{NotSent: true}}
			}
			l.Done(kvroute.Outcome{NotSent: true})
			h.answerFailure(w, req, t, failed, err)
			return nil
		}
	}
	u := t.URL
	if u == nil {
		u = h.Backends[t.Backend]
	}
	if u == nil {
		err := errors.New("kvhttp: no URL for backend " + t.Backend)
		if end != nil {
			end(Result{Err: err, Outcome: kvroute.Outcome{NotSent: true}, CachedTokens: -1})
		}
		if canRetry {
			return &failure{cause: err, outcome: kvroute.Outcome{NotSent: true}}
		}
		l.Done(kvroute.Outcome{NotSent: true})
		h.answerFailure(w, req, t, failed, err)
		return nil
	}
	body := t.Body
	if body == nil {
		body = req.Body
	}
	a := &attempt{Context: r.Context(), client: r.Context(), t: t, url: u, lease: l, canRetry: canRetry, body: body,
		stream: req.Parsed != nil && req.Parsed.Params.Stream}
	if len(failed) > 0 {
		a.retried = strings.Join(failed, ", ")
	}
	a.w = writer{ResponseWriter: w, a: a}
	aw := &a.w
	// The upstream call follows the client's cancellation, except that a stream whose terminal
	// event has already gone out is let finish: SDK clients close the connection as soon as they
	// read "data: [DONE]", and cancelling the upstream read then would abort a complete response
	// (which a response cache would then not store). A stream's context (and one with a header
	// timeout, which may cancel it) is then the attempt's own, with a cancellation that follows
	// the client's (clientGone); a plain answer's is the client's.
	if a.stream || t.HeaderTimeout > 0 {
		ctx, cancel := context.WithCancelCause(context.Background())
		defer cancel(nil)
		a.Context, a.cancel = ctx, cancel
		stopAfter := context.AfterFunc(r.Context(), a.clientGone)
		defer func() {
			if !stopAfter() {
				if tm := a.grace.Load(); tm != nil {
					tm.Stop()
				}
			}
		}()
	}
	if t.HeaderTimeout > 0 {
		tm := time.AfterFunc(t.HeaderTimeout, func() {
			if a.headers.CompareAndSwap(headersWaiting, headersTimedOut) {
				a.cancel(ErrHeaderTimeout)
			}
		})
		defer tm.Stop()
	}
	// ReverseProxy copies the request; Rewrite gives the copy the body again, in a reader that
	// net/http knows to be in memory.
	out := r.WithContext(a)
	a.bodyR.Reset(body)
	a.reqBody = io.NopCloser(&a.bodyR)
	out.Body, out.ContentLength, out.GetBody = a.reqBody, int64(len(body)), nil

	completed := false
	defer func() {
		if completed {
			return
		}
		// ReverseProxy aborts (panics with http.ErrAbortHandler) when the copy of the body fails:
		// the backend died mid-answer, or the client left. The panic goes on to net/http.
		res := Result{Status: a.status, Err: ErrAborted, Outcome: kvroute.Outcome{Err: ErrAborted}, CachedTokens: aw.scan.CachedTokens()}
		if aw.writeErr != nil || r.Context().Err() != nil {
			res.Err, res.Outcome = clientErr(r.Context(), aw.writeErr), kvroute.Outcome{NotSent: true}
		}
		if end != nil {
			end(res)
		}
		l.Done(res.Outcome)
	}()
	h.rp.ServeHTTP(aw, out)
	completed = true
	if a.err != nil && a.headers.Load() == headersTimedOut {
		a.err = ErrHeaderTimeout
	}

	res := Result{Status: a.status, Err: a.err, CachedTokens: aw.scan.CachedTokens()}
	if a.err != nil && !aw.wroteHeader {
		switch {
		case r.Context().Err() != nil: // the client left before the answer
			res.Err, res.Outcome = clientErr(r.Context(), nil), kvroute.Outcome{NotSent: true}
		case a.refused:
			res.Outcome.Refused = true
		default:
			res.Outcome.Err = a.err
		}
		if end != nil {
			end(res)
		}
		if canRetry && !res.Outcome.NotSent {
			return &failure{cause: a.err, outcome: res.Outcome}
		}
		l.Done(res.Outcome)
		if !res.Outcome.NotSent {
			h.answerFailure(w, req, t, failed, a.err)
		}
		return nil
	}
	switch {
	case a.refused: // relayed as the engine sent it: room, not health
		res.Outcome.Refused = true
	case a.status >= 500:
		res.Err = &StatusError{Code: a.status}
		res.Outcome.Err = res.Err
	}
	if end != nil {
		end(res)
	}
	l.Done(res.Outcome)
	return nil
}

// clientErr is the failure of an attempt whose client left: the client's context's cause, or
// the write error.
func clientErr(ctx context.Context, writeErr error) error {
	if err := context.Cause(ctx); err != nil {
		return err
	}
	return writeErr
}

// answerFailure answers the client for an attempt on t that failed with err before answering
// (and is not retried): err itself when it is an apierror.Error, else 502 upstream_error. The
// answer carries t's headers.
func (h *Handler) answerFailure(w http.ResponseWriter, req *Request, t *Target, failed []string, err error) {
	a := attempt{t: t}
	if len(failed) > 0 {
		a.retried = strings.Join(failed, ", ")
	}
	a.setHeaders(w.Header())
	if ae, ok := errors.AsType[apierror.Error](err); ok {
		ae.Write(w, req.Format)
		return
	}
	apierror.Error{Status: http.StatusBadGateway, Code: "upstream_error", Message: failedMessage(failed, t.Backend, err)}.Write(w, req.Format)
}

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
