package main

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/textproto"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/disagg"
)

// Tests of what the proxy forwards, byte for byte: each test starts the proxy (http.Server and
// httputil.ReverseProxy, as run serves it) in front of a backend on a plain TCP listener, sends a
// client request, and checks what the backend receives and what the client receives against what
// a proxy is meant to do. The helpers take a list of proxies so that a test can put two
// configurations side by side; forwardModes names the one every test starts.

// forwardModes labels the proxies the tests start.
var forwardModes = []string{"proxy"}

// fwdHost is the Host the clients send, so that X-Forwarded-Host does not depend on the proxy's
// port.
const fwdHost = "api.example.test"

// fwdChat is the clients' request body.
var fwdChat = chatBody("You are a differential test.", "Hello?", "")

// fwdProxy is a proxy served by http.Server on a loopback port.
type fwdProxy struct {
	mode   string
	srv    *server
	addr   string
	client *http.Client // its own connections, closed at the end of the test
}

// startFwdProxies starts one proxy per mode in front of backends (health checks off), with edit
// applied to the configuration; everything stops at the end of the test.
func startFwdProxies(t *testing.T, backends []config.BackendConfig, edit func(*config.Config)) []*fwdProxy {
	t.Helper()
	var ps []*fwdProxy
	for _, mode := range forwardModes {
		ps = append(ps, startFwdProxy(t, mode, backends, edit))
	}
	return ps
}

func startFwdProxy(t *testing.T, mode string, backends []config.BackendConfig, edit func(*config.Config)) *fwdProxy {
	t.Helper()
	p := startProxy(t, fakeConfig(t, backends, edit))
	tr := &http.Transport{DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &fwdProxy{mode: mode, srv: p.server, addr: strings.TrimPrefix(p.URL, "http://"),
		client: &http.Client{Transport: tr, Timeout: 5 * time.Second}}
}

// fwdSeen is one request as a backend received it.
type fwdSeen struct {
	backend string
	raw     string        // head and body, as they came on the wire
	req     *http.Request // as net/http parses it; its body is in body
	body    string
}

// fwdBackend is a backend on a plain TCP listener, for exact bytes both ways: it records every
// request as it came and answers it with respond, which writes the response bytes itself (it may
// also block, or write nothing) and reports whether the connection may carry another request. A
// request with Expect: 100-continue gets its 100 Continue as soon as its head is read.
type fwdBackend struct {
	name    string
	url     string
	respond func(c net.Conn, s fwdSeen) (keep bool)

	ln    net.Listener
	wg    sync.WaitGroup
	mu    sync.Mutex
	conns map[net.Conn]struct{}
	done  bool // the test is over: no more connections
	seen  []fwdSeen
}

func startFwdBackend(t *testing.T, name string, respond func(c net.Conn, s fwdSeen) bool) *fwdBackend {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &fwdBackend{name: name, url: "http://" + ln.Addr().String(), respond: respond, ln: ln, conns: map[net.Conn]struct{}{}}
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			b.mu.Lock()
			if b.done {
				b.mu.Unlock()
				_ = c.Close()
				return
			}
			b.conns[c] = struct{}{}
			b.wg.Add(1)
			b.mu.Unlock()
			go b.serve(c)
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		b.mu.Lock()
		b.done = true
		for c := range b.conns {
			_ = c.Close()
		}
		b.mu.Unlock()
		b.wg.Wait()
	})
	return b
}

func (b *fwdBackend) serve(c net.Conn) {
	defer b.wg.Done()
	defer func() {
		_ = c.Close()
		b.mu.Lock()
		delete(b.conns, c)
		b.mu.Unlock()
	}()
	var rec bytes.Buffer // what br read from c: the requests' bytes
	br := bufio.NewReader(io.TeeReader(c, &rec))
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		if req.Header.Get("Expect") == "100-continue" {
			_, _ = io.WriteString(c, "HTTP/1.1 100 Continue\r\n\r\n")
		}
		body, err := io.ReadAll(req.Body)
		if err != nil {
			return
		}
		n := rec.Len() - br.Buffered()
		s := fwdSeen{backend: b.name, raw: string(rec.Bytes()[:n]), req: req, body: string(body)}
		rest := slices.Clone(rec.Bytes()[n:])
		rec.Reset()
		rec.Write(rest)
		b.mu.Lock()
		b.seen = append(b.seen, s)
		b.mu.Unlock()
		if !b.respond(c, s) {
			return
		}
	}
}

// requests returns the requests received so far.
func (b *fwdBackend) requests() []fwdSeen {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.seen)
}

// last returns the last request received.
func (b *fwdBackend) last(t *testing.T) fwdSeen {
	t.Helper()
	s := b.requests()
	if len(s) == 0 {
		t.Fatalf("backend %s received no request", b.name)
	}
	return s[len(s)-1]
}

// fwdAnswer returns a respond function that writes resp and keeps the connection.
func fwdAnswer(resp string) func(net.Conn, fwdSeen) bool {
	return func(c net.Conn, _ fwdSeen) bool {
		_, err := io.WriteString(c, resp)
		return err == nil
	}
}

// fwdJSON is a complete 200 response with a JSON body.
func fwdJSON(body string) string {
	return "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body
}

// fwdChunk is one chunk of a chunked body.
func fwdChunk(s string) string { return strconv.FormatInt(int64(len(s)), 16) + "\r\n" + s + "\r\n" }

// fwdHeader returns a header of the key and value pairs kv, in order.
func fwdHeader(kv ...string) http.Header {
	h := http.Header{}
	for i := 0; i+1 < len(kv); i += 2 {
		h.Add(kv[i], kv[i+1])
	}
	return h
}

