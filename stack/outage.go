package stack

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/kvroute/kvroute/events"
)

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

// Apply implements events.Sink.
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

// ClearBackend implements events.Sink.
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

func (g *replayGuard) stats() OutageReplayStats {
	return OutageReplayStats{DuplicateBatches: g.batches.Load(), DuplicateEvents: g.events.Load()}
}
