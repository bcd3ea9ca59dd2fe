//go:build unix

package main

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvroute/kvroute/config"
)

// BenchmarkHandlerCPU measures the CPU the proxy's handler spends on one chat completion with
// nothing else in the process: the upstream is a RoundTripper that reads the request body and
// answers a canned vLLM answer from memory, the client a ResponseWriter that counts bytes. Beside
// it, in the same run, a bare httputil.ReverseProxy over the same RoundTripper and writer: the
// relay (b) of benchmarks/cmd/overhead. The configurations are those of the overhead tool's
// targets: tier 1 only (c), and the in-memory response cache with the tier-4 in-memory KV index
// and the tokenizer estimate, every request a cache miss (d). The difference of ns/op is the
// proxy's own work per request, without the sockets and the scheduling that both pay.
//
// caches=warm runs the requests back to back, as a busy gateway's core does; caches=cold
// writes 8 MiB between two requests, as the engine, the client and other processes do between
// the requests of one connection on a small machine, and reports the requests' own time as
// ns/request: the code and data a request touches then come from memory, which is what the
// overhead tool's one-connection loop measures.
func BenchmarkHandlerCPU(b *testing.B) {
	const model = "bench-model"
	engine := "http://127.0.0.1:1"
	tier1 := "server:\n  bind_address: \"127.0.0.1\"\n  port: 0\nprefix_routing:\n  enabled: true\n" +
		"backends:\n  - name: e\n    url: " + engine + "\n    model: " + model + "\nhealth_checks:\n  enabled: false\n"
	all := tier1 + "response_cache:\n  enabled: true\n  backend: memory\n  capacity: 10000\n  ttl: \"10m\"\n" +
		"kv_cache_index:\n  enabled: true\n  backend: memory\n  block_size: 16\n  tokenizer: estimate\n" +
		"  event_sources:\n    - backend_name: e\n      endpoint: \"tcp://127.0.0.1:1\"\n      model: " + model + "\n"
	for _, tc := range []struct {
		name string
		yaml string // "" for the bare ReverseProxy
	}{
		{"relay", ""},
		{"tier1", tier1},
		{"cache+kv", all},
	} {
		for _, cold := range []bool{false, true} {
			b.Run("target="+tc.name+"/caches="+map[bool]string{false: "warm", true: "cold"}[cold], func(b *testing.B) {
				run := newHandlerRun(b, model, engine, tc.yaml)
				run()
				b.ReportAllocs()
				if !cold {
					for b.Loop() {
						run()
					}
					return
				}
				// b.StopTimer would read the memory statistics, which flushes the allocator's
				// per-CPU caches: the requests are timed one by one instead, and ns/op left
				// to include the writes.
				junk := make([]byte, 8<<20)
				var took time.Duration
				n := 0
				for b.Loop() {
					for i := 0; i < len(junk); i += 64 {
						junk[i]++
					}
					start := time.Now()
					run()
					took += time.Since(start)
					n++
				}
				b.ReportMetric(float64(took.Nanoseconds())/float64(n), "ns/request")
			})
		}
	}
}

// newHandlerRun returns a function that sends one chat completion, its user message new each
// time, through the proxy configured by yamlConfig (a bare ReverseProxy when it is empty) to a
// RoundTripper that answers from memory as the engine at engine would, and checks the answer.
func newHandlerRun(b *testing.B, model, engine, yamlConfig string) func() {
	system := strings.Repeat("You are a careful assistant for the support desk of an online bookshop. ", 15)
	head := `{"model":"` + model + `","temperature":0,"max_tokens":16,"messages":[{"role":"system","content":"` +
		system + `"},{"role":"user","content":"Question #`
	answer := []byte(`{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"` + model + `",` +
		`"choices":[{"index":0,"message":{"role":"assistant","content":"tok tok tok tok tok tok tok tok tok tok tok tok tok tok tok tok"},` +
		`"finish_reason":"length"}],"usage":{"prompt_tokens":260,"completion_tokens":16,"total_tokens":276,` +
		`"prompt_tokens_details":{"cached_tokens":256}}}`)
	rt := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		if r.Body != nil {
			_, _ = io.Copy(io.Discard, r.Body)
			r.Body.Close()
		}
		return &http.Response{StatusCode: http.StatusOK, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
			Header: http.Header{"Content-Type": {"application/json"}, "Content-Length": {strconv.Itoa(len(answer))},
				"Date": {"Sat, 29 Nov 2026 01:00:00 GMT"}, "Server": {"uvicorn"}},
			ContentLength: int64(len(answer)), Body: io.NopCloser(bytes.NewReader(answer)), Request: r}, nil
	})
	var h http.Handler
	if yamlConfig == "" {
		u, _ := url.Parse(engine)
		h = &httputil.ReverseProxy{Transport: rt, BufferPool: &benchBuffers{},
			Rewrite: func(pr *httputil.ProxyRequest) { pr.SetURL(u) }}
	} else {
		path := filepath.Join(b.TempDir(), "proxy.yaml")
		if err := os.WriteFile(path, []byte(yamlConfig), 0o600); err != nil {
			b.Fatal(err)
		}
		cfg, err := config.Load(path)
		if err != nil {
			b.Fatal(err)
		}
		srv, err := newServer(cfg, nil)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = srv.Close() })
		srv.llm.Transport = rt
		h = srv.Handler()
	}
	target, _ := url.Parse("http://127.0.0.1:8080/v1/chat/completions")
	w := &benchWriter{h: http.Header{}}
	rb := &benchBody{}
	n := 0
	return func() {
		n++
		body := []byte(head + strconv.Itoa(n) + `: where is my order?"}]}`)
		req := &http.Request{Method: http.MethodPost, URL: target, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
			Host: target.Host, RemoteAddr: "127.0.0.1:40000", RequestURI: target.Path, ContentLength: int64(len(body)),
			Header: http.Header{"Content-Type": {"application/json"}, "Accept-Encoding": {"gzip"}, "User-Agent": {"Go-http-client/1.1"}}}
		rb.Reset(body)
		req.Body = rb
		clear(w.h)
		w.status, w.n = 0, 0
		h.ServeHTTP(w, req)
		if w.status != http.StatusOK || w.n != len(answer) {
			b.Fatalf("status %d, %d bytes", w.status, w.n)
		}
	}
}

// roundTripFunc is an http.RoundTripper of a function.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// benchBuffers is a pool of ReverseProxy's 32 KiB copy buffers, as the overhead tool's relay has.
type benchBuffers struct{ p sync.Pool }

func (p *benchBuffers) Get() []byte {
	if v, ok := p.p.Get().(*[]byte); ok {
		return *v
	}
	return make([]byte, 32<<10)
}

func (p *benchBuffers) Put(buf []byte) { p.p.Put(&buf) }
