// Command proxy is kvroute's reference proxy: an OpenAI- and Anthropic-compatible gateway that
// shows how to compose the library into a net/http server. main.go reads top to bottom as the
// composition: configuration (package config, YAML) → response cache and store → KV index and
// the consumers of the engines' KV events → Router → health → handler (http.Server in front,
// httputil.ReverseProxy to the backends). What every kvroute front end builds the same way —
// the replicas and engine_metrics sections, the health probes, the engines' tokenizer — comes
// from package stack, which the Envoy endpoint picker (integrations/extproc) uses too.
//
//	go run ./examples/proxy                        # demo: simulated vLLM engines in-process
//	go run ./examples/proxy -demo disagg           # demo: prefill and decode engines, KV through an in-process S3
//	go run ./examples/proxy -config fleet.yaml     # a real fleet (examples in configs/); SIGHUP reloads it
//
// Request flow (proxy.go, on package kvhttp): body checks → response cache → Router.Route
// (tokenization inside, when tier 4 is on) → ReverseProxy → Decision.Done. A backend that fails
// before anything reached the client is replaced once by another; with disaggregated_serving,
// Router.Disagg().Route may run a one-token prefill on a prefill backend first (disagg.go). Admin,
// models and the other /v1 endpoints are in admin.go and gateway.go. README.md lists the
// endpoints, headers and errors.
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
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/admin"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/enginesim"
	"github.com/kvroute/kvroute/kvhttp"
	"github.com/kvroute/kvroute/stack"
)

func main() {
	if err := mainErr(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, "kvroute proxy:", err)
		}
		os.Exit(1)
	}
}

