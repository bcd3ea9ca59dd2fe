package enginemetrics_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/enginemetrics"
	"github.com/kvroute/kvroute/internal/enginesim"
)

// twoModels is an endpoint that reports two models (an engine behind a gateway that merges
// several engines' metrics, say).
const twoModels = `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama-8b"} 4.0
vllm:num_requests_running{engine="0",model_name="qwen-32b"} 9.0
vllm:num_requests_running{engine="1",model_name="qwen-32b"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama-8b"} 2.0
vllm:num_requests_waiting{engine="0",model_name="qwen-32b"} 0.0
vllm:num_requests_waiting{engine="1",model_name="qwen-32b"} 6.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama-8b"} 0.5
vllm:kv_cache_usage_perc{engine="0",model_name="qwen-32b"} 0.9
vllm:kv_cache_usage_perc{engine="1",model_name="qwen-32b"} 0.7
`

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		name, body, model string
		engine            enginemetrics.Engine
		running, waiting  int
		usage             float64
	}{
		{"vLLM one engine", fixture(t, "vllm.prom"), "", enginemetrics.EngineVLLM, 7, 3, 0.4123},
		{"vLLM one engine, its model", fixture(t, "vllm.prom"), "meta-llama/Llama-3.1-8B-Instruct", enginemetrics.EngineVLLM, 7, 3, 0.4123},
		{"vLLM data parallel: counts summed, usage averaged", fixture(t, "vllm_dp2.prom"), "", enginemetrics.EngineVLLM, 21, 5, 0.7},
		{"vLLM before kv_cache_usage_perc", fixture(t, "vllm_old.prom"), "", enginemetrics.EngineVLLM, 4, 1, 0.25},
		{"SGLang two ranks", fixture(t, "sglang.prom"), "", enginemetrics.EngineSGLang, 38, 7, 0.30},
		{"SGLang one rank", sglangBody("m", 3, 1, 0.5), "m", enginemetrics.EngineSGLang, 3, 1, 0.5},
		{"two models, none chosen: all summed", twoModels, "", enginemetrics.EngineVLLM, 14, 8, 0.7},
		{"two models, the first", twoModels, "llama-8b", enginemetrics.EngineVLLM, 4, 2, 0.5},
		{"two models, the second", twoModels, "qwen-32b", enginemetrics.EngineVLLM, 10, 6, 0.8},
		{"no usage gauge", "vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n", "", enginemetrics.EngineVLLM, 2, 1, -1},
		{"untyped, no labels", "sglang:num_running_reqs 5\nsglang:num_queue_reqs 0\nsglang:token_usage 0.125\n", "", enginemetrics.EngineSGLang, 5, 0, 0.125},
		{"NaN and infinite samples skipped", `vllm:num_requests_running{engine="0"} NaN
vllm:num_requests_running{engine="1"} 3
vllm:num_requests_waiting{engine="0"} +Inf
vllm:num_requests_waiting{engine="1"} 2
vllm:kv_cache_usage_perc{engine="0"} NaN
`, "", enginemetrics.EngineVLLM, 3, 2, -1},
		{"negative counts are 0, usage clamped", "vllm:num_requests_running -4\nvllm:num_requests_waiting 1e300\nvllm:kv_cache_usage_perc 7\n",
			"", enginemetrics.EngineVLLM, 0, 1 << 30, 1},
		{"fractional counts rounded", "vllm:num_requests_running 2.6\nvllm:num_requests_waiting 0.2\n", "", enginemetrics.EngineVLLM, 3, 0, -1},
		{"OpenMetrics-style gauges", "# TYPE vllm:num_requests_running gauge\n# UNIT vllm:num_requests_running requests\nvllm:num_requests_running 1\n" +
			"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 2\n# EOF\n", "", enginemetrics.EngineVLLM, 1, 2, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, eng, err := enginemetrics.Parse(strings.NewReader(tc.body), tc.model)
			require.NoError(t, err)
			assert.Equal(t, tc.engine, eng)
			assert.Equal(t, tc.running, l.Running, "running")
			assert.Equal(t, tc.waiting, l.Waiting, "waiting")
			assert.InDelta(t, tc.usage, l.KVCacheUsage, 1e-9, "KV cache usage")
			assert.True(t, l.At.IsZero())
		})
	}
}

