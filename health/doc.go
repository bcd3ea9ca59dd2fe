// Package health keeps a Router's view of its backends in line with their health: active HTTP
// probes and a circuit breaker per backend decide which backends are in rotation, and a Target
// (the Router) is told whenever that changes.
//
// # Probes
//
// A Monitor GETs URL+Path of every backend every Interval, each probe bounded by Timeout and
// reading at most 64 KiB of the answer. A 2xx answer is a success. UnhealthyThreshold failures in
// a row mark the backend unhealthy; HealthyThreshold successes in a row mark it healthy again.
//
// # Circuit breaker
//
// The breaker is the circuit breaker pattern of M. Nygard, "Release It!" (2007), ch. 5, as
// described by M. Fowler, "CircuitBreaker" (martinfowler.com/bliki/CircuitBreaker.html, 2014),
// with a bounded half-open state:
//
//	closed    --FailureThreshold consecutive failures-->           open
//	open      --RecoveryTimeout (a timer), or probes healthy again--> half_open
//	half_open --HalfOpenMaxRequests trial successes-->             closed
//	half_open --one trial failure-->                               open
//
// The caller brackets each request with Monitor.Admit and Ticket.Done. An open circuit refuses
// every request; a half-open one admits at most HalfOpenMaxRequests trials. Each state change
// starts a new generation, and an outcome counts only in the generation that admitted its
// request: a slow request admitted before the circuit opened cannot close it by succeeding late.
// Because an open backend is out of rotation and receives no requests, the move to half-open is
// made by a timer, not by the next request.
//
// A backend is in rotation when its probes say healthy and its circuit is not open.
//
// # Concurrency
//
// A Monitor is safe for concurrent use. Start runs one probing goroutine and the recovery timers
// run on the Clock; Close stops them. The set of backends may change while it runs:
// Monitor.AddBackend and Monitor.RemoveBackend add a backend (probed at once, then every round)
// and remove one (its probes, timer and breaker state go with it), for a pool whose endpoints come
// and go, such as the pods found by DNS discovery. The Target and the Logger are never called with a lock
// held. The package has no global state.
//
// # Use
//
//	m, err := health.New(health.Config{
//		Backends: []health.Backend{{Name: "pod-a", URL: "http://10.0.0.1:8000"}},
//		Target:   router, // a *kvroute.DefaultRouter
//	})
//	if err != nil {
//		return err
//	}
//	m.Start()
//	defer m.Close()
//	if t, ok := m.Admit("pod-a"); ok {
//		t.Done(send("pod-a")) // nil: success; a connection error or 5xx: failure
//	}
package health
