package kvroute

import (
	"context"
	"fmt"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/kvroute/kvroute/chwbl"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/telemetry"
)

// scopeName is the instrumentation scope of the package's metrics.
const scopeName = "github.com/kvroute/kvroute"

// routerMetrics holds the Router's instruments. The decision counters are observed from the
// Router's own atomic counts when metrics are collected, so that routing a request costs no
// metrics call; the histograms record as they go (tier 4 only).
type routerMetrics struct {
	queryLatency metric.Float64Histogram
	overlap      metric.Float64Histogram
	reg          metric.Registration
	once         sync.Once
}

func newRouterMetrics(mp metric.MeterProvider, r *DefaultRouter) (*routerMetrics, error) {
	if mp == nil {
		mp = noop.NewMeterProvider()
	}
	meter := mp.Meter(scopeName)
	m := &routerMetrics{}
	var err error
	requests, err := meter.Int64ObservableCounter(telemetry.MetricPrefixRoutingRequests,
		metric.WithDescription("Routing decisions by strategy (prefix_hash, overflow, fallback, strategy, kv_aware, load_bound, imbalance, least_work)."),
		metric.WithUnit("{request}"))
	if err != nil {
		return nil, fmt.Errorf("kvroute: metric %s: %w", telemetry.MetricPrefixRoutingRequests, err)
	}
	var byReason, byDecision [numReasons]metric.ObserveOption
	for _, why := range allReasons {
		byReason[why] = metric.WithAttributeSet(attribute.NewSet(attribute.String("strategy", why.String())))
		byDecision[why] = metric.WithAttributeSet(attribute.NewSet(attribute.String("decision", why.String())))
	}
	kvDecisions, err := meter.Int64ObservableCounter(telemetry.MetricKVRoutingDecisions,
		metric.WithDescription("Requests tier 4 looked at, by outcome (kv_aware, load_bound, imbalance, least_work; fallback: left to tier 1)."),
		metric.WithUnit("{request}"))
	if err != nil {
		return nil, fmt.Errorf("kvroute: metric %s: %w", telemetry.MetricKVRoutingDecisions, err)
	}
	kvFallback := metric.WithAttributeSet(attribute.NewSet(attribute.String("decision", "fallback")))
	m.queryLatency, err = meter.Float64Histogram(telemetry.MetricKVQueryLatency,
		metric.WithDescription("KV index query latency."), metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2))
	if err != nil {
		return nil, fmt.Errorf("kvroute: metric %s: %w", telemetry.MetricKVQueryLatency, err)
	}
	m.overlap, err = meter.Float64Histogram(telemetry.MetricKVOverlapScore,
		metric.WithDescription("Best overlap (fraction of the request's blocks cached) seen for routed requests."),
		metric.WithExplicitBucketBoundaries(0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1))
	if err != nil {
		return nil, fmt.Errorf("kvroute: metric %s: %w", telemetry.MetricKVOverlapScore, err)
	}
	dist, err := meter.Int64ObservableGauge(telemetry.MetricPrefixRoutingDistribution,
		metric.WithDescription("In-flight requests per backend under prefix routing."),
		metric.WithUnit("{request}"))
	if err != nil {
		return nil, fmt.Errorf("kvroute: metric %s: %w", telemetry.MetricPrefixRoutingDistribution, err)
	}
	card, err := meter.Int64ObservableGauge(telemetry.MetricPrefixRoutingCardinality,
		metric.WithDescription("Approximate count of unique prefix keys seen."),
		metric.WithUnit("{prefix}"))
	if err != nil {
		return nil, fmt.Errorf("kvroute: metric %s: %w", telemetry.MetricPrefixRoutingCardinality, err)
	}
	expired, err := meter.Int64ObservableCounter(telemetry.MetricDecisionsExpired,
		metric.WithDescription("Decisions whose Done had not come after max_decision_age, whose slots the Router reclaimed."),
		metric.WithUnit("{request}"))
	if err != nil {
		return nil, fmt.Errorf("kvroute: metric %s: %w", telemetry.MetricDecisionsExpired, err)
	}
	m.reg, err = meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		r.expireDecisions(r.cfg.Now())
		o.ObserveInt64(expired, int64(r.live.expired.Load()))
		set := r.set.Load()
		var buf [loadsBuf]chwbl.Load
		for _, l := range r.ring.Loads(buf[:0]) {
			opt := metric.WithAttributeSet(attribute.NewSet(attribute.String("backend", l.Name)))
			if st := set.byName[l.Name]; st != nil {
				opt = st.attrOption
			}
			o.ObserveInt64(dist, int64(l.InFlight), opt)
		}
		o.ObserveInt64(card, int64(r.prefix.estimate()))
		for _, why := range allReasons {
			o.ObserveInt64(requests, int64(r.counts[why].Load()), byReason[why])
		}
		if t := r.kv; t != nil {
			for _, why := range []Reason{ReasonKVAware, ReasonLoadBound, ReasonImbalance, ReasonLeastWork} {
				o.ObserveInt64(kvDecisions, int64(r.counts[why].Load()), byDecision[why])
			}
			o.ObserveInt64(kvDecisions, int64(t.handedOff.Load()), kvFallback)
		}
		return nil
	}, dist, card, requests, kvDecisions, expired)
	if err != nil {
		return nil, fmt.Errorf("kvroute: metric callback: %w", err)
	}
	return m, nil
}

