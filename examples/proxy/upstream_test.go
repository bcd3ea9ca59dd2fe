package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/textproto"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// connCounter counts a test server's connections.
type connCounter struct {
	opened, closed atomic.Int32
}

// newCountingServer starts an httptest server for h that counts its connections; edit, when not
// nil, adjusts its http.Server before it starts.
func newCountingServer(t *testing.T, h http.HandlerFunc, edit func(*http.Server)) (*httptest.Server, *connCounter) {
	t.Helper()
	cc := &connCounter{}
	srv := httptest.NewUnstartedServer(h)
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		switch s {
		case http.StateNew:
			cc.opened.Add(1)
		case http.StateClosed, http.StateHijacked:
			cc.closed.Add(1)
		}
	}
	if edit != nil {
		edit(srv.Config)
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, cc
}

// newTestUpstream returns an upstreamTransport with cfg's defaults, closed at the end of the test.
func newTestUpstream(t *testing.T, cfg upstreamConfig) *upstreamTransport {
	t.Helper()
	tr := newUpstreamTransport(cfg)
	t.Cleanup(tr.CloseIdleConnections)
	return tr
}

// upRequest is a POST of body to url with a rewindable body, as the proxy sends them.
func upRequest(t *testing.T, ctx context.Context, url, body string) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	setBody(req, []byte(body))
	return req
}

// fetch round-trips req and reads the whole body.
func fetch(tr http.RoundTripper, req *http.Request) (string, error) {
	resp, err := tr.RoundTrip(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// echo answers "ok <request body>".
func echo(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	fmt.Fprintf(w, "ok %s", b)
}

func idleCount(tr *upstreamTransport, key string) int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return len(tr.idle[key])
}

func TestUpstreamKeepAlive(t *testing.T) {
	tests := []struct {
		name      string
		reqClose  bool // the request says Connection: close
		respClose bool // the response does
		wantConns int32
	}{
		{"reused", false, false, 1},
		{"request close", true, false, 3},
		{"response close", false, true, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv, cc := newCountingServer(t, func(w http.ResponseWriter, r *http.Request) {
				if tt.respClose {
					w.Header().Set("Connection", "close")
				}
				echo(w, r)
			}, nil)
			tr := newTestUpstream(t, upstreamConfig{})
			for i := range 3 {
				req := upRequest(t, context.Background(), srv.URL+"/v1/x?q=1", strconv.Itoa(i))
				req.Close = tt.reqClose
				got, err := fetch(tr, req)
				if err != nil || got != "ok "+strconv.Itoa(i) {
					t.Fatalf("request %d: %q, %v", i, got, err)
				}
				want := 0
				if tt.wantConns == 1 {
					want = 1
				}
				if n := idleCount(tr, srv.Listener.Addr().String()); n != want {
					t.Errorf("request %d: %d idle connections, want %d", i, n, want)
				}
			}
			if n := cc.opened.Load(); n != tt.wantConns {
				t.Errorf("%d connections, want %d", n, tt.wantConns)
			}
		})
	}
}

func TestUpstreamUnreadBodyNotReused(t *testing.T) {
	chunk := strings.Repeat("x", 32<<10)
	stop := make(chan struct{})
	srv, cc := newCountingServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/endless" {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if _, err := io.WriteString(w, chunk); err != nil {
					return
				}
			}
		}
		echo(w, r)
	}, nil)
	t.Cleanup(func() { close(stop) })
	tr := newTestUpstream(t, upstreamConfig{})
	resp, err := tr.RoundTrip(upRequest(t, context.Background(), srv.URL+"/endless", ""))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(resp.Body, make([]byte, 100)); err != nil {
		t.Fatal(err)
	}
	closed := make(chan struct{})
	go func() {
		resp.Body.Close() // must not drain the body
		resp.Body.Close() // idempotent
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(time.Second):
		t.Fatal("Close blocked, draining the body")
	}
	if _, err := resp.Body.Read(make([]byte, 1)); !errors.Is(err, errBodyClosed) {
		t.Errorf("Read after Close: %v", err)
	}
	if got, err := fetch(tr, upRequest(t, context.Background(), srv.URL, "b")); err != nil || got != "ok b" {
		t.Fatalf("next request: %q, %v", got, err)
	}
	if n := cc.opened.Load(); n != 2 {
		t.Errorf("%d connections, want 2: a half-read connection was reused", n)
	}
}

// rawServer accepts connections on loopback and serves each with handle(conn, i), i counting
// from 0; it returns the base URL and the number of connections accepted.
func rawServer(t *testing.T, handle func(c net.Conn, br *bufio.Reader, i int)) (string, *atomic.Int32) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var n atomic.Int32
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			i := int(n.Add(1) - 1)
			wg.Go(func() {
				defer c.Close()
				handle(c, bufio.NewReader(c), i)
			})
		}
	})
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	return "http://" + ln.Addr().String(), &n
}

// readRequest reads one request and its body from br.
func readRequest(br *bufio.Reader) (string, error) {
	req, err := http.ReadRequest(br)
	if err != nil {
		return "", err
	}
	b, err := io.ReadAll(req.Body)
	return string(b), err
}

