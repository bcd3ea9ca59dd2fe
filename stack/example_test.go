package stack_test

import (
	"context"
	"fmt"
	"log"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/stack"
)

// A front end builds the shared parts from the configuration around its Router. Here replicas
// and engine_metrics are off, so the Fleet has no part to start; with them on, the same code
// joins the replica group and scrapes the engines.
func Example() {
	cfg, err := config.Parse([]byte(`
backends:
  - {name: vllm-0, url: "http://127.0.0.1:8001", model: llama}
  - {name: vllm-1, url: "http://127.0.0.1:8002/", model: llama}
engine_metrics: {path: /metrics}
`), nil)
	if err != nil {
		log.Fatal(err)
	}
	var o config.Options
	fleet, err := stack.NewFleet(cfg, o, stack.FleetOptions{})
	if err != nil {
		log.Fatal(err)
	}
	defer fleet.Close()
	rcfg, err := cfg.RouterConfig(o)
	if err != nil {
		log.Fatal(err)
	}
	rcfg.Peers = fleet.Peers() // nil: replicas is off
	router, err := kvroute.New(rcfg)
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()
	mon, err := stack.NewHealth(cfg, router, nil, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer mon.Close() // mon.Start() would start probing the backends
	fleet.SetRouter(router)
	if err := fleet.Start(context.Background()); err != nil {
		log.Fatal(err)
	}
	fmt.Println("replicas:", fleet.Stats().Enabled)
	fmt.Println("vllm-1 metrics:", stack.MetricsTargets(cfg)["vllm-1"])
	// Output:
	// replicas: false
	// vllm-1 metrics: http://127.0.0.1:8002/metrics
}
