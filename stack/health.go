package stack

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/health"
)

// NewHealth builds the health probes and circuit breakers of health_checks and circuit_breaker
// for cfg's backends, which take backends in and out of target's rotation (the Router:
// *kvroute.DefaultRouter is a health.Target). The probes go through rt (the gateway's transport
// to the backends; nil means http.DefaultTransport); log receives the Monitor's logs (nil
// discards them). cfg must be validated with its defaults applied. Nothing starts: call the
// Monitor's Start, and Close when done. The error, health_checks: and the library's, comes from
// a configuration the health package refuses.
func NewHealth(cfg *config.Config, target health.Target, rt http.RoundTripper, log *slog.Logger) (*health.Monitor, error) {
	hc, cb := cfg.HealthChecks, cfg.CircuitBreaker
	if hc.Enabled == nil || cb.Enabled == nil {
		return nil, errors.New("health_checks: the configuration's defaults are not applied (config.Load, or Config.ApplyDefaults)")
	}
	hcfg := health.Config{
		Target: target,
		Client: &http.Client{Transport: rt},
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
