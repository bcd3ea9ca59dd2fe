package events_test

// The SSE consumer's tests, against scripted streams. They are in package events_test so that they
// can use the recording Sink of events/internal/eventstest, which imports events.

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/events/internal/eventstest"
)

const (
	waitFor = 10 * time.Second
	tick    = 5 * time.Millisecond
)

// sseServer serves a scripted stream per request; script returns when the stream should end
// (the handler then closes it). It counts requests and records their Last-Event-ID headers.
type sseServer struct {
	*httptest.Server
	requests  atomic.Int64
	mu        sync.Mutex
	lastIDs   []string
	accept    []string
	done      chan struct{}
	closeOnce sync.Once
}

func newSSEServer(t *testing.T, tls bool, script func(n int64, w http.ResponseWriter, flush func(), done <-chan struct{}, r *http.Request)) *sseServer {
	t.Helper()
	s := &sseServer{done: make(chan struct{})}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := s.requests.Add(1)
		s.mu.Lock()
		s.lastIDs = append(s.lastIDs, r.Header.Get("Last-Event-ID"))
		s.accept = append(s.accept, r.Header.Get("Accept"))
		s.mu.Unlock()
		flush := func() { w.(http.Flusher).Flush() }
		script(n, w, flush, s.done, r)
	})
	if tls {
		s.Server = httptest.NewTLSServer(h)
	} else {
		s.Server = httptest.NewServer(h)
	}
	t.Cleanup(func() {
		s.closeOnce.Do(func() { close(s.done) })
		s.Server.Close()
	})
	return s
}

func streamHeaders(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.WriteHeader(http.StatusOK)
}

// hold keeps the stream open until the client or the test goes away.
func hold(r *http.Request, done <-chan struct{}) {
	select {
	case <-r.Context().Done():
	case <-done:
	}
}

func created(hash string, tokens int) string {
	return fmt.Sprintf("event: cache_created\ndata: {\"event\":\"cache_created\",\"prefix_hash\":%q,\"token_count\":%d}\n\n", hash, tokens)
}

func startSSE(t *testing.T, cfg events.SSEConfig) *events.SSEConsumer {
	t.Helper()
	if cfg.InitialBackoff == 0 {
		cfg.InitialBackoff = 5 * time.Millisecond
	}
	if cfg.MaxBackoff == 0 {
		cfg.MaxBackoff = 50 * time.Millisecond
	}
	c, err := events.NewSSEConsumer(cfg)
	require.NoError(t, err)
	require.NoError(t, c.Start(context.Background()))
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	return c
}

func TestNewSSEConsumerConfig(t *testing.T) {
	sink := eventstest.NewRecordingSink()
	src := []events.SSESource{{Backend: "a", URL: "http://vllm-1:8000/v1/kv_events"}}
	for _, tc := range []struct {
		name string
		cfg  events.SSEConfig
		ok   bool
	}{
		{"ok", events.SSEConfig{Sink: sink, Sources: src}, true},
		{"https", events.SSEConfig{Sink: sink, Sources: []events.SSESource{{Backend: "a", URL: "https://h/v1/kv_events"}}}, true},
		{"no sink", events.SSEConfig{Sources: src}, false},
		{"no sources", events.SSEConfig{Sink: sink}, false},
		{"no backend", events.SSEConfig{Sink: sink, Sources: []events.SSESource{{URL: "http://h/"}}}, false},
		{"duplicate backend", events.SSEConfig{Sink: sink, Sources: []events.SSESource{{Backend: "a", URL: "http://h/"}, {Backend: "a", URL: "http://g/"}}}, false},
		{"ws scheme", events.SSEConfig{Sink: sink, Sources: []events.SSESource{{Backend: "a", URL: "ws://h/"}}}, false},
		{"relative URL", events.SSEConfig{Sink: sink, Sources: []events.SSESource{{Backend: "a", URL: "/v1/kv_events"}}}, false},
		{"negative size", events.SSEConfig{Sink: sink, Sources: src, MaxEventSize: -1}, false},
		{"backoff inverted", events.SSEConfig{Sink: sink, Sources: src, InitialBackoff: time.Minute, MaxBackoff: time.Second}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := events.NewSSEConsumer(tc.cfg)
			if !tc.ok {
				require.ErrorIs(t, err, events.ErrInvalidConfig)
				return
			}
			require.NoError(t, err)
			require.NoError(t, c.Close())
		})
	}
}

