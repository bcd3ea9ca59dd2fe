package enginesim

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

// vtokens returns n tokens start, start+1, ….
func vtokens(start, n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(start + i)
	}
	return t
}

func newTestVirtual(t *testing.T, cfg Config) *VirtualEngine {
	t.Helper()
	v, err := NewVirtual(cfg, VirtualOptions{})
	require.NoError(t, err)
	return v
}

func TestVirtualPrefixHitAndLatency(t *testing.T) {
	lat := Latency{Base: time.Millisecond, PerToken: time.Microsecond, PerOutputToken: 10 * time.Millisecond}
	v := newTestVirtual(t, Config{CapacityBlocks: 64, Latency: lat})
	t0 := time.Unix(1000, 0)
	prompt := vtokens(1, 100) // 6 full blocks and 4 tokens

	got, err := v.Submit(t0, 1, Input{Tokens: prompt, OutputTokens: 5}, nil)
	require.NoError(t, err)
	require.Len(t, got, 1)
	s := got[0]
	require.Equal(t, uint64(1), s.ID)
	require.Equal(t, 0, s.Result.CachedTokens)
	require.Equal(t, lat.Prefill(100, 0, 0), s.Result.Prefill)
	require.Equal(t, t0.Add(s.Result.Prefill), s.FirstToken)
	require.Equal(t, s.FirstToken.Add(50*time.Millisecond), s.Finish)

	t1 := s.Finish
	require.Empty(t, v.Finish(t1, 1, nil))
	got, err = v.Submit(t1, 2, Input{Tokens: prompt, OutputTokens: 5}, nil)
	require.NoError(t, err)
	require.Equal(t, 96, got[0].Result.CachedTokens, "6 full blocks cached")
	require.Equal(t, lat.Prefill(100, 96, 0), got[0].Result.Prefill)

	// A prompt of exactly 4 blocks reuses at most 3: the last token is always computed.
	v2 := newTestVirtual(t, Config{CapacityBlocks: 64})
	four := vtokens(500, 64)
	_, err = v2.Submit(t0, 1, Input{Tokens: four}, nil)
	require.NoError(t, err)
	got, err = v2.Submit(t0, 2, Input{Tokens: four}, nil)
	require.NoError(t, err)
	require.Equal(t, 48, got[0].Result.CachedTokens)
}

func TestVirtualQueueing(t *testing.T) {
	t.Run("concurrency limit", func(t *testing.T) {
		v := newTestVirtual(t, Config{CapacityBlocks: 64, MaxConcurrent: 1})
		t0 := time.Unix(0, 0)
		a, err := v.Submit(t0, 1, Input{Tokens: vtokens(0, 32), OutputTokens: 2}, nil)
		require.NoError(t, err)
		require.Len(t, a, 1)
		b, err := v.Submit(t0.Add(time.Millisecond), 2, Input{Tokens: vtokens(1000, 32), OutputTokens: 2}, nil)
		require.NoError(t, err)
		require.Empty(t, b, "waits behind the running request")
		require.Equal(t, 1, v.Stats().Waiting)
		started := v.Finish(a[0].Finish, 1, nil)
		require.Len(t, started, 1)
		require.Equal(t, uint64(2), started[0].ID)
		require.Equal(t, a[0].Finish, started[0].Start)
		require.Equal(t, a[0].Finish.Sub(t0.Add(time.Millisecond)), started[0].Result.Queued)
	})
	t.Run("cache full", func(t *testing.T) {
		v := newTestVirtual(t, Config{CapacityBlocks: 8})
		t0 := time.Unix(0, 0)
		a, err := v.Submit(t0, 1, Input{Tokens: vtokens(0, 80), OutputTokens: 16}, nil) // 6 blocks
		require.NoError(t, err)
		require.Len(t, a, 1)
		b, err := v.Submit(t0, 2, Input{Tokens: vtokens(1000, 48)}, nil) // 3 blocks: does not fit
		require.NoError(t, err)
		require.Empty(t, b)
		require.Len(t, v.Finish(a[0].Finish, 1, nil), 1)
	})
	t.Run("rejections", func(t *testing.T) {
		v := newTestVirtual(t, Config{CapacityBlocks: 4, MaxConcurrent: 1, MaxQueue: -1})
		t0 := time.Unix(0, 0)
		_, err := v.Submit(t0, 1, Input{Tokens: vtokens(0, 100)}, nil)
		require.ErrorIs(t, err, ErrTooLong)
		_, err = v.Submit(t0, 2, Input{Tokens: vtokens(0, 20)}, nil)
		require.NoError(t, err)
		_, err = v.Submit(t0, 3, Input{Tokens: vtokens(0, 20)}, nil)
		require.True(t, errors.Is(err, ErrOverloaded))
		require.Equal(t, uint64(2), v.Stats().Rejected)
	})
}

