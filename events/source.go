package events

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
)

// Instrumentation scope and metric names of the consumers. They follow kvroute's Tier-4 list
// with the kvroute prefix in OpenTelemetry style; a Prometheus exporter renders them as
// kvroute_kv_event_received_total, kvroute_kv_consumer_connected, … Every instrument carries a
// "backend" attribute; the source-status gauge also carries "status" (one of the SourceState
// values, 1 for the current state and 0 for the others).
//
// The counters are observable: they report the same atomics Status reads, so counting an event
// costs one atomic add and no OpenTelemetry call.
const (
	ScopeName = "github.com/kvroute/kvroute/events"

	MetricEventReceived      = "kvroute.kv_event.received"
	MetricEventProcessed     = "kvroute.kv_event.processed"
	MetricEventDropped       = "kvroute.kv_event.dropped"
	MetricConsumerConnected  = "kvroute.kv_consumer.connected"
	MetricConsumerReconnects = "kvroute.kv_consumer.reconnects"
	MetricConsumerGaps       = "kvroute.kv_consumer.sequence_gaps"
	MetricEventSourceStatus  = "kvroute.kv_index.event_source_status"
)

// Errors callers branch on.
var (
	// ErrInvalidConfig is wrapped by the constructors' errors for a configuration they reject.
	ErrInvalidConfig = errors.New("events: invalid config")
	// ErrClosed is returned by Start after Close.
	ErrClosed = errors.New("events: consumer closed")
	// ErrStarted is returned by Start after a successful Start.
	ErrStarted = errors.New("events: consumer already started")
)

// SourceState is the connection state of an event source.
type SourceState string

// Source states, as reported in ConnectionStatus.State and the event-source-status gauge.
const (
	StateConnecting   SourceState = "connecting"   // dialing, or not started yet
	StateConnected    SourceState = "connected"    // receiving (bind mode: a publisher of this backend is connected)
	StateDisconnected SourceState = "disconnected" // lost or failed; waiting for the next attempt
	StateClosed       SourceState = "closed"       // the consumer was closed
)

// numStates is the number of SourceState values; stateAt lists them in gauge order.
const numStates = 4

func stateAt(i int) SourceState {
	switch i {
	case 0:
		return StateConnecting
	case 1:
		return StateConnected
	case 2:
		return StateDisconnected
	default:
		return StateClosed
	}
}

// SourceStatus is a snapshot of one event source: an engine endpoint in ZMQ connect mode, a
// backend seen on one bound address in bind mode (one status per address and backend), or an SSE
// stream. Its JSON form carries what the
// kvroute's GET /admin/kv-index/backends shows per backend ("backend_name", "connection":
// {"connected", "reconnect_count", "last_event_at"}, "events": {"received", "dropped", …}); the
// index's own counts (index_created, …) come from the index.
type SourceStatus struct {
	Backend   string `json:"backend_name"`
	Transport string `json:"transport"` // "zmq" or "sse"
	Endpoint  string `json:"endpoint"`  // the URL, the engine endpoint, or the bound address
	Topic     string `json:"topic,omitempty"`

	Connection ConnectionStatus `json:"connection"`
	Events     EventStats       `json:"events"`
	Sequence   SequenceStats    `json:"sequence,omitzero"`

	// LastError is the last error the source met (dial, stream, decode or sink), "" for none.
	LastError   string    `json:"last_error,omitempty"`
	LastErrorAt time.Time `json:"last_error_at,omitzero"`
}

// ConnectionStatus is a source's connection state.
type ConnectionStatus struct {
	Connected bool        `json:"connected"`
	State     SourceState `json:"status"`
	// ReconnectCount counts connection attempts after the first one (ZMQ connect mode, SSE), or
	// returns of a publisher after it disconnected (ZMQ bind mode).
	ReconnectCount uint64    `json:"reconnect_count"`
	ConnectedSince time.Time `json:"connected_since,omitzero"`
	LastEventAt    time.Time `json:"last_event_at,omitzero"` // last message with events
}

