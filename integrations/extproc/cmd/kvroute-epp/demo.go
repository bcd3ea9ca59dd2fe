package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/integrations/extproc/app"
	"github.com/kvroute/kvroute/integrations/extproc/envoysim"
)

// demoGateway is the demo's stand-in for Envoy: an HTTP server whose handler calls the picker
// over ext_proc and forwards each request where it says.
type demoGateway struct {
	srv  *http.Server
	conn *grpc.ClientConn
	ln   net.Listener
}

func startDemoGateway(ctx context.Context, addr, grpcAddr string, log *slog.Logger) (*demoGateway, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("demo gateway: cannot listen on %s: %w (pick another with -addr 127.0.0.1:0)", addr, err)
	}
	conn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		_ = ln.Close()
		return nil, err
	}
	fw, err := envoysim.New(envoysim.Config{Client: extprocv3.NewExternalProcessorClient(conn)})
	if err != nil {
		_ = ln.Close()
		_ = conn.Close()
		return nil, err
	}
	g := &demoGateway{srv: &http.Server{Handler: fw, ReadHeaderTimeout: 10 * time.Second,
		BaseContext: func(net.Listener) context.Context { return ctx }}, conn: conn, ln: ln}
	go func() {
		if err := g.srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			log.Error("demo gateway stopped", "error", err)
		}
	}()
	return g, nil
}

// Addr is where the gateway listens.
func (g *demoGateway) Addr() net.Addr { return g.ln.Addr() }

// Close stops the gateway and its ext_proc connection.
func (g *demoGateway) Close() error {
	err := g.srv.Close()
	return errors.Join(err, g.conn.Close())
}

// printBanner tells a newcomer what runs and how to try it.
func printBanner(w io.Writer, cfg *config.Config, gw net.Addr, ln app.Listeners, demo bool) {
	var b strings.Builder
	model := "<model>"
	if len(cfg.Backends) > 0 && cfg.Backends[0].ModelName() != "" {
		model = cfg.Backends[0].ModelName()
	}
	metrics := "off"
	if ln.Metrics != nil {
		metrics = "http://" + ln.Metrics.Addr().String() + "/metrics"
	}
	fmt.Fprintf(&b, "\nkvroute-epp: ext_proc on %s, gRPC health on %s, metrics on %s\n", ln.GRPC.Addr(), ln.Health.Addr(), metrics)
	if demo {
		fmt.Fprintf(&b, "  pool: %d simulated vLLM engines in this process (KV events over ZMQ):", len(cfg.Backends))
	} else {
		fmt.Fprintf(&b, "  pool: %d backends from the configuration (and those discovery finds):", len(cfg.Backends))
	}
	for _, be := range cfg.Backends {
		fmt.Fprintf(&b, " %s=%s", be.Name, strings.TrimPrefix(be.URL, "http://"))
	}
	fmt.Fprintf(&b, "\n  a Go stand-in for Envoy (ext_proc filter + ORIGINAL_DST) on http://%s\n\n", gw)
	fmt.Fprintf(&b, "Try it (run it twice: the second answer comes from the engine that cached the prompt, X-Kvroute-Route: kv_aware, once its KV events came):\n\n")
	fmt.Fprintf(&b, "  curl -s -D - http://%s/v1/chat/completions -H 'Content-Type: application/json' \\\n", gw)
	fmt.Fprintf(&b, "    -d '{\"model\":\"%s\",\"max_tokens\":16,\"messages\":[{\"role\":\"system\",\"content\":\"You are a helpful assistant who answers in one short paragraph, citing the facts you rely on.\"},{\"role\":\"user\",\"content\":\"Hello!\"}]}'\n\n", model)
	fmt.Fprintf(&b, "Ctrl-C stops it.\n")
	fmt.Fprint(w, b.String())
}
