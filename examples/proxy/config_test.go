package main

import (
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/disagg"
)

// env returns a lookup over m.
func env(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

const minimalBackends = `
backends:
  - name: vllm-1
    url: http://127.0.0.1:8001
`

func TestParseConfigDefaults(t *testing.T) {
	cfg, err := parseConfig([]byte(minimalBackends), env(nil))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.addr() != "127.0.0.1:8080" {
		t.Errorf("addr %s", cfg.addr())
	}
	if !*cfg.PrefixRouting.Enabled || cfg.ResponseCache.Enabled || cfg.KVCacheIndex.Enabled {
		t.Errorf("tiers: %+v", cfg)
	}
	if cfg.Server.MaxBodyBytes != 8<<20 || time.Duration(cfg.Server.ShutdownTimeout) != 30*time.Second {
		t.Errorf("server defaults: %+v", cfg.Server)
	}
	if h := cfg.HealthChecks; !*h.Enabled || h.Path != "/health" || h.UnhealthyThreshold != 3 || h.HealthyThreshold != 2 {
		t.Errorf("health defaults: %+v", h)
	}
	if cb := cfg.CircuitBreaker; !*cb.Enabled || cb.FailureThreshold != 5 || time.Duration(cb.RecoveryTimeout) != 30*time.Second {
		t.Errorf("breaker defaults: %+v", cb)
	}
	if w := cfg.KVCacheIndex.Scoring; *w.OverlapWeight != 0.6 || *w.LoadWeight != 0.3 || *w.HealthWeight != 0.1 || w.MinOverlapThreshold != 0.3 {
		t.Errorf("scoring defaults: %+v", w)
	}
	if cfg.Backends[0].Weight != 1 {
		t.Errorf("weight %v", cfg.Backends[0].Weight)
	}
}

// Validation errors name the field path.
func TestConfigErrorsNameTheField(t *testing.T) {
	tests := []struct {
		name, yaml string
		env        map[string]string
		want       []string
	}{
		{"weights sum", minimalBackends + `
kv_cache_index:
  enabled: true
  scoring: {overlap_weight: 0.7, load_weight: 0.4, health_weight: 0.1}
`, nil, []string{"kv_cache_index.scoring: weights sum to 1.2, must be 1.0"}},
		{"one weight set", minimalBackends + `
kv_cache_index:
  enabled: true
  scoring: {overlap_weight: 0.8}
`, nil, []string{"kv_cache_index.scoring: weights sum to 1.2, must be 1.0"}},
		{"unknown field", minimalBackends + `
server:
  bind_adress: 0.0.0.0
`, nil, []string{"server.bind_adress: unknown field (did you mean bind_address?) (line 7)"}},
		{"unknown nested field", minimalBackends + `
response_cache:
  redis:
    pool: 3
`, nil, []string{"response_cache.redis.pool: unknown field"}},
		{"unknown field in a list", `
backends:
  - name: a
    url: http://a
    wieght: 2
`, nil, []string{"backends[0].wieght: unknown field (did you mean weight?)"}},
		{"bad duration", minimalBackends + `
response_cache:
  enabled: true
  ttl: 5x
`, nil, []string{`response_cache.ttl: invalid duration "5x"`}},
		{"type error", minimalBackends + `
server:
  port: eighty
`, nil, []string{`server.port: "eighty" is not an integer`}},
		{"mapping expected", minimalBackends + `
prefix_routing: true
`, nil, []string{"prefix_routing: must be a mapping"}},
		{"missing env", minimalBackends + `
admin:
  auth_token: ${ADMIN_TOKEN}
`, nil, []string{"admin.auth_token: environment variable ADMIN_TOKEN is not set"}},
		{"no backends", `prefix_routing: {enabled: true}`, nil, []string{"backends: at least one backend is required"}},
		{"backend url and dup", `
backends:
  - {name: a, url: "ftp://x"}
  - {name: a, url: "http://y"}
`, nil, []string{`backends[0].url: "ftp://x": scheme must be http or https`, `backends[1].name: "a" is already the name of backends[0]`}},
		{"epsilon", minimalBackends + `
prefix_routing: {load_factor_epsilon: 20}
`, nil, []string{"prefix_routing.load_factor_epsilon: 20 is not in [0.01, 10]"}},
		{"strategy", minimalBackends + `
selection_strategy: Fastest
`, nil, []string{`selection_strategy: "Fastest" is not one of`}},
		{"cache backend", minimalBackends + `
response_cache: {enabled: true, backend: disk}
`, nil, []string{`response_cache.backend: "disk" is not one of memory, redis, tiered`}},
		{"tiered without l2", minimalBackends + `
response_cache: {enabled: true, backend: tiered}
`, nil, []string{`response_cache.l2.type: "": must be s3`, "response_cache.l2.endpoint: is required", "response_cache.l2.bucket: is required"}},
		{"kv ranges", minimalBackends + `
kv_cache_index:
  enabled: true
  max_entries: 5
  entry_ttl_seconds: 100000
  scoring: {min_overlap_threshold: 1.5, storage_tier_weight: 2, load_factor_epsilon: 20}
`, nil, []string{"kv_cache_index.max_entries: 5 is not in [100, 10000000]",
			"kv_cache_index.entry_ttl_seconds: 100000 is not in [1, 86400]",
			"kv_cache_index.scoring.min_overlap_threshold: 1.5 is not in (0, 1]",
			"kv_cache_index.scoring.load_factor_epsilon: 20 is not in [0.01, 10]",
			"kv_cache_index.scoring.storage_tier_weight: 2 is not in [0, 1]"}},
		{"event sources", minimalBackends + `
kv_cache_index:
  enabled: true
  event_sources:
    - {backend_name: vllm-9, endpoint: "http://x/v1/kv_events"}
    - {backend_name: vllm-1, endpoint: "wss://x/v1/kv_events"}
    - {endpoint: "tcp://127.0.0.1:5557"}
`, nil, []string{`kv_cache_index.event_sources[0].backend_name: "vllm-9" is not a configured backend`,
			`kv_cache_index.event_sources[1].endpoint: "wss://x/v1/kv_events": WebSocket event streams are not supported`,
			"kv_cache_index.event_sources[2].backend_name: is required"}},
		{"redis index without url", minimalBackends + `
kv_cache_index: {enabled: true, backend: redis}
`, nil, []string{"kv_cache_index.redis.url: is required with backend redis"}},
		{"health", minimalBackends + `
health_checks: {interval: 1ms, path: health}
`, nil, []string{"health_checks.interval: 1ms is shorter than 10ms", `health_checks.path: "health" must start with /`}},
		{"decode role without disaggregation", `
backends:
  - {name: d, url: "http://d", role: decode}
  - {name: u, url: "http://u"}
`, nil, []string{`backends[0].role: "decode" needs disaggregated_serving.enabled: true`}},
		{"unknown role", `
backends:
  - {name: p, url: "http://p", role: leader}
`, nil, []string{`backends[0].role: "leader" is not one of prefill, decode, unified`}},
		{"prefill pool without decode pool", `
disaggregated_serving: {enabled: true}
backends:
  - {name: p, url: "http://p", role: prefill}
  - {name: u, url: "http://u", role: unified}
`, nil, []string{"backends: 1 backend(s) with role prefill but none with role decode"}},
		{"prefill sharing no storage", `
disaggregated_serving:
  enabled: true
  default_external_storage: {endpoint: "http://kv-a:8080", kv_namespace: inference/kv-cache}
backends:
  - name: p
    url: http://p
    role: prefill
    external_storage: {endpoint: "http://kv-b:8080", kv_namespace: inference/kv-cache}
  - {name: d, url: "http://d", role: decode}
`, nil, []string{`backends[0].external_storage: prefill backend "p" shares its storage (endpoint="http://kv-b:8080" namespace="inference/kv-cache") with no decode backend`}},
		{"external storage fields", `
disaggregated_serving:
  enabled: true
  default_external_storage: {kv_namespace: x, access_key: AKIA}
backends:
  - name: d
    url: http://d
    role: decode
    external_storage: {endpoint: "s3://kv", bucket: "a/b"}
`, nil, []string{"disaggregated_serving.default_external_storage.endpoint: is required",
			"disaggregated_serving.default_external_storage: set both access_key and secret_key, or neither",
			`backends[0].external_storage.endpoint: "s3://kv": scheme must be http or https`,
			`backends[0].external_storage.bucket: "a/b" must be a bucket name`}},
		{"unknown storage field", `
backends:
  - name: d
    url: http://d
    external_storage: {endpoint: "http://kv", regoin: eu}
`, nil, []string{"backends[0].external_storage.regoin: unknown field"}},
		{"conditional thresholds", minimalBackends + `
disaggregated_serving:
  enabled: true
  conditional: {max_uncached_tokens: -5, max_uncached_ratio: 1.5}
`, nil, []string{"disaggregated_serving.conditional.max_uncached_tokens: -5 must not be negative",
			"disaggregated_serving.conditional.max_uncached_ratio: 1.5 is not in [0, 1]"}},
		{"negative timeout", minimalBackends + `
disaggregated_serving: {enabled: true, prefill_timeout: -1s}
`, nil, []string{`disaggregated_serving.prefill_timeout: invalid duration "-1s"`}},
		{"storage credentials from env", minimalBackends + `
disaggregated_serving:
  enabled: true
  default_external_storage: {endpoint: "http://kv:8080", credentials: "${KV_CREDENTIALS}"}
`, nil, []string{"disaggregated_serving.default_external_storage.credentials: environment variable KV_CREDENTIALS is not set"}},
		{"invalid yaml", "backends: [", nil, []string{"invalid YAML"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseConfig([]byte(tc.yaml), env(tc.env))
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error\n%v\ndoes not contain\n%s", err, w)
				}
			}
		})
	}
}

