package main

import (
	"context"
	"fmt"
	"net"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/admin"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/enginesim"
	"github.com/kvroute/kvroute/prefixkey"
)

// ringOwner returns the backend the CHWBL ring alone would choose for body among names.
func ringOwner(t *testing.T, body string, names []string) string {
	t.Helper()
	req, err := prefixkey.ParseOpenAIChat([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	var bs []kvroute.Backend
	for _, n := range names {
		bs = append(bs, kvroute.Backend{Name: n})
	}
	twin, err := kvroute.New(kvroute.Config{Backends: bs})
	if err != nil {
		t.Fatal(err)
	}
	defer twin.Close()
	d, err := twin.Route(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	d.Done(kvroute.Outcome{})
	return d.Backend
}

// warmNonOwner sends body's prompt straight to an engine that is not the ring's choice, and
// waits until the proxy has indexed its events. It returns that engine's name.
func warmNonOwner(t *testing.T, p *testProxy, f *enginesim.Fleet, body, warm string) string {
	t.Helper()
	var names []string
	for _, in := range f.Info() {
		names = append(names, in.Name)
	}
	owner := ringOwner(t, body, names)
	for _, in := range f.Info() {
		if in.Name == owner {
			continue
		}
		awaitEvents(t, p, in.URL, in.Name, 10*time.Second)
		before := indexCreated(t, p, in.Name)
		if r, b := post(t, in.URL+"/v1/chat/completions", warm); r.StatusCode != 200 {
			t.Fatalf("warm-up: %d %s", r.StatusCode, b)
		}
		waitFor(t, 10*time.Second, in.Name+"'s KV events", func() bool { return indexCreated(t, p, in.Name) > before })
		return in.Name
	}
	t.Fatal("no engine besides the owner")
	return ""
}

// The seeds' form: SSE event sources (prefix-granular events) and no tokenizer.
func TestE2ESSEEventSources(t *testing.T) {
	f := startFleet(t, 3, false)
	cfg := fleetConfig(t, f, func(c *config.Config) {
		c.KVCacheIndex.Tokenizer = ""
		c.KVCacheIndex.EventSources = nil
		for _, in := range f.Info() {
			c.KVCacheIndex.EventSources = append(c.KVCacheIndex.EventSources,
				config.EventSourceConfig{BackendName: in.Name, Endpoint: in.KVEventsURL, ReconnectIntervalMS: 100})
		}
	})
	if cfg.KVCacheIndex.Tokenizer != config.TokenizerNone {
		t.Fatalf("tokenizer %q, want none for SSE sources", cfg.KVCacheIndex.Tokenizer)
	}
	p := startProxy(t, cfg)
	sys := longSystemPrompt("SSE", 100)
	body := chatBody(sys, "A question.", `"temperature":0.5,"max_tokens":2`)
	holder := warmNonOwner(t, p, f, body, chatBody(sys, "Warm-up.", `"max_tokens":1`))
	expectKVRouted(t, p, body, holder, "the warmed prompt")
	var st admin.KVIndexStats
	getJSON(t, p.URL+"/admin/kv-index/stats", &st)
	if len(st.EventSources) != 3 || st.EventSources[0].Transport != "sse" || !st.EventSources[0].Connected {
		t.Errorf("event sources %+v", st.EventSources)
	}
}

// Centralized ZMQ: the proxy binds one endpoint and every engine connects to it; messages are
// placed by their kv@<engine>@<model> topic.
func TestE2EZMQBind(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	bind := "tcp://" + ln.Addr().String()
	ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	f, err := enginesim.StartFleet(ctx, enginesim.FleetConfig{N: 3, ZMQ: true, ZMQConnect: bind,
		Base: enginesim.Config{BlockSize: 16, CapacityBlocks: 2048}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	cfg := fleetConfig(t, f, func(c *config.Config) {
		c.KVCacheIndex.EventSources = []config.EventSourceConfig{{Endpoint: bind, Bind: true}}
	})
	p := startProxy(t, cfg)
	waitFor(t, 10*time.Second, "the engines to connect", func() bool {
		// An engine shows up in bind mode with its first message; make every engine publish.
		for i, in := range f.Info() {
			post(t, in.URL+"/v1/chat/completions", chatBody(fmt.Sprint("hello ", i, " ", time.Now().UnixNano()), strings.Repeat("word ", 20), `"max_tokens":1`))
		}
		n := 0
		for _, s := range p.statuses() {
			if s.Connection.Connected {
				n++
			}
		}
		return n == 3
	})
	sys := longSystemPrompt("bind", 100)
	body := chatBody(sys, "A question.", `"temperature":0.5,"max_tokens":2`)
	holder := warmNonOwner(t, p, f, body, chatBody(sys, "Warm-up.", `"max_tokens":1`))
	expectKVRouted(t, p, body, holder, "the warmed prompt")
}

// Close stops every goroutine newServer and start started (consumers retrying unreachable
// engines, health probes, the index's sweeper, the breakers' timers).
func TestCloseStopsEverything(t *testing.T) {
	up := newFakeUpstream(t, "a")
	time.Sleep(50 * time.Millisecond)
	base := runtime.NumGoroutine()
	cfg := fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}, {Name: "b", URL: deadURL(t)}}, func(c *config.Config) {
		c.HealthChecks.Enabled = ptr(true)
		c.HealthChecks.Interval = config.Duration(10 * time.Millisecond)
		c.CircuitBreaker.FailureThreshold = 1
		c.ResponseCache.Enabled = true
		c.KVCacheIndex.Enabled = true
		c.KVCacheIndex.EventSources = []config.EventSourceConfig{
			{BackendName: "a", Endpoint: up.URL + "/v1/kv_events"},
			{BackendName: "b", Endpoint: "tcp://" + strings.TrimPrefix(deadURL(t), "http://")},
		}
	})
	srv, err := newServer(cfg, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.start(context.Background()); err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv.Handler())
	for i := range 10 {
		post(t, ts.URL+"/v1/chat/completions", chatBody(fmt.Sprint("s", i), "u", ""))
	}
	time.Sleep(50 * time.Millisecond)
	ts.Close()
	if err := srv.Close(); err != nil {
		t.Fatal(err)
	}
	if err := srv.Close(); err != nil {
		t.Fatal("second Close:", err)
	}
	waitFor(t, 5*time.Second, "goroutines to end", func() bool { return runtime.NumGoroutine() <= base })
}

// An engine that crashes comes back with an empty cache. The proxy forgets what the engine held
// as soon as its event connection drops, so that after the restart a prompt it used to hold is
// not sent to it for a cache it no longer has; its new events are indexed again.
func TestE2EEngineRestartForgetsItsCache(t *testing.T) {
	f := startFleet(t, 3, true)
	p := startProxy(t, fleetConfig(t, f, nil))
	sys := longSystemPrompt("restart", 100)
	body := chatBody(sys, "A question.", `"temperature":0.5,"max_tokens":2`)
	holder := warmNonOwner(t, p, f, body, chatBody(sys, "Warm-up.", `"max_tokens":1`))
	var eng *enginesim.Engine
	for _, e := range f.Engines() {
		if e.Name() == holder {
			eng = e
		}
	}
	if n := kvBackend(t, p, holder).IndexEntries; n == 0 {
		t.Fatalf("%s has no index entries after its warm-up", holder)
	}

	eng.Kill()
	waitFor(t, 10*time.Second, "the killed engine's entries dropped", func() bool { return kvBackend(t, p, holder).IndexEntries == 0 })
	if err := eng.Restart(t.Context()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the restarted engine back in rotation", func() bool { return p.health.InRotation(holder) })
	r, b := post(t, p.URL+"/v1/chat/completions", body)
	if r.StatusCode != 200 {
		t.Fatalf("%d %s", r.StatusCode, b)
	}
	if got, route := r.Header.Get(HeaderBackend), r.Header.Get(HeaderRoute); got == holder && route == "kv_aware" {
		t.Errorf("routed to %s (kv_aware) for a cache it lost in its restart", got)
	}
	awaitEvents(t, p, eng.URL(), holder, 10*time.Second)
}

// The reproduction of issue 28: an engine whose topic names a pod (kv@10.0.0.7:8000@m) that is
// no configured backend publishes to a bound endpoint without backend_name. Every event is
// dropped; the bound endpoint's counts show it in /admin/kv-index/stats, /admin/kv-index/backends
// and /metrics (they showed 0 everywhere, with one WARN line).
func TestE2EZMQBindUnplacedEventsCounted(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	bind := "tcp://" + ln.Addr().String()
	ln.Close()
	eng, err := enginesim.New(enginesim.Config{Name: "10.0.0.7:8000", BlockSize: 16, CapacityBlocks: 2048,
		Events: enginesim.EventsConfig{ZMQEndpoint: bind, Topic: "kv@10.0.0.7:8000@m"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = eng.Close() })
	eln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if err := eng.Serve(eln); err != nil {
		t.Fatal(err)
	}
	if err := eng.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	cfg := fakeConfig(t, []config.BackendConfig{{Name: "vllm-1", URL: eng.URL()}}, func(c *config.Config) {
		c.KVCacheIndex.Enabled = true
		c.KVCacheIndex.EventSources = []config.EventSourceConfig{{Endpoint: bind, Bind: true}}
	})
	p := startProxy(t, cfg)
	var unplaced uint64
	waitFor(t, 10*time.Second, "the engine's messages counted as unplaced", func() bool {
		for i := range 3 {
			r, b := post(t, p.URL+"/v1/chat/completions", chatBody(fmt.Sprint("unplaced ", i, " ", time.Now().UnixNano()), strings.Repeat("word ", 20), `"max_tokens":1`))
			if r.StatusCode != 200 {
				t.Fatalf("%d %s", r.StatusCode, b)
			}
		}
		var st admin.KVIndexStats
		getJSON(t, p.URL+"/admin/kv-index/stats", &st)
		if len(st.EventListeners) != 1 {
			t.Fatalf("event listeners %+v, want the bound endpoint", st.EventListeners)
		}
		m := st.EventListeners[0].Messages
		if m.Placed != 0 || m.Malformed != 0 || m.Received != m.Unplaced {
			t.Fatalf("listener messages %+v, want every one unplaced", m)
		}
		unplaced = m.Unplaced
		return unplaced >= 3
	})

	var backends struct {
		Backends  []admin.BackendSummary
		Listeners []struct {
			Endpoint string
			Messages struct{ Unplaced uint64 }
		}
	}
	getJSON(t, p.URL+"/admin/kv-index/backends", &backends)
	if len(backends.Listeners) != 1 || backends.Listeners[0].Endpoint != bind || backends.Listeners[0].Messages.Unplaced < unplaced {
		t.Errorf("/admin/kv-index/backends listeners %+v, want %s with ≥ %d unplaced", backends.Listeners, bind, unplaced)
	}
	if len(backends.Backends) != 1 || backends.Backends[0].Events.Received != 0 {
		t.Errorf("backends %+v: vllm-1 received none of the engine's events", backends.Backends)
	}

	_, body := adminDo(t, "GET", p.URL+"/metrics", "", "")
	want := fmt.Sprintf(`kvroute_kv_consumer_listener_messages_total{endpoint=%q,`, bind)
	found := false
	for line := range strings.Lines(string(body)) {
		if strings.HasPrefix(line, want) && strings.Contains(line, `outcome="unplaced"`) {
			var n uint64
			if _, err := fmt.Sscan(line[strings.LastIndexByte(line, ' ')+1:], &n); err != nil || n < unplaced {
				t.Errorf("metric line %q: want ≥ %d", line, unplaced)
			}
			found = true
		}
	}
	if !found {
		t.Errorf("/metrics has no %s…outcome=\"unplaced\" line:\n%s", want, grepLines(string(body), "listener_messages"))
	}
}

// grepLines returns the lines of s that contain sub.
func grepLines(s, sub string) string {
	var b strings.Builder
	for line := range strings.Lines(s) {
		if strings.Contains(line, sub) {
			b.WriteString(line)
		}
	}
	return b.String()
}
