//go:build unix

package main

import (
	"bytes"
	"context"
	"net/http"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/enginesim"
)

// BenchmarkProxyRequest measures the proxy's handler on one chat completion, from the parsed
// client request to the relayed answer: the body checks, Route, ReverseProxy and the upstream
// transport over loopback to a simulated engine without latency, the lease and the metrics. The
// HTTP server in front of the handler is left out (a cheap ResponseWriter stands in for it), and
// so is the engine's own work, which shares the CPU: ns/op is the round trip, allocs/op and B/op
// are mostly the proxy's (the engine runs in this process, so they include its share).
func BenchmarkProxyRequest(b *testing.B) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	f, err := enginesim.StartFleet(ctx, enginesim.FleetConfig{N: 1, SSE: true,
		Base: enginesim.Config{BlockSize: 16, CapacityBlocks: 2048}})
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	e := f.Info()[0]
	// Tier 1: prefix routing, no response cache, no KV index; the health probes are off so that
	// nothing but the benchmark runs in the background.
	cfg := &config.Config{Backends: []config.BackendConfig{{Name: e.Name, URL: e.URL, Model: e.Model}}}
	cfg.Server.Port = ptr(0)
	cfg.HealthChecks.Enabled = ptr(false)
	cfg.ApplyDefaults()
	if err := cfg.Validate(); err != nil {
		b.Fatal(err)
	}
	srv, err := newServer(cfg, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer srv.Close()
	h := srv.Handler()

	const chat = `{"model":"` + testModel + `","messages":[{"role":"system","content":"You are a helpful assistant."},` +
		`{"role":"user","content":"Say hello to the benchmark, please."}],"max_tokens":4,"temperature":0.7`
	for _, bc := range []struct {
		name string
		body string
	}{
		{"stream=false", chat + `}`},
		{"stream=true", chat + `,"stream":true}`},
	} {
		b.Run(bc.name, func(b *testing.B) {
			body := []byte(bc.body)
			u, _ := url.Parse("http://127.0.0.1:8080/v1/chat/completions")
			tmpl := http.Request{Method: http.MethodPost, URL: u, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
				Host: u.Host, RemoteAddr: "127.0.0.1:40000", RequestURI: u.Path, ContentLength: int64(len(body)),
				Header: http.Header{"Content-Type": {"application/json"}, "Accept": {"*/*"}, "User-Agent": {"bench/1"}}}
			w := &benchWriter{h: http.Header{}}
			rb := &benchBody{}
			run := func() {
				// A server gives every request a context it cancels when the request ends.
				rctx, rcancel := context.WithCancel(context.Background())
				req := tmpl
				rb.Reset(body)
				req.Body = rb
				clear(w.h)
				w.status, w.n = 0, 0
				h.ServeHTTP(w, req.WithContext(rctx))
				rcancel()
				if w.status != http.StatusOK || w.n == 0 {
					b.Fatalf("status %d, %d bytes", w.status, w.n)
				}
			}
			run()
			if bc.name == "stream=true" && !strings.Contains(w.h.Get("Content-Type"), "text/event-stream") {
				b.Fatalf("Content-Type %q", w.h.Get("Content-Type"))
			}
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			user, sys := processCPU()
			for b.Loop() {
				run()
			}
			user2, sys2 := processCPU()
			// The CPU time of the whole process, the engine's included: on a shared machine it
			// varies less than the time per request.
			b.ReportMetric(float64(user2-user)/float64(b.N), "user-ns/op")
			b.ReportMetric(float64(sys2-sys)/float64(b.N), "sys-ns/op")
		})
	}
}

// processCPU returns the user and system CPU time the process has used.
func processCPU() (user, sys time.Duration) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, 0
	}
	return time.Duration(ru.Utime.Nano()), time.Duration(ru.Stime.Nano())
}

// benchBody is a request body that can be reset for the next request.
type benchBody struct{ bytes.Reader }

func (*benchBody) Close() error { return nil }

// benchWriter is a ResponseWriter that keeps the status and counts the body bytes.
type benchWriter struct {
	h      http.Header
	status int
	n      int
}

func (w *benchWriter) Header() http.Header { return w.h }

func (w *benchWriter) WriteHeader(code int) {
	if w.status == 0 && code >= 200 {
		w.status = code
	}
}

func (w *benchWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	w.n += len(p)
	return len(p), nil
}

func (w *benchWriter) Flush() {}
