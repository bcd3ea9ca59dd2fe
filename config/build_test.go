package config

import (
	"bytes"
	"cmp"
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/events/zmqevents"
	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/kvindex/redisindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/scorer"
)

// Integration environment: internal/testenv's REDIS_ADDR and S3_* variables, and
// KVROUTE_REQUIRE_INTEGRATION=1 to turn every skip for a missing server into a failure.

// s3Env returns the S3_* variables (testenv.S3) as YAML variables, or skips.
func s3Env(t testing.TB) map[string]string {
	t.Helper()
	e := testenv.S3(t)
	return map[string]string{"S3_ENDPOINT": e.Endpoint, "S3_ACCESS_KEY": e.AccessKey, "S3_SECRET_KEY": e.SecretKey,
		"S3_BUCKET": e.Bucket}
}

// mustParse parses yaml with vars or fails t.
func mustParse(t testing.TB, yaml string, vars map[string]string) *Config {
	t.Helper()
	cfg, err := Parse([]byte(yaml), env(vars))
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// mustLoad reads testdata/name and parses it with vars.
func mustLoad(t testing.TB, name string, vars map[string]string) *Config {
	t.Helper()
	data, err := os.ReadFile("testdata/" + name)
	if err != nil {
		t.Fatal(err)
	}
	return mustParse(t, string(data), vars)
}

func TestParseStrategy(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want kvroute.Strategy
		ok   bool
	}{
		{"", "", true},
		{"prefix_aware_hash", kvroute.StrategyPrefixAwareHash, true},
		{"PrefixAwareHash", kvroute.StrategyPrefixAwareHash, true},
		{"round_robin", kvroute.StrategyRoundRobin, true},
		{"RoundRobin", kvroute.StrategyRoundRobin, true},
		{"least_loaded", kvroute.StrategyLeastLoaded, true},
		{"LeastConnections", kvroute.StrategyLeastLoaded, true},
		{"random", kvroute.StrategyRandom, true},
		{"least-latency", kvroute.StrategyLeastLatency, true},
		{"LeastLatency", kvroute.StrategyLeastLatency, true},
		{"Fastest", "", false},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, ok := ParseStrategy(tc.in)
			if got != tc.want || ok != tc.ok {
				t.Errorf("ParseStrategy(%q) = %q, %v; want %q, %v", tc.in, got, ok, tc.want, tc.ok)
			}
		})
	}
}

// Every selection_strategy the configuration accepts is one the Router accepts, under the same
// name: one vocabulary from the YAML file to the Router's stats.
func TestSelectionStrategyReachesRouter(t *testing.T) {
	for in, want := range map[string]string{"": "round_robin", "round_robin": "round_robin", "LeastConnections": "least_loaded",
		"random": "random", "LeastLatency": "least_latency", "prefix_aware_hash": "prefix_aware_hash", "PrefixAwareHash": "prefix_aware_hash"} {
		t.Run(in, func(t *testing.T) {
			cfg := mustParse(t, minimalBackends+"selection_strategy: \""+in+"\"\n", nil)
			rcfg, err := cfg.RouterConfig(Options{})
			if err != nil {
				t.Fatal(err)
			}
			r, err := kvroute.New(rcfg)
			if err != nil {
				t.Fatalf("the Router refuses what the configuration accepts: %v", err)
			}
			defer r.Close()
			if got := cmp.Or(rcfg.Strategy, kvroute.DefaultStrategy); string(got) != want {
				t.Errorf("the Router's strategy is %q, want %q", got, want)
			}
		})
	}
}

