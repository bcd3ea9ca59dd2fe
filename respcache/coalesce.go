package respcache

import (
	"context"
	"net/http"
	"sync"
)

// This file holds request coalescing: concurrent identical eligible requests (same Key) share one
// call to the wrapped handler. It is a singleflight specialised for HTTP responses: the first
// request of a key (the leader) calls the handler through a recorder that publishes to a flight;
// the others (waiters) attach to the flight and either replay the finished entry (non-streaming) or
// follow the recorded stream live (SSE). See the Cache doc for the contract.
//
// Memory: while a stream is below MaxStreamBufferSize, waiters read the recorder's own buffer
// (append-only, so a slice of it taken under the flight's lock stays valid) and a singly linked
// list of pieces that are sub-slices of that buffer; only the list's tail is held by the flight, so
// pieces every follower has written become garbage. Past the cap the recorder drops its buffer and
// the pieces are copies, made only while someone follows. Nothing is allocated for followers when
// nobody follows.
//
// Locks: Cache.mu (the flights map) may be held while taking flight.mu, never the reverse. No lock
// is held while calling the wrapped handler, writing to a client, or calling the store.

// flightPhase is where a flight's response stands.
type flightPhase uint8

const (
	phaseWaiting flightPhase = iota // the leader's status is not known, or a non-stream body is being recorded
	phaseLive                       // a 200 SSE stream is being recorded: waiters follow it
	phaseFailed                     // the response cannot be shared: waiters call the handler themselves
	phaseDone                       // the leader's handler returned (or panicked)
)

// flight is one in-progress call to the wrapped handler shared by concurrent identical requests.
type flight struct {
	c   *Cache
	key Key

	mu        sync.Mutex
	phase     flightPhase
	status    int
	header    []string // stored headers, name/value pairs
	joinable  bool     // live: new followers may still replay the stream from its start
	body      []byte   // live and joinable: the stream recorded so far
	tail      *piece   // last piece relayed to followers; nil when none follows
	followers int      // attached waiters (following or waiting)
	wake      chan struct{}
	result    *storedResponse // at phaseDone: the shared response, nil when not shareable
	aborted   bool            // the leader's handler panicked
	// the leader's client left; cancel stops the leader's handler once no waiter is attached
	leaderGone bool
	cancel     context.CancelFunc
}

// piece is one Write of the leader, relayed to live followers.
type piece struct {
	data []byte
	next *piece
}

// followResult is how a waiter's attachment to a flight ended.
type followResult uint8

const (
	followServed   followResult = iota // a response (or part of one) was written
	followLeft                         // the waiter's context ended before it wrote anything
	followFallback                     // nothing was written: call the handler
)

// serveCoalesced serves an eligible request that missed the store: it leads a new flight for key
// or attaches to the one in progress.
func (c *Cache) serveCoalesced(w http.ResponseWriter, r *http.Request, next http.Handler, key Key, skey string, settled uint64) {
	rechecked := false
	for {
		c.mu.Lock()
		f := c.flights[key]
		if f == nil {
			if !rechecked && c.settled.Load() != settled {
				// A flight finished (and stored its response) since this request's lookup: look
				// again rather than call the handler for a response just stored.
				c.mu.Unlock()
				rechecked = true
				if e := c.lookup(r.Context(), skey); e != nil {
					c.counters.result(dispHit)
					c.replay(w, e)
					return
				}
				continue
			}
			f = &flight{c: c, key: key}
			c.flights[key] = f
			c.mu.Unlock()
			c.counters.result(dispMiss)
			c.lead(w, r, next, skey, f)
			return
		}
		joined := f.join()
		c.mu.Unlock()
		if !joined {
			c.counters.result(dispMiss)
			c.fill(w, r, next, skey, nil)
			return
		}
		switch f.follow(w, r) {
		case followServed:
			c.counters.result(dispHit)
			c.counters.coalesce()
		case followLeft:
			c.counters.result(dispMiss)
		case followFallback:
			c.counters.result(dispMiss)
			c.fill(w, r, next, skey, nil)
		}
		return
	}
}

