package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"net/url"
	"reflect"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http/httpguts"
)

// Tests of httpServer (httpserve.go): the loop's answers are compared with http.Server's for the
// same handler and the same bytes on the wire.

// testIOTimeout bounds every read and write of a test connection: a test that hangs fails instead.
const testIOTimeout = 3 * time.Second

// loopServer is an httpServer on a loopback listener. It counts the requests the loop served
// itself and those it handed to its net/http fallback (the /probe requests of rawDo aside).
type loopServer struct {
	*httpServer
	addr        string
	loopServed  atomic.Int64
	netServed   atomic.Int64
	serveResult chan error
}

// startLoop serves h with an httpServer on 127.0.0.1 until the test ends.
func startLoop(t *testing.T, h http.Handler, edit ...func(*httpServerConfig)) *loopServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ls := &loopServer{addr: ln.Addr().String(), serveResult: make(chan error, 1)}
	cfg := httpServerConfig{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/probe" {
				if _, ok := w.(*response); ok {
					ls.loopServed.Add(1)
				} else {
					ls.netServed.Add(1)
				}
			}
			h.ServeHTTP(w, r)
		}),
		Log: testLogger(t),
	}
	for _, e := range edit {
		e(&cfg)
	}
	ls.httpServer = newHTTPServer(cfg)
	go func() { ls.serveResult <- ls.Serve(ln) }()
	t.Cleanup(func() {
		_ = ls.Close()
		select {
		case <-ls.serveResult:
		case <-time.After(testIOTimeout):
			t.Error("Serve did not return after Close")
		}
	})
	return ls
}

// startNetHTTP serves h with an http.Server on 127.0.0.1 until the test ends: the reference.
func startNetHTTP(t *testing.T, h http.Handler) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h, ErrorLog: slog.NewLogLogger(testLogger(t).Handler(), slog.LevelWarn)}
	done := make(chan struct{})
	go func() { _ = srv.Serve(ln); close(done) }()
	t.Cleanup(func() { _ = srv.Close(); <-done })
	return ln.Addr().String()
}

// dial opens a raw connection to addr, closed when the test ends.
func dialRaw(t *testing.T, addr string) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(testIOTimeout))
	t.Cleanup(func() { c.Close() })
	return c, bufio.NewReader(c)
}

// respView is what a client sees of one response.
type respView struct {
	Status  int
	Header  http.Header // without Date, and without Connection when it is close
	Date    bool        // a valid Date header was sent
	Close   bool        // Connection: close
	TE      []string
	Length  int64
	Body    string
	BodyErr bool // the body ended early
	Trailer http.Header
}

// rawResult is what a client sees of a connection: its responses (informational ones included)
// and whether the server closed it afterwards.
type rawResult struct {
	Responses []respView
	Closed    bool
}

func (r rawResult) String() string {
	r.Responses = append([]respView(nil), r.Responses...)
	for i, ex := range r.Responses {
		if len(ex.Body) > 80 {
			r.Responses[i].Body = fmt.Sprintf("%s... (%d bytes)", ex.Body[:40], len(ex.Body))
		}
	}
	b, _ := json.Marshal(r)
	return string(b)
}

// readExchange reads one response to a request with the given method.
func readExchange(br *bufio.Reader, method string) (respView, error) {
	resp, err := http.ReadResponse(br, &http.Request{Method: method})
	if err != nil {
		return respView{}, err
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	ex := respView{
		Status:  resp.StatusCode,
		Header:  resp.Header,
		Close:   resp.Close,
		TE:      resp.TransferEncoding,
		Length:  resp.ContentLength,
		Body:    string(body),
		BodyErr: err != nil,
		Trailer: resp.Trailer,
	}
	if d, ok := ex.Header["Date"]; ok {
		_, perr := http.ParseTime(d[0])
		ex.Date = len(d) == 1 && perr == nil
		delete(ex.Header, "Date")
	}
	return ex, nil
}

// probeClosed reports whether the server closed the connection: it asks for /probe, which
// withProbe answers, and fails to read an answer on a closed connection.
func probeClosed(c net.Conn, br *bufio.Reader) (closed bool) {
	if _, err := io.WriteString(c, "GET /probe HTTP/1.1\r\nHost: probe\r\n\r\n"); err != nil {
		return true
	}
	ex, err := readExchange(br, http.MethodGet)
	return err != nil || ex.Body != "probe"
}

// withProbe answers /probe for probeClosed and passes the rest to h.
func withProbe(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/probe" {
			_, _ = io.WriteString(w, "probe")
			return
		}
		h.ServeHTTP(w, r)
	})
}

// rawDo writes req to a new connection to addr, reads a final response for each of methods
// (and the informational ones before it), and probes whether the connection stays open.
func rawDo(t *testing.T, addr, req string, methods ...string) rawResult {
	t.Helper()
	if len(methods) == 0 {
		methods = []string{http.MethodGet}
	}
	c, br := dialRaw(t, addr)
	if _, err := io.WriteString(c, req); err != nil {
		t.Fatal(err)
	}
	var res rawResult
	for _, m := range methods {
		for {
			ex, err := readExchange(br, m)
			if err != nil {
				res.Closed = true
				return res
			}
			res.Responses = append(res.Responses, ex)
			if ex.Status >= 200 {
				break
			}
		}
	}
	res.Closed = probeClosed(c, br)
	return res
}

// conformCase is one request sequence sent, as raw bytes, to the loop and to net/http.
type conformCase struct {
	name    string
	handler http.HandlerFunc
	req     string   // raw bytes; default a GET of / with a Host
	methods []string // the methods of the requests in req, one final response each; default GET
	handoff bool     // net/http serves it all, not the loop
	// framing says the loop may frame the body otherwise: it sends up to pendingBodyLimit bytes
	// with a Content-Length where net/http chunks what it does not get in one write of up to 2 KiB.
	framing bool
	check   func(t *testing.T, got rawResult)
}

const getRoot = "GET / HTTP/1.1\r\nHost: example.com\r\n\r\n"

// runConform sends c.req to an httpServer and an http.Server serving c.handler and requires the
// same answers, then checks which of the two parts of httpServer served the requests.
func runConform(t *testing.T, c conformCase) {
	t.Helper()
	req := c.req
	if req == "" {
		req = getRoot
	}
	h := withProbe(c.handler)
	ls := startLoop(t, h)
	std := startNetHTTP(t, h)
	got := rawDo(t, ls.addr, req, c.methods...)
	want := rawDo(t, std, req, c.methods...)
	if c.framing {
		want = unframed(want)
		if check := c.check; check != nil {
			framed := got
			defer check(t, framed)
		}
		got = unframed(got)
		c.check = nil
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("httpServer and http.Server answer differently\nhttpServer:  %v\nhttp.Server: %v", got, want)
	}
	n := max(len(c.methods), 1)
	switch {
	case c.handoff && ls.loopServed.Load() != 0:
		t.Errorf("the loop served %d requests; want them handed to net/http", ls.loopServed.Load())
	case !c.handoff && ls.netServed.Load() != 0:
		t.Errorf("net/http served %d requests; want the loop to serve them", ls.netServed.Load())
	case !c.handoff && ls.loopServed.Load() != int64(n):
		t.Errorf("the loop served %d requests; want %d", ls.loopServed.Load(), n)
	}
	if c.check != nil {
		c.check(t, got)
	}
}

// unframed is r without how its bodies were framed.
func unframed(r rawResult) rawResult {
	r.Responses = append([]respView(nil), r.Responses...)
	for i := range r.Responses {
		ex := &r.Responses[i]
		ex.Header = ex.Header.Clone()
		delete(ex.Header, "Content-Length")
		ex.TE, ex.Length = nil, 0
	}
	return r
}

func wantOne(t *testing.T, got rawResult, status int, body string, closed bool) respView {
	t.Helper()
	if len(got.Responses) != 1 {
		t.Fatalf("got %d responses, want 1: %v", len(got.Responses), got)
	}
	ex := got.Responses[0]
	if ex.Status != status || ex.Body != body || ex.BodyErr || got.Closed != closed {
		t.Errorf("got %d %q (body error %v, closed %v); want %d %q (closed %v)",
			ex.Status, ex.Body, ex.BodyErr, got.Closed, status, body, closed)
	}
	if !ex.Date {
		t.Error("no valid Date header")
	}
	return ex
}

func wantHeader(t *testing.T, ex respView, key, want string) {
	t.Helper()
	if got := strings.Join(ex.Header[key], ","); got != want {
		t.Errorf("%s = %q; want %q", key, got, want)
	}
}

func writeString(s string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, s) }
}

// requestView is what a handler sees of a request, as JSON.
type requestView struct {
	Method, RequestURI, Path, RawQuery, Proto, Host string
	ProtoMajor, ProtoMinor                          int
	Header                                          http.Header
	ContentLength                                   int64
	Close                                           bool
	TransferEncoding                                []string
	NoBody, HasRemote, HasLocalAddr, HasServer      bool
	Body                                            string
}

