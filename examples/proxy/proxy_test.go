package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/admin"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/health"
	"github.com/kvroute/kvroute/internal/testenv"
)

// fakeUpstream is a minimal OpenAI-compatible backend whose behaviour a test controls.
type fakeUpstream struct {
	*httptest.Server
	name     string
	status   atomic.Int32 // answer status for LLM requests (200 when 0)
	health   atomic.Int32 // /health status (200 when 0)
	requests atomic.Int32
	mu       sync.Mutex
	bodies   []string
}

func newFakeUpstream(t *testing.T, name string) *fakeUpstream {
	t.Helper()
	u := &fakeUpstream{name: name}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			if c := u.health.Load(); c != 0 {
				w.WriteHeader(int(c))
			}
			return
		}
		b, _ := io.ReadAll(r.Body)
		u.requests.Add(1)
		u.mu.Lock()
		u.bodies = append(u.bodies, string(b))
		u.mu.Unlock()
		if c := u.status.Load(); c != 0 && c != 200 {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(int(c))
			fmt.Fprintf(w, `{"error":{"message":"fake %d"}}`, c)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"x","object":"chat.completion","model":"m","backend":%q,"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}`, name)
	}))
	t.Cleanup(u.Close)
	return u
}

func (u *fakeUpstream) lastBody() string {
	u.mu.Lock()
	defer u.mu.Unlock()
	if len(u.bodies) == 0 {
		return ""
	}
	return u.bodies[len(u.bodies)-1]
}

// deadURL returns the URL of a loopback port nobody listens on.
func deadURL(t *testing.T) string {
	t.Helper()
	return "http://" + testenv.RefusedAddr(t)
}

// fakeConfig configures the proxy in front of the given backends (name=url pairs) with health
// checks off, then applies edit.
func fakeConfig(t *testing.T, backends []config.BackendConfig, edit func(*config.Config)) *config.Config {
	t.Helper()
	cfg := &config.Config{Backends: backends}
	cfg.Server.Port = ptr(0)
	cfg.HealthChecks.Enabled = ptr(false)
	if edit != nil {
		edit(cfg)
	}
	cfg.ApplyDefaults()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	return cfg
}

func TestMalformedJSON(t *testing.T) {
	up := newFakeUpstream(t, "a")
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, nil))
	tests := []struct {
		path, body, param string
	}{
		{"/v1/chat/completions", `{"model":"m","messages":[`, ""},
		{"/v1/chat/completions", `{"model":"m","messages":"hello"}`, "messages"},
		{"/v1/chat/completions", `not json`, ""},
		{"/v1/completions", `{"model":"m"}`, "prompt"},
		{"/v1/chat/completions", ``, ""},
	}
	for _, tc := range tests {
		r, b := post(t, p.URL+tc.path, tc.body)
		if r.StatusCode != http.StatusBadRequest {
			t.Errorf("%s %q: status %d", tc.path, tc.body, r.StatusCode)
			continue
		}
		var eb errorBody
		if err := json.Unmarshal(b, &eb); err != nil || eb.Error == nil {
			t.Errorf("%q: body %s", tc.body, b)
			continue
		}
		if eb.Error.Type != "invalid_request_error" || eb.Error.Message == "" {
			t.Errorf("%q: error %+v", tc.body, *eb.Error)
		}
		if tc.param != "" && (eb.Error.Param == nil || *eb.Error.Param != tc.param) {
			t.Errorf("%q: param %v, want %s", tc.body, eb.Error.Param, tc.param)
		}
		// The four members are always present (param and code may be null).
		var raw map[string]map[string]json.RawMessage
		_ = json.Unmarshal(b, &raw)
		for _, k := range []string{"message", "type", "param", "code"} {
			if _, ok := raw["error"][k]; !ok {
				t.Errorf("%q: error body lacks %q: %s", tc.body, k, b)
			}
		}
	}
	if up.requests.Load() != 0 {
		t.Errorf("malformed requests reached the backend")
	}

	r, b := post(t, p.URL+"/v1/messages", `{"model":"m","max_tokens":5,"messages":{}}`)
	var ab struct {
		Type  string `json:"type"`
		Error struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		} `json:"error"`
	}
	if r.StatusCode != 400 || json.Unmarshal(b, &ab) != nil || ab.Type != "error" || ab.Error.Type != "invalid_request_error" || !strings.Contains(ab.Error.Message, "messages") {
		t.Errorf("anthropic malformed: %d %s", r.StatusCode, b)
	}

	resp, err := httpClient.Get(p.URL + "/v1/chat/completions")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("GET: %d", resp.StatusCode)
	}
}

