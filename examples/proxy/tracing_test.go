package main

import (
	"bytes"
	"compress/gzip"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/telemetry"
)

// otlpCollector is a fake OpenTelemetry Collector: it keeps the spans OTLP/HTTP exports to it.
type otlpCollector struct {
	*httptest.Server
	mu    sync.Mutex
	spans []*tracepb.Span
}

func newOTLPCollector(t *testing.T) *otlpCollector {
	t.Helper()
	c := &otlpCollector{}
	c.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body io.Reader = r.Body
		if r.Header.Get("Content-Encoding") == "gzip" {
			zr, err := gzip.NewReader(r.Body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			body = zr
		}
		b, err := io.ReadAll(body)
		var req coltracepb.ExportTraceServiceRequest
		if err == nil {
			err = proto.Unmarshal(b, &req)
		}
		if r.URL.Path != "/v1/traces" || err != nil {
			http.Error(w, fmt.Sprintf("path %s: %v", r.URL.Path, err), http.StatusBadRequest)
			return
		}
		c.mu.Lock()
		for _, rs := range req.GetResourceSpans() {
			for _, ss := range rs.GetScopeSpans() {
				c.spans = append(c.spans, ss.GetSpans()...)
			}
		}
		c.mu.Unlock()
		w.Header().Set("Content-Type", "application/x-protobuf")
	}))
	t.Cleanup(c.Close)
	return c
}

// trace returns the spans received of the trace traceID (hex).
func (c *otlpCollector) trace(traceID string) []*tracepb.Span {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*tracepb.Span
	for _, s := range c.spans {
		if hex.EncodeToString(s.GetTraceId()) == traceID {
			out = append(out, s)
		}
	}
	return out
}

// traceparentBackend is a backend that answers every LLM request and keeps the traceparent
// header of each.
type traceparentBackend struct {
	*httptest.Server
	mu      sync.Mutex
	parents []string
}