// fwdRawExchange writes a request, head and body, on a new connection to addr and returns the
// final response (informational ones skipped) with its body read.
func fwdRawExchange(t *testing.T, addr, request string) (*http.Response, string) {
	t.Helper()
	c, br := dialRaw(t, addr)
	if _, err := io.WriteString(c, request); err != nil {
		t.Fatal(err)
	}
	for {
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("reading the response: %v", err)
		}
		if resp.StatusCode >= 200 {
			b, err := io.ReadAll(resp.Body)
			if err != nil {
				t.Fatalf("reading the response body: %v", err)
			}
			return resp, string(b)
		}
	}
}

// TestForwardRequest sends the same request bytes through the proxy and compares the
// bytes the backend receives, and its view of them (method, target, Host, every header, body)
// with what the proxy is meant to send: the client's end-to-end headers, without the hop-by-hop
// ones, the forwarding ones (set anew) and Accept-Encoding; no User-Agent of its own. Each case
// runs with a backend at the root and one under a base path.
func TestForwardRequest(t *testing.T) {
	const target = "/v1/chat/completions"
	tests := []struct {
		name    string
		target  string // the client's request target
		header  string // the client's header lines (Host and the body's framing aside)
		chunked bool   // the client sends the body chunked
		body    string // fwdChat when empty
		// wantTarget is the target the backend gets after its base path (target when empty);
		// wantHeader its headers but Content-Type, the body's framing and X-Forwarded-*.
		wantTarget string
		wantHeader http.Header
	}{
		{
			name: "end-to-end headers in order, empty value kept",
			header: "Authorization: Bearer sk-test\r\nAccept: application/json\r\nUser-Agent: OpenAI/Python 1.40.0\r\n" +
				"X-Request-Id: client-id-1\r\nX-Multi: one\r\nX-Multi: two, three\r\nX-Empty:\r\nOpenAI-Organization: org-1\r\n",
			wantHeader: fwdHeader("Authorization", "Bearer sk-test", "Accept", "application/json", "User-Agent", "OpenAI/Python 1.40.0",
				"X-Request-Id", "client-id-1", "X-Multi", "one", "X-Multi", "two, three", "X-Empty", "", "Openai-Organization", "org-1"),
		},
		{
			name:       "no User-Agent: none added",
			header:     "Accept: */*\r\n",
			wantHeader: fwdHeader("Accept", "*/*"),
		},
		{
			name: "hop-by-hop and client forwarding headers dropped",
			header: "Connection: keep-alive, x-hop-a , X-HOP-B\r\nX-Hop-A: 1\r\nX-Hop-B: 2\r\nProxy-Connection: keep-alive\r\n" +
				"Keep-Alive: timeout=5\r\nTe: gzip\r\nProxy-Authorization: Basic Zm9vOmJhcg==\r\nProxy-Authenticate: Basic\r\n" +
				"Forwarded: for=10.0.0.1;proto=https\r\nX-Forwarded-For: 10.0.0.1\r\nX-Forwarded-For: 10.0.0.2\r\n" +
				"X-Forwarded-Host: evil.example\r\nX-Forwarded-Proto: https\r\nAccept-Encoding: gzip, br\r\nX-Kept: yes\r\n",
			wantHeader: fwdHeader("X-Kept", "yes"),
		},
		{
			name:       "Te: trailers forwarded as trailers",
			header:     "Te: gzip, trailers\r\n",
			wantHeader: fwdHeader("Te", "trailers"),
		},
		{
			// RFC 9110, section 10.1.4: a sender of TE must also send a "TE" connection option.
			name:       "Te: trailers with Connection: TE",
			header:     "Connection: TE\r\nTE: trailers\r\n",
			wantHeader: fwdHeader("Te", "trailers"),
		},
		{
			name:       "Te token that only Unicode folding makes trailers",
			header:     "Te: trailer\u017f\r\n", // ſ (U+017F) folds to s under strings.EqualFold
			wantHeader: fwdHeader(),
		},
		{
			name:       "Connection token with a no-break space",
			header:     "Connection: X-Hop\u00a0\r\nX-Hop: 1\r\n", // not a token; ReverseProxy keeps X-Hop
			wantHeader: fwdHeader("X-Hop", "1"),
		},
		{
			name:       "Trailer header dropped (net/http fallback)",
			header:     "Trailer: X-Checksum\r\nX-Kept: yes\r\n",
			wantHeader: fwdHeader("X-Kept", "yes"),
		},
		{
			name:       "Upgrade (net/http fallback)",
			header:     "Connection: Upgrade\r\nUpgrade: websocket\r\n",
			wantHeader: fwdHeader("Connection", "Upgrade", "Upgrade", "websocket"),
		},
		{
			// The proxy has the body already: the backend's own 100 Continue would reach the
			// client as a second one.
			name:       "Expect: 100-continue not forwarded",
			header:     "Expect: 100-continue\r\n",
			wantHeader: fwdHeader(),
		},
		{
			name:       "body of 40 KiB",
			body:       chatBody(longSystemPrompt("large", 6000), "Hello?", ""),
			wantHeader: fwdHeader(),
		},
		{
			name:       "more than 32 header keys",
			header:     fwdManyHeaders(39),
			wantHeader: fwdManyHeadersWant(39),
		},
		{
			name:       "query string kept",
			target:     target + "?api-version=2024-06-01&x=a%20b&y=",
			wantHeader: fwdHeader(),
		},
		{
			name:       "query with a semicolon",
			target:     target + "?a=1;b=2&c=3",
			wantTarget: target + "?c=3", // ReverseProxy re-encodes what url.ParseQuery keeps
			wantHeader: fwdHeader(),
		},
		{
			name:       "query with a malformed escape",
			target:     target + "?a=%zz&b=2",
			wantTarget: target + "?b=2",
			wantHeader: fwdHeader(),
		},
	}

	be := startFwdBackend(t, "a", fwdAnswer(fwdJSON(`{"ok":true}`)))
	for _, base := range []string{"", "/base"} {
		name := "backend at the root"
		if base != "" {
			name = "backend under " + base
		}
		t.Run(name, func(t *testing.T) {
			proxies := startFwdProxies(t, []config.BackendConfig{{Name: "a", URL: be.url + base}}, nil)
			for _, tc := range tests {
				t.Run(tc.name, func(t *testing.T) {
					tgt, body := cmp.Or(tc.target, target), cmp.Or(tc.body, fwdChat)
					req := "POST " + tgt + " HTTP/1.1\r\nHost: " + fwdHost + "\r\nContent-Type: application/json\r\n" + tc.header
					if tc.chunked {
						half := len(body) / 2
						req += "Transfer-Encoding: chunked\r\n\r\n" + fwdChunk(body[:half]) + fwdChunk(body[half:]) + "0\r\n\r\n"
					} else {
						req += "Content-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body
					}
					want := tc.wantHeader.Clone()
					want.Set("Content-Type", "application/json")
					if !tc.chunked {
						want.Set("Content-Length", strconv.Itoa(len(body)))
					}
					want.Set("X-Forwarded-For", "127.0.0.1")
					want.Set("X-Forwarded-Host", fwdHost)
					want.Set("X-Forwarded-Proto", "http")
					wantURI := base + cmp.Or(tc.wantTarget, tgt)

					got := map[string]fwdSeen{}
					for _, p := range proxies {
						resp, answer := fwdRawExchange(t, p.addr, req)
						if resp.StatusCode != http.StatusOK || answer != `{"ok":true}` {
							t.Fatalf("%s: the client got %d %q", p.mode, resp.StatusCode, answer)
						}
						s := be.last(t)
						got[p.mode] = s
						r := s.req
						if r.Method != http.MethodPost || r.RequestURI != wantURI || r.Host != strings.TrimPrefix(be.url, "http://") {
							t.Errorf("%s: the backend got %s %s, Host %s; want POST %s, Host %s", p.mode, r.Method, r.RequestURI, r.Host,
								wantURI, strings.TrimPrefix(be.url, "http://"))
						}
						if !reflect.DeepEqual(r.Header, want) {
							t.Errorf("%s: the backend got the headers\n%s\nwant\n%s", p.mode, fwdHeaderString(r.Header), fwdHeaderString(want))
						}
						if s.body != body {
							t.Errorf("%s: the backend got a body of %d bytes, not the client's %d", p.mode, len(s.body), len(body))
						}
						if framing := r.TransferEncoding; tc.chunked != (len(framing) > 0) || !tc.chunked && r.ContentLength != int64(len(body)) {
							t.Errorf("%s: the body came with Content-Length %d, Transfer-Encoding %q; want chunked %v", p.mode, r.ContentLength, framing, tc.chunked)
						}
					}
				})
			}
		})
	}
}

