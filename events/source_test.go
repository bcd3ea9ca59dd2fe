package events_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/events/internal/eventstest"
	"github.com/kvroute/kvroute/telemetry"
)

func TestSourceStatusJSON(t *testing.T) {
	s := events.NewSource(events.SourceInfo{Backend: "vllm-1", Transport: "sse", Endpoint: "http://vllm-1:8000/v1/kv_events"}, func() time.Time {
		return time.Date(2026, 3, 13, 10, 24, 17, 0, time.UTC)
	})
	s.SetState(events.StateConnected)
	s.Received.Add(8412)
	s.Touch()
	raw, err := json.Marshal(s.Status())
	require.NoError(t, err)
	var got map[string]any
	require.NoError(t, json.Unmarshal(raw, &got))
	assert.Equal(t, "vllm-1", got["backend_name"])
	conn := got["connection"].(map[string]any)
	assert.Equal(t, true, conn["connected"])
	assert.Equal(t, float64(0), conn["reconnect_count"])
	assert.Equal(t, "2026-03-13T10:24:17Z", conn["last_event_at"])
	ev := got["events"].(map[string]any)
	assert.Equal(t, float64(8412), ev["received"])
	assert.Equal(t, float64(0), ev["dropped"])
	assert.NotContains(t, got, "sequence", "all-zero sequence stats are left out")
	assert.NotContains(t, got, "last_error_at")

	s.Replays.Add(1)
	s.CatchUps.Add(2)
	s.CatchUpFailures.Add(3)
	s.CaughtUpBatches.Add(4)
	raw, err = json.Marshal(s.Status())
	require.NoError(t, err)
	got = nil
	require.NoError(t, json.Unmarshal(raw, &got))
	seq := got["sequence"].(map[string]any)
	for key, want := range map[string]float64{"replays": 1, "replay_failures": 0, "catch_ups": 2, "catch_up_failures": 3, "caught_up_batches": 4} {
		assert.Equal(t, want, seq[key], key)
	}
}

// TestSourceSetMetrics: a backend's sources are summed, and reported by the worst one's state;
// a source of its own (NewSource) is not reported; Close reports closed sources and then
// unregisters, once.
func TestSourceSetMetrics(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())

	set := events.NewSourceSet(nil)
	require.NoError(t, set.RegisterMetrics(mp))
	assert.Error(t, set.RegisterMetrics(mp), "a second registration")
	rank0 := set.Add(events.SourceInfo{Backend: "a", Transport: "nats", Endpoint: "nats://h:4222", Topic: "kv.a.0"})
	rank1 := set.Add(events.SourceInfo{Backend: "a", Transport: "nats", Endpoint: "nats://h:4222", Topic: "kv.a.1"})
	other := set.Add(events.SourceInfo{Backend: "b", Transport: "nats", Endpoint: "nats://h:4222"})
	alone := events.NewSource(events.SourceInfo{Transport: "nats", Endpoint: "nats://h:4222"}, nil)
	rank0.SetState(events.StateConnected)
	rank1.SetState(events.StateDisconnected)
	other.SetState(events.StateConnected)
	rank0.Received.Add(3)
	rank1.Received.Add(4)
	rank1.Gaps.Add(1)
	other.Reconnects.Add(2)
	alone.Received.Add(100)

	got := eventstest.CollectInt64(t, reader)
	for key, want := range map[string]int64{
		telemetry.MetricEventReceived + ",backend=a":                            7,
		telemetry.MetricConsumerGaps + ",backend=a":                             1,
		telemetry.MetricConsumerConnected + ",backend=a":                        0,
		telemetry.MetricEventSourceStatus + ",backend=a,status=disconnected":    1,
		telemetry.MetricEventSourceStatus + ",backend=a,status=connected":       0,
		telemetry.MetricEventReceived + ",backend=b":                            0,
		telemetry.MetricConsumerReconnects + ",backend=b":                       2,
		telemetry.MetricConsumerConnected + ",backend=b":                        1,
		telemetry.MetricEventSourceStatus + ",backend=b,status=connected":       1,
		telemetry.MetricEventSourceStatus + ",backend=b,status=" + "connecting": 0,
	} {
		assert.Contains(t, got, key)
		assert.Equal(t, want, got[key], key)
	}
	assert.NotContains(t, got, telemetry.MetricEventReceived+",backend=", "a source of its own is not reported")

	st := set.Status()
	require.Len(t, st, 3)
	assert.Equal(t, []string{"kv.a.0", "kv.a.1", ""}, []string{st[0].Topic, st[1].Topic, st[2].Topic}, "in the order added")
	assert.Equal(t, "nats", st[0].Transport)

	require.NoError(t, set.Close())
	require.NoError(t, set.Close(), "idempotent")
	for _, s := range set.Status() {
		assert.Equal(t, events.StateClosed, s.Connection.State)
	}
	assert.Empty(t, eventstest.CollectInt64(t, reader), "unregistered")
}

