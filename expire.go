package kvroute

import (
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// DefaultMaxDecisionAge is Config.MaxDecisionAge's default: far above any LLM request a gateway
// serves, streamed or not, so that only a decision whose Done was forgotten reaches it.
const DefaultMaxDecisionAge = 30 * time.Minute

// liveShards is the number of queues the live decisions are spread over, so that Route on many
// cores rarely waits on another's lock: 1<<liveShardBits.
const (
	liveShardBits = 5
	liveShards    = 1 << liveShardBits
)

// liveMinCap is the smallest capacity of a shard's queue once it holds a decision.
const liveMinCap = 16

// A live decision is one Route returned and whose Done has not come: the Router keeps it in one
// of liveShards queues, oldest first, so that Config.MaxDecisionAge can reclaim what it holds if
// Done never comes. Route appends to a queue (one uncontended lock; the queue is chosen by the
// decision's start time, with no shared counter and no random source). Done takes no lock: it
// marks the decision's liveNode ended (a Decision's Done sets that mark anyway, to run once),
// and the entries of ended decisions are dropped later, from a queue's front by the sweep and
// from the whole queue when Route finds it full, before it grows; so a queue's capacity stays
// within four times the most decisions live in it at once (or liveMinCap). The sweep looks at
// the queues' fronts only when the oldest decision may have expired (one atomic load per Route
// otherwise). No goroutine and no timer is involved: the sweep runs in Route,
// DisaggRouter.Route, Stats and the metrics' collection, by Config.Now.

// liveNode is a decision's mark among the live ones: ended is set once the sweep has nothing
// left to reclaim of it. A Decision's Done sets it as it begins, and so does the sweep as it
// reclaims the decision; a DisaggDecision's Done, PrefillFailed and DecodeFailed set it
// (untrack).
type liveNode struct {
	ended atomic.Bool
}

// expirer is a decision the sweep can end: expire releases what it holds as Done would, with
// nothing recorded against its backend, unless it has ended already; it returns the backend
// and whether it released anything.
type expirer interface {
	expire() (backend string, released bool)
}

// liveEntry is a tracked decision in its shard's queue.
type liveEntry struct {
	node  *liveNode
	owner expirer
	at    int64 // when Route began, in nanoseconds since the Router's epoch
}

// liveShard is one queue, padded to its own cache line: ents[head:] are its entries, in the
// order Route tracked them.
type liveShard struct {
	mu   sync.Mutex
	head int
	ents []liveEntry
	_    [24]byte
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

// track queues owner, a decision begun at at whose mark is n. A no-op when the net is off. The
// queue is chosen by a hash of at, whose low bits differ from one Route to the next on a clock of
// nanosecond resolution (on a coarser clock, decisions of the same tick share a queue).
func (l *liveSet) track(n *liveNode, owner expirer, at int64) {
	if l.maxAge == 0 {
		return
	}
	s := &l.shards[(uint64(at)*0x9e3779b97f4a7c15)>>(64-liveShardBits)]
	s.mu.Lock()
	if len(s.ents) == cap(s.ents) {
		s.compactLocked()
	}
	i := len(s.ents)
	s.ents = s.ents[:i+1] // within capacity: only the length is written
	s.ents[i] = liveEntry{node: n, owner: owner, at: at}
	s.mu.Unlock()
}

// untrack marks n's decision ended, so that the sweep passes over it. Safe to call more than
// once.
func (l *liveSet) untrack(n *liveNode) { n.ended.Store(true) }

// compactLocked drops the entries of the decisions that have ended, keeping the others in their
// order, and sizes the queue for what is left: twice the room when more than half of it is still
// live, a quarter of it (not below liveMinCap) when less than an eighth is. The dropped entries
// past the new length are not cleared (the appends that follow overwrite them): what the queue's
// array keeps reachable stays within its capacity either way.
func (s *liveShard) compactLocked() {
	k := 0
	for _, e := range s.ents[s.head:] {
		if !e.node.ended.Load() {
			s.ents[k] = e
			k++
		}
	}
	s.ents, s.head = s.ents[:k], 0
	switch c := cap(s.ents); {
	case c < liveMinCap:
		s.ents = append(make([]liveEntry, 0, liveMinCap), s.ents...)
	case k > c/2:
		s.ents = append(make([]liveEntry, 0, 2*c), s.ents...)
	case c > liveMinCap && k < c/8:
		s.ents = append(make([]liveEntry, 0, max(c/4, liveMinCap)), s.ents...)
	}
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
	if t := r.since(now); r.live.due(t) {
		r.sweepDecisions(t)
	}
}

// sweepDecisions is expireDecisions at t (nanoseconds since the epoch), once the oldest decision
// may have expired.
func (r *DefaultRouter) sweepDecisions(t int64) {
	l := &r.live
	if !l.sweeping.TryLock() {
		return
	}
	cut := t - l.maxAge
	next := t + l.maxAge
	var old []liveEntry
	for i := range l.shards {
		s := &l.shards[i]
		s.mu.Lock()
		for s.head < len(s.ents) {
			e := &s.ents[s.head]
			if !e.node.ended.Load() {
				if e.at > cut {
					next = min(next, e.at+l.maxAge)
					break
				}
				old = append(old, *e)
			}
			*e = liveEntry{}
			s.head++
		}
		if s.head == len(s.ents) {
			s.ents, s.head = s.ents[:0], 0
		}
		s.mu.Unlock()
	}
	l.next.Store(next)
	l.sweeping.Unlock()
	for _, e := range old {
		backend, ok := e.owner.expire()
		if !ok {
			continue
		}
		l.expired.Add(1)
		r.cfg.Logger.Warn("kvroute: a decision's Done never came; its slot is reclaimed (Config.MaxDecisionAge)",
			"backend", backend, "age", time.Duration(t-e.at), "max_decision_age", time.Duration(l.maxAge))
	}
}

// expire ends a Route decision whose Done never came (see expireDecisions).
func (d *Decision) expire() (string, bool) {
	if !d.end(Outcome{NotSent: true}) {
		return "", false
	}
	return d.Backend, true
}

// expire ends a DisaggRouter decision (prefill_then_decode or fast_decode) whose Done never came:
// its prefill and decode slots are released, nothing recorded.
func (d *DisaggDecision) expire() (string, bool) {
	p := d.prefill.Release()
	dec := d.decode.Release()
	return d.Plan.Decode, p || dec
}
