package kvhttp_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/kvhttp"
)

// BenchmarkHandler compares a request through a kvhttp.Handler (read, parse, Route on kvroute's
// default Router, forward, first token, usage, Done) with the same request through a bare
// httputil.ReverseProxy (SetURL, a pool of copy buffers: benchmarks/cmd/overhead's relay), in the
// same run: one loopback engine, the same Transport, a client with keep-alive connections,
// requests one at a time (serial) and from every core (parallel). The difference of the two
// ns/op is what the Handler adds to a request.
func BenchmarkHandler(b *testing.B) {
	const system = "You are a helpful assistant. Answer in one short sentence, and never apologise."
	chat := `{"model":"m","messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"hi"}]}`
	for _, answer := range []struct {
		name, ctype, body string
	}{
		{"json", "application/json", jsonAnswer},
		{"sse", "text/event-stream", sseAnswer},
	} {
		engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", answer.ctype)
			_, _ = io.WriteString(w, answer.body)
		}))
		u, _ := url.Parse(engine.URL)
		router, err := kvroute.New(kvroute.Config{Backends: []kvroute.Backend{{Name: "e"}}})
		if err != nil {
			b.Fatal(err)
		}
		tr := kvhttp.NewTransport(0)
		relays := []struct {
			name string
			h    http.Handler
		}{
			{"reverseproxy", &httputil.ReverseProxy{Transport: tr, BufferPool: &buffers{},
				Rewrite: func(pr *httputil.ProxyRequest) { pr.SetURL(u) }}},
			{"kvhttp", &kvhttp.Handler{Router: router, Backends: map[string]*url.URL{"e": u}, Transport: tr}},
		}
		for _, relay := range relays {
			gw := httptest.NewServer(relay.h)
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64, DisableCompression: true}}
			do := func(b *testing.B) {
				res, err := client.Post(gw.URL+"/v1/chat/completions", "application/json", strings.NewReader(chat))
				if err != nil {
					b.Fatal(err)
				}
				n, _ := io.Copy(io.Discard, res.Body)
				res.Body.Close()
				if res.StatusCode != 200 || int(n) != len(answer.body) {
					b.Fatalf("%d, %d bytes", res.StatusCode, n)
				}
			}
			b.Run("answer="+answer.name+"/relay="+relay.name+"/serial", func(b *testing.B) {
				b.ReportAllocs()
				b.SetBytes(int64(len(chat) + len(answer.body)))
				for b.Loop() {
					do(b)
				}
			})
			b.Run("answer="+answer.name+"/relay="+relay.name+"/parallel", func(b *testing.B) {
				b.ReportAllocs()
				b.SetBytes(int64(len(chat) + len(answer.body)))
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						do(b)
					}
				})
			})
			gw.Close()
			client.CloseIdleConnections()
		}
		tr.CloseIdleConnections()
		router.Close()
		engine.Close()
	}
}

// buffers is a pool of ReverseProxy's 32 KiB copy buffers.
type buffers struct{ p sync.Pool }

func (b *buffers) Get() []byte {
	if v, ok := b.p.Get().(*[]byte); ok {
		return *v
	}
	return make([]byte, 32<<10)
}

func (b *buffers) Put(buf []byte) { b.p.Put(&buf) }
