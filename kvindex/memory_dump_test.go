package kvindex_test

import (
	"context"
	"testing"

	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/kvindex/indextest"
	"github.com/kvroute/kvroute/prefixkey"
)

// TestMemoryDumpConformance runs the Dumper suite against MemoryIndex: the defaults (256 shards),
// a table of 16 shards, and a single shard, whose keys come from the engine-hash map and the
// speculative queue instead of the shard, with the backends' own engine-hash maps and with the
// shared one.
func TestMemoryDumpConformance(t *testing.T) {
	for _, tc := range []struct {
		name   string
		cfg    kvindex.MemoryConfig
		shared bool // every backend on the shared engine-hash map
	}{
		{"defaults", kvindex.MemoryConfig{}, false},
		{"16_shards_no_sweep", kvindex.MemoryConfig{MaxEntries: 1 << 16, SweepInterval: -1}, false},
		{"one_shard", kvindex.MemoryConfig{MaxEntries: 4096}, false},
		{"one_shard_shared_engines", kvindex.MemoryConfig{MaxEntries: 4096}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			indextest.RunDump(t, func(t *testing.T, opts indextest.Options) kvindex.KvCacheIndex {
				cfg := tc.cfg
				cfg.BlockSize = opts.BlockSize
				cfg.DefaultModel = opts.DefaultModel
				cfg.StorageOffloading = opts.StorageOffloading
				cfg.TreatEvictionAsOffload = opts.TreatEvictionAsOffload
				cfg.EntryTTL = opts.EntryTTL
				cfg.SpeculativeTTL = opts.SpeculativeTTL
				cfg.TierWeights = opts.TierWeights
				cfg.Now = opts.Now
				newMemory := kvindex.NewMemory
				if tc.shared {
					newMemory = kvindex.NewMemorySharedEngines
				}
				ix, err := newMemory(cfg)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = ix.Close() })
				return ix
			})
		})
	}
}

// A dump of many blocks reads every shard (and several slices of none) and stops at its limit;
// the keys it lists are the request's keys.
func TestMemoryDumpManyBlocks(t *testing.T) {
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: "m"})
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close()
	ctx := context.Background()
	toks := make([]uint32, 3000*16)
	for i := range toks {
		toks[i] = uint32(i * 7)
	}
	keys := prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot("m", ""), toks, 16, nil)
	if err := ix.Speculate(ctx, "a", keys, 0); err != nil {
		t.Fatal(err)
	}
	want := map[uint64]bool{}
	for _, k := range keys {
		want[k] = true
	}
	got := map[uint64]bool{}
	err = ix.Dump(ctx, "a", 10_000, func(e kvindex.DumpEntry) error {
		if !want[e.Key] || got[e.Key] {
			t.Errorf("unexpected or repeated key %016x", e.Key)
		}
		got[e.Key] = true
		return nil
	})
	if err != nil || len(got) != len(keys) {
		t.Fatalf("Dump: %v, %d keys, want %d", err, len(got), len(keys))
	}
	n := 0
	if err := ix.Dump(ctx, "a", 1234, func(kvindex.DumpEntry) error { n++; return nil }); err != nil || n != 1234 {
		t.Fatalf("limit 1234: %d entries, %v", n, err)
	}
}

// Dump holds a shard's lock only while it copies: a callback that applies events (which lock
// shards) does not deadlock.
func TestMemoryDumpCallbackMayWrite(t *testing.T) {
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{MaxEntries: 4096})
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close()
	ctx := context.Background()
	keys := []uint64{1, 2, 3, 4}
	if err := ix.Speculate(ctx, "a", keys, 0); err != nil {
		t.Fatal(err)
	}
	n := 0
	err = ix.Dump(ctx, "a", 0, func(e kvindex.DumpEntry) error {
		n++
		return ix.Speculate(ctx, "a", []uint64{e.Key + 100}, 0)
	})
	if err != nil || n != len(keys) {
		t.Fatalf("Dump: %v after %d entries", err, n)
	}
}
