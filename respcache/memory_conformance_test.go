package respcache_test

import (
	"testing"
	"time"

	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/cachetest"
)

func TestMemoryConformance(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  respcache.MemoryConfig
	}{
		{"default", respcache.MemoryConfig{}},
		{"shards=4/max_bytes=8MiB", respcache.MemoryConfig{Shards: 4, MaxBytes: 8 << 20}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := cachetest.NewClock(time.Time{})
			cfg := tc.cfg
			cfg.Now = clk.Now
			cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
				s, err := respcache.NewMemory(cfg)
				if err != nil {
					t.Fatal(err)
				}
				return s
			}, cachetest.Options{Advance: clk.Advance, DefaultTTL: respcache.DefaultTTL})
		})
	}
}

// TestMemoryConformanceRun runs the options-free entry point, as a user's store would.
func TestMemoryConformanceRun(t *testing.T) {
	cachetest.Run(t, func(t *testing.T) respcache.CacheStore {
		s, err := respcache.NewMemory(respcache.MemoryConfig{})
		if err != nil {
			t.Fatal(err)
		}
		return s
	})
}
