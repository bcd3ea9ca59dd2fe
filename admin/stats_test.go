package admin_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/admin"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata")

// snapshot is a known kvroute.Stats: two unified backends (one with an engine report, one
// unhealthy), a prefill and a decode backend, tier 4 with the expected-TTFT scorer, peers and
// disaggregation.
func snapshot() kvroute.Stats {
	return kvroute.Stats{
		Decisions: kvroute.DecisionCounts{PrefixHash: 120, Overflow: 3, Fallback: 2, KVAware: 40, LoadBound: 5,
			Imbalance: 1, LeastWork: 9, HandedOff: 7, Expired: 4},
		Backends: []kvroute.BackendStats{
			{Name: "vllm-1", Role: disagg.RoleUnified, Healthy: true, Weight: 1, InFlight: 3, ExternalLoad: 2,
				Decisions: 100, Latency: 12500 * time.Microsecond, SuccessRate: 0.98, Refusals: 1,
				Engine: &kvroute.EngineLoad{Running: 4, Waiting: 1, KVCacheUsage: 0.5, At: time.Date(2026, 3, 13, 10, 24, 17, 0, time.UTC)}},
			{Name: "vllm-2", Role: disagg.RoleUnified, Weight: 2, Decisions: 80, SuccessRate: 1},
			{Name: "prefill-1", Role: disagg.RolePrefill, Healthy: true, Weight: 1, InFlight: 2, Decisions: 10,
				Latency: time.Second, SuccessRate: 0.9},
			{Name: "decode-1", Role: disagg.RoleDecode, Healthy: true, Weight: 2, InFlight: 5, Decisions: 12,
				SuccessRate: 1, Refusals: 2},
		},
		UniquePrefixes: 57,
		Lookups:        62,
		LookupErrors:   2,
		TokenizeErrors: 1,
		ScoreErrors:    1,
		NoBlockKeys:    3,
		Index: &kvindex.Stats{Backend: "memory", Blocks: 618, Entries: 618, PrefixCount: 312, SpeculativeCount: 4,
			Lookups: 12490, Evictions: 83, Mutations: map[string]uint64{"stored": 700, "removed": 82},
			Dropped: map[string]uint64{}, PerBackend: map[string]int{"vllm-1": 400, "vllm-2": 218}, MemoryBytes: 65536},
		Scorer:            "expected_ttft",
		AttentionCost:     2e-5,
		BlockSize:         16,
		SpeculativeTTL:    2 * time.Second,
		LoadFactorEpsilon: kvroute.DefaultKVLoadFactorEpsilonExpectedTTFT,
		Peers:             kvroute.PeerStats{Peers: 2, InFlight: 5, Applied: 90, Ignored: 1, Expired: 2, Forgot: 3, EngineReports: 40, EngineStale: 1},
		Disagg: &disagg.Stats{Total: 30, FastDecode: 12, PrefillThenDecode: 10, Unified: 6, Fallback: 2,
			Reasons:   disagg.ReasonCounts{LocalHit: 8, StorageHit: 4, CacheMiss: 10, ShortPrompt: 6, PrefillFailed: 2},
			NoBackend: 1, PrefillFailures: 2, DecodeFailures: 0},
	}
}

// kvConfig is a gateway's configuration of tier 4 (kvroute's defaults).
func kvConfig() admin.KVIndexConfig {
	w := func(v float64) *float64 { return &v }
	return admin.KVIndexConfig{
		MinOverlapThreshold: 0.3, Speculation: "speculate", MaxEntries: 100000,
		EntryTTLSeconds: 600, EventSourcesCount: 2, Tokenizer: "engine",
		Scoring: admin.Scoring{OverlapWeight: w(0.6), LoadWeight: w(0.3), HealthWeight: w(0.1),
			MinOverlapThreshold: 0.3, GPUTierWeight: 1, CPUTierWeight: 0.8, StorageTierWeight: 0.6},
	}
}

// sources are two event sources, one connected and one down.
func sources() []events.SourceStatus {
	at := time.Date(2026, 3, 13, 10, 24, 17, 0, time.UTC)
	return []events.SourceStatus{
		{Backend: "vllm-1", Transport: "zmq", Endpoint: "tcp://vllm-1:5557",
			Connection: events.ConnectionStatus{Connected: true, State: events.StateConnected, LastEventAt: at},
			Events:     events.Stats{Received: 8412, Dropped: 0}, Sequence: events.SequenceStats{Gaps: 1}},
		{Backend: "vllm-2", Transport: "sse", Endpoint: "http://vllm-2:8000/v1/kv_events",
			Connection: events.ConnectionStatus{State: events.StateDisconnected, ReconnectCount: 3},
			LastError:  "connection refused"},
	}
}