// backendOption is the attribute option that labels a backend's observations.
func (m *routerMetrics) backendOption(name string) metric.MeasurementOption {
	return metric.WithAttributeSet(attribute.NewSet(attribute.String("backend", name)))
}

func (m *routerMetrics) recordLookup(ctx context.Context, d time.Duration) {
	m.queryLatency.Record(ctx, d.Seconds())
}

func (m *routerMetrics) recordOverlap(ctx context.Context, ratio float64) {
	m.overlap.Record(ctx, ratio)
}

func (m *routerMetrics) close() error {
	var err error
	m.once.Do(func() {
		if m.reg != nil {
			err = m.reg.Unregister()
		}
	})
	return err
}

// disaggMetrics holds the instruments of disaggregated serving; options are built once, so that
// recording a plan allocates nothing.
type disaggMetrics struct {
	requests  metric.Int64Counter
	byPlan    [][][]metric.AddOption // [path][reason]
	noBackend metric.Int64Counter
	failures  metric.Int64Counter
	reg       metric.Registration
	once      sync.Once
}

func newDisaggMetrics(mp metric.MeterProvider, r *DefaultRouter) (*disaggMetrics, error) {
	if mp == nil {
		mp = noop.NewMeterProvider()
	}
	meter := mp.Meter(scopeName)
	m := &disaggMetrics{}
	var err error
	if m.requests, err = meter.Int64Counter(telemetry.MetricDisaggRequests,
		metric.WithDescription("Requests routed with disaggregation on, by path (fast_decode, prefill_then_decode, unified, fallback) and reason."),
		metric.WithUnit("{request}")); err != nil {
		return nil, fmt.Errorf("kvroute: metric %s: %w", telemetry.MetricDisaggRequests, err)
	}
	paths, reasons := disagg.Paths(), disagg.Reasons()
	m.byPlan = make([][][]metric.AddOption, len(paths)+1)
	for _, p := range paths {
		m.byPlan[p] = make([][]metric.AddOption, len(reasons)+1)
		for _, why := range reasons {
			m.byPlan[p][why] = []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(
				attribute.String("path", p.String()), attribute.String("reason", why.String())))}
		}
	}
	if m.noBackend, err = meter.Int64Counter(telemetry.MetricDisaggNoBackend,
		metric.WithDescription("Requests that no routing path could serve (ErrNoBackend)."),
		metric.WithUnit("{request}")); err != nil {
		return nil, fmt.Errorf("kvroute: metric %s: %w", telemetry.MetricDisaggNoBackend, err)
	}
	if m.failures, err = meter.Int64Counter(telemetry.MetricDisaggPrefillFailures,
		metric.WithDescription("Remote prefills reported failed."),
		metric.WithUnit("{request}")); err != nil {
		return nil, fmt.Errorf("kvroute: metric %s: %w", telemetry.MetricDisaggPrefillFailures, err)
	}
	inflight, err := meter.Int64ObservableGauge(telemetry.MetricDisaggInFlight,
		metric.WithDescription("Request phases in flight per prefill or decode backend."),
		metric.WithUnit("{request}"))
	if err != nil {
		return nil, fmt.Errorf("kvroute: metric %s: %w", telemetry.MetricDisaggInFlight, err)
	}
	m.reg, err = meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		var buf [loadsBuf]chwbl.Load
		for _, pool := range [...]struct {
			ring  *chwbl.Ring
			phase string
		}{{r.dis.prefill, "prefill"}, {r.dis.decode, "decode"}} {
			for _, l := range pool.ring.Loads(buf[:0]) {
				o.ObserveInt64(inflight, int64(l.InFlight), metric.WithAttributeSet(attribute.NewSet(
					attribute.String("backend", l.Name), attribute.String("phase", pool.phase))))
			}
		}
		return nil
	}, inflight)
	if err != nil {
		return nil, fmt.Errorf("kvroute: metric callback: %w", err)
	}
	return m, nil
}

func (m *disaggMetrics) recordPlan(ctx context.Context, p disagg.Plan) {
	if int(p.Path) < len(m.byPlan) && int(p.Reason) < len(m.byPlan[p.Path]) {
		m.requests.Add(ctx, 1, m.byPlan[p.Path][p.Reason]...)
	}
}

func (m *disaggMetrics) recordNoBackend(ctx context.Context)      { m.noBackend.Add(ctx, 1) }
func (m *disaggMetrics) recordPrefillFailure(ctx context.Context) { m.failures.Add(ctx, 1) }

func (m *disaggMetrics) close() error {
	var err error
	m.once.Do(func() {
		if m.reg != nil {
			err = m.reg.Unregister()
		}
	})
	return err
}
