package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/prefixkey"
)

// reloadConfig is the test's configuration file: backends, admin token, a tier-4 threshold and the
// response cache's TTL as given.
func reloadConfig(port int, token string, threshold float64, ttl string, backends ...*fakeUpstream) string {
	var b strings.Builder
	fmt.Fprintf(&b, `server: {port: %d}
admin: {auth_token: %q}
log_level: %s
health_checks: {enabled: false}
response_cache: {enabled: true, ttl: %s}
kv_cache_index: {enabled: true, scoring: {min_overlap_threshold: %v}}
backends:
`, port, token, map[bool]string{true: "debug", false: "info"}[token == "new-token"], ttl, threshold)
	for _, u := range backends {
		fmt.Fprintf(&b, "  - {name: %s, url: %q}\n", u.name, u.URL)
	}
	return b.String()
}

// SIGHUP reloads the configuration file: a new backend takes traffic and a removed one none, the
// old admin token is refused and the new one accepted, the threshold, the cache TTL and the log
// level change; a configuration that does not load is logged and the one in force kept; a change
// that needs a restart (the port) is logged as such. The proxy keeps serving throughout, and
// SIGTERM (ctx) still drains and stops it.
func TestReload(t *testing.T) {
	a, b, c := newFakeUpstream(t, "a"), newFakeUpstream(t, "b"), newFakeUpstream(t, "c")
	path := filepath.Join(t.TempDir(), "proxy.yaml")
	write := func(yaml string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(reloadConfig(0, "old-token", 0.3, "5m", a, b))
	var logs testenv.LogBuffer
	level := new(slog.LevelVar)
	l := &live{load: func() (*config.Config, error) { return config.Load(path) }, level: level,
		log: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))}
	cfg, err := l.load()
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + ln.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error, 1)
	go func() { runErr <- l.run(ctx, cfg, ln) }()
	defer func() {
		cancel()
		if err := <-runErr; err != nil {
			t.Errorf("run: %v", err)
		}
	}()
	waitFor(t, 10*time.Second, "the proxy to serve", func() bool {
		r, err := httpClient.Get(url + "/healthz")
		if err == nil {
			r.Body.Close()
		}
		return err == nil && r.StatusCode == 200
	})
	admin := func(token string) int {
		return getJSON(t, url+"/admin/backends", nil, "Authorization", "Bearer "+token)
	}
	send := func(n int, tag string) {
		t.Helper()
		for i := range n {
			r, body := post(t, url+"/v1/chat/completions", chatBody(fmt.Sprintf("system %s %d", tag, i), "hi", `"max_tokens":1`))
			if r.StatusCode != 200 {
				t.Fatalf("request %d: %d %s", i, r.StatusCode, body)
			}
		}
	}
	send(20, "before")
	if admin("old-token") != 200 || c.requests.Load() != 0 || level.Level() != slog.LevelInfo {
		t.Fatalf("before the reload: admin %d, c %d requests, level %v", admin("old-token"), c.requests.Load(), level.Level())
	}
	first := l.cur.Load()

	t.Run("SIGHUP applies backends, admin token, threshold, TTL, log level", func(t *testing.T) {
		write(reloadConfig(0, "new-token", 0.5, "1m", a, c))
		if runtime.GOOS == "windows" {
			if err := l.reload(); err != nil {
				t.Fatal(err)
			}
		} else {
			p, _ := os.FindProcess(os.Getpid())
			if err := p.Signal(syscall.SIGHUP); err != nil {
				t.Fatal(err)
			}
		}
		waitFor(t, 10*time.Second, "the reload", func() bool { return strings.Contains(logs.String(), "configuration reloaded") })
		if !strings.Contains(logs.String(), `applied="[admin.auth_token response_cache.ttl kv_cache_index.scoring.min_overlap_threshold backends log_level]"`) {
			t.Errorf("log:\n%s", logs.String())
		}
		if code := admin("old-token"); code != 401 {
			t.Errorf("old token: %d, want 401", code)
		}
		if code := admin("new-token"); code != 200 {
			t.Errorf("new token: %d, want 200", code)
		}
		bBefore := b.requests.Load()
		send(20, "after")
		if c.requests.Load() == 0 || b.requests.Load() != bBefore {
			t.Errorf("after the reload: c got %d requests (want some), b %d more (want none)", c.requests.Load(), b.requests.Load()-bBefore)
		}
		s := l.cur.Load()
		// The Router's threshold in force, as a probe reports it.
		pr, err := s.router.Probe(context.Background(), &prefixkey.Request{Model: "m"})
		if err != nil || pr.KV == nil {
			t.Fatalf("probe: %+v, %v", pr, err)
		}
		if s == first || pr.KV.MinOverlapThreshold != 0.5 || s.cache.TTL() != time.Minute || level.Level() != slog.LevelDebug {
			t.Errorf("threshold %v, TTL %v, level %v", pr.KV.MinOverlapThreshold, s.cache.TTL(), level.Level())
		}
		if s.cache != first.cache || s.index != first.index {
			t.Error("the reload rebuilt the response cache or the KV index")
		}
	})

	t.Run("unchanged file: logged as nothing changed", func(t *testing.T) {
		before := l.cur.Load()
		if err := l.reload(); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(logs.String(), `level=INFO msg="reloaded, nothing changed"`) {
			t.Errorf("log:\n%s", logs.String())
		}
		if l.cur.Load() != before {
			t.Error("a reload that changed nothing replaced the server")
		}
		send(2, "unchanged")
	})

	t.Run("invalid configuration: logged, the one in force kept", func(t *testing.T) {
		before := l.cur.Load()
		write("backends:\n  - {name: d, url: \"http://127.0.0.1:1\", role: decode}\n")
		err := l.reload()
		if err == nil || !strings.Contains(err.Error(), "disaggregated_serving.enabled") {
			t.Fatalf("reload: %v", err)
		}
		if !strings.Contains(logs.String(), "reload failed; the configuration in force is kept") || l.cur.Load() != before {
			t.Errorf("log:\n%s", logs.String())
		}
		if admin("new-token") != 200 {
			t.Error("the configuration in force was not kept")
		}
		send(2, "invalid")
	})

	// Issue 28: a token of spaces could never be sent (HTTP trims the header): it would lock every
	// operator out. It is invalid configuration, and the token in force stays.
	t.Run("whitespace-only admin token: refused, the token in force kept", func(t *testing.T) {
		before := l.cur.Load()
		write(reloadConfig(0, "   ", 0.5, "1m", a, c))
		err := l.reload()
		if err == nil || !strings.Contains(err.Error(), "admin.auth_token: is only whitespace") {
			t.Fatalf("reload: %v", err)
		}
		if l.cur.Load() != before || admin("new-token") != 200 {
			t.Error("the configuration in force was not kept")
		}
	})

	t.Run("restart-only change: logged as needing a restart", func(t *testing.T) {
		before := l.cur.Load()
		write(reloadConfig(18080, "new-token", 0.5, "1m", a, c))
		if err := l.reload(); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(logs.String(), `need a restart; their values in force are kept" settings=[server.port]`) {
			t.Errorf("log:\n%s", logs.String())
		}
		if l.cur.Load() != before || *before.cfg.Server.Port != 0 {
			t.Error("a restart-only change replaced the server")
		}
		send(2, "restart")
	})
}