func echoRequest(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	_, hasLocal := r.Context().Value(http.LocalAddrContextKey).(net.Addr)
	_, hasServer := r.Context().Value(http.ServerContextKey).(*http.Server)
	v := requestView{
		Method: r.Method, RequestURI: r.RequestURI, Path: r.URL.Path, RawQuery: r.URL.RawQuery,
		Proto: r.Proto, Host: r.Host, ProtoMajor: r.ProtoMajor, ProtoMinor: r.ProtoMinor,
		Header: r.Header, ContentLength: r.ContentLength, Close: r.Close,
		TransferEncoding: r.TransferEncoding, NoBody: r.Body == http.NoBody,
		HasRemote: r.RemoteAddr != "", HasLocalAddr: hasLocal, HasServer: hasServer,
		Body: string(body),
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

func TestHTTPServerConformance(t *testing.T) {
	big := strings.Repeat("0123456789abcdef", 640) // 10 KiB
	cases := []conformCase{
		{
			name:    "GET/request as the handler sees it",
			handler: echoRequest,
			req: "GET /v1/models?x=1&y=%20 HTTP/1.1\r\nhost: Example.com:8080\r\nuser-agent: sdk/1.0\r\n" +
				"x-stainless-lang: go\r\nAccept: a\r\naccept: b\r\nAuthorization: Bearer k\r\n\r\n",
			check: func(t *testing.T, got rawResult) {
				if len(got.Responses) != 1 {
					t.Fatalf("got %v", got)
				}
				ex := wantOne(t, got, 200, got.Responses[0].Body, false)
				var v requestView
				if err := json.Unmarshal([]byte(ex.Body), &v); err != nil {
					t.Fatal(err)
				}
				if v.Host != "Example.com:8080" || v.Header.Get("X-Stainless-Lang") != "go" ||
					len(v.Header["Accept"]) != 2 || !v.NoBody || !v.HasRemote || !v.HasLocalAddr || !v.HasServer {
					t.Errorf("handler saw %+v", v)
				}
			},
		},
		{
			name:    "POST/body read by the handler",
			handler: echoRequest,
			req:     "POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"a\":\"bcd\"}",
			methods: []string{"POST"},
			check: func(t *testing.T, got rawResult) {
				if len(got.Responses) != 1 {
					t.Fatalf("got %v", got)
				}
				ex := wantOne(t, got, 200, got.Responses[0].Body, false)
				if !strings.Contains(ex.Body, `"Body":"{\"a\":\"bcd\"}"`) || !strings.Contains(ex.Body, `"ContentLength":11`) {
					t.Errorf("handler saw %s", ex.Body)
				}
			},
		},
		{
			name:    "POST/Content-Length 0",
			handler: echoRequest,
			req:     "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n",
			methods: []string{"POST"},
		},
		{
			name:    "POST/no Content-Length",
			handler: echoRequest,
			req:     "POST / HTTP/1.1\r\nHost: h\r\n\r\n",
			methods: []string{"POST"},
		},
		{
			name:    "PUT PATCH DELETE OPTIONS pipelined",
			handler: echoRequest,
			req: "PUT /a HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\n\r\nx" +
				"PATCH /b HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\nyy" +
				"DELETE /c HTTP/1.1\r\nHost: h\r\n\r\n" +
				"OPTIONS /d HTTP/1.1\r\nHost: h\r\n\r\n",
			methods: []string{"PUT", "PATCH", "DELETE", "OPTIONS"},
		},
		{
			name:    "handler writes nothing/200 with Content-Length 0",
			handler: func(http.ResponseWriter, *http.Request) {},
			check: func(t *testing.T, got rawResult) {
				ex := wantOne(t, got, 200, "", false)
				wantHeader(t, ex, "Content-Length", "0")
				wantHeader(t, ex, "Content-Type", "")
			},
		},
		{
			name:    "small body without Content-Length/sent with one, type sniffed",
			handler: writeString("hello"),
			check: func(t *testing.T, got rawResult) {
				ex := wantOne(t, got, 200, "hello", false)
				wantHeader(t, ex, "Content-Length", "5")
				wantHeader(t, ex, "Content-Type", "text/plain; charset=utf-8")
			},
		},
		{
			name: "small body in pieces/HTML sniffed",
			handler: func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.WriteString(w, "<!DOCTYPE html>")
				_, _ = io.WriteString(w, "<p>hi</p>")
			},
			check: func(t *testing.T, got rawResult) {
				ex := wantOne(t, got, 200, "<!DOCTYPE html><p>hi</p>", false)
				wantHeader(t, ex, "Content-Type", "text/html; charset=utf-8")
			},
		},
		{
			name:    "body of exactly 4 KiB/sent with Content-Length",
			handler: writeString(big[:4096]),
			framing: true,
			check: func(t *testing.T, got rawResult) {
				ex := wantOne(t, got, 200, big[:4096], false)
				wantHeader(t, ex, "Content-Length", "4096")
			},
		},
		{
			name: "large body in small writes/chunked",
			handler: func(w http.ResponseWriter, r *http.Request) {
				for i := 0; i < len(big); i += 100 {
					_, _ = io.WriteString(w, big[i:min(i+100, len(big))])
				}
			},
			check: func(t *testing.T, got rawResult) {
				ex := wantOne(t, got, 200, big, false)
				if len(ex.TE) != 1 || ex.TE[0] != "chunked" || ex.Length != -1 {
					t.Errorf("Transfer-Encoding %q, Content-Length %d; want chunked", ex.TE, ex.Length)
				}
				wantHeader(t, ex, "Content-Type", "text/plain; charset=utf-8")
			},
		},
		{
			name:    "large body in one write/chunked, type sniffed",
			handler: writeString(big),
			check: func(t *testing.T, got rawResult) {
				ex := wantOne(t, got, 200, big, false)
				if len(ex.TE) != 1 || ex.TE[0] != "chunked" {
					t.Errorf("Transfer-Encoding %q; want chunked", ex.TE)
				}
				wantHeader(t, ex, "Content-Type", "text/plain; charset=utf-8")
			},
		},
		{
			name: "declared Content-Length/type sniffed",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Length", "5")
				_, _ = io.WriteString(w, "hello")
			},
			check: func(t *testing.T, got rawResult) {
				ex := wantOne(t, got, 200, "hello", false)
				wantHeader(t, ex, "Content-Type", "text/plain; charset=utf-8")
			},
		},
		{
			name: "declared Content-Length/large, typed",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "application/octet-stream")
				w.Header().Set("Content-Length", strconv.Itoa(len(big)))
				_, _ = io.WriteString(w, big[:100])
				_, _ = io.WriteString(w, big[100:])
			},
			check: func(t *testing.T, got rawResult) {
				ex := wantOne(t, got, 200, big, false)
				if ex.Length != int64(len(big)) || ex.TE != nil {
					t.Errorf("Content-Length %d, Transfer-Encoding %q", ex.Length, ex.TE)
				}
			},
		},
		{
			name: "Content-Type nil/not sniffed",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header()["Content-Type"] = nil
				_, _ = io.WriteString(w, "hello")
			},
			check: func(t *testing.T, got rawResult) {
				wantHeader(t, wantOne(t, got, 200, "hello", false), "Content-Type", "")
			},
		},
		{
			name: "Content-Encoding set/not sniffed",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Encoding", "identity-ish")
				_, _ = io.WriteString(w, "hello")
			},
			check: func(t *testing.T, got rawResult) {
				wantHeader(t, wantOne(t, got, 200, "hello", false), "Content-Type", "")
			},
		},
		{
			name: "header changed after Write/not sent",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("X-Early", "1")
				_, _ = io.WriteString(w, "hello")
				w.Header().Set("X-Early", "2")
				w.Header().Set("X-Late", "1")
				w.Header().Set("Content-Type", "application/json")
			},
			check: func(t *testing.T, got rawResult) {
				ex := wantOne(t, got, 200, "hello", false)
				wantHeader(t, ex, "X-Early", "1")
				wantHeader(t, ex, "X-Late", "")
				wantHeader(t, ex, "Content-Type", "text/plain; charset=utf-8")
			},
		},
		{
			name: "Date set by the handler/kept",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Date", "Mon, 02 Jan 2006 15:04:05 GMT")
			},
		},
		{
			name: "handler sets Transfer-Encoding chunked/chunked",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Transfer-Encoding", "chunked")
				_, _ = io.WriteString(w, "hello")
			},
			check: func(t *testing.T, got rawResult) {
				wantOne(t, got, 200, "hello", false)
			},
		},
		{
			name: "204/no body",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("X-A", "1")
				w.WriteHeader(http.StatusNoContent)
				if _, err := io.WriteString(w, "body"); !errors.Is(err, http.ErrBodyNotAllowed) {
					panic(fmt.Sprintf("Write after 204: %v", err))
				}
			},
			check: func(t *testing.T, got rawResult) {
				ex := wantOne(t, got, 204, "", false)
				wantHeader(t, ex, "Content-Length", "")
			},
		},
		{
			name: "304/no body",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("ETag", `"v1"`)
				w.WriteHeader(http.StatusNotModified)
				_, _ = io.WriteString(w, "body")
			},
			check: func(t *testing.T, got rawResult) {
				ex := wantOne(t, got, 304, "", false)
				wantHeader(t, ex, "Etag", `"v1"`)
			},
		},
		{
			name: "304 with Content-Type and Content-Length/suppressed",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "application/json")
				w.Header().Set("Content-Length", "12")
				w.WriteHeader(http.StatusNotModified)
			},
		},
		{
			name: "404 from http.Error",
			handler: func(w http.ResponseWriter, r *http.Request) {
				http.Error(w, "no such model", http.StatusNotFound)
			},
			check: func(t *testing.T, got rawResult) {
				wantOne(t, got, 404, "no such model\n", false)
			},
		},
		{
			name: "status without text/599",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(599)
			},
		},
		{
			name: "103 Early Hints/before the final response",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Add("Link", "</style.css>; rel=preload; as=style")
				w.WriteHeader(http.StatusEarlyHints)
				w.Header().Set("X-Final", "1")
				_, _ = io.WriteString(w, "done")
			},
			check: func(t *testing.T, got rawResult) {
				if len(got.Responses) != 2 || got.Responses[0].Status != 103 || got.Responses[1].Status != 200 {
					t.Fatalf("got %v; want 103 then 200", got)
				}
				wantHeader(t, got.Responses[0], "Link", "</style.css>; rel=preload; as=style")
				wantHeader(t, got.Responses[0], "X-Final", "")
			},
		},
		{
			name: "trailers/declared, short body",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Trailer", "X-Checksum")
				_, _ = io.WriteString(w, "hello")
				w.Header().Set("X-Checksum", "abc")
			},
			check: func(t *testing.T, got rawResult) {
				ex := wantOne(t, got, 200, "hello", false)
				if ex.Trailer.Get("X-Checksum") != "abc" {
					t.Errorf("trailers %v; want X-Checksum: abc", ex.Trailer)
				}
			},
		},
		{
			name: "trailers/TrailerPrefix, short body",
			handler: func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.WriteString(w, "hello")
				w.Header().Set(http.TrailerPrefix+"X-Usage", "42")
			},
			// net/http, like the loop, sends a short body with a Content-Length and so drops
			// trailers that the header did not announce when it was written.
		},
		{
			name: "trailers/declared and TrailerPrefix, chunked body",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Trailer", "X-Checksum, x-count")
				w.Header().Set("Content-Type", "text/plain")
				_, _ = io.WriteString(w, big)
				w.Header().Set("X-Checksum", "abc")
				w.Header().Set("X-Count", "3")
				w.Header().Set(http.TrailerPrefix+"X-Usage", "42")
			},
			check: func(t *testing.T, got rawResult) {
				ex := wantOne(t, got, 200, big, false)
				if ex.Trailer.Get("X-Checksum") != "abc" || ex.Trailer.Get("X-Count") != "3" || ex.Trailer.Get("X-Usage") != "42" {
					t.Errorf("trailers %v", ex.Trailer)
				}
			},
		},
		{
			name: "handler sets Connection close/closed after",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Connection", "close")
				_, _ = io.WriteString(w, "bye")
			},
			check: func(t *testing.T, got rawResult) {
				if !wantOne(t, got, 200, "bye", true).Close {
					t.Error("no Connection: close")
				}
			},
		},
		{
			name:    "client sends Connection close/closed after",
			handler: writeString("bye"),
			req:     "GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
			check: func(t *testing.T, got rawResult) {
				if !wantOne(t, got, 200, "bye", true).Close {
					t.Error("no Connection: close")
				}
			},
		},
		{
			name:    "client sends Connection close in a token list/closed after",
			handler: writeString("bye"),
			req:     "GET / HTTP/1.1\r\nHost: h\r\nConnection: keep-alive, CLOSE\r\n\r\n",
			check: func(t *testing.T, got rawResult) {
				wantOne(t, got, 200, "bye", true)
			},
		},
		{
			name: "client sends Connection close, handler keep-alive/close wins",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Connection", "keep-alive")
			},
			req: "GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
			check: func(t *testing.T, got rawResult) {
				if ex := wantOne(t, got, 200, "", true); !ex.Close || ex.Header.Get("Connection") != "" {
					t.Errorf("Connection: close %v, and %q; want only close", ex.Close, ex.Header["Connection"])
				}
			},
		},
		{
			name: "pipelined/two requests in one write answered in order",
			handler: func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.WriteString(w, r.URL.Path)
			},
			req:     "GET /first HTTP/1.1\r\nHost: h\r\n\r\nPOST /second HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc",
			methods: []string{"GET", "POST"},
			check: func(t *testing.T, got rawResult) {
				if len(got.Responses) != 2 || got.Responses[0].Body != "/first" || got.Responses[1].Body != "/second" || got.Closed {
					t.Errorf("got %v", got)
				}
			},
		},
		{
			name:    "extra CRLF after a POST body/tolerated",
			handler: writeString("ok"),
			req:     "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\nhi\r\nGET / HTTP/1.1\r\nHost: h\r\n\r\n",
			methods: []string{"POST", "GET"},
			check: func(t *testing.T, got rawResult) {
				if len(got.Responses) != 2 || got.Responses[1].Status != 200 {
					t.Errorf("got %v; want two 200s", got)
				}
			},
		},
		{
			name:    "request body unread, small/connection kept",
			handler: writeString("ok"),
			req:     "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 10000\r\n\r\n" + big[:10000],
			methods: []string{"POST"},
			check: func(t *testing.T, got rawResult) {
				wantOne(t, got, 200, "ok", false)
			},
		},
		{
			name: "request body half read/connection kept",
			handler: func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.ReadFull(r.Body, make([]byte, 5000))
				_, _ = io.WriteString(w, "ok")
			},
			req:     "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 10000\r\n\r\n" + big[:10000],
			methods: []string{"POST"},
			check: func(t *testing.T, got rawResult) {
				wantOne(t, got, 200, "ok", false)
			},
		},
		{
			name: "short write/closed after",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Length", "10")
				_, _ = io.WriteString(w, "hello")
			},
			check: func(t *testing.T, got rawResult) {
				if len(got.Responses) != 1 || !got.Responses[0].BodyErr || got.Responses[0].Body != "hello" || !got.Closed {
					t.Errorf("got %v; want a truncated body and the connection closed", got)
				}
			},
		},
		{
			name: "write beyond Content-Length/ErrContentLength, closed after",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "text/plain")
				w.Header().Set("Content-Length", "3")
				if _, err := io.WriteString(w, "hello"); !errors.Is(err, http.ErrContentLength) {
					panic(fmt.Sprintf("Write beyond Content-Length: %v", err))
				}
			},
			check: func(t *testing.T, got rawResult) {
				if len(got.Responses) != 1 || !got.Responses[0].BodyErr || !got.Closed {
					t.Errorf("got %v; want a truncated body and the connection closed", got)
				}
			},
		},
		{
			name: "invalid response header name and value/dropped, cleaned",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header()["Bad Name"] = []string{"x"}
				w.Header().Set("X-Split", "a\r\nInjected: 1")
			},
		},
		{
			name:    "bad escape in the target/400",
			handler: echoRequest,
			req:     "GET /%zz HTTP/1.1\r\nHost: h\r\n\r\n",
			handoff: true,
			check: func(t *testing.T, got rawResult) {
				if len(got.Responses) != 1 || got.Responses[0].Status != 400 || !got.Closed {
					t.Errorf("got %v; want 400 and closed", got)
				}
			},
		},
		{
			name:    "malformed Host/400",
			handler: echoRequest,
			req:     "GET / HTTP/1.1\r\nHost: a b\r\n\r\n",
			handoff: true,
			check: func(t *testing.T, got rawResult) {
				if len(got.Responses) != 1 || got.Responses[0].Status != 400 {
					t.Errorf("got %v; want 400", got)
				}
			},
		},
		{
			name:    "Content-Length -0/400",
			handler: echoRequest,
			req:     "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: -0\r\n\r\n",
			methods: []string{"POST"},
			handoff: true,
			check: func(t *testing.T, got rawResult) {
				if len(got.Responses) != 1 || got.Responses[0].Status != 400 {
					t.Errorf("got %v; want 400", got)
				}
			},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { runConform(t, c) })
	}
}

