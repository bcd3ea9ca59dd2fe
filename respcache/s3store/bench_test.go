package s3store_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/kvroute/kvroute/respcache"
)

// Benchmarks of a tiered store with an S3 L2 on loopback. They need the S3_* variables (see
// helpers_test.go); without them they skip:
//
//	S3_ENDPOINT=http://127.0.0.1:7070 S3_ACCESS_KEY=… S3_SECRET_KEY=… S3_BUCKET=… \
//	go test -run '^$' -bench Tiered -benchtime 2s ./respcache/s3store/

var benchSizes = []int{1 << 10, 16 << 10}

func sizeName(n int) string { return "size=" + strconv.Itoa(n>>10) + "KiB" }

// BenchmarkTieredL2Hit: an L1 (memory) miss then an S3 hit, promotion disabled so that every Get
// stays an L2 hit. BenchmarkTieredL1Hit is the same store with the key in L1, for contrast.
func BenchmarkTieredL2Hit(b *testing.B) {
	for _, size := range benchSizes {
		b.Run(sizeName(size), func(b *testing.B) {
			l2 := newTestS3(b, s3TestConfig(b))
			s := mustTiered(b, respcache.TieredConfig{L1: mustMemory(b, respcache.MemoryConfig{}), L2: l2, DisablePromotion: true})
			ctx := context.Background()
			if err := l2.Set(ctx, "k", make([]byte, size), time.Hour); err != nil {
				b.Fatal(err)
			}
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				if _, ok, err := s.Get(ctx, "k"); err != nil || !ok {
					b.Fatalf("Get = %v, %v", ok, err)
				}
			}
			if c := s.Counts(); c.L1Hits != 0 {
				b.Fatalf("L1 hits %d: not an L2 benchmark", c.L1Hits)
			}
		})
	}
}

func BenchmarkTieredL1Hit(b *testing.B) {
	for _, size := range benchSizes {
		b.Run(sizeName(size), func(b *testing.B) {
			l2 := newTestS3(b, s3TestConfig(b))
			s := mustTiered(b, respcache.TieredConfig{L1: mustMemory(b, respcache.MemoryConfig{}), L2: l2})
			ctx := context.Background()
			if err := s.Set(ctx, "k", make([]byte, size), time.Hour); err != nil {
				b.Fatal(err)
			}
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				if _, ok, err := s.Get(ctx, "k"); err != nil || !ok {
					b.Fatalf("Get = %v, %v", ok, err)
				}
			}
		})
	}
}
