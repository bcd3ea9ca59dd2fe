package respcache_test

import (
	"testing"
	"time"

	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/cachetest"
)

func mustTiered(t testing.TB, cfg respcache.TieredConfig) *respcache.TieredStore {
	t.Helper()
	s, err := respcache.NewTiered(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func mustMemory(t testing.TB, cfg respcache.MemoryConfig) *respcache.MemoryStore {
	t.Helper()
	m, err := respcache.NewMemory(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestTieredConformance runs the CacheStore suite against a tiered store of memory over memory
// (no server needed); package s3store runs it over S3, with a memory or a Redis L1.
func TestTieredConformance(t *testing.T) {
	t.Run("memory_over_memory", func(t *testing.T) {
		clk := cachetest.NewClock(time.Time{})
		cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
			return mustTiered(t, respcache.TieredConfig{
				L1: mustMemory(t, respcache.MemoryConfig{Capacity: 100, Now: clk.Now}),
				L2: mustMemory(t, respcache.MemoryConfig{Capacity: 10000, Now: clk.Now}),
			})
		}, cachetest.Options{Advance: clk.Advance, DefaultTTL: respcache.DefaultTTL})
	})
}