// Tier 1: the backends, the ring's settings and the strategy reach the Router, which builds.
func TestRouterConfigTier1(t *testing.T) {
	cfg := mustLoad(t, "tier1.yaml", nil)
	rcfg, err := cfg.RouterConfig(Options{})
	if err != nil {
		t.Fatal(err)
	}
	if rcfg.DisablePrefixRouting || rcfg.MaxPrefixLength != 1024 || rcfg.LoadFactorEpsilon != 0.25 || rcfg.VirtualNodes != 150 ||
		rcfg.Strategy != kvroute.StrategyRoundRobin || rcfg.KV != nil || rcfg.Disagg != nil || rcfg.MeterProvider != nil {
		t.Errorf("router config %+v", rcfg)
	}
	if len(rcfg.Backends) != 2 || rcfg.Backends[0].Name != "vllm-1" || rcfg.Backends[1].Name != "vllm-2" ||
		rcfg.Backends[0].Weight != 1 || rcfg.Backends[0].Role != disagg.RoleUnified || rcfg.Backends[0].Storage != nil {
		t.Errorf("backends %+v", rcfg.Backends)
	}
	r, err := kvroute.New(rcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	req, err := prefixkey.ParseOpenAIChat([]byte(`{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	d, err := r.Route(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Done(kvroute.Outcome{})
	if d.Reason != kvroute.ReasonPrefixHash {
		t.Errorf("reason %s", d.Reason)
	}

	off := mustParse(t, minimalBackends+"prefix_routing: {enabled: false}\nselection_strategy: LeastLatency\n", nil)
	if rcfg, _ := off.RouterConfig(Options{}); !rcfg.DisablePrefixRouting || rcfg.Strategy != kvroute.StrategyLeastLatency {
		t.Errorf("prefix routing off: %+v", rcfg)
	}
}

// max_decision_age reaches the Router: its default, a value, and 0 as the library's "off"; the
// Router logs through Options.Logger.
func TestRouterConfigMaxDecisionAge(t *testing.T) {
	for in, want := range map[string]time.Duration{"": kvroute.DefaultMaxDecisionAge,
		"max_decision_age: 2h\n": 2 * time.Hour, "max_decision_age: 0\n": -1} {
		rcfg, err := mustParse(t, minimalBackends+in, nil).RouterConfig(Options{})
		if err != nil {
			t.Fatal(err)
		}
		if rcfg.MaxDecisionAge != want || rcfg.Logger == nil {
			t.Errorf("%q: MaxDecisionAge %v, want %v (logger %v)", in, rcfg.MaxDecisionAge, want, rcfg.Logger)
		}
		r, err := kvroute.New(rcfg)
		if err != nil {
			t.Fatalf("%q: %v", in, err)
		}
		_ = r.Close()
	}
}

// Disaggregated serving: roles, storage, timeouts, thresholds and the scorer reach the Router,
// which builds with tier 4 on.
func TestRouterConfigDisaggregated(t *testing.T) {
	cfg := mustLoad(t, "disaggregated.yaml", map[string]string{"S3_ACCESS_KEY": "AKIA", "S3_SECRET_KEY": "secret"})
	// One backend names its own storage: it reaches the Router as that backend's Storage.
	own := *cfg.DisaggregatedServing.DefaultExternalStorage
	own.KVNamespace = "inference/kv-cache"
	cfg.Backends[7].ExternalStorage = &own
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	rcfg, err := cfg.RouterConfig(Options{})
	if err != nil {
		t.Fatal(err)
	}
	roles := map[disagg.Role]int{}
	for _, b := range rcfg.Backends {
		roles[b.Role]++
	}
	if roles[disagg.RolePrefill] != 2 || roles[disagg.RoleDecode] != 6 || roles[disagg.RoleUnified] != 1 {
		t.Errorf("roles %v", roles)
	}
	if st := rcfg.Backends[7].Storage; st == nil || st.Endpoint != "http://127.0.0.1:7070/kv-cache" || rcfg.Backends[6].Storage != nil {
		t.Errorf("storage of decode-6 %v, of decode-5 %v", st, rcfg.Backends[6].Storage)
	}
	dc := rcfg.Disagg
	if dc == nil {
		t.Fatal("no Disagg")
	}
	if dc.PrefillTimeout != time.Minute || dc.KVTransferTimeout != 15*time.Second || dc.DisableFallback || dc.DisableConditional ||
		dc.MaxUncachedTokens != 512 || dc.MaxUncachedRatio != 0.1 || dc.Scorer == nil {
		t.Errorf("disagg config %+v", dc)
	}
	if dc.DefaultStorage.Endpoint != "http://127.0.0.1:7070/kv-cache" || dc.DefaultStorage.Namespace != "inference/kv-cache" ||
		dc.DefaultStorage.AccessKey != "AKIA" || dc.DefaultStorage.SecretKey != "secret" {
		t.Errorf("default storage %#v", dc.DefaultStorage)
	}

	ix, closeIndex, err := cfg.NewKVIndex()
	if err != nil {
		t.Fatal(err)
	}
	defer closeIndex()
	rcfg.KV = cfg.KVConfig(ix, nil)
	r, err := kvroute.New(rcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if got, ok := r.Disagg().Config(); !ok || got.MaxUncachedTokens != 512 {
		t.Errorf("router's disagg config %+v, %v", got, ok)
	}
}

// The YAML's 0 turns a conditional test off; the library spells that with a negative value.
// Without tier 4 the library's default scorer is used.
func TestDisaggConfigConventions(t *testing.T) {
	cfg := mustParse(t, `
disaggregated_serving:
  enabled: true
  fallback_to_unified: false
  conditional: {enabled: false, max_uncached_tokens: 0, max_uncached_ratio: 0}
backends:
  - {name: p, url: "http://p", role: prefill}
  - {name: d, url: "http://d", role: decode}
`, nil)
	dc, err := cfg.DisaggConfig()
	if err != nil {
		t.Fatal(err)
	}
	if dc.MaxUncachedTokens != -1 || dc.MaxUncachedRatio != -1 || !dc.DisableFallback || !dc.DisableConditional ||
		dc.Scorer != nil || !dc.DefaultStorage.IsZero() {
		t.Errorf("%+v", dc)
	}
	off := mustParse(t, minimalBackends, nil)
	if dc, err := off.DisaggConfig(); dc != nil || err != nil {
		t.Errorf("disabled: %+v, %v", dc, err)
	}
}

// missThenHit sends one cacheable chat completion twice through c and checks that the first is a
// MISS served by the handler and the second a HIT served from the store; then it clears c.
func missThenHit(t *testing.T, c *respcache.Cache) {
	t.Helper()
	calls := 0
	h := c.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls++
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"choices":[{"message":{"role":"assistant","content":"hello"}}]}`))
	}))
	body := `{"model":"m","temperature":0,"messages":[{"role":"user","content":"cache me ` + testenv.RandHex() + `"}]}`
	var got []string
	for range 2 {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body)))
		if rec.Code != http.StatusOK || !strings.Contains(rec.Body.String(), "hello") {
			t.Fatalf("%d %s", rec.Code, rec.Body)
		}
		got = append(got, rec.Header().Get(respcache.HeaderXCache))
	}
	if calls != 1 || got[0] != "MISS" || got[1] != "HIT" {
		t.Errorf("X-Cache %v, %d handler calls; want MISS then HIT, 1 call", got, calls)
	}
	if _, err := c.Invalidate(context.Background(), respcache.InvalidateRequest{ClearAll: true}); err != nil {
		t.Errorf("clear: %v", err)
	}
}

