package respcache

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvroute/kvroute/prefixkey"
)

// mwChat returns an OpenAI chat completions body. extra is spliced in as more top-level members
// (e.g. `"temperature":0.7`).
func mwChat(content string, extra ...string) []byte {
	var b strings.Builder
	b.WriteString(`{"model":"m","messages":[{"role":"user","content":`)
	c, _ := json.Marshal(content)
	b.Write(c)
	b.WriteString(`}]`)
	for _, e := range extra {
		b.WriteString(",")
		b.WriteString(e)
	}
	b.WriteString("}")
	return []byte(b.String())
}

// mwAnthropic returns an Anthropic messages body.
func mwAnthropic(content string, extra ...string) []byte {
	var b strings.Builder
	b.WriteString(`{"model":"claude","max_tokens":64,"messages":[{"role":"user","content":`)
	c, _ := json.Marshal(content)
	b.Write(c)
	b.WriteString(`}]`)
	for _, e := range extra {
		b.WriteString(",")
		b.WriteString(e)
	}
	b.WriteString("}")
	return []byte(b.String())
}

// mwNew makes a Cache for a test; it fails the test on error and closes it at cleanup.
func mwNew(t testing.TB, cfg Config) *Cache {
	t.Helper()
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// mwJSONHandler answers every request with a JSON body naming the request body's length, and
// counts its calls.
type mwJSONHandler struct {
	calls  atomic.Int64
	status int
	bodies chan []byte // when not nil, receives each request body
}

func (h *mwJSONHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := h.calls.Add(1)
	body, _ := io.ReadAll(r.Body)
	if h.bodies != nil {
		h.bodies <- body
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Set-Cookie", "session=secret")
	w.Header().Set("X-Request-Id", "req-"+string(rune('0'+n%10)))
	if h.status != 0 {
		w.WriteHeader(h.status)
	}
	_, _ = w.Write([]byte(`{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hello"}}],"n":` + string(rune('0'+n%10)) + `}`))
}

// mwDo sends one request through h with an httptest recorder.
func mwDo(h http.Handler, path string, body []byte, hdr ...string) *httptest.ResponseRecorder {
	r := httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body))
	for i := 0; i+1 < len(hdr); i += 2 {
		r.Header.Set(hdr[i], hdr[i+1])
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

func mwWantXCache(t *testing.T, w *httptest.ResponseRecorder, want string) {
	t.Helper()
	if got := w.Result().Header.Values(HeaderXCache); len(got) != 1 || got[0] != want {
		t.Fatalf("X-Cache = %q, want [%q]", got, want)
	}
}

func TestHitAfterMissNonStreaming(t *testing.T) {
	c := mwNew(t, Config{})
	next := &mwJSONHandler{}
	h := c.Middleware(next)
	body := mwChat("hi", `"temperature":0`)

	w1 := mwDo(h, "/v1/chat/completions", body)
	mwWantXCache(t, w1, XCacheMiss)
	w2 := mwDo(h, "/v1/chat/completions", body)
	mwWantXCache(t, w2, XCacheHit)
	if next.calls.Load() != 1 {
		t.Fatalf("next called %d times, want 1", next.calls.Load())
	}
	if !bytes.Equal(w1.Body.Bytes(), w2.Body.Bytes()) {
		t.Fatalf("HIT body differs:\n%s\n%s", w1.Body, w2.Body)
	}
	if w2.Code != http.StatusOK || w2.Header().Get("Content-Type") != "application/json" {
		t.Fatalf("HIT status %d content-type %q", w2.Code, w2.Header().Get("Content-Type"))
	}
	if got := w2.Header().Get("Content-Length"); got != strconv.Itoa(w2.Body.Len()) {
		t.Fatalf("Content-Length %s, body %d", got, w2.Body.Len())
	}
	if w2.Header().Get("Set-Cookie") != "" || w2.Header().Get("X-Request-Id") != "" {
		t.Fatalf("HIT replayed a header it must not: %v", w2.Header())
	}
	// Key order and an explicit absent temperature do not matter; the other formats key apart.
	w3 := mwDo(h, "/v1/chat/completions", []byte(`{"temperature":0,"messages":[{"content":"hi","role":"user"}],"model":"m"}`))
	mwWantXCache(t, w3, XCacheHit)
	st := c.Stats(context.Background())
	if st.Requests.Hit != 2 || st.Requests.Miss != 1 || st.Requests.Total != 3 || st.HitRate != "0.6667" {
		t.Fatalf("stats %+v", st.Requests)
	}
}

func TestHeadersSelectionAndConfig(t *testing.T) {
	c := mwNew(t, Config{Headers: []string{"x-model-version"}})
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Model-Version", "v7")
		w.Header().Set("X-Cache", "upstream") // an upstream cache's header is replaced
		_, _ = io.WriteString(w, `{}`)
	})
	h := c.Middleware(next)
	body := mwChat("x", `"temperature":0`)
	mwWantXCache(t, mwDo(h, "/v1/chat/completions", body), XCacheMiss)
	w := mwDo(h, "/v1/chat/completions", body)
	mwWantXCache(t, w, XCacheHit)
	if w.Header().Get("X-Model-Version") != "v7" {
		t.Fatalf("configured header not replayed: %v", w.Header())
	}
	// A stored header replaces what an outer handler had set.
	pre := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		h.ServeHTTP(w, r)
	})
	w = mwDo(pre, "/v1/chat/completions", body)
	if got := w.Header().Values("Content-Type"); len(got) != 1 || got[0] != "application/json" {
		t.Fatalf("HIT Content-Type %q", got)
	}
	for _, bad := range []string{"Set-Cookie", "content-length", "X-Cache", ""} {
		if _, err := New(Config{Headers: []string{bad}}); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("Headers %q: err %v, want ErrInvalidConfig", bad, err)
		}
	}
}