func TestSSEConsumer(t *testing.T) {
	for _, useTLS := range []bool{false, true} {
		t.Run(fmt.Sprintf("tls=%v", useTLS), func(t *testing.T) {
			srv := newSSEServer(t, useTLS, func(_ int64, w http.ResponseWriter, flush func(), done <-chan struct{}, r *http.Request) {
				streamHeaders(w)
				io.WriteString(w, ": hello\n\n")
				io.WriteString(w, created("9F2C", 2048))
				// The event: field wins over the JSON event.
				io.WriteString(w, "event: cache_evicted\ndata: {\"event\":\"cache_created\",\"prefix_hash\":\"9f2c\",\"token_count\":512}\n\n")
				// No event: field: the JSON event is used. Data split over two lines.
				io.WriteString(w, "data: {\"event\":\"cache_offloaded\",\ndata: \"prefix_hash\":\"ab\"}\n\n")
				io.WriteString(w, "event: cache_created\ndata: not json\n\n") // malformed
				io.WriteString(w, "event: cache_purged\r\ndata: {\"prefix_hash\":\"ab\"}\r\n\r\n")
				flush()
				hold(r, done)
			})
			sink := eventstest.NewRecordingSink()
			cfg := events.SSEConfig{Sink: sink, Sources: []events.SSESource{{Backend: "vllm-1", URL: srv.URL + "/v1/kv_events", Model: "llama"}}}
			if useTLS {
				cfg.Client = srv.Client()
			}
			c := startSSE(t, cfg)
			require.Eventually(t, func() bool { return len(sink.Applied("vllm-1")) == 4 }, waitFor, tick)
			var got []string
			for _, b := range sink.Applied("vllm-1") {
				require.Len(t, b.Prefix, 1)
				assert.Equal(t, "llama", b.Model)
				got = append(got, b.Prefix[0])
			}
			assert.Equal(t, []string{
				"cache_created:9f2c:2048",
				"cache_evicted:9f2c:512",
				"cache_offloaded:ab:0",
				"cache_purged:ab:0",
			}, got)
			st := eventstest.StatusOf(t, c, "vllm-1")
			assert.True(t, st.Connection.Connected)
			assert.Equal(t, "sse", st.Transport)
			assert.Equal(t, events.Stats{Received: 4, Processed: 4, Malformed: 1}, st.Events)
			assert.Contains(t, st.LastError, "malformed")
			assert.Zero(t, st.Connection.ReconnectCount)
			assert.Equal(t, []string{"text/event-stream"}, srv.accept)
		})
	}
}

func TestSSEReconnect(t *testing.T) {
	for _, clearOnReconnect := range []bool{false, true} {
		t.Run(fmt.Sprintf("clear=%v", clearOnReconnect), func(t *testing.T) {
			srv := newSSEServer(t, false, func(n int64, w http.ResponseWriter, flush func(), done <-chan struct{}, r *http.Request) {
				switch n {
				case 1: // one event, then the engine goes away
					streamHeaders(w)
					io.WriteString(w, "id: 7\n"+created("01", 16))
					flush()
				case 2: // restarting
					http.Error(w, "starting", http.StatusServiceUnavailable)
				case 3:
					w.Header().Set("Content-Type", "application/json")
					io.WriteString(w, "{}")
				default:
					streamHeaders(w)
					io.WriteString(w, created("02", 32))
					flush()
					hold(r, done)
				}
			})
			sink := eventstest.NewRecordingSink()
			c := startSSE(t, events.SSEConfig{Sink: sink, ClearOnReconnect: clearOnReconnect,
				Sources: []events.SSESource{{Backend: "a", URL: srv.URL}}})
			require.Eventually(t, func() bool { return len(sink.Applied("a")) == 2 }, waitFor, tick)
			st := eventstest.StatusOf(t, c, "a")
			assert.True(t, st.Connection.Connected)
			assert.Equal(t, uint64(3), st.Connection.ReconnectCount)
			assert.Equal(t, uint64(2), st.Events.Processed)
			srv.mu.Lock()
			assert.Equal(t, []string{"", "7", "7", "7"}, srv.lastIDs, "Last-Event-ID is sent back")
			srv.mu.Unlock()
			if clearOnReconnect {
				assert.Equal(t, 1, sink.Clears("a"))
				assert.Equal(t, uint64(1), st.Sequence.Resets)
			} else {
				assert.Zero(t, sink.Clears("a"))
			}
		})
	}
}

