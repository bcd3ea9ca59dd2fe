package main

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/kvroute/kvroute/events"
)

// eventConsumer is what the proxy needs of an events transport (ZMQ or SSE consumer).
type eventConsumer interface {
	Start(ctx context.Context) error
	Status() []events.SourceStatus
	Close() error
}

// indexCounts are the index mutations one backend's events caused (the seeds' index_created and
// index_evicted per backend).
type indexCounts struct {
	created, evicted, cleared, applyErrors atomic.Uint64
}

// countingSink forwards every batch to the index and counts, per backend, the blocks (or prefix
// entries) its events created and evicted. Safe for concurrent use.
type countingSink struct {
	next events.Sink
	mu   sync.Mutex
	m    map[string]*indexCounts
}

func newCountingSink(next events.Sink) *countingSink {
	return &countingSink{next: next, m: map[string]*indexCounts{}}
}

func (s *countingSink) counts(backend string) *indexCounts {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.m[backend]
	if c == nil {
		c = &indexCounts{}
		s.m[backend] = c
	}
	return c
}

// Apply implements events.Sink.
func (s *countingSink) Apply(ctx context.Context, backend string, b *events.Batch) error {
	err := s.next.Apply(ctx, backend, b)
	c := s.counts(backend)
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

// ClearBackend implements events.Sink.
func (s *countingSink) ClearBackend(ctx context.Context, backend string) error {
	s.counts(backend).cleared.Add(1)
	return s.next.ClearBackend(ctx, backend)
}

// snapshot returns the counts of every backend seen.
func (s *countingSink) snapshot() map[string]*indexCounts {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]*indexCounts, len(s.m))
	for k, v := range s.m {
		out[k] = v
	}
	return out
}

// observe registers the seeds' kv_index_events_total{backend, type} counter.
func (s *countingSink) observe(mp metric.MeterProvider) (metric.Registration, error) {
	m := mp.Meter(proxyScope)
	ctr, err := m.Int64ObservableCounter(metricIndexMutations,
		metric.WithDescription("Index mutations caused by KV events, by backend and type (created, evicted)."),
		metric.WithUnit("{event}"))
	if err != nil {
		return nil, err
	}
	return m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		for b, c := range s.snapshot() {
			o.ObserveInt64(ctr, int64(c.created.Load()), metric.WithAttributes(attribute.String("backend", b), attribute.String("type", "created")))
			o.ObserveInt64(ctr, int64(c.evicted.Load()), metric.WithAttributes(attribute.String("backend", b), attribute.String("type", "evicted")))
		}
		return nil
	}, ctr)
}

// newEventConsumers builds the consumers of kv_cache_index.event_sources: one SSE consumer for
// the http(s) sources, one ZMQ consumer connecting to the tcp:// sources, and one ZMQ consumer
// bound to the bind: true endpoint.
func newEventConsumers(cfg *Config, sink events.Sink, mp metric.MeterProvider, log *slog.Logger) ([]eventConsumer, error) {
	var (
		sse          []events.SSESource
		zmq          []events.ZMQEndpoint
		sseBackoff   time.Duration
		zmqBackoff   time.Duration
		out          []eventConsumer
		bindSource   *EventSourceConfig
		minBackoffOf = func(cur time.Duration, ms int) time.Duration {
			if ms <= 0 {
				return cur
			}
			d := time.Duration(ms) * time.Millisecond
			if cur == 0 || d < cur {
				return d
			}
			return cur
		}
	)
	for i := range cfg.KVCacheIndex.EventSources {
		es := &cfg.KVCacheIndex.EventSources[i]
		switch {
		case es.Bind:
			bindSource = es
		case isZMQEndpoint(es.Endpoint):
			zmq = append(zmq, events.ZMQEndpoint{Backend: es.BackendName, Endpoint: es.Endpoint,
				ReplayEndpoint: es.ReplayEndpoint, Model: es.Model})
			zmqBackoff = minBackoffOf(zmqBackoff, es.ReconnectIntervalMS)
		default:
			sse = append(sse, events.SSESource{Backend: es.BackendName, URL: es.Endpoint, Model: es.Model})
			sseBackoff = minBackoffOf(sseBackoff, es.ReconnectIntervalMS)
		}
	}
	closeAll := func() {
		for _, c := range out {
			_ = c.Close()
		}
	}
	logger := log.With("component", "kv-events")
	if len(sse) > 0 {
		c, err := events.NewSSEConsumer(events.SSEConfig{Sink: sink, Sources: sse, InitialBackoff: sseBackoff,
			MaxBackoff: max(sseBackoff, events.DefaultSSEMaxBackoff), ClearOnReconnect: true,
			MeterProvider: mp, Logger: logger})
		if err != nil {
			return nil, fmt.Errorf("kv_cache_index.event_sources (SSE): %w", err)
		}
		out = append(out, c)
	}
	if len(zmq) > 0 {
		c, err := events.NewZMQConsumer(events.ZMQConfig{Sink: sink, Endpoints: zmq, InitialBackoff: zmqBackoff,
			MaxBackoff: max(zmqBackoff, events.DefaultZMQMaxBackoff), MeterProvider: mp, Logger: logger})
		if err != nil {
			closeAll()
			return nil, fmt.Errorf("kv_cache_index.event_sources (ZMQ): %w", err)
		}
		out = append(out, c)
	}
	if bindSource != nil {
		model := bindSource.Model
		if model == "" && len(cfg.Backends) > 0 {
			model = cfg.Backends[0].model()
		}
		c, err := events.NewZMQConsumer(events.ZMQConfig{Sink: sink, Bind: bindSource.Endpoint,
			TopicBackend: bindSource.TopicBackends, DefaultBackend: bindSource.BackendName, Model: model,
			MeterProvider: mp, Logger: logger})
		if err != nil {
			closeAll()
			return nil, fmt.Errorf("kv_cache_index.event_sources (ZMQ bind): %w", err)
		}
		out = append(out, c)
	}
	return out, nil
}