// fwdManyHeaders returns n header lines X-H-0: 0 … (Content-Type makes one more key).
func fwdManyHeaders(n int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "X-H-%d: %d\r\n", i, i)
	}
	return b.String()
}

// fwdManyHeadersWant is fwdManyHeaders(n) as a header.
func fwdManyHeadersWant(n int) http.Header {
	h := http.Header{}
	for i := range n {
		h.Set(fmt.Sprintf("X-H-%d", i), strconv.Itoa(i))
	}
	return h
}

// fwdHeaderString lists h one field per line, keys sorted, for messages.
func fwdHeaderString(h http.Header) string {
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(h)) {
		for _, v := range h[k] {
			fmt.Fprintf(&b, "  %s: %q\n", k, v)
		}
		if len(h[k]) == 0 {
			fmt.Fprintf(&b, "  %s (no value)\n", k)
		}
	}
	return strings.TrimSuffix(b.String(), "\n")
}

// With disaggregation on, the decode attempt carries the X-Request-Id of its prefill: the
// client's, or one the proxy made up. The decode request and
// the prefill request carry it.
func TestForwardRequestIDDisagg(t *testing.T) {
	prefillAnswer := fwdJSON(`{"id":"p","choices":[{"index":0,"text":"x"}],"kv_transfer_params":{"remote_block_ids":[1,2]}}`)
	be := startFwdBackend(t, "engine", func(c net.Conn, s fwdSeen) bool {
		resp := fwdJSON(`{"id":"d","choices":[{"index":0,"message":{"role":"assistant","content":"ok"}}]}`)
		if strings.Contains(s.body, `"do_remote_decode":true`) {
			resp = prefillAnswer
		}
		_, err := io.WriteString(c, resp)
		return err == nil
	})
	proxies := startFwdProxies(t, []config.BackendConfig{{Name: "p", URL: be.url, Role: "prefill"}, {Name: "d", URL: be.url, Role: "decode"}},
		func(c *config.Config) {
			c.DisaggregatedServing = config.DisaggregatedConfig{Enabled: true,
				DefaultExternalStorage: &config.ExternalStorageConfig{Endpoint: "http://127.0.0.1:9"},
				Conditional:            config.ConditionalConfig{Enabled: ptr(false)}} // always a remote prefill
		})
	generated := regexp.MustCompile(`^[0-9a-f]{32}$`)
	tests := []struct {
		name     string
		clientID string // the client's X-Request-Id; none when empty
	}{
		{"the client's X-Request-Id", "client-req-7"},
		{"an X-Request-Id of the proxy's", ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, p := range proxies {
				req, _ := http.NewRequest(http.MethodPost, "http://"+p.addr+"/v1/chat/completions", strings.NewReader(fwdChat))
				req.Host = fwdHost
				req.Header.Set("Content-Type", "application/json")
				if tc.clientID != "" {
					req.Header.Set(headerRequestID, tc.clientID)
				}
				resp, err := p.client.Do(req)
				if err != nil {
					t.Fatalf("%s: %v", p.mode, err)
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 || resp.Header.Get(disagg.HeaderRoutingPath) != "prefill_then_decode" {
					t.Fatalf("%s: %d %s %q", p.mode, resp.StatusCode, b, resp.Header)
				}
				seen := be.requests()
				if len(seen) < 2 {
					t.Fatalf("%s: the backend saw %d requests", p.mode, len(seen))
				}
				pre, dec := seen[len(seen)-2], seen[len(seen)-1]
				id := dec.req.Header.Get(headerRequestID)
				switch {
				case id == "" || id != pre.req.Header.Get(headerRequestID):
					t.Errorf("%s: decode X-Request-Id %q, prefill %q", p.mode, id, pre.req.Header.Get(headerRequestID))
				case tc.clientID != "" && id != tc.clientID:
					t.Errorf("%s: X-Request-Id %q, want the client's %q", p.mode, id, tc.clientID)
				case tc.clientID == "" && !generated.MatchString(id):
					t.Errorf("%s: generated X-Request-Id %q", p.mode, id)
				}
				if !strings.Contains(dec.body, `"kv_transfer_params":{"remote_block_ids":[1,2]}`) {
					t.Errorf("%s: the decode body lacks the transfer parameters: %s", p.mode, dec.body)
				}
			}
		})
	}
}

