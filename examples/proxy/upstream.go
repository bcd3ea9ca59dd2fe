package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Values of the -upstream-client flag.
const (
	upstreamDirect  = "direct"   // upstreamTransport, falling back to net/http for what it does not do
	upstreamNetHTTP = "net/http" // http.Transport only
)

// serverOption sets what comes from flags rather than from the configuration.
type serverOption func(*server)

// withUpstreamClient selects the transport of the proxied requests: upstreamDirect (the default)
// or upstreamNetHTTP.
func withUpstreamClient(name string) serverOption {
	return func(s *server) { s.upstreamClient = name }
}

// Defaults of upstreamConfig, the limits of the proxy's http.Transport.
const (
	defaultUpstreamMaxIdlePerHost = 128
	defaultUpstreamIdleTimeout    = 90 * time.Second
)

// Buffer sizes of one upstream connection. The writer holds a request's headers and an
// in-memory body of up to 16 KiB (a prompt of a few thousand tokens), sent with one write; the
// reader is net/http's size: response headers are small, and reads of a body as large as the
// buffer bypass it.
const (
	upstreamReadBufferSize  = 4 << 10
	upstreamWriteBufferSize = 16 << 10
)

// errClosedBeforeResponse is the failure of an exchange whose upstream closed the connection
// without a byte of response.
var errClosedBeforeResponse = fmt.Errorf("upstream closed the connection before responding: %w", io.EOF)

// max1xxResponses bounds the informational responses skipped before the final one.
const max1xxResponses = 8

// upstreamConfig configures an upstreamTransport.
type upstreamConfig struct {
	// Dial dials "tcp" host:port; ctx bounds the dial. nil: a zero net.Dialer's DialContext.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// Fallback carries the requests upstreamTransport does not (https, upgrades, CONNECT). nil:
	// http.DefaultTransport.
	Fallback http.RoundTripper
	// MaxIdlePerHost bounds the idle keep-alive connections kept per host:port; 0 means
	// defaultUpstreamMaxIdlePerHost.
	MaxIdlePerHost int
	// IdleTimeout closes connections idle for longer; 0 means defaultUpstreamIdleTimeout.
	IdleTimeout time.Duration
}

// upstreamTransport is an http.RoundTripper for plain-http HTTP/1.1 upstreams that does each
// exchange in the caller's goroutine, safe for concurrent use. It writes the request and reads
// the response headers, and the response body reads the body, from the connection itself;
// http.Transport instead runs a read and a write goroutine per connection and hands every request
// and response between them and the caller: two goroutine wake-ups per request, which on a small
// VM cost more than the proxy's own work. Idle connections wait in a LIFO pool per host:port. Its
// only goroutine is a timer's, which closes connections idle past IdleTimeout;
// CloseIdleConnections closes the idle connections and stops it.
//
// Requests over https, with an Upgrade header or with method CONNECT go to the fallback.
type upstreamTransport struct {
	dial           func(ctx context.Context, network, addr string) (net.Conn, error)
	fallback       http.RoundTripper
	maxIdlePerHost int
	idleTimeout    time.Duration

	mu    sync.Mutex
	idle  map[string][]*upConn // per host:port, most recently used last
	timer *time.Timer          // prunes idle connections; armed while timerOn
	// timerOn is set while the timer is armed: it then fires within idleTimeout and re-arms
	// itself while connections are idle.
	timerOn bool
}

var _ http.RoundTripper = (*upstreamTransport)(nil)

// newUpstreamTransport returns an upstreamTransport for cfg.
func newUpstreamTransport(cfg upstreamConfig) *upstreamTransport {
	t := &upstreamTransport{
		dial:           cfg.Dial,
		fallback:       cfg.Fallback,
		maxIdlePerHost: cfg.MaxIdlePerHost,
		idleTimeout:    cfg.IdleTimeout,
		idle:           map[string][]*upConn{},
	}
	if t.dial == nil {
		t.dial = (&net.Dialer{}).DialContext
	}
	if t.fallback == nil {
		t.fallback = http.DefaultTransport
	}
	if t.maxIdlePerHost <= 0 {
		t.maxIdlePerHost = defaultUpstreamMaxIdlePerHost
	}
	if t.idleTimeout <= 0 {
		t.idleTimeout = defaultUpstreamIdleTimeout
	}
	return t
}

