package eventlog

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/telemetry"
)

// DefaultSnapshotInterval is SnapshotterOptions.Interval when zero.
const DefaultSnapshotInterval = time.Minute

// Object metadata keys of a snapshot object.
const (
	metaStream  = "kvroute-stream"
	metaSeq     = "kvroute-seq"
	metaFormat  = "kvroute-format"
	metaCreated = "kvroute-created"
)

// ErrSnapshotMismatch is wrapped by Restore's and ReadSnapshot's error for a snapshot of another
// stream, of an index of another block size, or of another block-key version
// (prefixkey.KeySpace).
var ErrSnapshotMismatch = errors.New("eventlog: snapshot does not match")

// SeqSource tells the last stream sequence applied to an index: *Consumer implements it.
type SeqSource interface {
	LastSeq() uint64
}

// SeqSourceFunc adapts a function to SeqSource.
type SeqSourceFunc func() uint64

// LastSeq calls f.
func (f SeqSourceFunc) LastSeq() uint64 { return f() }

var (
	_ SeqSource = (*Consumer)(nil)
	_ SeqSource = SeqSourceFunc(nil)
)

// SnapshotterOptions are the Snapshotter's own settings.
type SnapshotterOptions struct {
	// Exporter is the index to snapshot (*kvindex.MemoryIndex); required.
	Exporter kvindex.Exporter
	// Seq is the consumer applying the stream to that index; required.
	Seq SeqSource
	// Interval is the period of snapshots (DefaultSnapshotInterval). A period whose sequence has
	// not moved since the last snapshot writes none.
	Interval time.Duration
}

// SnapshotInfo describes one snapshot written.
type SnapshotInfo struct {
	SnapshotHeader
	SnapshotCounts
	Duration time.Duration `json:"duration"`
}

// SnapshotterStats are a Snapshotter's counters and its last snapshot.
type SnapshotterStats struct {
	Snapshots   uint64       `json:"snapshots"`
	Failures    uint64       `json:"failures"`
	Last        SnapshotInfo `json:"last"`
	Age         float64      `json:"age_seconds"` // since Last.Created; 0 before the first
	LastError   string       `json:"last_error,omitempty"`
	LastErrorAt time.Time    `json:"last_error_at,omitzero"`
}

// Snapshotter writes snapshots of a replica's index to the fleet's Object Store bucket
// (Config.Bucket, object Config.Fleet), each with the stream sequence it reflects: the consumer's
// LastSeq read before the export starts, so that replaying from Seq+1 may apply again events the
// snapshot already shows (which is harmless: an event sets what it names) but never misses one.
// The snapshot streams from the index to the server (WriteSnapshot through a pipe into
// ObjectStore.Put); the object replaces the previous one when complete.
//
// Start runs one goroutine that snapshots every Interval; Snapshot makes one now. One replica
// per fleet is enough; several write the same object in turn, each a valid snapshot. Safe for
// concurrent use (snapshots are serialised). Create it with NewSnapshotter.
type Snapshotter struct {
	cfg  Config
	opts SnapshotterOptions

	snapMu sync.Mutex // one snapshot at a time

	mu      sync.Mutex
	last    SnapshotInfo
	lastErr string
	errAt   time.Time
	started bool
	closed  bool

	snapshots, failures atomic.Uint64
	lastSeq, lastBytes  atomic.Int64
	lastCreated         atomic.Int64 // unix ns

	reg    metric.Registration
	done   chan struct{}
	cancel context.CancelFunc
	once   sync.Once
}

