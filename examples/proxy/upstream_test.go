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