func TestNewValidates(t *testing.T) {
	for name, cfg := range map[string]Config{
		"ttl":               {TTL: -1},
		"max_resp":          {MaxResponseSize: -1},
		"max_stream":        {MaxStreamBufferSize: -1},
		"max_body":          {MaxBodyBytes: -1},
		"too_big":           {MaxStreamBufferSize: 1 << 31},
		"tenant_and_shared": {Tenant: CredentialTenant, SharedAcrossTenants: true},
	} {
		if _, err := New(cfg); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("%s: err %v, want ErrInvalidConfig", name, err)
		}
	}
}

func TestBypass(t *testing.T) {
	long := strings.Repeat("x", 300)
	for _, tc := range []struct {
		name string
		cfg  Config
		path string
		body []byte
	}{
		{name: "temperature=0.7", path: "/v1/chat/completions", body: mwChat("a", `"temperature":0.7`)},
		{name: "n=2", path: "/v1/chat/completions", body: mwChat("a", `"temperature":0`, `"n":2`)},
		{name: "anthropic/temperature=1", path: "/v1/messages", body: mwAnthropic("a", `"temperature":1`)},
		{name: "streaming_disabled", cfg: Config{DisableStreaming: true}, path: "/v1/chat/completions", body: mwChat("a", `"temperature":0`, `"stream":true`)},
		{name: "temperature_absent", path: "/v1/chat/completions", body: mwChat("a")},
		{name: "anthropic/temperature_absent", path: "/v1/messages", body: mwAnthropic("a")},
		{name: "temperature_absent/seed", path: "/v1/chat/completions", body: mwChat("a", `"seed":7`)},
		{name: "greedy_default/n=2", cfg: Config{AssumeGreedyDefault: true}, path: "/v1/chat/completions", body: mwChat("a", `"n":2`)},
		{name: "greedy_default/temperature=0.7", cfg: Config{AssumeGreedyDefault: true}, path: "/v1/chat/completions", body: mwChat("a", `"temperature":0.7`)},
		{name: "parse_error", path: "/v1/chat/completions", body: []byte(`{"model":"m","messages":[{"role":"user","content":`)},
		{name: "not_json", path: "/v1/chat/completions", body: []byte("\x00\xff garbage")},
		{name: "unknown_path", path: "/v1/embeddings", body: mwChat("a", `"temperature":0`)},
		{name: "over_max_body", cfg: Config{MaxBodyBytes: 100}, path: "/v1/chat/completions", body: mwChat(long, `"temperature":0`)},
		{name: "custom_parse_error", cfg: Config{Parse: func(string, []byte) (*prefixkey.Request, error) { return nil, errors.New("no") }}, path: "/v1/chat/completions", body: mwChat("a", `"temperature":0`)},
		{name: "custom_parse_nil", cfg: Config{Parse: func(string, []byte) (*prefixkey.Request, error) { return nil, nil }}, path: "/v1/chat/completions", body: mwChat("a", `"temperature":0`)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := mwNew(t, tc.cfg)
			next := &mwJSONHandler{bodies: make(chan []byte, 2)}
			h := c.Middleware(next)
			for i := range 2 {
				w := mwDo(h, tc.path, tc.body)
				mwWantXCache(t, w, XCacheBypass)
				if got := <-next.bodies; !bytes.Equal(got, tc.body) {
					t.Fatalf("request %d: next got body %q, want %q", i, got, tc.body)
				}
			}
			if next.calls.Load() != 2 {
				t.Fatalf("next called %d times, want 2", next.calls.Load())
			}
			st := c.Stats(context.Background())
			if st.Entries != 0 || st.Requests.Skip != 2 {
				t.Fatalf("entries %d skip %d, want 0 and 2", st.Entries, st.Requests.Skip)
			}
		})
	}
}

