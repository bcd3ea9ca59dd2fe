package redisstore_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/redis/rueidis"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/internal/storetest"
	"github.com/kvroute/kvroute/respcache/redisstore"
)

// Fault tests: each against its own server process on its own port, so that killing it harms no
// other test. "No failed call" means: no Get or Set returns an error while the fallback is on.

// directClient returns a plain rueidis client on addr, closed at cleanup.
func directClient(t *testing.T, addr string) rueidis.Client {
	t.Helper()
	c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{addr}, DisableCache: true,
		ForceSingleClient: true})
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c
}

// TestFaultKillAndRestart kills -9 a private Redis under load: no call may fail, the fallback
// takes over, and when a new Redis starts on the same port the store goes back to it within the
// health interval, with later Sets landing in Redis.
func TestFaultKillAndRestart(t *testing.T) {
	proc := testenv.StartRedisServer(t)
	const interval = 200 * time.Millisecond
	s, err := redisstore.New(redisstore.Config{
		URL: proc.URL(), KeyPrefix: uniquePrefix("fault"), HealthInterval: interval,
		CommandTimeout: 500 * time.Millisecond, ConnectTimeout: 500 * time.Millisecond,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	require.False(t, s.FallbackActive())

	l := storetest.StartLoad(s, 6)
	time.Sleep(300 * time.Millisecond)
	before := l.Calls()
	proc.Kill()
	require.Eventually(t, s.FallbackActive, 2*time.Second, 5*time.Millisecond, "fallback did not activate after kill -9")
	time.Sleep(500 * time.Millisecond) // keep serving from the fallback for a while
	during := l.Calls()

	proc.Start()
	restarted := time.Now()
	require.Eventually(t, func() bool { return !s.FallbackActive() }, 10*interval, 10*time.Millisecond,
		"store did not return to Redis within the health interval")
	t.Logf("back on Redis %v after the restart (health interval %v)", time.Since(restarted).Round(time.Millisecond), interval)
	time.Sleep(200 * time.Millisecond)
	calls, failures, firstErr := l.Stop()
	require.Zerof(t, failures, "%d of %d calls failed; first: %v", failures, calls, firstErr)
	require.Greater(t, before, int64(0))
	require.Greater(t, during, before, "no calls served during the outage")

	// Subsequent Sets land in Redis.
	ctx := context.Background()
	require.NoError(t, s.Set(ctx, "after-restart", []byte("in redis"), time.Minute))
	c := directClient(t, proc.Addr())
	keys, err := c.Do(ctx, c.B().Keys().Pattern("kvroute-test:fault:*after-restart").Build()).AsStrSlice()
	require.NoError(t, err)
	require.Len(t, keys, 1)
	v, err := c.Do(ctx, c.B().Get().Key(keys[0]).Build()).ToString()
	require.NoError(t, err)
	require.Equal(t, "in redis", v)

	st := s.Stats(ctx)
	require.False(t, st.Remote.FallbackActive)
	require.Positive(t, st.Errors[respcache.ErrorTypeConnection], "connection errors not counted: %+v", st.Errors)
	t.Logf("calls %d, failures %d, errors %v", calls, failures, st.Errors)
}

// TestFaultRecoveryIsPromptWithALongHealthInterval: a store whose health interval is long leaves
// the fallback within about a second of Redis's return, not at the next health check: what it
// stores meanwhile would reach neither Redis nor the other router replicas.
func TestFaultRecoveryIsPromptWithALongHealthInterval(t *testing.T) {
	proc := testenv.StartRedisServer(t)
	s, err := redisstore.New(redisstore.Config{
		URL: proc.URL(), KeyPrefix: uniquePrefix("recovery"), HealthInterval: time.Hour,
		CommandTimeout: 500 * time.Millisecond, ConnectTimeout: 500 * time.Millisecond,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	ctx := context.Background()
	proc.Kill()
	// The first failing command switches to the fallback; the hour-long monitor has not run.
	require.Eventually(t, func() bool {
		_ = s.Set(ctx, "k", []byte("v"), time.Minute)
		return s.FallbackActive()
	}, 5*time.Second, 20*time.Millisecond, "fallback did not activate after kill -9")

	proc.Start()
	restarted := time.Now()
	require.Eventually(t, func() bool { return !s.FallbackActive() }, 10*time.Second, 10*time.Millisecond,
		"store did not return to Redis after its restart")
	t.Logf("back on Redis %v after the restart (health interval 1h)", time.Since(restarted).Round(time.Millisecond))
}

// TestFaultDownAtStart: New with nothing listening works from the fallback and recovers
// when a server appears on that port.
func TestFaultDownAtStart(t *testing.T) {
	proc := testenv.NewRedisServer(t) // not started
	const interval = 200 * time.Millisecond
	s, err := redisstore.New(redisstore.Config{
		URL: proc.URL(), KeyPrefix: uniquePrefix("down"), HealthInterval: interval,
		ConnectTimeout: 300 * time.Millisecond, CommandTimeout: 300 * time.Millisecond,
	})
	require.NoError(t, err, "New must not fail with Redis down while the fallback is on")
	t.Cleanup(func() { _ = s.Close() })
	require.True(t, s.FallbackActive())

	ctx := context.Background()
	require.NoError(t, s.Set(ctx, "k", []byte("from fallback"), time.Minute))
	v, ok, err := s.Get(ctx, "k")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, "from fallback", string(v))
	require.NoError(t, s.Delete(ctx, "k"))

	proc.Start()
	require.Eventually(t, func() bool { return !s.FallbackActive() }, 10*interval, 10*time.Millisecond,
		"store did not connect to the Redis that appeared")
	require.NoError(t, s.Set(ctx, "k2", []byte("in redis"), time.Minute))
	c := directClient(t, proc.Addr())
	keys, err := c.Do(ctx, c.B().Keys().Pattern("kvroute-test:down:*k2").Build()).AsStrSlice()
	require.NoError(t, err)
	require.Len(t, keys, 1)
}

// TestFaultDownAtStartNoFallback: with the fallback off, New reports respcache.ErrUnavailable.
func TestFaultDownAtStartNoFallback(t *testing.T) {
	_, err := redisstore.New(redisstore.Config{
		URL: "redis://127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)), DisableFallback: true,
		ConnectTimeout: 300 * time.Millisecond,
	})
	require.ErrorIs(t, err, respcache.ErrUnavailable)
}

// TestFaultCallersClient kills -9 the Redis under a store on a caller's client (rueidis defaults:
// retries on): no call fails, the fallback takes over once CommandTimeout fires, and the store
// goes back to Redis when the client has reconnected to the restarted server. The client stays
// the caller's: Close leaves it open.
func TestFaultCallersClient(t *testing.T) {
	proc := testenv.StartRedisServer(t)
	c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{proc.Addr()}, DisableCache: true})
	require.NoError(t, err)
	t.Cleanup(c.Close)
	const interval = 200 * time.Millisecond
	s, err := redisstore.NewWithClient(c, redisstore.Config{
		KeyPrefix: uniquePrefix("shared-fault"), HealthInterval: interval, CommandTimeout: 300 * time.Millisecond,
	})
	require.NoError(t, err)
	require.False(t, s.FallbackActive())

	l := storetest.StartLoad(s, 4)
	time.Sleep(200 * time.Millisecond)
	proc.Kill()
	require.Eventually(t, s.FallbackActive, 3*time.Second, 5*time.Millisecond, "fallback did not activate after kill -9")
	proc.Start()
	require.Eventually(t, func() bool { return !s.FallbackActive() }, 20*interval, 10*time.Millisecond,
		"store did not return to Redis after the restart")
	calls, failures, firstErr := l.Stop()
	require.Zerof(t, failures, "%d of %d calls failed; first: %v", failures, calls, firstErr)

	ctx := context.Background()
	require.NoError(t, s.Set(ctx, "after-restart", []byte("in redis"), time.Minute))
	require.NoError(t, s.Close())
	require.NoError(t, c.Do(ctx, c.B().Ping().Build()).Error(), "Close closed the caller's client")
	require.Positive(t, s.Stats(ctx).Errors[respcache.ErrorTypeConnection]+s.Stats(ctx).Errors[respcache.ErrorTypeTimeout])
}
