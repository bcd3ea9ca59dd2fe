package kvindex

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/prefixkey"
)

// exported is an index's Export, per backend, with the records copied.
type exported map[string][]StateRecord

func exportAll(t testing.TB, m *MemoryIndex) exported {
	t.Helper()
	out := exported{}
	require.NoError(t, m.Export(context.Background(), func(backend string, r *StateRecord) error {
		c := *r
		c.Keys = slices.Clone(r.Keys)
		out[backend] = append(out[backend], c)
		return nil
	}))
	return out
}

func (e exported) restoreInto(t testing.TB, m *MemoryIndex) {
	t.Helper()
	for backend, recs := range e {
		require.NoError(t, m.Restore(context.Background(), backend, recs))
	}
}

// restoreScenario is a fleet's history: blocks stored on several tiers and backends, engine blocks
// of two index blocks, blocks removed, prefix entries.
func restoreScenario(t testing.TB, m *MemoryIndex) {
	t.Helper()
	ctx := context.Background()
	storeChain(t, m, "a", testTokens(1, 40*16), 1000, events.TierGPU)
	storeChain(t, m, "b", testTokens(1, 24*16), 5000, events.TierGPU)
	storeChain(t, m, "b", testTokens(2, 8*16), 6000, events.TierStorage)
	apply := func(backend string, evs ...events.Event) {
		require.NoError(t, m.Apply(ctx, backend, &events.Batch{Model: testModel, Events: evs}))
	}
	// b offloads its first 4 blocks to CPU, then evicts blocks 20..23 from the GPU.
	apply("b", events.Event{Kind: events.KindBlockStored, BlockHashes: []uint64{5000, 5001, 5002, 5003}, Tier: events.TierCPU},
		events.Event{Kind: events.KindBlockRemoved, BlockHashes: []uint64{5020, 5021, 5022, 5023}})
	// c has engine blocks of 32 tokens: two index blocks each.
	toks := testTokens(3, 12*16)
	apply("c", events.Event{Kind: events.KindBlockStored, BlockHashes: []uint64{1, 2, 3}, TokenIDs: toks[:6*16], BlockSize: 32})
	apply("c", events.Event{Kind: events.KindBlockStored, BlockHashes: []uint64{4, 5, 6}, TokenIDs: toks[6*16:], BlockSize: 32,
		Parent: 3, HasParent: true})
	apply("c", events.Event{Kind: events.KindPrefix, PrefixOp: events.PrefixCreated, PrefixHash: "abcd", TokenCount: 256})
}

// restoreFollowUp is what the fleet does after the snapshot: chains continued from blocks stored
// before it (by their engine hashes), and removals of blocks stored before it.
func restoreFollowUp(t testing.TB, m *MemoryIndex) {
	t.Helper()
	ctx := context.Background()
	toksA := testTokens(1, 48*16)
	apply := func(backend string, evs ...events.Event) {
		require.NoError(t, m.Apply(ctx, backend, &events.Batch{Model: testModel, Events: evs}))
	}
	apply("a", events.Event{Kind: events.KindBlockStored, BlockHashes: []uint64{1040, 1041, 1042, 1043, 1044, 1045, 1046, 1047},
		TokenIDs: toksA[40*16:], BlockSize: 16, Parent: 1039, HasParent: true})
	apply("b", events.Event{Kind: events.KindBlockRemoved, BlockHashes: []uint64{5016, 5017, 5018, 5019}})
	apply("c", events.Event{Kind: events.KindBlockRemoved, BlockHashes: []uint64{6}}) // both index blocks of 6
	toksC := testTokens(3, 14*16)
	apply("c", events.Event{Kind: events.KindBlockStored, BlockHashes: []uint64{7}, TokenIDs: toksC[12*16:], BlockSize: 32,
		Parent: 5, HasParent: true})
}

// lookups answers, for the scenario's requests, every backend's match.
func lookups(t testing.TB, m *MemoryIndex) []Match {
	t.Helper()
	var out []Match
	names := []string{"a", "b", "c", "d"}
	for _, toks := range [][]uint32{testTokens(1, 48*16), testTokens(2, 8*16), testTokens(3, 14*16)} {
		keys := prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot(testModel, ""), toks, DefaultBlockSize, nil)
		res, err := m.Lookup(context.Background(), keys, names, make([]Match, len(names)))
		require.NoError(t, err)
		out = append(out, res...)
	}
	res, err := m.LookupPrefix(context.Background(), "abcd", names, make([]Match, len(names)))
	require.NoError(t, err)
	return append(out, res...)
}

