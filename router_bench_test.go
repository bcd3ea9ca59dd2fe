package kvroute

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/prefixkey"
)

// BenchmarkRoute measures Route()+Done() with tier 1: prefix key over a system prompt, CHWBL
// acquire and release.
func BenchmarkRoute(b *testing.B) {
	for _, n := range []int{4, 16, 64} {
		for _, sys := range []int{256, 1024} {
			b.Run(fmt.Sprintf("backends=%d/system=%dB", n, sys), func(b *testing.B) {
				r, err := New(Config{Backends: backends(n)})
				if err != nil {
					b.Fatal(err)
				}
				defer r.Close()
				reqs := make([]*prefixkey.Request, 64)
				for i := range reqs {
					reqs[i] = chatReq(fmt.Sprintf("%04d", i)+strings.Repeat("s", sys-4), "hello")
				}
				ctx := context.Background()
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; b.Loop(); i++ {
					d, err := r.Route(ctx, reqs[i%len(reqs)])
					if err != nil {
						b.Fatal(err)
					}
					d.Done(Outcome{})
				}
			})
		}
	}
	b.Run("backends=16/fallback=round_robin", func(b *testing.B) {
		r, _ := New(Config{Backends: backends(16)})
		defer r.Close()
		req := &prefixkey.Request{Model: "m"}
		ctx := context.Background()
		b.ReportAllocs()
		for b.Loop() {
			d, _ := r.Route(ctx, req)
			d.Done(Outcome{})
		}
	})
	b.Run("backends=16/fallback=least_loaded", func(b *testing.B) {
		r, _ := New(Config{Backends: backends(16), Strategy: StrategyLeastLoaded})
		defer r.Close()
		req := &prefixkey.Request{Model: "m"}
		ctx := context.Background()
		b.ReportAllocs()
		for b.Loop() {
			d, _ := r.Route(ctx, req)
			d.Done(Outcome{})
		}
	})
}

// BenchmarkRouteParallel measures Route()+Done() from every core at once on 64 hot prefixes.
func BenchmarkRouteParallel(b *testing.B) {
	r, err := New(Config{Backends: backends(16)})
	if err != nil {
		b.Fatal(err)
	}
	defer r.Close()
	reqs := make([]*prefixkey.Request, 64)
	for i := range reqs {
		reqs[i] = chatReq(fmt.Sprintf("%04d", i)+strings.Repeat("s", 1020), "hello")
	}
	ctx := context.Background()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			d, err := r.Route(ctx, reqs[i%len(reqs)])
			if err != nil {
				b.Error(err)
				return
			}
			d.Done(Outcome{})
			i++
		}
	})
}
