package kvhttp_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/iotest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/apierror"
	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/kvhttp"
	"github.com/kvroute/kvroute/prefixkey"
)

// decision is what the gateway reported on one Decision of a recorder.
type decision struct {
	backend string
	firsts  int
	dones   []kvroute.Outcome
	done    chan struct{} // closed by the first Done
}

// recorder is a Router of its own: it routes the requests to its backends in turn, with
// Decisions whose hooks record what the gateway reported.
type recorder struct {
	backends []string
	mu       sync.Mutex
	next     int
	ds       []*decision
}

func (rc *recorder) Route(ctx context.Context, _ *prefixkey.Request) (*kvroute.Decision, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	d := &decision{backend: rc.backends[rc.next%len(rc.backends)], done: make(chan struct{})}
	rc.next++
	rc.ds = append(rc.ds, d)
	return kvroute.NewDecision(d.backend, kvroute.ReasonCustom, &kvroute.DecisionHooks{
		FirstToken: func() { rc.mu.Lock(); d.firsts++; rc.mu.Unlock() },
		Done: func(o kvroute.Outcome) {
			rc.mu.Lock()
			defer rc.mu.Unlock()
			if d.dones = append(d.dones, o); len(d.dones) == 1 {
				close(d.done)
			}
		},
	}), nil
}

// decisions waits until every decision made is done, then returns them.
func (rc *recorder) decisions(t *testing.T) []*decision {
	t.Helper()
	rc.mu.Lock()
	ds := append([]*decision(nil), rc.ds...)
	rc.mu.Unlock()
	for _, d := range ds {
		select {
		case <-d.done:
		case <-time.After(5 * time.Second):
			t.Fatalf("the decision on %s was never done", d.backend)
		}
	}
	time.Sleep(20 * time.Millisecond) // a second Done would come now
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return append([]*decision(nil), rc.ds...)
}

// outcome names an Outcome: success, failure, refused or cancelled (NotSent).
func outcome(o kvroute.Outcome) string {
	switch {
	case o.NotSent:
		return "cancelled"
	case o.Refused:
		return "refused"
	case o.Err != nil:
		return "failure"
	}
	return "success"
}

const (
	chatStream = `{"model":"m","stream":true,"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"hi"}]}`
	chatJSON   = `{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"hi"}]}`
	sseAnswer  = "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n" +
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n" +
		"data: [DONE]\n\n"
	jsonAnswer = `{"choices":[{"message":{"content":"Hi"}}],"usage":{"prompt_tokens":40,"prompt_tokens_details": {"cached_tokens" : 16}}}`
)

// sse writes chunk as a flushed text/event-stream write.
func sse(w http.ResponseWriter, chunk string) {
	w.Header().Set("Content-Type", "text/event-stream")
	_, _ = io.WriteString(w, chunk)
	w.(http.Flusher).Flush()
}

// upstream starts a backend serving h and returns its URL.
func upstream(t *testing.T, h http.HandlerFunc) *url.URL {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	u, _ := url.Parse(srv.URL)
	return u
}

// deadURL returns the URL of a port nobody listens on.
func deadURL(t *testing.T) *url.URL {
	t.Helper()
	return &url.URL{Scheme: "http", Host: testenv.RefusedAddr(t)}
}