// TestHTTPServerHandoff sends what the loop does not serve itself: each request must get
// net/http's answer, from the fallback.
func TestHTTPServerHandoff(t *testing.T) {
	bigHead := "GET /many HTTP/1.1\r\nHost: h\r\n"
	for i := 0; len(bigHead) < 6<<10; i++ {
		bigHead += fmt.Sprintf("X-Header-%03d: %s\r\n", i, strings.Repeat("v", 40))
	}
	bigHead += "\r\n"
	cases := []conformCase{
		{name: "HTTP/1.0", req: "GET /old HTTP/1.0\r\nHost: h\r\n\r\n"},
		{name: "HTTP/1.0 keep-alive", req: "GET /old HTTP/1.0\r\nHost: h\r\nConnection: keep-alive\r\n\r\n"},
		{name: "HTTP/1.0 without Host", req: "GET /old HTTP/1.0\r\n\r\n"},
		{
			name:    "chunked request body",
			req:     "POST /c HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
			methods: []string{"POST"},
		},
		{
			name:    "chunked request body with trailer",
			req:     "POST /c HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nTrailer: X-T\r\n\r\n5\r\nhello\r\n0\r\nX-T: 1\r\n\r\n",
			methods: []string{"POST"},
		},
		{
			name:    "HEAD",
			req:     "HEAD /h HTTP/1.1\r\nHost: h\r\n\r\n",
			methods: []string{"HEAD"},
		},
		{name: "head larger than 4 KiB", req: bigHead},
		{name: "bare LF line endings", req: "GET /lf HTTP/1.1\nHost: h\n\n"},
		{name: "bare LF blank line", req: "GET /lf HTTP/1.1\r\nHost: h\r\n\n"},
		{name: "malformed request line", req: "GET /a b HTTP/1.1\r\nHost: h\r\n\r\n"},
		{name: "lower-case method", req: "get / HTTP/1.1\r\nHost: h\r\n\r\n"},
		{name: "unknown method", req: "PROPFIND / HTTP/1.1\r\nHost: h\r\n\r\n"},
		{name: "HTTP/2.0 request line", req: "GET / HTTP/2.0\r\nHost: h\r\n\r\n"},
		{name: "HTTP/1.2", req: "GET / HTTP/1.2\r\nHost: h\r\n\r\n"},
		{name: "missing Host", req: "GET / HTTP/1.1\r\nUser-Agent: x\r\n\r\n"},
		{name: "two Hosts", req: "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"},
		{name: "absolute-form target", req: "GET http://example.com/abs?q=1 HTTP/1.1\r\nHost: other\r\n\r\n"},
		{name: "asterisk-form OPTIONS", req: "OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n", methods: []string{"OPTIONS"}},
		{name: "Upgrade websocket", req: "GET /ws HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"},
		{name: "Upgrade header alone", req: "GET /ws HTTP/1.1\r\nHost: h\r\nUpgrade: h2c\r\n\r\n"},
		{name: "obsolete line folding", req: "GET / HTTP/1.1\r\nHost: h\r\nX-Folded: a\r\n b\r\n\r\n"},
		{name: "invalid header name", req: "GET / HTTP/1.1\r\nHost: h\r\nBad Name: x\r\n\r\n"},
		{name: "space before colon", req: "GET / HTTP/1.1\r\nHost : h\r\n\r\n"},
		{name: "NUL in a header value", req: "GET / HTTP/1.1\r\nHost: h\r\nX: a\x00b\r\n\r\n"},
		{name: "two Content-Lengths", req: "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", methods: []string{"POST"}},
		{name: "equal Content-Lengths", req: "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nab", methods: []string{"POST"}},
		{name: "Content-Length +5", req: "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: +5\r\n\r\nhello", methods: []string{"POST"}},
		{name: "Content-Length -1", req: "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: -1\r\n\r\n", methods: []string{"POST"}},
		{name: "Transfer-Encoding gzip", req: "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip\r\n\r\n", methods: []string{"POST"}},
		{name: "target with a non-ASCII byte", req: "GET /\xff HTTP/1.1\r\nHost: h\r\n\r\n"},
		{name: "leading blank line", req: "\r\nGET / HTTP/1.1\r\nHost: h\r\n\r\n"},
		{name: "garbage", req: "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n"},
	}
	for _, c := range cases {
		c.handler = echoRequest
		c.handoff = true
		t.Run(c.name, func(t *testing.T) { runConform(t, c) })
	}

	t.Run("Expect 100-continue", func(t *testing.T) {
		run := func(addr string) []string {
			c, br := dialRaw(t, addr)
			_, _ = io.WriteString(c, "POST /e HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
			var got []string
			ex, err := readExchange(br, "POST")
			if err != nil {
				t.Fatalf("reading 100 Continue: %v", err)
			}
			got = append(got, strconv.Itoa(ex.Status))
			_, _ = io.WriteString(c, "hello")
			ex, err = readExchange(br, "POST")
			if err != nil {
				t.Fatalf("reading the response: %v", err)
			}
			var v requestView
			_ = json.Unmarshal([]byte(ex.Body), &v)
			return append(got, strconv.Itoa(ex.Status), v.Body)
		}
		ls := startLoop(t, http.HandlerFunc(echoRequest))
		got, want := run(ls.addr), run(startNetHTTP(t, http.HandlerFunc(echoRequest)))
		if !reflect.DeepEqual(got, want) || !reflect.DeepEqual(got, []string{"100", "200", "hello"}) {
			t.Errorf("httpServer: %q; http.Server: %q; want 100, 200, hello", got, want)
		}
		if ls.loopServed.Load() != 0 || ls.netServed.Load() != 1 {
			t.Errorf("served by the loop %d, by net/http %d; want 0, 1", ls.loopServed.Load(), ls.netServed.Load())
		}
	})

	t.Run("Expect 100-continue from http.Client", func(t *testing.T) {
		ls := startLoop(t, http.HandlerFunc(echoRequest))
		tr := &http.Transport{ExpectContinueTimeout: testIOTimeout}
		defer tr.CloseIdleConnections()
		req, _ := http.NewRequest("POST", "http://"+ls.addr+"/e", strings.NewReader("hello"))
		req.Header.Set("Expect", "100-continue")
		var got100 atomic.Bool
		req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
			Got100Continue: func() { got100.Store(true) },
		}))
		resp, err := (&http.Client{Transport: tr, Timeout: testIOTimeout}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(body), `"Body":"hello"`) || !got100.Load() {
			t.Errorf("got %d %s (100 Continue seen: %v)", resp.StatusCode, body, got100.Load())
		}
		if ls.netServed.Load() != 1 {
			t.Errorf("net/http served %d requests; want 1", ls.netServed.Load())
		}
	})

	t.Run("served then handed off on one connection", func(t *testing.T) {
		req := "GET /one HTTP/1.1\r\nHost: h\r\n\r\n" +
			"POST /two HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n" +
			"GET /three HTTP/1.0\r\nHost: h\r\nConnection: keep-alive\r\n\r\n"
		h := withProbe(http.HandlerFunc(echoRequest))
		ls := startLoop(t, h)
		got := rawDo(t, ls.addr, req, "GET", "POST", "GET")
		want := rawDo(t, startNetHTTP(t, h), req, "GET", "POST", "GET")
		if !reflect.DeepEqual(got, want) {
			t.Errorf("httpServer and http.Server answer differently\nhttpServer:  %v\nhttp.Server: %v", got, want)
		}
		if len(got.Responses) != 3 || got.Closed {
			t.Errorf("got %v; want 3 responses on a connection kept open", got)
		}
		if ls.loopServed.Load() != 1 || ls.netServed.Load() != 2 {
			t.Errorf("served by the loop %d, by net/http %d; want 1, 2", ls.loopServed.Load(), ls.netServed.Load())
		}
	})

	t.Run("served then handed off, in separate writes", func(t *testing.T) {
		ls := startLoop(t, withProbe(http.HandlerFunc(echoRequest)))
		c, br := dialRaw(t, ls.addr)
		for i, req := range []string{
			"GET /one HTTP/1.1\r\nHost: h\r\n\r\n",
			"GET /two HTTP/1.0\r\nHost: h\r\nConnection: keep-alive\r\n\r\n",
			"GET /three HTTP/1.1\r\nHost: h\r\n\r\n",
		} {
			_, _ = io.WriteString(c, req)
			ex, err := readExchange(br, "GET")
			if err != nil || ex.Status != 200 {
				t.Fatalf("request %d: %v %v", i+1, ex, err)
			}
		}
		if ls.loopServed.Load() != 1 || ls.netServed.Load() != 2 {
			t.Errorf("served by the loop %d, by net/http %d; want 1, 2", ls.loopServed.Load(), ls.netServed.Load())
		}
	})
}

