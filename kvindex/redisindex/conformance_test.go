package redisindex_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"testing"
	"time"

	"github.com/redis/rueidis"

	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/kvindex/indextest"
	"github.com/kvroute/kvroute/kvindex/redisindex"
)

// TestConformance runs the exported conformance suite kvindex/indextest against Index on REDIS_ADDR
// (skipped when unset, failed when KVROUTE_REQUIRE_INTEGRATION=1). Every subtest gets a fresh key
// prefix, deleted when it ends; the index reads time through the suite's clock (entry expiries are
// written in that clock), so the TTL subtests run too.
func TestConformance(t *testing.T) {
	addr := testenv.RedisAddr(t)
	client, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{addr}, DisableCache: true})
	if err != nil {
		t.Fatalf("connect to %s: %v", addr, err)
	}
	defer client.Close()
	indextest.Run(t, func(t *testing.T, opts indextest.Options) kvindex.KvCacheIndex {
		var b [8]byte
		if _, err := rand.Read(b[:]); err != nil {
			t.Fatal(err)
		}
		prefix := "kvroute:test:" + hex.EncodeToString(b[:]) + ":"
		ix, err := redisindex.NewWithClient(client, redisindex.Config{
			KeyPrefix:              prefix,
			BlockSize:              opts.BlockSize,
			DefaultModel:           opts.DefaultModel,
			StorageOffloading:      opts.StorageOffloading,
			TreatEvictionAsOffload: opts.TreatEvictionAsOffload,
			EntryTTL:               opts.EntryTTL,
			SpeculativeTTL:         opts.SpeculativeTTL,
			TierWeights:            opts.TierWeights,
			Now:                    opts.Now,
			CommandTimeout:         5 * time.Second, // -race on a shared machine; not a timing test
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_ = ix.Close()
			redisConformanceCleanup(t, client, prefix)
		})
		return ix
	})
}

// redisConformanceCleanup deletes every key under prefix (SCAN MATCH prefix* + DEL).
func redisConformanceCleanup(t *testing.T, c rueidis.Client, prefix string) {
	ctx := context.Background()
	var cursor uint64
	for {
		e, err := c.Do(ctx, c.B().Scan().Cursor(cursor).Match(prefix+"*").Count(1000).Build()).AsScanEntry()
		if err != nil {
			t.Errorf("cleanup of %s*: %v", prefix, err)
			return
		}
		if len(e.Elements) > 0 {
			if err := c.Do(ctx, c.B().Del().Key(e.Elements...).Build()).Error(); err != nil {
				t.Errorf("cleanup of %s*: %v", prefix, err)
			}
		}
		if cursor = e.Cursor; cursor == 0 {
			return
		}
	}
}
