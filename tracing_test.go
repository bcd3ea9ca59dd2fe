package kvroute

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/telemetry"
)

// recorder returns an SDK TracerProvider that keeps every ended span in memory, and the recorder.
func recorder(t *testing.T) (*sdktrace.TracerProvider, *tracetest.SpanRecorder) {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return tp, rec
}

// spansByName indexes the ended spans by name; a name must not repeat.
func spansByName(t *testing.T, rec *tracetest.SpanRecorder) map[string]sdktrace.ReadOnlySpan {
	t.Helper()
	out := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		require.NotContains(t, out, s.Name(), "span %s recorded twice", s.Name())
		out[s.Name()] = s
	}
	return out
}

// attrs returns a span's attributes by key.
func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	out := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		out[kv.Key] = kv.Value
	}
	return out
}

func TestTracingRouteSpans(t *testing.T) {
	toks := promptTokens(7, 10*16)
	errTok := errors.New("tokenizer timeout")
	tok := prefixkey.TokenizerFunc(func(_ context.Context, req *prefixkey.Request) ([]uint32, error) {
		if req.System == "broken" {
			return nil, errTok
		}
		return toks, nil
	})
	kvReq := chatReq("tokenize me", "u")
	kvReq.Model = testModel

	for _, tc := range []struct {
		name      string
		kv        bool // tier 4 on, vllm-2 holding toks
		index     bool // a failing index instead
		req       *prefixkey.Request
		spans     []string
		reason    string
		attrs     map[attribute.Key]attribute.Value // on the route span
		absent    []attribute.Key                   // not on the route span
		failed    string                            // the span with status Error
		child     map[attribute.Key]attribute.Value // on the tokenize and lookup spans
		childFrom string                            // the span child holds
	}{{
		name: "kv_aware", kv: true, req: kvReq,
		spans:  []string{telemetry.SpanRoute, telemetry.SpanTokenize, telemetry.SpanKVLookup},
		reason: "kv_aware",
		attrs: map[attribute.Key]attribute.Value{telemetry.AttrBackend: attribute.StringValue("vllm-2"),
			telemetry.AttrExpectedCachedTokens: attribute.IntValue(160), telemetry.AttrBestOverlap: attribute.Float64Value(1)},
		child: map[attribute.Key]attribute.Value{telemetry.AttrTokens: attribute.IntValue(160), telemetry.AttrBlocks: attribute.IntValue(10),
			telemetry.AttrBackends: attribute.IntValue(3)},
	}, {
		name: "tier1_only", req: chatReq("system A", "u"),
		spans:  []string{telemetry.SpanRoute},
		reason: "prefix_hash",
		absent: []attribute.Key{telemetry.AttrExpectedCachedTokens, telemetry.AttrBestOverlap},
	}, {
		name: "tokenizer_error", kv: true, req: chatReq("broken", "u"),
		spans:  []string{telemetry.SpanRoute, telemetry.SpanTokenize},
		reason: "prefix_hash",
		absent: []attribute.Key{telemetry.AttrExpectedCachedTokens, telemetry.AttrBestOverlap},
		failed: telemetry.SpanTokenize,
	}, {
		name: "index_error", index: true, req: tokReq("s", promptTokens(1, 64)),
		spans:  []string{telemetry.SpanRoute, telemetry.SpanKVLookup},
		reason: "prefix_hash",
		absent: []attribute.Key{telemetry.AttrExpectedCachedTokens, telemetry.AttrBestOverlap},
		failed: telemetry.SpanKVLookup,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			tp, rec := recorder(t)
			cfg := Config{Backends: backends(3), TracerProvider: tp}
			if tc.kv {
				ix := newMemIndex(t)
				storeBlocks(t, ix, "vllm-2", toks, 10, events.TierGPU)
				cfg.KV = &KVConfig{Index: ix, Tokenizer: tok, Speculation: SpeculationOff}
			}
			if tc.index {
				cfg.KV = &KVConfig{Index: failingIndex{}, Speculation: SpeculationOff}
			}
			r := newRouter(t, cfg)

			ctx, parent := tp.Tracer("test").Start(context.Background(), "parent")
			d, err := r.Route(ctx, tc.req)
			require.NoError(t, err)
			d.Done(Outcome{})
			parent.End()

			spans := spansByName(t, rec)
			require.Len(t, spans, len(tc.spans)+1)
			route := spans[telemetry.SpanRoute]
			require.NotNil(t, route)
			assert.Equal(t, parent.SpanContext().SpanID(), route.Parent().SpanID(), "route is a child of the caller's span")
			assert.Equal(t, parent.SpanContext().TraceID(), route.SpanContext().TraceID())
			got := attrs(route)
			assert.Equal(t, tc.reason, got[telemetry.AttrReason].AsString())
			assert.Equal(t, d.Backend, got[telemetry.AttrBackend].AsString())
			assert.Equal(t, d.PrefixKey.String(), got[telemetry.AttrPrefixKey].AsString())
			for k, v := range tc.attrs {
				assert.Equal(t, v, got[k], "%s", k)
			}
			for _, k := range tc.absent {
				assert.NotContains(t, got, k)
			}
			assert.Equal(t, codes.Unset, route.Status().Code)
			for _, name := range tc.spans[1:] {
				s := spans[name]
				require.NotNil(t, s, name)
				assert.Equal(t, route.SpanContext().SpanID(), s.Parent().SpanID(), "%s is a child of the route span", name)
				for k, v := range attrs(s) {
					if want, ok := tc.child[k]; ok {
						assert.Equal(t, want, v, "%s %s", name, k)
					}
				}
				if name == tc.failed {
					assert.Equal(t, codes.Error, s.Status().Code, name)
				} else {
					assert.Equal(t, codes.Unset, s.Status().Code, name)
				}
			}
		})
	}
}