// bothServers runs f against an httpServer and an http.Server serving h.
func bothServers(t *testing.T, h http.Handler, f func(t *testing.T, addr string)) {
	t.Run("loop", func(t *testing.T) {
		ls := startLoop(t, h)
		f(t, ls.addr)
		if ls.netServed.Load() != 0 {
			t.Errorf("net/http served %d requests; want the loop to serve them all", ls.netServed.Load())
		}
	})
	t.Run("net/http", func(t *testing.T) { f(t, startNetHTTP(t, h)) })
}

func testClient(t *testing.T) *http.Client {
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: testIOTimeout}
}

func TestHTTPServerClientFlush(t *testing.T) {
	release := make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "first")
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-time.After(testIOTimeout):
		}
		_, _ = io.WriteString(w, " second")
	})
	bothServers(t, h, func(t *testing.T, addr string) {
		resp, err := testClient(t).Get("http://" + addr)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		first := make([]byte, 5)
		if _, err := io.ReadFull(resp.Body, first); err != nil || string(first) != "first" {
			t.Fatalf("first chunk %q, %v", first, err)
		}
		if len(resp.TransferEncoding) != 1 || resp.Header.Get("Content-Type") != "text/plain; charset=utf-8" {
			t.Errorf("Transfer-Encoding %q, Content-Type %q", resp.TransferEncoding, resp.Header.Get("Content-Type"))
		}
		release <- struct{}{}
		rest, err := io.ReadAll(resp.Body)
		if err != nil || string(rest) != " second" {
			t.Errorf("rest %q, %v", rest, err)
		}
	})
}

func TestHTTPServerClientInformational(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</a.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		w.Header().Set("Link", "</b.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		_, _ = io.WriteString(w, "ok")
	})
	bothServers(t, h, func(t *testing.T, addr string) {
		var links []string
		ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
			Got1xxResponse: func(code int, header textproto.MIMEHeader) error {
				links = append(links, fmt.Sprint(code, " ", header.Get("Link")))
				return nil
			},
		})
		req, _ := http.NewRequestWithContext(ctx, "GET", "http://"+addr, nil)
		resp, err := testClient(t).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		want := []string{"103 </a.css>; rel=preload", "103 </b.css>; rel=preload"}
		if resp.StatusCode != 200 || string(body) != "ok" || !reflect.DeepEqual(links, want) {
			t.Errorf("got %d %q after %q; want 200 ok after %q", resp.StatusCode, body, links, want)
		}
	})
}

