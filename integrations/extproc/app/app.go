// Package app composes kvroute-epp from kvroute's configuration: the KV index and the consumers
// of the engines' KV events, the Router, health checks, the pool's endpoints, the ext_proc
// server, and the gRPC health service Kubernetes probes. The command (cmd/kvroute-epp), its tests
// and the overhead benchmark build the same App; a program of yours that wants kvroute-epp whole,
// from the same YAML, builds one too (New, Start, Serve, Close).
package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"sync"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"go.opentelemetry.io/otel/metric"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/events"
	kvhealth "github.com/kvroute/kvroute/health"
	"github.com/kvroute/kvroute/integrations/extproc"
	"github.com/kvroute/kvroute/integrations/extproc/discovery"
	"github.com/kvroute/kvroute/kvhttp"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/stack"
)

// Options are what the command passes besides the configuration.
type Options struct {
	// Logger receives the logs; nil discards them.
	Logger *slog.Logger
	// MeterProvider receives the metrics; nil means none.
	MeterProvider metric.MeterProvider
	// Metrics, when set, is served at /metrics on the metrics listener.
	Metrics http.Handler
	// Resolver resolves endpoint_picker.discovery.dns_name; nil is net.DefaultResolver.
	Resolver discovery.Resolver
}

// App is one kvroute-epp.
type App struct {
	cfg       *config.Config
	log       *slog.Logger
	opts      config.Options
	Router    *kvroute.DefaultRouter
	Server    *extproc.Server
	Endpoints *extproc.Endpoints
	Health    *kvhealth.Monitor
	Index     kvindex.KvCacheIndex // nil when kv_cache_index is off

	cons    []config.EventConsumer
	fleet   *stack.Fleet           // replicas and engine_metrics; its parts are nil when off
	sink    events.Sink            // what the KV events feed: the event log, else the index
	tok     *stack.EngineTokenizer // nil unless kv_cache_index.tokenizer is engine
	watcher *discovery.Watcher
	// metricsTargets sets the engine-metrics scraper's targets; nil when engine_metrics is off.
	metricsTargets func(map[string]string) error
	ctx            context.Context // the App's life: what it starts later (discovered engines' consumers) stops with it
	cancel         context.CancelFunc
	transport      *http.Transport
	grpc           *grpc.Server
	probes         *grpc.Server
	status         *health.Server
	metrics        http.Handler

	mu      sync.Mutex
	closers []func() error
	started bool
	closed  bool
}

