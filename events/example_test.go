package events_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
)

// Pod-discovery mode: one SUB connection per engine (and per data-parallel rank), with the
// engines' replay endpoints to fill sequence gaps and to catch up, on each connection, on what
// the engines cached before it. The in-memory index is the Sink.
func ExampleNewZMQConsumer() {
	index, err := kvindex.NewMemory(kvindex.MemoryConfig{})
	if err != nil {
		log.Fatal(err)
	}
	defer index.Close()

	const model = "meta-llama/Llama-3.1-8B-Instruct"
	c, err := events.NewZMQConsumer(events.ZMQConfig{
		Sink: index,
		Endpoints: []events.ZMQEndpoint{
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
func ExampleNewZMQConsumer_bind() {
	index, err := kvindex.NewMemory(kvindex.MemoryConfig{})
	if err != nil {
		log.Fatal(err)
	}
	defer index.Close()

	c, err := events.NewZMQConsumer(events.ZMQConfig{
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

// printSink prints the events it receives.
type printSink struct{ done chan struct{} }

func (s printSink) Apply(_ context.Context, backend string, b *events.Batch) error {
	for _, ev := range b.Events {
		fmt.Printf("%s %s %s tokens=%d\n", backend, ev.PrefixOp, ev.PrefixHash, ev.TokenCount)
	}
	s.done <- struct{}{}
	return nil
}

func (printSink) ClearBackend(context.Context, string) error { return nil }

// The SSE consumer reads the seeds' GET /v1/kv_events stream; the SSE event: field wins over
// the JSON "event".
func ExampleNewSSEConsumer() {
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "event: cache_created\n")
		io.WriteString(w, "data: {\"event\":\"cache_created\",\"prefix_hash\":\"9F2C\",\"token_count\":2048}\n\n")
		io.WriteString(w, "event: cache_evicted\n")
		io.WriteString(w, "data: {\"prefix_hash\":\"9f2c\",\"token_count\":2048}\n\n")
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}))
	defer engine.Close()

	sink := printSink{done: make(chan struct{})}
	c, err := events.NewSSEConsumer(events.SSEConfig{
		Sink:    sink,
		Sources: []events.SSESource{{Backend: "vllm-1", URL: engine.URL + "/v1/kv_events"}},
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := c.Start(context.Background()); err != nil {
		log.Fatal(err)
	}
	<-sink.done
	<-sink.done
	c.Close()
	// Output:
	// vllm-1 cache_created 9f2c tokens=2048
	// vllm-1 cache_evicted 9f2c tokens=2048
}

// Status renders as the per-backend part of the seeds' GET /admin/kv-index/backends.
func ExampleSSEConsumer_Status() {
	c, err := events.NewSSEConsumer(events.SSEConfig{
		Sink:    printSink{},
		Sources: []events.SSESource{{Backend: "vllm-1", URL: "http://vllm-1:8000/v1/kv_events"}},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	// Not started: connecting, nothing received yet.
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	enc.Encode(map[string]any{"enabled": true, "backends": c.Status()})
	// Output:
	// {
	//   "backends": [
	//     {
	//       "backend_name": "vllm-1",
	//       "transport": "sse",
	//       "endpoint": "http://vllm-1:8000/v1/kv_events",
	//       "connection": {
	//         "connected": false,
	//         "status": "connecting",
	//         "reconnect_count": 0
	//       },
	//       "events": {
	//         "received": 0,
	//         "processed": 0,
	//         "dropped": 0,
	//         "malformed": 0
	//       }
	//     }
	//   ],
	//   "enabled": true
	// }
}