// fwdView is what a client sees of one response.
type fwdView struct {
	Informational []fwdInfo
	Status        int
	Header        http.Header // but Date
	Chunked       bool
	Body          string
	Truncated     bool     // the body ended with an error
	Declared      []string // the trailers the head announced, sorted
	Trailer       http.Header
}

// fwdInfo is an informational (1xx) response.
type fwdInfo struct {
	Code   int
	Header http.Header
}

func (v fwdView) String() string {
	var b strings.Builder
	for _, in := range v.Informational {
		fmt.Fprintf(&b, "%d\n%s\n", in.Code, fwdHeaderString(in.Header))
	}
	fmt.Fprintf(&b, "%d chunked=%v truncated=%v declared=%q\n%s\nbody %q", v.Status, v.Chunked, v.Truncated, v.Declared,
		fwdHeaderString(v.Header), v.Body)
	if len(v.Trailer) > 0 {
		fmt.Fprintf(&b, "\ntrailer\n%s", fwdHeaderString(v.Trailer))
	}
	return b.String()
}

// fwdEachMode sends the test request through each proxy and checks what the client got, after
// adjust (nil: as is), against want; after (nil: nothing) runs for each proxy once its request
// is done. The modes must agree.
func fwdEachMode(t *testing.T, proxies []*fwdProxy, want fwdView, adjust func(*fwdProxy, fwdView) fwdView, after func(*fwdProxy)) {
	t.Helper()
	got := map[string]fwdView{}
	for _, p := range proxies {
		v := fwdDo(t, p)
		if adjust != nil {
			v = adjust(p, v)
		}
		got[p.mode] = v
		if !reflect.DeepEqual(v, want) {
			t.Errorf("%s: the client got\n%v\nwant\n%v", p.mode, v, want)
		}
		if after != nil {
			after(p)
		}
	}
}

// fwdDo sends the chat request to p and returns what the client sees.
func fwdDo(t *testing.T, p *fwdProxy) fwdView {
	t.Helper()
	var v fwdView
	var mu sync.Mutex
	trace := &httptrace.ClientTrace{Got1xxResponse: func(code int, h textproto.MIMEHeader) error {
		mu.Lock()
		defer mu.Unlock()
		v.Informational = append(v.Informational, fwdInfo{code, http.Header(h).Clone()})
		return nil
	}}
	req, _ := http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace), http.MethodPost,
		"http://"+p.addr+"/v1/chat/completions", strings.NewReader(fwdChat))
	req.Host = fwdHost
	req.Header.Set("Content-Type", "application/json")
	resp, err := p.client.Do(req)
	if err != nil {
		t.Fatalf("%s: %v", p.mode, err)
	}
	defer resp.Body.Close()
	declared := fwdDeclared(resp) // before the body: Go's client adds the unannounced ones at its end
	b, err := io.ReadAll(resp.Body)
	mu.Lock()
	defer mu.Unlock()
	v.Status, v.Body, v.Truncated, v.Declared = resp.StatusCode, string(b), err != nil, declared
	v.Header = resp.Header.Clone()
	v.Header.Del("Date")
	v.Chunked = slices.Contains(resp.TransferEncoding, "chunked")
	for k, vs := range resp.Trailer {
		if vs == nil { // announced in the head, and not sent: nil as Go's client leaves it
			continue
		}
		if v.Trailer == nil {
			v.Trailer = http.Header{}
		}
		v.Trailer[k] = vs
	}
	return v
}

// fwdDeclared returns the trailer names the response head announces, as Go's client lists them
// before the body is read.
func fwdDeclared(resp *http.Response) []string {
	var names []string
	for k := range resp.Trailer {
		names = append(names, k)
	}
	slices.Sort(names)
	return names
}