// New builds an App from cfg (defaults applied, validated). Nothing talks to the network yet but
// the stores' own clients; Start starts the rest.
func New(cfg *config.Config, o Options) (_ *App, err error) {
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	a := &App{cfg: cfg, log: log, Endpoints: extproc.NewEndpoints(), metrics: o.Metrics,
		opts: config.Options{MeterProvider: o.MeterProvider, Logger: log}}
	a.ctx, a.cancel = context.WithCancel(context.Background())
	a.closers = append(a.closers, func() error { a.cancel(); return nil })
	defer func() {
		if err != nil {
			_ = a.Close()
		}
	}()
	a.transport = kvhttp.NewTransport(time.Duration(cfg.Server.UpstreamDialTimeout))
	a.closers = append(a.closers, func() error { a.transport.CloseIdleConnections(); return nil })

	// Tier 4: the KV index; the replicas (decisions over NATS, the engines' KV events through
	// the JetStream event log) and the engines' own load, built as the reference proxy builds
	// them (package stack); then the consumers of the engines' KV events, into the event log
	// when it is on, else into the index.
	if cfg.KVCacheIndex.Enabled {
		index, closeIndex, err := cfg.NewKVIndex()
		if err != nil {
			return nil, err
		}
		a.Index = index
		a.closers = append(a.closers, closeIndex)
	}
	if a.fleet, err = stack.NewFleet(cfg, a.opts, stack.FleetOptions{Index: a.Index, ClientName: "kvroute-epp"}); err != nil {
		return nil, err
	}
	a.closers = append(a.closers, a.fleet.Close)
	if cfg.EngineMetrics.Enabled {
		a.metricsTargets = a.fleet.SetMetricsTargets
	}
	var tok prefixkey.Tokenizer
	if a.Index != nil {
		a.sink = a.fleet.EventsSink()
		if a.cons, err = cfg.NewEventConsumers(a.sink, a.opts); err != nil {
			return nil, err
		}
		for _, c := range a.cons {
			a.closers = append(a.closers, c.Close)
		}
		if cfg.KVCacheIndex.Tokenizer == config.TokenizerEngine {
			if a.tok, err = stack.NewEngineTokenizer(cfg, &http.Client{Transport: a.transport}, a.InRotation); err != nil {
				return nil, err
			}
			tok = a.tok
		}
	}

	// The Router, tiers 1 and 4, with the peers' decisions when replicas are on.
	rcfg, err := cfg.RouterConfig(a.opts)
	if err != nil {
		return nil, err
	}
	rcfg.KV = cfg.KVConfig(a.Index, tok)
	if p := a.fleet.Peers(); p != nil {
		rcfg.Peers = p
	}
	if a.Router, err = kvroute.New(rcfg); err != nil {
		return nil, fmt.Errorf("router: %w", err)
	}
	a.closers = append(a.closers, a.Router.Close)
	a.fleet.SetRouter(a.Router)

	// Health probes and circuit breakers take backends in and out of the Router's rotation.
	if a.Health, err = stack.NewHealth(cfg, a.Router, a.transport, log.With("component", "health")); err != nil {
		return nil, err
	}
	a.closers = append(a.closers, func() error { a.Health.Close(); return nil })

	for _, b := range cfg.Backends {
		ep, err := extproc.EndpointOfURL(b.URL)
		if err != nil {
			return nil, fmt.Errorf("backend %s: %w", b.Name, err)
		}
		if host, _, _ := net.SplitHostPort(ep); net.ParseIP(host) == nil {
			return nil, fmt.Errorf("backend %s: url %s: the endpoint picker names endpoints as ip:port, which Envoy connects to as they are: "+
				"give the engine's IP address, or find the engines by their DNS name with endpoint_picker.discovery", b.Name, b.URL)
		}
		if err := a.Endpoints.Set(b.Name, ep); err != nil {
			return nil, err
		}
	}

	ep := cfg.EndpointPicker
	mode := extproc.FailClosed
	if ep.FailOpen() {
		mode = extproc.FailOpen
	}
	if a.Server, err = extproc.New(extproc.Config{
		Router: a.Router, Endpoints: a.Endpoints, InRotation: a.Health.InRotation,
		FailureMode: mode, Fallbacks: ep.FallbackEndpoints, MaxBodyBytes: cfg.Server.MaxBodyBytes,
		BodyIdleTimeout:      time.Duration(cfg.Server.BodyIdleTimeout),
		ReadTimeout:          time.Duration(cfg.Server.ReadTimeout),
		BodyBudget:           kvhttp.NewBudget(cfg.Server.MaxInflightBodyBytes),
		DestinationNamespace: ep.DestinationNamespace, SubsetNamespace: ep.SubsetNamespace,
		Logger: log.With("component", "ext_proc"), MeterProvider: o.MeterProvider,
	}); err != nil {
		return nil, err
	}
	a.closers = append(a.closers, a.Server.Close)
	if ep.Discovery.Enabled() {
		if err := a.newDiscovery(o); err != nil {
			return nil, err
		}
	}

	// gRPC: ext_proc on its listener, health on its own (Kubernetes probes it). A buffered body
	// comes in one message: the message limit follows max_body_bytes.
	a.grpc = grpc.NewServer(extproc.ServerOptions(cfg.Server.MaxBodyBytes)...)
	extprocv3.RegisterExternalProcessorServer(a.grpc, a.Server)
	a.status = health.NewServer()
	a.status.SetServingStatus(extproc.HealthLiveness, healthpb.HealthCheckResponse_SERVING)
	for _, svc := range []string{"", extproc.HealthReadiness, extproc.HealthExtProc} {
		a.status.SetServingStatus(svc, healthpb.HealthCheckResponse_NOT_SERVING)
	}
	a.probes = grpc.NewServer()
	healthpb.RegisterHealthServer(a.probes, a.status)
	healthpb.RegisterHealthServer(a.grpc, a.status) // Envoy's own gRPC health checks of the cluster
	return a, nil
}

