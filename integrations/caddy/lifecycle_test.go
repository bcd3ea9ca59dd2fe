package kvroutecaddy

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/prefixkey"
)

// recRouter is the entry's Router with every decision's lifecycle written down, in routing order.
type recRouter struct {
	routerAPI
	mu   sync.Mutex
	decs []*decRec
}

// decRec is one decision's lifecycle.
type decRec struct {
	backend string
	first   bool   // FirstToken ran
	first2  bool   // FirstToken ran after Done
	outcome string // "" until Done: ok, err, refused or notsent
}

// summary is "backend outcome", with "first" before the outcome when FirstToken ran.
func (d *decRec) summary() string {
	s := d.backend
	if d.first {
		s += " first"
	}
	if d.first2 {
		s += " first-after-done"
	}
	if d.outcome == "" {
		return s + " open"
	}
	return s + " " + d.outcome
}

func (r *recRouter) Route(ctx context.Context, req *prefixkey.Request) (*kvroute.Decision, error) {
	d, err := r.routerAPI.Route(ctx, req)
	if err != nil {
		return nil, err
	}
	rec := &decRec{backend: d.Backend}
	r.mu.Lock()
	r.decs = append(r.decs, rec)
	r.mu.Unlock()
	return kvroute.WrapDecision(d, &kvroute.DecisionHooks{
		FirstToken: func() {
			r.mu.Lock()
			defer r.mu.Unlock()
			if rec.outcome != "" {
				rec.first2 = true
			}
			rec.first = true
		},
		Done: func(o kvroute.Outcome) {
			r.mu.Lock()
			defer r.mu.Unlock()
			rec.outcome = describe(o)
		},
	}), nil
}

// events returns each decision's summary, in routing order.
func (r *recRouter) events() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]string, len(r.decs))
	for i, d := range r.decs {
		out[i] = d.summary()
	}
	return out
}

func describe(o kvroute.Outcome) string {
	switch {
	case o.NotSent:
		return "notsent"
	case o.Refused:
		return "refused"
	case o.Err != nil:
		return "err"
	}
	return "ok"
}

// testBackends are the upstreams of the tests that run no server.
var testBackends = []string{"127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"}

// newTestHandler returns a provisioned handler over testBackends (or h's own backends) whose
// Router records its decisions, and the policy with a first-available fallback.
func newTestHandler(t testing.TB, h *Handler) (*Handler, *recRouter, *Policy) {
	t.Helper()
	if h == nil {
		h = &Handler{}
	}
	if len(h.Backends) == 0 {
		for _, b := range testBackends {
			h.Backends = append(h.Backends, Backend{Address: b})
		}
	}
	key, err := h.poolKey()
	if err != nil {
		t.Fatal(err)
	}
	e, err := newEntry(h, key, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Destruct() })
	rec := &recRouter{routerAPI: e.router}
	e.router = rec
	h.entry, h.maxBody, h.logger = e, 1<<20, zap.NewNop()
	return h, rec, &Policy{fallback: reverseproxy.FirstSelection{}}
}

// testPool returns upstreams for names, as reverse_proxy provisions them.
func testPool(names ...string) reverseproxy.UpstreamPool {
	pool := make(reverseproxy.UpstreamPool, len(names))
	for i, n := range names {
		pool[i] = &reverseproxy.Upstream{Dial: n, Host: new(reverseproxy.Host)}
	}
	return pool
}

// attemptFunc is one attempt of the fake reverse_proxy on u (the i-th, from 0): it answers
// through w, and returns retry true to have the proxy ask the policy again, as Caddy's retry
// loop does after a transport error or an lb_retry_match.
type attemptFunc func(i int, u *reverseproxy.Upstream, w http.ResponseWriter, r *http.Request) (err error, retry bool)

