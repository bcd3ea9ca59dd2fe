package scorer

import (
	"fmt"
	"sync"
	"time"
)

// DefaultMaxAge is ActiveConfig.MaxAge when left 0.
const DefaultMaxAge = 10 * time.Minute

// Pool bounds for Active's recycled sequence records: at most maxFreeSeqs are kept, and a record
// whose key slice grew beyond maxPooledKeys (a 64k-token prompt at 16 tokens per block) is dropped
// rather than kept.
const (
	maxFreeSeqs   = 64
	maxPooledKeys = 4096
)

// ActiveConfig configures an Active. Its zero value means MaxAge 10 minutes and the wall clock.
type ActiveConfig struct {
	// MaxAge bounds how long a request that never calls Done is tracked: entries older than MaxAge
	// are dropped by a lazy sweep in Add (no goroutine). 0 means DefaultMaxAge; negative is an
	// error. Set it above your longest request.
	MaxAge time.Duration
	// Now is the clock; nil means time.Now. It is called outside Active's lock.
	Now func() time.Time
}

// Active tracks the requests in flight on each backend, in KV blocks, for the Cost scorer: Dynamo's
// "active blocks" slot manager. A routed request is registered with Add; its uncached blocks count
// as prefill load until FirstToken, and all its blocks count as decode load until Done. Blocks are
// counted once per backend: each (backend, block key) is reference-counted, so two running requests
// that share a prefix on one backend count the shared blocks once, as the engine holds them once.
//
// Memory is bounded: a request that never calls Done is dropped MaxAge after its Add, by a sweep
// that Add runs (O(1) when nothing expired); backends left with no request are forgotten by the
// same sweep, at most once per MaxAge.
//
// Active is safe for concurrent use; one mutex guards it, and no method calls user code while
// holding it. Create one with NewActive; the zero value is also ready to use, with the defaults.
// Steady-state Add and Done allocate nothing: sequence records are recycled, and the maps reuse
// their space.
type Active struct {
	maxAge time.Duration
	now    func() time.Time

	mu          sync.Mutex
	seqs        map[uint64]*activeSeq
	backends    map[string]*backendLoad
	head, tail  *activeSeq // live sequences, oldest Add first
	free        *activeSeq // recycled records, linked through next
	nfree       int
	lastCleanup time.Time
	expired     uint64
}

// backendLoad is one backend's active load.
type backendLoad struct {
	prefill int              // Σ prefill of its sequences still prefilling
	refs    map[uint64]int32 // block key → number of its sequences holding it
	nseq    int
}

// activeSeq is one registered request.
type activeSeq struct {
	id         uint64
	b          *backendLoad
	keys       []uint64 // owned copy of the block keys
	prefill    int      // uncached blocks, 0 once the first token arrived
	at         time.Time
	prev, next *activeSeq
}

// NewActive validates cfg and returns an empty tracker. The error wraps ErrInvalidConfig when
// MaxAge is negative.
func NewActive(cfg ActiveConfig) (*Active, error) {
	if cfg.MaxAge < 0 {
		return nil, fmt.Errorf("%w: MaxAge = %v, want ≥ 0", ErrInvalidConfig, cfg.MaxAge)
	}
	return &Active{maxAge: cfg.MaxAge, now: cfg.Now}, nil
}

func (a *Active) clock() time.Time {
	if a.now != nil {
		return a.now()
	}
	return time.Now()
}

func (a *Active) age() time.Duration {
	if a.maxAge > 0 {
		return a.maxAge
	}
	return DefaultMaxAge
}

// Add registers request id as routed to backend, with its block keys (in order; they are copied)
// of which the first cachedBlocks are already cached there: its prefill load is
// len(blockKeys) − cachedBlocks (clamped to [0, len(blockKeys)]) until FirstToken(id), and its
// blocks count toward the backend's decode load until Done(id). An id that is already registered
// is first released, as by Done. Add also sweeps requests older than MaxAge. Safe for concurrent
// use.
func (a *Active) Add(id uint64, backend string, blockKeys []uint64, cachedBlocks int) {
	now := a.clock()
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.seqs == nil {
		a.seqs = make(map[uint64]*activeSeq)
		a.backends = make(map[string]*backendLoad)
	}
	a.sweepLocked(now)
	if old := a.seqs[id]; old != nil {
		a.releaseLocked(old)
	}
	b := a.backends[backend]
	if b == nil {
		b = &backendLoad{refs: make(map[uint64]int32, len(blockKeys))}
		a.backends[backend] = b
	}
	s := a.newSeqLocked()
	s.id, s.b, s.at = id, b, now
	s.keys = append(s.keys[:0], blockKeys...)
	for _, k := range s.keys {
		b.refs[k]++
	}
	s.prefill = len(blockKeys) - min(max(cachedBlocks, 0), len(blockKeys))
	b.prefill += s.prefill
	b.nseq++
	s.prev, s.next = a.tail, nil
	if a.tail != nil {
		a.tail.next = s
	} else {
		a.head = s
	}
	a.tail = s
	a.seqs[id] = s
}

