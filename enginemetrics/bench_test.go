package enginemetrics_test

import (
	"bytes"
	"fmt"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/enginemetrics"
)

// dataParallel returns the single-engine vLLM body with every engine="0" series repeated for
// engines 0 … n−1, keeping each family's lines together: a data-parallel deployment's body.
func dataParallel(body string, n int) string {
	var b strings.Builder
	for _, line := range strings.SplitAfter(body, "\n") {
		if !strings.Contains(line, `engine="0"`) {
			b.WriteString(line)
			continue
		}
		for e := range n {
			b.WriteString(strings.Replace(line, `engine="0"`, fmt.Sprintf(`engine="%d"`, e), 1))
		}
	}
	return b.String()
}

// BenchmarkParse parses a vLLM engine's whole /metrics body (testdata/vllm.prom: 199 series,
// scheduler gauges, counters, eleven histograms, the Python client's process metrics) and one of
// eight data-parallel engines.
func BenchmarkParse(b *testing.B) {
	one := fixture(b, "vllm.prom")
	for _, tc := range []struct {
		name string
		body string
	}{
		{"engines=1", one},
		{"engines=8", dataParallel(one, 8)},
	} {
		b.Run(fmt.Sprintf("%s/series=%d", tc.name, strings.Count(tc.body, "\n")-strings.Count(tc.body, "# ")), func(b *testing.B) {
			in := []byte(tc.body)
			b.SetBytes(int64(len(in)))
			b.ReportAllocs()
			for b.Loop() {
				if _, _, err := enginemetrics.Parse(bytes.NewReader(in), ""); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