// fakeProxy is reverse_proxy's loop, as far as the policy and the writer see it.
func fakeProxy(pool reverseproxy.UpstreamPool, p *Policy, attempt attemptFunc) caddyhttp.Handler {
	return caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		for i := 0; ; i++ {
			u := p.Select(pool, r, w)
			if u == nil {
				return caddyhttp.Error(http.StatusServiceUnavailable, errors.New("no upstreams available"))
			}
			err, retry := attempt(i, u, w, r)
			if !retry {
				return err
			}
		}
	})
}

// caddyRequest is a request with the context values Caddy's server gives every request.
func caddyRequest(ctx context.Context, path, body string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
	ctx = context.WithValue(ctx, caddy.ReplacerCtxKey, caddy.NewReplacer())
	ctx = context.WithValue(ctx, caddyhttp.VarsCtxKey, map[string]any{})
	return r.WithContext(ctx)
}

const chatBody = `{"model":"m","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"hi"}]}`

// answer writes a JSON answer with status code.
func answer(code int) attemptFunc {
	return func(_ int, _ *reverseproxy.Upstream, w http.ResponseWriter, r *http.Request) (error, bool) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		_, _ = w.Write([]byte(`{"ok":true}`))
		return nil, false
	}
}

func TestLifecycle(t *testing.T) {
	errDial := errors.New("dial tcp: connection refused")
	for _, tc := range []struct {
		name    string
		attempt attemptFunc
		// want is the decisions' lifecycle, with B for the first decision's backend and C for
		// the second's.
		want []string
	}{
		{name: "200 is a success with its first token", attempt: answer(200),
			want: []string{"B first ok"}},
		{name: "400 is the client's: a success, no first token", attempt: answer(400),
			want: []string{"B ok"}},
		{name: "500 is a failure", attempt: answer(500),
			want: []string{"B err"}},
		{name: "502 from the engine is a failure", attempt: answer(502),
			want: []string{"B err"}},
		{name: "429 is a refusal", attempt: answer(429),
			want: []string{"B refused"}},
		{name: "503 is a refusal", attempt: answer(503),
			want: []string{"B refused"}},
		{name: "transport error is a failure",
			attempt: func(int, *reverseproxy.Upstream, http.ResponseWriter, *http.Request) (error, bool) {
				return caddyhttp.Error(http.StatusBadGateway, errDial), false
			},
			want: []string{"B err"}},
		{name: "client gone before the answer is not sent (Caddy writes 499)",
			attempt: func(_ int, _ *reverseproxy.Upstream, w http.ResponseWriter, _ *http.Request) (error, bool) {
				w.WriteHeader(499)
				return nil, false
			},
			want: []string{"B notsent"}},
		// The retry asks the Router with the failed backend avoided (kvroute.WithAvoid): no
		// decision lands on it again to be held and released unsent.
		{name: "retry after a transport error ends the first decision and routes again, avoiding it",
			attempt: func(i int, u *reverseproxy.Upstream, w http.ResponseWriter, r *http.Request) (error, bool) {
				if i == 0 {
					return errDial, true
				}
				return answer(200)(i, u, w, r)
			},
			want: []string{"B err", "C first ok"}},
		{name: "retry of a 503 (lb_retry_match) ends the first decision as refused",
			attempt: func(i int, u *reverseproxy.Upstream, w http.ResponseWriter, r *http.Request) (error, bool) {
				if i == 0 {
					repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
					repl.Set(statusPlaceholder, 503)
					return errors.New("upstream response matched retry_match (status 503)"), true
				}
				return answer(200)(i, u, w, r)
			},
			want: []string{"B refused", "C first ok"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, rec, p := newTestHandler(t, nil)
			pool := testPool(testBackends...)
			w := httptest.NewRecorder()
			err := h.ServeHTTP(w, caddyRequest(t.Context(), "/v1/chat/completions", chatBody), fakeProxy(pool, p, tc.attempt))
			got := rec.events()
			want := resolve(tc.want, got)
			if strings.Join(got, "; ") != strings.Join(want, "; ") {
				t.Fatalf("lifecycle:\n got %q\nwant %q", got, want)
			}
			if got := w.Header().Get(HeaderBackend); w.Code != 499 && err == nil && got != lastBackend(rec.events()) {
				t.Errorf("%s = %q, want the backend that answered, %q", HeaderBackend, got, lastBackend(rec.events()))
			}
		})
	}
}

