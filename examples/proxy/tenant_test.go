package main

import (
	"testing"

	"github.com/kvroute/kvroute/config"
)

// TestResponseCacheTenants: through the proxy, a cached response is served only to the tenant
// that made it. By default the caller's credential (Authorization, x-api-key or api-key) is the tenant;
// response_cache.tenant_header hands the decision to a header; shared_across_tenants turns
// isolation off.
func TestResponseCacheTenants(t *testing.T) {
	body := chatBody("You are terse.", "Who are you?", `"temperature":0`)
	alice := []string{"Authorization", "Bearer sk-alice"}
	bob := []string{"Authorization", "Bearer sk-bob"}
	with := func(a, b []string) []string { return append(append([]string{}, a...), b...) }
	for _, tc := range []struct {
		name string
		edit func(*config.ResponseCacheConfig)
		hdrs [][]string
		want []string
	}{
		{"two bearer tokens", nil,
			[][]string{alice, bob, alice, bob}, []string{"MISS", "MISS", "HIT", "HIT"}},
		{"same bearer token", nil,
			[][]string{alice, alice}, []string{"MISS", "HIT"}},
		{"two x-api-keys", nil,
			[][]string{{"x-api-key", "sk-ant-alice"}, {"x-api-key", "sk-ant-bob"}, {"x-api-key", "sk-ant-alice"}},
			[]string{"MISS", "MISS", "HIT"}},
		{"two azure api-keys, and none", nil, // issue 28: they shared the anonymous tenant
			[][]string{{"api-key", "azure-alice"}, {"api-key", "azure-bob"}, nil, {"api-key", "azure-alice"}},
			[]string{"MISS", "MISS", "MISS", "HIT"}},
		{"credential vs none", nil,
			[][]string{alice, nil, nil}, []string{"MISS", "MISS", "HIT"}},
		{"tenant_header decides", func(rc *config.ResponseCacheConfig) { rc.TenantHeader = "X-Tenant-Id" },
			[][]string{with([]string{"X-Tenant-Id", "acme"}, alice), with([]string{"X-Tenant-Id", "acme"}, bob),
				with([]string{"X-Tenant-Id", "globex"}, alice), alice},
			[]string{"MISS", "HIT", "MISS", "MISS"}},
		{"shared_across_tenants", func(rc *config.ResponseCacheConfig) { rc.SharedAcrossTenants = true },
			[][]string{alice, bob, {"x-api-key", "sk-ant-carol"}}, []string{"MISS", "HIT", "HIT"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			up := newFakeUpstream(t, "a")
			p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) {
				c.ResponseCache.Enabled = true
				if tc.edit != nil {
					tc.edit(&c.ResponseCache)
				}
			}))
			misses := 0
			for i, hdr := range tc.hdrs {
				r, b := post(t, p.URL+"/v1/chat/completions", body, hdr...)
				if r.StatusCode != 200 {
					t.Fatalf("request %d: %d %s", i, r.StatusCode, b)
				}
				if got := r.Header.Get("X-Cache"); got != tc.want[i] {
					t.Fatalf("request %d (%q): X-Cache %q, want %q", i, hdr, got, tc.want[i])
				}
				if tc.want[i] == "MISS" {
					misses++
				}
			}
			if n := int(up.requests.Load()); n != misses {
				t.Errorf("upstream saw %d requests, want %d", n, misses)
			}
		})
	}
}

// TestResponseCacheSamplingDefault: a request without a temperature samples at the providers'
// default of 1 and is not cached, unless response_cache.assume_greedy_default says the fleet
// decodes greedily by default.
func TestResponseCacheSamplingDefault(t *testing.T) {
	body := chatBody("You are terse.", "Pick a number.", "")
	for _, tc := range []struct {
		greedy bool
		want   []string
	}{
		{false, []string{"BYPASS", "BYPASS"}},
		{true, []string{"MISS", "HIT"}},
	} {
		up := newFakeUpstream(t, "a")
		p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) {
			c.ResponseCache.Enabled = true
			c.ResponseCache.AssumeGreedyDefault = tc.greedy
		}))
		for i, want := range tc.want {
			r, b := post(t, p.URL+"/v1/chat/completions", body)
			if r.StatusCode != 200 || r.Header.Get("X-Cache") != want {
				t.Fatalf("assume_greedy_default %v, request %d: %d X-Cache %q, want %q (%s)", tc.greedy, i, r.StatusCode, r.Header.Get("X-Cache"), want, b)
			}
		}
	}
}
