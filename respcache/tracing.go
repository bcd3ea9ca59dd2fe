package respcache

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvroute/kvroute/telemetry"
)

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

// lookup is get within a telemetry.SpanResponseCacheLookup span when tracing is on.
func (c *Cache) lookup(ctx context.Context, key string) *storedResponse {
	if c.tracer == nil {
		return c.get(ctx, key)
	}
	ctx, span := c.tracer.Start(ctx, telemetry.SpanResponseCacheLookup)
	e := c.get(ctx, key)
	span.SetAttributes(attribute.Bool(telemetry.AttrResponseCacheHit, e != nil))
	span.End()
	return e
}

// traceError marks the telemetry.SpanResponseCacheLookup span in ctx failed with err.
func (c *Cache) traceError(ctx context.Context, err error) {
	if c.tracer != nil {
		span := trace.SpanFromContext(ctx)
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
}
