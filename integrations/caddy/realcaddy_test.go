package kvroutecaddy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvroute/kvroute/admin"
	"github.com/kvroute/kvroute/internal/enginesim"
	"github.com/kvroute/kvroute/internal/testenv"
)

// TestRealCaddy builds a Caddy binary with this module the way xcaddy does (the main package
// cmd/caddy-kvroute: Caddy's command, its standard modules and this one), checks that it lists
// the modules and adapts the README's Caddyfile to the golden JSON, then runs it with a Caddyfile
// in front of three simulated engines that publish their KV events over ZMQ, and checks, in
// order: requests sharing a system prompt land on one engine and hit its prefix cache; streaming
// goes through Caddy chunk by chunk; a reload through the admin API keeps the Routers' state; an
// engine that refuses (503) has its request retried elsewhere (lb_retry_match) and the refusal
// counted; an engine killed mid-run is routed around. The Caddyfile has two sites over the same
// engines: one with tier 4 (ZMQ events), one with tier 1 alone (kvroute <upstreams...>).
//
// It skips only when no go command is on PATH (and fails then under
// KVROUTE_REQUIRE_INTEGRATION=1). The build is Go's: cached after the first run.
func TestRealCaddy(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		testenv.SkipOrFail(t, "TestRealCaddy builds a Caddy binary and needs the go command on PATH")
	}
	bin := filepath.Join(t.TempDir(), "caddy-kvroute")
	began := time.Now()
	build := exec.Command(goBin, "build", "-o", bin, "./cmd/caddy-kvroute")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/caddy-kvroute: %v\n%s", err, out)
	}
	built := time.Now()
	t.Logf("built the Caddy binary in %v", built.Sub(began).Round(time.Millisecond))
	defer func() { t.Logf("ran against it for %v", time.Since(built).Round(time.Millisecond)) }()

	t.Run("list-modules", func(t *testing.T) {
		out, err := exec.Command(bin, "list-modules").CombinedOutput()
		if err != nil {
			t.Fatalf("caddy list-modules: %v\n%s", err, out)
		}
		for _, id := range []string{"http.handlers.kvroute", "http.reverse_proxy.selection_policies.kvroute", "admin.api.kvroute"} {
			if !bytes.Contains(out, []byte(id+"\n")) {
				t.Errorf("caddy list-modules does not list %s", id)
			}
		}
	})
	t.Run("adapt", func(t *testing.T) {
		out, err := exec.Command(bin, "adapt", "--config", "testdata/README.Caddyfile", "--pretty").Output()
		if err != nil {
			t.Fatalf("caddy adapt: %v", err)
		}
		want, err := os.ReadFile("testdata/README.json")
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(bytes.TrimSpace(out), bytes.TrimSpace(want)) {
			t.Fatalf("caddy adapt of testdata/README.Caddyfile differs from testdata/README.json:\n%s", out)
		}
	})

	ctx := t.Context()
	fleet, err := enginesim.StartFleet(ctx, enginesim.FleetConfig{N: 3, ZMQ: true,
		Base: enginesim.Config{Latency: enginesim.Latency{Base: 2 * time.Millisecond, PerToken: 20 * time.Microsecond,
			PerOutputToken: 10 * time.Millisecond, SpeedFactor: 1}}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = fleet.Close() }()
	c := startCaddy(t, bin, fleet)
	engines := map[string]*enginesim.Engine{} // by name
	for _, e := range fleet.Engines() {
		engines[e.Name()] = e
	}

	system := "You are the support assistant of a company that sells bicycles. " + strings.Repeat("Answer politely, cite the manual, and keep every answer short. ", 30)
	var holder string // the engine that holds system's prefix
	t.Run("shared system prompt lands on one engine with cached tokens", func(t *testing.T) {
		for i := range 6 {
			res := c.chat(t, system, fmt.Sprintf("Question %d: how do I fix a flat tyre?", i))
			if i == 0 {
				holder = res.engine
			} else if res.engine != holder {
				t.Fatalf("request %d went to %s, the first to %s (route %s)", i, res.engine, holder, res.route)
			}
			if i > 0 && res.cached == 0 {
				t.Errorf("request %d on %s: usage.prompt_tokens_details.cached_tokens = 0, want a prefix-cache hit (route %s)", i, res.engine, res.route)
			}
			t.Logf("request %d: %s, route %s, %d cached tokens", i, res.engine, res.route, res.cached)
		}
	})
	if holder == "" {
		t.FailNow()
	}

	t.Run("streaming goes through chunk by chunk", func(t *testing.T) {
		c.stream(t, system)
	})

	t.Run("reload keeps the router's state", func(t *testing.T) {
		before, before1 := c.stats(t, true), c.stats(t, false)
		cfg := c.admin(t, http.MethodGet, "/config/", nil, nil)
		// The same configuration, as JSON; must-revalidate makes Caddy load it although it did not
		// change, re-provisioning every module.
		c.admin(t, http.MethodPost, "/load", cfg, http.Header{"Content-Type": {"application/json"}, "Cache-Control": {"must-revalidate"}})
		// Caddy writes its log through a pipe: the reload's lines may come a moment after /load
		// has answered.
		if !c.waitLogged("kvroute router reused", 10*time.Second) {
			t.Fatalf("the reload did not re-provision the handler onto the pooled Router; Caddy's log:\n%s", c.log())
		}
		after, after1 := c.stats(t, true), c.stats(t, false)
		for _, p := range [][2]RouterStats{{before, after}, {before1, after1}} {
			if p[1].ID != p[0].ID || p[1].PrefixRouting.RoutingDecisions.Total != p[0].PrefixRouting.RoutingDecisions.Total {
				t.Fatalf("after the reload: router %s with %d decisions; before: %s with %d",
					p[1].ID, p[1].PrefixRouting.RoutingDecisions.Total, p[0].ID, p[0].PrefixRouting.RoutingDecisions.Total)
			}
		}
		res := c.chat(t, system, "After the reload: which tyre pressure?")
		if res.engine != holder || res.cached == 0 {
			t.Fatalf("after the reload the shared prompt went to %s with %d cached tokens (route %s); want %s, cached", res.engine, res.cached, res.route, holder)
		}
		if got, want := c.stats(t, true).PrefixRouting.RoutingDecisions.Total, before.PrefixRouting.RoutingDecisions.Total+1; got != want {
			t.Fatalf("decisions after one more request: %d, want %d (the counters went on)", got, want)
		}
	})

	t.Run("refusing engine is retried elsewhere and counted as a refusal", func(t *testing.T) {
		addr := c.addrOf[holder]
		before := c.backend(t, true, addr)
		engines[holder].SetDown(true) // every endpoint answers 503, as a full engine does
		res := c.chat(t, system, "While the holder is full: which saddle?")
		engines[holder].SetDown(false)
		if res.engine == holder || res.retriedFrom != addr {
			t.Fatalf("answered by %s, retried from %q; want lb_retry_match to move it off %s (%s)", res.engine, res.retriedFrom, holder, addr)
		}
		after := c.backend(t, true, addr)
		if after.Refusals != before.Refusals+1 || after.SuccessRate != before.SuccessRate {
			t.Fatalf("%s: refusals %d → %d, success rate %v → %v; want one refusal more and no failure",
				addr, before.Refusals, after.Refusals, before.SuccessRate, after.SuccessRate)
		}
		// The refusal holds its slot there for kvroute's RefusalHold (1 s), then lets it go.
		deadline := time.Now().Add(5 * time.Second)
		for c.backend(t, true, addr).InFlightRequests != 0 {
			if time.Now().After(deadline) {
				t.Fatalf("%s keeps the refused request's slot", addr)
			}
			time.Sleep(100 * time.Millisecond)
		}
	})

	t.Run("killed engine is routed around", func(t *testing.T) {
		// The tier-1 site sends a prompt to its prefix key's owner on the ring, and keeps doing so
		// after the owner dies, until a failed attempt tells: the retry must go elsewhere and the
		// Router must hold the owner down. The tier-4 site's index forgets the dead engine as soon
		// as its event stream breaks.
		fourth := "You write release notes for a routing library. " + strings.Repeat("Lead with what changed for users, then why. ", 30)
		other := "You translate product manuals from German into English. " + strings.Repeat("Keep the units metric and the tone neutral. ", 30)
		warm := c.chatAt(t, c.base1, fourth, "Warm-up")
		victim := warm.engine
		if warm.route != "prefix_hash" {
			t.Fatalf("the tier-1 site routed by %s, want prefix_hash", warm.route)
		}
		retried := false
		for i := range 9 {
			if i == 2 {
				engines[victim].Kill()
				t.Logf("killed %s, the owner of the tier-1 prompt", victim)
			}
			var res chatResult
			switch i % 3 { // every request must succeed: chatAt fails the test otherwise
			case 2:
				res = c.chatAt(t, c.base1, fourth, fmt.Sprintf("Mid-run question %d", i))
			case 0:
				res = c.chat(t, system, fmt.Sprintf("Mid-run question %d", i))
			case 1:
				res = c.chat(t, other, fmt.Sprintf("Mid-run question %d", i))
			}
			t.Logf("request %d: %s, route %s, retried from %q", i, res.engine, res.route, res.retriedFrom)
			if i >= 2 && res.engine == victim {
				t.Fatalf("request %d answered by %s, which was killed", i, victim)
			}
			retried = retried || res.retriedFrom == c.addrOf[victim]
		}
		if !retried {
			t.Errorf("no request was retried off %s: the tier-1 Router never sent its prompt to the dead owner", victim)
		}
		// Caddy's passive health check holds the dead engine down, and both Routers followed it;
		// every decision, the retried ones included, has ended (no slot is left in flight).
		for _, tier4 := range []bool{false, true} {
			for _, b := range c.stats(t, tier4).PrefixRouting.BackendDistribution {
				if b.Backend == c.addrOf[victim] && b.Healthy {
					t.Errorf("backend %s (the killed %s) is still healthy in the Router's stats (tier 4 %v)", b.Backend, victim, tier4)
				}
				if b.InFlightRequests != 0 {
					t.Errorf("backend %s: %d requests in flight after the last answer, want 0 (tier 4 %v)", b.Backend, b.InFlightRequests, tier4)
				}
			}
		}
	})
}

