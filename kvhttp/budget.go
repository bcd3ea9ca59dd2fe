package kvhttp

import (
	"context"
	"errors"
	"sync"
)

// Budget bounds the bytes of the request bodies that Handlers hold at once, read or being
// parsed: a weighted semaphore. Share one among the Handlers it should bound together (those of a
// gateway's generations across a configuration reload, say). Safe for concurrent use.
//
// A Handler holds a body's bytes as they arrive, not as its Content-Length announces them (see
// ReadRequest), and keeps two bounds besides the size:
//
//   - a large body, one that announces more than 64 KiB or no length, may not take the
//     budget's last quarter: that reserve is left to small bodies, so that large ones that
//     stall or crowd in cannot refuse small requests (the reserve shrinks when a body of
//     Handler.MaxBodyBytes would not fit beside it);
//   - the bodies of one client (Handler.ClientKey) hold at most Handler.MaxClientBodyBytes.
//
// Waiters are served in arrival order, except that a waiter held back only by its client's bound
// holds back nobody, and a large body's wait for room outside the reserve holds back no small
// body. TryAcquire, Acquire and Release take and give back bytes of the whole budget, counted to
// no client.
type Budget struct {
	size    int64
	mu      sync.Mutex
	used    int64
	clients map[string]int64 // bytes held per client, by Handlers
	waiters []*budgetWaiter  // in arrival order
}

// grant is a request for n more bytes of a Budget: used may then be at most ceil, and, when
// counted, the bytes count to client, whose bytes may then be at most limit (no bound when
// limit <= 0).
type grant struct {
	n, ceil int64
	client  string
	limit   int64
	counted bool
}

// budgetWaiter is one grant waiting for room.
type budgetWaiter struct {
	grant
	ready chan struct{} // closed once its bytes are held
}

// Errors of a grant that found no room in time.
var (
	// errBudget is readBody's error when the Budget left no room within budgetWait.
	errBudget = errors.New("kvhttp: too many request bytes in flight")
	// errClientBudget is readBody's error when the client's bound left no room within budgetWait.
	errClientBudget = errors.New("kvhttp: too many request bytes in flight from one client")
)

// NewBudget returns a Budget of size bytes (at least 1).
func NewBudget(size int64) *Budget { return &Budget{size: max(size, 1)} }

// TryAcquire holds n bytes and reports true when they are free now and nobody waits before it
// for room in the whole budget; otherwise it holds nothing and reports false. n above the
// budget's size counts as its size.
func (b *Budget) TryAcquire(n int64) bool {
	return b.tryGrant(&grant{n: min(max(n, 0), b.size), ceil: b.size})
}

// Acquire holds n bytes, waiting for them after the requests that came first, until ctx ends:
// then it holds nothing and returns ctx.Err(). n above the budget's size counts as its size.
func (b *Budget) Acquire(ctx context.Context, n int64) error {
	return b.acquire(ctx, grant{n: min(max(n, 0), b.size), ceil: b.size})
}

// AcquireBody holds n more bytes of a request body of which held bytes are already held, for a
// gateway that holds bodies itself as they arrive (an Envoy external processor) and wants the
// Handler's bound on large bodies: once the body is larger than 64 KiB, its bytes may not take
// the budget's last quarter, the reserve kept for small bodies (unless a body of maxBody bytes,
// the largest allowed, would not fit beside it). It waits for room after the requests that came
// first, until ctx ends: then it holds nothing and returns ctx.Err(). Release gives the bytes
// back. n above the budget's size counts as its size.
func (b *Budget) AcquireBody(ctx context.Context, held, n, maxBody int64) error {
	g := grant{n: min(max(n, 0), b.size), ceil: b.size}
	if held+n > smallBody {
		g.ceil = max(b.size-b.size/4, min(max(maxBody, 1), b.size))
	}
	return b.acquire(ctx, g)
}

// Release gives back n bytes held by TryAcquire, Acquire or AcquireBody (n above the budget's size counts as
// its size). Releasing more than is held is a programmer error: it panics.
func (b *Budget) Release(n int64) { b.release(min(max(n, 0), b.size), "", 0) }

// tryGrant holds g's bytes and reports true when they fit now and no earlier waiter that would
// take them first is held back for room.
func (b *Budget) tryGrant(g *grant) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if g.ceil > b.barrier() && b.fits(g) {
		b.take(g)
		return true
	}
	return false
}

