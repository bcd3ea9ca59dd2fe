package main

import (
	"net/http"
	"net/url"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/kvhttp"
)

// NewGateway returns the handler of the LLM endpoints: kvhttp.Handler reads the body (at most
// 8 MiB), parses it, routes it, forwards it to the chosen backend (once more to another backend
// when the first fails before answering), and tells the Router how it went — FirstToken when the
// first byte of a successful (2xx) answer goes out, then Done once with the request's Outcome:
// a failure (Err) for a 5xx, a transport error or an answer that broke off; a refusal for an
// engine's 429 or 503 (load, not ill health); nothing recorded (NotSent) when the client left.
func NewGateway(router kvroute.Router, backends map[string]*url.URL) http.Handler {
	return &kvhttp.Handler{Router: router, Backends: backends}
}
