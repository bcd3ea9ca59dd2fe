package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/testenv"
)

// The real entry point with no configuration: the demo fleet starts, the banner shows where to
// go, a chat completion twice is a MISS then a HIT, the profiles are served on the -pprof address
// only, and SIGTERM stops everything.
func TestMainDemoMode(t *testing.T) {
	if !canSendSIGTERM {
		t.Skip("the test stops the proxy with SIGTERM, which this system cannot send to itself")
	}
	pr, pw := io.Pipe()
	var stderr testenv.LogBuffer
	errc := make(chan error, 1)
	go func() {
		errc <- mainErr([]string{"-addr", "127.0.0.1:0", "-engines", "2", "-engine-speed", "0", "-pprof", "127.0.0.1:0"}, pw, &stderr)
		pw.Close()
	}()
	var banner strings.Builder
	base := ""
	sc := bufio.NewScanner(pr)
	for sc.Scan() {
		banner.WriteString(sc.Text() + "\n")
		if strings.Contains(sc.Text(), "Stop with Ctrl-C") {
			break
		}
		if m := regexp.MustCompile(`listening on (http://\S+)`).FindStringSubmatch(sc.Text()); m != nil {
			base = m[1]
		}
	}
	go func() { _, _ = io.Copy(io.Discard, pr) }()
	if base == "" {
		t.Fatalf("no address in the banner:\n%s\nstderr:\n%s", banner.String(), stderr.String())
	}
	for _, want := range []string{"curl -s -D - " + base + "/v1/chat/completions", `"model":"meta-llama/Llama-3.1-8B-Instruct"`,
		base + "/admin/prefix-routing/stats", base + "/admin/kv-index/backends", base + "/metrics"} {
		if !strings.Contains(banner.String(), want) {
			t.Errorf("banner lacks %q:\n%s", want, banner.String())
		}
	}

	body := `{"model":"meta-llama/Llama-3.1-8B-Instruct","temperature":0,"max_tokens":16,"messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Hello!"}]}`
	r1, b1 := post(t, base+"/v1/chat/completions", body)
	r2, b2 := post(t, base+"/v1/chat/completions", body)
	if r1.StatusCode != 200 || r1.Header.Get("X-Cache") != "MISS" || r2.Header.Get("X-Cache") != "HIT" || !bytes.Equal(b1, b2) {
		t.Errorf("demo: %d %q then %q", r1.StatusCode, r1.Header.Get("X-Cache"), r2.Header.Get("X-Cache"))
	}
	for _, path := range []string{"/admin/prefix-routing/stats", "/admin/response-cache/stats", "/admin/kv-index/stats", "/admin/kv-index/backends", "/healthz"} {
		if code := getJSON(t, base+path, nil); code != 200 {
			t.Errorf("%s: %d", path, code)
		}
	}

	m := regexp.MustCompile(`msg=pprof addr=(\S+)`).FindStringSubmatch(stderr.String())
	if m == nil {
		t.Fatalf("no pprof address in the logs:\n%s", stderr.String())
	}
	if code := getStatus(t, "http://"+m[1]+"/debug/pprof/cmdline"); code != 200 {
		t.Errorf("pprof address: /debug/pprof/cmdline %d, want 200", code)
	}
	if code := getStatus(t, base+"/debug/pprof/cmdline"); code != 404 {
		t.Errorf("serving address: /debug/pprof/cmdline %d, want 404", code)
	}

	if err := sendSIGTERM(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		if err != nil {
			t.Fatalf("mainErr: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("SIGTERM did not stop the proxy")
	}
	if _, err := net.DialTimeout("tcp", m[1], time.Second); err == nil {
		t.Error("pprof still listening after SIGTERM")
	}
	if !strings.Contains(stderr.String(), "shutting down") || !strings.Contains(stderr.String(), "msg=stopped") {
		t.Errorf("logs:\n%s", stderr.String())
	}
	if _, err := net.DialTimeout("tcp", strings.TrimPrefix(base, "http://"), time.Second); err == nil {
		t.Error("still listening after SIGTERM")
	}
}

// getStatus GETs url and returns the status code.
func getStatus(t *testing.T, url string) int {
	t.Helper()
	res, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	_, _ = io.Copy(io.Discard, res.Body)
	res.Body.Close()
	return res.StatusCode
}

// run drains the requests in flight when its context ends.
func TestRunDrainsInFlightRequests(t *testing.T) {
	started := make(chan struct{}, 1)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			return
		}
		started <- struct{}{}
		time.Sleep(300 * time.Millisecond)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"ok":true}`)
	}))
	t.Cleanup(up.Close)
	cfg := fakeConfig(t, []config.BackendConfig{{Name: "slow", URL: up.URL}}, func(c *config.Config) {
		c.Server.ShutdownTimeout = config.Duration(10 * time.Second)
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + ln.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	runErr := make(chan error, 1)
	go func() { runErr <- run(ctx, cfg, ln, testLogger(t)) }()

	type result struct {
		code int
		body string
		err  error
	}
	res := make(chan result, 1)
	go func() {
		resp, err := httpClient.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(chatBody("s", "slow", "")))
		if err != nil {
			res <- result{err: err}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		res <- result{code: resp.StatusCode, body: string(b)}
	}()
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("request did not reach the backend")
	}
	cancel() // SIGTERM
	r := <-res
	if r.err != nil || r.code != 200 || r.body != `{"ok":true}` {
		t.Errorf("in-flight request: %+v", r)
	}
	select {
	case err := <-runErr:
		if err != nil {
			t.Errorf("run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("run did not return")
	}
}

func TestListenAddressInUse(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	_, err = listen(context.Background(), ln.Addr().String())
	if err == nil || !strings.Contains(err.Error(), "already in use") || !strings.Contains(err.Error(), "-addr") {
		t.Errorf("err = %v", err)
	}
	var stderr bytes.Buffer
	err = mainErr([]string{"-addr", ln.Addr().String()}, io.Discard, &stderr)
	if err == nil || !strings.Contains(err.Error(), "already in use") {
		t.Errorf("mainErr: %v", err)
	}
}

func TestMainBadConfig(t *testing.T) {
	path := filepath.Join(t.TempDir(), "bad.yaml")
	bad := "backends:\n  - {name: d, url: \"http://127.0.0.1:1\", role: decode}\n"
	if err := os.WriteFile(path, []byte(bad), 0o600); err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	err := mainErr([]string{"-config", path}, io.Discard, &stderr)
	if err == nil || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "disaggregated_serving.enabled") {
		t.Errorf("err = %v", err)
	}
	if err := mainErr([]string{"-config", "testdata/does-not-exist.yaml"}, io.Discard, &stderr); err == nil {
		t.Error("missing file accepted")
	}
}

// A server that is closed without being started (or whose start failed) closes at once.
func TestCloseWithoutStart(t *testing.T) {
	up := newFakeUpstream(t, "a")
	cfg := fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) { c.HealthChecks.Enabled = ptr(true) })
	srv, err := newServer(cfg, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close without start hangs")
	}

	// A bind that fails makes run return the error, and release everything.
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	cfg = fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) {
		c.HealthChecks.Enabled = ptr(true)
		c.KVCacheIndex.Enabled = true
		c.KVCacheIndex.EventSources = []config.EventSourceConfig{{Endpoint: "tcp://" + busy.Addr().String(), Bind: true}}
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { done <- run(context.Background(), cfg, ln, testLogger(t)) }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "kv events") {
			t.Errorf("run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("run with a failing bind hangs")
	}
}

// Every configuration shipped in configs/ loads, with the environment its comments ask for, and
// config's test copies of them are the same files.
func TestShippedConfigs(t *testing.T) {
	files, err := filepath.Glob("configs/*.yaml")
	if err != nil || len(files) < 5 {
		t.Fatalf("configs: %v %v", files, err)
	}
	vars := map[string]string{"ADMIN_TOKEN": "t0ken", "S3_ENDPOINT": "http://127.0.0.1:7070", "S3_BUCKET": "b",
		"S3_ACCESS_KEY": "AKIAEXAMPLE", "S3_SECRET_KEY": "secret", "REDIS_URL": "redis://127.0.0.1:6379", "REPLICA_ID": "router-a"}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := config.Parse(data, func(k string) (string, bool) { v, ok := vars[k]; return v, ok }); err != nil {
				t.Fatal(err)
			}
			if copy, err := os.ReadFile(filepath.Join("..", "..", "config", "testdata", filepath.Base(f))); err == nil && !bytes.Equal(copy, data) {
				t.Errorf("config/testdata/%s differs from the shipped file", filepath.Base(f))
			}
		})
	}
}
