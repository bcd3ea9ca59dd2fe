package redisindex_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/rueidis"

	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/kvindex/indextest"
	"github.com/kvroute/kvroute/kvindex/redisindex"
)

// dumpClient returns a client of REDIS_ADDR, or skips (fails with KVROUTE_REQUIRE_INTEGRATION=1).
func dumpClient(t *testing.T) rueidis.Client {
	t.Helper()
	addr := testenv.RedisAddr(t)
	client, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{addr}, DisableCache: true})
	if err != nil {
		t.Fatalf("connect to %s: %v", addr, err)
	}
	t.Cleanup(client.Close)
	return client
}

// dumpPrefix returns a fresh key prefix, whose keys are deleted when t ends.
func dumpPrefix(t *testing.T, client rueidis.Client) string {
	prefix := "kvroute:test:" + testenv.RandHex() + ":"
	t.Cleanup(func() { redisConformanceCleanup(t, client, prefix) })
	return prefix
}

// TestDumpConformance runs the Dumper suite of kvindex/indextest against Index on REDIS_ADDR.
func TestDumpConformance(t *testing.T) {
	client := dumpClient(t)
	indextest.RunDump(t, func(t *testing.T, opts indextest.Options) kvindex.KvCacheIndex {
		ix, err := redisindex.NewWithClient(client, redisindex.Config{
			KeyPrefix:              dumpPrefix(t, client),
			BlockSize:              opts.BlockSize,
			DefaultModel:           opts.DefaultModel,
			StorageOffloading:      opts.StorageOffloading,
			TreatEvictionAsOffload: opts.TreatEvictionAsOffload,
			EntryTTL:               opts.EntryTTL,
			SpeculativeTTL:         opts.SpeculativeTTL,
			TierWeights:            opts.TierWeights,
			Now:                    opts.Now,
			CommandTimeout:         5 * time.Second,
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ix.Close() })
		return ix
	})
}

// A dump pages through a large membership set (several ZSCAN pages), lists each block once and
// stops at its limit.
func TestDumpPages(t *testing.T) {
	client := dumpClient(t)
	ix, err := redisindex.NewWithClient(client, redisindex.Config{KeyPrefix: dumpPrefix(t, client), CommandTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close()
	ctx := context.Background()
	keys := make([]uint64, 2000)
	for i := range keys {
		keys[i] = uint64(i)*0x9e3779b97f4a7c15 + 1
	}
	if err := ix.Speculate(ctx, "a", keys, time.Minute); err != nil {
		t.Fatal(err)
	}
	seen := map[uint64]bool{}
	err = ix.Dump(ctx, "a", 100_000, func(e kvindex.DumpEntry) error {
		if seen[e.Key] || !e.Speculative {
			t.Errorf("entry %+v repeated or not speculative", e)
		}
		seen[e.Key] = true
		return nil
	})
	if err != nil || len(seen) != len(keys) {
		t.Fatalf("Dump: %v, %d blocks, want %d", err, len(seen), len(keys))
	}
	n := 0
	if err := ix.Dump(ctx, "a", 777, func(kvindex.DumpEntry) error { n++; return nil }); err != nil || n != 777 {
		t.Fatalf("limit 777: %d entries, %v", n, err)
	}
	if err := ix.Close(); err != nil {
		t.Fatal(err)
	}
	if err := ix.Dump(ctx, "a", 1, func(kvindex.DumpEntry) error { return nil }); !errors.Is(err, kvindex.ErrClosed) {
		t.Fatalf("after Close: %v, want ErrClosed", err)
	}
}
