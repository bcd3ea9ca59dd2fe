package respcache

import (
	"context"
	"encoding/json"
	"reflect"
	"sort"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/kvroute/kvroute/telemetry"
)

func TestCompactDuration(t *testing.T) {
	for d, want := range map[time.Duration]string{
		5 * time.Minute:                  "5m",
		30 * time.Minute:                 "30m",
		time.Hour:                        "1h",
		90 * time.Minute:                 "1h30m",
		90 * time.Second:                 "1m30s",
		1500 * time.Millisecond:          "1.5s",
		0:                                "0s",
		time.Hour + time.Second:          "1h0m1s",
		24 * time.Hour:                   "24h",
		2*time.Hour + 10*time.Minute + 0: "2h10m",
	} {
		if got := compactDuration(d); got != want {
			t.Errorf("compactDuration(%v) = %q, want %q", d, got, want)
		}
	}
}

// jsonKeys returns the keys of a JSON object, sorted.
func jsonKeys(t *testing.T, raw json.RawMessage) []string {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func TestStatsJSONShape(t *testing.T) {
	c := mwNew(t, Config{TTL: 30 * time.Minute})
	h := c.Middleware(&mwJSONHandler{})
	for _, b := range [][]byte{mwChat("a", `"temperature":0`), mwChat("a", `"temperature":0`), mwChat("a", `"temperature":0`), mwChat("b", `"temperature":0`), mwChat("c", `"temperature":0.5`)} {
		mwDo(h, "/v1/chat/completions", b)
	}
	st := c.Stats(context.Background())
	out, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	var top map[string]json.RawMessage
	_ = json.Unmarshal(out, &top)
	wantTop := []string{"backend_type", "capacity", "coalesced", "config", "enabled", "entries", "evictions", "hit_rate", "requests", "size_bytes", "store_errors"}
	if got := jsonKeys(t, out); !reflect.DeepEqual(got, wantTop) {
		t.Fatalf("keys %v, want %v", got, wantTop)
	}
	if got := jsonKeys(t, top["requests"]); !reflect.DeepEqual(got, []string{"hit", "miss", "skip", "total"}) {
		t.Fatalf("requests keys %v", got)
	}
	if got := jsonKeys(t, top["config"]); !reflect.DeepEqual(got, []string{"backend", "capacity", "max_response_size", "max_stream_buffer_size", "ttl"}) {
		t.Fatalf("config keys %v", got)
	}
	want := Stats{
		Enabled: true, BackendType: "memory", Entries: 2, Capacity: DefaultCapacity,
		Requests:  RequestStats{Hit: 2, Miss: 2, Skip: 1, Total: 5},
		HitRate:   "0.5000",
		SizeBytes: st.SizeBytes,
		Config: StatsConfig{Backend: "memory", TTL: "30m", Capacity: DefaultCapacity,
			MaxResponseSize: DefaultMaxResponseSize, MaxStreamBufferSize: DefaultMaxStreamBufferSize},
		StoreErrors: map[string]uint64{"get": 0, "set": 0, "delete": 0, "clear": 0, "corrupt": 0},
	}
	if !reflect.DeepEqual(st, want) {
		t.Fatalf("stats\n got %+v\nwant %+v", st, want)
	}
	if st.SizeBytes <= 0 {
		t.Fatalf("size_bytes %d", st.SizeBytes)
	}
	if string(top["hit_rate"]) != `"0.5000"` || string(top["enabled"]) != "true" {
		t.Fatalf("hit_rate %s enabled %s", top["hit_rate"], top["enabled"])
	}
}

// mwRedisStatsStore is a store that reports a Redis section inside a tier.
type mwRedisStatsStore struct{ mwFailStore }

func (s *mwRedisStatsStore) Stats(context.Context) StoreStats {
	return StoreStats{Backend: "tiered", Entries: 1243, Capacity: 5000,
		L1: &StoreStats{Backend: "redis", Remote: &RemoteStats{
			Connections:    Connections{Active: 3, Idle: 5},
			FallbackActive: false,
			Errors:         map[string]uint64{"connection": 0, "timeout": 2, "other": 0},
		}}}
}

func TestStatsRedisSection(t *testing.T) {
	c := mwNew(t, Config{Store: &mwRedisStatsStore{}})
	out, _ := json.Marshal(c.Stats(context.Background()))
	var top map[string]json.RawMessage
	_ = json.Unmarshal(out, &top)
	const want = `{"connections":{"active":3,"idle":5},"fallback_active":false,"errors":{"connection":0,"other":0,"timeout":2}}`
	if string(top["redis"]) != want {
		t.Fatalf("redis section %s, want %s", top["redis"], want)
	}
	if string(top["hit_rate"]) != `"0.0000"` || string(top["entries"]) != "1243" {
		t.Fatalf("hit_rate %s entries %s", top["hit_rate"], top["entries"])
	}
}

// mwRemoteStore is a third party's store on another server: its section shows as "remote".
type mwRemoteStore struct{ mwFailStore }

func (s *mwRemoteStore) Stats(context.Context) StoreStats {
	return StoreStats{Backend: "memcached", Remote: &RemoteStats{Connections: Connections{Active: 1}, FallbackActive: true}}
}

func TestStatsRemoteSection(t *testing.T) {
	c := mwNew(t, Config{Store: &mwRemoteStore{}})
	st := c.Stats(context.Background())
	if st.Redis != nil || st.Remote == nil || !st.Remote.FallbackActive || st.BackendType != "memcached" {
		t.Fatalf("stats %+v: want the store's section as remote, none as redis", st)
	}
}

func TestMetrics(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer func() { _ = mp.Shutdown(context.Background()) }()
	c := mwNew(t, Config{MeterProvider: mp})
	h := c.Middleware(&mwJSONHandler{})
	for _, b := range [][]byte{mwChat("a", `"temperature":0`), mwChat("a", `"temperature":0`), mwChat("a", `"temperature":0`), mwChat("b", `"temperature":0`, `"n":3`)} {
		mwDo(h, "/v1/chat/completions", b)
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]any{}
	for _, sm := range rm.ScopeMetrics {
		if sm.Scope.Name != scopeName {
			continue
		}
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					name := m.Name
					if v, ok := p.Attributes.Value("result"); ok {
						name += "{result=" + v.AsString() + "}"
					}
					got[name] = p.Value
				}
			case metricdata.Gauge[int64]:
				got[m.Name] = d.DataPoints[0].Value
			case metricdata.Gauge[float64]:
				got[m.Name] = d.DataPoints[0].Value
			}
		}
	}
	for name, want := range map[string]any{
		telemetry.MetricResponseCacheRequests + "{result=hit}":  int64(2),
		telemetry.MetricResponseCacheRequests + "{result=miss}": int64(1),
		telemetry.MetricResponseCacheRequests + "{result=skip}": int64(1),
		telemetry.MetricResponseCacheEntries:                    int64(1),
		telemetry.MetricResponseCacheEvictions:                  int64(0),
		telemetry.MetricResponseCacheHitRate:                    2.0 / 3,
	} {
		if got[name] != want {
			t.Errorf("%s = %v, want %v (all: %v)", name, got[name], want, got)
		}
	}
	if v, _ := got[telemetry.MetricResponseCacheSize].(int64); v <= 0 {
		t.Errorf("%s = %v", telemetry.MetricResponseCacheSize, got[telemetry.MetricResponseCacheSize])
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil { // idempotent
		t.Fatal(err)
	}
	rm = metricdata.ResourceMetrics{}
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	requests := false
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch m.Name {
			case telemetry.MetricResponseCacheEntries:
				t.Fatal("entries still observed after Close")
			case telemetry.MetricResponseCacheRequests:
				requests = true
			}
		}
	}
	if !requests { // the Cache still serves: its counts go on
		t.Error("requests no longer reported after Close")
	}
}
