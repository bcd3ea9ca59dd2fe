package kvroute

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvroute/kvroute/prefixkey"
)

// Spans of the default Router, recorded through Config.TracerProvider (OpenTelemetry's trace API;
// without a provider, or with the API's no-op one, the Router records none and allocates nothing
// for them). kvroute.route is a child of the span in Route's context, the others children of
// kvroute.route. DisaggRouter.Route records the same spans, one kvroute.route per call whatever the
// path: AttrReason is the plan's reason (local_hit, storage_hit, short_prompt, cache_miss), or on
// the unified and fallback paths the unified decision's; AttrBackend the decode (or unified)
// backend; AttrRoutingPath the path and AttrPrefillBackend the prefill backend, when there is one;
// AttrExpectedCachedTokens the plan's with tier 4 on; its kvroute.kv_index.lookup asks about every
// backend, and on the unified and fallback paths Route's own tokenize and lookup follow.
//
//	kvroute.route              Route: AttrReason, AttrBackend, AttrPrefixKey when the request has one,
//	                           AttrExpectedCachedTokens when tier 4 decided (Reason.FromKVIndex),
//	                           AttrBestOverlap when the KV index was asked; status Error with the
//	                           error Route returned
//	  kvroute.tokenize         KVConfig.Tokenizer's call: AttrTokens; status Error with its error
//	  kvroute.kv_index.lookup  the KV index's Lookup (or LookupPrefix): AttrBlocks, AttrBackends;
//	                           status Error with its error
const (
	SpanRoute    = "kvroute.route"
	SpanTokenize = "kvroute.tokenize"
	SpanKVLookup = "kvroute.kv_index.lookup"
)

// Attribute keys of the Router's spans.
const (
	// AttrReason is the decision's Reason label (prefix_hash, kv_aware, …).
	AttrReason = "kvroute.reason"
	// AttrBackend is the chosen backend.
	AttrBackend = "kvroute.backend"
	// AttrPrefixKey is the request's prefix key, in hex (prefixkey.Key.String).
	AttrPrefixKey = "kvroute.prefix_key"
	// AttrExpectedCachedTokens is Decision.ExpectedCachedTokens.
	AttrExpectedCachedTokens = "kvroute.expected_cached_tokens"
	// AttrBestOverlap is the largest share of the request's blocks (tier-weighted) that one
	// healthy backend holds by the KV index, in [0, 1]; 1 when it holds a prefix entry.
	AttrBestOverlap = "kvroute.best_overlap"
	// AttrTokens is the number of prompt tokens the tokenizer returned.
	AttrTokens = "kvroute.tokens"
	// AttrBlocks is the number of the request's block keys looked up (0 for a prefix entry).
	AttrBlocks = "kvroute.blocks"
	// AttrBackends is the number of backends the index was asked about: Route asks about the
	// healthy ones, DisaggRouter.Route about every backend (a prefix an unhealthy one wrote to
	// shared storage is still there).
	AttrBackends = "kvroute.backends"
	// AttrRoutingPath is a DisaggRouter.Route decision's routing path (disagg.Path: fast_decode,
	// prefill_then_decode, unified, fallback).
	AttrRoutingPath = "kvroute.routing_path"
	// AttrPrefillBackend is a prefill_then_decode decision's prefill backend.
	AttrPrefillBackend = "kvroute.prefill_backend"
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

// routeTraced is route within a SpanRoute span.
func (r *DefaultRouter) routeTraced(ctx context.Context, req *prefixkey.Request) (*Decision, error) {
	ctx, span := r.tracer.Start(ctx, SpanRoute)
	d, err := r.route(ctx, req)
	if err == nil {
		span.SetAttributes(attribute.String(AttrReason, d.Reason.String()), attribute.String(AttrBackend, d.Backend))
		if d.HasPrefixKey {
			span.SetAttributes(attribute.String(AttrPrefixKey, d.PrefixKey.String()))
		}
		if d.Reason.FromKVIndex() {
			span.SetAttributes(attribute.Int(AttrExpectedCachedTokens, d.ExpectedCachedTokens))
		}
	}
	endSpan(span, err)
	return d, err
}

// routeTraced is DisaggRouter.route within a SpanRoute span.
func (dr *DisaggRouter) routeTraced(ctx context.Context, req *prefixkey.Request) (*DisaggDecision, error) {
	r := dr.r
	ctx, span := r.tracer.Start(ctx, SpanRoute)
	d, err := dr.route(ctx, req)
	if err == nil {
		reason, fromKV := d.Reason.String(), r.kv != nil
		if d.Unified != nil {
			reason, fromKV = d.Unified.Reason.String(), d.Unified.Reason.FromKVIndex()
		}
		span.SetAttributes(attribute.String(AttrReason, reason), attribute.String(AttrBackend, d.Decode),
			attribute.String(AttrRoutingPath, d.Path.String()))
		if d.Prefill != "" {
			span.SetAttributes(attribute.String(AttrPrefillBackend, d.Prefill))
		}
		if d.HasPrefixKey {
			span.SetAttributes(attribute.String(AttrPrefixKey, d.PrefixKey.String()))
		}
		if fromKV {
			span.SetAttributes(attribute.Int(AttrExpectedCachedTokens, d.ExpectedCachedTokens))
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

// tokenize calls KVConfig.Tokenizer within a SpanTokenize span.
func (r *DefaultRouter) tokenize(ctx context.Context, req *prefixkey.Request) ([]uint32, error) {
	ctx, span := r.startSpan(ctx, SpanTokenize)
	tokens, err := r.kv.cfg.Tokenizer.Tokenize(ctx, req)
	if r.tracer != nil {
		span.SetAttributes(attribute.Int(AttrTokens, len(tokens)))
		endSpan(span, err)
	}
	return tokens, err
}

// endLookup ends the SpanKVLookup span of a lookup of s's block keys on s's backends.
func (r *DefaultRouter) endLookup(span trace.Span, s *scratch4, err error) {
	r.endLookupOf(span, len(s.keys), len(s.names), err)
}

// endLookupOf ends the SpanKVLookup span of a lookup of blocks block keys on backends backends.
func (r *DefaultRouter) endLookupOf(span trace.Span, blocks, backends int, err error) {
	if r.tracer != nil {
		span.SetAttributes(attribute.Int(AttrBlocks, blocks), attribute.Int(AttrBackends, backends))
		endSpan(span, err)
	}
}

// traceOverlap records the best overlap ratio on the SpanRoute span in ctx.
func (r *DefaultRouter) traceOverlap(ctx context.Context, ratio float64) {
	if r.tracer != nil {
		trace.SpanFromContext(ctx).SetAttributes(attribute.Float64(AttrBestOverlap, ratio))
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
