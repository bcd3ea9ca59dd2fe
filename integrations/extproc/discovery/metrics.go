package discovery

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
)

// Metric names of a Watcher, in OpenTelemetry's dotted form (a Prometheus exporter shows them as
// kvroute_discovery_resolves_total and so on).
const (
	// MetricResolves counts resolves by result: ok, empty (no address) or error (resolver error
	// or too many addresses; the endpoints were kept).
	MetricResolves = "kvroute.discovery.resolves"
	// MetricEndpoints is the number of endpoints the Membership holds.
	MetricEndpoints = "kvroute.discovery.endpoints"
	// MetricMembershipErrors counts the changes the Membership refused, by op (add, remove).
	MetricMembershipErrors = "kvroute.discovery.membership_errors"
)

// scopeName is the instrumentation scope of the Watcher's metrics.
const scopeName = "github.com/kvroute/kvroute/integrations/extproc/discovery"

// Results of MetricResolves.
const (
	resultOK    = "ok"
	resultEmpty = "empty"
	resultError = "error"
)

// instruments are a Watcher's metrics.
type instruments struct {
	resolves   metric.Int64Counter
	memberErrs metric.Int64Counter
	reg        metric.Registration
	results    map[string]metric.AddOption
	ops        map[string]metric.AddOption
}

func newInstruments(mp metric.MeterProvider, w *Watcher) (*instruments, error) {
	if mp == nil {
		mp = noop.NewMeterProvider()
	}
	meter := mp.Meter(scopeName)
	in := &instruments{results: map[string]metric.AddOption{}, ops: map[string]metric.AddOption{}}
	for _, r := range []string{resultOK, resultEmpty, resultError} {
		in.results[r] = metric.WithAttributeSet(attribute.NewSet(attribute.String("result", r)))
	}
	for _, op := range []string{"add", "remove"} {
		in.ops[op] = metric.WithAttributeSet(attribute.NewSet(attribute.String("op", op)))
	}
	var err error
	if in.resolves, err = meter.Int64Counter(MetricResolves, metric.WithUnit("{resolve}"),
		metric.WithDescription("DNS resolves of the endpoint picker's discovery name, by result (ok, empty, error).")); err != nil {
		return nil, fmt.Errorf("discovery: metric %s: %w", MetricResolves, err)
	}
	if in.memberErrs, err = meter.Int64Counter(MetricMembershipErrors, metric.WithUnit("{change}"),
		metric.WithDescription("Endpoint changes the membership refused, by op (add, remove); each is retried at the next resolve.")); err != nil {
		return nil, fmt.Errorf("discovery: metric %s: %w", MetricMembershipErrors, err)
	}
	gauge, err := meter.Int64ObservableGauge(MetricEndpoints, metric.WithUnit("{endpoint}"),
		metric.WithDescription("Endpoints found by DNS discovery and held by the membership."))
	if err != nil {
		return nil, fmt.Errorf("discovery: metric %s: %w", MetricEndpoints, err)
	}
	if in.reg, err = meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		o.ObserveInt64(gauge, int64(w.Stats().Endpoints))
		return nil
	}, gauge); err != nil {
		return nil, fmt.Errorf("discovery: metric %s: %w", MetricEndpoints, err)
	}
	return in, nil
}

// resolved counts one resolve.
func (in *instruments) resolved(ctx context.Context, result string) {
	in.resolves.Add(context.WithoutCancel(ctx), 1, in.results[result])
}

// membershipError counts one refused change.
func (in *instruments) membershipError(op string) {
	in.memberErrs.Add(context.Background(), 1, in.ops[op])
}

// close unregisters the gauge's callback.
func (in *instruments) close() {
	if in.reg != nil {
		_ = in.reg.Unregister()
	}
}