func TestBypassNonPOSTAndNoWrite(t *testing.T) {
	c := mwNew(t, Config{})
	h := c.Middleware(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})) // writes nothing
	r := httptest.NewRequest(http.MethodGet, "/v1/chat/completions", nil)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	mwWantXCache(t, w, XCacheBypass)
	// An eligible request whose handler writes nothing still says MISS, and stores nothing.
	w = mwDo(h, "/v1/chat/completions", mwChat("a", `"temperature":0`))
	mwWantXCache(t, w, XCacheMiss)
	w = mwDo(h, "/v1/chat/completions", mwChat("a", `"temperature":0`))
	mwWantXCache(t, w, XCacheMiss)
}

// mwErrBody fails after yielding its prefix.
type mwErrBody struct {
	r      io.Reader
	closed bool
}

func (b *mwErrBody) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	if err == io.EOF {
		return n, io.ErrUnexpectedEOF
	}
	return n, err
}
func (b *mwErrBody) Close() error { b.closed = true; return nil }

func TestBodyReadErrorForwarded(t *testing.T) {
	c := mwNew(t, Config{})
	var got []byte
	var gotErr error
	h := c.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got, gotErr = io.ReadAll(r.Body)
		w.WriteHeader(http.StatusBadRequest)
	}))
	body := mwChat("abc", `"temperature":0`)
	eb := &mwErrBody{r: bytes.NewReader(body)}
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", eb)
	r.ContentLength = -1
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	mwWantXCache(t, w, XCacheBypass)
	if !bytes.Equal(got, body) || !errors.Is(gotErr, io.ErrUnexpectedEOF) {
		t.Fatalf("next read %q, %v; want the body then the same error", got, gotErr)
	}
}

func TestBodyRestoredWithGetBody(t *testing.T) {
	c := mwNew(t, Config{})
	body := mwChat("restore me", `"temperature":0`)
	h := c.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b1, _ := io.ReadAll(r.Body)
		rc, err := r.GetBody()
		if err != nil {
			t.Error(err)
			return
		}
		b2, _ := io.ReadAll(rc)
		if !bytes.Equal(b1, body) || !bytes.Equal(b2, body) || r.ContentLength != int64(len(body)) {
			t.Errorf("body %q getbody %q len %d", b1, b2, r.ContentLength)
		}
	}))
	mwDo(h, "/v1/chat/completions", body)
}

