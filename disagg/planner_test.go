package disagg

import (
	"errors"
	"math"
	"net/http"
	"testing"
	"time"

	"github.com/kvroute/kvroute/chwbl"
)

// Candidate builders. cached is in tokens; the tier-weighted overlap is cached/16 blocks at the
// tier's default weight.
func dec(name string, load, cached int, tier Tier) Candidate {
	return Candidate{Name: name, Role: RoleDecode, Healthy: true, Health: 1, DecodeLoad: load,
		CachedTokens: cached, WeightedBlocks: overlapOf(cached, tier), Tier: tier}
}

func pre(name string, load, cached int, tier Tier) Candidate {
	return Candidate{Name: name, Role: RolePrefill, Healthy: true, Health: 1, PrefillLoad: load,
		CachedTokens: cached, WeightedBlocks: overlapOf(cached, tier), Tier: tier}
}

func uni(name string, load int) Candidate {
	return Candidate{Name: name, Role: RoleUnified, Healthy: true, Health: 1, DecodeLoad: load}
}

func overlapOf(tokens int, t Tier) float64 {
	return float64(tokens/16) * [...]float64{1, 0.8, 0.6}[t]
}

func down(c Candidate) Candidate { c.Healthy = false; return c }

// written says that c holds a prefix of n tokens in its external storage too.
func written(c Candidate, n int) Candidate { c.StoredTokens = n; return c }

func at(c Candidate, s ExternalStorage) Candidate { c.Storage = &s; return c }

var (
	storeA = ExternalStorage{Endpoint: "http://store-a:8080", Namespace: "kv"}
	storeB = ExternalStorage{Endpoint: "http://store-b:8080", Namespace: "kv"}
)

func in(tokens int, cands ...Candidate) Input {
	return Input{Candidates: cands, PromptTokens: tokens, PromptBlocks: tokens / 16}
}

