package redisstore

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/redis/rueidis"

	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/internal/storeutil"
)

// TestClientOptions checks how Config maps onto rueidis options.
func TestClientOptions(t *testing.T) {
	build := func(t *testing.T, cfg Config) (Config, redisOpts) {
		t.Helper()
		if err := normalise(&cfg); err != nil {
			t.Fatal(err)
		}
		applyClientDefaults(&cfg)
		opt, err := clientOptions(cfg)
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
		cfg  Config
		want redisOpts
	}{
		{"defaults", Config{}, redisOpts{addr: "127.0.0.1:6379", pool: DefaultPoolSize,
			dial: DefaultConnectTimeout, noRetry: true, noCache: true}},
		{"rediss", Config{URL: "rediss://u:p@cache.example:6380/2"}, redisOpts{addr: "cache.example:6380", tls: true,
			serverName: "cache.example", user: "u", pass: "p", db: 2, pool: DefaultPoolSize,
			dial: DefaultConnectTimeout, noRetry: true, noCache: true}},
		{"tls_flag", Config{URL: "redis://cache.example:6379", TLS: true}, redisOpts{addr: "cache.example:6379", tls: true,
			serverName: "cache.example", pool: DefaultPoolSize, dial: DefaultConnectTimeout, noRetry: true, noCache: true}},
		{"tls_config", Config{URL: "redis://h:1", TLSConfig: &tls.Config{ServerName: "custom"}}, redisOpts{addr: "h:1", tls: true,
			serverName: "custom", pool: DefaultPoolSize, dial: DefaultConnectTimeout, noRetry: true, noCache: true}},
		{"credentials_override", Config{URL: "redis://u:p@h:1", Username: "u2", Password: "p2", PoolSize: 16,
			ConnectTimeout: time.Second}, redisOpts{addr: "h:1", user: "u2", pass: "p2", pool: 16, dial: time.Second,
			noRetry: true, noCache: true}},
		{"client_side_caching", Config{URL: "redis://h:1", ClientSideCaching: true}, redisOpts{addr: "h:1",
			pool: DefaultPoolSize, dial: DefaultConnectTimeout, noRetry: true, multiplex: -1,
			cacheBytes: DefaultClientCacheBytes}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, got := build(t, tc.cfg)
			if got != tc.want {
				t.Errorf("options = %+v, want %+v", got, tc.want)
			}
			if cfg.KeyPrefix != DefaultKeyPrefix || cfg.FallbackCapacity != DefaultFallbackCapacity ||
				cfg.FallbackTTL != DefaultFallbackTTL || cfg.HealthInterval != DefaultHealthInterval ||
				cfg.CommandTimeout != DefaultCommandTimeout || cfg.DefaultTTL != respcache.DefaultTTL {
				t.Errorf("defaults not applied: %v", cfg)
			}
		})
	}
	if opt, err := clientOptions(Config{URL: "unix:///tmp/redis.sock?db=3"}); err != nil ||
		opt.InitAddress[0] != "/tmp/redis.sock" || opt.SelectDB != 3 {
		t.Errorf("unix URL: %v, %v", opt.InitAddress, err)
	}
	if _, err := clientOptions(Config{URL: "memcached://h:1"}); !errors.Is(err, respcache.ErrInvalidConfig) {
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

// redisErr returns the *rueidis.RedisError of the server reply "-msg" (built through
// CacheUnmarshalView, the one public way to make a RedisMessage without a server).
func redisErr(t *testing.T, msg string) error {
	t.Helper()
	buf := make([]byte, 7, 7+9+len(msg)) // 7 bytes of cache TTL, then type, length, string
	buf = append(buf, '-')
	buf = binary.BigEndian.AppendUint64(buf, uint64(len(msg)))
	buf = append(buf, msg...)
	var m rueidis.RedisMessage
	if err := m.CacheUnmarshalView(buf); err != nil {
		t.Fatal(err)
	}
	err := m.Error()
	if _, ok := rueidis.IsRedisErr(err); !ok {
		t.Fatalf("redisErr(%q) = %v: not a RedisError (rueidis' cache format changed?)", msg, err)
	}
	return err
}

// TestErrorType checks rueidis' errors on top of respcache.ErrorTypeOf: "not ready" replies and a
// closing client are outages, other replies are not, also when wrapped or redacted.
func TestErrorType(t *testing.T) {
	loading := redisErr(t, "LOADING Redis is loading the dataset in memory")
	for _, tc := range []struct {
		name string
		err  error
		want string
	}{
		{"canceled", fmt.Errorf("x: %w", context.Canceled), ""},
		{"deadline", context.DeadlineExceeded, respcache.ErrorTypeTimeout},
		{"eof", io.EOF, respcache.ErrorTypeConnection},
		{"rueidis_closing", rueidis.ErrClosing, respcache.ErrorTypeConnection},
		{"loading", loading, respcache.ErrorTypeConnection},
		{"loading_redacted", storeutil.Redact(loading, storeutil.Secrets("pw")), respcache.ErrorTypeConnection},
		{"masterdown", redisErr(t, "MASTERDOWN Link with MASTER is down"), respcache.ErrorTypeConnection},
		{"busy", redisErr(t, "BUSY Redis is busy running a script"), respcache.ErrorTypeConnection},
		{"busykey", redisErr(t, "BUSYKEY Target key name already exists"), respcache.ErrorTypeOther},
		{"wrongtype", fmt.Errorf("get: %w", redisErr(t, "WRONGTYPE Operation against a key holding the wrong kind of value")), respcache.ErrorTypeOther},
		{"noauth", redisErr(t, "NOAUTH Authentication required"), respcache.ErrorTypeOther},
		{"other", errors.New("boom"), respcache.ErrorTypeOther},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := errorType(tc.err); got != tc.want {
				t.Errorf("errorType(%v) = %q, want %q", tc.err, got, tc.want)
			}
		})
	}
}
