package discovery

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strings"
	"sync"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/health"
)

// DefaultClearTimeout bounds Members' call to the KV index's ClearBackend when ClearTimeout is 0.
const DefaultClearTimeout = 10 * time.Second

// Members is the Membership of a kvroute deployment: a discovered endpoint joins (and leaves) the
// Router, the health Monitor, the engine-metrics scraper's targets and, with its KV-event
// consumer, the KV index. Config and Router are required; the other parts may be nil (that part
// is then left out). Set the fields before the first call and do not change them afterwards.
//
// Its methods are safe for concurrent use; they take turns, and call the parts (Events and
// Metrics included) one change at a time, so a part must not call Members back.
type Members struct {
	// Config is the configuration: the static backends (whose metrics targets stay in the set
	// given to Metrics) and engine_metrics.path.
	Config *config.Config
	// Router routes to the endpoints: AddBackend puts a new one in rotation, RemoveBackend takes
	// it out.
	Router *kvroute.DefaultRouter
	// Health probes the endpoints and runs their circuit breakers; a removed endpoint's state is
	// dropped.
	Health *health.Monitor
	// Index is the KV index the events feed: a removed endpoint's blocks are cleared from it
	// (ClearBackend), after its event consumer has stopped, so that a pod that comes back under the
	// same address, or another pod given it, starts with no stale blocks. Survivors keep theirs.
	Index events.Sink
	// ClearTimeout bounds Index.ClearBackend (0: DefaultClearTimeout).
	ClearTimeout time.Duration
	// Metrics, when set, is given the whole set of metrics targets (backend name → URL; static
	// backends' metrics_url or url + engine_metrics.path, endpoints' url + engine_metrics.path)
	// after each change: typically an enginemetrics.Scraper's SetTargets. A refusal is logged and
	// the set given again at the next change.
	Metrics func(targets map[string]string) error
	// Events, when set, starts the KV-event consumer of an endpoint's sources (connect-mode ZMQ,
	// from discovery.zmq_endpoint) and returns the function that stops it; Members calls it when
	// the endpoint is added with sources, and the stop function when it is removed, before
	// clearing the index.
	Events func(sources []config.EventSourceConfig) (stop func() error, err error)
	// Logger receives what fails without failing the change (a consumer's stop, a metrics
	// refusal); nil discards it.
	Logger *slog.Logger

	mu      sync.Mutex
	members map[string]*member
}

// member is one endpoint added through Members.
type member struct {
	url  string
	stop func() error // stops the endpoint's event consumer; nil without one
	// removing: RemoveBackend failed after taking the endpoint out of the Router and the Monitor;
	// the steps left are retried.
	removing bool
}

var _ Membership = (*Members)(nil)

// AddBackend adds b to the Router (weight b.Weight), the Monitor (probing b.URL), starts its
// event consumer when sources are given, and gives Metrics the new target set. It is all or
// nothing: when a step fails, the steps done are undone and the error returned (wrapping
// kvroute.ErrDuplicateBackend when the Router already has the name: a static backend of the same
// name, say). Adding an endpoint whose removal has not completed first completes the removal. A
// Metrics refusal does not fail the change (see Members.Metrics).
func (ms *Members) AddBackend(b config.BackendConfig, sources []config.EventSourceConfig) error {
	if ms.Config == nil || ms.Router == nil {
		return errors.New("discovery: Members needs Config and Router")
	}
	ms.mu.Lock()
	defer ms.mu.Unlock()
	if m := ms.members[b.Name]; m != nil {
		if !m.removing {
			return fmt.Errorf("%w: %q", kvroute.ErrDuplicateBackend, b.Name)
		}
		if err := ms.removeLocked(b.Name, m); err != nil {
			return fmt.Errorf("discovery: completing the removal of %q before adding it again: %w", b.Name, err)
		}
	}
	if err := ms.Router.AddBackend(kvroute.Backend{Name: b.Name, Weight: b.Weight}); err != nil {
		return fmt.Errorf("discovery: adding %q to the router: %w", b.Name, err)
	}
	undo := func() {
		if ms.Health != nil {
			_ = ms.Health.RemoveBackend(b.Name)
		}
		_ = ms.Router.RemoveBackend(b.Name)
	}
	if ms.Health != nil {
		if err := ms.Health.AddBackend(health.Backend{Name: b.Name, URL: b.URL}); err != nil {
			undo()
			return fmt.Errorf("discovery: adding %q to the health monitor: %w", b.Name, err)
		}
	}
	m := &member{url: b.URL}
	if ms.Events != nil && len(sources) > 0 {
		stop, err := ms.Events(sources)
		if err != nil {
			undo()
			return fmt.Errorf("discovery: starting the KV events of %q: %w", b.Name, err)
		}
		m.stop = stop
	}
	if ms.members == nil {
		ms.members = map[string]*member{}
	}
	ms.members[b.Name] = m
	ms.updateMetricsLocked()
	return nil
}

