package kvroute

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/telemetry"
)

func TestMetricsExported(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer func() { _ = mp.Shutdown(context.Background()) }()
	r := newRouter(t, Config{Backends: backends(2), MeterProvider: mp})
	ctx := context.Background()
	held, err := r.Route(ctx, chatReq("sys-a", "u"))
	require.NoError(t, err)
	for range 3 {
		d, err := r.Route(ctx, chatReq("sys-b", "u"))
		require.NoError(t, err)
		d.Done(Outcome{})
	}
	d, err := r.Route(ctx, &prefixkey.Request{Model: "m"})
	require.NoError(t, err)
	d.Done(Outcome{})

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	got := map[string]metricdata.Aggregation{}
	for _, sm := range rm.ScopeMetrics {
		assert.Equal(t, scopeName, sm.Scope.Name)
		for _, m := range sm.Metrics {
			got[m.Name] = m.Data
		}
	}
	reqs := got[telemetry.MetricPrefixRoutingRequests].(metricdata.Sum[int64])
	byStrategy := map[string]int64{}
	for _, dp := range reqs.DataPoints {
		v, _ := dp.Attributes.Value("strategy")
		byStrategy[v.AsString()] += dp.Value
	}
	assert.Equal(t, int64(4), byStrategy["prefix_hash"]+byStrategy["overflow"])
	assert.Equal(t, int64(1), byStrategy["fallback"])

	dist := got[telemetry.MetricPrefixRoutingDistribution].(metricdata.Gauge[int64])
	inflight := map[string]int64{}
	for _, dp := range dist.DataPoints {
		v, _ := dp.Attributes.Value("backend")
		inflight[v.AsString()] = dp.Value
	}
	assert.Len(t, inflight, 2)
	assert.Equal(t, int64(1), inflight[held.Backend])

	card := got[telemetry.MetricPrefixRoutingCardinality].(metricdata.Gauge[int64])
	require.Len(t, card.DataPoints, 1)
	assert.Equal(t, int64(2), card.DataPoints[0].Value)

	held.Done(Outcome{})
	require.NoError(t, r.Close())
	require.NoError(t, r.Close()) // idempotent
}
