package main

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvroute/kvroute/config"
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
	rs := newRedisServer(t)
	return rs.addr, rs.kill
}

// redisServer is a private redis-server (no persistence) on a loopback port of its own, which it
// keeps across restarts.
type redisServer struct {
	t    *testing.T
	bin  string
	port int
	addr string
	mu   sync.Mutex
	stop func() // kills the running process; nil when none runs
}

// newRedisServer starts a redisServer, killed at the end of the test.
func newRedisServer(t *testing.T) *redisServer {
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
	rs := &redisServer{t: t, bin: bin, port: port, addr: fmt.Sprintf("127.0.0.1:%d", port)}
	t.Cleanup(rs.kill)
	rs.start()
	return rs
}

// start runs redis-server, empty, and waits until it answers PING.
func (rs *redisServer) start() {
	rs.t.Helper()
	cmd := exec.Command(rs.bin, "--port", fmt.Sprint(rs.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", rs.t.TempDir())
	if err := cmd.Start(); err != nil {
		rs.t.Fatalf("redis-server: %v", err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	rs.mu.Lock()
	rs.stop = func() {
		_ = cmd.Process.Kill()
		<-done
	}
	rs.mu.Unlock()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if c, err := net.DialTimeout("tcp", rs.addr, 200*time.Millisecond); err == nil {
			fmt.Fprint(c, "PING\r\n")
			_ = c.SetReadDeadline(time.Now().Add(time.Second))
			line, _ := bufio.NewReader(c).ReadString('\n')
			c.Close()
			if strings.HasPrefix(line, "+PONG") {
				return
			}
		}
		if time.Now().After(deadline) {
			rs.t.Fatalf("redis-server on %s did not answer", rs.addr)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// kill stops the running redis-server, if any; what it held is lost.
func (rs *redisServer) kill() {
	rs.mu.Lock()
	stop := rs.stop
	rs.stop = nil
	rs.mu.Unlock()
	if stop != nil {
		stop()
	}
}

// With the response cache and the KV index in Redis, a Redis outage does not stop the proxy:
// the cache falls back to memory, the index to consistent hashing.
func TestE2ERedisDown(t *testing.T) {
	addr, kill := startRedis(t)
	f := startFleet(t, 2, true)
	cfg := fleetConfig(t, f, func(c *config.Config) {
		c.ResponseCache.Backend = "redis"
		c.ResponseCache.Redis.URL = config.Secret("redis://" + addr)
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

// A Redis-backed KV index outlives a Redis restart that lost its data, whether the engines
// published during the outage (those batches cannot be written, so their consumer marks the
// backend to be cleared) or Redis came back between two batches (the next write finds the
// backend's id gone, kvindex.ErrBackendLost). Either way the engine's next batch clears the
// backend and first replays what the engine's replay buffer still holds, so the index knows again
// which engine holds a prefix without waiting for those blocks to be stored again.
func TestE2ERedisIndexHealsAfterRestart(t *testing.T) {
	for _, tt := range []struct {
		name         string
		batchesWhile bool // the holder publishes while Redis is down
	}{{"batches dropped while down", true}, {"restart between two batches", false}} {
		t.Run(tt.name, func(t *testing.T) {
			rs := newRedisServer(t)
			f := startFleet(t, 3, true)
			cfg := fleetConfig(t, f, func(c *config.Config) {
				c.KVCacheIndex.Backend = "redis"
				c.KVCacheIndex.Redis.URL = config.Secret("redis://" + rs.addr)
				c.KVCacheIndex.Redis.KeyPrefix = "kvroute-proxy-test:heal:"
			})
			p := startProxy(t, cfg)
			sys := longSystemPrompt("heal", 100)
			body := chatBody(sys, "A question.", `"temperature":0.5,"max_tokens":2`)
			holder := warmNonOwner(t, p, f, body, chatBody(sys, "Warm-up.", `"max_tokens":1`))
			holderURL := ""
			for _, in := range f.Info() {
				if in.Name == holder {
					holderURL = in.URL
				}
			}
			// live has the holder store new blocks, so that it publishes a batch.
			n := 0
			live := func() {
				t.Helper()
				n++
				if r, b := post(t, holderURL+"/v1/chat/completions", chatBody(longSystemPrompt(fmt.Sprint("live ", n), 40), "Hi.", `"max_tokens":1`)); r.StatusCode != 200 {
					t.Fatalf("live request %d: %d %s", n, r.StatusCode, b)
				}
			}

			catchUps := catchUpsOf(t, p, holder)
			rs.kill()
			if tt.batchesWhile {
				waitFor(t, 10*time.Second, "a batch dropped for the outage", func() bool {
					live()
					return kvBackend(t, p, holder).Events.Dropped > 0
				})
				live()
			}
			rs.start() // empty: everything the index held is gone
			// The holder's next batches clear its backend and replay its buffer (the catch-up is
			// counted once its batches are applied).
			waitFor(t, 10*time.Second, "a catch-up after the restart", func() bool {
				live()
				return catchUpsOf(t, p, holder) > catchUps
			})
			r, b := post(t, p.URL+"/v1/chat/completions", body)
			if r.StatusCode != 200 {
				t.Fatalf("%d %s", r.StatusCode, b)
			}
			if got, route := r.Header.Get(HeaderBackend), r.Header.Get(HeaderRoute); got != holder || route != "kv_aware" {
				var st kvStatsBody
				getJSON(t, p.URL+"/admin/kv-index/stats", &st)
				t.Errorf("after the restart: routed to %s (%s), want %s (kv_aware): the index did not relearn the warm-up; holder %+v; index error %q",
					got, route, holder, kvBackend(t, p, holder), st.IndexError)
			}
		})
	}
}

// Two proxies share one Redis index, as router replicas do: what one learns the other routes by,
// and after a Redis restart that lost the index both heal (each clears the backend and catches
// up from the engine; the last catch-up leaves the index whole).
func TestE2ERedisIndexSharedByReplicas(t *testing.T) {
	rs := newRedisServer(t)
	f := startFleet(t, 3, true)
	replica := func() *testProxy {
		return startProxy(t, fleetConfig(t, f, func(c *config.Config) {
			c.KVCacheIndex.Backend = "redis"
			c.KVCacheIndex.Redis.URL = config.Secret("redis://" + rs.addr)
			c.KVCacheIndex.Redis.KeyPrefix = "kvroute-proxy-test:replicas:"
		}))
	}
	a, b := replica(), replica()
	sys := longSystemPrompt("replicas", 100)
	body := chatBody(sys, "A question.", `"temperature":0.5,"max_tokens":2`)
	awaitEvents(t, b, f.Info()[0].URL, f.Info()[0].Name, 10*time.Second) // b subscribed too
	holder := warmNonOwner(t, a, f, body, chatBody(sys, "Warm-up.", `"max_tokens":1`))
	holderURL := ""
	for _, in := range f.Info() {
		if in.Name == holder {
			holderURL = in.URL
		}
	}
	routesToHolder := func(p *testProxy, when string) {
		t.Helper()
		r, out := post(t, p.URL+"/v1/chat/completions", body)
		if r.StatusCode != 200 {
			t.Fatalf("%s: %d %s", when, r.StatusCode, out)
		}
		if got, route := r.Header.Get(HeaderBackend), r.Header.Get(HeaderRoute); got != holder || route != "kv_aware" {
			t.Errorf("%s: routed to %s (%s), want %s (kv_aware)", when, got, route, holder)
		}
	}
	routesToHolder(b, "the other replica")

	before := [2]uint64{catchUpsOf(t, a, holder), catchUpsOf(t, b, holder)}
	rs.kill()
	rs.start()
	n := 0
	waitFor(t, 10*time.Second, "both replicas to catch up after the restart", func() bool {
		n++
		if r, out := post(t, holderURL+"/v1/chat/completions", chatBody(longSystemPrompt(fmt.Sprint("live ", n), 40), "Hi.", `"max_tokens":1`)); r.StatusCode != 200 {
			t.Fatalf("live request %d: %d %s", n, r.StatusCode, out)
		}
		return catchUpsOf(t, a, holder) > before[0] && catchUpsOf(t, b, holder) > before[1]
	})
	routesToHolder(a, "after the restart, replica a")
	routesToHolder(b, "after the restart, replica b")
}

// catchUpsOf is the number of catch-ups of backend's event source.
func catchUpsOf(t *testing.T, p *testProxy, backend string) uint64 {
	t.Helper()
	b := kvBackend(t, p, backend)
	if len(b.Sources) != 1 {
		t.Fatalf("%s has %d event sources, want 1", backend, len(b.Sources))
	}
	return b.Sources[0].Sequence.CatchUps
}
