package main

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// healthSetter is the part of the Router the health manager drives.
type healthSetter interface {
	SetHealthy(name string, healthy bool) error
}

// breakerState is a circuit breaker's state.
type breakerState int

const (
	breakerClosed   breakerState = iota // traffic flows; failures are counted
	breakerOpen                         // the backend is out of rotation until the recovery timeout
	breakerHalfOpen                     // back in rotation on trial: the next outcome decides
)

// String returns "closed", "open" or "half_open".
func (s breakerState) String() string {
	switch s {
	case breakerOpen:
		return "open"
	case breakerHalfOpen:
		return "half_open"
	default:
		return "closed"
	}
}

// backendHealth is one backend's health: the verdict of its probes and its circuit breaker.
// The backend is in rotation when the probes say healthy and the breaker is not open.
type backendHealth struct {
	name    string
	baseURL string

	mu          sync.Mutex
	probeOK     bool // the probes' verdict (true until UnhealthyThreshold failures)
	probeOKRun  int  // consecutive successful probes
	probeBadRun int  // consecutive failed probes
	lastProbe   time.Time
	lastErr     string
	state       breakerState
	failures    int         // consecutive upstream failures
	timer       *time.Timer // guarded by healthManager.mu (lock order: backendHealth.mu, then healthManager.mu)
	opens       uint64
	inRotation  bool // the last value given to the Router
}

// healthManager runs the health probes and the circuit breakers of every backend and keeps the
// Router's view (SetHealthy) in line with them. Its methods are safe for concurrent use; Start
// runs one probing goroutine, stopped by Close.
type healthManager struct {
	router   healthSetter
	log      *slog.Logger
	probe    HealthCheckConfig
	breaker  CircuitBreakerConfig
	client   *http.Client
	backends []*backendHealth
	byName   map[string]*backendHealth
	now      func() time.Time

	closeOnce sync.Once
	stop      chan struct{}
	done      chan struct{} // closed when the probing goroutine has returned (or never ran)
	started   bool
	closed    bool
	mu        sync.Mutex // guards started, closed and the breakers' timers against Close
}

func newHealthManager(router healthSetter, cfg *Config, client *http.Client, log *slog.Logger) *healthManager {
	h := &healthManager{
		router:  router,
		log:     log,
		probe:   cfg.HealthChecks,
		breaker: cfg.CircuitBreaker,
		client:  client,
		byName:  map[string]*backendHealth{},
		now:     time.Now,
		stop:    make(chan struct{}),
		done:    make(chan struct{}),
	}
	for _, b := range cfg.Backends {
		bh := &backendHealth{name: b.Name, baseURL: b.URL, probeOK: true, inRotation: true}
		h.backends = append(h.backends, bh)
		h.byName[b.Name] = bh
	}
	return h
}

// Start probes every backend once (without waiting for the answers) and then every
// Interval, until Close. It does nothing when health checks are disabled.
func (h *healthManager) Start() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed || h.started {
		return
	}
	h.started = true
	if !*h.probe.Enabled {
		close(h.done)
		return
	}
	go h.loop()
}

func (h *healthManager) loop() {
	defer close(h.done)
	t := time.NewTicker(time.Duration(h.probe.Interval))
	defer t.Stop()
	for {
		h.probeAll()
		select {
		case <-h.stop:
			return
		case <-t.C:
		}
	}
}

// probeAll probes every backend concurrently and waits for the probes.
func (h *healthManager) probeAll() {
	var wg sync.WaitGroup
	for _, b := range h.backends {
		wg.Go(func() { h.probeOne(b) })
	}
	wg.Wait()
}

func (h *healthManager) probeOne(b *backendHealth) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(h.probe.Timeout))
	defer cancel()
	go func() { // Close aborts probes in flight
		select {
		case <-h.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	err := h.get(ctx, b.baseURL+h.probe.Path)
	select {
	case <-h.stop:
		return
	default:
	}
	h.observeProbe(b, err)
}

func (h *healthManager) get(ctx context.Context, u string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return err
	}
	resp, err := h.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return &statusError{code: resp.StatusCode}
	}
	return nil
}

// observeProbe folds one probe result into the backend's verdict.
func (h *healthManager) observeProbe(b *backendHealth, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.lastProbe = h.now()
	if err == nil {
		b.probeOKRun++
		b.probeBadRun = 0
		b.lastErr = ""
		if !b.probeOK && b.probeOKRun >= h.probe.HealthyThreshold {
			b.probeOK = true
			h.log.Info("backend healthy again", "backend", b.name, "probes", b.probeOKRun)
			if b.state == breakerOpen { // the probes vouch for it: give it a trial
				b.state = breakerHalfOpen
			}
		}
	} else {
		b.probeBadRun++
		b.probeOKRun = 0
		b.lastErr = err.Error()
		if b.probeOK && b.probeBadRun >= h.probe.UnhealthyThreshold {
			b.probeOK = false
			h.log.Warn("backend unhealthy", "backend", b.name, "failed_probes", b.probeBadRun, "err", err)
		}
	}
	h.applyLocked(b)
}

