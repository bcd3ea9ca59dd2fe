package main

import (
	"os"
	"testing"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/testenv"
)

// The shipped all-tiers.yaml, as is but for the addresses: Redis L1 (a private redis-server) in
// front of S3 L2 (S3_ENDPOINT, S3_BUCKET, S3_ACCESS_KEY, S3_SECRET_KEY: the CI's versitygw), and
// the KV index in Redis. A repeated request is a HIT; with Redis killed the proxy still serves,
// and L2 still answers.
func TestE2EAllTiers(t *testing.T) {
	testenv.S3(t) // all-tiers.yaml reads the S3_* variables itself
	rs := testenv.StartRedisServer(t)
	data, err := os.ReadFile("configs/all-tiers.yaml")
	if err != nil {
		t.Fatal(err)
	}
	vars := map[string]string{"REDIS_URL": "redis://" + rs.Addr(), "ADMIN_TOKEN": "tiers-token"}
	cfg, err := config.Parse(data, func(k string) (string, bool) {
		if v, ok := vars[k]; ok {
			return v, true
		}
		return os.LookupEnv(k)
	})
	if err != nil {
		t.Fatal(err)
	}
	f := startFleet(t, 2, true)
	demo := demoConfig(f.Info())
	cfg.Backends, cfg.KVCacheIndex.EventSources = demo.Backends, demo.KVCacheIndex.EventSources
	cfg.Server.BindAddress, cfg.Server.Port = "127.0.0.1", ptr(0)
	cfg.ResponseCache.Redis.KeyPrefix = "kvroute-proxy-test:" + t.Name() + ":"
	cfg.ResponseCache.L2.KeyPrefix = "kvroute-proxy-test/" + t.Name() + "/"
	cfg.KVCacheIndex.TokenizeTimeout = config.Duration(5e9)
	cfg.ApplyDefaults()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, cfg)
	t.Cleanup(func() {
		adminDo(t, "POST", p.URL+"/admin/response-cache/invalidate", "tiers-token", `{"clear_all":true}`)
	})

	body := chatBody(longSystemPrompt("tiers", 40), "cache me in two tiers", `"temperature":0,"max_tokens":4`)
	r1, b1 := post(t, p.URL+"/v1/chat/completions", body)
	r2, b2 := post(t, p.URL+"/v1/chat/completions", body)
	if r1.StatusCode != 200 || r1.Header.Get("X-Cache") != "MISS" || r2.Header.Get("X-Cache") != "HIT" || string(b1) != string(b2) {
		t.Fatalf("%d %q then %d %q", r1.StatusCode, r1.Header.Get("X-Cache"), r2.StatusCode, r2.Header.Get("X-Cache"))
	}
	var cs map[string]any
	getJSON(t, p.URL+"/admin/response-cache/stats", &cs, "Authorization", "Bearer tiers-token")
	if cs["backend_type"] != "tiered" {
		t.Errorf("backend_type %v", cs["backend_type"])
	}

	rs.Kill()
	r3, b3 := post(t, p.URL+"/v1/chat/completions", body)
	if r3.StatusCode != 200 || string(b3) != string(b1) {
		t.Errorf("with Redis down: %d %q %s", r3.StatusCode, r3.Header.Get("X-Cache"), b3)
	}
	t.Logf("with Redis down: X-Cache %s", r3.Header.Get("X-Cache"))
	r4, _ := post(t, p.URL+"/v1/chat/completions", chatBody("new prompt", "while Redis is down", `"temperature":0,"max_tokens":4`))
	if r4.StatusCode != 200 {
		t.Errorf("new request with Redis down: %d", r4.StatusCode)
	}
}