func TestEnvExpansion(t *testing.T) {
	cfg, err := parseConfig([]byte(minimalBackends+`
server:
  port: ${PORT}
admin:
  auth_token: "${TOKEN}"
response_cache:
  enabled: true
  backend: redis
  ttl: ${TTL:-30m}
  redis:
    url: "redis://:${REDIS_PASSWORD}@${REDIS_HOST:-localhost}:6379/0"
`), env(map[string]string{"PORT": "9090", "TOKEN": "s3cr3t-token", "REDIS_PASSWORD": "hunter2"}))
	if err != nil {
		t.Fatal(err)
	}
	if *cfg.Server.Port != 9090 || cfg.Admin.AuthToken != "s3cr3t-token" || time.Duration(cfg.ResponseCache.TTL) != 30*time.Minute {
		t.Errorf("expanded: port %d token %q ttl %v", *cfg.Server.Port, string(cfg.Admin.AuthToken), cfg.ResponseCache.TTL)
	}
	if got := string(cfg.ResponseCache.Redis.URL); got != "redis://:hunter2@localhost:6379/0" {
		t.Errorf("url %q", got)
	}
}

// The shipped example configurations load (with their environment) and so do the seeds' own.
func TestExampleConfigs(t *testing.T) {
	vars := map[string]string{"ADMIN_TOKEN": "t0ken", "S3_ENDPOINT": "http://127.0.0.1:7070",
		"S3_ACCESS_KEY": "AKIAEXAMPLE", "S3_SECRET_KEY": "wJalrXUtnFEMI/K7MDENG", "REDIS_URL": "redis://127.0.0.1:6379"}
	files, _ := filepath.Glob("configs/*.yaml")
	files = append(files, "testdata/seeds-all-tiers.yaml")
	if len(files) < 4 {
		t.Fatalf("configs: %v", files)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			cfg, err := parseConfig(data, env(vars))
			if err != nil {
				t.Fatal(err)
			}
			if len(cfg.Backends) == 0 {
				t.Error("no backends")
			}
		})
	}
	t.Run("all-tiers needs its secrets", func(t *testing.T) {
		data, _ := os.ReadFile("configs/all-tiers.yaml")
		_, err := parseConfig(data, env(map[string]string{"ADMIN_TOKEN": "x"}))
		if err == nil || !strings.Contains(err.Error(), "response_cache.l2.endpoint: environment variable S3_ENDPOINT is not set") {
			t.Errorf("err = %v", err)
		}
	})
	t.Run("seeds production example", func(t *testing.T) {
		data, _ := os.ReadFile("testdata/seeds-production.yaml")
		cfg, err := parseConfig(data, env(map[string]string{"VAST_ACCESS_KEY": "a", "VAST_SECRET_KEY": "b"}))
		if err != nil {
			t.Fatal(err)
		}
		ds := cfg.DisaggregatedServing
		if !ds.Enabled || time.Duration(ds.PrefillTimeout) != time.Minute || time.Duration(ds.KVTransferTimeout) != 15*time.Second ||
			!*ds.FallbackToUnified {
			t.Errorf("disaggregated_serving: %+v", ds)
		}
		roles := map[disagg.Role]int{}
		for _, b := range cfg.Backends {
			roles[b.role()]++
			if got := cfg.storageOf(&b); got.Endpoint != "http://vast-cluster.prod.example.com:8080" || got.Namespace != "prod/inference/kv-cache" {
				t.Errorf("%s: storage %v", b.Name, got)
			}
		}
		if roles[disagg.RolePrefill] != 2 || roles[disagg.RoleDecode] != 3 || roles[disagg.RoleUnified] != 1 {
			t.Errorf("roles %v", roles)
		}
	})
}

