package kvroute

import (
	"container/list"
	"context"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvroute/kvroute/scorer"
)

// This file holds what the package documentation's "Router replicas" describes.

// PeerEventKind is what a PeerEvent reports.
type PeerEventKind uint8

const (
	// PeerRouted: the replica routed a request to Backend.
	PeerRouted PeerEventKind = iota + 1
	// PeerFirstToken: the request's first token came; its prefill load ends.
	PeerFirstToken
	// PeerDone: the request ended; its in-flight slot ends.
	PeerDone
)

// String returns "routed", "first_token" or "done".
func (k PeerEventKind) String() string {
	switch k {
	case PeerRouted:
		return "routed"
	case PeerFirstToken:
		return "first_token"
	case PeerDone:
		return "done"
	}
	return fmt.Sprintf("PeerEventKind(%d)", uint8(k))
}

// PeerEvent is one step of a routing decision, as a replica shares it with the others.
type PeerEvent struct {
	Kind PeerEventKind
	// ID identifies the decision among its replica's: the FirstToken and Done of a decision carry
	// its Routed event's ID.
	ID uint64
	// Backend, BlockKeys, CachedBlocks and PrefillTokens are set on PeerRouted: the backend chosen,
	// the request's block keys (nil when it was not tokenized), the blocks the backend held of
	// it, and the prompt tokens it must prefill (not cached there).
	Backend       string
	BlockKeys     []uint64
	CachedBlocks  int
	PrefillTokens int
}

// PeerPublisher receives the Router's own decision events (Config.Peers) to share with the other
// replicas. PublishPeerEvent is called on the goroutine that routed, finished or ended the
// request: it must not block (buffer, and drop when the buffer is full), and must copy
// ev.BlockKeys if it keeps them past the call.
type PeerPublisher interface {
	PublishPeerEvent(ev PeerEvent)
}

// DefaultPeerMaxAge is Config.PeerMaxAge's default.
const DefaultPeerMaxAge = 5 * time.Minute

// Bounds on what peers and engines can make a Router hold or count: at most maxPeerDecisions peer
// decisions in flight (beyond it the oldest is dropped, counted as expired), a peer decision's
// prefill tokens and an engine's running or waiting requests at most maxReportedLoad each. A
// peer or engine that is wrong, or hostile, then costs routing accuracy and bounded memory, never
// an overflow.
const (
	maxPeerDecisions = 1 << 20
	maxReportedLoad  = 1 << 30
)

// DefaultEngineLoadMaxAge is Config.EngineLoadMaxAge's default.
const DefaultEngineLoadMaxAge = 10 * time.Second

// EngineLoad is a backend's load as its engine reports it.
type EngineLoad struct {
	Running int `json:"running"` // requests the engine is running (vllm:num_requests_running)
	Waiting int `json:"waiting"` // requests queued there (vllm:num_requests_waiting)
	// KVCacheUsage is the fraction of its KV cache in use, in [0, 1] (vllm:kv_cache_usage_perc);
	// negative when the engine does not report it.
	KVCacheUsage float64 `json:"kv_cache_usage"`
	// At is when the engine's answer was read; the zero time means now.
	At time.Time `json:"at"`
}

// PeerStats is what the Router knows of its peers and of engine-reported load (Stats.Peers).
type PeerStats struct {
	Peers    int    // replicas with decisions in flight here
	InFlight int    // their decisions not yet done
	Applied  uint64 // peer events applied
	Ignored  uint64 // peer events for an unknown backend or decision
	Expired  uint64 // peer decisions dropped after PeerMaxAge
	Forgot   uint64 // peer decisions dropped by ForgetPeer
	// EngineReports counts ReportEngineLoad calls applied, EngineStale the reports that had grown
	// older than EngineLoadMaxAge (on arrival, or before the next one came).
	EngineReports uint64
	EngineStale   uint64
}

// peerKey names one peer decision.
type peerKey struct {
	replica string
	id      uint64
}

// peerEntry is one peer decision in flight here.
type peerEntry struct {
	key      peerKey
	st       *backendState
	backlog  int64       // its tokens on st.backlog until its first token
	prefill  prefillNode // its place in st.prefill until then
	activeID uint64      // its active-sequence id, 0 when none
	at       time.Time
	elem     *list.Element // in peers.order
}

