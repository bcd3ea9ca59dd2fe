package scorer

import (
	"errors"
	"math"
	"testing"
	"time"
)

// near reports whether a and b agree to a relative 1e-12 (exactly, for infinities).
func near(a, b float64) bool {
	if math.IsInf(a, 0) || math.IsInf(b, 0) {
		return a == b
	}
	return math.Abs(a-b) <= 1e-12*max(1, math.Abs(a), math.Abs(b))
}

func newTTFT(t *testing.T, cfg ExpectedTTFTConfig) *ExpectedTTFT {
	t.Helper()
	e, err := NewExpectedTTFT(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// ttftScore is ExpectedTTFT's documented score, from its formula: −((pending + own)/weight +
// cacheWeight·own) with own = PrefillWork(tokens, cached, attention).
func ttftScore(cacheWeight, attention float64, tokens, cached int, pending, weight float64) float64 {
	own := PrefillWork(tokens, cached, attention)
	return -((pending+own)/weight + cacheWeight*own)
}

// best returns the Backend PickBest chooses.
func best(scores []float64, cands []Candidate) string {
	i := PickBest(scores, cands)
	if i < 0 {
		return ""
	}
	return cands[i].Backend
}

func TestPrefillWork(t *testing.T) {
	nan := math.NaN()
	tests := []struct {
		name          string
		tokens        int
		cached        int
		attentionCost float64
		want          float64
	}{
		{name: "linear: no attention", tokens: 100, want: 100},
		{name: "linear: cached part free", tokens: 100, cached: 40, want: 60},
		{name: "linear: negative attention", tokens: 100, cached: 40, attentionCost: -1, want: 60},
		{name: "linear: -Inf attention", tokens: 100, cached: 40, attentionCost: math.Inf(-1), want: 60},
		{name: "linear: NaN attention", tokens: 100, cached: 40, attentionCost: nan, want: 60},
		// (n − c) + a·(n² − c²)
		{name: "quadratic", tokens: 100, attentionCost: 0.01, want: 100 + 0.01*100*100},
		{name: "quadratic with cache", tokens: 100, cached: 40, attentionCost: 0.01, want: 60 + 0.01*(100*100-40*40)},
		{name: "default attention", tokens: 10_000, attentionCost: DefaultAttentionCost, want: 10_000 + 2e-5*1e8},
		{name: "cached beyond the prompt", tokens: 100, cached: 150, attentionCost: 0.01, want: 0},
		{name: "all cached", tokens: 100, cached: 100, attentionCost: 0.01, want: 0},
		{name: "negative cached", tokens: 100, cached: -5, attentionCost: 0.01, want: 200},
		{name: "negative tokens", tokens: -10, attentionCost: 0.01, want: 0},
		{name: "negative tokens and cached", tokens: -10, cached: -20, attentionCost: 0.01, want: 0},
		{name: "negative tokens, positive cached", tokens: -10, cached: 5, attentionCost: 0.01, want: 0},
		{name: "empty prompt", attentionCost: 0.01, want: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := PrefillWork(tt.tokens, tt.cached, tt.attentionCost); !near(got, tt.want) {
				t.Errorf("PrefillWork(%d, %d, %v) = %v, want %v", tt.tokens, tt.cached, tt.attentionCost, got, tt.want)
			}
		})
	}
}

// The last 10,000 tokens of a 100,000-token prompt attend to 90,000 tokens before them: they cost
// more than a 10,000-token prompt, and exactly as much without attention.
func TestPrefillWorkLongContext(t *testing.T) {
	tail := PrefillWork(100_000, 90_000, DefaultAttentionCost)
	short := PrefillWork(10_000, 0, DefaultAttentionCost)
	if !(tail > short) {
		t.Errorf("last 10k of 100k: %v, a 10k prompt: %v; want the former larger", tail, short)
	}
	// 10,000 + 2e-5·(1e10 − 8.1e9) = 48,000 against 10,000 + 2e-5·1e8 = 12,000.
	if !near(tail, 48_000) || !near(short, 12_000) {
		t.Errorf("got %v and %v, want 48000 and 12000", tail, short)
	}
	if a, b := PrefillWork(100_000, 90_000, 0), PrefillWork(10_000, 0, 0); a != b {
		t.Errorf("without attention: %v and %v, want equal", a, b)
	}
}

// More tokens cost more, more cached costs less.
func TestPrefillWorkMonotone(t *testing.T) {
	for _, a := range []float64{0, DefaultAttentionCost, MaxAttentionCost} {
		for n := 0; n <= 4096; n += 512 {
			for c := 0; c <= n; c += 256 {
				w := PrefillWork(n, c, a)
				if w < 0 {
					t.Fatalf("PrefillWork(%d, %d, %v) = %v < 0", n, c, a, w)
				}
				if next := PrefillWork(n+1, c, a); !(next > w) {
					t.Errorf("PrefillWork(%d, %d, %v) = %v, not above %v for %d tokens", n+1, c, a, next, w, n)
				}
				if c < n {
					if next := PrefillWork(n, c+1, a); !(next < w) {
						t.Errorf("PrefillWork(%d, %d, %v) = %v, not below %v for %d cached", n, c+1, a, next, w, c)
					}
				}
			}
		}
	}
}

func TestNewExpectedTTFT(t *testing.T) {
	nan, inf := math.NaN(), math.Inf(1)
	defaults := ExpectedTTFTConfig{CacheWeight: 6, AttentionCost: 2e-5, HotShare: 1.1, HotDiscount: 5, WaitLimit: 10 * time.Second, WaitPenalty: 3}
	with := func(f func(*ExpectedTTFTConfig)) ExpectedTTFTConfig {
		c := defaults
		f(&c)
		return c
	}
	tests := []struct {
		name    string
		cfg     ExpectedTTFTConfig
		want    ExpectedTTFTConfig
		wantErr bool
	}{
		{name: "zero means defaults", want: defaults},
		{name: "defaults are the constants", want: ExpectedTTFTConfig{DefaultCacheWeight, DefaultAttentionCost, DefaultHotShare, DefaultHotDiscount, DefaultWaitLimit, DefaultWaitPenalty}},
		{name: "cache weight", cfg: ExpectedTTFTConfig{CacheWeight: 2.5}, want: with(func(c *ExpectedTTFTConfig) { c.CacheWeight = 2.5 })},
		{name: "small cache weight", cfg: ExpectedTTFTConfig{CacheWeight: 1e-9}, want: with(func(c *ExpectedTTFTConfig) { c.CacheWeight = 1e-9 })},
		{name: "attention cost", cfg: ExpectedTTFTConfig{AttentionCost: 1e-3}, want: with(func(c *ExpectedTTFTConfig) { c.AttentionCost = 1e-3 })},
		{name: "attention cost at its maximum", cfg: ExpectedTTFTConfig{AttentionCost: MaxAttentionCost}, want: with(func(c *ExpectedTTFTConfig) { c.AttentionCost = MaxAttentionCost })},
		{name: "attention off reads -1", cfg: ExpectedTTFTConfig{AttentionCost: -1}, want: with(func(c *ExpectedTTFTConfig) { c.AttentionCost = -1 })},
		{name: "any negative attention is off", cfg: ExpectedTTFTConfig{AttentionCost: -0.5}, want: with(func(c *ExpectedTTFTConfig) { c.AttentionCost = -1 })},
		{name: "-Inf attention is off", cfg: ExpectedTTFTConfig{AttentionCost: -inf}, want: with(func(c *ExpectedTTFTConfig) { c.AttentionCost = -1 })},
		{name: "hot share 1", cfg: ExpectedTTFTConfig{HotShare: 1}, want: with(func(c *ExpectedTTFTConfig) { c.HotShare = 1 })},
		{name: "hot share 3", cfg: ExpectedTTFTConfig{HotShare: 3}, want: with(func(c *ExpectedTTFTConfig) { c.HotShare = 3 })},
		{name: "hot discount", cfg: ExpectedTTFTConfig{HotDiscount: 0.5}, want: with(func(c *ExpectedTTFTConfig) { c.HotDiscount = 0.5 })},
		{name: "hot discount off reads -1", cfg: ExpectedTTFTConfig{HotDiscount: -1}, want: with(func(c *ExpectedTTFTConfig) { c.HotDiscount = -1 })},
		{name: "any negative hot discount is off", cfg: ExpectedTTFTConfig{HotDiscount: -7}, want: with(func(c *ExpectedTTFTConfig) { c.HotDiscount = -1 })},
		{name: "everything set", cfg: ExpectedTTFTConfig{3, 1e-4, 1.5, 2, 4 * time.Second, 1}, want: ExpectedTTFTConfig{3, 1e-4, 1.5, 2, 4 * time.Second, 1}},
		{name: "everything off", cfg: ExpectedTTFTConfig{3, -1, 1.5, -1, -1, 1}, want: ExpectedTTFTConfig{3, -1, 1.5, -1, -1, 1}},
		{name: "wait limit", cfg: ExpectedTTFTConfig{WaitLimit: 30 * time.Second}, want: with(func(c *ExpectedTTFTConfig) { c.WaitLimit = 30 * time.Second })},
		{name: "any negative wait limit is off", cfg: ExpectedTTFTConfig{WaitLimit: -time.Hour}, want: with(func(c *ExpectedTTFTConfig) { c.WaitLimit = -1 })},
		{name: "wait penalty", cfg: ExpectedTTFTConfig{WaitPenalty: 0.5}, want: with(func(c *ExpectedTTFTConfig) { c.WaitPenalty = 0.5 })},
		{name: "negative wait penalty", cfg: ExpectedTTFTConfig{WaitPenalty: -1}, wantErr: true},
		{name: "NaN wait penalty", cfg: ExpectedTTFTConfig{WaitPenalty: nan}, wantErr: true},
		{name: "Inf wait penalty", cfg: ExpectedTTFTConfig{WaitPenalty: inf}, wantErr: true},

		{name: "negative cache weight", cfg: ExpectedTTFTConfig{CacheWeight: -1}, wantErr: true},
		{name: "NaN cache weight", cfg: ExpectedTTFTConfig{CacheWeight: nan}, wantErr: true},
		{name: "Inf cache weight", cfg: ExpectedTTFTConfig{CacheWeight: inf}, wantErr: true},
		{name: "-Inf cache weight", cfg: ExpectedTTFTConfig{CacheWeight: -inf}, wantErr: true},
		{name: "attention above its maximum", cfg: ExpectedTTFTConfig{AttentionCost: MaxAttentionCost * 1.01}, wantErr: true},
		{name: "attention 1", cfg: ExpectedTTFTConfig{AttentionCost: 1}, wantErr: true},
		{name: "Inf attention", cfg: ExpectedTTFTConfig{AttentionCost: inf}, wantErr: true},
		{name: "NaN attention", cfg: ExpectedTTFTConfig{AttentionCost: nan}, wantErr: true},
		{name: "hot share 0.5", cfg: ExpectedTTFTConfig{HotShare: 0.5}, wantErr: true},
		{name: "hot share just below 1", cfg: ExpectedTTFTConfig{HotShare: 0.999}, wantErr: true},
		{name: "hot share tiny", cfg: ExpectedTTFTConfig{HotShare: 1e-9}, wantErr: true},
		{name: "negative hot share", cfg: ExpectedTTFTConfig{HotShare: -1}, wantErr: true},
		{name: "NaN hot share", cfg: ExpectedTTFTConfig{HotShare: nan}, wantErr: true},
		{name: "Inf hot share", cfg: ExpectedTTFTConfig{HotShare: inf}, wantErr: true},
		{name: "-Inf hot share", cfg: ExpectedTTFTConfig{HotShare: -inf}, wantErr: true},
		{name: "NaN hot discount", cfg: ExpectedTTFTConfig{HotDiscount: nan}, wantErr: true},
		{name: "Inf hot discount", cfg: ExpectedTTFTConfig{HotDiscount: inf}, wantErr: true},
		{name: "-Inf hot discount", cfg: ExpectedTTFTConfig{HotDiscount: -inf}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e, err := NewExpectedTTFT(tt.cfg)
			if tt.wantErr {
				if !errors.Is(err, ErrInvalidConfig) {
					t.Fatalf("err = %v, want ErrInvalidConfig", err)
				}
				if e != nil {
					t.Errorf("a scorer with the error: %+v", e)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got := e.Config()
			if got != tt.want {
				t.Fatalf("Config() = %+v, want %+v", got, tt.want)
			}
			// Round trip: the configuration in effect builds the same scorer.
			again, err := NewExpectedTTFT(got)
			if err != nil {
				t.Fatalf("NewExpectedTTFT(%+v): %v", got, err)
			}
			if c := again.Config(); c != got {
				t.Errorf("round trip: Config() = %+v, want %+v", c, got)
			}
		})
	}
}

func TestExpectedTTFTScore(t *testing.T) {
	ninf := math.Inf(-1)
	noAttention := ExpectedTTFTConfig{AttentionCost: -1} // work is tokens: round numbers
	tests := []struct {
		name  string
		cfg   ExpectedTTFTConfig
		req   Request
		cands []Candidate
		want  []float64
	}{
		{
			name: "formula without attention",
			cfg:  noAttention,
			req:  Request{Tokens: 1000},
			cands: []Candidate{
				{Backend: "holder", CachedTokens: 1000, Weight: 1, Healthy: true},
				{Backend: "cold", Weight: 1, Healthy: true},
				{Backend: "busy-big", CachedTokens: 400, PendingPrefillWork: 500, Weight: 2, Healthy: true},
				{Backend: "down", CachedTokens: 1000, Healthy: false},
			},
			// holder: own 0; cold: 1000 + 6·1000; busy-big: own 600, (500+600)/2 + 6·600.
			want: []float64{0, -7000, -4150, ninf},
		},
		{
			name: "formula with the default attention",
			req:  Request{Tokens: 4096},
			cands: []Candidate{
				{CachedTokens: 1024, PendingPrefillWork: 300, Weight: 1, Healthy: true},
				{CachedTokens: 0, Weight: 1, Healthy: true},
			},
			want: []float64{
				ttftScore(6, 2e-5, 4096, 1024, 300, 1),
				ttftScore(6, 2e-5, 4096, 0, 0, 1),
			},
		},
		{
			name: "cache weight 1",
			cfg:  ExpectedTTFTConfig{CacheWeight: 1, AttentionCost: -1},
			req:  Request{Tokens: 100},
			cands: []Candidate{
				{CachedTokens: 30, PendingPrefillWork: 10, Healthy: true},
			},
			want: []float64{-((10 + 70) + 70)},
		},
		{
			name: "cached beyond the prompt counts as the prompt; negative as none",
			cfg:  noAttention,
			req:  Request{Tokens: 100},
			cands: []Candidate{
				{CachedTokens: 500, Healthy: true},
				{CachedTokens: -5, Healthy: true},
			},
			want: []float64{0, -700},
		},
		{
			name: "invalid weight counts as one",
			cfg:  noAttention,
			req:  Request{Tokens: 100},
			cands: []Candidate{
				{PendingPrefillWork: 100, Weight: 0, Healthy: true},
				{PendingPrefillWork: 100, Weight: -2, Healthy: true},
				{PendingPrefillWork: 100, Weight: math.NaN(), Healthy: true},
				{PendingPrefillWork: 100, Weight: math.Inf(1), Healthy: true},
				{PendingPrefillWork: 100, Weight: 1, Healthy: true},
			},
			want: []float64{-800, -800, -800, -800, -800},
		},
		{
			name: "unhealthy scores -Inf whatever it holds",
			req:  Request{Tokens: 64},
			cands: []Candidate{
				{CachedTokens: 64, Healthy: false, Health: 1},
				{CachedTokens: 0, PendingPrefillWork: math.NaN(), Healthy: false},
			},
			want: []float64{ninf, ninf},
		},
		{name: "no candidates", req: Request{Tokens: 64}, want: []float64{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newTTFT(t, tt.cfg)
			out := make([]float64, 0, 8)
			got := e.Score(tt.req, tt.cands, out)
			if len(got) != len(tt.want) {
				t.Fatalf("len(scores) = %d, want %d (%v)", len(got), len(tt.want), got)
			}
			for i := range tt.want {
				if !near(got[i], tt.want[i]) {
					t.Errorf("score[%d] = %v, want %v (all %v)", i, got[i], tt.want[i], got)
				}
			}
			if len(tt.cands) > 0 && &got[0] != &out[:1][0] {
				t.Error("Score did not reuse out")
			}
		})
	}
}

func TestExpectedTTFTScoreGrowsSmallOut(t *testing.T) {
	e := newTTFT(t, ExpectedTTFTConfig{})
	cands := []Candidate{{Healthy: true}, {}, {Healthy: true, CachedTokens: 8}}
	small := make([]float64, 1)
	got := e.Score(Request{Tokens: 8}, cands, small)
	if len(got) != 3 {
		t.Fatalf("len(scores) = %d, want 3", len(got))
	}
	if !math.IsInf(got[1], -1) || got[2] != 0 || !(got[0] < 0) {
		t.Errorf("scores %v", got)
	}
	if got := e.Score(Request{}, make([]Candidate, 2), nil); len(got) != 2 || !math.IsInf(got[0], -1) || !math.IsInf(got[1], -1) {
		t.Errorf("nil out: %v", got)
	}
}

// Idle, the backend that holds the whole prompt beats every cold or partly warm backend.
func TestExpectedTTFTIdleHolderWins(t *testing.T) {
	for _, cfg := range []ExpectedTTFTConfig{{}, {AttentionCost: -1}, {CacheWeight: 1e-6}, {CacheWeight: 50, AttentionCost: MaxAttentionCost}} {
		e := newTTFT(t, cfg)
		cands := []Candidate{
			{Backend: "cold-1", Weight: 1, Healthy: true},
			{Backend: "warm", CachedTokens: 4096, Weight: 1, Healthy: true},
			{Backend: "holder", CachedTokens: 8192, Weight: 1, Healthy: true},
			{Backend: "cold-2", Weight: 1, Healthy: true},
		}
		scores := e.Score(Request{Tokens: 8192}, cands, nil)
		if got := best(scores, cands); got != "holder" {
			t.Errorf("%+v: picked %s (scores %v), want holder", e.Config(), got, scores)
		}
		if scores[2] != 0 {
			t.Errorf("%+v: the idle holder of the whole prompt scored %v, want 0", e.Config(), scores[2])
		}
		if !(scores[1] > scores[0]) || scores[0] != scores[3] {
			t.Errorf("%+v: scores %v, want warm above cold, the cold ones equal", e.Config(), scores)
		}
	}
}

// The holder's cost is pending + (1+CacheWeight)·own_holder (weight 1), a cold idle backend's
// (1+CacheWeight)·own_cold: the holder keeps the request while its pending work is below
// (1 + CacheWeight)·saved, saved = own_cold − own_holder the prefill its cache saves (the "about
// CacheWeight times" of the documentation), and loses it above.
func TestExpectedTTFTQueueThreshold(t *testing.T) {
	const n = 4096
	for _, tc := range []struct {
		name   string
		cfg    ExpectedTTFTConfig
		cached int
	}{
		{name: "defaults, whole prompt", cached: n},
		{name: "defaults, half the prompt", cached: n / 2},
		{name: "no attention, whole prompt", cfg: ExpectedTTFTConfig{AttentionCost: -1}, cached: n},
		{name: "cache weight 1, most of the prompt", cfg: ExpectedTTFTConfig{CacheWeight: 1}, cached: 3000},
		{name: "cache weight 20, whole prompt", cfg: ExpectedTTFTConfig{CacheWeight: 20, AttentionCost: 1e-3}, cached: n},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newTTFT(t, tc.cfg)
			cfg := e.Config()
			attn := max(cfg.AttentionCost, 0)
			saved := PrefillWork(n, 0, attn) - PrefillWork(n, tc.cached, attn)
			threshold := (1 + cfg.CacheWeight) * saved
			for _, side := range []struct {
				factor float64
				want   string
			}{{0, "holder"}, {0.5, "holder"}, {0.99, "holder"}, {1.01, "cold"}, {2, "cold"}} {
				cands := []Candidate{
					{Backend: "cold", Weight: 1, Healthy: true},
					{Backend: "holder", CachedTokens: tc.cached, PendingPrefillWork: side.factor * threshold, Weight: 1, Healthy: true},
				}
				scores := e.Score(Request{Tokens: n}, cands, nil)
				if got := best(scores, cands); got != side.want {
					t.Errorf("pending %.2f × threshold %.1f: picked %s (scores %v), want %s", side.factor, threshold, got, scores, side.want)
				}
			}
		})
	}
}

