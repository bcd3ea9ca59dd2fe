package eventlog

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/zeebo/xxh3"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/telemetry"
)

// Defaults of PublisherOptions.
const (
	DefaultQueueSize   = 4096
	DefaultMaxInFlight = 256
	DefaultAckTimeout  = 5 * time.Second
)

// PublisherOptions are the Publisher's own settings; the zero value means the defaults.
type PublisherOptions struct {
	// QueueSize is the most messages waiting to be published (DefaultQueueSize): while the server
	// is slow or down, Apply drops what does not fit.
	QueueSize int
	// MaxInFlight is the most messages published and not yet acknowledged (DefaultMaxInFlight).
	MaxInFlight int
	// AckTimeout is how long a publish waits for the stream's acknowledgement before it counts as
	// failed (DefaultAckTimeout).
	AckTimeout time.Duration
	// DisableDedup publishes without a Nats-Msg-Id header. By default a batch that carries an
	// engine sequence number (Batch.Seq ≠ 0) is published with an ID derived from its encoding,
	// so that the stream stores once what several bridges of one engine publish within
	// Config.Duplicates.
	DisableDedup bool
	// RetryInterval is the pause between attempts to create the stream (DefaultRetryInterval).
	RetryInterval time.Duration
}

// PublisherStats are a Publisher's counters.
type PublisherStats struct {
	// Accepted counts the batches and clears Apply and ClearBackend queued.
	Accepted uint64 `json:"accepted"`
	// Published counts the messages the stream acknowledged, Duplicates those of them it
	// acknowledged as duplicates (stored once already).
	Published  uint64 `json:"published"`
	Duplicates uint64 `json:"duplicates"`
	// Dropped counts batches not queued (the queue was full, or the publisher closed),
	// Oversized those beyond the encoding's limits, Failed the publishes that failed or were not
	// acknowledged within AckTimeout. Each marks its backend for a clear (Clears counts them
	// sent): consumers drop what they hold of the backend before its next message.
	Dropped   uint64 `json:"dropped"`
	Oversized uint64 `json:"oversized"`
	Failed    uint64 `json:"failed"`
	Clears    uint64 `json:"clears"`
	// Queued and InFlight are the messages waiting now, and published but not acknowledged.
	Queued   int `json:"queued"`
	InFlight int `json:"in_flight"`
	// LastSeq is the stream sequence of the last acknowledged message.
	LastSeq uint64 `json:"last_seq"`
	// StreamReady reports that the stream was created or updated, and no publish since found it
	// missing.
	StreamReady bool      `json:"stream_ready"`
	LastError   string    `json:"last_error,omitempty"`
	LastErrorAt time.Time `json:"last_error_at,omitzero"`
}

// Publisher is the event bridge: an events.Sink that publishes each batch it is given to the
// fleet's stream, for the Consumers of every router replica to apply. Hand it to an events
// transport (zmqevents.New's sink, events.NewSSEConsumer's) as the index, or beside the index
// with a sink that applies to both.
//
// It never blocks its caller on the server: Apply encodes the batch and queues it (QueueSize);
// one goroutine publishes the queue asynchronously, at most MaxInFlight unacknowledged, and
// another collects the acknowledgements. A batch that cannot be queued or published is counted
// (PublisherStats) and its backend marked: the backend's next message carries a clear, so that
// consumers never build on a hole in a backend's events.
//
// Safe for concurrent use, as events.Sink requires (one goroutine per backend at a time). Create
// it with NewPublisher, call Start, and Close it; the zero value is not usable.
type Publisher struct {
	cfg   Config
	opts  PublisherOptions
	queue chan *pubItem
	acks  chan *pubItem

	mu       sync.Mutex
	pending  map[string]uint64 // backend → generation of its pending clear
	gen      uint64
	lastErr  string
	lastErAt time.Time
	started  bool
	closed   bool

	accepted, published, duplicates, dropped, oversized, failed, clears atomic.Uint64
	inFlight, outstanding                                               atomic.Int64
	lastSeq                                                             atomic.Uint64
	ready                                                               atomic.Bool

	reg       metric.Registration
	stop      chan struct{}
	wg        sync.WaitGroup
	closeOnce sync.Once
}

type pubItem struct {
	backend string
	data    []byte
	msgID   string
	fut     jetstream.PubAckFuture
	at      time.Time
}

var _ events.Sink = (*Publisher)(nil)

