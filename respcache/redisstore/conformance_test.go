package redisstore_test

import (
	"strconv"
	"testing"
	"time"

	"github.com/redis/rueidis"

	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/cachetest"
	"github.com/kvroute/kvroute/respcache/internal/storetest"
	"github.com/kvroute/kvroute/respcache/redisstore"
)

// newTestRedis returns a Store on REDIS_ADDR under a fresh key prefix; cleanup clears the prefix
// and closes the store.
func newTestRedis(t testing.TB, cfg redisstore.Config) *redisstore.Store {
	t.Helper()
	if cfg.URL == "" {
		cfg.URL = "redis://" + testenv.RedisAddr(t)
	}
	if cfg.KeyPrefix == "" {
		cfg.KeyPrefix = uniquePrefix("conf")
	}
	s, err := redisstore.New(cfg)
	if err != nil {
		t.Fatalf("New(%v) = %v", cfg, err)
	}
	cleanupStore(t, s)
	return s
}

// cleanupStore clears s's prefix and closes s at cleanup.
func cleanupStore(t testing.TB, s *redisstore.Store) { storetest.ClearAndClose(t, s, 5*time.Second) }

// sharedClient returns a caller's rueidis client on addr, as a gateway sharing one client between
// the response cache and the KV index makes it; closed at cleanup (after the stores on it).
func sharedClient(t testing.TB, addr string, clientSideCaching bool) rueidis.Client {
	t.Helper()
	opt := rueidis.ClientOption{InitAddress: []string{addr}, DisableCache: !clientSideCaching}
	if clientSideCaching {
		opt.PipelineMultiplex = -1 // one connection: the store reads its own writes (Config.ClientSideCaching)
	}
	c, err := rueidis.NewClient(opt)
	if err != nil {
		t.Fatalf("rueidis.NewClient(%s): %v", addr, err)
	}
	t.Cleanup(c.Close)
	return c
}

// TestConformance runs the CacheStore suite against a real Redis (REDIS_ADDR), with and without
// client-side caching, on the store's own client and on a caller's, and against a store whose
// Redis is down (all in fallback). The five run in parallel: each store has its own key prefix,
// and each waits out a real TTL.
func TestConformance(t *testing.T) {
	t.Run("redis", func(t *testing.T) {
		t.Parallel()
		testenv.RedisAddr(t)
		cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
			s := newTestRedis(t, redisstore.Config{})
			if s.FallbackActive() {
				t.Fatal("fallback active against a live Redis")
			}
			return s
		}, cachetest.Options{RealTimeTTL: true})
	})
	t.Run("client_side_caching", func(t *testing.T) {
		t.Parallel()
		testenv.RedisAddr(t)
		cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
			return newTestRedis(t, redisstore.Config{ClientSideCaching: true})
		}, cachetest.Options{RealTimeTTL: true})
	})
	for _, csc := range []bool{false, true} {
		name := "callers_client"
		if csc {
			name += "_client_side_caching"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			c := sharedClient(t, testenv.RedisAddr(t), csc)
			cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
				s, err := redisstore.NewWithClient(c, redisstore.Config{KeyPrefix: uniquePrefix("shared"), ClientSideCaching: csc})
				if err != nil {
					t.Fatal(err)
				}
				cleanupStore(t, s)
				return s
			}, cachetest.Options{RealTimeTTL: true})
		})
	}
	t.Run("fallback_only", func(t *testing.T) {
		t.Parallel()
		// Nothing listens on the port: the store starts in fallback and stays there.
		cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
			s, err := redisstore.New(redisstore.Config{
				URL:            "redis://127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)),
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
