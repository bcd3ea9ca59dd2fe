package respcache

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"log"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	neturl "net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// Stream shapes, as the engines send them.
var (
	mwOpenAIEvents = []string{
		"data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n",
		"data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n",
		"data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"},\"finish_reason\":\"stop\"}]}\n\n",
		"data: [DONE]\n\n",
	}
	mwAnthropicEvents = []string{
		"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"role\":\"assistant\",\"content\":[]}}\n\n",
		"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
		"event: ping\ndata: {\"type\": \"ping\"}\n\n",
		"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n\n",
		"event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
		"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"}}\n\n",
		"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
	}
)

func TestSSEScanner(t *testing.T) {
	for _, tc := range []struct {
		name   string
		stream string
		want   bool
	}{
		{"openai", strings.Join(mwOpenAIEvents, ""), true},
		{"anthropic", strings.Join(mwAnthropicEvents, ""), true},
		{"openai/crlf", strings.ReplaceAll(strings.Join(mwOpenAIEvents, ""), "\n", "\r\n"), true},
		{"openai/cr", strings.ReplaceAll(strings.Join(mwOpenAIEvents, ""), "\n", "\r"), true},
		{"no_space", "data:[DONE]\n\n", true},
		{"done_then_more", "data: [DONE]\n\n: keep-alive\n\n", true},
		{"empty", "", false},
		{"no_done", strings.Join(mwOpenAIEvents[:3], ""), false},
		{"done_not_dispatched", "data: x\n\ndata: [DONE]\n", false},
		{"done_two_data_lines", "data: x\ndata: [DONE]\n\n", false},
		{"done_with_suffix", "data: [DONE] \n\n", false},
		{"done_in_comment", ": data: [DONE]\n\n", false},
		{"done_field_name", "[DONE]\n\n", false},
		{"anthropic/no_stop", strings.Join(mwAnthropicEvents[:6], ""), false},
		{"anthropic/stop_not_dispatched", strings.Join(mwAnthropicEvents[:6], "") + "event: message_stop\ndata: {}\n", false},
		{"anthropic/error", strings.Join(mwAnthropicEvents[:2], "") + "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\"}}\n\n" + mwAnthropicEvents[6], false},
		{"openai/error_then_done", mwOpenAIEvents[0] + "data: {\"error\": {\"message\": \"boom\"}}\n\ndata: [DONE]\n\n", false},
		{"openai/error_spaced", "data: { \"error\" : 1}\n\ndata: [DONE]\n\n", false},
		{"openai/long_line", "data: " + strings.Repeat("x", 500) + "\n\ndata: [DONE]\n\n", true},
		{"long_line_ending_in_done", "data: " + strings.Repeat("x", 500) + "[DONE]\n\n", false},
		{"event_overridden", "event: message_stop\nevent: other\ndata: {}\n\n", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Whole, byte by byte, and in random pieces: the same verdict.
			var whole sseScanner
			whole.feed([]byte(tc.stream))
			if whole.complete() != tc.want {
				t.Fatalf("whole: complete %v, want %v", whole.complete(), tc.want)
			}
			var bytewise sseScanner
			for i := range len(tc.stream) {
				bytewise.feed([]byte{tc.stream[i]})
			}
			if bytewise.complete() != tc.want {
				t.Fatalf("byte by byte: complete %v, want %v", bytewise.complete(), tc.want)
			}
			rng := rand.New(rand.NewPCG(1, 2))
			for range 20 {
				var s sseScanner
				for p := []byte(tc.stream); len(p) > 0; {
					n := 1 + rng.IntN(len(p))
					s.feed(p[:n])
					p = p[n:]
				}
				if s.complete() != tc.want {
					t.Fatalf("random pieces: complete %v, want %v", s.complete(), tc.want)
				}
			}
		})
	}
}

func FuzzSSEScanner(f *testing.F) {
	f.Add([]byte(strings.Join(mwOpenAIEvents, "")), uint8(3))
	f.Add([]byte(strings.Join(mwAnthropicEvents, "")), uint8(7))
	f.Add([]byte("data: [DONE]\r\n\r\n"), uint8(1))
	f.Fuzz(func(t *testing.T, b []byte, step uint8) {
		var whole, pieces sseScanner
		whole.feed(b)
		n := int(step) + 1
		for p := b; len(p) > 0; {
			k := min(n, len(p))
			pieces.feed(p[:k])
			p = p[k:]
		}
		if whole != pieces {
			t.Fatalf("state depends on the split: %+v vs %+v", whole, pieces)
		}
		// nextEvent splits b into pieces that concatenate back to b.
		var out []byte
		for rest := b; len(rest) > 0; {
			k := nextEvent(rest)
			if k <= 0 || k > len(rest) {
				t.Fatalf("nextEvent = %d of %d", k, len(rest))
			}
			out = append(out, rest[:k]...)
			rest = rest[k:]
		}
		if !bytes.Equal(out, b) {
			t.Fatal("events do not concatenate back to the stream")
		}
	})
}