func TestNon200NotStored(t *testing.T) {
	for _, status := range []int{http.StatusInternalServerError, http.StatusTooManyRequests, http.StatusCreated} {
		t.Run(http.StatusText(status), func(t *testing.T) {
			c := mwNew(t, Config{})
			next := &mwJSONHandler{status: status}
			h := c.Middleware(next)
			for range 2 {
				w := mwDo(h, "/v1/chat/completions", mwChat("a", `"temperature":0`))
				mwWantXCache(t, w, XCacheMiss)
				if w.Code != status {
					t.Fatalf("status %d, want %d", w.Code, status)
				}
			}
			if next.calls.Load() != 2 {
				t.Fatalf("next called %d times", next.calls.Load())
			}
		})
	}
}

func TestTooLargeOrShortOrEncodedNotStored(t *testing.T) {
	for _, tc := range []struct {
		name  string
		write func(w http.ResponseWriter)
	}{
		{"over_max_response_size", func(w http.ResponseWriter) { _, _ = w.Write(bytes.Repeat([]byte("x"), 200)) }},
		{"content_length_over", func(w http.ResponseWriter) {
			w.Header().Set("Content-Length", "200")
			_, _ = w.Write(bytes.Repeat([]byte("x"), 200))
		}},
		{"short_of_content_length", func(w http.ResponseWriter) {
			w.Header().Set("Content-Length", "50")
			_, _ = w.Write([]byte("short"))
		}},
		{"gzip", func(w http.ResponseWriter) {
			w.Header().Set("Content-Encoding", "gzip")
			_, _ = w.Write([]byte("\x1f\x8b"))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := mwNew(t, Config{MaxResponseSize: 100})
			var calls atomic.Int64
			h := c.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				calls.Add(1)
				tc.write(w)
			}))
			for range 2 {
				mwWantXCache(t, mwDo(h, "/v1/chat/completions", mwChat("a", `"temperature":0`)), XCacheMiss)
			}
			if calls.Load() != 2 {
				t.Fatalf("next called %d times, want 2", calls.Load())
			}
		})
	}
}

func TestTenantSeparatesEntries(t *testing.T) {
	c := mwNew(t, Config{Tenant: func(r *http.Request) string { return r.Header.Get("X-Tenant") }})
	next := &mwJSONHandler{}
	h := c.Middleware(next)
	body := mwChat("same prompt", `"temperature":0`)
	mwWantXCache(t, mwDo(h, "/v1/chat/completions", body, "X-Tenant", "a"), XCacheMiss)
	mwWantXCache(t, mwDo(h, "/v1/chat/completions", body, "X-Tenant", "b"), XCacheMiss)
	mwWantXCache(t, mwDo(h, "/v1/chat/completions", body), XCacheMiss)
	mwWantXCache(t, mwDo(h, "/v1/chat/completions", body, "X-Tenant", "a"), XCacheHit)
	mwWantXCache(t, mwDo(h, "/v1/chat/completions", body, "X-Tenant", "b"), XCacheHit)
	if next.calls.Load() != 3 {
		t.Fatalf("next called %d times, want 3", next.calls.Load())
	}
	// KeyFor with the tenant set finds tenant a's entry.
	req, err := prefixkey.ParseOpenAIChat(body)
	if err != nil {
		t.Fatal(err)
	}
	req.Tenant = "a"
	if _, ok, _ := c.store.Get(context.Background(), KeyFor(req)); !ok {
		t.Fatal("KeyFor(tenant a) not in the store")
	}
}

// mwFailStore fails every call.
type mwFailStore struct{ calls atomic.Int64 }

var errMWStore = errors.New("store down")

func (s *mwFailStore) Get(context.Context, string) ([]byte, bool, error) {
	s.calls.Add(1)
	return nil, false, errMWStore
}
func (s *mwFailStore) Set(context.Context, string, []byte, time.Duration) error {
	s.calls.Add(1)
	return errMWStore
}
func (s *mwFailStore) Delete(context.Context, string) error { s.calls.Add(1); return errMWStore }
func (s *mwFailStore) Clear(context.Context) (int, error)   { s.calls.Add(1); return 0, errMWStore }
func (s *mwFailStore) Stats(context.Context) StoreStats {
	return StoreStats{Backend: "fail", Entries: -1, Errors: map[string]uint64{"other": 1}}
}

