package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/textproto"
	"net/url"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http/httpguts"
)

// Values of the -server flag.
const (
	serverLoop    = "loop"     // httpServer: the proxy's own HTTP/1.1 loop, net/http for the rest
	serverNetHTTP = "net/http" // http.Server only
)

// withHTTPServer selects what serves the proxy's connections: serverLoop (the default) or
// serverNetHTTP.
func withHTTPServer(name string) serverOption {
	return func(s *server) { s.httpServerKind = name }
}

// Sizes and delays of httpServer.
const (
	// serverReadBufferSize bounds a request head the loop serves itself: SDK requests carry well
	// under 1 KiB of headers; longer heads go to net/http, whose limit is 1 MiB.
	serverReadBufferSize = 4 << 10
	// serverWriteBufferSize is the response writer's buffer: a routed JSON answer's head and body
	// leave in one write.
	serverWriteBufferSize = 8 << 10
	// pendingBodyLimit is how much of a body without Content-Length is held back so that a short
	// answer goes out with a Content-Length rather than chunked.
	pendingBodyLimit = 4 << 10
	// maxBodyDiscard is how much of a request body the handler left unread is read and dropped to
	// keep the connection; beyond it the connection is closed.
	maxBodyDiscard = 256 << 10
	// disconnectWatchDelay is how long a request runs before its connection is watched for the
	// client going away (as net/http does from the start): most routed answers come sooner, and
	// the watch costs a goroutine and a read per request.
	disconnectWatchDelay = 10 * time.Millisecond
)

// errHandoff marks a request the loop does not serve itself: its connection goes to net/http.
var errHandoff = errors.New("handed to net/http")

// errClientClosed is the cause of a request's cancellation when its client closed the connection.
var errClientClosed = fmt.Errorf("client closed the connection: %w", context.Canceled)

// httpServer serves HTTP/1.1 connections for an http.Handler in one goroutine per connection:
// each request is parsed, handled and answered in that goroutine, and the connection is watched
// for a client that goes away only when a request runs longer than disconnectWatchDelay.
// http.Server instead watches every request from a second goroutine from the start and parses
// headers more generally; on a small VM those wake-ups and copies cost more than the proxy's own
// work (BENCHMARKS.md, "Reference proxy overhead").
//
// The loop serves the common shape of API traffic: HTTP/1.1, origin-form targets, bodies of known
// length, heads within serverReadBufferSize. A connection whose request is anything else (HTTP/1.0,
// chunked or 100-continue bodies, upgrades, HEAD, malformed heads) is handed, with the bytes
// already read, to a net/http server for the rest of its life, so that every request gets
// net/http's answer. Responses are written as net/http writes them: Content-Length for short
// bodies, chunked otherwise, Date, sniffed Content-Type, trailers, Flush.
//
// Serve, Shutdown and Close are safe for concurrent use. Shutdown drains like http.Server's.
type httpServer struct {
	handler           http.Handler
	readHeaderTimeout time.Duration
	idleTimeout       time.Duration
	log               *slog.Logger

	fallback     *http.Server
	handoff      *handoffListener
	fallbackOnce sync.Once

	date atomic.Pointer[dateStamp]

	mu        sync.Mutex
	listeners map[net.Listener]struct{}
	conns     map[*serverConn]struct{}
	closing   atomic.Bool
}

// httpServerConfig configures an httpServer.
type httpServerConfig struct {
	Handler           http.Handler
	ReadHeaderTimeout time.Duration // 0: no limit
	IdleTimeout       time.Duration // 0: no limit
	Log               *slog.Logger
}

