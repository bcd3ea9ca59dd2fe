package respcache_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/cachetest"
	"github.com/kvroute/kvroute/respcache/internal/storetest"
)

// fakeStore wraps a MemoryStore: it can fail every call with err, records Set TTLs, and runs an
// optional hook inside Get (to interleave a concurrent write deterministically).
type fakeStore struct {
	*respcache.MemoryStore
	mu      sync.Mutex
	err     error
	ttls    map[string]time.Duration
	onGet   func(key string)
	getHits int
}

func newFake(t *testing.T, now func() time.Time) *fakeStore {
	return &fakeStore{MemoryStore: storetest.MustMemory(t, respcache.MemoryConfig{Now: now}), ttls: map[string]time.Duration{}}
}

func (f *fakeStore) fail(err error) {
	f.mu.Lock()
	f.err = err
	f.mu.Unlock()
}

func (f *fakeStore) failure() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.err
}

func (f *fakeStore) ttl(key string) time.Duration {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ttls[key]
}

func (f *fakeStore) Get(ctx context.Context, key string) ([]byte, bool, error) {
	if err := f.failure(); err != nil {
		return nil, false, err
	}
	v, ok, err := f.MemoryStore.Get(ctx, key)
	f.mu.Lock()
	hook := f.onGet
	if ok {
		f.getHits++
	}
	f.mu.Unlock()
	if hook != nil {
		hook(key)
	}
	return v, ok, err
}

func (f *fakeStore) Set(ctx context.Context, key string, value []byte, ttl time.Duration) error {
	if err := f.failure(); err != nil {
		return err
	}
	f.mu.Lock()
	f.ttls[key] = ttl
	f.mu.Unlock()
	return f.MemoryStore.Set(ctx, key, value, ttl)
}

func (f *fakeStore) Delete(ctx context.Context, key string) error {
	if err := f.failure(); err != nil {
		return err
	}
	return f.MemoryStore.Delete(ctx, key)
}

func (f *fakeStore) Clear(ctx context.Context) (int, error) {
	if err := f.failure(); err != nil {
		return 0, err
	}
	return f.MemoryStore.Clear(ctx)
}

func (f *fakeStore) has(key string) bool {
	_, ok, _ := f.MemoryStore.Get(context.Background(), key)
	return ok
}

var errDown = fmt.Errorf("%w: test outage", respcache.ErrUnavailable)

func TestNewTieredValidation(t *testing.T) {
	m := storetest.MustMemory(t, respcache.MemoryConfig{})
	m2 := storetest.MustMemory(t, respcache.MemoryConfig{})
	for _, tc := range []struct {
		name string
		cfg  respcache.TieredConfig
	}{
		{"no_l1", respcache.TieredConfig{L2: m}},
		{"no_l2", respcache.TieredConfig{L1: m}},
		{"same", respcache.TieredConfig{L1: m, L2: m}},
		{"negative_size", respcache.TieredConfig{L1: m, L2: m2, L1MaxValueSize: -1}},
		{"negative_promotion_ttl", respcache.TieredConfig{L1: m, L2: m2, L1PromotionTTL: -time.Second}},
		{"negative_l2_ttl", respcache.TieredConfig{L1: m, L2: m2, L2TTL: -time.Second}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := respcache.NewTiered(tc.cfg)
			require.ErrorIs(t, err, respcache.ErrInvalidConfig)
		})
	}
}

