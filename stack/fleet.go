package stack

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
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

// restoreTimeout bounds NewFleet's talk with JetStream (the event log's reset and the restore of
// the fleet's snapshot): a NATS server that is down must not hold a gateway's start-up (and its
// listener) for long; without a snapshot the replica replays the whole stream once NATS is back.
const restoreTimeout = 5 * time.Second

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

// FleetOptions are what NewFleet needs besides the configuration: the KV index the event log
// feeds, and the name the replica gives its NATS connection.
type FleetOptions struct {
	// Index is the KV index (config.Config.NewStores's); nil when kv_cache_index is off, and then
	// replicas.event_log stays off. The event log restores the fleet's latest snapshot into it
	// when it is an eventlog.RestoreTarget, and snapshots it when it is a kvindex.Exporter (as
	// kvindex.MemoryIndex is).
	Index kvindex.KvCacheIndex
	// Sink is where the event log's stream applies the engines' events: Index, or a wrapper of
	// it that passes every call on (admin.CountingSink, which counts what the events changed).
	// Nil means Index. It is also what Fleet.EventsSink returns when there is no event log.
	Sink events.Sink
	// ClientName names the NATS connection, followed by a space and the replica's id, in the
	// server's monitoring (default "kvroute").
	ClientName string
}

// Fleet is what a gateway shares with its fleet and reads from it, built from the replicas and
// engine_metrics sections: the replica sync (natsync.Sync), the event log's Publisher, Consumer
// and Snapshotter (natsync/eventlog), and the scraper of the engines' metrics endpoints
// (enginemetrics.Scraper); each part is absent when its section is off. It outlives reloads: it
// acts on the Router in force, which SetRouter sets. All its methods are safe for concurrent use.
//
// NewFleet builds it without starting anything but the NATS connection, which retries in the
// background while the server is down; Start starts the parts' goroutines, Close stops them.
// The zero Fleet is not usable.
type Fleet struct {
	ref      *routerRef
	log      *slog.Logger
	nc       *nats.Conn
	sync     *natsync.Sync
	pub      *eventlog.Publisher // the engines' events this replica receives go to the stream
	cons     *eventlog.Consumer  // the stream feeds this replica's index
	snap     *eventlog.Snapshotter
	guard    *replayGuard            // between the stream and the index: skips what the outage tee applied
	restored *eventlog.RestoreResult // what the start-up restore did
	scraper  *enginemetrics.Scraper
	sink     events.Sink // FleetOptions.Sink, or Index

	closers []func() error // the parts, in the order built
	closed  atomic.Bool
}

