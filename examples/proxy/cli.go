package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/enginesim"
)

// setAddr sets the server's bind address and port from host:port.
func setAddr(cfg *config.Config, addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("-addr %q: %w", addr, err)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 0 || p > 65535 {
		return fmt.Errorf("-addr %q: bad port", addr)
	}
	cfg.Server.BindAddress, cfg.Server.Host, cfg.Server.Port = host, "", &p
	cfg.ApplyDefaults()
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

// demoConfig is the default demo's configuration for engines: every tier on (demoProxyConfig).
func demoConfig(engines []enginesim.EngineInfo) *config.Config {
	return demoProxyConfig(engines, nil)
}

// printBanner tells a newcomer what is running, how to try it and where the stats are.
func printBanner(w io.Writer, cfg *config.Config, addr net.Addr, demo bool) {
	host, port, _ := net.SplitHostPort(addr.String())
	if ip := net.ParseIP(host); ip == nil || ip.IsUnspecified() {
		host = "127.0.0.1"
	}
	base := "http://" + net.JoinHostPort(host, port)
	model := "<model>"
	if len(cfg.Backends) > 0 && cfg.Backends[0].ModelName() != "" {
		model = cfg.Backends[0].ModelName()
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
	if cfg.ResponseCache.Enabled {
		fmt.Fprintf(&b, "\n\nTry it (run it twice: the second answer comes from the response cache, X-Cache: HIT):\n\n")
	} else {
		fmt.Fprintf(&b, "\n\nTry it:\n\n")
	}
	fmt.Fprintf(&b, "  curl -s -D - %s/v1/chat/completions -H 'Content-Type: application/json' \\\n", base)
	fmt.Fprintf(&b, "    -d '{\"model\":\"%s\",\"temperature\":0,\"max_tokens\":16,\"messages\":[{\"role\":\"system\",\"content\":\"You are a helpful assistant.\"},{\"role\":\"user\",\"content\":\"Hello!\"}]}'\n\n", model)
	auth := ""
	if cfg.Admin.AuthToken != "" {
		auth = "  (admin endpoints need -H 'Authorization: Bearer <admin.auth_token>')"
	}
	fmt.Fprintf(&b, "Stats:%s\n", auth)
	paths := []string{"/admin/prefix-routing/stats", "/admin/backends"}
	if cfg.ResponseCache.Enabled {
		paths = append(paths, "/admin/response-cache/stats")
	}
	if cfg.KVCacheIndex.Enabled {
		paths = append(paths, "/admin/kv-index/stats", "/admin/kv-index/backends")
	}
	if cfg.DisaggregatedServing.Enabled {
		paths = append(paths, "/admin/disaggregation/stats")
	}
	if cfg.Replicas.Enabled || cfg.EngineMetrics.Enabled {
		paths = append(paths, "/admin/replicas/stats")
	}
	for _, p := range paths {
		fmt.Fprintf(&b, "  %s%s\n", base, p)
	}
	fmt.Fprintf(&b, "  %s/metrics   (Prometheus)\n  %s/healthz\n\nStop with Ctrl-C (requests in flight are drained).\n\n", base, base)
	_, _ = io.WriteString(w, b.String())
}

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
