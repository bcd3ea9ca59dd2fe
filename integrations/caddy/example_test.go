package kvroutecaddy_test

import (
	"encoding/json"
	"fmt"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	kvroutecaddy "github.com/kvroute/kvroute/integrations/caddy"
)

// The kvroute directive and the JSON Caddy runs it as (caddy adapt shows the whole config).
func ExampleHandler_UnmarshalCaddyfile() {
	d := caddyfile.NewTestDispenser(`kvroute vllm-1:8000 {
		backend vllm-2:8000 {
			zmq tcp://vllm-2:5557 tcp://vllm-2:5558
		}
		tokenizer engine 200ms
	}`)
	var h kvroutecaddy.Handler
	if err := h.UnmarshalCaddyfile(d); err != nil {
		fmt.Println(err)
		return
	}
	b, _ := json.Marshal(h)
	fmt.Println(string(b))
	// Output:
	// {"backends":[{"address":"vllm-1:8000"},{"address":"vllm-2:8000","zmq_endpoint":"tcp://vllm-2:5557","zmq_replay_endpoint":"tcp://vllm-2:5558"}],"tokenizer":{"mode":"engine","timeout":200000000}}
}

// The address a backend is matched by: the one reverse_proxy dials for the same upstream.
func ExampleDialAddress() {
	for _, s := range []string{"vllm-1:8000", "http://vllm-1:8000", "https://vllm-1"} {
		a, _ := kvroutecaddy.DialAddress(s)
		fmt.Println(a)
	}
	// Output:
	// vllm-1:8000
	// vllm-1:8000
	// vllm-1:443
}
