package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/enginesim"
)

// prefill_timeout bounds the prefill, kv_transfer_timeout the decode engine's response headers
// only: a stream that lasts longer is not cut, a decode engine that does not answer is replaced
// by the unified engine, and so is a prefill engine that does not answer. Each case has a fleet
// and a proxy of its own (one stalls an engine the others need), so the three wait out their
// timeouts side by side.
func TestDisaggTimeouts(t *testing.T) {
	// Real time: 150 ms per generated token, next to nothing per prompt token. The timeouts are 3 s,
	// not less: under -race beside the workspace's other tests, a 1 ms prefill has taken over 1 s.
	start := func(t *testing.T) (p *testProxy, prefill, decode *enginesim.Engine, unified string) {
		t.Helper()
		f := startPDFleet(t, 1, 1, 1, func(c *enginesim.Config) {
			c.Latency = enginesim.Latency{Base: time.Millisecond, PerToken: time.Microsecond, PerOutputToken: 150 * time.Millisecond, SpeedFactor: 1}
		})
		p = startProxy(t, pdConfig(t, f, func(c *config.Config) {
			c.DisaggregatedServing.PrefillTimeout = config.Duration(3 * time.Second)
			c.DisaggregatedServing.KVTransferTimeout = config.Duration(3 * time.Second)
		}))
		return p, f.engine(t, f.prefill[0]), f.engine(t, f.decode[0]), f.unified[0]
	}
	// metrics checks that p's /metrics has every one of want.
	metrics := func(t *testing.T, p *testProxy, want ...string) {
		t.Helper()
		code, m := adminDo(t, "GET", p.URL+"/metrics", "", "")
		for _, w := range want {
			if code != 200 || !strings.Contains(string(m), w) {
				t.Errorf("/metrics (%d) lacks %s", code, w)
			}
		}
	}

	t.Run("a stream longer than kv_transfer_timeout is not cut", func(t *testing.T) {
		t.Parallel()
		p, _, decode, _ := start(t)
		resp, b := post(t, p.URL+"/v1/chat/completions", longPrompt("long-stream", 800, `"max_tokens":24,"stream":true`))
		r := readPD(resp, b)
		if r.status != 200 || r.path != "prefill_then_decode" || r.decode != decode.Name() || resp.Header.Get(HeaderRetriedFrom) != "" {
			t.Fatalf("%v retried from %q", r, resp.Header.Get(HeaderRetriedFrom))
		}
		if n := strings.Count(string(b), `"content":`); n < 24 || !strings.HasSuffix(strings.TrimSpace(string(b)), "data: [DONE]") {
			t.Errorf("%d content chunks, want 24, in\n%s", n, b)
		}
		metrics(t, p, "kvroute_disagg_requests_total")
	})
	t.Run("decode engine stalls: the unified engine serves", func(t *testing.T) {
		t.Parallel()
		p, _, decode, unified := start(t)
		decode.SetStall(true)
		defer decode.SetStall(false)
		resp, b := post(t, p.URL+"/v1/chat/completions", longPrompt("stalled-decode", 800, `"max_tokens":2`))
		r := readPD(resp, b)
		if r.status != 200 || r.path != "fallback" || r.prefill != "" || r.decode != unified || r.backend != unified || r.engine != unified ||
			resp.Header.Get(HeaderRetriedFrom) != decode.Name() {
			t.Fatalf("%v retried from %q: %s", r, resp.Header.Get(HeaderRetriedFrom), b)
		}
		if st := disaggStats(t, p).Requests; st.DecodeFailures != 1 || st.Reasons.DecodeFailed != 1 {
			t.Errorf("decode failure not counted by the router: %+v", st)
		}
		metrics(t, p, fmt.Sprintf(`kvroute_proxy_upstream_errors_total{backend=%q,kind="timeout"`, decode.Name()),
			"kvroute_disagg_requests_total")
	})
	t.Run("prefill engine stalls: the unified engine serves", func(t *testing.T) {
		t.Parallel()
		p, prefill, _, unified := start(t)
		failures := disaggStats(t, p).Requests.PrefillFailures
		prefill.SetStall(true)
		defer prefill.SetStall(false)
		r := postPD(t, p, longPrompt("stalled-prefill", 800, `"max_tokens":2`))
		if r.status != 200 || r.path != "fallback" || r.prefill != "" || r.decode != unified || r.engine != unified {
			t.Fatalf("%v: %s", r, r.body)
		}
		if got := disaggStats(t, p).Requests.PrefillFailures; got != failures+1 {
			t.Errorf("prefill failures %d → %d", failures, got)
		}
		metrics(t, p, fmt.Sprintf(`kvroute_proxy_upstream_errors_total{backend=%q,kind="timeout"`, prefill.Name()),
			"kvroute_disagg_requests_total", "kvroute_disagg_prefill_failures_total")
	})
}