// InRotation reports whether backend takes requests (the engine tokenizer asks it).
func (a *App) InRotation(backend string) bool {
	return a.Health == nil || a.Health.InRotation(backend)
}

// Start starts the event consumers and the health probes, then reports ready.
func (a *App) Start(ctx context.Context) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.started {
		return errors.New("kvroute-epp already started")
	}
	a.started = true
	if err := a.fleet.Start(ctx); err != nil {
		return err
	}
	for _, c := range a.cons {
		if err := c.Start(ctx); err != nil {
			return fmt.Errorf("kv events: %w", err)
		}
	}
	a.Health.Start()
	a.syncDiscovery(ctx)
	a.setReady(true)
	return nil
}

// setReady sets readiness and the ext_proc service's status.
func (a *App) setReady(ready bool) {
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if ready {
		st = healthpb.HealthCheckResponse_SERVING
	}
	for _, svc := range []string{"", extproc.HealthReadiness, extproc.HealthExtProc} {
		a.status.SetServingStatus(svc, st)
	}
}

// Listeners are where an App serves; Metrics may be nil.
type Listeners struct {
	GRPC, Health, Metrics net.Listener
}

// Serve serves on ln until ctx ends, then drains: readiness goes NOT_SERVING, the ext_proc streams
// in progress get server.shutdown_timeout to end, and those still open are cut (their requests'
// decisions end as not sent). It returns the first serving error, or nil after a drain.
func (a *App) Serve(ctx context.Context, ln Listeners) error {
	errc := make(chan error, 3)
	go func() { errc <- a.grpc.Serve(ln.GRPC) }()
	go func() { errc <- a.probes.Serve(ln.Health) }()
	var hs *http.Server
	if ln.Metrics != nil {
		mux := http.NewServeMux()
		if a.metrics != nil {
			mux.Handle("GET /metrics", a.metrics)
		}
		mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
		hs = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() {
			if err := hs.Serve(ln.Metrics); !errors.Is(err, http.ErrServerClosed) {
				errc <- err
			}
		}()
	}
	var err error
	select {
	case <-ctx.Done():
	case err = <-errc:
	}
	a.setReady(false)
	a.log.Info("draining: readiness NOT_SERVING; the streams in flight get server.shutdown_timeout to end",
		"streams", a.Server.Stats().Streams, "shutdown_timeout", time.Duration(a.cfg.Server.ShutdownTimeout))
	drained := make(chan struct{})
	go func() { a.grpc.GracefulStop(); close(drained) }()
	timer := time.NewTimer(time.Duration(a.cfg.Server.ShutdownTimeout))
	defer timer.Stop()
	select {
	case <-drained:
	case <-timer.C:
		a.log.Warn("ext_proc streams still open at the end of the shutdown timeout; cutting them",
			"streams", a.Server.Stats().Streams)
		a.grpc.Stop()
		<-drained
	}
	a.probes.Stop()
	if hs != nil {
		_ = hs.Close()
	}
	a.log.Info("stopped")
	return err
}

// Close releases everything New and Start built, in reverse order. Idempotent.
func (a *App) Close() error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return nil
	}
	a.closed = true
	closers := slices.Clone(a.closers)
	a.mu.Unlock()
	if a.grpc != nil {
		a.grpc.Stop()
	}
	if a.probes != nil {
		a.probes.Stop()
	}
	var errs []error
	for i := len(closers) - 1; i >= 0; i-- {
		if err := closers[i](); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
