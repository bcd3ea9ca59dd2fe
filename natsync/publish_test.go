package natsync

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/natsync/natstest"
	"github.com/kvroute/kvroute/telemetry"
)

// unstarted returns a Sync that is never started, on a connection that never connects: its
// buffer is read with takePending.
func unstarted(t testing.TB, cfg Config) *Sync {
	t.Helper()
	cfg.Conn = &nats.Conn{}
	s, err := New(cfg)
	require.NoError(t, err)
	return s
}

// drain decodes the events s buffered, checking each message's size.
func drain(t *testing.T, s *Sync) (messages int, events []kvroute.PeerEvent) {
	t.Helper()
	batches, _ := s.takePending()
	for _, b := range batches {
		assert.LessOrEqual(t, len(b), s.maxMsg)
		putHeader(b, msgEvents, s.ReplicaID(), 1)
		h, body, err := decodeHeader(b)
		require.NoError(t, err)
		assert.Equal(t, s.ReplicaID(), string(h.replica))
		evs, err := decodeEvents(body, nil, nil)
		require.NoError(t, err)
		events = append(events, evs...)
	}
	s.recycle(batches)
	return len(batches), events
}

func TestPublishCopiesKeys(t *testing.T) {
	s := unstarted(t, Config{})
	k := keys(1, 128)
	s.PublishPeerEvent(kvroute.PeerEvent{Kind: kvroute.PeerRouted, ID: 1, Backend: "a", BlockKeys: k, CachedBlocks: 4, PrefillTokens: 100})
	want := keys(1, 128)
	clear(k) // the router reuses its scratch
	_, evs := drain(t, s)
	require.Len(t, evs, 1)
	assert.Equal(t, want, evs[0].BlockKeys)
	assert.Equal(t, uint64(1), s.Stats().Published)
}

func TestPublishBatches(t *testing.T) {
	s := unstarted(t, Config{MaxMessageBytes: 16 << 10})
	var want []kvroute.PeerEvent
	for i := range 100 {
		ev := kvroute.PeerEvent{Kind: kvroute.PeerRouted, ID: uint64(i + 1), Backend: "vllm-1", BlockKeys: keys(uint64(i), 128), CachedBlocks: 3, PrefillTokens: 2000}
		s.PublishPeerEvent(ev)
		want = append(want, ev, kvroute.PeerEvent{Kind: kvroute.PeerDone, ID: uint64(i + 1)})
		s.PublishPeerEvent(want[len(want)-1])
	}
	n, evs := drain(t, s)
	assert.Equal(t, want, evs, "in order")
	assert.Equal(t, 7, n, "100 events of 1 KiB in messages of 16 KiB")
	n, evs = drain(t, s)
	assert.Zero(t, n)
	assert.Empty(t, evs)
}

func TestPublishDropsWhenFull(t *testing.T) {
	s := unstarted(t, Config{BufferSize: 3})
	for i := range 5 {
		s.PublishPeerEvent(kvroute.PeerEvent{Kind: kvroute.PeerDone, ID: uint64(i)})
	}
	st := s.Stats()
	assert.Equal(t, uint64(3), st.Published)
	assert.Equal(t, uint64(2), st.Dropped)
	batches, lost := s.takePending()
	assert.True(t, lost, "the next message skips a sequence number")
	s.recycle(batches)
	_, lost = s.takePending()
	assert.False(t, lost)

	// The byte bound too.
	s = unstarted(t, Config{BufferBytes: 3000})
	for i := range 3 {
		s.PublishPeerEvent(kvroute.PeerEvent{Kind: kvroute.PeerRouted, ID: uint64(i), Backend: "a", BlockKeys: keys(1, 128)})
	}
	assert.Equal(t, uint64(1), s.Stats().Dropped)

	// Nonsense is dropped.
	s.PublishPeerEvent(kvroute.PeerEvent{Kind: 9})
	s.PublishPeerEvent(kvroute.PeerEvent{Kind: kvroute.PeerRouted, Backend: string(make([]byte, MaxBackendLen+1))})
	assert.Equal(t, uint64(3), s.Stats().Dropped)
}

