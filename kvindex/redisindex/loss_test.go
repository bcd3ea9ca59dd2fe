package redisindex

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/kvindex"
)

// TestLossDetected: Redis loses the index (restarted empty, or flushed) while this process
// caches the backends' ids and registry. Whichever call comes first afterwards — a Lookup, a
// Speculate, another backend's Apply, or nothing at all (BackendLost's own check) — every
// backend this process wrote for is reported lost, including one that only ever speculated;
// Apply refuses a lost backend's batches until ClearBackend, after which it is learnt again.
func TestLossDetected(t *testing.T) {
	type first struct {
		name string
		do   func(ctx context.Context, idx *Index, keys []uint64) error
	}
	firsts := []first{
		{"lookup", func(ctx context.Context, idx *Index, keys []uint64) error {
			_, err := idx.Lookup(ctx, keys, []string{"a", "b"}, make([]kvindex.Match, 2))
			return err
		}},
		{"speculate", func(ctx context.Context, idx *Index, keys []uint64) error {
			return idx.Speculate(ctx, "spec", keys, 0)
		}},
		{"apply of a new backend", func(ctx context.Context, idx *Index, keys []uint64) error {
			err := idx.Apply(ctx, "new", redisBatch(redisStored([]uint64{9}, 0, false, redisTokens(99, 16), 16, events.TierGPU)))
			if errors.Is(err, kvindex.ErrBackendLost) {
				// An earlier attempt failed on a connection that had not noticed the restart
				// yet, and may have landed: "new" is lost too, and cleared, as a consumer would.
				_ = idx.ClearBackend(ctx, "new")
			}
			return err
		}},
		{"nothing", nil},
	}
	for _, how := range []string{"restart", "flush"} {
		for _, f := range firsts {
			t.Run(how+"/"+f.name, func(t *testing.T) {
				t.Parallel() // its own Redis server and index
				rc := testenv.StartRedisServer(t)
				idx, err := New(Config{Addr: rc.Addr(), CommandTimeout: 2 * time.Second, UnavailableBackoff: 10 * time.Millisecond})
				if err != nil {
					t.Fatal(err)
				}
				defer idx.Close()
				ctx := context.Background()
				tokA, tokB := redisTokens(1, 32), redisTokens(2, 32)
				keysA, keysB := redisReqKeys(tokA, 16), redisReqKeys(tokB, 16)
				evA := redisStored([]uint64{1, 2}, 0, false, tokA, 16, events.TierGPU)
				evB := redisStored([]uint64{3, 4}, 0, false, tokB, 16, events.TierGPU)
				redisApply(t, idx, "a", evA)
				redisApply(t, idx, "b", evB)
				if err := idx.Speculate(ctx, "spec", keysA, time.Minute); err != nil {
					t.Fatal(err)
				}
				if out := redisLookup(t, idx, keysA, "a", "b", "spec"); out[0].Blocks != 2 || out[2].Blocks != 2 {
					t.Fatalf("before the loss: %+v", out)
				}
				for _, b := range []string{"a", "b", "spec"} {
					if lost, err := idx.BackendLost(ctx, b); lost || err != nil {
						t.Fatalf("BackendLost(%s) before the loss: %v %v", b, lost, err)
					}
				}

				if how == "restart" {
					rc.Kill()
					rc.Start()
				} else if r := rc.Command("FLUSHALL"); r != "+OK" {
					t.Fatalf("FLUSHALL: %q", r)
				}
				if f.do != nil { // the first call after the loss (the connection may need a retry)
					waitUntil(t, 10*time.Second, "the first call to succeed", func() bool { return f.do(ctx, idx, keysA) == nil })
				}
				// Every backend is lost, at once after a call that read the epoch, or within
				// DefaultLossCheckInterval when nothing else talks to Redis.
				for _, b := range []string{"a", "b", "spec"} {
					waitUntil(t, 3*DefaultLossCheckInterval, b+" reported lost", func() bool {
						lost, _ := idx.BackendLost(ctx, b)
						return lost
					})
				}
				if lost, err := idx.BackendLost(ctx, "never-seen"); lost || err != nil {
					t.Errorf("BackendLost of a backend never written for: %v %v", lost, err)
				}
				// a's next batch is refused: the index would build on a hole.
				if err := idx.Apply(ctx, "a", redisBatch(evA)); !errors.Is(err, kvindex.ErrBackendLost) {
					t.Fatalf("Apply(a) after the loss: %v, want kvindex.ErrBackendLost", err)
				}
				if err := idx.Apply(ctx, "a", redisBatch(evA)); !errors.Is(err, kvindex.ErrBackendLost) {
					t.Fatalf("second Apply(a) after the loss: %v, want kvindex.ErrBackendLost until ClearBackend", err)
				}
				// The consumer's answer: clear, then replay what the engine holds.
				for _, b := range []string{"a", "b", "spec"} {
					// (a connection of the client's pool may still have to notice the restart)
					waitUntil(t, 10*time.Second, "ClearBackend("+b+")", func() bool { return idx.ClearBackend(ctx, b) == nil })
					if lost, err := idx.BackendLost(ctx, b); lost || err != nil {
						t.Fatalf("BackendLost(%s) after ClearBackend: %v %v", b, lost, err)
					}
				}
				redisApply(t, idx, "a", evA)
				redisApply(t, idx, "b", evB)
				if out := redisLookup(t, idx, keysA, "a", "b"); out[0].Blocks != 2 || out[1].Blocks != 0 {
					t.Fatalf("a after healing: %+v", out)
				}
				if out := redisLookup(t, idx, keysB, "a", "b"); out[1].Blocks != 2 {
					t.Fatalf("b after healing: %+v", out)
				}
			})
		}
	}
}

