package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/integrations/extproc"
	"github.com/kvroute/kvroute/kvhttp"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
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
		maxMsg  = 4 << 20
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
		srv, cleanup = p, closeAll
		maxMsg = int(min(cfg.Server.MaxBodyBytes+1<<20, math.MaxInt32)) // a buffered body comes in one message
	}
	defer cleanup()

	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", *addr)
	if err != nil {
		return err
	}
	if *pprofAddr != "" {
		stop, err := servePprof(ctx, *pprofAddr, stderr)
		if err != nil {
			ln.Close()
			return err
		}
		defer stop()
	}
	g := grpc.NewServer(grpc.MaxRecvMsgSize(maxMsg))
	extprocv3.RegisterExternalProcessorServer(g, srv)
	fmt.Fprintf(stdout, "%s%s\n", pickerBanner, ln.Addr())
	errc := make(chan error, 1)
	go func() { errc <- g.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	g.Stop()
	<-errc
	return nil
}

// newKvroutePicker builds kvroute's extproc.Server as kvroute-epp composes it from cfg: the KV
// index and the consumers of the engines' events when kv_cache_index is on (the engine's
// /tokenize as the tokenizer with tokenizer engine), the Router, the pool's endpoints from the
// backends' URLs, the body budget, and an OpenTelemetry SDK MeterProvider for the metrics the
// Router and the Server record. Health checks are the configuration's business (the measurement
// turns them off). closeAll releases everything.
func newKvroutePicker(ctx context.Context, cfg *config.Config) (srv *extproc.Server, closeAll func(), err error) {
	var closers []func() error
	closeAll = func() {
		for i := len(closers) - 1; i >= 0; i-- {
			_ = closers[i]()
		}
	}
	defer func() {
		if err != nil {
			closeAll()
		}
	}()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	closers = append(closers, func() error { return mp.Shutdown(context.Background()) })
	opts := config.Options{MeterProvider: mp}

	var index kvindex.KvCacheIndex
	var tok prefixkey.Tokenizer
	if cfg.KVCacheIndex.Enabled {
		var closeIndex func() error
		if index, closeIndex, err = cfg.NewKVIndex(); err != nil {
			return nil, nil, err
		}
		closers = append(closers, closeIndex)
		cons, err := cfg.NewEventConsumers(index, opts)
		if err != nil {
			return nil, nil, err
		}
		for _, c := range cons {
			closers = append(closers, c.Close)
			if err := c.Start(ctx); err != nil {
				return nil, nil, fmt.Errorf("kv events: %w", err)
			}
		}
		if cfg.KVCacheIndex.Tokenizer == config.TokenizerEngine {
			if len(cfg.Backends) != 1 {
				return nil, nil, fmt.Errorf("tokenizer engine: the measurement's picker has one backend, not %d", len(cfg.Backends))
			}
			if tok, err = prefixkey.NewEngineTokenizer(prefixkey.EngineTokenizerConfig{BaseURL: cfg.Backends[0].URL,
				Timeout: time.Duration(cfg.KVCacheIndex.TokenizeTimeout), CacheBytes: cfg.KVCacheIndex.TokenizeCacheBytes}); err != nil {
				return nil, nil, err
			}
		}
	}
	rcfg, err := cfg.RouterConfig(opts)
	if err != nil {
		return nil, nil, err
	}
	rcfg.KV = cfg.KVConfig(index, tok)
	router, err := kvroute.New(rcfg)
	if err != nil {
		return nil, nil, fmt.Errorf("router: %w", err)
	}
	closers = append(closers, router.Close)
	eps := extproc.NewEndpoints()
	for _, b := range cfg.Backends {
		ep, err := extproc.EndpointOfURL(b.URL)
		if err != nil {
			return nil, nil, fmt.Errorf("backend %s: %w", b.Name, err)
		}
		if err := eps.Set(b.Name, ep); err != nil {
			return nil, nil, err
		}
	}
	if srv, err = extproc.New(extproc.Config{Router: router, Endpoints: eps, MaxBodyBytes: cfg.Server.MaxBodyBytes,
		BodyBudget: kvhttp.NewBudget(cfg.Server.MaxInflightBodyBytes), MeterProvider: mp}); err != nil {
		return nil, nil, err
	}
	closers = append(closers, srv.Close)
	return srv, closeAll, nil
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
