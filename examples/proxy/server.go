package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"sync/atomic"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/health"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/respcache"
	"golang.org/x/sync/semaphore"
)

// server is the proxy: the Router and everything around it. newServer builds it without
// starting anything that talks to the network but the stores' own clients; start starts the
// event consumers and the health probes; Close releases everything. Its handler is safe for
// concurrent use.
type server struct {
	cfg    *config.Config
	log    *slog.Logger
	tel    *telemetry
	router *kvroute.DefaultRouter
	index  kvindex.KvCacheIndex // nil when tier 4 is off
	sink   *events.CountingSink // nil when tier 4 is off
	cons   []config.EventConsumer
	cache  *respcache.Cache // nil when the response cache is off
	health *health.Monitor
	tok    prefixkey.Tokenizer // the engines' /tokenize, when kv_cache_index.tokenizer is engine

	backends  map[string]*url.URL
	transport *http.Transport // carries every request to the backends
	rp        *httputil.ReverseProxy
	handler   http.Handler
	draining  atomic.Bool
	passNext  atomic.Uint64       // turns of the passed-through requests over the backends
	bodies    *semaphore.Weighted // request-body bytes in flight (server.max_inflight_body_bytes)

	closers []func() error // run in reverse order by Close
	started atomic.Bool
	closed  atomic.Bool
}

// newTransport returns the http.Transport every request to the backends goes through: keep-alive
// connections enough for a busy fleet, dials bounded by server.upstream_dial_timeout, and
// identity bodies (cacheable, and streamed without a decompressor's buffering).
func newTransport(cfg *config.Config) *http.Transport {
	dialer := &net.Dialer{Timeout: time.Duration(cfg.Server.UpstreamDialTimeout), KeepAlive: 30 * time.Second}
	return &http.Transport{
		DialContext:           dialer.DialContext,
		MaxIdleConns:          512,
		MaxIdleConnsPerHost:   128,
		IdleConnTimeout:       90 * time.Second,
		ExpectContinueTimeout: time.Second,
		DisableCompression:    true,
	}
}

// newHealth builds the health probes and circuit breakers of health_checks and circuit_breaker,
// which take backends in and out of the Router's rotation.
func newHealth(cfg *config.Config, router health.Target, tr http.RoundTripper, log *slog.Logger) (*health.Monitor, error) {
	hc, cb := cfg.HealthChecks, cfg.CircuitBreaker
	hcfg := health.Config{
		Target: router,
		Client: &http.Client{Transport: tr},
		Probe: health.ProbeConfig{Disabled: !*hc.Enabled, Interval: time.Duration(hc.Interval), Timeout: time.Duration(hc.Timeout),
			UnhealthyThreshold: hc.UnhealthyThreshold, HealthyThreshold: hc.HealthyThreshold, Path: hc.Path},
		Breaker: health.BreakerConfig{Disabled: !*cb.Enabled, FailureThreshold: cb.FailureThreshold,
			RecoveryTimeout: time.Duration(cb.RecoveryTimeout)},
		Logger: log,
	}
	for _, b := range cfg.Backends {
		hcfg.Backends = append(hcfg.Backends, health.Backend{Name: b.Name, URL: b.URL})
	}
	m, err := health.New(hcfg)
	if err != nil {
		return nil, fmt.Errorf("health_checks: %w", err)
	}
	return m, nil
}

// start starts the KV-event consumers and the health probes. ctx bounds the consumers' binds.
func (s *server) start(ctx context.Context) error {
	if !s.started.CompareAndSwap(false, true) {
		return errors.New("proxy already started")
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
func (s *server) Close() error {
	if !s.closed.CompareAndSwap(false, true) {
		return nil
	}
	var errs []error
	for i := len(s.closers) - 1; i >= 0; i-- {
		if err := s.closers[i](); err != nil {
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