func TestNextEvent(t *testing.T) {
	s := "data: a\n\nevent: x\r\ndata: b\r\n\r\ndata: c\r\rtail"
	var got []string
	for b := []byte(s); len(b) > 0; {
		n := nextEvent(b)
		got = append(got, string(b[:n]))
		b = b[n:]
	}
	want := []string{"data: a\n\n", "event: x\r\ndata: b\r\n\r\n", "data: c\r\r", "tail"}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("events %q, want %q", got, want)
	}
}

// mwStreamHandler streams events as an engine does: Content-Type text/event-stream, one Write and
// one Flush per event. After the first event it blocks until the test says it has read that event
// on the client side (gate), proving the event was not held back by the middleware.
type mwStreamHandler struct {
	events []string
	gate   chan struct{} // nil: no wait
	calls  atomic.Int64
	split  bool // write each event in two pieces (across the boundary of lines)
}

func (h *mwStreamHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h.calls.Add(1)
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	flusher := w.(http.Flusher)
	for i, ev := range h.events {
		if h.split && len(ev) > 3 {
			_, _ = io.WriteString(w, ev[:len(ev)-3])
			_, _ = io.WriteString(w, ev[len(ev)-3:])
		} else {
			_, _ = io.WriteString(w, ev)
		}
		flusher.Flush()
		if i == 0 && h.gate != nil {
			select {
			case <-h.gate:
			case <-r.Context().Done():
				return
			case <-time.After(10 * time.Second):
				panic("test did not read the first event: the middleware buffered it")
			}
		}
	}
}

// mwReadStream posts body to url and reads the SSE response. When gate is not nil it is closed
// as soon as the first event (up to its blank line) arrived.
func mwReadStream(t *testing.T, url string, body []byte, first string, gate chan struct{}) (*http.Response, []byte) {
	t.Helper()
	resp, err := mwClient.Post(url, "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	var got []byte
	if gate != nil {
		for !bytes.Equal(got, []byte(first)) {
			line, err := br.ReadBytes('\n')
			got = append(got, line...)
			if err != nil || len(got) > len(first) {
				t.Fatalf("first event: read %q, %v", got, err)
			}
		}
		close(gate)
	}
	rest, err := io.ReadAll(br)
	if err != nil {
		t.Fatalf("reading the stream: %v", err)
	}
	return resp, append(got, rest...)
}

func TestStreamingHitAfterMiss(t *testing.T) {
	for _, tc := range []struct {
		name   string
		path   string
		body   []byte
		events []string
		split  bool
	}{
		{"openai", "/v1/chat/completions", mwChat("stream me", `"temperature":0`, `"stream":true`), mwOpenAIEvents, false},
		{"openai/split_writes", "/v1/chat/completions", mwChat("stream me", `"temperature":0`, `"stream":true`), mwOpenAIEvents, true},
		{"anthropic", "/v1/messages", mwAnthropic("stream me", `"temperature":0`, `"stream":true`), mwAnthropicEvents, false},
		{"completions", "/v1/completions", []byte(`{"model":"m","prompt":"p","stream":true,"temperature":0}`), mwOpenAIEvents, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, coalesce := range []bool{true, false} {
				c := mwNew(t, Config{DisableCoalescing: !coalesce})
				next := &mwStreamHandler{events: tc.events, gate: make(chan struct{}), split: tc.split}
				srv := httptest.NewServer(c.Middleware(next))
				want := strings.Join(tc.events, "")

				resp, got := mwReadStream(t, srv.URL+tc.path, tc.body, tc.events[0], next.gate)
				if resp.Header.Get(HeaderXCache) != XCacheMiss || string(got) != want {
					t.Fatalf("MISS: X-Cache %q body\n%q\nwant\n%q", resp.Header.Get(HeaderXCache), got, want)
				}
				resp, got = mwReadStream(t, srv.URL+tc.path, tc.body, "", nil)
				if resp.Header.Get(HeaderXCache) != XCacheHit || string(got) != want {
					t.Fatalf("HIT: X-Cache %q body\n%q\nwant\n%q", resp.Header.Get(HeaderXCache), got, want)
				}
				if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
					t.Fatalf("HIT Content-Type %q", ct)
				}
				if cc := resp.Header.Get("Cache-Control"); cc != "no-cache" {
					t.Fatalf("HIT Cache-Control %q, want no-cache", cc)
				}
				if next.calls.Load() != 1 {
					t.Fatalf("next called %d times", next.calls.Load())
				}
				srv.Close()

				// The replay writes and flushes one event at a time.
				fw := &mwFlushLog{ResponseRecorder: httptest.NewRecorder()}
				c.Middleware(next).ServeHTTP(fw, httptest.NewRequest(http.MethodPost, tc.path, bytes.NewReader(tc.body)))
				if strings.Join(fw.flushed, "") != want || len(fw.flushed) != len(tc.events) {
					t.Fatalf("replay flushed %d pieces %q, want the %d events", len(fw.flushed), fw.flushed, len(tc.events))
				}
			}
		})
	}
}