// newHTTPServer returns an httpServer for cfg, with its net/http fallback configured alike.
func newHTTPServer(cfg httpServerConfig) *httpServer {
	log := cfg.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &httpServer{
		handler:           cfg.Handler,
		readHeaderTimeout: cfg.ReadHeaderTimeout,
		idleTimeout:       cfg.IdleTimeout,
		log:               log,
		listeners:         map[net.Listener]struct{}{},
		conns:             map[*serverConn]struct{}{},
	}
	s.fallback = &http.Server{
		Handler:           cfg.Handler,
		ReadHeaderTimeout: cfg.ReadHeaderTimeout,
		IdleTimeout:       cfg.IdleTimeout,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	s.handoff = newHandoffListener()
	return s
}

// Serve accepts connections on ln and serves them until Shutdown or Close, then returns
// http.ErrServerClosed; an accept error that is not temporary ends it with that error. ln is
// closed when Serve returns.
func (s *httpServer) Serve(ln net.Listener) error {
	s.mu.Lock()
	if s.closing.Load() {
		s.mu.Unlock()
		ln.Close()
		return http.ErrServerClosed
	}
	s.listeners[ln] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, ln)
		s.mu.Unlock()
		ln.Close()
	}()
	s.fallbackOnce.Do(func() {
		s.handoff.addr = ln.Addr()
		// It returns when Shutdown or Close closes the handoff listener.
		go func() { _ = s.fallback.Serve(s.handoff) }()
	})

	var backoff time.Duration
	for {
		c, err := ln.Accept()
		if err != nil {
			if s.closing.Load() {
				return http.ErrServerClosed
			}
			if te, ok := err.(interface{ Temporary() bool }); ok && te.Temporary() {
				// Out of file descriptors, say: wait for connections to close.
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				s.log.Warn("accept failed; retrying", "err", err, "in", backoff.String())
				time.Sleep(backoff)
				continue
			}
			return err
		}
		backoff = 0
		sc := s.newConn(c)
		s.mu.Lock()
		if s.closing.Load() {
			s.mu.Unlock()
			c.Close()
			return http.ErrServerClosed
		}
		s.conns[sc] = struct{}{}
		s.mu.Unlock()
		go sc.serve()
	}
}

// Shutdown stops accepting, closes idle connections and waits for the others to finish their
// request (theirs and the net/http fallback's) or for ctx to end, whose error it then returns
// with the connections left open (Close closes them).
func (s *httpServer) Shutdown(ctx context.Context) error {
	s.closeListeners()
	fb := make(chan error, 1)
	go func() { fb <- s.fallback.Shutdown(ctx) }()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		if s.closeIdle() {
			break
		}
		select {
		case <-ctx.Done():
			<-fb
			return ctx.Err()
		case <-tick.C:
		}
	}
	return <-fb
}

// Close closes the listeners and every connection at once.
func (s *httpServer) Close() error {
	s.closeListeners()
	s.mu.Lock()
	for c := range s.conns {
		c.c.Close()
	}
	s.mu.Unlock()
	return s.fallback.Close()
}

func (s *httpServer) closeListeners() {
	s.mu.Lock()
	s.closing.Store(true)
	for ln := range s.listeners {
		ln.Close()
	}
	s.mu.Unlock()
	s.handoff.Close()
}

// closeIdle closes the connections waiting for a request and reports whether none is left.
func (s *httpServer) closeIdle() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for c := range s.conns {
		if c.state.CompareAndSwap(connIdle, connClosed) {
			c.c.Close()
		}
	}
	return len(s.conns) == 0
}

// dateStamp is a Date header value, made once a second.
type dateStamp struct {
	unix int64
	line []byte // "Date: ...\r\n"
}

// dateLine returns the Date header line for now.
func (s *httpServer) dateLine(now time.Time) []byte {
	sec := now.Unix()
	if d := s.date.Load(); d != nil && d.unix == sec {
		return d.line
	}
	line := append([]byte("Date: "), now.UTC().AppendFormat(nil, http.TimeFormat)...)
	line = append(line, "\r\n"...)
	s.date.Store(&dateStamp{unix: sec, line: line})
	return line
}

// handoffListener is the net/http fallback's listener: the connections the loop hands over.
type handoffListener struct {
	ch   chan net.Conn
	done chan struct{}
	once sync.Once
	addr net.Addr
}

func newHandoffListener() *handoffListener {
	return &handoffListener{ch: make(chan net.Conn), done: make(chan struct{})}
}