func TestHTTPServerClientTrailers(t *testing.T) {
	for _, size := range []int{5, 10 << 10} {
		for _, how := range []string{"declared", "TrailerPrefix"} {
			if how == "TrailerPrefix" && size < 2<<10 {
				// net/http, like the loop, sends a short body with a Content-Length and so drops
				// trailers that the header did not announce when it was written.
				continue
			}
			t.Run(fmt.Sprintf("%s/body=%d", how, size), func(t *testing.T) {
				h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					if how == "declared" {
						w.Header().Set("Trailer", "X-Checksum")
					}
					_, _ = w.Write(bytes.Repeat([]byte("x"), size))
					if how == "declared" {
						w.Header().Set("X-Checksum", "abc")
					} else {
						w.Header().Set(http.TrailerPrefix+"X-Checksum", "abc")
					}
				})
				bothServers(t, h, func(t *testing.T, addr string) {
					resp, err := testClient(t).Get("http://" + addr)
					if err != nil {
						t.Fatal(err)
					}
					body, err := io.ReadAll(resp.Body)
					resp.Body.Close()
					if err != nil || len(body) != size {
						t.Fatalf("body of %d bytes, %v", len(body), err)
					}
					if got := resp.Trailer.Get("X-Checksum"); got != "abc" {
						t.Errorf("trailer X-Checksum = %q (trailers %v, Content-Length %d); want abc",
							got, resp.Trailer, resp.ContentLength)
					}
				})
			})
		}
	}
}

func TestHTTPServerClientKeepAlive(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		_, _ = fmt.Fprintf(w, "%s %s %s", r.Method, r.URL.Path, body)
	})
	bothServers(t, h, func(t *testing.T, addr string) {
		client := testClient(t)
		var conns atomic.Int64
		ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
			GotConn: func(info httptrace.GotConnInfo) {
				if !info.Reused {
					conns.Add(1)
				}
			},
		})
		for i := 0; i < 50; i++ {
			method, body := "GET", ""
			if i%2 == 1 {
				method, body = "POST", strings.Repeat("b", i*100)
			}
			req, _ := http.NewRequestWithContext(ctx, method, fmt.Sprintf("http://%s/%d", addr, i), strings.NewReader(body))
			resp, err := client.Do(req)
			if err != nil {
				t.Fatalf("request %d: %v", i, err)
			}
			got, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if want := fmt.Sprintf("%s /%d %s", method, i, body); string(got) != want {
				t.Fatalf("request %d: got %q; want %q", i, got, want)
			}
		}
		if n := conns.Load(); n != 1 {
			t.Errorf("50 requests took %d connections; want 1", n)
		}
	})
}

// TestHTTPServerLargeUnreadBody: a request body of more than maxBodyDiscard that the handler does
// not read closes the connection, after a response the client can read: net/http half-closes and
// waits (closeWriteAndWait) so that its close does not reset the connection before the client
// has read the response.
func TestHTTPServerLargeUnreadBody(t *testing.T) {
	body := bytes.Repeat([]byte("z"), 1<<20)
	bothServers(t, withProbe(writeString("ok")), func(t *testing.T, addr string) {
		t.Run("raw", func(t *testing.T) {
			c, br := dialRaw(t, addr)
			go func() {
				_, _ = fmt.Fprintf(c, "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n", len(body))
				_, _ = c.Write(body)
			}()
			ex, err := readExchange(br, "POST")
			if err != nil {
				t.Fatalf("reading the response: %v", err)
			}
			if ex.Status != 200 || ex.Body != "ok" || !ex.Close {
				t.Errorf("got %+v; want 200 ok with Connection: close", ex)
			}
			if _, err := br.ReadByte(); err == nil {
				t.Error("the connection stays open")
			}
		})
		t.Run("http.Client", func(t *testing.T) {
			// The reset is a race the server loses now and then: try a few times.
			client := testClient(t)
			for i := 0; i < 20; i++ {
				resp, err := client.Post("http://"+addr, "text/plain", bytes.NewReader(body))
				if err != nil {
					t.Fatalf("POST %d of 1 MiB left unread: %v", i, err)
				}
				got, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 || string(got) != "ok" || err != nil || !resp.Close {
					t.Fatalf("got %d %q %v (Close %v); want 200 ok with Connection: close", resp.StatusCode, got, err, resp.Close)
				}
			}
		})
	})
}

// pollUntil polls cond every millisecond until it holds, failing the test after testIOTimeout.
func pollUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(testIOTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// onlyConn returns the one connection the loop serves.
func (ls *loopServer) onlyConn(t *testing.T) *serverConn {
	t.Helper()
	var sc *serverConn
	pollUntil(t, "one connection", func() bool {
		ls.mu.Lock()
		defer ls.mu.Unlock()
		for c := range ls.conns {
			sc = c
		}
		return len(ls.conns) == 1
	})
	return sc
}

func TestHTTPServerDisconnectWatch(t *testing.T) {
	type outcome struct {
		err, cause error
	}
	for _, tc := range []struct {
		name, req string
	}{
		{"GET", "GET /wait HTTP/1.1\r\nHost: h\r\n\r\n"},
		{"POST with a body", "POST /wait HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			started := make(chan struct{})
			done := make(chan outcome, 1)
			ls := startLoop(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if _, err := io.ReadAll(r.Body); err != nil {
					t.Errorf("reading the body: %v", err)
				}
				close(started)
				select {
				case <-r.Context().Done():
					done <- outcome{r.Context().Err(), context.Cause(r.Context())}
				case <-time.After(testIOTimeout):
					done <- outcome{}
				}
			}))
			c, _ := dialRaw(t, ls.addr)
			_, _ = io.WriteString(c, tc.req)
			<-started
			c.Close()
			o := <-done
			if o.err == nil {
				t.Fatal("the request's context was not cancelled after the client closed")
			}
			if !errors.Is(o.err, context.Canceled) || !errors.Is(o.cause, context.Canceled) {
				t.Errorf("ctx.Err() = %v, Cause = %v; want both to wrap context.Canceled", o.err, o.cause)
			}
		})
	}

	t.Run("pipelined request read by the watch", func(t *testing.T) {
		release := make(chan struct{})
		ls := startLoop(t, withProbe(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/slow" {
				select {
				case <-release:
				case <-r.Context().Done():
					t.Error("the slow request was cancelled")
				case <-time.After(testIOTimeout):
				}
			}
			_, _ = io.WriteString(w, r.URL.Path)
		})))
		c, br := dialRaw(t, ls.addr)
		_, _ = io.WriteString(c, "GET /slow HTTP/1.1\r\nHost: h\r\n\r\n")
		sc := ls.onlyConn(t)
		pollUntil(t, "the disconnect watch", func() bool {
			sc.watchMu.Lock()
			defer sc.watchMu.Unlock()
			return sc.watching
		})
		_, _ = io.WriteString(c, "GET /next HTTP/1.1\r\nHost: h\r\n\r\n")
		time.Sleep(5 * time.Millisecond) // lets the watch read the first byte
		close(release)
		for _, want := range []string{"/slow", "/next"} {
			ex, err := readExchange(br, "GET")
			if err != nil || ex.Status != 200 || ex.Body != want {
				t.Fatalf("got %+v, %v; want 200 %s", ex, err, want)
			}
		}
		if ls.loopServed.Load() != 2 {
			t.Errorf("the loop served %d requests; want 2", ls.loopServed.Load())
		}
		if probeClosed(c, br) {
			t.Error("the connection closed")
		}
	})

	t.Run("many slow requests on one connection", func(t *testing.T) {
		ls := startLoop(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			time.Sleep(disconnectWatchDelay + 2*time.Millisecond)
			if r.Context().Err() != nil {
				t.Errorf("request %s cancelled: %v", r.URL.Path, context.Cause(r.Context()))
			}
			_, _ = io.WriteString(w, r.URL.Path)
		}))
		c, br := dialRaw(t, ls.addr)
		for i := 0; i < 10; i++ {
			// Odd ones come while the previous request runs.
			path := fmt.Sprintf("/%d", i)
			_, _ = fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: h\r\n\r\n", path)
			if i%2 == 0 {
				continue
			}
			for _, p := range []string{fmt.Sprintf("/%d", i-1), path} {
				ex, err := readExchange(br, "GET")
				if err != nil || ex.Body != p {
					t.Fatalf("got %+v, %v; want %s", ex, err, p)
				}
			}
		}
	})
}

// TestHTTPServerHalfClose: a client that shuts down its sending side after its request still
// reads the response. The request's context ends (net/http cancels it too), but a handler that
// answers anyway is heard.
func TestHTTPServerHalfClose(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(4 * disconnectWatchDelay) // past the watch's start
		_, _ = io.WriteString(w, "answer")
	})
	bothServers(t, h, func(t *testing.T, addr string) {
		c, br := dialRaw(t, addr)
		_, _ = io.WriteString(c, "GET / HTTP/1.1\r\nHost: h\r\n\r\n")
		if err := c.(*net.TCPConn).CloseWrite(); err != nil {
			t.Fatal(err)
		}
		ex, err := readExchange(br, "GET")
		if err != nil || ex.Body != "answer" {
			t.Errorf("got %+v, %v; want the answer", ex, err)
		}
	})
}

