package events

import (
	"context"
	"fmt"
)

// BackendWriter applies one backend's batches to a Sink so that the sink never builds on a view
// with a hole in it: after a failed Sink.Apply, or once a reset is requested (a sequence gap that
// cannot be filled, a publisher restart, a lost connection), it clears the backend
// (Sink.ClearBackend) before it applies anything else. It counts each outcome on the Source
// passed to Apply: Processed or Dropped for the batch's events, Resets for each clear, and the
// sink's error as LastError.
//
// A transport keeps one BackendWriter per backend and calls it from one goroutine at a time, as
// the Sink contract requires: it is not safe for concurrent use. A transport that reads one
// backend on several goroutines (several connections or ranks) queues their batches to one
// worker that owns the writer. The zero value has no sink: use NewBackendWriter.
type BackendWriter struct {
	sink      Sink
	backend   string
	needClear bool
	clears    uint64 // successful ClearBackend calls
}

// NewBackendWriter returns a writer of backend's batches to sink, with no reset pending.
func NewBackendWriter(sink Sink, backend string) *BackendWriter {
	return &BackendWriter{sink: sink, backend: backend}
}

// Backend returns the backend the writer applies to.
func (w *BackendWriter) Backend() string { return w.backend }

// RequestReset makes the next Apply clear the backend first: the transport lost batches it cannot
// recover, or the publisher restarted with an empty cache.
func (w *BackendWriter) RequestReset() { w.needClear = true }

// ResetPending reports whether a clear is due before the next batch: one was requested, a
// Sink.Apply failed, or a ClearBackend failed. A transport may call Apply with an empty Batch to
// perform it without waiting for a batch (a publisher that went quiet).
func (w *BackendWriter) ResetPending() bool { return w.needClear }

// Clears returns how many times the writer has cleared the backend: a transport that tracks
// several publishers (chains) on one backend compares it with the count it saw at a chain's last
// batch, to tell that the backend was cleared since for a cause not that chain's own, and so
// that the chain should catch up again.
func (w *BackendWriter) Clears() uint64 { return w.clears }

// Apply performs a pending clear, then applies b to the sink, and reports whether b was applied.
// A batch without events only performs the pending clear (true when there was none to do, or it
// succeeded). ctx is passed to the sink.
//
// When the clear fails, b is not applied (its events count as Dropped) and the clear stays
// pending. When Sink.Apply fails, b's events count as Dropped and a clear becomes pending (the
// sink missed them), unless ctx was done (the transport is closing). src is the source b came
// from, and must not be nil. b is not kept.
func (w *BackendWriter) Apply(ctx context.Context, src *Source, b *Batch) bool {
	n := uint64(len(b.Events))
	if w.needClear {
		if err := w.sink.ClearBackend(ctx, w.backend); err != nil {
			src.SetError(fmt.Errorf("sink clear backend %q: %w", w.backend, err))
			src.Dropped.Add(n)
			return false
		}
		w.needClear = false
		w.clears++
		src.Resets.Add(1)
	}
	if n == 0 {
		return true
	}
	if err := w.sink.Apply(ctx, w.backend, b); err != nil {
		src.SetError(fmt.Errorf("sink apply: %w", err))
		src.Dropped.Add(n)
		if ctx.Err() == nil {
			w.needClear = true // the sink missed these events: its view has a hole
		}
		return false
	}
	src.Processed.Add(n)
	return true
}
