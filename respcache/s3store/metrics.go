package s3store

import (
	"go.opentelemetry.io/otel/metric"

	"github.com/kvroute/kvroute/respcache/internal/storeutil"
	"github.com/kvroute/kvroute/telemetry"
)

// scopeName is the instrumentation scope of the package's metrics.
const scopeName = "github.com/kvroute/kvroute/respcache/s3store"

// newStoreMetrics registers the latency histogram and the error counter.
func newStoreMetrics(mp metric.MeterProvider) (*storeutil.Instruments, error) {
	return storeutil.NewInstruments(storeutil.Meter(mp, scopeName), "s3store", "s3", telemetry.MetricCacheS3Latency, telemetry.MetricCacheS3Errors)
}