// SIGHUP in the demo (no configuration file) is logged at INFO as ignored, not as a failed reload,
// and the proxy keeps serving.
func TestSIGHUPInDemoMode(t *testing.T) {
	up := newFakeUpstream(t, "a")
	var logs testenv.LogBuffer
	l := &live{log: slog.New(slog.NewTextHandler(&logs, nil)), level: new(slog.LevelVar)} // no load: the demo's
	cfg := fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, nil)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + ln.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error, 1)
	go func() { runErr <- l.run(ctx, cfg, ln) }()
	defer func() {
		cancel()
		if err := <-runErr; err != nil {
			t.Errorf("run: %v", err)
		}
	}()
	waitFor(t, 10*time.Second, "the proxy to serve", func() bool { return strings.Contains(logs.String(), "serving") })
	if runtime.GOOS == "windows" { // no SIGHUP to send: what the signal runs
		l.hangup()
	} else {
		p, _ := os.FindProcess(os.Getpid())
		if err := p.Signal(syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
	}
	const ignored = `level=INFO msg="SIGHUP ignored in demo mode: there is no configuration file to reload"`
	waitFor(t, 10*time.Second, "the SIGHUP logged", func() bool { return strings.Contains(logs.String(), ignored) })
	if strings.Contains(logs.String(), "level=ERROR") {
		t.Errorf("an error logged:\n%s", logs.String())
	}
	r, body := post(t, url+"/v1/chat/completions", chatBody("system", "hi", `"max_tokens":1`))
	if r.StatusCode != 200 {
		t.Fatalf("after SIGHUP: %d %s", r.StatusCode, body)
	}
}