// mwFlushLog records what was written between flushes.
type mwFlushLog struct {
	*httptest.ResponseRecorder
	pending bytes.Buffer
	flushed []string
}

func (f *mwFlushLog) Write(p []byte) (int, error) {
	f.pending.Write(p)
	return f.ResponseRecorder.Write(p)
}

func (f *mwFlushLog) Flush() {
	f.flushed = append(f.flushed, f.pending.String())
	f.pending.Reset()
	f.ResponseRecorder.Flush()
}

func TestIncompleteStreamNotStored(t *testing.T) {
	for name, events := range map[string][]string{
		"openai_no_done":      mwOpenAIEvents[:3],
		"anthropic_no_stop":   mwAnthropicEvents[:6],
		"openai_error":        {mwOpenAIEvents[0], "data: {\"error\":{\"message\":\"engine died\"}}\n\n", "data: [DONE]\n\n"},
		"done_not_dispatched": {mwOpenAIEvents[0], "data: [DONE]\n"},
	} {
		t.Run(name, func(t *testing.T) {
			c := mwNew(t, Config{})
			next := &mwStreamHandler{events: events}
			h := c.Middleware(next)
			want := strings.Join(events, "")
			for range 2 {
				w := mwDo(h, "/v1/chat/completions", mwChat("a", `"temperature":0`, `"stream":true`))
				mwWantXCache(t, w, XCacheMiss)
				if w.Body.String() != want {
					t.Fatalf("body %q, want %q", w.Body, want)
				}
			}
			if next.calls.Load() != 2 {
				t.Fatalf("next called %d times, want 2", next.calls.Load())
			}
		})
	}
}

func TestStreamOverCapDeliveredNotStored(t *testing.T) {
	events := []string{}
	for i := range 50 {
		events = append(events, "data: {\"i\":"+strings.Repeat("9", 60)+"}\n\n")
		_ = i
	}
	events = append(events, "data: [DONE]\n\n")
	want := strings.Join(events, "")
	c := mwNew(t, Config{MaxStreamBufferSize: 1024})
	next := &mwStreamHandler{events: events}
	srv := httptest.NewServer(c.Middleware(next))
	defer srv.Close()
	for range 2 {
		resp, got := mwReadStream(t, srv.URL+"/v1/chat/completions", mwChat("big", `"temperature":0`, `"stream":true`), "", nil)
		if string(got) != want || resp.Header.Get(HeaderXCache) != XCacheMiss {
			t.Fatalf("X-Cache %q, got %d bytes, want %d", resp.Header.Get(HeaderXCache), len(got), len(want))
		}
	}
	if next.calls.Load() != 2 {
		t.Fatalf("next called %d times, want 2", next.calls.Load())
	}
	// Within the cap it is stored.
	c2 := mwNew(t, Config{MaxStreamBufferSize: len(want)})
	h2 := c2.Middleware(next)
	mwWantXCache(t, mwDo(h2, "/v1/chat/completions", mwChat("big", `"temperature":0`, `"stream":true`)), XCacheMiss)
	mwWantXCache(t, mwDo(h2, "/v1/chat/completions", mwChat("big", `"temperature":0`, `"stream":true`)), XCacheHit)
}