func TestPlan(t *testing.T) {
	shared := Config{DefaultStorage: storeA}
	tests := []struct {
		name string
		cfg  Config
		in   Input
		want Plan // Storage is compared by location only
	}{
		{
			name: "gpu hit on a decode backend is fast_decode there",
			in:   in(1000, dec("d1", 0, 0, TierGPU), dec("d2", 1, 960, TierGPU), dec("d3", 1, 320, TierGPU), pre("p1", 0, 0, TierGPU)),
			want: Plan{Path: PathFastDecode, Reason: ReasonLocalHit, Decode: "d2", ExpectedCachedTokens: 960, UncachedTokens: 40},
		},
		{
			name: "cpu offload counts as the backend's own memory",
			in:   in(1000, dec("d1", 0, 0, TierGPU), dec("d2", 1, 992, TierCPU), pre("p1", 0, 0, TierGPU)),
			want: Plan{Path: PathFastDecode, Reason: ReasonLocalHit, Decode: "d2", ExpectedCachedTokens: 992, UncachedTokens: 8},
		},
		{
			name: "equal local hits go to the less loaded holder",
			in:   in(1000, dec("d1", 3, 992, TierGPU), dec("d2", 2, 992, TierGPU), dec("d3", 6, 0, TierGPU), pre("p1", 0, 0, TierGPU)),
			want: Plan{Path: PathFastDecode, Reason: ReasonLocalHit, Decode: "d2", ExpectedCachedTokens: 992, UncachedTokens: 8},
		},
		{
			name: "storage hit goes to the least-loaded decode backend, which loads it",
			cfg:  shared,
			in: in(1000, dec("d1", 3, 0, TierGPU), dec("d2", 1, 0, TierGPU), dec("d3", 2, 0, TierGPU),
				pre("p1", 0, 960, TierStorage)),
			want: Plan{Path: PathFastDecode, Reason: ReasonStorageHit, Decode: "d2", ExpectedCachedTokens: 960, UncachedTokens: 40, Storage: storeA},
		},
		{
			name: "storage written by an unhealthy backend is still readable",
			cfg:  shared,
			in: in(1000, dec("d1", 3, 0, TierGPU), dec("d2", 1, 0, TierGPU), down(dec("d3", 0, 1000, TierStorage)),
				pre("p1", 0, 0, TierGPU)),
			want: Plan{Path: PathFastDecode, Reason: ReasonStorageHit, Decode: "d2", ExpectedCachedTokens: 1000, UncachedTokens: 0, Storage: storeA},
		},
		{
			name: "a longer prefix in storage beats a shorter one in gpu",
			cfg:  shared,
			in: in(1000, dec("d1", 0, 480, TierGPU), dec("d2", 5, 0, TierGPU), dec("d3", 9, 0, TierGPU),
				pre("p1", 0, 992, TierStorage)),
			want: Plan{Path: PathFastDecode, Reason: ReasonStorageHit, Decode: "d1", ExpectedCachedTokens: 992, UncachedTokens: 8, Storage: storeA},
		},
		{
			name: "storage at another location is not readable",
			in: in(1000, at(dec("d1", 0, 0, TierGPU), storeB), at(dec("d2", 1, 0, TierGPU), storeA),
				at(pre("p1", 0, 992, TierStorage), storeA), at(pre("p2", 0, 0, TierGPU), storeB)),
			want: Plan{Path: PathFastDecode, Reason: ReasonStorageHit, Decode: "d2", ExpectedCachedTokens: 992, UncachedTokens: 8, Storage: storeA},
		},
		{
			name: "without external storage a storage-tier prefix is the holder's own disk",
			in: in(1000, dec("d1", 0, 0, TierGPU), dec("d2", 0, 0, TierGPU),
				pre("p1", 0, 992, TierStorage), pre("p2", 0, 0, TierGPU)),
			want: Plan{Path: PathPrefillThenDecode, Reason: ReasonCacheMiss, Prefill: "p1", Decode: "d1", ExpectedCachedTokens: 992, UncachedTokens: 8},
		},
		{
			name: "a prefill backend's gpu prefix written to storage is a storage hit",
			in: in(1000, at(dec("d1", 2, 0, TierGPU), storeA), at(dec("d2", 1, 0, TierGPU), storeA), at(dec("d3", 0, 0, TierGPU), storeB),
				at(written(pre("p1", 0, 992, TierGPU), 992), storeA)),
			want: Plan{Path: PathFastDecode, Reason: ReasonStorageHit, Decode: "d2", ExpectedCachedTokens: 992, UncachedTokens: 8, Storage: storeA},
		},
		{
			name: "the same prefix on gpu only needs a remote prefill",
			in: in(1000, at(dec("d1", 2, 0, TierGPU), storeA), at(dec("d2", 1, 0, TierGPU), storeA), at(dec("d3", 0, 0, TierGPU), storeB),
				at(pre("p1", 0, 992, TierGPU), storeA)),
			want: Plan{Path: PathPrefillThenDecode, Reason: ReasonCacheMiss, Prefill: "p1", Decode: "d2", ExpectedCachedTokens: 992, UncachedTokens: 8, Storage: storeA},
		},
		{
			name: "only the stored part of a gpu prefix is readable from storage",
			in: in(1000, at(dec("d1", 0, 0, TierGPU), storeA),
				at(written(pre("p1", 0, 992, TierGPU), 480), storeA), at(written(pre("p2", 1, 0, TierGPU), 0), storeA)),
			want: Plan{Path: PathPrefillThenDecode, Reason: ReasonCacheMiss, Prefill: "p1", Decode: "d1", ExpectedCachedTokens: 992, UncachedTokens: 8, Storage: storeA},
		},
		{
			name: "a stored prefix longer than a decode backend's own beats it",
			in: in(1000, at(dec("d1", 0, 480, TierGPU), storeA), at(dec("d2", 3, 0, TierGPU), storeA),
				at(written(pre("p1", 0, 992, TierGPU), 960), storeA)),
			want: Plan{Path: PathFastDecode, Reason: ReasonStorageHit, Decode: "d1", ExpectedCachedTokens: 960, UncachedTokens: 40, Storage: storeA},
		},
		{
			name: "a decode backend's own gpu prefix beats the same one in storage",
			in: in(1000, at(dec("d1", 0, 0, TierGPU), storeA), at(written(dec("d2", 1, 992, TierGPU), 992), storeA),
				at(written(pre("p1", 0, 992, TierGPU), 992), storeA)),
			want: Plan{Path: PathFastDecode, Reason: ReasonLocalHit, Decode: "d2", ExpectedCachedTokens: 992, UncachedTokens: 8},
		},
		{
			name: "a stored prefix is not readable from another location",
			in: in(1000, at(dec("d1", 0, 0, TierGPU), storeB),
				at(written(pre("p1", 0, 992, TierGPU), 992), storeA), at(pre("p2", 0, 0, TierGPU), storeB)),
			want: Plan{Path: PathPrefillThenDecode, Reason: ReasonCacheMiss, Prefill: "p2", Decode: "d1", UncachedTokens: 1000, Storage: storeB},
		},
		{
			name: "no cache: prefill by overlap, decode by decode load only",
			in: in(1000, dec("d1", 1, 448, TierGPU), dec("d2", 2, 0, TierGPU), dec("d3", 0, 0, TierGPU),
				pre("p1", 0, 0, TierGPU), pre("p2", 1, 800, TierGPU)),
			want: Plan{Path: PathPrefillThenDecode, Reason: ReasonCacheMiss, Prefill: "p2", Decode: "d3", ExpectedCachedTokens: 800, UncachedTokens: 200},
		},
		{
			name: "no cache anywhere: prefill by prefill load, decode load ignored on prefill backends",
			in: in(1000, dec("d1", 0, 0, TierGPU), dec("d2", 1, 0, TierGPU),
				Candidate{Name: "p1", Role: RolePrefill, Healthy: true, Health: 1, PrefillLoad: 0, DecodeLoad: 100},
				pre("p2", 4, 0, TierGPU)),
			want: Plan{Path: PathPrefillThenDecode, Reason: ReasonCacheMiss, Prefill: "p1", Decode: "d1", UncachedTokens: 1000},
		},
		{
			name: "prefill and decode must share storage",
			in: in(1000, at(dec("d1", 0, 0, TierGPU), storeB), at(dec("d2", 9, 0, TierGPU), storeA),
				at(pre("p1", 0, 992, TierGPU), storeB), at(pre("p2", 3, 0, TierGPU), storeA),
				at(down(dec("d3", 0, 0, TierGPU)), storeB)),
			want: Plan{Path: PathPrefillThenDecode, Reason: ReasonCacheMiss, Prefill: "p1", Decode: "d1", ExpectedCachedTokens: 992, UncachedTokens: 8, Storage: storeB},
		},
		{
			name: "short prompt without cache skips the remote prefill",
			in:   in(300, dec("d1", 2, 0, TierGPU), dec("d2", 1, 0, TierGPU), pre("p1", 0, 0, TierGPU)),
			want: Plan{Path: PathFastDecode, Reason: ReasonShortPrompt, Decode: "d2", UncachedTokens: 300},
		},
		{
			name: "uncached tokens under the token threshold",
			in:   in(10000, dec("d1", 0, 9600, TierGPU), dec("d2", 0, 0, TierGPU), pre("p1", 0, 0, TierGPU)),
			want: Plan{Path: PathFastDecode, Reason: ReasonLocalHit, Decode: "d1", ExpectedCachedTokens: 9600, UncachedTokens: 400},
		},
		{
			name: "uncached tokens over the token threshold and the ratio",
			in:   in(10000, dec("d1", 0, 8000, TierGPU), dec("d2", 0, 0, TierGPU), pre("p1", 0, 0, TierGPU)),
			want: Plan{Path: PathPrefillThenDecode, Reason: ReasonCacheMiss, Prefill: "p1", Decode: "d1", UncachedTokens: 10000},
		},
		{
			name: "uncached ratio under its threshold, tokens over theirs",
			in:   in(100000, dec("d1", 0, 95000, TierGPU), dec("d2", 0, 0, TierGPU), pre("p1", 0, 0, TierGPU)),
			want: Plan{Path: PathFastDecode, Reason: ReasonLocalHit, Decode: "d1", ExpectedCachedTokens: 95000, UncachedTokens: 5000},
		},
		{
			name: "ratio test off: the token threshold alone decides",
			cfg:  Config{MaxUncachedRatio: -1},
			in:   in(100000, dec("d1", 0, 95000, TierGPU), dec("d2", 0, 0, TierGPU), pre("p1", 0, 0, TierGPU)),
			want: Plan{Path: PathPrefillThenDecode, Reason: ReasonCacheMiss, Prefill: "p1", Decode: "d1", UncachedTokens: 100000},
		},
		{
			name: "token test off: the ratio alone decides",
			cfg:  Config{MaxUncachedTokens: -1, MaxUncachedRatio: 0.1},
			in:   in(300, dec("d1", 0, 0, TierGPU), pre("p1", 0, 0, TierGPU)),
			want: Plan{Path: PathPrefillThenDecode, Reason: ReasonCacheMiss, Prefill: "p1", Decode: "d1", UncachedTokens: 300},
		},
		{
			name: "custom thresholds",
			cfg:  Config{MaxUncachedTokens: 100, MaxUncachedRatio: 0.5},
			in:   in(1000, dec("d1", 0, 512, TierGPU), pre("p1", 0, 0, TierGPU)),
			want: Plan{Path: PathFastDecode, Reason: ReasonLocalHit, Decode: "d1", ExpectedCachedTokens: 512, UncachedTokens: 488},
		},
		{
			name: "conditional off: any local prefix is fast_decode",
			cfg:  Config{DisableConditional: true},
			in:   in(10000, dec("d1", 0, 16, TierGPU), dec("d2", 0, 0, TierGPU), pre("p1", 0, 0, TierGPU)),
			want: Plan{Path: PathFastDecode, Reason: ReasonLocalHit, Decode: "d1", ExpectedCachedTokens: 16, UncachedTokens: 9984},
		},
		{
			name: "conditional off: a short prompt without cache is still prefilled remotely",
			cfg:  Config{DisableConditional: true},
			in:   in(100, dec("d1", 0, 0, TierGPU), pre("p1", 0, 0, TierGPU)),
			want: Plan{Path: PathPrefillThenDecode, Reason: ReasonCacheMiss, Prefill: "p1", Decode: "d1", UncachedTokens: 100},
		},
		{
			name: "unknown prompt length: a hit is fast_decode",
			in:   Input{Candidates: []Candidate{dec("d1", 0, 16, TierGPU), pre("p1", 0, 0, TierGPU)}},
			want: Plan{Path: PathFastDecode, Reason: ReasonLocalHit, Decode: "d1", ExpectedCachedTokens: 16},
		},
		{
			name: "unknown prompt length and no hit: prefill_then_decode",
			in:   Input{Candidates: []Candidate{dec("d1", 0, 0, TierGPU), pre("p1", 0, 0, TierGPU)}},
			want: Plan{Path: PathPrefillThenDecode, Reason: ReasonCacheMiss, Prefill: "p1", Decode: "d1"},
		},
		{
			name: "a gpu holder at its load bound loses its hit",
			in: in(1000, dec("d1", 10, 992, TierGPU), dec("d2", 1, 0, TierGPU), dec("d3", 0, 0, TierGPU),
				pre("p1", 0, 0, TierGPU)),
			want: Plan{Path: PathPrefillThenDecode, Reason: ReasonCacheMiss, Prefill: "p1", Decode: "d3", UncachedTokens: 1000},
		},
		{
			name: "weights scale the decode load",
			in: in(1000, Candidate{Name: "d1", Role: RoleDecode, Healthy: true, Health: 1, DecodeLoad: 3, Weight: 4},
				dec("d2", 1, 0, TierGPU), pre("p1", 0, 0, TierGPU)),
			want: Plan{Path: PathPrefillThenDecode, Reason: ReasonCacheMiss, Prefill: "p1", Decode: "d1", UncachedTokens: 1000},
		},
		{
			name: "prefill not needed: an unhealthy prefill pool does not matter",
			in:   in(1000, dec("d1", 0, 992, TierGPU), down(pre("p1", 0, 0, TierGPU)), uni("u1", 0)),
			want: Plan{Path: PathFastDecode, Reason: ReasonLocalHit, Decode: "d1", ExpectedCachedTokens: 992, UncachedTokens: 8},
		},
		{
			name: "decode pool unhealthy, fallback on: unified",
			in:   in(1000, down(dec("d1", 0, 992, TierGPU)), pre("p1", 0, 0, TierGPU), uni("u1", 3), uni("u2", 1)),
			want: Plan{Path: PathFallback, Reason: ReasonPoolUnavailable, Decode: "u2", UncachedTokens: 1000},
		},
		{
			name: "prefill pool unhealthy and a prefill needed, fallback on: unified",
			in:   in(1000, dec("d1", 0, 0, TierGPU), down(pre("p1", 0, 0, TierGPU)), uni("u1", 0)),
			want: Plan{Path: PathFallback, Reason: ReasonPoolUnavailable, Decode: "u1", UncachedTokens: 1000},
		},
		{
			name: "no prefill or decode backend at all: unified",
			in:   in(1000, uni("u1", 2), uni("u2", 0)),
			want: Plan{Path: PathUnified, Reason: ReasonNoPools, Decode: "u2", UncachedTokens: 1000},
		},
		{
			name: "disabled: unified even with healthy pools",
			cfg:  Config{Disabled: true},
			in:   in(1000, dec("d1", 0, 992, TierGPU), pre("p1", 0, 0, TierGPU), uni("u1", 0)),
			want: Plan{Path: PathUnified, Reason: ReasonDisabled, Decode: "u1", UncachedTokens: 1000},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := New(tt.cfg)
			if err != nil {
				t.Fatal(err)
			}
			got, err := p.Plan(tt.in)
			if err != nil {
				t.Fatalf("Plan: %v", err)
			}
			if !got.Storage.SameLocation(tt.want.Storage) {
				t.Errorf("Storage = %v, want %v", got.Storage, tt.want.Storage)
			}
			got.Storage, tt.want.Storage = ExternalStorage{}, ExternalStorage{}
			if got != tt.want {
				t.Errorf("Plan =\n %+v, want\n %+v", got, tt.want)
			}
		})
	}
}

