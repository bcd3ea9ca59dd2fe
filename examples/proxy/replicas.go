package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/admin"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/enginemetrics"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/natsync"
	"github.com/kvroute/kvroute/natsync/eventlog"
)

// This file composes what the proxy shares with the gateway's other replicas (the replicas
// section: decisions over NATS with natsync, the engines' KV events through a JetStream stream
// with index snapshots with natsync/eventlog) and what it reads from the engines themselves
// (engine_metrics, with enginemetrics). They are built once and outlive reloads; they act on the
// Router in force through routerRef.

// routerRef is the Router in force, for the parts that outlive a reload: the replica sync applies
// the peers' decisions to it and the scraper reports the engines' load to it. A new Router starts
// without the peers' decisions made before it (their load returns as they route on).
type routerRef struct {
	cur atomic.Pointer[kvroute.DefaultRouter]
}

// ApplyPeerEvent implements natsync.Applier.
func (r *routerRef) ApplyPeerEvent(replica string, ev kvroute.PeerEvent) {
	if rt := r.cur.Load(); rt != nil {
		rt.ApplyPeerEvent(replica, ev)
	}
}

// ForgetPeer implements natsync.Applier.
func (r *routerRef) ForgetPeer(replica string) int {
	if rt := r.cur.Load(); rt != nil {
		return rt.ForgetPeer(replica)
	}
	return 0
}

// ReportEngineLoad implements enginemetrics.Sink. A backend the Router in force does not have
// (removed by a reload, while the scraper's targets change) is no error worth a log line.
func (r *routerRef) ReportEngineLoad(backend string, l kvroute.EngineLoad) error {
	rt := r.cur.Load()
	if rt == nil {
		return nil
	}
	if err := rt.ReportEngineLoad(backend, l); err != nil && !errors.Is(err, kvroute.ErrUnknownBackend) {
		return err
	}
	return nil
}

// fleet is the proxy's replica sync, event log and engine scrapes; each part is nil when off.
type fleet struct {
	ref      *routerRef
	nc       *nats.Conn
	sync     *natsync.Sync
	pub      *eventlog.Publisher // the engines' events this replica receives go to the stream
	cons     *eventlog.Consumer  // the stream feeds this replica's index
	snap     *eventlog.Snapshotter
	guard    *replayGuard            // between the stream and the index: skips what the outage tee applied
	restored *eventlog.RestoreResult // what the start-up restore did
	scraper  *enginemetrics.Scraper
}

// newFleet builds the replicas and engine_metrics parts of cfg (nothing starts talking to the
// network but the NATS connection, which retries in the background while the server is down).
// With the event log, the event sources write to the Publisher (eventsSink) and the Consumer
// writes to the index's sink.
func (s *server) newFleet(cfg *config.Config) (*fleet, error) {
	f := &fleet{ref: &routerRef{}}
	if em := cfg.EngineMetrics; em.Enabled {
		sc, err := enginemetrics.New(enginemetrics.Config{Targets: metricsTargets(cfg), Interval: time.Duration(em.Interval),
			Timeout: time.Duration(em.Timeout), MeterProvider: s.opts.MeterProvider, Logger: s.log.With("component", "engine_metrics")}, f.ref)
		if err != nil {
			return nil, fmt.Errorf("engine_metrics: %w", err)
		}
		f.scraper = sc
		s.closers = append(s.closers, sc.Close)
	}
	rp := cfg.Replicas
	if !rp.Enabled {
		return f, nil
	}
	id := rp.ReplicaID
	if id == "" {
		host, _ := os.Hostname()
		id = natsIDPart(host) + "-" + strconv.Itoa(os.Getpid())
	}
	nc, err := nats.Connect(string(rp.NATSURL), nats.Name("kvroute-proxy "+id), nats.MaxReconnects(-1),
		nats.RetryOnFailedConnect(true), nats.ReconnectWait(500*time.Millisecond), nats.NoEcho())
	if err != nil {
		return nil, fmt.Errorf("replicas.nats_url: %w", err)
	}
	f.nc = nc
	s.closers = append(s.closers, func() error { nc.Close(); return nil })
	if f.sync, err = natsync.New(natsync.Config{Conn: nc, Group: rp.Group, ReplicaID: id, Heartbeat: time.Duration(rp.Heartbeat),
		PeerTimeout: time.Duration(rp.PeerTimeout), MeterProvider: s.opts.MeterProvider, Logger: s.log.With("component", "replicas")}); err != nil {
		return nil, fmt.Errorf("replicas: %w", err)
	}
	s.closers = append(s.closers, f.sync.Close)
	if el := rp.EventLog; el.Enabled && s.index != nil {
		if err := f.newEventLog(s, cfg); err != nil {
			return nil, fmt.Errorf("replicas.event_log: %w", err)
		}
	}
	return f, nil
}