// gateway serves h and returns its URL; its transport's idle connections close with the test.
func gateway(t *testing.T, h *kvhttp.Handler) string {
	t.Helper()
	if h.Transport == nil {
		tr := &http.Transport{DisableCompression: true}
		t.Cleanup(tr.CloseIdleConnections)
		h.Transport = tr
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv.URL
}

// checkNoLeak fails t when goroutines started during it are still running at its end.
func checkNoLeak(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Cleanup(func() {
		http.DefaultClient.CloseIdleConnections()
		deadline := time.Now().Add(5 * time.Second)
		for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if n := runtime.NumGoroutine(); n > before {
			buf := make([]byte, 1<<20)
			t.Errorf("%d goroutines at the start, %d at the end:\n%s", before, n, buf[:runtime.Stack(buf, true)])
		}
	})
}

// The Handler tells the Router the whole story of each request: FirstToken on the first byte of
// a successful answer, streamed or not, then Done exactly once with the outcome the request had,
// on every path; the answer's cached tokens are read.
func TestLifecycle(t *testing.T) {
	checkNoLeak(t)
	release := make(chan struct{}) // unblocks the backends that wait for the client to leave
	t.Cleanup(func() { close(release) })
	wait := func(r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body) // net/http notices a closed connection once the body is read
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}
	cancelled := make(chan string, 4) // the backends that saw their request cancelled
	ok := func(name string) *url.URL {
		return upstream(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set(kvhttp.HeaderBackend, "spoofed")
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"from":"`+name+`"}`)
		})
	}

	for _, tc := range []struct {
		name     string
		body     string
		path     string
		backends map[string]*url.URL
		order    []string // the Router's choices, in turn
		leave    bool     // the client leaves 200 ms after sending
		status   int      // what the client gets, when it stays
		answer   string   // the body it gets, when set
		outcomes []string // per decision, in order
		firsts   []int    // FirstToken hook runs, per decision
		retried  string   // X-Kvroute-Retried-From
		cached   int      // Result.CachedTokens of the last attempt
		cancel   string   // the backend whose request must be cancelled
	}{
		{name: "SSE success", body: chatStream, backends: map[string]*url.URL{"a": upstream(t, func(w http.ResponseWriter, _ *http.Request) {
			for _, chunk := range strings.SplitAfter(sseAnswer, "\n\n") {
				sse(w, chunk)
			}
		})}, status: 200, answer: sseAnswer, outcomes: []string{"success"}, firsts: []int{1}, cached: 32},
		{name: "JSON success", body: chatJSON, backends: map[string]*url.URL{"a": upstream(t, func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, jsonAnswer)
		})}, status: 200, answer: jsonAnswer, outcomes: []string{"success"}, firsts: []int{1}, cached: 16},
		{name: "Anthropic success", path: "/v1/messages", body: `{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`,
			backends: map[string]*url.URL{"a": upstream(t, func(w http.ResponseWriter, _ *http.Request) {
				w.Header().Set("Content-Type", "application/json")
				_, _ = io.WriteString(w, `{"type":"message","usage":{"input_tokens":3,"cache_read_input_tokens":48,"output_tokens":1}}`)
			})}, status: 200, outcomes: []string{"success"}, firsts: []int{1}, cached: 48},
		{name: "upstream 500", body: chatStream, backends: map[string]*url.URL{"a": upstream(t, func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, `{"error":"boom"}`, http.StatusInternalServerError)
		})}, status: 500, outcomes: []string{"failure"}, firsts: []int{0}, cached: -1},
		{name: "429 alone", body: chatJSON, backends: map[string]*url.URL{"a": upstream(t, func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, `{"error":"busy"}`, http.StatusTooManyRequests)
		})}, status: 429, outcomes: []string{"refused"}, firsts: []int{0}, cached: -1},
		{name: "503 retried", body: chatJSON, order: []string{"full", "b"}, backends: map[string]*url.URL{
			"full": upstream(t, func(w http.ResponseWriter, _ *http.Request) {
				http.Error(w, "KV cache full", http.StatusServiceUnavailable)
			}),
			"b": ok("b")}, status: 200, answer: `{"from":"b"}`, outcomes: []string{"refused", "success"}, firsts: []int{0, 1}, retried: "full", cached: -1},
		{name: "502 retried", body: chatJSON, order: []string{"bad", "b"}, backends: map[string]*url.URL{
			"bad": upstream(t, func(w http.ResponseWriter, _ *http.Request) { http.Error(w, "bad gateway", http.StatusBadGateway) }),
			"b":   ok("b")}, status: 200, answer: `{"from":"b"}`, outcomes: []string{"failure", "success"}, firsts: []int{0, 1}, retried: "bad", cached: -1},
		{name: "connection refused, retried", body: chatStream, order: []string{"dead", "b"},
			backends: map[string]*url.URL{"dead": deadURL(t), "b": ok("b")},
			status:   200, answer: `{"from":"b"}`, outcomes: []string{"failure", "success"}, firsts: []int{0, 1}, retried: "dead", cached: -1},
		{name: "connection refused, both", body: chatJSON, order: []string{"dead", "dead2"},
			backends: map[string]*url.URL{"dead": deadURL(t), "dead2": deadURL(t)},
			status:   502, outcomes: []string{"failure", "failure"}, firsts: []int{0, 0}, retried: "dead", cached: -1},
		{name: "connection refused, alone", body: chatJSON, backends: map[string]*url.URL{"a": deadURL(t)},
			status: 502, outcomes: []string{"failure"}, firsts: []int{0}, cached: -1},
		{name: "backend dies mid-answer", body: chatStream, backends: map[string]*url.URL{"a": upstream(t, func(w http.ResponseWriter, _ *http.Request) {
			sse(w, "data: {}\n\n")
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
		})}, status: 200, outcomes: []string{"failure"}, firsts: []int{1}, cached: -1},
		{name: "client leaves mid-stream", body: chatStream, backends: map[string]*url.URL{"a": upstream(t, func(w http.ResponseWriter, r *http.Request) {
			sse(w, "data: {}\n\n")
			wait(r)
			if r.Context().Err() != nil {
				cancelled <- "a"
			}
		})}, leave: true, outcomes: []string{"cancelled"}, firsts: []int{1}, cancel: "a", cached: -1},
		{name: "client leaves before the answer", body: chatJSON, backends: map[string]*url.URL{"a": upstream(t, func(_ http.ResponseWriter, r *http.Request) {
			wait(r)
			if r.Context().Err() != nil {
				cancelled <- "a"
			}
		})}, leave: true, outcomes: []string{"cancelled"}, firsts: []int{0}, cancel: "a", cached: -1},
		{name: "body too large", body: `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 2048) + `"}]}`,
			backends: map[string]*url.URL{"a": ok("a")}, status: 413},
		{name: "malformed", body: `{"model":"m","messages":"not a list"}`, backends: map[string]*url.URL{"a": ok("a")}, status: 400},
		{name: "no LLM endpoint", path: "/v1/embeddings", body: `{"model":"m","input":"hi"}`, backends: map[string]*url.URL{"a": ok("a")}, status: 404},
	} {
		t.Run(tc.name, func(t *testing.T) {
			order := tc.order
			if order == nil {
				for name := range tc.backends {
					order = append(order, name)
				}
			}
			rc := &recorder{backends: order}
			var mu sync.Mutex
			var results []kvhttp.Result
			h := &kvhttp.Handler{Router: rc, Backends: tc.backends, MaxBodyBytes: 1024,
				Attempt: func(*http.Request, *kvhttp.Target) (func(kvhttp.Result), error) {
					return func(res kvhttp.Result) { mu.Lock(); results = append(results, res); mu.Unlock() }, nil
				}}
			gw := gateway(t, h)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			path := tc.path
			if path == "" {
				path = "/v1/chat/completions"
			}
			req, _ := http.NewRequestWithContext(ctx, "POST", gw+path, strings.NewReader(tc.body))
			if tc.leave {
				time.AfterFunc(200*time.Millisecond, cancel)
			}
			res, err := http.DefaultClient.Do(req)
			switch {
			case err == nil:
				b, _ := io.ReadAll(res.Body)
				res.Body.Close()
				if tc.leave {
					break
				}
				assert.Equal(t, tc.status, res.StatusCode, "%s", b)
				if tc.answer != "" {
					assert.Equal(t, tc.answer, string(b))
				}
				if len(tc.outcomes) > 0 && tc.status != 502 {
					assert.Equal(t, order[len(tc.outcomes)-1], res.Header.Get(kvhttp.HeaderBackend), "the backend that answered")
					assert.Equal(t, "custom", res.Header.Get(kvhttp.HeaderRoute))
				}
				assert.Equal(t, tc.retried, res.Header.Get(kvhttp.HeaderRetriedFrom))
				if tc.status >= 400 && tc.status != 429 && tc.status != 500 {
					var doc map[string]any
					assert.NoError(t, json.Unmarshal(b, &doc), "an API error body: %s", b)
				}
			case !tc.leave:
				t.Fatalf("request failed: %v", err)
			}
			if tc.cancel != "" {
				select {
				case got := <-cancelled:
					assert.Equal(t, tc.cancel, got)
				case <-time.After(5 * time.Second):
					t.Fatal("the upstream request was not cancelled when the client left")
				}
			}
			ds := rc.decisions(t)
			require.Len(t, ds, len(tc.outcomes), "decisions")
			for i, d := range ds {
				require.Len(t, d.dones, 1, "Done exactly once on %s", d.backend)
				assert.Equal(t, tc.outcomes[i], outcome(d.dones[0]), "decision %d on %s: %+v", i, d.backend, d.dones[0])
				assert.Equal(t, tc.firsts[i], d.firsts, "FirstToken on decision %d", i)
			}
			mu.Lock()
			defer mu.Unlock()
			require.Len(t, results, len(tc.outcomes), "one Result per attempt")
			if len(results) > 0 {
				last := results[len(results)-1]
				assert.Equal(t, tc.cached, last.CachedTokens, "cached tokens")
				assert.Equal(t, outcome(last.Outcome), tc.outcomes[len(tc.outcomes)-1])
			}
		})
	}
}