// EventStats counts a source's events. Received = Processed + Dropped once the queue is empty.
type EventStats struct {
	// Received counts events that arrived in decodable messages (skipped events included).
	Received uint64 `json:"received"`
	// Processed counts events the sink applied without error.
	Processed uint64 `json:"processed"`
	// Dropped counts received events that were not applied: queue full (backpressure), skipped
	// by the decoder, sink error, or discarded while a reset was pending.
	Dropped uint64 `json:"dropped"`
	// Malformed counts undecodable input: whole messages (bad framing, not a batch, bad SSE
	// JSON) and events the decoder skipped inside an otherwise valid batch.
	Malformed uint64 `json:"malformed"`
	// Oversized counts SSE events dropped because they exceeded the buffer cap (1 MiB).
	Oversized uint64 `json:"oversized,omitempty"`
}

// SequenceStats describes a source's sequence tracking (ZMQ) and the resets of its backend.
type SequenceStats struct {
	Batches        uint64 `json:"batches"`  // well-framed messages received
	LastSeq        uint64 `json:"last_seq"` // sequence number of the last message received
	Gaps           uint64 `json:"gaps"`     // jumps forward in a publisher's sequence (queue overflows included)
	Replays        uint64 `json:"replays"`  // gaps filled by replay
	ReplayFailures uint64 `json:"replay_failures"`
	// CatchUps counts catch-ups that completed: on a publisher's first batch, the batches its
	// replay endpoint kept from before it were applied (ZMQConfig.CatchUpBatches).
	CatchUps        uint64 `json:"catch_ups"`
	CatchUpFailures uint64 `json:"catch_up_failures"`
	// CaughtUpBatches counts the batches the completed catch-ups applied.
	CaughtUpBatches uint64 `json:"caught_up_batches"`
	// Resets counts Sink.ClearBackend calls made for this source: publisher restarts (sequence
	// went back), gaps that could not be replayed, catch-ups that failed part-way, and recovery
	// after a sink error.
	Resets uint64 `json:"resets"`
	// QueueOverflows counts batches dropped because the backend's queue was full.
	QueueOverflows uint64 `json:"queue_overflows"`
}

// source holds one event source's counters and state. Counters are atomics written by the
// reader and worker goroutines and read by Status and the metrics callback.
type source struct {
	backend   string
	transport string
	endpoint  string
	topic     string
	now       func() time.Time
	attrs     *backendAttrs // nil: not reported as metrics

	received, processed, dropped, malformed, oversized atomic.Uint64
	batches, lastSeq, gaps, replays, replayFailures    atomic.Uint64
	catchUps, catchUpFailures, caughtUpBatches         atomic.Uint64
	resets, overflows, reconnects                      atomic.Uint64
	state                                              atomic.Uint32 // stateAt index
	lastEventAt, connectedSince                        atomic.Int64  // unix nanoseconds, 0 = never
	liveConns                                          atomic.Int64  // bind mode: open connections that carried this backend
	everConnected                                      atomic.Bool
	lastWarnAt                                         atomic.Int64 // unix nanoseconds of the last rate-limited Warn

	mu        sync.Mutex
	lastErr   string
	lastErrAt time.Time
}

func newSource(backend, transport, endpoint, topic string, now func() time.Time, attrs *backendAttrs) *source {
	return &source{backend: backend, transport: transport, endpoint: endpoint, topic: topic, now: now, attrs: attrs}
}

// setState records a state change; entering StateConnected stamps ConnectedSince.
func (s *source) setState(st SourceState) {
	for i := range numStates {
		if stateAt(i) == st {
			s.state.Store(uint32(i))
		}
	}
	if st == StateConnected {
		s.connectedSince.Store(s.now().UnixNano())
		s.everConnected.Store(true)
	} else {
		s.connectedSince.Store(0)
	}
}

func (s *source) getState() SourceState { return stateAt(int(s.state.Load())) }

// setError records err as the source's last error.
func (s *source) setError(err error) {
	if err == nil {
		return
	}
	msg, at := err.Error(), s.now()
	s.mu.Lock()
	s.lastErr, s.lastErrAt = msg, at
	s.mu.Unlock()
}

// warnEvery is the least interval between two rate-limited Warn lines of one source (dropped
// batches, oversized events): a publisher that sends nothing else must not flood the log.
const warnEvery = 5 * time.Second

