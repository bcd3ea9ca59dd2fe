package kvindex

import (
	"sync"
	"sync/atomic"
)

// MaxMemoryBackends is the largest MemoryConfig.MaxBackends: a block's holders are a 64-bit set.
const MaxMemoryBackends = 64

// DefaultMaxBackends is MemoryConfig.MaxBackends when zero.
const DefaultMaxBackends = MaxMemoryBackends

// backendState is what MemoryIndex keeps per backend: its small integer id (its bit in the block
// table's holder sets), its engine-hash map (its own, or its share of the shared one, see
// memory_shared.go) and the queue of its speculative blocks.
type backendState struct {
	name string
	id   uint8

	// life is held shared by Apply and Speculate while they use id, and exclusively by retire,
	// so that an id is never written to after its backend was cleared.
	life    sync.RWMutex
	retired bool // under life

	emu sync.Mutex
	em  engineMap // under emu
	// subKeys is the most keys one engine hash of the backend has stood for (its engine blocks'
	// size over the index's), 0 before its first; under emu. keysOf probes no further.
	subKeys int
	// shared: the backend writes its engine hashes to the shared map; sharedEver: it has done
	// so, and may have entries there; shareScore: the evidence for sharing (see noteShared).
	// Under emu.
	shared, sharedEver bool
	shareScore         int

	// specMu guards spec. Lock order: life (shared), then specMu, then shard locks.
	specMu sync.Mutex
	spec   specQueue // under specMu
	// specDue is 1<<32 | spec's soonest expiry, 0 when spec is empty: written under specMu, read
	// without it by Speculate to skip the queue when nothing is due.
	specDue atomic.Uint64

	lastActive atomic.Uint32 // tick of the last Apply or Speculate
}

// registry interns backend names to ids.
//
// Reads (Lookup) load an immutable name → state map; writers copy it. A cleared backend's id is
// "retired": its bits stay in the block table until a sweep (periodic, or synchronous when ids
// run out) clears them; only then is the id free again. ClearBackend is therefore O(1).
type registry struct {
	mu      sync.Mutex
	names   atomic.Pointer[map[string]*backendState]
	byID    [MaxMemoryBackends]*backendState // under mu
	free    uint64                           // under mu
	retired atomic.Uint64                    // ids whose bits are garbage; written under mu
	// shareAll starts every backend on the shared engine-hash map (tests).
	shareAll bool
}

func (r *registry) init(maxBackends int) {
	empty := map[string]*backendState{}
	r.names.Store(&empty)
	if maxBackends >= 64 {
		r.free = ^uint64(0)
	} else {
		r.free = 1<<uint(maxBackends) - 1
	}
}

// lookup returns the live state of name, or nil.
func (r *registry) lookup(name string) *backendState {
	return (*r.names.Load())[name]
}

// register returns name's state, creating it with a free id; nil when no id is free.
func (r *registry) register(name string) *backendState {
	r.mu.Lock()
	defer r.mu.Unlock()
	names := *r.names.Load()
	if bs := names[name]; bs != nil {
		return bs
	}
	if r.free == 0 {
		return nil
	}
	id := uint8(0)
	for r.free&(1<<id) == 0 {
		id++
	}
	r.free &^= 1 << id
	bs := &backendState{name: name, id: id, shared: r.shareAll, sharedEver: r.shareAll}
	next := make(map[string]*backendState, len(names)+1)
	for k, v := range names {
		next[k] = v
	}
	next[name] = bs
	r.byID[id] = bs
	r.names.Store(&next)
	return bs
}

// unlink removes name from the registry and marks its id retired; it returns the removed state
// (nil when name was unknown). The caller then calls retire on it.
func (r *registry) unlink(name string) *backendState {
	r.mu.Lock()
	defer r.mu.Unlock()
	names := *r.names.Load()
	bs := names[name]
	if bs == nil {
		return nil
	}
	next := make(map[string]*backendState, len(names))
	for k, v := range names {
		if k != name {
			next[k] = v
		}
	}
	r.byID[bs.id] = nil
	r.retired.Or(1 << bs.id)
	r.names.Store(&next)
	return bs
}

