package kvroute

import (
	"context"
	"testing"

	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/events"
)

// BenchmarkRouteDisagg measures DisaggRouter.Route plus the release of its slots on the example config's fleet (2
// prefill, 3 decode, 1 unified) with the in-memory index, for a 1,024-token prompt.
func BenchmarkRouteDisagg(b *testing.B) {
	for _, path := range []string{"fast_decode", "prefill_then_decode"} {
		b.Run("path="+path, func(b *testing.B) {
			ix := dgIndex(b)
			r := dgRouter(b, ix, disagg.Config{}, func(c *Config) { c.KV.Speculation = SpeculationOff })
			toks := dgTokens(1, 64*16)
			if path == "fast_decode" {
				dgHold(b, ix, "decode-2", toks, 64, events.TierGPU)
			}
			req := dgReq(toks)
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				d, err := r.Disagg().Route(ctx, req)
				if err != nil {
					b.Fatal(err)
				}
				if d.Plan.Path.String() != path {
					b.Fatalf("path %v", d.Plan.Path)
				}
				d.PrefillDone(Outcome{})
				d.Done(Outcome{})
			}
		})
	}
}