func TestSSEBackoffGrowsAndResets(t *testing.T) {
	var mu sync.Mutex
	var at []time.Time
	srv := newSSEServer(t, false, func(n int64, w http.ResponseWriter, flush func(), done <-chan struct{}, r *http.Request) {
		mu.Lock()
		at = append(at, time.Now())
		mu.Unlock()
		http.Error(w, "down", http.StatusBadGateway)
	})
	c := startSSE(t, events.SSEConfig{Sink: eventstest.NewRecordingSink(), InitialBackoff: 20 * time.Millisecond, MaxBackoff: 80 * time.Millisecond,
		Sources: []events.SSESource{{Backend: "a", URL: srv.URL}}})
	require.Eventually(t, func() bool { return srv.requests.Load() >= 6 }, waitFor, tick)
	require.NoError(t, c.Close())
	mu.Lock()
	defer mu.Unlock()
	// Delays: ~20, ~40, ~80, ~80 ms (±20%, plus scheduling): growing, then capped.
	d1, d3 := at[1].Sub(at[0]), at[3].Sub(at[2])
	assert.GreaterOrEqual(t, d1, 15*time.Millisecond)
	assert.GreaterOrEqual(t, d3, 60*time.Millisecond)
	assert.Greater(t, d3, d1)
	st := eventstest.StatusOf(t, c, "a")
	assert.Contains(t, st.LastError, "502")
	assert.Equal(t, events.StateClosed, st.Connection.State)
}

func TestSSEOversizedEvent(t *testing.T) {
	srv := newSSEServer(t, false, func(_ int64, w http.ResponseWriter, flush func(), done <-chan struct{}, r *http.Request) {
		streamHeaders(w)
		io.WriteString(w, "event: cache_created\ndata: {\"prefix_hash\":\"")
		chunk := strings.Repeat("a", 64<<10)
		for range 20 { // 1.25 MiB on one line
			io.WriteString(w, chunk)
		}
		io.WriteString(w, "\"}\n\n")
		io.WriteString(w, created("beef", 1))
		flush()
		hold(r, done)
	})
	sink := eventstest.NewRecordingSink()
	c := startSSE(t, events.SSEConfig{Sink: sink, Sources: []events.SSESource{{Backend: "a", URL: srv.URL}}})
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 1 }, waitFor, tick)
	assert.Equal(t, "cache_created:beef:1", sink.Applied("a")[0].Prefix[0])
	st := eventstest.StatusOf(t, c, "a")
	assert.Equal(t, uint64(1), st.Events.Oversized)
	assert.True(t, st.Connection.Connected, "the stream resyncs instead of reconnecting")
	assert.Zero(t, st.Connection.ReconnectCount)
}

func TestSSEIdleTimeout(t *testing.T) {
	for _, tc := range []struct {
		name    string
		headers bool
		want    string
	}{
		{"silent stream", true, "no data for"},
		{"no response", false, "no response in"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := newSSEServer(t, false, func(_ int64, w http.ResponseWriter, flush func(), done <-chan struct{}, r *http.Request) {
				if tc.headers {
					streamHeaders(w)
					flush()
				}
				hold(r, done) // silent
			})
			c := startSSE(t, events.SSEConfig{Sink: eventstest.NewRecordingSink(), IdleTimeout: 30 * time.Millisecond,
				Sources: []events.SSESource{{Backend: "a", URL: srv.URL}}})
			require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Connection.ReconnectCount >= 2 }, waitFor, tick)
			assert.Contains(t, eventstest.StatusOf(t, c, "a").LastError, tc.want)
		})
	}
}

