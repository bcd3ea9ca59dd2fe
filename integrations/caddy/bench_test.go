package kvroutecaddy

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

// BenchmarkServeHTTP is the module's cost per request, without the network: read and parse the
// body, route, select, wrap the writer, answer, end the decision. The fake proxy answers a small
// JSON body.
func BenchmarkServeHTTP(b *testing.B) {
	system := strings.Repeat("You are a helpful assistant. ", 40)
	body := `{"model":"m","messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"hi"}]}`
	for _, bc := range []struct {
		name string
		h    *Handler
	}{
		{"tier1", &Handler{}},
		{"tier4_estimate", &Handler{KVIndex: &KVIndex{}}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			h, _, p := newTestHandler(b, bc.h)
			h.entry.router = h.entry.router.(*recRouter).routerAPI // no recording
			proxy := fakeProxy(testPool(testBackends...), p,
				func(_ int, _ *reverseproxy.Upstream, w http.ResponseWriter, r *http.Request) (error, bool) {
					_, _ = io.Copy(io.Discard, r.Body)
					w.WriteHeader(200)
					_, _ = w.Write([]byte(`{"ok":true}`))
					return nil, false
				})
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				w := httptest.NewRecorder()
				if err := h.ServeHTTP(w, caddyRequest(context.Background(), "/v1/chat/completions", body), proxy); err != nil || w.Code != 200 {
					b.Fatal(err, w.Code)
				}
			}
		})
	}
}