// A restored index answers like the one exported, before and after both apply the same later
// events — continuations of chains stored before the snapshot and removals of their blocks —
// for a single-shard table (keys from the engine-hash maps) and a sharded one, with the
// backends' own engine-hash maps and with the shared one.
func TestMemoryRestoreRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		name   string
		cfg    MemoryConfig
		shared bool
	}{
		{"sharded", MemoryConfig{LookupStride: 1}, false},
		{"one_shard", MemoryConfig{MaxEntries: 4096, LookupStride: 1}, false},
		{"jump_search", MemoryConfig{}, false},
		{"sharded_shared_engines", MemoryConfig{LookupStride: 1}, true},
		{"one_shard_shared_engines", MemoryConfig{MaxEntries: 4096, LookupStride: 1}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src, _ := newTestIndex(t, tc.cfg)
			src.reg.shareAll = tc.shared
			restoreScenario(t, src)
			snap := exportAll(t, src)
			require.Len(t, snap, 3)

			dst, _ := newTestIndex(t, tc.cfg)
			dst.reg.shareAll = tc.shared
			snap.restoreInto(t, dst)
			checkConsistency(t, dst)
			assert.Equal(t, lookups(t, src), lookups(t, dst), "after restore")
			want := lookups(t, src)
			assert.Equal(t, 40, want[0].Blocks, "a holds its 40 blocks")
			assert.Equal(t, 8, want[4+1].StoredBlocks, "b holds the second request on storage")

			restoreFollowUp(t, src)
			restoreFollowUp(t, dst)
			checkConsistency(t, dst)
			got := lookups(t, dst)
			assert.Equal(t, lookups(t, src), got, "after the same later events")
			assert.Equal(t, 48, got[0].Blocks, "a's chain continued from a restored parent")
			assert.Equal(t, 16, got[1].Blocks, "b's removed blocks stay removed")
			assert.Equal(t, 10, got[8+2].Blocks, "c's engine block 6 removed; 7 follows 5 with other tokens")

			s, err := dst.Stats(context.Background())
			require.NoError(t, err)
			assert.Zero(t, s.Dropped[DropUnknownBlock.String()], "every removal found its block")
			assert.Zero(t, s.Dropped[DropUnknownParent.String()], "every continuation found its parent")
		})
	}
}

// Exporting a restored index lists what the first one listed: nothing is lost in a second round.
func TestMemoryRestoreExportStable(t *testing.T) {
	src, _ := newTestIndex(t, MemoryConfig{})
	restoreScenario(t, src)
	first := exportAll(t, src)
	dst, _ := newTestIndex(t, MemoryConfig{})
	first.restoreInto(t, dst)
	second := exportAll(t, dst)
	for backend, recs := range first {
		assert.ElementsMatch(t, recs, second[backend], backend)
	}
}

// Restored entries keep their remaining lifetime: they expire when the exported ones would have.
func TestMemoryRestoreKeepsExpiry(t *testing.T) {
	cfg := MemoryConfig{EntryTTL: 64 * time.Second}
	src, clk := newTestIndex(t, cfg)
	toks := testTokens(9, 4*16)
	keys := testKeys(toks)
	storeChain(t, src, "a", toks, 1, events.TierGPU)
	clk.Advance(40 * time.Second)
	snap := exportAll(t, src)

	dst, err := NewMemory(MemoryConfig{DefaultModel: testModel, EntryTTL: 64 * time.Second, SweepInterval: -1, Now: clk.Now})
	require.NoError(t, err)
	defer dst.Close()
	snap.restoreInto(t, dst)
	assert.Equal(t, []int{4}, blocksOf(t, dst, keys, "a"))
	clk.Advance(20 * time.Second)
	assert.Equal(t, []int{4}, blocksOf(t, dst, keys, "a"), "60 s after the store")
	clk.Advance(6 * time.Second)
	assert.Equal(t, []int{0}, blocksOf(t, src, keys, "a"), "the source expired")
	assert.Equal(t, []int{0}, blocksOf(t, dst, keys, "a"), "the restored index expired with it")

	// An expired snapshot restores nothing; a zero expiry means a full EntryTTL.
	late, lateClk := newTestIndex(t, cfg)
	require.NoError(t, late.Restore(context.Background(), "a", []StateRecord{
		{Kind: StateBlock, Key: keys[0], Tiers: TierSetOf(events.TierGPU), Expires: lateClk.Now().Add(-time.Second)},
	}))
	assert.Equal(t, []int{0}, blocksOf(t, late, keys, "a"))
	require.NoError(t, late.Restore(context.Background(), "a", []StateRecord{
		{Kind: StateBlock, Key: keys[0], Tiers: TierSetOf(events.TierCPU)},
		{Kind: StateBlock, Key: keys[1], Tiers: 0}, // no tier: skipped
		{Kind: 99, Key: keys[1]},                   // unknown kind: skipped
	}))
	assert.Equal(t, []int{1}, blocksOf(t, late, keys, "a"))
	checkConsistency(t, late)
}