// cacheDispositions sends body to c's middleware once per header set (pairs of name, value) and
// returns the X-Cache of each response.
func cacheDispositions(t *testing.T, c *respcache.Cache, body string, hdrs ...[]string) []string {
	t.Helper()
	h := c.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"choices":[{"message":{"role":"assistant","content":"hello"}}]}`))
	}))
	var got []string
	for _, hdr := range hdrs {
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
		for i := 0; i+1 < len(hdr); i += 2 {
			r.Header.Set(hdr[i], hdr[i+1])
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		got = append(got, rec.Header().Get(respcache.HeaderXCache))
	}
	return got
}

// TestNewResponseCacheTenantsAndSampling checks the mapping of tenant_header,
// shared_across_tenants and assume_greedy_default onto the cache's behaviour.
func TestNewResponseCacheTenantsAndSampling(t *testing.T) {
	t0 := `{"model":"m","temperature":0,"messages":[{"role":"user","content":"tenants"}]}`
	noT := `{"model":"m","messages":[{"role":"user","content":"no temperature"}]}`
	alice, bob := []string{"Authorization", "Bearer alice"}, []string{"Authorization", "Bearer bob"}
	for _, tc := range []struct {
		name, yaml, body string
		hdrs             [][]string
		want             []string
	}{
		{"default: credentials are tenants", ``, t0,
			[][]string{alice, bob, alice, {"x-api-key", "k1"}, {"x-api-key", "k2"}},
			[]string{"MISS", "MISS", "HIT", "MISS", "MISS"}},
		{"tenant_header decides", `tenant_header: x-tenant-id`, t0,
			[][]string{append([]string{"X-Tenant-Id", "acme"}, alice...), append([]string{"X-Tenant-Id", "acme"}, bob...),
				append([]string{"X-Tenant-Id", "globex"}, alice...)},
			[]string{"MISS", "HIT", "MISS"}},
		{"shared_across_tenants", `shared_across_tenants: true`, t0,
			[][]string{alice, bob, nil}, []string{"MISS", "HIT", "HIT"}},
		{"default: no temperature is not cached", ``, noT,
			[][]string{alice, alice}, []string{"BYPASS", "BYPASS"}},
		{"assume_greedy_default", `assume_greedy_default: true`, noT,
			[][]string{alice, alice, bob}, []string{"MISS", "HIT", "MISS"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := mustParse(t, minimalBackends+"response_cache:\n  enabled: true\n  "+tc.yaml+"\n", nil)
			c, closeAll, err := cfg.NewResponseCache(Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer closeAll()
			if got := cacheDispositions(t, c, tc.body, tc.hdrs...); !slices.Equal(got, tc.want) {
				t.Errorf("X-Cache %v, want %v", got, tc.want)
			}
		})
	}
	t.Run("invalid tenant_header in an unvalidated Config", func(t *testing.T) {
		cfg := mustParse(t, minimalBackends+"response_cache: {enabled: true}\n", nil)
		cfg.ResponseCache.TenantHeader = "bad header"
		c, closeAll, err := cfg.NewResponseCache(Options{})
		if err == nil || c != nil || closeAll != nil || !strings.HasPrefix(err.Error(), "response_cache.tenant_header:") {
			t.Fatalf("%v %v", c, err)
		}
	})
}

func TestNewResponseCache(t *testing.T) {
	t.Run("disabled", func(t *testing.T) {
		c, closeAll, err := mustParse(t, minimalBackends, nil).NewResponseCache(Options{})
		if c != nil || closeAll == nil || err != nil {
			t.Fatalf("%v %v", c, err)
		}
		if err := closeAll(); err != nil {
			t.Error(err)
		}
	})
	t.Run("memory", func(t *testing.T) {
		cfg := mustParse(t, minimalBackends+`