// NewPublisher returns a publisher of cfg's stream. It validates cfg and opts (errors wrap
// ErrInvalidConfig) and registers its metrics; it does no I/O and starts nothing (Start does).
func NewPublisher(cfg Config, opts PublisherOptions) (*Publisher, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if opts.QueueSize == 0 {
		opts.QueueSize = DefaultQueueSize
	}
	if opts.MaxInFlight == 0 {
		opts.MaxInFlight = DefaultMaxInFlight
	}
	if opts.AckTimeout == 0 {
		opts.AckTimeout = DefaultAckTimeout
	}
	if opts.RetryInterval == 0 {
		opts.RetryInterval = DefaultRetryInterval
	}
	if opts.QueueSize < 1 || opts.MaxInFlight < 1 || opts.AckTimeout < 0 || opts.RetryInterval < 0 {
		return nil, fmt.Errorf("%w: QueueSize, MaxInFlight must be ≥ 1, AckTimeout and RetryInterval ≥ 0", ErrInvalidConfig)
	}
	p := &Publisher{
		cfg:     cfg,
		opts:    opts,
		queue:   make(chan *pubItem, opts.QueueSize),
		acks:    make(chan *pubItem, opts.MaxInFlight),
		pending: map[string]uint64{},
		stop:    make(chan struct{}),
	}
	attrs := metric.WithAttributeSet(attribute.NewSet(attribute.String("stream", cfg.Stream)))
	p.reg, err = registerMetrics(cfg.MeterProvider, attrs, []counterSpec{
		{name: telemetry.MetricEventlogPublished, desc: "KV event batches the stream acknowledged.", unit: "{batch}", value: func() int64 { return int64(p.published.Load()) }},
		{name: telemetry.MetricEventlogDuplicates, desc: "KV event batches the stream acknowledged as duplicates.", unit: "{batch}", value: func() int64 { return int64(p.duplicates.Load()) }},
		{name: telemetry.MetricEventlogDropped, desc: "KV event batches dropped before publishing (queue full, oversized).", unit: "{batch}", value: func() int64 { return int64(p.dropped.Load() + p.oversized.Load()) }},
		{name: telemetry.MetricEventlogPublishFailures, desc: "KV event batch publishes that failed or timed out.", unit: "{batch}", value: func() int64 { return int64(p.failed.Load()) }},
		{name: telemetry.MetricEventlogPublishedSeq, desc: "Stream sequence of the last acknowledged batch.", gauge: true, value: func() int64 { return int64(p.lastSeq.Load()) }},
	})
	if err != nil {
		return nil, err
	}
	return p, nil
}

// Start starts the two goroutines that publish the queue and collect acknowledgements; they
// create or update the stream (Config's limits) before the first publish, retrying every
// RetryInterval while the server is unreachable. ctx is not kept. It returns ErrStarted after a
// successful Start and ErrClosed after Close.
func (p *Publisher) Start(context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.closed:
		return ErrClosed
	case p.started:
		return ErrStarted
	}
	p.started = true
	p.wg.Add(2)
	go p.publishLoop()
	go p.ackLoop()
	return nil
}

// Apply queues b, as coming from backend, for publishing (events.Sink). It returns ErrClosed after
// Close and nil otherwise: a batch dropped (queue full, too large) is counted in Stats and makes
// the backend's next message carry a clear. It never blocks on the server; ctx is not used. b is
// not kept.
func (p *Publisher) Apply(_ context.Context, backend string, b *events.Batch) error {
	return p.enqueue(backend, b)
}

// ClearBackend queues a clear of backend (events.Sink): consumers forget what they hold of it.
// Same contract as Apply.
func (p *Publisher) ClearBackend(_ context.Context, backend string) error {
	p.mark(backend, nil)
	return p.enqueue(backend, &events.Batch{})
}

var errQueueFull = errors.New("eventlog: publish queue full")

func (p *Publisher) enqueue(backend string, b *events.Batch) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return ErrClosed
	}
	gen, clear := p.pending[backend]
	p.mu.Unlock()
	if !clear && len(b.Events) == 0 {
		return nil
	}
	m := Message{Backend: backend, Clear: clear, Batch: *b}
	data, err := AppendMessage(nil, &m)
	if err != nil {
		p.oversized.Add(1)
		p.mark(backend, err)
		return nil
	}
	it := &pubItem{backend: backend, data: data}
	if !p.opts.DisableDedup && b.Seq != 0 {
		h := xxh3.Hash128(data).Bytes()
		it.msgID = "kv-" + hex.EncodeToString(h[:])
	}
	p.outstanding.Add(1)
	select {
	case p.queue <- it:
	default:
		p.outstanding.Add(-1)
		p.dropped.Add(1)
		p.mark(backend, errQueueFull)
		return nil
	}
	p.accepted.Add(1)
	if clear {
		p.clears.Add(1)
		p.mu.Lock()
		if p.pending[backend] == gen {
			delete(p.pending, backend)
		}
		p.mu.Unlock()
	}
	return nil
}

// mark makes backend's next message carry a clear, and records err (when not nil).
func (p *Publisher) mark(backend string, err error) {
	p.mu.Lock()
	p.gen++
	p.pending[backend] = p.gen
	if err != nil {
		p.lastErr, p.lastErAt = err.Error(), p.cfg.Now()
	}
	p.mu.Unlock()
}

