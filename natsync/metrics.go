package natsync

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/kvroute/kvroute/telemetry"
)

// scopeName is the instrumentation scope of the package's metrics.
const scopeName = "github.com/kvroute/kvroute/natsync"

// registerMetrics registers the Sync's instruments with mp; it returns nil with no provider.
func (s *Sync) registerMetrics(mp metric.MeterProvider) (metric.Registration, error) {
	if mp == nil {
		return nil, nil
	}
	meter := mp.Meter(scopeName)
	events, err := meter.Int64ObservableCounter(telemetry.MetricNatsyncEvents,
		metric.WithDescription("Peer decision events, by outcome (published, dropped, truncated, applied)."),
		metric.WithUnit("{event}"))
	if err != nil {
		return nil, fmt.Errorf("natsync: metric %s: %w", telemetry.MetricNatsyncEvents, err)
	}
	messages, err := meter.Int64ObservableCounter(telemetry.MetricNatsyncMessages,
		metric.WithDescription("Messages on the group's subject, by outcome (sent, send_error, received, decode_error)."),
		metric.WithUnit("{message}"))
	if err != nil {
		return nil, fmt.Errorf("natsync: metric %s: %w", telemetry.MetricNatsyncMessages, err)
	}
	gaps, err := meter.Int64ObservableCounter(telemetry.MetricNatsyncGaps,
		metric.WithDescription("Gaps in the peers' message sequences; each made the replica forget that peer's decisions."),
		metric.WithUnit("{gap}"))
	if err != nil {
		return nil, fmt.Errorf("natsync: metric %s: %w", telemetry.MetricNatsyncGaps, err)
	}
	forgotten, err := meter.Int64ObservableCounter(telemetry.MetricNatsyncPeersForgotten,
		metric.WithDescription("Peers forgotten, by reason (timeout, goodbye)."),
		metric.WithUnit("{peer}"))
	if err != nil {
		return nil, fmt.Errorf("natsync: metric %s: %w", telemetry.MetricNatsyncPeersForgotten, err)
	}
	peers, err := meter.Int64ObservableGauge(telemetry.MetricNatsyncPeers,
		metric.WithDescription("Peers heard from within the peer timeout."),
		metric.WithUnit("{peer}"))
	if err != nil {
		return nil, fmt.Errorf("natsync: metric %s: %w", telemetry.MetricNatsyncPeers, err)
	}
	connected, err := meter.Int64ObservableGauge(telemetry.MetricNatsyncConnected,
		metric.WithDescription("1 while the NATS connection is up, 0 otherwise."))
	if err != nil {
		return nil, fmt.Errorf("natsync: metric %s: %w", telemetry.MetricNatsyncConnected, err)
	}
	group := attribute.String("group", s.cfg.Group)
	with := func(k, v string) metric.ObserveOption {
		return metric.WithAttributeSet(attribute.NewSet(group, attribute.String(k, v)))
	}
	var (
		published, dropped, truncated, applied = with("outcome", "published"), with("outcome", "dropped"), with("outcome", "truncated"), with("outcome", "applied")
		sent, sendError, received, decodeError = with("outcome", "sent"), with("outcome", "send_error"), with("outcome", "received"), with("outcome", "decode_error")
		timeout, goodbye                       = with("reason", "timeout"), with("reason", "goodbye")
		plain                                  = metric.WithAttributeSet(attribute.NewSet(group))
	)
	c := &s.stats
	reg, err := meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		o.ObserveInt64(events, int64(c.published.Load()), published)
		o.ObserveInt64(events, int64(c.dropped.Load()), dropped)
		o.ObserveInt64(events, int64(c.truncated.Load()), truncated)
		o.ObserveInt64(events, int64(c.applied.Load()), applied)
		o.ObserveInt64(messages, int64(c.sent.Load()), sent)
		o.ObserveInt64(messages, int64(c.sendErrors.Load()), sendError)
		o.ObserveInt64(messages, int64(c.received.Load()), received)
		o.ObserveInt64(messages, int64(c.decodeErrors.Load()), decodeError)
		o.ObserveInt64(gaps, int64(c.gaps.Load()), plain)
		o.ObserveInt64(forgotten, int64(c.timedOut.Load()), timeout)
		o.ObserveInt64(forgotten, int64(c.goodbyes.Load()), goodbye)
		s.pmu.Lock()
		n := len(s.peers)
		s.pmu.Unlock()
		o.ObserveInt64(peers, int64(n), plain)
		up := int64(0)
		if s.nc.IsConnected() {
			up = 1
		}
		o.ObserveInt64(connected, up, plain)
		return nil
	}, events, messages, gaps, forgotten, peers, connected)
	if err != nil {
		return nil, fmt.Errorf("natsync: metrics callback: %w", err)
	}
	return reg, nil
}