response_cache: {enabled: true, capacity: 7, ttl: 2m, max_response_size: 4096, cache_streaming: false}
`, nil)
		c, closeAll, err := cfg.NewResponseCache(Options{})
		if err != nil {
			t.Fatal(err)
		}
		missThenHit(t, c)
		st := c.Stats(context.Background())
		if st.BackendType != "memory" || st.Capacity != 7 || st.Config.TTL != "2m" || st.Config.MaxResponseSize != 4096 {
			t.Errorf("stats %+v", st)
		}
		if err := closeAll(); err != nil {
			t.Error(err)
		}
		if err := closeAll(); err != nil {
			t.Errorf("second close: %v", err)
		}
	})
	t.Run("redis", func(t *testing.T) {
		addr := testenv.RedisAddr(t)
		var logs bytes.Buffer
		cfg := mustParse(t, minimalBackends+`
response_cache:
  enabled: true
  backend: redis
  redis: {url: "redis://${REDIS_ADDR}", key_prefix: "${PREFIX}"}
`, map[string]string{"REDIS_ADDR": addr, "PREFIX": "kvroute-test:config:" + testenv.RandHex() + ":"})
		c, closeAll, err := cfg.NewResponseCache(Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		defer closeAll()
		if st := c.Stats(context.Background()); st.BackendType != "redis" || st.Redis == nil {
			t.Errorf("stats %+v", st)
		}
		missThenHit(t, c)
	})
	t.Run("redis unreachable without fallback", func(t *testing.T) {
		cfg := mustParse(t, minimalBackends+`