func TestOversizeBody(t *testing.T) {
	up := newFakeUpstream(t, "a")
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) {
		c.Server.MaxBodyBytes = 4096
		c.ResponseCache.Enabled = true
	}))
	big := chatBody("s", strings.Repeat("x", 5000), "")
	r, b := post(t, p.URL+"/v1/chat/completions", big)
	var eb errorBody
	if r.StatusCode != http.StatusRequestEntityTooLarge || json.Unmarshal(b, &eb) != nil || eb.Error == nil || eb.Error.Code == nil || *eb.Error.Code != "request_too_large" {
		t.Errorf("declared length: %d %s", r.StatusCode, b)
	}
	// Without a declared length (chunked), the request is refused before its body is read.
	req, _ := http.NewRequest(http.MethodPost, p.URL+"/v1/messages", io.MultiReader(strings.NewReader(big)))
	req.ContentLength = -1
	resp, err := httpClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(b), `"invalid_request_error"`) {
		t.Errorf("chunked: %d %s", resp.StatusCode, b)
	}
	if up.requests.Load() != 0 {
		t.Error("oversize requests reached the backend")
	}
	// Just under the limit goes through.
	r, b = post(t, p.URL+"/v1/chat/completions", chatBody("s", strings.Repeat("x", 3000), ""))
	if r.StatusCode != 200 {
		t.Errorf("under the limit: %d %s", r.StatusCode, b)
	}
}

func TestNoHealthyBackend(t *testing.T) {
	up := newFakeUpstream(t, "a")
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, nil))
	if err := p.router.SetHealthy("a", false); err != nil {
		t.Fatal(err)
	}
	r, b := post(t, p.URL+"/v1/chat/completions", chatBody("s", "u", ""))
	var eb errorBody
	if r.StatusCode != 503 || json.Unmarshal(b, &eb) != nil || eb.Error == nil || *eb.Error.Code != "no_healthy_backend" {
		t.Errorf("%d %s", r.StatusCode, b)
	}
	r, b = post(t, p.URL+"/v1/messages", `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}`)
	if r.StatusCode != 503 || !strings.Contains(string(b), `"type":"error"`) {
		t.Errorf("anthropic: %d %s", r.StatusCode, b)
	}
}

// A backend that refuses connections is replaced by another, once.
func TestRetryOnConnectionRefused(t *testing.T) {
	up := newFakeUpstream(t, "good")
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "dead", URL: deadURL(t)}, {Name: "good", URL: up.URL}},
		func(c *config.Config) { c.CircuitBreaker.FailureThreshold = 1000 }))
	retried := 0
	for i := range 20 {
		r, b := post(t, p.URL+"/v1/chat/completions", chatBody(fmt.Sprintf("system %d", i), "u", ""))
		if r.StatusCode != 200 || r.Header.Get(HeaderBackend) != "good" {
			t.Fatalf("request %d: %d %s %s", i, r.StatusCode, r.Header.Get(HeaderBackend), b)
		}
		if r.Header.Get(HeaderRetriedFrom) == "dead" {
			retried++
		}
	}
	if retried == 0 {
		t.Error("no request was routed to the dead backend first")
	}
	var st struct {
		BackendDistribution []struct {
			Backend          string `json:"backend"`
			InFlightRequests int    `json:"in_flight_requests"`
		} `json:"backend_distribution"`
	}
	getJSON(t, p.URL+"/admin/prefix-routing/stats", &st)
	for _, b := range st.BackendDistribution {
		if b.InFlightRequests != 0 {
			t.Errorf("%s holds %d in-flight slots after all requests ended", b.Backend, b.InFlightRequests)
		}
	}
}

