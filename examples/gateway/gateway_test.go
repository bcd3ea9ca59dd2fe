package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/prefixkey"
)

// Requests sharing a system prompt meet the same backend; a malformed body gets a 400 in the
// OpenAI style; a dead backend gets a 502 and its decision is released as a failure.
func TestGateway(t *testing.T) {
	urls := map[string]*url.URL{}
	var cfg kvroute.Config
	for _, name := range []string{"a", "b", "c"} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(map[string]any{"backend": name, "bytes": len(b)})
		}))
		t.Cleanup(srv.Close)
		urls[name], _ = url.Parse(srv.URL)
		cfg.Backends = append(cfg.Backends, kvroute.Backend{Name: name})
	}
	dead := httptest.NewServer(http.NotFoundHandler())
	urls["dead"], _ = url.Parse(dead.URL)
	dead.Close()
	router, err := kvroute.New(cfg)
	require.NoError(t, err)
	defer router.Close()
	gw := httptest.NewServer(NewGateway(router, urls))
	defer gw.Close()

	post := func(path, body string) (*http.Response, map[string]any) {
		res, err := http.Post(gw.URL+path, "application/json", strings.NewReader(body))
		require.NoError(t, err)
		defer res.Body.Close()
		var doc map[string]any
		require.NoError(t, json.NewDecoder(res.Body).Decode(&doc))
		return res, doc
	}
	chat := func(system, user string) string {
		return `{"model":"m","messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"` + user + `"}]}`
	}
	first, doc := post("/v1/chat/completions", chat("You are the ACME assistant.", "hi"))
	require.Equal(t, 200, first.StatusCode)
	assert.Equal(t, len(chat("You are the ACME assistant.", "hi")), int(doc["bytes"].(float64)), "the body reaches the backend whole")
	for _, q := range []string{"where is my order?", "change my address", "thanks"} {
		res, doc := post("/v1/chat/completions", chat("You are the ACME assistant.", q))
		assert.Equal(t, first.Header.Get("X-Kvroute-Backend"), doc["backend"], "same prefix, same backend")
		assert.Equal(t, doc["backend"], res.Header.Get("X-Kvroute-Backend"))
	}

	res, doc := post("/v1/chat/completions", `{"model":"m","messages":"not a list"}`)
	assert.Equal(t, 400, res.StatusCode)
	assert.Equal(t, "invalid_request_error", doc["error"].(map[string]any)["type"])
	res, doc = post("/v1/messages", `{"model":`)
	assert.Equal(t, 400, res.StatusCode)
	assert.Equal(t, "error", doc["type"], "Anthropic's error style on its endpoint")

	only, err := kvroute.New(kvroute.Config{Backends: []kvroute.Backend{{Name: "dead"}}})
	require.NoError(t, err)
	defer only.Close()
	gw2 := httptest.NewServer(NewGateway(only, urls))
	defer gw2.Close()
	r2, err := http.Post(gw2.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hi"}`))
	require.NoError(t, err)
	r2.Body.Close()
	assert.Equal(t, 502, r2.StatusCode)
	rs, err := only.Stats(context.Background())
	require.NoError(t, err)
	st := rs.Backends[0]
	assert.Zero(t, st.InFlight, "the decision is released")
	assert.Less(t, st.SuccessRate, 1.0, "as a failure")
}

// lifecycle records what the gateway reported on one Decision.
type lifecycle struct {
	mu       sync.Mutex
	firsts   int // FirstToken hook runs
	dones    []kvroute.Outcome
	doneSeen chan struct{} // closed by the first Done
}

// pinned is a Router that routes every request to its backend with a Decision whose hooks record
// into its lifecycle.
type pinned struct {
	l       *lifecycle
	backend string
}

// router routes every request to backend with a Decision whose hooks record into l.
func (l *lifecycle) router(backend string) kvroute.Router { return pinned{l, backend} }

func (p pinned) Route(context.Context, *prefixkey.Request) (*kvroute.Decision, error) {
	l := p.l
	return kvroute.NewDecision(p.backend, kvroute.ReasonCustom, &kvroute.DecisionHooks{
		FirstToken: func() { l.mu.Lock(); l.firsts++; l.mu.Unlock() },
		Done: func(o kvroute.Outcome) {
			l.mu.Lock()
			defer l.mu.Unlock()
			if l.dones = append(l.dones, o); len(l.dones) == 1 {
				close(l.doneSeen)
			}
		},
	}), nil
}

