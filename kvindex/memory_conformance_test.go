package kvindex_test

import (
	"strings"
	"testing"

	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/kvindex/indextest"
)

// TestMemoryConformance runs the exported conformance suite against MemoryIndex: with the
// defaults (sweep goroutine running); with no sweep and a table of several shards; and as a jump
// search (LookupStride 16), which passes everything but LongRequest, whose hole strictly between
// two probes is the approximation LookupStride documents.
func TestMemoryConformance(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  kvindex.MemoryConfig
		skip string // subtest skipped
	}{
		{"defaults", kvindex.MemoryConfig{}, ""},
		{"no_sweep", kvindex.MemoryConfig{SweepInterval: -1, MaxEntries: 1 << 16}, ""},
		{"jump_search", kvindex.MemoryConfig{LookupStride: 16}, "/LongRequest"},
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
				ix, err := kvindex.NewMemory(cfg)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = ix.Close() })
				return ix
			})
		})
	}
}