// unlinkState is unlink for exactly bs: it reports false when bs is no longer registered.
func (r *registry) unlinkState(bs *backendState) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	names := *r.names.Load()
	if names[bs.name] != bs {
		return false
	}
	next := make(map[string]*backendState, len(names))
	for k, v := range names {
		if v != bs {
			next[k] = v
		}
	}
	r.byID[bs.id] = nil
	r.retired.Or(1 << bs.id)
	r.names.Store(&next)
	return true
}

// release frees the retired ids of mask, whose bits are gone from every table.
func (r *registry) release(mask uint64) {
	r.mu.Lock()
	r.retired.And(^mask)
	r.free |= mask
	r.mu.Unlock()
}

// active returns the live backends (a snapshot).
func (r *registry) active() map[string]*backendState { return *r.names.Load() }

// specQueue is one backend's speculative entries in order of expiry, so that each leaves the
// table, and the counters, as it expires (MemoryIndex.expireSpecs), and so that with
// MemoryConfig.ApproximateCapacityBlocks the oldest go first. An entry is a block's mixed key and
// the expiry tick it was queued with, never later than the block's speculative expiry while the
// backend's speculation on it lasts (a block's expiry only grows, and an entry is queued again
// when one shrinks). Entries arrive in order of expiry when the backend's callers use one TTL:
// they go to a FIFO whose expiries never decrease, stored once per run of equal expiries (one
// Speculate call), 8 bytes an entry. The others, whose expiry is before the FIFO's last (a
// shorter TTL, or an entry queued again with its extended expiry), go to a min-heap of 16-byte
// entries. Entries whose speculation ended otherwise (confirmed, evicted, cleared) stay until
// popped or compacted. Under backendState.specMu.
type specQueue struct {
	keys ring[uint64]  // the FIFO's mixed keys, oldest first
	runs ring[specRun] // the FIFO's expiries: the first runs.front().n keys expire at its exp, …
	late []specEntry   // min-heap by exp
}

type specRun struct{ exp, n uint32 }

type specEntry struct {
	h   uint64
	exp uint32
}

// before reports whether tick a is before tick b (ticks wrap; see MaxTTL).
func before(a, b uint32) bool { return int32(a-b) < 0 }

func (q *specQueue) len() int { return q.keys.n + len(q.late) }

// push queues block h (mixed) expiring at tick exp.
func (q *specQueue) push(h uint64, exp uint32) {
	if q.runs.n > 0 {
		last := q.runs.back()
		if last.exp == exp {
			last.n++
			q.keys.push(h)
			return
		}
		if before(exp, last.exp) {
			q.pushLate(specEntry{h, exp})
			return
		}
	}
	q.runs.push(specRun{exp, 1})
	q.keys.push(h)
}

// next returns the soonest expiry queued; ok is false when the queue is empty.
func (q *specQueue) next() (exp uint32, ok bool) {
	switch {
	case q.runs.n > 0 && (len(q.late) == 0 || !before(q.late[0].exp, q.runs.front().exp)):
		return q.runs.front().exp, true
	case len(q.late) > 0:
		return q.late[0].exp, true
	}
	return 0, false
}

// pop removes and returns the entry with the soonest expiry; ok is false when the queue is empty.
func (q *specQueue) pop() (h uint64, exp uint32, ok bool) {
	switch {
	case q.runs.n > 0 && (len(q.late) == 0 || !before(q.late[0].exp, q.runs.front().exp)):
		r := q.runs.front()
		exp = r.exp
		if r.n--; r.n == 0 {
			q.runs.popFront()
		}
		return q.keys.popFront(), exp, true
	case len(q.late) > 0:
		e := q.popLate()
		return e.h, e.exp, true
	}
	return 0, 0, false
}