func TestVirtualSerialPrefill(t *testing.T) {
	lat := Latency{Base: 100 * time.Millisecond, PerOutputToken: 10 * time.Millisecond}
	v, err := NewVirtual(Config{CapacityBlocks: 64, Latency: lat}, VirtualOptions{PrefillUnits: 1})
	require.NoError(t, err)
	t0 := time.Unix(0, 0)
	var got []VirtualStart
	for i := range 3 {
		got, err = v.Submit(t0.Add(time.Duration(i)*10*time.Millisecond), uint64(i), Input{Tokens: vtokens(1000*i, 20), OutputTokens: 10}, got)
		require.NoError(t, err)
	}
	require.Len(t, got, 3, "all admitted at once: memory and slots suffice")
	for i, s := range got {
		// Prefills run back to back; decodes overlap.
		require.Equal(t, t0.Add(time.Duration(i)*100*time.Millisecond), s.PrefillStart, "request %d", i)
		require.Equal(t, s.PrefillStart.Add(100*time.Millisecond), s.FirstToken)
		require.Equal(t, s.FirstToken.Add(100*time.Millisecond), s.Finish)
		require.Equal(t, s.PrefillStart.Sub(s.Start.Add(0)), s.Result.Queued)
	}
	// The prefills admitted and not yet run are owed: the unit frees at 300 ms.
	require.Equal(t, 280*time.Millisecond, v.Backlog(t0.Add(20*time.Millisecond)))
	// The compute is free again after the last prefill: a late request starts at once.
	late := t0.Add(time.Second)
	require.Zero(t, v.Backlog(late))
	got, err = v.Submit(late, 9, Input{Tokens: vtokens(9000, 20)}, got[:0])
	require.NoError(t, err)
	require.Equal(t, late, got[0].PrefillStart)
	require.Zero(t, got[0].Result.Queued)

	// Two units: the third prefill waits for the first to end.
	v2, err := NewVirtual(Config{CapacityBlocks: 64, Latency: lat}, VirtualOptions{PrefillUnits: 2})
	require.NoError(t, err)
	got = got[:0]
	for i := range 3 {
		got, err = v2.Submit(t0, uint64(i), Input{Tokens: vtokens(1000*i, 20)}, got)
		require.NoError(t, err)
	}
	require.Equal(t, []time.Time{t0, t0, t0.Add(100 * time.Millisecond)},
		[]time.Time{got[0].PrefillStart, got[1].PrefillStart, got[2].PrefillStart})
	require.Equal(t, 100*time.Millisecond, v2.Backlog(t0), "the unit that frees first")

	// A request waiting for a slot owes its prefill too.
	v3, err := NewVirtual(Config{CapacityBlocks: 64, MaxConcurrent: 1, Latency: lat}, VirtualOptions{PrefillUnits: 1})
	require.NoError(t, err)
	got, err = v3.Submit(t0, 1, Input{Tokens: vtokens(1000, 20), OutputTokens: 10}, got[:0])
	require.NoError(t, err)
	got, err = v3.Submit(t0, 2, Input{Tokens: vtokens(2000, 20), OutputTokens: 10}, got)
	require.NoError(t, err)
	require.Len(t, got, 1, "the second waits for the slot")
	require.Equal(t, 200*time.Millisecond, v3.Backlog(t0))
	_, err = NewVirtual(Config{}, VirtualOptions{PrefillUnits: -1})
	require.ErrorIs(t, err, ErrInvalidConfig)
}

// TestVirtualEventsFeedIndex checks that the batches a VirtualEngine hands over, applied to
// kvroute's index, make the index report what the engine really holds, through stores and
// evictions.
func TestVirtualEventsFeedIndex(t *testing.T) {
	const model = "m"
	v := newTestVirtual(t, Config{Model: model, CapacityBlocks: 24})
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: model, SweepInterval: -1})
	require.NoError(t, err)
	defer ix.Close()
	ctx := context.Background()
	now := time.Unix(0, 0)
	root := prefixkey.BlockRoot(model, "")
	var seq uint64
	var removed int
	for i := range 12 {
		prompt := append(vtokens(0, 64), vtokens(10_000*(i+1), 48)...) // a shared 4-block prefix
		st, err := v.Submit(now, uint64(i), Input{Tokens: prompt, OutputTokens: 1}, nil)
		require.NoError(t, err)
		require.Len(t, st, 1)
		if i > 0 {
			require.Equal(t, 64, st[0].Result.CachedTokens)
		}
		now = st[0].Finish
		v.Finish(now, uint64(i), nil)
		b, ok := v.TakeBatch(now)
		require.True(t, ok)
		require.Equal(t, seq, b.Seq)
		seq++
		for _, ev := range b.Events {
			if ev.Kind == events.KindBlockRemoved {
				removed += len(ev.BlockHashes)
			}
		}
		require.NoError(t, ix.Apply(ctx, "e", &b))

		keys := prefixkey.AppendBlockKeys(nil, root, prompt, 16, nil)
		m, err := ix.Lookup(ctx, keys, []string{"e"}, make([]kvindex.Match, 1))
		require.NoError(t, err)
		_, cached := v.Lookup(prompt)
		require.Equal(t, cached, m[0].Blocks, "request %d", i)
		require.Equal(t, 7, cached)
	}
	require.Positive(t, removed, "a 24-block cache evicted")
	require.Equal(t, uint64(removed), v.Stats().Evictions)
	_, ok := v.TakeBatch(now)
	require.False(t, ok)
}
