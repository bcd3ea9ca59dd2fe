package costscore_test

import (
	"context"
	"errors"
	"math"
	"testing"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/scorer"
	"github.com/kvroute/kvroute/scorer/scorertest"

	"example.com/thirdparty/costscore"
)

func TestConformance(t *testing.T) {
	for name, cfg := range map[string]costscore.Config{
		"defaults":    {},
		"queue-heavy": {QueueWeight: 4, RequestCost: 4096, ErrorPenalty: 1},
	} {
		t.Run(name, func(t *testing.T) {
			scorertest.Run(t, func(t *testing.T) scorer.BackendScorer {
				s, err := costscore.New(cfg)
				if err != nil {
					t.Fatal(err)
				}
				return s
			})
		})
	}
	t.Run("zero value", func(t *testing.T) {
		scorertest.Run(t, func(*testing.T) scorer.BackendScorer { return &costscore.Scorer{} })
	})
}

func TestScore(t *testing.T) {
	s, err := costscore.New(costscore.Config{})
	if err != nil {
		t.Fatal(err)
	}
	req := scorer.Request{Blocks: 8, Tokens: 128}
	cands := []scorer.Candidate{
		{Backend: "warm", CachedBlocks: 8, CachedTokens: 128, WeightedBlocks: 8, Weight: 1, Healthy: true, Health: 1},
		{Backend: "cpu", CachedBlocks: 8, CachedTokens: 128, WeightedBlocks: 6.4, Weight: 1, Healthy: true, Health: 1},
		{Backend: "busy", CachedBlocks: 8, CachedTokens: 128, WeightedBlocks: 8, InFlight: 1, PendingPrefillTokens: 64, Weight: 2, Healthy: true, Health: 1},
		{Backend: "flaky", Weight: 1, Healthy: true, Health: 0.5},
		{Backend: "down", CachedBlocks: 8, CachedTokens: 128, WeightedBlocks: 8, Healthy: false},
	}
	got := s.Score(req, cands, nil)
	want := []float64{128, 102.4, 128 - (64+256)/2.0, -1024, math.Inf(-1)}
	for i := range want {
		if math.Abs(got[i]-want[i]) > 1e-9 && got[i] != want[i] {
			t.Errorf("%s: score %v, want %v", cands[i].Backend, got[i], want[i])
		}
	}
	if n := testing.AllocsPerRun(100, func() { s.Score(req, cands, got) }); n != 0 {
		t.Errorf("Score allocates %v times per call", n)
	}
	for _, bad := range []costscore.Config{{QueueWeight: -1}, {RequestCost: math.NaN()}, {ErrorPenalty: math.Inf(1)}} {
		if _, err := costscore.New(bad); !errors.Is(err, costscore.ErrInvalidConfig) {
			t.Errorf("New(%+v) = %v", bad, err)
		}
	}
}

// staticIndex is a KV index that says what each backend holds of any request: a fixed number of
// its leading blocks. It answers lookups only (KVConfig then needs SpeculationOff).
type staticIndex map[string]int

func (ix staticIndex) Lookup(_ context.Context, keys []uint64, cands []string, out []kvindex.Match) ([]kvindex.Match, error) {
	out = out[:len(cands)]
	for i, c := range cands {
		n := min(ix[c], len(keys))
		out[i] = kvindex.Match{Backend: c, Blocks: n, Tokens: n * kvindex.DefaultBlockSize, WeightedBlocks: float64(n)}
	}
	return out, nil
}

// The default Router's tier 4 ranks backends with the scorer: the warmest backend first, then,
// while it is busy, the next warmest, then even a cold one (load_bound) rather than a third request
// queued on a busy backend.
func TestWithDefaultRouter(t *testing.T) {
	s, err := costscore.New(costscore.Config{})
	if err != nil {
		t.Fatal(err)
	}
	r, err := kvroute.New(kvroute.Config{
		Backends: []kvroute.Backend{{Name: "a"}, {Name: "b"}, {Name: "c"}},
		KV: &kvroute.KVConfig{
			Index:       staticIndex{"a": 8, "b": 6}, // of an 8-block prompt
			Scorer:      s,
			Speculation: kvroute.SpeculationOff,
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	toks := make([]uint32, 8*kvindex.DefaultBlockSize)
	for i := range toks {
		toks[i] = uint32(i + 1)
	}
	route := func() *kvroute.Decision {
		t.Helper()
		d, err := r.Route(context.Background(), &prefixkey.Request{Model: "m", TokenIDs: toks})
		if err != nil {
			t.Fatal(err)
		}
		return d
	}

	first := route()
	if first.Backend != "a" || first.Reason != kvroute.ReasonKVAware || first.ExpectedCachedTokens != 128 {
		t.Fatalf("first request: %s (%s, %d cached); want a, kv_aware, 128", first.Backend, first.Reason, first.ExpectedCachedTokens)
	}
	// The Router reports the scorer's own scores.
	for _, o := range first.Overlaps {
		if want := map[string]float64{"a": 128, "b": 96, "c": 0}[o.Backend]; o.Score != want {
			t.Errorf("Overlaps: %s scored %v, want %v", o.Backend, o.Score, want)
		}
	}
	second := route() // a: 128 − 256 for the request in flight; b: 96
	if second.Backend != "b" || second.Reason != kvroute.ReasonKVAware {
		t.Errorf("second request: %s (%s); want b, kv_aware", second.Backend, second.Reason)
	}
	third := route() // b now also carries 32 uncached tokens of backlog and a request: c's 0 wins
	if third.Backend != "c" || third.Reason != kvroute.ReasonLoadBound {
		t.Errorf("third request: %s (%s); want c, load_bound", third.Backend, third.Reason)
	}
	for _, d := range []*kvroute.Decision{first, second, third} {
		d.Done(kvroute.Outcome{})
	}
	if d := route(); d.Backend != "a" {
		t.Errorf("with the fleet idle again: %s, want a", d.Backend)
	}
}
