package main

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvroute/kvroute/admin"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/testenv"
)

// With the response cache and the KV index in Redis, a Redis outage does not stop the proxy:
// the cache falls back to memory, the index to consistent hashing.
func TestE2ERedisDown(t *testing.T) {
	rs := testenv.StartRedisServer(t)
	f := startFleet(t, 2, true)
	cfg := fleetConfig(t, f, func(c *config.Config) {
		c.ResponseCache.Backend = "redis"
		c.ResponseCache.Redis.URL = config.Secret("redis://" + rs.Addr())
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

	rs.Kill()
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
	var ks admin.KVIndexStats
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
	t.Parallel() // its own Redis servers, engines and proxies
	for _, tt := range []struct {
		name         string
		batchesWhile bool // the holder publishes while Redis is down
	}{{"batches dropped while down", true}, {"restart between two batches", false}} {
		t.Run(tt.name, func(t *testing.T) {
			rs := testenv.StartRedisServer(t)
			f := startFleet(t, 3, true)
			cfg := fleetConfig(t, f, func(c *config.Config) {
				c.KVCacheIndex.Backend = "redis"
				c.KVCacheIndex.Redis.URL = config.Secret("redis://" + rs.Addr())
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
			rs.Kill()
			if tt.batchesWhile {
				waitFor(t, 10*time.Second, "a batch dropped for the outage", func() bool {
					live()
					return kvBackend(t, p, holder).Events.Dropped > 0
				})
				live()
			}
			rs.Start() // empty: everything the index held is gone
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
				var st admin.KVIndexStats
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
	rs := testenv.StartRedisServer(t)
	f := startFleet(t, 3, true)
	replica := func() *testProxy {
		return startProxy(t, fleetConfig(t, f, func(c *config.Config) {
			c.KVCacheIndex.Backend = "redis"
			c.KVCacheIndex.Redis.URL = config.Secret("redis://" + rs.Addr())
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
		expectKVRouted(t, p, body, holder, when)
	}
	routesToHolder(b, "the other replica")

	before := [2]uint64{catchUpsOf(t, a, holder), catchUpsOf(t, b, holder)}
	rs.Kill()
	rs.Start()
	// Generous: under -race with the workspace's other packages running beside it, one catch-up
	// (a loss check each second, a clear, the engine's replay) has taken over 10 s.
	deadline := time.Now().Add(30 * time.Second)
	for n := 1; catchUpsOf(t, a, holder) <= before[0] || catchUpsOf(t, b, holder) <= before[1]; n++ {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for both replicas to catch up after the restart (catch-ups before %v):\na: %+v\nb: %+v",
				before, kvBackend(t, a, holder), kvBackend(t, b, holder))
		}
		if r, out := post(t, holderURL+"/v1/chat/completions", chatBody(longSystemPrompt(fmt.Sprint("live ", n), 40), "Hi.", `"max_tokens":1`)); r.StatusCode != 200 {
			t.Fatalf("live request %d: %d %s", n, r.StatusCode, out)
		}
		time.Sleep(20 * time.Millisecond)
	}
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