// resolve replaces B and C in want by the first and second distinct backends of got.
func resolve(want, got []string) []string {
	var routed []string
	for _, g := range got {
		if b := strings.Fields(g)[0]; !slices.Contains(routed, b) {
			routed = append(routed, b)
		}
	}
	out := make([]string, len(want))
	for i, w := range want {
		f := strings.Fields(w)
		for j, name := range []string{"B", "C"} {
			if f[0] == name && j < len(routed) {
				f[0] = routed[j]
			}
		}
		out[i] = strings.Join(f, " ")
	}
	return out
}

// lastBackend is the backend of the last decision.
func lastBackend(log []string) string {
	if len(log) == 0 {
		return ""
	}
	return strings.Fields(log[len(log)-1])[0]
}

func TestRetryAvoidsTheFailedUpstreamAndRestoresTheBody(t *testing.T) {
	h, rec, p := newTestHandler(t, nil)
	pool := testPool(testBackends...)
	var bodies []string
	var ups []string
	w := httptest.NewRecorder()
	err := h.ServeHTTP(w, caddyRequest(t.Context(), "/v1/chat/completions", chatBody),
		fakeProxy(pool, p, func(i int, u *reverseproxy.Upstream, w http.ResponseWriter, r *http.Request) (error, bool) {
			b, _ := io.ReadAll(r.Body) // the failed attempt reads the body, as a sent request does
			bodies, ups = append(bodies, string(b)), append(ups, u.Dial)
			if i < 2 {
				return errors.New("connection reset"), true
			}
			return answer(200)(i, u, w, r)
		}))
	if err != nil {
		t.Fatal(err)
	}
	if len(ups) != 3 || ups[0] == ups[1] || ups[1] == ups[2] || ups[0] == ups[2] {
		t.Fatalf("attempts went to %q, want three distinct upstreams", ups)
	}
	for i, b := range bodies {
		if b != chatBody {
			t.Errorf("attempt %d sent body %q, want the request's", i, b)
		}
	}
	if got := w.Header().Get(HeaderRetriedFrom); got != ups[1] {
		t.Errorf("%s = %q, want %q", HeaderRetriedFrom, got, ups[1])
	}
	// Every decision ends once; those the attempts used end with the attempts' outcomes, and the
	// others (held while routing around the failed upstreams) unsent.
	got := rec.events()
	var used []string
	for _, ev := range got {
		if strings.HasSuffix(ev, " open") {
			t.Errorf("decision %q never ended", ev)
		}
		if !strings.HasSuffix(ev, " notsent") {
			used = append(used, ev)
		}
	}
	want := []string{ups[0] + " err", ups[1] + " err", ups[2] + " first ok"}
	if strings.Join(used, "; ") != strings.Join(want, "; ") {
		t.Fatalf("decisions %q: the attempted ones %q, want %q", got, used, want)
	}
}

