package natsync

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/metric"

	"github.com/kvroute/kvroute"
)

// Defaults of Config's fields.
const (
	DefaultSubjectPrefix   = "kvroute.replicas"
	DefaultGroup           = "default"
	DefaultHeartbeat       = time.Second
	DefaultBufferSize      = 8192
	DefaultBufferBytes     = 8 << 20
	DefaultFlushInterval   = 5 * time.Millisecond
	DefaultMaxMessageBytes = 64 << 10
)

// Bounds of Config's fields.
const (
	// minMessageBytes leaves room for a header, a routed event with the longest backend name and
	// some of its keys.
	minMessageBytes = 4 << 10
	maxMessageBytes = 1 << 20 // NATS's default max_payload
	// receiveBuffer is the number of messages the subscription holds for the receiving goroutine;
	// beyond it NATS drops messages (a slow consumer), which the receivers see as a sequence gap.
	receiveBuffer = 1024
	// closeTimeout bounds how long Close waits for the server to take its last messages.
	closeTimeout = 2 * time.Second
	// startTimeout bounds Start's wait for the server to confirm its subscription when ctx has no
	// deadline.
	startTimeout = 5 * time.Second
	// freeBuffers is how many spare batch buffers a Sync keeps for reuse.
	freeBuffers = 16
)

// Errors.
var (
	// ErrInvalidConfig is wrapped by New's errors for a Config it refuses.
	ErrInvalidConfig = errors.New("natsync: invalid config")
	// ErrStarted is Start's error when the Sync has started already.
	ErrStarted = errors.New("natsync: already started")
	// ErrClosed is Start's error after Close.
	ErrClosed = errors.New("natsync: closed")
)

// Applier receives the decision events of the other replicas, and is told to forget a replica
// when it stops. *kvroute.DefaultRouter implements it; a Sync calls it from one goroutine of its
// own, never while holding a lock.
type Applier interface {
	// ApplyPeerEvent applies ev, an event of replica. ev.BlockKeys is the Applier's to keep.
	ApplyPeerEvent(replica string, ev kvroute.PeerEvent)
	// ForgetPeer drops every decision of replica and returns how many it dropped.
	ForgetPeer(replica string) int
}

var _ Applier = (*kvroute.DefaultRouter)(nil)

// NopApplier applies nothing: a Sync started with it shares its own router's decisions and
// ignores the others'.
type NopApplier struct{}

// ApplyPeerEvent does nothing.
func (NopApplier) ApplyPeerEvent(string, kvroute.PeerEvent) {}

// ForgetPeer does nothing and returns 0.
func (NopApplier) ForgetPeer(string) int { return 0 }

var (
	_ Applier               = NopApplier{}
	_ kvroute.PeerPublisher = (*Sync)(nil)
)

