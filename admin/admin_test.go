package admin_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/admin"
)

func TestGuard(t *testing.T) {
	ok := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	do := func(token, method, remote, host string, hdr ...string) int {
		r := httptest.NewRequest(method, "/admin/x", strings.NewReader(`{}`))
		r.RemoteAddr, r.Host = remote, host
		for i := 0; i+1 < len(hdr); i += 2 {
			r.Header.Set(hdr[i], hdr[i+1])
		}
		w := httptest.NewRecorder()
		admin.Guard(token, ok).ServeHTTP(w, r)
		return w.Code
	}
	const json = "application/json"
	for _, tc := range []struct {
		name string
		got  int
		want int
	}{
		{"no token, loopback operator", do("", "POST", "127.0.0.1:1", "127.0.0.1:8080", "Content-Type", json), 200},
		{"no token, ::1 and localhost", do("", "GET", "[::1]:1", "localhost:8080"), 200},
		{"no token, remote", do("", "GET", "192.0.2.1:1", "127.0.0.1:8080"), 403},
		{"no token, forwarded-for ignored", do("", "GET", "192.0.2.1:1", "127.0.0.1:8080", "X-Forwarded-For", "127.0.0.1"), 403},
		{"no token, rebinding host", do("", "GET", "127.0.0.1:1", "evil.example"), 403},
		{"no token, cross-site origin", do("", "POST", "127.0.0.1:1", "127.0.0.1:8080", "Content-Type", json, "Origin", "http://evil.example"), 403},
		{"no token, form post", do("", "POST", "127.0.0.1:1", "127.0.0.1:8080", "Content-Type", "text/plain"), 403},
		{"no token, fetch metadata", do("", "GET", "127.0.0.1:1", "127.0.0.1:8080", "Sec-Fetch-Site", "same-site"), 403},
		{"token, remote with it", do("t0k", "POST", "192.0.2.1:1", "gw.example", "Authorization", "bearer t0k"), 200},
		{"token, wrong", do("t0k", "GET", "127.0.0.1:1", "127.0.0.1", "Authorization", "Bearer t0"), 401},
		{"token, wrong scheme", do("t0k", "GET", "127.0.0.1:1", "127.0.0.1", "Authorization", "Basic t0k"), 401},
		{"token, missing", do("t0k", "GET", "127.0.0.1:1", "127.0.0.1"), 401},
	} {
		if tc.got != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, tc.got, tc.want)
		}
	}
}
