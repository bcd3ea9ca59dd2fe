package s3store_test

import (
	"testing"

	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/internal/storetest"
)

// Benchmarks of a tiered store with an S3 L2 on loopback. They need the S3_* variables (see
// helpers_test.go); without them they skip:
//
//	S3_ENDPOINT=http://127.0.0.1:7070 S3_ACCESS_KEY=… S3_SECRET_KEY=… S3_BUCKET=… \
//	go test -run '^$' -bench Tiered -benchtime 2s ./respcache/s3store/

// BenchmarkTieredL2Hit: an L1 (memory) miss then an S3 hit, promotion disabled so that every Get
// stays an L2 hit. BenchmarkTieredL1Hit is the same store with the key in L1, for contrast.
func BenchmarkTieredL2Hit(b *testing.B) {
	for _, size := range storetest.BenchSizes() {
		b.Run(storetest.SizeName(size), func(b *testing.B) {
			l2 := newTestS3(b, s3TestConfig(b))
			s := storetest.MustTiered(b, respcache.TieredConfig{L1: storetest.MustMemory(b, respcache.MemoryConfig{}), L2: l2, DisablePromotion: true})
			storetest.BenchGetHits(b, l2, s, size)
			if c := s.Counts(); c.L1Hits != 0 {
				b.Fatalf("L1 hits %d: not an L2 benchmark", c.L1Hits)
			}
		})
	}
}

func BenchmarkTieredL1Hit(b *testing.B) {
	for _, size := range storetest.BenchSizes() {
		b.Run(storetest.SizeName(size), func(b *testing.B) {
			l2 := newTestS3(b, s3TestConfig(b))
			s := storetest.MustTiered(b, respcache.TieredConfig{L1: storetest.MustMemory(b, respcache.MemoryConfig{}), L2: l2})
			storetest.BenchGetHits(b, s, s, size)
		})
	}
}
