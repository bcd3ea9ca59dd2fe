package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
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

func TestParseDefaults(t *testing.T) {
	cfg, err := Parse([]byte(minimalBackends), env(nil))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Addr() != "127.0.0.1:8080" {
		t.Errorf("addr %s", cfg.Addr())
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
	if rc := cfg.ResponseCache; rc.TenantHeader != "" || rc.SharedAcrossTenants || rc.AssumeGreedyDefault {
		t.Errorf("response cache tenant and sampling defaults: %+v", rc)
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
		{"tokenize cache bytes", minimalBackends + `
kv_cache_index:
  enabled: true
  tokenize_cache_bytes: -2
`, nil, []string{"kv_cache_index.tokenize_cache_bytes: -2: want a size in bytes"}},
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
		{"prefix_aware_hash without prefix routing", minimalBackends + `
selection_strategy: PrefixAwareHash
prefix_routing: {enabled: false}
`, nil, []string{`selection_strategy: prefix_aware_hash routes by prefix key: it needs prefix_routing.enabled`}},
		{"cache backend", minimalBackends + `
response_cache: {enabled: true, backend: disk}
`, nil, []string{`response_cache.backend: "disk" is not one of memory, redis, tiered`}},
		{"tenant header not a token", minimalBackends + `
response_cache: {enabled: true, tenant_header: "X Tenant"}
`, nil, []string{`response_cache.tenant_header: "X Tenant" is not a valid header name`}},
		{"admin token of spaces", minimalBackends + `
admin: {auth_token: "   "}
`, nil, []string{"admin.auth_token: is only whitespace"}},
		{"admin token of spaces from the environment", minimalBackends + `
admin:
  auth_token: ${ADMIN_TOKEN}
`, map[string]string{"ADMIN_TOKEN": " \t"}, []string{"admin.auth_token: is only whitespace"}},
		{"admin token with a trailing newline", minimalBackends + `
admin: {auth_token: "t0ken\n"}
`, nil, []string{"admin.auth_token: begins or ends with whitespace"}},
		{"admin token with a control character", minimalBackends + `
admin: {auth_token: "t0\u0001ken"}
`, nil, []string{"admin.auth_token: contains a control character"}},
		{"max decision age", minimalBackends + `
max_decision_age: 2d
`, nil, []string{"max_decision_age: 2d is above 1d"}},
		{"environment reference in a flow mapping", "server: {port: ${PORT:-18080}}\n" + minimalBackends, nil,
			[]string{`${PORT:-18080} inside a flow mapping {...} must be quoted, as "${PORT:-18080}" (line 1, column 16)`}},
		{"tenant header with a colon", minimalBackends + `
response_cache: {enabled: true, tenant_header: "X-Tenant:"}
`, nil, []string{`response_cache.tenant_header: "X-Tenant:" is not a valid header name`}},
		{"tenant header and shared", minimalBackends + `
response_cache: {enabled: true, tenant_header: X-Tenant-Id, shared_across_tenants: true}
`, nil, []string{`response_cache.tenant_header: set it or shared_across_tenants, not both`}},
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
			_, err := Parse([]byte(tc.yaml), env(tc.env))
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
	cfg, err := Parse([]byte(minimalBackends+`
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

// The shipped example configurations load (with their environment) and so do the deployment shapes of kvroute's reference.
func TestExampleConfigs(t *testing.T) {
	vars := map[string]string{"ADMIN_TOKEN": "t0ken", "S3_ENDPOINT": "http://127.0.0.1:7070",
		"S3_ACCESS_KEY": "AKIAEXAMPLE", "S3_SECRET_KEY": "wJalrXUtnFEMI/K7MDENG", "REDIS_URL": "redis://127.0.0.1:6379",
		"VAST_ACCESS_KEY": "a", "VAST_SECRET_KEY": "b"}
	files, _ := filepath.Glob("testdata/*.yaml")
	if len(files) < 6 {
		t.Fatalf("configs: %v", files)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			cfg, err := Parse(data, env(vars))
			if err != nil {
				t.Fatal(err)
			}
			if len(cfg.Backends) == 0 {
				t.Error("no backends")
			}
		})
	}
	t.Run("all-tiers needs its secrets", func(t *testing.T) {
		data, _ := os.ReadFile("testdata/all-tiers.yaml")
		_, err := Parse(data, env(map[string]string{"ADMIN_TOKEN": "x"}))
		if err == nil || !strings.Contains(err.Error(), "response_cache.l2.endpoint: environment variable S3_ENDPOINT is not set") {
			t.Errorf("err = %v", err)
		}
	})
	t.Run("seeds production example", func(t *testing.T) {
		data, _ := os.ReadFile("testdata/seeds-production.yaml")
		cfg, err := Parse(data, env(map[string]string{"VAST_ACCESS_KEY": "a", "VAST_SECRET_KEY": "b"}))
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
			roles[b.ParsedRole()]++
			if got := cfg.StorageOf(&b); got.Endpoint != "http://vast-cluster.prod.example.com:8080" || got.Namespace != "prod/inference/kv-cache" {
				t.Errorf("%s: storage %v", b.Name, got)
			}
		}
		if roles[disagg.RolePrefill] != 2 || roles[disagg.RoleDecode] != 3 || roles[disagg.RoleUnified] != 1 {
			t.Errorf("roles %v", roles)
		}
	})
}

// logEverything writes cfg to buf in every form a gateway might log it: slog's JSON and text
// handlers, fmt's verbs, and JSON.
func logEverything(t *testing.T, buf *bytes.Buffer, cfg *Config) {
	t.Helper()
	slog.New(slog.NewJSONHandler(buf, nil)).Info("configuration", "config", cfg, "l2", cfg.ResponseCache.L2,
		"redis", cfg.ResponseCache.Redis, "disaggregated_serving", cfg.DisaggregatedServing)
	slog.New(slog.NewTextHandler(buf, nil)).Info("configuration", "config", cfg, "l2", cfg.ResponseCache.L2,
		"redis", cfg.ResponseCache.Redis, "disaggregated_serving", cfg.DisaggregatedServing)
	for _, b := range cfg.Backends {
		slog.New(slog.NewTextHandler(buf, nil)).Info("backend", "name", b.Name, "url", RedactURL(b.URL),
			"role", b.ParsedRole().String(), "external_storage", cfg.StorageOf(&b))
	}
	fmt.Fprintf(buf, "%v %+v %#v %s\n", cfg, cfg, cfg, cfg.Admin.AuthToken)
	fmt.Fprintf(buf, "%v %+v %#v\n", cfg.ResponseCache.L2, cfg.ResponseCache.L2, cfg.ResponseCache.L2)
	j, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	buf.Write(j)
	buf.WriteString("\n" + RedactURL(string(cfg.ResponseCache.Redis.URL)) + "\n")
}

// Secrets never reach the logs: not through slog, fmt or JSON.
func TestSecretsRedacted(t *testing.T) {
	data, _ := os.ReadFile("testdata/all-tiers.yaml")
	secret := "wJalrXUtnFEMI-K7MDENG-super-secret"
	cfg, err := Parse(data, env(map[string]string{"ADMIN_TOKEN": "admin-" + secret, "S3_ENDPOINT": "http://127.0.0.1:1",
		"S3_ACCESS_KEY": "AKIA-" + secret, "S3_SECRET_KEY": secret, "REDIS_URL": "redis://user:pw-" + secret + "@127.0.0.1:6379"}))
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	logEverything(t, &buf, cfg)
	if strings.Contains(buf.String(), secret) {
		t.Errorf("secret leaked:\n%s", buf.String())
	}
	if !strings.Contains(buf.String(), "[REDACTED]") {
		t.Errorf("no redaction marker:\n%s", buf.String())
	}
}

// Storage credentials of disaggregated serving never reach the logs either, nor the Router's
// disaggregation config built from them.
func TestDisaggSecretsRedacted(t *testing.T) {
	data, err := os.ReadFile("testdata/disaggregated.yaml")
	if err != nil {
		t.Fatal(err)
	}
	secret := "kv-store-secret-9f3a"
	cfg, err := Parse(data, env(map[string]string{"S3_ACCESS_KEY": "AKIA-" + secret, "S3_SECRET_KEY": secret}))
	if err != nil {
		t.Fatal(err)
	}
	// decode-6 names the same storage itself, with an opaque credential.
	st := *cfg.DisaggregatedServing.DefaultExternalStorage
	st.Credentials = Secret("cred-" + secret)
	cfg.Backends[7].ExternalStorage = &st
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	logEverything(t, &buf, cfg)
	dc, err := cfg.DisaggConfig()
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(&buf, "%v %+v %#v %v %+v %#v", st, st, st, dc.DefaultStorage, dc.DefaultStorage, dc.DefaultStorage)
	j, err := json.Marshal(dc.DefaultStorage)
	if err != nil {
		t.Fatal(err)
	}
	buf.Write(j)
	if strings.Contains(buf.String(), secret) {
		t.Errorf("secret leaked:\n%s", buf.String())
	}
	for _, want := range []string{"[REDACTED]", `{"endpoint":"http://127.0.0.1:7070/kv-cache"`, "role=decode", "role=prefill"} {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("log lacks %s:\n%s", want, buf.String())
		}
	}
	// The library values still carry the credentials themselves.
	if dc.DefaultStorage.SecretKey != secret || cfg.StorageOf(&cfg.Backends[7]).Credentials != "cred-"+secret {
		t.Errorf("credentials lost: %q %q", dc.DefaultStorage.SecretKey, cfg.StorageOf(&cfg.Backends[7]).Credentials)
	}
}

// Load prefixes every error but a read error with the file's path (the proxy's -config error).
func TestLoad(t *testing.T) {
	cfg, err := Load("testdata/tier1.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Addr() != "127.0.0.1:8080" || len(cfg.Backends) != 2 {
		t.Errorf("addr %s, %d backends", cfg.Addr(), len(cfg.Backends))
	}
	path := filepath.Join(t.TempDir(), "bad.yaml")
	bad := "backends:\n  - {name: d, url: \"http://127.0.0.1:1\", role: decode}\n"
	if err := os.WriteFile(path, []byte(bad), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = Load(path)
	if err == nil || !strings.HasPrefix(err.Error(), path+": ") || !strings.Contains(err.Error(), "disaggregated_serving.enabled") {
		t.Errorf("err = %v", err)
	}
	if _, err := Load("testdata/does-not-exist.yaml"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
}

// A nil lookup expands nothing: defaults apply, a reference without one is an error.
func TestParseNilLookup(t *testing.T) {
	cfg, err := Parse([]byte("server: {port: \"${PORT:-9000}\"}\n"+minimalBackends), nil)
	if err != nil || *cfg.Server.Port != 9000 {
		t.Fatalf("%v %v", cfg, err)
	}
	if _, err := Parse([]byte("admin: {auth_token: \"${T}\"}\n"+minimalBackends), nil); err == nil ||
		!strings.Contains(err.Error(), "admin.auth_token: environment variable T is not set") {
		t.Errorf("err = %v", err)
	}
}

// Validate joins one error per problem, each starting with its field path.
func TestValidateJoinsErrors(t *testing.T) {
	_, err := Parse([]byte("server: {port: 70000, max_body_bytes: -1}\n"), env(nil))
	u, ok := err.(interface{ Unwrap() []error })
	if !ok {
		t.Fatalf("%T %v", err, err)
	}
	var paths []string
	for _, e := range u.Unwrap() {
		p, _, _ := strings.Cut(e.Error(), ":")
		paths = append(paths, p)
	}
	if got := strings.Join(paths, ","); got != "server.port,server.max_body_bytes,backends" {
		t.Errorf("paths %s", got)
	}
}

func TestBackendHelpers(t *testing.T) {
	cfg, err := Parse([]byte(`
server: {host: 0.0.0.0, port: 0}
backends:
  - {name: one, url: "http://a", model: m-1}
  - {name: many, url: "http://b", models: [m-2, m-3]}
  - {name: any, url: "http://c"}
`), env(nil))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Addr() != "0.0.0.0:0" {
		t.Errorf("addr %s", cfg.Addr())
	}
	one, many, anyModel := cfg.Backend("one"), cfg.Backend("many"), cfg.Backend("any")
	if one != &cfg.Backends[0] || many != &cfg.Backends[1] || anyModel != &cfg.Backends[2] || cfg.Backend("none") != nil {
		t.Fatal("Backend")
	}
	for _, tc := range []struct {
		b     *BackendConfig
		model string
		want  bool
	}{
		{one, "m-1", true}, {one, "m-2", false}, {many, "m-3", true}, {many, "m-1", false}, {anyModel, "whatever", true},
	} {
		if got := tc.b.Serves(tc.model); got != tc.want {
			t.Errorf("%s.Serves(%s) = %v", tc.b.Name, tc.model, got)
		}
	}
	if one.ModelName() != "m-1" || many.ModelName() != "m-2" || anyModel.ModelName() != "" {
		t.Errorf("models %q %q %q", one.ModelName(), many.ModelName(), anyModel.ModelName())
	}
	if one.ParsedRole() != disagg.RoleUnified {
		t.Errorf("role %v", one.ParsedRole())
	}
	var none *ExternalStorageConfig
	if !none.Location().IsZero() || !cfg.StorageOf(one).IsZero() {
		t.Error("no storage is not the zero location")
	}
	st := &ExternalStorageConfig{Endpoint: "http://s3:9000/", Bucket: "kv", KVNamespace: "ns"}
	if l := st.Location(); l.Endpoint != "http://s3:9000/kv" || l.Namespace != "ns" {
		t.Errorf("location %v", l)
	}
}

// The tokenizer and speculation defaults follow the event sources; event sources take their
// backend's model.
func TestKVDefaults(t *testing.T) {
	for _, tc := range []struct {
		name, sources, tokenizer, want, speculation string
	}{
		{"no sources", "", "", TokenizerEstimate, "approximate"},
		{"auto, no sources", "", "auto", TokenizerEstimate, "approximate"},
		{"ZMQ", `[{backend_name: vllm-1, endpoint: "tcp://127.0.0.1:5557"}]`, "", TokenizerEngine, "speculate"},
		{"SSE", `[{backend_name: vllm-1, endpoint: "http://127.0.0.1:8001/v1/kv_events"}]`, "", TokenizerNone, "speculate"},
		{"mixed", `[{backend_name: vllm-1, endpoint: "http://127.0.0.1:8001/v1/kv_events"}, {endpoint: "tcp://127.0.0.1:5557", bind: true, backend_name: vllm-2}]`,
			"", TokenizerEngine, "speculate"},
		{"explicit", `[{backend_name: vllm-1, endpoint: "tcp://127.0.0.1:5557"}]`, "estimate", TokenizerEstimate, "speculate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			y := `
backends:
  - {name: vllm-1, url: "http://127.0.0.1:8001", model: llama}
  - {name: vllm-2, url: "http://127.0.0.1:8002", model: llama}
kv_cache_index:
  enabled: true
`
			if tc.sources != "" {
				y += "  event_sources: " + tc.sources + "\n"
			}
			if tc.tokenizer != "" {
				y += "  tokenizer: " + tc.tokenizer + "\n"
			}
			cfg, err := Parse([]byte(y), env(nil))
			if err != nil {
				t.Fatal(err)
			}
			kv := cfg.KVCacheIndex
			if kv.Tokenizer != tc.want || kv.Speculation != tc.speculation {
				t.Errorf("tokenizer %q speculation %q, want %q %q", kv.Tokenizer, kv.Speculation, tc.want, tc.speculation)
			}
			for _, es := range kv.EventSources {
				if es.BackendName == "vllm-1" && es.Model != "llama" {
					t.Errorf("source model %q", es.Model)
				}
			}
		})
	}
	if _, err := Parse([]byte(minimalBackends+"kv_cache_index: {enabled: true, tokenizer: bpe}\n"), env(nil)); err == nil ||
		!strings.Contains(err.Error(), `kv_cache_index.tokenizer: "bpe" is not one of auto, engine, estimate, none`) {
		t.Errorf("err = %v", err)
	}
}

// ApplyDefaults is idempotent.
func TestApplyDefaultsIdempotent(t *testing.T) {
	cfg, err := Parse([]byte(minimalBackends), env(nil))
	if err != nil {
		t.Fatal(err)
	}
	before, _ := json.Marshal(cfg)
	cfg.ApplyDefaults()
	after, _ := json.Marshal(cfg)
	if !bytes.Equal(before, after) {
		t.Errorf("before %s\nafter  %s", before, after)
	}
}
