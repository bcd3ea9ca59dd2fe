// Command proxy is kvroute's reference proxy: a thin OpenAI- and Anthropic-compatible HTTP proxy
// that composes the library — response cache, tokenization, KV-cache-aware routing, and
// forwarding to the chosen backend — configured by YAML in the seeds' schema.
//
// With no configuration it starts four simulated vLLM engines in-process (internal/enginesim,
// KV events over ZMQ) and serves in front of them, so that the first run needs nothing else:
//
//	go run ./examples/proxy                        # demo fleet, http://127.0.0.1:8080
//	go run ./examples/proxy -config fleet.yaml     # a real fleet
//
// Endpoints: POST /v1/chat/completions, /v1/completions and /v1/messages (streaming passed
// through); GET /admin/prefix-routing/stats, /admin/response-cache/stats,
// /admin/kv-index/stats, /admin/kv-index/backends, /admin/disaggregation/stats; POST
// /admin/response-cache/invalidate and
// /admin/kv-index/clear (bearer token when admin.auth_token is set); GET /metrics (Prometheus) and
// GET /healthz. Every routed response carries X-Kvroute-Backend and X-Kvroute-Route, and X-Cache
// when the response cache is on.
//
// Request flow: body checks (413 over server.max_body_bytes, 400 with an OpenAI- or
// Anthropic-style error for a malformed body) → response cache → tokenization (the engines'
// /tokenize, an estimate, or none) → Router.Route → forward → Decision.Done. A backend that
// fails before anything was sent to the client (connection refused or reset, or a 502/503/504) is
// replaced once by another; health probes and a circuit breaker take failing backends out of
// rotation. SIGINT or SIGTERM drains the requests in flight (server.shutdown_timeout) and exits.
//
// The proxy is made of the standard pieces a Go gateway already runs: http.Server serves the
// clients (with read-header, idle and write-free timeouts suited to long streams) and
// httputil.ReverseProxy over a tuned http.Transport forwards each attempt. kvroute adds the
// parsing, caching and routing around ReverseProxy, which is what a gateway that embeds the
// library would add to its own handler.
//
// With disaggregated_serving enabled, backends have roles (prefill, decode, unified) and
// Router.RouteDisagg chooses each request's path: fast_decode, unified and fallback forward it
// as above; prefill_then_decode first sends a one-token prefill to a prefill backend and then the
// request, with the prefill's kv_transfer_params, to a decode backend (see disagg.go). Responses
// then also carry X-Kvroute-Routing-Path, X-Kvroute-Prefill-Backend and X-Kvroute-Decode-Backend.
//
// Example configurations are in configs/: tier1.yaml, all-tiers.yaml, zmq-events.yaml and
// disaggregated.yaml.
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
	"net/http/pprof"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvroute/kvroute/internal/enginesim"
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
		cfgPath   = fs.String("config", "", "YAML configuration file (seeds' schema); none: demo fleet of simulated engines")
		addr      = fs.String("addr", "127.0.0.1:8080", "listen address host:port (overrides server.bind_address and server.port)")
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

	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	var h slog.Handler
	switch *logFormat {
	case "text":
		h = slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level})
	case "json":
		h = slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level})
	default:
		return fmt.Errorf("-log-format %q: want text or json", *logFormat)
	}
	log := slog.New(h)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	var cfg *Config
	if *cfgPath != "" {
		c, err := loadConfig(*cfgPath)
		if err != nil {
			return err
		}
		cfg = c
		if addrSet {
			if err := setAddr(cfg, *addr); err != nil {
				return err
			}
		}
	} else {
		cfg = &Config{}
		if err := setAddr(cfg, *addr); err != nil {
			return err
		}
	}

	// Listen before starting anything, so that a taken port fails fast and clearly.
	ln, err := listen(ctx, cfg.addr())
	if err != nil {
		return err
	}

	var fleet *enginesim.Fleet
	if *cfgPath == "" {
		if *engines < 1 || *engines > 64 {
			ln.Close()
			return fmt.Errorf("-engines %d: want 1 to 64", *engines)
		}
		log.Info("starting simulated engines", "n", *engines)
		fleet, err = startDemoFleet(ctx, *engines, *speed)
		if err != nil {
			ln.Close()
			return fmt.Errorf("demo fleet: %w", err)
		}
		defer fleet.Close()
		demo := demoConfig(fleet.Info())
		demo.Server = cfg.Server
		demo.applyDefaults()
		if err := demo.validate(); err != nil {
			ln.Close()
			return fmt.Errorf("demo configuration: %w", err)
		}
		cfg = demo
	}
	if *pprofAddr != "" {
		stopPprof, err := servePprof(ctx, *pprofAddr, log)
		if err != nil {
			ln.Close()
			return err
		}
		defer stopPprof()
	}
	printBanner(stdout, cfg, ln.Addr(), fleet != nil)
	return run(ctx, cfg, ln, log)
}