// 502/503/504 before any byte reached the client are retried elsewhere; on the retry they pass
// through; other statuses pass through at once.
func TestRetryOnUnavailableStatus(t *testing.T) {
	a, b := newFakeUpstream(t, "a"), newFakeUpstream(t, "b")
	a.status.Store(503)
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: a.URL}, {Name: "b", URL: b.URL}},
		func(c *config.Config) { c.CircuitBreaker.FailureThreshold = 1000 }))
	for i := range 10 {
		r, body := post(t, p.URL+"/v1/chat/completions", chatBody(fmt.Sprintf("s%d", i), "u", ""))
		if r.StatusCode != 200 || r.Header.Get(HeaderBackend) != "b" {
			t.Fatalf("%d %s %s", r.StatusCode, r.Header.Get(HeaderBackend), body)
		}
	}
	b.status.Store(503)
	r, body := post(t, p.URL+"/v1/chat/completions", chatBody("both down", "u", ""))
	if r.StatusCode != 503 || !strings.Contains(string(body), "fake 503") {
		t.Errorf("both 503: %d %s", r.StatusCode, body)
	}
	a.status.Store(400)
	b.status.Store(400)
	before := a.requests.Load() + b.requests.Load()
	r, _ = post(t, p.URL+"/v1/chat/completions", chatBody("client error", "u", ""))
	if r.StatusCode != 400 || a.requests.Load()+b.requests.Load() != before+1 {
		t.Errorf("400 retried or changed: %d", r.StatusCode)
	}
}

// An engine that refuses a request for lack of room (429, 503, or a 500 that says so) is retried
// on another backend before the first byte, counted as a refusal in the Router's load, and not
// held against the engine's circuit breaker; a plain 500 passes through.
func TestRetryOnRefusal(t *testing.T) {
	t.Parallel() // its own backends and proxy
	var status, refusals atomic.Int32
	var plain atomic.Bool // a 500 that says nothing of capacity
	full := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		refusals.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(int(status.Load()))
		if status.Load() == 500 && !plain.Load() {
			_, _ = io.WriteString(w, `{"error":{"message":"Insufficient KV cache capacity: cannot schedule the request"}}`)
			return
		}
		_, _ = io.WriteString(w, `{"error":{"message":"busy"}}`)
	}))
	t.Cleanup(full.Close)
	b := newFakeUpstream(t, "b")
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "full", URL: full.URL}, {Name: "b", URL: b.URL}},
		func(c *config.Config) { c.CircuitBreaker.FailureThreshold = 2 }))
	var st struct {
		BackendDistribution []admin.BackendLoad `json:"backend_distribution"`
	}
	idle := func() bool {
		getJSON(t, p.URL+"/admin/prefix-routing/stats", &st)
		for _, l := range st.BackendDistribution {
			if l.InFlightRequests != 0 {
				return false
			}
		}
		return true
	}
	for _, code := range []int32{500, 429, 503} {
		// The refused requests' slots weigh on the engine for a second (RefusalHold): while
		// they do, new requests go to b.
		waitFor(t, 5*time.Second, "the refusals' slots released", idle)
		status.Store(code)
		before := refusals.Load()
		for i := range 12 {
			r, body := post(t, p.URL+"/v1/chat/completions", chatBody(fmt.Sprintf("s%d-%d", code, i), "u", ""))
			if r.StatusCode != 200 || r.Header.Get(HeaderBackend) != "b" {
				t.Fatalf("%d refusal, request %d: %d from %s: %s", code, i, r.StatusCode, r.Header.Get(HeaderBackend), body)
			}
		}
		if refusals.Load() == before {
			t.Fatalf("%d: no request went to the full engine first", code)
		}
	}
	var hz struct {
		Backends []health.Status `json:"backends"`
	}
	getJSON(t, p.URL+"/admin/backends", &hz)
	for _, st := range hz.Backends {
		if st.Circuit != "closed" {
			t.Errorf("%s: circuit %s after refusals, want closed (a refusal is load, not a failure)", st.Name, st.Circuit)
		}
	}
	getJSON(t, p.URL+"/admin/prefix-routing/stats", &st)
	for _, l := range st.BackendDistribution {
		if l.Backend == "full" && (l.Refusals != uint64(refusals.Load()) || l.SuccessRate != 1) {
			t.Errorf("full: %+v, want %d refusals and an untouched success rate", l, refusals.Load())
		}
	}

	// A 500 that is no refusal is the engine's answer: relayed, not retried.
	status.Store(500)
	plain.Store(true)
	b.status.Store(500)
	for i := range 4 {
		r, body := post(t, p.URL+"/v1/chat/completions", chatBody(fmt.Sprintf("plain %d", i), "u", ""))
		if r.StatusCode != 500 || r.Header.Get(HeaderRetriedFrom) != "" {
			t.Errorf("plain 500: %d retried from %q: %s", r.StatusCode, r.Header.Get(HeaderRetriedFrom), body)
		}
	}

	// Alone, a refusing engine's own answer reaches the client.
	status.Store(429)
	p1 := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "full", URL: full.URL}}, nil))
	r, body := post(t, p1.URL+"/v1/chat/completions", chatBody("alone", "u", ""))
	if r.StatusCode != 429 || !strings.Contains(string(body), "busy") {
		t.Errorf("single refusing backend: %d %s", r.StatusCode, body)
	}
}