// answer writes a keep-alive response with body.
func answer(c net.Conn, body string) {
	fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
}

// The upstream closes a pooled connection as the next request arrives on it: the request went
// nowhere and is sent again on a new connection.
func TestUpstreamRetriesOnClosedIdleConn(t *testing.T) {
	tests := []struct {
		name      string
		reset     bool // close with RST instead of FIN
		body      bool
		getBody   bool
		wantRetry bool
	}{
		{"fin", false, true, true, true},
		{"rst", true, true, true, true},
		{"no body", false, false, false, true},
		{"body not rewindable", false, true, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var seen atomic.Int32 // requests that reached the server
			url, conns := rawServer(t, func(c net.Conn, br *bufio.Reader, i int) {
				for j := 0; ; j++ {
					if i == 0 && j == 1 {
						// The second request on the first connection: close without answering.
						if _, err := br.Peek(1); err != nil {
							return
						}
						seen.Add(1)
						if tt.reset {
							c.(*net.TCPConn).SetLinger(0)
						} else {
							readRequest(br)
						}
						return
					}
					b, err := readRequest(br)
					if err != nil {
						return
					}
					seen.Add(1)
					answer(c, "ok "+b)
				}
			})
			tr := newTestUpstream(t, upstreamConfig{})
			if got, err := fetch(tr, upRequest(t, context.Background(), url, "1")); err != nil || got != "ok 1" {
				t.Fatalf("first request: %q, %v", got, err)
			}
			req := upRequest(t, context.Background(), url, "2")
			want := "ok 2"
			if !tt.body {
				req.Body, req.GetBody, req.ContentLength = nil, nil, 0
				want = "ok "
			} else if !tt.getBody {
				req.GetBody = nil
			}
			got, err := fetch(tr, req)
			if !tt.wantRetry {
				if err == nil || !closedByPeer(err) {
					t.Fatalf("got %q, %v; want the connection's failure", got, err)
				}
				return
			}
			if err != nil || got != want {
				t.Fatalf("second request: %q, %v", got, err)
			}
			if n := conns.Load(); n != 2 {
				t.Errorf("%d connections, want 2", n)
			}
			if n := seen.Load(); n != 3 {
				t.Errorf("the server saw %d requests, want 3", n)
			}
		})
	}
}

// A new connection that fails is the backend's failure: no retry.
func TestUpstreamNoRetryOnFreshConn(t *testing.T) {
	url, conns := rawServer(t, func(c net.Conn, br *bufio.Reader, _ int) { readRequest(br) })
	tr := newTestUpstream(t, upstreamConfig{})
	_, err := fetch(tr, upRequest(t, context.Background(), url, "x"))
	if !errors.Is(err, errClosedBeforeResponse) {
		t.Errorf("err %v, want errClosedBeforeResponse", err)
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("%d connections, want 1", n)
	}
}

// The upstream's keep-alive timeout closed the pooled connection a while ago: the next request
// goes out on a new one.
func TestUpstreamStaleIdleConn(t *testing.T) {
	srv, cc := newCountingServer(t, echo, func(s *http.Server) { s.IdleTimeout = 20 * time.Millisecond })
	tr := newTestUpstream(t, upstreamConfig{})
	for i := range 3 {
		if got, err := fetch(tr, upRequest(t, context.Background(), srv.URL, "x")); err != nil || got != "ok x" {
			t.Fatalf("request %d: %q, %v", i, got, err)
		}
		waitFor(t, time.Second, "the server closed the idle connection", func() bool { return cc.closed.Load() == int32(i+1) })
	}
	if n := cc.opened.Load(); n != 3 {
		t.Errorf("%d connections, want 3", n)
	}
}

func TestPeerClosed(t *testing.T) {
	if runtime.GOOS == "windows" || runtime.GOOS == "plan9" {
		t.Skip("no non-blocking read here")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	tests := []struct {
		name string
		peer func(net.Conn)
		want bool
	}{
		{"idle", func(net.Conn) {}, false},
		{"closed", func(c net.Conn) { c.Close() }, true},
		{"unasked data", func(c net.Conn) { io.WriteString(c, "HTTP/1.1 408 Request Timeout\r\n\r\n") }, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			s, err := ln.Accept()
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			tt.peer(s)
			deadline := time.Now().Add(time.Second)
			got := peerClosed(c)
			for got != tt.want && tt.want && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond) // the FIN or the data is on its way
				got = peerClosed(c)
			}
			if got != tt.want {
				t.Errorf("peerClosed %v, want %v", got, tt.want)
			}
		})
	}
}

func TestUpstreamBodyCutShort(t *testing.T) {
	tests := []struct {
		name, response string
	}{
		{"content-length", "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789"},
		{"chunked", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			url, _ := rawServer(t, func(c net.Conn, br *bufio.Reader, _ int) {
				readRequest(br)
				io.WriteString(c, tt.response)
			})
			tr := newTestUpstream(t, upstreamConfig{})
			got, err := fetch(tr, upRequest(t, context.Background(), url, "x"))
			if !errors.Is(err, io.ErrUnexpectedEOF) {
				t.Errorf("read %q, %v; want io.ErrUnexpectedEOF", got, err)
			}
			if n := idleCount(tr, strings.TrimPrefix(url, "http://")); n != 0 {
				t.Errorf("%d idle connections after a failed body", n)
			}
		})
	}
}

