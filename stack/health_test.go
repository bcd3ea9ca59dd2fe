package stack_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/stack"
)

// NewHealth probes health_checks.path of every backend through the given transport and takes a
// backend whose probes fail out of the Router's rotation.
func TestNewHealthTakesFailingBackendOut(t *testing.T) {
	up := startEngine(t, "up", "m")
	var downProbes atomic.Int64
	down := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			downProbes.Add(1)
		}
		http.Error(w, "down", http.StatusServiceUnavailable)
	}))
	defer down.Close()
	cfg := parse(t, "health_checks: {interval: 100ms, timeout: 2s, unhealthy_threshold: 2, healthy_threshold: 1}\n"+
		backendsYAML("m", up.URL, down.URL))
	rcfg, err := cfg.RouterConfig(config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	router, err := kvroute.New(rcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer router.Close()
	var sent atomic.Int64
	rt := roundTripperFunc(func(r *http.Request) (*http.Response, error) {
		sent.Add(1)
		return http.DefaultTransport.RoundTrip(r)
	})
	m, err := stack.NewHealth(cfg, router, rt, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	m.Start()
	waitFor(t, 10*time.Second, "b1 out of rotation", func() bool { return !m.InRotation("b1") })
	if !m.InRotation("b0") {
		t.Error("b0, whose engine answers its probes, is out of rotation")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	st, _ := router.Stats(ctx)
	for _, b := range st.Backends {
		if want := b.Name == "b0"; b.Healthy != want {
			t.Errorf("the Router has %s healthy=%v, want %v", b.Name, b.Healthy, want)
		}
	}
	if up.calls["/health"].Load() == 0 || downProbes.Load() < 2 || sent.Load() == 0 {
		t.Errorf("probes: b0 %d, b1 %d, through the transport %d; want them on /health through the given transport",
			up.calls["/health"].Load(), downProbes.Load(), sent.Load())
	}
}

// A configuration whose defaults were not applied, or that the health package refuses, is an
// error, not a panic.
func TestNewHealthBadInput(t *testing.T) {
	if _, err := stack.NewHealth(&config.Config{}, nil, nil, nil); err == nil {
		t.Error("a configuration without its defaults: no error")
	}
	cfg := parse(t, backendsYAML("m", "http://127.0.0.1:1"))
	cfg.HealthChecks.UnhealthyThreshold = -1
	if _, err := stack.NewHealth(cfg, nil, nil, nil); err == nil || !strings.HasPrefix(err.Error(), "health_checks: ") {
		t.Errorf("a negative unhealthy_threshold: err %v, want health_checks's error", err)
	}
}

type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
