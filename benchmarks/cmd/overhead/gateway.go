package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvroute/kvroute/integrations/extproc"
	"github.com/kvroute/kvroute/integrations/extproc/envoysim"
)

// gatewayCommand is the first argument that makes the program the stand-in for Envoy in front of
// a picker, targets (f) to (h):
//
//	overhead gateway -extproc 127.0.0.1:9002 [-addr 127.0.0.1:0] [-max-idle 256] [-pprof ADDR]
//
// an http.Server whose handler is an envoysim.Forwarder: each request's headers and body go to
// the picker over one ext_proc stream (one gRPC connection for all of them, as an Envoy worker
// keeps), full duplex both ways (the mode the Endpoint Picker Protocol requires), then to the
// endpoint the picker names, over a Transport tuned as the relay's. Every picker gets an identical
// gateway, so that the differences between (f), (g) and (h) are the pickers'. It prints "gateway
// listening on http://HOST:PORT" on stdout and serves until killed or interrupted.
const gatewayCommand = "gateway"

// gatewayBanner opens the line that gives the gateway's address.
const gatewayBanner = "gateway listening on "

// gatewayMain serves the gateway until ctx ends.
func gatewayMain(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("overhead gateway", flag.ContinueOnError)
	fs.SetOutput(stderr)
	picker := fs.String("extproc", "", "the picker's gRPC address, host:port (required)")
	addr := fs.String("addr", "127.0.0.1:0", "listen address")
	maxIdle := fs.Int("max-idle", 2*DefaultConns, "idle upstream connections kept (MaxIdleConnsPerHost): at least the clients' connections")
	pprofAddr := fs.String("pprof", "", "serve net/http/pprof on this address (logged on stderr); off when empty")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("gateway: unexpected arguments %q", fs.Args())
	}
	if _, _, err := net.SplitHostPort(*picker); err != nil {
		return fmt.Errorf("-extproc %q: want host:port", *picker)
	}
	if *maxIdle < 1 {
		return fmt.Errorf("-max-idle %d: want ≥ 1", *maxIdle)
	}
	conn, err := grpc.NewClient(*picker, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	fw, err := envoysim.New(envoysim.Config{Client: extprocv3.NewExternalProcessorClient(conn),
		RequestBodyMode: extproc.BodyFullDuplex, ResponseBodyMode: extproc.BodyFullDuplex,
		Transport: upstreamTransport(*maxIdle)})
	if err != nil {
		return err
	}
	srv := &http.Server{
		Handler:           fw,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          log.New(stderr, "gateway: ", log.LstdFlags),
	}
	return serveChild(ctx, *addr, *pprofAddr, gatewayBanner+"http://", stdout, stderr, httpServe(srv))
}
