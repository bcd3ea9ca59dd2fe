package respcache

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// SpanLookup is the span of the Cache's store lookup for an eligible request (Config.TracerProvider),
// a child of the request context's span: AttrHit tells whether the store held the response;
// status Error with a store error or a corrupt entry (both a miss). A request a concurrent
// identical one then answers (coalescing) shows as a miss here.
const SpanLookup = "respcache.lookup"

// AttrHit is SpanLookup's attribute: true when the store held the response.
const AttrHit = "respcache.hit"

// tracerScope is the instrumentation scope of the Cache's spans.
const tracerScope = "github.com/kvroute/kvroute/respcache"

// newTracer returns tp's tracer for the Cache, or nil (no spans) when tp is nil or the API's no-op
// provider.
func newTracer(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		return nil
	}
	if _, off := tp.(noop.TracerProvider); off {
		return nil
	}
	return tp.Tracer(tracerScope)
}

// lookup is get within a SpanLookup span when tracing is on.
func (c *Cache) lookup(ctx context.Context, key string) *storedResponse {
	if c.tracer == nil {
		return c.get(ctx, key)
	}
	ctx, span := c.tracer.Start(ctx, SpanLookup)
	e := c.get(ctx, key)
	span.SetAttributes(attribute.Bool(AttrHit, e != nil))
	span.End()
	return e
}

// traceError marks the SpanLookup span in ctx failed with err.
func (c *Cache) traceError(ctx context.Context, err error) {
	if c.tracer != nil {
		span := trace.SpanFromContext(ctx)
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
}