func TestHTTPServerPanic(t *testing.T) {
	var logs syncBuffer
	ls := startLoop(t, withProbe(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/abort":
			_, _ = w.Write(bytes.Repeat([]byte("a"), 8<<10))
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler)
		case "/abort-unflushed":
			_, _ = io.WriteString(w, "partial")
			panic(http.ErrAbortHandler)
		case "/panic":
			panic("boom in handler")
		}
		_, _ = io.WriteString(w, "ok")
	})), func(cfg *httpServerConfig) { cfg.Log = slog.New(slog.NewTextHandler(&logs, nil)) })
	client := testClient(t)
	get := func(path string) (string, error) {
		resp, err := client.Get("http://" + ls.addr + path)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return string(b), err
	}
	// An idle connection opened before the panics must keep working.
	idle, idleBR := dialRaw(t, ls.addr)
	if probeClosed(idle, idleBR) {
		t.Fatal("probe failed")
	}

	t.Run("ErrAbortHandler mid chunked body", func(t *testing.T) {
		body, err := get("/abort")
		if err == nil {
			t.Errorf("read %d bytes without error; want a truncated body", len(body))
		}
		if strings.Contains(logs.String(), "panic") {
			t.Errorf("ErrAbortHandler logged: %s", logs.String())
		}
	})
	t.Run("ErrAbortHandler before the head", func(t *testing.T) {
		if body, err := get("/abort-unflushed"); err == nil {
			t.Errorf("got %q; want an error", body)
		}
	})
	t.Run("plain panic", func(t *testing.T) {
		if body, err := get("/panic"); err == nil {
			t.Errorf("got %q; want an error", body)
		}
		l := logs.String()
		if !strings.Contains(l, "panic serving request") || !strings.Contains(l, "boom in handler") ||
			!strings.Contains(l, "stack=") || !strings.Contains(l, "level=ERROR") {
			t.Errorf("log %q; want the panic, its value and stack at ERROR", l)
		}
	})
	t.Run("still serving", func(t *testing.T) {
		if body, err := get("/"); err != nil || body != "ok" {
			t.Errorf("got %q, %v", body, err)
		}
		if probeClosed(idle, idleBR) {
			t.Error("the idle connection was closed")
		}
	})
}