// With kvroute's own Router: requests sharing a system prompt stay on one backend, a dead
// backend is routed around, and every in-flight slot is released, the dead backend's as
// failures.
func TestDefaultRouter(t *testing.T) {
	checkNoLeak(t)
	var served sync.Map // backend -> requests
	backends := map[string]*url.URL{"dead": deadURL(t)}
	cfg := kvroute.Config{Backends: []kvroute.Backend{{Name: "dead"}}}
	for _, name := range []string{"a", "b", "c"} {
		backends[name] = upstream(t, func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			n, _ := served.LoadOrStore(name, new(atomic.Int64))
			n.(*atomic.Int64).Add(1)
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"from":"`+name+`","usage":{"prompt_tokens_details":{"cached_tokens":5}}}`)
		})
		cfg.Backends = append(cfg.Backends, kvroute.Backend{Name: name})
	}
	router, err := kvroute.New(cfg)
	require.NoError(t, err)
	defer router.Close()
	gw := gateway(t, &kvhttp.Handler{Router: router, Backends: backends})

	chat := func(system, user string) string {
		return `{"model":"m","messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"` + user + `"}]}`
	}
	retried := 0
	for i := range 40 {
		sys := fmt.Sprintf("system prompt %d", i%8)
		res, err := http.Post(gw+"/v1/chat/completions", "application/json", strings.NewReader(chat(sys, fmt.Sprint("question ", i))))
		require.NoError(t, err)
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		require.Equal(t, 200, res.StatusCode, "%s", b)
		assert.NotEqual(t, "dead", res.Header.Get(kvhttp.HeaderBackend))
		if res.Header.Get(kvhttp.HeaderRetriedFrom) == "dead" {
			retried++
		}
	}
	assert.Positive(t, retried, "some requests went to the dead backend first")
	// A prefix that found a live backend keeps it.
	first, err := http.Post(gw+"/v1/chat/completions", "application/json", strings.NewReader(chat("sticky", "1")))
	require.NoError(t, err)
	first.Body.Close()
	for i := range 5 {
		res, err := http.Post(gw+"/v1/chat/completions", "application/json", strings.NewReader(chat("sticky", fmt.Sprint(i))))
		require.NoError(t, err)
		res.Body.Close()
		assert.Equal(t, first.Header.Get(kvhttp.HeaderBackend), res.Header.Get(kvhttp.HeaderBackend), "same prefix, same backend")
		assert.Contains(t, []string{"prefix_hash", "overflow"}, res.Header.Get(kvhttp.HeaderRoute), "tier 1 (overflow when the prefix's owner is the dead backend)")
	}
	st, err := router.Stats(context.Background())
	require.NoError(t, err)
	for _, b := range st.Backends {
		assert.Zero(t, b.InFlight, "%s holds no slot", b.Name)
		if b.Name == "dead" {
			assert.Less(t, b.SuccessRate, 1.0, "the dead backend's attempts are failures")
		} else {
			assert.Equal(t, 1.0, b.SuccessRate, b.Name)
		}
	}
}

// Handler.Route and Handler.Attempt: a flow of one's own with a header timeout, request headers,
// headers that replace or delete the backend's, an attempt refused with an API error, and a
// Retry that hands the request on.
func TestHooks(t *testing.T) {
	checkNoLeak(t)
	slow := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
		}
	})
	var seen atomic.Value
	fast := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		seen.Store(r.Header.Get("X-Request-Id") + " " + string(b))
		w.Header().Set("X-Kvroute-Path", "spoofed")
		w.Header().Set("X-Kvroute-Prefill", "spoofed")
		_, _ = io.WriteString(w, `{}`)
	})
	var log []string
	var mu sync.Mutex
	note := func(s string) { mu.Lock(); log = append(log, s); mu.Unlock() }
	h := &kvhttp.Handler{
		Route: func(w http.ResponseWriter, r *http.Request, req *kvhttp.Request) (*kvhttp.Target, error) {
			switch r.URL.Query().Get("case") {
			case "answered":
				w.WriteHeader(http.StatusTeapot)
				return nil, nil
			case "refused":
				return &kvhttp.Target{Backend: "fast", URL: fast}, nil
			}
			return &kvhttp.Target{Backend: "slow", URL: slow, HeaderTimeout: 100 * time.Millisecond, Route: "mine",
				Retry: func(ctx context.Context, cause error) (*kvhttp.Target, error) {
					note("retry after " + cause.Error())
					return &kvhttp.Target{Backend: "fast", URL: fast, Route: "second", Body: []byte("changed"),
						RequestHeader: http.Header{"X-Request-Id": {"r1"}},
						Header:        http.Header{"X-Kvroute-Path": {"fallback"}, "X-Kvroute-Prefill": nil}}, nil
				}}, nil
		},
		Attempt: func(r *http.Request, t *kvhttp.Target) (func(kvhttp.Result), error) {
			if r.URL.Query().Get("case") == "refused" {
				t.Header = http.Header{"Retry-After": {"7"}}
				return nil, apierror.Error{Status: 503, Code: "no_healthy_backend", Message: "circuit open"}
			}
			return func(res kvhttp.Result) { note(fmt.Sprintf("%s %d %v", t.Backend, res.Status, res.Err)) }, nil
		},
	}
	gw := gateway(t, h)
	res, err := http.Post(gw+"/v1/chat/completions", "application/json", strings.NewReader(chatJSON))
	require.NoError(t, err)
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	assert.Equal(t, 200, res.StatusCode, "%s", b)
	assert.Equal(t, "r1 changed", seen.Load())
	assert.Equal(t, "fast", res.Header.Get(kvhttp.HeaderBackend))
	assert.Equal(t, "second", res.Header.Get(kvhttp.HeaderRoute))
	assert.Equal(t, "slow", res.Header.Get(kvhttp.HeaderRetriedFrom))
	assert.Equal(t, "fallback", res.Header.Get("X-Kvroute-Path"))
	assert.Empty(t, res.Header.Values("X-Kvroute-Prefill"), "deleted")
	mu.Lock()
	assert.Equal(t, []string{"slow 0 " + kvhttp.ErrHeaderTimeout.Error(), "retry after " + kvhttp.ErrHeaderTimeout.Error(), "fast 200 <nil>"}, log)
	mu.Unlock()

	res, err = http.Post(gw+"/v1/chat/completions?case=refused", "application/json", strings.NewReader(chatJSON))
	require.NoError(t, err)
	b, _ = io.ReadAll(res.Body)
	res.Body.Close()
	assert.Equal(t, 503, res.StatusCode)
	assert.Equal(t, "7", res.Header.Get("Retry-After"))
	assert.Contains(t, string(b), `"code":"no_healthy_backend"`)

	res, err = http.Post(gw+"/v1/chat/completions?case=answered", "application/json", strings.NewReader(chatJSON))
	require.NoError(t, err)
	res.Body.Close()
	assert.Equal(t, http.StatusTeapot, res.StatusCode)
}

