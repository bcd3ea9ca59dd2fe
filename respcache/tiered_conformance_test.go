package respcache_test

import (
	"testing"
	"time"

	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/cachetest"
	"github.com/kvroute/kvroute/respcache/internal/storetest"
)

// TestTieredConformance runs the CacheStore suite against a tiered store of memory over memory
// (no server needed); package s3store runs it over S3, with a memory or a Redis L1.
func TestTieredConformance(t *testing.T) {
	t.Run("memory_over_memory", func(t *testing.T) {
		clk := cachetest.NewClock(time.Time{})
		cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
			return storetest.MustTiered(t, respcache.TieredConfig{
				L1: storetest.MustMemory(t, respcache.MemoryConfig{Capacity: 100, Now: clk.Now}),
				L2: storetest.MustMemory(t, respcache.MemoryConfig{Capacity: 10000, Now: clk.Now}),
			})
		}, cachetest.Options{Advance: clk.Advance, DefaultTTL: respcache.DefaultTTL})
	})
}
