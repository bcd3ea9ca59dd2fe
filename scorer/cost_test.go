package scorer

import (
	"errors"
	"math"
	"testing"
)

func TestNewCost(t *testing.T) {
	tests := []struct {
		name    string
		cfg     CostConfig
		want    CostConfig
		wantErr bool
	}{
		{name: "zero means default", want: CostConfig{PrefillWeight: 1}},
		{name: "custom", cfg: CostConfig{PrefillWeight: 2.5}, want: CostConfig{PrefillWeight: 2.5}},
		{name: "load only", cfg: CostConfig{LoadOnly: true}, want: CostConfig{LoadOnly: true}},
		{name: "load only with weight", cfg: CostConfig{PrefillWeight: 1, LoadOnly: true}, wantErr: true},
		{name: "negative", cfg: CostConfig{PrefillWeight: -1}, wantErr: true},
		{name: "NaN", cfg: CostConfig{PrefillWeight: math.NaN()}, wantErr: true},
		{name: "Inf", cfg: CostConfig{PrefillWeight: math.Inf(1)}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := NewCost(tt.cfg)
			if tt.wantErr {
				if !errors.Is(err, ErrInvalidConfig) {
					t.Fatalf("err = %v, want ErrInvalidConfig", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.Sequences() == nil {
				t.Fatal("no tracker of active sequences")
			}
			if got := c.Config(); got.PrefillWeight != tt.want.PrefillWeight || got.LoadOnly != tt.want.LoadOnly {
				t.Errorf("Config() = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestCostScore(t *testing.T) {
	ninf := math.Inf(-1)
	// Dynamo's worked example: prefill 8/5/2 and decode 10/5/9 blocks give costs 18/10/11.
	dynamo := []Candidate{
		{Backend: "w1", CachedBlocks: 2, ActivePrefillBlocks: 6, ActiveDecodeBlocks: 6, Healthy: true},
		{Backend: "w2", CachedBlocks: 4, ActivePrefillBlocks: 5, ActiveDecodeBlocks: 1, Healthy: true},
		{Backend: "w3", CachedBlocks: 2, ActivePrefillBlocks: 0, ActiveDecodeBlocks: 5, Healthy: true},
	}
	tests := []struct {
		name  string
		cfg   CostConfig
		req   Request
		cands []Candidate
		want  []float64
		pick  int
	}{
		{name: "dynamo example", req: Request{Blocks: 4}, cands: dynamo, want: []float64{-18, -10, -11}, pick: 1},
		{name: "prefill weight 2", cfg: CostConfig{PrefillWeight: 2}, req: Request{Blocks: 4}, cands: dynamo, want: []float64{-26, -15, -13}, pick: 2},
		{name: "load only", cfg: CostConfig{LoadOnly: true}, req: Request{Blocks: 4}, cands: dynamo, want: []float64{-10, -5, -9}, pick: 1},
		{
			name: "unhealthy and clamps",
			req:  Request{Blocks: 3},
			cands: []Candidate{
				{CachedBlocks: 9, Healthy: true}, // cached beyond the request
				{CachedBlocks: -2, ActivePrefillBlocks: -5, ActiveDecodeBlocks: -1, Healthy: true}, // negatives count as 0
				{CachedBlocks: 3},
			},
			want: []float64{-3, -6, ninf},
			pick: 0,
		},
		{name: "untokenized request", req: Request{}, cands: []Candidate{{ActivePrefillBlocks: 2, ActiveDecodeBlocks: 3, Healthy: true}}, want: []float64{-5}, pick: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := NewCost(tt.cfg)
			if err != nil {
				t.Fatal(err)
			}
			got := c.Score(tt.req, tt.cands, make([]float64, len(tt.cands)))
			assertScores(t, got, tt.want)
			if p := PickBest(got, tt.cands); p != tt.pick {
				t.Errorf("PickBest = %d, want %d", p, tt.pick)
			}
		})
	}
}

func TestCostAllocs(t *testing.T) {
	c, _ := NewCost(CostConfig{})
	cands := benchCandidates(16, 64)
	out := make([]float64, len(cands))
	assertNoAllocs(t, func() { out = c.Score(Request{Blocks: 64}, cands, out) })
}