// Pending work is divided by the weight: a backend of weight 2 drains the same queue twice as
// fast.
func TestExpectedTTFTWeight(t *testing.T) {
	e := newTTFT(t, ExpectedTTFTConfig{})
	cands := []Candidate{
		{Backend: "small", CachedTokens: 512, PendingPrefillWork: 20_000, Weight: 1, Healthy: true},
		{Backend: "big", CachedTokens: 512, PendingPrefillWork: 20_000, Weight: 2, Healthy: true},
	}
	req := Request{Tokens: 2048}
	scores := e.Score(req, cands, nil)
	if got := best(scores, cands); got != "big" || !(scores[1] > scores[0]) {
		t.Errorf("picked %s (scores %v), want big strictly better", got, scores)
	}
	for i, w := range []float64{1, 2} {
		if want := ttftScore(6, 2e-5, 2048, 512, 20_000, w); !near(scores[i], want) {
			t.Errorf("score[%d] = %v, want %v", i, scores[i], want)
		}
	}
	// Twice the queue on twice the capacity waits as long.
	cands[1].PendingPrefillWork = 40_000 + PrefillWork(2048, 512, DefaultAttentionCost)
	scores = e.Score(req, cands, scores)
	if !near(scores[0], scores[1]) {
		t.Errorf("scores %v, want equal", scores)
	}
}

