package kvroute

import (
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"
)

// DefaultMaxDecisionAge is Config.MaxDecisionAge's default: far above any LLM request a gateway
// serves, streamed or not, so that only a decision whose Done was forgotten reaches it.
const DefaultMaxDecisionAge = 30 * time.Minute

// liveShards is the number of lists the live decisions are spread over, so that Route and Done
// on many cores rarely wait on one another's lock. A power of two.
const liveShards = 32

// A live decision is one Route returned and whose Done has not come: the Router keeps it on one
// of liveShards intrusive lists, oldest first, so that Config.MaxDecisionAge can reclaim what it
// holds if Done never comes. Route appends (one uncontended lock), Done unlinks (the same), and
// the sweep looks at the lists' heads only when the oldest may have expired (one atomic load
// per Route otherwise). No goroutine and no timer is involved: the sweep runs in Route,
// DisaggRouter.Route, Stats and the metrics' collection, by Config.Now.

// liveNode is a live decision's place on its list.
type liveNode struct {
	prev, next *liveNode
	at         int64   // when Route began, in nanoseconds since the Router's epoch
	owner      expirer // the decision
	shard      uint8   // its list; set once, before Route returns
	tracked    bool    // it was put on a list (set once, before Route returns)
	linked     bool    // it is on its list now (under the list's lock)
}

// expirer is a decision the sweep can end: expire releases what it holds as Done would, with
// nothing recorded against its backend, unless it has ended already; it returns the backend
// and whether it released anything.
type expirer interface {
	expire() (backend string, released bool)
}

// liveShard is one list, padded to its own cache line.
type liveShard struct {
	mu         sync.Mutex
	head, tail *liveNode
	_          [40]byte
}

// liveSet holds the live decisions of a Router.
type liveSet struct {
	maxAge   int64 // Config.MaxDecisionAge in nanoseconds; 0 when the net is off
	shards   [liveShards]liveShard
	next     atomic.Int64 // no decision expires before this (nanoseconds since the epoch)
	sweeping sync.Mutex   // one sweep at a time (TryLock: Route never waits for one)
	expired  atomic.Uint64
}

func (l *liveSet) init(maxAge time.Duration) {
	if maxAge <= 0 {
		l.next.Store(math.MaxInt64)
		return
	}
	l.maxAge = int64(maxAge)
	l.next.Store(l.maxAge)
}

// track puts n, a decision begun at at, on a list. A no-op when the net is off.
func (l *liveSet) track(n *liveNode, owner expirer, at int64) {
	if l.maxAge == 0 {
		return
	}
	n.owner, n.at, n.tracked = owner, at, true
	n.shard = uint8(rand.Uint32() % liveShards)
	s := &l.shards[n.shard]
	s.mu.Lock()
	n.prev, n.next, n.linked = s.tail, nil, true
	if s.tail != nil {
		s.tail.next = n
	} else {
		s.head = n
	}
	s.tail = n
	s.mu.Unlock()
}

// untrack takes n off its list, if it is still there. Safe to call more than once.
func (l *liveSet) untrack(n *liveNode) {
	if !n.tracked {
		return
	}
	s := &l.shards[n.shard]
	s.mu.Lock()
	s.unlinkLocked(n)
	s.mu.Unlock()
}

func (s *liveShard) unlinkLocked(n *liveNode) {
	if !n.linked {
		return
	}
	if n.prev != nil {
		n.prev.next = n.next
	} else {
		s.head = n.next
	}
	if n.next != nil {
		n.next.prev = n.prev
	} else {
		s.tail = n.prev
	}
	n.prev, n.next, n.linked = nil, nil, false
}

// due reports whether a decision may have expired at now (nanoseconds since the epoch).
func (l *liveSet) due(now int64) bool { return now >= l.next.Load() }

// expireDecisions reclaims, at now, the slots of the decisions older than Config.MaxDecisionAge
// whose Done has not come: each is ended as Done(Outcome{NotSent: true}) would end it (its slot,
// prefill backlog, active sequence and peers' copy released, nothing recorded against its
// backend), counted (Stats.Decisions.Expired, telemetry.MetricDecisionsExpired) and logged
// once at Warn. A later Done on it does nothing. Costs one atomic load until the oldest decision
// may have expired.
func (r *DefaultRouter) expireDecisions(now time.Time) {
	l := &r.live
	t := r.since(now)
	if !l.due(t) || !l.sweeping.TryLock() {
		return
	}
	cut := t - l.maxAge
	next := t + l.maxAge
	var old []*liveNode
	for i := range l.shards {
		s := &l.shards[i]
		s.mu.Lock()
		for n := s.head; n != nil && n.at <= cut; n = s.head {
			s.unlinkLocked(n)
			old = append(old, n)
		}
		if s.head != nil {
			next = min(next, s.head.at+l.maxAge)
		}
		s.mu.Unlock()
	}
	l.next.Store(next)
	l.sweeping.Unlock()
	for _, n := range old {
		backend, ok := n.owner.expire()
		if !ok {
			continue
		}
		l.expired.Add(1)
		r.cfg.Logger.Warn("kvroute: a decision's Done never came; its slot is reclaimed (Config.MaxDecisionAge)",
			"backend", backend, "age", time.Duration(t-n.at), "max_decision_age", time.Duration(l.maxAge))
	}
}

// expire ends a Route decision whose Done never came (see expireDecisions).
func (d *Decision) expire() (string, bool) {
	if !d.ended.CompareAndSwap(false, true) {
		return "", false
	}
	d.end(Outcome{NotSent: true})
	return d.Backend, true
}

// expire ends a DisaggRouter decision (prefill_then_decode or fast_decode) whose Done never came:
// its prefill and decode slots are released, nothing recorded.
func (d *DisaggDecision) expire() (string, bool) {
	p := d.prefill.Release()
	dec := d.decode.Release()
	return d.Plan.Decode, p || dec
}
