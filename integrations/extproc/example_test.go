package extproc_test

import (
	"context"
	"log"
	"net"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/integrations/extproc"
	"github.com/kvroute/kvroute/kvhttp"
)

// Embedding the endpoint picker in a gRPC server of your own: a Router over the pool's engines,
// their endpoints, the Server, the options its messages need, and the health services the
// Endpoint Picker Protocol names. (kvroute-epp does the same from kvroute's YAML, with the KV
// index, health checks and discovery.)
func Example() {
	router, err := kvroute.New(kvroute.Config{Backends: []kvroute.Backend{{Name: "vllm-0"}, {Name: "vllm-1"}}})
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()
	endpoints := extproc.NewEndpoints()
	for name, ep := range map[string]string{"vllm-0": "10.0.0.7:8000", "vllm-1": "10.0.0.8:8000"} {
		if err := endpoints.Set(name, ep); err != nil {
			log.Fatal(err)
		}
	}
	const maxBody = 8 << 20
	picker, err := extproc.New(extproc.Config{Router: router, Endpoints: endpoints, MaxBodyBytes: maxBody,
		BodyBudget: kvhttp.NewBudget(128 << 20)})
	if err != nil {
		log.Fatal(err)
	}
	defer picker.Close()

	srv := grpc.NewServer(extproc.ServerOptions(maxBody)...)
	extprocv3.RegisterExternalProcessorServer(srv, picker)
	status := health.NewServer()
	for _, svc := range []string{"", extproc.HealthLiveness, extproc.HealthReadiness, extproc.HealthExtProc} {
		status.SetServingStatus(svc, healthpb.HealthCheckResponse_SERVING)
	}
	healthpb.RegisterHealthServer(srv, status)

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()

	// On shutdown: readiness first, then the streams in flight get a while to end, then the
	// rest are cut (their requests' decisions end as not sent).
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	status.SetServingStatus(extproc.HealthReadiness, healthpb.HealthCheckResponse_NOT_SERVING)
	stopped := make(chan struct{})
	go func() { srv.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-ctx.Done():
		srv.Stop()
	}
	// Output:
}
