package events

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/metric"

	"github.com/kvroute/kvroute/events/internal/run"
)

// Defaults of SSEConfig (kvroute's values).
const (
	DefaultSSEInitialBackoff = time.Second
	DefaultSSEMaxBackoff     = 60 * time.Second
	DefaultSSEMaxEventSize   = 1 << 20 // bytes: one line, and one event's data
)

const (
	sseReadBuf     = 32 << 10 // bytes read from the stream at a time
	sseKeepBufSize = 64 << 10 // line and data buffers larger than this are released after use
)

// SSESource is one engine's KV-event stream.
type SSESource struct {
	// Backend is the routing backend the events belong to. Required.
	Backend string
	// URL is the stream, e.g. "http://vllm-1:8000/v1/kv_events" (http or https). Required.
	URL string
	// Model is set as Batch.Model on every event of the source; "" is the sink's default.
	Model string
}

// SSEConfig configures an SSEConsumer. Zero durations and sizes mean the Default* constants.
type SSEConfig struct {
	// Sink receives the events, one single-event Batch at a time. Required.
	Sink Sink
	// Sources lists the streams, at least one; each runs in its own goroutine.
	Sources []SSESource
	// Client performs the requests; nil means a client with no timeout over
	// http.DefaultTransport. TLS settings (custom roots, client certificates) go here. Its
	// Timeout, if set, ends every stream after that long (the consumer then reconnects).
	Client *http.Client
	// Header holds extra request headers (e.g. Authorization), sent on every request.
	Header http.Header
	// InitialBackoff and MaxBackoff bound the jittered exponential backoff between connection
	// attempts; it is reset after each successful connection. A server's "retry:" field
	// replaces InitialBackoff for its source (capped by MaxBackoff).
	InitialBackoff time.Duration
	MaxBackoff     time.Duration
	// MaxEventSize caps one line and one event's data, in bytes. A larger event is dropped and
	// counted (Events.Oversized, LastError; a Warn at most once per source every few seconds);
	// the parser skips to the next event without buffering it and the stream stays connected,
	// so memory stays bounded.
	MaxEventSize int
	// IdleTimeout, when positive, reconnects a stream that delivered no byte for that long (a
	// silently dead peer). Leave it 0 unless the server sends comments as heartbeats.
	IdleTimeout time.Duration
	// ClearOnReconnect makes the consumer call Sink.ClearBackend when a stream reconnects, since
	// the events sent while it was down are lost (an engine restart empties its cache). Off,
	// the index keeps its entries until their TTL.
	ClearOnReconnect bool

	// MeterProvider supplies the instruments (scopeName); nil means no metrics.
	MeterProvider metric.MeterProvider
	// Logger receives connection-level events at Debug and Warn; nil discards them.
	Logger *slog.Logger
	// Now is the clock for the status timestamps; nil means time.Now.
	Now func() time.Time
}

// SSEConsumer consumes kvroute's prefix-granular KV events (GET <engine>/v1/kv_events,
// text/event-stream: "event: cache_created" / "data: {…}") and applies each to a Sink as a
// single-event Batch. The SSE event: field wins over the JSON "event"; "data:" lines are joined
// with "\n"; a blank line dispatches; comments are ignored; "id:" is sent back as Last-Event-ID
// on reconnection and "retry:" sets the reconnection delay.
//
// Start runs one goroutine per source; it reads the stream and applies the events itself, so a
// slow sink slows the stream down (TCP backpressure) rather than dropping events. A stream that
// fails, ends or is refused is retried with jittered exponential backoff (InitialBackoff to
// MaxBackoff). Close stops and waits for every goroutine. All methods are safe for concurrent use.
type SSEConsumer struct {
	cfg    SSEConfig
	client *http.Client
	now    func() time.Time
	log    *slog.Logger
	life   run.Lifecycle
	srcs   *SourceSet

	sources []*sseSource
}

// sseSource is one stream and the state of its goroutine.
type sseSource struct {
	cfg   SSESource
	src   *Source
	w     *BackendWriter
	batch Batch
	id    string        // last event id
	retry time.Duration // server's retry: hint, 0 = none
	log   *slog.Logger
}