// A stream's events arrive as the upstream sends them, not when the response ends.
func TestUpstreamStreamsIncrementally(t *testing.T) {
	next := make(chan struct{})
	srv, _ := newCountingServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: first\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-next:
		case <-r.Context().Done():
			return
		}
		io.WriteString(w, "data: second\n\ndata: [DONE]\n\n")
	}, nil)
	tr := newTestUpstream(t, upstreamConfig{})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	resp, err := tr.RoundTrip(upRequest(t, ctx, srv.URL, "x"))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	first := make([]byte, len("data: first\n\n"))
	if _, err := io.ReadFull(resp.Body, first); err != nil {
		t.Fatalf("first event: %v (not delivered before the second was written?)", err)
	}
	close(next)
	rest, err := io.ReadAll(resp.Body)
	if err != nil || string(rest) != "data: second\n\ndata: [DONE]\n\n" {
		t.Fatalf("rest %q, %v", rest, err)
	}
	if n := idleCount(tr, srv.Listener.Addr().String()); n != 1 {
		t.Errorf("%d idle connections after the stream, want 1", n)
	}
}

var errTestCause = errors.New("test cause")

func TestUpstreamCancel(t *testing.T) {
	release := make(chan struct{})
	srv, _ := newCountingServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/body" {
			w.WriteHeader(200)
			io.WriteString(w, "partial")
			w.(http.Flusher).Flush()
		}
		select {
		case <-release:
		case <-r.Context().Done():
		case <-time.After(2 * time.Second): // the cancellation did not reach the connection
		}
	}, nil)
	t.Cleanup(func() { close(release) })
	tr := newTestUpstream(t, upstreamConfig{})
	key := srv.Listener.Addr().String()

	causes := []error{errTestCause, errKVTransferTimeout, context.Canceled}
	for _, cause := range causes {
		t.Run("headers/"+cause.Error(), func(t *testing.T) {
			ctx, cancel := context.WithCancelCause(context.Background())
			defer cancel(nil)
			time.AfterFunc(20*time.Millisecond, func() { cancel(cause) })
			// Without the cancellation the handler answers after 2 s and err is nil.
			_, err := tr.RoundTrip(upRequest(t, ctx, srv.URL+"/headers", "x"))
			if !errors.Is(err, cause) {
				t.Fatalf("err %v, want %v", err, cause)
			}
			if cause == errKVTransferTimeout && errKind(err) != "timeout" {
				t.Errorf("errKind %q, want timeout", errKind(err))
			}
		})
	}
	t.Run("body", func(t *testing.T) {
		ctx, cancel := context.WithCancelCause(context.Background())
		defer cancel(nil)
		resp, err := tr.RoundTrip(upRequest(t, ctx, srv.URL+"/body", "x"))
		if err != nil {
			t.Fatal(err)
		}
		time.AfterFunc(20*time.Millisecond, func() { cancel(errTestCause) })
		b, err := io.ReadAll(resp.Body)
		if !errors.Is(err, errTestCause) || string(b) != "partial" {
			t.Errorf("read %q, %v; want %q, %v", b, err, "partial", errTestCause)
		}
		if _, err2 := resp.Body.Read(make([]byte, 1)); !errors.Is(err2, errTestCause) {
			t.Errorf("second Read: %v", err2)
		}
		resp.Body.Close()
	})
	t.Run("body closed during read", func(t *testing.T) {
		ctx, cancel := context.WithCancelCause(context.Background())
		defer cancel(nil)
		resp, err := tr.RoundTrip(upRequest(t, ctx, srv.URL+"/body", "x"))
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error)
		go func() {
			_, err := io.ReadAll(resp.Body)
			done <- err
		}()
		time.Sleep(10 * time.Millisecond)
		cancel(errTestCause)
		resp.Body.Close() // concurrently with the Read that the cancel unblocks
		select {
		case err := <-done:
			if err == nil {
				t.Error("read to EOF")
			}
		case <-time.After(time.Second):
			t.Fatal("Read still blocked")
		}
	})
	t.Run("already done", func(t *testing.T) {
		ctx, cancel := context.WithCancelCause(context.Background())
		cancel(errTestCause)
		if _, err := tr.RoundTrip(upRequest(t, ctx, srv.URL, "x")); !errors.Is(err, errTestCause) {
			t.Errorf("err %v", err)
		}
	})
	if n := idleCount(tr, key); n != 0 {
		t.Errorf("%d idle connections after cancelled exchanges, want 0", n)
	}
}

func TestUpstreamDialError(t *testing.T) {
	tr := newTestUpstream(t, upstreamConfig{Dial: (&net.Dialer{Timeout: time.Second}).DialContext})
	_, err := tr.RoundTrip(upRequest(t, context.Background(), deadURL(t), "x"))
	if _, ok := errors.AsType[*net.OpError](err); !ok || errKind(err) != "connect" {
		t.Errorf("err %T %v, want a *net.OpError of kind connect", err, err)
	}
}