// warnDue reports whether the source may log a rate-limited Warn now, and if so records it.
func (s *source) warnDue() bool {
	now := s.now().UnixNano()
	last := s.lastWarnAt.Load()
	if last != 0 && now-last < int64(warnEvery) {
		return false
	}
	return s.lastWarnAt.CompareAndSwap(last, now)
}

func (s *source) touch() { s.lastEventAt.Store(s.now().UnixNano()) }

func unixNanoTime(ns int64) time.Time {
	if ns == 0 {
		return time.Time{}
	}
	return time.Unix(0, ns).UTC()
}

// status returns a snapshot.
func (s *source) status() SourceStatus {
	st := s.getState()
	out := SourceStatus{
		Backend:   s.backend,
		Transport: s.transport,
		Endpoint:  s.endpoint,
		Topic:     s.topic,
		Connection: ConnectionStatus{
			Connected:      st == StateConnected,
			State:          st,
			ReconnectCount: s.reconnects.Load(),
			ConnectedSince: unixNanoTime(s.connectedSince.Load()),
			LastEventAt:    unixNanoTime(s.lastEventAt.Load()),
		},
		Events: EventStats{
			Received:  s.received.Load(),
			Processed: s.processed.Load(),
			Dropped:   s.dropped.Load(),
			Malformed: s.malformed.Load(),
			Oversized: s.oversized.Load(),
		},
		Sequence: SequenceStats{
			Batches:         s.batches.Load(),
			LastSeq:         s.lastSeq.Load(),
			Gaps:            s.gaps.Load(),
			Replays:         s.replays.Load(),
			ReplayFailures:  s.replayFailures.Load(),
			CatchUps:        s.catchUps.Load(),
			CatchUpFailures: s.catchUpFailures.Load(),
			CaughtUpBatches: s.caughtUpBatches.Load(),
			Resets:          s.resets.Load(),
			QueueOverflows:  s.overflows.Load(),
		},
	}
	s.mu.Lock()
	out.LastError, out.LastErrorAt = s.lastErr, s.lastErrAt
	s.mu.Unlock()
	return out
}

// registry is a consumer's set of sources and their per-backend metric attributes. Safe for
// concurrent use.
type registry struct {
	mu      sync.Mutex
	sources []*source
	attrs   map[string]*backendAttrs
}

// backendAttrs are one backend's pre-built attribute options.
type backendAttrs struct {
	backend string
	opt     metric.ObserveOption
	status  [numStates]metric.ObserveOption
}

// attrsFor returns the backend's attribute options, building them once. Called with r.mu held.
func (r *registry) attrsFor(backend string) *backendAttrs {
	if a := r.attrs[backend]; a != nil {
		return a
	}
	if r.attrs == nil {
		r.attrs = make(map[string]*backendAttrs)
	}
	a := &backendAttrs{
		backend: backend,
		opt:     metric.WithAttributeSet(attribute.NewSet(attribute.String("backend", backend))),
	}
	for i := range numStates {
		a.status[i] = metric.WithAttributeSet(attribute.NewSet(
			attribute.String("backend", backend), attribute.String("status", string(stateAt(i)))))
	}
	r.attrs[backend] = a
	return a
}

// add registers a new source whose metrics are reported under its backend.
func (r *registry) add(backend, transport, endpoint, topic string, now func() time.Time) *source {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := newSource(backend, transport, endpoint, topic, now, r.attrsFor(backend))
	r.sources = append(r.sources, s)
	return s
}

// snapshot returns the current sources; the slice is the caller's.
func (r *registry) snapshot() []*source {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*source(nil), r.sources...)
}

// statuses returns the status of every source, in registration order.
func (r *registry) statuses() []SourceStatus {
	srcs := r.snapshot()
	out := make([]SourceStatus, len(srcs))
	for i, s := range srcs {
		out[i] = s.status()
	}
	return out
}

// closeAll marks every source closed.
func (r *registry) closeAll() {
	for _, s := range r.snapshot() {
		s.setState(StateClosed)
		s.liveConns.Store(0)
	}
}

// consumerMetrics are a consumer's observable instruments.
type consumerMetrics struct {
	reg  metric.Registration
	once sync.Once
}