// caddyProc is a running Caddy with its addresses and log.
type caddyProc struct {
	base     string // the tier-4 site: kvroute with ZMQ events
	base1    string // the tier-1 site: kvroute with the upstreams alone
	adminURL string
	addrOf   map[string]string // engine name → its upstream address
	mu       sync.Mutex
	logBuf   bytes.Buffer
}

func (c *caddyProc) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.logBuf.Write(p)
}

func (c *caddyProc) log() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.logBuf.String()
}

func (c *caddyProc) logged(s string) bool { return strings.Contains(c.log(), s) }

// waitLogged reports whether Caddy's log holds s within d.
func (c *caddyProc) waitLogged(s string, d time.Duration) bool {
	for deadline := time.Now().Add(d); ; time.Sleep(20 * time.Millisecond) {
		if c.logged(s) {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
	}
}

// startCaddy writes the test's Caddyfile and runs bin with it until the test ends.
func startCaddy(t *testing.T, bin string, fleet *enginesim.Fleet) *caddyProc {
	t.Helper()
	adminPort, httpPort, httpPort1 := testenv.FreePort(t), testenv.FreePort(t), testenv.FreePort(t)
	c := &caddyProc{base: fmt.Sprintf("http://127.0.0.1:%d", httpPort), base1: fmt.Sprintf("http://127.0.0.1:%d", httpPort1),
		adminURL: fmt.Sprintf("http://127.0.0.1:%d", adminPort), addrOf: map[string]string{}}
	var backends, upstreams strings.Builder
	for _, in := range fleet.Info() {
		addr := strings.TrimPrefix(in.URL, "http://")
		c.addrOf[in.Name] = addr
		fmt.Fprintf(&backends, "\t\tbackend %s {\n\t\t\tzmq %s %s\n\t\t}\n", addr, in.ZMQEndpoint, in.ReplayEndpoint)
		fmt.Fprintf(&upstreams, " %s", addr)
	}
	proxy := `	reverse_proxy` + upstreams.String() + ` {
		lb_policy kvroute
		lb_retries 2
		lb_retry_match {
			method POST
		}
		lb_retry_match {
			expression {rp.status_code} in [429, 503]
		}
		fail_duration 30s
	}`
	caddyfile := fmt.Sprintf(`{
	admin 127.0.0.1:%d
	auto_https off
	persist_config off
}

http://127.0.0.1:%d {
	bind 127.0.0.1
	kvroute {
%s	}
%s
}

http://127.0.0.1:%d {
	bind 127.0.0.1
	kvroute%s
%s
}
`, adminPort, httpPort, backends.String(), proxy, httpPort1, upstreams.String(), proxy)
	dir := t.TempDir()
	path := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(path, []byte(caddyfile), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "run", "--config", path, "--adapter", "caddyfile")
	cmd.Env = append(os.Environ(), "HOME="+dir, "XDG_DATA_HOME="+dir, "XDG_CONFIG_HOME="+dir)
	cmd.Stdout, cmd.Stderr = c, c
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		stopped := false
		if res, err := http.Post(c.adminURL+"/stop", "", nil); err == nil {
			_ = res.Body.Close()
			select {
			case <-exited:
				stopped = true
			case <-time.After(10 * time.Second):
			}
		}
		if !stopped {
			_ = cmd.Process.Kill()
			<-exited
		}
		if t.Failed() || os.Getenv("KVROUTE_CADDY_LOG") != "" {
			t.Logf("Caddyfile:\n%s\nCaddy's log:\n%s", caddyfile, c.log())
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		res, err := http.Get(c.base + "/v1/models")
		if err == nil {
			_ = res.Body.Close()
			if res.StatusCode == http.StatusOK {
				return c
			}
		}
		select {
		case err := <-exited:
			t.Fatalf("caddy exited: %v\n%s", err, c.log())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("caddy did not serve within 30s (last error %v):\n%s", err, c.log())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// admin calls Caddy's admin API and returns the answer's body.
func (c *caddyProc) admin(t *testing.T, method, path string, body []byte, h http.Header) []byte {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, c.adminURL+path, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range h {
		req.Header[k] = v
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = res.Body.Close() }()
	b, _ := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusOK {
		t.Fatalf("%s %s: %d %s", method, path, res.StatusCode, b)
	}
	return b
}

// stats returns the tier-4 Router's stats (tier4 true) or the tier-1 Router's, from GET
// /kvroute/stats.
func (c *caddyProc) stats(t *testing.T, tier4 bool) RouterStats {
	t.Helper()
	var body StatsBody
	if err := json.Unmarshal(c.admin(t, http.MethodGet, "/kvroute/stats", nil, nil), &body); err != nil {
		t.Fatal(err)
	}
	if len(body.Routers) != 2 {
		t.Fatalf("GET /kvroute/stats lists %d routers, want 2 (one per site)", len(body.Routers))
	}
	for _, r := range body.Routers {
		if (r.KVIndex != nil) == tier4 {
			return r
		}
	}
	t.Fatalf("GET /kvroute/stats has no router with tier 4 %v", tier4)
	return RouterStats{}
}

// backend returns one backend's line of the Router's stats.
func (c *caddyProc) backend(t *testing.T, tier4 bool, addr string) admin.BackendLoad {
	t.Helper()
	for _, b := range c.stats(t, tier4).PrefixRouting.BackendDistribution {
		if b.Backend == addr {
			return b
		}
	}
	t.Fatalf("no backend %s in the Router's stats", addr)
	return admin.BackendLoad{}
}

// chatResult is what one chat completion through Caddy showed.
type chatResult struct {
	engine, backend, route, retriedFrom string
	cached                              int
}

// chat sends one chat completion through Caddy's tier-4 site and checks it succeeded.
func (c *caddyProc) chat(t *testing.T, system, user string) chatResult {
	t.Helper()
	return c.chatAt(t, c.base, system, user)
}

// chatAt sends one chat completion to the site at base and checks it succeeded.
func (c *caddyProc) chatAt(t *testing.T, base, system, user string) chatResult {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": enginesim.DefaultModel, "max_tokens": 2,
		"messages": []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": user}}})
	res, err := http.Post(base+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = res.Body.Close() }()
	b, _ := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusOK {
		t.Fatalf("POST /v1/chat/completions: %d %s", res.StatusCode, b)
	}
	var out struct {
		Usage struct {
			PromptTokensDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatalf("answer %s: %v", b, err)
	}
	r := chatResult{engine: res.Header.Get(enginesim.HeaderEngine), backend: res.Header.Get(HeaderBackend),
		route: res.Header.Get(HeaderRoute), retriedFrom: res.Header.Get(HeaderRetriedFrom),
		cached: out.Usage.PromptTokensDetails.CachedTokens}
	if r.backend != c.addrOf[r.engine] {
		t.Fatalf("%s = %q but engine %s (%s) answered", HeaderBackend, r.backend, r.engine, c.addrOf[r.engine])
	}
	return r
}

// stream sends a streaming chat completion through Caddy and checks that its SSE events arrive
// one by one, the first well before the last.
func (c *caddyProc) stream(t *testing.T, system string) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": enginesim.DefaultModel, "max_tokens": 12, "stream": true,
		"messages": []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": "Stream me a tip."}}})
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, c.base+"/v1/chat/completions", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = res.Body.Close() }()
	if res.StatusCode != http.StatusOK || !strings.HasPrefix(res.Header.Get("Content-Type"), "text/event-stream") {
		b, _ := io.ReadAll(res.Body)
		t.Fatalf("streaming answer %d %q: %s", res.StatusCode, res.Header.Get("Content-Type"), b)
	}
	if res.Header.Get(HeaderBackend) == "" {
		t.Errorf("no %s on the stream", HeaderBackend)
	}
	var first, done time.Time
	events := 0
	sc := bufio.NewScanner(res.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "data: ") {
			continue
		}
		events++
		if first.IsZero() {
			first = time.Now()
		}
		if line == "data: [DONE]" {
			done = time.Now()
			break
		}
		var chunk struct {
			Object string `json:"object"`
		}
		if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &chunk); err != nil || chunk.Object != "chat.completion.chunk" {
			t.Fatalf("event %q: want a chat.completion.chunk (%v)", line, err)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	// 12 tokens at 10 ms each: the first event must not wait for the last (Caddy flushes SSE).
	if done.IsZero() || events < 12 || done.Sub(first) < 50*time.Millisecond {
		t.Fatalf("%d events, [DONE] %v after the first; want ≥ 12 events spread over the decode", events, done.Sub(first))
	}
}
