package respcache

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"sync"
	"time"
)

// Defaults of MemoryConfig, from kvroute's response_cache section.
const (
	// DefaultCapacity is the number of entries a MemoryStore holds before LRU eviction
	// (response_cache.capacity).
	DefaultCapacity = 1000
	// DefaultTTL is the TTL of an entry Set with ttl ≤ 0 (response_cache.ttl, "5m").
	DefaultTTL = 5 * time.Minute
)

// ErrTooLarge is wrapped by the error of a Set whose entry alone exceeds a store's byte budget
// (MemoryConfig.MaxBytes); the value is not stored and the key's previous value, if any, is removed.
var ErrTooLarge = errors.New("respcache: value too large")

// entryOverhead is what a MemoryStore counts per entry on top of len(key)+len(value): the entry
// struct, its map slot and the slice and string headers, rounded.
const entryOverhead = 128

// MemoryConfig configures a MemoryStore. The zero value means the defaults: DefaultCapacity entries,
// no byte budget, DefaultTTL, the wall clock, one shard.
type MemoryConfig struct {
	// Capacity is the most entries the store holds; a Set beyond it evicts the least recently used.
	// 0 means DefaultCapacity; negative is invalid.
	Capacity int

	// MaxBytes, when > 0, bounds the store's accounted size: len(key) + len(value) + 128 bytes of
	// overhead per entry. A Set evicts least recently used entries until the store fits; an entry
	// that alone exceeds the budget (of its shard, see Shards) is rejected with ErrTooLarge. 0 means
	// no byte budget; negative is invalid.
	MaxBytes int64

	// DefaultTTL is the TTL of a Set with ttl ≤ 0. 0 means DefaultTTL; negative is invalid.
	DefaultTTL time.Duration

	// Now is the store's clock; nil means time.Now. It is called once per operation, outside any
	// lock, and must be safe for concurrent use.
	Now func() time.Time

	// Shards splits the store into independently locked LRUs, keys spread by a per-store seeded
	// hash, so that concurrent operations on different keys rarely contend. Capacity and MaxBytes
	// are divided among the shards and recency is tracked per shard: with more than one shard the
	// store evicts the least recently used entry of the shard being written, not of the whole store.
	// 0 means 1 (exact LRU); it must not exceed Capacity.
	Shards int
}

// MemoryStore is an in-process CacheStore: an LRU of at most Capacity entries (and, optionally,
// MaxBytes bytes) with a TTL per entry. All methods are safe for concurrent use; none starts a
// goroutine, so the store needs no Close. The zero value is not usable: make one with NewMemory.
//
// Expired entries are misses and are removed when a Get finds them, and when a Set into a full
// shard finds them among the 8 least recently used entries (removing one of those is not counted
// as an eviction; evicting a live entry is). The ctx arguments are accepted for the CacheStore
// contract and ignored: nothing blocks except on the store's own short critical sections.
//
// A hit costs one map lookup under the shard's mutex and one allocation, the returned copy.
type MemoryStore struct {
	shards   []memShard
	seed     maphash.Seed
	now      func() time.Time
	ttl      time.Duration
	capacity int
}

var _ CacheStore = (*MemoryStore)(nil)

// memShard is one LRU: a map into an intrusive doubly linked list, most recent at root.next.
type memShard struct {
	mu       sync.Mutex
	m        map[string]*memEntry
	root     memEntry // sentinel; root.next is the most recently used, root.prev the least
	capacity int
	maxBytes int64 // 0: unbounded
	size     int64

	hits, misses, evictions uint64

	_ [64]byte // keep neighbouring shards' mutexes off one cache line
}

type memEntry struct {
	prev, next *memEntry
	key        string
	value      []byte // never written after Set: Get copies it outside the lock
	expires    int64  // Unix nanoseconds; the entry is live while now < expires
}

func (e *memEntry) size() int64 { return int64(len(e.key)+len(e.value)) + entryOverhead }