// eventLogConfig is the event log's configuration of cfg over connection nc.
func eventLogConfig(cfg *config.Config, nc *nats.Conn, s *server) (eventlog.Config, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return eventlog.Config{}, err
	}
	el := cfg.Replicas.EventLog
	return eventlog.Config{JetStream: js, Stream: el.Stream, Bucket: el.Bucket, Fleet: cfg.Replicas.Group,
		MaxAge: time.Duration(el.MaxAge), Logger: s.log.With("component", "event_log"), MeterProvider: s.opts.MeterProvider}, nil
}

// newEventLog builds the event log's parts: the Publisher that the event sources' consumers
// write to (when this replica has event sources), and the Consumer that feeds the index from the
// stream, after a restore from the fleet's latest snapshot, with a Snapshotter of the index.
func (f *fleet) newEventLog(s *server, cfg *config.Config) error {
	ecfg, err := eventLogConfig(cfg, f.nc, s)
	if err != nil {
		return err
	}
	// A NATS server that is down must not hold the start-up (and the listener) for long: without
	// a snapshot the replica replays the whole stream once NATS is back.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if cfg.Replicas.EventLog.ResetOnStart {
		res, err := eventlog.Reset(ctx, ecfg)
		if err != nil {
			return fmt.Errorf("reset_on_start: %w", err)
		}
		s.log.Warn("event log reset: stream purged and snapshots deleted (replicas.event_log.reset_on_start)", "result", res)
	}
	if len(cfg.KVCacheIndex.EventSources) > 0 {
		if f.pub, err = eventlog.NewPublisher(ecfg, eventlog.PublisherOptions{}); err != nil {
			return err
		}
		s.closers = append(s.closers, f.pub.Close)
	}
	start := uint64(1)
	if target, ok := s.index.(eventlog.RestoreTarget); ok {
		res, err := eventlog.Restore(ctx, ecfg, target)
		f.restored = &res
		if err != nil {
			s.log.Warn("event log: no snapshot restored; replaying the whole stream", "err", err)
		} else if res.Found {
			s.log.Info("event log: index restored from the fleet's snapshot", "blocks", res.Counts, "age_seconds", res.Age,
				"start_seq", res.StartSeq, "stale", res.Stale)
		}
		start = res.StartSeq
	}
	f.guard = newReplayGuard(s.sink)
	reg, err := s.tel.observeOutageReplay(f.guard)
	if err != nil {
		return err
	}
	s.closers = append(s.closers, reg.Unregister)
	if f.cons, err = eventlog.NewConsumer(ecfg, eventlog.ConsumerOptions{Sink: f.guard, StartSeq: start}); err != nil {
		return err
	}
	s.closers = append(s.closers, f.cons.Close)
	if ex, ok := s.index.(kvindex.Exporter); ok {
		if f.snap, err = eventlog.NewSnapshotter(ecfg, eventlog.SnapshotterOptions{Exporter: ex, Seq: f.cons,
			Interval: time.Duration(cfg.Replicas.EventLog.SnapshotInterval)}); err != nil {
			return err
		}
		s.closers = append(s.closers, f.snap.Close)
	}
	return nil
}

// eventsSink is where the event sources' consumers write: the event log's Publisher when there is
// one (the stream then feeds the index), else the index.
func (f *fleet) eventsSink(index events.Sink) events.Sink {
	if f != nil && f.pub != nil {
		return &outageTee{pub: f.pub, index: index, connected: f.nc.IsConnected, guard: f.guard}
	}
	return index
}