// Config configures a Sync. Conn or URL is required; every other field has a default.
type Config struct {
	// Conn is the NATS connection to use. The caller owns it: a Sync neither changes its options
	// nor closes it, and its reconnection policy is the caller's (kvroute's advice: reconnect
	// forever, nats.MaxReconnects(-1)). Several Syncs may share one connection.
	Conn *nats.Conn
	// URL is the NATS server (or comma-separated servers) to dial when Conn is nil. The Sync owns
	// that connection: it reconnects forever (a reconnect attempt every 500 ms, with jitter),
	// retries a failed first connection the same way, so that New succeeds while the server is
	// down, does not echo its own messages, and Close closes it.
	URL string
	// Options are added to the Sync's own when it dials URL (credentials, TLS, a name), and
	// override them.
	Options []nats.Option

	// SubjectPrefix and Group make the subject the replicas of one fleet share:
	// "<SubjectPrefix>.<Group>". The prefix is one or more dot-separated tokens, the group one
	// token; no wildcards (* and >), white space or control characters. "" means
	// DefaultSubjectPrefix ("kvroute.replicas") and DefaultGroup ("default").
	SubjectPrefix string
	Group         string
	// ReplicaID names this replica among its group's, at most MaxReplicaIDLen bytes; "" means a
	// random id, unique per Sync. Replicas with the same id ignore each other's messages.
	ReplicaID string

	// Heartbeat is how often the Sync tells its peers it is alive; 0 means DefaultHeartbeat (1 s).
	Heartbeat time.Duration
	// PeerTimeout is how long a peer may stay silent before it is forgotten (Applier.ForgetPeer);
	// 0 means 3 × Heartbeat. It must exceed Heartbeat, and should exceed the peers' Heartbeat.
	PeerTimeout time.Duration

	// BufferSize and BufferBytes bound the events PublishPeerEvent holds until they are sent,
	// in events and in encoded bytes; beyond either, events are dropped (Stats.Dropped). 0 means
	// DefaultBufferSize (8192) and DefaultBufferBytes (8 MiB).
	BufferSize  int
	BufferBytes int
	// FlushInterval is how long an event may wait for others to share its message; 0 means
	// DefaultFlushInterval (5 ms). At most Heartbeat.
	FlushInterval time.Duration
	// MaxMessageBytes is the largest message sent; a batch that reaches it is sent at once. 0
	// means DefaultMaxMessageBytes (64 KiB); valid 4 KiB to 1 MiB, and no more than the server's
	// max_payload (New lowers it to that when it is connected).
	MaxMessageBytes int

	// MeterProvider receives the Sync's metrics (see telemetry.MetricNatsyncEvents); nil means none.
	MeterProvider metric.MeterProvider
	// Logger receives peer arrivals and departures, connection losses and the first malformed
	// message; nil means none.
	Logger *slog.Logger
}