func TestPlanNoBackend(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		in   Input
	}{
		{"decode pool unhealthy, fallback off", Config{DisableFallback: true},
			in(1000, down(dec("d1", 0, 0, TierGPU)), pre("p1", 0, 0, TierGPU), uni("u1", 0))},
		{"prefill pool unhealthy, fallback off", Config{DisableFallback: true},
			in(1000, dec("d1", 0, 0, TierGPU), down(pre("p1", 0, 0, TierGPU)), uni("u1", 0))},
		{"no prefill backend pairs with a decode backend, fallback off", Config{DisableFallback: true},
			in(1000, at(dec("d1", 0, 0, TierGPU), storeA), at(pre("p1", 0, 0, TierGPU), storeB), uni("u1", 0))},
		{"pools unhealthy, fallback on, no unified backend", Config{},
			in(1000, down(dec("d1", 0, 0, TierGPU)), pre("p1", 0, 0, TierGPU))},
		{"pools unhealthy, fallback on, unified unhealthy", Config{},
			in(1000, down(dec("d1", 0, 0, TierGPU)), down(uni("u1", 0)))},
		{"disabled without unified backend", Config{Disabled: true},
			in(1000, dec("d1", 0, 0, TierGPU), pre("p1", 0, 0, TierGPU))},
		{"empty fleet", Config{}, Input{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := New(tt.cfg)
			if err != nil {
				t.Fatal(err)
			}
			got, err := p.Plan(tt.in)
			if !errors.Is(err, ErrNoBackend) {
				t.Fatalf("Plan = %+v, %v; want ErrNoBackend", got, err)
			}
			if got != (Plan{}) {
				t.Errorf("Plan = %+v with an error, want the zero Plan", got)
			}
		})
	}
}