// A backend receiving more than HotShare times its fair share has its cached part counted at
// 1 − HotDiscount·(RecentShare − HotShare), never below 0.
func TestExpectedTTFTHotDiscount(t *testing.T) {
	const n = 4096
	req := Request{Tokens: n}
	cold := ttftScore(6, 2e-5, n, 0, 0, 1)
	tests := []struct {
		name  string
		cfg   ExpectedTTFTConfig
		share float64
		want  float64 // the idle holder's score
	}{
		{name: "unknown share", share: 0, want: 0},
		{name: "fair share", share: 1, want: 0},
		{name: "at the hot share", share: 1.1, want: 0},
		{name: "NaN share", share: math.NaN(), want: 0},
		// 1 − 5·(1.2 − 1.1) = 0.5: half the prompt counts as cached.
		{name: "a little hot", share: 1.2, want: ttftScore(6, 2e-5, n, n/2, 0, 1)},
		// 1 − 5·(1.25 − 1.1) = 0.25.
		{name: "hotter", share: 1.25, want: ttftScore(6, 2e-5, n, n/4, 0, 1)},
		// HotShare + 1/HotDiscount = 1.3: nothing counts as cached, the holder is a cold backend.
		{name: "at HotShare + 1/HotDiscount", share: 1.3, want: cold},
		{name: "far above", share: 4, want: cold},
		{name: "Inf share", share: math.Inf(1), want: cold},
		{name: "discount off", cfg: ExpectedTTFTConfig{HotDiscount: -1}, share: 4, want: 0},
		{name: "custom: below", cfg: ExpectedTTFTConfig{HotShare: 2, HotDiscount: 1}, share: 1.9, want: 0},
		// 1 − 1·(2.5 − 2) = 0.5.
		{name: "custom: half", cfg: ExpectedTTFTConfig{HotShare: 2, HotDiscount: 1}, share: 2.5, want: ttftScore(6, 2e-5, n, n/2, 0, 1)},
		{name: "custom: at HotShare + 1/HotDiscount", cfg: ExpectedTTFTConfig{HotShare: 2, HotDiscount: 1}, share: 3, want: cold},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newTTFT(t, tt.cfg)
			cands := []Candidate{{Backend: "holder", CachedTokens: n, RecentShare: tt.share, Weight: 1, Healthy: true}}
			if got := e.Score(req, cands, nil)[0]; !near(got, tt.want) {
				t.Errorf("score = %v, want %v (cold: %v)", got, tt.want, cold)
			}
		})
	}
}