// outageTee hands the engines' events to the event log's Publisher and, while the connection to
// NATS is down (connected false), to this replica's index as well, so that the replica that
// receives them keeps indexing through an outage. Once NATS is back the stream may bring some of
// them again, in the same order (publishes buffered through the reconnection): guard, through
// which the stream reaches the index, skips those it applied (nil: none is skipped).
type outageTee struct {
	pub       events.Sink
	index     events.Sink
	connected func() bool
	guard     *replayGuard
}

func (o *outageTee) Apply(ctx context.Context, backend string, b *events.Batch) error {
	err := o.pub.Apply(ctx, backend, b)
	if !o.connected() {
		if err := o.index.Apply(ctx, backend, b); err != nil {
			return err
		}
		o.guard.appliedDirectly(backend, b)
		return nil
	}
	return err
}

func (o *outageTee) ClearBackend(ctx context.Context, backend string) error {
	err := o.pub.ClearBackend(ctx, backend)
	if !o.connected() {
		o.guard.forget(backend)
		return o.index.ClearBackend(ctx, backend)
	}
	return err
}

// replayGuard is the event-log consumer's sink: it applies the stream's batches to the index,
// but for those the outage tee applied to the index already while NATS was down. It keeps, per
// backend and data-parallel rank, the engine sequence of the last batch the tee applied; a batch
// from the stream at or below it is skipped and counted as a duplicate, the first one above it
// ends the watch (the stream is past the outage), and a clear of the backend (from the stream or
// the tee) forgets it. Applying such a batch a second time leaves the index's entries as they
// were, but counts its removes of blocks already removed as unknown_block drops and its stores
// whose parent went since as unknown_parent: a drop alert would fire for no loss. Batches without
// an engine sequence (SSE) are always applied. Safe for concurrent use.
type replayGuard struct {
	sink events.Sink

	mu   sync.Mutex
	seen map[guardKey]uint64

	batches, events atomic.Uint64 // duplicates skipped
}

type guardKey struct {
	backend string
	rank    int // -1: the batches name none
}

func newReplayGuard(sink events.Sink) *replayGuard {
	return &replayGuard{sink: sink, seen: map[guardKey]uint64{}}
}

func keyOf(backend string, b *events.Batch) guardKey {
	k := guardKey{backend: backend, rank: -1}
	if b.HasDPRank {
		k.rank = b.DPRank
	}
	return k
}

// appliedDirectly records that b reached the index without the stream. A nil guard does nothing.
func (g *replayGuard) appliedDirectly(backend string, b *events.Batch) {
	if g == nil || b.Seq == 0 {
		return
	}
	g.mu.Lock()
	g.seen[keyOf(backend, b)] = b.Seq
	g.mu.Unlock()
}

// forget drops what is recorded of backend. A nil guard does nothing.
func (g *replayGuard) forget(backend string) {
	if g == nil {
		return
	}
	g.mu.Lock()
	for k := range g.seen {
		if k.backend == backend {
			delete(g.seen, k)
		}
	}
	g.mu.Unlock()
}

// Apply implements events.Sink.
func (g *replayGuard) Apply(ctx context.Context, backend string, b *events.Batch) error {
	if b.Seq != 0 {
		k := keyOf(backend, b)
		g.mu.Lock()
		last, ok := g.seen[k]
		if ok && b.Seq <= last {
			g.mu.Unlock()
			g.batches.Add(1)
			g.events.Add(uint64(len(b.Events)))
			return nil
		}
		if ok {
			delete(g.seen, k)
		}
		g.mu.Unlock()
	}
	return g.sink.Apply(ctx, backend, b)
}

// ClearBackend implements events.Sink.
func (g *replayGuard) ClearBackend(ctx context.Context, backend string) error {
	g.forget(backend)
	return g.sink.ClearBackend(ctx, backend)
}

// replayGuardStats is the guard's line in /admin/replicas/stats.
type replayGuardStats struct {
	// DuplicateBatches and DuplicateEvents count what the stream brought again after an outage
	// and was not applied a second time (this replica had indexed it during the outage).
	DuplicateBatches uint64 `json:"duplicate_batches"`
	DuplicateEvents  uint64 `json:"duplicate_events"`
}