// With fallback_to_unified off (or no unified backend), a failed prefill is answered 503 in the
// endpoint's API style, never a hang or a 500.
func TestDisaggNoFallback(t *testing.T) {
	f := startPDFleet(t, 1, 1, 0, nil)
	p := startProxy(t, pdConfig(t, f, func(c *config.Config) {
		c.DisaggregatedServing.FallbackToUnified = ptr(false)
		c.HealthChecks.Enabled = ptr(false) // the killed engine stays in rotation: its prefill fails
		c.CircuitBreaker.Enabled = ptr(false)
	}))
	f.engine(t, f.prefill[0]).Kill()

	resp, b := post(t, p.URL+"/v1/chat/completions", longPrompt("no-fallback", 800, `"max_tokens":2`))
	var oe struct {
		Error struct{ Message, Type, Code string } `json:"error"`
	}
	if resp.StatusCode != http.StatusServiceUnavailable || json.Unmarshal(b, &oe) != nil || oe.Error.Code != "no_healthy_backend" ||
		oe.Error.Type != "server_error" || !strings.Contains(oe.Error.Message, "prefill on "+f.prefill[0]+" failed") {
		t.Errorf("OpenAI: %d %s", resp.StatusCode, b)
	}
	body := fmt.Sprintf(`{"model":%q,"max_tokens":2,"system":%q,"messages":[{"role":"user","content":"hi"}]}`,
		testModel, longSystemPrompt("no-fallback-anthropic", 800))
	resp, b = post(t, p.URL+"/v1/messages", body)
	var ae struct {
		Type  string
		Error struct{ Type, Message string }
	}
	if resp.StatusCode != http.StatusServiceUnavailable || json.Unmarshal(b, &ae) != nil || ae.Type != "error" || ae.Error.Type != "overloaded_error" {
		t.Errorf("Anthropic: %d %s", resp.StatusCode, b)
	}
	if st := disaggStats(t, p).Requests; st.PrefillFailures != 2 || st.NoBackend != 2 {
		t.Errorf("requests %+v", st)
	}
}

// GET /admin/disaggregation/stats: behind the admin token, the configuration (credentials
// redacted), the requests by path and reason, and every prefill and decode backend.
func TestDisaggAdminStats(t *testing.T) {
	f := startPDFleet(t, 1, 2, 1, nil)
	const token, credential = "pd-admin", "kv-credential-do-not-print"
	p := startProxy(t, pdConfig(t, f, func(c *config.Config) {
		c.Admin.AuthToken = token
		c.DisaggregatedServing.DefaultExternalStorage.Credentials = credential
	}))
	if r := postPD(t, p, longPrompt("admin", 800, `"max_tokens":2`)); r.status != 200 || r.path != "prefill_then_decode" {
		t.Fatalf("%v", r)
	}
	if code, _ := adminDo(t, "GET", p.URL+"/admin/disaggregation/stats", "", ""); code != http.StatusUnauthorized {
		t.Errorf("without the token: %d", code)
	}
	code, b := adminDo(t, "GET", p.URL+"/admin/disaggregation/stats", token, "")
	if code != 200 {
		t.Fatalf("%d %s", code, b)
	}
	for _, secret := range []string{credential, f.s3.secretKey} {
		if secret != "" && strings.Contains(string(b), secret) {
			t.Errorf("a credential leaked into the stats:\n%s", b)
		}
	}
	// The access key is checked by its field: its value may well also be the bucket's name (CI
	// uses one name for both), which the storage location shows.
	if !strings.Contains(string(b), `"access_key": "[REDACTED]"`) {
		t.Errorf("access key not redacted in the stats:\n%s", b)
	}
	var st disaggStatsBody
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	if !st.Enabled || st.Config.PrefillTimeout != "1m0s" || st.Config.KVTransferTimeout != "15s" || !st.Config.FallbackToUnified ||
		string(st.Config.DefaultStorage["credentials"]) != `"[REDACTED]"` {
		t.Errorf("config %+v", st.Config)
	}
	if st.PrefillBackends != 1 || st.DecodeBackends != 2 || st.UnifiedBackends != 1 || len(st.Backends) != 3 {
		t.Errorf("pools: %d prefill, %d decode, %d unified, backends %+v", st.PrefillBackends, st.DecodeBackends, st.UnifiedBackends, st.Backends)
	}
	if st.Requests.Total != 1 || st.Requests.PrefillThenDecode != 1 || st.Requests.Reasons.CacheMiss != 1 {
		t.Errorf("requests %+v", st.Requests)
	}
}

