package redisstore_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/rueidis"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/internal/storetest"
	"github.com/kvroute/kvroute/respcache/redisstore"
	"github.com/kvroute/kvroute/telemetry"
)

func TestNewValidation(t *testing.T) {
	down := "redis://127.0.0.1:" + strconv.Itoa(testenv.FreePort(t))
	for _, tc := range []struct {
		name string
		cfg  redisstore.Config
	}{
		{"glob_star", redisstore.Config{URL: down, KeyPrefix: "cache:*:"}},
		{"glob_question", redisstore.Config{URL: down, KeyPrefix: "cache?"}},
		{"glob_open_bracket", redisstore.Config{URL: down, KeyPrefix: "cache[1"}},
		{"glob_close_bracket", redisstore.Config{URL: down, KeyPrefix: "cache]"}},
		{"glob_backslash", redisstore.Config{URL: down, KeyPrefix: `cache\`}},
		{"scheme", redisstore.Config{URL: "http://127.0.0.1:6379"}},
		{"unparsable", redisstore.Config{URL: "redis://user:pa ss@[::1"}},
		{"bad_db", redisstore.Config{URL: "redis://127.0.0.1:6379/x"}},
		{"negative_pool", redisstore.Config{URL: down, PoolSize: -1}},
		{"negative_command_timeout", redisstore.Config{URL: down, CommandTimeout: -time.Second}},
		{"negative_fallback_ttl", redisstore.Config{URL: down, FallbackTTL: -time.Second}},
		{"negative_health_interval", redisstore.Config{URL: down, HealthInterval: -time.Second}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := redisstore.New(tc.cfg)
			if s != nil {
				_ = s.Close()
			}
			require.ErrorIs(t, err, respcache.ErrInvalidConfig)
			require.NotContains(t, err.Error(), "pa ss")
		})
	}
}

const redisSecret = "hunter2-s3cr3t"

func TestSecretsRedacted(t *testing.T) {
	cfg := redisstore.Config{
		URL:      "redis://app:" + redisSecret + "@127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)) + "/0",
		Password: redisSecret + "-override", ConnectTimeout: 200 * time.Millisecond, HealthInterval: time.Hour,
	}
	var logBuf bytes.Buffer
	slog.New(slog.NewJSONHandler(&logBuf, nil)).Info("config", "redis", cfg)
	for _, out := range []string{cfg.String(), fmt.Sprint(cfg), fmt.Sprintf("%+v", cfg), fmt.Sprintf("%#v", cfg), logBuf.String()} {
		require.NotContains(t, out, redisSecret)
		require.Contains(t, out, "127.0.0.1")
	}
	s, err := redisstore.New(cfg) // Redis down: fallback
	require.NoError(t, err)
	defer s.Close()
	require.NotContains(t, s.String(), redisSecret)
	require.NotContains(t, fmt.Sprintf("%v %+v %#v %s", s, s, s, s), redisSecret)

	// Errors do not echo the password either.
	cfg.URL = "redis://app:" + redisSecret + "@127.0.0.1:6379/notadb"
	_, err = redisstore.New(cfg)
	require.Error(t, err)
	require.NotContains(t, err.Error(), redisSecret)
}

// TestWrongPassword: a server that rejects the credentials is a configuration error, not an
// outage, and the password is not in the error.
func TestWrongPassword(t *testing.T) {
	proc := testenv.StartRedisServer(t)
	c := directClient(t, proc.Addr())
	ctx := context.Background()
	require.NoError(t, c.Do(ctx, c.B().ConfigSet().ParameterValue().ParameterValue("requirepass", "right-one").Build()).Error())
	_, err := redisstore.New(redisstore.Config{URL: proc.URL(), Password: redisSecret})
	require.ErrorIs(t, err, respcache.ErrInvalidConfig)
	require.NotContains(t, err.Error(), redisSecret)

	s, err := redisstore.New(redisstore.Config{URL: proc.URL(), Password: "right-one", KeyPrefix: uniquePrefix("auth")})
	require.NoError(t, err)
	defer s.Close()
	require.NoError(t, s.Set(ctx, "k", []byte("v"), time.Minute))
	require.False(t, s.FallbackActive())
}

// TestTTL checks the PX argument: the given ttl, DefaultTTL for ttl ≤ 0, and a sub-millisecond
// ttl rounded up rather than sent as 0 (which Redis rejects).
func TestTTL(t *testing.T) {
	prefix := uniquePrefix("ttl")
	s := newTestRedis(t, redisstore.Config{KeyPrefix: prefix, DefaultTTL: 42 * time.Second})
	c := directClient(t, testenv.RedisAddr(t))
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

// TestClearOnlyItsPrefix: Clear removes the store's keys, not another prefix's.
func TestClearOnlyItsPrefix(t *testing.T) {
	a := newTestRedis(t, redisstore.Config{KeyPrefix: uniquePrefix("a")})
	b := newTestRedis(t, redisstore.Config{KeyPrefix: uniquePrefix("b")})
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

// TestClientSideCachingServesLocally: with client-side caching, repeated Gets reach the server
// once, a write by another client is seen after its invalidation, and the store's own writes at
// once.
func TestClientSideCachingServesLocally(t *testing.T) {
	proc := testenv.StartRedisServer(t)
	prefix := uniquePrefix("csc")
	s, err := redisstore.New(redisstore.Config{URL: proc.URL(), KeyPrefix: prefix, ClientSideCaching: true})
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

// TestCancelledContextNoFallback: a caller's cancellation is returned, never blamed on Redis.
func TestCancelledContextNoFallback(t *testing.T) {
	s := newTestRedis(t, redisstore.Config{})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, _, err := s.Get(ctx, "k")
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorIs(t, s.Set(ctx, "k", []byte("v"), time.Minute), context.Canceled)
	require.False(t, s.FallbackActive())
	st := s.Stats(context.Background())
	require.Zero(t, st.Errors[respcache.ErrorTypeConnection]+st.Errors[respcache.ErrorTypeTimeout])
}

// TestNoFallbackErrors: with DisableFallback, an outage is returned as ErrUnavailable.
func TestNoFallbackErrors(t *testing.T) {
	proc := testenv.StartRedisServer(t)
	s, err := redisstore.New(redisstore.Config{URL: proc.URL(), DisableFallback: true,
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

// TestFallbackCapsTTL: entries stored while in fallback live at most FallbackTTL.
func TestFallbackCapsTTL(t *testing.T) {
	s, err := redisstore.New(redisstore.Config{URL: "redis://127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)),
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

// TestCloseIdempotent: Close twice (concurrently), then every method but Stats is ErrClosed,
// and the store's goroutines are gone.
func TestCloseIdempotent(t *testing.T) {
	proc := testenv.StartRedisServer(t)
	before := storeGoroutines()
	s, err := redisstore.New(redisstore.Config{URL: proc.URL(), KeyPrefix: uniquePrefix("close"),
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
	storetest.RequireClosed(t, s)
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

// TestMetrics: the fallback and backend gauges follow the store's state, errors are counted by
// type, and operations are timed.
func TestMetrics(t *testing.T) {
	proc := testenv.NewRedisServer(t)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	s, err := redisstore.New(redisstore.Config{URL: proc.URL(), KeyPrefix: uniquePrefix("metrics"),
		MeterProvider: mp, HealthInterval: 100 * time.Millisecond, ConnectTimeout: 200 * time.Millisecond})
	require.NoError(t, err)
	defer s.Close()

	collect := func() map[string]map[string]float64 {
		var rm metricdata.ResourceMetrics
		require.NoError(t, reader.Collect(context.Background(), &rm))
		out := map[string]map[string]float64{}
		for _, sm := range rm.ScopeMetrics {
			require.Equal(t, "github.com/kvroute/kvroute/respcache/redisstore", sm.Scope.Name)
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
	require.Equal(t, 1.0, m[telemetry.MetricCacheFallbackActive][""])
	require.Equal(t, 1.0, m[telemetry.MetricCacheBackendType]["backend=memory"])
	require.Equal(t, 0.0, m[telemetry.MetricCacheBackendType]["backend=redis"])
	require.GreaterOrEqual(t, m[telemetry.MetricCacheRedisErrors]["type=connection"], 1.0)

	proc.Start()
	require.Eventually(t, func() bool { return !s.FallbackActive() }, 2*time.Second, 10*time.Millisecond)
	ctx := context.Background()
	require.NoError(t, s.Set(ctx, "k", []byte("v"), time.Minute))
	_, _, err = s.Get(ctx, "k")
	require.NoError(t, err)
	require.NoError(t, s.Delete(ctx, "k"))
	m = collect()
	require.Equal(t, 0.0, m[telemetry.MetricCacheFallbackActive][""])
	require.Equal(t, 1.0, m[telemetry.MetricCacheBackendType]["backend=redis"])
	for _, op := range []string{"get", "set", "delete"} {
		require.Equal(t, 1.0, m[telemetry.MetricCacheRedisLatency]["operation="+op], op)
	}
	require.Equal(t, float64(redisstore.DefaultPoolSize), m[telemetry.MetricCacheRedisConnections]["state=idle"])

	st := s.Stats(ctx)
	require.Equal(t, "redis", st.Backend)
	require.Equal(t, -1, st.Entries)
	require.NotNil(t, st.Remote)
	require.Equal(t, redisstore.DefaultPoolSize, st.Remote.Connections.Idle)
	require.Equal(t, st.Errors, st.Remote.Errors)
}

// unusedClient is a rueidis.Client for tests that must fail before the client is used: every
// method panics.
type unusedClient struct{ rueidis.Client }

func TestNewWithClientValidation(t *testing.T) {
	for _, tc := range []struct {
		name   string
		client rueidis.Client
		cfg    redisstore.Config
		want   string // in the error
	}{
		{"nil_client", nil, redisstore.Config{}, "needs a client"},
		{"url", unusedClient{}, redisstore.Config{URL: "redis://127.0.0.1:6379"}, "URL"},
		{"tls", unusedClient{}, redisstore.Config{TLS: true}, "TLS"},
		{"tls_config", unusedClient{}, redisstore.Config{TLSConfig: &tls.Config{}}, "TLSConfig"},
		{"credentials", unusedClient{}, redisstore.Config{Username: "u", Password: redisSecret}, "Username, Password"},
		{"pool_size", unusedClient{}, redisstore.Config{PoolSize: 4}, "PoolSize"},
		{"connect_timeout", unusedClient{}, redisstore.Config{ConnectTimeout: time.Second}, "ConnectTimeout"},
		{"client_cache_bytes", unusedClient{}, redisstore.Config{ClientCacheBytes: 1 << 20}, "ClientCacheBytes"},
		{"glob_prefix", unusedClient{}, redisstore.Config{KeyPrefix: "cache:*"}, "glob"},
		{"negative_fallback_ttl", unusedClient{}, redisstore.Config{FallbackTTL: -time.Second}, "negative"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := redisstore.NewWithClient(tc.client, tc.cfg)
			if s != nil {
				_ = s.Close()
			}
			require.ErrorIs(t, err, respcache.ErrInvalidConfig)
			require.Contains(t, err.Error(), tc.want)
			require.NotContains(t, err.Error(), redisSecret)
		})
	}
}

// TestNewWithClientShares: two stores and the caller share one client, each store under its own
// prefix; Stats knows no pool (Idle 0); closing a store leaves the client to its owner.
func TestNewWithClientShares(t *testing.T) {
	c := sharedClient(t, testenv.RedisAddr(t), false)
	ctx := context.Background()
	prefixA, prefixB := uniquePrefix("share-a"), uniquePrefix("share-b")
	a, err := redisstore.NewWithClient(c, redisstore.Config{KeyPrefix: prefixA})
	require.NoError(t, err)
	cleanupStore(t, a)
	b, err := redisstore.NewWithClient(c, redisstore.Config{KeyPrefix: prefixB})
	require.NoError(t, err)
	require.False(t, a.FallbackActive())
	require.Contains(t, a.String(), prefixA)

	require.NoError(t, a.Set(ctx, "k", []byte("a"), time.Minute))
	require.NoError(t, b.Set(ctx, "k", []byte("b"), time.Minute))
	v, err := c.Do(ctx, c.B().Get().Key(prefixA+"k").Build()).ToString()
	require.NoError(t, err)
	require.Equal(t, "a", v)
	n, err := b.Clear(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	got, ok, err := a.Get(ctx, "k")
	require.NoError(t, err)
	require.True(t, ok, "b's Clear removed a's key")
	require.Equal(t, "a", string(got))

	st := a.Stats(ctx)
	require.Equal(t, respcache.Connections{}, st.Remote.Connections)
	require.NoError(t, b.Close())
	require.NoError(t, c.Do(ctx, c.B().Ping().Build()).Error(), "Close closed the caller's client")
	_, ok, err = a.Get(ctx, "k")
	require.NoError(t, err)
	require.True(t, ok)
}