func TestHTTPServerShutdown(t *testing.T) {
	t.Run("drains in flight, closes idle", func(t *testing.T) {
		started, release := make(chan struct{}), make(chan struct{})
		ls := startLoop(t, withProbe(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			close(started)
			select {
			case <-release:
			case <-time.After(testIOTimeout):
			}
			_, _ = io.WriteString(w, "done")
		})))
		idle, idleBR := dialRaw(t, ls.addr)
		if probeClosed(idle, idleBR) {
			t.Fatal("probe failed")
		}
		busy, busyBR := dialRaw(t, ls.addr)
		_, _ = io.WriteString(busy, "GET /slow HTTP/1.1\r\nHost: h\r\n\r\n")
		<-started

		shut := make(chan error, 1)
		go func() { shut <- ls.Shutdown(context.Background()) }()
		_ = idle.SetReadDeadline(time.Now().Add(time.Second))
		if _, err := idleBR.ReadByte(); err == nil || isTimeout(err) {
			t.Errorf("the idle connection: %v; want it closed at once", err)
		}
		select {
		case err := <-shut:
			t.Fatalf("Shutdown returned %v with a request in flight", err)
		case <-time.After(20 * time.Millisecond):
		}
		close(release)
		ex, err := readExchange(busyBR, "GET")
		if err != nil || ex.Status != 200 || ex.Body != "done" || !ex.Close {
			t.Errorf("in-flight request: %+v, %v; want 200 done with Connection: close", ex, err)
		}
		if _, err := busyBR.ReadByte(); err == nil {
			t.Error("the connection of the drained request stays open")
		}
		select {
		case err := <-shut:
			if err != nil {
				t.Errorf("Shutdown: %v", err)
			}
		case <-time.After(testIOTimeout):
			t.Fatal("Shutdown did not return")
		}
		select {
		case err := <-ls.serveResult:
			ls.serveResult <- err // for the cleanup
			if !errors.Is(err, http.ErrServerClosed) {
				t.Errorf("Serve returned %v; want http.ErrServerClosed", err)
			}
		case <-time.After(testIOTimeout):
			t.Fatal("Serve did not return")
		}
		if c, err := net.Dial("tcp", ls.addr); err == nil {
			c.Close()
			t.Error("still accepting")
		}
	})

	t.Run("context expires", func(t *testing.T) {
		started, release := make(chan struct{}), make(chan struct{})
		defer close(release)
		ls := startLoop(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			close(started)
			select {
			case <-release:
			case <-time.After(testIOTimeout):
			}
		}))
		c, _ := dialRaw(t, ls.addr)
		_, _ = io.WriteString(c, "GET / HTTP/1.1\r\nHost: h\r\n\r\n")
		<-started
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
		defer cancel()
		if err := ls.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Shutdown = %v; want context.DeadlineExceeded", err)
		}
	})

	t.Run("drains a handed-off request", func(t *testing.T) {
		started, release := make(chan struct{}), make(chan struct{})
		ls := startLoop(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			close(started)
			select {
			case <-release:
			case <-time.After(testIOTimeout):
			}
			_, _ = io.WriteString(w, "done")
		}))
		c, br := dialRaw(t, ls.addr)
		_, _ = io.WriteString(c, "GET / HTTP/1.0\r\nHost: h\r\n\r\n")
		<-started
		shut := make(chan error, 1)
		go func() { shut <- ls.Shutdown(context.Background()) }()
		select {
		case err := <-shut:
			t.Fatalf("Shutdown returned %v with a handed-off request in flight", err)
		case <-time.After(30 * time.Millisecond):
		}
		close(release)
		if ex, err := readExchange(br, "GET"); err != nil || ex.Body != "done" {
			t.Errorf("handed-off request: %+v, %v", ex, err)
		}
		select {
		case err := <-shut:
			if err != nil {
				t.Errorf("Shutdown: %v", err)
			}
		case <-time.After(testIOTimeout):
			t.Fatal("Shutdown did not return")
		}
		if ls.netServed.Load() != 1 {
			t.Errorf("net/http served %d requests; want 1", ls.netServed.Load())
		}
	})

	t.Run("Serve after Shutdown", func(t *testing.T) {
		s := newHTTPServer(httpServerConfig{Handler: http.NotFoundHandler()})
		if err := s.Shutdown(context.Background()); err != nil {
			t.Fatalf("Shutdown: %v", err)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("Serve = %v; want http.ErrServerClosed", err)
		}
		if _, err := ln.Accept(); err == nil {
			t.Error("the listener is open")
		}
	})

	t.Run("Close", func(t *testing.T) {
		started := make(chan struct{})
		ls := startLoop(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			close(started)
			select {
			case <-r.Context().Done():
			case <-time.After(testIOTimeout):
				t.Error("the request's context was not cancelled by Close")
			}
		}))
		c, br := dialRaw(t, ls.addr)
		_, _ = io.WriteString(c, "GET / HTTP/1.1\r\nHost: h\r\n\r\n")
		<-started
		if err := ls.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if _, err := br.ReadByte(); err == nil {
			t.Error("the connection stays open")
		}
	})
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func TestHTTPServerTimeouts(t *testing.T) {
	t.Run("IdleTimeout", func(t *testing.T) {
		ls := startLoop(t, withProbe(writeString("ok")), func(cfg *httpServerConfig) { cfg.IdleTimeout = 50 * time.Millisecond })
		c, br := dialRaw(t, ls.addr)
		if probeClosed(c, br) {
			t.Fatal("probe failed")
		}
		if _, err := br.ReadByte(); err == nil || isTimeout(err) {
			t.Errorf("idle connection: %v; want it closed", err)
		}
	})
	// net/http bounds the wait for a new connection's first request by ReadHeaderTimeout.
	t.Run("ReadHeaderTimeout on a silent new connection", func(t *testing.T) {
		ls := startLoop(t, writeString("ok"), func(cfg *httpServerConfig) { cfg.ReadHeaderTimeout = 50 * time.Millisecond })
		c, err := net.Dial("tcp", ls.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetReadDeadline(time.Now().Add(time.Second))
		if _, err := c.Read(make([]byte, 1)); err == nil || isTimeout(err) {
			t.Errorf("a connection that sends nothing: %v after 1s; want it closed after ReadHeaderTimeout", err)
		}
	})
	t.Run("ReadHeaderTimeout", func(t *testing.T) {
		ls := startLoop(t, withProbe(writeString("ok")), func(cfg *httpServerConfig) { cfg.ReadHeaderTimeout = 50 * time.Millisecond })
		c, br := dialRaw(t, ls.addr)
		_, _ = io.WriteString(c, "GET / HTTP/1.1\r\nHost: h\r\n") // no end of head
		if _, err := br.ReadByte(); err == nil || isTimeout(err) {
			t.Errorf("incomplete head: %v; want the connection closed", err)
		}
	})
}

func TestParseRequestHead(t *testing.T) {
	type want struct {
		method, target, host string
		header               http.Header
		contentLength        int64
		close                bool
	}
	head := func(lines ...string) string {
		return strings.Join(lines, "\r\n") + "\r\n\r\n"
	}
	ok := func(w want) *want {
		if w.method == "" {
			w.method = "GET"
		}
		if w.target == "" {
			w.target = "/"
		}
		if w.host == "" {
			w.host = "h"
		}
		if w.header == nil {
			w.header = http.Header{}
		}
		return &w
	}
	cases := []struct {
		name string
		head string
		want *want // nil: errHandoff
	}{
		{"minimal", head("GET / HTTP/1.1", "Host: h"), ok(want{})},
		{"POST with Content-Length", head("POST /v1/chat/completions HTTP/1.1", "Host: h", "Content-Length: 42"),
			ok(want{method: "POST", target: "/v1/chat/completions", contentLength: 42,
				header: http.Header{"Content-Length": {"42"}}})},
		{"methods/PUT", head("PUT /x HTTP/1.1", "Host: h"), ok(want{method: "PUT", target: "/x"})},
		{"methods/PATCH", head("PATCH /x HTTP/1.1", "Host: h"), ok(want{method: "PATCH", target: "/x"})},
		{"methods/DELETE", head("DELETE /x HTTP/1.1", "Host: h"), ok(want{method: "DELETE", target: "/x"})},
		{"methods/OPTIONS", head("OPTIONS /x HTTP/1.1", "Host: h"), ok(want{method: "OPTIONS", target: "/x"})},
		{"methods/HEAD", head("HEAD / HTTP/1.1", "Host: h"), nil},
		{"methods/CONNECT", head("CONNECT h:443 HTTP/1.1", "Host: h"), nil},
		{"methods/TRACE", head("TRACE / HTTP/1.1", "Host: h"), nil},
		{"methods/lower case", head("get / HTTP/1.1", "Host: h"), nil},
		{"target/query kept raw", head("GET /a%20b?x=1&y=%zz HTTP/1.1", "Host: h"), ok(want{target: "/a%20b?x=1&y=%zz"})},
		{"target/asterisk", head("OPTIONS * HTTP/1.1", "Host: h"), nil},
		{"target/absolute", head("GET http://h/ HTTP/1.1", "Host: h"), nil},
		{"target/empty", head("GET  HTTP/1.1", "Host: h"), nil},
		{"target/non-ASCII", head("GET /\xc3\xa9 HTTP/1.1", "Host: h"), nil},
		{"target/DEL", head("GET /\x7f HTTP/1.1", "Host: h"), nil},
		{"request line/three spaces", head("GET / x HTTP/1.1", "Host: h"), nil},
		{"request line/no protocol", head("GET /", "Host: h"), nil},
		{"request line/trailing space", head("GET / HTTP/1.1 ", "Host: h"), nil},
		{"request line/empty", head("", "Host: h"), nil},
		{"protocol/HTTP/1.0", head("GET / HTTP/1.0", "Host: h"), nil},
		{"protocol/HTTP/2.0", head("GET / HTTP/2.0", "Host: h"), nil},
		{"protocol/lower case", head("GET / http/1.1", "Host: h"), nil},
		{"names/lower case canonicalised",
			head("POST / HTTP/1.1", "host: h", "content-type: application/json", "x-api-key: k", "user-agent: u", "x-stainless-os: Linux", "content-length: 0"),
			ok(want{method: "POST", header: http.Header{"Content-Type": {"application/json"}, "X-Api-Key": {"k"},
				"User-Agent": {"u"}, "X-Stainless-Os": {"Linux"}, "Content-Length": {"0"}}})},
		{"names/upper case canonicalised", head("GET / HTTP/1.1", "HOST: h", "X-API-KEY: k", "ACCEPT: */*"),
			ok(want{header: http.Header{"X-Api-Key": {"k"}, "Accept": {"*/*"}}})},
		{"names/odd tokens kept", head("GET / HTTP/1.1", "Host: h", "x_under: 1", "1st-thing: 2", "a.b~c!: 3"),
			ok(want{header: http.Header{"X_under": {"1"}, "1st-Thing": {"2"}, "A.b~c!": {"3"}}})},
		{"repeated headers kept in order", head("GET / HTTP/1.1", "Accept: a", "Host: h", "X-A: 1", "accept: b", "ACCEPT: c"),
			ok(want{header: http.Header{"Accept": {"a", "b", "c"}, "X-A": {"1"}}})},
		{"values/trimmed", head("GET / HTTP/1.1", "Host:   h\t", "X-A:\t v  w \t", "X-Empty:", "X-Spaces:   "),
			ok(want{header: http.Header{"X-A": {"v  w"}, "X-Empty": {""}, "X-Spaces": {""}}})},
		{"values/colon in value", head("GET / HTTP/1.1", "Host: h:8080", "X-Url: http://a:1/b"),
			ok(want{host: "h:8080", header: http.Header{"X-Url": {"http://a:1/b"}}})},
		{"values/obs-text kept", head("GET / HTTP/1.1", "Host: h", "X-Name: caf\xc3\xa9"),
			ok(want{header: http.Header{"X-Name": {"caf\xc3\xa9"}}})},
		{"host/moved out of the header", head("GET / HTTP/1.1", "hOsT: Example.COM:8080", "X-A: 1"),
			ok(want{host: "Example.COM:8080", header: http.Header{"X-A": {"1"}}})},
		{"host/IPv6", head("GET / HTTP/1.1", "Host: [::1]:8080"), ok(want{host: "[::1]:8080"})},
		{"host/missing", head("GET / HTTP/1.1", "X-A: 1"), nil},
		{"host/no headers", head("GET / HTTP/1.1"), nil},
		{"host/twice", head("GET / HTTP/1.1", "Host: a", "Host: a"), nil},
		{"host/malformed", head("GET / HTTP/1.1", "Host: a b"), nil},
		{"host/non-ASCII", head("GET / HTTP/1.1", "Host: caf\xc3\xa9"), nil},
		{"content length/with spaces", head("POST / HTTP/1.1", "Host: h", "Content-Length:  7 "),
			ok(want{method: "POST", contentLength: 7, header: http.Header{"Content-Length": {"7"}}})},
		{"content length/leading zeros", head("POST / HTTP/1.1", "Host: h", "Content-Length: 007"),
			ok(want{method: "POST", contentLength: 7, header: http.Header{"Content-Length": {"007"}}})},
		{"content length/max", head("POST / HTTP/1.1", "Host: h", "Content-Length: 9223372036854775807"),
			ok(want{method: "POST", contentLength: 1<<63 - 1, header: http.Header{"Content-Length": {"9223372036854775807"}}})},
		{"content length/+5", head("POST / HTTP/1.1", "Host: h", "Content-Length: +5"), nil},
		{"content length/-1", head("POST / HTTP/1.1", "Host: h", "Content-Length: -1"), nil},
		{"content length/-0", head("POST / HTTP/1.1", "Host: h", "Content-Length: -0"), nil},
		{"content length/empty", head("POST / HTTP/1.1", "Host: h", "Content-Length:"), nil},
		{"content length/hex", head("POST / HTTP/1.1", "Host: h", "Content-Length: 0x5"), nil},
		{"content length/list", head("POST / HTTP/1.1", "Host: h", "Content-Length: 5, 5"), nil},
		{"content length/overflow", head("POST / HTTP/1.1", "Host: h", "Content-Length: 9223372036854775808"), nil},
		{"content length/two different", head("POST / HTTP/1.1", "Host: h", "Content-Length: 5", "Content-Length: 6"), nil},
		{"content length/two equal", head("POST / HTTP/1.1", "Host: h", "Content-Length: 5", "content-length: 5"), nil},
		{"connection/close", head("GET / HTTP/1.1", "Host: h", "Connection: close"),
			ok(want{close: true, header: http.Header{"Connection": {"close"}}})},
		{"connection/close in a token list", head("GET / HTTP/1.1", "Host: h", "Connection: keep-alive ,\tClOsE"),
			ok(want{close: true, header: http.Header{"Connection": {"keep-alive ,\tClOsE"}}})},
		{"connection/close on a second line", head("GET / HTTP/1.1", "Host: h", "Connection: keep-alive", "connection: close"),
			ok(want{close: true, header: http.Header{"Connection": {"keep-alive", "close"}}})},
		{"connection/closed is not close", head("GET / HTTP/1.1", "Host: h", "Connection: closed, xclose"),
			ok(want{header: http.Header{"Connection": {"closed, xclose"}}})},
		{"connection/close with NBSP is not close", head("GET / HTTP/1.1", "Host: h", "Connection: close\u00a0"),
			ok(want{header: http.Header{"Connection": {"close\u00a0"}}})},
		{"connection/upgrade", head("GET / HTTP/1.1", "Host: h", "Connection: keep-alive, Upgrade"), nil},
		{"handed off/Transfer-Encoding", head("POST / HTTP/1.1", "Host: h", "Transfer-Encoding: chunked"), nil},
		{"handed off/transfer-encoding lower case", head("POST / HTTP/1.1", "Host: h", "transfer-encoding: identity"), nil},
		{"handed off/Expect", head("POST / HTTP/1.1", "Host: h", "Expect: 100-continue"), nil},
		{"handed off/Upgrade", head("GET / HTTP/1.1", "Host: h", "Upgrade: websocket"), nil},
		{"handed off/Trailer", head("POST / HTTP/1.1", "Host: h", "Trailer: X"), nil},
		{"invalid/obsolete folding", head("GET / HTTP/1.1", "Host: h", "X-A: a", " b"), nil},
		{"invalid/folding with tab", head("GET / HTTP/1.1", "Host: h", "X-A: a", "\tb"), nil},
		{"invalid/name with space", head("GET / HTTP/1.1", "Host: h", "Bad Name: x"), nil},
		{"invalid/space before colon", head("GET / HTTP/1.1", "Host: h", "X-A : x"), nil},
		{"invalid/empty name", head("GET / HTTP/1.1", "Host: h", ": x"), nil},
		{"invalid/no colon", head("GET / HTTP/1.1", "Host: h", "X-A x"), nil},
		{"invalid/separator in name", head("GET / HTTP/1.1", "Host: h", "X(A): x"), nil},
		{"invalid/DEL in name", head("GET / HTTP/1.1", "Host: h", "X\x7f: x"), nil},
		{"invalid/non-ASCII name", head("GET / HTTP/1.1", "Host: h", "X-\xc3\xa9: x"), nil},
		{"invalid/NUL in value", head("GET / HTTP/1.1", "Host: h", "X-A: a\x00b"), nil},
		{"invalid/CR in value", head("GET / HTTP/1.1", "Host: h", "X-A: a\rb"), nil},
		{"invalid/DEL in value", head("GET / HTTP/1.1", "Host: h", "X-A: a\x7fb"), nil},
		{"invalid/escape in value", head("GET / HTTP/1.1", "Host: h", "X-A: \x1b[31m"), nil},
		{"invalid/no CRLF at all", "GET / HTTP/1.1", nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rh, err := parseRequestHead([]byte(c.head))
			if c.want == nil {
				if !errors.Is(err, errHandoff) {
					t.Errorf("parseRequestHead(%q) = %+v, %v; want errHandoff", c.head, rh, err)
				}
				return
			}
			if err != nil {
				t.Fatalf("parseRequestHead(%q): %v", c.head, err)
			}
			got := want(rh)
			if !reflect.DeepEqual(got, *c.want) {
				t.Errorf("parseRequestHead(%q)\n got %+v\nwant %+v", c.head, got, *c.want)
			}
		})
	}

	t.Run("appending to one value does not touch the next", func(t *testing.T) {
		rh, err := parseRequestHead([]byte("GET / HTTP/1.1\r\nHost: h\r\nX-A: a\r\nX-B: b\r\n\r\n"))
		if err != nil {
			t.Fatal(err)
		}
		rh.header.Add("X-A", "a2")
		if got := rh.header["X-B"]; len(got) != 1 || got[0] != "b" {
			t.Errorf("X-B = %q after adding to X-A", got)
		}
	})
}

