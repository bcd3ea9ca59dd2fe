package kvroute

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

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
				reqs := hotPrefixes(64, sys)
				routeAndDone(b, r, reqs)
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

// BenchmarkRouteMaxDecisionAge measures tier 1's Route()+Done() (16 backends, 1 KiB system prompt)
// with Config.MaxDecisionAge's net off and on, with no other decision live and with 1,000 held
// live, as a gateway's streams are, whose entries the live queues keep.
func BenchmarkRouteMaxDecisionAge(b *testing.B) {
	for _, net := range []struct {
		name string
		age  time.Duration
	}{{"off", -1}, {"on", DefaultMaxDecisionAge}} {
		for _, held := range []int{0, 1000} {
			b.Run(fmt.Sprintf("net=%s/held=%d", net.name, held), func(b *testing.B) {
				r, err := New(Config{Backends: backends(16), MaxDecisionAge: net.age})
				if err != nil {
					b.Fatal(err)
				}
				defer r.Close()
				reqs := hotPrefixes(64, 1024)
				ctx := context.Background()
				live := make([]*Decision, held)
				for i := range live {
					if live[i], err = r.Route(ctx, reqs[i%len(reqs)]); err != nil {
						b.Fatal(err)
					}
				}
				defer func() {
					for _, d := range live {
						d.Done(Outcome{})
					}
				}()
				routeAndDone(b, r, reqs)
			})
		}
	}
}

// hotPrefixes returns n chat requests with distinct system prompts of sys bytes (sys ≥ 4).
func hotPrefixes(n, sys int) []*prefixkey.Request {
	reqs := make([]*prefixkey.Request, n)
	for i := range reqs {
		reqs[i] = chatReq(fmt.Sprintf("%04d", i)+strings.Repeat("s", sys-4), "hello")
	}
	return reqs
}

// routeAndDone times Route()+Done() over reqs in turn, allocations reported.
func routeAndDone(b *testing.B, r *DefaultRouter, reqs []*prefixkey.Request) {
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
}

// BenchmarkRouteParallel measures Route()+Done() from every core at once on 64 hot prefixes.
func BenchmarkRouteParallel(b *testing.B) {
	r, err := New(Config{Backends: backends(16)})
	if err != nil {
		b.Fatal(err)
	}
	defer r.Close()
	reqs := hotPrefixes(64, 1024)
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