// Consecutive upstream failures open the circuit (the backend leaves rotation); after the
// recovery timeout a trial request closes it again.
func TestCircuitBreaker(t *testing.T) {
	up := newFakeUpstream(t, "a")
	up.status.Store(500)
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) {
		c.CircuitBreaker.FailureThreshold = 3
		c.CircuitBreaker.RecoveryTimeout = config.Duration(300 * time.Millisecond)
	}))
	for i := range 3 {
		if r, _ := post(t, p.URL+"/v1/chat/completions", chatBody("s", fmt.Sprint(i), "")); r.StatusCode != 500 {
			t.Fatalf("request %d: %d", i, r.StatusCode)
		}
	}
	if r, _ := post(t, p.URL+"/v1/chat/completions", chatBody("s", "open", "")); r.StatusCode != 503 {
		t.Errorf("open circuit: %d, want 503", r.StatusCode)
	}
	if n := up.requests.Load(); n != 3 {
		t.Errorf("backend saw %d requests, want 3", n)
	}
	var hz struct {
		Backends []health.Status `json:"backends"`
	}
	getJSON(t, p.URL+"/admin/backends", &hz)
	if hz.Backends[0].Circuit != "open" || hz.Backends[0].InRotation {
		t.Errorf("healthz: %+v", hz.Backends)
	}
	up.status.Store(200)
	waitFor(t, 5*time.Second, "half-open", func() bool { return p.health.InRotation("a") })
	if r, _ := post(t, p.URL+"/v1/chat/completions", chatBody("s", "trial", "")); r.StatusCode != 200 {
		t.Errorf("trial: %d", r.StatusCode)
	}
	getJSON(t, p.URL+"/admin/backends", &hz)
	if hz.Backends[0].Circuit != "closed" {
		t.Errorf("after trial: %+v", hz.Backends)
	}
}

// Health probes take a backend out of rotation after unhealthy_threshold failures and back after
// healthy_threshold successes.
func TestHealthChecks(t *testing.T) {
	a, b := newFakeUpstream(t, "a"), newFakeUpstream(t, "b")
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: a.URL}, {Name: "b", URL: b.URL}}, func(c *config.Config) {
		c.HealthChecks = config.HealthCheckConfig{Enabled: ptr(true), Interval: config.Duration(20 * time.Millisecond),
			Timeout: config.Duration(time.Second), UnhealthyThreshold: 2, HealthyThreshold: 2}
	}))
	a.health.Store(503)
	waitFor(t, 5*time.Second, "a out of rotation", func() bool { return !p.health.InRotation("a") })
	for i := range 10 {
		r, _ := post(t, p.URL+"/v1/chat/completions", chatBody(fmt.Sprint("s", i), "u", ""))
		if r.Header.Get(HeaderBackend) != "b" {
			t.Fatalf("routed to %s while a is down", r.Header.Get(HeaderBackend))
		}
	}
	var hz struct {
		Status   string          `json:"status"`
		Backends []health.Status `json:"backends"`
	}
	if code := getJSON(t, p.URL+"/admin/backends", &hz); code != 200 || hz.Backends[0].ProbeOK || !strings.Contains(hz.Backends[0].LastError, "503") {
		t.Errorf("healthz %d %+v", code, hz)
	}
	b.health.Store(500)
	waitFor(t, 5*time.Second, "b out of rotation", func() bool { return !p.health.InRotation("b") })
	if code := getJSON(t, p.URL+"/healthz", &hz); code != 503 || hz.Status != "no_healthy_backend" {
		t.Errorf("all down: healthz %d %+v", code, hz.Status)
	}
	a.health.Store(0)
	waitFor(t, 5*time.Second, "a back in rotation", func() bool { return p.health.InRotation("a") })
}

