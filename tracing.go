package kvroute

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/telemetry"
)

// tracerScope is the instrumentation scope of the Router's spans.
const tracerScope = "github.com/kvroute/kvroute"

// newTracer returns tp's tracer for the Router, or nil (no spans, and no work for them) when tp is
// nil or the API's no-op provider.
func newTracer(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		return nil
	}
	if _, off := tp.(noop.TracerProvider); off {
		return nil
	}
	return tp.Tracer(tracerScope)
}

// routeTraced is route within a telemetry.SpanRoute span.
func (r *DefaultRouter) routeTraced(ctx context.Context, req *prefixkey.Request) (*Decision, error) {
	ctx, span := r.tracer.Start(ctx, telemetry.SpanRoute)
	d, err := r.route(ctx, req)
	if err == nil {
		span.SetAttributes(attribute.String(telemetry.AttrReason, d.Reason.String()), attribute.String(telemetry.AttrBackend, d.Backend))
		if d.HasPrefixKey {
			span.SetAttributes(attribute.String(telemetry.AttrPrefixKey, d.PrefixKey.String()))
		}
		if d.Reason.FromKVIndex() {
			span.SetAttributes(attribute.Int(telemetry.AttrExpectedCachedTokens, d.ExpectedCachedTokens))
		}
	}
	endSpan(span, err)
	return d, err
}

// routeTraced is DisaggRouter.route within a telemetry.SpanRoute span.
func (dr *DisaggRouter) routeTraced(ctx context.Context, req *prefixkey.Request) (*DisaggDecision, error) {
	r := dr.r
	ctx, span := r.tracer.Start(ctx, telemetry.SpanRoute)
	d, err := dr.route(ctx, req)
	if err == nil {
		reason, fromKV := d.Plan.Reason.String(), r.kv != nil
		if d.Unified != nil {
			reason, fromKV = d.Unified.Reason.String(), d.Unified.Reason.FromKVIndex()
		}
		span.SetAttributes(attribute.String(telemetry.AttrReason, reason), attribute.String(telemetry.AttrBackend, d.Plan.Decode),
			attribute.String(telemetry.AttrRoutingPath, d.Plan.Path.String()))
		if d.Plan.Prefill != "" {
			span.SetAttributes(attribute.String(telemetry.AttrPrefillBackend, d.Plan.Prefill))
		}
		if d.HasPrefixKey {
			span.SetAttributes(attribute.String(telemetry.AttrPrefixKey, d.PrefixKey.String()))
		}
		if fromKV {
			span.SetAttributes(attribute.Int(telemetry.AttrExpectedCachedTokens, d.Plan.ExpectedCachedTokens))
		}
	}
	endSpan(span, err)
	return d, err
}

// startSpan starts a child span of ctx named name; with tracing off it returns ctx and a no-op
// span, without allocating.
func (r *DefaultRouter) startSpan(ctx context.Context, name string) (context.Context, trace.Span) {
	if r.tracer == nil {
		return ctx, noop.Span{}
	}
	return r.tracer.Start(ctx, name)
}

// tokenize calls KVConfig.Tokenizer within a telemetry.SpanTokenize span.
func (r *DefaultRouter) tokenize(ctx context.Context, req *prefixkey.Request) ([]uint32, error) {
	ctx, span := r.startSpan(ctx, telemetry.SpanTokenize)
	tokens, err := r.kv.cfg.Tokenizer.Tokenize(ctx, req)
	if r.tracer != nil {
		span.SetAttributes(attribute.Int(telemetry.AttrTokens, len(tokens)))
		endSpan(span, err)
	}
	return tokens, err
}

// endLookup ends the telemetry.SpanKVLookup span of a lookup of s's block keys on s's backends.
func (r *DefaultRouter) endLookup(span trace.Span, s *scratch4, err error) {
	r.endLookupOf(span, len(s.keys), len(s.names), err)
}

// endLookupOf ends the telemetry.SpanKVLookup span of a lookup of blocks block keys on backends backends.
func (r *DefaultRouter) endLookupOf(span trace.Span, blocks, backends int, err error) {
	if r.tracer != nil {
		span.SetAttributes(attribute.Int(telemetry.AttrBlocks, blocks), attribute.Int(telemetry.AttrBackends, backends))
		endSpan(span, err)
	}
}

// traceOverlap records the best overlap ratio on the telemetry.SpanRoute span in ctx.
func (r *DefaultRouter) traceOverlap(ctx context.Context, ratio float64) {
	if r.tracer != nil {
		trace.SpanFromContext(ctx).SetAttributes(attribute.Float64(telemetry.AttrBestOverlap, ratio))
	}
}

// endSpan ends span, with status Error when err is not nil.
func endSpan(span trace.Span, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}
