package chwbl_test

import (
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/kvroute/kvroute/chwbl"
)

var benchSizes = []int{8, 64, 256}

func benchRing(b *testing.B, backends int) *chwbl.Ring {
	b.Helper()
	r, err := chwbl.New(chwbl.Config{}) // 150 virtual nodes per backend
	if err != nil {
		b.Fatal(err)
	}
	for i := range backends {
		if err := r.Add("pod-"+strconv.Itoa(i), 1); err != nil {
			b.Fatal(err)
		}
	}
	return r
}

func benchKeys(n int) []uint64 {
	rng := rand.New(rand.NewPCG(1, 2))
	keys := make([]uint64, n)
	for i := range keys {
		keys[i] = rng.Uint64()
	}
	return keys
}

// BenchmarkAcquireRelease: one request's routing and completion on an otherwise idle ring.
func BenchmarkAcquireRelease(b *testing.B) {
	keys := benchKeys(1 << 12)
	for _, n := range benchSizes {
		b.Run("backends="+strconv.Itoa(n), func(b *testing.B) {
			r := benchRing(b, n)
			var h chwbl.Handle
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				if _, err := r.Acquire(&h, keys[i&(len(keys)-1)]); err != nil {
					b.Fatal(err)
				}
				h.Release()
				i++
			}
		})
	}
}

// BenchmarkAcquireReleaseParallel: the same from GOMAXPROCS goroutines on one ring.
func BenchmarkAcquireReleaseParallel(b *testing.B) {
	keys := benchKeys(1 << 12)
	for _, n := range benchSizes {
		b.Run("backends="+strconv.Itoa(n), func(b *testing.B) {
			r := benchRing(b, n)
			b.ReportAllocs()
			b.ResetTimer() // RunParallel, unlike b.Loop, does not exclude the setup
			b.RunParallel(func(pb *testing.PB) {
				var h chwbl.Handle
				i := rand.IntN(len(keys))
				for pb.Next() {
					if _, err := r.Acquire(&h, keys[i&(len(keys)-1)]); err != nil {
						b.Error(err)
						return
					}
					h.Release()
					i++
				}
			})
		})
	}
}

// BenchmarkAcquireReleaseLoaded: a loaded ring (4 slots held per backend) and one hot key, so that
// every request walks past full backends (the overflow path).
func BenchmarkAcquireReleaseLoaded(b *testing.B) {
	for _, n := range benchSizes {
		b.Run("backends="+strconv.Itoa(n), func(b *testing.B) {
			r := benchRing(b, n)
			held := make([]chwbl.Handle, 4*n)
			for i := range held {
				if _, err := r.Acquire(&held[i], 42); err != nil {
					b.Fatal(err)
				}
			}
			var h chwbl.Handle
			b.ReportAllocs()
			for b.Loop() {
				if _, err := r.Acquire(&h, 42); err != nil {
					b.Fatal(err)
				}
				h.Release()
			}
			for i := range held {
				held[i].Release()
			}
		})
	}
}

// BenchmarkCandidate: the read-only preview.
func BenchmarkCandidate(b *testing.B) {
	keys := benchKeys(1 << 12)
	for _, n := range benchSizes {
		b.Run("backends="+strconv.Itoa(n), func(b *testing.B) {
			r := benchRing(b, n)
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				if _, _, err := r.Candidate(keys[i&(len(keys)-1)]); err != nil {
					b.Fatal(err)
				}
				i++
			}
		})
	}
}

// BenchmarkAddRemove: one membership change (a backend joins, then leaves) on a ring of n.
func BenchmarkAddRemove(b *testing.B) {
	for _, n := range benchSizes {
		b.Run("backends="+strconv.Itoa(n), func(b *testing.B) {
			r := benchRing(b, n)
			b.ReportAllocs()
			for b.Loop() {
				if err := r.Add("extra", 1); err != nil {
					b.Fatal(err)
				}
				if err := r.Remove("extra"); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
