package scorer

import (
	"errors"
	"math"
	"testing"
)

// assertNoAllocs fails when f allocates (skipped under -race).
func assertNoAllocs(t *testing.T, f func()) {
	t.Helper()
	if raceEnabled {
		t.Log("skipping allocation check under -race")
		return
	}
	if n := testing.AllocsPerRun(100, f); n != 0 {
		t.Errorf("allocs per run = %v, want 0", n)
	}
}

func approx(a, b float64) bool {
	if math.IsInf(a, 0) || math.IsInf(b, 0) {
		return a == b
	}
	return math.Abs(a-b) < 1e-12
}

func assertScores(t *testing.T, got, want []float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("len(scores) = %d, want %d (%v)", len(got), len(want), got)
	}
	for i := range want {
		if !approx(got[i], want[i]) {
			t.Errorf("score[%d] = %v, want %v (all %v)", i, got[i], want[i], got)
		}
	}
}

func TestNewComposite(t *testing.T) {
	nan := math.NaN()
	tests := []struct {
		name    string
		cfg     CompositeConfig
		want    CompositeConfig
		wantErr bool
	}{
		{name: "zero means defaults", want: CompositeConfig{0.6, 0.3, 0.1, 0.3, 1024}},
		{name: "custom weights", cfg: CompositeConfig{OverlapWeight: 0.5, LoadWeight: 0.5}, want: CompositeConfig{0.5, 0.5, 0, 0.3, 1024}},
		{name: "overlap only", cfg: CompositeConfig{OverlapWeight: 1}, want: CompositeConfig{1, 0, 0, 0.3, 1024}},
		{name: "sum within tolerance", cfg: CompositeConfig{0.7, 0.2, 0.1 + 5e-10, 0, 0}, want: CompositeConfig{0.7, 0.2, 0.1 + 5e-10, 0.3, 1024}},
		{name: "threshold set", cfg: CompositeConfig{MinOverlapThreshold: 1}, want: CompositeConfig{0.6, 0.3, 0.1, 1, 1024}},
		{name: "tiny threshold", cfg: CompositeConfig{MinOverlapThreshold: 1e-9}, want: CompositeConfig{0.6, 0.3, 0.1, 1e-9, 1024}},
		{name: "sum below one", cfg: CompositeConfig{OverlapWeight: 0.5, LoadWeight: 0.3}, wantErr: true},
		{name: "sum above one", cfg: CompositeConfig{0.6, 0.3, 0.2, 0, 0}, wantErr: true},
		{name: "negative weight", cfg: CompositeConfig{1.2, -0.2, 0, 0, 0}, wantErr: true},
		{name: "NaN weight", cfg: CompositeConfig{nan, 0.5, 0.5, 0, 0}, wantErr: true},
		{name: "Inf weight", cfg: CompositeConfig{math.Inf(1), 0, 0, 0, 0}, wantErr: true},
		{name: "negative threshold", cfg: CompositeConfig{MinOverlapThreshold: -0.1}, wantErr: true},
		{name: "threshold above one", cfg: CompositeConfig{MinOverlapThreshold: 1.5}, wantErr: true},
		{name: "NaN threshold", cfg: CompositeConfig{MinOverlapThreshold: nan}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := NewComposite(tt.cfg)
			if tt.wantErr {
				if !errors.Is(err, ErrInvalidConfig) {
					t.Fatalf("err = %v, want ErrInvalidConfig", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := c.Config(); got != tt.want {
				t.Errorf("Config() = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestCompositeScore(t *testing.T) {
	ninf := math.Inf(-1)
	tests := []struct {
		name  string
		cfg   CompositeConfig
		req   Request
		cands []Candidate
		want  []float64
	}{
		{
			name: "fraction of request blocks",
			req:  Request{Blocks: 10},
			cands: []Candidate{
				{Backend: "a", WeightedBlocks: 10, Healthy: true, Health: 1},
				{Backend: "b", WeightedBlocks: 5, InFlight: 2, Healthy: true, Health: 1},
				{Backend: "c", WeightedBlocks: 10, Healthy: false, Health: 1},
			},
			// a: .6·1 + .3·(1−0) + .1·1; b: .6·.5 + .3·(1−1) + .1·1
			want: []float64{1.0, 0.4, ninf},
		},
		{
			name: "a small overlap stays small",
			req:  Request{Blocks: 100},
			cands: []Candidate{
				{WeightedBlocks: 1, Healthy: true},
				{WeightedBlocks: 0, Healthy: true},
			},
			want: []float64{0.6*0.01 + 0.3, 0.3},
		},
		{
			name: "unknown length normalises by best healthy overlap",
			req:  Request{},
			cands: []Candidate{
				{WeightedBlocks: 4, Healthy: true},
				{WeightedBlocks: 2, Healthy: true},
				{WeightedBlocks: 8, Healthy: false},
			},
			want: []float64{0.6 + 0.3, 0.3 + 0.3, ninf},
		},
		{
			name: "unknown length and no overlap",
			cands: []Candidate{
				{Healthy: true, Health: 0.5},
				{Healthy: true, Health: 1},
			},
			want: []float64{0.3 + 0.05, 0.3 + 0.1},
		},
		{
			name: "weighted load",
			req:  Request{Blocks: 4},
			cands: []Candidate{
				{InFlight: 4, Weight: 2, Healthy: true},
				{InFlight: 2, Weight: 1, Healthy: true},
				{InFlight: 1, Weight: 1, Healthy: true},
				{InFlight: 100, Healthy: false}, // unhealthy load does not set the max
			},
			want: []float64{0, 0, 0.3 * 0.5, ninf},
		},
		{
			name: "invalid weight counts as one",
			req:  Request{Blocks: 4},
			cands: []Candidate{
				{InFlight: 2, Weight: -1, Healthy: true},
				{InFlight: 1, Weight: math.NaN(), Healthy: true},
				{InFlight: -3, Healthy: true},
			},
			want: []float64{0, 0.15, 0.3},
		},
		{
			name: "values clamped",
			req:  Request{Blocks: 4},
			cands: []Candidate{
				{WeightedBlocks: 9, Health: 2, Healthy: true},
				{WeightedBlocks: -1, Health: -1, Healthy: true},
				{WeightedBlocks: math.NaN(), Health: math.NaN(), Healthy: true},
			},
			want: []float64{1, 0.3, 0.3},
		},
		{
			name: "custom weights",
			cfg:  CompositeConfig{OverlapWeight: 0.5, LoadWeight: 0.5},
			req:  Request{Blocks: 2},
			cands: []Candidate{
				{WeightedBlocks: 1, InFlight: 1, Healthy: true, Health: 1},
				{WeightedBlocks: 2, InFlight: 2, Healthy: true, Health: 1},
			},
			want: []float64{0.25 + 0.25, 0.5},
		},
		{name: "no candidates", req: Request{Blocks: 3}, want: []float64{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := NewComposite(tt.cfg)
			if err != nil {
				t.Fatal(err)
			}
			out := make([]float64, 0, 8)
			got := c.Score(tt.req, tt.cands, out)
			assertScores(t, got, tt.want)
			if len(tt.cands) > 0 && &got[0] != &out[:1][0] {
				t.Error("Score did not reuse out")
			}
		})
	}
}

func TestCompositeScoreGrowsSmallOut(t *testing.T) {
	c, _ := NewComposite(CompositeConfig{})
	got := c.Score(Request{}, make([]Candidate, 3), nil)
	assertScores(t, got, []float64{math.Inf(-1), math.Inf(-1), math.Inf(-1)})
}

func TestCompositeActive(t *testing.T) {
	tests := []struct {
		name      string
		threshold float64
		req       Request
		cands     []Candidate
		best      float64
		active    bool
	}{
		{name: "below threshold", req: Request{Blocks: 100}, cands: []Candidate{{WeightedBlocks: 29, Healthy: true}, {WeightedBlocks: 10, Healthy: true}}, best: 0.29},
		{name: "at threshold", req: Request{Blocks: 100}, cands: []Candidate{{WeightedBlocks: 30, Healthy: true}}, best: 0.3, active: true},
		{name: "tier weighted", req: Request{Blocks: 10}, cands: []Candidate{{CachedBlocks: 10, WeightedBlocks: 6, Healthy: true}}, best: 0.6, active: true},
		{name: "only unhealthy holds it", req: Request{Blocks: 10}, cands: []Candidate{{WeightedBlocks: 10}, {WeightedBlocks: 1, Healthy: true}}, best: 0.1},
		{name: "no overlap", req: Request{Blocks: 10}, cands: []Candidate{{Healthy: true}}, best: 0},
		{name: "no overlap tiny threshold", threshold: 1e-12, req: Request{Blocks: 10}, cands: []Candidate{{Healthy: true}}, best: 0},
		{name: "any overlap tiny threshold", threshold: 1e-12, req: Request{Blocks: 1000}, cands: []Candidate{{WeightedBlocks: 0.01, Healthy: true}}, best: 1e-5, active: true},
		{name: "unknown length uses the default normalisation", req: Request{}, cands: []Candidate{{WeightedBlocks: 0.1, Healthy: true}}, best: 1, active: true},
		{name: "no candidates", req: Request{Blocks: 10}, best: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := NewComposite(CompositeConfig{MinOverlapThreshold: tt.threshold})
			if err != nil {
				t.Fatal(err)
			}
			if got := c.BestOverlapRatio(tt.req, tt.cands); !approx(got, tt.best) {
				t.Errorf("BestOverlapRatio = %v, want %v", got, tt.best)
			}
			if got := c.Active(tt.req, tt.cands); got != tt.active {
				t.Errorf("Active = %v, want %v", got, tt.active)
			}
		})
	}
}

func TestCompositeAllocs(t *testing.T) {
	c, _ := NewComposite(CompositeConfig{})
	cands := benchCandidates(16, 64)
	req := Request{Blocks: 64}
	out := make([]float64, len(cands))
	assertNoAllocs(t, func() { out = c.Score(req, cands, out) })
	assertNoAllocs(t, func() { _ = c.Active(req, cands) })
}

// A backend with a long prompt still to prefill is busier than its request count says: with the
// default PrefillTokensPerRequest its pending tokens count, and a negative value restores the
// the documented load ratio of requests alone.
func TestCompositePendingPrefillTokens(t *testing.T) {
	cands := []Candidate{
		{Backend: "one-short", WeightedBlocks: 4, InFlight: 1, Healthy: true, Health: 1},
		{Backend: "long-prompt", WeightedBlocks: 4, InFlight: 0, PendingPrefillTokens: 4096, Healthy: true, Health: 1},
	}
	req := Request{Blocks: 8}
	for _, tc := range []struct {
		name   string
		perReq int
		want   string
	}{
		{"default counts pending tokens", 0, "one-short"},
		{"128 tokens per request", 128, "one-short"},
		{"negative ignores them", -1, "long-prompt"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := NewComposite(CompositeConfig{PrefillTokensPerRequest: tc.perReq})
			if err != nil {
				t.Fatal(err)
			}
			s := c.Score(req, cands, nil)
			best := 0
			if s[1] > s[0] {
				best = 1
			}
			if got := cands[best].Backend; got != tc.want {
				t.Errorf("best %s (scores %v), want %s", got, s, tc.want)
			}
		})
	}
}
