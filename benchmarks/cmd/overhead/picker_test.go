package main

import (
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/integrations/extproc"
	"github.com/kvroute/kvroute/integrations/extproc/envoysim"
	"github.com/kvroute/kvroute/internal/enginesim"
)

// servePicker serves srv on a loopback gRPC listener until the test ends and returns a client
// connection to it.
func servePicker(t *testing.T, srv extprocv3.ExternalProcessorServer) *grpc.ClientConn {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(g, srv)
	go func() { _ = g.Serve(ln) }()
	t.Cleanup(g.Stop)
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// The pickers of (f) to (h) behind envoysim, in the body modes the protocol allows: the
// measurement's request reaches the engine and its whole answer comes back, and kvroute's picker
// names itself in the answer's headers while the no-op picker adds nothing.
func TestPickersThroughEnvoysim(t *testing.T) {
	fleet, err := enginesim.StartFleet(t.Context(), enginesim.FleetConfig{N: 1, ZMQ: true,
		Base: enginesim.Config{Latency: enginesim.Latency{SpeedFactor: 0}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fleet.Close() })
	in := fleet.Info()[0]
	eng := engineInfo{Name: in.Name, Model: in.Model, URL: in.URL, ZMQEndpoint: in.ZMQEndpoint,
		ReplayEndpoint: in.ReplayEndpoint, BlockSize: in.BlockSize}

	pickers := map[string]extprocv3.ExternalProcessorServer{"noop": &noopPicker{endpoint: hostPort(eng.URL)}}
	for name, kv := range map[string]bool{"tier1": false, "kv-index": true} {
		cfg, err := config.Parse([]byte(pickerConfig(eng, kv, "estimate")), nil)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		p, closeAll, err := newKvroutePicker(t.Context(), cfg)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		t.Cleanup(closeAll)
		pickers[name] = p
	}
	body := chatBody(eng.Model, "t", 16, true)
	for name, p := range pickers {
		conn := servePicker(t, p)
		for _, mode := range []extproc.BodyMode{extproc.BodyFullDuplex, extproc.BodyBuffered, extproc.BodyStreamed, extproc.BodyNone} {
			fw, err := envoysim.New(envoysim.Config{Client: extprocv3.NewExternalProcessorClient(conn),
				RequestBodyMode: mode, ResponseBodyMode: mode, ChunkSize: 256, Transport: upstreamTransport(4)})
			if err != nil {
				t.Fatal(err)
			}
			gw := httptest.NewServer(fw)
			resp, err := gw.Client().Post(gw.URL+"/v1/chat/completions", "application/json", bytes.NewReader(body()))
			if err != nil {
				t.Fatalf("%s, mode %d: %v", name, mode, err)
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			gw.Close()
			if err != nil || resp.StatusCode != http.StatusOK {
				t.Fatalf("%s, mode %d: status %d, %v: %s", name, mode, resp.StatusCode, err, b)
			}
			var answer struct {
				Choices []struct {
					Message struct{ Content string } `json:"message"`
				} `json:"choices"`
			}
			if err := json.Unmarshal(b, &answer); err != nil || len(answer.Choices) != 1 ||
				len(strings.Fields(answer.Choices[0].Message.Content)) != 16 {
				t.Errorf("%s, mode %d: the answer is not whole (%v): %s", name, mode, err, b)
			}
			if got := resp.Header.Get(enginesim.HeaderEngine); got != eng.Name {
				t.Errorf("%s, mode %d: answered by %q, want %q", name, mode, got, eng.Name)
			}
			if got, want := resp.Header.Get("X-Kvroute-Backend"), map[bool]string{true: "", false: eng.Name}[name == "noop"]; got != want {
				t.Errorf("%s, mode %d: X-Kvroute-Backend %q, want %q", name, mode, got, want)
			}
		}
	}
}

func TestPickerConfig(t *testing.T) {
	e := engineInfo{Name: "enginesim-0", Model: "m/x", URL: "http://127.0.0.1:1", ZMQEndpoint: "tcp://127.0.0.1:2",
		ReplayEndpoint: "tcp://127.0.0.1:3", BlockSize: 16}
	for _, kv := range []bool{false, true} {
		cfg, err := config.Parse([]byte(pickerConfig(e, kv, "engine")), nil)
		if err != nil {
			t.Fatalf("kv %v: %v", kv, err)
		}
		if cfg.ResponseCache.Enabled || cfg.KVCacheIndex.Enabled != kv || !*cfg.PrefixRouting.Enabled || *cfg.HealthChecks.Enabled {
			t.Errorf("kv %v: response cache %v, KV index %v, prefix routing %v, health checks %v", kv,
				cfg.ResponseCache.Enabled, cfg.KVCacheIndex.Enabled, *cfg.PrefixRouting.Enabled, *cfg.HealthChecks.Enabled)
		}
		if kv && (cfg.KVCacheIndex.Tokenizer != "engine" || len(cfg.KVCacheIndex.EventSources) != 1) {
			t.Errorf("KV index: tokenizer %q, %d event sources", cfg.KVCacheIndex.Tokenizer, len(cfg.KVCacheIndex.EventSources))
		}
	}
}

func TestPickerFlags(t *testing.T) {
	for _, args := range [][]string{nil, {"-noop", "127.0.0.1:1", "-config", "x.yaml"}, {"-noop", "nowhere"}, {"-noop", "127.0.0.1:1", "extra"}} {
		if err := pickerMain(t.Context(), args, io.Discard, io.Discard); err == nil {
			t.Errorf("picker %q: no error", args)
		}
	}
	for _, args := range [][]string{nil, {"-extproc", "nowhere"}, {"-extproc", "127.0.0.1:1", "-max-idle", "0"}} {
		if err := gatewayMain(t.Context(), args, io.Discard, io.Discard); err == nil {
			t.Errorf("gateway %q: no error", args)
		}
	}
}
