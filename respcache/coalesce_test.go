package respcache

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// mwWaitFollowers waits until the flights of c have n waiters attached in all.
func mwWaitFollowers(t testing.TB, c *Cache, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := 0
		c.mu.Lock()
		for _, f := range c.flights {
			f.mu.Lock()
			got += f.followers
			f.mu.Unlock()
		}
		c.mu.Unlock()
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d waiters attached, want %d", got, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// mwGatedHandler blocks every call until release is closed, then answers with status and body.
type mwGatedHandler struct {
	release chan struct{}
	calls   atomic.Int64
	status  int
	body    string
	panics  bool
}

func (h *mwGatedHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := h.calls.Add(1)
	if n == 1 {
		<-h.release
	}
	if h.panics && n == 1 {
		panic(http.ErrAbortHandler)
	}
	w.Header().Set("Content-Type", "application/json")
	if h.status != 0 && n == 1 {
		w.WriteHeader(h.status)
	}
	_, _ = io.WriteString(w, h.body)
}

func TestCoalesceConcurrentIdentical(t *testing.T) {
	const n = 20
	c := mwNew(t, Config{})
	next := &mwGatedHandler{release: make(chan struct{}), body: `{"choices":[{"message":{"content":"once"}}]}`}
	h := c.Middleware(next)
	body := mwChat("coalesce me", `"temperature":0`)
	results := make([]*httptest.ResponseRecorder, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { results[i] = mwDo(h, "/v1/chat/completions", body) })
	}
	mwWaitFollowers(t, c, n-1)
	close(next.release)
	wg.Wait()
	if next.calls.Load() != 1 {
		t.Fatalf("next called %d times, want 1", next.calls.Load())
	}
	hits, misses := 0, 0
	for i, w := range results {
		if w.Code != http.StatusOK || w.Body.String() != next.body || w.Header().Get("Content-Type") != "application/json" {
			t.Fatalf("response %d: %d %v %q", i, w.Code, w.Header(), w.Body)
		}
		switch w.Header().Get(HeaderXCache) {
		case XCacheHit:
			hits++
		case XCacheMiss:
			misses++
		}
	}
	if hits != n-1 || misses != 1 {
		t.Fatalf("%d HIT, %d MISS; want %d and 1", hits, misses, n-1)
	}
	st := c.Stats(context.Background())
	if st.Coalesced != n-1 || st.Requests.Hit != n-1 || st.Requests.Miss != 1 || st.Entries != 1 {
		t.Fatalf("stats: coalesced %d requests %+v entries %d", st.Coalesced, st.Requests, st.Entries)
	}
	mwWaitFlights(t, c, 0)
}

func TestCoalesceWaiterContextEnds(t *testing.T) {
	c := mwNew(t, Config{})
	next := &mwGatedHandler{release: make(chan struct{}), body: `{"ok":true}`}
	h := c.Middleware(next)
	body := mwChat("wait", `"temperature":0`)
	var wg sync.WaitGroup
	results := make([]*httptest.ResponseRecorder, 3)
	for i := range 3 { // the leader and two patient waiters
		wg.Go(func() { results[i] = mwDo(h, "/v1/chat/completions", body) })
	}
	mwWaitFollowers(t, c, 2)

	ctx, cancel := context.WithCancel(context.Background())
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(body)).WithContext(ctx)
	impatient := httptest.NewRecorder()
	left := make(chan struct{})
	go func() { defer close(left); h.ServeHTTP(impatient, r) }()
	mwWaitFollowers(t, c, 3)
	cancel()
	select {
	case <-left:
	case <-time.After(10 * time.Second):
		t.Fatal("the cancelled waiter did not return")
	}
	if impatient.Body.Len() != 0 || impatient.Header().Get(HeaderXCache) != "" {
		t.Fatalf("the cancelled waiter wrote %v %q", impatient.Header(), impatient.Body)
	}
	mwWaitFollowers(t, c, 2)
	close(next.release)
	wg.Wait()
	for i, w := range results {
		if w.Body.String() != next.body {
			t.Fatalf("response %d: %q", i, w.Body)
		}
	}
	if next.calls.Load() != 1 {
		t.Fatalf("next called %d times", next.calls.Load())
	}
}

