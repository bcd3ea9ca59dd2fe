package eventlog

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/telemetry"
)

// scopeName is the instrumentation scope of the package's metrics.
const scopeName = "github.com/kvroute/kvroute/natsync/eventlog"

// ConsumerOptions are the Consumer's own settings.
type ConsumerOptions struct {
	// Sink is the replica's index (a kvindex.KvCacheIndex); required.
	Sink events.Sink
	// StartSeq is the first stream sequence to apply: RestoreResult.StartSeq after a Restore, 0
	// or 1 for the whole stream.
	StartSeq uint64
	// RetryInterval is the pause before subscribing again after the subscription failed
	// (DefaultRetryInterval).
	RetryInterval time.Duration
}

// ConsumerStats are a Consumer's counters.
type ConsumerStats struct {
	// Messages counts the stream messages read; Applied the messages applied to the sink, and
	// Events their events; DecodeErrors the messages that were not valid event-log messages
	// (skipped); ApplyErrors the messages the sink failed to take (the backend is then cleared
	// before its next message, as events.BackendWriter does); Clears the backend clears done.
	Messages     uint64 `json:"messages"`
	Applied      uint64 `json:"applied"`
	Events       uint64 `json:"events"`
	DecodeErrors uint64 `json:"decode_errors"`
	ApplyErrors  uint64 `json:"apply_errors"`
	Clears       uint64 `json:"clears"`
	// Gaps counts jumps in the stream sequence (messages removed by the stream's limits or a
	// purge before this consumer read them); Missed the sequence numbers skipped.
	Gaps   uint64 `json:"gaps"`
	Missed uint64 `json:"missed"`
	// LastSeq is the stream sequence of the last message handled (applied or skipped).
	LastSeq uint64 `json:"last_seq"`
	// Subscriptions counts the subscriptions made (1 + resubscriptions after failures).
	Subscriptions uint64 `json:"subscriptions"`
	Running       bool   `json:"running"`
	// Subscribed is true while the consumer holds a subscription to the stream (the ordered
	// consumer recreates itself through a server restart or a lost connection meanwhile), since
	// SubscribedAt. A LastError older than SubscribedAt is history: the failure it names (a
	// stream not created yet, a server that was down) was recovered from.
	Subscribed   bool      `json:"subscribed"`
	SubscribedAt time.Time `json:"subscribed_at,omitzero"`
	// LastError is the last error met, LastErrorAt when; they stay after a recovery (see
	// Subscribed).
	LastError   string    `json:"last_error,omitempty"`
	LastErrorAt time.Time `json:"last_error_at,omitzero"`
}

// Consumer applies the fleet's stream to one replica's index: an ordered JetStream consumer
// from StartSeq, each message decoded and applied to the sink in stream order, through one
// events.BackendWriter per backend (a failed Apply clears the backend before its next batch).
// Messages that do not decode, or whose subject does not name their backend, are counted and
// skipped. LastSeq, the sequence of the last message handled, is what a Snapshotter records.
//
// One goroutine (Start) reads and applies; the ordered consumer recreates itself after a server
// restart or a lost connection, and the goroutine subscribes again from LastSeq+1 after any
// other failure. Safe for concurrent use. Create it with NewConsumer; the zero value is not
// usable.
type Consumer struct {
	cfg  Config
	opts ConsumerOptions

	lastSeq                                                                   atomic.Uint64
	messages, applied, evs, decodeErrs, applyErrs, clears, gaps, missed, subs atomic.Uint64
	running                                                                   atomic.Bool
	subscribedAt                                                              atomic.Int64 // unix nanoseconds, 0 while unsubscribed

	mu      sync.Mutex
	started bool
	closed  bool
	iter    jetstream.MessagesContext
	lastErr string
	errAt   time.Time
	seqCond chan struct{} // closed and replaced when lastSeq moves

	writers map[string]*events.BackendWriter // goroutine-owned
	srcs    map[string]*events.Source
	msg     Message

	reg    metric.Registration
	stop   chan struct{}
	done   chan struct{}
	cancel context.CancelFunc
	once   sync.Once
}

