package main

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/apierror"
	"github.com/kvroute/kvroute/prefixkey"
)

// NewGateway returns the handler of the LLM endpoints: read the body (at most 8 MiB), parse it,
// route it, forward it to the chosen backend, tell the router how it went.
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
		var failed error
		proxy := &httputil.ReverseProxy{
			Rewrite: func(pr *httputil.ProxyRequest) { pr.SetURL(backends[d.Backend]) },
			ErrorHandler: func(w http.ResponseWriter, _ *http.Request, err error) {
				failed = err
				apierror.Error{Status: http.StatusBadGateway, Code: "upstream_error", Message: "backend " + d.Backend + " failed"}.Write(w, format)
			},
		}
		r.Body, r.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
		w.Header().Set("X-Kvroute-Backend", d.Backend)
		proxy.ServeHTTP(w, r)
		d.Done(kvroute.Outcome{Err: failed})
	})
}
