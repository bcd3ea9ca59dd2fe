package replay

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/scorer"
)

// Policy names. Every routing policy goes through kvroute's own packages; the two oracles do not
// route at all.
const (
	PolicyRandom      = "random"       // uniform at random (a seeded source; see policy docs)
	PolicyRoundRobin  = "round_robin"  // kvroute.StrategyRoundRobin, prefix routing off
	PolicyLeastLoaded = "least_loaded" // kvroute.StrategyLeastLoaded, prefix routing off
	PolicyCHWBL       = "chwbl"        // tier 1: prefix key on the bounded-load ring
	PolicyApproximate = "approximate"  // tier 4 fed by routing decisions only (Approximate), default scorer
	PolicyPrecise     = "precise"      // tier 4 fed by KV events, composite scorer, no speculation
	PolicyCost        = "cost"         // tier 4 fed by KV events, prefill+decode cost scorer
	PolicyKVRoute     = "kvroute"      // kvroute's recommended setup: tier 1 + tier 4, defaults
	OracleGlobalLRU   = "oracle_global_lru"
	OracleInfinite    = "oracle_infinite"
)

// AllPolicies lists every policy and oracle in the order reports show them.
var AllPolicies = []string{PolicyRandom, PolicyRoundRobin, PolicyLeastLoaded, PolicyCHWBL, PolicyApproximate,
	PolicyPrecise, PolicyCost, PolicyKVRoute, OracleGlobalLRU, OracleInfinite}

// ParsePolicies splits a comma-separated list of policy names ("all" means AllPolicies) and
// checks every name.
func ParsePolicies(s string) ([]string, error) {
	if s == "" || s == "all" {
		return append([]string(nil), AllPolicies...), nil
	}
	var out []string
	for _, p := range strings.Split(s, ",") {
		p = strings.TrimSpace(p)
		known := false
		for _, k := range AllPolicies {
			known = known || k == p
		}
		if !known {
			return nil, fmt.Errorf("%w: unknown policy %q (want %s)", ErrInvalidConfig, p, strings.Join(AllPolicies, ", "))
		}
		out = append(out, p)
	}
	return out, nil
}

// router is what the simulator needs of a routing policy. route returns the chosen engine and the
// decision to close (nil for policies that keep no in-flight accounting); apply delivers one
// engine's KV-event batch (ignored by policies without an event-fed index).
type router interface {
	route(req *prefixkey.Request) (int, *kvroute.Decision, error)
	apply(engine int, b *events.Batch) error
	stats() routerStats
	close()
}

// routerStats are a policy's decision counts by reason.
type routerStats struct {
	decisions uint64
	kvAware   uint64 // kv_aware and imbalance
}

// policyEnv is what building a policy needs from the simulation.
type policyEnv struct {
	names          []string
	now            func() time.Time
	blockSize      int
	capacityBlocks int // per engine, in blocks of blockSize
	model          string
	seed           uint64
	// peers, peerDelay and engineLoadMaxAge set kvroute.Config's Peers, PeerDelay and
	// EngineLoadMaxAge of a router replica (nil and 0 for a single router).
	peers            kvroute.PeerPublisher
	peerDelay        time.Duration
	engineLoadMaxAge time.Duration
}

