package main

import (
	"io"
	"net/http"
	"net/http/httptrace"
	"net/http/httputil"
	"net/textproto"
	"net/url"
	"strings"
)

// isHopHeader reports whether the canonical key k is a hop-by-hop header (RFC 9110, section
// 7.6.1), which a proxy does not forward; so are the headers a Connection header names.
func isHopHeader(k string) bool {
	switch k {
	case "Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization",
		"Te", "Trailer", "Transfer-Encoding", "Upgrade":
		return true
	}
	return false
}

// connectionTokens returns the canonical names h's Connection header lists, nil when none.
func connectionTokens(h http.Header) []string {
	var names []string
	for _, v := range h["Connection"] {
		for tok := range strings.SplitSeq(v, ",") {
			if tok = textproto.TrimString(tok); tok != "" {
				names = append(names, textproto.CanonicalMIMEHeaderKey(tok))
			}
		}
	}
	return names
}

// forwardAttempt forwards one attempt the way httputil.ReverseProxy with the proxy's Rewrite,
// Transport, ModifyResponse and ErrorHandler does (newReverseProxy), in fewer steps: the
// outbound headers are built once instead of cloned and pruned, the response headers are moved
// instead of copied value by value, and no flush timer is set up. It is the -upstream-client
// direct path; net/http keeps ReverseProxy, so the two can be compared (forward_test.go does).
// in carries the attempt in its context. As ReverseProxy does, it panics with
// http.ErrAbortHandler when copying the body fails after the response started.
func (s *server) forwardAttempt(w http.ResponseWriter, in *http.Request, a *attempt) {
	// A protocol upgrade goes through ReverseProxy, which forwards it and tunnels a 101 (in is
	// the attempt's request, which its Rewrite and ModifyResponse read).
	if hasToken(in.Header["Connection"], "upgrade") {
		s.rp.ServeHTTP(w, in)
		return
	}
	// Informational answers (103 Early Hints) go to the client as they come.
	a.trace.Got1xxResponse = a.got1xx
	out := in.WithContext(httptrace.WithClientTrace(in.Context(), &a.trace)) // shallow: method, body
	u := *in.URL
	u.RawQuery = cleanQueryParams(u.RawQuery)
	out.URL = &u
	out.Header = forwardHeader(in.Header)
	out.RequestURI = ""
	out.Close = false
	pr := httputil.ProxyRequest{In: in, Out: out}
	pr.SetURL(a.target)
	pr.SetXForwarded()
	if in.Body != nil {
		a.bodyR.Reset(a.body)
		out.Body, out.ContentLength, out.GetBody = a.reqBody, int64(len(a.body)), a.getBody
	}
	if a.requestID != "" {
		out.Header.Set(headerRequestID, a.requestID)
	}

	res, err := s.upstream.RoundTrip(out)
	if err != nil {
		a.err = err
		return
	}
	if !a.headers.CompareAndSwap(headersWaiting, headersArrived) && a.headers.Load() == headersTimedOut {
		_ = res.Body.Close()
		a.err = errKVTransferTimeout
		return
	}
	a.status = res.StatusCode
	if a.canRetry && retryableStatus(res.StatusCode) {
		_ = res.Body.Close()
		a.err = &errRetryStatus{code: res.StatusCode}
		return
	}

	h := w.Header()
	hop := connectionTokens(res.Header)
	for k, vs := range res.Header {
		if isHopHeader(k) || contains(hop, k) {
			continue
		}
		if have, ok := h[k]; ok {
			h[k] = append(have, vs...)
		} else {
			h[k] = vs // res is ours: its slices need no copy
		}
	}
	if len(res.Trailer) > 0 {
		names := make([]string, 0, len(res.Trailer))
		for k := range res.Trailer {
			names = append(names, k)
		}
		h.Add("Trailer", strings.Join(names, ", "))
	}
	w.WriteHeader(res.StatusCode)

	// Streams (server-sent events, or bodies of unknown length) are flushed after every write,
	// and their head at once, as ReverseProxy's flush timer does: the first event may be a
	// prefill away. A body of known length is written as it comes and flushed when the handler
	// returns.
	ct, _, _ := strings.Cut(res.Header.Get("Content-Type"), ";")
	flush := res.ContentLength < 0 || strings.EqualFold(strings.TrimSpace(ct), "text/event-stream")
	if flush {
		if f, ok := w.(http.Flusher); ok {
			f.Flush()
		}
	}
	if err := copyBody(w, res.Body, flush); err != nil {
		_ = res.Body.Close()
		panic(http.ErrAbortHandler)
	}
	_ = res.Body.Close()
	if len(res.Trailer) > 0 {
		if f, ok := w.(http.Flusher); ok {
			f.Flush() // the body goes chunked, so the trailers can follow it
		}
		for k, vs := range res.Trailer {
			h[http.TrailerPrefix+k] = vs
		}
	}
}