// The shipped configs/disaggregated.yaml (2 prefill, 6 decode, 1 unified engines, S3 from the
// environment) in front of a fleet of that shape: a cold long prompt is prefilled and decoded,
// repeated it stays on its decode engine.
func TestDisaggShippedConfig(t *testing.T) {
	f := startPDFleet(t, 2, 6, 1, nil)
	data, err := os.ReadFile("configs/disaggregated.yaml")
	if err != nil {
		t.Fatal(err)
	}
	vars := map[string]string{"S3_ENDPOINT": f.s3.endpoint, "S3_BUCKET": f.s3.bucket, "S3_ACCESS_KEY": f.s3.accessKey,
		"S3_SECRET_KEY": f.s3.secretKey}
	cfg, err := config.Parse(data, env(vars))
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.Backends) != len(f.Info()) {
		t.Fatalf("%d backends in the file, %d engines", len(cfg.Backends), len(f.Info()))
	}
	// The file's backends in order are the fleet's engines in order (prefill, decode, unified):
	// only the addresses, and the test's S3 namespace, change.
	for i, in := range f.Info() {
		b := &cfg.Backends[i]
		if b.ParsedRole().String() != in.Role.String() {
			t.Fatalf("backends[%d] %s is %s, engine %s is %s", i, b.Name, b.Role, in.Name, in.Role)
		}
		es := &cfg.KVCacheIndex.EventSources[i]
		if es.BackendName != b.Name {
			t.Fatalf("event_sources[%d] is %s's, want %s's", i, es.BackendName, b.Name)
		}
		b.URL, es.Endpoint = in.URL, in.ZMQEndpoint
	}
	cfg.DisaggregatedServing.DefaultExternalStorage.KVNamespace = f.s3.namespace
	cfg.Server.Port = ptr(0)
	cfg.KVCacheIndex.TokenizeTimeout = config.Duration(5 * time.Second)
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, cfg)
	prompt := longPrompt("shipped", 1000, `"max_tokens":4`)
	r1 := postPD(t, p, prompt)
	if r1.status != 200 || r1.path != "prefill_then_decode" || !strings.HasPrefix(r1.prefill, "prefill-") ||
		!strings.HasPrefix(r1.decode, "decode-") || r1.storageTokens < 900 {
		t.Fatalf("%v: %s", r1, r1.body)
	}
	r2 := postPD(t, p, prompt)
	if r2.status != 200 || r2.path != "fast_decode" || r2.decode != r1.decode || r2.route != "local_hit" {
		t.Errorf("again: %v", r2)
	}
	r3 := postPD(t, p, longPrompt("shipped-short", 100, `"max_tokens":4`))
	if r3.status != 200 || r3.path != "fast_decode" || r3.route != "short_prompt" || !strings.HasPrefix(r3.decode, "decode-") {
		t.Errorf("short: %v", r3)
	}
}

// The engines' S3 unreachable: the prefill engine cannot write the prompt's KV and answers 503;
// the unified engine serves the request.
func TestDisaggStorageDown(t *testing.T) {
	dead := deadURL(t)
	f := startPDFleet(t, 1, 1, 1, func(c *enginesim.Config) { c.Storage.Endpoint = dead })
	p := startProxy(t, pdConfig(t, f, nil))
	r := postPD(t, p, longPrompt("storage-down", 800, `"max_tokens":3`))
	if r.status != 200 || r.path != "fallback" || r.decode != f.unified[0] || r.engine != f.unified[0] {
		t.Fatalf("%v: %s", r, r.body)
	}
	if st := f.engine(t, f.prefill[0]).Stats(); st.StorageErrors == 0 || st.PrefillHandoffs != 0 {
		t.Errorf("prefill engine: %d storage errors, %d handoffs", st.StorageErrors, st.PrefillHandoffs)
	}
	if st := disaggStats(t, p).Requests; st.PrefillFailures != 1 || st.Reasons.PrefillFailed != 1 {
		t.Errorf("requests %+v", st)
	}
}
