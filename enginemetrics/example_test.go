package enginemetrics_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/enginemetrics"
)

// A Router fed by a Scraper. The engine here is a stand-in for vLLM's /metrics; in production the
// Targets are the engines' metrics URLs and the Router itself is the Sink.
func Example() {
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		fmt.Fprint(w, `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama-3-8b"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama-3-8b"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama-3-8b"} 0.25
`)
	}))
	defer engine.Close()

	router, err := kvroute.New(kvroute.Config{Backends: []kvroute.Backend{{Name: "vllm-0"}}})
	if err != nil {
		panic(err)
	}
	defer router.Close()

	// The Router is the Sink; the wrapper only tells this example when the first load arrived.
	reported := make(chan struct{}, 1)
	sink := enginemetrics.SinkFunc(func(backend string, l kvroute.EngineLoad) error {
		err := router.ReportEngineLoad(backend, l)
		select {
		case reported <- struct{}{}:
		default:
		}
		return err
	})
	s, err := enginemetrics.New(enginemetrics.Config{
		Targets:  map[string]string{"vllm-0": engine.URL + "/metrics"},
		Interval: 100 * time.Millisecond,
	}, sink)
	if err != nil {
		panic(err)
	}
	if err := s.Start(context.Background()); err != nil {
		panic(err)
	}
	defer s.Close()

	<-reported
	rs, _ := router.Stats(context.Background())
	bl := rs.Backends[0]
	fmt.Printf("%s: external load %d (running %d, waiting %d, KV cache %.0f%%)\n",
		bl.Name, bl.ExternalLoad, bl.Engine.Running, bl.Engine.Waiting, 100*bl.Engine.KVCacheUsage)
	st := s.Stats()[0]
	fmt.Printf("engine %s, %d consecutive failures\n", st.Engine, st.ConsecutiveFailures)
	// Output:
	// vllm-0: external load 7 (running 5, waiting 2, KV cache 25%)
	// engine vllm, 0 consecutive failures
}

// Parse reads one body, for a caller that fetches the metrics itself.
func ExampleParse() {
	l, eng, err := enginemetrics.Parse(strings.NewReader(`# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen",dp_rank="0"} 12.0
sglang:num_running_reqs{model_name="qwen",dp_rank="1"} 10.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen",dp_rank="0"} 3.0
sglang:num_queue_reqs{model_name="qwen",dp_rank="1"} 0.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen",dp_rank="0"} 0.5
sglang:token_usage{model_name="qwen",dp_rank="1"} 0.3
`), "qwen")
	if err != nil {
		panic(err)
	}
	fmt.Printf("%s: running %d, waiting %d, KV cache %.2f\n", eng, l.Running, l.Waiting, l.KVCacheUsage)
	// Output: sglang: running 22, waiting 3, KV cache 0.40
}
