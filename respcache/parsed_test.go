package respcache

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kvroute/kvroute/prefixkey"
)

// failingBody fails every read: the middleware must not read a body handed over in the context.
type failingBody struct{}

func (failingBody) Read([]byte) (int, error) { return 0, errors.New("the body was read again") }

// A request parsed by the caller reaches the cache through the context: MISS then HIT with the
// same key as a parse of the body would give, the body never read again, and the tenant still
// the caller's.
func TestWithParsedRequest(t *testing.T) {
	c := mwNew(t, Config{})
	next := &mwJSONHandler{}
	h := c.Middleware(next)
	body := mwChat("hello", `"temperature":0`)
	do := func(auth string) *httptest.ResponseRecorder {
		req, err := prefixkey.Parse(prefixkey.FormatOpenAIChat, body)
		if err != nil {
			t.Fatal(err)
		}
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", failingBody{})
		r.Header.Set("Authorization", auth)
		r = r.WithContext(WithParsedRequest(r.Context(), body, req))
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w
	}
	mwWantXCache(t, do("Bearer a"), XCacheMiss)
	mwWantXCache(t, do("Bearer a"), XCacheHit)
	mwWantXCache(t, do("Bearer b"), XCacheMiss)
	// A request that reads its body as usual finds the entry the handed-over one stored.
	mwWantXCache(t, mwDo(h, "/v1/chat/completions", body, "Authorization", "Bearer a"), XCacheHit)
	if n := next.calls.Load(); n != 2 {
		t.Errorf("the backend saw %d requests, want 2", n)
	}
}
