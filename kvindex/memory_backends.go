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
// table's holder sets), its engine-hash map and, in approximate mode, the order of its speculative
// blocks.
type backendState struct {
	name string
	id   uint8

	// life is held shared by Apply and Speculate while they use id, and exclusively by retire,
	// so that an id is never written to after its backend was cleared.
	life    sync.RWMutex
	retired bool // under life

	emu sync.Mutex
	em  engineMap // under emu

	specMu sync.Mutex
	ring   specRing // under specMu

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
	bs := &backendState{name: name, id: id}
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

// specRing is a FIFO of one backend's speculative blocks (mixed keys), oldest first, kept only
// when MemoryConfig.ApproximateCapacityBlocks is set. Entries whose speculation has ended since
// (confirmed, expired, evicted) stay until popped or compacted.
type specRing struct {
	buf  []uint64
	head int
	n    int
}

func (q *specRing) push(h uint64) {
	if q.n == len(q.buf) {
		nb := make([]uint64, max(16, 2*len(q.buf)))
		for i := range q.n {
			nb[i] = q.buf[(q.head+i)%len(q.buf)]
		}
		q.buf, q.head = nb, 0
	}
	q.buf[(q.head+q.n)%len(q.buf)] = h
	q.n++
}

func (q *specRing) pop() (uint64, bool) {
	if q.n == 0 {
		return 0, false
	}
	h := q.buf[q.head]
	q.head = (q.head + 1) % len(q.buf)
	q.n--
	return h, true
}

// retain keeps, in order, the entries for which keep returns true.
func (q *specRing) retain(keep func(h uint64) bool) {
	nb := make([]uint64, 0, max(16, q.n))
	for i := range q.n {
		if h := q.buf[(q.head+i)%len(q.buf)]; keep(h) {
			nb = append(nb, h)
		}
	}
	q.n = len(nb)
	q.buf, q.head = nb[:cap(nb)], 0
}

func (q *specRing) bytes() int64 { return int64(cap(q.buf)) * 8 }