// roundTripperFunc adapts a function to http.RoundTripper.
type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func TestUpstreamFallback(t *testing.T) {
	var calls atomic.Int32
	fb := roundTripperFunc(func(r *http.Request) (*http.Response, error) {
		calls.Add(1)
		return &http.Response{StatusCode: 299, Body: http.NoBody, Request: r}, nil
	})
	srv, cc := newCountingServer(t, echo, nil)
	tr := newTestUpstream(t, upstreamConfig{Fallback: fb})
	tests := []struct {
		name     string
		url      string
		edit     func(*http.Request)
		fallback bool
	}{
		{"http", srv.URL, nil, false},
		{"https", strings.Replace(srv.URL, "http:", "https:", 1), nil, true},
		{"upgrade", srv.URL, func(r *http.Request) { r.Header.Set("Connection", "Upgrade"); r.Header.Set("Upgrade", "websocket") }, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before, beforeConns := calls.Load(), cc.opened.Load()
			req := upRequest(t, context.Background(), tt.url, "x")
			if tt.edit != nil {
				tt.edit(req)
			}
			resp, err := tr.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if got := calls.Load() > before; got != tt.fallback {
				t.Errorf("fallback used %v, want %v (status %d)", got, tt.fallback, resp.StatusCode)
			}
			if tt.fallback && cc.opened.Load() != beforeConns {
				t.Error("a fallback request reached the server directly")
			}
		})
	}
}

func TestUpstreamInformational(t *testing.T) {
	srv, cc := newCountingServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</style.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		w.Header().Del("Link")
		echo(w, r)
	}, nil)
	tr := newTestUpstream(t, upstreamConfig{})
	for range 2 {
		var got1xx []int
		trace := &httptrace.ClientTrace{Got1xxResponse: func(code int, _ textproto.MIMEHeader) error {
			got1xx = append(got1xx, code)
			return nil
		}}
		ctx := httptrace.WithClientTrace(context.Background(), trace)
		resp, err := tr.RoundTrip(upRequest(t, ctx, srv.URL, "x"))
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != 200 || string(b) != "ok x" || len(got1xx) != 1 || got1xx[0] != 103 {
			t.Errorf("%d %q %v, 1xx %v", resp.StatusCode, b, err, got1xx)
		}
	}
	if n := cc.opened.Load(); n != 1 {
		t.Errorf("%d connections, want 1", n)
	}
}

func TestUpstreamConcurrent(t *testing.T) {
	srv, _ := newCountingServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/stream" {
			w.Header().Set("Content-Type", "text/event-stream")
			for i := range 3 {
				fmt.Fprintf(w, "data: %d\n\n", i)
				w.(http.Flusher).Flush()
			}
			return
		}
		echo(w, r)
	}, nil)
	const workers, perWorker = 16, 30
	tr := newTestUpstream(t, upstreamConfig{MaxIdlePerHost: workers / 2})
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			for i := range perWorker {
				body := fmt.Sprintf("%d-%d", w, i)
				switch i % 3 {
				case 0: // read to the end
					got, err := fetch(tr, upRequest(t, context.Background(), srv.URL, body))
					if err != nil || got != "ok "+body {
						errs <- fmt.Errorf("%s: %q, %v", body, got, err)
						return
					}
				case 1: // stream, closed early
					resp, err := tr.RoundTrip(upRequest(t, context.Background(), srv.URL+"/stream", body))
					if err != nil {
						errs <- err
						return
					}
					resp.Body.Read(make([]byte, 4))
					resp.Body.Close()
				case 2: // stream to the end
					got, err := fetch(tr, upRequest(t, context.Background(), srv.URL+"/stream", body))
					if err != nil || got != "data: 0\n\ndata: 1\n\ndata: 2\n\n" {
						errs <- fmt.Errorf("%s: %q, %v", body, got, err)
						return
					}
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if n := idleCount(tr, srv.Listener.Addr().String()); n > workers/2 {
		t.Errorf("%d idle connections, bound %d", n, workers/2)
	}
}

func TestUpstreamPoolBound(t *testing.T) {
	const inFlight, bound = 6, 2
	var arrived sync.WaitGroup
	arrived.Add(inFlight)
	srv, cc := newCountingServer(t, func(w http.ResponseWriter, r *http.Request) {
		arrived.Done()
		arrived.Wait() // all six connections are open at once
		echo(w, r)
	}, nil)
	tr := newTestUpstream(t, upstreamConfig{MaxIdlePerHost: bound})
	var wg sync.WaitGroup
	for i := range inFlight {
		wg.Go(func() {
			if got, err := fetch(tr, upRequest(t, context.Background(), srv.URL, strconv.Itoa(i))); err != nil || got != "ok "+strconv.Itoa(i) {
				t.Errorf("%q, %v", got, err)
			}
		})
	}
	wg.Wait()
	if n := idleCount(tr, srv.Listener.Addr().String()); n != bound {
		t.Errorf("%d idle connections, want %d", n, bound)
	}
	waitFor(t, time.Second, "the connections over the bound closed", func() bool { return cc.closed.Load() == inFlight-bound })
	if n := cc.opened.Load(); n != inFlight {
		t.Errorf("%d connections, want %d", n, inFlight)
	}
}

// The most recently used connection is reused first, so that the others age out.
func TestUpstreamLIFO(t *testing.T) {
	var arrived sync.WaitGroup
	arrived.Add(2)
	srv, _ := newCountingServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/together" {
			arrived.Done()
			arrived.Wait()
		}
		io.WriteString(w, r.RemoteAddr)
	}, nil)
	tr := newTestUpstream(t, upstreamConfig{})
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() { fetch(tr, upRequest(t, context.Background(), srv.URL+"/together", "")) })
	}
	wg.Wait()
	seen := map[string]bool{}
	for range 4 {
		addr, err := fetch(tr, upRequest(t, context.Background(), srv.URL, ""))
		if err != nil {
			t.Fatal(err)
		}
		seen[addr] = true
	}
	if len(seen) != 1 {
		t.Errorf("sequential requests used %d connections, want 1: %v", len(seen), seen)
	}
}