// upConn is one connection to an upstream. Only the exchange that holds it uses it, but for
// conn.Close and conn.SetDeadline, which a cancellation may call at any time.
type upConn struct {
	conn   net.Conn
	br     *bufio.Reader
	bw     *bufio.Writer
	key    string    // host:port
	idleAt time.Time // when it went back to the pool
	reused bool      // it carried an exchange before this one
}

// aLongTimeAgo is a deadline in the past: it fails blocked and later reads and writes at once.
var aLongTimeAgo = time.Unix(1, 0)

// abort fails the connection's blocked and later reads and writes (a cancelled exchange).
func (pc *upConn) abort() { _ = pc.conn.SetDeadline(aLongTimeAgo) }

// RoundTrip implements http.RoundTripper. It returns an error only when no response was read:
// the dial failed (the net.Dialer's error), the connection failed (the net error, or
// io.ErrUnexpectedEOF when the upstream closed it), the response was malformed, or the request's
// context ended — then the error is the context's cause, as http.Transport returns it. The
// context also bounds the reading of the body, whose Read then returns the cause. The response
// body must be closed; the connection is reused when the body was read to io.EOF.
func (t *upstreamTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	u := req.URL
	if u == nil || u.Scheme != "http" || req.Method == http.MethodConnect || hasUpgrade(req.Header) {
		return t.fallback.RoundTrip(req)
	}
	ctx := req.Context()
	if u.Host == "" {
		closeRequestBody(req)
		return nil, errors.New("upstream: request URL has no host")
	}
	if ctx.Err() != nil {
		closeRequestBody(req)
		return nil, context.Cause(ctx)
	}
	key := u.Host
	if u.Port() == "" {
		key = net.JoinHostPort(u.Hostname(), "80")
	}

	pc, err := t.getConn(ctx, key)
	if err != nil {
		closeRequestBody(req)
		return nil, err
	}
	resp, nothingRead, err := t.exchange(ctx, pc, req)
	if err == nil || !pc.reused || !nothingRead || !closedByPeer(err) || ctx.Err() != nil {
		return resp, err
	}
	// A connection from the pool failed before the first byte of the response: the upstream
	// closed it while it was idle, just before or as the request went out (its keep-alive
	// timeout — vLLM's uvicorn has 5 s — raced our reuse, or it restarted). It closed the
	// connection without answering, so it did not process the request: send it again, once, on
	// a new connection. http.Transport retries only requests it knows to be idempotent here;
	// the proxy already re-sends any request that failed before its answer (to another backend:
	// an LLM call has no side effect but its compute), so re-sending it to the same backend on a
	// fresh connection is no less safe. A fresh connection that fails is not retried: that is
	// the backend's failure, for the proxy's retry.
	if req.Body != nil && req.Body != http.NoBody {
		if req.GetBody == nil {
			return nil, err
		}
		body, gerr := req.GetBody()
		if gerr != nil {
			return nil, err
		}
		r2 := *req
		r2.Body = body
		req = &r2
	}
	if pc, err = t.dialConn(ctx, key); err != nil {
		closeRequestBody(req)
		return nil, err
	}
	resp, _, err = t.exchange(ctx, pc, req)
	return resp, err
}

// hasUpgrade reports whether h asks for a protocol upgrade.
func hasUpgrade(h http.Header) bool {
	_, ok := h["Upgrade"]
	return ok
}

// closeRequestBody closes req's body, as a RoundTripper must even when it fails.
func closeRequestBody(req *http.Request) {
	if req.Body != nil {
		_ = req.Body.Close()
	}
}

