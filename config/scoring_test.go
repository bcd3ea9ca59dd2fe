package config

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/scorer"
)

// kvScoring is a configuration with tier 4 on and scoring as its kv_cache_index.scoring mapping.
func kvScoring(scoring string) string {
	return minimalBackends + "kv_cache_index:\n  enabled: true\n  scoring: " + scoring + "\n"
}

// buildKV returns cfg's KVConfig over a memory index and the stats of the Router built with it.
func buildKV(t *testing.T, cfg *Config) (*kvroute.KVConfig, kvroute.Stats) {
	t.Helper()
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = ix.Close() })
	rcfg, err := cfg.RouterConfig(Options{})
	require.NoError(t, err)
	kc := cfg.KVConfig(ix, nil)
	require.NotNil(t, kc)
	rcfg.KV = kc
	r, err := kvroute.New(rcfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	st, err := r.Stats(t.Context())
	require.NoError(t, err)
	return kc, st
}

// Without scoring settings tier 4 uses ExpectedTTFT with its defaults; the composite's weights
// still get theirs (disaggregated serving and the admin stats read them).
func TestScoringDefaultIsExpectedTTFT(t *testing.T) {
	cfg := mustParse(t, kvScoring("{}"), nil)
	sc := cfg.KVCacheIndex.Scoring
	assert.Equal(t, ScorerExpectedTTFT, sc.Scorer)
	assert.Equal(t, scorer.DefaultCacheWeight, *sc.CacheWeight)
	assert.Equal(t, scorer.DefaultAttentionCost, *sc.AttentionCost)
	assert.Equal(t, []float64{0.6, 0.3, 0.1}, []float64{*sc.OverlapWeight, *sc.LoadWeight, *sc.HealthWeight})

	kc, st := buildKV(t, cfg)
	ett, ok := kc.Scorer.(*scorer.ExpectedTTFT)
	require.True(t, ok, "Scorer %T", kc.Scorer)
	assert.Equal(t, scorer.DefaultCacheWeight, ett.Config().CacheWeight)
	assert.Equal(t, scorer.DefaultAttentionCost, ett.Config().AttentionCost)
	assert.Equal(t, scorer.DefaultAttentionCost, kc.AttentionCost)
	assert.Equal(t, ScorerExpectedTTFT, st.Scorer)
	assert.Equal(t, scorer.DefaultAttentionCost, st.AttentionCost)

	// Applying the defaults again changes nothing and flags nothing: the weights filled by the
	// defaults are not the configuration's own.
	cfg.ApplyDefaults()
	require.NoError(t, cfg.Validate())
	assert.Equal(t, ScorerExpectedTTFT, cfg.KVCacheIndex.Scoring.Scorer)
}

func TestScoringExpectedTTFTSettings(t *testing.T) {
	cfg := mustParse(t, kvScoring("{scorer: expected_ttft, cache_weight: 3, attention_cost: 1e-4}"), nil)
	kc, st := buildKV(t, cfg)
	ett, ok := kc.Scorer.(*scorer.ExpectedTTFT)
	require.True(t, ok, "Scorer %T", kc.Scorer)
	assert.Equal(t, 3.0, ett.Config().CacheWeight)
	assert.Equal(t, 1e-4, ett.Config().AttentionCost)
	assert.Equal(t, 1e-4, kc.AttentionCost)
	assert.Equal(t, 1e-4, st.AttentionCost)
}