func (q *specQueue) pushLate(e specEntry) {
	q.late = append(q.late, e)
	a := q.late
	for i := len(a) - 1; i > 0; {
		p := (i - 1) / 2
		if !before(a[i].exp, a[p].exp) {
			break
		}
		a[i], a[p] = a[p], a[i]
		i = p
	}
}

func (q *specQueue) popLate() specEntry {
	a := q.late
	top := a[0]
	n := len(a) - 1
	a[0] = a[n]
	q.late = a[:n]
	siftDown(q.late, 0)
	return top
}

func siftDown(a []specEntry, i int) {
	for {
		c := 2*i + 1
		if c >= len(a) {
			return
		}
		if c+1 < len(a) && before(a[c+1].exp, a[c].exp) {
			c++
		}
		if !before(a[c].exp, a[i].exp) {
			return
		}
		a[i], a[c] = a[c], a[i]
		i = c
	}
}

// retain keeps, in order, the entries for which keep returns true.
func (q *specQueue) retain(keep func(h uint64) bool) {
	kept, runs, i := 0, 0, 0
	for r := range q.runs.n {
		run := *q.runs.at(r)
		from := kept
		for range run.n {
			if h := *q.keys.at(i); keep(h) {
				*q.keys.at(kept) = h
				kept++
			}
			i++
		}
		if kept > from {
			*q.runs.at(runs) = specRun{run.exp, uint32(kept - from)}
			runs++
		}
	}
	q.keys.n, q.runs.n = kept, runs
	late := q.late[:0]
	for _, e := range q.late {
		if keep(e.h) {
			late = append(late, e)
		}
	}
	clear(q.late[len(late):])
	q.late = late
	for i := len(late)/2 - 1; i >= 0; i-- {
		siftDown(late, i)
	}
	q.shrink()
}

// shrink gives back the memory of a queue that has shrunk to a quarter of its capacity. Buffers
// are not shrunk below minShrink entries, so that a small queue that empties and fills again
// does not reallocate.
func (q *specQueue) shrink() {
	q.keys.shrink()
	q.runs.shrink()
	if c := cap(q.late); c > minShrink && 4*len(q.late) < c {
		q.late = append(make([]specEntry, 0, max(minShrink, 2*len(q.late))), q.late...)
	}
}

func (q *specQueue) bytes() int64 {
	return int64(len(q.keys.buf))*8 + int64(len(q.runs.buf))*8 + int64(cap(q.late))*16
}

// ring is a FIFO in a circular buffer whose length is 0 or a power of two.
type ring[T any] struct {
	buf  []T
	head int
	n    int
}

func (r *ring[T]) push(x T) {
	if r.n == len(r.buf) {
		r.resize(max(16, 2*len(r.buf)))
	}
	r.buf[(r.head+r.n)&(len(r.buf)-1)] = x
	r.n++
}

// front and back return the first and the last element; the ring must not be empty.
func (r *ring[T]) front() *T { return &r.buf[r.head] }
func (r *ring[T]) back() *T  { return r.at(r.n - 1) }

// at returns the i-th element from the front.
func (r *ring[T]) at(i int) *T { return &r.buf[(r.head+i)&(len(r.buf)-1)] }

// popFront removes and returns the first element; the ring must not be empty.
func (r *ring[T]) popFront() T {
	x := r.buf[r.head]
	r.head = (r.head + 1) & (len(r.buf) - 1)
	r.n--
	return x
}

// resize moves the elements to a new buffer of size (a power of two ≥ n).
func (r *ring[T]) resize(size int) {
	nb := make([]T, size)
	for i := range r.n {
		nb[i] = *r.at(i)
	}
	r.buf, r.head = nb, 0
}

// minShrink is the size (a power of two) below which specQueue.shrink shrinks no buffer.
const minShrink = 256

// shrink halves the buffer (or more, down to minShrink) when it is less than a quarter full.
func (r *ring[T]) shrink() {
	if size := len(r.buf); size > minShrink && 4*r.n < size {
		for size > minShrink && 4*r.n < size {
			size /= 2
		}
		r.resize(size)
	}
}