// closedByPeer reports whether err is the failure of a connection that the peer closed or reset.
func closedByPeer(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// exchange sends req on pc and reads the response headers. On success the response body owns
// pc. On failure pc is closed and nothingRead reports whether the failure came before the first
// byte of the response.
func (t *upstreamTransport) exchange(ctx context.Context, pc *upConn, req *http.Request) (resp *http.Response, nothingRead bool, err error) {
	stop := context.AfterFunc(ctx, pc.abort)
	fail := func(err error, nothingRead bool) (*http.Response, bool, error) {
		stop()
		_ = pc.conn.Close()
		if ctx.Err() != nil {
			err = context.Cause(ctx)
		}
		return nil, nothingRead, err
	}
	// One write: the headers and the in-memory body go through the buffer, flushed once.
	if err := req.Write(pc.bw); err != nil {
		return fail(err, true)
	}
	if err := pc.bw.Flush(); err != nil {
		return fail(err, true)
	}
	if _, err := pc.br.Peek(1); err != nil {
		if err == io.EOF {
			err = errClosedBeforeResponse
		}
		return fail(err, true)
	}
	for n1xx := 0; ; n1xx++ {
		resp, err = http.ReadResponse(pc.br, req)
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return fail(err, false)
		}
		if resp.StatusCode >= 200 {
			break
		}
		if resp.StatusCode == http.StatusSwitchingProtocols || n1xx == max1xxResponses {
			return fail(fmt.Errorf("upstream: unexpected %s", resp.Status), false)
		}
		// Informational: ReverseProxy relays them to its client through this hook.
		if trace := httptrace.ContextClientTrace(ctx); trace != nil && trace.Got1xxResponse != nil {
			if err := trace.Got1xxResponse(resp.StatusCode, textproto.MIMEHeader(resp.Header)); err != nil {
				return fail(err, false)
			}
		}
	}
	reuse := !resp.Close && !req.Close
	if resp.Body == http.NoBody {
		t.release(pc, stop, reuse)
		return resp, false, nil
	}
	resp.Body = &upBody{t: t, pc: pc, rc: resp.Body, ctx: ctx, stop: stop, reuse: reuse}
	return resp, false, nil
}

// release ends an exchange on pc: pc goes back to the pool when reuse is set and the context's
// AfterFunc has not fired (stop stops it); it is closed otherwise.
func (t *upstreamTransport) release(pc *upConn, stop func() bool, reuse bool) {
	if !stop() || !reuse {
		_ = pc.conn.Close()
		return
	}
	t.put(pc)
}

// States of upBody.state.
const (
	bodyOpen int32 = iota
	bodyEOF
	bodyFailed
	bodyClosed
)

// errBodyClosed is the error of a Read after Close.
var errBodyClosed = errors.New("upstream: read on closed response body")

// upBody is a response body read from its connection. Read is not safe for concurrent use; Close
// is, also concurrently with a Read (which it then fails).
type upBody struct {
	t     *upstreamTransport
	pc    *upConn
	rc    io.ReadCloser // the body as http.ReadResponse framed it
	ctx   context.Context
	stop  func() bool // stops the context's AfterFunc
	reuse bool        // the connection may carry another exchange after this body
	state atomic.Int32
	err   error // after bodyFailed: Read's error
}

// Read implements io.Reader. At io.EOF the connection goes back to the pool; any other error
// closes it, and is the context's cause when the context ended.
func (b *upBody) Read(p []byte) (int, error) {
	switch b.state.Load() {
	case bodyEOF:
		return 0, io.EOF
	case bodyFailed:
		return 0, b.err
	case bodyClosed:
		return 0, errBodyClosed
	}
	n, err := b.rc.Read(p)
	switch {
	case err == nil:
		return n, nil
	case err == io.EOF:
		if b.state.CompareAndSwap(bodyOpen, bodyEOF) {
			b.t.release(b.pc, b.stop, b.reuse)
		}
		return n, io.EOF
	}
	if b.ctx.Err() != nil {
		err = context.Cause(b.ctx)
	}
	b.err = err
	if b.state.CompareAndSwap(bodyOpen, bodyFailed) {
		b.stop()
		_ = b.pc.conn.Close()
	}
	return n, err
}

// Close implements io.Closer. Before io.EOF it closes the connection rather than read the rest,
// which may not end. It is idempotent.
func (b *upBody) Close() error {
	if b.state.CompareAndSwap(bodyOpen, bodyClosed) {
		b.stop()
		_ = b.pc.conn.Close()
	}
	return nil
}