func (c Config) withDefaults() (Config, error) {
	if c.SubjectPrefix == "" {
		c.SubjectPrefix = DefaultSubjectPrefix
	}
	if c.Group == "" {
		c.Group = DefaultGroup
	}
	if c.ReplicaID == "" {
		var b [8]byte
		_, _ = rand.Read(b[:]) // never fails (crypto/rand)
		c.ReplicaID = hex.EncodeToString(b[:])
	}
	if c.Heartbeat == 0 {
		c.Heartbeat = DefaultHeartbeat
	}
	if c.PeerTimeout == 0 {
		c.PeerTimeout = 3 * c.Heartbeat
	}
	if c.BufferSize == 0 {
		c.BufferSize = DefaultBufferSize
	}
	if c.BufferBytes == 0 {
		c.BufferBytes = DefaultBufferBytes
	}
	if c.FlushInterval == 0 {
		c.FlushInterval = DefaultFlushInterval
	}
	if c.MaxMessageBytes == 0 {
		c.MaxMessageBytes = DefaultMaxMessageBytes
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	switch {
	case c.Conn == nil && c.URL == "":
		return c, fmt.Errorf("%w: neither Conn nor URL", ErrInvalidConfig)
	case c.Conn != nil && c.URL != "":
		return c, fmt.Errorf("%w: both Conn and URL", ErrInvalidConfig)
	case c.Conn != nil && len(c.Options) > 0:
		return c, fmt.Errorf("%w: Options apply to a connection dialled from URL, not to Conn", ErrInvalidConfig)
	}
	for _, tok := range strings.Split(c.SubjectPrefix, ".") {
		if !validToken(tok) {
			return c, fmt.Errorf("%w: SubjectPrefix %q is not dot-separated subject tokens without wildcards", ErrInvalidConfig, c.SubjectPrefix)
		}
	}
	if !validToken(c.Group) {
		return c, fmt.Errorf("%w: Group %q is not one subject token without wildcards", ErrInvalidConfig, c.Group)
	}
	if len(c.ReplicaID) > MaxReplicaIDLen {
		return c, fmt.Errorf("%w: ReplicaID is %d bytes, above %d", ErrInvalidConfig, len(c.ReplicaID), MaxReplicaIDLen)
	}
	if c.Heartbeat < time.Millisecond {
		return c, fmt.Errorf("%w: Heartbeat %v is below 1ms", ErrInvalidConfig, c.Heartbeat)
	}
	if c.PeerTimeout <= c.Heartbeat {
		return c, fmt.Errorf("%w: PeerTimeout %v does not exceed Heartbeat %v", ErrInvalidConfig, c.PeerTimeout, c.Heartbeat)
	}
	if c.BufferSize < 1 || c.BufferBytes < 1 {
		return c, fmt.Errorf("%w: BufferSize %d and BufferBytes %d must be positive", ErrInvalidConfig, c.BufferSize, c.BufferBytes)
	}
	if c.FlushInterval < 0 || c.FlushInterval > c.Heartbeat {
		return c, fmt.Errorf("%w: FlushInterval %v not in (0, Heartbeat]", ErrInvalidConfig, c.FlushInterval)
	}
	if c.MaxMessageBytes < minMessageBytes || c.MaxMessageBytes > maxMessageBytes {
		return c, fmt.Errorf("%w: MaxMessageBytes %d not in [%d, %d]", ErrInvalidConfig, c.MaxMessageBytes, minMessageBytes, maxMessageBytes)
	}
	return c, nil
}

// validToken reports whether tok is a NATS subject token a Sync accepts: not empty, no wildcard,
// separator, white space or control character.
func validToken(tok string) bool {
	if tok == "" {
		return false
	}
	for _, r := range tok {
		if r == '*' || r == '>' || r == '.' || unicode.IsSpace(r) || unicode.IsControl(r) || r == unicode.ReplacementChar {
			return false
		}
	}
	return true
}

// Sync shares a router's decisions with the other replicas of its group over NATS, and applies
// theirs to it. Its methods are safe for concurrent use.
//
// Build it with New, give it to the router as kvroute.Config.Peers, then Start it with the
// router (see the package example); Close it when the router stops. Between New and Start,
// PublishPeerEvent buffers (and drops beyond the buffer); Start launches two goroutines, one
// sending, one receiving, that Close stops.
type Sync struct {
	cfg     Config
	nc      *nats.Conn
	owned   bool // nc was dialled by New: Close closes it
	subject string
	log     *slog.Logger
	hdrLen  int
	maxMsg  int // MaxMessageBytes, lowered to the server's max_payload

	// The outbox: events PublishPeerEvent encoded, waiting for the sender. Guarded by mu.
	mu        sync.Mutex
	cur       []byte   // the batch being filled: hdrLen bytes of room, then events
	curEvents int      // events in cur
	sealed    [][]byte // full batches waiting
	spare     [][]byte // sealed's other backing array, swapped by the sender
	free      [][]byte // batch buffers to reuse
	pending   int      // events in cur and sealed
	pendBytes int      // their encoded bytes
	lost      bool     // events were dropped since the last send
	closed    bool     // Close has begun: PublishPeerEvent drops

	kick chan struct{} // tells the sender that a batch began or filled

	// Lifecycle, guarded by life.
	life    sync.Mutex
	started bool
	stopped bool
	stop    chan struct{}
	wg      sync.WaitGroup
	applier Applier
	sub     *nats.Subscription
	msgs    chan *nats.Msg
	closeMu sync.Mutex // serialises Close's callers
	closeEr error
	didStop bool

	// Peers heard from, guarded by pmu: written by the receiving goroutine, read by Stats.
	pmu   sync.Mutex
	peers map[string]*peer

	// The sending goroutine's own.
	seq uint64

	// The receiving goroutine's own.
	events []kvroute.PeerEvent
	names  map[string]string // backend and replica names, interned
	connUp bool              // the connection state last seen
	warned atomic.Bool       // a malformed message has been logged

	stats   counters
	metrics metric.Registration
}

// peer is what a Sync knows of one peer.
type peer struct {
	seq       uint64
	lastHeard time.Time
	joined    time.Time
	messages  uint64
	events    uint64
}

// counters are a Sync's statistics.
type counters struct {
	published, dropped, truncated         atomic.Uint64
	sent, sendErrors                      atomic.Uint64
	received, applied, decodeErrors, gaps atomic.Uint64
	timedOut, goodbyes                    atomic.Uint64
}

// New returns a Sync for cfg, dialling cfg.URL when cfg.Conn is nil; it starts no goroutine (see
// Start). The error wraps ErrInvalidConfig for a Config it refuses, or is the dial's (a malformed
// URL: an unreachable server is no error, the connection keeps trying).
func New(cfg Config) (*Sync, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	s := &Sync{
		cfg:     cfg,
		nc:      cfg.Conn,
		subject: cfg.SubjectPrefix + "." + cfg.Group,
		log:     cfg.Logger.With("replica", cfg.ReplicaID, "subject", cfg.SubjectPrefix+"."+cfg.Group),
		hdrLen:  headerLen(cfg.ReplicaID),
		maxMsg:  cfg.MaxMessageBytes,
		kick:    make(chan struct{}, 1),
		stop:    make(chan struct{}),
		peers:   map[string]*peer{},
		names:   map[string]string{},
	}
	if s.nc == nil {
		opts := append([]nats.Option{
			nats.Name("kvroute natsync " + cfg.ReplicaID),
			nats.MaxReconnects(-1),
			nats.ReconnectWait(500 * time.Millisecond),
			nats.RetryOnFailedConnect(true),
			nats.NoEcho(),
			nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
				s.log.Warn("natsync: NATS error", "err", err)
			}),
		}, cfg.Options...)
		if s.nc, err = nats.Connect(cfg.URL, opts...); err != nil {
			return nil, fmt.Errorf("natsync: connect to %s: %w", cfg.URL, err)
		}
		s.owned = true
	}
	if mp := s.nc.MaxPayload(); mp > 0 && int64(s.maxMsg) > mp {
		s.maxMsg = int(mp)
	}
	s.cur = s.newBufLocked()
	s.connUp = s.nc.IsConnected()
	if s.metrics, err = s.registerMetrics(cfg.MeterProvider); err != nil {
		if s.owned {
			s.nc.Close()
		}
		return nil, err
	}
	return s, nil
}

