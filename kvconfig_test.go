package kvroute

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/kvindex"
)

// bareIndex is an index of one's own that implements Lookup alone.
type bareIndex struct{}

func (bareIndex) Lookup(_ context.Context, _ []uint64, _ []string, out []kvindex.Match) ([]kvindex.Match, error) {
	return out, nil
}

func TestKVBlockSizeMustMatchTheIndex(t *testing.T) {
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: testModel, BlockSize: 32})
	require.NoError(t, err)
	t.Cleanup(func() { ix.Close() })

	_, err = New(Config{Backends: backends(2), KV: &KVConfig{Index: ix, BlockSize: 16}})
	require.ErrorIs(t, err, ErrInvalidConfig)
	assert.ErrorContains(t, err, "KV.BlockSize 16 differs from the index's block size 32")

	r, err := New(Config{Backends: backends(2), KV: &KVConfig{Index: ix}})
	require.NoError(t, err, "0 takes the index's block size")
	defer r.Close()
	assert.Equal(t, 32, r.kv.cfg.BlockSize)

	r2, err := New(Config{Backends: backends(2), KV: &KVConfig{Index: ix, BlockSize: 32}})
	require.NoError(t, err)
	r2.Close()

	// An index that does not report its block size is taken at its word.
	r3, err := New(Config{Backends: backends(2), KV: &KVConfig{Index: bareIndex{}, BlockSize: 64}})
	require.NoError(t, err)
	defer r3.Close()
	assert.Equal(t, 64, r3.kv.cfg.BlockSize)
}

func TestKVSpeculationAuto(t *testing.T) {
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: testModel})
	require.NoError(t, err)
	t.Cleanup(func() { ix.Close() })

	r, err := New(Config{Backends: backends(2), KV: &KVConfig{Index: ix}})
	require.NoError(t, err)
	defer r.Close()
	assert.Equal(t, SpeculationOn, r.kv.cfg.Speculation, "an index that speculates: on")

	r2, err := New(Config{Backends: backends(2), KV: &KVConfig{Index: bareIndex{}}})
	require.NoError(t, err, "the zero KVConfig works with a Lookuper-only index")
	defer r2.Close()
	assert.Equal(t, SpeculationOff, r2.kv.cfg.Speculation)

	_, err = New(Config{Backends: backends(2), KV: &KVConfig{Index: bareIndex{}, Speculation: SpeculationApproximate}})
	require.ErrorIs(t, err, ErrInvalidConfig, "approximate needs a kvindex.Speculator")
}

func TestSpeculationText(t *testing.T) {
	for _, m := range []Speculation{SpeculationAuto, SpeculationOn, SpeculationOff, SpeculationApproximate} {
		b, err := m.MarshalText()
		require.NoError(t, err)
		var back Speculation
		require.NoError(t, back.UnmarshalText(b))
		assert.Equal(t, m, back)
	}
	var s Speculation
	assert.Error(t, s.UnmarshalText([]byte("sometimes")))
	_, err := Speculation(9).MarshalText()
	assert.Error(t, err)
}