// Accept implements net.Listener.
func (l *handoffListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ch:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// Close implements net.Listener.
func (l *handoffListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

// Addr implements net.Listener.
func (l *handoffListener) Addr() net.Addr {
	if l.addr == nil {
		return &net.TCPAddr{}
	}
	return l.addr
}

// give hands c to net/http, or closes it when the fallback is closed.
func (l *handoffListener) give(c net.Conn) {
	select {
	case l.ch <- c:
	case <-l.done:
		c.Close()
	}
}

// handedConn is a connection handed to net/http with the bytes the loop already read.
type handedConn struct {
	net.Conn
	r *bufio.Reader
}

// Read implements net.Conn: the loop's buffer first.
func (c *handedConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// States of serverConn.state.
const (
	connIdle int32 = iota
	connActive
	connClosed
)

// serverConn is one client connection of an httpServer.
type serverConn struct {
	srv    *httpServer
	c      net.Conn
	remote string // c's remote address, the requests' RemoteAddr
	cr     connReader
	br     *bufio.Reader
	bw     *bufio.Writer
	ctx    context.Context
	state  atomic.Int32
	// pending holds a response body of unknown length until it outgrows pendingBodyLimit.
	pending []byte
	// handedOff is set when the connection goes to net/http as serve returns.
	handedOff bool
	// linger is set when the connection closes with request bytes unread: see lingerClose.
	linger bool

	// The disconnect watch of the running request: watchTimer starts it disconnectWatchDelay
	// after the request body was read; watching is set while its goroutine reads c.
	watchMu    sync.Mutex
	watchTimer *time.Timer
	watchArmed bool
	watching   bool
	watchDone  chan struct{}
	cancelReq  context.CancelCauseFunc
	clientGone atomic.Bool
}

// connReader reads a connection, after the byte a disconnect watch read, if any.
type connReader struct {
	c          net.Conn
	pending    byte
	hasPending bool
}

// Read implements io.Reader.
func (r *connReader) Read(p []byte) (int, error) {
	if r.hasPending && len(p) > 0 {
		p[0] = r.pending
		r.hasPending = false
		return 1, nil
	}
	return r.c.Read(p)
}

func (s *httpServer) newConn(c net.Conn) *serverConn {
	sc := &serverConn{srv: s, c: c, remote: c.RemoteAddr().String()}
	sc.cr.c = c
	sc.br = bufio.NewReaderSize(&sc.cr, serverReadBufferSize)
	sc.bw = bufio.NewWriterSize(c, serverWriteBufferSize)
	sc.ctx = context.WithValue(context.WithValue(context.Background(),
		http.ServerContextKey, s.fallback), http.LocalAddrContextKey, c.LocalAddr())
	sc.watchTimer = time.AfterFunc(time.Hour, sc.watch)
	sc.watchTimer.Stop()
	return sc
}

// serve runs the connection's requests until it closes, fails or is handed off.
func (c *serverConn) serve() {
	defer func() {
		c.watchTimer.Stop()
		c.srv.mu.Lock()
		delete(c.srv.conns, c)
		c.srv.mu.Unlock()
		if c.handedOff {
			c.srv.handoff.give(&handedConn{Conn: c.c, r: c.br})
			return
		}
		if c.linger {
			c.lingerClose()
		}
		c.c.Close()
	}()
	first, afterPOST := true, false
	for {
		if c.br.Buffered() == 0 {
			// As net/http: the first request's wait is bounded by ReadHeaderTimeout, later
			// ones by IdleTimeout.
			wait := c.srv.idleTimeout
			if first && c.srv.readHeaderTimeout > 0 {
				wait = c.srv.readHeaderTimeout
			}
			if wait > 0 {
				_ = c.c.SetReadDeadline(time.Now().Add(wait))
			}
			if _, err := c.br.Peek(1); err != nil {
				return
			}
		}
		if afterPOST {
			// RFC 9112, section 2.2: old clients send a CRLF after a POST body (net/http
			// drops up to 4 such bytes).
			peek, _ := c.br.Peek(min(4, c.br.Buffered()))
			n := 0
			for n < len(peek) && (peek[n] == '\r' || peek[n] == '\n') {
				n++
			}
			if n > 0 {
				_, _ = c.br.Discard(n)
				afterPOST = false
				continue
			}
		}
		first = false
		if !c.state.CompareAndSwap(connIdle, connActive) {
			return // closed by Shutdown
		}
		head, err := c.readHead()
		if err != nil {
			c.handedOff = errors.Is(err, errHandoff)
			return
		}
		rh, err := parseRequestHead(head)
		if err != nil {
			// net/http answers it (400, 431, 505, …) or serves what the loop does not.
			c.handedOff = true
			return
		}
		_ = c.c.SetReadDeadline(time.Time{})
		_, _ = c.br.Discard(len(head))
		afterPOST = rh.method == http.MethodPost
		if !c.serveRequest(rh) {
			return
		}
		if !c.state.CompareAndSwap(connActive, connIdle) || c.srv.closing.Load() {
			return
		}
	}
}

// rstAvoidanceDelay bounds lingerClose, as net/http's of the same name.
const rstAvoidanceDelay = 500 * time.Millisecond

// lingerClose half-closes the connection and reads what the client still sends until it
// closes or rstAvoidanceDelay passes: closing with unread input makes the kernel send a reset,
// which can destroy the response before the client has read it (net/http's closeWriteAndWait).
func (c *serverConn) lingerClose() {
	if cw, ok := c.c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	_ = c.c.SetReadDeadline(time.Now().Add(rstAvoidanceDelay))
	_, _ = io.Copy(io.Discard, c.c)
}

// readHead waits for a whole request head in the read buffer and returns it (not consumed).
// It returns errHandoff for a head that does not fit or ends its lines with bare LF.
func (c *serverConn) readHead() ([]byte, error) {
	deadline := false
	for {
		buf, _ := c.br.Peek(c.br.Buffered())
		if n, ok := headEnd(buf); ok {
			if n < 0 {
				return nil, errHandoff
			}
			return buf[:n], nil
		}
		if len(buf) >= c.br.Size() {
			return nil, errHandoff
		}
		if !deadline && c.srv.readHeaderTimeout > 0 {
			_ = c.c.SetReadDeadline(time.Now().Add(c.srv.readHeaderTimeout))
			deadline = true
		}
		if _, err := c.br.Peek(len(buf) + 1); err != nil {
			return nil, err
		}
	}
}

// headEnd finds the end of a request head in b: its length including the blank line and true;
// -1 and true for a head with a bare-LF line ending (net/http's to judge); false when b holds no
// whole head yet.
func headEnd(b []byte) (int, bool) {
	for i := 0; i < len(b); i++ {
		if b[i] != '\n' {
			continue
		}
		if i == 0 || b[i-1] != '\r' {
			return -1, true
		}
		if i+1 < len(b) && b[i+1] == '\n' {
			return -1, true
		}
		if i+2 < len(b) && b[i+1] == '\r' && b[i+2] == '\n' {
			return i + 3, true
		}
	}
	return 0, false
}

// requestHead is a request line and header block the loop serves.
type requestHead struct {
	method, target, host string
	header               http.Header
	contentLength        int64 // 0 when absent
	close                bool  // Connection: close
}

// parseRequestHead parses head, a request line and its headers up to and including the blank
// line, all lines ending in CRLF. It returns errHandoff, possibly wrapped, for anything the loop
// does not serve: another method than GET, POST, PUT, PATCH, DELETE or OPTIONS; a target not in
// origin form; another protocol than HTTP/1.1; Transfer-Encoding, Expect, Upgrade or Trailer;
// no Host or several; a malformed or repeated Content-Length; an invalid header name or value;
// obsolete line folding.
func parseRequestHead(head []byte) (requestHead, error) {
	var rh requestHead
	s := string(head) // one allocation: every string below is a part of it
	line, rest, ok := strings.Cut(s, "\r\n")
	if !ok {
		return rh, errHandoff
	}
	m, after, ok := strings.Cut(line, " ")
	if !ok {
		return rh, errHandoff
	}
	switch m {
	case http.MethodGet, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete, http.MethodOptions:
		rh.method = m
	default:
		return rh, errHandoff
	}
	target, proto, ok := strings.Cut(after, " ")
	if !ok || proto != "HTTP/1.1" || len(target) == 0 || target[0] != '/' || !validTarget(target) {
		return rh, errHandoff
	}
	rh.target = target

	lines := strings.Count(rest, "\r\n") - 1 // the blank line ends rest
	if lines < 0 {
		return rh, errHandoff
	}
	rh.header = make(http.Header, lines)
	strs := make([]string, lines) // one backing array for the single values
	hosts, lengths := 0, 0
	for i := 0; i < lines; i++ {
		line, rest, _ = strings.Cut(rest, "\r\n")
		if line == "" || line[0] == ' ' || line[0] == '\t' {
			return rh, errHandoff // obsolete folding
		}
		name, value, ok := strings.Cut(line, ":")
		if !ok || !validFieldName(name) {
			return rh, errHandoff
		}
		value = strings.Trim(value, " \t")
		if !httpguts.ValidHeaderFieldValue(value) {
			return rh, errHandoff
		}
		key := name
		if !isCanonicalKey(name) {
			key = textproto.CanonicalMIMEHeaderKey(name) // interns the common names
		}
		switch key {
		case "Host":
			if !httpguts.ValidHostHeader(value) {
				return rh, errHandoff // net/http answers 400
			}
			hosts++
			rh.host = value
			continue // net/http moves it to Request.Host
		case "Content-Length":
			lengths++
			n, err := strconv.ParseUint(value, 10, 63) // digits only, as net/http
			if err != nil {
				return rh, errHandoff
			}
			rh.contentLength = int64(n)
		case "Transfer-Encoding", "Expect", "Upgrade", "Trailer":
			return rh, errHandoff
		case "Connection":
			for tok := range strings.SplitSeq(value, ",") {
				tok = strings.Trim(tok, " \t")
				if strings.EqualFold(tok, "close") {
					rh.close = true
				} else if strings.EqualFold(tok, "upgrade") {
					return rh, errHandoff
				}
			}
		}
		if vs, ok := rh.header[key]; ok {
			rh.header[key] = append(vs, value)
			continue
		}
		strs[i] = value
		rh.header[key] = strs[i : i+1 : i+1]
	}
	if hosts != 1 || lengths > 1 {
		return rh, errHandoff
	}
	return rh, nil
}

// validTarget reports whether an origin-form target holds only visible ASCII.
func validTarget(t string) bool {
	for i := 0; i < len(t); i++ {
		if t[i] <= ' ' || t[i] >= 0x7f {
			return false
		}
	}
	return true
}

// isCanonicalKey reports whether a valid header name is in textproto's canonical form already:
// upper case at the start and after each hyphen, lower case elsewhere.
func isCanonicalKey(s string) bool {
	upper := true
	for i := 0; i < len(s); i++ {
		b := s[i]
		if upper && 'a' <= b && b <= 'z' || !upper && 'A' <= b && b <= 'Z' {
			return false
		}
		upper = b == '-'
	}
	return true
}

// serveRequest runs the handler for one request and finishes its response. It reports whether
// the connection may carry another request.
func (c *serverConn) serveRequest(rh requestHead) (keep bool) {
	u, err := url.ParseRequestURI(rh.target)
	if err != nil {
		// Cannot happen for a valid origin-form target; answer like net/http would.
		_, _ = io.WriteString(c.c, "HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n400 Bad Request")
		return false
	}
	ctx, cancel := context.WithCancelCause(c.ctx)
	defer cancel(context.Canceled)
	req := (&http.Request{
		Method:        rh.method,
		URL:           u,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        rh.header,
		ContentLength: rh.contentLength,
		Close:         rh.close,
		Host:          rh.host,
		RemoteAddr:    c.remote,
		RequestURI:    rh.target,
	}).WithContext(ctx)
	body := &requestBody{c: c, remaining: rh.contentLength}
	if rh.contentLength > 0 {
		req.Body = body
	} else {
		req.Body = http.NoBody
	}
	w := &response{c: c, req: req, body: body, header: make(http.Header, 8), closeAfter: rh.close}

	c.watchMu.Lock()
	c.cancelReq = cancel
	c.watchMu.Unlock()
	if rh.contentLength == 0 {
		c.armWatch()
	}
	aborted := c.runHandler(w, req)
	c.stopWatch()
	if aborted {
		// The handler gave up mid-response: what was written goes out, cut short, and the
		// connection closes, as with net/http.
		c.pending = c.pending[:0]
		if w.committed && w.writeErr == nil {
			_ = c.bw.Flush()
		}
		return false
	}
	// A client that only half-closed still reads the answer, as from net/http.
	keep = w.finish() && !c.clientGone.Load()
	if !keep && body.remaining > 0 && body.err == nil {
		c.linger = true
	}
	return keep
}

// runHandler calls the handler, reporting whether it panicked (http.ErrAbortHandler included).
func (c *serverConn) runHandler(w *response, req *http.Request) (aborted bool) {
	defer func() {
		if v := recover(); v != nil {
			aborted = true
			if v != http.ErrAbortHandler {
				c.srv.log.Error("http: panic serving request", "remote", req.RemoteAddr, "panic", v,
					"stack", string(debug.Stack()))
			}
		}
	}()
	c.srv.handler.ServeHTTP(w, req)
	return false
}

// armWatch schedules the disconnect watch of the running request, once its body is read and
// nothing more is buffered (a pipelined request would be read by the watch instead).
func (c *serverConn) armWatch() {
	if c.br.Buffered() > 0 {
		return
	}
	c.watchMu.Lock()
	c.watchArmed = true
	c.watchMu.Unlock()
	c.watchTimer.Reset(disconnectWatchDelay)
}

// watch reads the connection while the request runs: end of stream or an error means the client
// left, and the request's context is cancelled; a byte means a pipelined request, kept for the
// loop.
func (c *serverConn) watch() {
	c.watchMu.Lock()
	if !c.watchArmed || c.watching {
		c.watchMu.Unlock()
		return
	}
	c.watching = true
	done := make(chan struct{})
	c.watchDone = done
	cancel := c.cancelReq
	c.watchMu.Unlock()
	defer close(done)

	var b [1]byte
	n, err := c.c.Read(b[:])
	if n == 1 {
		c.cr.pending, c.cr.hasPending = b[0], true
		return
	}
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		return // stopWatch ended the read
	}
	c.clientGone.Store(true)
	cancel(errClientClosed)
}

// stopWatch ends the disconnect watch of the request that finished, waiting for its read.
func (c *serverConn) stopWatch() {
	c.watchMu.Lock()
	c.watchArmed = false
	watching, done := c.watching, c.watchDone
	c.watching, c.watchDone, c.cancelReq = false, nil, nil
	c.watchMu.Unlock()
	c.watchTimer.Stop()
	if watching {
		_ = c.c.SetReadDeadline(aLongTimeAgo)
		<-done
		_ = c.c.SetReadDeadline(time.Time{})
	}
}

// requestBody is the body of a request with a Content-Length, read from the connection.
type requestBody struct {
	c         *serverConn
	remaining int64
	closed    bool
	err       error
}

// Read implements io.Reader.
func (b *requestBody) Read(p []byte) (int, error) {
	if b.closed {
		return 0, http.ErrBodyReadAfterClose
	}
	if b.err != nil {
		return 0, b.err
	}
	if b.remaining == 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > b.remaining {
		p = p[:b.remaining]
	}
	n, err := b.c.br.Read(p)
	b.remaining -= int64(n)
	if b.remaining == 0 {
		b.c.armWatch()
		return n, io.EOF
	}
	if err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	if err != nil {
		b.err = err
		b.c.clientGone.Store(true)
	}
	return n, err
}

// Close implements io.Closer: later reads fail; the rest of the body is dropped after the
// handler, or the connection closed.
func (b *requestBody) Close() error {
	b.closed = true
	return nil
}

// response is the http.ResponseWriter of one request on the loop. Its head is written when the
// first byte of a body of known length is, on Flush, when a body of unknown length outgrows
// pendingBodyLimit, or when the handler returns.
type response struct {
	c      *serverConn
	req    *http.Request
	body   *requestBody
	header http.Header
	sent   http.Header // header as of WriteHeader: the head's fields

	status      int   // 0 until WriteHeader(≥ 200) or the first Write
	committed   bool  // the head is in the write buffer
	chunked     bool  // the body is sent chunked
	declared    int64 // the Content-Length sent; -1: none
	written     int64 // body bytes accepted
	noBody      bool  // the status allows no body
	closeAfter  bool  // Connection: close
	trailerKeys []string
	writeErr    error
}

var (
	_ http.ResponseWriter = (*response)(nil)
	_ http.Flusher        = (*response)(nil)
)

// Header implements http.ResponseWriter.
func (w *response) Header() http.Header { return w.header }

// WriteHeader implements http.ResponseWriter. Informational statuses (1xx) are sent at once with
// the headers set so far; the first status of 200 or more is the response's.
func (w *response) WriteHeader(code int) {
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code))
	}
	if w.status != 0 {
		return
	}
	if code < 200 {
		if code == http.StatusSwitchingProtocols {
			return // upgrades go to net/http; nothing to switch to here
		}
		bw := w.c.bw
		writeStatusLine(bw, code)
		w.writeFields(bw, w.header)
		_, _ = bw.WriteString("\r\n")
		if err := bw.Flush(); err != nil && w.writeErr == nil {
			w.writeErr = err
		}
		return
	}
	w.status = code
	w.noBody = code == http.StatusNoContent || code == http.StatusNotModified
	// As net/http: later changes to the header map are not sent, but trailers.
	w.sent = w.header.Clone()
}