// ReplicaID is the id this Sync's messages carry. Safe for concurrent use.
func (s *Sync) ReplicaID() string { return s.cfg.ReplicaID }

// Subject is the subject this Sync publishes and listens on. Safe for concurrent use.
func (s *Sync) Subject() string { return s.subject }

// PublishPeerEvent queues ev, one of the router's decision events, for the other replicas: it
// implements kvroute.PeerPublisher. It never blocks and never does I/O: it encodes ev (copying
// its block keys) into the batch being filled, under a lock held for that copy only; the sending
// goroutine takes the batch from there (before Start, events wait in the buffer). ev is dropped
// (Stats.Dropped) when the buffer is full (BufferSize events, or BufferBytes), after Close began,
// when its kind is unknown, or when it is routed to a backend whose name exceeds MaxBackendLen. A
// routed event's block keys are cut to a prefix (Stats.Truncated) when they exceed
// MaxKeysPerEvent or what a message holds: the first blocks are the ones worth sharing. Safe for
// concurrent use.
func (s *Sync) PublishPeerEvent(ev kvroute.PeerEvent) {
	if ev.Kind < kvroute.PeerRouted || ev.Kind > kvroute.PeerDone || ev.Kind == kvroute.PeerRouted && len(ev.Backend) > MaxBackendLen {
		s.stats.dropped.Add(1)
		return
	}
	nkeys := 0
	truncated := false
	if ev.Kind == kvroute.PeerRouted {
		nkeys = min(len(ev.BlockKeys), MaxKeysPerEvent)
		// The room a message has for this event's keys.
		room := (s.maxMsg - s.hdrLen - eventSize(&kvroute.PeerEvent{Kind: ev.Kind, ID: ev.ID, Backend: ev.Backend}, 0) - 16) / 8
		nkeys = min(nkeys, max(room, 0))
		truncated = nkeys < len(ev.BlockKeys)
	}
	size := eventSize(&ev, nkeys)
	wake := false
	s.mu.Lock()
	if s.closed || s.pending >= s.cfg.BufferSize || s.pendBytes+size > s.cfg.BufferBytes {
		s.lost = true
		s.mu.Unlock()
		s.stats.dropped.Add(1)
		return
	}
	if len(s.cur)+size > s.maxMsg || s.curEvents == MaxEventsPerMessage {
		s.sealed = append(s.sealed, s.cur)
		s.cur, s.curEvents = s.newBufLocked(), 0
		wake = true
	}
	wake = wake || s.pending == 0
	s.cur = appendEvent(s.cur, &ev, nkeys)
	s.curEvents++
	s.pending++
	s.pendBytes += size
	s.mu.Unlock()
	s.stats.published.Add(1)
	if truncated {
		s.stats.truncated.Add(1)
	}
	if wake {
		select {
		case s.kick <- struct{}{}:
		default:
		}
	}
}