func TestDecidedUpstreamMissingFromThePoolIsReplaced(t *testing.T) {
	h, rec, p := newTestHandler(t, nil)
	// Find the backend this request is decided to, then offer a pool without it: Caddy holds it
	// down (unavailable upstreams and missing ones take the same path).
	probe := rec.routerAPI.(*kvroute.DefaultRouter)
	req, _ := prefixkey.ParseOpenAIChat([]byte(chatBody))
	pr, err := probe.Probe(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	var others []string
	for _, b := range testBackends {
		if b != pr.Backend {
			others = append(others, b)
		}
	}
	w := httptest.NewRecorder()
	if err := h.ServeHTTP(w, caddyRequest(t.Context(), "/v1/chat/completions", chatBody), fakeProxy(testPool(others...), p, answer(200))); err != nil {
		t.Fatal(err)
	}
	got := rec.events()
	if len(got) < 2 || got[0] != pr.Backend+" notsent" {
		t.Fatalf("lifecycle %q: want the first decision, on %s, released as not sent", got, pr.Backend)
	}
	last := lastBackend(got)
	if last == pr.Backend || got[len(got)-1] != last+" first ok" {
		t.Fatalf("lifecycle %q: want a second decision on an upstream of the pool, ended ok", got)
	}
	if w.Header().Get(HeaderBackend) != last {
		t.Errorf("%s = %q, want %q", HeaderBackend, w.Header().Get(HeaderBackend), last)
	}
}

func TestFallbackPolicyWhenNoDecisionFits(t *testing.T) {
	h, rec, p := newTestHandler(t, nil)
	w := httptest.NewRecorder()
	// A reverse_proxy whose upstream is no kvroute backend: no decision can name it.
	if err := h.ServeHTTP(w, caddyRequest(t.Context(), "/v1/chat/completions", chatBody),
		fakeProxy(testPool("127.0.0.1:9999"), p, answer(200))); err != nil {
		t.Fatal(err)
	}
	if got := w.Header().Get(HeaderRoute); got != RouteFallbackPolicy {
		t.Errorf("%s = %q, want %q", HeaderRoute, got, RouteFallbackPolicy)
	}
	// One decision, released unsent at once: the policy does not route around a pool it cannot
	// match.
	if got := rec.events(); len(got) != 1 || !strings.HasSuffix(got[0], " notsent") || strings.Contains(got[0], "first") {
		t.Errorf("decisions %q, want one released unsent, without a first token", got)
	}
}

func TestStreamingFirstTokenAndFlush(t *testing.T) {
	h, rec, p := newTestHandler(t, nil)
	w := httptest.NewRecorder()
	firstAt := 0 // 1 when FirstToken had run once the first chunk was written
	err := h.ServeHTTP(w, caddyRequest(t.Context(), "/v1/chat/completions", chatBody),
		fakeProxy(testPool(testBackends...), p, func(_ int, _ *reverseproxy.Upstream, w http.ResponseWriter, _ *http.Request) (error, bool) {
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(200)
			if err := http.NewResponseController(w).Flush(); err != nil {
				t.Errorf("flush through the wrapper: %v", err)
			}
			if ev := rec.events(); len(ev) != 1 || strings.Contains(ev[0], "first") {
				t.Errorf("decisions before the first byte: %q, want one without a first token", ev)
			}
			for i, chunk := range []string{"data: {\"a\":1}\n\n", "data: {\"a\":2}\n\n", "data: [DONE]\n\n"} {
				_, _ = w.Write([]byte(chunk))
				w.(http.Flusher).Flush()
				if i == 0 && strings.Contains(rec.events()[0], "first") {
					firstAt = 1
				}
			}
			return nil, false
		}))
	if err != nil {
		t.Fatal(err)
	}
	if !w.Flushed {
		t.Error("the stream was not flushed through to the client")
	}
	got := rec.events()
	b := lastBackend(got)
	want := []string{b + " first ok"}
	if strings.Join(got, "; ") != strings.Join(want, "; ") || firstAt != 1 {
		t.Fatalf("lifecycle %q (first token after %d events), want %q with the first token at the first chunk", got, firstAt, want)
	}
	if !strings.Contains(w.Body.String(), "[DONE]") {
		t.Errorf("body %q", w.Body.String())
	}
}

func TestAnswerBrokeOff(t *testing.T) {
	for _, tc := range []struct {
		name       string
		clientGone bool
		want       string
	}{
		{"upstream died mid-stream: failure", false, "err"},
		{"client left mid-stream: not sent", true, "notsent"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, rec, p := newTestHandler(t, nil)
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			w := httptest.NewRecorder()
			func() {
				defer func() {
					if v := recover(); v != http.ErrAbortHandler {
						t.Errorf("recovered %v, want the proxy's http.ErrAbortHandler passed on", v)
					}
				}()
				_ = h.ServeHTTP(w, caddyRequest(ctx, "/v1/chat/completions", chatBody),
					fakeProxy(testPool(testBackends...), p, func(_ int, _ *reverseproxy.Upstream, w http.ResponseWriter, _ *http.Request) (error, bool) {
						w.WriteHeader(200)
						_, _ = w.Write([]byte("data: {}\n\n"))
						if tc.clientGone {
							cancel()
						}
						panic(http.ErrAbortHandler) // reverse_proxy's way to abort a broken answer
					}))
			}()
			got := rec.events()
			b := lastBackend(got)
			want := []string{b + " first " + tc.want}
			if strings.Join(got, "; ") != strings.Join(want, "; ") {
				t.Fatalf("lifecycle %q, want %q", got, want)
			}
		})
	}
}

