package config

import (
	"context"
	"encoding/binary"
	"io"
	"log"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/events/zmqevents"
)

const fourBackends = `
backends:
  - {name: a, url: "http://127.0.0.1:8001", model: m-a}
  - {name: b, url: "http://127.0.0.1:8002", model: m-b}
  - {name: c, url: "http://127.0.0.1:8003", model: m-c}
  - {name: d, url: "http://127.0.0.1:8004", model: m-d}
kv_cache_index:
  enabled: true
  event_sources:
`

// Several bound endpoints validate: one per engine, one per data-parallel rank, one per group of
// engines, beside connect-mode and SSE sources of other backends.
func TestEventSourcesSeveralBound(t *testing.T) {
	for _, tc := range []struct{ name, sources string }{
		{"one per engine", `
    - {endpoint: "tcp://0.0.0.0:5557", bind: true, backend_name: a}
    - {endpoint: "tcp://0.0.0.0:5558", bind: true, backend_name: b}
`},
		{"vLLM's default topic per engine", `
    - {endpoint: "tcp://*:5557", bind: true, topic_backends: {"": a}}
    - {endpoint: "tcp://*:5558", bind: true, topic_backends: {"": b}}
`},
		{"one per data-parallel rank of one engine", `
    - {endpoint: "tcp://0.0.0.0:5557", bind: true, backend_name: a}
    - {endpoint: "tcp://0.0.0.0:5558", bind: true, backend_name: a}
`},
		{"one per rank of every engine", `
    - {endpoint: "tcp://0.0.0.0:5557", bind: true}
    - {endpoint: "tcp://0.0.0.0:5558", bind: true}
`},
		{"groups of engines", `
    - {endpoint: "tcp://0.0.0.0:5557", bind: true, topic_backends: {"kv@10.0.0.1:8000@llama": a, "kv@10.0.0.2:8000@llama": b}}
    - {endpoint: "tcp://0.0.0.0:5558", bind: true}
`},
		{"same port on two hosts", `
    - {endpoint: "tcp://10.0.0.1:5557", bind: true, backend_name: a}
    - {endpoint: "tcp://10.0.0.2:5557", bind: true, backend_name: b}
`},
		{"free ports", `
    - {endpoint: "tcp://127.0.0.1:0", bind: true, backend_name: a}
    - {endpoint: "tcp://127.0.0.1:0", bind: true, backend_name: b}
`},
		{"beside other transports", `
    - {endpoint: "tcp://0.0.0.0:5557", bind: true, backend_name: a}
    - {endpoint: "tcp://0.0.0.0:5558", bind: true}
    - {backend_name: c, endpoint: "tcp://vllm-c:5557"}
    - {backend_name: c, endpoint: "tcp://vllm-c:5558"}
    - {backend_name: d, endpoint: "http://vllm-d:8000/v1/kv_events"}
`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Parse([]byte(fourBackends+tc.sources), env(nil)); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// What would break a backend's order, or could not work, is rejected with the field and the reason.
func TestEventSourcesRejected(t *testing.T) {
	const mixed = "through one consumer (the SSE sources, the connect-mode ZMQ sources and the bound ZMQ endpoints have one each)"
	for _, tc := range []struct {
		name, sources string
		want          []string
	}{
		{"same address", `
    - {endpoint: "tcp://0.0.0.0:5557", bind: true, backend_name: a}
    - {endpoint: "tcp://0.0.0.0:5557", bind: true, backend_name: b}
`, []string{`kv_cache_index.event_sources[1].endpoint: "tcp://0.0.0.0:5557" overlaps the address event_sources[0] binds ("tcp://0.0.0.0:5557"): give each bound endpoint its own port`}},
		{"wildcard host and a host on one port", `
    - {endpoint: "tcp://10.0.0.1:5557", bind: true, backend_name: a}
    - {endpoint: "tcp://*:5557", bind: true, backend_name: b}
`, []string{`kv_cache_index.event_sources[1].endpoint: "tcp://*:5557" overlaps the address event_sources[0] binds ("tcp://10.0.0.1:5557")`}},
		{"same ipc path", `
    - {endpoint: "ipc:///run/kv.sock", bind: true, backend_name: a}
    - {endpoint: "ipc:///run/kv.sock", bind: true, backend_name: b}
`, []string{`kv_cache_index.event_sources[1].endpoint: "ipc:///run/kv.sock" overlaps`}},
		{"bound and connect-mode", `
    - {backend_name: a, endpoint: "tcp://vllm-a:5557"}
    - {endpoint: "tcp://0.0.0.0:5557", bind: true, backend_name: a}
`, []string{`kv_cache_index.event_sources[1].backend_name: "a" already gets its events from event_sources[0] (a connect-mode ZMQ source), and this is a bound ZMQ endpoint: a backend's events must all come ` + mixed}},
		{"topic_backends and SSE", `
    - {endpoint: "tcp://0.0.0.0:5557", bind: true, topic_backends: {"kv@x@m": b}}
    - {backend_name: b, endpoint: "http://vllm-b:8000/v1/kv_events"}
`, []string{`kv_cache_index.event_sources[1].backend_name: "b" already gets its events from event_sources[0] (a bound ZMQ endpoint), and this is an SSE source`}},
		{"SSE and connect-mode", `
    - {backend_name: c, endpoint: "http://vllm-c:8000/v1/kv_events"}
    - {backend_name: c, endpoint: "tcp://vllm-c:5557"}
`, []string{`kv_cache_index.event_sources[1].backend_name: "c" already gets its events from event_sources[0] (an SSE source), and this is a connect-mode ZMQ source`}},
		{"two SSE sources", `
    - {backend_name: c, endpoint: "http://vllm-c:8000/v1/kv_events"}
    - {backend_name: c, endpoint: "http://vllm-c2:8000/v1/kv_events"}
`, []string{`kv_cache_index.event_sources[1].backend_name: "c" already has an SSE event source (event_sources[0])`}},
		{"unknown backend", `
    - {endpoint: "tcp://0.0.0.0:5557", bind: true, backend_name: z, topic_backends: {"t": y}}
`, []string{`kv_cache_index.event_sources[0].backend_name: "z" is not a configured backend`,
			`kv_cache_index.event_sources[0].topic_backends.t: "y" is not a configured backend`}},
		{"a bound endpoint that could place nothing", `
    - {backend_name: a, endpoint: "tcp://vllm-a:5557"}
    - {backend_name: b, endpoint: "tcp://vllm-b:5557"}
    - {backend_name: c, endpoint: "http://vllm-c:8000/v1/kv_events"}
    - {backend_name: d, endpoint: "tcp://vllm-d:5557"}
    - {endpoint: "tcp://0.0.0.0:5557", bind: true}
`, []string{`kv_cache_index.event_sources[4].backend_name: is required here: every backend gets its events from an SSE or connect-mode source`}},
		{"replay on a bound endpoint", `
    - {endpoint: "tcp://0.0.0.0:5557", bind: true, backend_name: a, replay_endpoint: "tcp://vllm-a:5558"}
`, []string{`kv_cache_index.event_sources[0].replay_endpoint: is not supported with bind`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(fourBackends+tc.sources), env(nil))
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error\n%v\ndoes not contain\n%s", err, w)
				}
			}
			if n := len(err.(interface{ Unwrap() []error }).Unwrap()); n != len(tc.want) {
				t.Errorf("%d errors, want %d:\n%v", n, len(tc.want), err)
			}
		})
	}
}