// NewFleet builds the replicas and engine_metrics parts of cfg, a configuration validated with
// its defaults applied (config.Load's). o's MeterProvider receives the parts' metrics and its
// Logger their logs (each with a "component" attribute: replicas, event_log, engine_metrics).
// With replicas.event_log on and an index, NewFleet resets the stream first when reset_on_start
// says so, then restores the fleet's latest snapshot into the index, talking to JetStream for at
// most 5 seconds: without a snapshot (NATS down, none written yet) the replica replays the whole
// stream, and Stats says what the restore did. The event sources' consumers then write to
// EventsSink, the stream to opts.Sink.
//
// The error names the section at fault (replicas.nats_url, replicas, replicas.event_log,
// engine_metrics) and wraps the library's; what was built before it has been closed.
func NewFleet(cfg *config.Config, o config.Options, opts FleetOptions) (_ *Fleet, err error) {
	if cfg == nil {
		return nil, errors.New("stack: NewFleet needs a configuration")
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	f := &Fleet{ref: &routerRef{}, log: log, sink: opts.Sink}
	if f.sink == nil && opts.Index != nil {
		f.sink = opts.Index
	}
	defer func() {
		if err != nil {
			_ = f.Close()
		}
	}()
	if em := cfg.EngineMetrics; em.Enabled {
		sc, err := enginemetrics.New(enginemetrics.Config{Targets: MetricsTargets(cfg), Interval: time.Duration(em.Interval),
			Timeout: time.Duration(em.Timeout), MeterProvider: o.MeterProvider, Logger: log.With("component", "engine_metrics")}, f.ref)
		if err != nil {
			return nil, fmt.Errorf("engine_metrics: %w", err)
		}
		f.scraper = sc
		f.closers = append(f.closers, sc.Close)
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
	name := opts.ClientName
	if name == "" {
		name = "kvroute"
	}
	nc, err := nats.Connect(string(rp.NATSURL), nats.Name(name+" "+id), nats.MaxReconnects(-1),
		nats.RetryOnFailedConnect(true), nats.ReconnectWait(500*time.Millisecond), nats.NoEcho())
	if err != nil {
		return nil, fmt.Errorf("replicas.nats_url: %w", err)
	}
	f.nc = nc
	f.closers = append(f.closers, func() error { nc.Close(); return nil })
	if f.sync, err = natsync.New(natsync.Config{Conn: nc, Group: rp.Group, ReplicaID: id, Heartbeat: time.Duration(rp.Heartbeat),
		PeerTimeout: time.Duration(rp.PeerTimeout), MeterProvider: o.MeterProvider, Logger: log.With("component", "replicas")}); err != nil {
		return nil, fmt.Errorf("replicas: %w", err)
	}
	f.closers = append(f.closers, f.sync.Close)
	if el := rp.EventLog; el.Enabled && opts.Index != nil {
		if err := f.newEventLog(cfg, o, opts.Index); err != nil {
			return nil, fmt.Errorf("replicas.event_log: %w", err)
		}
	}
	return f, nil
}

// eventLogConfig is the event log's configuration of cfg over connection nc.
func eventLogConfig(cfg *config.Config, nc *nats.Conn, o config.Options, log *slog.Logger) (eventlog.Config, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return eventlog.Config{}, err
	}
	el := cfg.Replicas.EventLog
	return eventlog.Config{JetStream: js, Stream: el.Stream, Bucket: el.Bucket, Fleet: cfg.Replicas.Group,
		MaxAge: time.Duration(el.MaxAge), Logger: log.With("component", "event_log"), MeterProvider: o.MeterProvider}, nil
}

// newEventLog builds the event log's parts: the Publisher that the event sources' consumers
// write to (when this replica has event sources), and the Consumer that feeds the index from the
// stream, after a restore from the fleet's latest snapshot, with a Snapshotter of the index.
func (f *Fleet) newEventLog(cfg *config.Config, o config.Options, index kvindex.KvCacheIndex) error {
	ecfg, err := eventLogConfig(cfg, f.nc, o, f.log)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), restoreTimeout)
	defer cancel()
	if cfg.Replicas.EventLog.ResetOnStart {
		res, err := eventlog.Reset(ctx, ecfg)
		if err != nil {
			return fmt.Errorf("reset_on_start: %w", err)
		}
		f.log.Warn("event log reset: stream purged and snapshots deleted (replicas.event_log.reset_on_start)", "result", res)
	}
	if len(cfg.KVCacheIndex.EventSources) > 0 {
		if f.pub, err = eventlog.NewPublisher(ecfg, eventlog.PublisherOptions{}); err != nil {
			return err
		}
		f.closers = append(f.closers, f.pub.Close)
	}
	start := uint64(1)
	if target, ok := index.(eventlog.RestoreTarget); ok {
		res, err := eventlog.Restore(ctx, ecfg, target)
		f.restored = &res
		if err != nil {
			f.log.Warn("event log: no snapshot restored; replaying the whole stream", "err", err)
		} else if res.Found {
			f.log.Info("event log: index restored from the fleet's snapshot", "blocks", res.Counts, "age_seconds", res.Age,
				"start_seq", res.StartSeq, "stale", res.Stale)
		}
		start = res.StartSeq
	}
	f.guard = newReplayGuard(f.sink)
	if f.cons, err = eventlog.NewConsumer(ecfg, eventlog.ConsumerOptions{Sink: f.guard, StartSeq: start}); err != nil {
		return err
	}
	f.closers = append(f.closers, f.cons.Close)
	if ex, ok := index.(kvindex.Exporter); ok {
		if f.snap, err = eventlog.NewSnapshotter(ecfg, eventlog.SnapshotterOptions{Exporter: ex, Seq: f.cons,
			Interval: time.Duration(cfg.Replicas.EventLog.SnapshotInterval)}); err != nil {
			return err
		}
		f.closers = append(f.closers, f.snap.Close)
	}
	return nil
}

// SetRouter makes r the Router in force: the peers' decisions and the engines' scraped load go
// to it from now on (nil: nowhere). A gateway calls it once its Router is built, and again with
// each Router a reload builds; a new Router starts without the peers' decisions made before it
// (their load returns as they route on).
func (f *Fleet) SetRouter(r *kvroute.DefaultRouter) { f.ref.cur.Store(r) }

// Peers returns what receives the Router's decisions for the other replicas, for
// kvroute.Config.Peers: the replica sync, or nil when replicas is off. Every Router the gateway
// builds, reloads' included, gets it.
func (f *Fleet) Peers() kvroute.PeerPublisher {
	if f.sync == nil {
		return nil
	}
	return f.sync
}

// EventsSink returns where the event sources' consumers write (config.Config.NewEventConsumers's
// sink): with the event log and event sources, the event log's Publisher (the stream then feeds
// the index), which also applies them to FleetOptions.Sink while the connection to NATS is down,
// so that the replica that receives them keeps indexing through an outage; else
// FleetOptions.Sink itself.
func (f *Fleet) EventsSink() events.Sink {
	if f.pub != nil {
		return &outageTee{pub: f.pub, index: f.sink, connected: f.nc.IsConnected, guard: f.guard}
	}
	return f.sink
}