func TestCoalesceFallback(t *testing.T) {
	for _, tc := range []struct {
		name   string
		status int
		body   string
		panics bool
		cfg    Config
	}{
		{name: "status_503", status: http.StatusServiceUnavailable, body: `{"error":"busy"}`},
		{name: "too_large", body: strings.Repeat("x", 200), cfg: Config{MaxResponseSize: 100}},
		{name: "leader_panics", panics: true, body: `{}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const waiters = 4
			c := mwNew(t, tc.cfg)
			next := &mwGatedHandler{release: make(chan struct{}), status: tc.status, body: tc.body, panics: tc.panics}
			h := c.Middleware(next)
			var wg sync.WaitGroup
			results := make([]*httptest.ResponseRecorder, waiters)
			wg.Go(func() {
				defer func() { _ = recover() }() // the leader's panic reaches its own caller only
				mwDo(h, "/v1/chat/completions", mwChat("fb", `"temperature":0`))
			})
			mwWaitFlights(t, c, 1)
			for i := range waiters {
				wg.Go(func() { results[i] = mwDo(h, "/v1/chat/completions", mwChat("fb", `"temperature":0`)) })
			}
			mwWaitFollowers(t, c, waiters)
			close(next.release)
			wg.Wait()
			if got := next.calls.Load(); got != 1+waiters {
				t.Fatalf("next called %d times, want %d (waiters fall back)", got, 1+waiters)
			}
			for i, w := range results {
				mwWantXCache(t, w, XCacheMiss)
				if w.Code != http.StatusOK || w.Body.String() != tc.body {
					t.Fatalf("waiter %d: %d %q", i, w.Code, w.Body)
				}
			}
		})
	}
}

// mwLiveStream is a streaming handler driven by the test: it writes the events it receives on
// events, flushing after each, and returns when events is closed.
type mwLiveStream struct {
	events chan string
	calls  atomic.Int64
	ctxErr atomic.Value // the handler's context error when it returned
}

func (h *mwLiveStream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if h.calls.Add(1) > 1 {
		// Later calls (fallbacks) stream everything at once.
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, strings.Join(mwOpenAIEvents, ""))
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	w.(http.Flusher).Flush()
	for ev := range h.events {
		if _, err := io.WriteString(w, ev); err != nil {
			h.ctxErr.Store(err)
			return
		}
		w.(http.Flusher).Flush()
	}
	if err := r.Context().Err(); err != nil {
		h.ctxErr.Store(err)
	}
}

// mwClient bounds every test request, so that a bug shows as a failure, not a hung test.
var mwClient = &http.Client{Timeout: 20 * time.Second}

// mwStreamClient reads one SSE response, event by event.
type mwStreamClient struct {
	resp   *http.Response
	br     *bufio.Reader
	got    bytes.Buffer
	cancel context.CancelFunc
}

func mwOpenStream(t *testing.T, url string, body []byte) *mwStreamClient {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	resp, err := mwClient.Do(req)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	return &mwStreamClient{resp: resp, br: bufio.NewReader(resp.Body), cancel: cancel}
}

// readEvent reads up to and including the next blank line.
func (s *mwStreamClient) readEvent(t *testing.T) string {
	t.Helper()
	var ev []byte
	for {
		line, err := s.br.ReadBytes('\n')
		ev = append(ev, line...)
		if err != nil {
			t.Fatalf("reading an event: got %q, %v", ev, err)
		}
		if len(line) == 1 {
			s.got.Write(ev)
			return string(ev)
		}
	}
}

func (s *mwStreamClient) readAll(t *testing.T) string {
	t.Helper()
	rest, err := io.ReadAll(s.br)
	if err != nil {
		t.Fatalf("reading the stream: %v", err)
	}
	s.got.Write(rest)
	s.resp.Body.Close()
	s.cancel()
	return s.got.String()
}

// TestCoalesceStreamFollowsLive: waiters see each event while the leader's handler is still
// running (they do not wait for the end), a waiter arriving mid-stream gets the stream from its
// start, everyone gets the same bytes, and the handler runs once.
func TestCoalesceStreamFollowsLive(t *testing.T) {
	c := mwNew(t, Config{})
	next := &mwLiveStream{events: make(chan string)}
	srv := httptest.NewServer(c.Middleware(next))
	defer srv.Close()
	url, body := srv.URL+"/v1/chat/completions", mwChat("live", `"temperature":0`, `"stream":true`)

	leader := mwOpenStream(t, url, body)
	mwWaitFlights(t, c, 1)
	early := []*mwStreamClient{mwOpenStream(t, url, body), mwOpenStream(t, url, body)}
	mwWaitFollowers(t, c, 2)
	for _, ev := range mwOpenAIEvents[:2] {
		next.events <- ev
		for _, cl := range append([]*mwStreamClient{leader}, early...) {
			if got := cl.readEvent(t); got != ev {
				t.Fatalf("live event %q, want %q", got, ev)
			}
		}
	}
	late := mwOpenStream(t, url, body) // joins mid-stream
	mwWaitFollowers(t, c, 3)
	if got := late.readEvent(t) + late.readEvent(t); got != mwOpenAIEvents[0]+mwOpenAIEvents[1] {
		t.Fatalf("late joiner got %q", got)
	}
	for _, ev := range mwOpenAIEvents[2:] {
		next.events <- ev
	}
	close(next.events)
	want := strings.Join(mwOpenAIEvents, "")
	for i, cl := range append([]*mwStreamClient{leader, late}, early...) {
		if got := cl.readAll(t); got != want {
			t.Fatalf("client %d got %q", i, got)
		}
		wantX := XCacheHit
		if i == 0 {
			wantX = XCacheMiss
		}
		if x := cl.resp.Header.Get(HeaderXCache); x != wantX || cl.resp.Header.Get("Content-Type") != "text/event-stream" {
			t.Fatalf("client %d: X-Cache %q Content-Type %q", i, x, cl.resp.Header.Get("Content-Type"))
		}
	}
	if next.calls.Load() != 1 {
		t.Fatalf("next called %d times", next.calls.Load())
	}
	mwWaitFlights(t, c, 0)
	if c.Stats(context.Background()).Entries != 1 {
		t.Fatal("the shared stream was not stored")
	}
}

// TestCoalesceLeaderLeaves: the leader's client disconnects mid-stream while a waiter follows; the
// handler keeps running for the waiter (its context is not cancelled), and the stream is stored.
func TestCoalesceLeaderLeaves(t *testing.T) {
	c := mwNew(t, Config{})
	next := &mwLiveStream{events: make(chan string)}
	srv := httptest.NewServer(c.Middleware(next))
	defer srv.Close()
	url, body := srv.URL+"/v1/chat/completions", mwChat("leader leaves", `"temperature":0`, `"stream":true`)

	leader := mwOpenStream(t, url, body)
	mwWaitFlights(t, c, 1)
	waiter := mwOpenStream(t, url, body)
	mwWaitFollowers(t, c, 1)
	next.events <- mwOpenAIEvents[0]
	leader.readEvent(t)
	waiter.readEvent(t)
	leader.cancel() // the leader's client goes away
	leader.resp.Body.Close()
	for _, ev := range mwOpenAIEvents[1:] {
		next.events <- ev
		time.Sleep(5 * time.Millisecond) // let the server notice the closed connection
	}
	close(next.events)
	if got := waiter.readAll(t); got != strings.Join(mwOpenAIEvents, "") {
		t.Fatalf("waiter got %q", got)
	}
	mwWaitFlights(t, c, 0)
	if err := next.ctxErr.Load(); err != nil {
		t.Fatalf("the handler failed although a waiter followed: %v", err)
	}
	if c.Stats(context.Background()).Entries != 1 {
		t.Fatal("the stream was not stored")
	}
}

// TestCoalesceStreamOverCap: followers attached before the stream outgrew the cap still get all of
// it; a request arriving after calls the handler itself; nothing is stored.
func TestCoalesceStreamOverCap(t *testing.T) {
	c := mwNew(t, Config{MaxStreamBufferSize: 600})
	next := &mwLiveStream{events: make(chan string)}
	srv := httptest.NewServer(c.Middleware(next))
	defer srv.Close()
	url, body := srv.URL+"/v1/chat/completions", mwChat("big", `"temperature":0`, `"stream":true`)

	leader := mwOpenStream(t, url, body)
	mwWaitFlights(t, c, 1)
	follower := mwOpenStream(t, url, body)
	mwWaitFollowers(t, c, 1)
	var events []string
	for i := range 10 {
		ev := "data: {\"chunk\":\"" + strings.Repeat(string(rune('a'+i)), 100) + "\"}\n\n"
		events = append(events, ev)
		next.events <- ev
		leader.readEvent(t)
		follower.readEvent(t)
	}
	mwWaitFlights(t, c, 0) // over the cap: the flight is no longer joinable
	late := mwOpenStream(t, url, body)
	if got := late.readAll(t); got != strings.Join(mwOpenAIEvents, "") || late.resp.Header.Get(HeaderXCache) != XCacheMiss {
		t.Fatalf("late request: X-Cache %q body %q", late.resp.Header.Get(HeaderXCache), got)
	}
	next.events <- "data: [DONE]\n\n"
	close(next.events)
	want := strings.Join(events, "") + "data: [DONE]\n\n"
	for i, cl := range []*mwStreamClient{leader, follower} {
		if got := cl.readAll(t); got != want {
			t.Fatalf("client %d got %d bytes, want %d", i, len(got), len(want))
		}
	}
	if next.calls.Load() != 2 {
		t.Fatalf("next called %d times, want 2", next.calls.Load())
	}
}

// TestCoalesceIncompleteStreamMirrored: the leader's stream ends without [DONE]; a follower that
// already relayed part of it ends the same way; a waiter that had not started falls back.
func TestCoalesceIncompleteStreamMirrored(t *testing.T) {
	c := mwNew(t, Config{})
	next := &mwLiveStream{events: make(chan string)}
	srv := httptest.NewServer(c.Middleware(next))
	defer srv.Close()
	url, body := srv.URL+"/v1/chat/completions", mwChat("cut", `"temperature":0`, `"stream":true`)
	leader := mwOpenStream(t, url, body)
	mwWaitFlights(t, c, 1)
	follower := mwOpenStream(t, url, body)
	mwWaitFollowers(t, c, 1)
	next.events <- mwOpenAIEvents[0]
	close(next.events)
	for i, cl := range []*mwStreamClient{leader, follower} {
		if got := cl.readAll(t); got != mwOpenAIEvents[0] {
			t.Fatalf("client %d got %q", i, got)
		}
	}
	mwWaitFlights(t, c, 0)
	if c.Stats(context.Background()).Entries != 0 {
		t.Fatal("an incomplete stream was stored")
	}
}

// mwBreakableWriter is a ResponseWriter whose client can "leave": from then on every Write and
// Flush fails, as on a closed connection. It records what was written before.
type mwBreakableWriter struct {
	mu     sync.Mutex
	h      http.Header
	code   int
	body   bytes.Buffer
	broken bool
}

var errMWGone = io.ErrClosedPipe

func (w *mwBreakableWriter) Header() http.Header  { return w.h }
func (w *mwBreakableWriter) WriteHeader(code int) { w.code = code }
func (w *mwBreakableWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.broken {
		return 0, errMWGone
	}
	return w.body.Write(p)
}
func (w *mwBreakableWriter) FlushError() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.broken {
		return errMWGone
	}
	return nil
}
func (w *mwBreakableWriter) breakNow() { w.mu.Lock(); w.broken = true; w.mu.Unlock() }
func (w *mwBreakableWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.body.String()
}

// TestCoalesceShieldsLeaderWrites: the leader's client fails mid-stream while a waiter follows; the
// handler sees no write error and finishes, the follower gets everything, the stream is stored. A
// follower whose own client fails leaves without disturbing anyone.
func TestCoalesceShieldsLeaderWrites(t *testing.T) {
	c := mwNew(t, Config{})
	var writeErrs atomic.Int64
	step := make(chan struct{})
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		for i, ev := range mwOpenAIEvents {
			if i > 0 {
				<-step
			}
			if _, err := io.WriteString(w, ev); err != nil {
				writeErrs.Add(1)
			}
			if err := rc.Flush(); err != nil {
				writeErrs.Add(1)
			}
		}
	})
	h := c.Middleware(next)
	body := mwChat("shield", `"temperature":0`, `"stream":true`)
	serve := func(w http.ResponseWriter) chan struct{} {
		done := make(chan struct{})
		go func() {
			defer close(done)
			h.ServeHTTP(w, httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(body)))
		}()
		return done
	}
	leader := &mwBreakableWriter{h: http.Header{}}
	leaderDone := serve(leader)
	mwWaitFlights(t, c, 1)
	follower := &mwBreakableWriter{h: http.Header{}}
	quitter := &mwBreakableWriter{h: http.Header{}}
	followerDone, quitterDone := serve(follower), serve(quitter)
	mwWaitFollowers(t, c, 2)
	leader.breakNow()
	quitter.breakNow()
	for range mwOpenAIEvents[1:] {
		step <- struct{}{}
	}
	for _, d := range []chan struct{}{leaderDone, followerDone, quitterDone} {
		select {
		case <-d:
		case <-time.After(10 * time.Second):
			t.Fatal("a request did not finish")
		}
	}
	if writeErrs.Load() != 0 {
		t.Fatalf("the handler saw %d write errors although a waiter followed", writeErrs.Load())
	}
	want := strings.Join(mwOpenAIEvents, "")
	if follower.String() != want || follower.h.Get(HeaderXCache) != XCacheHit {
		t.Fatalf("follower: X-Cache %q body %q", follower.h.Get(HeaderXCache), follower.String())
	}
	if c.Stats(context.Background()).Entries != 1 {
		t.Fatal("the stream was not stored")
	}
}

// TestCoalesceRecheckAfterSettled: a request that missed the store just before another request's
// response was stored finds it on a second look instead of calling the handler.
func TestCoalesceRecheckAfterSettled(t *testing.T) {
	c := mwNew(t, Config{})
	next := &mwJSONHandler{}
	h := c.Middleware(next)
	body := mwChat("recheck", `"temperature":0`)
	mwDo(h, "/v1/chat/completions", body) // stores; settled becomes 1
	req, _ := DefaultParse("/v1/chat/completions", body)
	key := KeyOf(req)
	w := httptest.NewRecorder()
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(body))
	c.serveCoalesced(w, r, next, key, key.String(), 0) // as if its lookup ran before the store
	mwWantXCache(t, w, XCacheHit)
	if next.calls.Load() != 1 {
		t.Fatalf("next called %d times, want 1", next.calls.Load())
	}
}

// TestCoalesceJoinFinishedFlight: a request arriving after the leader finished but before its
// flight was forgotten replays the shared response.
func TestCoalesceJoinFinishedFlight(t *testing.T) {
	c := mwNew(t, Config{})
	body := mwChat("late", `"temperature":0`)
	req, _ := DefaultParse("/v1/chat/completions", body)
	key := KeyOf(req)
	e := &storedResponse{status: 200, header: []string{"Content-Type", "application/json"}, body: []byte(`{"x":1}`)}
	f := &flight{c: c, key: key, phase: phaseDone, result: e}
	c.flights[key] = f
	next := &mwJSONHandler{}
	w := mwDo(c.Middleware(next), "/v1/chat/completions", body)
	mwWantXCache(t, w, XCacheHit)
	if w.Body.String() != `{"x":1}` || next.calls.Load() != 0 {
		t.Fatalf("body %q, next called %d times", w.Body, next.calls.Load())
	}
	// A finished flight with nothing to share sends newcomers to the handler.
	f.result = nil
	w = mwDo(c.Middleware(next), "/v1/chat/completions", body)
	mwWantXCache(t, w, XCacheMiss)
	if next.calls.Load() != 1 {
		t.Fatalf("next called %d times, want 1", next.calls.Load())
	}
}