// A weight of the configuration's own selects the composite (kv_overlap), as before
// ExpectedTTFT became the default; so does scorer: kv_overlap.
func TestScoringKVOverlap(t *testing.T) {
	for _, tc := range []struct {
		name, scoring string
		want          scorer.CompositeConfig
	}{
		{"all weights", "{overlap_weight: 0.5, load_weight: 0.4, health_weight: 0.1}",
			scorer.CompositeConfig{OverlapWeight: 0.5, LoadWeight: 0.4, HealthWeight: 0.1, MinOverlapThreshold: 0.3}},
		{"one weight", "{health_weight: 0.1}",
			scorer.CompositeConfig{OverlapWeight: 0.6, LoadWeight: 0.3, HealthWeight: 0.1, MinOverlapThreshold: 0.3}},
		{"explicit scorer", "{scorer: kv_overlap, min_overlap_threshold: 0.2}",
			scorer.CompositeConfig{OverlapWeight: 0.6, LoadWeight: 0.3, HealthWeight: 0.1, MinOverlapThreshold: 0.2}},
		{"explicit scorer and weights", "{scorer: kv_overlap, overlap_weight: 0.7, load_weight: 0.3, health_weight: 0}",
			scorer.CompositeConfig{OverlapWeight: 0.7, LoadWeight: 0.3, HealthWeight: 0, MinOverlapThreshold: 0.3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := mustParse(t, kvScoring(tc.scoring), nil)
			assert.Equal(t, ScorerKVOverlap, cfg.KVCacheIndex.Scoring.Scorer)
			kc, st := buildKV(t, cfg)
			comp, ok := kc.Scorer.(*scorer.Composite)
			require.True(t, ok, "Scorer %T", kc.Scorer)
			tc.want.PrefillTokensPerRequest = scorer.DefaultPrefillTokensPerRequest // Config reports the defaults
			assert.Equal(t, tc.want, comp.Config())
			assert.Equal(t, scorer.DefaultAttentionCost, kc.AttentionCost)
			assert.Equal(t, ScorerKVOverlap, st.Scorer)
		})
	}
}

// attention_cost: 0 is linear prefill work: the library's negative value, for either scorer.
func TestScoringAttentionCostZero(t *testing.T) {
	kc, st := buildKV(t, mustParse(t, kvScoring("{attention_cost: 0}"), nil))
	assert.Less(t, kc.AttentionCost, 0.0)
	ett, ok := kc.Scorer.(*scorer.ExpectedTTFT)
	require.True(t, ok, "Scorer %T", kc.Scorer)
	assert.Equal(t, -1.0, ett.Config().AttentionCost) // turned off
	assert.Equal(t, 0.0, st.AttentionCost)

	kc, st = buildKV(t, mustParse(t, kvScoring("{scorer: kv_overlap, attention_cost: 0}"), nil))
	assert.Less(t, kc.AttentionCost, 0.0)
	assert.Equal(t, 0.0, st.AttentionCost)
	assert.Equal(t, ScorerKVOverlap, st.Scorer)

	kc, st = buildKV(t, mustParse(t, kvScoring("{attention_cost: 0.01}"), nil))
	assert.Equal(t, scorer.MaxAttentionCost, kc.AttentionCost)
	assert.Equal(t, scorer.MaxAttentionCost, st.AttentionCost)
}

