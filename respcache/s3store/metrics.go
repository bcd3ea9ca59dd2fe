package s3store

import (
	"context"
	"fmt"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/kvroute/kvroute/respcache"
)

// ScopeName is the instrumentation scope of the store's metrics.
const ScopeName = "github.com/kvroute/kvroute/respcache/s3store"

// Metric names of the store, after kvroute's cache metric list (OTel style; a Prometheus exporter
// adds _seconds/_total suffixes).
const (
	MetricLatency = "kvroute.cache.s3.latency" // histogram, s, {operation=get|set|delete}
	MetricErrors  = "kvroute.cache.s3.errors"  // counter, {type=connection|timeout|other}
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
}

// newStoreMetrics registers the latency histogram and the error counter.
func newStoreMetrics(mp metric.MeterProvider) (*storeMetrics, error) {
	if mp == nil {
		mp = noop.NewMeterProvider()
	}
	meter := mp.Meter(ScopeName)
	m := &storeMetrics{errOpts: make(map[string][]metric.AddOption, 3)}
	var err error
	m.hist, err = meter.Float64Histogram(MetricLatency,
		metric.WithDescription("s3 operation latency (get, set, delete)."),
		metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5))
	if err != nil {
		return nil, fmt.Errorf("s3store: metric %s: %w", MetricLatency, err)
	}
	m.errs, err = meter.Int64Counter(MetricErrors,
		metric.WithDescription("s3 errors by type (connection, timeout, other)."),
		metric.WithUnit("{error}"))
	if err != nil {
		return nil, fmt.Errorf("s3store: metric %s: %w", MetricErrors, err)
	}
	for op := range numOps {
		m.opOpts[op] = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(attribute.String("operation", op.String())))}
	}
	for _, typ := range []string{respcache.ErrorTypeConnection, respcache.ErrorTypeTimeout, respcache.ErrorTypeOther} {
		m.errOpts[typ] = []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(attribute.String("type", typ)))}
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