// Start starts what talks to the network: the replica sync (applying the peers' decisions to the
// Router in force), the event log's parts and the scrapes. ctx bounds the sync's start-up; the
// parts run until Close, whatever ctx does afterwards. The error names the section whose part
// failed to start. Call it once, before the event sources' consumers start.
func (f *Fleet) Start(ctx context.Context) error {
	if f.sync != nil {
		if err := f.sync.Start(ctx, f.ref); err != nil {
			return fmt.Errorf("replicas: %w", err)
		}
	}
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

// Close stops and releases every part, in the reverse order of their building (the Snapshotter,
// the Consumer, the Publisher, the sync, the NATS connection, the scraper), and returns their
// errors joined. Close the event sources' consumers first. Idempotent.
func (f *Fleet) Close() error {
	if !f.closed.CompareAndSwap(false, true) {
		return nil
	}
	var errs []error
	for i := len(f.closers) - 1; i >= 0; i-- {
		if err := f.closers[i](); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// SetMetricsTargets replaces the engines' metrics URLs the scraper reads (MetricsTargets's map,
// after a reload changed the backends). It does nothing when engine_metrics is off; the error is
// the scraper's (a URL it refuses), and the targets in force are then kept.
func (f *Fleet) SetMetricsTargets(targets map[string]string) error {
	if f.scraper == nil {
		return nil
	}
	if err := f.scraper.SetTargets(targets); err != nil {
		return fmt.Errorf("engine_metrics: %w", err)
	}
	return nil
}

// Stats is what a Fleet's parts report: the reference proxy's GET /admin/replicas/stats.
type Stats struct {
	// Enabled is replicas.enabled.
	Enabled bool `json:"enabled"`
	// Sync is the replica sync's state; nil when replicas is off.
	Sync *natsync.Stats `json:"sync,omitempty"`
	// Peers is what the Router in force knows of its peers and of the engines' reported load.
	Peers admin.PeerStats `json:"peers"`
	// EventLog is the event log's parts; nil when it is off.
	EventLog *EventLogStats `json:"event_log,omitempty"`
	// EngineMetrics is each scrape target's state; nil when engine_metrics is off.
	EngineMetrics []enginemetrics.TargetStats `json:"engine_metrics,omitempty"`
}

// EventLogStats is the event log's part of Stats.
type EventLogStats struct {
	// Publisher is nil when this replica has no event sources.
	Publisher *eventlog.PublisherStats `json:"publisher,omitempty"`
	Consumer  *eventlog.ConsumerStats  `json:"consumer,omitempty"`
	// OutageReplay counts the stream's batches that this replica had indexed during a NATS
	// outage, skipped rather than applied again.
	OutageReplay *OutageReplayStats `json:"outage_replay,omitempty"`
	// Snapshotter is nil when the index cannot be exported (kvindex.Exporter).
	Snapshotter *eventlog.SnapshotterStats `json:"snapshotter,omitempty"`
	// Restore is what NewFleet's restore did; nil when the index cannot be restored into.
	Restore *eventlog.RestoreResult `json:"restore,omitempty"`
}

// OutageReplayStats counts the event log's batches that this replica had applied to its index
// during a NATS outage and that the stream brought again once NATS was back: skipped rather than
// applied a second time, where they would count as index drops (unknown_block, unknown_parent)
// for no loss.
type OutageReplayStats struct {
	DuplicateBatches uint64 `json:"duplicate_batches"`
	DuplicateEvents  uint64 `json:"duplicate_events"`
}

// Stats returns what the parts report, with the Router in force's view of its peers (its own
// counters: the KV index is not asked).
func (f *Fleet) Stats() Stats {
	var peers kvroute.PeerStats
	if rt := f.ref.cur.Load(); rt != nil {
		ctx, cancel := context.WithCancel(context.Background())
		cancel() // a done ctx: the Router's counters alone (DefaultRouter.Stats)
		st, _ := rt.Stats(ctx)
		peers = st.Peers
	}
	st := Stats{Enabled: f.sync != nil, Peers: admin.NewPeerStats(peers)}
	if f.sync != nil {
		ss := f.sync.Stats()
		st.Sync = &ss
	}
	if f.cons != nil {
		el := &EventLogStats{Restore: f.restored}
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

// OutageReplay returns the event log's outage-replay counters, and false when the event log is
// off (there is nothing to count): for a gateway's metric of them.
func (f *Fleet) OutageReplay() (OutageReplayStats, bool) {
	if f.guard == nil {
		return OutageReplayStats{}, false
	}
	return f.guard.stats(), true
}
