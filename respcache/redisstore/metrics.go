package redisstore

import (
	"context"
	"fmt"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/kvroute/kvroute/respcache"
)

// ScopeName is the instrumentation scope of the store's metrics.
const ScopeName = "github.com/kvroute/kvroute/respcache/redisstore"

// Metric names of the store, after kvroute's cache metric list (OTel style; a Prometheus exporter
// adds _seconds/_total suffixes).
const (
	MetricLatency        = "kvroute.cache.redis.latency"     // histogram, s, {operation=get|set|delete}
	MetricErrors         = "kvroute.cache.redis.errors"      // counter, {type=connection|timeout|other}
	MetricConnections    = "kvroute.cache.redis.connections" // gauge, {state=active|idle}
	MetricFallbackActive = "kvroute.cache.fallback_active"   // gauge, 1 while the fallback serves
	MetricBackendType    = "kvroute.cache.backend_type"      // gauge, {backend=redis|memory}: 1 = serving
)

// opKind is an operation label of the latency histogram.
type opKind uint8

const (
	opGet opKind = iota
	opSet
	opDelete
	numOps
)

func (op opKind) String() string {
	switch op {
	case opGet:
		return "get"
	case opSet:
		return "set"
	}
	return "delete"
}

// storeMetrics holds the store's instruments, with attribute options built once so that recording
// allocates nothing.
type storeMetrics struct {
	hist    metric.Float64Histogram
	errs    metric.Int64Counter
	opOpts  [numOps][]metric.RecordOption
	errOpts map[string][]metric.AddOption // by error type
	reg     metric.Registration
	once    sync.Once
}

// newStoreMetrics registers the latency histogram, the error counter and the observable gauges
// (fallback, backend type, connections) of r, whose callback reads only atomics.
func newStoreMetrics(mp metric.MeterProvider, r *Store) (*storeMetrics, error) {
	if mp == nil {
		mp = noop.NewMeterProvider()
	}
	meter := mp.Meter(ScopeName)
	m := &storeMetrics{errOpts: make(map[string][]metric.AddOption, 3)}
	var err error
	m.hist, err = meter.Float64Histogram(MetricLatency,
		metric.WithDescription("redis operation latency (get, set, delete)."),
		metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5))
	if err != nil {
		return nil, fmt.Errorf("redisstore: metric %s: %w", MetricLatency, err)
	}
	m.errs, err = meter.Int64Counter(MetricErrors,
		metric.WithDescription("redis errors by type (connection, timeout, other)."),
		metric.WithUnit("{error}"))
	if err != nil {
		return nil, fmt.Errorf("redisstore: metric %s: %w", MetricErrors, err)
	}
	for op := range numOps {
		m.opOpts[op] = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(attribute.String("operation", op.String())))}
	}
	for _, typ := range []string{respcache.ErrorTypeConnection, respcache.ErrorTypeTimeout, respcache.ErrorTypeOther} {
		m.errOpts[typ] = []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(attribute.String("type", typ)))}
	}
	fallback, err := meter.Int64ObservableGauge(MetricFallbackActive,
		metric.WithDescription("1 while the in-memory fallback serves instead of Redis."))
	if err != nil {
		return nil, fmt.Errorf("redisstore: metric %s: %w", MetricFallbackActive, err)
	}
	backendType, err := meter.Int64ObservableGauge(MetricBackendType,
		metric.WithDescription("Active backend type: 1 for the backend serving (redis or memory), 0 for the other."))
	if err != nil {
		return nil, fmt.Errorf("redisstore: metric %s: %w", MetricBackendType, err)
	}
	conns, err := meter.Int64ObservableGauge(MetricConnections,
		metric.WithDescription("Redis connections: active = commands in flight, idle = pool size − active."),
		metric.WithUnit("{connection}"))
	if err != nil {
		return nil, fmt.Errorf("redisstore: metric %s: %w", MetricConnections, err)
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

func (m *storeMetrics) latency(ctx context.Context, op opKind, start time.Time) {
	m.hist.Record(ctx, time.Since(start).Seconds(), m.opOpts[op]...)
}

// countError counts one error of type typ; other values ("" included) are ignored.
func (m *storeMetrics) countError(typ string) {
	if opts, ok := m.errOpts[typ]; ok {
		m.errs.Add(context.Background(), 1, opts...)
	}
}

// close unregisters the gauges' callback; idempotent.
func (m *storeMetrics) close() {
	m.once.Do(func() {
		if m.reg != nil {
			_ = m.reg.Unregister()
		}
	})
}