// FirstToken records that request id produced its first token: its prefill load ends. Repeated
// calls and unknown ids are no-ops. Safe for concurrent use.
func (a *Active) FirstToken(id uint64) {
	a.mu.Lock()
	if s := a.seqs[id]; s != nil {
		s.b.prefill -= s.prefill
		s.prefill = 0
	}
	a.mu.Unlock()
}

// Done releases request id: its prefill load, if any, and its references to its blocks. Repeated
// calls and unknown ids are no-ops. Safe for concurrent use.
func (a *Active) Done(id uint64) {
	a.mu.Lock()
	if s := a.seqs[id]; s != nil {
		a.releaseLocked(s)
	}
	a.mu.Unlock()
}

// Load returns backend's active load: prefillBlocks, the uncached blocks of its requests still
// prefilling, and decodeBlocks, the distinct blocks of all its active requests. Both are 0 for an
// unknown backend. Safe for concurrent use; does not allocate.
func (a *Active) Load(backend string) (prefillBlocks, decodeBlocks int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if b := a.backends[backend]; b != nil {
		return b.prefill, len(b.refs)
	}
	return 0, 0
}

// Fill sets ActivePrefillBlocks and ActiveDecodeBlocks of every candidate in place, as Load would
// return them for its Backend, under one acquisition of the lock. Safe for concurrent use (cands
// must not be shared with another goroutine while it runs); does not allocate.
func (a *Active) Fill(cands []Candidate) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for i := range cands {
		c := &cands[i]
		c.ActivePrefillBlocks, c.ActiveDecodeBlocks = 0, 0
		if b := a.backends[c.Backend]; b != nil {
			c.ActivePrefillBlocks, c.ActiveDecodeBlocks = b.prefill, len(b.refs)
		}
	}
}

// Len returns the number of requests registered and not yet released or expired. Safe for
// concurrent use.
func (a *Active) Len() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.seqs)
}

// Expired returns how many requests have been dropped by the MaxAge sweep so far: requests whose
// Done never came (a leak in the caller's lifecycle handling, or requests longer than MaxAge).
// Safe for concurrent use.
func (a *Active) Expired() uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.expired
}

// sweepLocked drops sequences older than MaxAge and, at most once per MaxAge, forgets backends
// with no sequence.
func (a *Active) sweepLocked(now time.Time) {
	maxAge := a.age()
	for a.head != nil && now.Sub(a.head.at) > maxAge {
		a.releaseLocked(a.head)
		a.expired++
	}
	if now.Sub(a.lastCleanup) > maxAge {
		a.lastCleanup = now
		for name, b := range a.backends {
			if b.nseq == 0 {
				delete(a.backends, name)
			}
		}
	}
}

// releaseLocked undoes s's Add and recycles it.
func (a *Active) releaseLocked(s *activeSeq) {
	b := s.b
	for _, k := range s.keys {
		if n := b.refs[k] - 1; n > 0 {
			b.refs[k] = n
		} else {
			delete(b.refs, k)
		}
	}
	b.prefill -= s.prefill
	b.nseq--
	if s.prev != nil {
		s.prev.next = s.next
	} else {
		a.head = s.next
	}
	if s.next != nil {
		s.next.prev = s.prev
	} else {
		a.tail = s.prev
	}
	delete(a.seqs, s.id)
	if a.nfree >= maxFreeSeqs || cap(s.keys) > maxPooledKeys {
		return
	}
	keys := s.keys[:0]
	*s = activeSeq{keys: keys, next: a.free}
	a.free = s
	a.nfree++
}

// newSeqLocked returns a recycled record, or a new one.
func (a *Active) newSeqLocked() *activeSeq {
	s := a.free
	if s == nil {
		return new(activeSeq)
	}
	a.free = s.next
	a.nfree--
	s.next = nil
	return s
}