func TestFallback(t *testing.T) {
	cands := []Candidate{dec("d1", 0, 0, TierGPU), pre("p1", 0, 0, TierGPU), uni("u1", 4), uni("u2", 0)}
	p, _ := New(Config{})
	got, err := p.Fallback(Input{Candidates: cands})
	if err != nil {
		t.Fatal(err)
	}
	want := Plan{Path: PathFallback, Reason: ReasonPrefillFailed, Decode: "u2"}
	if got != want {
		t.Errorf("Fallback = %+v, want %+v", got, want)
	}
	off, _ := New(Config{DisableFallback: true})
	if _, err := off.Fallback(Input{Candidates: cands}); !errors.Is(err, ErrNoBackend) {
		t.Errorf("Fallback with fallback off: %v, want ErrNoBackend", err)
	}
	got, err = p.DecodeFallback(Input{Candidates: cands})
	if want.Reason = ReasonDecodeFailed; err != nil || got != want {
		t.Errorf("DecodeFallback = %+v, %v, want %+v", got, err, want)
	}
	if _, err := off.DecodeFallback(Input{Candidates: cands}); !errors.Is(err, ErrNoBackend) {
		t.Errorf("DecodeFallback with fallback off: %v, want ErrNoBackend", err)
	}
}

// Equal backends are chosen in turn as TieBreak varies, so that idle fleets do not send every
// request to the first one.
func TestPlanTieBreakSpreads(t *testing.T) {
	p, _ := New(Config{})
	for _, tt := range []struct {
		name  string
		cands []Candidate
		pick  func(Plan) string
	}{
		{"decode", []Candidate{dec("d1", 0, 0, TierGPU), dec("d2", 0, 0, TierGPU), dec("d3", 0, 0, TierGPU), pre("p1", 0, 0, TierGPU)},
			func(p Plan) string { return p.Decode }},
		{"prefill", []Candidate{dec("d1", 0, 0, TierGPU), pre("p1", 0, 0, TierGPU), pre("p2", 0, 0, TierGPU), pre("p3", 0, 0, TierGPU)},
			func(p Plan) string { return p.Prefill }},
		{"short prompt", []Candidate{dec("d1", 0, 0, TierGPU), dec("d2", 0, 0, TierGPU), dec("d3", 0, 0, TierGPU)},
			func(p Plan) string { return p.Decode }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			seen := map[string]bool{}
			tokens := 5000
			if tt.name == "short prompt" {
				tokens = 10
			}
			for tb := range uint64(3) {
				plan, err := p.Plan(Input{Candidates: tt.cands, PromptTokens: tokens, TieBreak: tb})
				if err != nil {
					t.Fatal(err)
				}
				seen[tt.pick(plan)] = true
			}
			if len(seen) != 3 {
				t.Errorf("TieBreak 0..2 chose %v, want 3 distinct backends", seen)
			}
		})
	}
}

