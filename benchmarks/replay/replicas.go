package replay

import (
	"context"
	"math/rand/v2"
	"slices"
	"strconv"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/prefixkey"
)

// What router replicas share (Config.Sync). Every replica's KV index receives every engine's KV
// events in all of them.
const (
	// SyncNone: each replica knows only its own decisions: its own in-flight counts, prefill
	// backlogs and speculation.
	SyncNone = "none"
	// SyncMetrics: every Config.ScrapePeriod each replica reports every engine's running and
	// waiting requests at that instant (kvroute.DefaultRouter.ReportEngineLoad), as a scrape of
	// the engines' metrics endpoints would.
	SyncMetrics = "metrics"
	// SyncPeers: each replica's decision events (kvroute.PeerEvent) reach the other replicas
	// Config.SyncDelay after it published them (kvroute.DefaultRouter.ApplyPeerEvent).
	SyncPeers = "peers"
	// SyncBoth: SyncMetrics and SyncPeers.
	SyncBoth = "both"
)

// SyncModes lists the sync modes in the order reports show them.
var SyncModes = []string{SyncNone, SyncMetrics, SyncPeers, SyncBoth}

// How arrivals are spread over router replicas (Config.Spread).
const (
	// SpreadRandom sends each arrival to a replica drawn uniformly from a source seeded by
	// Config.Seed, as an L4 load balancer (ECMP, a cloud network load balancer) spreads
	// connections: replicas get uneven shares over short spans, and consecutive turns of a
	// conversation land on different replicas.
	SpreadRandom = "random"
	// SpreadRoundRobin sends arrival i to replica i mod Replicas.
	SpreadRoundRobin = "round_robin"
)

// engineLoadMaxAge is the replicas' kvroute.Config.EngineLoadMaxAge for a scrape period: five
// periods, as the reference proxy's engine_metrics.max_age, within the Router's limit of an hour.
// The Router ages reports by its Config.Now, the simulation's clock.
func engineLoadMaxAge(scrape time.Duration) time.Duration { return min(5*scrape, time.Hour) }

// peerDelay is the replicas' kvroute.Config.PeerDelay: Config.PeerDelay, else the sync's own
// delay (an operator sets the delay they measure), else off: with no delay nothing is unseen.
func (c Config) peerDelay() time.Duration {
	switch {
	case c.PeerDelay != 0:
		return c.PeerDelay
	case c.SyncDelay > 0:
		return c.SyncDelay
	}
	return -1
}

func (c Config) peerSync() bool    { return c.Sync == SyncPeers || c.Sync == SyncBoth }
func (c Config) metricsSync() bool { return c.Sync == SyncMetrics || c.Sync == SyncBoth }

// replicaSet is one policy running as Config.Replicas router instances in a simulation: arrivals
// are spread over them, every engine's KV events go to each one's index, and Config.Sync says
// what else they share, through the simulation's event queue.
type replicaSet struct {
	s     *sim
	rs    []*kvRouter
	names []string // the replicas' names in their PeerEvents
	rng   *rand.Rand
	next  int
}

// peerLink is replica from's kvroute.PeerPublisher: it schedules the event's delivery to the
// other replicas Config.SyncDelay later.
type peerLink struct {
	s    *sim
	from int32
	name string
}

// ReplicaID names the replica, as the others name it in ApplyPeerEvent.
func (p *peerLink) ReplicaID() string { return p.name }

func (p *peerLink) PublishPeerEvent(ev kvroute.PeerEvent) {
	ev.BlockKeys = slices.Clone(ev.BlockKeys)
	p.s.push(simEvent{at: p.s.now + p.s.cfg.SyncDelay, kind: evPeer, replica: p.from, peer: &ev})
}

func newReplicaSet(s *sim, policy string, env policyEnv) (*replicaSet, error) {
	k := s.cfg.Replicas
	set := &replicaSet{s: s, names: make([]string, k),
		rng: rand.New(rand.NewPCG(s.cfg.Seed, 0x5245504c49434153))} // "REPLICAS"
	for j := range k {
		set.names[j] = "replica-" + strconv.Itoa(j)
		e := env
		if s.cfg.peerSync() {
			e.peers = &peerLink{s: s, from: int32(j), name: set.names[j]}
			e.peerDelay = s.cfg.peerDelay()
		}
		e.engineLoadMaxAge = engineLoadMaxAge(set.s.cfg.ScrapePeriod)
		pol, err := newRouter(policy, e)
		if err != nil {
			set.close()
			return nil, err
		}
		set.rs = append(set.rs, pol.(*kvRouter))
	}
	return set, nil
}

// startScrapes schedules each replica's first engine-load report under metrics sync: replica j
// at j/Replicas of ScrapePeriod, so that the replicas' scrapes are not simultaneous.
func (set *replicaSet) startScrapes() {
	c := set.s.cfg
	if !c.metricsSync() {
		return
	}
	for j := range set.rs {
		at := c.ScrapePeriod * time.Duration(j) / time.Duration(len(set.rs))
		set.s.push(simEvent{at: at, kind: evScrape, replica: int32(j)})
	}
}

// scrape reports every engine's load to replica j, and schedules its next scrape while requests
// remain.
func (set *replicaSet) scrape(j int) {
	s := set.s
	now := s.clock()
	for i, e := range s.engines {
		st := e.Stats()
		// The error can only be an unknown backend, and every engine is one.
		_ = set.rs[j].r.ReportEngineLoad(set.rs[j].names[i], kvroute.EngineLoad{Running: st.Running, Waiting: st.Waiting,
			KVCacheUsage: st.Usage, At: now})
	}
	if s.left > 0 {
		s.push(simEvent{at: s.now + s.cfg.ScrapePeriod, kind: evScrape, replica: int32(j)})
	}
}

// deliver applies replica from's event ev to every other replica.
func (set *replicaSet) deliver(from int, ev *kvroute.PeerEvent) {
	for j, r := range set.rs {
		if j != from {
			r.r.ApplyPeerEvent(set.names[from], *ev)
		}
	}
}

func (set *replicaSet) pick() int {
	if set.s.cfg.Spread == SpreadRoundRobin {
		j := set.next
		set.next = (set.next + 1) % len(set.rs)
		return j
	}
	return set.rng.IntN(len(set.rs))
}

func (set *replicaSet) route(req *prefixkey.Request) (int, *kvroute.Decision, error) {
	return set.rs[set.pick()].route(req)
}

func (set *replicaSet) apply(engine int, b *events.Batch) error {
	for _, r := range set.rs {
		if err := r.apply(engine, b); err != nil {
			return err
		}
	}
	return nil
}

func (set *replicaSet) stats() routerStats {
	var st routerStats
	for _, r := range set.rs {
		st.decisions += r.st.decisions
		st.kvAware += r.st.kvAware
	}
	return st
}

func (set *replicaSet) peerCounts() PeerCounts {
	var c PeerCounts
	for _, r := range set.rs {
		p := routerCounts(r.r).Peers
		c.Applied += p.Applied
		c.Ignored += p.Ignored
		c.Expired += p.Expired
		c.EngineReports += p.EngineReports
		c.EngineStale += p.EngineStale
	}
	return c
}

func (set *replicaSet) close() {
	for _, r := range set.rs {
		r.close()
	}
}

// routerCounts returns r's stats without its KV index's: a context already done skips the index's
// Stats call (which a memory index answers by walking its tables).
func routerCounts(r *kvroute.DefaultRouter) kvroute.Stats {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	st, _ := r.Stats(ctx)
	return st
}
