package cachetest_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/cachetest"
)

// broken wraps a correct store and breaks the rule its mode names. It is not safe for concurrent
// use in the modes that remember slices (the child runs the suite with one goroutine).
type broken struct {
	*respcache.MemoryStore
	mode string
	last map[string][]byte
}

func (b *broken) Set(ctx context.Context, k string, v []byte, ttl time.Duration) error {
	switch b.mode {
	case "retain_set":
		b.last[k] = v
	case "no_ttl":
		ttl = 1000 * time.Hour
	}
	return b.MemoryStore.Set(ctx, k, v, ttl)
}

func (b *broken) Get(ctx context.Context, k string) ([]byte, bool, error) {
	switch b.mode {
	case "retain_set":
		if v, ok := b.last[k]; ok {
			if _, ok, _ := b.MemoryStore.Get(ctx, k); ok {
				return v, true, nil
			}
		}
	case "shared_get":
		if v, ok := b.last[k]; ok {
			if _, ok, _ := b.MemoryStore.Get(ctx, k); ok {
				return v, true, nil
			}
		}
		v, ok, err := b.MemoryStore.Get(ctx, k)
		if ok {
			b.last[k] = v
		}
		return v, ok, err
	case "ctx_err":
		if ctx.Err() != nil {
			return nil, false, context.DeadlineExceeded
		}
	case "empty_nil_miss":
		v, ok, err := b.MemoryStore.Get(ctx, k)
		if ok && len(v) == 0 {
			return nil, false, nil
		}
		return v, ok, err
	}
	return b.MemoryStore.Get(ctx, k)
}

func (b *broken) Clear(ctx context.Context) (int, error) {
	n, err := b.MemoryStore.Clear(ctx)
	if b.mode == "clear_count" {
		n++
	}
	return n, err
}

func (b *broken) Stats(ctx context.Context) respcache.StoreStats {
	st := b.MemoryStore.Stats(ctx)
	switch b.mode {
	case "no_backend":
		st.Backend = ""
	case "stats_entries":
		st.Entries++
	}
	return st
}

func (b *broken) Delete(ctx context.Context, k string) error {
	if b.mode == "delete_noop" {
		return nil
	}
	return b.MemoryStore.Delete(ctx, k)
}

// brokenModes are the mutants of a correct store the suite must reject, each breaking one rule.
var brokenModes = []string{
	"retain_set",     // keeps the caller's Set slice
	"shared_get",     // hands out the same slice twice
	"no_ttl",         // ignores the TTL
	"ctx_err",        // fails a cancelled Get with an error that is not context.Canceled
	"empty_nil_miss", // treats an empty value as a miss
	"clear_count",    // miscounts Clear
	"no_backend",     // leaves Stats.Backend empty
	"stats_entries",  // miscounts Stats.Entries
	"delete_noop",    // does not delete
}

// TestSuiteRejectsBrokenStores runs the suite against each mutant in a child process (the suite
// reports through a real *testing.T, so a failure must fail something) and requires it to fail.
func TestSuiteRejectsBrokenStores(t *testing.T) {
	if mode := os.Getenv("CACHETEST_BROKEN_MODE"); mode != "" {
		t.Skip("child process")
	}
	for _, mode := range brokenModes {
		t.Run(mode, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestBrokenChild$", "-test.count=1")
			cmd.Env = append(os.Environ(), "CACHETEST_BROKEN_MODE="+mode)
			out, err := cmd.CombinedOutput()
			var exit *exec.ExitError
			if !errors.As(err, &exit) {
				t.Fatalf("the suite accepted a store that breaks %q (err %v):\n%s", mode, err, out)
			}
			if !strings.Contains(string(out), "--- FAIL: TestBrokenChild/") {
				t.Fatalf("child failed without a subtest failure:\n%s", out)
			}
		})
	}
}

// TestBrokenChild runs the suite against the mutant named by CACHETEST_BROKEN_MODE, in the child
// process of TestSuiteRejectsBrokenStores; without it, against the correct store.
func TestBrokenChild(t *testing.T) {
	mode := os.Getenv("CACHETEST_BROKEN_MODE")
	clk := cachetest.NewClock(time.Time{})
	cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
		m, err := respcache.NewMemory(respcache.MemoryConfig{Now: clk.Now})
		if err != nil {
			t.Fatal(err)
		}
		return &broken{MemoryStore: m, mode: mode, last: map[string][]byte{}}
	}, cachetest.Options{Advance: clk.Advance, Goroutines: 1, DefaultTTL: respcache.DefaultTTL})
}