// fwdKV returns the header of a response of backend a on a first attempt: the proxy's own
// fields, then the pairs kv.
func fwdKV(kv ...string) http.Header {
	return fwdHeader(append([]string{HeaderBackend, "a", HeaderRoute, "prefix_hash"}, kv...)...)
}

// TestForwardResponse compares what a client receives of one backend answer (written byte for
// byte) through the proxy: status, headers (hop-by-hop ones dropped, also those the
// backend's Connection names; multiple values in order; the proxy's own added), body, framing,
// trailers (announced or not) and informational answers (103 Early Hints before the final one).
func TestForwardResponse(t *testing.T) {
	const ok = `{"ok":true}`
	tests := []struct {
		name   string
		answer string // the backend's response bytes
		close  bool   // the backend closes the connection after it
		want   fwdView
	}{
		{
			name: "hop-by-hop dropped, multiple values in order",
			answer: "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n" +
				"Connection: keep-alive, X-Backend-Hop, x-other-hop\r\nX-Backend-Hop: 1\r\nX-Other-Hop: 2\r\n" +
				"Keep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nProxy-Authenticate: Basic realm=x\r\nUpgrade: h2c\r\n" +
				"Te: trailers\r\nTrailer: X-Never\r\n" +
				"Set-Cookie: a=1\r\nSet-Cookie: b=2\r\nX-Multi: 1\r\nX-Multi: 2, 3\r\nX-Kvroute-Backend: spoofed\r\nVary: Accept\r\n\r\n" + ok,
			// A backend's X-Kvroute-* headers are replaced by the proxy's own: no spoofing.
			want: fwdView{Status: 200, Body: ok, Header: fwdHeader(HeaderBackend, "a", HeaderRoute, "prefix_hash",
				"Content-Type", "application/json", "Content-Length", "11", "Set-Cookie", "a=1", "Set-Cookie", "b=2",
				"X-Multi", "1", "X-Multi", "2, 3", "Vary", "Accept")},
		},
		{
			name:   "Connection: close from the backend is not the client's",
			answer: "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\nConnection: close\r\n\r\n" + ok,
			close:  true,
			want:   fwdView{Status: 200, Body: ok, Header: fwdKV("Content-Type", "application/json", "Content-Length", "11")},
		},
		{
			name:   "201 Created",
			answer: "HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nLocation: /v1/x\r\nContent-Length: 11\r\n\r\n" + ok,
			want:   fwdView{Status: 201, Body: ok, Header: fwdKV("Content-Type", "application/json", "Location", "/v1/x", "Content-Length", "11")},
		},
		{
			name:   "429 with Retry-After",
			answer: "HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nRetry-After: 3\r\nContent-Length: 11\r\n\r\n" + ok,
			want:   fwdView{Status: 429, Body: ok, Header: fwdKV("Content-Type", "application/json", "Retry-After", "3", "Content-Length", "11")},
		},
		{
			name:   "503 with one backend passes through",
			answer: "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n" + ok,
			want:   fwdView{Status: 503, Body: ok, Header: fwdKV("Content-Type", "application/json", "Content-Length", "11")},
		},
		{
			name:   "204 No Content",
			answer: "HTTP/1.1 204 No Content\r\nX-A: 1\r\n\r\n",
			want:   fwdView{Status: 204, Header: fwdKV("X-A", "1")},
		},
		{
			name:   "304 Not Modified",
			answer: "HTTP/1.1 304 Not Modified\r\nEtag: \"v1\"\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n",
			want:   fwdView{Status: 304, Header: fwdKV("Etag", `"v1"`)},
		},
		{
			name:   "body of unknown length, to the connection's end",
			answer: "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + ok,
			close:  true,
			want:   fwdView{Status: 200, Body: ok, Chunked: true, Header: fwdKV("Content-Type", "application/json")},
		},
		{
			name: "announced trailer",
			answer: "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum\r\n\r\n" +
				fwdChunk(ok) + "0\r\nX-Checksum: abc\r\n\r\n",
			want: fwdView{Status: 200, Body: ok, Chunked: true, Declared: []string{"X-Checksum"},
				Header: fwdKV("Content-Type", "application/json"), Trailer: fwdHeader("X-Checksum", "abc")},
		},
		{
			name: "trailer not announced",
			answer: "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" +
				fwdChunk(ok) + "0\r\nX-Late: z\r\n\r\n",
			want: fwdView{Status: 200, Body: ok, Chunked: true, Header: fwdKV("Content-Type", "application/json"),
				Trailer: fwdHeader("X-Late", "z")},
		},
		{
			name: "announced and unannounced trailers",
			answer: "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum, X-Count\r\n\r\n" +
				fwdChunk(ok) + "0\r\nX-Checksum: abc\r\nX-Count: 1\r\nX-Late: z\r\n\r\n",
			want: fwdView{Status: 200, Body: ok, Chunked: true, Declared: []string{"X-Checksum", "X-Count"},
				Header: fwdKV("Content-Type", "application/json"), Trailer: fwdHeader("X-Checksum", "abc", "X-Count", "1", "X-Late", "z")},
		},
		{
			name: "103 Early Hints before the answer",
			answer: "HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload; as=style\r\nLink: </b.js>; rel=preload; as=script\r\n\r\n" +
				"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n" + ok,
			want: fwdView{Status: 200, Body: ok, Header: fwdKV("Content-Type", "application/json", "Content-Length", "11"),
				Informational: []fwdInfo{{103, fwdHeader("Link", "</a.css>; rel=preload; as=style", "Link", "</b.js>; rel=preload; as=script")}}},
		},
		{
			// Informational answers are relayed as the backend sent them; the proxy's headers go
			// with the final answer.
			name: "two 103 Early Hints",
			answer: "HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n" +
				"HTTP/1.1 103 Early Hints\r\nLink: </b.js>; rel=preload\r\n\r\n" + fwdJSON(ok),
			want: fwdView{Status: 200, Body: ok, Header: fwdKV("Content-Type", "application/json", "Content-Length", "11"),
				Informational: []fwdInfo{{103, fwdHeader("Link", "</a.css>; rel=preload")}, {103, fwdHeader("Link", "</b.js>; rel=preload")}}},
		},
		{
			// http.Transport relays any number of them to a Got1xxResponse hook.
			name:   "nine 103 Early Hints",
			answer: strings.Repeat("HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n", 9) + fwdJSON(ok),
			want: fwdView{Status: 200, Body: ok, Header: fwdKV("Content-Type", "application/json", "Content-Length", "11"),
				Informational: slices.Repeat([]fwdInfo{{103, fwdHeader("Link", "</a.css>; rel=preload")}}, 9)},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			be := startFwdBackend(t, "a", func(c net.Conn, _ fwdSeen) bool {
				_, err := io.WriteString(c, tc.answer)
				return err == nil && !tc.close
			})
			proxies := startFwdProxies(t, []config.BackendConfig{{Name: "a", URL: be.url}}, nil)
			fwdEachMode(t, proxies, tc.want, nil, nil)
		})
	}
}