func TestTracingRouteError(t *testing.T) {
	tp, rec := recorder(t)
	r := newRouter(t, Config{TracerProvider: tp}) // no backends
	_, err := r.Route(context.Background(), chatReq("s", "u"))
	require.ErrorIs(t, err, ErrNoBackend)
	spans := rec.Ended()
	require.Len(t, spans, 1)
	assert.Equal(t, telemetry.SpanRoute, spans[0].Name())
	assert.Equal(t, codes.Error, spans[0].Status().Code)
	assert.Equal(t, ErrNoBackend.Error(), spans[0].Status().Description)
	assert.False(t, spans[0].Parent().IsValid(), "a root span without a caller's span")
}

// TestTracingOffAllocs: without a TracerProvider, or with the API's no-op one, Route allocates no
// more than it does untraced (the Decision; tier 4's overlaps), and traced it records spans.
func TestTracingOffAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts differ under -race")
	}
	toks := promptTokens(3, 8*16)
	for _, tc := range []struct {
		name string
		kv   bool
		want float64
	}{{"tier1", false, 1}, {"tier4", true, 2}} {
		for _, tp := range []struct {
			name string
			tp   trace.TracerProvider
		}{{"nil", nil}, {"noop", noop.NewTracerProvider()}} {
			t.Run(tc.name+"/"+tp.name, func(t *testing.T) {
				cfg := Config{Backends: backends(4), TracerProvider: tp.tp}
				if tc.kv {
					ix := newMemIndex(t)
					storeBlocks(t, ix, "vllm-1", toks, 8, events.TierGPU)
					cfg.KV = &KVConfig{Index: ix, Speculation: SpeculationOff}
				}
				r := newRouter(t, cfg)
				req := tokReq("allocs", toks)
				ctx := context.Background()
				got := testing.AllocsPerRun(200, func() {
					d, err := r.Route(ctx, req)
					if err != nil {
						t.Fatal(err)
					}
					d.Done(Outcome{})
				})
				assert.Equal(t, tc.want, got)
			})
		}
	}
}

