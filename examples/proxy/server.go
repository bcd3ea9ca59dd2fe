package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/admin"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/health"
	"github.com/kvroute/kvroute/kvhttp"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/stack"
)

// server is the proxy: the Router and everything around it. newServer builds it without
// starting anything that talks to the network but the stores' own clients; start starts the
// event consumers and the health probes; Close releases everything. Its handler is safe for
// concurrent use.
type server struct {
	cfg    *config.Config
	log    *slog.Logger
	tel    *otelSDK
	router *kvroute.DefaultRouter
	index  kvindex.KvCacheIndex // nil when tier 4 is off
	sink   *admin.CountingSink  // nil when tier 4 is off
	cons   []config.EventConsumer
	cache  *respcache.Cache // nil when the response cache is off
	health *health.Monitor
	tok    prefixkey.Tokenizer // the engines' /tokenize, when kv_cache_index.tokenizer is engine
	tracer trace.Tracer        // the proxy's spans; nil when tracing is off
	fleet  *stack.Fleet        // replicas and engine_metrics (package stack); shared by reloads

	backends  map[string]*url.URL
	transport *http.Transport // carries every request to the backends
	llm, pass *kvhttp.Handler // the LLM endpoints' lifecycle, and the other /v1 endpoints'
	handler   http.Handler
	draining  atomic.Bool
	passNext  atomic.Uint64  // turns of the passed-through requests over the backends
	bodies    *kvhttp.Budget // request-body bytes in flight (server.max_inflight_body_bytes)

	opts    config.Options // what the stores and the Router were built with
	own     []func() error // this server's own (Router, health): run in reverse order by Close and retire
	closers []func() error // the parts reloads share: run in reverse order by Close, after own
	started atomic.Bool
	closed  atomic.Bool
}

// start starts the KV-event consumers and the health probes. ctx bounds the consumers' binds.
func (s *server) start(ctx context.Context) error {
	if !s.started.CompareAndSwap(false, true) {
		return errors.New("proxy already started")
	}
	if err := s.fleet.Start(ctx); err != nil {
		return err
	}
	for _, c := range s.cons {
		if err := c.Start(ctx); err != nil {
			return fmt.Errorf("kv events: %w", err)
		}
	}
	s.health.Start()
	return nil
}

// httpClient returns a client over the proxy's upstream transport.
func (s *server) httpClient() *http.Client { return &http.Client{Transport: s.transport} }

// Handler returns the proxy's HTTP handler.
func (s *server) Handler() http.Handler { return s.handler }

// Close stops everything newServer and start started, in reverse order. Idempotent.
func (s *server) Close() error { return s.stop(slices.Concat(s.closers, s.own)) }

// stop runs closers in reverse order, once: Close, or reload's stop of a replaced server's own.
func (s *server) stop(closers []func() error) error {
	if !s.closed.CompareAndSwap(false, true) {
		return nil
	}
	var errs []error
	for i := len(closers) - 1; i >= 0; i-- {
		if err := closers[i](); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// logConfig logs the configuration in force, secrets redacted.
func (s *server) logConfig() {
	ctx := context.Background()
	s.log.LogAttrs(ctx, slog.LevelInfo, "configuration", s.cfg.LogAttrs()...)
	for i := range s.cfg.Backends {
		s.log.LogAttrs(ctx, slog.LevelInfo, "backend", s.cfg.BackendLogAttrs(&s.cfg.Backends[i])...)
	}
}

// live serves with the current server, which reload replaces by one built from the re-read
// configuration over the same stores; a request finishes on its server. Safe for concurrent use.
type live struct {
	load    func() (*config.Config, error) // reads the configuration again; nil: nothing to reload
	log     *slog.Logger
	level   *slog.LevelVar // the logger's: log_level, or debug with -v (verbose)
	verbose bool
	mu      sync.Mutex // serialises reloads
	cur     atomic.Pointer[server]
}

func (l *live) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	l.cur.Load().handler.ServeHTTP(w, r)
}

// run serves the proxy for cfg on ln until ctx ends, then drains the requests in flight (up to
// server.shutdown_timeout) and releases everything. SIGHUP reloads the configuration. It closes ln.
func (l *live) run(ctx context.Context, cfg *config.Config, ln net.Listener) error {
	srv, err := newServer(cfg, l.log)
	if err != nil {
		ln.Close()
		return err
	}
	l.cur.Store(srv)
	defer func() { _ = l.cur.Load().Close() }()
	if !l.verbose {
		l.level.Set(cfg.Level())
	}
	srv.logConfig()
	stack.ApplyMemoryLimit(cfg, l.log)
	if err := srv.start(ctx); err != nil {
		ln.Close()
		return err
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	hs := srv.newHTTPServer()
	hs.Handler = l
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	l.log.Info("serving", "addr", ln.Addr().String())
	for ctx.Err() == nil {
		select {
		case err := <-errc:
			return fmt.Errorf("serve: %w", err)
		case <-hup:
			l.hangup()
		case <-ctx.Done():
		}
	}
	timeout := time.Duration(cfg.Server.ShutdownTimeout)
	l.log.Info("shutting down: draining requests in flight", "timeout", timeout.String())
	l.cur.Load().draining.Store(true) // reload refuses a draining server
	sctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := hs.Shutdown(sctx); err != nil {
		l.log.Warn("drain timed out; closing the remaining connections", "err", err)
		_ = hs.Close()
	}
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		l.log.Warn("serve", "err", err)
	}
	l.log.Info("stopped")
	return nil
}

// hangup answers a SIGHUP: a reload, or in demo mode, which has no configuration file, a note at
// INFO that the signal is ignored. Either way the proxy keeps serving.
func (l *live) hangup() {
	if l.load == nil {
		l.log.Info("SIGHUP ignored in demo mode: there is no configuration file to reload")
		return
	}
	_ = l.reload()
}

// reload reads the configuration again and swaps in a server built from its live settings
// (config.PlanReload); the old server's Router and probes stop, its requests finish. Settings that
// need a restart keep their values in force. A failure is logged, returned, and changes nothing.
func (l *live) reload() (err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	defer func() {
		if err != nil {
			l.log.Error("reload failed; the configuration in force is kept", "err", err)
		}
	}()
	old := l.cur.Load()
	switch {
	case l.load == nil:
		return errors.New("no configuration file to reload (demo mode)")
	case old.draining.Load():
		return errors.New("shutting down")
	}
	next, err := l.load()
	if err != nil {
		return err
	}
	plan := config.PlanReload(old.cfg, next)
	if len(plan.Restart) > 0 {
		l.log.Warn("reload: these changed settings need a restart; their values in force are kept", "settings", plan.Restart)
	}
	if len(plan.Live) == 0 { // nothing to apply: the server in force keeps its state
		if len(plan.Restart) == 0 {
			l.log.Info("reloaded, nothing changed")
		}
		return nil
	}
	reg := old.tel.reg // old's health gauges, which the new server's replace
	s, err := newGeneration(plan.Next, l.log, old)
	if err != nil {
		return err
	}
	s.closers, _ = old.closers, reg.Unregister()
	if s.cache != nil {
		_ = s.cache.SetTTL(time.Duration(plan.Next.ResponseCache.TTL))
	}
	s.health.Start()
	l.cur.Store(s)
	_ = old.stop(old.own) // its requests in flight still finish
	stack.ApplyMemoryLimit(plan.Next, l.log)
	if !l.verbose {
		l.level.Set(plan.Next.Level())
	}
	l.log.Info("configuration reloaded", "applied", plan.Live)
	return nil
}
