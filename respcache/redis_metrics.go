package respcache

import (
	"context"
	"fmt"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
)

// Metric names of the S3 store.
const (
	MetricS3Latency = "kvroute.cache.s3.latency" // histogram, s, {operation=get|set|delete}
	MetricS3Errors  = "kvroute.cache.s3.errors"  // counter, {type=connection|timeout|other}
)

// opKind is an operation label of the latency histograms.
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

// storeMetrics holds a remote store's instruments, with attribute options built once so that
// recording allocates nothing.
type storeMetrics struct {
	hist    metric.Float64Histogram
	errs    metric.Int64Counter
	opOpts  [numOps][]metric.RecordOption
	errOpts [numKinds][]metric.AddOption
	reg     metric.Registration // Redis gauges; nil otherwise
	once    sync.Once
}

// newStoreMetrics registers the latency histogram and the error counter of backend ("redis" or
// "s3") and, for a Redis store r, the observable gauges (fallback, backend type, connections),
// whose callback reads only atomics.
func newStoreMetrics(mp metric.MeterProvider, backend string, r *RedisStore) (*storeMetrics, error) {
	if mp == nil {
		mp = noop.NewMeterProvider()
	}
	meter := mp.Meter(ScopeName)
	latName, errName := MetricRedisLatency, MetricRedisErrors
	if backend == "s3" {
		latName, errName = MetricS3Latency, MetricS3Errors
	}
	m := &storeMetrics{}
	var err error
	m.hist, err = meter.Float64Histogram(latName,
		metric.WithDescription(fmt.Sprintf("%s operation latency (get, set, delete).", backend)),
		metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5))
	if err != nil {
		return nil, fmt.Errorf("respcache: metric %s: %w", latName, err)
	}
	m.errs, err = meter.Int64Counter(errName,
		metric.WithDescription(fmt.Sprintf("%s errors by type (connection, timeout, other).", backend)),
		metric.WithUnit("{error}"))
	if err != nil {
		return nil, fmt.Errorf("respcache: metric %s: %w", errName, err)
	}
	for op := range numOps {
		m.opOpts[op] = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(attribute.String("operation", op.String())))}
	}
	for _, k := range []errKind{kindConnection, kindTimeout, kindOther} {
		m.errOpts[k] = []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(attribute.String("type", k.String())))}
	}
	if r == nil {
		return m, nil
	}
	fallback, err := meter.Int64ObservableGauge(MetricFallbackActive,
		metric.WithDescription("1 while the in-memory fallback serves instead of Redis."))
	if err != nil {
		return nil, fmt.Errorf("respcache: metric %s: %w", MetricFallbackActive, err)
	}
	backendType, err := meter.Int64ObservableGauge(MetricBackendType,
		metric.WithDescription("Active backend type: 1 for the backend serving (redis or memory), 0 for the other."))
	if err != nil {
		return nil, fmt.Errorf("respcache: metric %s: %w", MetricBackendType, err)
	}
	conns, err := meter.Int64ObservableGauge(MetricRedisConnections,
		metric.WithDescription("Redis connections: active = commands in flight, idle = pool size − active."),
		metric.WithUnit("{connection}"))
	if err != nil {
		return nil, fmt.Errorf("respcache: metric %s: %w", MetricRedisConnections, err)
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
		return nil, fmt.Errorf("respcache: metric callback: %w", err)
	}
	return m, nil
}

func (m *storeMetrics) latency(ctx context.Context, op opKind, start time.Time) {
	m.hist.Record(ctx, time.Since(start).Seconds(), m.opOpts[op]...)
}

func (m *storeMetrics) countError(k errKind) {
	if opts := m.errOpts[k]; opts != nil {
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
