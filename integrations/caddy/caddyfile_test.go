package kvroutecaddy

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile" // the caddyfile adapter
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata")

// adaptCaddyfile adapts the Caddyfile at path to Caddy's JSON, indented as caddy adapt --pretty
// prints it.
func adaptCaddyfile(t *testing.T, path string) []byte {
	t.Helper()
	src, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	out, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt(src, map[string]any{"filename": path})
	if err != nil {
		t.Fatalf("adapting %s: %v", path, err)
	}
	for _, w := range warnings {
		t.Errorf("adapting %s: warning %s", path, w.String())
	}
	var buf bytes.Buffer
	if err := json.Indent(&buf, out, "", "\t"); err != nil {
		t.Fatal(err)
	}
	buf.WriteByte('\n')
	return buf.Bytes()
}

// TestAdaptCaddyfile adapts the Caddyfiles under testdata and compares them with their golden
// JSON (go test -run TestAdaptCaddyfile -update rewrites it). TestRealCaddy checks that the
// binary's caddy adapt prints the same.
func TestAdaptCaddyfile(t *testing.T) {
	files, err := filepath.Glob("testdata/*.Caddyfile")
	if err != nil || len(files) == 0 {
		t.Fatalf("no Caddyfiles under testdata (%v)", err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			got := adaptCaddyfile(t, f)
			golden := strings.TrimSuffix(f, ".Caddyfile") + ".json"
			if *update {
				if err := os.WriteFile(golden, got, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("adapted JSON differs from %s (rerun with -update if intended):\n%s", golden, got)
			}
		})
	}
}

// TestAdaptedJSONRoundTrips decodes the adapted handler back into the module and maps it onto
// kvroute's configuration: the JSON config says what the Caddyfile says.
func TestAdaptedJSONRoundTrips(t *testing.T) {
	var cfg any
	if err := json.Unmarshal(adaptCaddyfile(t, "testdata/all-options.Caddyfile"), &cfg); err != nil {
		t.Fatal(err)
	}
	var h *Handler
	for _, raw := range findHandlers(cfg, "kvroute") {
		h = new(Handler)
		if err := json.Unmarshal(raw, h); err != nil {
			t.Fatal(err)
		}
	}
	if h == nil {
		t.Fatal("no kvroute handler in the adapted JSON")
	}
	want := Handler{
		Backends: []Backend{{Address: "10.0.0.1:8000"}, {Address: "10.0.0.2:8000"},
			{Address: "http://10.0.0.3:8000", Weight: 2, Model: "llama-3-8b", URL: "http://10.0.0.3:8000",
				ZMQEndpoint: "tcp://10.0.0.3:5557", ZMQReplayEndpoint: "tcp://10.0.0.3:5558"}},
		MaxBodySize: 4 << 20, SelectionStrategy: "least_loaded",
		PrefixRouting: &PrefixRouting{MaxPrefixLength: 2048, LoadFactorEpsilon: 0.5, VirtualNodes: 100},
		KVIndex: &KVIndex{Backend: "redis", RedisURL: "{env.REDIS_URL}", BlockSize: 16, MaxEntries: 50000,
			EntryTTL: 300e9, MinOverlapThreshold: 0.4, LoadFactorEpsilon: 1.5, Speculation: "speculate"},
		Tokenizer: &Tokenizer{Mode: "engine", Timeout: 150e6},
		ResponseCache: &ResponseCache{Backend: "redis", RedisURL: "redis://cache:6379", Capacity: 500, TTL: 600e9,
			MaxResponseSize: 2 << 20, TenantHeader: "X-Tenant-Id"},
		DisableResponseHeaders: true,
	}
	gotKey, _ := h.poolKey()
	wantKey, _ := want.poolKey()
	if gotKey != wantKey || !h.DisableResponseHeaders {
		t.Fatalf("decoded handler\n %s\nwant\n %s", gotKey, wantKey)
	}
	// The mapping onto kvroute's schema accepts it (the Redis URL's placeholder is replaced).
	t.Setenv("REDIS_URL", "redis://index:6379")
	c, err := h.config()
	if err != nil {
		t.Fatal(err)
	}
	if got := string(c.KVCacheIndex.Redis.URL); got != "redis://index:6379" {
		t.Errorf("kv index Redis URL %q, want the placeholder replaced", got)
	}
	if n := len(c.KVCacheIndex.EventSources); n != 1 || c.KVCacheIndex.EventSources[0].BackendName != "10.0.0.3:8000" {
		t.Errorf("event sources %+v, want one for 10.0.0.3:8000", c.KVCacheIndex.EventSources)
	}
}

func TestCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"unknown option", "kvroute a:1 {\n\tfoo bar\n}", "unrecognized kvroute option 'foo'"},
		{"unknown backend option", "kvroute {\n\tbackend a:1 {\n\t\tport 3\n\t}\n}", "unrecognized backend option 'port'"},
		{"zmq without endpoint", "kvroute {\n\tbackend a:1 {\n\t\tzmq\n\t}\n}", "wrong argument count"},
		{"bad size", "kvroute a:1 {\n\tmax_body_size lots\n}", "max_body_size"},
		{"bad weight", "kvroute {\n\tbackend a:1 {\n\t\tweight heavy\n\t}\n}", "want a number"},
		{"NaN weight", "kvroute {\n\tbackend a:1 {\n\t\tweight NaN\n\t}\n}", "want a number"},
		{"infinite epsilon", "kvroute a:1 {\n\tprefix_routing {\n\t\tload_factor_epsilon +Inf\n\t}\n}", "want a number"},
		{"bad ttl", "kvroute a:1 {\n\tresponse_cache {\n\t\tttl soon\n\t}\n}", "want a duration"},
		{"prefix_routing on", "kvroute a:1 {\n\tprefix_routing on\n}", "the only argument is off"},
		{"kv_index memory url", "kvroute a:1 {\n\tkv_index memory redis://x\n}", "wrong argument count"},
		{"response_headers on", "kvroute a:1 {\n\tresponse_headers on\n}", "the only value is off"},
		{"tokenizer args", "kvroute a:1 {\n\ttokenizer\n}", "wrong argument count"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var h Handler
			err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.in))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestPolicyCaddyfile(t *testing.T) {
	for _, tc := range []struct{ name, in, fallback, err string }{
		{name: "default", in: "kvroute"},
		{name: "fallback", in: "kvroute {\n\tfallback random\n}", fallback: `{"policy":"random"}`},
		{name: "fallback with options", in: "kvroute {\n\tfallback query key {\n\t\tfallback first\n\t}\n}",
			fallback: `{"fallback":{"policy":"first"},"key":"key","policy":"query"}`},
		{name: "argument", in: "kvroute x", err: "wrong argument count"},
		{name: "unknown option", in: "kvroute {\n\tcolor red\n}", err: "unrecognized lb_policy kvroute option"},
		{name: "fallback twice", in: "kvroute {\n\tfallback random\n\tfallback first\n}", err: "already specified"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var p Policy
			err := p.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.in))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("error %v, want one containing %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if string(p.FallbackRaw) != tc.fallback {
				t.Fatalf("fallback %s, want %s", p.FallbackRaw, tc.fallback)
			}
		})
	}
}

// findHandlers returns, as JSON, every object in v whose "handler" is name.
func findHandlers(v any, name string) []json.RawMessage {
	var out []json.RawMessage
	switch x := v.(type) {
	case map[string]any:
		if x["handler"] == name {
			b, _ := json.Marshal(x)
			out = append(out, b)
		}
		for _, e := range x {
			out = append(out, findHandlers(e, name)...)
		}
	case []any:
		for _, e := range x {
			out = append(out, findHandlers(e, name)...)
		}
	}
	return out
}
