package scorer

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestNewPrepareCache(t *testing.T) {
	tests := []struct {
		name    string
		cfg     PrepareConfig
		ttl     time.Duration
		shards  int
		wantErr bool
	}{
		{name: "defaults", ttl: DefaultPrepareTTL, shards: prepareShards},
		{name: "small", cfg: PrepareConfig{TTL: time.Second, Size: 2}, ttl: time.Second, shards: 1},
		{name: "medium", cfg: PrepareConfig{Size: 256}, ttl: DefaultPrepareTTL, shards: 4},
		{name: "negative TTL", cfg: PrepareConfig{TTL: -1}, wantErr: true},
		{name: "negative size", cfg: PrepareConfig{Size: -1}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := NewPrepareCache[int](tt.cfg)
			if tt.wantErr {
				if !errors.Is(err, ErrInvalidConfig) {
					t.Fatalf("err = %v, want ErrInvalidConfig", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.ttl != tt.ttl || len(c.shards) != tt.shards {
				t.Errorf("ttl, shards = %v, %d, want %v, %d", c.ttl, len(c.shards), tt.ttl, tt.shards)
			}
		})
	}
}

// counter returns a fetch that counts its calls and answers value, err.
func counter(n *atomic.Int64, value int, err error) func(context.Context) (int, error) {
	return func(context.Context) (int, error) {
		n.Add(1)
		return value, err
	}
}

func TestPrepareCacheTTL(t *testing.T) {
	clk := newFakeClock()
	c, err := NewPrepareCache[int](PrepareConfig{TTL: 100 * time.Millisecond, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var n atomic.Int64
	steps := []struct {
		advance time.Duration
		key     uint64
		value   int
		want    int
		fetches int64
	}{
		{key: 1, value: 10, want: 10, fetches: 1},
		{advance: 99 * time.Millisecond, key: 1, value: 11, want: 10, fetches: 1}, // fresh: cached
		{key: 2, value: 20, want: 20, fetches: 2},                                 // another key
		{advance: time.Millisecond, key: 1, value: 12, want: 12, fetches: 3},      // 100 ms old: stale
		{key: 1, value: 13, want: 12, fetches: 3},
	}
	for i, s := range steps {
		clk.Advance(s.advance)
		got, err := c.Get(ctx, s.key, counter(&n, s.value, nil))
		if err != nil || got != s.want || n.Load() != s.fetches {
			t.Errorf("step %d: Get = %d, %v with %d fetches, want %d, nil with %d", i, got, err, n.Load(), s.want, s.fetches)
		}
	}
}

func TestPrepareCacheErrorsNotCached(t *testing.T) {
	c, _ := NewPrepareCache[int](PrepareConfig{})
	ctx := context.Background()
	boom := errors.New("boom")
	var n atomic.Int64
	for i := range 3 {
		if _, err := c.Get(ctx, 7, counter(&n, 0, boom)); !errors.Is(err, boom) {
			t.Fatalf("call %d: err = %v, want boom", i, err)
		}
	}
	if n.Load() != 3 {
		t.Errorf("fetches = %d, want 3 (errors must not be cached)", n.Load())
	}
	if v, err := c.Get(ctx, 7, counter(&n, 5, nil)); v != 5 || err != nil {
		t.Errorf("Get = %d, %v, want 5, nil", v, err)
	}
}

func TestPrepareCacheSingleflight(t *testing.T) {
	c, _ := NewPrepareCache[int](PrepareConfig{TTL: time.Hour})
	ctx := context.Background()
	var n atomic.Int64
	started, release := make(chan struct{}), make(chan struct{})
	fetch := func(context.Context) (int, error) {
		if n.Add(1) == 1 {
			close(started)
		}
		<-release
		return 42, nil
	}
	const callers = 16
	var wg sync.WaitGroup
	results := make([]int, callers)
	wg.Go(func() { results[0], _ = c.Get(ctx, 9, fetch) })
	<-started
	for i := 1; i < callers; i++ {
		wg.Go(func() { results[i], _ = c.Get(ctx, 9, fetch) })
	}
	close(release)
	wg.Wait()
	if n.Load() != 1 {
		t.Errorf("fetches = %d, want 1", n.Load())
	}
	for i, r := range results {
		if r != 42 {
			t.Errorf("caller %d got %d, want 42", i, r)
		}
	}
}

func TestPrepareCacheWaiterContext(t *testing.T) {
	c, _ := NewPrepareCache[int](PrepareConfig{TTL: time.Hour})
	started, release := make(chan struct{}), make(chan struct{})
	leaderDone := make(chan error, 1)
	go func() {
		_, err := c.Get(context.Background(), 3, func(context.Context) (int, error) {
			close(started)
			<-release
			return 1, nil
		})
		leaderDone <- err
	}()
	<-started
	// A waiter whose context has ended returns at once, without harming the leader.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := c.Get(ctx, 3, func(context.Context) (int, error) {
		t.Error("waiter ran fetch")
		return 0, nil
	}); !errors.Is(err, context.Canceled) {
		t.Errorf("waiter err = %v, want context.Canceled", err)
	}
	close(release)
	if err := <-leaderDone; err != nil {
		t.Errorf("leader err = %v", err)
	}
	if v, err := c.Get(context.Background(), 3, nil); v != 1 || err != nil {
		t.Errorf("cached Get = %d, %v, want 1, nil", v, err)
	}
}

func TestPrepareCacheLeaderCancelled(t *testing.T) {
	c, _ := NewPrepareCache[int](PrepareConfig{TTL: time.Hour})
	leaderCtx, cancelLeader := context.WithCancel(context.Background())
	started := make(chan struct{})
	leaderErr := make(chan error, 1)
	go func() {
		_, err := c.Get(leaderCtx, 4, func(ctx context.Context) (int, error) {
			close(started)
			<-ctx.Done()
			return 0, ctx.Err()
		})
		leaderErr <- err
	}()
	<-started
	waiter := make(chan int, 1)
	go func() {
		v, err := c.Get(context.Background(), 4, func(context.Context) (int, error) { return 8, nil })
		if err != nil {
			t.Errorf("waiter err = %v, want nil: the leader's cancellation must not leak", err)
		}
		waiter <- v
	}()
	cancelLeader()
	if err := <-leaderErr; !errors.Is(err, context.Canceled) {
		t.Errorf("leader err = %v, want context.Canceled", err)
	}
	if v := <-waiter; v != 8 {
		t.Errorf("waiter got %d, want 8", v)
	}
}

func TestPrepareCachePanic(t *testing.T) {
	c, _ := NewPrepareCache[int](PrepareConfig{})
	func() {
		defer func() {
			if recover() == nil {
				t.Error("panic not propagated to the leader")
			}
		}()
		_, _ = c.Get(context.Background(), 5, func(context.Context) (int, error) { panic("fetch bug") })
	}()
	v, err := c.Get(context.Background(), 5, func(context.Context) (int, error) { return 6, nil })
	if v != 6 || err != nil {
		t.Errorf("Get after panic = %d, %v, want 6, nil", v, err)
	}
}

func TestPrepareCacheBounded(t *testing.T) {
	c, _ := NewPrepareCache[int](PrepareConfig{Size: 2, TTL: time.Hour})
	ctx := context.Background()
	var n atomic.Int64
	for k := range uint64(3) {
		_, _ = c.Get(ctx, k, counter(&n, int(k), nil))
	}
	if c.Len() != 2 {
		t.Errorf("Len = %d, want 2", c.Len())
	}
	_, _ = c.Get(ctx, 0, counter(&n, 0, nil)) // least recently used: evicted
	if n.Load() != 4 {
		t.Errorf("fetches = %d, want 4", n.Load())
	}
}

func TestPrepareCacheConcurrent(t *testing.T) {
	c, _ := NewPrepareCache[uint64](PrepareConfig{Size: 64, TTL: time.Millisecond})
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 500 {
				key := uint64((g + i) % 100)
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				v, err := c.Get(ctx, key, func(ctx context.Context) (uint64, error) {
					if i%17 == 0 {
						return 0, errors.New("flaky")
					}
					return key * 3, nil
				})
				cancel()
				if err == nil && v != key*3 {
					t.Errorf("Get(%d) = %d", key, v)
				}
			}
		})
	}
	wg.Wait()
}

func TestPrepareCacheHitAllocs(t *testing.T) {
	c, _ := NewPrepareCache[[]int](PrepareConfig{TTL: time.Hour})
	ctx := context.Background()
	fetch := func(context.Context) ([]int, error) { return []int{1, 2}, nil }
	_, _ = c.Get(ctx, 1, fetch)
	assertNoAllocs(t, func() { _, _ = c.Get(ctx, 1, fetch) })
}
