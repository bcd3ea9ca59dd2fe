package redisstore

import (
	"context"
	"fmt"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/kvroute/kvroute/respcache/internal/storeutil"
	"github.com/kvroute/kvroute/telemetry"
)

// scopeName is the instrumentation scope of the package's metrics.
const scopeName = "github.com/kvroute/kvroute/respcache/redisstore"

// storeMetrics holds the store's instruments: the latency histogram and error counter every store
// has, and the registration of its gauges.
type storeMetrics struct {
	*storeutil.Instruments
	reg  metric.Registration
	once sync.Once
}

// newStoreMetrics registers the latency histogram, the error counter and the observable gauges
// (fallback, backend type, connections) of r, whose callback reads only atomics.
func newStoreMetrics(mp metric.MeterProvider, r *Store) (*storeMetrics, error) {
	meter := storeutil.Meter(mp, scopeName)
	inst, err := storeutil.NewInstruments(meter, "redisstore", "redis", telemetry.MetricCacheRedisLatency, telemetry.MetricCacheRedisErrors)
	if err != nil {
		return nil, err
	}
	m := &storeMetrics{Instruments: inst}
	fallback, err := meter.Int64ObservableGauge(telemetry.MetricCacheFallbackActive,
		metric.WithDescription("1 while the in-memory fallback serves instead of Redis."))
	if err != nil {
		return nil, fmt.Errorf("redisstore: metric %s: %w", telemetry.MetricCacheFallbackActive, err)
	}
	backendType, err := meter.Int64ObservableGauge(telemetry.MetricCacheBackendType,
		metric.WithDescription("Active backend type: 1 for the backend serving (redis or memory), 0 for the other."))
	if err != nil {
		return nil, fmt.Errorf("redisstore: metric %s: %w", telemetry.MetricCacheBackendType, err)
	}
	conns, err := meter.Int64ObservableGauge(telemetry.MetricCacheRedisConnections,
		metric.WithDescription("Redis connections: active = commands in flight, idle = pool size − active."),
		metric.WithUnit("{connection}"))
	if err != nil {
		return nil, fmt.Errorf("redisstore: metric %s: %w", telemetry.MetricCacheRedisConnections, err)
	}
	redisOpt := metric.WithAttributeSet(attribute.NewSet(attribute.String("backend", "redis")))
	memOpt := metric.WithAttributeSet(attribute.NewSet(attribute.String("backend", "memory")))
	activeOpt := metric.WithAttributeSet(attribute.NewSet(attribute.String("state", "active")))
	idleOpt := metric.WithAttributeSet(attribute.NewSet(attribute.String("state", "idle")))
	m.reg, err = meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		var fb int64
		if r.active.Load() {
			fb = 1
		}
		o.ObserveInt64(fallback, fb)
		o.ObserveInt64(backendType, 1-fb, redisOpt)
		o.ObserveInt64(backendType, fb, memOpt)
		active := max(r.inflight.Load(), 0)
		o.ObserveInt64(conns, active, activeOpt)
		o.ObserveInt64(conns, max(int64(r.cfg.PoolSize)-active, 0), idleOpt)
		return nil
	}, fallback, backendType, conns)
	if err != nil {
		return nil, fmt.Errorf("redisstore: metric callback: %w", err)
	}
	return m, nil
}

// close unregisters the gauges' callback; idempotent.
func (m *storeMetrics) close() {
	m.once.Do(func() {
		if m.reg != nil {
			_ = m.reg.Unregister()
		}
	})
}
