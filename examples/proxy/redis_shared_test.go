package main

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/testenv"
)

// redisClientConns counts the connections the Redis at addr has open under client name name
// (CLIENT LIST over a raw connection).
func redisClientConns(t *testing.T, addr, name string) int {
	t.Helper()
	c, r := dialRaw(t, addr)
	defer c.Close()
	if _, err := io.WriteString(c, "*2\r\n$6\r\nCLIENT\r\n$4\r\nLIST\r\n"); err != nil {
		t.Fatal(err)
	}
	line, err := r.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "$") {
		t.Fatalf("CLIENT LIST: %q %v", line, err)
	}
	n, _ := strconv.Atoi(strings.TrimSpace(line[1:]))
	buf := make([]byte, n+2)
	if _, err := io.ReadFull(r, buf); err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(buf), " name="+name+" ")
}

// The response cache and the KV index on one Redis URL share one client: with client_cache on (one
// connection per client), the proxy holds exactly one connection under the URL's client name,
// where a client each would hold two; both tiers work through it (a HIT, the engines' events
// indexed). On two URLs each has its own.
func TestRedisSharedClient(t *testing.T) {
	addr := testenv.RedisAddr(t)
	f := startFleet(t, 2, true)
	for _, tc := range []struct {
		name   string
		kvURL  string // kv_cache_index.redis.url ("" shares response_cache.redis.url)
		rc, kv int    // connections under each client name
	}{
		{name: "one URL", rc: 1},
		{name: "two URLs", kvURL: "redis://%s/0?client_name=%s", rc: 1, kv: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rcName, kvName, prefix := "kvroute-proxy-rc-"+testenv.RandHex(), "kvroute-proxy-kv-"+testenv.RandHex(), testenv.RandHex()
			p := startProxy(t, fleetConfig(t, f, func(c *config.Config) {
				c.ResponseCache.Backend = "redis"
				c.ResponseCache.Redis = config.RedisConfig{URL: config.Secret(fmt.Sprintf("redis://%s/0?client_name=%s", addr, rcName)),
					KeyPrefix: "kvroute-proxy-test:" + prefix + ":resp:", ClientCache: true}
				c.KVCacheIndex.Backend = "redis"
				c.KVCacheIndex.Redis.KeyPrefix = "kvroute-proxy-test:" + prefix + ":kvidx:"
				if tc.kvURL != "" {
					c.KVCacheIndex.Redis.URL = config.Secret(fmt.Sprintf(tc.kvURL, addr, kvName))
				}
			}))
			body := chatBody(longSystemPrompt("shared redis "+prefix, 60), "cache me", `"temperature":0,"max_tokens":4`)
			r1, _ := post(t, p.URL+"/v1/chat/completions", body)
			r2, _ := post(t, p.URL+"/v1/chat/completions", body)
			if r1.StatusCode != 200 || r2.Header.Get("X-Cache") != "HIT" {
				t.Errorf("response cache on Redis: %d, then X-Cache %q", r1.StatusCode, r2.Header.Get("X-Cache"))
			}
			engine := r1.Header.Get(HeaderBackend)
			waitFor(t, 10*time.Second, engine+"'s KV events in the Redis index", func() bool { return indexCreated(t, p, engine) > 0 })
			if got := redisClientConns(t, addr, rcName); got != tc.rc {
				t.Errorf("%d connections under the response cache's client name, want %d", got, tc.rc)
			}
			if got := redisClientConns(t, addr, kvName); got < tc.kv || (tc.kv == 0 && got != 0) {
				t.Errorf("%d connections under the index's own client name, want %d", got, tc.kv)
			}
		})
	}
}
