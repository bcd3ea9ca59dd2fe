package health

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var errUpstream = errors.New("HTTP 500 Internal Server Error")

// breakerHarness drives one backend "a" of a Monitor with probes disabled and a fake clock.
type breakerHarness struct {
	t   *testing.T
	m   *Monitor
	clk *fakeClock
	rec *recorder
}

func newBreakerHarness(t *testing.T, cfg BreakerConfig) *breakerHarness {
	t.Helper()
	h := &breakerHarness{t: t, clk: newFakeClock(), rec: &recorder{}}
	m, err := New(Config{Backends: []Backend{{Name: "a"}}, Target: h.rec, Clock: h.clk,
		Probe: ProbeConfig{Disabled: true}, Breaker: cfg})
	require.NoError(t, err)
	t.Cleanup(m.Close)
	h.m = m
	return h
}

// admit takes a ticket on "a" and fails the test if Admit refuses.
func (h *breakerHarness) admit() Ticket {
	h.t.Helper()
	tk, ok := h.m.Admit("a")
	require.True(h.t, ok, "Admit refused in state %s", h.state())
	return tk
}

func (h *breakerHarness) refused() {
	h.t.Helper()
	_, ok := h.m.Admit("a")
	require.False(h.t, ok, "Admit admitted in state %s", h.state())
}

// fail sends n requests that fail; succeed n that succeed.
func (h *breakerHarness) fail(n int) {
	h.t.Helper()
	for range n {
		h.admit().Done(errUpstream)
	}
}

func (h *breakerHarness) succeed(n int) {
	h.t.Helper()
	for range n {
		h.admit().Done(nil)
	}
}

func (h *breakerHarness) state() CircuitState { return h.m.Statuses()[0].Circuit }

// want asserts the circuit state and the rotation verdict that goes with it.
func (h *breakerHarness) want(s CircuitState) {
	h.t.Helper()
	require.Equal(h.t, s, h.state())
	require.Equal(h.t, s != CircuitOpen, h.m.InRotation("a"), "in rotation in state %s", s)
}