// NewSSEConsumer validates cfg and returns a consumer that does nothing until Start.
//
// Errors wrap ErrInvalidConfig: no Sink, no sources, a source without Backend or with the
// Backend of an earlier one, a URL that is not absolute http or https, negative durations or sizes, MaxBackoff < InitialBackoff. The
// metric instruments are registered here; an error from the MeterProvider is returned as is.
func NewSSEConsumer(cfg SSEConfig) (*SSEConsumer, error) {
	if cfg.Sink == nil {
		return nil, fmt.Errorf("%w: Sink is required", ErrInvalidConfig)
	}
	if len(cfg.Sources) == 0 {
		return nil, fmt.Errorf("%w: no Sources", ErrInvalidConfig)
	}
	if cfg.InitialBackoff < 0 || cfg.MaxBackoff < 0 || cfg.MaxEventSize < 0 || cfg.IdleTimeout < 0 {
		return nil, fmt.Errorf("%w: negative size or duration", ErrInvalidConfig)
	}
	setDefault(&cfg.InitialBackoff, DefaultSSEInitialBackoff)
	setDefault(&cfg.MaxBackoff, DefaultSSEMaxBackoff)
	setDefault(&cfg.MaxEventSize, DefaultSSEMaxEventSize)
	if cfg.MaxBackoff < cfg.InitialBackoff {
		return nil, fmt.Errorf("%w: MaxBackoff %v < InitialBackoff %v", ErrInvalidConfig, cfg.MaxBackoff, cfg.InitialBackoff)
	}
	c := &SSEConsumer{cfg: cfg, client: cfg.Client, now: cfg.Now, log: discardLogger(cfg.Logger)}
	if c.client == nil {
		c.client = &http.Client{}
	}
	if c.now == nil {
		c.now = time.Now
	}
	c.srcs = NewSourceSet(c.now)
	seen := make(map[string]bool, len(cfg.Sources))
	for i, sc := range cfg.Sources {
		if sc.Backend == "" {
			return nil, fmt.Errorf("%w: Sources[%d]: Backend is required", ErrInvalidConfig, i)
		}
		if seen[sc.Backend] {
			// The Sink takes one goroutine per backend at a time, and an engine has one stream.
			return nil, fmt.Errorf("%w: Sources[%d]: backend %q listed twice", ErrInvalidConfig, i, sc.Backend)
		}
		seen[sc.Backend] = true
		u, err := url.Parse(sc.URL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return nil, fmt.Errorf("%w: Sources[%d]: URL %q is not an absolute http(s) URL", ErrInvalidConfig, i, sc.URL)
		}
		s := &sseSource{cfg: sc, w: NewBackendWriter(cfg.Sink, sc.Backend), log: c.log}
		s.batch.Events = make([]Event, 1)
		s.src = c.srcs.Add(SourceInfo{Backend: sc.Backend, Transport: "sse", Endpoint: sc.URL})
		c.sources = append(c.sources, s)
	}
	if err := c.srcs.RegisterMetrics(cfg.MeterProvider); err != nil {
		return nil, err
	}
	c.life.Init()
	return c, nil
}

// Start starts one goroutine per source and returns; it does not wait for any connection.
// Cancelling ctx after Start returns has no effect: stop the consumer with Close. It returns
// ctx's error if ctx is already done, ErrStarted after a successful Start and ErrClosed after
// Close.
func (c *SSEConsumer) Start(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return c.life.Start(func() error {
		for _, s := range c.sources {
			c.life.Go(func() { c.run(s) })
		}
		return nil
	})
}

// Close cancels every request and waits for the goroutines; an event being applied is finished
// first (the sink sees a cancelled ctx). Idempotent; it returns the error of unregistering the
// metric callback, if any.
func (c *SSEConsumer) Close() error {
	if !c.life.Shutdown() {
		return nil
	}
	return c.srcs.Close()
}

// Status returns a snapshot of every source, in configuration order. Safe for concurrent use;
// it never blocks on the network.
func (c *SSEConsumer) Status() []SourceStatus { return c.srcs.Status() }

// run connects, reads and reconnects one source until Close.
func (c *SSEConsumer) run(s *sseSource) {
	ctx := c.life.Context()
	bo := run.Backoff{Initial: c.cfg.InitialBackoff, Max: c.cfg.MaxBackoff}
	for attempt := 0; ; attempt++ {
		if attempt > 0 {
			s.src.Reconnects.Add(1)
		}
		s.src.SetState(StateConnecting)
		err := c.stream(ctx, s, &bo)
		if ctx.Err() != nil {
			return
		}
		s.src.SetError(err)
		if s.src.State() == StateConnected {
			c.log.Warn("kvroute events: sse stream lost", "backend", s.cfg.Backend, "url", s.cfg.URL, "err", err)
		} else {
			c.log.Debug("kvroute events: sse connect failed", "backend", s.cfg.Backend, "url", s.cfg.URL, "err", err)
		}
		s.src.SetState(StateDisconnected)
		if s.retry > 0 {
			bo.Initial = min(s.retry, bo.Max)
		}
		if !run.Sleep(ctx, bo.Next()) {
			return
		}
	}
}