// got1xx relays an informational answer of the backend to the client (httptrace.ClientTrace).
func (a *attempt) got1xx(code int, header textproto.MIMEHeader) error {
	h := a.w.Header()
	for k, vs := range header {
		h[k] = append([]string(nil), vs...)
	}
	a.w.WriteHeader(code)
	for k := range header {
		delete(h, k)
	}
	return nil
}

// forwardHeader returns the headers of the request to a backend: the client's, without the
// hop-by-hop ones, the forwarding ones (SetXForwarded writes them anew, as ReverseProxy's
// Rewrite mode does) and Accept-Encoding (the proxy reads identity bodies: cacheable, streamed
// as they come); User-Agent stays empty when the client sent none.
func forwardHeader(in http.Header) http.Header {
	hop := connectionTokens(in)
	out := make(http.Header, len(in)+3)
	for k, vs := range in {
		switch {
		case isHopHeader(k), contains(hop, k):
			continue
		case k == "Forwarded", k == "X-Forwarded-For", k == "X-Forwarded-Host", k == "X-Forwarded-Proto",
			k == "Accept-Encoding":
			continue
		}
		out[k] = vs // read-only for the transport; the client's request is not reused
	}
	// Te: trailers goes on whatever Connection names (Go issue 21096), as ReverseProxy does.
	if hasToken(in["Te"], "trailers") {
		out["Te"] = []string{"trailers"}
	}
	if _, ok := out["User-Agent"]; !ok {
		out["User-Agent"] = []string{""}
	}
	return out
}

// hasToken reports whether the comma-separated values vs hold tok, a lower-case token (ASCII
// case-insensitively, as httpguts.HeaderValuesContainsToken).
func hasToken(vs []string, tok string) bool {
	for _, v := range vs {
		for t := range strings.SplitSeq(v, ",") {
			if asciiEqualFold(textproto.TrimString(t), tok) {
				return true
			}
		}
	}
	return false
}

func contains(names []string, k string) bool {
	for _, n := range names {
		if n == k {
			return true
		}
	}
	return false
}

// copyBody copies a response body to w through a pooled buffer, flushing after each write when
// flush is set. It returns the read error (not io.EOF) or the write error that stopped it.
func copyBody(w http.ResponseWriter, body io.Reader, flush bool) error {
	buf := copyBuffers.Get()
	defer copyBuffers.Put(buf)
	f, _ := w.(http.Flusher)
	for {
		n, rerr := body.Read(buf)
		if n > 0 {
			if _, err := w.Write(buf[:n]); err != nil {
				return err
			}
			if flush && f != nil {
				f.Flush()
			}
		}
		if rerr == io.EOF {
			return nil
		}
		if rerr != nil {
			return rerr
		}
	}
}

// cleanQueryParams is ReverseProxy's (Rewrite mode): a query with a semicolon or a malformed
// escape, or of more than 10000 parameters, is re-encoded from what url.ParseQuery keeps of it.
func cleanQueryParams(s string) string {
	reencode := func(s string) string {
		v, _ := url.ParseQuery(s)
		return v.Encode()
	}
	if strings.Count(s, "&") >= 10000 {
		return reencode(s)
	}
	for i := 0; i < len(s); {
		switch s[i] {
		case ';':
			return reencode(s)
		case '%':
			if i+2 >= len(s) || !isHex(s[i+1]) || !isHex(s[i+2]) {
				return reencode(s)
			}
			i += 3
		default:
			i++
		}
	}
	return s
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}
