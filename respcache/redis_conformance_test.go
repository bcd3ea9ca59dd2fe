package respcache_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/cachetest"
)

// newTestRedis returns a RedisStore on REDIS_ADDR under a fresh key prefix; cleanup clears the
// prefix and closes the store.
func newTestRedis(t testing.TB, cfg respcache.RedisConfig) *respcache.RedisStore {
	t.Helper()
	if cfg.URL == "" {
		cfg.URL = "redis://" + redisAddr(t)
	}
	if cfg.KeyPrefix == "" {
		cfg.KeyPrefix = uniquePrefix("conf")
	}
	s, err := respcache.NewRedis(cfg)
	if err != nil {
		t.Fatalf("NewRedis(%v) = %v", cfg, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, err := s.Clear(ctx); err != nil {
			t.Errorf("cleanup Clear: %v", err)
		}
		_ = s.Close()
	})
	return s
}

// TestRedisConformance runs the CacheStore suite against a real Redis (REDIS_ADDR), with and
// without client-side caching, and against a store whose Redis is down (all in fallback).
func TestRedisConformance(t *testing.T) {
	t.Run("redis", func(t *testing.T) {
		redisAddr(t)
		cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
			s := newTestRedis(t, respcache.RedisConfig{})
			if s.FallbackActive() {
				t.Fatal("fallback active against a live Redis")
			}
			return s
		}, cachetest.Options{RealTimeTTL: true})
	})
	t.Run("client_side_caching", func(t *testing.T) {
		redisAddr(t)
		cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
			return newTestRedis(t, respcache.RedisConfig{ClientSideCaching: true})
		}, cachetest.Options{RealTimeTTL: true})
	})
	t.Run("fallback_only", func(t *testing.T) {
		// Nothing listens on the port: the store starts in fallback and stays there.
		cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
			s, err := respcache.NewRedis(respcache.RedisConfig{
				URL:            "redis://127.0.0.1:" + itoa(freePort(t)),
				ConnectTimeout: 200 * time.Millisecond,
				HealthInterval: time.Hour,
			})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = s.Close() })
			if !s.FallbackActive() {
				t.Fatal("FallbackActive() = false with Redis down")
			}
			return s
		}, cachetest.Options{RealTimeTTL: true})
	})
}