func TestFailingStore(t *testing.T) {
	for _, coalesce := range []bool{true, false} {
		t.Run("coalesce="+jsonBool(coalesce), func(t *testing.T) {
			store := &mwFailStore{}
			c := mwNew(t, Config{Store: store, DisableCoalescing: !coalesce})
			next := &mwJSONHandler{}
			h := c.Middleware(next)
			for range 3 {
				w := mwDo(h, "/v1/chat/completions", mwChat("a", `"temperature":0`))
				mwWantXCache(t, w, XCacheMiss)
				if w.Code != http.StatusOK || !strings.Contains(w.Body.String(), "hello") {
					t.Fatalf("response %d %q", w.Code, w.Body)
				}
			}
			st := c.Stats(context.Background())
			if st.StoreErrors["get"] != 3 || st.StoreErrors["set"] != 3 || st.Requests.Miss != 3 {
				t.Fatalf("store errors %v requests %+v", st.StoreErrors, st.Requests)
			}
			if st.Entries != -1 || st.BackendErrors["other"] != 1 {
				t.Fatalf("entries %d backend errors %v", st.Entries, st.BackendErrors)
			}
			if _, err := c.Invalidate(context.Background(), InvalidateRequest{ClearAll: true}); !errors.Is(err, errMWStore) {
				t.Fatalf("Invalidate err %v", err)
			}
			if _, err := c.Invalidate(context.Background(), InvalidateRequest{Key: strings.Repeat("ab", 32)}); !errors.Is(err, errMWStore) {
				t.Fatalf("Invalidate key err %v", err)
			}
		})
	}
}

func jsonBool(b bool) string {
	if b {
		return "true"
	}
	return "false"
}

func TestCorruptEntryIsAMiss(t *testing.T) {
	c := mwNew(t, Config{})
	next := &mwJSONHandler{}
	h := c.Middleware(next)
	body := mwChat("corrupt", `"temperature":0`)
	req, _ := prefixkey.ParseOpenAIChat(body)
	key := KeyFor(req)
	ctx := context.Background()
	for _, v := range [][]byte{nil, []byte("garbage"), bytes.Repeat([]byte{0xff}, 64)} {
		if err := c.store.Set(ctx, key, v, 0); err != nil {
			t.Fatal(err)
		}
		mwWantXCache(t, mwDo(h, "/v1/chat/completions", body), XCacheMiss)
		mwWantXCache(t, mwDo(h, "/v1/chat/completions", body), XCacheHit) // the MISS stored a good one
	}
	// A stored entry with one bit flipped is a miss.
	v, _, _ := c.store.Get(ctx, key)
	v[len(v)/2] ^= 1
	_ = c.store.Set(ctx, key, v, 0)
	mwWantXCache(t, mwDo(h, "/v1/chat/completions", body), XCacheMiss)
	if got := c.Stats(ctx).StoreErrors["corrupt"]; got != 4 {
		t.Fatalf("corrupt count %d, want 4", got)
	}
}

