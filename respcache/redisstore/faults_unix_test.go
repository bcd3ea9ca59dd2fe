//go:build unix

package redisstore_test

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/redisstore"
)

// TestFaultHangAndReplay freezes a private Redis (SIGSTOP): commands time out, the store falls
// back without failing a call; a Delete made during the outage is replayed on Redis when it
// resumes (SIGCONT), so the deleted entry does not come back.
func TestFaultHangAndReplay(t *testing.T) {
	proc := testenv.StartRedisServer(t)
	const interval = 200 * time.Millisecond
	prefix := uniquePrefix("hang")
	s, err := redisstore.New(redisstore.Config{
		URL: proc.URL(), KeyPrefix: prefix, HealthInterval: interval,
		CommandTimeout: 150 * time.Millisecond, ConnectTimeout: 300 * time.Millisecond,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	ctx := context.Background()
	require.NoError(t, s.Set(ctx, "victim", []byte("stale"), time.Hour))
	require.NoError(t, s.Set(ctx, "keeper", []byte("kept"), time.Hour))

	proc.Signal(syscall.SIGSTOP)
	start := time.Now()
	_, ok, err := s.Get(ctx, "keeper") // times out, answered by the (empty) fallback
	require.NoError(t, err)
	require.False(t, ok)
	require.Less(t, time.Since(start), time.Second, "a hung Redis must cost at most CommandTimeout")
	require.True(t, s.FallbackActive())
	require.Positive(t, s.Stats(ctx).Errors[respcache.ErrorTypeTimeout])
	require.NoError(t, s.Delete(ctx, "victim")) // remembered for replay
	require.NoError(t, s.Set(ctx, "outage", []byte("fallback only"), time.Hour))

	proc.Signal(syscall.SIGCONT)
	require.Eventually(t, func() bool { return !s.FallbackActive() }, 10*interval, 10*time.Millisecond)
	_, ok, err = s.Get(ctx, "victim")
	require.NoError(t, err)
	require.False(t, ok, "a Delete made during the outage was not replayed")
	v, ok, err := s.Get(ctx, "keeper")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, "kept", string(v))
}
