package app

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/integrations/extproc"
)

// testApp builds an App over two HTTP backends from a YAML configuration, with its listeners on
// free loopback ports.
func testApp(t *testing.T, extra string) (*App, Listeners) {
	t.Helper()
	var backends string
	for i := range 2 {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("ok")) }))
		t.Cleanup(srv.Close)
		backends += fmt.Sprintf("  - name: b%d\n    url: %s\n", i, srv.URL)
	}
	cfg, err := config.Parse([]byte("backends:\n"+backends+extra), func(string) (string, bool) { return "", false })
	if err != nil {
		t.Fatal(err)
	}
	a, err := New(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close() })
	var ln Listeners
	for _, l := range []*net.Listener{&ln.GRPC, &ln.Health} {
		if *l, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
			t.Fatal(err)
		}
	}
	return a, ln
}

func healthOf(t *testing.T, addr, service string) healthpb.HealthCheckResponse_ServingStatus {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	res, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: service})
	if err != nil {
		return healthpb.HealthCheckResponse_UNKNOWN
	}
	return res.GetStatus()
}

// TestHealthServices: liveness answers SERVING from the start; readiness and the ext_proc
// service only once the App has started, and no longer once it drains.
func TestHealthServices(t *testing.T) {
	a, ln := testApp(t, "server:\n  shutdown_timeout: 5s\n")
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- a.Serve(ctx, ln) }()
	addr := ln.Health.Addr().String()
	if got := healthOf(t, addr, extproc.HealthLiveness); got != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("liveness before Start: %v", got)
	}
	for _, svc := range []string{extproc.HealthReadiness, extproc.HealthExtProc} {
		if got := healthOf(t, addr, svc); got != healthpb.HealthCheckResponse_NOT_SERVING {
			t.Errorf("%s before Start: %v, want NOT_SERVING", svc, got)
		}
	}
	if err := a.Start(ctx); err != nil {
		t.Fatal(err)
	}
	for _, svc := range []string{extproc.HealthReadiness, extproc.HealthExtProc, ""} {
		if got := healthOf(t, addr, svc); got != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("%q after Start: %v, want SERVING", svc, got)
		}
	}
	// A stream in progress holds the drain open; meanwhile readiness says NOT_SERVING.
	s := openStream(t, ln.GRPC.Addr().String())
	sendHeaders(t, s)
	waitFor(t, func() bool { return a.Server.Stats().Streams == 1 })
	cancel()
	waitFor(t, func() bool {
		return healthOf(t, addr, extproc.HealthReadiness) == healthpb.HealthCheckResponse_NOT_SERVING
	})
	if got := healthOf(t, addr, extproc.HealthLiveness); got != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("liveness while draining: %v", got)
	}
	_ = s.CloseSend()
	if err := <-served; err != nil {
		t.Fatal(err)
	}
}

// TestDrainCutsStreamsAtTheTimeout: a stream still open at the end of server.shutdown_timeout is
// cut, and its request's decision ends (the Router holds no slot).
func TestDrainCutsStreamsAtTheTimeout(t *testing.T) {
	a, ln := testApp(t, "server:\n  shutdown_timeout: 200ms\n")
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- a.Serve(ctx, ln) }()
	if err := a.Start(ctx); err != nil {
		t.Fatal(err)
	}
	pickedStream(t, ln.GRPC.Addr().String()) // a decision is open
	cancel()
	select {
	case err := <-served:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return after the shutdown timeout")
	}
	waitFor(t, func() bool {
		st, err := a.Router.Stats(context.Background())
		if err != nil {
			return false
		}
		for _, b := range st.Backends {
			if b.InFlight != 0 {
				return false
			}
		}
		return a.Server.Stats().Outcomes["not_sent"] == 1
	})
}

// openStream opens an ext_proc stream to the picker at addr.
func openStream(t *testing.T, addr string) extprocv3.ExternalProcessor_ProcessClient {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	s, err := extprocv3.NewExternalProcessorClient(conn).Process(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// pickedStream opens a stream and sends a chat request whole; it returns once the picker has
// picked (a decision is open until the stream ends).
func pickedStream(t *testing.T, addr string) extprocv3.ExternalProcessor_ProcessClient {
	t.Helper()
	s := openStream(t, addr)
	sendHeaders(t, s)
	if err := s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
		Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`), EndOfStream: true}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); err != nil {
		t.Fatal(err)
	}
	return s
}

func sendHeaders(t *testing.T, s extprocv3.ExternalProcessor_ProcessClient) {
	t.Helper()
	if err := s.Send(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
				{Key: ":method", RawValue: []byte("POST")}, {Key: ":path", RawValue: []byte("/v1/chat/completions")}}}}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED},
	}); err != nil {
		t.Fatal(err)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 5 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestNewRefusesCleanly: a configuration New cannot serve is an error that names the problem,
// with what New had built closed (no panic): two backends on one endpoint, a backend named by a
// host name (the protocol's endpoints are ip:port).
func TestNewRefusesCleanly(t *testing.T) {
	for name, c := range map[string]struct{ yaml, want string }{
		"shared endpoint": {"backends:\n  - {name: a, url: http://127.0.0.1:18001}\n  - {name: b, url: http://127.0.0.1:18001/v2}\n", "already belongs"},
		"host name":       {"backends:\n  - {name: a, url: http://localhost:18001}\n", "IP address"},
	} {
		cfg, err := config.Parse([]byte(c.yaml), func(string) (string, bool) { return "", false })
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		a, err := New(cfg, Options{})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: New = %v, %v; want an error saying %q", name, a, err, c.want)
		}
	}
}