// ReadRequest holds the body's bytes against the Budget until Release; a request that finds no
// room within a second is answered 503 with Retry-After; a large body of tiny objects, or of text
// written with escapes (which parsing decodes into a copy), is charged what parsing it holds, and
// one of plain text little more than its size (parsing keeps views into it).
func TestReadRequestBudget(t *testing.T) {
	budget := kvhttp.NewBudget(4 << 20)
	h := &kvhttp.Handler{BodyBudget: budget, MaxBodyBytes: 2 << 20}
	read := func(body string) (*kvhttp.Request, *httptest.ResponseRecorder) {
		rec := httptest.NewRecorder()
		req, _ := h.ReadRequest(rec, httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(body)))
		return req, rec
	}
	tiny := `{"model":"m","messages":[` + strings.Repeat(`{"role":"user","content":"a"},`, 30000) + `{"role":"user","content":"b"}]}`
	prose := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("plain words ", 80000) + `"}]}`
	lines := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat(`a line\n`, 120000) + `"}]}`
	for _, tc := range []struct {
		name     string
		body     string
		heldMore bool
	}{{"tiny objects", tiny, true}, {"prose", prose, false}, {"escaped lines", lines, true}} {
		req, rec := read(tc.body)
		require.NotNil(t, req, "%s: %d %s", tc.name, rec.Code, rec.Body)
		assert.Equal(t, tc.body, string(req.Body))
		free := int64(4<<20) - int64(len(tc.body)) - int64(len(tc.body))/32 // 3 % more: the parse's small change
		if got := !budget.TryAcquire(free); got != tc.heldMore {
			t.Errorf("%s: holds more than its %d bytes: %v, want %v", tc.name, len(tc.body), got, tc.heldMore)
		} else if !got {
			budget.Release(free)
		}
		req.Release()
		req.Release() // idempotent
		require.True(t, budget.TryAcquire(4<<20), "%s: the budget was given back", tc.name)
		budget.Release(4 << 20)
	}

	require.True(t, budget.TryAcquire(4<<20-100))
	start := time.Now()
	req, rec := read(chatJSON)
	assert.Nil(t, req)
	assert.Equal(t, 503, rec.Code)
	assert.Equal(t, "1", rec.Header().Get("Retry-After"))
	assert.GreaterOrEqual(t, time.Since(start), 900*time.Millisecond, "waited for room")
	// Room that comes while it waits serves it.
	time.AfterFunc(100*time.Millisecond, func() { budget.Release(4<<20 - 100) })
	req, rec = read(chatJSON)
	require.NotNil(t, req, "%d %s", rec.Code, rec.Body)
	req.Release()
	require.True(t, budget.TryAcquire(4<<20))
}