// stateRank orders states from best to worst, to report a backend with several sources (data-
// parallel ranks) by its worst one.
func stateRank(st SourceState) int {
	switch st {
	case StateConnected:
		return 0
	case StateConnecting:
		return 1
	case StateDisconnected:
		return 2
	default:
		return 3
	}
}

// newConsumerMetrics registers the instruments and a callback that reads r's sources. Sources
// sharing a backend are summed (counters) or reported by their worst state (gauges).
func newConsumerMetrics(mp metric.MeterProvider, r *registry) (*consumerMetrics, error) {
	if mp == nil {
		mp = noop.NewMeterProvider()
	}
	meter := mp.Meter(ScopeName)
	counter := func(name, desc, unit string) (metric.Int64ObservableCounter, error) {
		c, err := meter.Int64ObservableCounter(name, metric.WithDescription(desc), metric.WithUnit(unit))
		if err != nil {
			return nil, fmt.Errorf("events: metric %s: %w", name, err)
		}
		return c, nil
	}
	received, err := counter(MetricEventReceived, "KV events received per backend.", "{event}")
	if err != nil {
		return nil, err
	}
	processed, err := counter(MetricEventProcessed, "KV events successfully applied to the index per backend.", "{event}")
	if err != nil {
		return nil, err
	}
	dropped, err := counter(MetricEventDropped, "KV events dropped per backend (queue backpressure, undecodable, sink errors).", "{event}")
	if err != nil {
		return nil, err
	}
	reconnects, err := counter(MetricConsumerReconnects, "Event-stream reconnection attempts per backend.", "{reconnect}")
	if err != nil {
		return nil, err
	}
	gaps, err := counter(MetricConsumerGaps, "Sequence gaps detected per backend (replayed or reset).", "{gap}")
	if err != nil {
		return nil, err
	}
	connected, err := meter.Int64ObservableGauge(MetricConsumerConnected,
		metric.WithDescription("1 when every event source of the backend is connected."))
	if err != nil {
		return nil, fmt.Errorf("events: metric %s: %w", MetricConsumerConnected, err)
	}
	status, err := meter.Int64ObservableGauge(MetricEventSourceStatus,
		metric.WithDescription("Event source connection status per backend: 1 for the current status, 0 for the others."))
	if err != nil {
		return nil, fmt.Errorf("events: metric %s: %w", MetricEventSourceStatus, err)
	}
	type agg struct {
		received, processed, dropped, reconnects, gaps int64
		worst                                          SourceState
	}
	m := &consumerMetrics{}
	m.reg, err = meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		srcs := r.snapshot()
		byBackend := make(map[*backendAttrs]*agg, len(srcs))
		order := make([]*backendAttrs, 0, len(srcs))
		for _, s := range srcs {
			if s.attrs == nil {
				continue
			}
			a := byBackend[s.attrs]
			if a == nil {
				a = &agg{worst: StateConnected}
				byBackend[s.attrs] = a
				order = append(order, s.attrs)
			}
			a.received += int64(s.received.Load())
			a.processed += int64(s.processed.Load())
			a.dropped += int64(s.dropped.Load())
			a.reconnects += int64(s.reconnects.Load())
			a.gaps += int64(s.gaps.Load())
			if st := s.getState(); stateRank(st) > stateRank(a.worst) {
				a.worst = st
			}
		}
		for _, attrs := range order {
			a := byBackend[attrs]
			o.ObserveInt64(received, a.received, attrs.opt)
			o.ObserveInt64(processed, a.processed, attrs.opt)
			o.ObserveInt64(dropped, a.dropped, attrs.opt)
			o.ObserveInt64(reconnects, a.reconnects, attrs.opt)
			o.ObserveInt64(gaps, a.gaps, attrs.opt)
			var up int64
			if a.worst == StateConnected {
				up = 1
			}
			o.ObserveInt64(connected, up, attrs.opt)
			for i := range numStates {
				var v int64
				if stateAt(i) == a.worst {
					v = 1
				}
				o.ObserveInt64(status, v, attrs.status[i])
			}
		}
		return nil
	}, received, processed, dropped, reconnects, gaps, connected, status)
	if err != nil {
		return nil, fmt.Errorf("events: metric callback: %w", err)
	}
	return m, nil
}

