package redisstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvroute/kvroute/respcache/internal/storetest"
	"github.com/kvroute/kvroute/respcache/redisstore"
)

// Benchmarks on loopback. They need REDIS_ADDR (see helpers_test.go); without it they skip:
//
//	REDIS_ADDR=127.0.0.1:6379 go test -run '^$' -bench GetHit -benchtime 2s ./respcache/redisstore/

// BenchmarkGetHit: a Get of a present key, with client-side caching off (a round trip per Get)
// and on (served from the local cache after the first).
func BenchmarkGetHit(b *testing.B) {
	for _, csc := range []bool{false, true} {
		for _, size := range storetest.BenchSizes() {
			name := "csc=off/" + storetest.SizeName(size)
			if csc {
				name = "csc=on/" + storetest.SizeName(size)
			}
			b.Run(name, func(b *testing.B) {
				s := newTestRedis(b, redisstore.Config{ClientSideCaching: csc, KeyPrefix: uniquePrefix("bench")})
				storetest.BenchGetHits(b, s, s, size)
			})
		}
		b.Run("parallel/csc="+map[bool]string{false: "off", true: "on"}[csc]+"/"+storetest.SizeName(1<<10), func(b *testing.B) {
			s := newTestRedis(b, redisstore.Config{ClientSideCaching: csc, KeyPrefix: uniquePrefix("bench")})
			ctx := context.Background()
			if err := s.Set(ctx, "k", make([]byte, 1<<10), time.Hour); err != nil {
				b.Fatal(err)
			}
			b.SetBytes(1 << 10)
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, ok, err := s.Get(ctx, "k"); err != nil || !ok {
						b.Errorf("Get = %v, %v", ok, err)
						return
					}
				}
			})
		})
	}
}