func TestUpstreamIdleTimeoutAndClose(t *testing.T) {
	srv, cc := newCountingServer(t, echo, nil)
	key := srv.Listener.Addr().String()
	t.Run("timeout", func(t *testing.T) {
		tr := newTestUpstream(t, upstreamConfig{IdleTimeout: 30 * time.Millisecond})
		if _, err := fetch(tr, upRequest(t, context.Background(), srv.URL, "x")); err != nil {
			t.Fatal(err)
		}
		if n := idleCount(tr, key); n != 1 {
			t.Fatalf("%d idle connections, want 1", n)
		}
		waitFor(t, time.Second, "the idle connection closed", func() bool { return idleCount(tr, key) == 0 && cc.closed.Load() == 1 })
	})
	t.Run("CloseIdleConnections", func(t *testing.T) {
		tr := newTestUpstream(t, upstreamConfig{})
		if _, err := fetch(tr, upRequest(t, context.Background(), srv.URL, "x")); err != nil {
			t.Fatal(err)
		}
		tr.CloseIdleConnections()
		waitFor(t, time.Second, "the idle connection closed", func() bool { return cc.closed.Load() == 2 })
		if got, err := fetch(tr, upRequest(t, context.Background(), srv.URL, "y")); err != nil || got != "ok y" {
			t.Errorf("after CloseIdleConnections: %q, %v", got, err)
		}
	})
}

// The proxy serves through either upstream client.
func TestUpstreamClientFlag(t *testing.T) {
	var stderr bytes.Buffer
	if err := mainErr([]string{"-upstream-client", "curl"}, io.Discard, &stderr); err == nil || !strings.Contains(err.Error(), "upstream-client") {
		t.Errorf("bad -upstream-client: %v", err)
	}
	up := newFakeUpstream(t, "a")
	for _, mode := range []string{upstreamDirect, upstreamNetHTTP} {
		t.Run(mode, func(t *testing.T) {
			srv, err := newServer(fakeConfig(t, []BackendConfig{{Name: "a", URL: up.URL}}, nil), testLogger(t), withUpstreamClient(mode))
			if err != nil {
				t.Fatal(err)
			}
			defer srv.Close()
			if _, direct := srv.upstream.(*upstreamTransport); direct != (mode == upstreamDirect) {
				t.Errorf("upstream %T for %s", srv.upstream, mode)
			}
			hs := httptest.NewServer(srv.Handler())
			defer hs.Close()
			for range 2 {
				r, b := post(t, hs.URL+"/v1/chat/completions", chatBody("s", "u", ""))
				if r.StatusCode != 200 || !strings.Contains(string(b), `"backend":"a"`) {
					t.Errorf("%d %s", r.StatusCode, b)
				}
			}
		})
	}
}