func TestNoPolicyReleasesTheDecision(t *testing.T) {
	h, rec, _ := newTestHandler(t, nil)
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
		w.WriteHeader(200) // a reverse_proxy with another lb_policy
		return nil
	})
	if err := h.ServeHTTP(httptest.NewRecorder(), caddyRequest(t.Context(), "/v1/chat/completions", chatBody), next); err != nil {
		t.Fatal(err)
	}
	got := rec.events()
	if len(got) != 1 || !strings.HasSuffix(got[0], " notsent") {
		t.Fatalf("lifecycle %q, want the decision released unsent", got)
	}
}

func TestPolicyWithoutDecisionFallsBack(t *testing.T) {
	p := &Policy{fallback: reverseproxy.FirstSelection{}}
	pool := testPool(testBackends...)
	r := httptest.NewRequest(http.MethodGet, "/v1/models", nil)
	if u := p.Select(pool, r, httptest.NewRecorder()); u != pool[0] {
		t.Fatalf("Select = %v, want the fallback's choice %v", u, pool[0])
	}
}

func TestHandlerAnswers(t *testing.T) {
	for _, tc := range []struct {
		name, path, body string
		down             bool // every backend unhealthy
		wantCode         int
		wantBody         string // a substring
		wantNext         bool
	}{
		{name: "malformed OpenAI body", path: "/v1/chat/completions", body: `{"model":"m","messages":"x"}`,
			wantCode: 400, wantBody: `"type":"invalid_request_error","param":"messages"`},
		{name: "malformed Anthropic body", path: "/v1/messages", body: `{"model":"m","messages":7,"max_tokens":8}`,
			wantCode: 400, wantBody: `{"type":"error","error":{"type":"invalid_request_error"`},
		{name: "body over the limit", path: "/v1/chat/completions", body: `{"model":"` + strings.Repeat("x", 1<<20) + `"}`,
			wantCode: 413, wantBody: `"code":"request_too_large"`},
		{name: "no healthy backend", path: "/v1/chat/completions", body: chatBody, down: true,
			wantCode: 503, wantBody: `"code":"no_healthy_backend"`},
		{name: "no healthy backend, Anthropic", path: "/v1/messages", body: `{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`, down: true,
			wantCode: 503, wantBody: `"type":"overloaded_error"`},
		{name: "other paths pass through", path: "/v1/models", body: ``, wantCode: 204, wantNext: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, rec, _ := newTestHandler(t, nil)
			if tc.down {
				for _, b := range testBackends {
					_ = rec.SetHealthy(b, false)
				}
			}
			called := false
			next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
				called = true
				w.WriteHeader(204)
				return nil
			})
			w := httptest.NewRecorder()
			if err := h.ServeHTTP(w, caddyRequest(t.Context(), tc.path, tc.body), next); err != nil {
				t.Fatal(err)
			}
			if w.Code != tc.wantCode || !strings.Contains(w.Body.String(), tc.wantBody) || called != tc.wantNext {
				t.Fatalf("answer %d %s (next called: %v), want %d with %s (next called: %v)",
					w.Code, w.Body.String(), called, tc.wantCode, tc.wantBody, tc.wantNext)
			}
			if !tc.wantNext && tc.wantCode != 503 && len(rec.events()) != 0 {
				t.Errorf("routed: %q", rec.events())
			}
		})
	}
}

