package health_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/health"
)

var _ health.Target = (*kvroute.DefaultRouter)(nil)

// upstream is a backend whose /health answers with status (200 when 0).
type upstream struct {
	*httptest.Server
	status atomic.Int32
	probes atomic.Int32
}

func newUpstream(t *testing.T) *upstream {
	t.Helper()
	u := &upstream{}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/health" {
			http.NotFound(w, r)
			return
		}
		u.probes.Add(1)
		if s := u.status.Load(); s != 0 {
			w.WriteHeader(int(s))
		}
	}))
	t.Cleanup(u.Close)
	return u
}

// calls is a Target that records its calls as "name=true|false".
type calls struct {
	mu  sync.Mutex
	got []string
}

func (c *calls) SetHealthy(name string, healthy bool) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.got = append(c.got, fmt.Sprintf("%s=%t", name, healthy))
	return nil
}

func (c *calls) Get() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.got)
}

func newMonitor(t *testing.T, cfg health.Config) *health.Monitor {
	t.Helper()
	m, err := health.New(cfg)
	require.NoError(t, err)
	t.Cleanup(m.Close)
	return m
}

// Probes take a backend out after UnhealthyThreshold failures, bring it back after
// HealthyThreshold successes, and tell the Target only of the changes.
func TestProbeThresholds(t *testing.T) {
	a, b := newUpstream(t), newUpstream(t)
	target := &calls{}
	m := newMonitor(t, health.Config{
		Backends: []health.Backend{{Name: "a", URL: a.URL}, {Name: "b", URL: b.URL}},
		Target:   target,
		Probe:    health.ProbeConfig{UnhealthyThreshold: 2, HealthyThreshold: 3},
	})
	ctx := t.Context()
	steps := []struct {
		name      string
		status    int32 // a's answer to this round's probe
		inRot     bool  // a in rotation after the round
		wantCalls []string
	}{
		{"healthy stays in", 0, true, nil},
		{"one failure is not enough", 503, true, nil},
		{"a success resets the failure run", 204, true, nil},
		{"first failure", 500, true, nil},
		{"second failure takes it out", 500, false, []string{"a=false"}},
		{"more failures tell nothing new", 500, false, []string{"a=false"}},
		{"first success", 0, false, []string{"a=false"}},
		{"second success", 0, false, []string{"a=false"}},
		{"third success brings it back", 0, true, []string{"a=false", "a=true"}},
		{"and it stays", 0, true, []string{"a=false", "a=true"}},
	}
	for _, s := range steps {
		a.status.Store(s.status)
		m.Probe(ctx)
		require.Equal(t, s.inRot, m.InRotation("a"), s.name)
		require.Equal(t, s.wantCalls, target.Get(), s.name)
		require.True(t, m.InRotation("b"), s.name)
	}
	assert.Equal(t, 2, m.HealthyCount())
	assert.Equal(t, int32(len(steps)), b.probes.Load())
}

func TestProbeFailures(t *testing.T) {
	tests := []struct {
		name    string
		handler http.HandlerFunc
		errPart string
	}{
		{"5xx", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(503) }, "HTTP 503 Service Unavailable"},
		{"3xx not followed to a 2xx", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(304) }, "HTTP 304"},
		{"404", http.NotFound, "HTTP 404"},
		{"no answer within the timeout", func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() }, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := httptest.NewServer(tt.handler)
			t.Cleanup(srv.Close)
			m := newMonitor(t, health.Config{
				Backends: []health.Backend{{Name: "a", URL: srv.URL}},
				Probe:    health.ProbeConfig{UnhealthyThreshold: 1, Timeout: 50 * time.Millisecond},
			})
			m.Probe(t.Context())
			st := m.Statuses()[0]
			assert.False(t, st.ProbeOK)
			assert.False(t, st.InRotation)
			assert.Contains(t, st.LastError, tt.errPart)
			assert.False(t, st.LastProbe.IsZero())
		})
	}
}

// A probe reads a bounded part of an endless answer and succeeds on its status.
func TestProbeBodyIsBounded(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		chunk := make([]byte, 32<<10)
		for r.Context().Err() == nil {
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	}))
	t.Cleanup(srv.Close)
	m := newMonitor(t, health.Config{
		Backends: []health.Backend{{Name: "a", URL: srv.URL}},
		Probe:    health.ProbeConfig{UnhealthyThreshold: 1, Timeout: time.Minute},
	})
	m.Probe(t.Context())
	st := m.Statuses()[0]
	assert.True(t, st.ProbeOK, st.LastError)
	assert.Empty(t, st.LastError)
}

// A probe that the caller's context ends is not counted.
func TestProbeCancelledIsNotCounted(t *testing.T) {
	a := newUpstream(t)
	a.status.Store(500)
	m := newMonitor(t, health.Config{
		Backends: []health.Backend{{Name: "a", URL: a.URL}},
		Probe:    health.ProbeConfig{UnhealthyThreshold: 1},
	})
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	m.Probe(ctx)
	st := m.Statuses()[0]
	assert.True(t, st.ProbeOK)
	assert.True(t, st.LastProbe.IsZero())
}