// The Budget serves its waiters first come, first served, and one that gives up holds nothing.
func TestBudget(t *testing.T) {
	b := kvhttp.NewBudget(10)
	require.True(t, b.TryAcquire(8))
	got := make(chan int, 2)
	go func() { assert.NoError(t, b.Acquire(context.Background(), 5)); got <- 5 }()
	time.Sleep(20 * time.Millisecond)
	go func() { assert.NoError(t, b.Acquire(context.Background(), 1)); got <- 1 }()
	time.Sleep(20 * time.Millisecond)
	assert.False(t, b.TryAcquire(1), "waiters come first")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	assert.ErrorIs(t, b.Acquire(ctx, 3), context.DeadlineExceeded)
	cancel()
	b.Release(8)
	assert.ElementsMatch(t, []int{5, 1}, []int{<-got, <-got})
	b.Release(6)
	assert.True(t, b.TryAcquire(100), "more than the size takes it all")
	assert.False(t, b.TryAcquire(1))
	b.Release(100)
	assert.Panics(t, func() { b.Release(1) })
}

// A slow body gets 408 and a closed connection once ReadTimeout has passed.
func TestReadTimeout(t *testing.T) {
	checkNoLeak(t)
	gw := gateway(t, &kvhttp.Handler{Router: &recorder{backends: []string{"a"}}, ReadTimeout: 200 * time.Millisecond})
	c, err := net.Dial("tcp", strings.TrimPrefix(gw, "http://"))
	require.NoError(t, err)
	defer c.Close()
	_, _ = io.WriteString(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\":")
	res, err := http.ReadResponse(bufio.NewReader(c), nil)
	require.NoError(t, err)
	res.Body.Close()
	assert.Equal(t, http.StatusRequestTimeout, res.StatusCode)
	assert.True(t, res.Close)
}

