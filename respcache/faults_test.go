package respcache_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/rueidis"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/respcache"
)

// Fault tests: each against its own server process on its own port, so that killing it harms no
// other test. "No failed call" means: no Get or Set returns an error while the fallback is on.

// load runs Set/Get loops from several goroutines until stop is closed, counting calls and errors.
type load struct {
	calls, failures atomic.Int64
	firstErr        atomic.Value // error
	stop            chan struct{}
	wg              sync.WaitGroup
}

func startLoad(s respcache.CacheStore, goroutines int) *load {
	l := &load{stop: make(chan struct{})}
	for g := range goroutines {
		l.wg.Go(func() {
			ctx := context.Background()
			for i := 0; ; i++ {
				select {
				case <-l.stop:
					return
				default:
				}
				k := fmt.Sprintf("load-%d-%d", g, i%50)
				var err error
				if i%2 == 0 {
					err = s.Set(ctx, k, []byte("value "+k), time.Minute)
				} else {
					_, _, err = s.Get(ctx, k)
				}
				l.calls.Add(1)
				if err != nil {
					l.failures.Add(1)
					l.firstErr.CompareAndSwap(nil, err)
				}
				time.Sleep(time.Millisecond) // 2 cores shared: a steady trickle, not a flood
			}
		})
	}
	return l
}

// Stop ends the loops and returns (calls, failures, first error).
func (l *load) Stop() (int64, int64, error) {
	close(l.stop)
	l.wg.Wait()
	err, _ := l.firstErr.Load().(error)
	return l.calls.Load(), l.failures.Load(), err
}

// directClient returns a plain rueidis client on addr, closed at cleanup.
func directClient(t *testing.T, addr string) rueidis.Client {
	t.Helper()
	c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{addr}, DisableCache: true,
		ForceSingleClient: true})
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c
}