// getConn returns an idle connection to key that its peer has not closed, or dials one.
func (t *upstreamTransport) getConn(ctx context.Context, key string) (*upConn, error) {
	for {
		pc := t.popIdle(key)
		if pc == nil {
			return t.dialConn(ctx, key)
		}
		if !peerClosed(pc.conn) {
			return pc, nil
		}
		_ = pc.conn.Close()
	}
}

// dialConn dials a new connection to key.
func (t *upstreamTransport) dialConn(ctx context.Context, key string) (*upConn, error) {
	c, err := t.dial(ctx, "tcp", key)
	if err != nil {
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		return nil, err
	}
	return &upConn{
		conn: c,
		br:   bufio.NewReaderSize(c, upstreamReadBufferSize),
		bw:   bufio.NewWriterSize(c, upstreamWriteBufferSize),
		key:  key,
	}, nil
}

// popIdle takes the most recently used idle connection to key, nil when there is none that has
// been idle for less than idleTimeout.
func (t *upstreamTransport) popIdle(key string) *upConn {
	now := time.Now()
	t.mu.Lock()
	s := t.idle[key]
	if len(s) == 0 {
		t.mu.Unlock()
		return nil
	}
	pc := s[len(s)-1]
	s[len(s)-1] = nil
	s = s[:len(s)-1]
	if now.Sub(pc.idleAt) < t.idleTimeout {
		t.idle[key] = s
		t.mu.Unlock()
		return pc
	}
	// The most recent one expired: so did all the others.
	t.idle[key] = s[:0]
	t.mu.Unlock()
	_ = pc.conn.Close()
	for i, old := range s {
		_ = old.conn.Close()
		s[i] = nil
	}
	return nil
}

// put returns pc to its host's pool, or closes it when the pool is full.
func (t *upstreamTransport) put(pc *upConn) {
	pc.idleAt = time.Now()
	pc.reused = true
	t.mu.Lock()
	s := t.idle[pc.key]
	if len(s) >= t.maxIdlePerHost {
		t.mu.Unlock()
		_ = pc.conn.Close()
		return
	}
	t.idle[pc.key] = append(s, pc)
	if !t.timerOn {
		t.timerOn = true
		if t.timer == nil {
			t.timer = time.AfterFunc(t.idleTimeout, t.prune)
		} else {
			t.timer.Reset(t.idleTimeout)
		}
	}
	t.mu.Unlock()
}

// prune closes the connections idle for idleTimeout or longer, and re-arms the timer for the
// oldest of the others. It runs on the timer's goroutine.
func (t *upstreamTransport) prune() {
	now := time.Now()
	var expired []*upConn
	var oldest time.Time
	t.mu.Lock()
	for key, s := range t.idle {
		n := 0
		for n < len(s) && now.Sub(s[n].idleAt) >= t.idleTimeout {
			n++
		}
		if n > 0 {
			expired = append(expired, s[:n]...)
			t.idle[key] = append(s[:0], s[n:]...)
			clear(s[len(s)-n:])
			s = t.idle[key]
		}
		if len(s) > 0 && (oldest.IsZero() || s[0].idleAt.Before(oldest)) {
			oldest = s[0].idleAt
		}
	}
	t.timerOn = !oldest.IsZero()
	if t.timerOn {
		t.timer.Reset(oldest.Add(t.idleTimeout).Sub(now))
	}
	t.mu.Unlock()
	for _, pc := range expired {
		_ = pc.conn.Close()
	}
}

// CloseIdleConnections closes the idle connections. Connections in use go on, and back to the
// pool when their exchange ends.
func (t *upstreamTransport) CloseIdleConnections() {
	t.mu.Lock()
	idle := t.idle
	t.idle = map[string][]*upConn{}
	if t.timer != nil {
		t.timer.Stop()
	}
	t.timerOn = false
	t.mu.Unlock()
	for _, s := range idle {
		for _, pc := range s {
			_ = pc.conn.Close()
		}
	}
}
