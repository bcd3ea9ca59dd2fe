package config_test

import (
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/config"
)

const reloadBase = `
server: {port: 8080}
admin: {auth_token: old-token}
response_cache: {enabled: true, ttl: 5m, capacity: 100}
kv_cache_index:
  enabled: true
  scoring: {min_overlap_threshold: 0.3}
backends:
  - {name: a, url: "http://127.0.0.1:8001"}
  - {name: b, url: "http://127.0.0.1:8002"}
`

func TestPlanReload(t *testing.T) {
	running, err := config.Parse([]byte(reloadBase), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name          string
		yaml          string
		live, restart []string
	}{
		{name: "nothing changed", yaml: reloadBase},
		{name: "live settings", yaml: `
server: {port: 8080}
admin: {auth_token: new-token}
response_cache: {enabled: true, ttl: 1m, capacity: 100}
kv_cache_index:
  enabled: true
  scoring: {min_overlap_threshold: 0.5}
backends:
  - {name: a, url: "http://127.0.0.1:8001", weight: 2}
  - {name: c, url: "http://127.0.0.1:8003"}
log_level: debug
`, live: []string{"admin.auth_token", "response_cache.ttl", "kv_cache_index.scoring.min_overlap_threshold", "backends", "log_level"}},
		{name: "restart settings kept", yaml: `
server: {port: 9090}
admin: {auth_token: new-token}
response_cache: {enabled: true, ttl: 5m, capacity: 200}
kv_cache_index:
  enabled: true
  block_size: 32
  scoring: {min_overlap_threshold: 0.3}
backends:
  - {name: a, url: "http://127.0.0.1:8001"}
  - {name: b, url: "http://127.0.0.1:8002"}
`, live: []string{"admin.auth_token"}, restart: []string{"server.port", "response_cache.capacity", "kv_cache_index.block_size"}},
		{name: "the admin token is never removed by a reload", yaml: `
server: {port: 8080}
response_cache: {enabled: true, ttl: 5m, capacity: 100}
kv_cache_index:
  enabled: true
  scoring: {min_overlap_threshold: 0.3}
backends:
  - {name: a, url: "http://127.0.0.1:8001"}
  - {name: b, url: "http://127.0.0.1:8002"}
`, restart: []string{"admin.auth_token"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			next, err := config.Parse([]byte(tc.yaml), nil)
			if err != nil {
				t.Fatal(err)
			}
			p := config.PlanReload(running, next)
			if !slices.Equal(p.Live, tc.live) || !slices.Equal(p.Restart, tc.restart) {
				t.Errorf("live %q, restart %q; want %q, %q", p.Live, p.Restart, tc.live, tc.restart)
			}
			n := p.Next
			// Live settings are the new file's, restart-only ones the running configuration's.
			wantToken := next.Admin.AuthToken
			if slices.Contains(tc.restart, "admin.auth_token") {
				wantToken = running.Admin.AuthToken
			}
			if n.Admin.AuthToken != wantToken || n.ResponseCache.TTL != next.ResponseCache.TTL ||
				!slices.EqualFunc(n.Backends, next.Backends, func(a, b config.BackendConfig) bool { return a.Name == b.Name && a.Weight == b.Weight }) ||
				n.KVCacheIndex.Scoring.MinOverlapThreshold != next.KVCacheIndex.Scoring.MinOverlapThreshold || n.LogLevel != next.LogLevel {
				t.Errorf("Next lacks a live setting: %+v", n)
			}
			if *n.Server.Port != *running.Server.Port || n.ResponseCache.Capacity != running.ResponseCache.Capacity ||
				n.KVCacheIndex.BlockSize != running.KVCacheIndex.BlockSize {
				t.Errorf("Next changed a restart-only setting: port %d, capacity %d, block size %d",
					*n.Server.Port, n.ResponseCache.Capacity, n.KVCacheIndex.BlockSize)
			}
			if err := n.Validate(); err != nil {
				t.Errorf("Next is invalid: %v", err)
			}
			// Neither input changed.
			if string(running.Admin.AuthToken) != "old-token" || *running.Server.Port != 8080 {
				t.Error("PlanReload changed the running configuration")
			}
		})
	}
}

// Every live setting names a setting of the schema (a typo would make a change restart-only).
func TestLiveSettingsAreFields(t *testing.T) {
	paths := map[string]bool{}
	var walk func(prefix string, typ reflect.Type)
	walk = func(prefix string, typ reflect.Type) {
		for i := range typ.NumField() {
			name, _, _ := strings.Cut(typ.Field(i).Tag.Get("yaml"), ",")
			if prefix != "" {
				name = prefix + "." + name
			}
			paths[name] = true
			if typ.Field(i).Type.Kind() == reflect.Struct {
				walk(name, typ.Field(i).Type)
			}
		}
	}
	walk("", reflect.TypeFor[config.Config]())
	for _, path := range config.LiveSettings() {
		if !paths[path] {
			t.Errorf("live setting %q is no setting of the schema", path)
		}
	}
	got := config.LiveSettings()
	got[0] = "changed"
	if config.LiveSettings()[0] == "changed" {
		t.Error("LiveSettings returned its own slice")
	}
}