// newBufLocked returns an empty batch buffer: room for the header, capacity for a message.
// Requires mu (or a Sync not yet shared).
func (s *Sync) newBufLocked() []byte {
	if n := len(s.free); n > 0 {
		b := s.free[n-1]
		s.free = s.free[:n-1]
		return b[:s.hdrLen]
	}
	return make([]byte, s.hdrLen, s.maxMsg)
}

// Start subscribes to the group's subject and launches the Sync's two goroutines: one sends the
// buffered events (within FlushInterval) and a heartbeat every Heartbeat, the other applies the
// peers' events to a and forgets the peers silent for PeerTimeout. a is usually the router whose
// Config.Peers is this Sync; NopApplier ignores the peers.
//
// ctx bounds the wait for the server to confirm the subscription (5 s when ctx has no deadline),
// so that the peers' next messages reach a; while the connection is down Start does not wait (the
// subscription is made when it comes back). The error is ErrStarted or ErrClosed, ctx's error,
// or the subscription's; on an error nothing was started. Safe for concurrent use.
func (s *Sync) Start(ctx context.Context, a Applier) error {
	if a == nil {
		return errors.New("natsync: Start with a nil Applier")
	}
	s.life.Lock()
	defer s.life.Unlock()
	switch {
	case s.stopped:
		return ErrClosed
	case s.started:
		return ErrStarted
	}
	msgs := make(chan *nats.Msg, receiveBuffer)
	sub, err := s.nc.ChanSubscribe(s.subject, msgs)
	if err != nil {
		return fmt.Errorf("natsync: subscribe to %s: %w", s.subject, err)
	}
	if s.nc.IsConnected() {
		fctx := ctx
		if _, ok := ctx.Deadline(); !ok {
			var cancel context.CancelFunc
			fctx, cancel = context.WithTimeout(ctx, startTimeout)
			defer cancel()
		}
		if err := s.nc.FlushWithContext(fctx); err != nil {
			if ctx.Err() != nil {
				_ = sub.Unsubscribe()
				return ctx.Err()
			}
			s.log.Warn("natsync: the server did not confirm the subscription; continuing", "err", err)
		}
	}
	s.applier, s.sub, s.msgs, s.started = a, sub, msgs, true
	s.wg.Add(2)
	go s.send()
	go s.receive()
	s.log.Info("natsync: started", "heartbeat", s.cfg.Heartbeat, "peer_timeout", s.cfg.PeerTimeout)
	return nil
}

