package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/attribute"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/kvroute/kvroute/admin"
	"github.com/kvroute/kvroute/health"
	"github.com/kvroute/kvroute/stack"
)

// Metric names of the proxy itself (the library packages register their own).
const (
	proxyScope            = "github.com/kvroute/kvroute/examples/proxy"
	metricProxyRequests   = "kvroute.proxy.requests"         // counter {endpoint, code}
	metricUpstreamErrors  = "kvroute.proxy.upstream_errors"  // counter {backend, kind}
	metricRetries         = "kvroute.proxy.retries"          // counter {backend}: the backend that failed
	metricBackendHealthy  = "kvroute.proxy.backend_healthy"  // gauge {backend}: 1 in rotation
	metricCircuitOpen     = "kvroute.proxy.circuit_open"     // gauge {backend}: 1 while open
	metricRequestDuration = "kvroute.proxy.request_duration" // histogram s {endpoint}
	metricIndexMutations  = "kvroute.kv_index.events"        // counter {backend, type}
	// metricOutageDuplicates counts the event log's batches this replica had indexed during a NATS
	// outage, skipped when the stream brought them again (stack.OutageReplayStats).
	metricOutageDuplicates = "kvroute.proxy.event_log_outage_duplicates" // counter
)

// otelSDK is the OpenTelemetry SDK MeterProvider the library packages and the proxy record
// into, exported through a Prometheus exporter registered on a private registry (never the
// global one), served at /metrics.
type otelSDK struct {
	provider *sdkmetric.MeterProvider
	registry *prometheus.Registry
	handler  http.Handler

	requests       metric.Int64ObservableCounter
	endpoints      []*endpointMetrics // forEndpoint's, observed by the requests counter
	upstreamErrors metric.Int64Counter
	retries        metric.Int64Counter
	duration       metric.Float64Histogram
	reg            metric.Registration
}

func newTelemetry() (*otelSDK, error) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	exp, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		return nil, fmt.Errorf("prometheus exporter: %w", err)
	}
	t := &otelSDK{
		provider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(exp)),
		registry: reg,
		handler:  promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}),
	}
	m := t.provider.Meter(proxyScope)
	errs := []error{}
	add := func(err error) { errs = append(errs, err) }
	t.requests, err = m.Int64ObservableCounter(metricProxyRequests, metric.WithDescription("Requests answered by the proxy, by endpoint and status code."), metric.WithUnit("{request}"))
	add(err)
	t.upstreamErrors, err = m.Int64Counter(metricUpstreamErrors, metric.WithDescription("Upstream failures by backend and kind (connect, status_5xx, other)."), metric.WithUnit("{error}"))
	add(err)
	t.retries, err = m.Int64Counter(metricRetries, metric.WithDescription("Requests retried on another backend after a connection failure, by failed backend."), metric.WithUnit("{request}"))
	add(err)
	t.duration, err = m.Float64Histogram(metricRequestDuration, metric.WithDescription("Time to the end of the response, by endpoint."), metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
	add(err)
	if err == nil {
		_, err = t.observeRequests() // unregistered with the provider's Shutdown
		add(err)
	}
	if err := errors.Join(errs...); err != nil {
		_ = t.provider.Shutdown(context.Background())
		return nil, err
	}
	return t, nil
}

// endpointMetrics records the requests of one LLM endpoint: a count per status code, observed
// when metrics are collected (no metrics call per request), and the duration histogram, whose
// attribute set is built once. Safe for concurrent use.
type endpointMetrics struct {
	endpoint attribute.KeyValue
	t        *otelSDK
	duration []metric.RecordOption
	counts   [600]atomic.Uint64 // by status code; codes out of range count under 0
}

// forEndpoint returns the recorder of endpoint's requests. Call it before the first collection.
func (t *otelSDK) forEndpoint(endpoint string) *endpointMetrics {
	kv := attribute.String("endpoint", endpoint)
	m := &endpointMetrics{t: t, endpoint: kv, duration: []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(kv))}}
	t.endpoints = append(t.endpoints, m)
	return m
}

