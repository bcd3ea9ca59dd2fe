package main

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/apierror"
	"github.com/kvroute/kvroute/prefixkey"
)

// NewGateway returns the handler of the LLM endpoints: read the body (at most 8 MiB), parse it,
// route it, forward it to the chosen backend, and tell the Router how it went — FirstToken when
// the first byte of a successful (2xx) answer arrives, then Done once with the request's Outcome:
// a failure (Err) for a 5xx or a transport error, before or during the answer; a refusal for an
// engine's 429 or 503 (load, not ill health); nothing recorded (NotSent) when the client left.
func NewGateway(router kvroute.Router, backends map[string]*url.URL) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		format := prefixkey.FormatOfPath(r.URL.Path)
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 8<<20))
		if err != nil {
			apierror.Error{Status: http.StatusRequestEntityTooLarge, Code: "request_too_large", Message: err.Error()}.Write(w, format)
			return
		}
		req, err := prefixkey.Parse(format, body)
		if err != nil {
			apierror.Error{Status: http.StatusBadRequest, Code: "invalid_request_error", Message: err.Error()}.Write(w, format)
			return
		}
		d, err := router.Route(r.Context(), req)
		if err != nil {
			apierror.Error{Status: http.StatusServiceUnavailable, Code: "no_healthy_backend", Message: err.Error()}.Write(w, format)
			return
		}
		var o kvroute.Outcome // a success unless the backend's answer says otherwise
		finished := false
		// Done runs once, here, also when ReverseProxy panics (http.ErrAbortHandler) because the
		// answer broke off: the backend died, or the client left.
		defer func() {
			switch {
			case finished && o.Err == nil: // the answer went out whole: a success, or a refusal
			case r.Context().Err() != nil: // the client left: cancelled, so nothing is recorded
				o = kvroute.Outcome{NotSent: true}
			case !finished:
				o.Err = errBrokeOff
			}
			d.Done(o)
		}()
		proxy := &httputil.ReverseProxy{
			Rewrite: func(pr *httputil.ProxyRequest) { pr.SetURL(backends[d.Backend]) },
			ModifyResponse: func(res *http.Response) error {
				switch c := res.StatusCode; {
				case c == http.StatusTooManyRequests || c == http.StatusServiceUnavailable:
					o.Refused = true
				case c >= 500:
					o.Err = errors.New("backend answered " + res.Status)
				case c >= 200 && c < 300:
					res.Body = &firstByte{ReadCloser: res.Body, d: d}
				}
				return nil
			},
			ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
				o.Err = err
				if r.Context().Err() == nil {
					apierror.Error{Status: http.StatusBadGateway, Code: "upstream_error", Message: "backend " + d.Backend + " failed"}.Write(w, format)
				}
			},
		}
		r.Body, r.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
		w.Header().Set("X-Kvroute-Backend", d.Backend)
		proxy.ServeHTTP(w, r)
		finished = true
	})
}

// errBrokeOff is the outcome of an answer the backend broke off.
var errBrokeOff = errors.New("the backend's answer broke off")

// firstByte calls d.FirstToken when the first bytes of the answer arrive.
type firstByte struct {
	io.ReadCloser
	d    *kvroute.Decision
	seen bool
}

func (b *firstByte) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if n > 0 && !b.seen {
		b.seen = true
		b.d.FirstToken()
	}
	return n, err
}