// TestSourceZeroValue: a zero Source and a zero SourceSet work, on the wall clock.
func TestSourceZeroValue(t *testing.T) {
	var s events.Source
	assert.Equal(t, events.StateConnecting, s.State())
	assert.False(t, s.EverConnected())
	s.SetState(events.StateConnected)
	assert.True(t, s.EverConnected())
	s.SetState(events.StateDisconnected)
	assert.True(t, s.EverConnected())
	assert.True(t, s.Status().Connection.ConnectedSince.IsZero())
	s.SetError(nil)
	assert.Empty(t, s.Status().LastError)
	s.SetError(errors.New("boom"))
	assert.Equal(t, "boom", s.Status().LastError)
	assert.WithinDuration(t, time.Now(), s.Status().LastErrorAt, time.Minute)

	var set events.SourceSet
	src := set.Add(events.SourceInfo{Backend: "a"})
	src.Touch()
	assert.WithinDuration(t, time.Now(), set.Status()[0].Connection.LastEventAt, time.Minute)
	assert.NoError(t, set.Close())
}

// TestSourceWarnDue: at most one rate-limited Warn per source every 5 s.
func TestSourceWarnDue(t *testing.T) {
	now := time.Date(2026, 3, 13, 10, 0, 0, 0, time.UTC)
	s := events.NewSource(events.SourceInfo{Backend: "a"}, func() time.Time { return now })
	assert.True(t, s.WarnDue())
	assert.False(t, s.WarnDue())
	now = now.Add(4 * time.Second)
	assert.False(t, s.WarnDue())
	now = now.Add(time.Second)
	assert.True(t, s.WarnDue())
	assert.Equal(t, events.SourceInfo{Backend: "a"}, s.Info())
}

// TestBackendWriter: a failed Apply makes the next one clear the backend first; a failed clear
// stays pending and drops the batch; an empty batch performs only the clear; each outcome is
// counted on the source.
func TestBackendWriter(t *testing.T) {
	ctx := context.Background()
	sink := eventstest.NewRecordingSink()
	src := events.NewSource(events.SourceInfo{Backend: "a"}, nil)
	w := events.NewBackendWriter(sink, "a")
	assert.Equal(t, "a", w.Backend())
	two := &events.Batch{Seq: 1, Events: make([]events.Event, 2)}
	var empty events.Batch

	require.True(t, w.Apply(ctx, src, two))
	assert.False(t, w.ResetPending())

	sink.FailApplies(1, eventstest.ErrSinkDown)
	assert.False(t, w.Apply(ctx, src, two))
	assert.True(t, w.ResetPending(), "the sink missed a batch")
	assert.Contains(t, src.Status().LastError, "sink down")

	sink.SetFail(eventstest.ErrSinkDown) // the clear fails too
	assert.False(t, w.Apply(ctx, src, &empty))
	assert.False(t, w.Apply(ctx, src, two))
	assert.True(t, w.ResetPending(), "a failed clear stays pending")
	assert.Zero(t, w.Clears())

	sink.SetFail(nil)
	assert.True(t, w.Apply(ctx, src, &empty), "an empty batch performs the pending clear")
	assert.False(t, w.ResetPending())
	assert.Equal(t, uint64(1), w.Clears())
	assert.True(t, w.Apply(ctx, src, &empty), "nothing to do")

	w.RequestReset()
	assert.True(t, w.ResetPending())
	require.True(t, w.Apply(ctx, src, two))
	assert.Equal(t, uint64(2), w.Clears())
	assert.Equal(t, []int64{1, -1, -1, 1}, sink.Seqs("a"), "apply, clear, clear, apply")

	st := src.Status()
	assert.Equal(t, uint64(4), st.Events.Processed)
	assert.Equal(t, uint64(4), st.Events.Dropped)
	assert.Equal(t, uint64(2), st.Sequence.Resets)

	// A failed Apply whose ctx is done (the transport is closing) leaves no clear pending.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	sink.FailApplies(1, context.Canceled)
	assert.False(t, w.Apply(cctx, src, two))
	assert.False(t, w.ResetPending())
}
