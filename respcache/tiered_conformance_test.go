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

// TestTieredConformance runs the CacheStore suite against tiered stores: memory over memory (no
// server needed), memory over S3, and Redis over S3.
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
	t.Run("memory_over_s3", func(t *testing.T) {
		base := s3TestConfig(t)
		clk := cachetest.NewClock(time.Time{})
		cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
			cfg := base
			cfg.KeyPrefix = s3TestConfig(t).KeyPrefix
			cfg.Now = clk.Now
			return mustTiered(t, respcache.TieredConfig{
				L1: mustMemory(t, respcache.MemoryConfig{Now: clk.Now}),
				L2: newTestS3(t, cfg),
			})
		}, cachetest.Options{Advance: clk.Advance, DefaultTTL: respcache.DefaultTTL})
	})
	t.Run("redis_over_s3", func(t *testing.T) {
		base := s3TestConfig(t)
		redisAddr(t)
		cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
			cfg := base
			cfg.KeyPrefix = s3TestConfig(t).KeyPrefix
			return mustTiered(t, respcache.TieredConfig{
				L1: newTestRedis(t, respcache.RedisConfig{}),
				L2: newTestS3(t, cfg),
			})
		}, cachetest.Options{RealTimeTTL: true})
	})
}