// TestLossSeenByReplica: after a restart, another replica writes first (recreating the
// epoch); this process's next Lookup sees an epoch it does not know and reports its backends lost.
func TestLossSeenByReplica(t *testing.T) {
	rc := testenv.StartRedisServer(t)
	ctx := context.Background()
	open := func() *Index {
		idx, err := New(Config{Addr: rc.Addr(), CommandTimeout: 2 * time.Second, UnavailableBackoff: 10 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { idx.Close() })
		return idx
	}
	a, b := open(), open()
	tok := redisTokens(3, 32)
	keys := redisReqKeys(tok, 16)
	ev := redisStored([]uint64{1, 2}, 0, false, tok, 16, events.TierGPU)
	redisApply(t, a, "x", ev)
	redisApply(t, b, "y", ev)
	if out := redisLookup(t, b, keys, "x", "y"); out[0].Blocks != 2 || out[1].Blocks != 2 {
		t.Fatalf("shared before the restart: %+v", out)
	}
	rc.Kill()
	rc.Start()
	waitUntil(t, 10*time.Second, "replica b to write", func() bool {
		// A backend new to b. (A write that failed on a connection that had not noticed the
		// restart yet may have landed: z is then lost too, and cleared, as a consumer would.)
		err := b.Apply(ctx, "z", redisBatch(ev))
		if errors.Is(err, kvindex.ErrBackendLost) {
			_ = b.ClearBackend(ctx, "z")
		}
		return err == nil
	})
	waitUntil(t, 10*time.Second, "a's Lookup", func() bool {
		_, err := a.Lookup(ctx, keys, []string{"x"}, make([]kvindex.Match, 1))
		return err == nil
	})
	if lost, err := a.BackendLost(ctx, "x"); !lost || err != nil {
		t.Fatalf("a: BackendLost(x) = %v %v after the restart another replica noticed first", lost, err)
	}
	if lost, _ := b.BackendLost(ctx, "y"); !lost {
		t.Error("b: y not lost: b's write after the restart had to recreate the epoch")
	}
	if lost, _ := b.BackendLost(ctx, "z"); lost {
		t.Error("b: z lost, though b first wrote it after the restart")
	}
}

// TestNoFalseLoss: replicas that start together on a fresh Redis, the index's Clear and the
// ordinary traffic never report a backend lost.
func TestNoFalseLoss(t *testing.T) {
	rc := testenv.StartRedisServer(t)
	ctx := context.Background()
	var idxs []*Index
	for range 2 {
		idx, err := New(Config{Addr: rc.Addr(), CommandTimeout: 2 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer idx.Close()
		idxs = append(idxs, idx)
	}
	tok := redisTokens(4, 32)
	keys := redisReqKeys(tok, 16)
	// The second replica reads first (no epoch yet), then both write concurrently.
	redisLookup(t, idxs[1], keys, "a")
	var wg sync.WaitGroup
	for i, idx := range idxs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range 20 {
				_ = idx.Apply(ctx, fmt.Sprint("b", i), redisBatch(redisStored([]uint64{uint64(j + 1)}, uint64(j), j > 0, tok[:16], 16, events.TierGPU)))
				_ = idx.Speculate(ctx, fmt.Sprint("s", i), keys, 0)
			}
		}()
	}
	wg.Wait()
	if _, err := idxs[0].Clear(ctx); err != nil {
		t.Fatal(err)
	}
	redisApply(t, idxs[1], "b1", redisStored([]uint64{100}, 0, false, tok[:16], 16, events.TierGPU))
	time.Sleep(DefaultLossCheckInterval + 100*time.Millisecond) // BackendLost reads the epoch itself
	for i, idx := range idxs {
		for _, b := range []string{"b0", "b1", "s0", "s1"} {
			if lost, err := idx.BackendLost(ctx, b); lost || err != nil {
				t.Errorf("replica %d: BackendLost(%s) = %v %v without a loss", i, b, lost, err)
			}
		}
	}
}

// waitUntil polls cond every 20 ms until it holds or timeout passes.
func waitUntil(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(timeout); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
	}
}