// TestStreamingAndNonStreamingKeyApart: the same prompt with and without stream are two entries.
func TestStreamingAndNonStreamingKeyApart(t *testing.T) {
	c := mwNew(t, Config{})
	sh := &mwStreamHandler{events: mwOpenAIEvents}
	jh := &mwJSONHandler{}
	h := c.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if bytes.Contains(b, []byte(`"stream":true`)) {
			sh.ServeHTTP(w, r)
		} else {
			jh.ServeHTTP(w, r)
		}
	}))
	mwDo(h, "/v1/chat/completions", mwChat("p", `"temperature":0`, `"stream":true`))
	mwDo(h, "/v1/chat/completions", mwChat("p", `"temperature":0`))
	w := mwDo(h, "/v1/chat/completions", mwChat("p", `"temperature":0`, `"stream":true`))
	mwWantXCache(t, w, XCacheHit)
	if w.Body.String() != strings.Join(mwOpenAIEvents, "") {
		t.Fatalf("stream HIT body %q", w.Body)
	}
	w = mwDo(h, "/v1/chat/completions", mwChat("p", `"temperature":0`))
	mwWantXCache(t, w, XCacheHit)
	if !strings.HasPrefix(w.Body.String(), `{"id"`) {
		t.Fatalf("JSON HIT body %q", w.Body)
	}
}

// TestStreamContextCancelStopsHandler: without waiters, a leader whose client leaves cancels its
// handler as it would without the middleware.
func TestStreamContextCancelStopsHandler(t *testing.T) {
	c := mwNew(t, Config{})
	stopped := make(chan struct{})
	h := c.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, mwOpenAIEvents[0])
		w.(http.Flusher).Flush()
		<-r.Context().Done()
		close(stopped)
	}))
	ctx, cancel := context.WithCancel(context.Background())
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(mwChat("a", `"temperature":0`, `"stream":true`))).WithContext(ctx)
	done := make(chan struct{})
	go func() { defer close(done); h.ServeHTTP(httptest.NewRecorder(), r) }()
	mwWaitFlights(t, c, 1)
	cancel()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("handler not cancelled")
	}
	<-done
}

// mwHoldHandler writes a complete stream, flushes, then holds the response open until the request
// context ends, as httputil.ReverseProxy does while it waits for the upstream to close, and then
// ends the way end says: "return" returns, "write" writes keep-alive comments until a write fails,
// "abort" panics with http.ErrAbortHandler (ReverseProxy on a failed copy). When cut is positive,
// only the first cut events are written before the hold and the rest after it. Only the first call
// holds: later ones write the whole stream and return.
type mwHoldHandler struct {
	events []string
	cut    int
	end    string
	calls  atomic.Int64
}

func (h *mwHoldHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := h.calls.Add(1)
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	if n > 1 {
		_, _ = io.WriteString(w, strings.Join(h.events, "")) // later calls answer at once
		return
	}
	cut := len(h.events)
	if h.cut > 0 {
		cut = h.cut
	}
	for _, ev := range h.events[:cut] {
		_, _ = io.WriteString(w, ev)
		w.(http.Flusher).Flush()
	}
	select {
	case <-r.Context().Done():
	case <-time.After(10 * time.Second):
		panic("the client's leaving did not cancel the handler's context")
	}
	for _, ev := range h.events[cut:] { // a handler that ignores the cancellation
		_, _ = io.WriteString(w, ev)
		w.(http.Flusher).Flush()
	}
	switch h.end {
	case "write":
		for range 1000 {
			if _, err := io.WriteString(w, ": keep-alive\n\n"); err != nil {
				return
			}
			if err := http.NewResponseController(w).Flush(); err != nil {
				return
			}
			time.Sleep(time.Millisecond)
		}
		panic("writes to a gone client kept succeeding")
	case "abort":
		panic(http.ErrAbortHandler)
	}
}