// RemoveBackend takes the endpoint named name out of the Monitor and the Router (requests in
// flight on it finish), stops its event consumer, clears its blocks from the index and gives
// Metrics the new target set. It returns nil for a name Members did not add. When a step fails
// (the index unreachable, say), the error is returned and the endpoint stays half-removed: out of
// rotation, its remaining steps done by the next RemoveBackend or AddBackend of the name. A
// failing stop of the consumer is logged and does not fail the removal.
func (ms *Members) RemoveBackend(name string) error {
	ms.mu.Lock()
	defer ms.mu.Unlock()
	m := ms.members[name]
	if m == nil {
		return nil
	}
	return ms.removeLocked(name, m)
}

// removeLocked runs the removal steps of m that are left. Under ms.mu.
func (ms *Members) removeLocked(name string, m *member) error {
	m.removing = true
	if ms.Health != nil {
		if err := ms.Health.RemoveBackend(name); err != nil && !errors.Is(err, health.ErrUnknownBackend) {
			return fmt.Errorf("discovery: removing %q from the health monitor: %w", name, err)
		}
	}
	if err := ms.Router.RemoveBackend(name); err != nil && !errors.Is(err, kvroute.ErrUnknownBackend) {
		return fmt.Errorf("discovery: removing %q from the router: %w", name, err)
	}
	if m.stop != nil {
		stop := m.stop
		m.stop = nil
		if err := stop(); err != nil {
			ms.logger().Warn("stopping the KV events of a removed endpoint failed", "endpoint", name, "err", err)
		}
	}
	if ms.Index != nil {
		timeout := ms.ClearTimeout
		if timeout <= 0 {
			timeout = DefaultClearTimeout
		}
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		err := ms.Index.ClearBackend(ctx, name)
		cancel()
		if err != nil {
			return fmt.Errorf("discovery: clearing %q from the KV index: %w", name, err)
		}
	}
	delete(ms.members, name)
	ms.updateMetricsLocked()
	return nil
}

// MetricsTargets returns the metrics targets Members gives Metrics: each static backend's
// metrics_url (or url + engine_metrics.path) and each endpoint's url + engine_metrics.path. Safe
// for concurrent use.
func (ms *Members) MetricsTargets() map[string]string {
	ms.mu.Lock()
	defer ms.mu.Unlock()
	return ms.targetsLocked()
}

// targetsLocked builds the metrics targets. Under ms.mu.
func (ms *Members) targetsLocked() map[string]string {
	path := ms.Config.EngineMetrics.Path
	if path == "" {
		path = config.DefaultEngineMetricsPath
	}
	out := make(map[string]string, len(ms.Config.Backends)+len(ms.members))
	for _, b := range ms.Config.Backends {
		u := b.MetricsURL
		if u == "" {
			u = strings.TrimRight(b.URL, "/") + path
		}
		out[b.Name] = u
	}
	for name, m := range ms.members {
		if !m.removing {
			out[name] = strings.TrimRight(m.url, "/") + path
		}
	}
	return out
}

// updateMetricsLocked gives Metrics the current targets. Under ms.mu.
func (ms *Members) updateMetricsLocked() {
	if ms.Metrics == nil {
		return
	}
	targets := ms.targetsLocked()
	if err := ms.Metrics(maps.Clone(targets)); err != nil {
		ms.logger().Error("the engine-metrics targets were refused; giving them again at the next change", "targets", len(targets), "err", err)
	}
}

func (ms *Members) logger() *slog.Logger {
	if ms.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return ms.Logger
}
