package extproc

import (
	"fmt"
	"net"
	"net/url"
	"slices"
	"strconv"
	"sync"
)

// Endpoints maps the Router's backends to the endpoints Envoy connects to, "ip:port" as the
// Endpoint Picker Protocol writes them, both ways. A pool's endpoints change while requests are
// routed (kvroute-epp's DNS discovery adds and removes them): an Endpoints is safe for concurrent
// use, and its readers see each Set and Remove whole. The zero value is not usable; call
// NewEndpoints.
type Endpoints struct {
	mu     sync.RWMutex
	byName map[string]string
	byAddr map[string]string
	names  []string // sorted
}

// NewEndpoints returns an empty set.
func NewEndpoints() *Endpoints {
	return &Endpoints{byName: map[string]string{}, byAddr: map[string]string{}}
}

// Set maps backend to endpoint, replacing the backend's previous endpoint. endpoint must be
// host:port with a numeric port (Envoy's ORIGINAL_DST cluster needs an IP address for host);
// two backends may not share one endpoint.
func (e *Endpoints) Set(backend, endpoint string) error {
	if backend == "" {
		return fmt.Errorf("extproc: endpoint %q: empty backend name", endpoint)
	}
	host, port, err := net.SplitHostPort(endpoint)
	if err != nil || host == "" {
		return fmt.Errorf("extproc: backend %s: endpoint %q is not host:port", backend, endpoint)
	}
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
		return fmt.Errorf("extproc: backend %s: endpoint %q has no port in 1..65535", backend, endpoint)
	}
	endpoint = net.JoinHostPort(host, port) // one spelling: IPv6 in brackets
	e.mu.Lock()
	defer e.mu.Unlock()
	if other, ok := e.byAddr[endpoint]; ok && other != backend {
		return fmt.Errorf("extproc: backend %s: endpoint %s already belongs to backend %s", backend, endpoint, other)
	}
	if old, ok := e.byName[backend]; ok {
		delete(e.byAddr, old)
	} else {
		i, _ := slices.BinarySearch(e.names, backend)
		e.names = slices.Insert(e.names, i, backend)
	}
	e.byName[backend], e.byAddr[endpoint] = endpoint, backend
	return nil
}

// Remove forgets backend; it reports whether the backend was there.
func (e *Endpoints) Remove(backend string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	addr, ok := e.byName[backend]
	if !ok {
		return false
	}
	delete(e.byName, backend)
	delete(e.byAddr, addr)
	if i, found := slices.BinarySearch(e.names, backend); found {
		e.names = slices.Delete(e.names, i, i+1)
	}
	return true
}

// Endpoint returns backend's endpoint.
func (e *Endpoints) Endpoint(backend string) (string, bool) {
	e.mu.RLock()
	addr, ok := e.byName[backend]
	e.mu.RUnlock()
	return addr, ok
}

// Backend returns the backend whose endpoint is endpoint (host:port; IPv6 with or without
// brackets around the host is the same endpoint).
func (e *Endpoints) Backend(endpoint string) (string, bool) {
	e.mu.RLock()
	name, ok := e.byAddr[endpoint]
	e.mu.RUnlock()
	if ok {
		return name, true
	}
	if host, port, err := net.SplitHostPort(endpoint); err == nil {
		e.mu.RLock()
		name, ok = e.byAddr[net.JoinHostPort(host, port)]
		e.mu.RUnlock()
	}
	return name, ok
}

// Backends returns the backends' names, sorted; the slice is the caller's.
func (e *Endpoints) Backends() []string {
	e.mu.RLock()
	defer e.mu.RUnlock()
	return slices.Clone(e.names)
}

// Len returns how many backends the set holds.
func (e *Endpoints) Len() int {
	e.mu.RLock()
	defer e.mu.RUnlock()
	return len(e.names)
}

// EndpointOfURL returns the endpoint of a backend's base URL: its host and port, the scheme's
// default port (80 or 443) when it names none.
func EndpointOfURL(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", err
	}
	if u.Hostname() == "" {
		return "", fmt.Errorf("extproc: URL %q has no host", raw)
	}
	port := u.Port()
	if port == "" {
		switch u.Scheme {
		case "https":
			port = "443"
		case "http":
			port = "80"
		default:
			return "", fmt.Errorf("extproc: URL %q has no port", raw)
		}
	}
	return net.JoinHostPort(u.Hostname(), port), nil
}
