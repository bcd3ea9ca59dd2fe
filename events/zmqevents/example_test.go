package zmqevents_test

import (
	"context"
	"log"

	"github.com/kvroute/kvroute/events/zmqevents"
	"github.com/kvroute/kvroute/kvindex"
)

// Pod-discovery mode: one SUB connection per engine (and per data-parallel rank), with the
// engines' replay endpoints to fill sequence gaps and to catch up, on each connection, on what
// the engines cached before it. The in-memory index is the Sink.
func ExampleNew() {
	index, err := kvindex.NewMemory(kvindex.MemoryConfig{})
	if err != nil {
		log.Fatal(err)
	}
	defer index.Close()

	const model = "meta-llama/Llama-3.1-8B-Instruct"
	c, err := zmqevents.New(zmqevents.Config{
		Sink: index,
		Endpoints: []zmqevents.Endpoint{
			{Backend: "vllm-0", Endpoint: "tcp://vllm-0:5557", ReplayEndpoint: "tcp://vllm-0:5558", Model: model},
			{Backend: "vllm-1", Endpoint: "tcp://vllm-1:5557", ReplayEndpoint: "tcp://vllm-1:5558", Model: model},
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	// Start returns at once: engines that are down are retried in the background.
	if err := c.Start(context.Background()); err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	// … route with index.Lookup; c.Status() feeds an admin endpoint.
}

// Centralized mode: the router binds, every engine connects to it (vLLM's publisher connects
// when its endpoint names a host, e.g. tcp://router:5557), and the llm-d topic
// kv@<pod>@<model> names each message's backend and model.
func ExampleNew_bind() {
	index, err := kvindex.NewMemory(kvindex.MemoryConfig{})
	if err != nil {
		log.Fatal(err)
	}
	defer index.Close()

	c, err := zmqevents.New(zmqevents.Config{
		Sink:  index,
		Bind:  "tcp://0.0.0.0:5557",
		Topic: "kv@", // llm-d topics only
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := c.Start(context.Background()); err != nil {
		log.Fatal(err) // e.g. the port is taken
	}
	defer c.Close()
}