// A setting of one scorer with the other, an unknown scorer and values out of range are errors
// naming the key.
func TestScoringErrors(t *testing.T) {
	for _, tc := range []struct{ scoring, want string }{
		{"{scorer: expected_ttft, overlap_weight: 0.6}",
			"kv_cache_index.scoring.overlap_weight: tunes scorer kv_overlap only, and scorer is expected_ttft"},
		{"{scorer: expected_ttft, load_weight: 0.3}", "kv_cache_index.scoring.load_weight: tunes scorer kv_overlap only"},
		{"{scorer: expected_ttft, health_weight: 0.1}", "kv_cache_index.scoring.health_weight: tunes scorer kv_overlap only"},
		{"{scorer: kv_overlap, cache_weight: 6}",
			"kv_cache_index.scoring.cache_weight: tunes scorer expected_ttft only, and scorer is kv_overlap"},
		// The weights choose kv_overlap, which cache_weight does not tune.
		{"{overlap_weight: 0.6, cache_weight: 6}", "kv_cache_index.scoring.cache_weight: tunes scorer expected_ttft only"},
		{"{scorer: ttft}", `kv_cache_index.scoring.scorer: "ttft" is not one of expected_ttft, kv_overlap`},
		{"{scorer: \"\"}", ""}, // empty is unset: the default
		{"{cache_weight: 0}", "kv_cache_index.scoring.cache_weight: 0 must be finite and > 0"},
		{"{cache_weight: -1}", "kv_cache_index.scoring.cache_weight: -1 must be finite and > 0"},
		{"{cache_weight: Inf}", "kv_cache_index.scoring.cache_weight: +Inf must be finite and > 0"},
		{"{cache_weight: NaN}", "kv_cache_index.scoring.cache_weight: NaN must be finite and > 0"},
		{"{attention_cost: -1e-5}", "kv_cache_index.scoring.attention_cost: -1e-05 is not in [0, 0.01]"},
		{"{attention_cost: 0.02}", "kv_cache_index.scoring.attention_cost: 0.02 is not in [0, 0.01]"},
		{"{attention_cost: NaN}", "kv_cache_index.scoring.attention_cost: NaN is not in [0, 0.01]"},
	} {
		t.Run(tc.scoring, func(t *testing.T) {
			_, err := Parse([]byte(kvScoring(tc.scoring)), env(nil))
			if tc.want == "" {
				assert.NoError(t, err)
				return
			}
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
	// Every conflicting weight is named.
	_, err := Parse([]byte(kvScoring("{scorer: expected_ttft, overlap_weight: 0.5, load_weight: 0.5, health_weight: 0}")), env(nil))
	require.Error(t, err)
	for _, k := range []string{"overlap_weight", "load_weight", "health_weight"} {
		assert.Contains(t, err.Error(), "kv_cache_index.scoring."+k+": tunes scorer kv_overlap only")
	}
}

// A Config built in Go follows the same rules: weights it sets itself are its own.
func TestScoringInGo(t *testing.T) {
	cfg := &Config{Backends: []BackendConfig{{Name: "a", URL: "http://127.0.0.1:8001"}}}
	cfg.KVCacheIndex.Enabled = true
	cfg.KVCacheIndex.Scoring.Scorer = ScorerExpectedTTFT
	cfg.KVCacheIndex.Scoring.OverlapWeight = ptr(0.6)
	cfg.ApplyDefaults()
	err := cfg.Validate()
	require.Error(t, err)
	assert.Contains(t, err.Error(), "kv_cache_index.scoring.overlap_weight: tunes scorer kv_overlap only")

	cfg = &Config{Backends: []BackendConfig{{Name: "a", URL: "http://127.0.0.1:8001"}}}
	cfg.KVCacheIndex.Enabled = true
	cfg.KVCacheIndex.Scoring.LoadWeight = ptr(0.3)
	cfg.ApplyDefaults()
	require.NoError(t, cfg.Validate())
	assert.Equal(t, ScorerKVOverlap, cfg.KVCacheIndex.Scoring.Scorer)
}

// Disaggregated serving keeps the composite (its candidates carry in-flight counts, not queued
// prefill work) while tier 4 uses ExpectedTTFT.
func TestScoringDisaggKeepsComposite(t *testing.T) {
	cfg := mustParse(t, `
kv_cache_index: {enabled: true}
disaggregated_serving: {enabled: true, default_external_storage: {endpoint: "http://127.0.0.1:7070"}}
backends:
  - {name: p, url: "http://127.0.0.1:8001", role: prefill}
  - {name: d, url: "http://127.0.0.1:8002", role: decode}
`, nil)
	dc, err := cfg.DisaggConfig()
	require.NoError(t, err)
	_, ok := dc.Scorer.(*scorer.Composite)
	assert.True(t, ok, "disagg Scorer %T", dc.Scorer)
	kc, st := buildKV(t, cfg)
	_, ok = kc.Scorer.(*scorer.ExpectedTTFT)
	assert.True(t, ok, "tier 4 Scorer %T", kc.Scorer)
	assert.Equal(t, ScorerExpectedTTFT, st.Scorer)
}

// Configurations in kvroute's reference shapes set the composite's weights: they keep it. The
// shipped examples document the scoring keys without pinning the composite.
func TestScoringOfShippedConfigs(t *testing.T) {
	vars := map[string]string{"ADMIN_TOKEN": "t0ken", "S3_ENDPOINT": "http://127.0.0.1:7070",
		"S3_ACCESS_KEY": "AKIAEXAMPLE", "S3_SECRET_KEY": "wJalrXUtnFEMI/K7MDENG", "REDIS_URL": "redis://127.0.0.1:6379",
		"VAST_ACCESS_KEY": "a", "VAST_SECRET_KEY": "b"}
	for name, want := range map[string]string{"seeds-production.yaml": ScorerKVOverlap, "seeds-all-tiers.yaml": ScorerKVOverlap,
		"all-tiers.yaml": ScorerExpectedTTFT, "zmq-events.yaml": ScorerExpectedTTFT} {
		data, err := os.ReadFile("testdata/" + name)
		require.NoError(t, err)
		cfg, err := Parse(data, env(vars))
		require.NoError(t, err, name)
		assert.Equal(t, want, cfg.KVCacheIndex.Scoring.Scorer, name)
	}
}

// The scorer and its settings change at a reload, like the composite's weights.
func TestScoringReload(t *testing.T) {
	running := mustParse(t, kvScoring("{}"), nil)
	next := mustParse(t, kvScoring("{overlap_weight: 0.5, load_weight: 0.5, health_weight: 0, attention_cost: 0}"), nil)
	p := PlanReload(running, next)
	// The composite's default bound on KV-aware choices (load_factor_epsilon) is tighter than
	// expected_ttft's: it changes with the scorer.
	assert.Equal(t, []string{"kv_cache_index.scoring.scorer", "kv_cache_index.scoring.overlap_weight",
		"kv_cache_index.scoring.load_weight", "kv_cache_index.scoring.health_weight",
		"kv_cache_index.scoring.attention_cost", "kv_cache_index.scoring.load_factor_epsilon"}, p.Live)
	assert.Equal(t, kvroute.DefaultKVLoadFactorEpsilonExpectedTTFT, running.KVCacheIndex.Scoring.LoadFactorEpsilon)
	assert.Equal(t, kvroute.DefaultKVLoadFactorEpsilon, p.Next.KVCacheIndex.Scoring.LoadFactorEpsilon)
	assert.Empty(t, p.Restart)
	require.NoError(t, p.Next.Validate())
	assert.Equal(t, ScorerKVOverlap, p.Next.KVCacheIndex.Scoring.Scorer)

	// And back: the weights of the running configuration are not the new one's.
	p = PlanReload(next, mustParse(t, kvScoring("{cache_weight: 3}"), nil))
	assert.Contains(t, p.Live, "kv_cache_index.scoring.cache_weight")
	require.NoError(t, p.Next.Validate())
	kc, _ := buildKV(t, p.Next)
	ett, ok := kc.Scorer.(*scorer.ExpectedTTFT)
	require.True(t, ok, "Scorer %T", kc.Scorer)
	assert.Equal(t, 3.0, ett.Config().CacheWeight)
}

// The configuration's log line names the scorer and its settings in force.
func TestScoringLogAttrs(t *testing.T) {
	attrs := func(scoring string) string {
		var b strings.Builder
		for _, a := range mustParse(t, kvScoring(scoring), nil).LogAttrs() {
			b.WriteString(a.String() + " ")
		}
		return b.String()
	}
	got := attrs("{}")
	assert.Contains(t, got, "kv_cache_index.scoring.scorer=expected_ttft")
	assert.Contains(t, got, "kv_cache_index.scoring.cache_weight=6")
	assert.Contains(t, got, "kv_cache_index.scoring.attention_cost=2e-05")
	got = attrs("{scorer: kv_overlap, attention_cost: 0}")
	assert.Contains(t, got, "kv_cache_index.scoring.scorer=kv_overlap")
	assert.NotContains(t, got, "cache_weight")
	assert.Contains(t, got, "kv_cache_index.scoring.attention_cost=0")
}
