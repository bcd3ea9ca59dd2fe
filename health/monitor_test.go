package health

import (
	"errors"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// isClosed reports whether ch is closed.
func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// Start probes at once, then once per Interval on the clock; a second Start adds no goroutine.
func TestStartProbesAtOnceThenEveryInterval(t *testing.T) {
	var probes atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { probes.Add(1) }))
	t.Cleanup(srv.Close)
	clk := newFakeClock()
	m, err := New(Config{Backends: []Backend{{Name: "a", URL: srv.URL}}, Clock: clk})
	require.NoError(t, err)
	defer m.Close()

	m.Start()
	m.Start()
	require.Eventually(t, func() bool { return probes.Load() == 1 && clk.Pending() == 1 }, 10*time.Second, time.Millisecond,
		"the first round, then a wait for the next")
	clk.Advance(DefaultProbeInterval - time.Nanosecond)
	assert.Equal(t, int32(1), probes.Load())
	for round := int32(2); round <= 4; round++ {
		clk.Advance(DefaultProbeInterval)
		require.Eventually(t, func() bool { return probes.Load() == round && clk.Pending() == 1 }, 10*time.Second, time.Millisecond,
			"round %d", round)
	}
}

// Close aborts the probe in flight, stops the probing goroutine and the recovery timers, and
// waits for them; Start after Close does nothing.
func TestCloseStopsEverything(t *testing.T) {
	entered := make(chan struct{}, 1)
	handlerDone := make(chan struct{})
	var once sync.Once
	srv := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		entered <- struct{}{}
		<-r.Context().Done() // answers only when the probe is aborted
		once.Do(func() { close(handlerDone) })
	}))
	t.Cleanup(srv.Close)
	clk := newFakeClock()
	m, err := New(Config{Backends: []Backend{{Name: "a", URL: srv.URL}}, Clock: clk,
		Probe: ProbeConfig{Timeout: time.Hour}, Breaker: BreakerConfig{FailureThreshold: 1}})
	require.NoError(t, err)

	tk, ok := m.Admit("a")
	require.True(t, ok)
	tk.Done(errors.New("refused")) // opens the circuit: a recovery timer is pending
	require.Equal(t, 1, clk.Pending())
	m.Start()
	<-entered
	m.Close()

	assert.True(t, isClosed(m.done), "the probing goroutine has not returned")
	assert.Equal(t, 0, clk.Pending(), "a timer is still pending")
	assert.Equal(t, CircuitOpen, m.Statuses()[0].Circuit)
	assert.True(t, m.Statuses()[0].LastProbe.IsZero(), "the aborted probe was counted")
	select {
	case <-handlerDone:
	case <-time.After(10 * time.Second):
		t.Fatal("the probe in flight was not aborted")
	}

	m.Start()
	m.Close() // idempotent
	assert.Equal(t, 0, clk.Pending(), "Start after Close started something")
}

func TestCloseWithoutStart(t *testing.T) {
	for name, probe := range map[string]ProbeConfig{"probes on": {}, "probes off": {Disabled: true}} {
		t.Run(name, func(t *testing.T) {
			m, err := New(Config{Backends: []Backend{{Name: "a", URL: "http://127.0.0.1:1"}}, Probe: probe})
			require.NoError(t, err)
			if probe.Disabled {
				m.Start() // does nothing
			}
			m.Close()
			m.Close()
			assert.True(t, isClosed(m.done))
		})
	}
}

// Requests, probes, recovery timers and readers all at once: run with -race. At the end the
// Target has been told the Monitor's final verdict.
func TestConcurrentUse(t *testing.T) {
	var status atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if s := status.Load(); s != 0 {
			w.WriteHeader(int(s))
		}
	}))
	t.Cleanup(srv.Close)
	clk := newFakeClock()
	told := map[string]bool{"a": true, "b": true}
	var toldMu sync.Mutex
	m, err := New(Config{
		Backends: []Backend{{Name: "a", URL: srv.URL}, {Name: "b", URL: srv.URL}},
		Clock:    clk,
		Target: TargetFunc(func(name string, healthy bool) error {
			toldMu.Lock()
			defer toldMu.Unlock()
			told[name] = healthy
			return nil
		}),
		Probe:   ProbeConfig{UnhealthyThreshold: 1, HealthyThreshold: 1},
		Breaker: BreakerConfig{FailureThreshold: 2, HalfOpenMaxRequests: 2},
	})
	require.NoError(t, err)
	defer m.Close()

	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 1))
			for range 500 {
				name := []string{"a", "b"}[r.IntN(2)]
				tk, ok := m.Admit(name)
				if !ok {
					continue
				}
				switch r.IntN(3) {
				case 0:
					tk.Done(nil)
				case 1:
					tk.Done(errors.New("boom"))
				default:
					tk.Cancel()
				}
			}
		})
	}
	wg.Go(func() {
		for i := range 30 {
			status.Store([]int32{0, 500}[i%2])
			m.Probe(t.Context())
		}
	})
	wg.Go(func() {
		for range 200 {
			clk.Advance(DefaultRecoveryTimeout)
			_ = m.Statuses()
			_ = m.HealthyCount()
		}
	})
	wg.Wait()

	toldMu.Lock()
	defer toldMu.Unlock()
	for _, st := range m.Statuses() {
		assert.Equal(t, told[st.Name], st.InRotation, st.Name)
		assert.Equal(t, st.ProbeOK && st.Circuit != CircuitOpen, st.InRotation, "%+v", st)
	}
}