// observeRequest folds the outcome of one proxied request into the backend's circuit breaker:
// failed is true for a connection failure or a 5xx answer.
func (h *healthManager) observeRequest(name string, failed bool, err error) {
	b := h.byName[name]
	if b == nil || !*h.breaker.Enabled {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if !failed {
		if b.state == breakerHalfOpen {
			h.log.Info("circuit closed", "backend", b.name)
		}
		b.state, b.failures = breakerClosed, 0
		h.applyLocked(b)
		return
	}
	b.failures++
	switch {
	case b.state == breakerHalfOpen:
		h.openLocked(b, err)
	case b.state == breakerClosed && b.failures >= h.breaker.FailureThreshold:
		h.openLocked(b, err)
	}
	h.applyLocked(b)
}

// openLocked opens b's circuit and schedules its half-open trial. Under b.mu.
func (h *healthManager) openLocked(b *backendHealth, err error) {
	b.state = breakerOpen
	b.opens++
	h.log.Warn("circuit opened", "backend", b.name, "consecutive_failures", b.failures,
		"recovery_timeout", h.breaker.RecoveryTimeout.String(), "err", err)
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return
	}
	if b.timer != nil {
		b.timer.Stop()
	}
	b.timer = time.AfterFunc(time.Duration(h.breaker.RecoveryTimeout), func() { h.halfOpen(b) })
}

// halfOpen moves an open circuit to half-open after the recovery timeout.
func (h *healthManager) halfOpen(b *backendHealth) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.state != breakerOpen {
		return
	}
	b.state = breakerHalfOpen
	h.log.Info("circuit half-open: next request is a trial", "backend", b.name)
	h.applyLocked(b)
}

// applyLocked gives the Router b's current rotation status when it changed. Under b.mu; the
// Router calls nothing back, so holding b.mu keeps the updates of one backend in order.
func (h *healthManager) applyLocked(b *backendHealth) {
	want := b.probeOK && b.state != breakerOpen
	if want == b.inRotation {
		return
	}
	if err := h.router.SetHealthy(b.name, want); err != nil {
		h.log.Error("cannot update backend health", "backend", b.name, "err", err)
		return
	}
	b.inRotation = want
}

// healthyCount returns how many backends are in rotation.
func (h *healthManager) healthyCount() int {
	n := 0
	for _, b := range h.backends {
		b.mu.Lock()
		if b.inRotation {
			n++
		}
		b.mu.Unlock()
	}
	return n
}

// inRotation reports whether the named backend is in rotation.
func (h *healthManager) inRotation(name string) bool {
	b := h.byName[name]
	if b == nil {
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.inRotation
}

// backendStatus is one backend's health as /healthz reports it.
type backendStatus struct {
	Name       string    `json:"name"`
	URL        string    `json:"url"`
	InRotation bool      `json:"in_rotation"`
	ProbeOK    bool      `json:"probe_ok"`
	Circuit    string    `json:"circuit"`
	LastProbe  time.Time `json:"last_probe,omitzero"`
	LastError  string    `json:"last_error,omitempty"`
	Opens      uint64    `json:"circuit_opens"`
}

// statuses returns every backend's health, in configuration order.
func (h *healthManager) statuses() []backendStatus {
	out := make([]backendStatus, 0, len(h.backends))
	for _, b := range h.backends {
		b.mu.Lock()
		out = append(out, backendStatus{Name: b.name, URL: b.baseURL, InRotation: b.inRotation, ProbeOK: b.probeOK,
			Circuit: b.state.String(), LastProbe: b.lastProbe, LastError: b.lastErr, Opens: b.opens})
		b.mu.Unlock()
	}
	return out
}

// Close stops the probes and the breakers' timers and waits for the probing goroutine (if Start
// ran). Idempotent; Start after Close does nothing.
func (h *healthManager) Close() {
	h.closeOnce.Do(func() {
		h.mu.Lock()
		h.closed = true
		if !h.started {
			close(h.done) // nothing to wait for
		}
		for _, b := range h.backends {
			if b.timer != nil {
				b.timer.Stop()
			}
		}
		h.mu.Unlock()
		close(h.stop)
	})
	<-h.done
}

// statusError is a non-2xx HTTP answer.
type statusError struct{ code int }

// Error returns "HTTP <code> <text>".
func (e *statusError) Error() string {
	return "HTTP " + strconv.Itoa(e.code) + " " + http.StatusText(e.code)
}
