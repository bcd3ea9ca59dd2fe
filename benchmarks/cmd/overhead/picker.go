package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/integrations/extproc"
	"github.com/kvroute/kvroute/integrations/extproc/app"
)

// pickerCommand is the first argument that makes the program an endpoint picker, an Envoy
// ext_proc server on gRPC, behind targets (f) to (h):
//
//	overhead picker -noop 127.0.0.1:8001 [-pprof ADDR]   # (f): every request to that endpoint
//	overhead picker -config FILE [-pprof ADDR]           # (g), (h): kvroute's extproc.Server
//
// The no-op picker answers every ext_proc message as the Endpoint Picker Protocol asks, with the
// fixed endpoint in x-gateway-destination-endpoint and the envoy.lb metadata, and does nothing
// else: what any picker's round trips cost. The other is kvroute's extproc.Server with the Router
// kvroute-epp builds from the configuration FILE (kvroute's YAML: tier 1, and tier 4 when
// kv_cache_index is on, fed by the engine's ZMQ events), recording its metrics in an
// OpenTelemetry SDK MeterProvider as kvroute-epp does. It prints "picker listening on HOST:PORT"
// on stdout and serves until killed or interrupted.
const pickerCommand = "picker"

// pickerBanner opens the line that gives a picker's gRPC address.
const pickerBanner = "picker listening on "

// pickerMain serves a picker until ctx ends.
func pickerMain(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("overhead picker", flag.ContinueOnError)
	fs.SetOutput(stderr)
	noop := fs.String("noop", "", "serve the no-op picker that sends every request to this endpoint (host:port)")
	cfgPath := fs.String("config", "", "serve kvroute's extproc.Server with the Router this kvroute YAML configuration builds")
	addr := fs.String("addr", "127.0.0.1:0", "gRPC listen address")
	pprofAddr := fs.String("pprof", "", "serve net/http/pprof on this address (logged on stderr); off when empty")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("picker: unexpected arguments %q", fs.Args())
	}
	if (*noop == "") == (*cfgPath == "") {
		return errors.New("picker: give -noop ENDPOINT or -config FILE")
	}
	var (
		srv     extprocv3.ExternalProcessorServer
		maxBody int64 // extproc's default
		cleanup = func() {}
	)
	if *noop != "" {
		if _, _, err := net.SplitHostPort(*noop); err != nil {
			return fmt.Errorf("-noop %q: want host:port", *noop)
		}
		srv = &noopPicker{endpoint: *noop}
	} else {
		cfg, err := config.Load(*cfgPath)
		if err != nil {
			return err
		}
		p, closeAll, err := newKvroutePicker(ctx, cfg)
		if err != nil {
			return err
		}
		srv, cleanup, maxBody = p, closeAll, cfg.Server.MaxBodyBytes
	}
	defer cleanup()

	g := grpc.NewServer(extproc.ServerOptions(maxBody)...)
	extprocv3.RegisterExternalProcessorServer(g, srv)
	return serveChild(ctx, *addr, *pprofAddr, pickerBanner, stdout, stderr, func(ln net.Listener) (func() error, func() error) {
		return func() error { return g.Serve(ln) }, func() error { g.Stop(); return nil }
	})
}

// newKvroutePicker builds kvroute's extproc.Server as kvroute-epp builds it from cfg (package
// app: the KV index and its event consumers, the engine tokenizer, the Router, health checks as
// configured, the pool's endpoints, the body budget), with an OpenTelemetry SDK MeterProvider for
// the metrics the Router and the Server record, and starts it. closeAll releases everything.
func newKvroutePicker(ctx context.Context, cfg *config.Config) (srv *extproc.Server, closeAll func(), err error) {
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	a, err := app.New(cfg, app.Options{MeterProvider: mp})
	if err != nil {
		_ = mp.Shutdown(context.Background())
		return nil, nil, err
	}
	closeAll = func() {
		_ = a.Close()
		_ = mp.Shutdown(context.Background())
	}
	if err := a.Start(ctx); err != nil {
		closeAll()
		return nil, nil, err
	}
	return a.Server, closeAll, nil
}

// noopPicker is target (f)'s picker: every request goes to endpoint. It answers each ext_proc
// message in the order and the shape the Endpoint Picker Protocol asks of any picker (the
// destination header and metadata in the answer Envoy waits for before it routes, the bodies
// handed back in full duplex), and nothing else: no parsing, no routing, no bookkeeping.
type noopPicker struct {
	extprocv3.UnimplementedExternalProcessorServer
	endpoint string
}