// BenchmarkUpstream compares the two upstream clients on one loopback round trip of a small
// chat completion: sequential (one connection, the added latency) and parallel.
func BenchmarkUpstream(b *testing.B) {
	resp := []byte(`{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"length"}]}`)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.Write(resp)
	}))
	defer srv.Close()
	small := `{"model":"m","max_tokens":4,"temperature":0.7,"messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"About the sea."}]}`
	large := `{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"` + strings.Repeat("lorem ipsum ", 1000) + `"}]}`
	clients := []struct {
		name string
		new  func() (http.RoundTripper, func())
	}{
		{"client=direct", func() (http.RoundTripper, func()) {
			t := newUpstreamTransport(upstreamConfig{})
			return t, t.CloseIdleConnections
		}},
		{"client=net-http", func() (http.RoundTripper, func()) {
			t := &http.Transport{MaxIdleConnsPerHost: 128, DisableCompression: true}
			return t, t.CloseIdleConnections
		}},
	}
	roundTrip := func(b *testing.B, tr http.RoundTripper, body, buf []byte) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/chat/completions", nil)
		setBody(req, body)
		res, err := tr.RoundTrip(req)
		if err != nil {
			b.Fatal(err)
		}
		for {
			if _, err := res.Body.Read(buf); err != nil {
				break
			}
		}
		res.Body.Close()
	}
	for _, body := range [][]byte{[]byte(small), []byte(large)} {
		for _, c := range clients {
			b.Run(fmt.Sprintf("body=%dB/mode=sequential/%s", len(body), c.name), func(b *testing.B) {
				tr, done := c.new()
				defer done()
				buf := make([]byte, 32<<10)
				b.ReportAllocs()
				b.SetBytes(int64(len(body) + len(resp)))
				for b.Loop() {
					roundTrip(b, tr, body, buf)
				}
			})
			b.Run(fmt.Sprintf("body=%dB/mode=parallel/%s", len(body), c.name), func(b *testing.B) {
				tr, done := c.new()
				defer done()
				b.ReportAllocs()
				b.SetBytes(int64(len(body) + len(resp)))
				b.RunParallel(func(pb *testing.PB) {
					buf := make([]byte, 32<<10)
					for pb.Next() {
						roundTrip(b, tr, body, buf)
					}
				})
			})
		}
	}
}

// writeBoth writes mk's request with writeRequest and with req.Write, each on a request of its
// own, and returns the bytes and errors of each.
func writeBoth(mk func() *http.Request) (fast, std []byte, fastErr, stdErr error) {
	var b1, b2 bytes.Buffer
	bw := bufio.NewWriterSize(&b1, upstreamWriteBufferSize)
	var lr io.LimitedReader
	fastErr = writeRequest(bw, &lr, mk())
	_ = bw.Flush()
	stdErr = mk().Write(&b2)
	return b1.Bytes(), b2.Bytes(), fastErr, stdErr
}

// errString is err's message, "" for nil.
func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// failingBody is a request body whose Read fails after n bytes.
type failingBody struct{ n int }

func (b *failingBody) Read(p []byte) (int, error) {
	if b.n == 0 {
		return 0, errors.New("disk on fire")
	}
	n := min(b.n, len(p))
	for i := range n {
		p[i] = 'x'
	}
	b.n -= n
	return n, nil
}

func (*failingBody) Close() error { return nil }

// writeRequest writes what req.Write writes, whichever way it takes.
func TestWriteRequest(t *testing.T) {
	chat := []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	proxied := func(edit func(*http.Request)) func() *http.Request {
		return func() *http.Request {
			req, _ := http.NewRequest(http.MethodPost, "http://127.0.0.1:8001/v1/chat/completions", nil)
			setBody(req, chat)
			req.Header = http.Header{"Content-Type": {"application/json"}, "Accept": {"text/event-stream"},
				"User-Agent": {""}, "X-Forwarded-For": {"10.0.0.1"}, "X-Forwarded-Host": {"proxy:8080"},
				"X-Forwarded-Proto": {"http"}, "Authorization": {"Bearer k"}}
			if edit != nil {
				edit(req)
			}
			return req
		}
	}
	tests := []struct {
		name string
		mk   func() *http.Request
		fast bool // writeRequest takes its own path
	}{
		{"proxied", proxied(nil), true},
		{"default user agent", proxied(func(r *http.Request) { delete(r.Header, "User-Agent") }), true},
		{"user agent trimmed", proxied(func(r *http.Request) { r.Header.Set("User-Agent", " sdk/1.0\t") }), true},
		{"values trimmed", proxied(func(r *http.Request) { r.Header["X-Pad"] = []string{"  a b ", "\tc"} }), true},
		{"non-canonical names", proxied(func(r *http.Request) { r.Header["x-lower"] = []string{"1"}; r.Header["X-EMPTY"] = nil }), true},
		{"host and query", proxied(func(r *http.Request) { r.Host = "engine.local:9000"; r.URL.RawQuery = "a=1&b=%20" }), true},
		{"escaped path", proxied(func(r *http.Request) { r.URL.Path = "/v1/a b"; r.URL.RawPath = "" }), true},
		{"excluded headers", proxied(func(r *http.Request) {
			r.Header["Content-Length"] = []string{"999"}
			r.Header["Host"] = []string{"other"}
			r.Header["Trailer"] = []string{"X"}
		}), true},
		{"body shorter than its length", proxied(func(r *http.Request) { r.ContentLength += 5 }), true},
		{"body longer than its length", proxied(func(r *http.Request) { r.ContentLength -= 5 }), true},
		{"body read error", proxied(func(r *http.Request) { r.Body, r.ContentLength = &failingBody{n: 3}, 10 }), true},
		{"no GetBody", proxied(func(r *http.Request) { r.GetBody = nil }), false},
		{"chunked", proxied(func(r *http.Request) { r.TransferEncoding = []string{"chunked"} }), false},
		{"close", proxied(func(r *http.Request) { r.Close = true }), false},
		{"line break in a value", proxied(func(r *http.Request) { r.Header.Set("X-Bad", "a\r\nInjected: 1") }), false},
		{"line break in the user agent", proxied(func(r *http.Request) { r.Header.Set("User-Agent", "a\nb") }), false},
		{"invalid name", proxied(func(r *http.Request) { r.Header["Bad Name"] = []string{"1"} }), false},
		{"zone in the host", proxied(func(r *http.Request) { r.Host = "[fe80::1%en0]:8001" }), false},
		{"non-ASCII host", proxied(func(r *http.Request) { r.Host = "bücher.example:80" }), false},
		{"control byte in the target", proxied(func(r *http.Request) { r.URL.RawQuery = "a=\x01" }), false},
		{"many headers", proxied(func(r *http.Request) {
			for i := range maxFastHeaderKeys {
				r.Header.Set(fmt.Sprintf("X-H%d", i), "v")
			}
		}), false},
		{"body larger than the buffer", proxied(func(r *http.Request) {
			setBody(r, bytes.Repeat([]byte("x"), upstreamWriteBufferSize))
		}), false},
		{"write trace", proxied(func(r *http.Request) {
			*r = *r.WithContext(httptrace.WithClientTrace(r.Context(), &httptrace.ClientTrace{WroteHeaders: func() {}}))
		}), false},
		{"no body", func() *http.Request {
			req, _ := http.NewRequest(http.MethodGet, "http://127.0.0.1:8001/health", nil)
			return req
		}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := tt.mk()
			head, fast := appendRequestHead(nil, req)
			fast = fast && int64(len(head)) < upstreamWriteBufferSize-req.ContentLength
			if fast != tt.fast {
				t.Errorf("own path %v, want %v", fast, tt.fast)
			}
			got, want, gotErr, wantErr := writeBoth(tt.mk)
			if !bytes.Equal(got, want) {
				t.Errorf("wrote\n%q\nreq.Write writes\n%q", got, want)
			}
			if errString(gotErr) != errString(wantErr) {
				t.Errorf("error %v, req.Write's %v", gotErr, wantErr)
			}
		})
	}
}