// The gateway tells the Router the whole story of each request: FirstToken on the first byte of a
// successful answer, then Done once, with the outcome the request had — a success, a failure for a
// 5xx or a transport error (before or during the answer), a refusal for an engine's 429 or 503, and
// a cancelled request (NotSent: nothing recorded) when the client leaves.
func TestGatewayLifecycle(t *testing.T) {
	release := make(chan struct{}) // unblocks the backends that wait for the client to leave
	var releaseOnce sync.Once
	backend := func(h http.HandlerFunc) *url.URL {
		srv := httptest.NewServer(h)
		t.Cleanup(func() {
			releaseOnce.Do(func() { close(release) })
			srv.Close()
		})
		u, _ := url.Parse(srv.URL)
		return u
	}
	sse := func(w http.ResponseWriter, chunk string) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, chunk)
		w.(http.Flusher).Flush()
	}
	dead := httptest.NewServer(http.NotFoundHandler())
	deadURL, _ := url.Parse(dead.URL)
	dead.Close()

	for _, tc := range []struct {
		name    string
		backend *url.URL
		leave   bool // the client leaves once the backend has the request (and has begun its answer)
		status  int  // what the client gets, when it stays
		first   int  // FirstToken hooks run
		want    string
	}{
		{name: "success", backend: backend(func(w http.ResponseWriter, _ *http.Request) {
			sse(w, "data: {}\n\n")
			sse(w, "data: [DONE]\n\n")
		}), status: 200, first: 1, want: "success"},
		{name: "5xx", backend: backend(func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, `{"error":"boom"}`, http.StatusInternalServerError)
		}), status: 500, want: "failure"},
		{name: "refused", backend: backend(func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, `{"error":"KV cache full"}`, http.StatusServiceUnavailable)
		}), status: 503, want: "refused"},
		{name: "connection refused", backend: deadURL, status: 502, want: "failure"},
		{name: "backend dies mid-answer", backend: backend(func(w http.ResponseWriter, _ *http.Request) {
			sse(w, "data: {}\n\n")
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
		}), status: 200, first: 1, want: "failure"},
		{name: "client leaves mid-answer", backend: backend(func(w http.ResponseWriter, r *http.Request) {
			sse(w, "data: {}\n\n")
			select {
			case <-r.Context().Done():
			case <-release:
			}
		}), leave: true, first: 1, want: "cancelled"},
		{name: "client leaves before the answer", backend: backend(func(w http.ResponseWriter, r *http.Request) {
			select {
			case <-r.Context().Done():
			case <-release:
			}
		}), leave: true, want: "cancelled"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := &lifecycle{doneSeen: make(chan struct{})}
			gw := httptest.NewServer(NewGateway(l.router("b"), map[string]*url.URL{"b": tc.backend}))
			defer gw.Close()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			body := `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`
			req, _ := http.NewRequestWithContext(ctx, "POST", gw.URL+"/v1/chat/completions", strings.NewReader(body))
			if tc.leave {
				go func() { // leave once the backend has been reached (and has answered, if it does)
					time.Sleep(200 * time.Millisecond)
					cancel()
				}()
			}
			res, err := http.DefaultClient.Do(req)
			switch {
			case err == nil:
				_, _ = io.ReadAll(res.Body)
				res.Body.Close()
				if !tc.leave {
					assert.Equal(t, tc.status, res.StatusCode)
				}
			case !tc.leave:
				t.Errorf("request failed: %v", err)
			}
			select {
			case <-l.doneSeen:
			case <-time.After(5 * time.Second):
				t.Fatal("Done was never called")
			}
			time.Sleep(50 * time.Millisecond) // a second Done would come now
			l.mu.Lock()
			defer l.mu.Unlock()
			require.Len(t, l.dones, 1, "Done exactly once")
			o := l.dones[0]
			got := "success"
			switch {
			case o.NotSent:
				got = "cancelled"
			case o.Refused:
				got = "refused"
			case o.Err != nil:
				got = "failure"
			}
			assert.Equal(t, tc.want, got, "outcome %+v", o)
			assert.Equal(t, tc.first, l.firsts, "FirstToken")
		})
	}
}