func TestTieredPromotion(t *testing.T) {
	ctx := context.Background()
	t.Run("promotes_with_promotion_ttl", func(t *testing.T) {
		clk := cachetest.NewClock(time.Time{})
		l1, l2 := newFake(t, clk.Now), newFake(t, clk.Now)
		s := storetest.MustTiered(t, respcache.TieredConfig{L1: l1, L2: l2, L1PromotionTTL: 30 * time.Minute})
		require.NoError(t, l2.Set(ctx, "k", []byte("v"), time.Hour))
		v, ok, err := s.Get(ctx, "k")
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, "v", string(v))
		require.True(t, l1.has("k"))
		require.Equal(t, 30*time.Minute, l1.ttl("k"))
		_, _, _ = s.Get(ctx, "k")
		require.Equal(t, respcache.TierCounts{L1Hits: 1, L2Hits: 1, Promotions: 1}, s.Counts())
	})
	t.Run("default_promotion_ttl", func(t *testing.T) {
		l1, l2 := newFake(t, nil), newFake(t, nil)
		s := storetest.MustTiered(t, respcache.TieredConfig{L1: l1, L2: l2})
		require.NoError(t, l2.Set(ctx, "k", []byte("v"), time.Hour))
		_, _, _ = s.Get(ctx, "k")
		require.Equal(t, respcache.DefaultL1PromotionTTL, l1.ttl("k"))
	})
	t.Run("disabled", func(t *testing.T) {
		l1, l2 := newFake(t, nil), newFake(t, nil)
		s := storetest.MustTiered(t, respcache.TieredConfig{L1: l1, L2: l2, DisablePromotion: true})
		require.NoError(t, l2.Set(ctx, "k", []byte("v"), time.Hour))
		for range 3 {
			_, ok, err := s.Get(ctx, "k")
			require.NoError(t, err)
			require.True(t, ok)
		}
		require.False(t, l1.has("k"))
		require.Equal(t, uint64(3), s.Counts().L2Hits)
	})
	t.Run("too_large_not_promoted", func(t *testing.T) {
		l1, l2 := newFake(t, nil), newFake(t, nil)
		s := storetest.MustTiered(t, respcache.TieredConfig{L1: l1, L2: l2, L1MaxValueSize: 4})
		require.NoError(t, l2.Set(ctx, "k", []byte("12345"), time.Hour))
		_, ok, _ := s.Get(ctx, "k")
		require.True(t, ok)
		require.False(t, l1.has("k"))
	})
	t.Run("racing_delete_undoes_promotion", func(t *testing.T) {
		l1, l2 := newFake(t, nil), newFake(t, nil)
		s := storetest.MustTiered(t, respcache.TieredConfig{L1: l1, L2: l2})
		require.NoError(t, l2.Set(ctx, "k", []byte("old"), time.Hour))
		once := sync.Once{}
		l2.onGet = func(key string) { // the Get has read "old"; a Delete completes before it promotes
			once.Do(func() { require.NoError(t, s.Delete(ctx, "k")) })
		}
		v, ok, err := s.Get(ctx, "k")
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, "old", string(v)) // it was a hit when read
		require.False(t, l1.has("k"), "the promotion resurrected a deleted entry")
		_, ok, _ = s.Get(ctx, "k")
		require.False(t, ok)
	})
	t.Run("racing_set_undoes_promotion", func(t *testing.T) {
		l1, l2 := newFake(t, nil), newFake(t, nil)
		s := storetest.MustTiered(t, respcache.TieredConfig{L1: l1, L2: l2})
		require.NoError(t, l2.Set(ctx, "k", []byte("old"), time.Hour))
		once := sync.Once{}
		l2.onGet = func(key string) {
			once.Do(func() { require.NoError(t, s.Set(ctx, "k", []byte("new"), time.Hour)) })
		}
		_, _, _ = s.Get(ctx, "k")
		l2.onGet = nil
		v, ok, err := s.Get(ctx, "k")
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, "new", string(v), "a stale promotion shadowed a newer Set")
	})
}

