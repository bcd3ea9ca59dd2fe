package kvroute

import (
	"cmp"
	"math"
	"slices"
	"sync/atomic"
	"time"

	"github.com/kvroute/kvroute/scorer"
)

// Router replicas see each other's decisions late: a peer's decision reaches this Router
// Config.PeerDelay after the peer made it. In that time the peers go on routing, and they route
// by views much like this Router's, so their unseen requests went where this Router would send
// its own: to the backends that look least busy. Left uncounted, every replica sends its next
// requests to the same backend, and a burst of arrivals piles up there (a herd). Tier 4 therefore
// counts the prefill work of the peers' decisions that its own does not see and that do not see
// it — their recent rate of routed work times twice PeerDelay — on the backends that look least
// busy (unseenPeerWork, spreadUnseen). While at least one such decision is expected, it breaks
// ties apart from the other replicas rather than by the in-flight counts they all share and
// would break alike (tieMode, breakTie).

// DefaultPeerDelay is Config.PeerDelay's default: natsync's default batching interval, on a
// network whose delay is small beside it.
const DefaultPeerDelay = 5 * time.Millisecond

// unseenWindow is the time constant of the peers' rate of routed work: an event counts
// e^(−age/unseenWindow). Short enough to follow the start of a burst, long enough to hold a
// rate between a few decisions.
const unseenWindow = time.Second

// peerRate is the decayed sums of the peers' decisions applied here that carried prefill work,
// and of that work: writers (ApplyPeerEvent, under peers.mu) fold an event in; Route reads the
// published sums and their time without a lock. A read between the stores pairs new sums with
// the older time, or one new sum with one old, and is off by at most one event: an estimate, as
// the rate is.
type peerRate struct {
	work atomicFloat  // token-equivalents, decayed to at
	n    atomicFloat  // decisions, decayed to at
	at   atomic.Int64 // nanoseconds since the Router's epoch
}

// add folds a decision of work w, applied at now, into the sums. Requires peers.mu (one writer
// at a time).
func (p *peerRate) add(w float64, now int64) {
	decay := 1.0
	if last := p.at.Load(); now > last {
		decay = math.Exp(-float64(now-last) / float64(unseenWindow))
	} // else the same instant, or a clock that went back: no decay, and the sums' time follows it
	p.work.store(p.work.load()*decay + w)
	p.n.store(p.n.load()*decay + 1)
	p.at.Store(now)
}

// unseenPeerWork is the peers' prefill work that a decision of this Router's at now does not see
// and that does not see it, and the number of their decisions it comes in: their rates times
// twice Config.PeerDelay, for the peers' decisions of the last PeerDelay have not reached this
// Router, and this decision will not reach them for the next. 0 without peers' decisions or with
// the estimate off.
func (r *DefaultRouter) unseenPeerWork(now int64) (work, decisions float64) {
	d := r.cfg.PeerDelay
	if d <= 0 {
		return 0, 0
	}
	w := r.peers.rate.work.load()
	if !(w > 0) {
		return 0, 0
	}
	age := max(now-r.peers.rate.at.Load(), 0)
	f := math.Exp(-float64(age)/float64(unseenWindow)) * 2 * float64(d) / float64(unseenWindow)
	return w * f, r.peers.rate.n.load() * f
}

// capUnseen returns, for n candidates, the unseen work u of decisions unseen decisions, scaled
// down to at most one decision per candidate: more would have the whole fleet look alike. It
// bounds the number of decisions, not their size: a peer that reports huge prefills can still
// make the backends' pending work look alike (see "Router replicas" in the package doc).
func capUnseen(u, decisions float64, n int) (float64, float64) {
	if c := float64(n); decisions > c {
		return u * c / decisions, c
	}
	return u, decisions
}