// record counts one answered request and its duration. The context only carries what exemplars
// may use (a span); the SDK records the measurement whether or not it is done.
func (m *endpointMetrics) record(ctx context.Context, code int, d time.Duration) {
	if code < 0 || code >= len(m.counts) {
		code = 0
	}
	m.counts[code].Add(1)
	m.t.duration.Record(ctx, d.Seconds(), m.duration...)
}

// observeRequests registers the callback that reports the endpoints' request counts.
func (t *otelSDK) observeRequests() (metric.Registration, error) {
	return t.provider.Meter(proxyScope).RegisterCallback(func(_ context.Context, o metric.Observer) error {
		for _, m := range t.endpoints {
			for code := range m.counts {
				if n := m.counts[code].Load(); n > 0 {
					o.ObserveInt64(t.requests, int64(n), metric.WithAttributes(m.endpoint, attribute.Int("code", code)))
				}
			}
		}
		return nil
	}, t.requests)
}

// upstreamError counts a failure of backend of the given kind (errKind's labels, or aborted).
func (t *otelSDK) upstreamError(ctx context.Context, backend, kind string) {
	t.upstreamErrors.Add(context.WithoutCancel(ctx), 1, metric.WithAttributes(attribute.String("backend", backend), attribute.String("kind", kind)))
}

// retry counts a request retried after backend failed.
func (t *otelSDK) retry(ctx context.Context, backend string) {
	t.retries.Add(context.WithoutCancel(ctx), 1, metric.WithAttributes(attribute.String("backend", backend)))
}

// observeIndexMutations registers kv_index_events_total{backend, type}: the index mutations the
// KV events caused (created, evicted).
func (t *otelSDK) observeIndexMutations(sink *admin.CountingSink) (metric.Registration, error) {
	m := t.provider.Meter(proxyScope)
	ctr, err := m.Int64ObservableCounter(metricIndexMutations,
		metric.WithDescription("Index mutations caused by KV events, by backend and type (created, evicted)."),
		metric.WithUnit("{event}"))
	if err != nil {
		return nil, err
	}
	return m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		for b, c := range sink.Counts() {
			o.ObserveInt64(ctr, int64(c.Created), metric.WithAttributes(attribute.String("backend", b), attribute.String("type", "created")))
			o.ObserveInt64(ctr, int64(c.Evicted), metric.WithAttributes(attribute.String("backend", b), attribute.String("type", "evicted")))
		}
		return nil
	}, ctr)
}

// observeOutageReplay registers metricOutageDuplicates, read from f's event log.
func (t *otelSDK) observeOutageReplay(f *stack.Fleet) (metric.Registration, error) {
	m := t.provider.Meter(proxyScope)
	ctr, err := m.Int64ObservableCounter(metricOutageDuplicates,
		metric.WithDescription("Event-log batches this replica had indexed during a NATS outage, skipped when the stream brought them again."),
		metric.WithUnit("{batch}"))
	if err != nil {
		return nil, err
	}
	return m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		st, _ := f.OutageReplay()
		o.ObserveInt64(ctr, int64(st.DuplicateBatches))
		return nil
	}, ctr)
}

// observeHealth registers the gauges of the backends' rotation and circuit states.
func (t *otelSDK) observeHealth(h *health.Monitor) error {
	m := t.provider.Meter(proxyScope)
	healthy, err := m.Int64ObservableGauge(metricBackendHealthy, metric.WithDescription("1 when the backend is in rotation (probes healthy and circuit not open)."))
	if err != nil {
		return err
	}
	open, err := m.Int64ObservableGauge(metricCircuitOpen, metric.WithDescription("1 while the backend's circuit breaker is open."))
	if err != nil {
		return err
	}
	t.reg, err = m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		for _, s := range h.Statuses() {
			attrs := metric.WithAttributes(attribute.String("backend", s.Name))
			o.ObserveInt64(healthy, b2i(s.InRotation), attrs)
			o.ObserveInt64(open, b2i(s.Circuit == health.CircuitOpen), attrs)
		}
		return nil
	}, healthy, open)
	return err
}

func b2i(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

// Close unregisters the callbacks and shuts the MeterProvider down.
func (t *otelSDK) Close() error {
	if t.reg != nil {
		_ = t.reg.Unregister()
	}
	return t.provider.Shutdown(context.Background())
}