func TestInvalidate(t *testing.T) {
	c := mwNew(t, Config{})
	h := c.Middleware(&mwJSONHandler{})
	ctx := context.Background()
	for _, s := range []string{"a", "b", "c"} {
		mwDo(h, "/v1/chat/completions", mwChat(s, `"temperature":0`))
	}
	req, _ := prefixkey.ParseOpenAIChat(mwChat("b", `"temperature":0`))
	res, err := c.Invalidate(ctx, InvalidateRequest{Key: KeyFor(req)})
	if err != nil || res != (InvalidateResult{Success: true, Action: "delete_key", ClearedEntries: 1}) {
		t.Fatalf("Invalidate key: %+v, %v", res, err)
	}
	res, _ = c.Invalidate(ctx, InvalidateRequest{Key: KeyFor(req)})
	if res.ClearedEntries != 0 {
		t.Fatalf("second delete cleared %d", res.ClearedEntries)
	}
	mwWantXCache(t, mwDo(h, "/v1/chat/completions", mwChat("a", `"temperature":0`)), XCacheHit)
	mwWantXCache(t, mwDo(h, "/v1/chat/completions", mwChat("b", `"temperature":0`)), XCacheMiss)
	res, err = c.Invalidate(ctx, InvalidateRequest{ClearAll: true})
	if err != nil || res != (InvalidateResult{Success: true, Action: "clear_all", ClearedEntries: 3}) {
		t.Fatalf("Invalidate clear_all: %+v, %v", res, err)
	}
	mwWantXCache(t, mwDo(h, "/v1/chat/completions", mwChat("a", `"temperature":0`)), XCacheMiss)
	if _, err := c.Invalidate(ctx, InvalidateRequest{}); !errors.Is(err, ErrEmptyInvalidate) {
		t.Fatalf("empty Invalidate err %v", err)
	}
	// The admin endpoint's wire form.
	var ir InvalidateRequest
	if err := json.Unmarshal([]byte(`{ "clear_all": true }`), &ir); err != nil || !ir.ClearAll {
		t.Fatal(ir, err)
	}
	out, _ := json.Marshal(InvalidateResult{Success: true, Action: "clear_all", ClearedEntries: 1243})
	if string(out) != `{"success":true,"action":"clear_all","cleared_entries":1243}` {
		t.Fatal(string(out))
	}
}

// TestInvalidateDuringRecording: a response whose recording spans an Invalidate is not kept.
func TestInvalidateDuringRecording(t *testing.T) {
	c := mwNew(t, Config{})
	release := make(chan struct{})
	h := c.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-release
		_, _ = io.WriteString(w, "{}")
	}))
	done := make(chan struct{})
	go func() { defer close(done); mwDo(h, "/v1/chat/completions", mwChat("a", `"temperature":0`)) }()
	mwWaitFlights(t, c, 1)
	if _, err := c.Invalidate(context.Background(), InvalidateRequest{ClearAll: true}); err != nil {
		t.Fatal(err)
	}
	close(release)
	<-done
	if n := c.Stats(context.Background()).Entries; n != 0 {
		t.Fatalf("%d entries after an invalidation during recording", n)
	}
}

// mwWaitFlights waits until the cache has n flights in progress.
func mwWaitFlights(t testing.TB, c *Cache, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c.mu.Lock()
		got := len(c.flights)
		c.mu.Unlock()
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d flights, want %d", got, n)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestEntryRoundTrip(t *testing.T) {
	for _, e := range []*storedResponse{
		{status: 200, body: []byte(`{"a":1}`), header: []string{"Content-Type", "application/json"}},
		{status: 200, stream: true, body: []byte("data: x\n\ndata: [DONE]\n\n"), header: []string{"Content-Type", "text/event-stream", "Content-Type", "second"}},
		{status: 299},
	} {
		v := encodeEntry(e)
		got, err := decodeEntry(v)
		if err != nil {
			t.Fatal(err)
		}
		if got.status != e.status || got.stream != e.stream || !bytes.Equal(got.body, e.body) || strings.Join(got.header, "|") != strings.Join(e.header, "|") {
			t.Fatalf("round trip %+v → %+v", e, got)
		}
		for i := range v { // every truncation is corrupt
			if _, err := decodeEntry(v[:i]); err == nil {
				t.Fatalf("truncated to %d decoded", i)
			}
		}
		if _, err := decodeEntry(append(v[:len(v):len(v)], 0)); err == nil {
			t.Fatal("trailing byte decoded")
		}
	}
}

// TestEntryGolden pins the envelope's layout: stores shared across versions depend on it.
func TestEntryGolden(t *testing.T) {
	v := encodeEntry(&storedResponse{status: 200, stream: true, header: []string{"Content-Type", "text/event-stream"}, body: []byte("data: [DONE]\n\n")})
	const want = "4b56524301" + "01" + "00c8" + "0001" + "0c" + "436f6e74656e742d54797065" + "11" + "746578742f6576656e742d73747265616d" + "0000000e" + "646174613a205b444f4e455d0a0a"
	got := strings.ToLower(hexOf(v[:len(v)-4]))
	if got != want {
		t.Fatalf("envelope\n got %s\nwant %s", got, want)
	}
}

