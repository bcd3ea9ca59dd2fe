package app

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/integrations/extproc"
	"github.com/kvroute/kvroute/integrations/extproc/discovery"
	"github.com/kvroute/kvroute/kvindex"
)

// pool is the Membership that DNS discovery changes: a discovered engine joins the Router, the
// health monitor, the engine-metrics targets and, with its KV-event consumer, the index
// (discovery.Members), then the picker's endpoints and the engine tokenizer; it leaves them in
// the opposite order, so that the picker never names an engine the Router no longer routes to
// for long, nor routes to one it cannot name.
type pool struct {
	a       *App
	members *discovery.Members
}

// AddBackend implements discovery.Membership.
func (p *pool) AddBackend(b config.BackendConfig, sources []config.EventSourceConfig) error {
	ep, err := extproc.EndpointOfURL(b.URL)
	if err != nil {
		return err
	}
	if err := p.members.AddBackend(b, sources); err != nil {
		return err
	}
	if err := p.a.Endpoints.Set(b.Name, ep); err != nil {
		return errors.Join(err, p.members.RemoveBackend(b.Name))
	}
	if p.a.tok != nil {
		if err := p.a.tok.AddBackend(b); err != nil {
			p.a.Endpoints.Remove(b.Name)
			return errors.Join(err, p.members.RemoveBackend(b.Name))
		}
	}
	return nil
}

// RemoveBackend implements discovery.Membership.
func (p *pool) RemoveBackend(name string) error {
	if err := p.members.RemoveBackend(name); err != nil {
		return err
	}
	p.a.Endpoints.Remove(name)
	if p.a.tok != nil {
		p.a.tok.RemoveBackend(name)
	}
	return nil
}

// startEvents starts the KV-event consumer of one discovered engine's sources (its ZMQ
// endpoints, from the discovery templates), built by the configuration's own builder as the
// static backends' consumers are.
func (a *App) startEvents(sources []config.EventSourceConfig) (stop func() error, err error) {
	if len(sources) == 0 {
		return func() error { return nil }, nil
	}
	host, _, err := net.SplitHostPort(sources[0].BackendName)
	if err != nil {
		return nil, fmt.Errorf("discovered backend %q: %w", sources[0].BackendName, err)
	}
	b, _ := a.cfg.DiscoveredBackend(host)
	one := *a.cfg
	one.Backends = append(slices.Clone(a.cfg.Backends), b)
	one.KVCacheIndex.EventSources = sources
	cons, err := one.NewEventConsumers(a.sink, a.opts)
	if err != nil {
		return nil, err
	}
	stopAll := func() error {
		var errs []error
		for _, c := range cons {
			errs = append(errs, c.Close())
		}
		return errors.Join(errs...)
	}
	for _, c := range cons {
		if err := c.Start(a.ctx); err != nil {
			return nil, errors.Join(err, stopAll())
		}
	}
	return stopAll, nil
}

// newDiscovery builds the Watcher of endpoint_picker.discovery over the App's parts.
func (a *App) newDiscovery(o Options) error {
	p := &pool{a: a, members: &discovery.Members{Config: a.cfg, Router: a.Router, Health: a.Health,
		Logger: a.log.With("component", "discovery")}}
	if a.Index != nil {
		p.members.Index = a.sink
		if a.cfg.EndpointPicker.Discovery.ZMQEndpoint != "" {
			p.members.Events = a.startEvents
		}
	}
	if a.metricsTargets != nil {
		p.members.Metrics = a.metricsTargets
	}
	max := 0
	if a.Index != nil && a.cfg.KVCacheIndex.Backend == "memory" {
		// The in-memory index tracks at most kvindex.MaxMemoryBackends engines.
		if max = kvindex.MaxMemoryBackends - len(a.cfg.Backends); max < 1 {
			return fmt.Errorf("endpoint_picker.discovery: the in-memory KV index tracks %d engines, all taken by backends", kvindex.MaxMemoryBackends)
		}
	}
	w, err := discovery.New(a.cfg, p, discovery.Options{Resolver: o.Resolver, Logger: a.log.With("component", "discovery"),
		MeterProvider: o.MeterProvider, MaxEndpoints: max})
	if err != nil {
		return err
	}
	a.watcher = w
	a.closers = append(a.closers, func() error { w.Close(); return nil })
	return nil
}

// syncDiscovery resolves the pool's name once, at start, so that the picker starts with its
// endpoints, then every interval. A failed first resolve is logged; the periodic ones go on.
func (a *App) syncDiscovery(ctx context.Context) {
	if a.watcher == nil {
		return
	}
	if err := a.watcher.Sync(ctx); err != nil {
		a.log.Warn("the first resolve of the pool's DNS name failed; retrying every interval",
			"dns_name", a.cfg.EndpointPicker.Discovery.DNSName, "error", err)
	}
	a.watcher.Start(a.ctx)
}
