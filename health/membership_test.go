package health

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// countingServer is an engine's health endpoint that answers status (200 when 0) and counts its
// probes.
type countingServer struct {
	*httptest.Server
	status atomic.Int32
	probes atomic.Int32
}

func newCountingServer(t *testing.T) *countingServer {
	s := &countingServer{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		s.probes.Add(1)
		if c := s.status.Load(); c != 0 {
			w.WriteHeader(int(c))
		}
	}))
	t.Cleanup(s.Close)
	return s
}

func names(st []Status) []string {
	out := make([]string, len(st))
	for i, s := range st {
		out[i] = s.Name
	}
	return out
}

// An added backend is watched like a configured one: listed last, probed at once while the
// Monitor runs and then every round, its verdict told to the Target, its circuit breaker working.
func TestAddBackendIsProbedAndTold(t *testing.T) {
	a, b := newCountingServer(t), newCountingServer(t)
	b.status.Store(http.StatusServiceUnavailable)
	clk := newFakeClock()
	rec := &recorder{}
	m, err := New(Config{Backends: []Backend{{Name: "a", URL: a.URL}}, Target: rec, Clock: clk,
		Probe: ProbeConfig{UnhealthyThreshold: 1, HealthyThreshold: 1}, Breaker: BreakerConfig{FailureThreshold: 1}})
	require.NoError(t, err)
	defer m.Close()
	m.Start()
	require.Eventually(t, func() bool { return a.probes.Load() == 1 && clk.Pending() == 1 }, 10*time.Second, time.Millisecond)

	require.NoError(t, m.AddBackend(Backend{Name: "b", URL: b.URL}))
	assert.Equal(t, []string{"a", "b"}, names(m.Statuses()))
	// Its first probe comes at once, not at the next round: the 503 takes it out of rotation.
	require.Eventually(t, func() bool { return len(rec.Calls()) == 1 }, 10*time.Second, time.Millisecond)
	assert.Equal(t, []string{"b=false"}, rec.Calls())
	assert.False(t, m.InRotation("b"))
	assert.Equal(t, 1, m.HealthyCount())
	assert.Equal(t, int32(1), a.probes.Load(), "adding b probed a")

	// Then it is probed every round with the others.
	b.status.Store(0)
	m.Probe(t.Context())
	assert.Equal(t, int32(2), b.probes.Load())
	assert.Equal(t, []string{"b=false", "b=true"}, rec.Calls())
	assert.Equal(t, 2, m.HealthyCount())

	// Its circuit breaker counts its requests.
	tk, ok := m.Admit("b")
	require.True(t, ok)
	tk.Done(errors.New("refused"))
	assert.Equal(t, CircuitOpen, m.Statuses()[1].Circuit)
	_, ok = m.Admit("b")
	assert.False(t, ok)
	assert.Equal(t, []string{"b=false", "b=true", "b=false"}, rec.Calls())
}

func TestAddBackendErrors(t *testing.T) {
	m, err := New(Config{Backends: []Backend{{Name: "a", URL: "http://127.0.0.1:1"}}})
	require.NoError(t, err)
	defer m.Close()
	err = m.AddBackend(Backend{Name: "a", URL: "http://127.0.0.1:2"})
	require.ErrorIs(t, err, ErrDuplicateBackend)
	assert.Contains(t, err.Error(), `"a"`)
	require.ErrorIs(t, m.AddBackend(Backend{URL: "http://127.0.0.1:2"}), ErrInvalidConfig)
	err = m.AddBackend(Backend{Name: "c", URL: "10.0.0.1:8000"})
	require.ErrorIs(t, err, ErrInvalidConfig)
	assert.Contains(t, err.Error(), `"10.0.0.1:8000" is not an absolute http(s) URL`)
	assert.Equal(t, []string{"a"}, names(m.Statuses()), "a refused backend was added")
	require.ErrorIs(t, m.RemoveBackend("nope"), ErrUnknownBackend)

	// Without probes a backend needs no URL.
	off, err := New(Config{Probe: ProbeConfig{Disabled: true}})
	require.NoError(t, err)
	defer off.Close()
	require.NoError(t, off.AddBackend(Backend{Name: "x"}))
	assert.True(t, off.InRotation("x"))
}