// Close stops the Sync: it sends the buffered events and a goodbye (so that the peers forget
// this replica at once), stops its goroutines and waits for them, forgets every peer in the
// Applier (their decisions' ends would no longer arrive), then waits up to 2 s for the server to
// take the last messages, and closes the connection if New dialled it. Events published
// meanwhile are dropped. The error is that last wait's (the goodbye may not have left: the peers
// then forget this replica after PeerTimeout). Close is idempotent: later calls return the first
// one's error. Safe for concurrent use.
func (s *Sync) Close() error {
	s.closeMu.Lock()
	defer s.closeMu.Unlock()
	if s.didStop {
		return s.closeEr
	}
	s.didStop = true
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()

	s.life.Lock()
	s.stopped = true
	started := s.started
	s.life.Unlock()
	if started {
		close(s.stop)
		s.wg.Wait()
		_ = s.sub.Unsubscribe()
		s.pmu.Lock()
		ids := make([]string, 0, len(s.peers))
		for id := range s.peers {
			ids = append(ids, id)
		}
		clear(s.peers)
		s.pmu.Unlock()
		for _, id := range ids {
			s.applier.ForgetPeer(id)
		}
		if s.nc.IsConnected() {
			if err := s.nc.FlushTimeout(closeTimeout); err != nil {
				s.closeEr = fmt.Errorf("natsync: flush on close: %w", err)
			}
		}
	}
	if s.owned {
		s.nc.Close()
	}
	if s.metrics != nil {
		_ = s.metrics.Unregister()
	}
	s.log.Info("natsync: closed")
	return s.closeEr
}

// send is the sending goroutine.
func (s *Sync) send() {
	defer s.wg.Done()
	hb := time.NewTicker(s.cfg.Heartbeat)
	defer hb.Stop()
	flush := time.NewTimer(time.Hour)
	flush.Stop()
	s.sendControl(msgHeartbeat) // announce this replica at once
	for {
		select {
		case <-s.kick:
			if !s.hasSealed() {
				// Let the batch fill for FlushInterval, unless it fills before.
				flush.Reset(s.cfg.FlushInterval)
				select {
				case <-flush.C:
				case <-s.kick:
					flush.Stop()
				case <-s.stop:
					flush.Stop()
					s.goodbye()
					return
				}
			}
			s.sendPending()
		case <-hb.C:
			s.sendControl(msgHeartbeat)
		case <-s.stop:
			s.goodbye()
			return
		}
	}
}

// goodbye sends what is buffered, then the goodbye.
func (s *Sync) goodbye() {
	s.sendPending()
	s.sendControl(msgGoodbye)
}

// hasSealed reports whether a full batch waits.
func (s *Sync) hasSealed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.sealed) > 0
}

// takePending takes the buffered batches (the one being filled too) and reports whether events
// were dropped since the last take. The caller gives the batches back with recycle.
func (s *Sync) takePending() (batches [][]byte, lost bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.curEvents > 0 {
		s.sealed = append(s.sealed, s.cur)
		s.cur, s.curEvents = s.newBufLocked(), 0
	}
	batches, s.sealed = s.sealed, s.spare[:0]
	s.spare = nil
	s.pending, s.pendBytes = 0, 0
	lost, s.lost = s.lost, false
	return batches, lost
}

// recycle gives back the batches takePending returned.
func (s *Sync) recycle(batches [][]byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, b := range batches {
		if len(s.free) < freeBuffers && cap(b) == s.maxMsg {
			s.free = append(s.free, b)
		}
		batches[i] = nil
	}
	s.spare = batches[:0]
}

// sendPending sends the buffered batches, one message each. When events were dropped since the
// last send, the first message skips a sequence number: the peers see the gap and forget this
// replica's decisions, whose ends may be among the dropped events.
func (s *Sync) sendPending() {
	batches, lost := s.takePending()
	if lost {
		s.seq++
	}
	for _, b := range batches {
		s.publish(msgEvents, b)
	}
	s.recycle(batches)
}

// sendControl sends a heartbeat or a goodbye.
func (s *Sync) sendControl(typ byte) {
	var arr [2 + 2 + MaxReplicaIDLen + seqLen]byte
	s.publish(typ, arr[:s.hdrLen])
}

