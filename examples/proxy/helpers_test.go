package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvroute/kvroute/admin"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/enginesim"
)

const testModel = enginesim.DefaultModel

// testLogger logs to the test's output at Warn and above (Debug with -v via testing.Verbose),
// and drops records once the test has finished, so that a late background log line cannot fail
// the run.
func testLogger(t *testing.T) *slog.Logger {
	t.Helper()
	w := &testWriter{t: t}
	t.Cleanup(w.stop) // registered first: runs last
	level := slog.LevelWarn
	if testing.Verbose() {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: level}))
}

type testWriter struct {
	mu   sync.Mutex
	t    *testing.T
	done bool
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.t.Log(strings.TrimRight(string(p), "\n"))
	}
	return len(p), nil
}

func (w *testWriter) stop() {
	w.mu.Lock()
	w.done = true
	w.mu.Unlock()
}

// startFleet starts n simulated engines without latency, with KV events over ZMQ (zmq true) or
// SSE.
func startFleet(t *testing.T, n int, zmq bool) *enginesim.Fleet {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	f, err := enginesim.StartFleet(ctx, enginesim.FleetConfig{N: n, ZMQ: zmq, SSE: !zmq,
		Base: enginesim.Config{BlockSize: 16, CapacityBlocks: 2048}})
	if err != nil {
		t.Fatalf("StartFleet: %v", err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return f
}

// fleetConfig is demoConfig for f with test-friendly timings, defaults applied and validated
// after edit.
func fleetConfig(t *testing.T, f *enginesim.Fleet, edit func(*config.Config)) *config.Config {
	t.Helper()
	cfg := demoConfig(f.Info())
	cfg.KVCacheIndex.TokenizeTimeout = config.Duration(5 * time.Second) // -race on shared cores
	cfg.HealthChecks.Interval = config.Duration(100 * time.Millisecond)
	cfg.HealthChecks.Timeout = config.Duration(2 * time.Second)
	cfg.Server.Port = ptr(0)
	if edit != nil {
		edit(cfg)
	}
	cfg.ApplyDefaults()
	if err := cfg.Validate(); err != nil {
		t.Fatalf("config: %v", err)
	}
	return cfg
}

// testProxy is a proxy serving on a loopback port.
type testProxy struct {
	*server
	URL string
}

// startProxy builds, starts and serves the proxy for cfg on a free loopback port, with the
// front server run serves with (the proxy's loop unless an option says otherwise); everything
// stops at the end of the test.
func startProxy(t *testing.T, cfg *config.Config) *testProxy {
	t.Helper()
	log := testLogger(t)
	srv, err := newServer(cfg, log)
	if err != nil {
		t.Fatalf("newServer: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.start(ctx); err != nil {
		_ = srv.Close()
		t.Fatalf("start: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		_ = srv.Close()
		t.Fatal(err)
	}
	hs := srv.newHTTPServer()
	done := make(chan struct{})
	go func() { defer close(done); _ = hs.Serve(ln) }()
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := hs.Shutdown(sctx); err != nil {
			_ = hs.Close()
		}
		<-done
		if err := srv.Close(); err != nil {
			t.Errorf("server Close: %v", err)
		}
	})
	return &testProxy{server: srv, URL: "http://" + ln.Addr().String()}
}

var httpClient = &http.Client{Timeout: 30 * time.Second}

// post sends body to the proxy and returns the response with its body read.
func post(t *testing.T, url string, body string, hdr ...string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("POST %s: reading body: %v", url, err)
	}
	return resp, b
}

// getJSON GETs url and decodes the JSON answer into v; it returns the status.
func getJSON(t *testing.T, url string, v any, hdr ...string) int {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if v != nil {
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatalf("GET %s: %v in %s", url, err, b)
		}
	}
	return resp.StatusCode
}

// chatBody returns an OpenAI chat body.
func chatBody(system, user string, extra string) string {
	b, _ := json.Marshal(map[string]any{"model": testModel, "messages": []map[string]string{
		{"role": "system", "content": system}, {"role": "user", "content": user}}})
	if extra != "" {
		b = append(b[:len(b)-1], ","+extra+"}"...)
	}
	return string(b)
}