// TestRedisFaultKillAndRestart kills -9 a private Redis under load: no call may fail, the fallback
// takes over, and when a new Redis starts on the same port the store goes back to it within the
// health interval, with later Sets landing in Redis.
func TestRedisFaultKillAndRestart(t *testing.T) {
	proc := startRedis(t, 0)
	const interval = 200 * time.Millisecond
	s, err := respcache.NewRedis(respcache.RedisConfig{
		URL: proc.URL(), KeyPrefix: uniquePrefix("fault"), HealthInterval: interval,
		CommandTimeout: 500 * time.Millisecond, ConnectTimeout: 500 * time.Millisecond,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	require.False(t, s.FallbackActive())

	l := startLoad(s, 6)
	time.Sleep(300 * time.Millisecond)
	before := l.calls.Load()
	proc.Kill()
	require.Eventually(t, s.FallbackActive, 2*time.Second, 5*time.Millisecond, "fallback did not activate after kill -9")
	time.Sleep(500 * time.Millisecond) // keep serving from the fallback for a while
	during := l.calls.Load()

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
	require.False(t, st.Redis.FallbackActive)
	require.Positive(t, st.Errors[respcache.ErrorTypeConnection], "connection errors not counted: %+v", st.Errors)
	t.Logf("calls %d, failures %d, errors %v", calls, failures, st.Errors)
}

// TestRedisFaultDownAtStart: NewRedis with nothing listening works from the fallback and recovers
// when a server appears on that port.
func TestRedisFaultDownAtStart(t *testing.T) {
	proc := newRedisProc(t, 0) // not started
	const interval = 200 * time.Millisecond
	s, err := respcache.NewRedis(respcache.RedisConfig{
		URL: proc.URL(), KeyPrefix: uniquePrefix("down"), HealthInterval: interval,
		ConnectTimeout: 300 * time.Millisecond, CommandTimeout: 300 * time.Millisecond,
	})
	require.NoError(t, err, "NewRedis must not fail with Redis down while the fallback is on")
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

// TestRedisFaultDownAtStartNoFallback: with the fallback off, NewRedis reports ErrUnavailable.
func TestRedisFaultDownAtStartNoFallback(t *testing.T) {
	_, err := respcache.NewRedis(respcache.RedisConfig{
		URL: "redis://127.0.0.1:" + strconv.Itoa(freePort(t)), DisableFallback: true,
		ConnectTimeout: 300 * time.Millisecond,
	})
	require.ErrorIs(t, err, respcache.ErrUnavailable)
}

// TestTieredFaultS3Unreachable: L2 is an S3Store on a port nothing listens on. Errors are counted,
// L1 serves its hits, and no Get or Set returns an error.
func TestTieredFaultS3Unreachable(t *testing.T) {
	l2, err := respcache.NewS3(respcache.S3Config{
		Endpoint: "http://127.0.0.1:" + strconv.Itoa(freePort(t)), Bucket: "absent",
		AccessKey: "AKIATEST", SecretKey: "very-secret", OpTimeout: 500 * time.Millisecond,
		Cooldown: 100 * time.Millisecond,
	})
	require.NoError(t, err, "NewS3 must not fail when S3 is unreachable")
	t.Cleanup(func() { _ = l2.Close() })
	s := mustTiered(t, respcache.TieredConfig{L1: mustMemory(t, respcache.MemoryConfig{}), L2: l2})

	l := startLoad(s, 4)
	time.Sleep(400 * time.Millisecond) // several cooldowns: probes fail again and again
	calls, failures, firstErr := l.Stop()
	require.Zerof(t, failures, "%d of %d calls failed; first: %v", failures, calls, firstErr)

	ctx := context.Background()
	require.NoError(t, s.Set(ctx, "hot", []byte("from L1"), time.Minute))
	v, ok, err := s.Get(ctx, "hot")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, "from L1", string(v))
	_, ok, err = s.Get(ctx, "cold")
	require.NoError(t, err)
	require.False(t, ok)

	st := s.Stats(ctx)
	require.Positive(t, st.Errors[respcache.ErrorTypeConnection], "tiered errors: %+v", st.Errors)
	require.Positive(t, st.L2.Errors[respcache.ErrorTypeConnection], "L2 errors: %+v", st.L2.Errors)
	require.Positive(t, st.Hits)
	t.Logf("calls %d; tiered errors %v; S3 errors %v", calls, st.Errors, st.L2.Errors)
}

// TestTieredFaultS3BlackHole: L2 accepts connections but never answers. The first request times
// out after OpTimeout; while the circuit is open the next ones fail fast, so an L1 miss does not
// cost OpTimeout each time.
func TestTieredFaultS3BlackHole(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var held sync.WaitGroup
	stopHold := make(chan struct{})
	held.Go(func() {
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				_ = c.Close()
			}
		}()
		for {
			c, err := ln.Accept()
			if err != nil {
				<-stopHold
				return
			}
			conns = append(conns, c) // hold it open, never answer
		}
	})
	t.Cleanup(func() { _ = ln.Close(); close(stopHold); held.Wait() })

	const opTimeout = 300 * time.Millisecond
	start := time.Now()
	l2, err := respcache.NewS3(respcache.S3Config{
		Endpoint: "http://" + ln.Addr().String(), Bucket: "hole", OpTimeout: opTimeout, Cooldown: time.Minute,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = l2.Close() })
	require.Less(t, time.Since(start), 3*opTimeout)
	s := mustTiered(t, respcache.TieredConfig{L1: mustMemory(t, respcache.MemoryConfig{}), L2: l2})

	ctx := context.Background()
	start = time.Now()
	for i := range 50 {
		_, ok, err := s.Get(ctx, "miss-"+strconv.Itoa(i))
		require.NoError(t, err)
		require.False(t, ok)
		require.NoError(t, s.Set(ctx, "k-"+strconv.Itoa(i), []byte("v"), time.Minute))
	}
	require.Less(t, time.Since(start), opTimeout, "an open circuit must fail fast")
	require.Positive(t, s.Stats(ctx).Errors[respcache.ErrorTypeTimeout]+s.Stats(ctx).Errors[respcache.ErrorTypeConnection])
}