// NewConsumer returns a consumer of cfg's stream into opts.Sink. It validates its arguments
// (errors wrap ErrInvalidConfig) and registers its metrics; it does no I/O (Start does).
func NewConsumer(cfg Config, opts ConsumerOptions) (*Consumer, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if opts.Sink == nil {
		return nil, fmt.Errorf("%w: ConsumerOptions.Sink is nil", ErrInvalidConfig)
	}
	if opts.RetryInterval == 0 {
		opts.RetryInterval = DefaultRetryInterval
	}
	if opts.RetryInterval < 0 {
		return nil, fmt.Errorf("%w: RetryInterval %v < 0", ErrInvalidConfig, opts.RetryInterval)
	}
	c := &Consumer{
		cfg:     cfg,
		opts:    opts,
		seqCond: make(chan struct{}),
		writers: map[string]*events.BackendWriter{},
		srcs:    map[string]*events.Source{},
		stop:    make(chan struct{}),
		done:    make(chan struct{}),
	}
	if opts.StartSeq > 1 {
		c.lastSeq.Store(opts.StartSeq - 1)
	}
	attrs := metric.WithAttributeSet(attribute.NewSet(attribute.String("stream", cfg.Stream)))
	c.reg, err = registerMetrics(cfg.MeterProvider, attrs, []counterSpec{
		{name: telemetry.MetricEventlogApplied, desc: "Event-log messages applied to the index.", unit: "{batch}", value: func() int64 { return int64(c.applied.Load()) }},
		{name: telemetry.MetricEventlogDecodeErrors, desc: "Event-log messages that did not decode (skipped).", unit: "{message}", value: func() int64 { return int64(c.decodeErrs.Load()) }},
		{name: telemetry.MetricEventlogApplyErrors, desc: "Event-log messages the index failed to apply.", unit: "{batch}", value: func() int64 { return int64(c.applyErrs.Load()) }},
		{name: telemetry.MetricEventlogGaps, desc: "Jumps in the stream sequence (messages gone before they were read).", unit: "{gap}", value: func() int64 { return int64(c.gaps.Load()) }},
		{name: telemetry.MetricEventlogAppliedSeq, desc: "Stream sequence of the last message handled.", gauge: true, value: func() int64 { return int64(c.lastSeq.Load()) }},
	})
	if err != nil {
		return nil, err
	}
	return c, nil
}

// Start starts the consuming goroutine. ctx bounds nothing after Start returns (Close stops
// the goroutine); the sink's Apply gets a context that Close cancels. It returns ErrStarted after
// a successful Start and ErrClosed after Close.
func (c *Consumer) Start(context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.closed:
		return ErrClosed
	case c.started:
		return ErrStarted
	}
	c.started = true
	ctx, cancel := context.WithCancel(context.Background())
	c.cancel = cancel
	go c.run(ctx)
	return nil
}

// LastSeq returns the stream sequence of the last message handled (StartSeq−1 before the first):
// every message up to it has been applied or skipped. Safe for concurrent use.
func (c *Consumer) LastSeq() uint64 { return c.lastSeq.Load() }