func TestHeadEnd(t *testing.T) {
	cases := []struct {
		name string
		in   string
		n    int
		ok   bool
	}{
		{"empty", "", 0, false},
		{"request line only", "GET / HTTP/1.1\r\n", 0, false},
		{"partial blank line", "GET / HTTP/1.1\r\nHost: h\r\n\r", 0, false},
		{"no CRLF yet", "GET / HTTP/1.1", 0, false},
		{"CR at the end", "GET / HTTP/1.1\r", 0, false},
		{"whole head", "GET / HTTP/1.1\r\nHost: h\r\n\r\n", 27, true},
		{"whole head and a body", "POST / HTTP/1.1\r\nHost: h\r\n\r\nbody\r\n\r\n", 28, true},
		{"two heads/the first", "GET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\n\r\n", 19, true},
		{"head without headers", "GET / HTTP/1.1\r\n\r\n", 18, true},
		{"blank line first", "\r\n\r\n", 4, true},
		{"bare LF in the request line", "GET / HTTP/1.1\nHost: h\r\n\r\n", -1, true},
		{"bare LF in a header", "GET / HTTP/1.1\r\nHost: h\n\r\n", -1, true},
		{"bare LF blank line", "GET / HTTP/1.1\r\nHost: h\r\n\n", -1, true},
		{"bare LF first", "\n", -1, true},
		{"bare LF after an incomplete line", "GET / HTTP/1.1\r\nX: a\n", -1, true},
		{"CR alone in a line", "GET / HTTP/1.1\r\nX: a\rb\r\n\r\n", 26, true},
		{"CR CR LF", "GET / HTTP/1.1\r\r\n\r\n", 19, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			n, ok := headEnd([]byte(c.in))
			if n != c.n || ok != c.ok {
				t.Errorf("headEnd(%q) = %d, %v; want %d, %v", c.in, n, ok, c.n, c.ok)
			}
		})
	}
}

func FuzzParseRequestHead(f *testing.F) {
	for _, s := range []string{
		"GET / HTTP/1.1\r\nHost: h\r\n\r\n",
		"POST /v1/chat/completions HTTP/1.1\r\nhost: api.example.com\r\ncontent-type: application/json\r\n" +
			"content-length: 123\r\nauthorization: Bearer x\r\naccept: */*\r\nuser-agent: OpenAI/Python 1.0\r\n\r\n",
		"GET /a?b=c HTTP/1.1\r\nHost: h\r\nAccept: a\r\naccept: b\r\nConnection: keep-alive, close\r\n\r\n",
		"DELETE /x HTTP/1.1\r\nHost: h\r\nX_Odd~Name!: v\r\nX-Empty:\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: h\r\nContent-Length: +5\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: h\r\nX: a\r\n b\r\n\r\n",
		"GET / HTTP/1.1\nHost: h\n\n",
		"GET http://h/ HTTP/1.1\r\nHost: h\r\n\r\n",
		"GET / HTTP/1.0\r\n\r\n",
		"PUT /%zz HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n",
		"OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n",
		"PATCH / HTTP/1.1\r\nHost: h\r\nPragma: no-cache\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: h\r\nX: \xff\xfe\r\n\r\n",
		"GET / HTTP/1.1\r\n\r\n",
		"\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		n, ok := headEnd(data)
		if !ok || n < 0 {
			return // the server hands these to net/http without parsing them
		}
		head := data[:n]
		rh, err := parseRequestHead(head)
		if err != nil {
			if !errors.Is(err, errHandoff) {
				t.Fatalf("error %v does not wrap errHandoff", err)
			}
			return
		}
		switch rh.method {
		case "GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS":
		default:
			t.Fatalf("method %q", rh.method)
		}
		if !strings.HasPrefix(rh.target, "/") || !validTarget(rh.target) {
			t.Fatalf("target %q", rh.target)
		}
		if rh.contentLength < 0 {
			t.Fatalf("content length %d", rh.contentLength)
		}
		for k, vs := range rh.header {
			if k != textproto.CanonicalMIMEHeaderKey(k) || k == "Host" || len(vs) == 0 {
				t.Fatalf("header key %q with %q", k, vs)
			}
			for _, v := range vs {
				if v != strings.Trim(v, " \t") || !httpguts.ValidHeaderFieldValue(v) {
					t.Fatalf("header value %q", v)
				}
			}
		}

		// The loop serves what it parses: net/http must parse it alike.
		if _, err := url.ParseRequestURI(rh.target); err != nil {
			return // the loop answers 400 itself, as net/http does
		}
		req, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(head)))
		if err != nil {
			t.Fatalf("the loop serves a head net/http rejects (%v): %q", err, head)
		}
		if !httpguts.ValidHostHeader(rh.host) {
			t.Fatalf("the loop serves a Host net/http rejects with 400: %q", rh.host)
		}
		delete(req.Header, "Host")
		if _, ok := rh.header["Cache-Control"]; !ok && req.Header.Get("Pragma") == "no-cache" {
			delete(req.Header, "Cache-Control") // net/http's fixPragmaCacheControl
		}
		got := fmt.Sprintf("%s %s %s %v %d %v", rh.method, rh.target, rh.host, rh.header, rh.contentLength, rh.close)
		want := fmt.Sprintf("%s %s %s %v %d %v", req.Method, req.RequestURI, req.Host, req.Header, req.ContentLength, req.Close)
		if got != want {
			t.Fatalf("head %q\nloop:     %s\nnet/http: %s", head, got, want)
		}
	})
}

// sdkHead is a typical request head of an OpenAI SDK.
const sdkHead = "POST /v1/chat/completions HTTP/1.1\r\n" +
	"Host: proxy.internal:8080\r\n" +
	"Accept: application/json\r\n" +
	"Authorization: Bearer sk-0123456789abcdef\r\n" +
	"Content-Type: application/json\r\n" +
	"User-Agent: OpenAI/Python 1.54.0\r\n" +
	"Content-Length: 1234\r\n" +
	"\r\n"

func TestParseRequestHeadAllocs(t *testing.T) {
	for _, c := range []struct {
		name string
		head string
		max  float64
	}{
		// Measured 4 (go1.26, amd64, with and without -race): the string, the map and its
		// group, the values' backing array.
		{"canonical names", sdkHead, 6},
		// Measured 5: Python's httpx sends lower-case names; textproto's table of common
		// headers spares a copy of all but Authorization.
		{"lower-case names", sdkHead[:36] + strings.ToLower(sdkHead[36:]), 7},
	} {
		t.Run(c.name, func(t *testing.T) {
			head := []byte(c.head)
			if _, err := parseRequestHead(head); err != nil {
				t.Fatal(err)
			}
			got := testing.AllocsPerRun(200, func() { _, _ = parseRequestHead(head) })
			t.Logf("%v allocations", got)
			if got > c.max {
				t.Errorf("parseRequestHead allocates %v times; want at most %v", got, c.max)
			}
		})
	}
}

func BenchmarkParseRequestHead(b *testing.B) {
	head := []byte(sdkHead)
	b.ReportAllocs()
	b.SetBytes(int64(len(head)))
	for b.Loop() {
		_, _ = parseRequestHead(head)
	}
}