// errStreamEnded reports a stream the server closed.
var errStreamEnded = errors.New("stream ended")

// stream performs one request and reads its stream until it fails or ends. ctx is the
// consumer's: it also bounds the sink calls, which the request's own cancellation (idle
// timeout) must not abort.
func (c *SSEConsumer) stream(ctx context.Context, s *sseSource, bo *run.Backoff) error {
	reqCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	var idle *idleReader
	if d := c.cfg.IdleTimeout; d > 0 {
		// Armed before the request: a server that never answers is an idle one too.
		idle = &idleReader{d: d, t: time.AfterFunc(d, cancel)}
		defer idle.t.Stop()
	}
	req, err := http.NewRequestWithContext(reqCtx, http.MethodGet, s.cfg.URL, nil)
	if err != nil {
		return err
	}
	for k, v := range c.cfg.Header {
		req.Header[k] = v
	}
	req.Header.Set("Accept", "text/event-stream")
	req.Header.Set("Cache-Control", "no-cache")
	if s.id != "" {
		req.Header.Set("Last-Event-ID", s.id)
	}
	resp, err := c.client.Do(req)
	if err != nil {
		if idle != nil && reqCtx.Err() != nil && ctx.Err() == nil {
			return fmt.Errorf("GET %s: no response in %v", s.cfg.URL, c.cfg.IdleTimeout)
		}
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.CopyN(io.Discard, resp.Body, 4<<10)
		return fmt.Errorf("GET %s: unexpected status %s", s.cfg.URL, resp.Status)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "" {
		if mt, _, err := mime.ParseMediaType(ct); err != nil || mt != "text/event-stream" {
			return fmt.Errorf("GET %s: content type %q is not text/event-stream", s.cfg.URL, ct)
		}
	}
	bo.Reset()
	reconnect := s.src.EverConnected()
	s.src.SetState(StateConnected)
	c.log.Debug("kvroute events: sse connected", "backend", s.cfg.Backend, "url", s.cfg.URL)
	if reconnect && c.cfg.ClearOnReconnect {
		s.w.RequestReset()
		var empty Batch
		s.w.Apply(ctx, s.src, &empty)
	}
	var body io.Reader = resp.Body
	if idle != nil {
		idle.r = resp.Body
		idle.t.Reset(idle.d)
		body = idle
	}
	p := sseParser{max: c.cfg.MaxEventSize, rd: body, buf: make([]byte, sseReadBuf)}
	err = p.run(func(typ string, data []byte) { c.dispatch(ctx, s, typ, data) }, s)
	if idle != nil && reqCtx.Err() != nil && ctx.Err() == nil {
		return fmt.Errorf("no data for %v", c.cfg.IdleTimeout)
	}
	if errors.Is(err, io.EOF) {
		return errStreamEnded
	}
	return err
}

// dispatch decodes one complete event and applies it.
func (c *SSEConsumer) dispatch(ctx context.Context, s *sseSource, typ string, data []byte) {
	ev := &s.batch.Events[0]
	if err := DecodeSSEEvent(typ, data, ev); err != nil {
		s.src.Malformed.Add(1)
		s.src.SetError(err)
		return
	}
	s.src.Received.Add(1)
	s.src.Touch()
	s.batch.Model = s.cfg.Model
	s.batch.Events = s.batch.Events[:1]
	s.w.Apply(ctx, s.src, &s.batch)
}

// idleReader cancels the request (through t) when no byte arrives for d.
type idleReader struct {
	r io.Reader
	d time.Duration
	t *time.Timer
}

func (r *idleReader) Read(p []byte) (int, error) {
	n, err := r.r.Read(p)
	if n > 0 {
		r.t.Reset(r.d)
	}
	return n, err
}

// sseParser splits a text/event-stream into events (the WHATWG "event stream interpretation"),
// with every buffer capped at max bytes. Lines end with "\n", "\r\n" or "\r". Not safe for
// concurrent use.
type sseParser struct {
	max  int
	rd   io.Reader
	buf  []byte // read buffer; buf[r:w] is unread
	r, w int
	rerr error

	line   []byte // a line that spans reads
	over   bool   // the current line exceeded max
	skipLF bool   // the last line ended with "\r": a leading "\n" belongs to it

	typ      []byte
	typStr   string // string(typ) of the last dispatch, reused while typ is unchanged
	data     []byte
	poisoned bool // the current event exceeded max: dropped at its end
}

// sseHooks receives what the parser sees besides events.
type sseHooks interface {
	oversized(size int)
	setID(id []byte)
	setRetry(d time.Duration)
}

func (s *sseSource) oversized(limit int) {
	s.src.Oversized.Add(1)
	s.src.SetError(fmt.Errorf("%w: sse event larger than %d bytes dropped", ErrMalformed, limit))
	if s.src.WarnDue() {
		s.log.Warn("kvroute events: oversized sse event dropped", "backend", s.cfg.Backend, "url", s.cfg.URL, "max", limit)
	}
}

func (s *sseSource) setID(id []byte) {
	if string(id) != s.id {
		s.id = string(id)
	}
}

func (s *sseSource) setRetry(d time.Duration) { s.retry = d }

// run parses until the reader fails, calling dispatch for each complete event with its event:
// field ("" when absent) and data (valid only during the call).
func (p *sseParser) run(dispatch func(typ string, data []byte), hooks sseHooks) error {
	for {
		line, over, err := p.readLine()
		if err != nil {
			return err // an unterminated last event is discarded, as the spec says
		}
		if over {
			p.poisoned = true
			continue
		}
		if len(line) == 0 {
			p.dispatch(dispatch, hooks)
			continue
		}
		if line[0] == ':' {
			continue // comment
		}
		field, value := line, []byte(nil)
		if i := bytes.IndexByte(line, ':'); i >= 0 {
			field, value = line[:i], line[i+1:]
			if len(value) > 0 && value[0] == ' ' {
				value = value[1:]
			}
		}
		switch string(field) {
		case "data":
			if p.poisoned {
				continue
			}
			if len(p.data)+len(value)+1+len(p.typ) > p.max {
				p.poisoned, p.data = true, p.data[:0]
				continue
			}
			p.data = append(p.data, value...)
			p.data = append(p.data, '\n')
		case "event":
			p.typ = append(p.typ[:0], value...)
		case "id":
			if bytes.IndexByte(value, 0) < 0 {
				hooks.setID(value)
			}
		case "retry":
			if ms, err := strconv.ParseUint(string(value), 10, 32); err == nil {
				hooks.setRetry(time.Duration(ms) * time.Millisecond)
			}
		}
	}
}

// dispatch ends the current event.
func (p *sseParser) dispatch(dispatch func(typ string, data []byte), hooks sseHooks) {
	switch {
	case p.poisoned:
		hooks.oversized(p.max)
	case len(p.data) > 0:
		if string(p.typ) != p.typStr {
			p.typStr = string(p.typ)
		}
		dispatch(p.typStr, p.data[:len(p.data)-1])
	}
	p.poisoned = false
	p.typ, p.data = p.typ[:0], p.data[:0]
	if cap(p.data) > sseKeepBufSize {
		p.data = nil
	}
	if cap(p.line) > sseKeepBufSize {
		p.line = nil
	}
}

// readLine returns the next line without its terminator, valid until the next call. over is
// true when the line was longer than max; its content is then discarded.
func (p *sseParser) readLine() (line []byte, over bool, err error) {
	p.line, p.over = p.line[:0], false
	spanning := false
	for {
		if p.r == p.w {
			if p.rerr != nil {
				return nil, false, p.rerr
			}
			n, err := p.rd.Read(p.buf)
			p.r, p.w, p.rerr = 0, n, err
			if n == 0 && err == nil {
				continue
			}
			if n == 0 {
				return nil, false, err
			}
		}
		win := p.buf[p.r:p.w]
		if p.skipLF {
			p.skipLF = false
			if win[0] == '\n' {
				p.r++
				continue
			}
		}
		i := bytes.IndexAny(win, "\r\n")
		if i < 0 {
			p.appendLine(win)
			p.r = p.w
			spanning = true
			continue
		}
		p.skipLF = win[i] == '\r'
		p.r += i + 1
		if !spanning {
			if i > p.max {
				return nil, true, nil
			}
			return win[:i], false, nil
		}
		p.appendLine(win[:i])
		return p.line, p.over, nil
	}
}

func (p *sseParser) appendLine(b []byte) {
	if p.over {
		return
	}
	if len(p.line)+len(b) > p.max {
		p.over, p.line = true, p.line[:0]
		return
	}
	p.line = append(p.line, b...)
}

func setDefault[T int | time.Duration](v *T, def T) {
	if *v == 0 {
		*v = def
	}
}

// discardLogger returns l, or a logger that drops everything when l is nil.
func discardLogger(l *slog.Logger) *slog.Logger {
	if l != nil {
		return l
	}
	return slog.New(slog.DiscardHandler)
}