// Restoring a block the backend predicted (Speculate) confirms it; a block it holds already keeps
// its tiers and gains the restored ones.
func TestMemoryRestoreMerges(t *testing.T) {
	m, _ := newTestIndex(t, MemoryConfig{})
	ctx := context.Background()
	toks := testTokens(4, 2*16)
	keys := testKeys(toks)
	require.NoError(t, m.Speculate(ctx, "a", keys[:1], 0))
	storeChain(t, m, "a", toks[16:], 50, events.TierGPU) // another chain: keys differ
	require.NoError(t, m.Restore(ctx, "a", []StateRecord{
		{Kind: StateBlock, Key: keys[0], Tiers: TierSetOf(events.TierGPU, events.TierStorage)},
		{Kind: StateBlock, Key: keys[1], Parent: keys[0], Tiers: TierSetOf(events.TierGPU)},
	}))
	checkConsistency(t, m)
	s, err := m.Stats(ctx)
	require.NoError(t, err)
	assert.Zero(t, s.SpeculativeCount, "the prediction was confirmed")
	res, err := m.Lookup(ctx, keys, []string{"a"}, make([]Match, 1))
	require.NoError(t, err)
	assert.Equal(t, 2, res[0].Blocks)
	assert.Equal(t, 1, res[0].StoredBlocks)
}

func TestMemoryRestoreErrors(t *testing.T) {
	m, _ := newTestIndex(t, MemoryConfig{})
	recs := make([]StateRecord, 3000)
	for i := range recs {
		recs[i] = StateRecord{Kind: StateBlock, Key: uint64(i + 1), Tiers: TierSetOf(events.TierGPU)}
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	assert.ErrorIs(t, m.Restore(ctx, "a", recs), context.Canceled)
	require.NoError(t, m.Close())
	assert.ErrorIs(t, m.Restore(context.Background(), "a", recs), ErrClosed)
	assert.ErrorIs(t, m.Export(context.Background(), func(string, *StateRecord) error { return nil }), ErrClosed)

	// fn's error stops Export.
	m2, _ := newTestIndex(t, MemoryConfig{})
	restoreScenario(t, m2)
	stop := errors.New("stop")
	n := 0
	assert.ErrorIs(t, m2.Export(context.Background(), func(string, *StateRecord) error { n++; return stop }), stop)
	assert.Equal(t, 1, n)

	// A backend beyond MaxBackends is counted as dropped.
	m3, _ := newTestIndex(t, MemoryConfig{MaxBackends: 1})
	require.NoError(t, m3.Restore(context.Background(), "a", recs[:1]))
	require.NoError(t, m3.Restore(context.Background(), "b", recs[:2]))
	s, err := m3.Stats(context.Background())
	require.NoError(t, err)
	assert.Equal(t, uint64(2), s.Dropped[DropTooManyBackends.String()])
}

func TestTierSet(t *testing.T) {
	s := TierSetOf(events.TierGPU, events.TierStorage, 7)
	assert.True(t, s.Has(events.TierGPU))
	assert.False(t, s.Has(events.TierCPU))
	assert.True(t, s.Has(events.TierStorage))
	assert.False(t, s.Has(9))
	assert.Equal(t, []Tier{events.TierGPU, events.TierStorage}, s.Tiers())
	assert.Empty(t, TierSet(0).Tiers())
	for _, k := range []StateKind{StateBlock, StateEngineHash, StatePrefix, 0} {
		assert.NotEmpty(t, k.String())
	}
	var called bool
	_ = RestorerFunc(func(context.Context, string, []StateRecord) error { called = true; return nil }).Restore(context.Background(), "", nil)
	assert.True(t, called)
}

// BenchmarkMemoryRestore restores a backend's blocks and engine hashes (one hash per block, as
// vLLM's 16-token blocks give) into an empty index.
func BenchmarkMemoryRestore(b *testing.B) {
	for _, n := range []int{1_000, 100_000} {
		b.Run(fmt.Sprintf("blocks=%d", n), func(b *testing.B) {
			toks := testTokens(5, n*16)
			keys := testKeys(toks)
			exp := time.Now().Add(5 * time.Minute)
			recs := make([]StateRecord, 0, 2*n)
			for i, k := range keys {
				r := StateRecord{Kind: StateBlock, Key: k, Tiers: TierSetOf(events.TierGPU), Expires: exp}
				if i > 0 {
					r.Parent = keys[i-1]
				}
				recs = append(recs, r)
			}
			for i := range keys {
				recs = append(recs, StateRecord{Kind: StateEngineHash, Hash: uint64(i + 1), Keys: keys[i : i+1 : i+1]})
			}
			b.ReportAllocs()
			for b.Loop() {
				b.StopTimer()
				m, err := NewMemory(MemoryConfig{DefaultModel: testModel, SweepInterval: -1})
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				if err := m.Restore(context.Background(), "a", recs); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				_ = m.Close()
				b.StartTimer()
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/block")
		})
	}
}