// The discount shifts the decision: a holder that keeps a request at its fair share loses it
// once it gets more than its share, and keeps it again with the discount turned off.
func TestExpectedTTFTHotHolderLosesItsAdvantage(t *testing.T) {
	const n = 4096
	saved := PrefillWork(n, 0, DefaultAttentionCost)
	pending := 0.5 * (1 + DefaultCacheWeight) * saved // half the threshold at the fair share
	for _, tc := range []struct {
		cfg   ExpectedTTFTConfig
		share float64
		want  string
	}{
		{share: 1, want: "holder"},
		{share: 1.1, want: "holder"},
		{share: 1.25, want: "cold"},
		{share: 2, want: "cold"},
		{cfg: ExpectedTTFTConfig{HotDiscount: -1}, share: 2, want: "holder"},
	} {
		e := newTTFT(t, tc.cfg)
		cands := []Candidate{
			{Backend: "cold", Weight: 1, Healthy: true, RecentShare: 0.5},
			{Backend: "holder", CachedTokens: n, PendingPrefillWork: pending, RecentShare: tc.share, Weight: 1, Healthy: true},
		}
		scores := e.Score(Request{Tokens: n}, cands, nil)
		if got := best(scores, cands); got != tc.want {
			t.Errorf("%+v, share %v: picked %s (scores %v), want %s", e.Config(), tc.share, got, scores, tc.want)
		}
	}
}

