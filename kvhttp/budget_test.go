package kvhttp

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// waitFor polls cond for up to 5 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal(what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waiting reports how many grants wait in b.
func waiting(b *Budget) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.waiters)
}

// Large grants stop at their ceiling and leave the reserve to small ones; a large waiter does not
// hold back a small grant, but a small waiter holds back a large one; a waiter held back by its
// client's bound holds back nobody and is served when its client gives back.
func TestBudgetGrants(t *testing.T) {
	b := NewBudget(100)
	large := func(n int64, client string) grant {
		return grant{n: n, ceil: 75, client: client, limit: 50, counted: true}
	}
	small := func(n int64, client string) grant {
		return grant{n: n, ceil: 100, client: client, limit: 50, counted: true}
	}
	g := large(40, "a")
	require.True(t, b.tryGrant(&g))
	g = large(35, "b")
	require.True(t, b.tryGrant(&g))
	g = large(1, "c")
	assert.False(t, b.tryGrant(&g), "large grants stop at 75")
	g = small(20, "c")
	assert.True(t, b.tryGrant(&g), "the reserve is for small grants")

	// A large waiter does not hold back a small grant.
	got := make(chan string, 4)
	go func() { assert.NoError(t, b.acquire(context.Background(), large(5, "c"))); got <- "large c" }()
	waitFor(t, "the large grant waits", func() bool { return waiting(b) == 1 })
	g = small(5, "d")
	assert.True(t, b.tryGrant(&g), "a large waiter does not hold back a small grant")
	// The budget is full (100); a small waiter now holds back a later large grant and small one.
	go func() { assert.NoError(t, b.acquire(context.Background(), small(10, "e"))); got <- "small e" }()
	waitFor(t, "the small grant waits", func() bool { return waiting(b) == 2 })
	b.release(20, "c", 20) // 80 used: room for small e (10) first; large c (5) then exceeds 75
	assert.Equal(t, "small e", <-got)
	b.release(10, "e", 10)
	b.release(35, "b", 35) // 45 used: large c fits under 75
	assert.Equal(t, "large c", <-got)

	// Client a holds 40 of its 50: a grant of 20 for a waits and holds back nobody.
	go func() { assert.NoError(t, b.acquire(context.Background(), small(20, "a"))); got <- "small a" }()
	waitFor(t, "the client-bound grant waits", func() bool { return waiting(b) == 1 })
	g = small(10, "f")
	assert.True(t, b.tryGrant(&g), "a waiter held back by its client holds back nobody")
	assert.True(t, b.TryAcquire(10), "nor the whole budget's grants")
	b.Release(10)
	err := b.grantWithin(context.Background(), small(20, "a"))
	assert.ErrorIs(t, err, errClientBudget)
	b.release(40, "a", 40)
	assert.Equal(t, "small a", <-got)
	b.release(20, "a", 20)
	b.release(5, "c", 5)
	b.release(5, "d", 5)
	b.release(10, "f", 10)
	assert.Empty(t, b.clients)
	assert.Zero(t, b.used)
	require.True(t, b.TryAcquire(1))
	assert.Panics(t, func() { b.release(1, "a", 1) }, "more than a client held")
}

// AcquireBody keeps the Handler's reserve: a body past 64 KiB cannot take the budget's last
// quarter, a small one can.
func TestAcquireBodyKeepsTheReserve(t *testing.T) {
	b := NewBudget(1 << 20)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := b.AcquireBody(ctx, 0, 700<<10, 1<<20); err != nil { // large: 700 KiB of 1 MiB
		t.Fatal(err)
	}
	if err := b.AcquireBody(ctx, 700<<10, 100<<10, 256<<10); err == nil { // 800 KiB > 768 KiB
		t.Fatal("a large body took the reserve")
	}
	if err := b.AcquireBody(context.Background(), 0, 32<<10, 256<<10); err != nil { // small: the reserve is its
		t.Fatalf("a small body was refused: %v", err)
	}
	b.Release(700<<10 + 32<<10)
	if !b.TryAcquire(1 << 20) {
		t.Error("the bytes were not all given back")
	}
}