// lead calls next for the flight f. The handler's context keeps r's values but is cancelled only
// when r's context ends with no waiter attached, or when the last waiter leaves after that.
func (c *Cache) lead(w http.ResponseWriter, r *http.Request, next http.Handler, skey string, f *flight) {
	parent := r.Context()
	ctx, cancel := context.WithCancel(context.WithoutCancel(parent))
	f.mu.Lock()
	f.cancel = cancel
	f.mu.Unlock()
	stop := context.AfterFunc(parent, f.leaderLeft)
	defer func() {
		stop()
		cancel()
		c.removeFlight(f)
	}()
	c.fill(w, r.WithContext(ctx), next, skey, f)
}

// removeFlight forgets f, unless a newer flight already replaced it.
func (c *Cache) removeFlight(f *flight) {
	c.mu.Lock()
	if c.flights[f.key] == f {
		delete(c.flights, f.key)
	}
	c.mu.Unlock()
}

// join attaches a waiter; false means the flight cannot be shared any more (call the handler).
// Called with Cache.mu held.
func (f *flight) join() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch f.phase {
	case phaseFailed:
		return false
	case phaseLive:
		if !f.joinable {
			return false
		}
	case phaseDone:
		if f.result == nil {
			return false
		}
	}
	f.followers++
	return true
}

// leaveLocked detaches a waiter and returns what to call once f.mu is released.
func (f *flight) leaveLocked() (cancel context.CancelFunc) {
	f.followers--
	if f.followers == 0 {
		f.tail = nil
		if f.leaderGone {
			return f.cancel
		}
	}
	return nil
}

func (f *flight) leave() {
	f.mu.Lock()
	cancel := f.leaveLocked()
	f.mu.Unlock()
	if cancel != nil {
		cancel()
	}
}

// leaderLeft runs when the leader's request context ends: the handler is cancelled now unless
// waiters depend on it.
func (f *flight) leaderLeft() {
	f.mu.Lock()
	f.leaderGone = true
	cancel := f.cancel
	if f.followers > 0 {
		cancel = nil
	}
	f.mu.Unlock()
	if cancel != nil {
		cancel()
	}
}

// shieldLeader reports whether waiters depend on the flight, so that a failed write to the
// leader's own client must not stop the handler.
func (f *flight) shieldLeader() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.followers > 0
}

// broadcastLocked wakes every waiter.
func (f *flight) broadcastLocked() {
	if f.wake != nil {
		close(f.wake)
		f.wake = nil
	}
}

// waitLocked releases f.mu until the flight changes or ctx ends, and takes it again. It returns
// false when ctx ended.
func (f *flight) waitLocked(ctx context.Context) bool {
	if f.wake == nil {
		f.wake = make(chan struct{})
	}
	ch := f.wake
	f.mu.Unlock()
	select {
	case <-ch:
		f.mu.Lock()
		return true
	case <-ctx.Done():
		f.mu.Lock()
		return false
	}
}

// Leader side: called by the recorder, in the leader's goroutine.

// publishHeader publishes a recordable 200 (or other recordable) status and its stored headers.
func (f *flight) publishHeader(status int, hdr []string, stream bool) {
	f.mu.Lock()
	f.status, f.header = status, hdr
	if stream && f.phase == phaseWaiting {
		f.phase = phaseLive
		f.joinable = true
		f.broadcastLocked()
	}
	f.mu.Unlock()
}

// fail marks the response as not shareable before any waiter could have written: they fall back.
func (f *flight) fail() {
	f.mu.Lock()
	failed := f.phase == phaseWaiting
	if failed {
		f.phase = phaseFailed
		f.broadcastLocked()
	}
	f.mu.Unlock()
	if failed {
		f.c.removeFlight(f)
	}
}

// overflow: the recording stopped (over the size limit, or the leader's client failed). A live
// stream stays followed by those who follow it; anything else fails.
func (f *flight) overflow() {
	f.mu.Lock()
	switch f.phase {
	case phaseLive:
		f.joinable = false
		f.body = nil
		f.mu.Unlock()
		f.c.removeFlight(f) // new requests start their own call
	case phaseWaiting:
		f.mu.Unlock()
		f.fail()
	default:
		f.mu.Unlock()
	}
}

