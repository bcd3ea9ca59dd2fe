package respcache

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/kvroute/kvroute/telemetry"
)

// TestTracingLookupSpans: each eligible request's store lookup is a telemetry.SpanResponseCacheLookup span, child of the
// request's span, telling hit or miss, and failed with a store error; bypassed requests have none.
func TestTracingLookupSpans(t *testing.T) {
	type want struct {
		hit    bool
		failed bool
	}
	for _, tc := range []struct {
		name  string
		store CacheStore // nil: memory
		body  []byte
		want  []want // one per request, two requests
	}{
		{"miss_then_hit", nil, mwChat("hi", `"temperature":0`), []want{{hit: false}, {hit: true}}},
		{"store_error", &mwFailStore{}, mwChat("hi", `"temperature":0`), []want{{failed: true}, {failed: true}}},
		{"bypass", nil, mwChat("hi", `"temperature":0.7`), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := tracetest.NewSpanRecorder()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
			defer func() { _ = tp.Shutdown(context.Background()) }()
			c := mwNew(t, Config{Store: tc.store, TracerProvider: tp})
			h := c.Middleware(&mwJSONHandler{})
			for i := range 2 {
				ctx, parent := tp.Tracer("test").Start(context.Background(), "request")
				r := httptest.NewRequestWithContext(ctx, http.MethodPost, "/v1/chat/completions", bytes.NewReader(tc.body))
				h.ServeHTTP(httptest.NewRecorder(), r)
				parent.End()

				var lookups []sdktrace.ReadOnlySpan
				for _, s := range rec.Ended() {
					if s.Name() == telemetry.SpanResponseCacheLookup && s.SpanContext().TraceID() == parent.SpanContext().TraceID() {
						lookups = append(lookups, s)
					}
				}
				if tc.want == nil {
					if len(lookups) != 0 {
						t.Fatalf("request %d: %d lookup spans for a bypassed request", i, len(lookups))
					}
					continue
				}
				if len(lookups) != 1 {
					t.Fatalf("request %d: %d lookup spans, want 1", i, len(lookups))
				}
				s, w := lookups[0], tc.want[i]
				if s.Parent().SpanID() != parent.SpanContext().SpanID() {
					t.Errorf("request %d: lookup span's parent %v, want the request's span %v", i, s.Parent().SpanID(), parent.SpanContext().SpanID())
				}
				if got := s.Attributes(); len(got) != 1 || got[0] != attribute.Bool(telemetry.AttrResponseCacheHit, w.hit) {
					t.Errorf("request %d: attributes %v, want %s=%v", i, got, telemetry.AttrResponseCacheHit, w.hit)
				}
				if failed := s.Status().Code == codes.Error; failed != w.failed {
					t.Errorf("request %d: status %v, want failed %v", i, s.Status(), w.failed)
				}
			}
		})
	}
}