func hexOf(b []byte) string {
	const digits = "0123456789abcdef"
	out := make([]byte, 0, 2*len(b))
	for _, c := range b {
		out = append(out, digits[c>>4], digits[c&15])
	}
	return string(out)
}

func FuzzDecodeEntry(f *testing.F) {
	f.Add(encodeEntry(&storedResponse{status: 200, header: []string{"Content-Type", "a"}, body: []byte("b")}))
	f.Add([]byte("KVRC\x01\x00\x00\xc8\xff\xff"))
	f.Fuzz(func(t *testing.T, v []byte) {
		e, err := decodeEntry(v)
		if err != nil {
			return
		}
		// A decodable value re-encodes to itself.
		if w := encodeEntry(e); !bytes.Equal(w, v) {
			t.Fatalf("re-encoding differs:\n%x\n%x", v, w)
		}
	})
}

// TestRecorderPassesThroughInterfaces: ResponseController reaches the server's writer through
// Unwrap, and Flush works on a writer that only ResponseController can flush.
func TestRecorderPassesThroughInterfaces(t *testing.T) {
	c := mwNew(t, Config{})
	var deadlineErr error
	srv := httptest.NewServer(c.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		deadlineErr = rc.SetWriteDeadline(time.Now().Add(time.Minute))
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, "{}")
		if err := rc.Flush(); err != nil {
			t.Error(err)
		}
	})))
	defer srv.Close()
	resp, err := http.Post(srv.URL+"/v1/chat/completions", "application/json", bytes.NewReader(mwChat("a", `"temperature":0`)))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if deadlineErr != nil {
		t.Fatalf("SetWriteDeadline through the recorder: %v", deadlineErr)
	}
	if resp.Header.Get(HeaderXCache) != XCacheMiss {
		t.Fatalf("X-Cache %q", resp.Header.Get(HeaderXCache))
	}
}

// TestPanicInHandlerPropagates: the handler's panic reaches the server unchanged and nothing is
// stored.
func TestPanicInHandlerPropagates(t *testing.T) {
	c := mwNew(t, Config{})
	h := c.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "{")
		panic("boom")
	}))
	func() {
		defer func() {
			if p := recover(); p != "boom" {
				t.Fatalf("recovered %v, want boom", p)
			}
		}()
		mwDo(h, "/v1/chat/completions", mwChat("a", `"temperature":0`))
	}()
	if n := c.Stats(context.Background()).Entries; n != 0 {
		t.Fatalf("%d entries after a panic", n)
	}
	mwWaitFlights(t, c, 0)
}

// mwDiscardWriter is a reusable ResponseWriter that keeps nothing.
type mwDiscardWriter struct {
	h    http.Header
	code int
}

func (w *mwDiscardWriter) Header() http.Header         { return w.h }
func (w *mwDiscardWriter) WriteHeader(code int)        { w.code = code }
func (w *mwDiscardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w *mwDiscardWriter) Flush()                      {}

// TestHitAllocs bounds the allocations of a HIT: the body read, the parse (prefixkey's arenas),
// the key's hex, the store's copy, the decoded entry and its header strings.
func TestHitAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates")
	}
	for _, tc := range []struct {
		stream bool
		max    float64
	}{{false, 16}, {true, 14}} {
		c := mwNew(t, Config{})
		h := c.Middleware(mwBenchHandler(1024, tc.stream))
		r, rewind := mwBenchRequest(1024, tc.stream, "0")
		w := &mwDiscardWriter{h: http.Header{}}
		rewind()
		h.ServeHTTP(w, r)
		allocs := testing.AllocsPerRun(200, func() {
			rewind()
			clear(w.h)
			h.ServeHTTP(w, r)
		})
		if w.h.Get(HeaderXCache) != XCacheHit {
			t.Fatal("not a HIT")
		}
		t.Logf("stream=%v: %.0f allocs per HIT", tc.stream, allocs)
		if allocs > tc.max {
			t.Errorf("stream=%v: %.0f allocs per HIT, want ≤ %.0f", tc.stream, allocs, tc.max)
		}
	}
}