// DisaggRouter.Route records one kvroute.route span per call, as Route does, with the plan's
// reason and decode backend, the routing path and (prefill_then_decode) the prefill backend, and
// the index's lookup as a kvroute.kv_index.lookup child; on the unified and fallback paths the
// route span carries the unified decision's reason, and Route's own steps are its children, never
// a second kvroute.route.
func TestTracingDisaggRouteSpans(t *testing.T) {
	long := dgTokens(1, 64*16+5) // 64 full blocks
	for _, tc := range []struct {
		name    string
		setup   func(t *testing.T, r *DefaultRouter, ix *kvindex.MemoryIndex)
		reason  string
		path    string
		backend string
		prefill string // "" for none
		lookups int    // kvroute.kv_index.lookup spans under the route span
	}{{
		name: "fast_decode",
		setup: func(t *testing.T, r *DefaultRouter, ix *kvindex.MemoryIndex) {
			dgHold(t, ix, "decode-2", long, 64, events.TierGPU)
		},
		reason: "local_hit", path: "fast_decode", backend: "decode-2", lookups: 1,
	}, {
		name: "prefill_then_decode",
		setup: func(t *testing.T, r *DefaultRouter, ix *kvindex.MemoryIndex) {
			dgHold(t, ix, "prefill-2", long, 40, events.TierGPU)
			dgBusy(t, r, "decode-1", 1)
			dgBusy(t, r, "decode-3", 1)
		},
		reason: "cache_miss", path: "prefill_then_decode", backend: "decode-2", prefill: "prefill-2", lookups: 1,
	}, {
		name: "fallback",
		setup: func(t *testing.T, r *DefaultRouter, ix *kvindex.MemoryIndex) {
			for _, n := range []string{"decode-1", "decode-2", "decode-3"} {
				require.NoError(t, r.SetHealthy(n, false))
			}
		},
		reason: "least_work", path: "fallback", backend: "unified-fallback", lookups: 2, // the plan's, then tier 4's over the unified backends
	}} {
		t.Run(tc.name, func(t *testing.T) {
			tp, rec := recorder(t)
			ix := dgIndex(t)
			r := dgRouter(t, ix, disagg.Config{}, func(c *Config) { c.KV.Speculation = SpeculationOff; c.TracerProvider = tp })
			tc.setup(t, r, ix)

			ctx, parent := tp.Tracer("test").Start(context.Background(), "parent")
			d, err := r.Disagg().Route(ctx, dgReq(long))
			require.NoError(t, err)
			d.Done(Outcome{})
			parent.End()
			require.Equal(t, tc.path, d.Plan.Path.String())

			var route sdktrace.ReadOnlySpan
			lookups := 0
			for _, s := range rec.Ended() {
				switch s.Name() {
				case telemetry.SpanRoute:
					require.Nil(t, route, "one kvroute.route span per call")
					route = s
				case telemetry.SpanKVLookup:
					lookups++
				}
			}
			require.NotNil(t, route, "no kvroute.route span")
			assert.Equal(t, parent.SpanContext().SpanID(), route.Parent().SpanID(), "route is a child of the caller's span")
			assert.Equal(t, codes.Unset, route.Status().Code)
			got := attrs(route)
			assert.Equal(t, tc.reason, got[telemetry.AttrReason].AsString())
			assert.Equal(t, tc.backend, got[telemetry.AttrBackend].AsString())
			assert.Equal(t, d.PrefixKey.String(), got[telemetry.AttrPrefixKey].AsString())
			assert.Equal(t, tc.path, got[telemetry.AttrRoutingPath].AsString())
			if tc.prefill != "" {
				assert.Equal(t, tc.prefill, got[telemetry.AttrPrefillBackend].AsString())
			} else {
				assert.NotContains(t, got, attribute.Key(telemetry.AttrPrefillBackend))
			}
			assert.Equal(t, int64(d.Plan.ExpectedCachedTokens), got[telemetry.AttrExpectedCachedTokens].AsInt64())
			assert.Contains(t, got, attribute.Key(telemetry.AttrBestOverlap))
			assert.Equal(t, tc.lookups, lookups)
			for _, s := range rec.Ended() {
				if s.Name() != telemetry.SpanKVLookup {
					continue
				}
				assert.Equal(t, route.SpanContext().SpanID(), s.Parent().SpanID(), "the lookup is a child of the route span")
				a := attrs(s)
				assert.Equal(t, int64(64), a[telemetry.AttrBlocks].AsInt64())
				assert.Positive(t, a[telemetry.AttrBackends].AsInt64())
			}
		})
	}
}

// A DisaggRouter.Route that finds no backend ends its span with status Error.
func TestTracingDisaggRouteError(t *testing.T) {
	tp, rec := recorder(t)
	r := dgRouter(t, nil, disagg.Config{DisableFallback: true}, func(c *Config) { c.TracerProvider = tp })
	for _, n := range []string{"decode-1", "decode-2", "decode-3"} {
		require.NoError(t, r.SetHealthy(n, false))
	}
	_, err := r.Disagg().Route(context.Background(), dgReq(dgTokens(3, 100)))
	require.ErrorIs(t, err, ErrNoBackend)
	spans := rec.Ended()
	require.Len(t, spans, 1)
	assert.Equal(t, telemetry.SpanRoute, spans[0].Name())
	assert.Equal(t, codes.Error, spans[0].Status().Code)
}