// NewMemory returns an empty MemoryStore configured by cfg. It returns an error wrapping
// ErrInvalidConfig when a field is out of range.
func NewMemory(cfg MemoryConfig) (*MemoryStore, error) {
	switch {
	case cfg.Capacity < 0:
		return nil, fmt.Errorf("%w: memory capacity %d < 0", ErrInvalidConfig, cfg.Capacity)
	case cfg.MaxBytes < 0:
		return nil, fmt.Errorf("%w: memory max bytes %d < 0", ErrInvalidConfig, cfg.MaxBytes)
	case cfg.DefaultTTL < 0:
		return nil, fmt.Errorf("%w: memory default TTL %v < 0", ErrInvalidConfig, cfg.DefaultTTL)
	case cfg.Shards < 0:
		return nil, fmt.Errorf("%w: memory shards %d < 0", ErrInvalidConfig, cfg.Shards)
	}
	if cfg.Capacity == 0 {
		cfg.Capacity = DefaultCapacity
	}
	if cfg.DefaultTTL == 0 {
		cfg.DefaultTTL = DefaultTTL
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Shards == 0 {
		cfg.Shards = 1
	}
	if cfg.Shards > cfg.Capacity {
		return nil, fmt.Errorf("%w: memory shards %d > capacity %d", ErrInvalidConfig, cfg.Shards, cfg.Capacity)
	}
	s := &MemoryStore{
		shards:   make([]memShard, cfg.Shards),
		seed:     maphash.MakeSeed(),
		now:      cfg.Now,
		ttl:      cfg.DefaultTTL,
		capacity: cfg.Capacity,
	}
	n := len(s.shards)
	for i := range s.shards {
		sh := &s.shards[i]
		sh.capacity = cfg.Capacity / n
		if i < cfg.Capacity%n {
			sh.capacity++
		}
		if cfg.MaxBytes > 0 {
			sh.maxBytes = cfg.MaxBytes / int64(n)
			if int64(i) < cfg.MaxBytes%int64(n) {
				sh.maxBytes++
			}
		}
		sh.m = make(map[string]*memEntry, min(sh.capacity, 1024))
		sh.root.next, sh.root.prev = &sh.root, &sh.root
	}
	return s, nil
}

func (s *MemoryStore) shard(key string) *memShard {
	if len(s.shards) == 1 {
		return &s.shards[0]
	}
	h := maphash.String(s.seed, key)
	return &s.shards[(h>>32)*uint64(len(s.shards))>>32]
}

// Get returns a copy of key's value: (value, true, nil) on a hit, (nil, false, nil) when key is
// absent or expired (an expired entry is removed). The error is always nil and ctx is ignored. It
// is safe for concurrent use; a hit marks the entry most recently used and allocates only the
// returned slice.
func (s *MemoryStore) Get(_ context.Context, key string) ([]byte, bool, error) {
	now := s.now().UnixNano()
	sh := s.shard(key)
	sh.mu.Lock()
	e := sh.m[key]
	if e == nil {
		sh.misses++
		sh.mu.Unlock()
		return nil, false, nil
	}
	if now >= e.expires {
		sh.remove(e)
		sh.misses++
		sh.mu.Unlock()
		return nil, false, nil
	}
	sh.moveToFront(e)
	sh.hits++
	v := e.value
	sh.mu.Unlock()
	// v is never written after Set, so copying it outside the lock is safe.
	out := make([]byte, len(v))
	copy(out, v)
	return out, true, nil
}

// Set stores a copy of value under key for ttl (ttl ≤ 0: the store's DefaultTTL), replacing any
// previous value and making the entry most recently used, then evicts least recently used entries
// while the shard holds more than its capacity or bytes. It returns nil, or an error wrapping
// ErrTooLarge when the entry alone exceeds the byte budget (the key is then absent). ctx is
// ignored. It is safe for concurrent use.
func (s *MemoryStore) Set(_ context.Context, key string, value []byte, ttl time.Duration) error {
	if ttl <= 0 {
		ttl = s.ttl
	}
	now := s.now().UnixNano()
	expires := now + int64(ttl)
	if expires < now { // overflow: keep it forever
		expires = int64(^uint64(0) >> 1)
	}
	v := make([]byte, len(value)) // copied before taking the lock
	copy(v, value)
	sh := s.shard(key)
	need := int64(len(key)+len(v)) + entryOverhead

	sh.mu.Lock()
	defer sh.mu.Unlock()
	old := sh.m[key]
	if sh.maxBytes > 0 && need > sh.maxBytes {
		if old != nil {
			sh.remove(old)
		}
		return fmt.Errorf("%w: %d bytes with overhead, budget %d", ErrTooLarge, need, sh.maxBytes)
	}
	if old != nil {
		sh.size += int64(len(v) - len(old.value))
		old.value = v
		old.expires = expires
		sh.moveToFront(old)
	} else {
		e := &memEntry{key: key, value: v, expires: expires}
		sh.m[key] = e
		sh.pushFront(e)
		sh.size += need
	}
	sh.shrink(now)
	return nil
}

// shrink removes entries from the back until the shard fits its capacity and byte budget: first
// expired entries among the 8 least recently used, then live ones (counted as evictions). The
// front entry, just written, is never removed. Called with sh.mu held.
func (sh *memShard) shrink(now int64) {
	over := func() bool {
		return len(sh.m) > sh.capacity || (sh.maxBytes > 0 && sh.size > sh.maxBytes)
	}
	if !over() {
		return
	}
	e := sh.root.prev
	for i := 0; i < 8 && e != &sh.root && e != sh.root.next; i++ {
		prev := e.prev
		if now >= e.expires {
			sh.remove(e)
		}
		e = prev
	}
	for over() && sh.root.prev != sh.root.next {
		sh.remove(sh.root.prev)
		sh.evictions++
	}
}

func (sh *memShard) pushFront(e *memEntry) {
	e.prev = &sh.root
	e.next = sh.root.next
	e.next.prev = e
	sh.root.next = e
}

func (sh *memShard) moveToFront(e *memEntry) {
	if sh.root.next == e {
		return
	}
	e.prev.next = e.next
	e.next.prev = e.prev
	sh.pushFront(e)
}

func (sh *memShard) remove(e *memEntry) {
	e.prev.next = e.next
	e.next.prev = e.prev
	e.prev, e.next = nil, nil
	delete(sh.m, e.key)
	sh.size -= e.size()
}

// Delete removes key; an absent key is not an error. The error is always nil and ctx is ignored.
// It is safe for concurrent use.
func (s *MemoryStore) Delete(_ context.Context, key string) error {
	sh := s.shard(key)
	sh.mu.Lock()
	if e := sh.m[key]; e != nil {
		sh.remove(e)
	}
	sh.mu.Unlock()
	return nil
}

// Clear removes every entry and returns how many it removed, expired ones included. Counters (hits,
// misses, evictions) are kept. The error is always nil and ctx is ignored. It is safe for
// concurrent use; each shard is emptied atomically, the store as a whole is not (a concurrent Set
// into an already cleared shard survives).
func (s *MemoryStore) Clear(_ context.Context) (int, error) {
	n := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		n += len(sh.m)
		clear(sh.m)
		sh.root.next, sh.root.prev = &sh.root, &sh.root
		sh.size = 0
		sh.mu.Unlock()
	}
	return n, nil
}

// Stats returns Backend "memory", the number of entries held (expired ones not yet removed
// included), the configured Capacity, the accounted SizeBytes (see MemoryConfig.MaxBytes) and the
// hit, miss and eviction counters since NewMemory. ctx is ignored. It is safe for concurrent use; it
// reads each shard under its lock, so the totals are not one atomic snapshot.
func (s *MemoryStore) Stats(_ context.Context) StoreStats {
	st := StoreStats{Backend: "memory", Capacity: s.capacity}
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		st.Entries += len(sh.m)
		st.SizeBytes += sh.size
		st.Hits += sh.hits
		st.Misses += sh.misses
		st.Evictions += sh.evictions
		sh.mu.Unlock()
	}
	return st
}
