package respcache_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/kvroute/kvroute/respcache"
)

func TestNewRedisValidation(t *testing.T) {
	down := "redis://127.0.0.1:" + strconv.Itoa(freePort(t))
	for _, tc := range []struct {
		name string
		cfg  respcache.RedisConfig
	}{
		{"glob_star", respcache.RedisConfig{URL: down, KeyPrefix: "cache:*:"}},
		{"glob_question", respcache.RedisConfig{URL: down, KeyPrefix: "cache?"}},
		{"glob_open_bracket", respcache.RedisConfig{URL: down, KeyPrefix: "cache[1"}},
		{"glob_close_bracket", respcache.RedisConfig{URL: down, KeyPrefix: "cache]"}},
		{"glob_backslash", respcache.RedisConfig{URL: down, KeyPrefix: `cache\`}},
		{"scheme", respcache.RedisConfig{URL: "http://127.0.0.1:6379"}},
		{"unparsable", respcache.RedisConfig{URL: "redis://user:pa ss@[::1"}},
		{"bad_db", respcache.RedisConfig{URL: "redis://127.0.0.1:6379/x"}},
		{"negative_pool", respcache.RedisConfig{URL: down, PoolSize: -1}},
		{"negative_command_timeout", respcache.RedisConfig{URL: down, CommandTimeout: -time.Second}},
		{"negative_fallback_ttl", respcache.RedisConfig{URL: down, FallbackTTL: -time.Second}},
		{"negative_health_interval", respcache.RedisConfig{URL: down, HealthInterval: -time.Second}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := respcache.NewRedis(tc.cfg)
			if s != nil {
				_ = s.Close()
			}
			require.ErrorIs(t, err, respcache.ErrInvalidConfig)
			require.NotContains(t, err.Error(), "pa ss")
		})
	}
}

const redisSecret = "hunter2-s3cr3t"

func TestRedisSecretsRedacted(t *testing.T) {
	cfg := respcache.RedisConfig{
		URL:      "redis://app:" + redisSecret + "@127.0.0.1:" + strconv.Itoa(freePort(t)) + "/0",
		Password: redisSecret + "-override", ConnectTimeout: 200 * time.Millisecond, HealthInterval: time.Hour,
	}
	var logBuf bytes.Buffer
	slog.New(slog.NewJSONHandler(&logBuf, nil)).Info("config", "redis", cfg)
	for _, out := range []string{cfg.String(), fmt.Sprint(cfg), fmt.Sprintf("%+v", cfg), fmt.Sprintf("%#v", cfg), logBuf.String()} {
		require.NotContains(t, out, redisSecret)
		require.Contains(t, out, "127.0.0.1")
	}
	s, err := respcache.NewRedis(cfg) // Redis down: fallback
	require.NoError(t, err)
	defer s.Close()
	require.NotContains(t, s.String(), redisSecret)
	require.NotContains(t, fmt.Sprintf("%v %+v %#v %s", s, s, s, s), redisSecret)

	// Errors do not echo the password either.
	cfg.URL = "redis://app:" + redisSecret + "@127.0.0.1:6379/notadb"
	_, err = respcache.NewRedis(cfg)
	require.Error(t, err)
	require.NotContains(t, err.Error(), redisSecret)
}

// TestRedisWrongPassword: a server that rejects the credentials is a configuration error, not an
// outage, and the password is not in the error.
func TestRedisWrongPassword(t *testing.T) {
	proc := startRedis(t, 0)
	c := directClient(t, proc.Addr())
	ctx := context.Background()
	require.NoError(t, c.Do(ctx, c.B().ConfigSet().ParameterValue().ParameterValue("requirepass", "right-one").Build()).Error())
	_, err := respcache.NewRedis(respcache.RedisConfig{URL: proc.URL(), Password: redisSecret})
	require.ErrorIs(t, err, respcache.ErrInvalidConfig)
	require.NotContains(t, err.Error(), redisSecret)

	s, err := respcache.NewRedis(respcache.RedisConfig{URL: proc.URL(), Password: "right-one", KeyPrefix: uniquePrefix("auth")})
	require.NoError(t, err)
	defer s.Close()
	require.NoError(t, s.Set(ctx, "k", []byte("v"), time.Minute))
	require.False(t, s.FallbackActive())
}

// TestRedisTTL checks the PX argument: the given ttl, DefaultTTL for ttl ≤ 0, and a sub-millisecond
// ttl rounded up rather than sent as 0 (which Redis rejects).
func TestRedisTTL(t *testing.T) {
	prefix := uniquePrefix("ttl")
	s := newTestRedis(t, respcache.RedisConfig{KeyPrefix: prefix, DefaultTTL: 42 * time.Second})
	c := directClient(t, redisAddr(t))
	ctx := context.Background()
	pttl := func(k string) time.Duration {
		ms, err := c.Do(ctx, c.B().Pttl().Key(prefix+k).Build()).AsInt64()
		require.NoError(t, err)
		return time.Duration(ms) * time.Millisecond
	}
	require.NoError(t, s.Set(ctx, "a", []byte("v"), 90*time.Second))
	require.InDelta(t, 90*time.Second, pttl("a"), float64(2*time.Second))
	require.NoError(t, s.Set(ctx, "b", []byte("v"), 0))
	require.InDelta(t, 42*time.Second, pttl("b"), float64(2*time.Second))
	require.NoError(t, s.Set(ctx, "c", []byte("v"), time.Microsecond))
}

// TestRedisClearOnlyItsPrefix: Clear removes the store's keys, not another prefix's.
func TestRedisClearOnlyItsPrefix(t *testing.T) {
	a := newTestRedis(t, respcache.RedisConfig{KeyPrefix: uniquePrefix("a")})
	b := newTestRedis(t, respcache.RedisConfig{KeyPrefix: uniquePrefix("b")})
	ctx := context.Background()
	for i := range 2500 { // more than one SCAN COUNT and UNLINK batch
		require.NoError(t, a.Set(ctx, strconv.Itoa(i), []byte("a"), time.Minute))
	}
	require.NoError(t, b.Set(ctx, "keep", []byte("b"), time.Minute))
	n, err := a.Clear(ctx)
	require.NoError(t, err)
	require.Equal(t, 2500, n)
	_, ok, err := a.Get(ctx, "1")
	require.NoError(t, err)
	require.False(t, ok)
	v, ok, err := b.Get(ctx, "keep")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, "b", string(v))
}

// TestRedisClientSideCachingServesLocally: with client-side caching, repeated Gets reach the server
// once, a write by another client is seen after its invalidation, and the store's own writes at
// once.
func TestRedisClientSideCachingServesLocally(t *testing.T) {
	proc := startRedis(t, 0)
	prefix := uniquePrefix("csc")
	s, err := respcache.NewRedis(respcache.RedisConfig{URL: proc.URL(), KeyPrefix: prefix, ClientSideCaching: true})
	require.NoError(t, err)
	defer s.Close()
	c := directClient(t, proc.Addr())
	ctx := context.Background()
	getCalls := func() int {
		info, err := c.Do(ctx, c.B().Info().Section("commandstats").Build()).ToString()
		require.NoError(t, err)
		for line := range strings.SplitSeq(info, "\r\n") {
			if rest, ok := strings.CutPrefix(line, "cmdstat_get:calls="); ok {
				n, _ := strconv.Atoi(rest[:strings.IndexByte(rest, ',')])
				return n
			}
		}
		return 0
	}
	require.NoError(t, s.Set(ctx, "k", []byte("v1"), time.Minute))
	for range 20 {
		v, ok, err := s.Get(ctx, "k")
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, "v1", string(v))
		v[0] = 'X' // the caller owns the slice: must not corrupt the local cache
	}
	require.Equal(t, 1, getCalls(), "20 Gets should reach the server once")

	require.NoError(t, c.Do(ctx, c.B().Set().Key(prefix+"k").Value("v2").Build()).Error())
	require.Eventually(t, func() bool {
		v, ok, err := s.Get(ctx, "k")
		return err == nil && ok && string(v) == "v2"
	}, time.Second, time.Millisecond)

	for i := range 200 { // own writes are read back at once
		want := "own-" + strconv.Itoa(i)
		require.NoError(t, s.Set(ctx, "k", []byte(want), time.Minute))
		v, ok, err := s.Get(ctx, "k")
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, want, string(v))
		switch i % 3 {
		case 0:
			require.NoError(t, s.Delete(ctx, "k"))
		case 1:
			_, err := s.Clear(ctx)
			require.NoError(t, err)
		default:
			continue
		}
		_, ok, err = s.Get(ctx, "k")
		require.NoError(t, err)
		require.False(t, ok, "a cached value outlived the store's own Delete/Clear")
	}
}

// TestRedisCancelledContextNoFallback: a caller's cancellation is returned, never blamed on Redis.
func TestRedisCancelledContextNoFallback(t *testing.T) {
	s := newTestRedis(t, respcache.RedisConfig{})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, _, err := s.Get(ctx, "k")
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorIs(t, s.Set(ctx, "k", []byte("v"), time.Minute), context.Canceled)
	require.False(t, s.FallbackActive())
	st := s.Stats(context.Background())
	require.Zero(t, st.Errors[respcache.ErrorTypeConnection]+st.Errors[respcache.ErrorTypeTimeout])
}

// TestRedisNoFallbackErrors: with DisableFallback, an outage is returned as ErrUnavailable.
func TestRedisNoFallbackErrors(t *testing.T) {
	proc := startRedis(t, 0)
	s, err := respcache.NewRedis(respcache.RedisConfig{URL: proc.URL(), DisableFallback: true,
		KeyPrefix: uniquePrefix("nofb"), CommandTimeout: 300 * time.Millisecond})
	require.NoError(t, err)
	defer s.Close()
	ctx := context.Background()
	require.NoError(t, s.Set(ctx, "k", []byte("v"), time.Minute))
	proc.Kill()
	_, _, err = s.Get(ctx, "k")
	require.ErrorIs(t, err, respcache.ErrUnavailable)
	require.ErrorIs(t, s.Set(ctx, "k", []byte("v"), time.Minute), respcache.ErrUnavailable)
	require.False(t, s.FallbackActive())
}

// TestRedisFallbackCapsTTL: entries stored while in fallback live at most FallbackTTL.
func TestRedisFallbackCapsTTL(t *testing.T) {
	s, err := respcache.NewRedis(respcache.RedisConfig{URL: "redis://127.0.0.1:" + strconv.Itoa(freePort(t)),
		FallbackTTL: 300 * time.Millisecond, HealthInterval: time.Hour, ConnectTimeout: 200 * time.Millisecond})
	require.NoError(t, err)
	defer s.Close()
	ctx := context.Background()
	require.NoError(t, s.Set(ctx, "k", []byte("v"), time.Hour))
	_, ok, _ := s.Get(ctx, "k")
	require.True(t, ok)
	time.Sleep(400 * time.Millisecond)
	_, ok, _ = s.Get(ctx, "k")
	require.False(t, ok)
}

// TestRedisCloseIdempotent: Close twice (concurrently), then every method but Stats is ErrClosed,
// and the store's goroutines are gone.
func TestRedisCloseIdempotent(t *testing.T) {
	proc := startRedis(t, 0)
	before := storeGoroutines()
	s, err := respcache.NewRedis(respcache.RedisConfig{URL: proc.URL(), KeyPrefix: uniquePrefix("close"),
		HealthInterval: 50 * time.Millisecond})
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, s.Set(ctx, "k", []byte("v"), time.Minute))
	var wg sync.WaitGroup
	for range 3 {
		wg.Go(func() { require.NoError(t, s.Close()) })
	}
	wg.Wait()
	require.NoError(t, s.Close())
	_, _, err = s.Get(ctx, "k")
	require.ErrorIs(t, err, respcache.ErrClosed)
	require.ErrorIs(t, s.Set(ctx, "k", nil, 0), respcache.ErrClosed)
	require.ErrorIs(t, s.Delete(ctx, "k"), respcache.ErrClosed)
	_, err = s.Clear(ctx)
	require.ErrorIs(t, err, respcache.ErrClosed)
	require.Equal(t, "redis", s.Stats(ctx).Backend)
	requireNoStoreGoroutines(t, before)
}

// attrKey renders an attribute set as "k=v,k2=v2" ("" when empty).
func attrKey(set attribute.Set) string {
	var parts []string
	for _, kv := range set.ToSlice() {
		parts = append(parts, string(kv.Key)+"="+kv.Value.String())
	}
	return strings.Join(parts, ",")
}

// TestRedisMetrics: the fallback and backend gauges follow the store's state, errors are counted by
// type, and operations are timed.
func TestRedisMetrics(t *testing.T) {
	proc := newRedisProc(t, 0)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	s, err := respcache.NewRedis(respcache.RedisConfig{URL: proc.URL(), KeyPrefix: uniquePrefix("metrics"),
		MeterProvider: mp, HealthInterval: 100 * time.Millisecond, ConnectTimeout: 200 * time.Millisecond})
	require.NoError(t, err)
	defer s.Close()

	collect := func() map[string]map[string]float64 {
		var rm metricdata.ResourceMetrics
		require.NoError(t, reader.Collect(context.Background(), &rm))
		out := map[string]map[string]float64{}
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				vals := map[string]float64{}
				switch d := m.Data.(type) {
				case metricdata.Gauge[int64]:
					for _, p := range d.DataPoints {
						vals[attrKey(p.Attributes)] = float64(p.Value)
					}
				case metricdata.Sum[int64]:
					for _, p := range d.DataPoints {
						vals[attrKey(p.Attributes)] = float64(p.Value)
					}
				case metricdata.Histogram[float64]:
					for _, p := range d.DataPoints {
						vals[attrKey(p.Attributes)] = float64(p.Count)
					}
				}
				out[m.Name] = vals
			}
		}
		return out
	}
	m := collect()
	require.Equal(t, 1.0, m[respcache.MetricFallbackActive][""])
	require.Equal(t, 1.0, m[respcache.MetricBackendType]["backend=memory"])
	require.Equal(t, 0.0, m[respcache.MetricBackendType]["backend=redis"])
	require.GreaterOrEqual(t, m[respcache.MetricRedisErrors]["type=connection"], 1.0)

	proc.Start()
	require.Eventually(t, func() bool { return !s.FallbackActive() }, 2*time.Second, 10*time.Millisecond)
	ctx := context.Background()
	require.NoError(t, s.Set(ctx, "k", []byte("v"), time.Minute))
	_, _, err = s.Get(ctx, "k")
	require.NoError(t, err)
	require.NoError(t, s.Delete(ctx, "k"))
	m = collect()
	require.Equal(t, 0.0, m[respcache.MetricFallbackActive][""])
	require.Equal(t, 1.0, m[respcache.MetricBackendType]["backend=redis"])
	for _, op := range []string{"get", "set", "delete"} {
		require.Equal(t, 1.0, m[respcache.MetricRedisLatency]["operation="+op], op)
	}
	require.Equal(t, float64(respcache.DefaultRedisPoolSize), m[respcache.MetricRedisConnections]["state=idle"])

	st := s.Stats(ctx)
	require.Equal(t, "redis", st.Backend)
	require.Equal(t, -1, st.Entries)
	require.NotNil(t, st.Redis)
	require.Equal(t, respcache.DefaultRedisPoolSize, st.Redis.Connections.Idle)
	require.Equal(t, st.Errors, st.Redis.Errors)
}
