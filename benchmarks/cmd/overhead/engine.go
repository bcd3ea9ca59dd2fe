package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/kvroute/kvroute/internal/enginesim"
)

// engineCommand is the first argument that makes the program the engine behind every target:
//
//	overhead engine
//
// one simulated vLLM engine (enginesim.StartFleet, N 1) with KV events over ZMQ and no simulated
// latency (Latency{SpeedFactor: 0}: the durations are computed, never slept), on free loopback
// ports. It prints "engine ready {JSON engineInfo}" on stdout and serves until killed or
// interrupted. The measurement starts it as its child, so that no target shares a process (and
// a Go scheduler) with the load generator: a real engine never does.
const engineCommand = "engine"

// engineBanner opens the line that describes the engine.
const engineBanner = "engine ready "

// engineInfo is where the engine is reachable: what the proxies' configurations need.
type engineInfo struct {
	Name           string `json:"name"`
	Model          string `json:"model"`
	URL            string `json:"url"`
	ZMQEndpoint    string `json:"zmq_endpoint"`
	ReplayEndpoint string `json:"replay_endpoint"`
	BlockSize      int    `json:"block_size"`
}

// engineMain serves the engine until ctx ends.
func engineMain(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("overhead engine", flag.ContinueOnError)
	fs.SetOutput(stderr)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("engine: unexpected arguments %q", fs.Args())
	}
	f, err := enginesim.StartFleet(ctx, enginesim.FleetConfig{N: 1, ZMQ: true,
		Base: enginesim.Config{Latency: enginesim.Latency{SpeedFactor: 0}}})
	if err != nil {
		return err
	}
	defer f.Close()
	in := f.Info()[0]
	b, err := json.Marshal(engineInfo{Name: in.Name, Model: in.Model, URL: in.URL, ZMQEndpoint: in.ZMQEndpoint,
		ReplayEndpoint: in.ReplayEndpoint, BlockSize: in.BlockSize})
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%s%s\n", engineBanner, b)
	<-ctx.Done()
	return nil
}

// parseEngineInfo reads what the engine child announced.
func parseEngineInfo(s string) (engineInfo, error) {
	var in engineInfo
	if err := json.Unmarshal([]byte(s), &in); err != nil {
		return in, fmt.Errorf("engine announced %q: %w", s, err)
	}
	if !strings.HasPrefix(in.URL, "http://127.0.0.1:") || !strings.HasPrefix(in.ZMQEndpoint, "tcp://127.0.0.1:") ||
		in.Model == "" || in.BlockSize < 1 {
		return in, fmt.Errorf("engine announced %q: want loopback addresses, a model and a block size", s)
	}
	return in, nil
}
