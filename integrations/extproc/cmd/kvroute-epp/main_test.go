package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestDemo runs kvroute-epp -demo as a newcomer would (on free ports): the stand-in for Envoy
// answers through the picker, a repeated conversation lands on the engine that cached it, the
// metrics show the picks, and cancelling the context (SIGTERM) drains and returns.
func TestDemo(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	gateway, metrics, done := startDemo(t, ctx, "0")
	body := `{"model":"meta-llama/Llama-3.1-8B-Instruct","max_tokens":4,"messages":[{"role":"system","content":"` +
		strings.Repeat("You are a careful assistant. ", 12) + `"},{"role":"user","content":"Hello!"}]}`
	var first, route string
	for i := 0; i < 40 && route != "kv_aware"; i++ {
		res, err := http.Post(gateway+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if res.StatusCode != 200 {
			t.Fatalf("status %d: %s", res.StatusCode, b)
		}
		if first == "" {
			first = res.Header.Get("X-Kvroute-Backend")
		}
		route = res.Header.Get("X-Kvroute-Route")
		if route == "kv_aware" && res.Header.Get("X-Kvroute-Backend") != first {
			t.Fatalf("kv_aware on %s, but %s served the conversation first", res.Header.Get("X-Kvroute-Backend"), first)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if route != "kv_aware" {
		t.Fatalf("the repeated conversation never routed kv_aware (last %q)", route)
	}
	res, err := http.Get(metrics)
	if err != nil {
		t.Fatal(err)
	}
	m, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if !strings.Contains(string(m), `kvroute_epp_requests_total`) || !strings.Contains(string(m), `result="picked"`) {
		t.Errorf("/metrics lacks the picker's counts:\n%.2000s", m)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v", err)
		}
	case <-time.After(40 * time.Second):
		t.Fatal("run did not return after its context ended")
	}
}

// TestFlags: kvroute-epp needs exactly one of -config and -demo.
func TestFlags(t *testing.T) {
	for _, args := range [][]string{{}, {"-demo", "-config", "x.yaml"}, {"-demo", "-log-format", "xml"}, {"-config", "x.yaml", "-engines", "4"}} {
		if err := run(context.Background(), args, io.Discard, io.Discard); err == nil {
			t.Errorf("%v: no error", args)
		}
	}
	if err := run(context.Background(), []string{"-config", "/nonexistent/epp.yaml"}, io.Discard, io.Discard); err == nil ||
		!strings.Contains(err.Error(), "epp.yaml") {
		t.Errorf("a missing file: %v", err)
	}
}

// startDemo runs kvroute-epp -demo on free ports with the engines at speed, and returns the
// gateway's and the metrics' URLs from the banner, and run's result to come.
func startDemo(t *testing.T, ctx context.Context, speed string) (gateway, metrics string, done chan error) {
	t.Helper()
	return startWith(t, ctx, "-demo", "-addr", "127.0.0.1:0", "-grpc-addr", "127.0.0.1:0", "-health-addr", "127.0.0.1:0",
		"-metrics-addr", "127.0.0.1:0", "-engine-speed", speed)
}

// startWith runs kvroute-epp with args and reads the gateway's and the metrics' URLs from its
// banner.
func startWith(t *testing.T, ctx context.Context, args ...string) (gateway, metrics string, done chan error) {
	t.Helper()
	out, w := io.Pipe()
	done = make(chan error, 1)
	go func() {
		done <- run(ctx, args, w, io.Discard)
		w.Close()
	}()
	gwRE := regexp.MustCompile(`Envoy \(ext_proc filter \+ ORIGINAL_DST\) on (http://\S+)`)
	mRE := regexp.MustCompile(`metrics on (http://\S+/metrics)`)
	sc := bufio.NewScanner(out)
	for sc.Scan() && (gateway == "" || metrics == "") {
		if m := gwRE.FindStringSubmatch(sc.Text()); m != nil {
			gateway = m[1]
		}
		if m := mRE.FindStringSubmatch(sc.Text()); m != nil {
			metrics = m[1]
		}
	}
	go func() { _, _ = io.Copy(io.Discard, out) }()
	if gateway == "" || metrics == "" {
		t.Fatalf("the banner named no gateway (%q) or metrics (%q)", gateway, metrics)
	}
	return gateway, metrics, done
}

// TestDemoDrains: a signal while an answer streams lets the answer end whole (the picker drains,
// the demo's engines and gateway stop after it), then run returns.
func TestDemoDrains(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	gateway, _, done := startDemo(t, ctx, "1")
	body := `{"model":"meta-llama/Llama-3.1-8B-Instruct","max_tokens":24,"stream":true,"messages":[{"role":"user","content":"Count slowly."}]}`
	res, err := http.Post(gateway+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	first := make([]byte, 1)
	if _, err := io.ReadFull(res.Body, first); err != nil {
		t.Fatal(err)
	}
	cancel() // SIGTERM
	rest, err := io.ReadAll(res.Body)
	if err != nil || !strings.Contains(string(rest), "[DONE]") {
		t.Fatalf("the stream in flight was cut by the signal (%v): %q", err, rest)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v", err)
		}
	case <-time.After(40 * time.Second):
		t.Fatal("run did not return after draining")
	}
}

// TestConfigWithGateway: with -config, -addr starts the stand-in for Envoy too, in front of the
// configured pool, to try it without an Envoy.
func TestConfigWithGateway(t *testing.T) {
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"choices":[{"message":{"content":"hi"}}]}`))
	}))
	defer engine.Close()
	path := filepath.Join(t.TempDir(), "epp.yaml")
	yaml := "health_checks: {enabled: false}\nbackends:\n  - {name: a, url: \"" + engine.URL + "\"}\n"
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	gateway, _, done := startWith(t, ctx, "-config", path, "-addr", "127.0.0.1:0", "-grpc-addr", "127.0.0.1:0",
		"-health-addr", "127.0.0.1:0", "-metrics-addr", "127.0.0.1:0")
	res, err := http.Post(gateway+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != 200 || res.Header.Get("X-Kvroute-Backend") != "a" {
		t.Fatalf("status %d, backend %q", res.StatusCode, res.Header.Get("X-Kvroute-Backend"))
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
