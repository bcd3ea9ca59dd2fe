package enginemetrics

import (
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/kvroute/kvroute/telemetry"
)

// scopeName is the instrumentation scope of the package's metrics.
const scopeName = "github.com/kvroute/kvroute/enginemetrics"

// result is the outcome of one scrape, the result attribute of telemetry.MetricEngineScrapes.
type result uint8

const (
	resultOK result = iota
	resultError
	resultTooLarge
	resultParseError
	numResults
)

// String returns the attribute value.
func (r result) String() string {
	switch r {
	case resultOK:
		return "ok"
	case resultTooLarge:
		return "too_large"
	case resultParseError:
		return "parse_error"
	}
	return "error"
}

// instruments are the Scraper's metric instruments; safe for concurrent use.
type instruments struct {
	scrapes  metric.Int64Counter
	duration metric.Float64Histogram
	reports  metric.Int64Counter
}

func newInstruments(mp metric.MeterProvider) (*instruments, error) {
	if mp == nil {
		mp = noop.NewMeterProvider()
	}
	meter := mp.Meter(scopeName)
	m := &instruments{}
	var err error
	if m.scrapes, err = meter.Int64Counter(telemetry.MetricEngineScrapes,
		metric.WithDescription("Scrapes of engine metrics endpoints by backend and result (ok, error, too_large, parse_error)."),
		metric.WithUnit("{scrape}")); err != nil {
		return nil, fmt.Errorf("enginemetrics: metric %s: %w", telemetry.MetricEngineScrapes, err)
	}
	if m.duration, err = meter.Float64Histogram(telemetry.MetricEngineScrapeDuration,
		metric.WithDescription("Duration of engine metrics scrapes by backend: request, body and parse."),
		metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5)); err != nil {
		return nil, fmt.Errorf("enginemetrics: metric %s: %w", telemetry.MetricEngineScrapeDuration, err)
	}
	if m.reports, err = meter.Int64Counter(telemetry.MetricEngineReportErrors,
		metric.WithDescription("Engine loads the sink refused, by backend."),
		metric.WithUnit("{report}")); err != nil {
		return nil, fmt.Errorf("enginemetrics: metric %s: %w", telemetry.MetricEngineReportErrors, err)
	}
	return m, nil
}

// targetAttrs are one backend's attribute options, built once so that recording allocates
// nothing.
type targetAttrs struct {
	scrapes [numResults][]metric.AddOption
	backend []metric.RecordOption
	reports []metric.AddOption
}

func newTargetAttrs(backend string) *targetAttrs {
	a := &targetAttrs{}
	b := attribute.String("backend", backend)
	for r := range numResults {
		a.scrapes[r] = []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(b, attribute.String("result", r.String())))}
	}
	set := metric.WithAttributeSet(attribute.NewSet(b))
	a.backend = []metric.RecordOption{set}
	a.reports = []metric.AddOption{set}
	return a
}