// TestTieredFaultS3KillAndRestart kills a private versitygw under load and starts it again: no call
// fails, L2 errors are counted, and L2 serves again once the cooldown has passed.
func TestTieredFaultS3KillAndRestart(t *testing.T) {
	gw := startVersityGW(t)
	l2, err := respcache.NewS3(respcache.S3Config{
		Endpoint: gw.endpoint, Bucket: gw.bucket, AccessKey: gw.access, SecretKey: gw.secret,
		OpTimeout: time.Second, Cooldown: 100 * time.Millisecond,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = l2.Close() })
	s := mustTiered(t, respcache.TieredConfig{L1: mustMemory(t, respcache.MemoryConfig{}), L2: l2})
	ctx := context.Background()
	require.NoError(t, s.Set(ctx, "durable", []byte("in S3"), time.Hour))

	l := startLoad(s, 4)
	time.Sleep(200 * time.Millisecond)
	gw.kill()
	time.Sleep(400 * time.Millisecond)
	require.Positive(t, l2.Stats(ctx).Errors[respcache.ErrorTypeConnection])
	gw.start()
	time.Sleep(300 * time.Millisecond)
	calls, failures, firstErr := l.Stop()
	require.Zerof(t, failures, "%d of %d calls failed; first: %v", failures, calls, firstErr)

	// L2 answers again: an L2-only read (L1 emptied) is a hit.
	l1 := mustMemory(t, respcache.MemoryConfig{})
	s2 := mustTiered(t, respcache.TieredConfig{L1: l1, L2: l2})
	require.Eventually(t, func() bool {
		v, ok, err := s2.Get(ctx, "durable")
		return err == nil && ok && string(v) == "in S3"
	}, 3*time.Second, 50*time.Millisecond)
	_, _ = l2.Clear(ctx)
}

// versityGW is a private versitygw (posix backend) on its own port.
type versityGW struct {
	t                                *testing.T
	bin, root, addr                  string
	endpoint, bucket, access, secret string
	cmd                              *exec.Cmd
}

// startVersityGW starts a private versitygw; skips when the binary is absent (versitygw on PATH
// or in $HOME/go/bin).
func startVersityGW(t *testing.T) *versityGW {
	t.Helper()
	bin, err := exec.LookPath("versitygw")
	if err != nil {
		home, _ := os.UserHomeDir()
		bin = filepath.Join(home, "go", "bin", "versitygw")
		if _, err := os.Stat(bin); err != nil {
			skipOrFail(t, "versitygw not found (PATH or ~/go/bin): cannot start a private S3")
		}
	}
	root := t.TempDir()
	g := &versityGW{t: t, bin: bin, root: root, bucket: "fault", access: "faultkey", secret: "faultsecret"}
	require.NoError(t, os.MkdirAll(filepath.Join(root, g.bucket), 0o755))
	g.addr = "127.0.0.1:" + strconv.Itoa(freePort(t))
	g.endpoint = "http://" + g.addr
	g.start()
	t.Cleanup(g.kill)
	return g
}

func (g *versityGW) start() {
	g.t.Helper()
	cmd := exec.Command(g.bin, "--port", g.addr, "posix", g.root)
	cmd.Env = append(os.Environ(), "ROOT_ACCESS_KEY="+g.access, "ROOT_SECRET_KEY="+g.secret)
	require.NoError(g.t, cmd.Start())
	g.cmd = cmd
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", g.addr, 100*time.Millisecond)
		if err == nil {
			_ = c.Close()
			return
		}
		if time.Now().After(deadline) {
			g.t.Fatalf("versitygw on %s did not listen within 10s", g.addr)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (g *versityGW) kill() {
	if g.cmd == nil {
		return
	}
	_ = g.cmd.Process.Kill()
	_ = g.cmd.Wait()
	g.cmd = nil
}