// A stream whose terminal event went out is let finish when the client leaves right after it:
// the backend's request is not cancelled, and the Decision is done.
func TestStreamEndGrace(t *testing.T) {
	checkNoLeak(t)
	finished := make(chan error, 1)
	u := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		sse(w, "data: {}\n\n")
		sse(w, "data: [DONE]\n\n")
		time.Sleep(300 * time.Millisecond) // the engine's bookkeeping after its last event
		finished <- r.Context().Err()
	})
	rc := &recorder{backends: []string{"a"}}
	gw := gateway(t, &kvhttp.Handler{Router: rc, Backends: map[string]*url.URL{"a": u}})
	res, err := http.Post(gw+"/v1/chat/completions", "application/json", strings.NewReader(chatStream))
	require.NoError(t, err)
	buf := make([]byte, len("data: {}\n\ndata: [DONE]\n\n"))
	_, err = io.ReadFull(res.Body, buf)
	require.NoError(t, err)
	res.Body.Close() // unread: the connection closes
	select {
	case err := <-finished:
		assert.NoError(t, err, "the backend's request was cancelled although its stream had ended")
	case <-time.After(5 * time.Second):
		t.Fatal("the backend never finished")
	}
	ds := rc.decisions(t)
	require.Len(t, ds, 1)
	assert.Len(t, ds[0].dones, 1)
}

