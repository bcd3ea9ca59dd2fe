package kvhttp

import (
	"net"
	"net/http"
	"strings"
	"time"
)

// DefaultDialTimeout is NewTransport's dial timeout when given 0.
const DefaultDialTimeout = 5 * time.Second

// NewTransport returns an http.Transport for a gateway's requests to its backends: keep-alive
// connections enough for a busy fleet (512 idle, 128 per backend, closed after 90 s unused),
// dials bounded by dialTimeout (0 means DefaultDialTimeout), TLS handshakes by 10 s, no proxy
// from the environment, and identity bodies (no compression: cacheable, readable, and streamed
// without a decompressor's buffering). http.DefaultTransport keeps only 2 idle connections per
// backend, which under concurrent load means a new connection for most requests. Handler's
// Transport is one of these when left nil.
func NewTransport(dialTimeout time.Duration) *http.Transport {
	if dialTimeout <= 0 {
		dialTimeout = DefaultDialTimeout
	}
	dialer := &net.Dialer{Timeout: dialTimeout, KeepAlive: 30 * time.Second}
	return &http.Transport{
		DialContext:           dialer.DialContext,
		MaxIdleConns:          512,
		MaxIdleConnsPerHost:   128,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ExpectContinueTimeout: time.Second,
		DisableCompression:    true,
	}
}

// hopHeaders are the hop-by-hop headers (RFC 9110, section 7.6.1) a proxy does not forward.
var hopHeaders = []string{"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization",
	"Te", "Trailer", "Transfer-Encoding", "Upgrade"}

// UpstreamHeader returns a copy of h, a client's request headers, as Forward sends them to a
// backend (but for X-Forwarded-*), for a request of the gateway's own beside the forwarded one (a
// disaggregated prefill, say): without the hop-by-hop headers (RFC 9110, section 7.6.1) and
// those its Connection header names, Content-Length, Expect and Accept-Encoding. Applied to a
// backend's response headers, it gives those a proxy relays (Content-Length aside).
func UpstreamHeader(h http.Header) http.Header {
	h = h.Clone()
	for _, f := range h.Values("Connection") {
		for name := range strings.SplitSeq(f, ",") {
			if n := strings.TrimSpace(name); n != "" {
				h.Del(n)
			}
		}
	}
	for _, k := range hopHeaders {
		h.Del(k)
	}
	h.Del("Content-Length")
	h.Del("Expect")
	h.Del("Accept-Encoding")
	return h
}