// Process implements extprocv3.ExternalProcessorServer: one HTTP request's stream.
func (p *noopPicker) Process(srv extprocv3.ExternalProcessor_ProcessServer) error {
	reqMode, respMode := filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	var body []byte
	for {
		req, err := srv.Recv()
		if err != nil {
			if err == io.EOF || status.Code(err) == codes.Canceled || srv.Context().Err() != nil {
				return nil
			}
			return err
		}
		if pc := req.GetProtocolConfig(); pc != nil {
			reqMode, respMode = pc.GetRequestBodyMode(), pc.GetResponseBodyMode()
		}
		var out []*extprocv3.ProcessingResponse
		switch r := req.Request.(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			switch {
			case r.RequestHeaders.GetEndOfStream() || reqMode == filterv3.ProcessingMode_NONE || reqMode == filterv3.ProcessingMode_STREAMED:
				out = append(out, p.headersAnswer())
			case reqMode == filterv3.ProcessingMode_BUFFERED || reqMode == filterv3.ProcessingMode_BUFFERED_PARTIAL:
				out = append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
					RequestHeaders: &extprocv3.HeadersResponse{}}})
			} // full duplex: the headers' answer waits for the body's end
		case *extprocv3.ProcessingRequest_RequestBody:
			b := r.RequestBody
			switch reqMode {
			case filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
				body = append(body, b.GetBody()...)
				if b.GetEndOfStream() {
					out = append(out, p.headersAnswer(), &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
						RequestBody: &extprocv3.BodyResponse{Response: streamedBody(body, true)}}})
					body = nil
				}
			case filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_BUFFERED_PARTIAL:
				c, md := p.destination()
				out = append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
					RequestBody: &extprocv3.BodyResponse{Response: c}}, DynamicMetadata: md})
			default:
				out = append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
					RequestBody: &extprocv3.BodyResponse{}}})
			}
		case *extprocv3.ProcessingRequest_RequestTrailers:
			out = append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
				RequestTrailers: &extprocv3.TrailersResponse{}}})
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			out = append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
				ResponseHeaders: &extprocv3.HeadersResponse{}}})
		case *extprocv3.ProcessingRequest_ResponseBody:
			resp := &extprocv3.BodyResponse{}
			if respMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
				resp.Response = streamedBody(r.ResponseBody.GetBody(), r.ResponseBody.GetEndOfStream())
			}
			out = append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: resp}})
		case *extprocv3.ProcessingRequest_ResponseTrailers:
			out = append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
				ResponseTrailers: &extprocv3.TrailersResponse{}}})
		default:
			return status.Error(codes.InvalidArgument, "a message without a request")
		}
		for _, resp := range out {
			if err := srv.Send(resp); err != nil {
				return err
			}
		}
	}
}

// destination returns the answer that routes the request to p.endpoint: the destination header,
// and the same endpoint in the dynamic metadata.
func (p *noopPicker) destination() (*extprocv3.CommonResponse, *structpb.Struct) {
	c := &extprocv3.CommonResponse{
		ClearRouteCache: true,
		HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{
			Header:       &corev3.HeaderValue{Key: extproc.HeaderDestination, RawValue: []byte(p.endpoint)},
			AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
		}}},
	}
	md := &structpb.Struct{Fields: map[string]*structpb.Value{
		extproc.DefaultDestinationNamespace: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			extproc.HeaderDestination: structpb.NewStringValue(p.endpoint),
		}}),
	}}
	return c, md
}

// headersAnswer is the request headers' answer with the destination.
func (p *noopPicker) headersAnswer() *extprocv3.ProcessingResponse {
	c, md := p.destination()
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
		RequestHeaders: &extprocv3.HeadersResponse{Response: c}}, DynamicMetadata: md}
}

// streamedBody hands a body (or a chunk of it) back to Envoy unchanged, as full duplex requires.
func streamedBody(b []byte, eos bool) *extprocv3.CommonResponse {
	return &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
		StreamedResponse: &extprocv3.StreamedBodyResponse{Body: b, EndOfStream: eos}}}}
}

// hostPort returns the host:port of an http:// root.
func hostPort(root string) string {
	return strings.TrimPrefix(root, "http://")
}
