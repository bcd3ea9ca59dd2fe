// Command kvroute-epp is kvroute's endpoint picker for Envoy and the Gateway API Inference
// Extension: an ext_proc gRPC server that sends each LLM request to the model server holding the
// most of its KV cache. It reads kvroute's YAML configuration (its endpoint_picker section, plus
// the Router's sections the reference proxy reads).
//
//	go run ./integrations/extproc/cmd/kvroute-epp -demo               # simulated engines and a Go stand-in for Envoy
//	go run ./integrations/extproc/cmd/kvroute-epp -config epp.yaml    # a real pool
//
// The demo starts three simulated vLLM engines (KV events over ZMQ), the picker on its gRPC port,
// and an HTTP gateway on -addr that plays Envoy's part (package envoysim): curl it, and the
// X-Kvroute-Backend and X-Kvroute-Route headers of each answer say where the picker sent it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/integrations/extproc/app"
	"github.com/kvroute/kvroute/internal/enginesim"
	"github.com/kvroute/kvroute/stack"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, "kvroute-epp:", err)
		}
		os.Exit(1)
	}
}

// run is main without the signals and the exit: it serves until ctx ends, then drains.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kvroute-epp", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		cfgPath   = fs.String("config", "", "YAML configuration file (kvroute's schema, with its endpoint_picker section)")
		demo      = fs.Bool("demo", false, "run with simulated engines and a Go stand-in for Envoy on -addr")
		addr      = fs.String("addr", "127.0.0.1:8080", "where a Go stand-in for Envoy listens: always with -demo; with -config only when given (to try a pool without Envoy; not for production)")
		grpcAddr  = fs.String("grpc-addr", "", "ext_proc listen address (overrides endpoint_picker.grpc_address)")
		hlthAddr  = fs.String("health-addr", "", "gRPC health listen address (overrides endpoint_picker.health_address)")
		metrAddr  = fs.String("metrics-addr", "", "metrics listen address (overrides endpoint_picker.metrics_address; \"off\" turns it off)")
		engines   = fs.Int("engines", 3, "demo: number of simulated engines")
		speed     = fs.Float64("engine-speed", 1, "demo: wall-clock seconds the engines sleep per simulated second (0: no latency)")
		verbose   = fs.Bool("v", false, "debug logging")
		logFormat = fs.String("log-format", "text", "log format: text or json")
	)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: kvroute-epp -config FILE | -demo [flags]\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if (*cfgPath == "") == !*demo {
		fs.Usage()
		return errors.New("give -config FILE, or -demo")
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if !*demo && (set["engines"] || set["engine-speed"]) {
		return errors.New("-engines and -engine-speed size the demo's simulated engines: use them with -demo")
	}
	gateway := *demo || set["addr"] // the stand-in for Envoy
	level := new(slog.LevelVar)
	if *verbose {
		level.Set(slog.LevelDebug)
	}
	log, err := stack.NewLogger(stderr, *logFormat, level)
	if err != nil {
		return err
	}

	var cfg *config.Config
	var fleet *enginesim.Demo
	// The demo's engines and gateway outlive ctx (a signal): they stop once the picker has
	// drained, so that the streams in flight end whole.
	demoCtx, stopDemo := context.WithCancel(context.WithoutCancel(ctx))
	defer stopDemo()
	if *demo {
		var err error
		if fleet, err = enginesim.StartDemo(demoCtx, enginesim.DemoConfig{Engines: *engines, SpeedFactor: *speed}); err != nil {
			return fmt.Errorf("demo engines: %w", err)
		}
		defer fleet.Close()
		cfg = app.DemoConfig(fleet.Info())
		if err := cfg.Validate(); err != nil {
			return fmt.Errorf("demo configuration: %w", err)
		}
	} else {
		var err error
		if cfg, err = config.Load(*cfgPath); err != nil {
			return err
		}
		if !*verbose {
			level.Set(cfg.Level())
		}
	}
	if *grpcAddr != "" {
		cfg.EndpointPicker.GRPCAddress = *grpcAddr
	}
	if *hlthAddr != "" {
		cfg.EndpointPicker.HealthAddress = *hlthAddr
	}
	switch *metrAddr {
	case "":
	case "off":
		cfg.EndpointPicker.MetricsAddress = new(string)
	default:
		cfg.EndpointPicker.MetricsAddress = metrAddr
	}

	stack.ApplyMemoryLimit(cfg, log) // server.memory_limit, as the reference proxy applies it

	tel, err := newTelemetry()
	if err != nil {
		return err
	}
	defer func() { _ = tel.provider.Shutdown(context.Background()) }()
	a, err := app.New(cfg, app.Options{Logger: log, MeterProvider: tel.provider, Metrics: tel.handler})
	if err != nil {
		return err
	}
	defer a.Close()
	ln, err := listen(cfg)
	if err != nil {
		return err
	}
	if err := a.Start(ctx); err != nil {
		closeListeners(ln)
		return err
	}
	if gateway {
		gw, err := startDemoGateway(demoCtx, *addr, ln.GRPC.Addr().String(), log)
		if err != nil {
			closeListeners(ln)
			return err
		}
		defer gw.Close()
		printBanner(stdout, cfg, gw.Addr(), ln, *demo)
	}
	log.Info("kvroute-epp serving", "grpc", ln.GRPC.Addr().String(), "health", ln.Health.Addr().String(),
		"metrics", addrOf(ln.Metrics), "endpoints", a.Endpoints.Len(), "failure_mode", cfg.EndpointPicker.FailureMode)

	return a.Serve(ctx, ln)
}

// listen opens the picker's listeners: gRPC, health, and metrics unless turned off.
func listen(cfg *config.Config) (app.Listeners, error) {
	var ln app.Listeners
	var err error
	ep := cfg.EndpointPicker
	if ln.GRPC, err = net.Listen("tcp", ep.GRPCAddress); err != nil {
		return ln, fmt.Errorf("endpoint_picker.grpc_address: %w", err)
	}
	if ln.Health, err = net.Listen("tcp", ep.HealthAddress); err != nil {
		closeListeners(ln)
		return ln, fmt.Errorf("endpoint_picker.health_address: %w", err)
	}
	if m := ep.MetricsAddress; m != nil && *m != "" {
		if ln.Metrics, err = net.Listen("tcp", *m); err != nil {
			closeListeners(ln)
			return ln, fmt.Errorf("endpoint_picker.metrics_address: %w", err)
		}
	}
	return ln, nil
}

func closeListeners(ln app.Listeners) {
	for _, l := range []net.Listener{ln.GRPC, ln.Health, ln.Metrics} {
		if l != nil {
			_ = l.Close()
		}
	}
}

func addrOf(l net.Listener) string {
	if l == nil {
		return "off"
	}
	return l.Addr().String()
}

// telemetry is the OpenTelemetry SDK with a Prometheus exporter, served at /metrics.
type telemetry struct {
	provider *sdkmetric.MeterProvider
	handler  http.Handler
}

func newTelemetry() (*telemetry, error) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	exp, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		return nil, fmt.Errorf("prometheus exporter: %w", err)
	}
	return &telemetry{provider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(exp)),
		handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError})}, nil
}