func TestPlanIsPure(t *testing.T) {
	p, _ := New(Config{DefaultStorage: storeA})
	input := in(1000, dec("d1", 3, 0, TierGPU), dec("d2", 1, 0, TierGPU), pre("p1", 2, 100, TierGPU), pre("p2", 0, 0, TierGPU), uni("u1", 0))
	before := append([]Candidate(nil), input.Candidates...)
	first, err := p.Plan(input)
	if err != nil {
		t.Fatal(err)
	}
	for range 10 {
		if again, _ := p.Plan(input); again != first {
			t.Fatalf("Plan changed between calls: %+v then %+v", first, again)
		}
	}
	for i := range before {
		if input.Candidates[i] != before[i] {
			t.Fatalf("Plan modified candidate %d: %+v → %+v", i, before[i], input.Candidates[i])
		}
	}
}

func TestPlanAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates")
	}
	p, _ := New(Config{DefaultStorage: storeA})
	cases := map[string]Input{
		"prefill_then_decode": in(1000, dec("d1", 3, 0, TierGPU), dec("d2", 1, 0, TierGPU), pre("p1", 2, 100, TierGPU), pre("p2", 0, 0, TierGPU)),
		"fast_decode":         in(1000, dec("d1", 3, 992, TierGPU), dec("d2", 1, 0, TierGPU), pre("p1", 2, 100, TierGPU)),
		"fallback":            in(1000, down(dec("d1", 3, 992, TierGPU)), pre("p1", 2, 100, TierGPU), uni("u1", 0)),
	}
	for name, input := range cases {
		t.Run(name, func(t *testing.T) {
			if n := testing.AllocsPerRun(100, func() { _, _ = p.Plan(input) }); n != 0 {
				t.Errorf("Plan allocates %v times per call, want 0", n)
			}
		})
	}
}

