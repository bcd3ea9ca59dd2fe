package kvindex_test

import (
	"context"
	"slices"
	"testing"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

func TestCheckStored(t *testing.T) {
	toks := tokens(64)
	for _, tc := range []struct {
		name      string
		ev        events.Event
		blockSize int
		perBlock  int
		reason    kvindex.DropReason
		ok        bool
	}{
		{"one block each", events.Event{BlockHashes: []uint64{1, 2, 3, 4}, TokenIDs: toks, BlockSize: 16}, 16, 1, 0, true},
		{"block size from the tokens", events.Event{BlockHashes: []uint64{1, 2}, TokenIDs: toks}, 16, 2, 0, true},
		{"engine blocks of 4 of ours", events.Event{BlockHashes: []uint64{1}, TokenIDs: toks, BlockSize: 64}, 16, 4, 0, true},
		{"tokenless", events.Event{BlockHashes: []uint64{1}, Tier: events.TierCPU}, 16, 0, 0, true},
		{"another attention group", events.Event{BlockHashes: []uint64{1}, TokenIDs: toks[:16], GroupIdx: 1}, 16, 0, kvindex.DropGroup, false},
		{"no blocks", events.Event{TokenIDs: toks[:16], BlockSize: 16}, 16, 0, kvindex.DropBadTokens, false},
		{"tokens short", events.Event{BlockHashes: []uint64{1, 2}, TokenIDs: toks[:20], BlockSize: 16}, 16, 0, kvindex.DropBadTokens, false},
		{"fewer tokens than blocks", events.Event{BlockHashes: []uint64{1, 2, 3}, TokenIDs: toks[:2]}, 16, 0, kvindex.DropBadTokens, false},
		{"not a multiple", events.Event{BlockHashes: []uint64{1, 2}, TokenIDs: toks[:48], BlockSize: 24}, 16, 0, kvindex.DropBadBlockSize, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.ev.Kind = events.KindBlockStored
			perBlock, reason, ok := kvindex.CheckStored(&tc.ev, tc.blockSize)
			if perBlock != tc.perBlock || ok != tc.ok || (!ok && reason != tc.reason) {
				t.Fatalf("CheckStored = (%d, %v, %v), want (%d, %v, %v)", perBlock, reason, ok, tc.perBlock, tc.reason, tc.ok)
			}
		})
	}
}

// The keys of stored events chained across events, whatever the engine's block size, are the keys
// of a request with the same tokens.
func TestAppendStoredKeysAreRequestKeys(t *testing.T) {
	const bs = 16
	toks := tokens(8 * 64)
	for _, tc := range []struct {
		name      string
		engineBS  int
		lora      string
		model     string
		wantModel string
	}{
		{"engine block = ours", 16, "", "llama", "llama"},
		{"engine block = 4 of ours", 64, "", "llama", "llama"},
		{"LoRA roots the chain", 16, "sql-adapter", "llama", "sql-adapter"},
		{"default model", 32, "", "", "default"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := len(toks) / tc.engineBS
			first := events.Event{Kind: events.KindBlockStored, BlockHashes: make([]uint64, n/2), TokenIDs: toks[:len(toks)/2],
				BlockSize: tc.engineBS, LoRAName: tc.lora}
			second := events.Event{Kind: events.KindBlockStored, BlockHashes: make([]uint64, n-n/2), TokenIDs: toks[len(toks)/2:],
				BlockSize: tc.engineBS, LoRAName: tc.lora, HasParent: true}
			r, _, ok := kvindex.CheckStored(&first, bs)
			if !ok || r != tc.engineBS/bs {
				t.Fatalf("CheckStored: perBlock %d, ok %v", r, ok)
			}
			keys := kvindex.AppendStoredKeys(nil, &first, kvindex.StoredRoot(&first, tc.model, "default"), bs, r)
			keys = kvindex.AppendStoredKeys(keys, &second, keys[len(keys)-1], bs, r) // the parent's last key
			want := prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot(tc.wantModel, ""), toks, bs, nil)
			if !slices.Equal(keys, want) {
				t.Fatalf("stored keys differ from the request's:\n got %x\nwant %x", keys, want)
			}
		})
	}
}