func TestParseErrors(t *testing.T) {
	for _, tc := range []struct {
		name, body, model string
		want              error
		engine            enginemetrics.Engine
	}{
		{"garbage", "<html><body>Bad Gateway</body></html>\n", "", enginemetrics.ErrParse, ""},
		{"binary", "\x00\x01\x02\xff{{{", "", enginemetrics.ErrParse, ""},
		{"bad value", "vllm:num_requests_running{engine=\"0\"} many\n", "", enginemetrics.ErrParse, ""},
		{"unterminated label", "vllm:num_requests_running{engine=\"0} 1\n", "", enginemetrics.ErrParse, ""},
		{"two TYPE lines", "# TYPE vllm:num_requests_running gauge\n# TYPE vllm:num_requests_running counter\n", "", enginemetrics.ErrParse, ""},
		{"empty", "", "", enginemetrics.ErrNoLoadMetrics, ""},
		{"another exporter", "# TYPE node_load1 gauge\nnode_load1 0.42\n", "", enginemetrics.ErrNoLoadMetrics, ""},
		{"both engines", "vllm:num_requests_running 1\nvllm:num_requests_waiting 1\nsglang:num_running_reqs 1\nsglang:num_queue_reqs 1\n", "",
			enginemetrics.ErrNoLoadMetrics, ""},
		{"running only", "vllm:num_requests_running 1\n", "", enginemetrics.ErrNoLoadMetrics, enginemetrics.EngineVLLM},
		{"waiting only", "sglang:num_queue_reqs 1\n", "", enginemetrics.ErrNoLoadMetrics, enginemetrics.EngineSGLang},
		{"wrong type", "# TYPE vllm:num_requests_running counter\nvllm:num_requests_running 1\nvllm:num_requests_waiting 1\n", "",
			enginemetrics.ErrNoLoadMetrics, enginemetrics.EngineVLLM},
		{"only NaN", "vllm:num_requests_running NaN\nvllm:num_requests_waiting 1\n", "", enginemetrics.ErrNoLoadMetrics, enginemetrics.EngineVLLM},
		{"another model", twoModels, "mistral-7b", enginemetrics.ErrNoLoadMetrics, enginemetrics.EngineVLLM},
		{"model chosen, no model label", "vllm:num_requests_running 1\nvllm:num_requests_waiting 1\n", "m", enginemetrics.ErrNoLoadMetrics, enginemetrics.EngineVLLM},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, eng, err := enginemetrics.Parse(strings.NewReader(tc.body), tc.model)
			require.ErrorIs(t, err, tc.want)
			assert.Equal(t, tc.engine, eng)
		})
	}
}

// The simulated engine's /metrics reads as the engine's own counts: one request running (the
// engine runs one at a time) and two waiting, held before their prefill.
func TestParseEnginesim(t *testing.T) {
	e, err := enginesim.New(enginesim.Config{Model: "sim-model", MaxConcurrent: 1, HashSeed: 1})
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.Close() })
	srv := httptest.NewServer(e.Handler())
	t.Cleanup(srv.Close)

	read := func(model string) (enginemetrics.Engine, int, int, float64) {
		r, err := http.Get(srv.URL + "/metrics")
		require.NoError(t, err)
		defer r.Body.Close()
		b, err := io.ReadAll(r.Body)
		require.NoError(t, err)
		l, eng, err := enginemetrics.Parse(strings.NewReader(string(b)), model)
		require.NoError(t, err)
		return eng, l.Running, l.Waiting, l.KVCacheUsage
	}
	eng, running, waiting, usage := read("")
	assert.Equal(t, enginemetrics.EngineVLLM, eng)
	assert.Zero(t, running)
	assert.Zero(t, waiting)
	assert.Zero(t, usage)

	stallRequests(t, e, 3)
	eng, running, waiting, usage = read("sim-model")
	assert.Equal(t, enginemetrics.EngineVLLM, eng)
	assert.Equal(t, 1, running)
	assert.Equal(t, 2, waiting)
	assert.InDelta(t, e.Stats().Usage, usage, 1e-12)
	assert.Positive(t, usage)
}

// stallRequests submits n requests to e, held before their prefill until the end of the test,
// and waits until e counts them all.
func stallRequests(t *testing.T, e *enginesim.Engine, n int) {
	t.Helper()
	e.SetStall(true)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() {
		cancel()
		e.SetStall(false)
		wg.Wait()
	})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			toks := make([]uint32, 64)
			for j := range toks {
				toks[j] = uint32(1000*(i+1) + j)
			}
			_, _ = e.Generate(ctx, enginesim.Input{Tokens: toks, OutputTokens: 1})
		}()
	}
	require.Eventually(t, func() bool {
		s := e.Stats()
		return s.Running+s.Waiting == n
	}, waitFor, tick)
}

// A body whose lines would make the text parser slow is refused before it is parsed: one series
// with many labels, or one very long line.
func TestParseRefusesSlowShapes(t *testing.T) {
	var labels strings.Builder
	for i := range 8000 {
		if i > 0 {
			labels.WriteByte(',')
		}
		fmt.Fprintf(&labels, `l%d="v"`, i)
	}
	manyLabels := "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{" + labels.String() + "} 1\n"
	longLine := "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"" + strings.Repeat("m", 70<<10) + "\"} 1\n"
	for name, body := range map[string]string{"many labels": manyLabels, "long line": longLine} {
		_, _, err := enginemetrics.Parse(strings.NewReader(body), "")
		if !errors.Is(err, enginemetrics.ErrParse) {
			t.Errorf("%s: %v, want ErrParse", name, err)
		}
	}
}
