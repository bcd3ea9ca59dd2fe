package natsync

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// Instrumentation scope and metric names. Each instrument carries the attribute group (Config.Group);
// the event and message counters are observed from the Sync's own counts when metrics are
// collected, so that PublishPeerEvent makes no metrics call.
const (
	ScopeName = "github.com/kvroute/kvroute/natsync"

	// MetricEvents counts events by outcome: published, dropped, truncated (Stats.Published,
	// Dropped, Truncated) and applied (Stats.Applied).
	MetricEvents = "kvroute.natsync.events"
	// MetricMessages counts messages by direction and outcome: sent, send_error, received,
	// decode_error.
	MetricMessages = "kvroute.natsync.messages"
	// MetricGaps counts the peers' sequence gaps (Stats.Gaps).
	MetricGaps = "kvroute.natsync.sequence_gaps"
	// MetricPeersForgotten counts the peers forgotten, by reason: timeout, goodbye.
	MetricPeersForgotten = "kvroute.natsync.peers_forgotten"
	// MetricPeers is the number of peers heard from within PeerTimeout.
	MetricPeers = "kvroute.natsync.peers"
	// MetricConnected is 1 while the NATS connection is up, 0 otherwise.
	MetricConnected = "kvroute.natsync.connected"
)

// registerMetrics registers the Sync's instruments with mp; it returns nil with no provider.
func (s *Sync) registerMetrics(mp metric.MeterProvider) (metric.Registration, error) {
	if mp == nil {
		return nil, nil
	}
	meter := mp.Meter(ScopeName)
	events, err := meter.Int64ObservableCounter(MetricEvents,
		metric.WithDescription("Peer decision events, by outcome (published, dropped, truncated, applied)."),
		metric.WithUnit("{event}"))
	if err != nil {
		return nil, fmt.Errorf("natsync: metric %s: %w", MetricEvents, err)
	}
	messages, err := meter.Int64ObservableCounter(MetricMessages,
		metric.WithDescription("Messages on the group's subject, by outcome (sent, send_error, received, decode_error)."),
		metric.WithUnit("{message}"))
	if err != nil {
		return nil, fmt.Errorf("natsync: metric %s: %w", MetricMessages, err)
	}
	gaps, err := meter.Int64ObservableCounter(MetricGaps,
		metric.WithDescription("Gaps in the peers' message sequences; each made the replica forget that peer's decisions."),
		metric.WithUnit("{gap}"))
	if err != nil {
		return nil, fmt.Errorf("natsync: metric %s: %w", MetricGaps, err)
	}
	forgotten, err := meter.Int64ObservableCounter(MetricPeersForgotten,
		metric.WithDescription("Peers forgotten, by reason (timeout, goodbye)."),
		metric.WithUnit("{peer}"))
	if err != nil {
		return nil, fmt.Errorf("natsync: metric %s: %w", MetricPeersForgotten, err)
	}
	peers, err := meter.Int64ObservableGauge(MetricPeers,
		metric.WithDescription("Peers heard from within the peer timeout."),
		metric.WithUnit("{peer}"))
	if err != nil {
		return nil, fmt.Errorf("natsync: metric %s: %w", MetricPeers, err)
	}
	connected, err := meter.Int64ObservableGauge(MetricConnected,
		metric.WithDescription("1 while the NATS connection is up, 0 otherwise."))
	if err != nil {
		return nil, fmt.Errorf("natsync: metric %s: %w", MetricConnected, err)
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
