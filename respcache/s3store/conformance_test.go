package s3store_test

import (
	"testing"
	"time"

	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/cachetest"
	"github.com/kvroute/kvroute/respcache/internal/storetest"
)

// TestConformance runs the CacheStore suite against a real S3-compatible server, with the expiry
// clock under the suite's control.
func TestConformance(t *testing.T) {
	base := s3TestConfig(t)
	clk := cachetest.NewClock(time.Time{})
	cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
		cfg := base
		cfg.KeyPrefix = s3TestConfig(t).KeyPrefix
		cfg.Now = clk.Now
		return newTestS3(t, cfg)
	}, cachetest.Options{Advance: clk.Advance, DefaultTTL: respcache.DefaultTTL})
}

// TestTieredConformance runs the CacheStore suite against tiered stores with an S3 L2: memory over
// S3, and Redis (REDIS_ADDR) over S3.
func TestTieredConformance(t *testing.T) {
	t.Run("memory_over_s3", func(t *testing.T) {
		base := s3TestConfig(t)
		clk := cachetest.NewClock(time.Time{})
		cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
			cfg := base
			cfg.KeyPrefix = s3TestConfig(t).KeyPrefix
			cfg.Now = clk.Now
			return storetest.MustTiered(t, respcache.TieredConfig{
				L1: storetest.MustMemory(t, respcache.MemoryConfig{Now: clk.Now}),
				L2: newTestS3(t, cfg),
			})
		}, cachetest.Options{Advance: clk.Advance, DefaultTTL: respcache.DefaultTTL})
	})
	t.Run("redis_over_s3", func(t *testing.T) {
		base := s3TestConfig(t)
		testenv.RedisAddr(t)
		cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
			cfg := base
			cfg.KeyPrefix = s3TestConfig(t).KeyPrefix
			return storetest.MustTiered(t, respcache.TieredConfig{
				L1: newTestRedis(t),
				L2: newTestS3(t, cfg),
			})
		}, cachetest.Options{RealTimeTTL: true})
	})
}
