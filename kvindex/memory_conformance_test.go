package kvindex_test

import (
	"strings"
	"testing"

	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/kvindex/indextest"
)

// TestMemoryConformance runs the exported conformance suite against MemoryIndex: exact (LookupStride
// 1), with the sweep goroutine running; exact with no sweep and a table of several shards; exact
// with every backend on the shared engine-hash map; and with the defaults, whose jump search
// passes everything but LongRequest: its hole strictly between two probes (a middle block
// removed, its descendants kept) is the case LookupStride documents as missed.
func TestMemoryConformance(t *testing.T) {
	for _, tc := range []struct {
		name   string
		cfg    kvindex.MemoryConfig
		skip   string // subtest skipped
		shared bool   // every backend on the shared engine-hash map
	}{
		{"exact", kvindex.MemoryConfig{LookupStride: 1}, "", false},
		{"exact_no_sweep", kvindex.MemoryConfig{LookupStride: 1, SweepInterval: -1, MaxEntries: 1 << 16}, "", false},
		{"exact_shared_engines", kvindex.MemoryConfig{LookupStride: 1}, "", true},
		{"defaults", kvindex.MemoryConfig{}, "/LongRequest", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			indextest.Run(t, func(t *testing.T, opts indextest.Options) kvindex.KvCacheIndex {
				if tc.skip != "" && strings.HasSuffix(t.Name(), tc.skip) {
					t.Skip("documented approximation of LookupStride")
				}
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