// The proxy's request costs writeRequest no allocation.
func TestWriteRequestAllocs(t *testing.T) {
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	br := bytes.NewReader(body)
	req, _ := http.NewRequest(http.MethodPost, "http://127.0.0.1:8001/v1/chat/completions", nil)
	req.Body, req.ContentLength = io.NopCloser(br), int64(len(body))
	req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	req.Header = http.Header{"Content-Type": {"application/json"}, "User-Agent": {""}, "X-Forwarded-For": {"10.0.0.1"}}
	bw := bufio.NewWriterSize(io.Discard, upstreamWriteBufferSize)
	var lr io.LimitedReader
	allocs := testing.AllocsPerRun(100, func() {
		br.Reset(body)
		if err := writeRequest(bw, &lr, req); err != nil {
			t.Fatal(err)
		}
		_ = bw.Flush()
	})
	if allocs != 0 {
		t.Errorf("%v allocations per request, want 0", allocs)
	}
}

// bufferedReader returns a reader of raw whose buffer holds what one read gave, as exchange has
// it when it reads the response.
func bufferedReader(raw []byte) *bufio.Reader {
	br := bufio.NewReaderSize(bytes.NewReader(raw), upstreamReadBufferSize)
	_, _ = br.Peek(1)
	return br
}

// compareResponse checks that parseResponseHead reads raw, the answer to a method request, as
// http.ReadResponse does: the same head, then the same body, error, trailer and rest of the
// stream. It reports whether parseResponseHead took the response.
func compareResponse(t *testing.T, raw []byte, method string) bool {
	t.Helper()
	req := &http.Request{Method: method}
	br := bufferedReader(raw)
	got := parseResponseHead(br, req)
	if got == nil {
		return false
	}
	wbr := bufferedReader(raw)
	want, err := http.ReadResponse(wbr, req)
	if err != nil {
		t.Fatalf("parseResponseHead took %q, which http.ReadResponse rejects: %v", raw, err)
	}
	head := func(r *http.Response) string {
		return fmt.Sprintf("%q %d %q %d.%d %v len=%d te=%q close=%v trailer=%v nobody=%v", r.Status, r.StatusCode, r.Proto,
			r.ProtoMajor, r.ProtoMinor, r.Header, r.ContentLength, r.TransferEncoding, r.Close, r.Trailer, r.Body == http.NoBody)
	}
	if g, w := head(got), head(want); g != w {
		t.Fatalf("%q:\nhead %s\nReadResponse's %s", raw, g, w)
	}
	gb, gerr := io.ReadAll(got.Body)
	wb, werr := io.ReadAll(want.Body)
	if !bytes.Equal(gb, wb) || errString(gerr) != errString(werr) {
		t.Fatalf("%q:\nbody %q, %v\nReadResponse's %q, %v", raw, gb, gerr, wb, werr)
	}
	if g, w := fmt.Sprint(got.Trailer), fmt.Sprint(want.Trailer); g != w {
		t.Fatalf("%q: trailer %s, ReadResponse's %s", raw, g, w)
	}
	if werr == nil {
		grest, _ := io.ReadAll(br)
		wrest, _ := io.ReadAll(wbr)
		if !bytes.Equal(grest, wrest) {
			t.Fatalf("%q: left %q, ReadResponse leaves %q", raw, grest, wrest)
		}
	}
	return true
}