// TestForwardStreaming checks that streamed answers reach the client as they come: the head as
// soon as the backend sends it (ReverseProxy flushes it at once for the answers it streams), then
// each part before the backend sends the next, which waits for the client to have read it.
// Server-sent events are streamed even with a Content-Length; other bodies when their length is
// unknown.
func TestForwardStreaming(t *testing.T) {
	const first, second = "data: {\"n\":1}\n\n", "data: {\"n\":2}\n\ndata: [DONE]\n\n"
	tests := []struct {
		name    string
		head    string              // the response head
		frame   func(string) string // a part as it goes on the wire
		end     string              // after the parts
		close   bool                // the body ends with the connection
		chunked bool                // what the client sees
		wantCT  string
	}{
		{"server-sent events, chunked", "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\n\r\n",
			fwdChunk, "0\r\n\r\n", false, true, "text/event-stream; charset=utf-8"},
		{"server-sent events with a Content-Length", "HTTP/1.1 200 OK\r\nContent-Type: Text/Event-Stream\r\nContent-Length: " +
			strconv.Itoa(len(first+second)) + "\r\n\r\n", func(s string) string { return s }, "", false, false, "Text/Event-Stream"},
		{"JSON lines, chunked", "HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n",
			fwdChunk, "0\r\n\r\n", false, true, "application/x-ndjson"},
		{"JSON lines to the connection's end", "HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n\r\n",
			func(s string) string { return s }, "", true, true, "application/x-ndjson"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			var steps []chan struct{} // per request: head sent, first part may go, second part may go
			be := startFwdBackend(t, "a", func(c net.Conn, _ fwdSeen) bool {
				mu.Lock()
				gate := [2]chan struct{}{make(chan struct{}), make(chan struct{})}
				steps = append(steps, gate[0], gate[1])
				mu.Unlock()
				for i, part := range []string{tc.head, tc.frame(first), tc.frame(second) + tc.end} {
					if i > 0 {
						select {
						case <-gate[i-1]:
						case <-time.After(testIOTimeout):
							return false
						}
					}
					if _, err := io.WriteString(c, part); err != nil {
						return false
					}
				}
				return !tc.close
			})
			release := func(i int) {
				mu.Lock()
				defer mu.Unlock()
				if i < len(steps) {
					select {
					case <-steps[i]:
					default:
						close(steps[i])
					}
				}
			}
			t.Cleanup(func() { // before the backend's cleanup
				mu.Lock()
				n := len(steps)
				mu.Unlock()
				for i := range n {
					release(i)
				}
			})
			proxies := startFwdProxies(t, []config.BackendConfig{{Name: "a", URL: be.url}}, nil)
			for i, p := range proxies {
				t.Run(p.mode, func(t *testing.T) {
					req, _ := http.NewRequest(http.MethodPost, "http://"+p.addr+"/v1/chat/completions", strings.NewReader(fwdChat))
					req.Host = fwdHost
					type result struct {
						resp *http.Response
						err  error
					}
					done := make(chan result, 1)
					go func() {
						resp, err := p.client.Do(req)
						done <- result{resp, err}
					}()
					var res result
					select {
					case res = <-done:
					case <-time.After(time.Second):
						t.Errorf("no response head within 1s of the backend's: the proxy held it back")
						release(2 * i)
						select {
						case res = <-done:
						case <-time.After(time.Second):
							t.Errorf("no response head within 1s of the first part either")
							release(2*i + 1)
							res = <-done
						}
					}
					if res.err != nil {
						t.Fatal(res.err)
					}
					resp := res.resp
					defer resp.Body.Close()
					if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != tc.wantCT || resp.Header.Get(HeaderBackend) != "a" ||
						resp.Header.Get(HeaderRoute) != "prefix_hash" || slices.Contains(resp.TransferEncoding, "chunked") != tc.chunked {
						t.Errorf("%d %q chunked %q", resp.StatusCode, resp.Header, resp.TransferEncoding)
					}
					release(2 * i)
					got := make(chan string, 1)
					go func() {
						b := make([]byte, len(first))
						n, _ := io.ReadFull(resp.Body, b)
						got <- string(b[:n])
					}()
					select {
					case s := <-got:
						if s != first {
							t.Errorf("first part %q, want %q", s, first)
						}
					case <-time.After(time.Second):
						t.Errorf("the first part did not reach the client before the second was sent")
						release(2*i + 1)
						<-got
					}
					release(2*i + 1)
					rest, err := io.ReadAll(resp.Body)
					if err != nil || string(rest) != second {
						t.Errorf("rest %q, %v; want %q", rest, err, second)
					}
				})
			}
		})
	}
}