// Secrets never reach the logs: not through slog, fmt or JSON.
func TestSecretsRedacted(t *testing.T) {
	data, _ := os.ReadFile("configs/all-tiers.yaml")
	secret := "wJalrXUtnFEMI-K7MDENG-super-secret"
	cfg, err := parseConfig(data, env(map[string]string{"ADMIN_TOKEN": "admin-" + secret, "S3_ENDPOINT": "http://127.0.0.1:1",
		"S3_ACCESS_KEY": "AKIA-" + secret, "S3_SECRET_KEY": secret, "REDIS_URL": "redis://user:pw-" + secret + "@127.0.0.1:6379"}))
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	s := &server{cfg: cfg, log: slog.New(slog.NewJSONHandler(&buf, nil)), tokMode: "engine"}
	s.logConfig()
	s.log = slog.New(slog.NewTextHandler(&buf, nil))
	s.logConfig()
	fmt.Fprintf(&buf, "%v %+v %#v %s", cfg.ResponseCache.L2, cfg.ResponseCache.L2, cfg.ResponseCache.L2, cfg.Admin.AuthToken)
	if strings.Contains(buf.String(), secret) {
		t.Errorf("secret leaked:\n%s", buf.String())
	}
	if !strings.Contains(buf.String(), "[REDACTED]") {
		t.Errorf("no redaction marker:\n%s", buf.String())
	}
}

