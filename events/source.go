package events

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/kvroute/kvroute/events/internal/run"
	"github.com/kvroute/kvroute/telemetry"
)

// scopeName is the instrumentation scope of the package's metrics.
const scopeName = "github.com/kvroute/kvroute/events"

// Errors callers branch on.
var (
	// ErrInvalidConfig is wrapped by the transports' constructors' errors (NewSSEConsumer,
	// zmqevents.New) for a configuration they reject.
	ErrInvalidConfig = errors.New("events: invalid config")
	// ErrClosed is returned by a transport's Start after Close.
	ErrClosed = run.ErrClosed // "events: consumer closed"
	// ErrStarted is returned by a transport's Start after a successful Start.
	ErrStarted = run.ErrStarted // "events: consumer already started"
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

// SourceStatus is a snapshot of one event source (Source.Status): an engine endpoint in ZMQ
// connect mode, a backend seen on one bound address in ZMQ bind mode (one status per address and
// backend), an SSE stream, or a source of another transport. Its JSON form carries what the
// kvroute's GET /admin/kv-index/backends shows per backend ("backend_name", "connection":
// {"connected", "reconnect_count", "last_event_at"}, "events": {"received", "dropped", …}); the
// index's own counts (index_created, …) come from the index.
type SourceStatus struct {
	Backend   string `json:"backend_name"`
	Transport string `json:"transport"` // "zmq", "sse", or another transport's name
	Endpoint  string `json:"endpoint"`  // the URL, the engine endpoint, or the bound address
	Topic     string `json:"topic,omitempty"`

	Connection ConnectionStatus `json:"connection"`
	Events     Stats            `json:"events"`
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

// Stats counts a source's events. Received = Processed + Dropped once the queue is empty.
type Stats struct {
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
	// replay endpoint kept from before it were applied (zmqevents.Config.CatchUpBatches).
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
	// ResetsLimited counts the resets this source's publishers asked for (a gap, a sequence
	// that went back, a lost connection) that were not made because the backend had used its
	// reset budget (zmqevents.Config.MaxResetsPerMinute): a publisher that keeps breaking its
	// sequence, or anyone who can reach a bound address, cannot keep clearing the backend.
	ResetsLimited uint64 `json:"resets_limited"`
}

// SourceInfo names an event source: the backend its events belong to, its transport ("sse",
// "zmq", or the name of another transport), its endpoint (a URL, an engine address, a bound
// address, a subject) and, when it has one, its topic. It is reported as is in SourceStatus.
type SourceInfo struct {
	Backend   string
	Transport string
	Endpoint  string
	Topic     string
}

// Source is one event source's counters and state: what Status reports, and for a source of a
// SourceSet what the set's metrics report. It is the bookkeeping a transport keeps per source
// (an engine stream, a subscription, one backend's messages on a bound address): the transport
// sets its state as it connects and disconnects, records errors, counts what it receives and
// decodes, and passes it to BackendWriter.Apply, which counts what the sink took.
//
// The counters are atomics that any goroutine may update, and every method is safe for
// concurrent use. A Source must not be copied. The zero value is a source with an empty
// SourceInfo, in state StateConnecting, on the wall clock; NewSource and SourceSet.Add name it.
type Source struct {
	// Counters of Stats. A transport adds Received for every event of a decodable message
	// (events the decoder skipped included), Malformed for undecodable input (whole messages, and
	// skipped events, which it also adds to Dropped), Dropped for events it received but will
	// not apply (a full queue, skipped events), and Oversized for input over its size cap.
	// BackendWriter.Apply adds Processed and Dropped for the events it applied or not.
	Received, Processed, Dropped, Malformed, Oversized atomic.Uint64
	// Counters of SequenceStats, for a transport that numbers its batches: Batches (well-framed
	// messages), LastSeq (stored, not added), Gaps, Replays, ReplayFailures, CatchUps,
	// CatchUpFailures, CaughtUpBatches and QueueOverflows. BackendWriter.Apply adds Resets.
	Batches, LastSeq, Gaps, Replays, ReplayFailures atomic.Uint64
	CatchUps, CatchUpFailures, CaughtUpBatches      atomic.Uint64
	Resets, QueueOverflows                          atomic.Uint64
	// ResetsLimited is SequenceStats.ResetsLimited: resets a transport did not request of the
	// BackendWriter because the backend's reset budget was spent.
	ResetsLimited atomic.Uint64
	// Reconnects is ConnectionStatus.ReconnectCount: connection attempts after the first one,
	// or returns of a publisher after it disconnected.
	Reconnects atomic.Uint64

	info  SourceInfo
	now   func() time.Time // nil: time.Now
	attrs *backendAttrs    // nil: not reported as metrics

	state                       atomic.Uint32 // stateAt index
	lastEventAt, connectedSince atomic.Int64  // unix nanoseconds, 0 = never
	everConnected               atomic.Bool
	lastWarnAt                  atomic.Int64 // unix nanoseconds of the last rate-limited Warn

	mu        sync.Mutex
	lastErr   string
	lastErrAt time.Time
}

// NewSource returns a source that is reported on its own, not by a SourceSet's metrics (the
// status of a bound socket, say, which belongs to no backend); now is the clock of its status
// timestamps (nil: time.Now).
func NewSource(info SourceInfo, now func() time.Time) *Source {
	return &Source{info: info, now: now}
}

// Info returns the source's name, as given to NewSource or SourceSet.Add.
func (s *Source) Info() SourceInfo { return s.info }

func (s *Source) clock() time.Time {
	if s.now == nil {
		return time.Now()
	}
	return s.now()
}

// SetState records a state change; entering StateConnected stamps ConnectedSince and marks the
// source as connected once (EverConnected), any other state clears ConnectedSince.
func (s *Source) SetState(st SourceState) {
	for i := range numStates {
		if stateAt(i) == st {
			s.state.Store(uint32(i))
		}
	}
	if st == StateConnected {
		s.connectedSince.Store(s.clock().UnixNano())
		s.everConnected.Store(true)
	} else {
		s.connectedSince.Store(0)
	}
}

// State returns the current state.
func (s *Source) State() SourceState { return stateAt(int(s.state.Load())) }

// EverConnected reports whether the source has been in StateConnected: a transport that
// connects again counts a reconnection (Reconnects) or clears its backend.
func (s *Source) EverConnected() bool { return s.everConnected.Load() }

// SetError records err, with the time, as the source's LastError; a nil err is ignored.
func (s *Source) SetError(err error) {
	if err == nil {
		return
	}
	msg, at := err.Error(), s.clock()
	s.mu.Lock()
	s.lastErr, s.lastErrAt = msg, at
	s.mu.Unlock()
}

// warnEvery is the least interval between two rate-limited Warn lines of one source (dropped
// batches, oversized events): a publisher that sends nothing else must not flood the log.
const warnEvery = 5 * time.Second

// WarnDue reports whether the source may log a rate-limited Warn now (at most one every 5 s), and
// if so records it: a transport calls it before logging a problem that a publisher can repeat
// at every message (dropped batches, oversized events, unknown topics).
func (s *Source) WarnDue() bool {
	now := s.clock().UnixNano()
	last := s.lastWarnAt.Load()
	if last != 0 && now-last < int64(warnEvery) {
		return false
	}
	return s.lastWarnAt.CompareAndSwap(last, now)
}

// Touch stamps LastEventAt: a message with events arrived.
func (s *Source) Touch() { s.lastEventAt.Store(s.clock().UnixNano()) }

func unixNanoTime(ns int64) time.Time {
	if ns == 0 {
		return time.Time{}
	}
	return time.Unix(0, ns).UTC()
}

// Status returns a snapshot of the source.
func (s *Source) Status() SourceStatus {
	st := s.State()
	out := SourceStatus{
		Backend:   s.info.Backend,
		Transport: s.info.Transport,
		Endpoint:  s.info.Endpoint,
		Topic:     s.info.Topic,
		Connection: ConnectionStatus{
			Connected:      st == StateConnected,
			State:          st,
			ReconnectCount: s.Reconnects.Load(),
			ConnectedSince: unixNanoTime(s.connectedSince.Load()),
			LastEventAt:    unixNanoTime(s.lastEventAt.Load()),
		},
		Events: Stats{
			Received:  s.Received.Load(),
			Processed: s.Processed.Load(),
			Dropped:   s.Dropped.Load(),
			Malformed: s.Malformed.Load(),
			Oversized: s.Oversized.Load(),
		},
		Sequence: SequenceStats{
			Batches:         s.Batches.Load(),
			LastSeq:         s.LastSeq.Load(),
			Gaps:            s.Gaps.Load(),
			Replays:         s.Replays.Load(),
			ReplayFailures:  s.ReplayFailures.Load(),
			CatchUps:        s.CatchUps.Load(),
			CatchUpFailures: s.CatchUpFailures.Load(),
			CaughtUpBatches: s.CaughtUpBatches.Load(),
			Resets:          s.Resets.Load(),
			QueueOverflows:  s.QueueOverflows.Load(),
			ResetsLimited:   s.ResetsLimited.Load(),
		},
	}
	s.mu.Lock()
	out.LastError, out.LastErrorAt = s.lastErr, s.lastErrAt
	s.mu.Unlock()
	return out
}

// SourceSet is a transport's sources, reported together: Status lists them in the order they
// were added, and the metrics (RegisterMetrics) report them per backend, summing the counters of
// a backend's sources and reporting its connection by its worst source. A transport holds one
// set, adds a Source per source as it learns of it, and closes the set in its Close.
//
// Safe for concurrent use. The zero value is an empty set on the wall clock; NewSourceSet
// injects a clock. A SourceSet must not be copied.
type SourceSet struct {
	now func() time.Time // nil: time.Now

	mu      sync.Mutex
	sources []*Source
	attrs   map[string]*backendAttrs
	reg     metric.Registration // set by RegisterMetrics
	closed  bool
}

// NewSourceSet returns an empty set whose sources stamp their status with now (nil: time.Now).
func NewSourceSet(now func() time.Time) *SourceSet { return &SourceSet{now: now} }

// backendAttrs are one backend's pre-built attribute options.
type backendAttrs struct {
	backend string
	opt     metric.ObserveOption
	status  [numStates]metric.ObserveOption
}

// attrsFor returns the backend's attribute options, building them once. Called with r.mu held.
func (r *SourceSet) attrsFor(backend string) *backendAttrs {
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

// Add returns a new source of the set, reported under info.Backend. Several sources may share a
// backend (one per data-parallel rank, or per bound address): each has its own status, and the
// metrics add them up.
func (r *SourceSet) Add(info SourceInfo) *Source {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := &Source{info: info, now: r.now, attrs: r.attrsFor(info.Backend)}
	r.sources = append(r.sources, s)
	return s
}

// snapshot returns the current sources; the slice is the caller's.
func (r *SourceSet) snapshot() []*Source {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*Source(nil), r.sources...)
}

// Status returns the status of every source, in the order they were added. It never blocks on
// anything but the set's lock.
func (r *SourceSet) Status() []SourceStatus {
	srcs := r.snapshot()
	out := make([]SourceStatus, len(srcs))
	for i, s := range srcs {
		out[i] = s.Status()
	}
	return out
}

// Close marks every source StateClosed and unregisters the metrics callback, if any. It is
// idempotent and returns the error of unregistering the callback.
func (r *SourceSet) Close() error {
	r.mu.Lock()
	reg, first := r.reg, !r.closed
	r.closed, r.reg = true, nil
	r.mu.Unlock()
	for _, s := range r.snapshot() {
		s.SetState(StateClosed)
	}
	if !first || reg == nil {
		return nil
	}
	return reg.Unregister()
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

// RegisterMetrics registers the set's observable instruments (scopeName and the Metric* names)
// on mp, and a callback that reports the sources at each collection: per backend, the counters
// summed over its sources (received, processed, dropped, reconnects, gaps, resets, resets
// limited) and its connection by
// its worst source (connected, and the source-status gauge). The counters report the atomics
// Status reads, so counting an event costs a transport one atomic add and no OpenTelemetry call.
// A nil mp registers nothing. Call it at most once, before or after adding sources; Close
// unregisters the callback. The error is the MeterProvider's, wrapped; nothing is left
// registered then.
func (r *SourceSet) RegisterMetrics(mp metric.MeterProvider) error {
	if mp == nil {
		mp = noop.NewMeterProvider()
	}
	meter := mp.Meter(scopeName)
	counter := func(name, desc, unit string) (metric.Int64ObservableCounter, error) {
		c, err := meter.Int64ObservableCounter(name, metric.WithDescription(desc), metric.WithUnit(unit))
		if err != nil {
			return nil, fmt.Errorf("events: metric %s: %w", name, err)
		}
		return c, nil
	}
	received, err := counter(telemetry.MetricEventReceived, "KV events received per backend.", "{event}")
	if err != nil {
		return err
	}
	processed, err := counter(telemetry.MetricEventProcessed, "KV events successfully applied to the index per backend.", "{event}")
	if err != nil {
		return err
	}
	dropped, err := counter(telemetry.MetricEventDropped, "KV events dropped per backend (queue backpressure, undecodable, sink errors).", "{event}")
	if err != nil {
		return err
	}
	reconnects, err := counter(telemetry.MetricConsumerReconnects, "Event-stream reconnection attempts per backend.", "{reconnect}")
	if err != nil {
		return err
	}
	gaps, err := counter(telemetry.MetricConsumerGaps, "Sequence gaps detected per backend (replayed or reset).", "{gap}")
	if err != nil {
		return err
	}
	resets, err := counter(telemetry.MetricConsumerResets, "Clears of a backend's index entries its event sources caused (unreplayable gaps, publisher restarts, lost connections).", "{reset}")
	if err != nil {
		return err
	}
	resetsLimited, err := counter(telemetry.MetricConsumerResetsLimited, "Resets a backend's publishers asked for beyond its reset budget, not made.", "{reset}")
	if err != nil {
		return err
	}
	connected, err := meter.Int64ObservableGauge(telemetry.MetricConsumerConnected,
		metric.WithDescription("1 when every event source of the backend is connected."))
	if err != nil {
		return fmt.Errorf("events: metric %s: %w", telemetry.MetricConsumerConnected, err)
	}
	status, err := meter.Int64ObservableGauge(telemetry.MetricEventSourceStatus,
		metric.WithDescription("Event source connection status per backend: 1 for the current status, 0 for the others."))
	if err != nil {
		return fmt.Errorf("events: metric %s: %w", telemetry.MetricEventSourceStatus, err)
	}
	type agg struct {
		received, processed, dropped, reconnects, gaps int64
		resets, resetsLimited                          int64
		worst                                          SourceState
	}
	reg, err := meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
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
			a.received += int64(s.Received.Load())
			a.processed += int64(s.Processed.Load())
			a.dropped += int64(s.Dropped.Load())
			a.reconnects += int64(s.Reconnects.Load())
			a.gaps += int64(s.Gaps.Load())
			a.resets += int64(s.Resets.Load())
			a.resetsLimited += int64(s.ResetsLimited.Load())
			if st := s.State(); stateRank(st) > stateRank(a.worst) {
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
			o.ObserveInt64(resets, a.resets, attrs.opt)
			o.ObserveInt64(resetsLimited, a.resetsLimited, attrs.opt)
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
	}, received, processed, dropped, reconnects, gaps, resets, resetsLimited, connected, status)
	if err != nil {
		return fmt.Errorf("events: metric callback: %w", err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case r.reg != nil:
		_ = reg.Unregister()
		return errors.New("events: SourceSet.RegisterMetrics called twice")
	case r.closed:
		return reg.Unregister() // closed meanwhile: report nothing
	}
	r.reg = reg
	return nil
}

// ListenerStatus is a snapshot of an address a transport binds and that receives messages for
// several backends (ZMQ bind mode: zmqevents.Consumer.Listeners): whether it is bound, and what
// it received before a message was placed on a backend. A placed message is then counted, event
// by event, on its backend's source (SourceStatus); an unplaced or malformed one belongs to no
// backend and is counted only here, so that events dropped for want of a backend show where an
// operator looks.
type ListenerStatus struct {
	Transport string `json:"transport"`
	// Endpoint is the address as configured; Bound the address bound (the port resolved, the
	// host a default bind chose), absent while unbound.
	Endpoint   string           `json:"endpoint"`
	Bound      string           `json:"bound,omitempty"`
	Connection ConnectionStatus `json:"connection"` // connected while bound
	Messages   ListenerMessages `json:"messages"`
	// LastError is the last error met: a failed bind or handshake, a message that could not be
	// placed; "" for none.
	LastError   string    `json:"last_error,omitempty"`
	LastErrorAt time.Time `json:"last_error_at,omitzero"`
}

// ListenerMessages counts the messages a bound address received (within the subscription's topic
// prefix): Received = Placed + Unplaced + Malformed.
type ListenerMessages struct {
	Received uint64 `json:"received"`
	// Placed counts the messages given to a backend (its source counts their events, and what
	// was dropped of them).
	Placed uint64 `json:"placed"`
	// Unplaced counts the messages dropped because no backend could be found for them: a topic
	// that the address's rules map to no backend, or a new topic beyond the transport's cap.
	Unplaced uint64 `json:"unplaced"`
	// Malformed counts the messages dropped because their framing was bad (not [topic, 8-byte
	// sequence, payload]): their topic, and so their backend, is unknown.
	Malformed uint64 `json:"malformed"`
}