// A backend whose probes recover gets its open circuit's trial at once, without waiting for the
// recovery timeout.
func TestProbeRecoveryHalfOpensCircuit(t *testing.T) {
	a := newUpstream(t)
	target := &calls{}
	m := newMonitor(t, health.Config{
		Backends: []health.Backend{{Name: "a", URL: a.URL}},
		Target:   target,
		Probe:    health.ProbeConfig{UnhealthyThreshold: 1, HealthyThreshold: 1},
		Breaker:  health.BreakerConfig{FailureThreshold: 1, RecoveryTimeout: time.Hour},
	})
	tk, ok := m.Admit("a")
	require.True(t, ok)
	tk.Done(errors.New("connection refused"))
	a.status.Store(503)
	m.Probe(t.Context())
	st := m.Statuses()[0]
	require.Equal(t, health.CircuitOpen, st.Circuit)
	require.False(t, st.ProbeOK)

	a.status.Store(0)
	m.Probe(t.Context())
	st = m.Statuses()[0]
	assert.Equal(t, health.CircuitHalfOpen, st.Circuit)
	assert.True(t, st.InRotation)
	assert.Equal(t, []string{"a=false", "a=true"}, target.Get())
	_, ok = m.Admit("a")
	assert.True(t, ok, "the trial")
	_, ok = m.Admit("a")
	assert.False(t, ok, "a second trial")
}

// A Target that refuses a verdict is asked again after the next probe.
func TestTargetErrorIsRetried(t *testing.T) {
	a := newUpstream(t)
	a.status.Store(500)
	var fail atomic.Bool
	fail.Store(true)
	var n atomic.Int32
	m := newMonitor(t, health.Config{
		Backends: []health.Backend{{Name: "a", URL: a.URL}},
		Target: health.TargetFunc(func(string, bool) error {
			n.Add(1)
			if fail.Load() {
				return errors.New("router busy")
			}
			return nil
		}),
		Probe: health.ProbeConfig{UnhealthyThreshold: 1},
	})
	m.Probe(t.Context())
	assert.True(t, m.InRotation("a"), "the Target refused: still in rotation as far as it knows")
	fail.Store(false)
	m.Probe(t.Context())
	assert.False(t, m.InRotation("a"))
	assert.Equal(t, int32(2), n.Load())
}

// Status's JSON is the reference proxy's /healthz entry; its field names do not change.
func TestStatusJSON(t *testing.T) {
	st := health.Status{Name: "a", URL: "http://a", InRotation: true, ProbeOK: false, Circuit: health.CircuitHalfOpen,
		LastProbe: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), LastError: "HTTP 503 Service Unavailable", Opens: 2, Failures: 1}
	got, err := json.Marshal(st)
	require.NoError(t, err)
	assert.JSONEq(t, `{"name":"a","url":"http://a","in_rotation":true,"probe_ok":false,"circuit":"half_open",
		"last_probe":"2026-01-02T03:04:05Z","last_error":"HTTP 503 Service Unavailable","circuit_opens":2,"consecutive_failures":1}`, string(got))
	got, err = json.Marshal(health.Status{Name: "b", Circuit: health.CircuitClosed})
	require.NoError(t, err)
	assert.JSONEq(t, `{"name":"b","url":"","in_rotation":false,"probe_ok":false,"circuit":"closed","circuit_opens":0,"consecutive_failures":0}`, string(got))
}

func TestNewRejects(t *testing.T) {
	ok := []health.Backend{{Name: "a", URL: "http://127.0.0.1:1"}}
	tests := []struct {
		name string
		cfg  health.Config
	}{
		{"empty name", health.Config{Backends: []health.Backend{{URL: "http://x"}}}},
		{"duplicate name", health.Config{Backends: append(ok, ok...)}},
		{"relative URL", health.Config{Backends: []health.Backend{{Name: "a", URL: "/x"}}}},
		{"non-http URL", health.Config{Backends: []health.Backend{{Name: "a", URL: "tcp://x:1"}}}},
		{"path without /", health.Config{Backends: ok, Probe: health.ProbeConfig{Path: "health"}}},
		{"negative interval", health.Config{Backends: ok, Probe: health.ProbeConfig{Interval: -1}}},
		{"negative timeout", health.Config{Backends: ok, Probe: health.ProbeConfig{Timeout: -1}}},
		{"negative unhealthy threshold", health.Config{Backends: ok, Probe: health.ProbeConfig{UnhealthyThreshold: -1}}},
		{"negative healthy threshold", health.Config{Backends: ok, Probe: health.ProbeConfig{HealthyThreshold: -1}}},
		{"negative failure threshold", health.Config{Backends: ok, Breaker: health.BreakerConfig{FailureThreshold: -1}}},
		{"negative recovery timeout", health.Config{Backends: ok, Breaker: health.BreakerConfig{RecoveryTimeout: -1}}},
		{"negative half-open requests", health.Config{Backends: ok, Breaker: health.BreakerConfig{HalfOpenMaxRequests: -1}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := health.New(tt.cfg)
			require.ErrorIs(t, err, health.ErrInvalidConfig)
		})
	}
}

func TestNewAccepts(t *testing.T) {
	for name, cfg := range map[string]health.Config{
		"no backends":                      {},
		"no URL with probes disabled":      {Backends: []health.Backend{{Name: "a"}}, Probe: health.ProbeConfig{Disabled: true}},
		"https URL":                        {Backends: []health.Backend{{Name: "a", URL: "https://a.example:8443/base"}}},
		"everything set":                   {Backends: []health.Backend{{Name: "a", URL: "http://a"}}, Probe: health.ProbeConfig{Interval: time.Second, Timeout: time.Second, UnhealthyThreshold: 1, HealthyThreshold: 1, Path: "/ready"}, Breaker: health.BreakerConfig{FailureThreshold: 1, RecoveryTimeout: time.Second, HalfOpenMaxRequests: 3}},
		"breaker disabled, probes enabled": {Backends: []health.Backend{{Name: "a", URL: "http://a"}}, Breaker: health.BreakerConfig{Disabled: true}},
	} {
		t.Run(name, func(t *testing.T) {
			m, err := health.New(cfg)
			require.NoError(t, err)
			m.Close()
		})
	}
}
