// Package storetest holds the test support that the tests of respcache and of its stores
// (redisstore, s3store) share: constructors that fail the test, a Set/Get load that fault tests
// run while they break a server, and a check that a closed store leaves no goroutine behind.
// Servers and the environment are package internal/testenv's.
//
//	l := storetest.StartLoad(store, 4)
//	srv.Kill() // the test's fault
//	...
//	calls, failures, firstErr := l.Stop()
//	require.Zerof(t, failures, "%d of %d calls failed; first: %v", failures, calls, firstErr)
package storetest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvroute/kvroute/respcache"
)

// MustTiered returns respcache.NewTiered(cfg), or fails t.
func MustTiered(t testing.TB, cfg respcache.TieredConfig) *respcache.TieredStore {
	t.Helper()
	s, err := respcache.NewTiered(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// MustMemory returns respcache.NewMemory(cfg), or fails t.
func MustMemory(t testing.TB, cfg respcache.MemoryConfig) *respcache.MemoryStore {
	t.Helper()
	m, err := respcache.NewMemory(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// ClearAndClose clears s and closes it when t ends, the Clear within timeout; a failed Clear is
// reported with t.Errorf.
func ClearAndClose(t testing.TB, s interface {
	respcache.CacheStore
	io.Closer
}, timeout time.Duration) {
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		if _, err := s.Clear(ctx); err != nil {
			t.Errorf("cleanup Clear: %v", err)
		}
		_ = s.Close()
	})
}

// RequireClosed fails t unless Get, Set, Delete and Clear of s, a closed store, all return
// respcache.ErrClosed.
func RequireClosed(t testing.TB, s respcache.CacheStore) {
	t.Helper()
	ctx := context.Background()
	if _, _, err := s.Get(ctx, "k"); !errors.Is(err, respcache.ErrClosed) {
		t.Fatalf("Get after Close: %v, want respcache.ErrClosed", err)
	}
	if err := s.Set(ctx, "k", nil, 0); !errors.Is(err, respcache.ErrClosed) {
		t.Fatalf("Set after Close: %v, want respcache.ErrClosed", err)
	}
	if err := s.Delete(ctx, "k"); !errors.Is(err, respcache.ErrClosed) {
		t.Fatalf("Delete after Close: %v, want respcache.ErrClosed", err)
	}
	if _, err := s.Clear(ctx); !errors.Is(err, respcache.ErrClosed) {
		t.Fatalf("Clear after Close: %v, want respcache.ErrClosed", err)
	}
}

// Load runs Set/Get loops from several goroutines until Stop, counting calls and errors. Its
// methods are safe for concurrent use.
type Load struct {
	calls, failures atomic.Int64
	firstErr        atomic.Value // error
	stop            chan struct{}
	wg              sync.WaitGroup
}

// StartLoad starts goroutines loops on s, each alternating a Set and a Get of one of 50 keys of
// its own, with a millisecond's pause between calls.
func StartLoad(s respcache.CacheStore, goroutines int) *Load {
	l := &Load{stop: make(chan struct{})}
	for g := range goroutines {
		l.wg.Go(func() {
			ctx := context.Background()
			for i := 0; ; i++ {
				select {
				case <-l.stop:
					return
				default:
				}
				k := fmt.Sprintf("load-%d-%d", g, i%50)
				var err error
				if i%2 == 0 {
					err = s.Set(ctx, k, []byte("value "+k), time.Minute)
				} else {
					_, _, err = s.Get(ctx, k)
				}
				l.calls.Add(1)
				if err != nil {
					l.failures.Add(1)
					l.firstErr.CompareAndSwap(nil, err)
				}
				time.Sleep(time.Millisecond) // 2 cores shared: a steady trickle, not a flood
			}
		})
	}
	return l
}

// Calls returns how many calls the loops have made so far.
func (l *Load) Calls() int64 { return l.calls.Load() }

// Stop ends the loops, waits for them and returns (calls, failures, first error). Call it once.
func (l *Load) Stop() (int64, int64, error) {
	close(l.stop)
	l.wg.Wait()
	err, _ := l.firstErr.Load().(error)
	return l.calls.Load(), l.failures.Load(), err
}

// BenchSizes are the value sizes the stores' benchmarks run over: 1 KiB and 16 KiB.
func BenchSizes() []int { return []int{1 << 10, 16 << 10} }

// SizeName names a sub-benchmark of value size n bytes: "size=16KiB".
func SizeName(n int) string { return "size=" + strconv.Itoa(n>>10) + "KiB" }

// BenchGetHits sets key "k" to size bytes in set, then measures a Get of "k" from get (set
// itself, or a store in front of it) per b.Loop; a miss or an error fails b.
func BenchGetHits(b *testing.B, set, get respcache.CacheStore, size int) {
	b.Helper()
	ctx := context.Background()
	if err := set.Set(ctx, "k", make([]byte, size), time.Hour); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(size))
	b.ReportAllocs()
	for b.Loop() {
		if _, ok, err := get.Get(ctx, "k"); err != nil || !ok {
			b.Fatalf("Get = %v, %v", ok, err)
		}
	}
}

// Goroutines returns the stacks of the live goroutines that contain any of markers ("redis/rueidis",
// "redisstore.(*Store)": a store's and its client's), ignoring unrelated ones.
func Goroutines(markers ...string) []string {
	buf := make([]byte, 4<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		for _, marker := range markers {
			if strings.Contains(g, marker) {
				out = append(out, g)
				break
			}
		}
	}
	return out
}

// RequireNoGoroutines fails t when the goroutines Goroutines(markers...) finds outlive a Close by
// more than a few seconds; before is what Goroutines(markers...) returned before the store was
// made.
func RequireNoGoroutines(t testing.TB, before []string, markers ...string) {
	t.Helper()
	var left []string
	for deadline := time.Now().Add(3 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if left = Goroutines(markers...); len(left) <= len(before) {
			return
		}
		if time.Now().After(deadline) {
			break
		}
	}
	t.Fatalf("%d store goroutines left after Close (%d before):\n%s", len(left), len(before), strings.Join(left, "\n\n"))
}
