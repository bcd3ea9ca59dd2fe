package s3store_test

import (
	"context"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/internal/storetest"
	"github.com/kvroute/kvroute/respcache/s3store"
)

// Fault tests of a respcache.TieredStore whose L2 is a Store: S3 unreachable, hanging, or killed
// and restarted (a private versitygw on its own port). "No failed call" means: no Get or Set of the
// tiered store returns an error.

// TestTieredFaultUnreachable: L2 is a Store on a port nothing listens on. Errors are counted,
// L1 serves its hits, and no Get or Set returns an error.
func TestTieredFaultUnreachable(t *testing.T) {
	l2, err := s3store.New(s3store.Config{
		Endpoint: "http://127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)), Bucket: "absent",
		AccessKey: "AKIATEST", SecretKey: "very-secret", OpTimeout: 500 * time.Millisecond,
		Cooldown: 100 * time.Millisecond,
	})
	require.NoError(t, err, "New must not fail when S3 is unreachable")
	t.Cleanup(func() { _ = l2.Close() })
	s := storetest.MustTiered(t, respcache.TieredConfig{L1: storetest.MustMemory(t, respcache.MemoryConfig{}), L2: l2})

	l := storetest.StartLoad(s, 4)
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

// TestTieredFaultBlackHole: L2 accepts connections but never answers. The first request times
// out after OpTimeout; while the circuit is open the next ones fail fast, so an L1 miss does not
// cost OpTimeout each time.
func TestTieredFaultBlackHole(t *testing.T) {
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
	l2, err := s3store.New(s3store.Config{
		Endpoint: "http://" + ln.Addr().String(), Bucket: "hole", OpTimeout: opTimeout, Cooldown: time.Minute,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = l2.Close() })
	require.Less(t, time.Since(start), 3*opTimeout)
	s := storetest.MustTiered(t, respcache.TieredConfig{L1: storetest.MustMemory(t, respcache.MemoryConfig{}), L2: l2})

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

// TestTieredFaultKillAndRestart kills a private versitygw under load and starts it again: no call
// fails, L2 errors are counted, and L2 serves again once the cooldown has passed.
func TestTieredFaultKillAndRestart(t *testing.T) {
	gw := startVersityGW(t)
	l2, err := s3store.New(s3store.Config{
		Endpoint: gw.endpoint, Bucket: gw.bucket, AccessKey: gw.access, SecretKey: gw.secret,
		OpTimeout: time.Second, Cooldown: 100 * time.Millisecond,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = l2.Close() })
	s := storetest.MustTiered(t, respcache.TieredConfig{L1: storetest.MustMemory(t, respcache.MemoryConfig{}), L2: l2})
	ctx := context.Background()
	require.NoError(t, s.Set(ctx, "durable", []byte("in S3"), time.Hour))

	l := storetest.StartLoad(s, 4)
	time.Sleep(200 * time.Millisecond)
	gw.kill()
	time.Sleep(400 * time.Millisecond)
	require.Positive(t, l2.Stats(ctx).Errors[respcache.ErrorTypeConnection])
	gw.start()
	time.Sleep(300 * time.Millisecond)
	calls, failures, firstErr := l.Stop()
	require.Zerof(t, failures, "%d of %d calls failed; first: %v", failures, calls, firstErr)

	// L2 answers again: an L2-only read (L1 emptied) is a hit.
	l1 := storetest.MustMemory(t, respcache.MemoryConfig{})
	s2 := storetest.MustTiered(t, respcache.TieredConfig{L1: l1, L2: l2})
	require.Eventually(t, func() bool {
		v, ok, err := s2.Get(ctx, "durable")
		return err == nil && ok && string(v) == "in S3"
	}, 3*time.Second, 50*time.Millisecond)
	_, _ = l2.Clear(ctx)
}