response_cache:
  enabled: true
  backend: redis
  redis: {url: "redis://user:hunter2@127.0.0.1:${PORT}", fallback_to_memory: false, connect_timeout_ms: 200}
`, map[string]string{"PORT": freePort(t)})
		c, closeAll, err := cfg.NewResponseCache(Options{})
		if err == nil {
			closeAll()
			t.Fatal("no error")
		}
		if c != nil || closeAll != nil || !strings.HasPrefix(err.Error(), "response_cache.redis (redis://user:xxxxx@127.0.0.1:") ||
			strings.Contains(err.Error(), "hunter2") {
			t.Errorf("%v %v", c, err)
		}
	})
	t.Run("tiered", func(t *testing.T) {
		vars := s3Env(t)
		vars["PREFIX"] = "kvroute-test/config/" + testenv.RandHex() + "/"
		cfg := mustParse(t, minimalBackends+`
response_cache:
  enabled: true
  backend: tiered
  l1: {type: memory, max_value_size: 1024}
  l2:
    type: s3
    endpoint: "${S3_ENDPOINT}"
    bucket: "${S3_BUCKET}"
    key_prefix: "${PREFIX}"
    access_key: "${S3_ACCESS_KEY}"
    secret_key: "${S3_SECRET_KEY}"
    ttl_override: 7d
  tiered: {promote_on_hit: false}
`, vars)
		c, closeAll, err := cfg.NewResponseCache(Options{})
		if err != nil {
			t.Fatal(err)
		}
		defer closeAll()
		if st := c.Stats(context.Background()); st.BackendType != "tiered" {
			t.Errorf("stats %+v", st)
		}
		missThenHit(t, c)
	})
	t.Run("tiered on redis", func(t *testing.T) {
		vars := s3Env(t)
		vars["REDIS_ADDR"] = testenv.RedisAddr(t)
		vars["PREFIX"] = testenv.RandHex()
		cfg := mustParse(t, minimalBackends+`
response_cache:
  enabled: true
  backend: tiered
  redis: {url: "redis://${REDIS_ADDR}", key_prefix: "kvroute-test:config:${PREFIX}:"}
  l1: {type: redis}
  l2: {type: s3, endpoint: "${S3_ENDPOINT}", bucket: "${S3_BUCKET}", key_prefix: "kvroute-test/config/${PREFIX}/",
       access_key: "${S3_ACCESS_KEY}", secret_key: "${S3_SECRET_KEY}"}
`, vars)
		c, closeAll, err := cfg.NewResponseCache(Options{})
		if err != nil {
			t.Fatal(err)
		}
		defer closeAll()
		if st := c.Stats(context.Background()); st.BackendType != "tiered" || st.Redis == nil {
			t.Errorf("stats %+v", st)
		}
		missThenHit(t, c)
	})
	t.Run("tiered with a missing bucket", func(t *testing.T) {
		vars := s3Env(t)
		vars["S3_BUCKET"] = "kvroute-no-such-bucket-" + testenv.RandHex()
		cfg := mustParse(t, minimalBackends+`
response_cache:
  enabled: true
  backend: tiered
  l2: {type: s3, endpoint: "${S3_ENDPOINT}", bucket: "${S3_BUCKET}", access_key: "${S3_ACCESS_KEY}", secret_key: "${S3_SECRET_KEY}"}