// close unregisters the callback; idempotent.
func (m *consumerMetrics) close() error {
	var err error
	m.once.Do(func() {
		if m.reg != nil {
			err = m.reg.Unregister()
		}
	})
	return err
}

// backoff is an exponential backoff with ±20% jitter. Not safe for concurrent use.
type backoff struct {
	initial, max, cur time.Duration
}

// next returns the delay before the next attempt and doubles the base, up to max.
func (b *backoff) next() time.Duration {
	if b.cur == 0 {
		b.cur = b.initial
	} else {
		b.cur = min(b.cur*2, b.max)
	}
	d := b.cur
	if j := int64(d) * 2 / 5; j > 0 {
		d += time.Duration(rand.Int64N(j+1) - j/2)
	}
	return min(max(d, time.Millisecond), b.max)
}

// reset makes the next delay the initial one again (after a successful connection).
func (b *backoff) reset() { b.cur = 0 }

// sleepCtx waits d or until ctx ends; it reports whether the full delay elapsed.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// lifecycle is the Start/Close state shared by the consumers: a context cancelled by Close and
// the goroutines Close waits for.
type lifecycle struct {
	mu      sync.Mutex
	started bool
	closed  bool
	ctx     context.Context
	cancel  context.CancelFunc
	wg      sync.WaitGroup
}

func (l *lifecycle) init() {
	l.ctx, l.cancel = context.WithCancel(context.Background())
}

// start runs launch (which starts the goroutines with goTracked) under the lock, so that a
// concurrent shutdown waits for every goroutine launch started. It fails after Close or after a
// successful start, and returns launch's error (launch must then have started nothing).
func (l *lifecycle) start(launch func() error) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.closed:
		return ErrClosed
	case l.started:
		return ErrStarted
	}
	if err := launch(); err != nil {
		return err
	}
	l.started = true
	return nil
}

// goTracked runs f as a goroutine Close waits for.
func (l *lifecycle) goTracked(f func()) {
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		f()
	}()
}

// shutdown cancels the context and waits for the goroutines; it reports whether this call was
// the first.
func (l *lifecycle) shutdown() bool {
	l.mu.Lock()
	first := !l.closed
	l.closed = true
	l.mu.Unlock()
	l.cancel()
	l.wg.Wait()
	return first
}

// discardLogger returns l, or a logger that drops everything when l is nil.
func discardLogger(l *slog.Logger) *slog.Logger {
	if l != nil {
		return l
	}
	return slog.New(slog.DiscardHandler)
}

// backendWriter applies one backend's batches to the sink. It is owned by one goroutine at a
// time (the Sink contract: one goroutine per backend). After a failed Apply, or when a reset was
// requested (sequence gap, publisher restart), it clears the backend before it applies anything
// else, so that the sink never builds on a view with a hole in it.
type backendWriter struct {
	sink      Sink
	backend   string
	needClear bool
	clears    uint64 // successful ClearBackend calls
}

// requestReset makes the next apply clear the backend first.
func (w *backendWriter) requestReset() { w.needClear = true }

// apply delivers b (pending reset first) and counts the outcome on src. It reports whether b
// was applied. A batch without events only performs the pending reset.
func (w *backendWriter) apply(ctx context.Context, src *source, b *Batch) bool {
	n := uint64(len(b.Events))
	if w.needClear {
		if err := w.sink.ClearBackend(ctx, w.backend); err != nil {
			src.setError(fmt.Errorf("sink clear backend %q: %w", w.backend, err))
			src.dropped.Add(n)
			return false
		}
		w.needClear = false
		w.clears++
		src.resets.Add(1)
	}
	if n == 0 {
		return true
	}
	if err := w.sink.Apply(ctx, w.backend, b); err != nil {
		src.setError(fmt.Errorf("sink apply: %w", err))
		src.dropped.Add(n)
		if ctx.Err() == nil {
			w.needClear = true // the sink missed these events: its view has a hole
		}
		return false
	}
	src.processed.Add(n)
	return true
}