func TestNewValidates(t *testing.T) {
	for _, tt := range []struct {
		name string
		cfg  Config
	}{
		{"negative prefill timeout", Config{PrefillTimeout: -time.Second}},
		{"negative transfer timeout", Config{KVTransferTimeout: -1}},
		{"ratio above 1", Config{MaxUncachedRatio: 1.5}},
		{"ratio NaN", Config{MaxUncachedRatio: math.NaN()}},
		{"epsilon too small", Config{LoadFactorEpsilon: 0.001}},
		{"epsilon too large", Config{LoadFactorEpsilon: 11}},
		{"epsilon NaN", Config{LoadFactorEpsilon: math.NaN()}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := New(tt.cfg); !errors.Is(err, ErrInvalidConfig) {
				t.Errorf("New(%+v) = %v, want ErrInvalidConfig", tt.cfg, err)
			}
		})
	}
	p, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	c := p.Config()
	if c.PrefillTimeout != 60*time.Second || c.KVTransferTimeout != 15*time.Second ||
		c.MaxUncachedTokens != DefaultMaxUncachedTokens || c.MaxUncachedRatio != DefaultMaxUncachedRatio ||
		c.LoadFactorEpsilon != chwbl.DefaultLoadFactorEpsilon || c.Scorer == nil || c.Disabled || c.DisableFallback || c.DisableConditional {
		t.Errorf("defaults not applied: %+v", c)
	}
}

func TestSetHeaders(t *testing.T) {
	h := http.Header{}
	Plan{Path: PathPrefillThenDecode, Prefill: "p1", Decode: "d1"}.SetHeaders(h)
	if h.Get(HeaderRoutingPath) != "prefill_then_decode" || h.Get(HeaderPrefillBackend) != "p1" || h.Get(HeaderDecodeBackend) != "d1" {
		t.Errorf("headers = %v", h)
	}
	// Re-planned as fallback: the failed prefill backend must not stay in the headers.
	Plan{Path: PathFallback, Decode: "u1"}.SetHeaders(h)
	if h.Get(HeaderRoutingPath) != "fallback" || h.Get(HeaderDecodeBackend) != "u1" {
		t.Errorf("headers = %v", h)
	}
	if _, ok := h[HeaderPrefillBackend]; ok {
		t.Errorf("prefill header left behind: %v", h)
	}
	if HeaderRoutingPath != "X-Kvroute-Routing-Path" || HeaderPrefillBackend != "X-Kvroute-Prefill-Backend" || HeaderDecodeBackend != "X-Kvroute-Decode-Backend" {
		t.Error("header names changed")
	}
}