`, vars)
		_, _, err := cfg.NewResponseCache(Options{})
		if err == nil || !strings.HasPrefix(err.Error(), "response_cache.l2: ") {
			t.Errorf("err = %v", err)
		}
	})
}

func TestNewKVIndex(t *testing.T) {
	t.Run("disabled", func(t *testing.T) {
		ix, closeIndex, err := mustParse(t, minimalBackends, nil).NewKVIndex()
		if ix != nil || closeIndex == nil || err != nil {
			t.Fatalf("%v %v", ix, err)
		}
		if err := closeIndex(); err != nil {
			t.Error(err)
		}
	})
	t.Run("memory", func(t *testing.T) {
		cfg := mustParse(t, `
backends:
  - {name: a, url: "http://a", models: [m-a, m-b]}
kv_cache_index: {enabled: true, max_entries: 500, entry_ttl_seconds: 60, block_size: 32}
`, nil)
		ix, closeIndex, err := cfg.NewKVIndex()
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := ix.(*kvindex.MemoryIndex); !ok {
			t.Errorf("index %T", ix)
		}
		if _, err := ix.Stats(context.Background()); err != nil {
			t.Error(err)
		}
		if err := closeIndex(); err != nil {
			t.Error(err)
		}
	})
	t.Run("redis on the response cache's URL", func(t *testing.T) {
		addr := testenv.RedisAddr(t)
		cfg := mustParse(t, minimalBackends+`
response_cache: {redis: {url: "redis://${REDIS_ADDR}"}}
kv_cache_index: {enabled: true, backend: redis, redis: {key_prefix: "${PREFIX}"}}
`, map[string]string{"REDIS_ADDR": addr, "PREFIX": "kvroute-test:config:kvidx:" + testenv.RandHex() + ":"})
		ix, closeIndex, err := cfg.NewKVIndex()
		if err != nil {
			t.Fatal(err)
		}
		defer closeIndex()
		if _, ok := ix.(*redisindex.Index); !ok {
			t.Errorf("index %T", ix)
		}
		if _, err := ix.Stats(context.Background()); err != nil {
			t.Error(err)
		}
	})
	t.Run("bad redis url", func(t *testing.T) {
		cfg := mustParse(t, minimalBackends+`
kv_cache_index: {enabled: true, backend: redis, redis: {url: "redis://u:hunter2@127.0.0.1:6379/not-a-db"}}
`, nil)
		ix, closeIndex, err := cfg.NewKVIndex()
		if err == nil {
			closeIndex()
			t.Skip("the library accepted the URL")
		}
		if ix != nil || !strings.HasPrefix(err.Error(), "kv_cache_index (redis redis://u:xxxxx@127.0.0.1:6379/not-a-db): ") ||
			strings.Contains(err.Error(), "hunter2") {
			t.Errorf("%v", err)
		}
	})
}

func TestKVConfig(t *testing.T) {
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close()
	tok := prefixkey.EstimateTokenizer{}
	for _, tc := range []struct {
		name, yaml string
		tok        prefixkey.Tokenizer
		check      func(t *testing.T, kc *kvroute.KVConfig)
	}{
		{"disabled", minimalBackends, tok, func(t *testing.T, kc *kvroute.KVConfig) {
			if kc != nil {
				t.Errorf("%+v", kc)
			}
		}},
		{"no sources: estimate, approximate", minimalBackends + "kv_cache_index: {enabled: true}\n", nil,
			func(t *testing.T, kc *kvroute.KVConfig) {
				if _, ok := kc.Tokenizer.(prefixkey.EstimateTokenizer); !ok || kc.Speculation != kvroute.SpeculationApproximate ||
					kc.UsePrefixEntries || kc.BlockSize != kvindex.DefaultBlockSize || kc.Index != ix {
					t.Errorf("%+v", kc)
				}
			}},
		{"SSE sources: none, prefix entries", minimalBackends + `
kv_cache_index:
  enabled: true
  block_size: 32
  event_sources: [{backend_name: vllm-1, endpoint: "http://127.0.0.1:8001/v1/kv_events"}]
  scoring: {overlap_weight: 0.5, load_weight: 0.5, health_weight: 0, min_overlap_threshold: 0.2, load_factor_epsilon: 0.5}
