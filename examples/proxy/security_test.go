package main

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/config"
)

// serveFrom runs one request through p's handler as if it came from remote (host:port).
func serveFrom(p *testProxy, remote, method, path, auth string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(method, path, strings.NewReader(`{"clear_all":true}`))
	req.RemoteAddr = remote
	req.Host = "127.0.0.1:8080"
	req.Header.Set("Content-Type", "application/json")
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	rec := httptest.NewRecorder()
	p.server.Handler().ServeHTTP(rec, req)
	return rec
}

// Without admin.auth_token, the admin endpoints (the destructive ones first) answer loopback
// clients only; /healthz and /metrics stay open unless admin.protect_metrics is set.
func TestAdminLoopbackOnlyWithoutToken(t *testing.T) {
	up := newFakeUpstream(t, "a")
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) {
		c.ResponseCache.Enabled = true
	}))
	for _, ep := range [][2]string{{"POST", "/admin/response-cache/invalidate"}, {"POST", "/admin/kv-index/clear"},
		{"GET", "/admin/backends"}, {"GET", "/admin/prefix-routing/stats"}} {
		for _, remote := range []string{"192.0.2.7:40000", "[2001:db8::1]:40000"} {
			if rec := serveFrom(p, remote, ep[0], ep[1], ""); rec.Code != http.StatusForbidden || !strings.Contains(rec.Body.String(), "loopback") {
				t.Errorf("%s %s from %s: %d %s", ep[0], ep[1], remote, rec.Code, rec.Body)
			}
		}
		for _, remote := range []string{"127.0.0.1:40000", "[::1]:40000", "[::ffff:127.0.0.1]:40000"} {
			if rec := serveFrom(p, remote, ep[0], ep[1], ""); rec.Code == http.StatusForbidden {
				t.Errorf("%s %s from %s: 403", ep[0], ep[1], remote)
			}
		}
	}
	for _, path := range []string{"/healthz", "/metrics"} {
		if rec := serveFrom(p, "192.0.2.7:40000", "GET", path, ""); rec.Code != http.StatusOK {
			t.Errorf("%s from a remote client: %d", path, rec.Code)
		}
	}

	q := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) {
		c.Admin.ProtectMetrics = true
	}))
	if rec := serveFrom(q, "192.0.2.7:40000", "GET", "/metrics", ""); rec.Code != http.StatusForbidden {
		t.Errorf("protected /metrics from a remote client: %d", rec.Code)
	}
	if rec := serveFrom(q, "127.0.0.1:40000", "GET", "/metrics", ""); rec.Code != http.StatusOK {
		t.Errorf("protected /metrics from loopback: %d", rec.Code)
	}
}

// With a token, any client that sends it is answered, whatever the case of the Bearer scheme.
func TestAdminTokenScheme(t *testing.T) {
	up := newFakeUpstream(t, "a")
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) {
		c.Admin.AuthToken = "s3cret"
		c.Admin.ProtectMetrics = true
	}))
	for _, tc := range []struct {
		auth string
		want int
	}{
		{"Bearer s3cret", 200}, {"bearer s3cret", 200}, {"BEARER  s3cret", 200},
		{"Bearer s3cre", 401}, {"Bearer s3cretX", 401}, {"Basic s3cret", 401}, {"s3cret", 401}, {"", 401},
	} {
		for _, path := range []string{"/admin/backends", "/metrics"} {
			if rec := serveFrom(p, "192.0.2.7:40000", "GET", path, tc.auth); rec.Code != tc.want {
				t.Errorf("%s with %q: %d, want %d", path, tc.auth, rec.Code, tc.want)
			}
		}
	}
}

// /healthz says whether the proxy can serve and nothing about the backends.
func TestHealthzIsBare(t *testing.T) {
	up := newFakeUpstream(t, "a")
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, nil))
	rec := serveFrom(p, "192.0.2.7:40000", "GET", "/healthz", "")
	var doc map[string]any
	if err := json.Unmarshal(rec.Body.Bytes(), &doc); err != nil || rec.Code != 200 || len(doc) != 1 || doc["status"] != "ok" {
		t.Errorf("%d %s", rec.Code, rec.Body)
	}
	if strings.Contains(rec.Body.String(), up.URL) {
		t.Error("/healthz shows a backend URL")
	}
}

// A client that sends its headers and then stalls its body gets 408 and a closed connection once
// server.read_timeout has passed.
func TestSlowBodyTimesOut(t *testing.T) {
	up := newFakeUpstream(t, "a")
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) {
		c.Server.ReadTimeout = config.Duration(300 * time.Millisecond)
	}))
	c, br := dialRaw(t, strings.TrimPrefix(p.URL, "http://"))
	_, _ = io.WriteString(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"+
		"Content-Length: 100\r\n\r\n{\"model\":")
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("no answer to a stalled body: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusRequestTimeout || !resp.Close {
		t.Errorf("got %d close=%v %s; want 408 and the connection closed", resp.StatusCode, resp.Close, b)
	}
	if up.requests.Load() != 0 {
		t.Error("the stalled request reached the backend")
	}
}