// fwdErrorView is an OpenAI error body with its message cut after "failed: ": what follows is the
// transport's error text, which is not the same for the two transports.
func fwdErrorView(t *testing.T, mode string, body string) (view, detail string) {
	t.Helper()
	var eb struct {
		Error map[string]any `json:"error"`
	}
	if err := json.Unmarshal([]byte(body), &eb); err != nil || eb.Error == nil {
		t.Errorf("%s: not an OpenAI error body: %q", mode, body)
		return body, ""
	}
	msg, _ := eb.Error["message"].(string)
	head, detail, ok := strings.Cut(msg, "failed: ")
	if !ok || detail == "" {
		t.Errorf("%s: message %q", mode, msg)
	}
	eb.Error["message"] = head + "failed: …"
	b, _ := json.Marshal(eb)
	return string(b), detail
}

// TestForwardFailures compares what a client sees, and what the Router and the circuit breaker
// record, when backends fail: one that closes the connection before answering (retried on the
// other backend when there are two, else 502), one that answers 502 or 504 first (retried on the
// other), one that refuses with 429 or 503 (retried on the other, counted as a refusal), one that dies in the middle of the body (the client's response is cut short, the
// lease is released as a failure).
func TestForwardFailures(t *testing.T) {
	t.Parallel() // its own backends and proxies
	closeConn := func(c net.Conn, _ fwdSeen) bool { return false }
	status := func(code int) func(net.Conn, fwdSeen) bool {
		return fwdAnswer(fmt.Sprintf("HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{\"error\":\"%d\"}",
			code, http.StatusText(code), code))
	}
	t.Run("retried on the other backend", func(t *testing.T) {
		tests := []struct {
			name    string
			first   func(net.Conn, fwdSeen) bool // the first request's answer, whichever backend gets it
			refusal bool                         // the answer is a refusal for lack of room, not a failure
		}{
			{"closed before answering", closeConn, false},
			{"502", status(502), false},
			{"503", status(503), true},
			{"429", status(429), true},
			{"504", status(504), false},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				var failed atomic.Bool
				var failedOn atomic.Value // the name of the backend that got the failing request
				respond := func(name string) func(net.Conn, fwdSeen) bool {
					return func(c net.Conn, s fwdSeen) bool {
						if failed.CompareAndSwap(false, true) {
							failedOn.Store(name)
							return tc.first(c, s)
						}
						_, err := io.WriteString(c, fwdJSON(`{"from":"`+name+`"}`))
						return err == nil
					}
				}
				a, b := startFwdBackend(t, "a", respond("a")), startFwdBackend(t, "b", respond("b"))
				for _, mode := range forwardModes {
					t.Run(mode, func(t *testing.T) {
						failed.Store(false)
						p := startFwdProxy(t, mode, []config.BackendConfig{{Name: "a", URL: a.url}, {Name: "b", URL: b.url}}, nil)
						na, nb := len(a.requests()), len(b.requests())
						v := fwdDo(t, p)
						if da, db := len(a.requests())-na, len(b.requests())-nb; da != 1 || db != 1 || !failed.Load() {
							t.Fatalf("requests to a: %d, to b: %d; want one to each", da, db)
						}
						from, to := "a", "b"
						if failedOn.Load() == "b" {
							from, to = "b", "a"
						}
						if v.Status != 200 || v.Body != `{"from":"`+to+`"}` || v.Header.Get(HeaderBackend) != to ||
							v.Header.Get(HeaderRetriedFrom) != from || v.Header.Get(HeaderRoute) == "" || v.Truncated {
							t.Errorf("the client got\n%v\nwant the answer of %s, retried from %s", v, to, from)
						}
						// The retried request is the client's, byte for byte.
						var first, second fwdSeen
						for _, s := range append(a.requests()[na:], b.requests()[nb:]...) {
							if s.backend == from {
								first = s
							} else {
								second = s
							}
						}
						if first.body != fwdChat || second.body != fwdChat {
							t.Errorf("bodies %q and %q", first.body, second.body)
						}
						waitFor(t, 2*time.Second, "the leases released", func() bool {
							return fwdState(p, "a").InFlight == 0 && fwdState(p, "b").InFlight == 0
						})
						switch st := fwdState(p, from); {
						case tc.refusal && (st.BreakerFailures != 0 || st.RouterFailed || st.Refusals != 1):
							t.Errorf("refusing backend %s: %+v; want the refusal counted, and no failure", from, st)
						case !tc.refusal && (st.BreakerFailures != 1 || !st.RouterFailed):
							t.Errorf("failed backend %s: %+v; want the failure counted", from, st)
						}
						if st := fwdState(p, to); st.BreakerFailures != 0 || st.RouterFailed {
							t.Errorf("answering backend %s: %+v", to, st)
						}
					})
				}
			})
		}
	})

	t.Run("one backend closes before answering", func(t *testing.T) {
		be := startFwdBackend(t, "a", closeConn)
		proxies := startFwdProxies(t, []config.BackendConfig{{Name: "a", URL: be.url}}, nil)
		details := map[string]string{}
		want := fwdView{Status: 502, Header: fwdKV("Content-Type", "application/json", "X-Content-Type-Options", "nosniff"),
			Body: `{"error":{"code":"upstream_error","message":"backend a failed: …","param":null,"type":"server_error"}}`}
		fwdEachMode(t, proxies, want, func(p *fwdProxy, v fwdView) fwdView {
			v.Body, details[p.mode] = fwdErrorView(t, p.mode, v.Body)
			v.Header.Del("Content-Length") // the length of the transport's error text
			return v
		}, func(p *fwdProxy) {
			if st := fwdState(p, "a"); st.InFlight != 0 || st.BreakerFailures != 1 || !st.RouterFailed {
				t.Errorf("%s: backend a %+v; want the failure counted", p.mode, st)
			}
		})
	})

	t.Run("the backend dies in the middle of the body", func(t *testing.T) {
		tests := []struct {
			name   string
			answer string
			want   fwdView
		}{
			{
				name: "server-sent events",
				answer: "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" +
					fwdChunk("data: {\"n\":1}\n\n"),
				want: fwdView{Status: 200, Body: "data: {\"n\":1}\n\n", Truncated: true, Chunked: true,
					Header: fwdKV("Content-Type", "text/event-stream")},
			},
		}
		// A response of known length that breaks off: net/http had not flushed the head when
		// ReverseProxy aborted, so the client sees the connection close before or in the answer.
		t.Run("Content-Length", func(t *testing.T) {
			be := startFwdBackend(t, "a", func(c net.Conn, _ fwdSeen) bool {
				_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"partial\":")
				return false
			})
			p := startFwdProxies(t, []config.BackendConfig{{Name: "a", URL: be.url}}, nil)[0]
			req, _ := http.NewRequest(http.MethodPost, "http://"+p.addr+"/v1/chat/completions", strings.NewReader(fwdChat))
			resp, err := p.client.Do(req)
			if err == nil {
				_, err = io.ReadAll(resp.Body)
				resp.Body.Close()
			}
			if err == nil {
				t.Fatal("the client read a whole answer")
			}
			waitFor(t, 2*time.Second, "the lease released", func() bool { return fwdState(p, "a").InFlight == 0 })
			if st := fwdState(p, "a"); st.BreakerFailures != 1 || !st.RouterFailed {
				t.Errorf("backend a %+v; want the abort counted", st)
			}
		})
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				be := startFwdBackend(t, "a", func(c net.Conn, _ fwdSeen) bool {
					_, _ = io.WriteString(c, tc.answer)
					return false
				})
				proxies := startFwdProxies(t, []config.BackendConfig{{Name: "a", URL: be.url}}, nil)
				fwdEachMode(t, proxies, tc.want, nil, func(p *fwdProxy) {
					waitFor(t, 2*time.Second, "the lease released", func() bool { return fwdState(p, "a").InFlight == 0 })
					if st := fwdState(p, "a"); st.BreakerFailures != 1 || !st.RouterFailed {
						t.Errorf("%s: backend a %+v; want the abort counted", p.mode, st)
					}
				})
			})
		}
	})
}