`, tok, func(t *testing.T, kc *kvroute.KVConfig) {
			if kc.Tokenizer != nil || kc.Speculation != kvroute.SpeculationOn || !kc.UsePrefixEntries || kc.BlockSize != 32 ||
				kc.MinOverlapThreshold != 0.2 || kc.LoadFactorEpsilon != 0.5 {
				t.Errorf("%+v", kc)
			}
			comp, ok := kc.Scorer.(*scorer.Composite)
			if !ok {
				t.Fatalf("Scorer %T, want the composite", kc.Scorer)
			}
			if w := comp.Config(); w.OverlapWeight != 0.5 || w.LoadWeight != 0.5 || w.HealthWeight != 0 || w.MinOverlapThreshold != 0.2 {
				t.Errorf("%+v", w)
			}
		}},
		{"ZMQ sources: engine, caller's tokenizer", minimalBackends + `
kv_cache_index:
  enabled: true
  speculation: "off"
  event_sources: [{backend_name: vllm-1, endpoint: "tcp://127.0.0.1:5557"}]
`, tok, func(t *testing.T, kc *kvroute.KVConfig) {
			if kc.Tokenizer != tok || kc.Speculation != kvroute.SpeculationOff || kc.UsePrefixEntries ||
				kc.LoadFactorEpsilon != kvroute.DefaultKVLoadFactorEpsilonExpectedTTFT {
				t.Errorf("%+v", kc)
			}
			if _, ok := kc.Scorer.(*scorer.ExpectedTTFT); !ok {
				t.Errorf("%+v", kc)
			}
		}},
		{"engine without a tokenizer", minimalBackends + "kv_cache_index: {enabled: true, tokenizer: engine}\n", nil,
			func(t *testing.T, kc *kvroute.KVConfig) {
				if kc.Tokenizer != nil {
					t.Errorf("%+v", kc)
				}
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.check(t, mustParse(t, tc.yaml, nil).KVConfig(ix, tc.tok))
		})
	}
}

// freePort returns a TCP port on 127.0.0.1 that nothing listens on (at the time of the call), as
// a YAML variable.
func freePort(t testing.TB) string { return strconv.Itoa(testenv.FreePort(t)) }

// The consumers build, start over loopback (nothing answers the connect-mode endpoints) and
// close.
func TestNewEventConsumers(t *testing.T) {
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close()
	const backends = `
backends:
  - {name: a, url: "http://127.0.0.1:8001", model: m-a}
  - {name: b, url: "http://127.0.0.1:8002", model: m-b}
  - {name: c, url: "http://127.0.0.1:8003", model: m-c}
`
	for _, tc := range []struct {
		name, sources string
		want          []string // the consumers' transports, in order
		statuses      []int    // Status lengths after Start
	}{
		{"zmq connect", `
    - {backend_name: a, endpoint: "tcp://127.0.0.1:${P1}", replay_endpoint: "tcp://127.0.0.1:${P2}", reconnect_interval_ms: 50}
    - {backend_name: b, endpoint: "tcp://127.0.0.1:${P2}"}
`, []string{"zmq"}, []int{2}},
		{"zmq bind", `
    - {endpoint: "tcp://127.0.0.1:0", bind: true, topic_backends: {"kv@x@m": a}}
`, []string{"zmq bind"}, []int{0}},
		{"sse", `
    - {backend_name: a, endpoint: "http://127.0.0.1:${P1}/v1/kv_events", reconnect_interval_ms: 2000}
    - {backend_name: b, endpoint: "http://127.0.0.1:${P2}/v1/kv_events"}
`, []string{"sse"}, []int{2}},
		{"all three", `
    - {backend_name: a, endpoint: "tcp://127.0.0.1:${P1}"}
    - {endpoint: "tcp://127.0.0.1:0", bind: true, backend_name: b}
    - {backend_name: c, endpoint: "http://127.0.0.1:${P2}/v1/kv_events"}
`, []string{"sse", "zmq", "zmq bind"}, []int{1, 1, 0}},
		{"several bound endpoints, one consumer", `
    - {endpoint: "tcp://127.0.0.1:0", bind: true, backend_name: a}
    - {endpoint: "tcp://127.0.0.1:0", bind: true, backend_name: b}
    - {endpoint: "tcp://127.0.0.1:0", bind: true}
