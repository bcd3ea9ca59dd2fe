package main

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvroute/kvroute/admin"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/events/zmqevents"
	"github.com/kvroute/kvroute/internal/testenv"
)

// redisHealWithin bounds the wait, after Redis comes back empty, for the proxy to route every
// engine's held prefixes by KV again. It is a generous bound, not a target: healing takes a
// second or two (the test logs it), but under -race beside the workspace's other tests it has
// taken over 10 s.
const redisHealWithin = 30 * time.Second

// A new user's setup: three engines with ZMQ events and replay, the proxy with the Redis index and
// speculation at its default, long system prompts routed kv_aware to the engines that hold them.
// Redis restarts empty. The engines still hold those prefixes, and a cache hit publishes nothing,
// so only the index's loss detection and the consumers' catch-ups can bring them back: within
// redisHealWithin every source has caught up and every prompt is routed kv_aware to its holder
// again — with requests flowing through the proxy all along, and with no request at all until the
// sources have healed (no Lookup, no event: the consumers ask the index).
func TestE2ERedisIndexHealsThroughProxy(t *testing.T) {
	t.Parallel() // its own Redis servers, engines and proxies
	for _, tt := range []struct {
		name    string
		traffic bool // requests flow through the proxy during the outage and the recovery
	}{{"requests flowing", true}, {"quiet gap before traffic resumes", false}} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel() // each has its own Redis, engines and proxy
			rs := testenv.StartRedisServer(t)
			f := startFleet(t, 3, true)
			cfg := fleetConfig(t, f, func(c *config.Config) {
				c.KVCacheIndex.Backend = "redis"
				c.KVCacheIndex.Redis.URL = config.Secret("redis://" + rs.Addr())
				c.KVCacheIndex.Redis.KeyPrefix = "kvroute-proxy-test:heal-through-proxy:"
			})
			p := startProxy(t, cfg)
			requireSequenceBlocks(t, p)

			// Six long prompts, each warmed on an engine other than the ring's choice, and
			// routed kv_aware to it.
			var names []string
			urls := map[string]string{}
			for _, in := range f.Info() {
				names = append(names, in.Name)
				urls[in.Name] = in.URL
				awaitEvents(t, p, in.URL, in.Name, 10*time.Second)
			}
			type prompt struct{ body, holder string }
			var prompts []prompt
			for i := range 6 {
				sys := longSystemPrompt(fmt.Sprint("heal through the proxy ", i), 120)
				body := chatBody(sys, "A question.", `"temperature":0.5,"max_tokens":2`)
				owner := ringOwner(t, body, names)
				holder := names[i%len(names)]
				if holder == owner {
					holder = names[(i+1)%len(names)]
				}
				before := indexCreated(t, p, holder)
				if r, b := post(t, urls[holder]+"/v1/chat/completions", chatBody(sys, "Warm-up.", `"max_tokens":1`)); r.StatusCode != 200 {
					t.Fatalf("warm-up %d: %d %s", i, r.StatusCode, b)
				}
				waitFor(t, 10*time.Second, holder+"'s KV events", func() bool { return indexCreated(t, p, holder) > before })
				prompts = append(prompts, prompt{body, holder})
			}
			// holders[i] are the engines known to hold prompt i: its warm-up's, and every engine
			// the proxy sent it to since (an engine keeps what it served).
			var mu sync.Mutex
			holders := make([]map[string]bool, len(prompts))
			for i, pr := range prompts {
				holders[i] = map[string]bool{pr.holder: true}
			}
			send := func(i int) (backend, route string, err error) {
				r, err := httpClient.Post(p.URL+"/v1/chat/completions", "application/json", strings.NewReader(prompts[i].body))
				if err != nil {
					return "", "", err
				}
				_, _ = io.Copy(io.Discard, r.Body)
				r.Body.Close()
				if r.StatusCode != 200 {
					return "", "", fmt.Errorf("prompt %d: status %d", i, r.StatusCode)
				}
				backend, route = r.Header.Get(HeaderBackend), r.Header.Get(HeaderRoute)
				mu.Lock()
				known := holders[i][backend]
				holders[i][backend] = true
				mu.Unlock()
				if !known || route != "kv_aware" {
					return backend, route, fmt.Errorf("prompt %d to %s (%s), want an engine holding it (kv_aware)", i, backend, route)
				}
				return backend, route, nil
			}
			routed := func() (bad []string) {
				for i := range prompts {
					if _, _, err := send(i); err != nil {
						bad = append(bad, err.Error())
					}
				}
				return bad
			}
			if bad := routed(); len(bad) > 0 {
				t.Fatalf("before the restart: %v", bad)
			}
			catchUps := map[string]uint64{}
			for _, n := range names {
				catchUps[n] = catchUpsOf(t, p, n)
			}

			// The users' traffic: the same prompts, through the proxy, every 100 ms. While Redis
			// is down they go by consistent hashing to other engines, which store them too; a
			// holder's cache hits publish nothing.
			var stop atomic.Bool
			var wg sync.WaitGroup
			var sent, failed atomic.Int64
			traffic := func() {
				defer wg.Done()
				for i := 0; !stop.Load(); i++ {
					sent.Add(1)
					if _, _, err := send(i % len(prompts)); err != nil && strings.Contains(err.Error(), "status") {
						failed.Add(1)
					}
					time.Sleep(100 * time.Millisecond)
				}
			}
			defer func() { stop.Store(true); wg.Wait() }()
			if tt.traffic {
				wg.Add(1)
				go traffic()
			}

			// The outage lasts longer than the consumers' loss-check interval, so that every
			// source's check fails at least once against the dead server, and, with traffic, until
			// requests have gone through the proxy while Redis was down.
			rs.Kill()
			down, sentBefore := time.Now(), sent.Load()
			time.Sleep(zmqevents.DefaultLossCheckInterval + 250*time.Millisecond)
			if tt.traffic {
				waitFor(t, 10*time.Second, "requests through the proxy during the outage", func() bool { return sent.Load() >= sentBefore+5 })
			}
			rs.Start() // empty: everything the index held is gone
			back := time.Now()
			t.Logf("Redis down for %v (%d requests)", back.Sub(down), sent.Load()-sentBefore)

			// Every source catches up from its engine's replay buffer, with or without traffic.
			waitFor(t, redisHealWithin, "a catch-up of every source after the restart", func() bool {
				for _, n := range names {
					if catchUpsOf(t, p, n) <= catchUps[n] {
						return false
					}
				}
				return true
			})
			healed := time.Since(back)
			var bad []string
			for {
				if bad = routed(); len(bad) == 0 || time.Since(back) > redisHealWithin {
					break
				}
				time.Sleep(200 * time.Millisecond)
			}
			if len(bad) > 0 {
				var st admin.KVIndexStats
				getJSON(t, p.URL+"/admin/kv-index/stats", &st)
				t.Fatalf("%v after Redis came back, prompts still not routed by KV: %v; index error %q", time.Since(back), bad, st.IndexError)
			}
			t.Logf("every source caught up %v after Redis came back; every prompt routed kv_aware to a holder after %v (%d requests during the outage and the recovery)",
				healed, time.Since(back), sent.Load())
			if !tt.traffic { // nothing but the warm-ups' holders holds the prompts
				mu.Lock()
				for i := range prompts {
					if len(holders[i]) != 1 {
						t.Errorf("prompt %d went to %v", i, holders[i])
					}
				}
				mu.Unlock()
			}
			if n := failed.Load(); n > 0 {
				t.Errorf("%d requests failed", n)
			}
		})
	}
}

// requireSequenceBlocks checks that /admin/kv-index/backends shows each ZMQ source's sequence
// block, catch_ups included, before the source's first batch.
func requireSequenceBlocks(t *testing.T, p *testProxy) {
	t.Helper()
	var body struct {
		Backends []struct {
			Backend string           `json:"backend_name"`
			Sources []map[string]any `json:"sources"`
		} `json:"backends"`
	}
	getJSON(t, p.URL+"/admin/kv-index/backends", &body)
	if len(body.Backends) == 0 {
		t.Fatal("no backends in /admin/kv-index/backends")
	}
	for _, b := range body.Backends {
		if len(b.Sources) == 0 {
			t.Errorf("%s: no sources", b.Backend)
		}
		for _, s := range b.Sources {
			seq, ok := s["sequence"].(map[string]any)
			if !ok {
				t.Errorf("%s: source %v has no sequence block", b.Backend, s)
				continue
			}
			if v, ok := seq["catch_ups"]; !ok || v != float64(0) {
				t.Errorf("%s: sequence %v, want catch_ups 0", b.Backend, seq)
			}
		}
	}
}
