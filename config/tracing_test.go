package config

import (
	"strings"
	"testing"

	"go.opentelemetry.io/otel/trace/noop"
)

func TestTracingSection(t *testing.T) {
	for _, tc := range []struct {
		name, yaml string
		want       TracingConfig // after defaults, when valid
		err        string        // the field path the error names
	}{
		{"absent", "", TracingConfig{Exporter: TracingOTLP, Endpoint: DefaultTracingEndpoint, SampleRatio: 1}, ""},
		{"otlp", "tracing: {enabled: true, endpoint: \"https://otel:4318/v1/traces\", sample_ratio: 0.25}\n",
			TracingConfig{Enabled: true, Exporter: TracingOTLP, Endpoint: "https://otel:4318/v1/traces", SampleRatio: 0.25}, ""},
		{"stdout", "tracing: {enabled: true, exporter: stdout}\n",
			TracingConfig{Enabled: true, Exporter: TracingStdout, Endpoint: DefaultTracingEndpoint, SampleRatio: 1}, ""},
		{"bad_exporter", "tracing: {enabled: true, exporter: zipkin}\n", TracingConfig{}, "tracing.exporter"},
		{"bad_endpoint", "tracing: {enabled: true, endpoint: \"otel:4318\"}\n", TracingConfig{}, "tracing.endpoint"},
		{"ratio_above_1", "tracing: {enabled: true, sample_ratio: 2}\n", TracingConfig{}, "tracing.sample_ratio"},
		{"ratio_negative", "tracing: {enabled: true, sample_ratio: -0.5}\n", TracingConfig{}, "tracing.sample_ratio"},
		{"off_not_checked", "tracing: {exporter: zipkin}\n", TracingConfig{Exporter: "zipkin", Endpoint: DefaultTracingEndpoint, SampleRatio: 1}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := Parse([]byte(minimalBackends+tc.yaml), env(nil))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err+":") {
					t.Fatalf("error %v, want one naming %s", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if cfg.Tracing != tc.want {
				t.Errorf("tracing %+v, want %+v", cfg.Tracing, tc.want)
			}
		})
	}
}

// TestTracerProviderPassedOn: Options.TracerProvider reaches the Router's and the response cache's
// configs.
func TestTracerProviderPassedOn(t *testing.T) {
	cfg, err := Parse([]byte(minimalBackends+"response_cache: {enabled: true}\n"), env(nil))
	if err != nil {
		t.Fatal(err)
	}
	tp := noop.NewTracerProvider()
	rcfg, err := cfg.RouterConfig(Options{TracerProvider: tp})
	if err != nil || rcfg.TracerProvider != tp {
		t.Errorf("RouterConfig: TracerProvider %v, err %v", rcfg.TracerProvider, err)
	}
	cache, closeCache, err := cfg.NewResponseCache(Options{TracerProvider: tp})
	if err != nil || cache == nil {
		t.Fatalf("NewResponseCache: %v", err)
	}
	_ = closeCache()
}