// A removed backend is no longer probed nor listed, its outcomes and timer count for nothing, and
// its breaker state is dropped: added again, it starts in rotation with a closed circuit.
func TestRemoveBackendDropsItsState(t *testing.T) {
	a, b := newCountingServer(t), newCountingServer(t)
	clk := newFakeClock()
	rec := &recorder{}
	m, err := New(Config{Backends: []Backend{{Name: "a", URL: a.URL}, {Name: "b", URL: b.URL}}, Target: rec, Clock: clk,
		Probe: ProbeConfig{UnhealthyThreshold: 1, HealthyThreshold: 1}, Breaker: BreakerConfig{FailureThreshold: 1}})
	require.NoError(t, err)
	defer m.Close()

	tk, ok := m.Admit("b")
	require.True(t, ok)
	tk.Done(errors.New("refused")) // opens b's circuit: a recovery timer is pending
	_, ok = m.Admit("b")
	require.False(t, ok, "b's circuit is open")
	require.Equal(t, 1, clk.Pending())
	require.Equal(t, []string{"b=false"}, rec.Calls())

	require.NoError(t, m.RemoveBackend("b"))
	assert.Equal(t, 0, clk.Pending(), "b's recovery timer is still pending")
	assert.Equal(t, []string{"a"}, names(m.Statuses()))
	assert.False(t, m.InRotation("b"))
	assert.Equal(t, 1, m.HealthyCount())
	require.ErrorIs(t, m.RemoveBackend("b"), ErrUnknownBackend)

	m.Probe(t.Context())
	assert.Equal(t, int32(1), a.probes.Load())
	assert.Equal(t, int32(0), b.probes.Load(), "a removed backend was probed")
	clk.Advance(DefaultRecoveryTimeout)
	assert.Equal(t, []string{"b=false"}, rec.Calls(), "the Target heard of a removed backend")

	// Added again under its name, it starts afresh.
	require.NoError(t, m.AddBackend(Backend{Name: "b", URL: b.URL}))
	st := m.Statuses()[1]
	assert.Equal(t, Status{Name: "b", URL: b.URL, InRotation: true, ProbeOK: true, Circuit: CircuitClosed}, st)
	nt, ok := m.Admit("b")
	require.True(t, ok, "the new b's circuit is closed")
	nt.Done(nil)
	assert.Equal(t, []string{"b=false"}, rec.Calls())
}

// A request admitted before its backend was removed ends without touching the backend added
// again under the same name.
func TestRemovedBackendTicketCountsForNothing(t *testing.T) {
	rec := &recorder{}
	m, err := New(Config{Backends: []Backend{{Name: "b", URL: "http://127.0.0.1:1"}}, Target: rec,
		Breaker: BreakerConfig{FailureThreshold: 1}})
	require.NoError(t, err)
	defer m.Close()
	old, ok := m.Admit("b")
	require.True(t, ok)
	require.NoError(t, m.RemoveBackend("b"))
	require.NoError(t, m.AddBackend(Backend{Name: "b", URL: "http://127.0.0.1:1"}))
	old.Done(errors.New("the old pod failed"))
	assert.Empty(t, rec.Calls())
	assert.True(t, m.InRotation("b"))
	assert.Equal(t, CircuitClosed, m.Statuses()[0].Circuit)
}

// RemoveBackend returns only once a SetHealthy call in progress for the backend has returned: a
// late call cannot reach a backend added again under the name.
func TestRemoveBackendWaitsForTheTarget(t *testing.T) {
	entered := make(chan struct{})
	release := make(chan struct{})
	var returned atomic.Bool
	target := TargetFunc(func(name string, healthy bool) error {
		close(entered)
		<-release
		returned.Store(true)
		return nil
	})
	m, err := New(Config{Backends: []Backend{{Name: "b", URL: "http://127.0.0.1:1"}}, Target: target,
		Breaker: BreakerConfig{FailureThreshold: 1}})
	require.NoError(t, err)
	defer m.Close()
	tk, ok := m.Admit("b")
	require.True(t, ok)
	var wg sync.WaitGroup
	wg.Go(func() { tk.Done(errors.New("boom")) }) // calls SetHealthy(b, false), which blocks
	<-entered

	removed := make(chan bool)
	go func() {
		_ = m.RemoveBackend("b")
		removed <- returned.Load()
	}()
	time.Sleep(20 * time.Millisecond) // let RemoveBackend return early, were it to
	close(release)
	assert.True(t, <-removed, "RemoveBackend returned while SetHealthy was still running")
	wg.Wait()
}

// Backends added and removed while probes, requests and readers run: run with -race. At the end
// the set is what the last changes made it.
func TestMembershipConcurrentWithProbes(t *testing.T) {
	srv := newCountingServer(t)
	m, err := New(Config{Backends: []Backend{{Name: "base", URL: srv.URL}}, Target: &recorder{},
		Probe: ProbeConfig{Interval: time.Millisecond, UnhealthyThreshold: 1, HealthyThreshold: 1}, Breaker: BreakerConfig{FailureThreshold: 2}})
	require.NoError(t, err)
	defer m.Close()
	m.Start()

	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 50 {
				name := fmt.Sprintf("pod-%d-%d", g, i%5)
				if m.AddBackend(Backend{Name: name, URL: srv.URL}) != nil {
					require.NoError(t, m.RemoveBackend(name))
				}
				if tk, ok := m.Admit(name); ok {
					tk.Done(errors.New("boom"))
				}
			}
		})
	}
	wg.Go(func() {
		for range 100 {
			_ = m.Statuses()
			_ = m.HealthyCount()
			srv.status.Store([]int32{0, 500}[srv.probes.Load()%2])
		}
	})
	wg.Wait()
	m.Close()

	// Each worker ends with i%5 = 0..4 toggled 10 times each: all removed.
	assert.Equal(t, []string{"base"}, names(m.Statuses()))
}
