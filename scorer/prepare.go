package scorer

import (
	"context"
	"errors"
	"fmt"
	"github.com/hashicorp/golang-lru/v2/simplelru"
	"sync"
	"time"
)

// Defaults of PrepareConfig.
const (
	// DefaultPrepareTTL is how long a fetched result is reused (kvroute's 100 ms prepare window).
	DefaultPrepareTTL = 100 * time.Millisecond
	// DefaultPrepareSize is how many keys' results are kept.
	DefaultPrepareSize = 4096
)

// prepareShards is the number of independently locked shards of a PrepareCache (fewer when Size
// is small), so that hits on different keys do not serialise on one mutex.
const prepareShards = 16

// errFetchPanicked is what waiters of a fetch that panicked receive (the panic itself propagates in
// the goroutine that ran the fetch).
var errFetchPanicked = errors.New("scorer: PrepareCache fetch panicked")

// PrepareConfig configures a PrepareCache. Its zero value means TTL 100 ms, 4096 entries and the
// wall clock.
type PrepareConfig struct {
	// TTL is how long a successful result is reused; 0 means DefaultPrepareTTL; negative is an
	// error.
	TTL time.Duration
	// Size bounds the number of keys whose results are kept (least recently used dropped first);
	// 0 means DefaultPrepareSize; negative is an error.
	Size int
	// Now is the clock; nil means time.Now. It is called outside the cache's locks.
	Now func() time.Time
}

// PrepareCache is the first phase of kvroute's two-phase scoring for remote indexes: prepare()
// fetches a key's index answer once, and score() then reads it synchronously. Get returns the
// cached result of fetch for a key while it is younger than the TTL; otherwise one caller (the
// leader) runs fetch while concurrent callers for the same key wait for its result
// (singleflight). Successful results are kept in a bounded LRU; errors are returned to the leader
// and its waiters but never cached.
//
// A PrepareCache is safe for concurrent use. Results are shared, not copied: treat them as
// read-only. Create one with NewPrepareCache; the zero value is not usable.
type PrepareCache[T any] struct {
	ttl    time.Duration
	now    func() time.Time
	shards []prepareShard[T]
}

type prepareShard[T any] struct {
	mu       sync.Mutex
	lru      *simplelru.LRU[uint64, prepared[T]] // guarded by mu
	inflight map[uint64]*prepareCall[T]
}

type prepared[T any] struct {
	v  T
	at time.Time
}

// prepareCall is one fetch in flight; done closes when v and err are final.
type prepareCall[T any] struct {
	done chan struct{}
	v    T
	err  error
	// retry: the fetch failed because the leader's context ended; waiters with a live
	// context start over rather than inherit the leader's cancellation.
	retry bool
}

// NewPrepareCache validates cfg and returns an empty cache. The error wraps ErrInvalidConfig when
// TTL or Size is negative.
func NewPrepareCache[T any](cfg PrepareConfig) (*PrepareCache[T], error) {
	if cfg.TTL < 0 {
		return nil, fmt.Errorf("%w: TTL = %v, want ≥ 0", ErrInvalidConfig, cfg.TTL)
	}
	if cfg.Size < 0 {
		return nil, fmt.Errorf("%w: Size = %d, want ≥ 0", ErrInvalidConfig, cfg.Size)
	}
	ttl, size := cfg.TTL, cfg.Size
	if ttl == 0 {
		ttl = DefaultPrepareTTL
	}
	if size == 0 {
		size = DefaultPrepareSize
	}
	n := min(prepareShards, max(size/64, 1)) // ≥ 64 entries per shard, unless size is small
	c := &PrepareCache[T]{ttl: ttl, now: cfg.Now, shards: make([]prepareShard[T], n)}
	per := (size + n - 1) / n
	for i := range c.shards {
		c.shards[i].lru, _ = simplelru.NewLRU[uint64, prepared[T]](per, nil) // per > 0
		c.shards[i].inflight = make(map[uint64]*prepareCall[T])
	}
	return c, nil
}

func (c *PrepareCache[T]) clock() time.Time {
	if c.now != nil {
		return c.now()
	}
	return time.Now()
}

func (c *PrepareCache[T]) shard(key uint64) *prepareShard[T] {
	// Keys are hashes already; mix anyway so that sequential test keys spread.
	return &c.shards[(key*0x9E3779B97F4A7C15>>32)%uint64(len(c.shards))]
}

// Get returns key's result: from the cache when it was fetched less than TTL ago, else from fetch,
// which runs once per key at a time: a caller that finds a fetch for key in flight waits for it.
//
// Cases:
//  1. Fresh cached result: returned at once, err nil, fetch not called. Allocates nothing.
//  2. Leader: fetch(ctx) runs with the caller's ctx, outside every lock; a nil error caches its
//     result for TTL. fetch's error is returned as is and not cached.
//  3. Waiter: receives the leader's result or error. If ctx ends first, it returns the zero T and
//     ctx.Err() at once; the fetch and the other callers are unaffected. If the leader's fetch
//     failed because the leader's own ctx ended, a waiter whose ctx is live starts over (and may
//     become the leader) instead of inheriting that cancellation.
//
// fetch must honour ctx: the leader cannot return before fetch does. If fetch panics, the panic
// propagates to the leader and waiters get an error. Safe for concurrent use.
func (c *PrepareCache[T]) Get(ctx context.Context, key uint64, fetch func(ctx context.Context) (T, error)) (T, error) {
	sh := c.shard(key)
	for {
		now := c.clock()
		sh.mu.Lock()
		if e, ok := sh.lru.Get(key); ok && now.Sub(e.at) < c.ttl {
			sh.mu.Unlock()
			return e.v, nil
		}
		if call := sh.inflight[key]; call != nil {
			sh.mu.Unlock()
			select {
			case <-call.done:
				if call.retry && ctx.Err() == nil {
					continue
				}
				return call.v, call.err
			case <-ctx.Done():
				var zero T
				return zero, ctx.Err()
			}
		}
		call := &prepareCall[T]{done: make(chan struct{})}
		sh.inflight[key] = call
		sh.mu.Unlock()
		return c.lead(ctx, sh, key, call, fetch)
	}
}

// lead runs fetch for call and publishes its outcome, even if fetch panics.
func (c *PrepareCache[T]) lead(ctx context.Context, sh *prepareShard[T], key uint64, call *prepareCall[T], fetch func(ctx context.Context) (T, error)) (v T, err error) {
	finished := false
	defer func() {
		if !finished { // fetch panicked
			call.err = errFetchPanicked
		}
		call.retry = call.err != nil && ctx.Err() != nil
		var at time.Time
		if call.err == nil {
			at = c.clock()
		}
		sh.mu.Lock()
		if call.err == nil {
			sh.lru.Add(key, prepared[T]{v: call.v, at: at})
		}
		delete(sh.inflight, key)
		sh.mu.Unlock()
		close(call.done)
	}()
	call.v, call.err = fetch(ctx)
	finished = true
	return call.v, call.err
}

// Len returns the number of results held, fresh or stale. Safe for concurrent use.
func (c *PrepareCache[T]) Len() int {
	n := 0
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.Lock()
		n += sh.lru.Len()
		sh.mu.Unlock()
	}
	return n
}