// longSystemPrompt returns a system prompt of about n words, distinct per seed.
func longSystemPrompt(seed string, n int) string {
	var b strings.Builder
	b.WriteString("You are the " + seed + " assistant.")
	words := []string{"policy", "refund", "order", "shipping", "account", "billing", "support", "warranty"}
	for i := range n {
		b.WriteString(" " + words[i%len(words)])
	}
	return b.String()
}

// waitFor polls cond every 20 ms until it holds or timeout passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// indexCreated returns the index_created count of backend from /admin/kv-index/backends.
// awaitEvents makes sure the proxy receives engine's KV events before a test relies on them: a
// PUB socket drops what it publishes before the subscription reaches it, and the consumer learns
// of a loss only from the next event. It sends throwaway prompts straight to the engine until the
// proxy's index has applied an event from it (bounded by timeout).
func awaitEvents(t *testing.T, p *testProxy, engineURL, backend string, timeout time.Duration) {
	t.Helper()
	before := indexCreated(t, p, backend)
	deadline := time.Now().Add(timeout)
	for i := 0; ; i++ {
		if r, b := post(t, engineURL+"/v1/chat/completions", chatBody(longSystemPrompt(fmt.Sprintf("probe %s %d", backend, i), 40), "Hi.", `"max_tokens":1`)); r.StatusCode != 200 {
			t.Fatalf("probe: %d %s", r.StatusCode, b)
		}
		for range 10 {
			if indexCreated(t, p, backend) > before {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		if time.Now().After(deadline) {
			t.Fatalf("no KV events from %s within %v", backend, timeout)
		}
	}
}

// indexCreated is the number of index entries backend's events created.
func indexCreated(t *testing.T, p *testProxy, backend string) uint64 {
	t.Helper()
	return kvBackend(t, p, backend).Events.IndexCreated
}

// expectKVRouted posts body to p and checks that the KV index sent it to holder (kv_aware); when
// says which request it is in a failure.
func expectKVRouted(t *testing.T, p *testProxy, body, holder, when string) {
	t.Helper()
	r, out := post(t, p.URL+"/v1/chat/completions", body)
	if r.StatusCode != 200 {
		t.Fatalf("%s: %d %s", when, r.StatusCode, out)
	}
	if got, route := r.Header.Get(HeaderBackend), r.Header.Get(HeaderRoute); got != holder || route != "kv_aware" {
		t.Errorf("%s: routed to %s (%s), want %s (kv_aware)", when, got, route, holder)
	}
}

// kvBackend is what /admin/kv-index/backends reports of backend; zero when it is not listed.
func kvBackend(t *testing.T, p *testProxy, backend string) admin.BackendSummary {
	t.Helper()
	var body struct {
		Backends []admin.BackendSummary `json:"backends"`
	}
	getJSON(t, p.URL+"/admin/kv-index/backends", &body)
	for _, b := range body.Backends {
		if b.Backend == backend {
			return b
		}
	}
	return admin.BackendSummary{}
}

// errorBody is the OpenAI error shape.
type errorBody struct {
	Error *struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    *string `json:"code"`
	} `json:"error"`
}

// compactJSON re-encodes JSON compactly, for comparisons.
func compactJSON(b []byte) string {
	var buf bytes.Buffer
	if err := json.Compact(&buf, b); err != nil {
		return string(b)
	}
	return buf.String()
}

// testIOTimeout bounds every read and write of a raw test connection.
const testIOTimeout = 3 * time.Second

// dialRaw opens a TCP connection to addr, with testIOTimeout as its deadline, closed at the end of
// the test.
func dialRaw(t *testing.T, addr string) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(testIOTimeout))
	t.Cleanup(func() { c.Close() })
	return c, bufio.NewReader(c)
}

// ptr returns a pointer to v.
func ptr[T any](v T) *T { return &v }

// env is a lookup of ${NAME} references in m, for config.Parse.
func env(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}
