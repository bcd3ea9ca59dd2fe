package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/http/httputil"
	"net/textproto"
	"slices"
	"strconv"
	"strings"
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

// max1xxResponses bounds the informational responses skipped before the final one, when no
// Got1xxResponse hook relays them.
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
	// abortFn is abort, bound once: an exchange hands it to context.AfterFunc.
	abortFn func()
	probe   peerProbe
	lr      io.LimitedReader // writeRequest's, kept to spare an allocation per request
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
	stop := context.AfterFunc(ctx, pc.abortFn)
	fail := func(err error, nothingRead bool) (*http.Response, bool, error) {
		stop()
		_ = pc.conn.Close()
		if ctx.Err() != nil {
			err = context.Cause(ctx)
		}
		return nil, nothingRead, err
	}
	// One write: the headers and the in-memory body go through the buffer, flushed once.
	if err := writeRequest(pc.bw, &pc.lr, req); err != nil {
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
		resp, err = readResponse(pc.br, req)
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return fail(err, false)
		}
		if resp.StatusCode >= 200 {
			break
		}
		// Informational: ReverseProxy relays them to its client through this hook. As with
		// http.Transport, their number is bounded only when nobody relays them.
		trace := httptrace.ContextClientTrace(ctx)
		relayed := trace != nil && trace.Got1xxResponse != nil
		if resp.StatusCode == http.StatusSwitchingProtocols || !relayed && n1xx == max1xxResponses {
			return fail(fmt.Errorf("upstream: unexpected %s", resp.Status), false)
		}
		if relayed {
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
		if !pc.probe.closed() {
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
	pc := &upConn{
		conn: c,
		br:   bufio.NewReaderSize(c, upstreamReadBufferSize),
		bw:   bufio.NewWriterSize(c, upstreamWriteBufferSize),
		key:  key,
	}
	pc.abortFn = pc.abort
	pc.probe.init(c)
	return pc, nil
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

// writeRequest writes req to bw as req.Write does, and like it closes the body. A request whose
// head needs none of net/http's cleaning (see appendRequestHead) and that fits in bw with its
// body is written by appendRequestHead and a copy of the body, with no allocation and none of
// fmt's formatting; any other goes through req.Write. lr is scratch space for the body's copy.
func writeRequest(bw *bufio.Writer, lr *io.LimitedReader, req *http.Request) error {
	head, ok := appendRequestHead(bw.AvailableBuffer(), req)
	// The whole request fits in the buffer, with room to spare: the copy below does no I/O
	// (bufio.Writer.ReadFrom flushes a buffer it filled exactly), so that any error it returns is
	// the body's.
	if !ok || int64(len(head)) >= int64(bw.Available())-req.ContentLength {
		return req.Write(bw)
	}
	_, _ = bw.Write(head) // head is bw's free space: this only counts it in
	*lr = io.LimitedReader{R: req.Body, N: req.ContentLength}
	n, err := bw.ReadFrom(lr)
	lr.R = nil
	if err == nil {
		// What the body holds beyond ContentLength is read and dropped, as net/http does.
		var extra int64
		extra, err = io.Copy(io.Discard, req.Body)
		n += extra
	}
	if err != nil {
		_ = req.Body.Close()
		return bodyReadError{err}
	}
	if err := req.Body.Close(); err != nil {
		return err
	}
	if n != req.ContentLength {
		return fmt.Errorf("http: ContentLength=%d with Body length %d", req.ContentLength, n)
	}
	return nil
}

// bodyReadError is the failure of a request body's Read. It does not unwrap, like net/http's own
// (which req.Write returns): a body that fails to read is no connection closed by its peer
// (closedByPeer).
type bodyReadError struct{ error }

// maxFastHeaderKeys bounds the header keys appendRequestHead sorts on the stack.
const maxFastHeaderKeys = 32

// appendRequestHead appends to b the head that req.Write writes for req, and reports true, when
// req is one whose head needs none of net/http's cleaning: a body of known, positive length that
// GetBody can re-read (in memory), no Transfer-Encoding nor Close (a Trailer, which net/http
// sends only with a chunked body, is ignored as it ignores it), a plain ASCII host, a target
// without control bytes, valid header names and values without line breaks, at most
// maxFastHeaderKeys keys, and no client trace that watches the writing. It reports false for any
// other request, b then holding nothing of use.
func appendRequestHead(b []byte, req *http.Request) ([]byte, bool) {
	if req.URL == nil || req.Body == nil || req.Body == http.NoBody || req.GetBody == nil || req.ContentLength <= 0 ||
		len(req.TransferEncoding) > 0 || req.Close || req.Method == http.MethodConnect {
		return b, false
	}
	if tr := httptrace.ContextClientTrace(req.Context()); tr != nil &&
		(tr.WroteHeaderField != nil || tr.WroteHeaders != nil || tr.WroteRequest != nil) {
		return b, false
	}
	host := req.Host
	if host == "" {
		host = req.URL.Host
	}
	if !plainHost(host) {
		return b, false
	}
	target := req.URL.RequestURI()
	for i := range len(target) {
		if c := target[i]; c < ' ' || c == 0x7f {
			return b, false
		}
	}
	method := req.Method
	if method == "" {
		method = http.MethodGet
	}
	b = append(b, method...)
	b = append(b, ' ')
	b = append(b, target...)
	b = append(b, " HTTP/1.1\r\nHost: "...)
	b = append(b, host...)
	b = append(b, "\r\n"...)
	// net/http's default User-Agent, unless the header is there (empty: none).
	ua := "Go-http-client/1.1"
	if v, ok := req.Header["User-Agent"]; ok {
		ua = ""
		if len(v) > 0 {
			ua = v[0]
		}
	}
	if ua != "" {
		if hasLineBreak(ua) {
			return b, false
		}
		b = append(b, "User-Agent: "...)
		b = append(b, textproto.TrimString(ua)...)
		b = append(b, "\r\n"...)
	}
	b = append(b, "Content-Length: "...)
	b = strconv.AppendInt(b, req.ContentLength, 10)
	b = append(b, "\r\n"...)
	var keys [maxFastHeaderKeys]string
	ks := keys[:0]
	for k := range req.Header {
		switch k {
		case "Host", "User-Agent", "Content-Length", "Transfer-Encoding", "Trailer": // written above, or not at all
			continue
		}
		if len(ks) == len(keys) {
			return b, false
		}
		ks = append(ks, k)
	}
	slices.Sort(ks)
	for _, k := range ks {
		if !validFieldName(k) {
			return b, false
		}
		for _, v := range req.Header[k] {
			if hasLineBreak(v) {
				return b, false
			}
			b = append(b, k...)
			b = append(b, ": "...)
			b = append(b, textproto.TrimString(v)...)
			b = append(b, "\r\n"...)
		}
	}
	return append(b, "\r\n"...), true
}

// hasLineBreak reports whether s holds a CR or an LF.
func hasLineBreak(s string) bool {
	return strings.IndexByte(s, '\r') >= 0 || strings.IndexByte(s, '\n') >= 0
}

// plainHost reports whether host is a non-empty host[:port] of letters, digits and . - _ : [ ]
// only: a Host header that net/http sends as it is.
func plainHost(host string) bool {
	if host == "" {
		return false
	}
	for i := range len(host) {
		switch c := host[i]; {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case c == '.', c == '-', c == '_', c == ':', c == '[', c == ']':
		default:
			return false
		}
	}
	return true
}

// validFieldName reports whether name is a valid header field name: a non-empty token.
func validFieldName(name string) bool {
	if name == "" {
		return false
	}
	for i := range len(name) {
		if !isTchar(name[i]) {
			return false
		}
	}
	return true
}

// tokenBytes has a bit set for each byte that may appear in a token (RFC 9110 section 5.6.2):
// letters, digits and !#$%&'*+-.^_`|~.
const tokenBytes = (1<<26-1)<<'a' | (1<<26-1)<<'A' | (1<<10-1)<<'0' |
	1<<'!' | 1<<'#' | 1<<'$' | 1<<'%' | 1<<'&' | 1<<'\'' | 1<<'*' | 1<<'+' | 1<<'-' | 1<<'.' |
	1<<'^' | 1<<'_' | 1<<'`' | 1<<'|' | 1<<'~'

// isTchar reports whether c may appear in a token (a tchar).
func isTchar(c byte) bool {
	if c < 64 {
		return uint64(tokenBytes&(1<<64-1))&(1<<c) != 0
	}
	return c < 128 && uint64(tokenBytes>>64)&(1<<(c-64)) != 0
}

// readResponse reads a response head from br as http.ReadResponse does. A head already in br's
// buffer that net/http would take as it is is parsed by parseResponseHead, in one pass and into
// one string; any other goes to http.ReadResponse, which then finds it unread.
func readResponse(br *bufio.Reader, req *http.Request) (*http.Response, error) {
	if resp := parseResponseHead(br, req); resp != nil {
		return resp, nil
	}
	return http.ReadResponse(br, req)
}

// parseResponseHead returns the response whose head starts br's buffer, with its head consumed
// and the body to read from br, when the head is one that http.ReadResponse would return as it
// is: HTTP/1.1; a status of 200 or more that allows a body (not 204 or 304); header lines ending
// in CRLF, with valid names and values, none folded; a body delimited by one valid
// Content-Length or by a chunked Transfer-Encoding alone; and none of the headers net/http acts
// upon (Connection, Pragma, Trailer). The response is then the one http.ReadResponse would
// return, but that the header values share one string. It returns nil, having read nothing, for
// any other head, for a head not wholly buffered, and for the answer to a HEAD request.
func parseResponseHead(br *bufio.Reader, req *http.Request) *http.Response {
	if req != nil && req.Method == http.MethodHead {
		return nil
	}
	buf, _ := br.Peek(br.Buffered())
	end := bytes.Index(buf, doubleCRLF)
	if end < len("HTTP/1.1 200") {
		return nil
	}
	head := string(buf[:end+2]) // every line with its CRLF
	line, rest, _ := strings.Cut(head, "\r\n")
	if len(line) < len("HTTP/1.1 200") || !strings.HasPrefix(line, "HTTP/1.1 ") ||
		len(line) > len("HTTP/1.1 200") && line[len("HTTP/1.1 200")] != ' ' {
		return nil
	}
	code := 0
	for _, c := range []byte(line[len("HTTP/1.1 "):len("HTTP/1.1 200")]) {
		if c < '0' || c > '9' {
			return nil
		}
		code = code*10 + int(c-'0')
	}
	if code < 200 || code == http.StatusNoContent || code == http.StatusNotModified {
		return nil
	}
	for i := len("HTTP/1.1 200"); i < len(line); i++ {
		if c := line[i]; c < ' ' && c != '\t' || c == 0x7f {
			return nil
		}
	}
	status := line[len("HTTP/1.1 "):]

	// The fields first, on the stack, so that the header is made at its size: the map's
	// allocations depend on it (more for more than eight keys).
	var stack [24]headerField
	fields := stack[:0]
	chunked := false
	for rest != "" {
		line, rest, _ = strings.Cut(rest, "\r\n")
		colon := strings.IndexByte(line, ':')
		if colon <= 0 {
			return nil
		}
		key, ok := canonicalKey(line[:colon])
		if !ok {
			return nil
		}
		v := line[colon+1:]
		for i := range len(v) {
			if c := v[i]; c < ' ' && c != '\t' || c == 0x7f {
				return nil
			}
		}
		v = strings.Trim(v, " \t")
		switch key {
		case "Connection", "Pragma", "Trailer":
			return nil
		case "Transfer-Encoding":
			if chunked || !asciiEqualFold(v, "chunked") {
				return nil
			}
			chunked = true
			continue // net/http takes it out of the header
		}
		fields = append(fields, headerField{key, v})
	}
	h := make(http.Header, len(fields))
	strs := make([]string, len(fields)) // the values' slices, one per field (as net/http allots them)
	for _, f := range fields {
		if vv := h[f.key]; vv != nil {
			h[f.key] = append(vv, f.value)
			continue
		}
		vv := strs[:1:1]
		strs = strs[1:]
		vv[0] = f.value
		h[f.key] = vv
	}

	resp := &http.Response{Status: status, StatusCode: code, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: h, Request: req}
	cl, hasCL := h["Content-Length"]
	switch {
	case chunked:
		if hasCL {
			return nil
		}
		resp.ContentLength = -1
		resp.TransferEncoding = []string{"chunked"}
		resp.Body = &chunkedBody{cr: httputil.NewChunkedReader(br), br: br, resp: resp}
	case len(cl) != 1:
		return nil // none: a body up to the connection's end; several: to check or reject
	default:
		n, err := strconv.ParseUint(cl[0], 10, 63)
		if err != nil {
			return nil
		}
		resp.ContentLength = int64(n)
		resp.Body = http.NoBody
		if n > 0 {
			resp.Body = &lengthBody{lr: io.LimitedReader{R: br, N: int64(n)}}
		}
	}
	_, _ = br.Discard(end + len(doubleCRLF))
	return resp
}

var doubleCRLF = []byte("\r\n\r\n")

// headerField is one field of a response head.
type headerField struct{ key, value string }

// canonicalKey returns the canonical form of the header name k (as textproto.CanonicalMIMEHeaderKey
// gives it), without allocating for a name already canonical or a common one; ok is false when
// k is not a valid name.
func canonicalKey(k string) (string, bool) {
	if len(k) > 64 {
		return "", false
	}
	canonical := true
	upper := true
	for i := range len(k) {
		c := k[i]
		if !isTchar(c) {
			return "", false
		}
		if upper && 'a' <= c && c <= 'z' || !upper && 'A' <= c && c <= 'Z' {
			canonical = false
		}
		upper = c == '-'
	}
	if canonical {
		return k, true
	}
	var a [64]byte
	b := a[:len(k)]
	upper = true
	for i := range len(k) {
		c := k[i]
		if upper && 'a' <= c && c <= 'z' {
			c -= 'a' - 'A'
		} else if !upper && 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		b[i] = c
		upper = c == '-'
	}
	switch string(b) {
	case "Content-Type":
		return "Content-Type", true
	case "Content-Length":
		return "Content-Length", true
	case "Date":
		return "Date", true
	case "Server":
		return "Server", true
	case "Transfer-Encoding":
		return "Transfer-Encoding", true
	case "Connection":
		return "Connection", true
	case "Cache-Control":
		return "Cache-Control", true
	case "Vary":
		return "Vary", true
	case "X-Request-Id":
		return "X-Request-Id", true
	}
	return string(b), true
}

// asciiEqualFold reports whether s equals t (lower case ASCII) under ASCII case folding.
func asciiEqualFold(s, t string) bool {
	if len(s) != len(t) {
		return false
	}
	for i := range len(s) {
		c := s[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != t[i] {
			return false
		}
	}
	return true
}

// lengthBody is a response body of ContentLength bytes, read as net/http reads one: the last
// bytes come with io.EOF, and a connection that ends before them gives io.ErrUnexpectedEOF.
type lengthBody struct {
	lr     io.LimitedReader
	sawEOF bool
	closed bool
}

// Read implements io.Reader.
func (b *lengthBody) Read(p []byte) (n int, err error) {
	if b.closed {
		return 0, http.ErrBodyReadAfterClose
	}
	if b.sawEOF {
		return 0, io.EOF
	}
	n, err = b.lr.Read(p)
	if err == io.EOF {
		b.sawEOF = true
		if b.lr.N > 0 {
			err = io.ErrUnexpectedEOF
		}
	}
	if err == nil && n > 0 && b.lr.N == 0 {
		err = io.EOF
		b.sawEOF = true
	}
	return n, err
}

// Close implements io.Closer: later reads fail. The connection is upBody's to keep or close.
func (b *lengthBody) Close() error {
	b.closed = true
	return nil
}

// errTrailerEOF is the error of a chunked body whose connection ended in its trailer.
var errTrailerEOF = errors.New("http: unexpected EOF reading trailer")

// chunkedBody is a chunked response body, read as net/http reads one: at the last chunk it reads
// the trailer, which it merges into resp.Trailer.
type chunkedBody struct {
	cr     io.Reader // the chunks' data
	br     *bufio.Reader
	resp   *http.Response
	sawEOF bool
	closed bool // by Close, or by a malformed trailer
}

// Read implements io.Reader.
func (b *chunkedBody) Read(p []byte) (n int, err error) {
	if b.closed {
		return 0, http.ErrBodyReadAfterClose
	}
	if b.sawEOF {
		return 0, io.EOF
	}
	n, err = b.cr.Read(p)
	if err == io.EOF {
		b.sawEOF = true
		if e := b.readTrailer(); e != nil {
			// Nothing more may be read from a body whose trailer is malformed.
			err = e
			b.sawEOF = false
			b.closed = true
		}
	}
	return n, err
}

// readTrailer reads what follows the last chunk: the CRLF, or trailer fields and the CRLF.
func (b *chunkedBody) readTrailer() error {
	buf, err := b.br.Peek(2)
	if bytes.Equal(buf, doubleCRLF[:2]) {
		_, _ = b.br.Discard(2)
		return nil
	}
	if len(buf) < 2 {
		return errTrailerEOF
	}
	if err != nil {
		return err
	}
	// A trailer must end within the buffer: an unbounded one is not read.
	if !seeUpcomingDoubleCRLF(b.br) {
		return errors.New("http: suspiciously long trailer after chunked body")
	}
	hdr, err := textproto.NewReader(b.br).ReadMIMEHeader()
	if err != nil {
		if err == io.EOF {
			return errTrailerEOF
		}
		return err
	}
	if b.resp.Trailer == nil {
		b.resp.Trailer = http.Header(hdr)
	} else {
		maps.Copy(b.resp.Trailer, http.Header(hdr))
	}
	return nil
}

// seeUpcomingDoubleCRLF reports whether a CRLF CRLF comes within br's buffer size.
func seeUpcomingDoubleCRLF(br *bufio.Reader) bool {
	for size := 4; ; size++ {
		buf, err := br.Peek(size)
		if bytes.HasSuffix(buf, doubleCRLF) {
			return true
		}
		if err != nil {
			return false
		}
	}
}

// Close implements io.Closer: later reads fail. The connection is upBody's to keep or close.
func (b *chunkedBody) Close() error {
	b.closed = true
	return nil
}