// Write implements http.ResponseWriter.
func (w *response) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	if w.noBody {
		return 0, http.ErrBodyNotAllowed
	}
	if w.writeErr != nil {
		return 0, w.writeErr
	}
	if !w.committed {
		if w.sent.Get("Content-Length") == "" && len(w.c.pending)+len(p) <= pendingBodyLimit {
			w.c.pending = append(w.c.pending, p...)
			w.written += int64(len(p))
			return len(p), nil
		}
		w.commit(false, p)
		if w.writeErr != nil {
			return 0, w.writeErr
		}
	}
	if w.declared >= 0 && w.written+int64(len(p)) > w.declared {
		return 0, http.ErrContentLength
	}
	w.written += int64(len(p))
	return w.writeBody(p)
}

// writeBody writes p as it goes on the wire: a chunk, or as is.
func (w *response) writeBody(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	bw := w.c.bw
	if w.chunked {
		var nb [24]byte
		_, _ = bw.Write(append(strconv.AppendInt(nb[:0], int64(len(p)), 16), '\r', '\n'))
	}
	n, err := bw.Write(p)
	if w.chunked && err == nil {
		_, err = bw.WriteString("\r\n")
	}
	if err != nil {
		w.failed(err)
		return n, err
	}
	return n, nil
}

// failed records a write error: the client is gone; the request's context ends.
func (w *response) failed(err error) {
	if w.writeErr != nil {
		return
	}
	w.writeErr = err
	w.c.clientGone.Store(true)
	w.c.watchMu.Lock()
	cancel := w.c.cancelReq
	w.c.watchMu.Unlock()
	if cancel != nil {
		cancel(errClientClosed)
	}
}

