package enginesim

import (
	"bufio"
	"context"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events/zmqevents"
)

func TestServeKillRestart(t *testing.T) {
	e := newTestEngine(t, Config{BlockSize: 4})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	require.NoError(t, e.Serve(ln))
	ln2, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	assert.ErrorIs(t, e.Serve(ln2), ErrStarted, "Serve once (the listener is closed)")
	body := `{"model":"` + DefaultModel + `","prompt":"a prompt long enough to fill a few blocks of four tokens"}`
	resp, _ := post(t, e.URL()+"/v1/completions", body)
	assert.Equal(t, http.StatusOK, resp.StatusCode)

	e.Kill()
	_, err = http.Post(e.URL()+"/v1/completions", "application/json", strings.NewReader(body))
	require.Error(t, err, "connection refused after Kill")
	assert.ErrorIs(t, e.Restart(context.Background()), nil)
	resp, b := post(t, e.URL()+"/v1/completions", body)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Contains(t, string(b), `"cached_tokens":0`, "a restarted engine has an empty cache")
}

func TestCloseStopsInFlightWork(t *testing.T) {
	base := runtime.NumGoroutine()
	e, err := New(Config{BlockSize: 4, MaxConcurrent: 1, Latency: Latency{Base: time.Hour, SpeedFactor: 1},
		Events: EventsConfig{SSE: true, ZMQEndpoint: "tcp://127.0.0.1:0", ZMQBind: true, ReplayEndpoint: "tcp://127.0.0.1:0",
			FlushInterval: time.Hour}})
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	require.NoError(t, e.Serve(ln))
	require.NoError(t, e.Start(context.Background()))

	// A ZMQ subscriber, a replay client, an SSE stream, a running and a queued request.
	sub := subscribeRaw(t, e, "")
	_, _ = dialZMTP(t, e.ReplayEndpoint(), zmq4.Dealer)
	sseResp, err := http.Get(e.URL() + "/v1/kv_events")
	require.NoError(t, err)
	defer sseResp.Body.Close()
	var wg sync.WaitGroup
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := http.Post(e.URL()+"/v1/completions", "application/json",
				strings.NewReader(`{"model":"`+DefaultModel+`","prompt":"request `+itoa(i)+`","stream":true}`))
			if err == nil {
				_, _ = bufio.NewReader(resp.Body).ReadString(0)
				resp.Body.Close()
			}
		}()
	}
	eventually(t, func() bool { s := e.Stats(); return s.Running == 1 && s.Waiting == 1 }, "one running, one queued")

	done := make(chan struct{})
	go func() { _ = e.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close hung")
	}
	require.NoError(t, e.Close(), "idempotent")
	wg.Wait()
	sub.c.Close()
	sseResp.Body.Close()
	http.DefaultClient.CloseIdleConnections()
	settleGoroutines(t, base, 2)
}

func TestFleet(t *testing.T) {
	base := runtime.NumGoroutine()
	f, err := StartFleet(context.Background(), FleetConfig{N: 3, ZMQ: true, Base: Config{Model: "llama", CapacityBlocks: 64}})
	require.NoError(t, err)
	info := f.Info()
	require.Len(t, info, 3)
	assert.Len(t, f.URLs(), 3)
	var eps []zmqevents.Endpoint
	for i, in := range info {
		assert.Equal(t, "enginesim-"+itoa(i), in.Name)
		assert.Equal(t, "kv@"+in.Name+"@llama", in.Topic)
		assert.True(t, strings.HasPrefix(in.ZMQEndpoint, "tcp://127.0.0.1:"))
		assert.True(t, strings.HasPrefix(in.ReplayEndpoint, "tcp://127.0.0.1:"))
		assert.Empty(t, in.KVEventsURL, "SSE off with ZMQ unless asked")
		eps = append(eps, zmqevents.Endpoint{Backend: in.Name, Endpoint: in.ZMQEndpoint, ReplayEndpoint: in.ReplayEndpoint})
	}
	idx := newIndex(t)
	c, err := zmqevents.New(zmqevents.Config{Sink: idx, Endpoints: eps})
	require.NoError(t, err)
	require.NoError(t, c.Start(context.Background()))
	engines := f.Engines()
	for _, e := range engines {
		eventually(t, func() bool { return e.Stats().ZMQSubscribers == 1 }, "subscribed")
	}
	for i, e := range engines {
		reqs := interopWorkload(t, e)[:2+i]
		checkConverges(t, e, idx, e.Name(), reqs)
	}
	require.NoError(t, c.Close())
	require.NoError(t, f.Close())
	require.NoError(t, f.Close())
	http.DefaultClient.CloseIdleConnections()
	settleGoroutines(t, base, 2)

	sf, err := StartFleet(context.Background(), FleetConfig{N: 1})
	require.NoError(t, err)
	defer sf.Close()
	assert.Equal(t, sf.Info()[0].URL+"/v1/kv_events", sf.Info()[0].KVEventsURL)
	_, err = StartFleet(context.Background(), FleetConfig{})
	assert.ErrorIs(t, err, ErrInvalidConfig)
}