// publish writes the header of msg (whose first hdrLen bytes are room for it) and publishes it.
// A message the connection refuses (its reconnect buffer full, or closed) is lost: its sequence
// number is spent, so the peers see the gap.
func (s *Sync) publish(typ byte, msg []byte) {
	s.seq++
	putHeader(msg, typ, s.cfg.ReplicaID, s.seq)
	if err := s.nc.Publish(s.subject, msg); err != nil {
		s.stats.sendErrors.Add(1)
		return
	}
	s.stats.sent.Add(1)
}

// receive is the receiving goroutine.
func (s *Sync) receive() {
	defer s.wg.Done()
	tick := time.NewTicker(max(s.cfg.PeerTimeout/4, time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case m := <-s.msgs:
			s.handle(m.Data, time.Now())
		case now := <-tick.C:
			s.expire(now)
			s.watchConn()
		case <-s.stop:
			return
		}
	}
}

// handle decodes and applies one message.
func (s *Sync) handle(data []byte, now time.Time) {
	h, body, err := decodeHeader(data)
	if err == nil && string(h.replica) == s.cfg.ReplicaID {
		return // this replica's own message
	}
	if err == nil && h.typ == msgEvents {
		s.events, err = decodeEvents(body, s.events, s.intern)
	}
	if err != nil {
		s.stats.decodeErrors.Add(1)
		if !s.warned.Swap(true) {
			s.log.Warn("natsync: dropped a malformed message (further ones are only counted)", "err", err, "bytes", len(data))
		}
		return
	}
	s.stats.received.Add(1)
	replica := s.intern(h.replica)

	s.pmu.Lock()
	p := s.peers[replica]
	joined, gap := p == nil, false
	if joined {
		p = &peer{joined: now}
		if h.typ != msgGoodbye {
			s.peers[replica] = p
		}
	} else {
		gap = h.seq != p.seq+1 && h.typ != msgGoodbye
	}
	p.seq, p.lastHeard = h.seq, now
	p.messages++
	p.events += uint64(len(s.events))
	if h.typ == msgGoodbye {
		delete(s.peers, replica)
	}
	s.pmu.Unlock()

	switch {
	case joined && h.typ != msgGoodbye:
		s.log.Info("natsync: peer joined", "peer", replica)
	case gap:
		// Messages of this peer were lost: a decision's end may have been among them. Forget
		// its decisions rather than let a lost end weigh on a backend for PeerMaxAge; the
		// requests still in flight then weigh nothing here until they end.
		s.stats.gaps.Add(1)
		n := s.applier.ForgetPeer(replica)
		s.log.Debug("natsync: lost messages of a peer; forgot its decisions", "peer", replica, "decisions", n)
	}
	switch h.typ {
	case msgEvents:
		for _, ev := range s.events {
			s.applier.ApplyPeerEvent(replica, ev)
		}
		s.stats.applied.Add(uint64(len(s.events)))
		clear(s.events)
		s.events = s.events[:0]
	case msgGoodbye:
		n := s.applier.ForgetPeer(replica)
		s.stats.goodbyes.Add(1)
		s.log.Info("natsync: peer said goodbye", "peer", replica, "decisions", n)
	}
}

// intern returns b as a string, the same string for the same bytes, so that the names on every
// message cost no allocation. The table is bounded: garbage cannot grow it without limit.
func (s *Sync) intern(b []byte) string {
	if v, ok := s.names[string(b)]; ok {
		return v
	}
	if len(s.names) >= 4096 {
		clear(s.names)
	}
	v := string(b)
	s.names[v] = v
	return v
}

// expire forgets the peers silent for PeerTimeout.
func (s *Sync) expire(now time.Time) {
	type gone struct {
		id     string
		silent time.Duration
	}
	var out []gone
	s.pmu.Lock()
	for id, p := range s.peers {
		if d := now.Sub(p.lastHeard); d >= s.cfg.PeerTimeout {
			out = append(out, gone{id, d})
			delete(s.peers, id)
		}
	}
	s.pmu.Unlock()
	for _, g := range out {
		n := s.applier.ForgetPeer(g.id)
		s.stats.timedOut.Add(1)
		s.log.Info("natsync: peer timed out; forgot it", "peer", g.id, "silent", g.silent.Round(time.Millisecond), "decisions", n)
	}
}