// peers is the Router's state of its peers' decisions.
type peers struct {
	mu      sync.Mutex
	entries map[peerKey]*peerEntry
	order   *list.List // *peerEntry, oldest arrival first
	byPeer  map[string]int

	applied, ignored, expired, forgot atomic.Uint64
	engineReports, engineStale        atomic.Uint64
	// engineNext is the earliest expiry of the backends' engine reports (a deadline: nanoseconds
	// since the Router's epoch, by Config.Now), 0 when there is none: Route, which reads the
	// clock anyway, sweeps them once it has passed (expireExternal), so that reports age by the
	// Router's clock and no timer holds the Router.
	engineNext atomic.Int64
	// peerNext is when the oldest peer decision expires (a deadline), 0 when there is none: Route
	// sweeps once it has passed.
	peerNext atomic.Int64
	// rate is the peers' recent rate of routed prefill work, self this replica's name (from
	// Config.Peers' ReplicaID, "" when it has none), others and below the peers with decisions
	// in flight here and those of them whose names sort before self, and share this replica's
	// place among them (unseen.go).
	rate          peerRate
	self          string
	others, below int
	share         atomic.Uint64
}

// engineReport is a backend's latest engine-reported load.
type engineReport struct {
	others  int // the engine's running and waiting requests beyond this Router's own at the time
	load    EngineLoad
	expires int64 // load.At + EngineLoadMaxAge, by Config.Now (deadline)
}

// ApplyPeerEvent applies the decision event ev of another router replica, replica (a name unique
// among the replicas, not this Router's own): see the package documentation's "Router replicas".
// Events for a backend this Router does not have, a FirstToken or Done of a decision it does not
// know (its Routed was lost, or it expired), and a second Routed for the same decision are
// ignored and counted (Stats.Peers.Ignored). Safe for concurrent use.
func (r *DefaultRouter) ApplyPeerEvent(replica string, ev PeerEvent) {
	p := &r.peers
	now := r.cfg.Now()
	k := peerKey{replica, ev.ID}
	p.mu.Lock()
	r.expirePeersLocked(now)
	switch ev.Kind {
	case PeerRouted:
		st := r.set.Load().byName[ev.Backend]
		if st == nil || p.entries[k] != nil {
			p.mu.Unlock()
			p.ignored.Add(1)
			return
		}
		if len(p.entries) >= maxPeerDecisions {
			r.dropPeerLocked(p.order.Front().Value.(*peerEntry))
			p.expired.Add(1)
		}
		e := &peerEntry{key: k, st: st, at: now}
		if n := int64(min(ev.PrefillTokens, maxReportedLoad)); n > 0 {
			e.backlog = n
			st.backlog.Add(n)
			w := r.peerWork(int(n), len(ev.BlockKeys))
			st.prefill.add(&e.prefill, w, r.since(now))
			p.rate.add(float64(w), r.since(now))
		}
		if r.kv != nil && len(ev.BlockKeys) > 0 {
			// A decision of the peer's that tier 4 made (it carries block keys) counts in the
			// backend's share of the recent decisions, as this Router's own do.
			st.noteDecision(r.since(now))
		}
		if r.kv != nil && r.kv.active != nil && len(ev.BlockKeys) > 0 {
			e.activeID = r.kv.nextID.Add(1)
			r.kv.active.Add(e.activeID, ev.Backend, ev.BlockKeys, ev.CachedBlocks)
		}
		if p.entries == nil {
			p.entries, p.order, p.byPeer = map[peerKey]*peerEntry{}, list.New(), map[string]int{}
		}
		p.entries[k] = e
		e.elem = p.order.PushBack(e)
		if p.order.Len() == 1 {
			p.peerNext.Store(r.deadline(now.Add(r.cfg.PeerMaxAge)))
		}
		if p.byPeer[replica]++; p.byPeer[replica] == 1 {
			p.reshareLocked(replica, true)
		}
		st.peerInFlight.Add(1)
		r.updateExternalLocked(st)
		p.mu.Unlock()
		p.applied.Add(1)
		// Speculation outside the lock: a remote index does I/O.
		if r.kv != nil && r.kv.specTTL > 0 && len(ev.BlockKeys) > 0 {
			_ = r.kv.spec.Speculate(context.Background(), ev.Backend, ev.BlockKeys, r.kv.specTTL)
		}
		return
	case PeerFirstToken, PeerDone:
		e := p.entries[k]
		if e == nil {
			p.mu.Unlock()
			p.ignored.Add(1)
			return
		}
		if ev.Kind == PeerFirstToken {
			r.endPeerPrefill(e)
		} else {
			r.dropPeerLocked(e)
		}
		p.mu.Unlock()
		p.applied.Add(1)
		return
	}
	p.mu.Unlock()
	p.ignored.Add(1)
}