// publishLoop publishes the queue, MaxInFlight at most unacknowledged.
func (p *Publisher) publishLoop() {
	defer p.wg.Done()
	defer close(p.acks)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-p.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	warned := false
	for {
		var it *pubItem
		select {
		case <-p.stop:
			return
		case it = <-p.queue:
		}
		for !p.ready.Load() {
			cctx, ccancel := context.WithTimeout(ctx, p.opts.RetryInterval+time.Second)
			_, err := p.cfg.JetStream.CreateOrUpdateStream(cctx, p.cfg.streamConfig())
			ccancel()
			if err == nil {
				p.ready.Store(true)
				warned = false
				break
			}
			p.setErr(fmt.Errorf("create stream %s: %w", p.cfg.Stream, err))
			if !warned {
				p.cfg.Logger.Warn("eventlog: cannot create the stream; retrying", "stream", p.cfg.Stream, "err", err)
				warned = true
			}
			if !sleepCtx(ctx, p.stop, p.opts.RetryInterval) {
				return
			}
		}
		msg := &nats.Msg{Subject: p.cfg.subject(it.backend), Data: it.data, Header: nats.Header{}}
		var popts []jetstream.PublishOpt
		if it.msgID != "" {
			popts = append(popts, jetstream.WithMsgID(it.msgID))
		}
		fut, err := p.cfg.JetStream.PublishMsgAsync(msg, popts...)
		if err != nil {
			p.fail(it, err)
			continue
		}
		it.fut, it.at = fut, time.Now()
		p.inFlight.Add(1)
		select {
		case p.acks <- it:
		case <-p.stop:
			p.inFlight.Add(-1)
			p.outstanding.Add(-1)
			return
		}
	}
}

// ackLoop collects acknowledgements in publishing order.
func (p *Publisher) ackLoop() {
	defer p.wg.Done()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for it := range p.acks {
		timer.Reset(max(0, p.opts.AckTimeout-time.Since(it.at)))
		select {
		case ack := <-it.fut.Ok():
			p.published.Add(1)
			if ack.Duplicate {
				p.duplicates.Add(1)
			}
			if ack.Sequence > p.lastSeq.Load() {
				p.lastSeq.Store(ack.Sequence)
			}
			p.outstanding.Add(-1)
		case err := <-it.fut.Err():
			p.fail(it, err)
		case <-timer.C:
			p.fail(it, fmt.Errorf("no acknowledgement in %v", p.opts.AckTimeout))
		case <-p.stop:
			p.inFlight.Add(-1)
			p.outstanding.Add(-1)
			for range p.acks {
				p.inFlight.Add(-1)
				p.outstanding.Add(-1)
			}
			return
		}
		p.inFlight.Add(-1)
	}
}

// fail counts a failed publish of it and marks its backend.
func (p *Publisher) fail(it *pubItem, err error) {
	p.failed.Add(1)
	p.outstanding.Add(-1)
	if errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders) ||
		errors.Is(err, jetstream.ErrStreamNotFound) {
		p.ready.Store(false) // the stream may be gone: create it again
	}
	p.mark(it.backend, fmt.Errorf("publish to %s: %w", p.cfg.subject(it.backend), err))
	if p.failed.Load()&(p.failed.Load()-1) == 0 { // 1st, 2nd, 4th, … failure
		p.cfg.Logger.Warn("eventlog: publish failed; the backend will be cleared in consumers",
			"backend", it.backend, "failures", p.failed.Load(), "err", err)
	}
}

func (p *Publisher) setErr(err error) {
	p.mu.Lock()
	p.lastErr, p.lastErAt = err.Error(), p.cfg.Now()
	p.mu.Unlock()
}

// Flush waits until every message queued before it was acknowledged or failed, or ctx ends (its
// error is then returned). It returns ErrClosed after Close.
func (p *Publisher) Flush(ctx context.Context) error {
	t := time.NewTicker(2 * time.Millisecond)
	defer t.Stop()
	for {
		p.mu.Lock()
		closed := p.closed
		p.mu.Unlock()
		if closed {
			return ErrClosed
		}
		if p.outstanding.Load() <= 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// Stats returns the publisher's counters. Safe for concurrent use.
func (p *Publisher) Stats() PublisherStats {
	s := PublisherStats{
		Accepted:    p.accepted.Load(),
		Published:   p.published.Load(),
		Duplicates:  p.duplicates.Load(),
		Dropped:     p.dropped.Load(),
		Oversized:   p.oversized.Load(),
		Failed:      p.failed.Load(),
		Clears:      p.clears.Load(),
		Queued:      len(p.queue),
		InFlight:    int(p.inFlight.Load()),
		LastSeq:     p.lastSeq.Load(),
		StreamReady: p.ready.Load(),
	}
	p.mu.Lock()
	s.LastError, s.LastErrorAt = p.lastErr, p.lastErAt
	p.mu.Unlock()
	return s
}

// Close stops the goroutines and unregisters the metrics; the messages still queued or awaiting
// acknowledgement are abandoned (call Flush first to wait for them). Later Apply and
// ClearBackend return ErrClosed. Idempotent; the error is the metrics' unregistration's.
func (p *Publisher) Close() error {
	var err error
	p.closeOnce.Do(func() {
		p.mu.Lock()
		p.closed = true
		p.mu.Unlock()
		close(p.stop)
		p.wg.Wait()
		if p.reg != nil {
			err = p.reg.Unregister()
		}
	})
	return err
}
