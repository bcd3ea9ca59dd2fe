package extproc_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/integrations/extproc"
	"github.com/kvroute/kvroute/integrations/extproc/envoysim"
	"github.com/kvroute/kvroute/prefixkey"
)

// This file is the harness the protocol tests share: a Router that records what the picker tells
// it, fake engines for the paths simulated engines do not take (failures, slow streams), the
// picker on a real gRPC server, and envoysim in front of it, as Envoy would be.

// rec is what the picker told the Router of one decision.
type rec struct {
	backend string
	done    atomic.Int32
	first   atomic.Int32
	mu      sync.Mutex
	outcome kvroute.Outcome
}

func (r *rec) Outcome() kvroute.Outcome {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.outcome
}

// recRouter wraps a Router and records every decision's Done and FirstToken. fail, when set, is
// Route's error instead.
type recRouter struct {
	inner kvroute.Router
	mu    sync.Mutex
	recs  []*rec
	fail  atomic.Pointer[error]
}

func (r *recRouter) Route(ctx context.Context, req *prefixkey.Request) (*kvroute.Decision, error) {
	if e := r.fail.Load(); e != nil {
		return nil, *e
	}
	d, err := r.inner.Route(ctx, req)
	if err != nil {
		return nil, err
	}
	rc := &rec{backend: d.Backend}
	r.mu.Lock()
	r.recs = append(r.recs, rc)
	r.mu.Unlock()
	return kvroute.WrapDecision(d, &kvroute.DecisionHooks{
		Done: func(o kvroute.Outcome) {
			rc.mu.Lock()
			rc.outcome = o
			rc.mu.Unlock()
			rc.done.Add(1)
		},
		FirstToken: func() { rc.first.Add(1) },
	}), nil
}

func (r *recRouter) all() []*rec {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*rec(nil), r.recs...)
}