// setAddr sets the server's bind address and port from host:port.
func setAddr(cfg *Config, addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("-addr %q: %w", addr, err)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 0 || p > 65535 {
		return fmt.Errorf("-addr %q: bad port", addr)
	}
	cfg.Server.BindAddress, cfg.Server.Host, cfg.Server.Port = host, "", &p
	cfg.applyDefaults()
	return nil
}

// listen opens the proxy's listener, explaining an address already in use.
func listen(ctx context.Context, addr string) (net.Listener, error) {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		if errors.Is(err, syscall.EADDRINUSE) {
			return nil, fmt.Errorf("cannot listen on %s: the address is already in use (is another proxy running?). "+
				"Stop it, or pick another address: -addr 127.0.0.1:8081 (or -addr 127.0.0.1:0 for any free port)", addr)
		}
		return nil, fmt.Errorf("cannot listen on %s: %w", addr, err)
	}
	return ln, nil
}

// startDemoFleet starts n simulated engines with KV events over ZMQ, block size 16 and a modest
// cache (2,048 blocks: 32,768 tokens each).
func startDemoFleet(ctx context.Context, n int, speed float64) (*enginesim.Fleet, error) {
	return enginesim.StartFleet(ctx, enginesim.FleetConfig{
		N:   n,
		ZMQ: true,
		Base: enginesim.Config{
			BlockSize:      16,
			CapacityBlocks: 2048,
			Latency:        enginesim.Latency{SpeedFactor: speed},
		},
	})
}

// demoConfig is the configuration of the demo: every tier on, in front of the simulated fleet —
// an in-memory response cache, a memory KV index fed by one ZMQ subscription per engine (with
// replay), tokenization by the engines' /tokenize, health checks every 2 s.
func demoConfig(engines []enginesim.EngineInfo) *Config {
	cfg := &Config{
		ResponseCache: ResponseCacheConfig{Enabled: true, Backend: "memory", Capacity: 1000, TTL: Duration(5 * time.Minute)},
		KVCacheIndex: KVCacheIndexConfig{Enabled: true, Backend: "memory", Tokenizer: tokenizerEngine,
			BlockSize: 16},
		HealthChecks:   HealthCheckConfig{Interval: Duration(2 * time.Second), Timeout: Duration(time.Second)},
		CircuitBreaker: CircuitBreakerConfig{FailureThreshold: 3, RecoveryTimeout: Duration(10 * time.Second)},
	}
	for _, e := range engines {
		cfg.Backends = append(cfg.Backends, BackendConfig{Name: e.Name, URL: e.URL, Model: e.Model})
		cfg.KVCacheIndex.EventSources = append(cfg.KVCacheIndex.EventSources, EventSourceConfig{
			BackendName: e.Name, Endpoint: e.ZMQEndpoint, ReplayEndpoint: e.ReplayEndpoint, Model: e.Model})
	}
	return cfg
}