// The stats bodies built from a known snapshot are, byte for byte, the golden files: the keys
// and formats kvroute's admin endpoints return (indented as the reference proxy writes them).
func TestStatsBodiesGolden(t *testing.T) {
	st := snapshot()
	overlap := snapshot()
	overlap.Scorer, overlap.LoadFactorEpsilon = "kv_overlap", kvroute.DefaultKVLoadFactorEpsilon
	overlap.Index = nil
	withTokenizer := admin.NewKVIndexStats(st, nil, kvConfig(), sources())
	withTokenizer.Tokenizer = &prefixkey.TokenizerStats{Calls: 50, CacheHits: 20, Errors: 1, Timeouts: 1}
	own := disagg.ExternalStorage{Endpoint: "http://own:9000", Namespace: "kv", Credentials: "cred-own-33"}
	dc := disagg.Config{PrefillTimeout: time.Minute, KVTransferTimeout: 15 * time.Second, MaxUncachedTokens: 256,
		MaxUncachedRatio: 0.5, LoadFactorEpsilon: 0.25, DisableConditional: true,
		DefaultStorage: disagg.ExternalStorage{Endpoint: "http://kv-store:8080", Namespace: "inference/kv-cache",
			AccessKey: "AKIA-secret", SecretKey: "very-secret"}}
	for _, tc := range []struct {
		file string
		body any
	}{
		{"prefix-routing-stats.json", admin.NewPrefixRoutingStats(st, true, admin.PrefixRoutingConfig{MaxPrefixLength: 1024,
			LoadFactorEpsilon: 0.25, VirtualNodes: 150, AnthropicCacheControlInjection: true, SelectionStrategy: "round_robin"})},
		{"kv-index-stats.json", withTokenizer},
		{"kv-index-stats-kv-overlap-index-error.json", admin.NewKVIndexStats(overlap, errors.New("kvindex: index unavailable: dial tcp: connection refused"), kvConfig(), nil)},
		{"disaggregation-stats.json", admin.NewDisaggStats(st, dc, map[string]*disagg.ExternalStorage{"prefill-1": &own})},
		{"replicas-peers.json", admin.NewPeerStats(st.Peers)},
	} {
		t.Run(tc.file, func(t *testing.T) {
			var b bytes.Buffer
			enc := json.NewEncoder(&b)
			enc.SetIndent("", "  ")
			if err := enc.Encode(tc.body); err != nil {
				t.Fatal(err)
			}
			path := filepath.Join("testdata", tc.file)
			if *update {
				if err := os.WriteFile(path, b.Bytes(), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v (go test -update writes it)", err)
			}
			if !bytes.Equal(b.Bytes(), want) {
				t.Errorf("%s differs from the golden file:\n%s", tc.file, b.Bytes())
			}
		})
	}
}

// The composite's weights show only while the composite ranks tier 4's candidates (issue 26):
// under expected_ttft, cost or a scorer of one's own they take no part in the decision.
func TestKVIndexStatsWeightsInEffect(t *testing.T) {
	for scorer, shown := range map[string]bool{"kv_overlap": true, "expected_ttft": false, "cost": false, "custom": false} {
		st := snapshot()
		st.Scorer = scorer
		b, err := json.Marshal(admin.NewKVIndexStats(st, nil, kvConfig(), nil))
		if err != nil {
			t.Fatal(err)
		}
		var doc struct {
			Config struct {
				Scorer  string         `json:"scorer"`
				Scoring map[string]any `json:"scoring"`
			} `json:"config"`
		}
		if err := json.Unmarshal(b, &doc); err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{"overlap_weight", "load_weight", "health_weight"} {
			if _, ok := doc.Config.Scoring[k]; ok != shown {
				t.Errorf("scorer %s: %s shown %v, want %v", scorer, k, ok, shown)
			}
		}
		for _, k := range []string{"min_overlap_threshold", "load_factor_epsilon", "gpu_tier_weight"} {
			if _, ok := doc.Config.Scoring[k]; !ok {
				t.Errorf("scorer %s: scoring lacks %s", scorer, k)
			}
		}
		if doc.Config.Scorer != scorer {
			t.Errorf("scorer %q, want %q", doc.Config.Scorer, scorer)
		}
	}
}

// Without disaggregation the body is the zero one; pool backends stay out of the prefix-routing
// distribution, and the unified ones out of the disaggregation's backends.
func TestStatsBodiesRoles(t *testing.T) {
	st := snapshot()
	pr := admin.NewPrefixRoutingStats(st, true, admin.PrefixRoutingConfig{})
	if len(pr.BackendDistribution) != 2 || pr.BackendDistribution[0].Backend != "vllm-1" || pr.BackendDistribution[1].Backend != "vllm-2" {
		t.Errorf("distribution %+v", pr.BackendDistribution)
	}
	if pr.RoutingDecisions.Total != 180 || pr.RoutingDecisions.OverflowRate != "0.0167" {
		t.Errorf("decisions %+v", pr.RoutingDecisions)
	}
	ds := admin.NewDisaggStats(st, disagg.Config{}, nil)
	if ds.UnifiedBackends != 2 || ds.PrefillBackends != 1 || ds.DecodeBackends != 1 || len(ds.Backends) != 2 ||
		ds.Backends[0].PrefillsInFlight != 2 || ds.Backends[1].DecodesInFlight != 5 || ds.Backends[0].Storage != nil {
		t.Errorf("disaggregation %+v", ds)
	}
	st.Disagg = nil
	if got := admin.NewDisaggStats(st, disagg.Config{}, nil); got.Enabled || got.Backends != nil || got.Requests != (disagg.Stats{}) {
		t.Errorf("without disaggregation: %+v", got)
	}
	empty := admin.NewPrefixRoutingStats(kvroute.Stats{}, false, admin.PrefixRoutingConfig{})
	if b, _ := json.Marshal(empty); !bytes.Contains(b, []byte(`"backend_distribution":[]`)) || !bytes.Contains(b, []byte(`"overflow_rate":"0.0000"`)) {
		t.Errorf("no decisions, no backends: %s", b)
	}
	kv := admin.NewKVIndexStats(kvroute.Stats{}, nil, admin.KVIndexConfig{}, nil)
	if b, _ := json.Marshal(kv); !bytes.Contains(b, []byte(`"event_sources":[]`)) || bytes.Contains(b, []byte(`index_error`)) {
		t.Errorf("no sources: %s", b)
	}
}
