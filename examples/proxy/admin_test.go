package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/admin"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/respcache"
)

// adminDo sends an admin request with an optional bearer token and returns status and body.
func adminDo(t *testing.T, method, url, token, body string) (int, []byte) {
	t.Helper()
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// hasKeys checks that the JSON object at path (dot-separated) of doc has every key.
func hasKeys(t *testing.T, what string, doc map[string]any, path string, keys ...string) {
	t.Helper()
	obj := doc
	if path != "" {
		for _, p := range strings.Split(path, ".") {
			next, ok := obj[p].(map[string]any)
			if !ok {
				t.Errorf("%s: %s is not an object in %v", what, p, doc)
				return
			}
			obj = next
		}
	}
	for _, k := range keys {
		if _, ok := obj[k]; !ok {
			t.Errorf("%s: %q lacks %q: %v", what, path, k, obj)
		}
	}
}

// The admin endpoints answer in the seeds' JSON shapes, behind the bearer token.
func TestAdminEndpoints(t *testing.T) {
	f := startFleet(t, 2, true)
	const token = "admin-secret"
	p := startProxy(t, fleetConfig(t, f, func(c *config.Config) { c.Admin.AuthToken = token }))

	sys := longSystemPrompt("admin", 60)
	body := chatBody(sys, "hello", `"temperature":0,"max_tokens":4`)
	if r, b := post(t, p.URL+"/v1/chat/completions", body); r.StatusCode != 200 {
		t.Fatalf("%d %s", r.StatusCode, b)
	}
	waitFor(t, 10*time.Second, "KV events indexed", func() bool {
		var st admin.KVIndexStats
		code, b := adminDo(t, "GET", p.URL+"/admin/kv-index/stats", token, "")
		return code == 200 && json.Unmarshal(b, &st) == nil && st.Index.Entries > 0
	})

	t.Run("auth", func(t *testing.T) {
		for _, ep := range []struct{ method, path string }{
			{"GET", "/admin/prefix-routing/stats"}, {"GET", "/admin/response-cache/stats"},
			{"POST", "/admin/response-cache/invalidate"}, {"GET", "/admin/kv-index/stats"},
			{"GET", "/admin/kv-index/backends"}, {"POST", "/admin/kv-index/clear"}, {"GET", "/admin/nope"},
		} {
			for _, tok := range []string{"", "wrong"} {
				code, b := adminDo(t, ep.method, p.URL+ep.path, tok, `{"clear_all":true}`)
				if code != http.StatusUnauthorized || !strings.Contains(string(b), "unauthorized") {
					t.Errorf("%s %s with token %q: %d %s", ep.method, ep.path, tok, code, b)
				}
			}
		}
		// /metrics and /healthz are not admin endpoints.
		for _, path := range []string{"/metrics", "/healthz"} {
			if code, _ := adminDo(t, "GET", p.URL+path, "", ""); code != 200 {
				t.Errorf("%s: %d", path, code)
			}
		}
	})

	get := func(path string) map[string]any {
		t.Helper()
		code, b := adminDo(t, "GET", p.URL+path, token, "")
		if code != 200 {
			t.Fatalf("%s: %d %s", path, code, b)
		}
		var doc map[string]any
		if err := json.Unmarshal(b, &doc); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		return doc
	}

	t.Run("prefix-routing/stats", func(t *testing.T) {
		doc := get("/admin/prefix-routing/stats")
		hasKeys(t, "prefix", doc, "", "enabled", "config", "routing_decisions", "backend_distribution", "unique_prefixes")
		hasKeys(t, "prefix", doc, "config", "max_prefix_length", "load_factor_epsilon", "virtual_nodes", "anthropic_cache_control_injection")
		hasKeys(t, "prefix", doc, "routing_decisions", "total", "prefix_hash", "overflow", "fallback", "overflow_rate")
		dist := doc["backend_distribution"].([]any)
		if len(dist) != 2 {
			t.Fatalf("distribution %v", dist)
		}
		hasKeys(t, "prefix", dist[0].(map[string]any), "", "backend", "in_flight_requests")
	})
	t.Run("response-cache", func(t *testing.T) {
		doc := get("/admin/response-cache/stats")
		hasKeys(t, "cache", doc, "", "enabled", "backend_type", "entries", "capacity", "requests", "hit_rate", "evictions", "size_bytes", "config")
		hasKeys(t, "cache", doc, "requests", "hit", "miss", "skip", "total")
		hasKeys(t, "cache", doc, "config", "backend", "ttl", "capacity", "max_response_size", "max_stream_buffer_size")
		if doc["entries"].(float64) != 1 {
			t.Errorf("entries %v", doc["entries"])
		}
		// Invalidate one key, then everything.
		req, _ := prefixkey.ParseOpenAIChat([]byte(body))
		code, b := adminDo(t, "POST", p.URL+"/admin/response-cache/invalidate", token, `{"key":"`+respcache.KeyFor(req)+`"}`)
		if code != 200 || compactJSON(b) != `{"success":true,"action":"delete_key","cleared_entries":1}` {
			t.Errorf("invalidate key: %d %s", code, b)
		}
		post(t, p.URL+"/v1/chat/completions", body)
		code, b = adminDo(t, "POST", p.URL+"/admin/response-cache/invalidate", token, `{"clear_all":true}`)
		if code != 200 || compactJSON(b) != `{"success":true,"action":"clear_all","cleared_entries":1}` {
			t.Errorf("clear_all: %d %s", code, b)
		}
		for _, bad := range []string{`{}`, `not json`, `{"clear_all":true,"extra":1}`, `{"key":"zz"}`, `{"key":"` + strings.Repeat("A", 64) + `"}`} {
			if code, b := adminDo(t, "POST", p.URL+"/admin/response-cache/invalidate", token, bad); code != 400 || !strings.Contains(string(b), `"success": false`) {
				t.Errorf("invalidate %s: %d %s", bad, code, b)
			}
		}
	})
	t.Run("kv-index/stats", func(t *testing.T) {
		doc := get("/admin/kv-index/stats")
		hasKeys(t, "kv", doc, "", "enabled", "config", "index", "event_sources", "routing_decisions", "query_latency_count", "overlap_score_count")
		hasKeys(t, "kv", doc, "config", "backend", "max_entries", "entry_ttl_seconds", "event_sources_count", "scoring")
		hasKeys(t, "kv", doc, "config.scoring", "min_overlap_threshold", "load_factor_epsilon")
		// expected_ttft decides: the composite's weights, which take no part, are not shown
		// (TestAdminKVIndexStatsWeights).
		if sc := doc["config"].(map[string]any); sc["scorer"] != "expected_ttft" || sc["scoring"].(map[string]any)["overlap_weight"] != nil {
			t.Errorf("kv: config %v", sc)
		}
		hasKeys(t, "kv", doc, "index", "prefix_count", "entry_count", "total_hits", "total_evictions")
		hasKeys(t, "kv", doc, "routing_decisions", "kv_aware", "load_bound", "imbalance", "least_work", "fallback", "total")
		srcs := doc["event_sources"].([]any)
		if len(srcs) != 2 {
			t.Fatalf("event_sources %v", srcs)
		}
		hasKeys(t, "kv", srcs[0].(map[string]any), "", "backend_name", "connected", "events_received", "events_dropped", "reconnect_count")
	})
	t.Run("kv-index/backends", func(t *testing.T) {
		// The engines publish their KV events asynchronously: wait (bounded) until the index has
		// applied some, then check the shape and the counts. A PUB socket drops what it publishes
		// before a subscription reaches it, and the consumer learns of such a loss only from the
		// next event's sequence number: keep some traffic going while waiting.
		var doc map[string]any
		deadline := time.Now().Add(10 * time.Second)
		for i := 0; ; i++ {
			if i%25 == 0 {
				post(t, p.URL+"/v1/chat/completions", chatBody(longSystemPrompt(fmt.Sprintf("events %d", i), 40), "Hello?", `"max_tokens":1`))
			}
			doc = get("/admin/kv-index/backends")
			created := 0.0
			for _, b := range doc["backends"].([]any) {
				if ev, ok := b.(map[string]any)["events"].(map[string]any); ok {
					created, _ = ev["index_created"].(float64)
				}
				if created > 0 {
					break
				}
			}
			if created > 0 || time.Now().After(deadline) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		bs := doc["backends"].([]any)
		if doc["enabled"] != true || len(bs) != 2 {
			t.Fatalf("%v", doc)
		}
		created := 0.0
		for _, b := range bs {
			m := b.(map[string]any)
			hasKeys(t, "backends", m, "", "backend_name", "connection", "events")
			hasKeys(t, "backends", m, "connection", "connected", "reconnect_count")
			hasKeys(t, "backends", m, "events", "received", "dropped", "index_created", "index_evicted")
			if m["connection"].(map[string]any)["connected"] != true {
				t.Errorf("not connected: %v", m)
			}
			created += m["events"].(map[string]any)["index_created"].(float64)
		}
		if created == 0 {
			t.Errorf("no index_created: %v", bs)
		}
	})
	t.Run("kv-index/clear", func(t *testing.T) {
		// The engines' events of the requests above may still be on their way: wait until the
		// index stops changing, so that none lands after the clear.
		entries := func() int {
			var st admin.KVIndexStats
			_, b := adminDo(t, "GET", p.URL+"/admin/kv-index/stats", token, "")
			_ = json.Unmarshal(b, &st)
			return st.Index.Entries
		}
		last := -1
		waitFor(t, 10*time.Second, "the index at rest", func() bool {
			n := entries()
			settled := n == last
			last = n
			time.Sleep(200 * time.Millisecond)
			return settled
		})
		code, b := adminDo(t, "POST", p.URL+"/admin/kv-index/clear", token, "")
		var res struct {
			Success            bool `json:"success"`
			EntriesBeforeClear int  `json:"entries_before_clear"`
			ClearedEntries     int  `json:"cleared_entries"`
		}
		if code != 200 || json.Unmarshal(b, &res) != nil || !res.Success || res.EntriesBeforeClear == 0 || res.ClearedEntries == 0 {
			t.Errorf("clear: %d %s", code, b)
		}
		var st admin.KVIndexStats
		_, b = adminDo(t, "GET", p.URL+"/admin/kv-index/stats", token, "")
		if json.Unmarshal(b, &st) != nil || st.Index.Entries != 0 {
			t.Errorf("after clear: %s", b)
		}
	})
	t.Run("metrics", func(t *testing.T) {
		code, b := adminDo(t, "GET", p.URL+"/metrics", "", "")
		for _, m := range []string{"kvroute_prefix_routing_requests_total", "kvroute_response_cache_requests_total",
			"kvroute_kv_event_received_total", "kvroute_proxy_requests_total", "kvroute_proxy_backend_healthy",
			"kvroute_kv_index_events_total", "kvroute_decisions_expired_total", "go_goroutines"} {
			if !strings.Contains(string(b), m) {
				t.Errorf("/metrics (%d) lacks %s", code, m)
			}
		}
	})
}

// GET /admin/kv-index/stats shows the composite scorer's weights only while it ranks tier 4's
// candidates (scorer kv_overlap), not while expected_ttft decides (issue 26); the rest of its
// scoring section shows either way.
func TestAdminKVIndexStatsWeights(t *testing.T) {
	up := newFakeUpstream(t, "a")
	for _, scorer := range []string{config.ScorerExpectedTTFT, config.ScorerKVOverlap} {
		t.Run(scorer, func(t *testing.T) {
			p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) {
				c.KVCacheIndex.Enabled = true
				c.KVCacheIndex.Scoring.Scorer = scorer
			}))
			var st admin.KVIndexStats
			if code := getJSON(t, p.URL+"/admin/kv-index/stats", &st); code != 200 {
				t.Fatalf("kv-index/stats: %d", code)
			}
			sc := st.Config.Scoring
			if st.Config.Scorer != scorer || sc.MinOverlapThreshold != 0.3 || sc.GPUTierWeight != 1 {
				t.Errorf("config %+v", st.Config)
			}
			if shown := sc.OverlapWeight != nil && sc.LoadWeight != nil && sc.HealthWeight != nil; shown != (scorer == config.ScorerKVOverlap) {
				t.Errorf("scorer %s: weights shown %v: %+v", scorer, shown, sc)
			} else if shown && (*sc.OverlapWeight != 0.6 || *sc.LoadWeight != 0.3 || *sc.HealthWeight != 0.1) {
				t.Errorf("weights %v %v %v", *sc.OverlapWeight, *sc.LoadWeight, *sc.HealthWeight)
			}
		})
	}
}

// Tiers that are off answer {"enabled": false}; their write endpoints 404.
func TestAdminDisabledTiers(t *testing.T) {
	up := newFakeUpstream(t, "a")
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, nil))
	for _, path := range []string{"/admin/response-cache/stats", "/admin/kv-index/stats", "/admin/kv-index/backends"} {
		var doc map[string]any
		if code := getJSON(t, p.URL+path, &doc); code != 200 || doc["enabled"] != false {
			t.Errorf("%s: %d %v", path, code, doc)
		}
	}
	for _, path := range []string{"/admin/response-cache/invalidate", "/admin/kv-index/clear"} {
		if code, b := adminDo(t, "POST", p.URL+path, "", `{"clear_all":true}`); code != 404 {
			t.Errorf("%s: %d %s", path, code, b)
		}
	}
}
