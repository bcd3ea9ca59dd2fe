package enginemetrics_test

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvroute/kvroute/enginemetrics"
)

// FuzzParse feeds Parse arbitrary bodies and model names: it never panics, an error wraps one of
// its two sentinels, and a load is always within its documented ranges.
func FuzzParse(f *testing.F) {
	names, _ := filepath.Glob(filepath.Join("testdata", "*.prom"))
	for _, name := range names {
		b, err := os.ReadFile(name)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b, "")
		f.Add(b, "meta-llama/Llama-3.1-8B-Instruct")
	}
	f.Add([]byte(twoModels), "qwen-32b")
	f.Add([]byte(sglangBody("m", 1, 2, 0.5)), "m")
	f.Add([]byte("vllm:num_requests_running NaN\nvllm:num_requests_waiting -1e309\nvllm:kv_cache_usage_perc +Inf\n"), "")
	f.Add([]byte("# TYPE x histogram\nx_bucket{le=\"1\"} 1\nx_count 1\nx_sum 1\n"), "")
	f.Add([]byte("{\"vllm:num_requests_running\",engine=\"0\"} 1\n"), "")
	f.Fuzz(func(t *testing.T, body []byte, model string) {
		if len(body) > 1<<20 {
			t.Skip("the Scraper bounds bodies")
		}
		l, eng, err := enginemetrics.Parse(bytes.NewReader(body), model)
		if err != nil {
			if !errors.Is(err, enginemetrics.ErrParse) && !errors.Is(err, enginemetrics.ErrNoLoadMetrics) {
				t.Fatalf("error wraps neither sentinel: %v", err)
			}
			if l.Running != 0 || l.Waiting != 0 {
				t.Fatalf("load %+v with error %v", l, err)
			}
			return
		}
		if eng != enginemetrics.EngineVLLM && eng != enginemetrics.EngineSGLang {
			t.Fatalf("engine %q", eng)
		}
		if l.Running < 0 || l.Running > 1<<30 || l.Waiting < 0 || l.Waiting > 1<<30 {
			t.Fatalf("counts out of range: %+v", l)
		}
		if u := l.KVCacheUsage; u != -1 && (u < 0 || u > 1 || u != u) {
			t.Fatalf("usage out of range: %+v", l)
		}
	})
}
