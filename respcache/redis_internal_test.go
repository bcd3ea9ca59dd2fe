package respcache

import (
	"crypto/tls"
	"errors"
	"testing"
	"time"
)

// TestRedisOptions checks how RedisConfig maps onto rueidis options.
func TestRedisOptions(t *testing.T) {
	build := func(t *testing.T, cfg RedisConfig) (RedisConfig, redisOpts) {
		t.Helper()
		if err := normaliseRedis(&cfg); err != nil {
			t.Fatal(err)
		}
		opt, err := redisOptions(cfg)
		if err != nil {
			t.Fatal(err)
		}
		tlsOn := opt.TLSConfig != nil
		var sn string
		if tlsOn {
			sn = opt.TLSConfig.ServerName
		}
		return cfg, redisOpts{addr: opt.InitAddress[0], tls: tlsOn, serverName: sn, user: opt.Username, pass: opt.Password,
			db: opt.SelectDB, pool: opt.BlockingPoolSize, dial: opt.Dialer.Timeout, noRetry: opt.DisableRetry,
			noCache: opt.DisableCache, multiplex: opt.PipelineMultiplex, cacheBytes: opt.CacheSizeEachConn}
	}
	for _, tc := range []struct {
		name string
		cfg  RedisConfig
		want redisOpts
	}{
		{"defaults", RedisConfig{}, redisOpts{addr: "127.0.0.1:6379", pool: DefaultRedisPoolSize,
			dial: DefaultRedisConnectTimeout, noRetry: true, noCache: true}},
		{"rediss", RedisConfig{URL: "rediss://u:p@cache.example:6380/2"}, redisOpts{addr: "cache.example:6380", tls: true,
			serverName: "cache.example", user: "u", pass: "p", db: 2, pool: DefaultRedisPoolSize,
			dial: DefaultRedisConnectTimeout, noRetry: true, noCache: true}},
		{"tls_flag", RedisConfig{URL: "redis://cache.example:6379", TLS: true}, redisOpts{addr: "cache.example:6379", tls: true,
			serverName: "cache.example", pool: DefaultRedisPoolSize, dial: DefaultRedisConnectTimeout, noRetry: true, noCache: true}},
		{"tls_config", RedisConfig{URL: "redis://h:1", TLSConfig: &tls.Config{ServerName: "custom"}}, redisOpts{addr: "h:1", tls: true,
			serverName: "custom", pool: DefaultRedisPoolSize, dial: DefaultRedisConnectTimeout, noRetry: true, noCache: true}},
		{"credentials_override", RedisConfig{URL: "redis://u:p@h:1", Username: "u2", Password: "p2", PoolSize: 16,
			ConnectTimeout: time.Second}, redisOpts{addr: "h:1", user: "u2", pass: "p2", pool: 16, dial: time.Second,
			noRetry: true, noCache: true}},
		{"client_side_caching", RedisConfig{URL: "redis://h:1", ClientSideCaching: true}, redisOpts{addr: "h:1",
			pool: DefaultRedisPoolSize, dial: DefaultRedisConnectTimeout, noRetry: true, multiplex: -1,
			cacheBytes: DefaultClientCacheBytes}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, got := build(t, tc.cfg)
			if got != tc.want {
				t.Errorf("options = %+v, want %+v", got, tc.want)
			}
			if cfg.KeyPrefix != DefaultRedisKeyPrefix || cfg.FallbackCapacity != DefaultFallbackCapacity ||
				cfg.FallbackTTL != DefaultFallbackTTL || cfg.HealthInterval != DefaultRedisHealthInterval ||
				cfg.CommandTimeout != DefaultRedisCommandTimeout || cfg.DefaultTTL != DefaultTTL {
				t.Errorf("defaults not applied: %v", cfg)
			}
		})
	}
	if opt, err := redisOptions(RedisConfig{URL: "unix:///tmp/redis.sock?db=3"}); err != nil ||
		opt.InitAddress[0] != "/tmp/redis.sock" || opt.SelectDB != 3 {
		t.Errorf("unix URL: %v, %v", opt.InitAddress, err)
	}
	if _, err := redisOptions(RedisConfig{URL: "memcached://h:1"}); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("memcached URL: err = %v, want ErrInvalidConfig", err)
	}
}

type redisOpts struct {
	addr, serverName, user, pass string
	tls, noRetry, noCache        bool
	db, pool, multiplex          int
	cacheBytes                   int
	dial                         time.Duration
}