// watchConn logs the connection's losses and returns.
func (s *Sync) watchConn() {
	up := s.nc.IsConnected()
	if up == s.connUp {
		return
	}
	s.connUp = up
	if up {
		s.log.Info("natsync: NATS connection is back")
	} else {
		s.log.Warn("natsync: NATS connection lost; peers will be forgotten after PeerTimeout", "status", s.nc.Status().String())
	}
}

// Stats is what a Sync did, and the peers it hears.
type Stats struct {
	Replica string `json:"replica"`
	Subject string `json:"subject"`
	// Connection is the NATS connection's status (CONNECTED, RECONNECTING, CLOSED...).
	Connection string `json:"connection"`
	Connected  bool   `json:"connected"`

	// Published counts the events PublishPeerEvent buffered, Dropped those it dropped (see
	// PublishPeerEvent), Truncated the published ones whose block keys were cut.
	Published uint64 `json:"published"`
	Dropped   uint64 `json:"dropped"`
	Truncated uint64 `json:"truncated"`
	// Sent counts the messages published (event batches, heartbeats, goodbye), SendErrors those
	// the connection refused (its reconnect buffer full, or closed).
	Sent       uint64 `json:"sent"`
	SendErrors uint64 `json:"send_errors"`

	// Received counts the peers' well-formed messages, Applied the events in them handed to the
	// Applier, DecodeErrors the malformed messages dropped.
	Received     uint64 `json:"received"`
	Applied      uint64 `json:"applied"`
	DecodeErrors uint64 `json:"decode_errors"`
	// Gaps counts the times a peer's sequence skipped (its messages were lost, or it dropped
	// events), each of which made this Sync forget the peer's decisions.
	Gaps uint64 `json:"gaps"`
	// TimedOut and Goodbyes count the peers forgotten for their silence and for their goodbye.
	TimedOut uint64 `json:"timed_out"`
	Goodbyes uint64 `json:"goodbyes"`

	// Peers are the peers heard from within PeerTimeout, by id.
	Peers []PeerInfo `json:"peers"`
}

// PeerInfo is one peer as a Sync hears it.
type PeerInfo struct {
	Replica   string    `json:"replica"`
	Joined    time.Time `json:"joined"`     // its first message since it was last forgotten
	LastHeard time.Time `json:"last_heard"` // its latest message
	Messages  uint64    `json:"messages"`
	Events    uint64    `json:"events"`
}

// Stats returns the Sync's statistics. Safe for concurrent use.
func (s *Sync) Stats() Stats {
	st := Stats{
		Replica:      s.cfg.ReplicaID,
		Subject:      s.subject,
		Connection:   s.nc.Status().String(),
		Connected:    s.nc.IsConnected(),
		Published:    s.stats.published.Load(),
		Dropped:      s.stats.dropped.Load(),
		Truncated:    s.stats.truncated.Load(),
		Sent:         s.stats.sent.Load(),
		SendErrors:   s.stats.sendErrors.Load(),
		Received:     s.stats.received.Load(),
		Applied:      s.stats.applied.Load(),
		DecodeErrors: s.stats.decodeErrors.Load(),
		Gaps:         s.stats.gaps.Load(),
		TimedOut:     s.stats.timedOut.Load(),
		Goodbyes:     s.stats.goodbyes.Load(),
	}
	s.pmu.Lock()
	st.Peers = make([]PeerInfo, 0, len(s.peers))
	for id, p := range s.peers {
		st.Peers = append(st.Peers, PeerInfo{Replica: id, Joined: p.joined, LastHeard: p.lastHeard, Messages: p.messages, Events: p.events})
	}
	s.pmu.Unlock()
	slices.SortFunc(st.Peers, func(a, b PeerInfo) int { return strings.Compare(a.Replica, b.Replica) })
	return st
}