// waitAllDone waits until every decision made has had its Done, and fails when one had it twice
// or never within five seconds.
func (r *recRouter) waitAllDone(t *testing.T) []*rec {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		recs, open := r.all(), 0
		for _, rc := range recs {
			if n := rc.done.Load(); n > 1 {
				t.Fatalf("decision on %s: Done ran %d times", rc.backend, n)
			} else if n == 0 {
				open++
			}
		}
		if open == 0 {
			return recs
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d decisions never had their Done", open, len(recs))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// fakeEngine is an OpenAI-compatible upstream whose answer the request's model chooses:
// "fail" answers 500, "full" 429, "slow" streams an event every 20 ms for two seconds, anything
// else answers at once (a stream when asked) with usage.prompt_tokens_details.cached_tokens 7.
type fakeEngine struct {
	*httptest.Server
	name   string
	served atomic.Int32
}

func startFakeEngine(t *testing.T, name string) *fakeEngine {
	t.Helper()
	e := &fakeEngine{name: name}
	e.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.served.Add(1)
		var body struct {
			Model  string `json:"model"`
			Stream bool   `json:"stream"`
		}
		raw, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(raw, &body)
		w.Header().Set("X-Engine", name)
		w.Header().Set("X-Body-Bytes", fmt.Sprint(len(raw)))
		switch {
		case body.Model == "fail":
			http.Error(w, `{"error":{"message":"engine failure"}}`, http.StatusInternalServerError)
		case body.Model == "full":
			http.Error(w, `{"error":{"message":"no KV blocks free"}}`, http.StatusTooManyRequests)
		case body.Stream || body.Model == "slow":
			w.Header().Set("Content-Type", "text/event-stream")
			n, gap := 3, time.Duration(0)
			if body.Model == "slow" {
				n, gap = 100, 20*time.Millisecond
			}
			for i := range n {
				fmt.Fprintf(w, "data: {\"choices\":[{\"delta\":{\"content\":\"tok%d \"}}]}\n\n", i)
				http.NewResponseController(w).Flush()
				select {
				case <-r.Context().Done():
					return
				case <-time.After(gap):
				}
			}
			fmt.Fprint(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":7}}}\n\ndata: [DONE]\n\n")
		default:
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"id":"x","object":"chat.completion","choices":[{"message":{"role":"assistant","content":"hi from %s"}}],"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":7}}}`, name)
		}
	}))
	t.Cleanup(e.Close)
	return e
}

// endpoint is the engine's host:port.
func (e *fakeEngine) endpoint() string { return strings.TrimPrefix(e.URL, "http://") }

// harness is the picker on a real gRPC server over loopback, with a client.
type harness struct {
	t       *testing.T
	router  *recRouter
	eps     *extproc.Endpoints
	srv     *extproc.Server
	grpc    *grpc.Server
	addr    string
	conn    *grpc.ClientConn
	client  extprocv3.ExternalProcessorClient
	serveWG sync.WaitGroup
}

// newHarness serves an extproc.Server for cfg (its Router wrapped in a recRouter) on 127.0.0.1.
func newHarness(t *testing.T, cfg extproc.Config) *harness {
	t.Helper()
	h := &harness{t: t, router: &recRouter{inner: cfg.Router}, eps: cfg.Endpoints}
	cfg.Router = h.router
	srv, err := extproc.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h.srv = srv
	t.Cleanup(func() { _ = srv.Close() })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h.addr = ln.Addr().String()
	h.serve(ln)
	h.conn, err = grpc.NewClient(h.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.conn.Close() })
	h.client = extprocv3.NewExternalProcessorClient(h.conn)
	return h
}

// serve starts a gRPC server for the picker on ln.
func (h *harness) serve(ln net.Listener) {
	h.grpc = grpc.NewServer(grpc.MaxRecvMsgSize(16 << 20))
	extprocv3.RegisterExternalProcessorServer(h.grpc, h.srv)
	g := h.grpc
	h.serveWG.Add(1)
	go func() { defer h.serveWG.Done(); _ = g.Serve(ln) }()
	h.t.Cleanup(g.Stop)
}

// restart stops the picker's gRPC server, cutting its streams, and serves it again on the same
// address: an EPP restart as Envoy sees it.
func (h *harness) restart() {
	h.t.Helper()
	h.grpc.Stop()
	h.serveWG.Wait()
	var ln net.Listener
	var err error
	for range 50 {
		if ln, err = net.Listen("tcp", h.addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		h.t.Fatalf("listening again on %s: %v", h.addr, err)
	}
	h.serve(ln)
}

// gateway returns envoysim in front of the picker, as an httptest server.
func (h *harness) gateway(cfg envoysim.Config) *httptest.Server {
	h.t.Helper()
	cfg.Client = h.client
	fw, err := envoysim.New(cfg)
	if err != nil {
		h.t.Fatal(err)
	}
	gw := httptest.NewServer(fw)
	h.t.Cleanup(gw.Close)
	return gw
}

// staticPool is n fake engines behind a tier-1 Router.
func staticPool(t *testing.T, n int) ([]*fakeEngine, *kvroute.DefaultRouter, *extproc.Endpoints) {
	t.Helper()
	eps := extproc.NewEndpoints()
	var backends []kvroute.Backend
	var engines []*fakeEngine
	for i := range n {
		e := startFakeEngine(t, fmt.Sprintf("engine-%d", i))
		engines = append(engines, e)
		backends = append(backends, kvroute.Backend{Name: e.name})
		if err := eps.Set(e.name, e.endpoint()); err != nil {
			t.Fatal(err)
		}
	}
	// Refusals release their slot at once: the tests count slots left in flight.
	r, err := kvroute.New(kvroute.Config{Backends: backends, RefusalHold: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return engines, r, eps
}

// post sends a chat request through the gateway and returns the answer, read whole.
func post(t *testing.T, url, body string) (*http.Response, string) {
	t.Helper()
	res, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		t.Fatal(err)
	}
	return res, string(b)
}

// chat is a chat request body.
func chat(model, system, user string, stream bool) string {
	b, _ := json.Marshal(map[string]any{"model": model, "stream": stream, "max_tokens": 8,
		"messages": []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": user}}})
	return string(b)
}

// rawStream is an ext_proc stream driven message by message, as Envoy drives it.
type rawStream struct {
	t *testing.T
	s extprocv3.ExternalProcessor_ProcessClient
}

func (h *harness) open(ctx context.Context) *rawStream {
	h.t.Helper()
	s, err := h.client.Process(ctx)
	if err != nil {
		h.t.Fatal(err)
	}
	return &rawStream{t: h.t, s: s}
}

// headers sends the request headers for a POST to path, in the given request body mode (full
// duplex responses), with a subset hint when subset is not nil.
func (r *rawStream) headers(path string, eos bool, mode filterv3.ProcessingMode_BodySendMode, subset []string) {
	r.t.Helper()
	msg := &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
				{Key: ":method", RawValue: []byte("POST")}, {Key: ":path", RawValue: []byte(path)},
				{Key: "content-type", RawValue: []byte("application/json")}}},
			EndOfStream: eos}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: mode,
			ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED},
	}
	if subset != nil {
		list := make([]any, len(subset))
		for i, s := range subset {
			list[i] = s
		}
		st, err := structpb.NewStruct(map[string]any{extproc.KeySubset: list})
		if err != nil {
			r.t.Fatal(err)
		}
		msg.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{extproc.DefaultSubsetNamespace: st}}
	}
	r.send(msg)
}

func (r *rawStream) body(b string, eos bool) {
	r.t.Helper()
	r.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: []byte(b), EndOfStream: eos}}})
}

func (r *rawStream) responseHeaders(status int, served string) {
	r.t.Helper()
	msg := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
			{Key: ":status", RawValue: []byte(fmt.Sprint(status))}}}}}}
	if served != "" {
		st, _ := structpb.NewStruct(map[string]any{extproc.KeyServed: served})
		msg.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{extproc.DefaultDestinationNamespace: st}}
	}
	r.send(msg)
}

func (r *rawStream) responseBody(b string, eos bool) {
	r.t.Helper()
	r.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: []byte(b), EndOfStream: eos}}})
}

func (r *rawStream) send(m *extprocv3.ProcessingRequest) {
	r.t.Helper()
	if err := r.s.Send(m); err != nil {
		r.t.Fatalf("send: %v", err)
	}
}

func (r *rawStream) recv() *extprocv3.ProcessingResponse {
	r.t.Helper()
	m, err := r.s.Recv()
	if err != nil {
		r.t.Fatalf("recv: %v", err)
	}
	return m
}

// destination returns the picked endpoints of a response: its header mutation's and its dynamic
// metadata's, which must agree.
func destination(t *testing.T, m *extprocv3.ProcessingResponse) string {
	t.Helper()
	var common *extprocv3.CommonResponse
	switch {
	case m.GetRequestHeaders() != nil:
		common = m.GetRequestHeaders().GetResponse()
	case m.GetRequestBody() != nil:
		common = m.GetRequestBody().GetResponse()
	default:
		t.Fatalf("no request answer: %v", m)
	}
	var header string
	for _, o := range common.GetHeaderMutation().GetSetHeaders() {
		if o.GetHeader().GetKey() == extproc.HeaderDestination {
			header = string(o.GetHeader().GetRawValue())
		}
	}
	md := m.GetDynamicMetadata().GetFields()[extproc.DefaultDestinationNamespace].GetStructValue().GetFields()[extproc.HeaderDestination].GetStringValue()
	if header == "" || header != md {
		t.Fatalf("destination header %q and envoy.lb metadata %q must be set and agree", header, md)
	}
	return header
}

// sendAll sends a full-duplex request's headers and body, without failing the test (for
// goroutines).
func sendAll(r *rawStream, body string) error {
	msgs := []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
				{Key: ":method", RawValue: []byte("POST")}, {Key: ":path", RawValue: []byte("/v1/chat/completions")}}}}},
			ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
				ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED}},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte(body), EndOfStream: true}}},
	}
	for _, m := range msgs {
		if err := r.s.Send(m); err != nil {
			return err
		}
	}
	return nil
}

// responseMessages are a 200 answer's headers and whole body, as Envoy sends them.
func responseMessages() []*extprocv3.ProcessingRequest {
	return []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte("200")}}}}}},
		{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{
			Body: []byte(`{"usage":{"prompt_tokens_details":{"cached_tokens":0}}}`), EndOfStream: true}}},
	}
}
