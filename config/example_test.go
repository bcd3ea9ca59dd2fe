package config_test

import (
	"context"
	"fmt"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/prefixkey"
)

// A gateway reads the reference gateway's YAML and builds a Router from it.
func ExampleParse() {
	yaml := `
selection_strategy: least_loaded
prefix_routing: {max_prefix_length: 2048, load_factor_epsilon: 0.5}
backends:
  - {name: vllm-1, url: "http://vllm-1:8000", model: llama-3-8b}
  - {name: vllm-2, url: "${VLLM_2_URL:-http://vllm-2:8000}", model: llama-3-8b, weight: 2}
`
	cfg, err := config.Parse([]byte(yaml), func(string) (string, bool) { return "", false })
	if err != nil {
		panic(err) // every error names the field: "backends[1].url: …"
	}
	rcfg, err := cfg.RouterConfig(config.Options{})
	if err != nil {
		panic(err)
	}
	router, err := kvroute.New(rcfg)
	if err != nil {
		panic(err)
	}
	defer router.Close()

	req, err := prefixkey.ParseOpenAIChat([]byte(`{"model":"llama-3-8b","messages":[
		{"role":"system","content":"You are the ACME support assistant."},
		{"role":"user","content":"Where is my order?"}]}`))
	if err != nil {
		panic(err)
	}
	d, err := router.Route(context.Background(), req)
	if err != nil {
		panic(err)
	}
	defer d.Done(kvroute.Outcome{})
	fmt.Println(cfg.Addr(), rcfg.Strategy, cfg.Backends[1].URL, cfg.Backend(d.Backend) != nil, d.Reason)
	// Output: 127.0.0.1:8080 least_loaded http://vllm-2:8000 true prefix_hash
}
