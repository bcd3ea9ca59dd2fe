package health_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"

	"github.com/kvroute/kvroute/health"
)

// Probes take a backend whose /health fails out of rotation; the Target (a Router, usually) is
// told.
func ExampleMonitor() {
	down := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer down.Close()
	up := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer up.Close()

	m, err := health.New(health.Config{
		Backends: []health.Backend{{Name: "pod-a", URL: down.URL}, {Name: "pod-b", URL: up.URL}},
		Target: health.TargetFunc(func(name string, healthy bool) error {
			fmt.Printf("router: %s healthy=%t\n", name, healthy)
			return nil
		}),
		Probe: health.ProbeConfig{UnhealthyThreshold: 2},
	})
	if err != nil {
		panic(err)
	}
	defer m.Close()
	// m.Start() would probe every Probe.Interval; here two rounds are run by hand.
	m.Probe(context.Background())
	m.Probe(context.Background())
	for _, st := range m.Statuses() {
		fmt.Printf("%s in_rotation=%t last_error=%q\n", st.Name, st.InRotation, st.LastError)
	}
	// Output:
	// router: pod-a healthy=false
	// pod-a in_rotation=false last_error="HTTP 503 Service Unavailable"
	// pod-b in_rotation=true last_error=""
}

// Every request is bracketed by Admit and Done; consecutive failures open the circuit and Admit
// then refuses the backend until its recovery timeout has passed.
func ExampleMonitor_Admit() {
	m, err := health.New(health.Config{
		Backends: []health.Backend{{Name: "pod-a"}},
		Probe:    health.ProbeConfig{Disabled: true},
		Breaker:  health.BreakerConfig{FailureThreshold: 3},
	})
	if err != nil {
		panic(err)
	}
	defer m.Close()
	send := func() error { return errors.New("HTTP 500 Internal Server Error") }
	for i := range 4 {
		t, ok := m.Admit("pod-a")
		if !ok {
			fmt.Printf("request %d: circuit %s, pick another backend\n", i, m.Statuses()[0].Circuit)
			continue
		}
		t.Done(send()) // nil: success; a connection error or a 5xx: failure
		fmt.Printf("request %d: failed\n", i)
	}
	// Output:
	// request 0: failed
	// request 1: failed
	// request 2: failed
	// request 3: circuit open, pick another backend
}