// A request of unknown length (Tokens ≤ 0) is taken as long as the best healthy candidate's
// cached prefix: it scores as if Tokens were that length.
func TestExpectedTTFTUnknownLength(t *testing.T) {
	e := newTTFT(t, ExpectedTTFTConfig{})
	cands := []Candidate{
		{Backend: "holder", CachedTokens: 2048, PendingPrefillWork: 100, Weight: 1, Healthy: true},
		{Backend: "partial", CachedTokens: 512, Weight: 1, Healthy: true},
		{Backend: "down", CachedTokens: 8192, Weight: 1, Healthy: false}, // does not set the length
		{Backend: "cold", Weight: 1, Healthy: true},
	}
	want := e.Score(Request{Tokens: 2048}, cands, nil)
	if !near(want[0], -100) {
		t.Fatalf("holder scored %v, want -100", want[0])
	}
	for _, tokens := range []int{0, -1} {
		got := e.Score(Request{Blocks: 128, Tokens: tokens}, cands, nil)
		for i := range want {
			if !near(got[i], want[i]) {
				t.Errorf("Tokens %d: score[%d] = %v, want %v (all %v)", tokens, i, got[i], want[i], got)
			}
		}
	}
	// Nothing cached anywhere: an empty prompt, every healthy candidate at its queue alone.
	none := []Candidate{{PendingPrefillWork: 7, Healthy: true}, {Healthy: true}}
	assertScores(t, e.Score(Request{}, none, nil), []float64{-7, 0})
}