func newTraceparentBackend(t *testing.T) *traceparentBackend {
	t.Helper()
	b := &traceparentBackend{}
	b.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		b.mu.Lock()
		b.parents = append(b.parents, r.Header.Get("Traceparent"))
		b.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}`)
	}))
	t.Cleanup(b.Close)
	return b
}

func (b *traceparentBackend) received() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.parents)
}

const (
	clientTraceID     = "4bf92f3577b34da6a3ce929d0e0e4736"
	clientSpanID      = "00f067aa0ba902b7"
	clientTraceparent = "00-" + clientTraceID + "-" + clientSpanID + "-01"
)

// TestTracingThroughProxy: with tracing on, a request's spans (the proxy's server span, the
// response cache's lookup, the Router's route, tokenization and KV-index lookup, the upstream
// attempt) form one trace that continues the client's W3C traceparent, and the backend receives
// that trace's context with the upstream span as its parent; Close flushes the spans to the OTLP
// endpoint.
func TestTracingThroughProxy(t *testing.T) {
	col := newOTLPCollector(t)
	be := newTraceparentBackend(t)
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: be.URL}}, func(c *config.Config) {
		c.ResponseCache.Enabled = true
		c.KVCacheIndex.Enabled = true
		c.Tracing = config.TracingConfig{Enabled: true, Endpoint: col.URL + "/v1/traces"}
	}))
	body := chatBody(longSystemPrompt("tracing", 200), "Hi.", `"temperature":0`)
	for i, want := range []string{respcache.XCacheMiss, respcache.XCacheHit} {
		resp, b := post(t, p.URL+"/v1/chat/completions", body, "Traceparent", clientTraceparent)
		if resp.StatusCode != 200 || resp.Header.Get(respcache.HeaderXCache) != want {
			t.Fatalf("request %d: %d %s X-Cache %q, want %s", i, resp.StatusCode, b, resp.Header.Get(respcache.HeaderXCache), want)
		}
	}
	if err := p.server.Close(); err != nil { // flushes the spans
		t.Fatal(err)
	}

	// The backend, asked once (the second answer is the cache's), continues the client's trace.
	got := be.received()
	if len(got) != 1 {
		t.Fatalf("backend received %d requests, want 1", len(got))
	}
	f := strings.Split(got[0], "-") // version, trace ID, parent span ID, flags
	if len(f) != 4 || f[1] != clientTraceID || f[3] != "01" {
		t.Fatalf("backend's traceparent %q, want the client's trace %s, sampled", got[0], clientTraceID)
	}
	parentID := f[2]

	spans := col.trace(clientTraceID)
	byName := map[string][]*tracepb.Span{}
	byID := map[string]*tracepb.Span{}
	for _, s := range spans {
		byName[s.GetName()] = append(byName[s.GetName()], s)
		byID[hex.EncodeToString(s.GetSpanId())] = s
	}
	want := map[string]int{"kvroute.proxy /v1/chat/completions": 2, telemetry.SpanResponseCacheLookup: 2, telemetry.SpanRoute: 1,
		telemetry.SpanTokenize: 1, telemetry.SpanKVLookup: 1, "upstream": 1}
	for name, n := range want {
		if len(byName[name]) != n {
			t.Errorf("%d %q spans, want %d (trace: %v)", len(byName[name]), name, n, names(spans))
		}
	}
	if t.Failed() {
		return
	}
	parentOf := func(s *tracepb.Span) string {
		if p := byID[hex.EncodeToString(s.GetParentSpanId())]; p != nil {
			return p.GetName()
		}
		return hex.EncodeToString(s.GetParentSpanId())
	}
	for _, s := range byName["kvroute.proxy /v1/chat/completions"] {
		if parentOf(s) != clientSpanID || s.GetKind() != tracepb.Span_SPAN_KIND_SERVER {
			t.Errorf("server span: parent %s kind %v, want the client's span %s, server", parentOf(s), s.GetKind(), clientSpanID)
		}
	}
	up := byName["upstream"][0]
	if hex.EncodeToString(up.GetSpanId()) != parentID {
		t.Errorf("backend's parent span %s is not the upstream span %x", parentID, up.GetSpanId())
	}
	if up.GetKind() != tracepb.Span_SPAN_KIND_CLIENT || !hasAttr(up, telemetry.AttrBackend, "a") {
		t.Errorf("upstream span: kind %v attributes %v", up.GetKind(), up.GetAttributes())
	}
	for child, parent := range map[string]string{telemetry.SpanResponseCacheLookup: "kvroute.proxy /v1/chat/completions",
		telemetry.SpanRoute: "kvroute.proxy /v1/chat/completions", "upstream": "kvroute.proxy /v1/chat/completions",
		telemetry.SpanTokenize: telemetry.SpanRoute, telemetry.SpanKVLookup: telemetry.SpanRoute} {
		if got := parentOf(byName[child][0]); got != parent {
			t.Errorf("%s's parent is %s, want %s", child, got, parent)
		}
	}
	if route := byName[telemetry.SpanRoute][0]; !hasAttr(route, telemetry.AttrBackend, "a") || !hasAttr(route, telemetry.AttrReason, "") {
		t.Errorf("route span attributes %v", route.GetAttributes())
	}
}

// TestTracingUpstreamFailure: an attempt whose backend cannot be reached ends its upstream span
// with status Error, and the proxy's answer (502) is still traced.
func TestTracingUpstreamFailure(t *testing.T) {
	col := newOTLPCollector(t)
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: deadURL(t)}}, func(c *config.Config) {
		c.Tracing = config.TracingConfig{Enabled: true, Endpoint: col.URL + "/v1/traces"}
	}))
	if resp, b := post(t, p.URL+"/v1/chat/completions", chatBody("s", "u", ""), "Traceparent", clientTraceparent); resp.StatusCode != http.StatusBadGateway {
		t.Fatalf("%d %s, want 502", resp.StatusCode, b)
	}
	if err := p.server.Close(); err != nil {
		t.Fatal(err)
	}
	var up *tracepb.Span
	for _, s := range col.trace(clientTraceID) {
		if s.GetName() == "upstream" {
			up = s
		}
	}
	if up == nil {
		t.Fatalf("no upstream span in %v", names(col.trace(clientTraceID)))
	}
	if up.GetStatus().GetCode() != tracepb.Status_STATUS_CODE_ERROR || up.GetStatus().GetMessage() == "" {
		t.Errorf("upstream span status %v, want an error", up.GetStatus())
	}
	for _, kv := range up.GetAttributes() {
		if kv.GetKey() == "http.response.status_code" {
			t.Errorf("upstream span has a status code (%v) without a response", kv.GetValue())
		}
	}
}

// TestTracingOffPassesTraceparent: with tracing off (the default) the proxy records nothing and
// relays the client's traceparent untouched.
func TestTracingOffPassesTraceparent(t *testing.T) {
	be := newTraceparentBackend(t)
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: be.URL}}, nil))
	if p.tracer != nil {
		t.Fatal("tracing on by default")
	}
	if resp, b := post(t, p.URL+"/v1/chat/completions", chatBody("s", "u", ""), "Traceparent", clientTraceparent); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if got := be.received(); len(got) != 1 || got[0] != clientTraceparent {
		t.Fatalf("backend received traceparent %q, want the client's %q", got, clientTraceparent)
	}
}

func names(spans []*tracepb.Span) []string {
	out := make([]string, len(spans))
	for i, s := range spans {
		out[i] = s.GetName()
	}
	return out
}

// hasAttr reports whether s has the string attribute key, with value want unless want is "".
func hasAttr(s *tracepb.Span, key, want string) bool {
	for _, kv := range s.GetAttributes() {
		if kv.GetKey() == key {
			return want == "" || kv.GetValue().GetStringValue() == want
		}
	}
	return false
}

// TestTracingDisaggPrefill: a disaggregated request's prefill call is a client span of its own,
// child of the proxy's server span, and its trace context reaches the prefill engine; the
// Router's kvroute.route span (the plan: reason, path, both backends) and its KV index lookup are
// there as for a unified request.
func TestTracingDisaggPrefill(t *testing.T) {
	col := newOTLPCollector(t)
	f := startPDFleet(t, 1, 1, 0, nil)
	p := startProxy(t, pdConfig(t, f, func(c *config.Config) {
		c.Tracing = config.TracingConfig{Enabled: true, Endpoint: col.URL + "/v1/traces"}
	}))
	resp, b := post(t, p.URL+"/v1/chat/completions", longPrompt("traced", 1200, `"max_tokens":4`), "Traceparent", clientTraceparent)
	if r := readPD(resp, b); r.status != 200 || r.path != "prefill_then_decode" {
		t.Fatalf("%v: %s", r, r.body)
	}
	if err := p.server.Close(); err != nil { // flushes the spans
		t.Fatal(err)
	}
	spans := col.trace(clientTraceID)
	var server, prefill, route, lookup *tracepb.Span
	for _, s := range spans {
		switch s.GetName() {
		case "kvroute.proxy /v1/chat/completions":
			server = s
		case "prefill":
			prefill = s
		case telemetry.SpanRoute:
			route = s
		case telemetry.SpanKVLookup:
			lookup = s
		}
	}
	if route == nil || lookup == nil {
		t.Fatalf("spans %v: want %s and %s", names(spans), telemetry.SpanRoute, telemetry.SpanKVLookup)
	}
	if !hasAttr(route, telemetry.AttrReason, "cache_miss") || !hasAttr(route, telemetry.AttrRoutingPath, "prefill_then_decode") ||
		!hasAttr(route, telemetry.AttrPrefillBackend, f.prefill[0]) || !hasAttr(route, telemetry.AttrBackend, f.decode[0]) ||
		!bytes.Equal(lookup.GetParentSpanId(), route.GetSpanId()) {
		t.Errorf("route span %v, lookup's parent %x (route %x)", route.GetAttributes(), lookup.GetParentSpanId(), route.GetSpanId())
	}
	if server == nil || prefill == nil {
		t.Fatalf("spans %v: want the server span and a prefill span", names(spans))
	}
	if !bytes.Equal(prefill.GetParentSpanId(), server.GetSpanId()) || prefill.GetKind() != tracepb.Span_SPAN_KIND_CLIENT ||
		!hasAttr(prefill, telemetry.AttrBackend, f.prefill[0]) {
		t.Errorf("prefill span: parent %x (server %x), kind %v, attributes %v", prefill.GetParentSpanId(), server.GetSpanId(),
			prefill.GetKind(), prefill.GetAttributes())
	}
}