func TestTieredSet(t *testing.T) {
	ctx := context.Background()
	t.Run("both_tiers_and_l2_ttl", func(t *testing.T) {
		l1, l2 := newFake(t, nil), newFake(t, nil)
		s := storetest.MustTiered(t, respcache.TieredConfig{L1: l1, L2: l2, L2TTL: 7 * 24 * time.Hour})
		require.NoError(t, s.Set(ctx, "k", []byte("v"), time.Minute))
		require.Equal(t, time.Minute, l1.ttl("k"))
		require.Equal(t, 7*24*time.Hour, l2.ttl("k"))
		require.NoError(t, s.Set(ctx, "d", []byte("v"), 0))
		require.Equal(t, time.Duration(0), l1.ttl("d"), "ttl ≤ 0 is passed on: each tier's default")
	})
	t.Run("large_value_l2_only", func(t *testing.T) {
		l1, l2 := newFake(t, nil), newFake(t, nil)
		s := storetest.MustTiered(t, respcache.TieredConfig{L1: l1, L2: l2, L1MaxValueSize: 8})
		require.NoError(t, s.Set(ctx, "k", []byte("small"), time.Minute))
		require.True(t, l1.has("k"))
		require.NoError(t, s.Set(ctx, "k", []byte(strings.Repeat("L", 9)), time.Minute))
		require.False(t, l1.has("k"), "an older small value would shadow the large one")
		v, ok, err := s.Get(ctx, "k")
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, strings.Repeat("L", 9), string(v))
	})
	t.Run("default_max_value_size", func(t *testing.T) {
		l1, l2 := newFake(t, nil), newFake(t, nil)
		s := storetest.MustTiered(t, respcache.TieredConfig{L1: l1, L2: l2})
		require.NoError(t, s.Set(ctx, "at", make([]byte, respcache.DefaultL1MaxValueSize), time.Minute))
		require.NoError(t, s.Set(ctx, "over", make([]byte, respcache.DefaultL1MaxValueSize+1), time.Minute))
		require.True(t, l1.has("at"))
		require.False(t, l1.has("over"))
		require.True(t, l2.has("over"))
	})
}

// TestTieredFailingTier: a failing tier is counted and treated as a miss; a call fails only when
// no tier could serve it.
func TestTieredFailingTier(t *testing.T) {
	ctx := context.Background()
	l1, l2 := newFake(t, nil), newFake(t, nil)
	s := storetest.MustTiered(t, respcache.TieredConfig{L1: l1, L2: l2})
	require.NoError(t, s.Set(ctx, "k", []byte("v"), time.Minute))

	l2.fail(errDown)
	v, ok, err := s.Get(ctx, "k")
	require.NoError(t, err)
	require.True(t, ok, "L1 serves while L2 is down")
	require.Equal(t, "v", string(v))
	_, ok, err = s.Get(ctx, "absent")
	require.NoError(t, err, "an L2 error is a miss")
	require.False(t, ok)
	require.NoError(t, s.Set(ctx, "k2", []byte("v2"), time.Minute), "stored in L1: not a failure")
	require.Error(t, s.Set(ctx, "big", make([]byte, respcache.DefaultL1MaxValueSize+1), time.Minute),
		"too large for L1 and L2 down: nothing stored")
	require.ErrorIs(t, s.Delete(ctx, "k"), respcache.ErrUnavailable, "a Delete that misses a tier must say so")
	st := s.Stats(ctx)
	require.Equal(t, "tiered", st.Backend)
	require.Equal(t, uint64(4), st.Errors[respcache.ErrorTypeConnection])
	require.NotNil(t, st.L1)
	require.NotNil(t, st.L2)
	require.Equal(t, "memory", st.L1.Backend)

	l1.fail(errors.New("l1 broken"))
	_, _, err = s.Get(ctx, "k2")
	require.Error(t, err, "both tiers failed")
	require.ErrorIs(t, err, respcache.ErrUnavailable)
	require.Equal(t, uint64(1), s.Stats(ctx).Errors[respcache.ErrorTypeOther])

	l2.fail(nil)
	require.NoError(t, l2.MemoryStore.Set(ctx, "only-l2", []byte("x"), time.Minute))
	v, ok, err = s.Get(ctx, "only-l2")
	require.NoError(t, err, "L1 error + L2 hit is a hit")
	require.True(t, ok)
	require.Equal(t, "x", string(v))
	require.NoError(t, s.Set(ctx, "k3", []byte("v3"), time.Minute), "stored in L2: not a failure")
}

func TestTieredClearCount(t *testing.T) {
	ctx := context.Background()
	l1, l2 := newFake(t, nil), newFake(t, nil)
	s := storetest.MustTiered(t, respcache.TieredConfig{L1: l1, L2: l2, L1MaxValueSize: 1})
	require.NoError(t, s.Set(ctx, "a", []byte("1"), time.Minute))
	require.NoError(t, s.Set(ctx, "b", []byte("22"), time.Minute)) // L2 only
	n, err := s.Clear(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.False(t, l1.has("a"))
	require.False(t, l2.has("b"))
}