func (g *replayGuard) stats() replayGuardStats {
	return replayGuardStats{DuplicateBatches: g.batches.Load(), DuplicateEvents: g.events.Load()}
}

// start starts what talks to the network: the sync (applying the peers' decisions to the Router
// in force), the event log's parts and the scrapes.
func (f *fleet) start(ctx context.Context) error {
	if f.sync != nil {
		if err := f.sync.Start(ctx, f.ref); err != nil {
			return fmt.Errorf("replicas: %w", err)
		}
	}
	// The others run until Close, whatever ctx (which bounds the start-up) does.
	bg := context.WithoutCancel(ctx)
	var err error
	if f.pub != nil {
		err = f.pub.Start(bg)
	}
	if f.cons != nil && err == nil {
		err = f.cons.Start(bg)
	}
	if f.snap != nil && err == nil {
		err = f.snap.Start(bg)
	}
	if err != nil {
		return fmt.Errorf("replicas.event_log: %w", err)
	}
	if f.scraper != nil {
		if err := f.scraper.Start(bg); err != nil {
			return fmt.Errorf("engine_metrics: %w", err)
		}
	}
	return nil
}

// metricsTargets maps each backend to its engine's metrics URL: metrics_url, or its URL with
// engine_metrics.path.
func metricsTargets(cfg *config.Config) map[string]string {
	out := make(map[string]string, len(cfg.Backends))
	for _, b := range cfg.Backends {
		if b.MetricsURL != "" {
			out[b.Name] = b.MetricsURL
			continue
		}
		out[b.Name] = joinURLPath(b.URL, cfg.EngineMetrics.Path)
	}
	return out
}

// joinURLPath appends path to base's path.
func joinURLPath(base, path string) string {
	for len(base) > 0 && base[len(base)-1] == '/' {
		base = base[:len(base)-1]
	}
	return base + path
}

// natsIDPart keeps the letters, digits, - and _ of s (at most 40), for a replica id.
func natsIDPart(s string) string {
	b := make([]byte, 0, len(s))
	for i := 0; i < len(s) && len(b) < 40; i++ {
		c := s[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' {
			b = append(b, c)
		}
	}
	if len(b) == 0 {
		return "kvroute"
	}
	return string(b)
}

// replicasStats is the body of GET /admin/replicas/stats.
type replicasStats struct {
	Enabled       bool                        `json:"enabled"`
	Sync          *natsync.Stats              `json:"sync,omitempty"`
	Peers         admin.PeerStats             `json:"peers"`
	EventLog      *eventLogStats              `json:"event_log,omitempty"`
	EngineMetrics []enginemetrics.TargetStats `json:"engine_metrics,omitempty"`
}

type eventLogStats struct {
	Publisher *eventlog.PublisherStats `json:"publisher,omitempty"`
	Consumer  *eventlog.ConsumerStats  `json:"consumer,omitempty"`
	// OutageReplay counts the stream's batches that this replica had indexed during a NATS
	// outage, skipped rather than applied again.
	OutageReplay *replayGuardStats          `json:"outage_replay,omitempty"`
	Snapshotter  *eventlog.SnapshotterStats `json:"snapshotter,omitempty"`
	Restore      *eventlog.RestoreResult    `json:"restore,omitempty"`
}

// stats returns what the fleet's parts report, with peers, what the Router knows of its peers.
func (f *fleet) stats(peers kvroute.PeerStats) replicasStats {
	st := replicasStats{Enabled: f.sync != nil, Peers: admin.NewPeerStats(peers)}
	if f.sync != nil {
		ss := f.sync.Stats()
		st.Sync = &ss
	}
	if f.cons != nil {
		el := &eventLogStats{Restore: f.restored}
		cs := f.cons.Stats()
		el.Consumer = &cs
		gs := f.guard.stats()
		el.OutageReplay = &gs
		if f.pub != nil {
			ps := f.pub.Stats()
			el.Publisher = &ps
		}
		if f.snap != nil {
			ss := f.snap.Stats()
			el.Snapshotter = &ss
		}
		st.EventLog = el
	}
	if f.scraper != nil {
		st.EngineMetrics = f.scraper.Stats()
	}
	return st
}
