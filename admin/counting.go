package admin

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvroute/kvroute/events"
)

// MutationCounts are the index mutations one backend's events caused: blocks (or prefix entries)
// created and evicted, whole-backend clears, and batches the next sink refused.
type MutationCounts struct {
	Created     uint64 `json:"index_created"`
	Evicted     uint64 `json:"index_evicted"`
	Cleared     uint64 `json:"cleared"`
	ApplyErrors uint64 `json:"apply_errors"`
}

// CountingSink is an events.Sink that passes every batch to the next one and counts, per
// backend, the mutations the batch carried (MutationCounts), for a gateway's
// /admin/kv-index/backends (SummarizeBackends). A batch the next sink refuses counts as an apply
// error only. It is safe for concurrent use.
type CountingSink struct {
	next events.Sink
	mu   sync.Mutex
	m    map[string]*mutationCounters
}

type mutationCounters struct{ created, evicted, cleared, applyErrors atomic.Uint64 }

var (
	_ events.Sink         = (*CountingSink)(nil)
	_ events.LossReporter = (*CountingSink)(nil)
)

// NewCountingSink returns a CountingSink in front of next.
func NewCountingSink(next events.Sink) *CountingSink {
	return &CountingSink{next: next, m: map[string]*mutationCounters{}}
}

func (s *CountingSink) counters(backend string) *mutationCounters {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.m[backend]
	if c == nil {
		c = &mutationCounters{}
		s.m[backend] = c
	}
	return c
}

// Apply passes b to the next sink and, when it succeeds, counts b's mutations for backend. It
// returns the next sink's error.
func (s *CountingSink) Apply(ctx context.Context, backend string, b *events.Batch) error {
	err := s.next.Apply(ctx, backend, b)
	c := s.counters(backend)
	if err != nil {
		c.applyErrors.Add(1)
		return err
	}
	for i := range b.Events {
		ev := &b.Events[i]
		switch ev.Kind {
		case events.KindBlockStored:
			c.created.Add(uint64(len(ev.BlockHashes)))
		case events.KindBlockRemoved:
			c.evicted.Add(uint64(len(ev.BlockHashes)))
		case events.KindAllBlocksCleared:
			c.cleared.Add(1)
		case events.KindPrefix:
			switch ev.PrefixOp {
			case events.PrefixCreated, events.PrefixReloaded:
				c.created.Add(1)
			default:
				c.evicted.Add(1)
			}
		}
	}
	return nil
}

// ClearBackend counts a clear for backend and passes it to the next sink.
func (s *CountingSink) ClearBackend(ctx context.Context, backend string) error {
	s.counters(backend).cleared.Add(1)
	return s.next.ClearBackend(ctx, backend)
}

// BackendLost implements events.LossReporter: it asks the next sink when that sink is an
// events.LossReporter, and otherwise reports no loss.
func (s *CountingSink) BackendLost(ctx context.Context, backend string) (bool, error) {
	if lr, ok := s.next.(events.LossReporter); ok {
		return lr.BackendLost(ctx, backend)
	}
	return false, nil
}

// Counts returns the counts of every backend seen so far.
func (s *CountingSink) Counts() map[string]MutationCounts {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]MutationCounts, len(s.m))
	for k, c := range s.m {
		out[k] = MutationCounts{Created: c.created.Load(), Evicted: c.evicted.Load(), Cleared: c.cleared.Load(),
			ApplyErrors: c.applyErrors.Load()}
	}
	return out
}

// BackendSummary is one backend's view of its event sources: their connection and event counts
// added up, the index mutations its events caused and the entries it holds, and each source.
type BackendSummary struct {
	Backend      string            `json:"backend_name"`
	Connection   BackendConnection `json:"connection"`
	Events       BackendEvents     `json:"events"`
	IndexEntries int               `json:"index_entries"`
	Sources      []SourceSummary   `json:"sources,omitempty"`
}

// BackendConnection adds up the connections of a backend's sources: connected when one is.
type BackendConnection struct {
	Connected      bool      `json:"connected"`
	ReconnectCount uint64    `json:"reconnect_count"`
	LastEventAt    time.Time `json:"last_event_at,omitzero"`
}

// BackendEvents adds up the events of a backend's sources, with the index mutations they caused.
type BackendEvents struct {
	Received     uint64 `json:"received"`
	Processed    uint64 `json:"processed"`
	Dropped      uint64 `json:"dropped"`
	Malformed    uint64 `json:"malformed"`
	IndexCreated uint64 `json:"index_created"`
	IndexEvicted uint64 `json:"index_evicted"`
	Resets       uint64 `json:"resets"`
	// ResetsLimited adds up the sources' resets refused by the backend's reset budget.
	ResetsLimited uint64 `json:"resets_limited"`
}

// SourceSummary is one source of a BackendSummary.
type SourceSummary struct {
	Transport string `json:"transport"`
	Endpoint  string `json:"endpoint"`
	Status    string `json:"status"`
	LastError string `json:"last_error,omitempty"`
	// Sequence: gaps, replays, catch-ups and resets of a ZMQ source, present (all zero) before its
	// first batch too; all zero for SSE, which numbers no batches.
	Sequence events.SequenceStats `json:"sequence"`
}

// SummarizeBackends returns one BackendSummary per backend: those of backends first, in their
// order, then any other backend a source or a count names, in the order met. entries gives each
// backend's index entries (nil: none known).
func SummarizeBackends(backends []string, sources []events.SourceStatus, counts map[string]MutationCounts, entries map[string]int) []BackendSummary {
	var out []BackendSummary
	at := map[string]int{}
	get := func(name string) *BackendSummary {
		i, ok := at[name]
		if !ok {
			i = len(out)
			at[name] = i
			out = append(out, BackendSummary{Backend: name, IndexEntries: entries[name]})
		}
		return &out[i]
	}
	for _, name := range backends {
		get(name)
	}
	for _, ss := range sources {
		b := get(ss.Backend)
		c := &b.Connection
		c.Connected = c.Connected || ss.Connection.Connected
		c.ReconnectCount += ss.Connection.ReconnectCount
		if ss.Connection.LastEventAt.After(c.LastEventAt) {
			c.LastEventAt = ss.Connection.LastEventAt
		}
		e := &b.Events
		e.Received += ss.Events.Received
		e.Processed += ss.Events.Processed
		e.Dropped += ss.Events.Dropped
		e.Malformed += ss.Events.Malformed
		e.Resets += ss.Sequence.Resets
		e.ResetsLimited += ss.Sequence.ResetsLimited
		b.Sources = append(b.Sources, SourceSummary{Transport: ss.Transport, Endpoint: ss.Endpoint,
			Status: string(ss.Connection.State), LastError: ss.LastError, Sequence: ss.Sequence})
	}
	names := make([]string, 0, len(counts))
	for name := range counts {
		names = append(names, name)
	}
	slices.Sort(names) // a stable order for backends only the counts name
	for _, name := range names {
		b := get(name)
		b.Events.IndexCreated = counts[name].Created
		b.Events.IndexEvicted = counts[name].Evicted
	}
	if out == nil {
		out = []BackendSummary{}
	}
	return out
}