// acquire holds g's bytes, waiting for them until ctx ends: then it holds nothing and returns
// ctx.Err().
func (b *Budget) acquire(ctx context.Context, g grant) error {
	b.mu.Lock()
	if g.ceil > b.barrier() && b.fits(&g) {
		b.take(&g)
		b.mu.Unlock()
		return nil
	}
	wt := &budgetWaiter{grant: g, ready: make(chan struct{})}
	b.waiters = append(b.waiters, wt)
	b.mu.Unlock()
	select {
	case <-wt.ready:
		return nil
	case <-ctx.Done():
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	select {
	case <-wt.ready: // served meanwhile: give it back
		b.give(&g)
	default:
		for i, x := range b.waiters {
			if x == wt {
				b.waiters = append(b.waiters[:i], b.waiters[i+1:]...)
				break
			}
		}
	}
	b.wake()
	return ctx.Err()
}

// grantWithin is acquire bounded by budgetWait (after a TryAcquire-like attempt): nil when g's
// bytes are held, else errClientBudget when the client's bound was what stood in the way, or
// errBudget.
func (b *Budget) grantWithin(ctx context.Context, g grant) error {
	if b.tryGrant(&g) {
		return nil
	}
	wctx, cancel := context.WithTimeout(ctx, budgetWait)
	defer cancel()
	if b.acquire(wctx, g) == nil {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.roomFor(&g) && !b.clientRoomFor(&g) {
		return errClientBudget
	}
	return errBudget
}

// release gives back n bytes, charged of them counted to client.
func (b *Budget) release(n int64, client string, charged int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.give(&grant{n: n - charged})
	if charged > 0 {
		b.give(&grant{n: charged, client: client, counted: true})
	}
	b.wake()
}

// roomFor reports whether g's bytes fit under its ceiling. b.mu is held.
func (b *Budget) roomFor(g *grant) bool { return b.used+g.n <= g.ceil }

// clientRoomFor reports whether g's bytes fit under its client's bound. b.mu is held.
func (b *Budget) clientRoomFor(g *grant) bool {
	return !g.counted || g.limit <= 0 || b.clients[g.client]+g.n <= g.limit
}

// fits reports whether g's bytes fit now. b.mu is held.
func (b *Budget) fits(g *grant) bool { return b.roomFor(g) && b.clientRoomFor(g) }

// take holds g's bytes. b.mu is held.
func (b *Budget) take(g *grant) {
	b.used += g.n
	if g.counted {
		if b.clients == nil {
			b.clients = map[string]int64{}
		}
		b.clients[g.client] += g.n
	}
}

// give gives back g's bytes. Giving back more than is held is a programmer error: it panics. b.mu
// is held.
func (b *Budget) give(g *grant) {
	if b.used -= g.n; b.used < 0 {
		panic("kvhttp: Budget released more than held")
	}
	if g.counted {
		c := b.clients[g.client] - g.n
		switch {
		case c < 0:
			panic("kvhttp: Budget released more than a client held")
		case c == 0:
			delete(b.clients, g.client)
		default:
			b.clients[g.client] = c
		}
	}
}

// barrier is the highest ceiling of the waiters held back for room: a grant whose ceiling is not
// above it waits behind them. 0 when none is. b.mu is held.
func (b *Budget) barrier() int64 {
	var bar int64
	for _, wt := range b.waiters {
		if !b.roomFor(&wt.grant) {
			bar = max(bar, wt.ceil)
		}
	}
	return bar
}

// wake serves, in order, the waiters whose bytes fit and that no earlier waiter held back for
// room stands before. b.mu is held.
func (b *Budget) wake() {
	var bar int64
	kept := b.waiters[:0]
	for _, wt := range b.waiters {
		switch {
		case wt.ceil > bar && b.fits(&wt.grant):
			b.take(&wt.grant)
			close(wt.ready)
		default:
			if !b.roomFor(&wt.grant) {
				bar = max(bar, wt.ceil)
			}
			kept = append(kept, wt)
		}
	}
	clear(b.waiters[len(kept):])
	b.waiters = kept
}

// acquireWithin is Acquire bounded by budgetWait, reporting success.
func (b *Budget) acquireWithin(ctx context.Context, n int64) bool {
	ctx, cancel := context.WithTimeout(ctx, budgetWait)
	defer cancel()
	return b.Acquire(ctx, n) == nil
}
