package enginesim

import (
	"context"
	"errors"
	"fmt"
	"net"
)

// FleetConfig configures StartFleet.
type FleetConfig struct {
	// N is the number of engines (at least 1).
	N int
	// Base is every engine's configuration; engine i is named Base.Name + "-" + i (Base.Name
	// defaulting to "enginesim"), and a non-zero Base.HashSeed is offset by i.
	Base Config
	// ZMQ publishes KV events over ZMQ: each engine binds a PUB socket and a replay socket on a
	// free loopback port with topic kv@<name>@<model>, unless ZMQConnect is set.
	ZMQ bool
	// ZMQConnect, with ZMQ, makes every engine connect its PUB socket to this endpoint (a
	// router's bound SUB socket: centralized mode) instead of binding.
	ZMQConnect string
	// SSE serves GET /v1/kv_events on every engine; it is on whenever ZMQ is off.
	SSE bool
	// Host is the loopback address the engines listen on; default "127.0.0.1".
	Host string
	// Roles, when set, gives engine i the role Roles[i] (engines beyond its length keep
	// Base.Role): a prefill/decode fleet, e.g. {RolePrefill, RoleDecode, RoleDecode}. The engines
	// share Base.Storage; its block keys do not depend on the engines' hash seeds, so the fleet
	// needs no common HashSeed.
	Roles []Role
}

// EngineInfo says where one engine of a fleet is reachable.
type EngineInfo struct {
	Name  string
	Model string
	// URL is the HTTP root, e.g. "http://127.0.0.1:40123".
	URL string
	// ZMQEndpoint, ReplayEndpoint and Topic are set with FleetConfig.ZMQ.
	ZMQEndpoint    string
	ReplayEndpoint string
	Topic          string
	// KVEventsURL is URL + "/v1/kv_events" when SSE events are on, "" otherwise.
	KVEventsURL string
	// BlockSize and CapacityBlocks size an index or approximate tracker for this engine
	// (CPUCapacityBlocks adds the CPU tier).
	BlockSize         int
	CapacityBlocks    int
	CPUCapacityBlocks int
	// Role is the engine's disaggregation role.
	Role Role
}

// Fleet is a set of engines serving on loopback listeners. Its methods are safe for concurrent
// use; Close stops every engine and is idempotent.
type Fleet struct {
	engines []*Engine
	info    []EngineInfo
}

// StartFleet starts cfg.N engines, each serving HTTP on a free port of cfg.Host with its event
// publishers started. On error the engines already started are closed. ctx bounds the binds.
func StartFleet(ctx context.Context, cfg FleetConfig) (*Fleet, error) {
	if cfg.N < 1 {
		return nil, fmt.Errorf("%w: FleetConfig.N %d: want ≥ 1", ErrInvalidConfig, cfg.N)
	}
	if len(cfg.Roles) > cfg.N {
		return nil, fmt.Errorf("%w: FleetConfig.Roles has %d entries for %d engines", ErrInvalidConfig, len(cfg.Roles), cfg.N)
	}
	host := cfg.Host
	if host == "" {
		host = "127.0.0.1"
	}
	base := cfg.Base.Name
	if base == "" {
		base = "enginesim"
	}
	f := &Fleet{}
	for i := range cfg.N {
		c := cfg.Base
		c.Name = fmt.Sprintf("%s-%d", base, i)
		if c.Model == "" {
			c.Model = DefaultModel
		}
		if c.HashSeed != 0 {
			c.HashSeed += uint64(i)
		}
		if i < len(cfg.Roles) {
			c.Role = cfg.Roles[i]
		}
		if cfg.ZMQ {
			c.Events.Topic = "kv@" + c.Name + "@" + c.Model
			c.Events.ReplayEndpoint = "tcp://" + net.JoinHostPort(host, "0")
			if cfg.ZMQConnect != "" {
				c.Events.ZMQEndpoint, c.Events.ZMQBind = cfg.ZMQConnect, false
			} else {
				c.Events.ZMQEndpoint, c.Events.ZMQBind = "tcp://"+net.JoinHostPort(host, "0"), true
			}
		}
		c.Events.SSE = cfg.SSE || !cfg.ZMQ || c.Events.SSE
		e, err := New(c)
		if err != nil {
			return nil, errors.Join(err, f.Close())
		}
		f.engines = append(f.engines, e)
		var lc net.ListenConfig
		ln, err := lc.Listen(ctx, "tcp", net.JoinHostPort(host, "0"))
		if err != nil {
			return nil, errors.Join(err, f.Close())
		}
		if err := e.Serve(ln); err != nil {
			return nil, errors.Join(err, f.Close())
		}
		if err := e.Start(ctx); err != nil {
			return nil, errors.Join(err, f.Close())
		}
		in := EngineInfo{Name: e.Name(), Model: e.Model(), URL: e.URL(), ZMQEndpoint: e.ZMQEndpoint(),
			ReplayEndpoint: e.ReplayEndpoint(), BlockSize: e.cfg.BlockSize, CapacityBlocks: e.cfg.CapacityBlocks,
			CPUCapacityBlocks: e.cfg.CPUCapacityBlocks, Role: e.cfg.Role}
		if cfg.ZMQ {
			in.Topic = c.Events.Topic
		}
		if e.cfg.Events.SSE {
			in.KVEventsURL = in.URL + "/v1/kv_events"
		}
		f.info = append(f.info, in)
	}
	return f, nil
}

// Engines returns the engines, in order.
func (f *Fleet) Engines() []*Engine { return append([]*Engine(nil), f.engines...) }

// Info returns where each engine is reachable, in order.
func (f *Fleet) Info() []EngineInfo { return append([]EngineInfo(nil), f.info...) }

// URLs returns the engines' HTTP roots, in order.
func (f *Fleet) URLs() []string {
	out := make([]string, len(f.info))
	for i := range f.info {
		out[i] = f.info[i].URL
	}
	return out
}

// Close closes every engine. Idempotent.
func (f *Fleet) Close() error {
	var errs []error
	for _, e := range f.engines {
		errs = append(errs, e.Close())
	}
	return errors.Join(errs...)
}