var responseHeadSeeds = []struct {
	name string
	raw  string
	fast bool // parseResponseHead takes it
}{
	{"net/http", "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\nDate: Mon, 01 Jan 2024 00:00:00 GMT\r\n\r\n{}", true},
	{"uvicorn", "HTTP/1.1 200 OK\r\ndate: Mon, 01 Jan 2024 00:00:00 GMT\r\nserver: uvicorn\r\ncontent-length: 2\r\ncontent-type: application/json\r\nx-request-id: abc\r\n\r\n{}", true},
	{"stream", "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n6\r\ndata: \r\n5\r\nhello\r\n0\r\n\r\nHTTP/1.1", true},
	{"trailer", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-Tokens: 7\r\n\r\n", true},
	{"empty", "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\nnext", true},
	{"error", "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5\r\nRetry-After: 1\r\n\r\nbusy.", true},
	{"no reason", "HTTP/1.1 200\r\nContent-Length: 1\r\n\r\nx", true},
	{"repeated and padded", "HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nset-cookie:b=2 \t\r\nX-Empty:\r\nContent-Length: 1\r\n\r\nx", true},
	{"obs-text", "HTTP/1.1 200 \xe2\x9c\x93\r\nX-Name: caf\xc3\xa9\r\nContent-Length: 1\r\n\r\nx", true},
	{"cut short", "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", true},
	{"bad chunk", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", true},
	{"HTTP/1.0", "HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx", false},
	{"no length", "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil close", false},
	{"connection close", "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\nx", false},
	{"pragma", "HTTP/1.1 200 OK\r\nPragma: no-cache\r\nContent-Length: 1\r\n\r\nx", false},
	{"announced trailer", "HTTP/1.1 200 OK\r\nTrailer: X-T\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-T: 1\r\n\r\n", false},
	{"two lengths", "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx", false},
	{"bad length", "HTTP/1.1 200 OK\r\nContent-Length: +1\r\n\r\nx", false},
	{"length and chunked", "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", false},
	{"gzip", "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", false},
	{"no content", "HTTP/1.1 204 No Content\r\n\r\n", false},
	{"informational", "HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", false},
	{"folded", "HTTP/1.1 200 OK\r\nX-A: 1\r\n  2\r\nContent-Length: 1\r\n\r\nx", false},
	{"bare LF", "HTTP/1.1 200 OK\nContent-Length: 1\n\nx", false},
	{"bare LF in a header", "HTTP/1.1 200 OK\r\nX-A: 1\nContent-Length: 1\r\n\r\nx", false},
	{"space before colon", "HTTP/1.1 200 OK\r\nX-A : 1\r\nContent-Length: 1\r\n\r\nx", false},
	{"control byte", "HTTP/1.1 200 OK\r\nX-A: \x01\r\nContent-Length: 1\r\n\r\nx", false},
	{"head not buffered", "HTTP/1.1 200 OK\r\nContent-Length: 1\r\n", false},
	{"two spaces", "HTTP/1.1  200 OK\r\nContent-Length: 1\r\n\r\nx", false},
}

// parseResponseHead takes the usual answers, and reads them as http.ReadResponse does.
func TestParseResponseHead(t *testing.T) {
	for _, tt := range responseHeadSeeds {
		t.Run(tt.name, func(t *testing.T) {
			if got := compareResponse(t, []byte(tt.raw), http.MethodPost); got != tt.fast {
				t.Errorf("taken %v, want %v", got, tt.fast)
			}
		})
	}
	if compareResponse(t, []byte(responseHeadSeeds[0].raw), http.MethodHead) {
		t.Error("the answer to a HEAD request taken")
	}
}

func FuzzParseResponseHead(f *testing.F) {
	for _, s := range responseHeadSeeds {
		f.Add([]byte(s.raw), false)
	}
	f.Fuzz(func(t *testing.T, raw []byte, head bool) {
		method := http.MethodPost
		if head {
			method = http.MethodHead
		}
		compareResponse(t, raw, method)
	})
}

// A usual answer's head costs parseResponseHead a few allocations: the head's string, the
// header, its values, the response and the body.
func TestParseResponseHeadAllocs(t *testing.T) {
	raw := []byte(responseHeadSeeds[1].raw)
	req := &http.Request{Method: http.MethodPost}
	r := bytes.NewReader(raw)
	br := bufio.NewReaderSize(r, upstreamReadBufferSize)
	allocs := testing.AllocsPerRun(100, func() {
		r.Reset(raw)
		br.Reset(r)
		_, _ = br.Peek(1)
		if parseResponseHead(br, req) == nil {
			t.Fatal("not taken")
		}
	})
	if allocs > 6 {
		t.Errorf("%v allocations per response, want at most 6", allocs)
	}
}

// peerClosed is a new peerProbe's verdict on c.
func peerClosed(c net.Conn) bool {
	var p peerProbe
	p.init(c)
	return p.closed()
}