// PendingPrefillWork that is NaN or negative counts as nothing queued; +Inf ranks the candidate
// last, with a finite score.
func TestExpectedTTFTPendingWorkEdges(t *testing.T) {
	e := newTTFT(t, ExpectedTTFTConfig{})
	req := Request{Tokens: 1024}
	idle := ttftScore(6, 2e-5, 1024, 256, 0, 1)
	for _, pending := range []float64{0, -1, -1e300, math.Inf(-1), math.NaN()} {
		got := e.Score(req, []Candidate{{CachedTokens: 256, PendingPrefillWork: pending, Weight: 1, Healthy: true}}, nil)
		if !near(got[0], idle) {
			t.Errorf("pending %v: score %v, want %v (as idle)", pending, got[0], idle)
		}
	}
	cands := []Candidate{
		{Backend: "inf-holder", CachedTokens: 1024, PendingPrefillWork: math.Inf(1), Weight: 1, Healthy: true},
		{Backend: "busy-cold", PendingPrefillWork: 1e15, Weight: 1, Healthy: true},
		{Backend: "inf-big", CachedTokens: 1024, PendingPrefillWork: math.Inf(1), Weight: 8, Healthy: true},
	}
	scores := e.Score(req, cands, nil)
	for i, s := range scores {
		if math.IsNaN(s) || math.IsInf(s, 0) {
			t.Errorf("score[%d] = %v, want finite", i, s)
		}
	}
	if got := best(scores, cands); got != "busy-cold" {
		t.Errorf("picked %s (scores %v), want busy-cold: +Inf pending ranks last", got, scores)
	}
	if !(scores[0] < scores[1]) {
		t.Errorf("scores %v: +Inf pending not below 1e15", scores)
	}
}