// newRouter builds the routing policy name over env's engines.
func newRouter(name string, env policyEnv) (router, error) {
	backends := make([]kvroute.Backend, len(env.names))
	for i, n := range env.names {
		backends[i] = kvroute.Backend{Name: n}
	}
	loadOnly := kvroute.Config{DisablePrefixRouting: true, Backends: backends, Now: env.now}
	newIndex := func(approx bool) (*kvindex.MemoryIndex, error) {
		// The index holds as many blocks as the fleet's caches together, as an operator sets
		// max_entries for a fleet: at kvindex's default (1M blocks) an index-fed policy forgets
		// blocks the engines still hold once 16 engines × 3M tokens are warm.
		cfg := kvindex.MemoryConfig{BlockSize: env.blockSize, DefaultModel: env.model, SweepInterval: -1, Now: env.now,
			MaxEntries: max(kvindex.DefaultMaxEntries, len(env.names)*env.capacityBlocks)}
		if approx {
			cfg.ApproximateCapacityBlocks = env.capacityBlocks
		}
		return kvindex.NewMemory(cfg)
	}
	switch name {
	case PolicyRandom:
		// kvroute.StrategyRandom draws from math/rand/v2's global source, which cannot be seeded; a
		// replay must be reproducible, so the uniform choice is made here from the run's seed.
		return &randomRouter{rng: rand.New(rand.NewPCG(env.seed, 0x52414e444f4d)), n: len(env.names)}, nil
	case PolicyRoundRobin:
		loadOnly.Strategy = kvroute.StrategyRoundRobin
		return newKVRouter(loadOnly, env, nil, false)
	case PolicyLeastLoaded:
		loadOnly.Strategy = kvroute.StrategyLeastLoaded
		return newKVRouter(loadOnly, env, nil, false)
	case PolicyCHWBL:
		return newKVRouter(kvroute.Config{Strategy: kvroute.StrategyLeastLoaded, Backends: backends, Now: env.now}, env, nil, false)
	case PolicyApproximate:
		ix, err := newIndex(true)
		if err != nil {
			return nil, err
		}
		cfg := loadOnly
		cfg.Strategy = kvroute.StrategyLeastLoaded
		cfg.KV = &kvroute.KVConfig{Index: ix, BlockSize: env.blockSize, Speculation: kvroute.SpeculationApproximate}
		return newKVRouter(cfg, env, ix, false) // routing decisions are its only source
	case PolicyPrecise, PolicyCost:
		ix, err := newIndex(false)
		if err != nil {
			return nil, err
		}
		cfg := loadOnly
		cfg.Strategy = kvroute.StrategyLeastLoaded
		cfg.KV = &kvroute.KVConfig{Index: ix, BlockSize: env.blockSize, Speculation: kvroute.SpeculationOff}
		if name == PolicyPrecise {
			// The composite scorer (kvroute's kv_overlap: overlap, load and health weighed
			// 0.6/0.3/0.1), as llm-d's precise prefix-cache scorer weighs overlap with load.
			composite, err := scorer.NewComposite(scorer.CompositeConfig{})
			if err != nil {
				return nil, err
			}
			cfg.KV.Scorer = composite
		}
		if name == PolicyCost {
			cost, err := scorer.NewCost(scorer.CostConfig{Sequences: scorer.ActiveConfig{MaxAge: 24 * time.Hour, Now: env.now}})
			if err != nil {
				return nil, err
			}
			cfg.KV.Scorer = cost
			// The cost function decides whenever any backend holds any of the prompt, as in Dynamo.
			cfg.KV.MinOverlapThreshold = 1e-9
		}
		return newKVRouter(cfg, env, ix, true)
	case PolicyKVRoute:
		ix, err := newIndex(false)
		if err != nil {
			return nil, err
		}
		// What README and doc.go recommend: prefix routing (tier 1) plus tier 4 with an event-fed
		// index, every other setting at its default (the expected-TTFT scorer, threshold 0.3,
		// short speculation).
		cfg := kvroute.Config{Strategy: kvroute.StrategyLeastLoaded, Backends: backends, Now: env.now,
			KV: &kvroute.KVConfig{Index: ix, BlockSize: env.blockSize}}
		return newKVRouter(cfg, env, ix, true)
	}
	return nil, fmt.Errorf("%w: %q is not a routing policy", ErrInvalidConfig, name)
}

// kvRouter is a kvroute.DefaultRouter, with the index it reads when tier 4 is on.
type kvRouter struct {
	r     *kvroute.DefaultRouter
	ix    *kvindex.MemoryIndex // nil without tier 4
	feed  bool                 // KV events go to ix
	names []string
	byN   map[string]int
	ctx   context.Context
	st    routerStats
}

// newKVRouter builds the router; feed says whether KV events go to ix.
func newKVRouter(cfg kvroute.Config, env policyEnv, ix *kvindex.MemoryIndex, feed bool) (router, error) {
	cfg.Peers, cfg.PeerDelay, cfg.EngineLoadMaxAge = env.peers, env.peerDelay, env.engineLoadMaxAge
	r, err := kvroute.New(cfg)
	if err != nil {
		if ix != nil {
			_ = ix.Close()
		}
		return nil, err
	}
	k := &kvRouter{r: r, ix: ix, feed: feed, names: env.names, byN: make(map[string]int, len(env.names)),
		ctx: context.Background()}
	for i, n := range env.names {
		k.byN[n] = i
	}
	return k, nil
}

func (k *kvRouter) route(req *prefixkey.Request) (int, *kvroute.Decision, error) {
	d, err := k.r.Route(k.ctx, req)
	if err != nil {
		return 0, nil, err
	}
	k.st.decisions++
	if d.Reason == kvroute.ReasonKVAware || d.Reason == kvroute.ReasonImbalance {
		k.st.kvAware++
	}
	i, ok := k.byN[d.Backend]
	if !ok {
		d.Done(kvroute.Outcome{})
		return 0, nil, fmt.Errorf("replay: router chose unknown backend %q", d.Backend)
	}
	return i, d, nil
}

func (k *kvRouter) apply(engine int, b *events.Batch) error {
	if !k.feed {
		return nil
	}
	return k.ix.Apply(k.ctx, k.names[engine], b)
}

func (k *kvRouter) stats() routerStats { return k.st }

func (k *kvRouter) close() {
	_ = k.r.Close()
	if k.ix != nil {
		_ = k.ix.Close()
	}
}

// randomRouter picks an engine uniformly at random from a seeded source.
type randomRouter struct {
	rng *rand.Rand
	n   int
	st  routerStats
}

func (r *randomRouter) route(*prefixkey.Request) (int, *kvroute.Decision, error) {
	r.st.decisions++
	return r.rng.IntN(r.n), nil, nil
}

func (r *randomRouter) apply(int, *events.Batch) error { return nil }
func (r *randomRouter) stats() routerStats             { return r.st }
func (r *randomRouter) close()                         {}