// mwReadUntilClose posts body to url, reads the SSE response up to and including the first event
// that contains marker, and closes the connection at once, as the OpenAI and Anthropic SDKs do.
func mwReadUntilClose(t *testing.T, url string, body []byte, marker string) (xcache string, got []byte) {
	t.Helper()
	resp, err := mwClient.Post(url, "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	var ev []byte
	for {
		line, err := br.ReadBytes('\n')
		got = append(got, line...)
		ev = append(ev, line...)
		if err != nil {
			t.Fatalf("read %q: %v", got, err)
		}
		if string(line) == "\n" {
			if bytes.Contains(ev, []byte(marker)) {
				return resp.Header.Get(HeaderXCache), got
			}
			ev = ev[:0]
		}
	}
}

// TestStreamStoredWhenClientLeavesAfterFinalEvent: the SDKs close the connection as soon as they
// read the terminal event; the handler then sees its context cancelled (and a proxy aborts, or a
// write fails). The recording is complete and must be stored all the same.
func TestStreamStoredWhenClientLeavesAfterFinalEvent(t *testing.T) {
	for _, fm := range []struct {
		name, path string
		body       []byte
		events     []string
		marker     string
	}{
		{"openai", "/v1/chat/completions", mwChat("leave", `"temperature":0`, `"stream":true`), mwOpenAIEvents, "data: [DONE]"},
		{"anthropic", "/v1/messages", mwAnthropic("leave", `"temperature":0`, `"stream":true`), mwAnthropicEvents, "event: message_stop"},
	} {
		for _, end := range []string{"return", "write", "abort", "proxy"} {
			for _, coalesce := range []bool{true, false} {
				name := fm.name + "/" + end
				if !coalesce {
					name += "/no_coalescing"
				}
				t.Run(name, func(t *testing.T) {
					c := mwNew(t, Config{DisableCoalescing: !coalesce})
					hold := &mwHoldHandler{events: fm.events, end: end}
					var next http.Handler = hold
					if end == "proxy" {
						hold.end = "return"
						up := httptest.NewServer(hold)
						defer up.Close()
						u, _ := neturl.Parse(up.URL)
						next = httputil.NewSingleHostReverseProxy(u)
					}
					served := make(chan struct{}, 4)
					mw := c.Middleware(next)
					srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
						defer func() { served <- struct{}{} }()
						mw.ServeHTTP(w, r)
					}))
					srv.Config.ErrorLog = log.New(io.Discard, "", 0)
					defer srv.Close()
					want := strings.Join(fm.events, "")

					xc, got := mwReadUntilClose(t, srv.URL+fm.path, fm.body, fm.marker)
					if xc != XCacheMiss || string(got) != want {
						t.Fatalf("first: X-Cache %q body\n%q\nwant\n%q", xc, got, want)
					}
					select {
					case <-served:
					case <-time.After(10 * time.Second):
						t.Fatal("the middleware did not return after the client left")
					}
					resp, got := mwReadStream(t, srv.URL+fm.path, fm.body, "", nil)
					if xc := resp.Header.Get(HeaderXCache); xc != XCacheHit || string(got) != want {
						t.Fatalf("second: X-Cache %q body\n%q\nwant\n%q", xc, got, want)
					}
					if n := hold.calls.Load(); n != 1 {
						t.Fatalf("handler called %d times, want 1", n)
					}
				})
			}
		}
	}
}

// TestStreamNotStoredWhenClientLeavesBeforeFinalEvent: a client that leaves before the terminal
// event leaves an incomplete recording, never stored, even if the handler writes the rest after
// its context ended.
func TestStreamNotStoredWhenClientLeavesBeforeFinalEvent(t *testing.T) {
	for _, fm := range []struct {
		name, path string
		body       []byte
		events     []string
		marker     string
	}{
		{"openai", "/v1/chat/completions", mwChat("early", `"temperature":0`, `"stream":true`), mwOpenAIEvents, "Hel"},
		{"anthropic", "/v1/messages", mwAnthropic("early", `"temperature":0`, `"stream":true`), mwAnthropicEvents, "content_block_start"},
	} {
		for _, end := range []string{"return", "write", "abort", "proxy"} {
			for _, coalesce := range []bool{true, false} {
				name := fm.name + "/" + end
				if !coalesce {
					name += "/no_coalescing"
				}
				t.Run(name, func(t *testing.T) {
					c := mwNew(t, Config{DisableCoalescing: !coalesce})
					hold := &mwHoldHandler{events: fm.events, cut: 2, end: end}
					var next http.Handler = hold
					if end == "proxy" {
						hold.end = "return"
						up := httptest.NewServer(hold)
						defer up.Close()
						u, _ := neturl.Parse(up.URL)
						next = httputil.NewSingleHostReverseProxy(u)
					}
					served := make(chan struct{}, 4)
					mw := c.Middleware(next)
					srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
						defer func() { served <- struct{}{} }()
						mw.ServeHTTP(w, r)
					}))
					srv.Config.ErrorLog = log.New(io.Discard, "", 0)
					defer srv.Close()

					xc, got := mwReadUntilClose(t, srv.URL+fm.path, fm.body, fm.marker)
					if want := strings.Join(fm.events[:2], ""); xc != XCacheMiss || string(got) != want {
						t.Fatalf("first: X-Cache %q body\n%q\nwant\n%q", xc, got, want)
					}
					select {
					case <-served:
					case <-time.After(10 * time.Second):
						t.Fatal("the middleware did not return after the client left")
					}
					if n := c.Stats(context.Background()).Entries; n != 0 {
						t.Fatalf("%d entries stored from an incomplete stream", n)
					}
					resp, err := mwClient.Post(srv.URL+fm.path, "application/json", bytes.NewReader(fm.body))
					if err != nil {
						t.Fatal(err)
					}
					resp.Body.Close()
					if xc := resp.Header.Get(HeaderXCache); xc != XCacheMiss {
						t.Fatalf("second: X-Cache %q, want MISS", xc)
					}
				})
			}
		}
	}
}
