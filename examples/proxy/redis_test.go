package main

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// skipOrFail skips t, or fails it under KVROUTE_REQUIRE_INTEGRATION=1.
func skipOrFail(t *testing.T, why string) {
	t.Helper()
	if os.Getenv("KVROUTE_REQUIRE_INTEGRATION") == "1" {
		t.Fatalf("KVROUTE_REQUIRE_INTEGRATION=1: %s", why)
	}
	t.Skip(why)
}

// startRedis starts a private redis-server (no persistence) on a free loopback port and returns
// its address and a function that kills it (also run at cleanup).
func startRedis(t *testing.T) (addr string, kill func()) {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		skipOrFail(t, "redis-server not on PATH")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	cmd := exec.Command(bin, "--port", fmt.Sprint(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", t.TempDir())
	if err := cmd.Start(); err != nil {
		t.Fatalf("redis-server: %v", err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	kill = func() {
		_ = cmd.Process.Kill()
		<-done
	}
	t.Cleanup(kill)
	addr = fmt.Sprintf("127.0.0.1:%d", port)
	deadline := time.Now().Add(10 * time.Second)
	for {
		if c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond); err == nil {
			fmt.Fprint(c, "PING\r\n")
			_ = c.SetReadDeadline(time.Now().Add(time.Second))
			line, _ := bufio.NewReader(c).ReadString('\n')
			c.Close()
			if strings.HasPrefix(line, "+PONG") {
				return addr, kill
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("redis-server on %s did not answer", addr)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// With the response cache and the KV index in Redis, a Redis outage does not stop the proxy:
// the cache falls back to memory, the index to consistent hashing.
func TestE2ERedisDown(t *testing.T) {
	addr, kill := startRedis(t)
	f := startFleet(t, 2, true)
	cfg := fleetConfig(t, f, func(c *Config) {
		c.ResponseCache.Backend = "redis"
		c.ResponseCache.Redis.URL = Secret("redis://" + addr)
		c.ResponseCache.Redis.KeyPrefix = "kvroute-proxy-test:resp:"
		c.ResponseCache.Redis.CommandTimeoutMS = 500
		c.KVCacheIndex.Backend = "redis"
		c.KVCacheIndex.Redis.KeyPrefix = "kvroute-proxy-test:kvidx:"
	})
	p := startProxy(t, cfg)

	body := chatBody(longSystemPrompt("redis", 50), "cache me", `"temperature":0,"max_tokens":4`)
	r1, b1 := post(t, p.URL+"/v1/chat/completions", body)
	r2, b2 := post(t, p.URL+"/v1/chat/completions", body)
	if r1.StatusCode != 200 || r2.StatusCode != 200 || r2.Header.Get("X-Cache") != "HIT" || string(b1) != string(b2) {
		t.Fatalf("with Redis: %d %d X-Cache %q", r1.StatusCode, r2.StatusCode, r2.Header.Get("X-Cache"))
	}
	var cs map[string]any
	getJSON(t, p.URL+"/admin/response-cache/stats", &cs)
	if cs["backend_type"] != "redis" {
		t.Errorf("backend_type %v", cs["backend_type"])
	}

	kill()
	for i := range 6 {
		body := chatBody(longSystemPrompt("redis", 50), fmt.Sprintf("after the outage %d", i/2), `"temperature":0,"max_tokens":4`)
		r, b := post(t, p.URL+"/v1/chat/completions", body)
		if r.StatusCode != 200 {
			t.Fatalf("request %d with Redis down: %d %s", i, r.StatusCode, b)
		}
		t.Logf("request %d: X-Cache %s, %s via %s", i, r.Header.Get("X-Cache"), r.Header.Get(HeaderBackend), r.Header.Get(HeaderRoute))
	}
	getJSON(t, p.URL+"/admin/response-cache/stats", &cs)
	redis, _ := cs["redis"].(map[string]any)
	if redis == nil || redis["fallback_active"] != true {
		t.Errorf("fallback not active: %v", cs)
	}
	var ks kvStatsBody
	if code := getJSON(t, p.URL+"/admin/kv-index/stats", &ks); code != 200 {
		t.Errorf("kv stats with Redis down: %d", code)
	}
	if ks.IndexError == "" {
		t.Errorf("kv stats should report the index error: %+v", ks)
	}
}