// Writes split anywhere find the same cached tokens and terminal event as one write.
func TestCachedTokensAcrossWrites(t *testing.T) {
	u := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var in struct {
			Model string `json:"model"` // the answer to send
			User  string `json:"user"`  // where to split it, -1: one write
		}
		_ = json.Unmarshal(body, &in)
		cut, _ := strconv.Atoi(in.User)
		if cut < 0 {
			_, _ = io.WriteString(w, in.Model)
			return
		}
		sse(w, in.Model[:cut])
		sse(w, in.Model[cut:])
	})
	got := make(chan int, 1)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	h := &kvhttp.Handler{Router: &recorder{backends: []string{"a"}}, Backends: map[string]*url.URL{"a": u}, Transport: tr,
		Attempt: func(*http.Request, *kvhttp.Target) (func(kvhttp.Result), error) {
			return func(res kvhttp.Result) { got <- res.CachedTokens }, nil
		}}
	through := func(answer string, cut int) int {
		m, _ := json.Marshal(answer)
		body := `{"model":` + string(m) + `,"user":"` + strconv.Itoa(cut) + `","messages":[{"role":"user","content":"hi"}]}`
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(body)))
		require.Equal(t, 200, rec.Code)
		require.Equal(t, answer, rec.Body.String())
		return <-got
	}
	for _, answer := range []string{sseAnswer, jsonAnswer, `{"usage":{"cache_read_input_tokens":  123456,"x":1}}`} {
		want := through(answer, -1)
		require.GreaterOrEqual(t, want, 0, answer)
		for cut := range len(answer) {
			if got := through(answer, cut); got != want {
				t.Fatalf("cut at %d of %q: %d, want %d", cut, answer, got, want)
			}
		}
	}
}