func TestSSESinkFailureResetsBackend(t *testing.T) {
	release := make(chan struct{})
	srv := newSSEServer(t, false, func(_ int64, w http.ResponseWriter, flush func(), done <-chan struct{}, r *http.Request) {
		streamHeaders(w)
		io.WriteString(w, created("01", 1))
		flush()
		select {
		case <-release:
		case <-done:
			return
		}
		io.WriteString(w, created("02", 2))
		flush()
		hold(r, done)
	})
	sink := eventstest.NewRecordingSink()
	sink.SetFail(eventstest.ErrSinkDown)
	c := startSSE(t, events.SSEConfig{Sink: sink, Sources: []events.SSESource{{Backend: "a", URL: srv.URL}}})
	require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "a").Events.Dropped == 1 }, waitFor, tick)
	sink.SetFail(nil)
	close(release)
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 1 }, waitFor, tick)
	assert.Equal(t, 1, sink.Clears("a"))
	assert.Equal(t, []int64{-1, 0}, sink.Seqs("a"))
}

func TestSSECloseStopsEverything(t *testing.T) {
	srv := newSSEServer(t, false, func(_ int64, w http.ResponseWriter, flush func(), done <-chan struct{}, r *http.Request) {
		streamHeaders(w)
		io.WriteString(w, created("01", 1))
		flush()
		hold(r, done)
	})
	down := httptest.NewServer(http.NotFoundHandler())
	downURL := down.URL
	down.Close() // an engine that is gone
	check := eventstest.CheckGoroutines(t, nil)
	sink := eventstest.NewRecordingSink()
	client := &http.Client{Transport: &http.Transport{}}
	c, err := events.NewSSEConsumer(events.SSEConfig{Sink: sink, InitialBackoff: 5 * time.Millisecond, MaxBackoff: 20 * time.Millisecond,
		Client:  client,
		Sources: []events.SSESource{{Backend: "a", URL: srv.URL}, {Backend: "b", URL: downURL}}})
	require.NoError(t, err)
	require.NoError(t, c.Start(context.Background()))
	require.ErrorIs(t, c.Start(context.Background()), events.ErrStarted)
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 1 }, waitFor, tick)
	require.Eventually(t, func() bool { return eventstest.StatusOf(t, c, "b").Connection.ReconnectCount >= 1 }, waitFor, tick)
	closed := make(chan error, 1)
	go func() { closed <- c.Close() }()
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(waitFor):
		t.Fatal("Close did not return")
	}
	require.NoError(t, c.Close())
	require.ErrorIs(t, c.Start(context.Background()), events.ErrClosed)
	for _, st := range c.Status() {
		assert.Equal(t, events.StateClosed, st.Connection.State)
		assert.False(t, st.Connection.Connected)
	}
	client.CloseIdleConnections()
	check()
}

// TestSSEOversizedEventsLogged: oversized events are dropped, counted, and logged at most once
// per source every few seconds; the stream stays connected.
func TestSSEOversizedEventsLogged(t *testing.T) {
	srv := newSSEServer(t, false, func(_ int64, w http.ResponseWriter, flush func(), done <-chan struct{}, r *http.Request) {
		streamHeaders(w)
		for range 3 {
			io.WriteString(w, "event: cache_created\ndata: {\"prefix_hash\":\""+strings.Repeat("a", 2048)+"\"}\n\n")
		}
		io.WriteString(w, created("beef", 1))
		flush()
		hold(r, done)
	})
	sink := eventstest.NewRecordingSink()
	logs := &eventstest.LockedBuffer{}
	c := startSSE(t, events.SSEConfig{Sink: sink, Sources: []events.SSESource{{Backend: "a", URL: srv.URL}}, MaxEventSize: 1024,
		Logger: slog.New(slog.NewTextHandler(logs, nil))})
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 1 }, waitFor, tick)
	st := eventstest.StatusOf(t, c, "a")
	assert.Equal(t, uint64(3), st.Events.Oversized)
	assert.Contains(t, st.LastError, "larger than 1024 bytes")
	assert.True(t, st.Connection.Connected)
	assert.Zero(t, st.Connection.ReconnectCount)
	assert.Equal(t, 1, logs.Count("oversized sse event dropped"))
}
