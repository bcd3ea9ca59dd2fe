package main

import (
	"context"
	"os"
	"time"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvroute/kvroute/config"
)

// startTracing builds the tracing section's TracerProvider (nil when tracing is off) and the
// proxy's tracer; Close shuts it down, flushing the spans not yet exported (for at most 5 s).
// KVROUTE_TRACING=stdout turns stdout tracing on whatever the configuration says (the demo has
// none).
func (s *server) startTracing() (trace.TracerProvider, error) {
	tc := s.cfg.Tracing
	if os.Getenv("KVROUTE_TRACING") == config.TracingStdout {
		tc.Enabled, tc.Exporter = true, config.TracingStdout
	}
	if !tc.Enabled {
		return nil, nil
	}
	var exp sdktrace.SpanExporter
	var err error
	if tc.Exporter == config.TracingStdout {
		exp, err = stdouttrace.New()
	} else {
		exp, err = otlptracehttp.New(context.Background(), otlptracehttp.WithEndpointURL(tc.Endpoint))
	}
	if err != nil {
		return nil, err
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(tc.SampleRatio))))
	s.closers = append(s.closers, func() error { // a collector that does not answer holds no exit up
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return tp.Shutdown(ctx)
	})
	s.tracer = tp.Tracer(proxyScope)
	return tp, nil
}
