package kvroute

import (
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// This file holds tier 4's estimate of the prefill work queued on each backend
// (scorer.Candidate.PendingPrefillWork) and of each backend's share of the recent decisions
// (scorer.Candidate.RecentShare). Times are nanoseconds since DefaultRouter.epoch.

// prefillNode is one request's place in a backend's prefill queue: a Decision's, or a peer's
// decision's. It is linked into the queue, without an allocation, while its prefill is pending.
type prefillNode struct {
	prev, next *prefillNode
	work       int64 // token-equivalents (scorer.PrefillWork)
	routed     int64 // when it joined the queue
	queued     bool
}

// kvPrefill is a Decision's prefill on its backend's queue: its uncached tokens on
// backendState.backlog and its work in backendState.prefill until its first token or Done. Only
// decisions tier 4 knows the prompt of have one (allocated then), so that the others stay small.
type kvPrefill struct {
	tokens atomic.Int64 // 0 once the prefill has ended
	node   prefillNode
}

// prefillQueue is a backend's pending prefills, in the order they were routed, and what its
// first tokens have shown of its prefill rate. Engines prefill first come, first served (vLLM's
// and SGLang's schedulers admit waiting requests in order), so the work ahead of a new request is
// the queue's, less the progress made on its head since the head began. Writers (a request
// joining or ending) take mu; Route reads the published atomics without it.
type prefillQueue struct {
	mu         sync.Mutex
	head, tail *prefillNode
	// Guarded by mu: decayed sums of the work of the prefills that ended with a first token and
	// of the busy time they took (from the previous first token, or from their routing if that
	// came later), the number of such samples, and the last first token.
	rateWork, rateBusy float64
	samples            int
	lastFirst          int64

	work      atomic.Int64 // the queued work
	headWork  atomic.Int64 // the head's work, 0 when the queue is empty
	headStart atomic.Int64 // when the head began: it joined an empty queue, or the one before it ended
	rate      atomicFloat  // token-equivalents per nanosecond; 0 until minRateSamples
}

// The prefill rate is rateWork/rateBusy, both sums decaying with the busy time, by e^(−t/rateWindow).
// A ratio of sums, not a mean of per-prefill rates, so that prefills that end together (an engine
// prefilling a batch) share the busy time that produced them. It is used once minRateSamples
// prefills have ended, and a sample counts at least the busy time that would make it
// maxRateStep times the rate known before it: an engine refusing a long prompt at once (a
// response whose first byte is an error) must not teach the Router that the backend prefills at
// memory speed.
const (
	rateWindow     = time.Minute
	minRateSamples = 3
	maxRateStep    = 4
)

// add puts n, of work w, at the tail of the queue at now.
func (q *prefillQueue) add(n *prefillNode, w, now int64) {
	if w <= 0 {
		return
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if n.queued {
		return
	}
	n.work, n.routed, n.queued = w, now, true
	n.prev, n.next = q.tail, nil
	if q.tail != nil {
		q.tail.next = n
	} else {
		q.head = n
		q.headWork.Store(w)
		q.headStart.Store(now)
	}
	q.tail = n
	q.work.Add(w)
}

// end takes n off the queue at now, once (a node not queued is ignored); firstToken says its
// prefill ended with a first token, which teaches the rate. When n was the head, the next request
// becomes the head and begins now.
func (q *prefillQueue) end(n *prefillNode, firstToken bool, now int64) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if !n.queued {
		return
	}
	if firstToken {
		q.learn(n, now)
	}
	wasHead := q.head == n
	if n.prev != nil {
		n.prev.next = n.next
	} else {
		q.head = n.next
	}
	if n.next != nil {
		n.next.prev = n.prev
	} else {
		q.tail = n.prev
	}
	n.prev, n.next, n.queued = nil, nil, false
	q.work.Add(-n.work)
	if wasHead {
		if q.head != nil {
			q.headWork.Store(q.head.work)
		} else {
			q.headWork.Store(0)
		}
		q.headStart.Store(now)
	}
}

// learn folds n's prefill, ended by a first token at now, into the rate. Requires q.mu.
func (q *prefillQueue) learn(n *prefillNode, now int64) {
	busy := float64(max(now-max(q.lastFirst, n.routed), 0))
	q.lastFirst = now
	decay := math.Exp(-busy / float64(rateWindow))
	w := float64(n.work)
	if old := q.rate.load(); old > 0 {
		busy = max(busy, w/(maxRateStep*old))
	}
	busy = max(busy, 1) // the same nanosecond: the sums still count the work
	q.rateWork = q.rateWork*decay + w
	q.rateBusy = q.rateBusy*decay + busy
	q.samples++
	if q.samples >= minRateSamples {
		q.rate.store(q.rateWork / q.rateBusy)
	}
}

// pending is the prefill work ahead of a new request at now: the queued work, less the progress
// made on the head since it began at the learned rate, never more than the head's own work (the
// rest of the queue waits for the head's first token, which a stalled engine or a response that
// reports none never gives).
func (q *prefillQueue) pending(now int64) float64 {
	w := float64(q.work.Load())
	if w <= 0 {
		return 0
	}
	if rate, el := q.rate.load(), now-q.headStart.Load(); rate > 0 && el > 0 {
		w -= min(rate*float64(el), float64(q.headWork.Load()))
	}
	return max(w, 0)
}

// since is t as tier 4 keeps times: nanoseconds since the Router's epoch (0 for an earlier t).
func (r *DefaultRouter) since(t time.Time) int64 {
	return max(int64(t.Sub(r.epoch)), 0)
}

// nowNanos is since(Config.Now()), from the monotonic clock alone when Now is time.Now.
func (r *DefaultRouter) nowNanos() int64 {
	if r.mono {
		return max(int64(time.Since(r.epoch)), 0)
	}
	return r.since(r.cfg.Now())
}

// deadline is t as the expiry times of peers' decisions and engine reports are kept: nanoseconds
// since the Router's epoch, at least 1 (0 means none). Compared with since(Config.Now()) or
// nowNanos, a deadline set from a reading of the default clock (which carries the monotonic
// clock) is immune to steps of the wall clock.
func (r *DefaultRouter) deadline(t time.Time) int64 { return max(r.since(t), 1) }

// timeAt is the time at (nanoseconds since the Router's epoch) on Config.Now's clock.
func (r *DefaultRouter) timeAt(at int64) time.Time { return r.epoch.Add(time.Duration(at)) }

// recentWindow is the time constant of backendState.recent: a decision counts e^(−age/5 min).
const recentWindow = 5 * time.Minute

// noteDecision counts a decision made at at (nanoseconds since the epoch) in the backend's
// decayed count. recent holds 1 + log Σ e^(tᵢ/recentWindow) over its decisions' times tᵢ (so that
// 0 means none): one addition updates it, and the counts of two backends compare by their
// logarithms at any time.
func (st *backendState) noteDecision(at int64) {
	x := 1 + float64(at)/float64(recentWindow)
	st.recent.update(func(old float64) float64 {
		if old == 0 {
			return x
		}
		hi, lo := max(old, x), min(old, x)
		return hi + math.Log1p(math.Exp(lo-hi))
	})
}