// NewSnapshotter returns a snapshotter of opts.Exporter. It validates its arguments (errors wrap
// ErrInvalidConfig) and registers its metrics; it does no I/O.
func NewSnapshotter(cfg Config, opts SnapshotterOptions) (*Snapshotter, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if opts.Exporter == nil || opts.Seq == nil {
		return nil, fmt.Errorf("%w: SnapshotterOptions.Exporter and Seq are required", ErrInvalidConfig)
	}
	if opts.Interval == 0 {
		opts.Interval = DefaultSnapshotInterval
	}
	if opts.Interval < 0 {
		return nil, fmt.Errorf("%w: Interval %v < 0", ErrInvalidConfig, opts.Interval)
	}
	s := &Snapshotter{cfg: cfg, opts: opts, done: make(chan struct{})}
	attrs := metric.WithAttributeSet(attribute.NewSet(attribute.String("fleet", cfg.Fleet)))
	s.reg, err = registerMetrics(cfg.MeterProvider, attrs, []counterSpec{
		{name: telemetry.MetricEventlogSnapshots, desc: "Index snapshots written.", unit: "{snapshot}", value: func() int64 { return int64(s.snapshots.Load()) }},
		{name: telemetry.MetricEventlogSnapshotFailures, desc: "Index snapshots that failed.", unit: "{snapshot}", value: func() int64 { return int64(s.failures.Load()) }},
		{name: telemetry.MetricEventlogSnapshotSeq, desc: "Stream sequence of the last snapshot.", gauge: true, value: s.lastSeq.Load},
		{name: telemetry.MetricEventlogSnapshotSize, desc: "Size of the last snapshot.", unit: "By", gauge: true, value: s.lastBytes.Load},
		{name: telemetry.MetricEventlogSnapshotAge, desc: "Age of the last snapshot.", unit: "s", gauge: true, value: func() int64 {
			if c := s.lastCreated.Load(); c != 0 {
				return int64(s.cfg.Now().Sub(time.Unix(0, c)) / time.Second)
			}
			return 0
		}},
	})
	if err != nil {
		return nil, err
	}
	return s, nil
}

// Start starts the goroutine that snapshots every Interval (the first one Interval after
// Start). ctx is not kept. It returns ErrStarted after a successful Start, ErrClosed after Close.
func (s *Snapshotter) Start(context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return ErrClosed
	case s.started:
		return ErrStarted
	}
	s.started = true
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	go s.loop(ctx)
	return nil
}

func (s *Snapshotter) loop(ctx context.Context) {
	defer close(s.done)
	t := time.NewTicker(s.opts.Interval)
	defer t.Stop()
	lastSeq, have := uint64(0), false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if seq := s.opts.Seq.LastSeq(); have && seq == lastSeq {
			continue
		}
		info, err := s.Snapshot(ctx)
		if err != nil {
			if ctx.Err() == nil {
				s.cfg.Logger.Warn("eventlog: snapshot failed", "fleet", s.cfg.Fleet, "err", err)
			}
			continue
		}
		lastSeq, have = info.Seq, true
	}
}

// Snapshot writes a snapshot now and returns what it wrote. The sequence is read before the
// export starts. The error is the server's (the bucket is created or updated first), the
// index's, or ctx's; the previous snapshot then stays. It returns ErrClosed after Close.
func (s *Snapshotter) Snapshot(ctx context.Context) (SnapshotInfo, error) {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return SnapshotInfo{}, ErrClosed
	}
	s.snapMu.Lock()
	defer s.snapMu.Unlock()
	info, err := s.snapshot(ctx)
	if err != nil {
		s.failures.Add(1)
		s.mu.Lock()
		s.lastErr, s.errAt = err.Error(), s.cfg.Now()
		s.mu.Unlock()
		return info, err
	}
	s.snapshots.Add(1)
	s.lastSeq.Store(int64(info.Seq))
	s.lastBytes.Store(info.Bytes)
	s.lastCreated.Store(info.Created.UnixNano())
	s.mu.Lock()
	s.last = info
	s.mu.Unlock()
	return info, nil
}

func (s *Snapshotter) snapshot(ctx context.Context) (SnapshotInfo, error) {
	start := time.Now()
	// The sequence first: everything up to it is in the index before the export reads it.
	h := SnapshotHeader{Stream: s.cfg.Stream, Fleet: s.cfg.Fleet, Seq: s.opts.Seq.LastSeq(), Created: s.cfg.Now()}
	if bs, ok := s.opts.Exporter.(interface{ BlockSize() int }); ok {
		h.BlockSize = bs.BlockSize()
	}
	obs, err := s.cfg.JetStream.CreateOrUpdateObjectStore(ctx, s.cfg.bucketConfig())
	if err != nil {
		return SnapshotInfo{}, fmt.Errorf("eventlog: snapshot bucket %s: %w", s.cfg.Bucket, err)
	}
	pr, pw := io.Pipe()
	var counts SnapshotCounts
	var werr error
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		counts, werr = WriteSnapshot(wctx, pw, h, s.opts.Exporter)
		pw.CloseWithError(werr) // nil: EOF
	}()
	meta := jetstream.ObjectMeta{
		Name:        s.cfg.Fleet,
		Description: "kvroute KV index snapshot",
		Metadata: map[string]string{
			metaStream:  h.Stream,
			metaSeq:     strconv.FormatUint(h.Seq, 10),
			metaFormat:  strconv.Itoa(snapVersion),
			metaCreated: h.Created.UTC().Format(time.RFC3339Nano),
		},
	}
	_, perr := obs.Put(ctx, meta, pr)
	cancel()
	_ = pr.CloseWithError(errors.New("eventlog: snapshot upload ended")) // unblocks the writer
	<-done
	info := SnapshotInfo{SnapshotHeader: h, SnapshotCounts: counts, Duration: time.Since(start)}
	switch {
	case werr != nil:
		return info, fmt.Errorf("eventlog: snapshot export: %w", werr)
	case perr != nil:
		return info, fmt.Errorf("eventlog: snapshot upload: %w", perr)
	}
	return info, nil
}