`, []string{"zmq bind"}, []int{0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := mustParse(t, backends+"kv_cache_index:\n  enabled: true\n  event_sources:"+tc.sources,
				map[string]string{"P1": freePort(t), "P2": freePort(t)})
			cons, err := cfg.NewEventConsumers(ix, Options{})
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, c := range cons {
				switch c := c.(type) {
				case *events.SSEConsumer:
					got = append(got, "sse")
				case *zmqevents.Consumer:
					if _, ok := c.Listener(); ok {
						got = append(got, "zmq bind")
					} else {
						got = append(got, "zmq")
					}
				default:
					t.Errorf("consumer %T", c)
				}
			}
			if strings.Join(got, ",") != strings.Join(tc.want, ",") {
				t.Fatalf("consumers %v, want %v", got, tc.want)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			for i, c := range cons {
				if err := c.Start(ctx); err != nil {
					t.Fatalf("%s: Start: %v", got[i], err)
				}
				if n := len(c.Status()); n != tc.statuses[i] {
					t.Errorf("%s: %d statuses, want %d: %+v", got[i], n, tc.statuses[i], c.Status())
				}
				if z, ok := c.(*zmqevents.Consumer); ok && got[i] == "zmq bind" {
					if n := strings.Count(tc.sources, "bind: true"); len(z.Addrs()) != n || len(z.Listeners()) != n {
						t.Errorf("bound consumer has addresses %v and listeners %+v, want %d", z.Addrs(), z.Listeners(), n)
					}
				}
			}
			for i, c := range cons {
				if err := c.Close(); err != nil {
					t.Errorf("%s: Close: %v", got[i], err)
				}
				if err := c.Close(); err != nil {
					t.Errorf("%s: second Close: %v", got[i], err)
				}
			}
		})
	}

	t.Run("disabled or no sources", func(t *testing.T) {
		for _, y := range []string{backends, backends + "kv_cache_index: {enabled: true}\n"} {
			if cons, err := mustParse(t, y, nil).NewEventConsumers(ix, Options{}); cons != nil || err != nil {
				t.Errorf("%v %v", cons, err)
			}
		}
	})
	t.Run("error names the transport", func(t *testing.T) {
		cfg := mustParse(t, backends+`
kv_cache_index:
  enabled: true
  event_sources: [{backend_name: a, endpoint: "tcp://127.0.0.1:1"}]
`, nil)
		cons, err := cfg.NewEventConsumers(nil, Options{})
		if err == nil || cons != nil || !strings.HasPrefix(err.Error(), "kv_cache_index.event_sources (ZMQ): ") {
			t.Errorf("%v %v", cons, err)
		}
	})
}

// The builders refuse a Config whose defaults were not applied: Validate with an error, the
// others with a panic that says what to do.
func TestBuildersNeedDefaults(t *testing.T) {
	cfg := &Config{Backends: []BackendConfig{{Name: "a", URL: "http://a"}}}
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "call ApplyDefaults before Validate") {
		t.Errorf("Validate: %v", err)
	}
	for name, f := range map[string]func(){
		"RouterConfig":     func() { _, _ = cfg.RouterConfig(Options{}) },
		"DisaggConfig":     func() { _, _ = cfg.DisaggConfig() },
		"NewResponseCache": func() { _, _, _ = cfg.NewResponseCache(Options{}) },
		"NewKVIndex":       func() { _, _, _ = cfg.NewKVIndex() },
		"KVConfig":         func() { _ = cfg.KVConfig(nil, nil) },
	} {
		t.Run(name, func(t *testing.T) {
			defer func() {
				if r := recover(); r == nil || !strings.Contains(r.(string), "Config."+name+" called before ApplyDefaults") {
					t.Errorf("recovered %v", r)
				}
			}()
			f()
		})
	}
	cfg.ApplyDefaults()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	if _, err := cfg.RouterConfig(Options{}); err != nil {
		t.Error(err)
	}
}