// A path with dot segments (encoded or not) is refused before anything is read or routed: it
// would otherwise reach the backend as it is, and a proxy in front of the engine that normalises
// paths would take it out of /v1/.
func TestDotSegmentsRefused(t *testing.T) {
	var hits atomic.Int64
	backends := map[string]*url.URL{"a": upstream(t, func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		_, _ = io.WriteString(w, `{}`)
	})}
	router, err := kvroute.New(kvroute.Config{Backends: []kvroute.Backend{{Name: "a"}}})
	require.NoError(t, err)
	defer router.Close()
	gw := gateway(t, &kvhttp.Handler{Router: router, Backends: backends})
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	for _, p := range []string{"/v1/%2e%2e/admin/v1/chat/completions", "/v1/..%2fadmin%2fv1/chat/completions",
		"/v1/./v1/messages", "/x//v1/completions"} {
		req, err := http.NewRequest(http.MethodPost, gw+p, strings.NewReader(body))
		require.NoError(t, err)
		req.URL.Opaque = p // sent as written, not cleaned by the client
		res, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		assert.Equal(t, http.StatusBadRequest, res.StatusCode, "%s: %s", p, b)
		assert.Contains(t, string(b), "dot or empty segments", p)
	}
	assert.Zero(t, hits.Load(), "nothing reached the backend")
	res, err := http.Post(gw+"/v1/chat/completions", "application/json", strings.NewReader(body))
	require.NoError(t, err)
	res.Body.Close()
	assert.Equal(t, http.StatusOK, res.StatusCode)
}

// ReadRequest returns the body byte for byte at every size around its buffers' edges, with and
// without a Content-Length, and read a byte at a time; a body over MaxBodyBytes without a
// Content-Length is 413; and every byte held is given back.
func TestReadRequestBodySizes(t *testing.T) {
	budget := kvhttp.NewBudget(8 << 20)
	const limit = 1 << 20
	h := &kvhttp.Handler{BodyBudget: budget, MaxBodyBytes: limit}
	for _, size := range []int{0, 1, 16<<10 - 1, 16 << 10, 16<<10 + 1, 64<<10 - 1, 64 << 10, 64<<10 + 1,
		3*64<<10 + 7, 300_001, limit} {
		body := make([]byte, size)
		for i := range body {
			body[i] = byte('a' + i%26 + i/4099%3)
		}
		for _, mode := range []string{"length", "chunked", "one byte a read"} {
			var r io.Reader = bytes.NewReader(body)
			if mode == "one byte a read" {
				r = iotest.OneByteReader(r)
			}
			hr := httptest.NewRequest("POST", "/v1/files", r)
			if mode != "length" {
				hr.ContentLength = -1
			}
			rec := httptest.NewRecorder()
			req, err := h.ReadRequest(rec, hr)
			require.NoError(t, err, "%d bytes, %s: %d %s", size, mode, rec.Code, rec.Body)
			require.True(t, bytes.Equal(body, req.Body), "%d bytes, %s: the body read differs", size, mode)
			req.Release()
			require.True(t, budget.TryAcquire(8<<20), "%d bytes, %s: the budget was not given back", size, mode)
			budget.Release(8 << 20)
		}
	}
	hr := httptest.NewRequest("POST", "/v1/files", bytes.NewReader(make([]byte, limit+1)))
	hr.ContentLength = -1
	rec := httptest.NewRecorder()
	_, err := h.ReadRequest(rec, hr)
	require.Error(t, err)
	assert.Equal(t, 413, rec.Code)
	require.True(t, budget.TryAcquire(8<<20), "the budget was not given back")
}

// orderRouter routes to the first of its backends that ctx does not avoid.
type orderRouter struct{ order []string }

func (o orderRouter) Route(ctx context.Context, _ *prefixkey.Request) (*kvroute.Decision, error) {
	avoid := kvroute.Avoided(ctx)
	for _, b := range o.order {
		if !slices.Contains(avoid, b) {
			return kvroute.NewDecision(b, kvroute.ReasonCustom, nil), nil
		}
	}
	return nil, kvroute.ErrNoBackend
}

// Each retry avoids every backend that failed the request, not only the last: with two dead
// backends first in the Router's order, the second retry reaches the live one (it went back to
// the first dead one).
func TestRetriesAvoidEveryFailedBackend(t *testing.T) {
	live := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[]}`)
	}))
	defer live.Close()
	dead := func() *url.URL { return deadURL(t) }
	liveURL, err := url.Parse(live.URL)
	require.NoError(t, err)
	h := &kvhttp.Handler{
		Router:   orderRouter{order: []string{"a", "b", "c"}},
		Backends: map[string]*url.URL{"a": dead(), "b": dead(), "c": liveURL},
		Retries:  2,
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("POST", "/v1/chat/completions",
		strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)))
	require.Equal(t, http.StatusOK, rec.Code, "%s", rec.Body)
}