func TestResponseCacheServesTheSecondRequest(t *testing.T) {
	h, rec, p := newTestHandler(t, &Handler{ResponseCache: &ResponseCache{}})
	body := `{"model":"m","temperature":0,"messages":[{"role":"user","content":"hi"}]}`
	calls := 0
	proxy := fakeProxy(testPool(testBackends...), p, func(i int, u *reverseproxy.Upstream, w http.ResponseWriter, r *http.Request) (error, bool) {
		calls++
		return answer(200)(i, u, w, r)
	})
	var caches []string
	for range 2 {
		w := httptest.NewRecorder()
		if err := h.ServeHTTP(w, caddyRequest(t.Context(), "/v1/chat/completions", body), proxy); err != nil {
			t.Fatal(err)
		}
		if w.Code != 200 || w.Body.String() != `{"ok":true}` {
			t.Fatalf("answer %d %q", w.Code, w.Body.String())
		}
		caches = append(caches, w.Header().Get("X-Cache"))
	}
	if calls != 1 || caches[0] != "MISS" || caches[1] != "HIT" {
		t.Fatalf("proxy calls %d, X-Cache %q; want 1 call, MISS then HIT", calls, caches)
	}
	if got := rec.events(); len(got) != 1 || !strings.HasSuffix(got[0], " first ok") {
		t.Fatalf("lifecycle %q: want one decision, for the miss", got)
	}
}

func TestDialAddress(t *testing.T) {
	for _, tc := range []struct{ in, want, err string }{
		{in: "10.0.0.1:8000", want: "10.0.0.1:8000"},
		{in: "vllm-1:8000", want: "vllm-1:8000"},
		{in: "http://vllm-1:8000", want: "vllm-1:8000"},
		{in: "http://vllm-1", want: "vllm-1:80"},
		{in: "https://vllm-1", want: "vllm-1:443"},
		{in: "http://[::1]:8000/", want: "[::1]:8000"},
		{in: "vllm-1", err: "want host:port"},
		{in: "http://vllm-1:8000/v1", err: "no path"},
		{in: "ftp://vllm-1", err: "want http or https"},
		{in: "", err: "empty"},
	} {
		got, err := DialAddress(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("DialAddress(%q) = %q, %v; want an error containing %q", tc.in, got, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("DialAddress(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
}

func TestConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		h    Handler
		want string
	}{
		{"no backends", Handler{}, "no backends"},
		{"twice", Handler{Backends: []Backend{{Address: "a:1"}, {Address: "http://a:1"}}}, "listed twice"},
		{"bad strategy", Handler{Backends: []Backend{{Address: "a:1"}}, SelectionStrategy: "fastest"}, "selection_strategy"},
		{"tokenizer without tier 4", Handler{Backends: []Backend{{Address: "a:1"}}, Tokenizer: &Tokenizer{Mode: "estimate"}}, "tokenizer"},
		{"replay without endpoint", Handler{Backends: []Backend{{Address: "a:1", ZMQReplayEndpoint: "tcp://a:2"}}}, "zmq_replay_endpoint"},
		{"bad overlap", Handler{Backends: []Backend{{Address: "a:1"}}, KVIndex: &KVIndex{MinOverlapThreshold: 2}}, "min_overlap_threshold"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tc.h.config()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("config() error %v, want one naming %q", err, tc.want)
			}
		})
	}
}