func TestExpectedTTFTAllocs(t *testing.T) {
	e := newTTFT(t, ExpectedTTFTConfig{})
	cands := benchCandidates(16, 512)
	req := Request{Blocks: 512, Tokens: 512 * 16}
	out := make([]float64, len(cands))
	assertNoAllocs(t, func() { out = e.Score(req, cands, out) })
	assertNoAllocs(t, func() { out = e.Score(Request{}, cands, out) })
	assertNoAllocs(t, func() { _ = PrefillWork(100_000, 90_000, DefaultAttentionCost) })
}

// A prefix held on a slower tier counts as its tier-weighted share of the cached tokens
// (Overlap/CachedBlocks below 1); an Overlap at or above CachedBlocks counts them whole.
func TestExpectedTTFTTierWeight(t *testing.T) {
	e := newTTFT(t, ExpectedTTFTConfig{})
	req := Request{Blocks: 200, Tokens: 3200}
	cands := []Candidate{
		{Backend: "gpu", CachedBlocks: 100, CachedTokens: 1600, WeightedBlocks: 100, Weight: 1, Healthy: true},
		{Backend: "storage", CachedBlocks: 100, CachedTokens: 1600, WeightedBlocks: 60, Weight: 1, Healthy: true},
		{Backend: "over", CachedBlocks: 100, CachedTokens: 1600, WeightedBlocks: 150, Weight: 1, Healthy: true},
	}
	got := e.Score(req, cands, nil)
	want := []float64{
		ttftScore(DefaultCacheWeight, DefaultAttentionCost, 3200, 1600, 0, 1),
		ttftScore(DefaultCacheWeight, DefaultAttentionCost, 3200, 960, 0, 1),
		ttftScore(DefaultCacheWeight, DefaultAttentionCost, 3200, 1600, 0, 1),
	}
	for i := range want {
		if !near(got[i], want[i]) {
			t.Errorf("%s: score %v, want %v", cands[i].Backend, got[i], want[i])
		}
	}
	if best(got, cands) != "gpu" {
		t.Errorf("best %s, want gpu", best(got, cands))
	}
}