// Storage credentials of disaggregated serving never reach the logs either.
func TestDisaggSecretsRedacted(t *testing.T) {
	data, err := os.ReadFile("configs/disaggregated.yaml")
	if err != nil {
		t.Fatal(err)
	}
	secret := "kv-store-secret-9f3a"
	cfg, err := parseConfig(data, env(map[string]string{"S3_ACCESS_KEY": "AKIA-" + secret, "S3_SECRET_KEY": secret}))
	if err != nil {
		t.Fatal(err)
	}
	// decode-6 names the same storage itself, with an opaque credential.
	st := *cfg.DisaggregatedServing.DefaultExternalStorage
	st.Credentials = Secret("cred-" + secret)
	cfg.Backends[7].ExternalStorage = &st
	if err := cfg.validate(); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	s := &server{cfg: cfg, log: slog.New(slog.NewJSONHandler(&buf, nil)), tokMode: "engine"}
	s.logConfig()
	s.log = slog.New(slog.NewTextHandler(&buf, nil))
	s.logConfig()
	dc, err := disaggConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(&buf, "%v %+v %#v %v %+v %#v", st, st, st, dc.DefaultStorage, dc.DefaultStorage, dc.DefaultStorage)
	if strings.Contains(buf.String(), secret) {
		t.Errorf("secret leaked:\n%s", buf.String())
	}
	for _, want := range []string{"[REDACTED]", `"disaggregated_serving.default_external_storage":{"endpoint":"http://127.0.0.1:7070/kv-cache"`,
		"role=decode", "role=prefill"} {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("log lacks %s:\n%s", want, buf.String())
		}
	}
}
