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
)

// A transport of your own (NATS, Kafka, a queue) is made of the exported pieces the SSE and ZMQ
// transports use: a SourceSet for status and metrics, a Source per stream, and a BackendWriter
// per backend, which clears the backend before it applies anything after a hole.
func Example_transport() {
	type message struct {
		seq     uint64
		payload []byte // a vLLM msgpack batch: [ts, [["BlockRemoved", [hash], "GPU"]]]
	}
	removed := func(hash byte) []byte {
		return append([]byte("\x92\xcb\x41\xda\x00\x00\x00\x00\x00\x00\x91\x93\xacBlockRemoved\x91"), hash, 0xa3, 'G', 'P', 'U')
	}
	ctx := context.Background()
	srcs := events.NewSourceSet(nil)
	if err := srcs.RegisterMetrics(nil); err != nil { // nil: your MeterProvider
		log.Fatal(err)
	}
	defer srcs.Close()
	src := srcs.Add(events.SourceInfo{Backend: "vllm-0", Transport: "nats", Endpoint: "nats://nats:4222", Topic: "kv.vllm-0"})
	w := events.NewBackendWriter(printKinds{}, "vllm-0")

	// The subscription's goroutine (one per backend at a time, as the Sink contract asks).
	src.SetState(events.StateConnected)
	var b events.Batch // reused for every message
	var last uint64
	for _, m := range []message{{1, removed(7)}, {2, removed(8)}, {4, removed(9)}} {
		src.Batches.Add(1)
		src.LastSeq.Store(m.seq)
		skipped, err := events.DecodeMsgpackBatch(m.payload, &b)
		if err != nil {
			src.Malformed.Add(1)
			src.SetError(err)
			w.RequestReset() // a lost batch: what it removed may still be in the index
			continue
		}
		if last != 0 && m.seq != last+1 {
			src.Gaps.Add(1)
			w.RequestReset() // batch 3 never came
		}
		last = m.seq
		src.Received.Add(uint64(len(b.Events) + skipped))
		src.Dropped.Add(uint64(skipped))
		src.Touch()
		b.Seq = m.seq
		w.Apply(ctx, src, &b) // counts Processed or Dropped, and Resets
	}
	st := srcs.Status()[0]
	fmt.Printf("received %d, processed %d, gaps %d, resets %d\n",
		st.Events.Received, st.Events.Processed, st.Sequence.Gaps, st.Sequence.Resets)
	// Output:
	// vllm-0 1 BlockRemoved [7]
	// vllm-0 2 BlockRemoved [8]
	// vllm-0 cleared
	// vllm-0 4 BlockRemoved [9]
	// received 3, processed 3, gaps 1, resets 1
}

// printKinds prints what it is asked to do.
type printKinds struct{}

func (printKinds) Apply(_ context.Context, backend string, b *events.Batch) error {
	for _, ev := range b.Events {
		fmt.Println(backend, b.Seq, ev.Kind, ev.BlockHashes)
	}
	return nil
}

func (printKinds) ClearBackend(_ context.Context, backend string) error {
	fmt.Println(backend, "cleared")
	return nil
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
