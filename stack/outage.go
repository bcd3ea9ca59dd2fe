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

// Apply implements events.Sink. While the connection is down the batch reaches the index, and
// the guard records it, before it is handed to the Publisher: the stream cannot bring it back
// ahead of the record, however soon the connection returns.
func (o *outageTee) Apply(ctx context.Context, backend string, b *events.Batch) error {
	if !o.connected() {
		o.guard.appliedDirectly(backend, b)
		err := o.index.Apply(ctx, backend, b)
		_ = o.pub.Apply(ctx, backend, b) // the stream takes it to the peers when it can
		return err
	}
	err := o.pub.Apply(ctx, backend, b)
	if !o.connected() { // lost during the publish: the batch waits in the client's buffer
		o.guard.appliedDirectly(backend, b)
		return o.index.Apply(ctx, backend, b)
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
// backend and data-parallel rank, the engine sequences of the first and the last batch the tee
// applied; a batch from the stream between them is skipped and counted as a duplicate, one below
// them is applied (published before the outage, or by an engine that restarted its count), the
// first one above them ends the watch (the stream is past the outage), and a clear of the backend
// (from the stream or the tee) forgets it. Applying such a batch a second time leaves the index's entries as they
// were, but counts its removes of blocks already removed as unknown_block drops and its stores
// whose parent went since as unknown_parent: a drop alert would fire for no loss. Batches without
// an engine sequence (SSE) are always applied. Safe for concurrent use.
type replayGuard struct {
	sink events.Sink

	mu   sync.Mutex
	seen map[guardKey]seqSpan

	batches, events atomic.Uint64 // duplicates skipped
}

// seqSpan is the engine sequences of the first and the last batch applied directly.
type seqSpan struct{ first, last uint64 }

type guardKey struct {
	backend string
	rank    int // -1: the batches name none
}

func newReplayGuard(sink events.Sink) *replayGuard {
	return &replayGuard{sink: sink, seen: map[guardKey]seqSpan{}}
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
	k := keyOf(backend, b)
	g.mu.Lock()
	sp, ok := g.seen[k]
	if !ok || b.Seq < sp.first {
		sp.first = b.Seq
	}
	sp.last = max(sp.last, b.Seq)
	g.seen[k] = sp
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
		sp, ok := g.seen[k]
		if ok && b.Seq >= sp.first && b.Seq <= sp.last {
			g.mu.Unlock()
			g.batches.Add(1)
			g.events.Add(uint64(len(b.Events)))
			return nil
		}
		if ok && b.Seq > sp.last {
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
