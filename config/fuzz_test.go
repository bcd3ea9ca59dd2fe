package config

import (
	"os"
	"path/filepath"
	"testing"
)

// FuzzParse: no input makes Parse panic or hang, and a Config Parse accepts maps onto the
// Router's configuration (RouterConfig, KVConfig: no I/O) without panicking either.
func FuzzParse(f *testing.F) {
	files, err := filepath.Glob("testdata/*.yaml")
	if err != nil || len(files) == 0 {
		f.Fatalf("seed corpus: %v %v", files, err)
	}
	for _, name := range files {
		data, err := os.ReadFile(name)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	for _, s := range []string{
		minimalBackends,
		minimalBackends + "kv_cache_index: {enabled: true, scoring: {overlap_weight: ~}}\nserver: {port: ~}\n",
		minimalBackends + "disaggregated_serving: {enabled: true, conditional: {max_uncached_tokens: 0, max_uncached_ratio: 0}}\n",
		"backends: [{name: a, url: \"${U:-http://a}\", role: ${R}}]\n",
		"backends: &b [{name: a, url: \"http://a\"}]\nserver: *b\n",
		"disaggregated_serving: {default_external_storage: {endpoint: x}}\n",
	} {
		f.Add([]byte(s))
	}
	lookup := func(k string) (string, bool) { return "v-" + k, len(k)%2 == 0 }
	f.Fuzz(func(t *testing.T, data []byte) {
		cfg, err := Parse(data, lookup)
		if err != nil {
			return
		}
		if _, err := cfg.RouterConfig(Options{}); err != nil {
			t.Fatalf("RouterConfig of a valid Config: %v", err)
		}
		_ = cfg.KVConfig(nil, nil)
		_ = cfg.Addr()
	})
}
