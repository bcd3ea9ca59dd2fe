package respcache

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// mwNopStore never hits and discards every Set: each request through it is a MISS.
type mwNopStore struct{}

func (mwNopStore) Get(context.Context, string) ([]byte, bool, error)        { return nil, false, nil }
func (mwNopStore) Set(context.Context, string, []byte, time.Duration) error { return nil }
func (mwNopStore) Delete(context.Context, string) error                     { return nil }
func (mwNopStore) Clear(context.Context) (int, error)                       { return 0, nil }
func (mwNopStore) Stats(context.Context) StoreStats                         { return StoreStats{Backend: "nop"} }

// mwBenchBody is a request body the benchmark rewinds instead of reallocating.
type mwBenchBody struct{ bytes.Reader }

func (*mwBenchBody) Close() error { return nil }

// mwBenchHandler answers like an engine: a JSON body of size bytes, or events SSE events of about
// size/events bytes each, flushed one by one, ending with [DONE].
func mwBenchHandler(size int, stream bool) http.Handler {
	const events = 32
	if !stream {
		resp := []byte(`{"choices":[{"message":{"content":"` + strings.Repeat("x", max(size-40, 0)) + `"}}]}`)
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(resp)
		})
	}
	ev := []byte(`data: {"choices":[{"delta":{"content":"` + strings.Repeat("x", max(size/events-40, 0)) + `"}}]}` + "\n\n")
	done := []byte("data: [DONE]\n\n")
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		f := w.(http.Flusher)
		for range events {
			_, _ = w.Write(ev)
			f.Flush()
		}
		_, _ = w.Write(done)
		f.Flush()
	})
}

// mwBenchRequest returns a chat request whose body has about promptBytes of prompt, and a function
// that rewinds its body before each iteration.
func mwBenchRequest(promptBytes int, stream bool, temperature string) (*http.Request, func()) {
	extra := []string{`"max_tokens":256`, `"temperature":` + temperature}
	if stream {
		extra = append(extra, `"stream":true`)
	}
	body := mwChat(strings.Repeat("lorem ipsum ", promptBytes/12), extra...)
	rb := &mwBenchBody{}
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
	r.ContentLength = int64(len(body))
	return r, func() {
		rb.Reset(body)
		r.Body = rb
		r.GetBody = nil
	}
}

// BenchmarkMiddlewareHit: a request (1 KiB prompt) served from the default MemoryStore, response
// of the given size; the wrapped handler is never called. writer=recorder writes into a fresh
// httptest.ResponseRecorder (whose buffer growth is most of the cost for large bodies);
// writer=discard into a reused writer that keeps nothing, which leaves the middleware's own cost.
func BenchmarkMiddlewareHit(b *testing.B) {
	for _, stream := range []bool{false, true} {
		for _, size := range []int{1 << 10, 16 << 10} {
			for _, writer := range []string{"recorder", "discard"} {
				b.Run(fmt.Sprintf("stream=%v/resp=%d/writer=%s", stream, size, writer), func(b *testing.B) {
					c := mwNew(b, Config{})
					h := c.Middleware(mwBenchHandler(size, stream))
					r, rewind := mwBenchRequest(1024, stream, "0")
					rewind()
					h.ServeHTTP(httptest.NewRecorder(), r) // MISS: fills the cache
					dw := &mwDiscardWriter{h: http.Header{}}
					b.SetBytes(int64(size))
					b.ReportAllocs()
					for b.Loop() {
						rewind()
						if writer == "discard" {
							clear(dw.h)
							h.ServeHTTP(dw, r)
							continue
						}
						w := httptest.NewRecorder()
						h.ServeHTTP(w, r)
						if w.Header().Get(HeaderXCache) != XCacheHit {
							b.Fatal("not a HIT")
						}
					}
				})
			}
		}
	}
}

// BenchmarkMiddlewareHitParallel: HITs from every P on one key of the default store.
func BenchmarkMiddlewareHitParallel(b *testing.B) {
	c := mwNew(b, Config{})
	h := c.Middleware(mwBenchHandler(1<<10, false))
	body := mwChat(strings.Repeat("lorem ipsum ", 85), `"temperature":0`)
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(body)))
	b.SetBytes(1 << 10)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		rb := &mwBenchBody{}
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
		r.ContentLength = int64(len(body))
		for pb.Next() {
			rb.Reset(body)
			r.Body = rb
			h.ServeHTTP(httptest.NewRecorder(), r)
		}
	})
}

// BenchmarkMiddlewareMiss compares calling the handler directly ("direct") with calling it through
// the middleware on a MISS ("miss": read and parse the body, key, lookup, record; the store
// discards the Set) and on a BYPASS ("bypass": temperature 0.7, parsed then forwarded). The
// difference is the middleware's overhead on a request the cache cannot serve.
func BenchmarkMiddlewareMiss(b *testing.B) {
	for _, stream := range []bool{false, true} {
		for _, size := range []int{1 << 10, 16 << 10} {
			next := mwBenchHandler(size, stream)
			c := mwNew(b, Config{Store: mwNopStore{}})
			mw := c.Middleware(next)
			for _, v := range []struct {
				name string
				h    http.Handler
				temp string
			}{
				{"direct", next, "0"},
				{"miss", mw, "0"},
				{"bypass", mw, "0.7"},
			} {
				b.Run(fmt.Sprintf("stream=%v/resp=%d/%s", stream, size, v.name), func(b *testing.B) {
					r, rewind := mwBenchRequest(1024, stream, v.temp)
					b.SetBytes(int64(size))
					b.ReportAllocs()
					for b.Loop() {
						rewind()
						v.h.ServeHTTP(httptest.NewRecorder(), r)
					}
				})
			}
		}
	}
}