// Flush implements http.Flusher.
func (w *response) Flush() { _ = w.FlushError() }

// FlushError sends the head and everything written so far (http.ResponseController).
func (w *response) FlushError() error {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	if !w.committed {
		w.commit(false, nil)
	}
	if w.writeErr != nil {
		return w.writeErr
	}
	if err := w.c.bw.Flush(); err != nil {
		w.failed(err)
		return err
	}
	return nil
}

// commit writes the head, and the body held back, into the write buffer. final says the handler
// has returned: a body held back is then the whole body, sent with its length. first is the
// write that commits, for sniffing when nothing was held back.
func (w *response) commit(final bool, first []byte) {
	w.committed = true
	h := w.sent
	w.declared = -1
	if cl := h.Get("Content-Length"); cl != "" {
		if n, err := strconv.ParseInt(cl, 10, 64); err == nil && n >= 0 {
			w.declared = n
		} else {
			h.Del("Content-Length")
		}
	}
	if w.noBody {
		// net/http's suppressedHeaders.
		h.Del("Transfer-Encoding")
		h.Del("Content-Length")
		if w.status == http.StatusNotModified {
			h.Del("Content-Type")
		}
	} else {
		te := h.Get("Transfer-Encoding")
		h.Del("Transfer-Encoding")
		_, haveType := h["Content-Type"] // set to nil: not sniffed
		if !haveType && te == "" && h.Get("Content-Encoding") == "" {
			sniff := w.c.pending
			if len(sniff) == 0 {
				sniff = first
			}
			if len(sniff) > 0 {
				h.Set("Content-Type", http.DetectContentType(sniff))
			}
		}
		trailers := len(h["Trailer"]) > 0
		for k := range h {
			trailers = trailers || strings.HasPrefix(k, http.TrailerPrefix)
		}
		switch {
		case te == "identity" && w.declared < 0:
			w.closeAfter = true // the body ends with the connection, as with net/http
		case te != "" && te != "identity", w.declared < 0 && (!final || trailers):
			w.declared = -1
			h.Del("Content-Length")
			w.chunked = true
		case w.declared < 0:
			w.declared = int64(len(w.c.pending))
			h.Set("Content-Length", strconv.FormatInt(w.declared, 10))
		}
		if tr := h["Trailer"]; len(tr) > 0 && w.chunked {
			for _, v := range tr {
				for k := range strings.SplitSeq(v, ",") {
					if k = strings.TrimSpace(k); k != "" {
						w.trailerKeys = append(w.trailerKeys, textproto.CanonicalMIMEHeaderKey(k))
					}
				}
			}
		}
	}
	if !w.closeAfter {
		for _, v := range h["Connection"] {
			if strings.EqualFold(strings.TrimSpace(v), "close") {
				w.closeAfter = true
			}
		}
	}
	if !w.closeAfter && (w.c.srv.closing.Load() || w.body.remaining > maxBodyDiscard) {
		w.closeAfter = true
	}

	bw := w.c.bw
	writeStatusLine(bw, w.status)
	if _, ok := h["Date"]; !ok {
		_, _ = bw.Write(w.c.srv.dateLine(time.Now()))
	}
	if w.closeAfter && !hasCloseToken(h["Connection"]) {
		h.Del("Connection") // net/http replaces it
	}
	w.writeFields(bw, h)
	if w.chunked {
		_, _ = bw.WriteString("Transfer-Encoding: chunked\r\n")
	}
	if w.closeAfter && !hasCloseToken(h["Connection"]) {
		_, _ = bw.WriteString("Connection: close\r\n")
	}
	if _, err := bw.WriteString("\r\n"); err != nil {
		w.failed(err)
		return
	}
	if len(w.c.pending) > 0 {
		pend := w.c.pending
		w.c.pending = w.c.pending[:0]
		if _, err := w.writeBody(pend); err != nil {
			return
		}
	}
}