// The bodies in flight are bounded: a request that finds no room within a second gets 503 with
// Retry-After, and room comes back when the holder is done.
func TestInflightBodyBudget(t *testing.T) {
	up := newFakeUpstream(t, "a")
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) {
		c.Server.MaxBodyBytes = 4096
		c.Server.MaxInflightBodyBytes = 6000
	}))
	// A client that announces 4,000 bytes and sends 10 holds 4,000 of the 6,000.
	c, br := dialRaw(t, strings.TrimPrefix(p.URL, "http://"))
	_, _ = io.WriteString(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4000\r\n\r\n0123456789")
	waitFor(t, 2*time.Second, "the first body's bytes held", func() bool { return !p.server.bodies.TryAcquire(2001) || release(p, 2001) })
	body := chatBody("s", strings.Repeat("x", 2500), "")
	r, b := post(t, p.URL+"/v1/chat/completions", body)
	if r.StatusCode != http.StatusServiceUnavailable || r.Header.Get("Retry-After") != "1" {
		t.Fatalf("over the budget: %d %q %s", r.StatusCode, r.Header.Get("Retry-After"), b)
	}
	// The holder finishes its body (any bytes: a malformed request), and room comes back.
	_, _ = io.WriteString(c, strings.Repeat(" ", 3990))
	if resp, err := http.ReadResponse(br, nil); err != nil || resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("the holder: %v %v", resp, err)
	}
	if r, b := post(t, p.URL+"/v1/chat/completions", body); r.StatusCode != 200 {
		t.Errorf("after the holder: %d %s", r.StatusCode, b)
	}
}

// release gives back n bytes taken by a probe of the budget; it reports false so that waitFor
// keeps waiting.
func release(p *testProxy, n int64) bool {
	p.server.bodies.Release(n)
	return false
}

// Without a token, a loopback client is answered only when nothing says it is a web page: a
// browser on the proxy's host must not drive the admin endpoints (cross-site POST, DNS
// rebinding).
func TestAdminRefusesBrowserRequestsWithoutToken(t *testing.T) {
	up := newFakeUpstream(t, "a")
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) {
		c.ResponseCache.Enabled = true
	}))
	do := func(method, host, ctype string, hdr ...string) int {
		req := httptest.NewRequest(method, "/admin/response-cache/invalidate", strings.NewReader(`{"clear_all":true}`))
		if method == http.MethodGet {
			req = httptest.NewRequest(method, "/admin/backends", nil)
		}
		req.RemoteAddr, req.Host = "127.0.0.1:40000", host
		if ctype != "" {
			req.Header.Set("Content-Type", ctype)
		}
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		rec := httptest.NewRecorder()
		p.server.Handler().ServeHTTP(rec, req)
		return rec.Code
	}
	for _, tc := range []struct {
		name string
		code int
		got  int
	}{
		{"curl on loopback", 200, do("POST", "127.0.0.1:8080", "application/json")},
		{"localhost", 200, do("POST", "localhost:8080", "application/json; charset=utf-8")},
		{"IPv6 loopback", 200, do("GET", "[::1]:8080", "")},
		{"same-origin page", 200, do("POST", "127.0.0.1:8080", "application/json", "Origin", "http://127.0.0.1:8080", "Sec-Fetch-Site", "same-origin")},
		{"cross-site form post", 403, do("POST", "127.0.0.1:8080", "text/plain")},
		{"cross-site origin", 403, do("POST", "127.0.0.1:8080", "application/json", "Origin", "http://evil.example")},
		{"cross-site fetch metadata", 403, do("GET", "127.0.0.1:8080", "", "Sec-Fetch-Site", "cross-site")},
		{"DNS rebinding host", 403, do("GET", "evil.example:8080", "")},
	} {
		if tc.got != tc.code {
			t.Errorf("%s: %d, want %d", tc.name, tc.got, tc.code)
		}
	}
}

// A large body of many tiny JSON objects, or of text written with escapes (decoded into a
// copy), is charged what parsing it will hold, not only its bytes, against
// server.max_inflight_body_bytes; one of plain text little more than its bytes.
func TestBodyBudgetChargesParseCost(t *testing.T) {
	up := newFakeUpstream(t, "a")
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) {
		c.Server.MaxBodyBytes = 2 << 20
		c.Server.MaxInflightBodyBytes = 4 << 20
	}))
	tiny := `{"model":"m","messages":[` + strings.Repeat(`{"role":"user","content":"a"},`, 30000) + `{"role":"user","content":"b"}]}`
	prose := chatBody("s", strings.Repeat("plain words ", 80000), "")
	lines := chatBody("s", strings.Repeat("a line\n", 120000), "")
	for _, tc := range []struct {
		name     string
		body     string
		heldMore bool // holds more than its bytes and 3 %
	}{{"tiny objects", tiny, true}, {"prose", prose, false}, {"escaped lines", lines, true}} {
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(tc.body))
		req, err := p.server.llm.ReadRequest(httptest.NewRecorder(), r)
		if err != nil || len(req.Body) != len(tc.body) {
			t.Fatalf("%s: %v", tc.name, err)
		}
		free := int64(4<<20) - int64(len(tc.body)) - int64(len(tc.body))/32
		if got := !p.server.bodies.TryAcquire(free); got != tc.heldMore {
			t.Errorf("%s: holds more than its %d bytes: %v, want %v", tc.name, len(tc.body), got, tc.heldMore)
		} else if !got {
			p.server.bodies.Release(free)
		}
		req.Release()
		if !p.server.bodies.TryAcquire(4 << 20) {
			t.Fatalf("%s: the budget was not given back", tc.name)
		}
		p.server.bodies.Release(4 << 20)
	}
}