// recorded publishes the recorded stream body, whose last n bytes were just written.
func (f *flight) recorded(body []byte, n int) {
	f.mu.Lock()
	if f.phase == phaseLive && f.joinable {
		f.body = body
		if f.tail != nil {
			f.appendLocked(body[len(body)-n:])
		}
	}
	f.mu.Unlock()
}

// relay hands p, written past the end of the recording, to live followers.
func (f *flight) relay(p []byte) {
	f.mu.Lock()
	if f.phase == phaseLive && f.tail != nil {
		f.appendLocked(append([]byte(nil), p...))
	}
	f.mu.Unlock()
}

func (f *flight) appendLocked(data []byte) {
	if len(data) == 0 {
		return
	}
	p := &piece{data: data}
	f.tail.next = p
	f.tail = p
	f.broadcastLocked()
}

// finish publishes the outcome: e is the shareable response or nil; aborted means the handler
// panicked.
func (f *flight) finish(e *storedResponse, aborted bool) {
	f.mu.Lock()
	f.phase = phaseDone
	f.result = e
	f.aborted = aborted
	f.body = nil
	f.broadcastLocked()
	f.mu.Unlock()
}

// Waiter side.

// follow waits for the flight's response and writes it to w.
func (f *flight) follow(w http.ResponseWriter, r *http.Request) followResult {
	ctx := r.Context()
	f.mu.Lock()
	for {
		switch f.phase {
		case phaseWaiting:
			if !f.waitLocked(ctx) {
				cancel := f.leaveLocked()
				f.mu.Unlock()
				if cancel != nil {
					cancel()
				}
				return followLeft
			}
		case phaseFailed:
			f.mu.Unlock()
			f.leave()
			return followFallback
		case phaseDone:
			e := f.result
			f.mu.Unlock()
			f.leave()
			if e == nil {
				return followFallback
			}
			f.c.replay(w, e)
			return followServed
		case phaseLive:
			if !f.joinable {
				f.mu.Unlock()
				f.leave()
				return followFallback
			}
			return f.followLive(ctx, w) // releases f.mu
		}
	}
}

// followLive relays a live stream: what was recorded so far, then each piece as it comes. It is
// called with f.mu held and releases it.
func (f *flight) followLive(ctx context.Context, w http.ResponseWriter) followResult {
	snap := f.body
	cur := f.tail
	if cur == nil {
		cur = &piece{}
		f.tail = cur
	}
	status, hdr := f.status, f.header
	f.mu.Unlock()

	h := w.Header()
	(&storedResponse{header: hdr}).setHeaders(h)
	h.Del("Content-Length")
	setXCache(h, XCacheHit)
	w.WriteHeader(status)
	flush := flusherOf(w)
	flush() // the client sees the headers now, as the leader's did
	if len(snap) > 0 {
		if _, err := w.Write(snap); err != nil {
			f.leave()
			return followServed
		}
		flush()
	}
	for {
		f.mu.Lock()
		for cur.next == nil && f.phase == phaseLive {
			if !f.waitLocked(ctx) {
				cancel := f.leaveLocked()
				f.mu.Unlock()
				if cancel != nil {
					cancel()
				}
				return followServed
			}
		}
		next, aborted := cur.next, f.aborted
		if next == nil { // the leader finished and everything was relayed
			cancel := f.leaveLocked()
			f.mu.Unlock()
			if cancel != nil {
				cancel()
			}
			if aborted {
				panic(http.ErrAbortHandler)
			}
			return followServed
		}
		f.mu.Unlock()
		if _, err := w.Write(next.data); err != nil {
			f.leave()
			return followServed
		}
		flush()
		cur = next
	}
}

// flusherOf returns a function flushing w (through http.ResponseController when w does not
// implement http.Flusher itself); errors are ignored, a failed client shows in the next Write.
func flusherOf(w http.ResponseWriter) func() {
	if f, ok := w.(http.Flusher); ok {
		return f.Flush
	}
	rc := http.NewResponseController(w)
	return func() { _ = rc.Flush() }
}