// spreadUnseen puts u of work, the peers' decisions this Router has not seen, on the healthy
// candidates with the least pending prefill work per unit of weight, as water fills a vessel:
// it raises the lowest of them to the one level that takes u, and leaves the others. order is
// scratch space, returned for reuse.
func spreadUnseen(cands []scorer.Candidate, u float64, order []int) []int {
	order = order[:0]
	for i := range cands {
		if cands[i].Healthy {
			order = append(order, i)
		}
	}
	if len(order) == 0 || !(u > 0) || math.IsInf(u, 1) {
		return order
	}
	per := func(i int) float64 { return cands[i].PendingPrefillWork / weightOf(cands[i].Weight) }
	slices.SortFunc(order, func(a, b int) int { return cmp.Compare(per(a), per(b)) })
	var work, weight float64 // over order[:k+1]
	level := 0.0
	for k, i := range order {
		work += cands[i].PendingPrefillWork
		weight += weightOf(cands[i].Weight)
		level = (work + u) / weight
		if k+1 == len(order) || level <= per(order[k+1]) {
			break
		}
	}
	for _, i := range order {
		w := weightOf(cands[i].Weight)
		if per(i) >= level {
			break
		}
		cands[i].PendingPrefillWork = level * w
	}
	return order
}

// replicaNamer is a PeerPublisher that names its replica, as its peers name it in ApplyPeerEvent
// (natsync.Sync).
type replicaNamer interface{ ReplicaID() string }

// reshareLocked counts peer name, which has just gained its first decision in flight here
// (joined) or lost its last, in share: this replica's place among the replicas with decisions in
// flight here and itself, in the order of their names (the low 32 bits the place, the high the
// count). Nothing without a name of its own. O(1): a peer's events cost the same however many
// replicas there are. Requires mu.
func (p *peers) reshareLocked(name string, joined bool) {
	if p.self == "" || name == p.self {
		return
	}
	d := 1
	if !joined {
		d = -1
	}
	p.others += d
	if name < p.self {
		p.below += d
	}
	p.share.Store(uint64(p.others+1)<<32 | uint64(p.below))
}

// sortedByName returns the candidates' indices in the order of their backends' names (in dst):
// an order the replicas agree on whatever order their backends were added in.
func sortedByName(cands []scorer.Candidate, dst []int) []int {
	dst = dst[:0]
	for i := range cands {
		dst = append(dst, i)
	}
	slices.SortFunc(dst, func(a, b int) int { return cmp.Compare(cands[a].Backend, cands[b].Backend) })
	return dst
}

// tieMode is how acquireHighest breaks ties among the best candidates.
type tieMode uint8

const (
	// tieUsual: to the less loaded, then round (scorer.PickBestFrom): less than one peer
	// decision expected unseen.
	tieUsual tieMode = iota
	// tieHash: among the tied backends loaded alike (breakTie), the first from a hash of the
	// request: at least one peer decision expected unseen, and no share.
	tieHash
	// tieShare: among the tied backends loaded alike, the less loaded in this replica's share,
	// else as tieHash: a named replica, at least one peer decision expected unseen, and at least
	// two backends per replica (with fewer, a share would leave nothing to choose by load).
	tieShare
)

// breakTie returns the candidate to take among those tied with i (PickBestFrom's choice, the
// least loaded of them) for the best s.work, when the replicas' ties are broken apart. Tied
// backends whose loads are within the unseen peer decisions of the least loaded count as loaded
// alike: so many decisions may have landed unseen on any of them. Of those, a replica with a
// share takes the less loaded whose place in the order of the backends' names falls in its share
// (place mod replicas = its own place); otherwise, or when none does, the first from start.
func (r *DefaultRouter) breakTie(s *scratch4, i, start int) int {
	n := len(s.work)
	if i < 0 || n == 0 || s.tie == tieUsual {
		return i
	}
	best, limit := s.work[i], weightedLoad(&s.cands[i])+s.unseenN
	sh := r.peers.share.Load()
	if k, place := int(sh>>32), int(uint32(sh)); s.tie == tieShare && k > 1 && len(s.byName) == n {
		own, load := -1, 0.0
		for j := range n {
			p := (start + j) % n
			if c := s.byName[p]; p%k == place && s.work[c] == best {
				if l := weightedLoad(&s.cands[c]); l <= limit && (own < 0 || l < load) {
					own, load = c, l
				}
			}
		}
		if own >= 0 {
			return own
		}
	}
	for j := range n {
		if c := (start + j) % n; s.work[c] == best && weightedLoad(&s.cands[c]) <= limit {
			return c
		}
	}
	return i
}

// weightedLoad is a candidate's requests in flight per unit of weight, as PickBestFrom weighs
// them.
func weightedLoad(c *scorer.Candidate) float64 {
	return float64(max(c.InFlight, 0)) / weightOf(c.Weight)
}
