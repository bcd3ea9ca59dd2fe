package kvroute

import (
	"math/rand/v2"
	"slices"

	"github.com/kvroute/kvroute/chwbl"
)

// Strategy is the selection strategy for requests without a prefix key (kvroute's
// selection_strategy); StrategyPrefixAwareHash names prefix routing itself.
type Strategy string

const (
	// StrategyRoundRobin cycles through the healthy backends.
	StrategyRoundRobin Strategy = "round_robin"
	// StrategyLeastLoaded picks the healthy backend with the fewest requests in flight (relative to
	// its weight); ties go round robin.
	StrategyLeastLoaded Strategy = "least_loaded"
	// StrategyRandom picks a healthy backend uniformly at random.
	StrategyRandom Strategy = "random"
	// StrategyLeastLatency picks the healthy backend with the lowest moving average of observed
	// latency (Decision.Done feeds it); backends not yet observed are tried first, ties go to the
	// least loaded.
	StrategyLeastLatency Strategy = "least_latency"
	// StrategyPrefixAwareHash is kvroute's PrefixAwareHash: tier 1 named as the strategy. A request
	// with a prefix key goes to the key's owner on the CHWBL ring (or the next one clockwise under
	// its load bound), as under every strategy while prefix routing is on; one without a key, which
	// no ring can place, goes round robin. It routes by prefix key, so New refuses it with
	// Config.DisablePrefixRouting.
	StrategyPrefixAwareHash Strategy = "prefix_aware_hash"
)

func (s Strategy) valid() bool {
	switch s {
	case StrategyRoundRobin, StrategyLeastLoaded, StrategyRandom, StrategyLeastLatency, StrategyPrefixAwareHash:
		return true
	}
	return false
}

// loadsBuf is the stack buffer size for ring snapshots; fleets beyond it allocate one slice.
const loadsBuf = 64

// acquireByStrategy takes a slot on the backend the configured strategy chooses among the healthy
// backends not named in avoid. It returns chwbl.ErrNoBackend when there is none.
func (r *DefaultRouter) acquireByStrategy(h *chwbl.Handle, avoid []string) error {
	set := r.set.Load()
	n := len(set.list)
	if n == 0 {
		return chwbl.ErrNoBackend
	}
	// Start scanning at a rotating offset so that ties do not always favour the first backend.
	start := int(r.rr.Add(1) % uint64(n))
	var pick *backendState
	switch r.cfg.Strategy {
	case StrategyRandom:
		pick = nthHealthy(set.list, rand.IntN(n), avoid)
	case StrategyLeastLoaded:
		pick = r.leastLoaded(set, start, avoid, nil)
	case StrategyLeastLatency:
		pick = r.leastLatency(set, start, avoid)
	default: // round robin, and prefix_aware_hash without a prefix key
		pick = nthHealthy(set.list, start, avoid)
	}
	if pick == nil {
		return chwbl.ErrNoBackend
	}
	err := r.ring.AcquireBackend(h, pick.name)
	if err == chwbl.ErrUnknownBackend { // removed between the snapshot and now
		return r.acquireByStrategy(h, avoid)
	}
	return err
}

// nthHealthy returns the first healthy backend not named in avoid at or after index i (wrapping),
// or nil.
func nthHealthy(list []*backendState, i int, avoid []string) *backendState {
	for k := range list {
		st := list[(i+k)%len(list)]
		if st.healthy.Load() && !slices.Contains(avoid, st.name) {
			return st
		}
	}
	return nil
}

// leastLoaded returns the healthy backend with the lowest in-flight/weight ratio, scanning the
// ring's snapshot from start, passing over those named in avoid; when only is non-nil it
// considers only backends it accepts.
func (r *DefaultRouter) leastLoaded(set *backendSet, start int, avoid []string, only func(*backendState) bool) *backendState {
	var buf [loadsBuf]chwbl.Load
	loads := r.ring.Loads(buf[:0])
	var best *backendState
	bestLoad := 0.0
	for k := range loads {
		l := &loads[(start+k)%len(loads)]
		if !l.Healthy || slices.Contains(avoid, l.Name) {
			continue
		}
		st := set.byName[l.Name]
		if st == nil || (only != nil && !only(st)) {
			continue
		}
		load := float64(l.InFlight) / l.Weight
		if best == nil || load < bestLoad {
			best, bestLoad = st, load
		}
	}
	return best
}

// leastLatency returns the healthy backend, not named in avoid, with the lowest latency average;
// unobserved backends come first, and ties go to the least loaded of the tied.
func (r *DefaultRouter) leastLatency(set *backendSet, start int, avoid []string) *backendState {
	best := -1.0
	for _, st := range set.list {
		if !st.healthy.Load() || slices.Contains(avoid, st.name) {
			continue
		}
		v := 0.0
		if st.observed.Load() > 0 {
			v = st.latencyNs.load()
		}
		if best < 0 || v < best {
			best = v
		}
	}
	if best < 0 {
		return nil
	}
	return r.leastLoaded(set, start, avoid, func(st *backendState) bool {
		v := 0.0
		if st.observed.Load() > 0 {
			v = st.latencyNs.load()
		}
		return v <= best
	})
}