// Block keys beyond what a message holds are cut to a prefix.
func TestPublishTruncates(t *testing.T) {
	s := unstarted(t, Config{MaxMessageBytes: 4 << 10})
	long := keys(5, 1000)
	s.PublishPeerEvent(kvroute.PeerEvent{Kind: kvroute.PeerRouted, ID: 1, Backend: "a", BlockKeys: long, CachedBlocks: 900, PrefillTokens: 7})
	s.PublishPeerEvent(kvroute.PeerEvent{Kind: kvroute.PeerDone, ID: 1})
	_, evs := drain(t, s)
	require.Len(t, evs, 2)
	k := len(evs[0].BlockKeys)
	assert.Greater(t, k, 400)
	assert.Less(t, k, 512)
	assert.Equal(t, long[:k], evs[0].BlockKeys)
	assert.Equal(t, k, evs[0].CachedBlocks)
	assert.Equal(t, 7, evs[0].PrefillTokens)
	assert.Equal(t, uint64(1), s.Stats().Truncated)
}

func TestPublishAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates")
	}
	s := unstarted(t, Config{})
	ev := kvroute.PeerEvent{Kind: kvroute.PeerRouted, ID: 1, Backend: "vllm-1", BlockKeys: keys(1, 128), CachedBlocks: 3, PrefillTokens: 2000}
	i := 0
	allocs := testing.AllocsPerRun(1000, func() {
		s.PublishPeerEvent(ev)
		if i++; i%32 == 0 {
			batches, _ := s.takePending()
			s.recycle(batches)
		}
	})
	assert.Zero(t, allocs)
	assert.Zero(t, s.Stats().Dropped)
}

func TestMetrics(t *testing.T) {
	srv := natstest.Start(t)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	cfg := fastConfig(srv.URL(), "replica-a")
	cfg.MeterProvider = mp
	a := newReplica(t, cfg, kvroute.Config{})
	b := newReplica(t, fastConfig(srv.URL(), "replica-b"), kvroute.Config{})
	waitPeers(t, a, b)
	finish(route(t, b.r, chatReq("x")))
	require.Eventually(t, func() bool { return a.s.Stats().Applied == 3 }, waitFor, tick)
	finish(route(t, a.r, chatReq("y")))
	require.NoError(t, b.s.Close())
	require.Eventually(t, func() bool { return a.s.Stats().Goodbyes == 1 }, waitFor, tick)

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		require.Equal(t, scopeName, sm.Scope.Name)
		for _, m := range sm.Metrics {
			var points []metricdata.DataPoint[int64]
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				points = d.DataPoints
			case metricdata.Gauge[int64]:
				points = d.DataPoints
			}
			for _, p := range points {
				g, _ := p.Attributes.Value("group")
				assert.Equal(t, "test", g.AsString())
				key := m.Name
				for _, k := range []attribute.Key{"outcome", "reason"} {
					if v, ok := p.Attributes.Value(k); ok {
						key += "/" + v.AsString()
					}
				}
				got[key] = p.Value
			}
		}
	}
	assert.Equal(t, int64(3), got[telemetry.MetricNatsyncEvents+"/published"])
	assert.Equal(t, int64(3), got[telemetry.MetricNatsyncEvents+"/applied"])
	assert.Equal(t, int64(0), got[telemetry.MetricNatsyncEvents+"/dropped"])
	assert.Equal(t, int64(1), got[telemetry.MetricNatsyncPeersForgotten+"/goodbye"])
	assert.Equal(t, int64(0), got[telemetry.MetricNatsyncPeersForgotten+"/timeout"])
	assert.Positive(t, got[telemetry.MetricNatsyncMessages+"/sent"])
	assert.Positive(t, got[telemetry.MetricNatsyncMessages+"/received"])
	assert.Equal(t, int64(0), got[telemetry.MetricNatsyncMessages+"/decode_error"])
	assert.Equal(t, int64(0), got[telemetry.MetricNatsyncPeers])
	assert.Equal(t, int64(1), got[telemetry.MetricNatsyncConnected])
	assert.Contains(t, got, telemetry.MetricNatsyncGaps)
}