// WaitSeq waits until LastSeq ≥ seq, or ctx ends (its error), or the consumer is closed
// (ErrClosed).
func (c *Consumer) WaitSeq(ctx context.Context, seq uint64) error {
	for {
		c.mu.Lock()
		ch, closed := c.seqCond, c.closed
		c.mu.Unlock()
		if c.lastSeq.Load() >= seq {
			return nil
		}
		if closed {
			return ErrClosed
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (c *Consumer) run(ctx context.Context) {
	defer close(c.done)
	c.running.Store(true)
	defer c.running.Store(false)
	warned := false
	for ctx.Err() == nil {
		err := c.consume(ctx)
		if ctx.Err() != nil {
			return
		}
		c.setErr(err)
		if !warned || !errors.Is(err, jetstream.ErrStreamNotFound) {
			c.cfg.Logger.Warn("eventlog: consumer stopped; subscribing again", "stream", c.cfg.Stream,
				"from", c.lastSeq.Load()+1, "err", err)
			warned = true
		}
		if !sleepCtx(ctx, c.stop, c.opts.RetryInterval) {
			return
		}
	}
}

// consume subscribes from LastSeq+1 and applies messages until the subscription fails.
func (c *Consumer) consume(ctx context.Context) error {
	sctx, cancel := context.WithTimeout(ctx, c.opts.RetryInterval+5*time.Second)
	cons, err := c.cfg.JetStream.OrderedConsumer(sctx, c.cfg.Stream, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{c.cfg.SubjectPrefix + ".>"},
		DeliverPolicy:  jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:    c.lastSeq.Load() + 1,
	})
	cancel()
	if err != nil {
		return fmt.Errorf("ordered consumer: %w", err)
	}
	it, err := cons.Messages()
	if err != nil {
		return fmt.Errorf("messages: %w", err)
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		it.Stop()
		return ErrClosed
	}
	c.iter = it
	c.mu.Unlock()
	c.subs.Add(1)
	c.subscribedAt.Store(c.cfg.Now().UnixNano())
	defer func() {
		c.subscribedAt.Store(0)
		c.mu.Lock()
		c.iter = nil
		c.mu.Unlock()
		it.Stop()
	}()
	for {
		msg, err := it.Next()
		if err != nil {
			return fmt.Errorf("next message: %w", err)
		}
		c.handle(ctx, msg)
	}
}

// handle applies one message.
func (c *Consumer) handle(ctx context.Context, msg jetstream.Msg) {
	meta, err := msg.Metadata()
	if err != nil {
		c.decodeErrs.Add(1)
		c.setErr(fmt.Errorf("metadata: %w", err))
		return
	}
	seq := meta.Sequence.Stream
	last := c.lastSeq.Load()
	if seq <= last {
		return // delivered again after a resubscription
	}
	c.messages.Add(1)
	if seq > last+1 {
		c.gaps.Add(1)
		c.missed.Add(seq - last - 1)
		c.cfg.Logger.Warn("eventlog: stream sequence gap: messages were removed before this replica read them",
			"stream", c.cfg.Stream, "after", last, "next", seq)
	}
	c.apply(ctx, msg.Subject(), msg.Data())
	c.lastSeq.Store(seq)
	c.mu.Lock()
	close(c.seqCond)
	c.seqCond = make(chan struct{})
	c.mu.Unlock()
}

func (c *Consumer) apply(ctx context.Context, subject string, data []byte) {
	m := &c.msg
	if err := DecodeMessage(data, m); err != nil {
		c.decodeErrs.Add(1)
		c.setErr(fmt.Errorf("message on %s: %w", subject, err))
		return
	}
	if tok, ok := strings.CutPrefix(subject, c.cfg.SubjectPrefix+"."); !ok || tok != SubjectToken(m.Backend) {
		c.decodeErrs.Add(1)
		c.setErr(fmt.Errorf("%w: message on %s names backend %q", ErrMalformed, subject, m.Backend))
		return
	}
	w := c.writers[m.Backend]
	if w == nil {
		w = events.NewBackendWriter(c.opts.Sink, m.Backend)
		c.writers[m.Backend] = w
		c.srcs[m.Backend] = events.NewSource(events.SourceInfo{Backend: m.Backend, Transport: "nats",
			Endpoint: c.cfg.Stream, Topic: subject}, c.cfg.Now)
	}
	if m.Clear {
		w.RequestReset()
	}
	before := w.Clears()
	ok := w.Apply(ctx, c.srcs[m.Backend], &m.Batch)
	c.clears.Add(w.Clears() - before)
	if !ok {
		c.applyErrs.Add(1)
		c.setErr(fmt.Errorf("apply %s: %s", m.Backend, c.srcs[m.Backend].Status().LastError))
		return
	}
	c.applied.Add(1)
	c.evs.Add(uint64(len(m.Batch.Events)))
}

func (c *Consumer) setErr(err error) {
	if err == nil {
		return
	}
	c.mu.Lock()
	c.lastErr, c.errAt = err.Error(), c.cfg.Now()
	c.mu.Unlock()
}

// Stats returns the consumer's counters. Safe for concurrent use.
func (c *Consumer) Stats() ConsumerStats {
	s := ConsumerStats{
		Messages:      c.messages.Load(),
		Applied:       c.applied.Load(),
		Events:        c.evs.Load(),
		DecodeErrors:  c.decodeErrs.Load(),
		ApplyErrors:   c.applyErrs.Load(),
		Clears:        c.clears.Load(),
		Gaps:          c.gaps.Load(),
		Missed:        c.missed.Load(),
		LastSeq:       c.lastSeq.Load(),
		Subscriptions: c.subs.Load(),
		Running:       c.running.Load(),
	}
	if at := c.subscribedAt.Load(); at != 0 {
		s.Subscribed, s.SubscribedAt = true, time.Unix(0, at).UTC()
	}
	c.mu.Lock()
	s.LastError, s.LastErrorAt = c.lastErr, c.errAt
	c.mu.Unlock()
	return s
}

// Close stops the goroutine, waiting for the message being applied, and unregisters the metrics.
// Idempotent; the error is the metrics' unregistration's.
func (c *Consumer) Close() error {
	var err error
	c.once.Do(func() {
		c.mu.Lock()
		c.closed = true
		started := c.started
		it := c.iter
		close(c.seqCond)
		c.seqCond = make(chan struct{})
		c.mu.Unlock()
		close(c.stop)
		if started {
			c.cancel()
			if it != nil {
				it.Stop()
			}
			<-c.done
		}
		if c.reg != nil {
			err = c.reg.Unregister()
		}
	})
	return err
}
