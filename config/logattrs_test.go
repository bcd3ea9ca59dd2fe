package config_test

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/config"
)

// The configuration's log summary names what is on and never prints a secret.
func TestLogAttrsRedacts(t *testing.T) {
	cfg, err := config.Parse([]byte(`
admin:
  auth_token: admin-secret
response_cache:
  enabled: true
  backend: tiered
  redis:
    url: redis://user:redis-secret@127.0.0.1:6379/0
    password: pass-secret
  l1:
    type: redis
  l2:
    type: s3
    endpoint: http://127.0.0.1:9000
    bucket: b
    access_key: access-secret
    secret_key: s3-secret
backends:
  - name: a
    url: http://user:url-secret@127.0.0.1:8001
`), nil)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, nil))
	log.LogAttrs(t.Context(), slog.LevelInfo, "configuration", cfg.LogAttrs()...)
	log.LogAttrs(t.Context(), slog.LevelInfo, "backend", cfg.BackendLogAttrs(&cfg.Backends[0])...)
	out := buf.String()
	for _, secret := range []string{"admin-secret", "redis-secret", "pass-secret", "access-secret", "s3-secret", "url-secret"} {
		if strings.Contains(out, secret) {
			t.Errorf("the log shows %s:\n%s", secret, out)
		}
	}
	for _, want := range []string{"admin_auth=true", "response_cache.backend=tiered", "response_cache.l2.bucket=b", "name=a"} {
		if !strings.Contains(out, want) {
			t.Errorf("the log lacks %s:\n%s", want, out)
		}
	}
}

// Every value the configuration's log line prints is the one in force: a setting left unset
// prints the default the builders apply, never a zero ("0s", "", 0).
func TestLogAttrsPrintsEffectiveValues(t *testing.T) {
	cfg, err := config.Parse([]byte(`
response_cache:
  enabled: true
  backend: tiered
  l1: {type: redis}
  l2: {type: s3, endpoint: "http://127.0.0.1:9000", bucket: b}
  redis: {client_cache: true}
kv_cache_index:
  enabled: true
  backend: redis
  redis: {url: "redis://127.0.0.1:6379"}
disaggregated_serving:
  enabled: true
  default_external_storage: {endpoint: "http://127.0.0.1:7070"}
backends:
  - {name: p, url: "http://127.0.0.1:8001", role: prefill}
  - {name: d, url: "http://127.0.0.1:8002", role: decode}
`), nil)
	if err != nil {
		t.Fatal(err)
	}
	attrs := cfg.LogAttrs()
	got := map[string]string{}
	for _, a := range attrs {
		got[a.Key] = a.Value.Resolve().String()
	}
	for key, want := range map[string]string{
		"response_cache.ttl":                                "5m",
		"response_cache.redis.url":                          "redis://127.0.0.1:6379",
		"response_cache.redis.key_prefix":                   "kvroute:resp:",
		"response_cache.redis.client_cache":                 "true",
		"response_cache.redis.client_cache_ttl":             "1m",
		"response_cache.redis.client_cache_bytes":           "33554432",
		"kv_cache_index.redis.key_prefix":                   "kvroute:kvidx:",
		"kv_cache_index.redis.shares_response_cache_client": "true",
		"selection_strategy":                                "round_robin",
		"log_level":                                         "INFO",
		"disaggregated_serving.prefill_timeout":             "1m",
	} {
		if got[key] != want {
			t.Errorf("%s=%q, want %q", key, got[key], want)
		}
	}
	for _, a := range attrs {
		switch v := a.Value.Resolve(); {
		case strings.HasSuffix(a.Key, "password"), strings.HasSuffix(a.Key, "_key"): // secrets: "" when unset
		case v.Kind() == slog.KindString && (v.String() == "" || v.String() == "0s"),
			v.Kind() == slog.KindInt64 && v.Int64() == 0 && a.Key != "kv_cache_index.event_sources":
			t.Errorf("%s prints %q, not the value in force", a.Key, v)
		}
	}
	for _, a := range cfg.BackendLogAttrs(&cfg.Backends[0]) {
		if a.Key == "weight" && a.Value.Float64() != 1 {
			t.Errorf("weight %v", a.Value)
		}
	}
}

func TestLogLevel(t *testing.T) {
	for _, tc := range []struct {
		yaml string
		want slog.Level
	}{{"", slog.LevelInfo}, {"log_level: debug", slog.LevelDebug}, {"log_level: WARN", slog.LevelWarn}, {"log_level: error", slog.LevelError}} {
		cfg, err := config.Parse([]byte(tc.yaml+"\nbackends: [{name: a, url: \"http://127.0.0.1:8001\"}]\n"), nil)
		if err != nil {
			t.Fatalf("%q: %v", tc.yaml, err)
		}
		if cfg.Level() != tc.want {
			t.Errorf("%q: %v, want %v", tc.yaml, cfg.Level(), tc.want)
		}
	}
	if _, err := config.Parse([]byte("log_level: loud\nbackends: [{name: a, url: \"http://127.0.0.1:8001\"}]\n"), nil); err == nil ||
		!strings.Contains(err.Error(), `log_level: "loud" is not one of debug, info, warn, error`) {
		t.Errorf("err = %v", err)
	}
}
