package redisstore_test

import (
	"testing"

	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/respcache/internal/storetest"
)

// Integration helpers of the store and fault tests. The servers are internal/testenv's: REDIS_ADDR
// (a Redis 7 the tests may write to, under unique key prefixes they delete), private redis-server
// processes for the fault tests, and KVROUTE_REQUIRE_INTEGRATION=1 turning every skip for a
// missing one into a failure.

// uniquePrefix returns a fresh Redis key prefix for one test, free of glob characters.
func uniquePrefix(kind string) string { return "kvroute-test:" + kind + ":" + testenv.RandHex() + ":" }

// storeMarkers pick out the goroutines of a store and its client (rueidis, this package's store).
var storeMarkers = []string{"redis/rueidis", "redisstore.(*Store)"}

// storeGoroutines returns the stacks of live goroutines that belong to a store or its client.
func storeGoroutines() []string { return storetest.Goroutines(storeMarkers...) }

// requireNoStoreGoroutines fails t when store goroutines outlive a Close by more than a few
// seconds; before is what storeGoroutines returned before the store was made.
func requireNoStoreGoroutines(t *testing.T, before []string) {
	t.Helper()
	storetest.RequireNoGoroutines(t, before, storeMarkers...)
}
