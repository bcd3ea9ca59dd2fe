package storeutil

import (
	"context"
	"fmt"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/kvroute/kvroute/respcache"
)

// Op is an operation label of the latency histogram.
type Op uint8

// The operations of the latency histogram's "operation" attribute.
const (
	OpGet Op = iota
	OpSet
	OpDelete
	numOps
)

// String returns the attribute value: "get", "set" or "delete".
func (op Op) String() string {
	switch op {
	case OpGet:
		return "get"
	case OpSet:
		return "set"
	}
	return "delete"
}

// Meter returns mp's meter of the instrumentation scope scope; a nil mp means a no-op provider.
func Meter(mp metric.MeterProvider, scope string) metric.Meter {
	if mp == nil {
		mp = noop.NewMeterProvider()
	}
	return mp.Meter(scope)
}

// Instruments are a store's latency histogram ({operation=get|set|delete}, in seconds) and error
// counter ({type=connection|timeout|other}), with their attribute options built once so that
// recording allocates nothing. Its methods are safe for concurrent use.
type Instruments struct {
	hist    metric.Float64Histogram
	errs    metric.Int64Counter
	opOpts  [numOps][]metric.RecordOption
	errOpts map[string][]metric.AddOption // by error type
}

// NewInstruments creates on meter the latency histogram latencyName and the error counter
// errorsName of a store whose server is system ("redis", "s3": the instruments' descriptions name
// it). An error of the meter is returned wrapped, after pkg ("redisstore") and the metric's name.
func NewInstruments(meter metric.Meter, pkg, system, latencyName, errorsName string) (*Instruments, error) {
	m := &Instruments{errOpts: make(map[string][]metric.AddOption, 3)}
	var err error
	m.hist, err = meter.Float64Histogram(latencyName,
		metric.WithDescription(system+" operation latency (get, set, delete)."),
		metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5))
	if err != nil {
		return nil, fmt.Errorf("%s: metric %s: %w", pkg, latencyName, err)
	}
	m.errs, err = meter.Int64Counter(errorsName,
		metric.WithDescription(system+" errors by type (connection, timeout, other)."),
		metric.WithUnit("{error}"))
	if err != nil {
		return nil, fmt.Errorf("%s: metric %s: %w", pkg, errorsName, err)
	}
	for op := range numOps {
		m.opOpts[op] = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(attribute.String("operation", op.String())))}
	}
	for _, typ := range []string{respcache.ErrorTypeConnection, respcache.ErrorTypeTimeout, respcache.ErrorTypeOther} {
		m.errOpts[typ] = []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(attribute.String("type", typ)))}
	}
	return m, nil
}

// Latency records the time since start as the latency of one operation op.
func (m *Instruments) Latency(ctx context.Context, op Op, start time.Time) {
	m.hist.Record(ctx, time.Since(start).Seconds(), m.opOpts[op]...)
}

// CountError counts one error of type typ; other values ("" included) are ignored.
func (m *Instruments) CountError(typ string) {
	if opts, ok := m.errOpts[typ]; ok {
		m.errs.Add(context.Background(), 1, opts...)
	}
}
