package respcache

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
)

// benchKeys returns n distinct 64-hex-digit keys, as KeyOf makes.
func benchKeys(n int) []string {
	ks := make([]string, n)
	for i := range ks {
		var k Key
		k[0], k[1], k[2] = byte(i), byte(i>>8), byte(i>>16)
		ks[i] = k.String()
	}
	return ks
}

// BenchmarkMemoryGetHit reads values of 64 B and 2 KiB (a typical chat completion) from a store of
// 1,000 entries; "parallel" runs on every P. shards=1 is the default (exact LRU), shards=16 spreads
// the keys over 16 locks. A hit costs the lookup plus allocating and copying the returned value.
func BenchmarkMemoryGetHit(b *testing.B) {
	ctx := context.Background()
	const n = 1000
	keys := benchKeys(n)
	for _, shards := range []int{1, 16} {
		for _, size := range []int{64, 2048} {
			s, err := NewMemory(MemoryConfig{Capacity: 2 * n, Shards: shards}) // room for uneven shards
			if err != nil {
				b.Fatal(err)
			}
			val := make([]byte, size)
			for _, k := range keys {
				_ = s.Set(ctx, k, val, 0)
			}
			name := fmt.Sprintf("shards=%d/value=%dB", shards, size)
			b.Run(name, func(b *testing.B) {
				b.ReportAllocs()
				b.SetBytes(int64(size))
				i := 0
				for b.Loop() {
					if _, ok, _ := s.Get(ctx, keys[i%n]); !ok {
						b.Fatal("miss")
					}
					i++
				}
			})
			b.Run(name+"/parallel", func(b *testing.B) {
				b.ReportAllocs()
				b.SetBytes(int64(size))
				var seq atomic.Int64
				b.RunParallel(func(pb *testing.PB) {
					i := int(seq.Add(1)) * 7919
					for pb.Next() {
						if _, ok, _ := s.Get(ctx, keys[i%n]); !ok {
							b.Fatal("miss")
						}
						i++
					}
				})
			})
		}
	}
}

// BenchmarkMemorySet writes 2 KiB values: "new" into a full store (each Set evicts), "overwrite"
// over existing keys.
func BenchmarkMemorySet(b *testing.B) {
	ctx := context.Background()
	const n = 1000
	keys := benchKeys(4 * n)
	val := make([]byte, 2048)
	for _, mode := range []string{"new", "overwrite"} {
		b.Run("mode="+mode, func(b *testing.B) {
			s, err := NewMemory(MemoryConfig{Capacity: n})
			if err != nil {
				b.Fatal(err)
			}
			for _, k := range keys[:n] {
				_ = s.Set(ctx, k, val, 0)
			}
			span := n
			if mode == "new" {
				span = len(keys)
			}
			b.ReportAllocs()
			b.SetBytes(int64(len(val)))
			i := 0
			for b.Loop() {
				_ = s.Set(ctx, keys[i%span], val, 0)
				i++
			}
		})
	}
}

// BenchmarkMemoryGetMiss looks up absent keys.
func BenchmarkMemoryGetMiss(b *testing.B) {
	ctx := context.Background()
	s, err := NewMemory(MemoryConfig{})
	if err != nil {
		b.Fatal(err)
	}
	k := "absent" + strconv.Itoa(1)
	b.ReportAllocs()
	for b.Loop() {
		_, _, _ = s.Get(ctx, k)
	}
}
