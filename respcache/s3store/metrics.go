package s3store

import (
	"go.opentelemetry.io/otel/metric"

	"github.com/kvroute/kvroute/respcache/internal/storeutil"
)

// ScopeName is the instrumentation scope of the store's metrics.
const ScopeName = "github.com/kvroute/kvroute/respcache/s3store"

// Metric names of the store, after kvroute's cache metric list (OTel style; a Prometheus exporter
// adds _seconds/_total suffixes).
const (
	MetricLatency = "kvroute.cache.s3.latency" // histogram, s, {operation=get|set|delete}
	MetricErrors  = "kvroute.cache.s3.errors"  // counter, {type=connection|timeout|other}
)

// newStoreMetrics registers the latency histogram and the error counter.
func newStoreMetrics(mp metric.MeterProvider) (*storeutil.Instruments, error) {
	return storeutil.NewInstruments(storeutil.Meter(mp, ScopeName), "s3store", "s3", MetricLatency, MetricErrors)
}