func TestBreakerTransitions(t *testing.T) {
	const recovery = DefaultRecoveryTimeout
	tests := []struct {
		name string
		cfg  BreakerConfig
		run  func(h *breakerHarness)
		// calls is what the Target must have been told, in order.
		calls []string
	}{
		{
			name: "closed stays closed below the threshold",
			run: func(h *breakerHarness) {
				h.fail(DefaultFailureThreshold - 1)
				h.want(CircuitClosed)
			},
		},
		{
			name: "closed opens at the threshold",
			run: func(h *breakerHarness) {
				h.fail(DefaultFailureThreshold)
				h.want(CircuitOpen)
				assert.Equal(h.t, uint64(1), h.m.Statuses()[0].Opens)
			},
			calls: []string{"a=false"},
		},
		{
			name: "a success resets the failure count",
			run: func(h *breakerHarness) {
				h.fail(DefaultFailureThreshold - 1)
				h.succeed(1)
				h.fail(DefaultFailureThreshold - 1)
				h.want(CircuitClosed)
				h.fail(1)
				h.want(CircuitOpen)
			},
			calls: []string{"a=false"},
		},
		{
			name: "open refuses Admit",
			cfg:  BreakerConfig{FailureThreshold: 1},
			run: func(h *breakerHarness) {
				h.fail(1)
				h.refused()
				h.refused()
				h.want(CircuitOpen)
			},
			calls: []string{"a=false"},
		},
		{
			name: "open turns half-open after the recovery timeout, not before",
			cfg:  BreakerConfig{FailureThreshold: 1},
			run: func(h *breakerHarness) {
				h.fail(1)
				h.clk.Advance(recovery - time.Nanosecond)
				h.want(CircuitOpen)
				h.clk.Advance(time.Nanosecond)
				h.want(CircuitHalfOpen)
			},
			calls: []string{"a=false", "a=true"},
		},
		{
			name: "half-open admits at most HalfOpenMaxRequests",
			cfg:  BreakerConfig{FailureThreshold: 1, HalfOpenMaxRequests: 2},
			run: func(h *breakerHarness) {
				h.fail(1)
				h.clk.Advance(recovery)
				h.admit()
				t2 := h.admit()
				h.refused()
				t2.Cancel() // gives its slot back
				h.admit()
				h.refused()
				h.want(CircuitHalfOpen)
			},
			calls: []string{"a=false", "a=true"},
		},
		{
			name: "half-open with the default admits one trial",
			cfg:  BreakerConfig{FailureThreshold: 1},
			run: func(h *breakerHarness) {
				h.fail(1)
				h.clk.Advance(recovery)
				h.admit()
				h.refused()
			},
			calls: []string{"a=false", "a=true"},
		},
		{
			name: "trial successes close the circuit",
			cfg:  BreakerConfig{FailureThreshold: 1, HalfOpenMaxRequests: 2},
			run: func(h *breakerHarness) {
				h.fail(1)
				h.clk.Advance(recovery)
				t1, t2 := h.admit(), h.admit()
				t1.Done(nil)
				h.want(CircuitHalfOpen)
				t2.Done(nil)
				h.want(CircuitClosed)
				h.succeed(5) // closed: anything goes
			},
			calls: []string{"a=false", "a=true"},
		},
		{
			name: "a trial failure opens the circuit again",
			cfg:  BreakerConfig{FailureThreshold: 1, HalfOpenMaxRequests: 2},
			run: func(h *breakerHarness) {
				h.fail(1)
				h.clk.Advance(recovery)
				t1, t2 := h.admit(), h.admit()
				t1.Done(nil)
				t2.Done(errUpstream)
				h.want(CircuitOpen)
				h.refused()
				assert.Equal(h.t, uint64(2), h.m.Statuses()[0].Opens)
				h.clk.Advance(recovery) // and it gets another trial later
				h.want(CircuitHalfOpen)
			},
			calls: []string{"a=false", "a=true", "a=false", "a=true"},
		},
		{
			// The reported bug: a request admitted while closed succeeds after the circuit
			// opened. A breaker that closes on any success closes here.
			name: "a late success does not close an open circuit",
			cfg:  BreakerConfig{FailureThreshold: 5, RecoveryTimeout: 30 * time.Second},
			run: func(h *breakerHarness) {
				slow := h.admit()
				h.fail(5)
				h.want(CircuitOpen)
				slow.Done(nil)
				h.want(CircuitOpen)
				h.refused()
			},
			calls: []string{"a=false"},
		},
		{
			name: "a late success does not close a half-open circuit",
			cfg:  BreakerConfig{FailureThreshold: 1},
			run: func(h *breakerHarness) {
				slow := h.admit()
				h.fail(1)
				h.clk.Advance(recovery)
				slow.Done(nil)
				h.want(CircuitHalfOpen)
				h.admit() // nor take its trial slot
			},
			calls: []string{"a=false", "a=true"},
		},
		{
			name: "a late failure does not re-open a half-open circuit",
			cfg:  BreakerConfig{FailureThreshold: 1},
			run: func(h *breakerHarness) {
				slow := h.admit()
				h.fail(1)
				h.clk.Advance(recovery)
				slow.Done(errUpstream)
				h.want(CircuitHalfOpen)
			},
			calls: []string{"a=false", "a=true"},
		},
		{
			name: "a late failure does not count in a closed circuit's new generation",
			cfg:  BreakerConfig{FailureThreshold: 1},
			run: func(h *breakerHarness) {
				slow := h.admit()
				h.fail(1)
				h.clk.Advance(recovery)
				h.succeed(1)
				h.want(CircuitClosed)
				slow.Done(errUpstream)
				h.want(CircuitClosed)
			},
			calls: []string{"a=false", "a=true"},
		},
		{
			name: "a cancelled ticket counts nothing",
			cfg:  BreakerConfig{FailureThreshold: 1},
			run: func(h *breakerHarness) {
				tk := h.admit()
				tk.Cancel()
				tk.Done(errUpstream) // after Cancel: ignored
				h.want(CircuitClosed)
			},
		},
		{
			name: "Done counts once",
			cfg:  BreakerConfig{FailureThreshold: 2},
			run: func(h *breakerHarness) {
				tk := h.admit()
				tk.Done(errUpstream)
				tk.Done(errUpstream)
				h.want(CircuitClosed)
			},
		},
		{
			name: "disabled breaker admits everything",
			cfg:  BreakerConfig{Disabled: true, FailureThreshold: 1},
			run: func(h *breakerHarness) {
				h.fail(100)
				h.want(CircuitClosed)
			},
		},
		{
			name: "unknown backend gets a ticket that counts nothing",
			cfg:  BreakerConfig{FailureThreshold: 1},
			run: func(h *breakerHarness) {
				tk, ok := h.m.Admit("nobody")
				require.True(h.t, ok)
				tk.Done(errUpstream)
				var zero Ticket
				zero.Done(errUpstream)
				zero.Cancel()
				h.want(CircuitClosed)
				assert.False(h.t, h.m.InRotation("nobody"))
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newBreakerHarness(t, tt.cfg)
			tt.run(h)
			assert.Equal(t, tt.calls, h.rec.Calls())
		})
	}
}

// Opening a circuit arms one recovery timer; Close stops it, and the circuit then stays open.
func TestBreakerTimers(t *testing.T) {
	h := newBreakerHarness(t, BreakerConfig{FailureThreshold: 1})
	h.fail(1)
	require.Equal(t, 1, h.clk.Pending())
	h.m.Close()
	assert.Equal(t, 0, h.clk.Pending(), "Close left a recovery timer running")
	h.clk.Advance(DefaultRecoveryTimeout)
	h.want(CircuitOpen) // after Close, open stays open
}
