package stack_test

import (
	"maps"
	"testing"

	"github.com/kvroute/kvroute/stack"
)

// A backend's metrics URL is its metrics_url, or its url (trailing slashes dropped) with
// engine_metrics.path.
func TestMetricsTargets(t *testing.T) {
	cfg := parse(t, `engine_metrics: {enabled: true, path: /stats/metrics}
backends:
  - {name: plain, url: "http://10.0.0.1:8000"}
  - {name: slash, url: "http://10.0.0.2:8000//"}
  - {name: own, url: "http://10.0.0.3:8000", metrics_url: "http://10.0.0.3:9400/metrics"}
`)
	want := map[string]string{
		"plain": "http://10.0.0.1:8000/stats/metrics",
		"slash": "http://10.0.0.2:8000/stats/metrics",
		"own":   "http://10.0.0.3:9400/metrics",
	}
	if got := stack.MetricsTargets(cfg); !maps.Equal(got, want) {
		t.Errorf("MetricsTargets = %v, want %v", got, want)
	}
}
