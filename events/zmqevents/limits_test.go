package zmqevents

import (
	"fmt"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/events/internal/eventstest"
)

// TestZMQOversizedFrame: a batch over MaxFrameBytes is dropped undecoded and counted as
// malformed, the hole it leaves is handled as a lost batch (replay, which fails on the same
// oversized batch, else a reset), the connection stays up, and the drops are logged once.
func TestZMQOversizedFrame(t *testing.T) {
	for _, replay := range []bool{false, true} {
		t.Run(fmt.Sprintf("replay=%v", replay), func(t *testing.T) {
			pub := NewFakePublisher(t, FakePublisherConfig{Replay: replay})
			sink := eventstest.NewRecordingSink()
			logs := &eventstest.LockedBuffer{}
			ep := Endpoint{Backend: "a", Endpoint: pub.Endpoint}
			if replay {
				ep.ReplayEndpoint = pub.ReplayEndpoint
			}
			c := startZMQ(t, Config{Sink: sink, Endpoints: []Endpoint{ep}, MaxFrameBytes: 1024,
				Logger: slog.New(slog.NewTextHandler(logs, nil))})
			pub.WaitSubscribed()
			big := StoredEvent([]uint64{7}, -1, make([]uint32, 512), 512, "GPU") // > 1 KiB: uint32 zeros cost 1 byte each, so pad
			big[3] = mpToksU32(1, 512)
			pub.Publish(stored(0))
			pub.Publish(big)
			pub.Publish(big)
			pub.Publish(big)
			pub.Publish(stored(4))
			require.Eventually(t, func() bool { return len(sink.Applied("a")) == 2 }, waitFor, tick)
			assert.Equal(t, int64(4), sink.Seqs("a")[len(sink.Seqs("a"))-1])
			assert.Contains(t, sink.Seqs("a"), int64(-1), "the hole resets the backend")
			st := eventstest.StatusOf(t, c, "a")
			if replay {
				// 3 live, and every replay that reaches one (how many depends on how the
				// worker meets the losses).
				assert.GreaterOrEqual(t, st.Events.Malformed, uint64(4))
				assert.NotZero(t, st.Sequence.ReplayFailures)
			} else {
				assert.Equal(t, uint64(3), st.Events.Malformed)
			}
			assert.Contains(t, st.LastError, "MaxFrameBytes")
			assert.Equal(t, uint64(2), st.Events.Received)
			assert.True(t, st.Connection.Connected)
			assert.Zero(t, st.Connection.ReconnectCount)
			assert.Equal(t, 1, logs.Count("batch dropped"), "rate-limited: one line for three drops")
		})
	}
}

// TestZMQMaxFrameBytesConfig: the default, and a negative size rejected.
func TestZMQMaxFrameBytesConfig(t *testing.T) {
	sink := eventstest.NewRecordingSink()
	eps := []Endpoint{{Backend: "a", Endpoint: "tcp://127.0.0.1:1"}}
	c, err := New(Config{Sink: sink, Endpoints: eps})
	require.NoError(t, err)
	assert.Equal(t, DefaultMaxFrameBytes, c.cfg.MaxFrameBytes)
	_, err = New(Config{Sink: sink, Endpoints: eps, MaxFrameBytes: -1})
	assert.ErrorIs(t, err, events.ErrInvalidConfig)
}

// mpToksU32 returns n realistic token ids (a 152k vocabulary: every msgpack width from fixint to
// uint32 occurs), deterministic in seed; the same as events' decoder tests use.
func mpToksU32(seed, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		switch i % 4 {
		case 0:
			out[i] = uint32((seed*31 + i) % 128) // fixint
		case 1:
			out[i] = uint32(128 + (seed*7+i)%128) // uint8
		case 2:
			out[i] = uint32(1000 + (seed*7919+i*104729)%60000) // uint16
		default:
			out[i] = uint32(70000 + (seed*7919+i*104729)%82000) // uint32
		}
	}
	return out
}