// mainErr is main without the exit: flags, logger, signals, configuration (or the demo fleet),
// listener, banner, run.
func mainErr(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("proxy", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		cfgPath   = fs.String("config", "", "YAML configuration file (SIGHUP reloads it); none: a demo fleet of simulated engines")
		addr      = fs.String("addr", "127.0.0.1:8080", "listen address host:port (overrides server.bind_address and server.port)")
		demoMode  = fs.String("demo", enginesim.DemoUnified, "demo mode: unified (every tier) or disagg (prefill and decode engines)")
		engines   = fs.Int("engines", 4, "demo mode: number of simulated engines")
		speed     = fs.Float64("engine-speed", 1, "demo mode: wall-clock seconds the engines sleep per simulated second (0: no latency)")
		verbose   = fs.Bool("v", false, "debug logging")
		logFormat = fs.String("log-format", "text", "log format: text or json")
		pprofAddr = fs.String("pprof", "", "serve net/http/pprof on this address (e.g. 127.0.0.1:6060); off when empty")
	)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: proxy [-config FILE] [-addr HOST:PORT] [flags]\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	addrSet := false
	fs.Visit(func(f *flag.Flag) { addrSet = addrSet || f.Name == "addr" })

	level := new(slog.LevelVar) // log_level, or debug with -v (live)
	if *verbose {
		level.Set(slog.LevelDebug)
	}
	log, err := stack.NewLogger(stderr, *logFormat, level)
	if err != nil {
		return err
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	// load reads the configuration file with -addr over its address; reload reads it again.
	load := func() (*config.Config, error) {
		c, err := config.Load(*cfgPath)
		if err == nil && addrSet {
			err = setAddr(c, *addr)
		}
		return c, err
	}
	cfg := &config.Config{}
	err = setAddr(cfg, *addr)
	if *cfgPath != "" {
		cfg, err = load()
	} else {
		load = nil // the demo has no file to reload
	}
	if err != nil {
		return err
	}

	// Listen before starting anything, so that a taken port fails fast and clearly.
	ln, err := listen(ctx, cfg.Addr())
	if err != nil {
		return err
	}

	if load == nil {
		log.Info("starting simulated engines", "demo", *demoMode, "n", *engines)
		fleet, err := enginesim.StartDemo(ctx, enginesim.DemoConfig{Mode: *demoMode, Engines: *engines,
			SpeedFactor: *speed, Storage: enginesim.StorageFromEnv(os.Getenv)})
		if err != nil {
			ln.Close()
			return fmt.Errorf("demo fleet (-demo, -engines): %w", err)
		}
		defer fleet.Close()
		if cfg, err = fleetProxyConfig(fleet, cfg.Server); err != nil {
			ln.Close()
			return fmt.Errorf("demo configuration: %w", err)
		}
	}
	if *pprofAddr != "" {
		stopPprof, err := servePprof(ctx, *pprofAddr, log)
		if err != nil {
			ln.Close()
			return err
		}
		defer stopPprof()
	}
	printBanner(stdout, cfg, ln.Addr(), load == nil)
	return (&live{load: load, log: log, level: level, verbose: *verbose}).run(ctx, cfg, ln)
}

// newServer composes the proxy from a validated configuration: the transport to the backends,
// the response cache and its store (tiers 2 and 3), the KV index with the event consumers that
// feed it and the tokenizer (tier 4), the Router over them (tier 1 and its fallbacks), the health
// probes and circuit breakers that drive the Router's rotation, and the handler. Nothing talks to
// the network yet but the stores' own clients; start starts the consumers and the probes.
func newServer(cfg *config.Config, log *slog.Logger) (*server, error) {
	return newGeneration(cfg, log, nil)
}

// newGeneration is newServer; with prev (live.reload) the new server uses prev's transport,
// telemetry, stores and event consumers (cfg keeps prev's restart-only settings), and builds its
// own tokenizer, Router, health monitor and handler: its Close stops those until given prev's closers.
func newGeneration(cfg *config.Config, log *slog.Logger, prev *server) (s *server, err error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s = &server{cfg: cfg, log: log, backends: map[string]*url.URL{}, bodies: kvhttp.NewBudget(cfg.Server.MaxInflightBodyBytes)}
	defer func() {
		if err != nil {
			_ = s.Close()
		}
	}()
	for _, b := range cfg.Backends {
		if s.backends[b.Name], err = url.Parse(b.URL); err != nil {
			return nil, fmt.Errorf("backend %s: %w", b.Name, err)
		}
	}
	if prev != nil {
		s.transport, s.tel, s.opts, s.tracer, s.bodies = prev.transport, prev.tel, prev.opts, prev.tracer, prev.bodies
		s.cache, s.index, s.sink, s.cons, s.fleet = prev.cache, prev.index, prev.sink, prev.cons, prev.fleet
	} else {
		s.transport = kvhttp.NewTransport(time.Duration(cfg.Server.UpstreamDialTimeout))
		s.closers = append(s.closers, func() error { s.transport.CloseIdleConnections(); return nil })
		if s.tel, err = newTelemetry(); err != nil {
			return nil, err
		}
		s.closers = append(s.closers, s.tel.Close)
		s.opts = config.Options{MeterProvider: s.tel.provider, Logger: log}
		if s.opts.TracerProvider, err = s.startTracing(); err != nil {
			return nil, err
		}

		// Tiers 2 to 4: the response cache, the KV index (one Redis client when both are on one
		// server) and the consumers of the engines' KV events.
		cache, index, closeStores, err := cfg.NewStores(s.opts)
		if err != nil {
			return nil, err
		}
		s.cache = cache
		s.closers = append(s.closers, closeStores)
		if index != nil {
			s.index, s.sink = index, admin.NewCountingSink(index)
			reg, err := s.tel.observeIndexMutations(s.sink)
			if err != nil {
				return nil, err
			}
			s.closers = append(s.closers, reg.Unregister)
		}
		// Replicas and the engines' own load; with the event log, the event sources feed the
		// stream, and the stream the index.
		fo := stack.FleetOptions{Index: s.index, ClientName: "kvroute-proxy"}
		if s.sink != nil {
			fo.Sink = s.sink
		}
		if s.fleet, err = stack.NewFleet(cfg, s.opts, fo); err != nil {
			return nil, err
		}
		s.closers = append(s.closers, s.fleet.Close)
		if _, ok := s.fleet.OutageReplay(); ok {
			reg, err := s.tel.observeOutageReplay(s.fleet)
			if err != nil {
				return nil, err
			}
			s.closers = append(s.closers, reg.Unregister)
		}
		if s.index != nil {
			if s.cons, err = cfg.NewEventConsumers(s.fleet.EventsSink(), s.opts); err != nil {
				return nil, err
			}
			for _, c := range s.cons {
				s.closers = append(s.closers, c.Close)
			}
		}
	}
	if s.index != nil && cfg.KVCacheIndex.Tokenizer == config.TokenizerEngine {
		// The health monitor is built after the Router, which needs the tokenizer: it is read
		// at each call.
		inRotation := func(name string) bool { return s.health == nil || s.health.InRotation(name) }
		if s.tok, err = stack.NewEngineTokenizer(cfg, s.httpClient(), inRotation); err != nil {
			return nil, err
		}
	}

	// The Router: tier 1, and tier 4 over the index.
	rcfg, err := cfg.RouterConfig(s.opts)
	if err != nil {
		return nil, err
	}
	rcfg.KV = cfg.KVConfig(s.index, s.tok)
	rcfg.Peers = s.fleet.Peers()
	if s.router, err = kvroute.New(rcfg); err != nil {
		return nil, fmt.Errorf("router: %w", err)
	}
	s.own = append(s.own, s.router.Close)

	// Health probes and circuit breakers take backends in and out of the Router's rotation.
	if s.health, err = stack.NewHealth(cfg, s.router, s.transport, log.With("component", "health")); err != nil {
		return nil, err
	}
	s.own = append(s.own, func() error { s.health.Close(); return nil })
	if err := s.tel.observeHealth(s.health); err != nil {
		return nil, err
	}
	s.handler = s.routes()
	if prev != nil {
		if err := s.fleet.SetMetricsTargets(stack.MetricsTargets(cfg)); err != nil {
			return nil, err
		}
	}
	s.fleet.SetRouter(s.router) // the peers' decisions and the engines' load go to it from now on
	return s, nil
}

// run serves the proxy for cfg on ln until ctx ends, without reloads (live.run).
func run(ctx context.Context, cfg *config.Config, ln net.Listener, log *slog.Logger) error {
	return (&live{log: log, level: new(slog.LevelVar)}).run(ctx, cfg, ln)
}

// newHTTPServer returns the http.Server that serves the proxy's clients. Reading a request's
// headers is bounded by server.read_header_timeout and its body by server.read_timeout; idle
// keep-alive connections close after serverIdleTimeout. There is no write timeout: a stream may
// last as long as the model generates, and a client that stops reading is cut off by the
// backend's own limits and the upstream call's cancellation.
func (s *server) newHTTPServer() *http.Server {
	return &http.Server{
		Handler:           s.Handler(),
		ReadHeaderTimeout: time.Duration(s.cfg.Server.ReadHeaderTimeout),
		ReadTimeout:       time.Duration(s.cfg.Server.ReadTimeout),
		IdleTimeout:       serverIdleTimeout,
		MaxHeaderBytes:    maxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
}

// serverIdleTimeout closes client connections idle for longer.
const serverIdleTimeout = 2 * time.Minute

// maxHeaderBytes caps a request's header block (net/http's default is 1 MiB; an API request's
// headers are a few hundred bytes).
const maxHeaderBytes = 64 << 10