// Several bound endpoints, end to end: the builder makes one consumer binding each; engines
// connect to their own endpoint, and each endpoint's events land only under the backends it may
// name, every endpoint's source connected.
func TestNewEventConsumersSeveralBound(t *testing.T) {
	cfg := mustParse(t, fourBackends+`
    - {endpoint: "tcp://127.0.0.1:0", bind: true, backend_name: a}
    - {endpoint: "tcp://127.0.0.1:0", bind: true, backend_name: b}
    - {endpoint: "tcp://127.0.0.1:0", bind: true}
    - {backend_name: d, endpoint: "tcp://127.0.0.1:${P}"}
`, map[string]string{"P": freePort(t)})
	sink := newRecordingSink()
	cons, err := cfg.NewEventConsumers(sink, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(cons) != 2 {
		t.Fatalf("%d consumers, want the connect-mode one and the bound one", len(cons))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, c := range cons {
		if err := c.Start(ctx); err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	bound := cons[1].(*zmqevents.Consumer)
	addrs := bound.Addrs()
	if len(addrs) != 3 {
		t.Fatalf("addresses %v, want 3", addrs)
	}
	eps := make([]string, len(addrs))
	for i, a := range addrs {
		eps[i] = "tcp://" + a.String()
	}

	// Engine a keeps vLLM's default topic; engine b's topic names pod c, but its endpoint is b's;
	// on the third endpoint the pod names the backend, except d, which its own (connect-mode)
	// source feeds.
	for _, p := range []struct {
		ep, topic string
		n         int
	}{
		{eps[0], "", 3},
		{eps[1], "kv@c@llama", 2},
		{eps[2], "kv@c@m-c", 1},
		{eps[2], "kv@d@m-d", 1},
	} {
		publish(ctx, t, p.ep, p.topic, p.n)
	}
	want := map[string]int{"a": 3, "b": 2, "c": 1}
	deadline := time.Now().Add(10 * time.Second)
	for !sink.has(want) || bound.Listeners()[2].Messages.Unplaced != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("applied %v, want %v; listeners %+v", sink.counts(), want, bound.Listeners())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if got := sink.counts(); len(got) != len(want) {
		t.Errorf("applied %v, want %v only (nothing under d)", got, want)
	}
	if m := sink.model("a"); m != "m-a" {
		t.Errorf("a's model %q, want its backend's (the topic names none)", m)
	}
	if m := sink.model("b"); m != "llama" {
		t.Errorf("b's model %q, want the topic's", m)
	}

	st := bound.Status()
	endpoints := map[string]string{}
	for _, s := range st {
		endpoints[s.Backend] = s.Endpoint
		if !s.Connection.Connected {
			t.Errorf("%s on %s is not connected", s.Backend, s.Endpoint)
		}
	}
	if len(st) != 3 || endpoints["a"] != eps[0] || endpoints["b"] != eps[1] || endpoints["c"] != eps[2] {
		t.Errorf("sources %+v", st)
	}
	for i, l := range bound.Listeners() {
		if !l.Connection.Connected {
			t.Errorf("listener %d: %+v", i, l)
		}
	}
}

// publish connects a PUB socket to ep, waits for the subscription and sends n batches of one
// stored block each on topic, with sequence numbers 0…n-1. The socket stays open until the test
// ends (closing it would clear the backend).
func publish(ctx context.Context, t *testing.T, ep, topic string, n int) {
	t.Helper()
	pub := zmq4.NewPub(ctx, zmq4.WithLogger(log.New(io.Discard, "", 0)),
		zmq4.WithDialerRetry(10*time.Millisecond), zmq4.WithDialerMaxRetries(500))
	t.Cleanup(func() { pub.Close() })
	if err := pub.Dial(ep); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); len(pub.(zmq4.Topics).Topics()) == 0; {
		if time.Now().After(deadline) {
			t.Fatalf("no subscription from %s", ep)
		}
		time.Sleep(5 * time.Millisecond)
	}
	for seq := range n {
		payload, err := msgpack.Marshal([]any{1.0, []any{
			[]any{"BlockStored", []any{uint64(seq + 1)}, nil, make([]uint32, 16), 16, nil, "GPU"},
		}, nil})
		if err != nil {
			t.Fatal(err)
		}
		var sf [8]byte
		binary.BigEndian.PutUint64(sf[:], uint64(seq))
		if err := pub.Send(zmq4.NewMsgFrom([]byte(topic), sf[:], payload)); err != nil {
			t.Fatal(err)
		}
	}
}

// recordingSink counts the batches applied per backend. Safe for concurrent use.
type recordingSink struct {
	mu      sync.Mutex
	applied map[string]int
	models  map[string]string
}

func newRecordingSink() *recordingSink {
	return &recordingSink{applied: map[string]int{}, models: map[string]string{}}
}

func (s *recordingSink) Apply(_ context.Context, backend string, b *events.Batch) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.applied[backend]++
	s.models[backend] = b.Model
	return nil
}

func (s *recordingSink) ClearBackend(context.Context, string) error { return nil }

func (s *recordingSink) counts() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]int, len(s.applied))
	for k, v := range s.applied {
		out[k] = v
	}
	return out
}

func (s *recordingSink) model(backend string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.models[backend]
}

func (s *recordingSink) has(want map[string]int) bool {
	got := s.counts()
	for k, v := range want {
		if got[k] != v {
			return false
		}
	}
	return true
}
