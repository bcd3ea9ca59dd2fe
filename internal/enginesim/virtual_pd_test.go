package enginesim

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events"
)

// TestVirtualStorageHandoff follows one prompt from a prefill engine through storage to a decode
// engine: the write announces the blocks on the storage tier, the read places them on the decode
// engine's GPU, its time comes between admission and prefill, and a second write of the same
// prompt moves nothing.
func TestVirtualStorageHandoff(t *testing.T) {
	lat := Latency{Base: time.Millisecond, PerToken: time.Microsecond, PerOutputToken: 10 * time.Millisecond}
	cfg := Config{BlockSize: 16, CapacityBlocks: 64, Latency: lat, Model: "m"}
	opts := VirtualOptions{PrefillUnits: 1}
	cfg.Name = "prefill"
	p, err := NewVirtual(cfg, opts)
	require.NoError(t, err)
	cfg.Name = "decode"
	d, err := NewVirtual(cfg, opts)
	require.NoError(t, err)
	// 1 KiB per token at 1 MB/s: a 16-token block moves in 16.384 ms.
	s, err := NewVirtualStorage("m", 16, 1024, 1e6)
	require.NoError(t, err)
	block := time.Duration(16 * 1024 * float64(time.Second) / 1e6)
	t0 := time.Unix(1000, 0)
	prompt := vtokens(1, 100) // 6 full blocks and 4 tokens

	got, err := p.Submit(t0, 1, Input{Tokens: prompt, OutputTokens: 1}, nil)
	require.NoError(t, err)
	_, _ = p.TakeEvents(t0)
	w := s.Write(p, prompt)
	require.Equal(t, VirtualTransfer{Blocks: 6, Bytes: 6 * 16 * 1024, Time: 6 * block}, w)
	require.Equal(t, 6, s.Stored(prompt))
	b, ok := p.TakeEvents(got[0].FirstToken)
	require.True(t, ok)
	require.Len(t, b.Events, 1)
	require.Equal(t, events.TierStorage, b.Events[0].Tier)
	require.Equal(t, events.KindBlockStored, b.Events[0].Kind)
	require.Len(t, b.Events[0].BlockHashes, 6)
	require.Zero(t, s.Write(p, prompt).Blocks, "written once")
	_, ok = p.TakeEvents(got[0].FirstToken)
	require.False(t, ok, "announced once")

	// The decode engine reads the 6 blocks a hit may cover, then computes the last 4 tokens.
	t1 := t0.Add(time.Second)
	starts, r, err := s.Submit(d, t1, 7, Input{Tokens: prompt, OutputTokens: 3}, nil)
	require.NoError(t, err)
	require.Equal(t, 6, r.Blocks)
	require.Len(t, starts, 1)
	st := starts[0]
	require.Equal(t, 96, st.Result.CachedTokens)
	require.Equal(t, 96, st.Result.StorageTokens)
	require.Equal(t, 6*block, st.Result.StorageLoad)
	require.Equal(t, t1.Add(6*block), st.PrefillStart)
	require.Equal(t, st.PrefillStart.Add(lat.Prefill(100, 96, 0)), st.FirstToken)
	require.Equal(t, st.FirstToken.Add(30*time.Millisecond), st.Finish)
	gpu, _ := d.Lookup(prompt)
	require.Equal(t, 6, gpu)
	b, ok = d.TakeEvents(t1)
	require.True(t, ok)
	for _, ev := range b.Events {
		require.Equal(t, events.TierGPU, ev.Tier)
	}

	// A second request on the decode engine: nothing to read, and its prefill waits for the
	// compute the first one holds.
	starts, r, err = s.Submit(d, t1, 8, Input{Tokens: prompt, OutputTokens: 3}, nil)
	require.NoError(t, err)
	require.Zero(t, r.Blocks)
	require.Equal(t, st.FirstToken, starts[0].PrefillStart)

	// A queued request's read applies when Finish starts it.
	cfg.Name, cfg.MaxConcurrent = "decode-1", 1
	d1, err := NewVirtual(cfg, opts)
	require.NoError(t, err)
	other := vtokens(5000, 40)
	s.Write(p, other)
	starts, _, err = s.Submit(d1, t1, 1, Input{Tokens: vtokens(9000, 20), OutputTokens: 1}, nil)
	require.NoError(t, err)
	fin := starts[0].Finish
	starts, r, err = s.Submit(d1, t1, 2, Input{Tokens: other, OutputTokens: 1}, nil)
	require.NoError(t, err)
	require.Empty(t, starts)
	require.Equal(t, 2, r.Blocks)
	starts = s.Finish(d1, fin, 1, nil)
	require.Len(t, starts, 1)
	require.Equal(t, fin.Add(2*block), starts[0].PrefillStart)
	require.Equal(t, 2*block, starts[0].Result.StorageLoad)

	_, err = NewVirtualStorage("m", 0, 0, 0)
	require.ErrorIs(t, err, ErrInvalidConfig)
	_, err = NewVirtualStorage("m", 16, 0, -1)
	require.ErrorIs(t, err, ErrInvalidConfig)
}