func TestAnthropicCacheControlInjection(t *testing.T) {
	body := `{"model":"m","max_tokens":5,"system":"You are terse.","messages":[{"role":"user","content":"hi"}]}`
	for _, inject := range []bool{false, true} {
		up := newFakeUpstream(t, "a")
		p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) {
			c.PrefixRouting.AnthropicCacheControlInjection = inject
		}))
		r, b := post(t, p.URL+"/v1/messages", body)
		if r.StatusCode != 200 {
			t.Fatalf("%d %s", r.StatusCode, b)
		}
		got := up.lastBody()
		if has := strings.Contains(got, `"cache_control":{"type":"ephemeral"}`); has != inject {
			t.Errorf("inject=%v: upstream body %s", inject, got)
		}
	}
}

// Streams are relayed as they come: the client reads the first event while the backend is still
// generating.
func TestStreamingIsFlushed(t *testing.T) {
	release := make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"first\"}}]}\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	t.Cleanup(up.Close)
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) { c.ResponseCache.Enabled = true }))
	req, _ := http.NewRequest(http.MethodPost, p.URL+"/v1/chat/completions", strings.NewReader(chatBody("s", "u", `"stream":true,"temperature":0`)))
	resp, err := httpClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	if err != nil || !strings.Contains(line, "first") {
		t.Fatalf("first line %q, %v", line, err)
	}
	close(release)
	rest, _ := io.ReadAll(br)
	if !strings.Contains(string(rest), "[DONE]") {
		t.Errorf("rest %q", rest)
	}
}

// A backend that dies mid-stream aborts the client's response; the decision is released.
func TestUpstreamAbortMidStream(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"partial\":true}\n\n")
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler)
	}))
	t.Cleanup(up.Close)
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) { c.CircuitBreaker.FailureThreshold = 1000 }))
	req, _ := http.NewRequest(http.MethodPost, p.URL+"/v1/chat/completions", strings.NewReader(chatBody("s", "u", `"stream":true`)))
	resp, err := httpClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err == nil {
		t.Errorf("truncated stream read without error: %q", b)
	}
	backend := func() kvroute.BackendStats {
		st, _ := p.router.Stats(context.Background())
		return st.Backends[0]
	}
	waitFor(t, 5*time.Second, "the slot released", func() bool { return backend().InFlight == 0 })
	if st := backend(); st.SuccessRate >= 1 {
		t.Errorf("the abort was not counted against the backend: %+v", st)
	}
}

// With a single backend in rotation there is nowhere to retry: its own 503 reaches the client.
func TestSingleBackendStatusPassesThrough(t *testing.T) {
	up := newFakeUpstream(t, "a")
	up.status.Store(503)
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, nil))
	r, b := post(t, p.URL+"/v1/chat/completions", chatBody("s", "u", ""))
	if r.StatusCode != 503 || !strings.Contains(string(b), "fake 503") || up.requests.Load() != 1 {
		t.Errorf("%d %s (%d upstream requests)", r.StatusCode, b, up.requests.Load())
	}
	// A refused connection with nowhere else to go is a 502 in the endpoint's style.
	p2 := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "dead", URL: deadURL(t)}}, nil))
	r, b = post(t, p2.URL+"/v1/messages", `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}`)
	if r.StatusCode != 502 || !strings.Contains(string(b), `"type":"api_error"`) {
		t.Errorf("dead single backend: %d %s", r.StatusCode, b)
	}
}