// A hit behind a long queue: the holder of a 38,000-token prompt has 26 s of prefill queued (at
// 13,300 token-equivalents a second), an idle backend holds nothing. Under CacheWeight's trade
// alone the request waits for its hit (the queue is under seven times what the hit saves); past
// the wait limit the queue weighs more and the idle backend wins — but only where the rate is
// known, and not with the limit off.
func TestExpectedTTFTWaitLimit(t *testing.T) {
	const tokens, rate = 38000, 13300.0
	cands := func(r float64) []Candidate {
		return []Candidate{
			{Backend: "holder", CachedBlocks: 2368, CachedTokens: 37888, WeightedBlocks: 2368, Weight: 1, Healthy: true,
				Health: 1, PendingPrefillWork: 26 * rate, PrefillRate: r},
			{Backend: "idle", Weight: 1, Healthy: true, Health: 1, PrefillRate: r},
		}
	}
	req := Request{Tokens: tokens, Blocks: tokens / 16}
	for _, tc := range []struct {
		name string
		cfg  ExpectedTTFTConfig
		rate float64
		want string
	}{
		{"default limit, rate known", ExpectedTTFTConfig{}, rate, "idle"},
		{"default limit, rate unknown", ExpectedTTFTConfig{}, 0, "holder"},
		{"limit off", ExpectedTTFTConfig{WaitLimit: -1}, rate, "holder"},
		{"limit above the queue", ExpectedTTFTConfig{WaitLimit: 30 * time.Second}, rate, "holder"},
		{"no penalty to speak of", ExpectedTTFTConfig{WaitPenalty: 0.01}, rate, "holder"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, err := NewExpectedTTFT(tc.cfg)
			if err != nil {
				t.Fatal(err)
			}
			c := cands(tc.rate)
			s := e.Score(req, c, nil)
			best := c[0].Backend
			if s[1] > s[0] {
				best = c[1].Backend
			}
			if best != tc.want {
				t.Errorf("chose %s (scores %v), want %s", best, s, tc.want)
			}
		})
	}
}