func hasCloseToken(vs []string) bool {
	for _, v := range vs {
		for tok := range strings.SplitSeq(v, ",") {
			if strings.EqualFold(strings.Trim(tok, " \t"), "close") {
				return true
			}
		}
	}
	return false
}

// writeFields writes a header block's fields, but trailers (net/http's TrailerPrefix), dropping
// invalid names and turning line breaks in values into spaces.
func (w *response) writeFields(bw *bufio.Writer, h http.Header) {
	for k, vs := range h {
		if !validFieldName(k) || strings.HasPrefix(k, http.TrailerPrefix) {
			continue
		}
		for _, v := range vs {
			_, _ = bw.WriteString(k)
			_, _ = bw.WriteString(": ")
			if strings.ContainsAny(v, "\r\n") {
				v = strings.NewReplacer("\r", " ", "\n", " ").Replace(v)
			}
			_, _ = bw.WriteString(strings.TrimSpace(v))
			_, _ = bw.WriteString("\r\n")
		}
	}
}

// finish completes the response after the handler returned and reports whether the connection
// may carry another request.
func (w *response) finish() bool {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	if !w.committed {
		w.commit(true, nil)
	}
	bw := w.c.bw
	if w.chunked && w.writeErr == nil {
		_, _ = bw.WriteString("0\r\n")
		for _, k := range w.trailerKeys {
			for _, v := range w.header[k] {
				_, _ = bw.WriteString(k + ": " + strings.TrimSpace(v) + "\r\n")
			}
		}
		for k, vs := range w.header {
			if name, ok := strings.CutPrefix(k, http.TrailerPrefix); ok && validFieldName(name) {
				for _, v := range vs {
					_, _ = bw.WriteString(name + ": " + strings.TrimSpace(v) + "\r\n")
				}
			}
		}
		_, _ = bw.WriteString("\r\n")
	}
	if w.writeErr == nil {
		if err := bw.Flush(); err != nil {
			w.failed(err)
		}
	}
	if w.writeErr != nil || w.closeAfter {
		return false
	}
	if !w.noBody && w.declared >= 0 && w.written < w.declared {
		return false // a short body: the client cannot tell where the next response starts
	}
	// The rest of the request body, unread by the handler, stands before the next request.
	if b := w.body; b.remaining > 0 {
		if b.err != nil || b.remaining > maxBodyDiscard {
			return false
		}
		if _, err := io.CopyN(io.Discard, w.c.br, b.remaining); err != nil {
			return false
		}
	}
	return true
}

// writeStatusLine writes "HTTP/1.1 code text\r\n".
func writeStatusLine(bw *bufio.Writer, code int) {
	if code == http.StatusOK {
		_, _ = bw.WriteString("HTTP/1.1 200 OK\r\n")
		return
	}
	var b [64]byte
	line := append(b[:0], "HTTP/1.1 "...)
	line = strconv.AppendInt(line, int64(code), 10)
	text := http.StatusText(code)
	if text == "" {
		text = "status code " + strconv.Itoa(code)
	}
	line = append(line, ' ')
	line = append(line, text...)
	line = append(line, "\r\n"...)
	_, _ = bw.Write(line)
}