// fwdBackendState is what the proxy recorded of one backend.
type fwdBackendState struct {
	InFlight        int    // the Router's requests in flight
	RouterFailed    bool   // the Router's success rate fell below 1
	BreakerFailures int    // the circuit breaker's consecutive failures
	Refusals        uint64 // the Router's refusals counted (Outcome.Refused)
}

func fwdState(p *fwdProxy, name string) fwdBackendState {
	var st fwdBackendState
	rs, _ := p.srv.router.Stats(context.Background())
	for _, l := range rs.Backends {
		if l.Name == name {
			st.InFlight, st.RouterFailed, st.Refusals = l.InFlight, l.SuccessRate < 1, l.Refusals
		}
	}
	for _, h := range p.srv.health.Statuses() {
		if h.Name == name {
			st.BreakerFailures = h.Failures
		}
	}
	return st
}

// A client that leaves in the middle of a stream cancels the backend's request (its handler sees
// its context end); the lease is released, and the backend is not blamed.
func TestForwardClientGone(t *testing.T) {
	started := make(chan struct{}, len(forwardModes))
	gone := make(chan error, len(forwardModes))
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"n\":1}\n\n")
		w.(http.Flusher).Flush()
		started <- struct{}{}
		select {
		case <-r.Context().Done():
			gone <- nil
		case <-time.After(testIOTimeout):
			gone <- fmt.Errorf("the request's context did not end within %v of the client leaving", testIOTimeout)
		}
	}))
	t.Cleanup(up.Close)
	for _, p := range startFwdProxies(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, nil) {
		t.Run(p.mode, func(t *testing.T) {
			req, _ := http.NewRequest(http.MethodPost, "http://"+p.addr+"/v1/chat/completions", strings.NewReader(fwdChat))
			req.Host = fwdHost
			resp, err := p.client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			<-started
			b := make([]byte, len("data: {\"n\":1}\n\n"))
			if _, err := io.ReadFull(resp.Body, b); err != nil {
				t.Fatalf("first event: %v", err)
			}
			resp.Body.Close() // unread: the client's transport closes the connection
			if err := <-gone; err != nil {
				t.Fatal(err)
			}
			waitFor(t, 2*time.Second, "the lease released", func() bool { return fwdState(p, "a").InFlight == 0 })
			if st := fwdState(p, "a"); st.BreakerFailures != 0 || st.RouterFailed {
				t.Errorf("backend a %+v; the client's leaving is no failure of the backend", st)
			}
		})
	}
}
