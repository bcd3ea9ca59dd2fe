package enginemetrics_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/enginemetrics"
)

const (
	waitFor = 10 * time.Second
	tick    = 5 * time.Millisecond
	// interval is the scrape interval of most tests: short, so that they run fast.
	interval = 20 * time.Millisecond
)

// fixture returns testdata/name.
func fixture(t testing.TB, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	require.NoError(t, err)
	return string(b)
}

// recorder is a Sink that keeps every report.
type recorder struct {
	mu      sync.Mutex
	reports map[string][]kvroute.EngineLoad
	err     error // returned by every call
}

func newRecorder() *recorder { return &recorder{reports: map[string][]kvroute.EngineLoad{}} }

func (r *recorder) ReportEngineLoad(backend string, l kvroute.EngineLoad) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.reports[backend] = append(r.reports[backend], l)
	return r.err
}

// count returns how many loads backend got.
func (r *recorder) count(backend string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.reports[backend])
}

// last returns backend's latest load.
func (r *recorder) last(backend string) (kvroute.EngineLoad, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	ls := r.reports[backend]
	if len(ls) == 0 {
		return kvroute.EngineLoad{}, false
	}
	return ls[len(ls)-1], true
}

// serve starts an httptest server answering GET with h, closed at the end of the test.
func serve(t testing.TB, h http.HandlerFunc) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

// body answers every request with the Prometheus text body b.
func body(b string) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		_, _ = w.Write([]byte(b))
	}
}

// switchable serves body b until fail is set, then 500s.
type switchable struct {
	mu   sync.Mutex
	b    string
	fail bool
}

func (s *switchable) set(b string, fail bool) {
	s.mu.Lock()
	s.b, s.fail = b, fail
	s.mu.Unlock()
}

func (s *switchable) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	s.mu.Lock()
	b, fail := s.b, s.fail
	s.mu.Unlock()
	if fail {
		http.Error(w, "engine is unavailable", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	_, _ = w.Write([]byte(b))
}

// sglangBody is a minimal SGLang body of one rank.
func sglangBody(model string, running, waiting int, usage float64) string {
	lbl := fmt.Sprintf(`{model_name=%q,pp_rank="0",tp_rank="0"}`, model)
	var b strings.Builder
	for _, m := range []struct {
		name, help string
		v          float64
	}{
		{"sglang:num_running_reqs", "The number of running requests.", float64(running)},
		{"sglang:token_usage", "The token usage.", usage},
		{"sglang:num_queue_reqs", "The number of requests in the waiting queue.", float64(waiting)},
	} {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s gauge\n%s%s %g\n", m.name, m.help, m.name, m.name, lbl, m.v)
	}
	return b.String()
}

// metricsReader returns a MeterProvider and the reader of its metrics.
func metricsReader(t testing.TB) (*sdkmetric.MeterProvider, *sdkmetric.ManualReader) {
	rd := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	return mp, rd
}

// counter returns the value of the Int64 sum name at the attributes kv (key, value, ...).
func counter(t testing.TB, rd *sdkmetric.ManualReader, name string, kv ...string) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, rd.Collect(context.Background(), &rm))
	want := make([]attribute.KeyValue, 0, len(kv)/2)
	for i := 0; i+1 < len(kv); i += 2 {
		want = append(want, attribute.String(kv[i], kv[i+1]))
	}
	wantSet := attribute.NewSet(want...)
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			sum, ok := m.Data.(metricdata.Sum[int64])
			require.True(t, ok, "%s is a %T", name, m.Data)
			for _, dp := range sum.DataPoints {
				if dp.Attributes.Equals(&wantSet) {
					return dp.Value
				}
			}
		}
	}
	return 0
}

// statsOf returns backend's stats.
func statsOf(t testing.TB, s *enginemetrics.Scraper, backend string) enginemetrics.TargetStats {
	t.Helper()
	for _, st := range s.Stats() {
		if st.Backend == backend {
			return st
		}
	}
	t.Fatalf("no stats for %q in %+v", backend, s.Stats())
	return enginemetrics.TargetStats{}
}

// start returns a started Scraper of cfg (Interval defaulting to interval) reporting to sink,
// closed at the end of the test.
func start(t testing.TB, cfg enginemetrics.Config, sink enginemetrics.Sink) *enginemetrics.Scraper {
	t.Helper()
	if cfg.Interval == 0 {
		cfg.Interval = interval
	}
	s, err := enginemetrics.New(cfg, sink)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	require.NoError(t, s.Start(context.Background()))
	return s
}