func TestAppendStoredKeysAllocs(t *testing.T) {
	toks := tokens(512)
	ev := events.Event{Kind: events.KindBlockStored, BlockHashes: make([]uint64, 32), TokenIDs: toks, BlockSize: 16}
	dst := make([]uint64, 0, 32)
	root := kvindex.StoredRoot(&ev, "llama", "")
	if n := testing.AllocsPerRun(100, func() {
		if _, _, ok := kvindex.CheckStored(&ev, 16); !ok {
			t.Fatal("rejected")
		}
		dst = kvindex.AppendStoredKeys(dst[:0], &ev, root, 16, 1)
	}); n != 0 {
		t.Errorf("CheckStored + AppendStoredKeys allocate %.0f times per event", n)
	}
}

func TestPrefixRule(t *testing.T) {
	type want struct {
		remove bool
		tier   kvindex.Tier
		mut    kvindex.Mutation
	}
	for _, tc := range []struct {
		name                  string
		op                    events.PrefixOp
		offloading, evictAsOf bool
		want                  want
	}{
		{"created", events.PrefixCreated, false, false, want{false, events.TierGPU, kvindex.MutationPrefixCreated}},
		{"reloaded", events.PrefixReloaded, true, true, want{false, events.TierGPU, kvindex.MutationPrefixReloaded}},
		{"offloaded without offloading", events.PrefixOffloaded, false, false, want{true, events.TierStorage, kvindex.MutationPrefixOffloaded}},
		{"offloaded with offloading", events.PrefixOffloaded, true, false, want{false, events.TierStorage, kvindex.MutationPrefixOffloaded}},
		{"evicted with offloading", events.PrefixEvicted, true, false, want{true, events.TierStorage, kvindex.MutationPrefixEvicted}},
		{"evicted as offload", events.PrefixEvicted, true, true, want{false, events.TierStorage, kvindex.MutationPrefixEvicted}},
		{"evicted as offload without offloading", events.PrefixEvicted, false, true, want{true, events.TierStorage, kvindex.MutationPrefixEvicted}},
		{"purged", events.PrefixPurged, true, true, want{true, events.TierGPU, kvindex.MutationPrefixPurged}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, ok := kvindex.PrefixRule(tc.op, tc.offloading, tc.evictAsOf)
			if !ok || c.Remove != tc.want.remove || (!c.Remove && c.Tier != tc.want.tier) || c.Mutation != tc.want.mut {
				t.Fatalf("PrefixRule = %+v, %v; want %+v", c, ok, tc.want)
			}
		})
	}
	if _, ok := kvindex.PrefixRule(0, true, true); ok {
		t.Error("PrefixRule accepted op 0")
	}
}

func TestEventTier(t *testing.T) {
	for in, want := range map[kvindex.Tier]kvindex.Tier{
		events.TierGPU: events.TierGPU, events.TierCPU: events.TierCPU, events.TierStorage: events.TierStorage,
		events.NumTiers: events.TierStorage, 200: events.TierStorage,
	} {
		if got := kvindex.EventTier(in); got != want {
			t.Errorf("EventTier(%d) = %v, want %v", in, got, want)
		}
	}
}

// The names are the keys of Stats.Mutations and Stats.Dropped, which dashboards read: pinned, and
// the ones the in-memory index reports.
func TestStatsNames(t *testing.T) {
	var muts, drops []string
	for m := range kvindex.NumMutations {
		muts = append(muts, m.String())
	}
	for r := range kvindex.NumDropReasons {
		drops = append(drops, r.String())
	}
	wantMuts := []string{"stored", "removed", "cleared", "speculated",
		"prefix_created", "prefix_evicted", "prefix_offloaded", "prefix_reloaded", "prefix_purged"}
	wantDrops := []string{"unknown_parent", "unknown_block", "bad_tokens", "bad_block_size",
		"non_full_attention_group", "too_many_backends", "unknown_kind", "bad_prefix"}
	if !slices.Equal(muts, wantMuts) || !slices.Equal(drops, wantDrops) {
		t.Fatalf("names:\n%q\n%q", muts, drops)
	}
	if kvindex.NumMutations.String() != "unknown" || kvindex.NumDropReasons.String() != "unknown" {
		t.Error("an out-of-range value has a name")
	}
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close()
	s, err := ix.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range muts {
		if _, ok := s.Mutations[m]; !ok {
			t.Errorf("MemoryIndex.Stats lacks mutation %q", m)
		}
	}
	for _, r := range drops {
		if _, ok := s.Dropped[r]; !ok {
			t.Errorf("MemoryIndex.Stats lacks drop reason %q", r)
		}
	}
	if len(s.Mutations) != len(muts) || len(s.Dropped) != len(drops) {
		t.Errorf("MemoryIndex.Stats has %d mutations and %d drop reasons, want %d and %d",
			len(s.Mutations), len(s.Dropped), len(muts), len(drops))
	}
}