// Stats returns the snapshotter's counters. Safe for concurrent use.
func (s *Snapshotter) Stats() SnapshotterStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := SnapshotterStats{Snapshots: s.snapshots.Load(), Failures: s.failures.Load(), Last: s.last,
		LastError: s.lastErr, LastErrorAt: s.errAt}
	if !s.last.Created.IsZero() {
		st.Age = s.cfg.Now().Sub(s.last.Created).Seconds()
	}
	return st
}

// Close stops the goroutine (cancelling a snapshot in progress) and unregisters the metrics.
// Idempotent; the error is the metrics' unregistration's.
func (s *Snapshotter) Close() error {
	var err error
	s.once.Do(func() {
		s.mu.Lock()
		s.closed = true
		started := s.started
		s.mu.Unlock()
		if started {
			s.cancel()
			<-s.done
		}
		if s.reg != nil {
			err = s.reg.Unregister()
		}
	})
	return err
}

// RestoreTarget is what Restore fills: an index that takes back state records and clears a
// backend. *kvindex.MemoryIndex implements it.
type RestoreTarget interface {
	kvindex.Restorer
	ClearBackend(ctx context.Context, backend string) error
}

// RestoreResult says what Restore did. StartSeq is where the replica's Consumer starts
// (ConsumerOptions.StartSeq): Seq+1 after a restored snapshot, 1 without one.
type RestoreResult struct {
	Found    bool           `json:"found"`
	Restored bool           `json:"restored"`
	Header   SnapshotHeader `json:"header"`
	Counts   SnapshotCounts `json:"counts"`
	StartSeq uint64         `json:"start_seq"`
	// Age is the snapshot's age when it was read; Stale reports that the stream no longer holds
	// the message after Seq (its limits removed it), so that the replay has a gap.
	Age      float64       `json:"age_seconds"`
	Stale    bool          `json:"stale,omitempty"`
	Duration time.Duration `json:"duration"`
	Error    string        `json:"error,omitempty"`
}

// Restore loads the fleet's latest snapshot into target, for a new or restarted replica, before
// its Consumer starts at the result's StartSeq. Without a snapshot (or bucket) it returns Found
// false, StartSeq 1 and no error: the consumer replays the whole stream.
//
// The snapshot streams from the server, a frame at a time. On an error part-way (a corrupt or
// truncated snapshot, a lost connection, ctx), the backends it restored are cleared again in
// target (ClearBackend), the result has StartSeq 1 and Restored false, and the error says why
// (wrapping ErrMalformed for a corrupt snapshot, ErrSnapshotMismatch for one of another stream,
// block size or block-key version): a caller may go on and replay the whole stream. target should be empty; its
// existing entries are merged with the snapshot's.
func Restore(ctx context.Context, cfg Config, target RestoreTarget) (RestoreResult, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return RestoreResult{StartSeq: 1}, err
	}
	start := time.Now()
	res, err := restore(ctx, &cfg, target)
	res.Duration = time.Since(start)
	if err != nil {
		res.Error = err.Error()
		res.StartSeq, res.Restored = 1, false
		cfg.Logger.Warn("eventlog: restore failed; replaying the whole stream", "fleet", cfg.Fleet, "err", err)
	}
	return res, err
}