// peerWork is the prefill work of a peer's decision with prefill tokens not cached on its backend
// and blocks block keys: the prompt is taken as long as its blocks (or its prefill tokens, when
// longer: the part of a block after the last full one has no key), cached but for those tokens.
func (r *DefaultRouter) peerWork(prefill, blocks int) int64 {
	if r.kv == nil {
		return int64(prefill)
	}
	n := max(blocks*r.kv.cfg.BlockSize, prefill)
	return int64(math.Ceil(min(scorer.PrefillWork(n, n-prefill, r.kv.attn), maxReportedLoad)))
}

// endPeerPrefill ends e's prefill load: its backlog tokens and work, and its active sequence's
// prefill. The peer's first token teaches this Router nothing of the backend's prefill rate: it
// reaches it late.
func (r *DefaultRouter) endPeerPrefill(e *peerEntry) {
	if e.backlog != 0 {
		e.st.backlog.Add(-e.backlog)
		e.backlog = 0
	}
	e.st.prefill.end(&e.prefill, false, r.since(r.cfg.Now()))
	if e.activeID != 0 {
		r.kv.active.FirstToken(e.activeID)
	}
}

// dropPeerLocked removes e and everything it added. Requires peers.mu.
func (r *DefaultRouter) dropPeerLocked(e *peerEntry) {
	p := &r.peers
	r.endPeerPrefill(e)
	if e.activeID != 0 {
		r.kv.active.Done(e.activeID)
	}
	delete(p.entries, e.key)
	p.order.Remove(e.elem)
	if p.byPeer[e.key.replica]--; p.byPeer[e.key.replica] <= 0 {
		delete(p.byPeer, e.key.replica)
		p.reshareLocked(e.key.replica, false)
	}
	e.st.peerInFlight.Add(-1)
	r.updateExternalLocked(e.st)
}

// expirePeersLocked drops the peer decisions older than PeerMaxAge. Requires peers.mu.
func (r *DefaultRouter) expirePeersLocked(now time.Time) {
	p := &r.peers
	if p.order == nil {
		return
	}
	cut := now.Add(-r.cfg.PeerMaxAge)
	for f := p.order.Front(); f != nil; f = p.order.Front() {
		e := f.Value.(*peerEntry)
		if !e.at.Before(cut) {
			p.peerNext.Store(r.deadline(e.at.Add(r.cfg.PeerMaxAge)))
			return
		}
		r.dropPeerLocked(e)
		p.expired.Add(1)
	}
	p.peerNext.Store(0)
}

// expireExternal drops, at at (nanoseconds since the Router's epoch), the peer decisions older
// than PeerMaxAge and the engine reports older than EngineLoadMaxAge: Route calls it, so that both
// age by Config.Now even when no peer event or report comes. It costs two atomic loads until one
// has expired.
func (r *DefaultRouter) expireExternal(at int64) {
	p := &r.peers
	pn, en := p.peerNext.Load(), p.engineNext.Load()
	if (pn == 0 || at < pn) && (en == 0 || at < en) {
		return
	}
	now := r.timeAt(at)
	p.mu.Lock()
	r.expirePeersLocked(now)
	r.expireEngineLocked(now)
	p.mu.Unlock()
}

// ForgetPeer drops every decision of replica, as if each had ended, and returns how many: call it
// when the replica stopped (its heartbeat stopped, or it said goodbye), so that its requests no
// longer weigh on the backends. Safe for concurrent use.
func (r *DefaultRouter) ForgetPeer(replica string) int {
	p := &r.peers
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.byPeer[replica] == 0 {
		return 0
	}
	n := 0
	for e := p.order.Front(); e != nil; {
		next := e.Next()
		if pe := e.Value.(*peerEntry); pe.key.replica == replica {
			r.dropPeerLocked(pe)
			n++
		}
		e = next
	}
	p.forgot.Add(uint64(n))
	return n
}