func TestPoolKeepsTheRouterAcrossProvisions(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: t.Context()})
	defer cancel()
	provision := func(h *Handler) *Handler {
		t.Helper()
		if err := h.Provision(ctx); err != nil {
			t.Fatal(err)
		}
		return h
	}
	cfg := func() *Handler {
		return &Handler{Backends: []Backend{{Address: "127.0.0.1:9101"}, {Address: "127.0.0.1:9102"}}}
	}
	a := provision(cfg())
	b := provision(cfg()) // a reload with the same configuration
	if a.entry != b.entry {
		t.Fatal("the same configuration built a second Router")
	}
	other := cfg()
	other.SelectionStrategy = "random"
	c := provision(other)
	if c.entry == a.entry {
		t.Fatal("another configuration shared the Router")
	}
	key := a.key
	if err := a.Cleanup(); err != nil { // the old configuration's cleanup, after the reload
		t.Fatal(err)
	}
	if n, ok := routers.References(key); !ok || n != 1 {
		t.Fatalf("after the old handler's cleanup: %d references (present %v), want 1", n, ok)
	}
	if err := b.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if _, ok := routers.References(key); ok {
		t.Fatal("the Router outlived its last handler")
	}
	if err := c.Cleanup(); err != nil {
		t.Fatal(err)
	}
}

func TestStatsEndpoint(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: t.Context()})
	defer cancel()
	h := &Handler{Backends: []Backend{{Address: "127.0.0.1:9201"}}, KVIndex: &KVIndex{}}
	if err := h.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = h.Cleanup() }()
	w := httptest.NewRecorder()
	if err := serveStats(w, httptest.NewRequest(http.MethodGet, "/kvroute/stats", nil)); err != nil {
		t.Fatal(err)
	}
	var body StatsBody
	if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
		t.Fatal(err)
	}
	var found *RouterStats
	for i := range body.Routers {
		if body.Routers[i].ID == h.entry.id {
			found = &body.Routers[i]
		}
	}
	if found == nil || len(found.Backends) != 1 || found.Backends[0] != "127.0.0.1:9201" || found.KVIndex == nil {
		t.Fatalf("stats %s: want the router %s with its backend and its KV index", w.Body.String(), h.entry.id)
	}
}

func TestEngineTokenizerAsksTheNextBackendWhenOneFails(t *testing.T) {
	var asked []string
	var mu sync.Mutex
	server := func(name string, code int) string {
		s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			asked = append(asked, name)
			mu.Unlock()
			w.WriteHeader(code)
			_, _ = w.Write([]byte(`{"count":3,"max_model_len":8192,"tokens":[1,2,3]}`))
		}))
		t.Cleanup(s.Close)
		return s.URL
	}
	h := &Handler{Backends: []Backend{
		{Address: "127.0.0.1:9301", URL: server("full", http.StatusServiceUnavailable)},
		{Address: "127.0.0.1:9302", URL: server("ok", http.StatusOK)},
	}, KVIndex: &KVIndex{}, Tokenizer: &Tokenizer{Mode: "engine"}}
	h, _, _ = newTestHandler(t, h)
	req, _ := prefixkey.ParseOpenAIChat([]byte(chatBody))
	tokens, err := h.entry.tokenizer.Tokenize(t.Context(), req)
	if err != nil || len(tokens) != 3 {
		t.Fatalf("Tokenize = %v, %v; want the second backend's 3 tokens", tokens, err)
	}
	if strings.Join(asked, ",") != "full,ok" {
		t.Fatalf("asked %q, want the first backend, then the next", asked)
	}
	// A backend Caddy holds down is not asked.
	h.entry.backends["127.0.0.1:9301"].healthy.Store(false)
	asked = nil
	req2, _ := prefixkey.ParseOpenAIChat([]byte(strings.Replace(chatBody, "hi", "hello", 1)))
	if _, err := h.entry.tokenizer.Tokenize(t.Context(), req2); err != nil || strings.Join(asked, ",") != "ok" {
		t.Fatalf("asked %q (%v), want only the healthy backend", asked, err)
	}
}
