package main

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/metric"

	"github.com/kvroute/kvroute/events"
)

// eventConsumer is what the proxy needs of an events transport (ZMQ or SSE consumer).
type eventConsumer interface {
	Start(ctx context.Context) error
	Status() []events.SourceStatus
	Close() error
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
