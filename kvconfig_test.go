package kvroute

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/scorer"
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

// trackedScorer is the default scorer with a tracker of active sequences: a scorer of one's own
// that reads the Candidate.Active* fields implements scorer.SequenceTracker so.
type trackedScorer struct {
	*scorer.ExpectedTTFT
	active *scorer.Active
}

func (s trackedScorer) Sequences() *scorer.Active { return s.active }

// tracked returns a trackedScorer and its tracker.
func tracked(t testing.TB) (scorer.BackendScorer, *scorer.Active) {
	t.Helper()
	e, err := scorer.NewExpectedTTFT(scorer.ExpectedTTFTConfig{})
	require.NoError(t, err)
	a, err := scorer.NewActive(scorer.ActiveConfig{})
	require.NoError(t, err)
	return trackedScorer{e, a}, a
}

// The attention cost: the scorer's own when KVConfig leaves it 0; a KVConfig value that differs
// from the scorer's is refused; the default scorer takes KVConfig's.
func TestKVAttentionCostFromTheScorer(t *testing.T) {
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: testModel})
	require.NoError(t, err)
	t.Cleanup(func() { ix.Close() })
	sc, err := scorer.NewExpectedTTFT(scorer.ExpectedTTFTConfig{AttentionCost: 4e-5})
	require.NoError(t, err)

	r, err := New(Config{Backends: backends(1), KV: &KVConfig{Index: ix, Scorer: sc}})
	require.NoError(t, err)
	assert.Equal(t, 4e-5, r.kv.attn)
	r.Close()

	_, err = New(Config{Backends: backends(1), KV: &KVConfig{Index: ix, Scorer: sc, AttentionCost: 2e-5}})
	require.ErrorIs(t, err, ErrInvalidConfig)

	r, err = New(Config{Backends: backends(1), KV: &KVConfig{Index: ix, AttentionCost: 3e-5}})
	require.NoError(t, err)
	assert.Equal(t, 3e-5, r.kv.attn)
	assert.Equal(t, 3e-5, r.kv.scorer.(scorer.AttentionCoster).AttentionCost(), "the default scorer takes KVConfig's")
	r.Close()

	comp, err := scorer.NewComposite(scorer.CompositeConfig{})
	require.NoError(t, err)
	r, err = New(Config{Backends: backends(1), KV: &KVConfig{Index: ix, Scorer: comp}})
	require.NoError(t, err)
	assert.Equal(t, scorer.DefaultAttentionCost, r.kv.attn, "a scorer without a cost model: the default")
	r.Close()
}