// ReportEngineLoad records backend's load as its engine reports it (see "Router replicas" in the
// package documentation): until the next report, or EngineLoadMaxAge after l.At, the engine's
// requests beyond this Router's own in-flight ones count as the backend's external load (unless
// its peers' in-flight requests are more). A report already older than EngineLoadMaxAge is
// counted stale and not applied. Ages are read on Config.Now: the next Route (or Stats,
// ReportEngineLoad) after a report's expiry drops it, and no timer runs. The error
// wraps ErrUnknownBackend when there is no such backend. Safe for concurrent use.
func (r *DefaultRouter) ReportEngineLoad(backend string, l EngineLoad) error {
	st := r.set.Load().byName[backend]
	if st == nil {
		return fmt.Errorf("%w: %q", ErrUnknownBackend, backend)
	}
	now := r.cfg.Now()
	if l.At.IsZero() {
		l.At = now
	}
	age := now.Sub(l.At)
	if age >= r.cfg.EngineLoadMaxAge {
		r.peers.engineStale.Add(1)
		return nil
	}
	own, _ := r.ring.InFlight(backend)
	l.Running, l.Waiting = min(max(l.Running, 0), maxReportedLoad), min(max(l.Waiting, 0), maxReportedLoad)
	rep := &engineReport{others: max(l.Running+l.Waiting-own, 0), load: l, expires: r.deadline(l.At.Add(r.cfg.EngineLoadMaxAge))}
	p := &r.peers
	p.mu.Lock()
	r.expireEngineLocked(now)
	st.engine = rep
	if n := p.engineNext.Load(); n == 0 || rep.expires < n {
		p.engineNext.Store(rep.expires)
	}
	r.updateExternalLocked(st)
	p.mu.Unlock()
	p.engineReports.Add(1)
	return nil
}

// expireEngineLocked is expireEngineReports with peers.mu held.
func (r *DefaultRouter) expireEngineLocked(now time.Time) {
	p := &r.peers
	t := r.since(now)
	if n := p.engineNext.Load(); n == 0 || t < n {
		return
	}
	next := int64(0)
	set := r.set.Load()
	for _, list := range [][]*backendState{set.list, set.pd} {
		for _, st := range list {
			switch e := st.engine; {
			case e == nil:
			case e.expires <= t:
				st.engine = nil
				p.engineStale.Add(1)
				r.updateExternalLocked(st)
			case next == 0 || e.expires < next:
				next = e.expires
			}
		}
	}
	p.engineNext.Store(next)
}

// updateExternalLocked sets st's external load on the ring: the larger of its peers' in-flight
// requests and its engine's others. Requires peers.mu.
func (r *DefaultRouter) updateExternalLocked(st *backendState) {
	n := int(st.peerInFlight.Load())
	if st.engine != nil {
		n = max(n, st.engine.others)
	}
	if st.external == n {
		return
	}
	st.external = n
	_ = r.ring.SetExternalLoad(st.name, n) // a removed backend: nothing to set
}

// peerStats returns what the Router knows of its peers, after dropping what has expired.
func (r *DefaultRouter) peerStats() PeerStats {
	p := &r.peers
	now := r.cfg.Now()
	p.mu.Lock()
	r.expirePeersLocked(now)
	r.expireEngineLocked(now)
	s := PeerStats{Peers: len(p.byPeer), InFlight: len(p.entries)}
	p.mu.Unlock()
	s.Applied, s.Ignored, s.Expired, s.Forgot = p.applied.Load(), p.ignored.Load(), p.expired.Load(), p.forgot.Load()
	s.EngineReports, s.EngineStale = p.engineReports.Load(), p.engineStale.Load()
	return s
}

// engineLoad returns st's current engine report, if any.
func (r *DefaultRouter) engineLoad(st *backendState) (EngineLoad, bool) {
	now := r.cfg.Now()
	r.peers.mu.Lock()
	defer r.peers.mu.Unlock()
	r.expireEngineLocked(now)
	if st.engine == nil {
		return EngineLoad{}, false
	}
	return st.engine.load, true
}

// publish sends one of d's events to Config.Peers, when d is one of this Router's decisions that
// it shares.
func (r *DefaultRouter) publish(d *Decision, kind PeerEventKind, keys []uint64) {
	if d.peerID == 0 {
		return
	}
	ev := PeerEvent{Kind: kind, ID: d.peerID}
	if kind == PeerRouted {
		ev.Backend, ev.BlockKeys = d.Backend, keys
		if d.prefill != nil {
			ev.PrefillTokens = int(d.prefill.tokens.Load())
		}
		if len(keys) > 0 && r.kv != nil {
			ev.CachedBlocks = min(d.ExpectedCachedTokens/r.kv.cfg.BlockSize, len(keys))
		}
	}
	r.cfg.Peers.PublishPeerEvent(ev)
}