func restore(ctx context.Context, cfg *Config, target RestoreTarget) (RestoreResult, error) {
	res := RestoreResult{StartSeq: 1}
	obs, err := cfg.JetStream.ObjectStore(ctx, cfg.Bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return res, nil
	}
	if err != nil {
		return res, fmt.Errorf("eventlog: snapshot bucket %s: %w", cfg.Bucket, err)
	}
	obj, err := obs.Get(ctx, cfg.Fleet)
	if errors.Is(err, jetstream.ErrObjectNotFound) {
		return res, nil
	}
	if err != nil {
		return res, fmt.Errorf("eventlog: snapshot %s: %w", cfg.Fleet, err)
	}
	defer obj.Close()
	res.Found = true
	s := &snapReader{r: bufio.NewReaderSize(obj, 64<<10)}
	h, err := readSnapshotHeader(s)
	res.Header = h
	if err != nil {
		return res, err
	}
	res.Age = cfg.Now().Sub(h.Created).Seconds()
	if h.Stream != cfg.Stream {
		return res, fmt.Errorf("%w: snapshot of stream %q, want %q", ErrSnapshotMismatch, h.Stream, cfg.Stream)
	}
	if bs, ok := target.(interface{ BlockSize() int }); ok && h.BlockSize != 0 && bs.BlockSize() != h.BlockSize {
		return res, fmt.Errorf("%w: snapshot of block size %d, index %d", ErrSnapshotMismatch, h.BlockSize, bs.BlockSize())
	}
	var touched []string
	counts, err := readSnapshotRecords(ctx, s, target, func(b string) { touched = append(touched, b) })
	res.Counts = counts
	if err == nil {
		// The object store checks the object's digest at its end.
		if _, rerr := io.Copy(io.Discard, obj); rerr != nil {
			err = fmt.Errorf("%w: snapshot object: %v", ErrMalformed, rerr)
		}
	}
	if err != nil {
		cctx := context.WithoutCancel(ctx)
		for _, b := range touched {
			_ = target.ClearBackend(cctx, b)
		}
		return res, err
	}
	res.Restored, res.StartSeq = true, h.Seq+1
	if st, err := cfg.JetStream.Stream(ctx, cfg.Stream); err == nil {
		if info, err := st.Info(ctx); err == nil && info.State.Msgs > 0 && info.State.FirstSeq > res.StartSeq {
			res.Stale = true
			cfg.Logger.Warn("eventlog: the stream no longer holds the events after the snapshot; the replay has a gap",
				"fleet", cfg.Fleet, "snapshot_seq", h.Seq, "first_seq", info.State.FirstSeq)
		}
	}
	return res, nil
}

// ResetResult says what Reset removed.
type ResetResult struct {
	PurgedMessages   uint64 `json:"purged_messages"`
	DeletedSnapshots int    `json:"deleted_snapshots"`
}

// Reset starts the fleet's log over, for an operator (as a router's "reset states" option): it
// purges the stream (its sequence numbers go on from where they were) and deletes every snapshot
// object of the bucket that follows this stream. A missing stream or bucket is no error. It does
// not touch running replicas' indexes: run it with the replicas stopped, or restart them after
// it. The error is the server's, wrapped.
func Reset(ctx context.Context, cfg Config) (ResetResult, error) {
	var res ResetResult
	cfg, err := cfg.withDefaults()
	if err != nil {
		return res, err
	}
	st, err := cfg.JetStream.Stream(ctx, cfg.Stream)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
	case err != nil:
		return res, fmt.Errorf("eventlog: reset stream %s: %w", cfg.Stream, err)
	default:
		info, err := st.Info(ctx)
		if err != nil {
			return res, fmt.Errorf("eventlog: reset stream %s: %w", cfg.Stream, err)
		}
		if err := st.Purge(ctx); err != nil {
			return res, fmt.Errorf("eventlog: purge stream %s: %w", cfg.Stream, err)
		}
		res.PurgedMessages = info.State.Msgs
	}
	obs, err := cfg.JetStream.ObjectStore(ctx, cfg.Bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return res, nil
	}
	if err != nil {
		return res, fmt.Errorf("eventlog: reset bucket %s: %w", cfg.Bucket, err)
	}
	list, err := obs.List(ctx)
	if errors.Is(err, jetstream.ErrNoObjectsFound) {
		return res, nil
	}
	if err != nil {
		return res, fmt.Errorf("eventlog: list bucket %s: %w", cfg.Bucket, err)
	}
	for _, o := range list {
		if o.Deleted || (o.Metadata[metaStream] != cfg.Stream && o.Name != cfg.Fleet) {
			continue
		}
		if err := obs.Delete(ctx, o.Name); err != nil && !errors.Is(err, jetstream.ErrObjectNotFound) {
			return res, fmt.Errorf("eventlog: delete snapshot %s: %w", o.Name, err)
		}
		res.DeletedSnapshots++
	}
	cfg.Logger.Info("eventlog: reset", "stream", cfg.Stream, "purged", res.PurgedMessages,
		"snapshots_deleted", res.DeletedSnapshots)
	return res, nil
}