// printBanner tells a newcomer what is running, how to try it and where the stats are.
func printBanner(w io.Writer, cfg *Config, addr net.Addr, demo bool) {
	host, port, _ := net.SplitHostPort(addr.String())
	if ip := net.ParseIP(host); ip == nil || ip.IsUnspecified() {
		host = "127.0.0.1"
	}
	base := "http://" + net.JoinHostPort(host, port)
	model := "<model>"
	if len(cfg.Backends) > 0 && cfg.Backends[0].model() != "" {
		model = cfg.Backends[0].model()
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\nkvroute proxy listening on %s\n", base)
	if demo {
		fmt.Fprintf(&b, "  backends: %d simulated vLLM engines in this process (KV events over ZMQ):", len(cfg.Backends))
	} else {
		fmt.Fprintf(&b, "  backends:")
	}
	for _, be := range cfg.Backends {
		fmt.Fprintf(&b, " %s", be.Name)
	}
	fmt.Fprintf(&b, "\n\nTry it (run it twice: the second answer comes from the response cache, X-Cache: HIT):\n\n")
	fmt.Fprintf(&b, "  curl -s -D - %s/v1/chat/completions -H 'Content-Type: application/json' \\\n", base)
	fmt.Fprintf(&b, "    -d '{\"model\":\"%s\",\"temperature\":0,\"max_tokens\":16,\"messages\":[{\"role\":\"system\",\"content\":\"You are a helpful assistant.\"},{\"role\":\"user\",\"content\":\"Hello!\"}]}'\n\n", model)
	auth := ""
	if cfg.Admin.AuthToken != "" {
		auth = "  (admin endpoints need -H 'Authorization: Bearer <admin.auth_token>')"
	}
	fmt.Fprintf(&b, "Stats:%s\n", auth)
	paths := []string{"/admin/prefix-routing/stats", "/admin/response-cache/stats", "/admin/kv-index/stats", "/admin/kv-index/backends"}
	if cfg.DisaggregatedServing.Enabled {
		paths = append(paths, "/admin/disaggregation/stats")
	}
	for _, p := range paths {
		fmt.Fprintf(&b, "  %s%s\n", base, p)
	}
	fmt.Fprintf(&b, "  %s/metrics   (Prometheus)\n  %s/healthz\n\nStop with Ctrl-C (requests in flight are drained).\n\n", base, base)
	_, _ = io.WriteString(w, b.String())
}

// run serves the proxy for cfg on ln until ctx ends, then drains the requests in flight (up to
// server.shutdown_timeout) and releases everything. It closes ln.
func run(ctx context.Context, cfg *Config, ln net.Listener, log *slog.Logger) error {
	srv, err := newServer(cfg, log)
	if err != nil {
		ln.Close()
		return err
	}
	defer srv.Close()
	srv.logConfig()
	if err := srv.start(ctx); err != nil {
		ln.Close()
		return err
	}
	hs := srv.newHTTPServer()
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	log.Info("serving", "addr", ln.Addr().String())

	select {
	case err := <-errc:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	timeout := time.Duration(cfg.Server.ShutdownTimeout)
	log.Info("shutting down: draining requests in flight", "timeout", timeout.String())
	srv.draining.Store(true)
	sctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := hs.Shutdown(sctx); err != nil {
		log.Warn("drain timed out; closing the remaining connections", "err", err)
		_ = hs.Close()
	}
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		log.Warn("serve", "err", err)
	}
	log.Info("stopped")
	return nil
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

// servePprof serves the runtime profiles of net/http/pprof on their own listener, apart from the
// proxy's mux so that they are never exposed on the serving address. The returned func stops it.
func servePprof(ctx context.Context, addr string, log *slog.Logger) (func(), error) {
	ln, err := listen(ctx, addr)
	if err != nil {
		return nil, fmt.Errorf("-pprof: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("pprof server", "err", err)
		}
	}()
	log.Info("pprof", "addr", ln.Addr().String())
	return func() { srv.Close() }, nil
}
