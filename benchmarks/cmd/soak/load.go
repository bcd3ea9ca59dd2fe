package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Request kinds of the mix, with their weights out of 1000.
const (
	kindChat       = "chat"        // a turn of a multi-turn chat over a shared system prompt
	kindChatStream = "chat_stream" // the same, streamed
	kindDeterm     = "determ"      // temperature 0 from a small pool, repeated: the response cache's
	kindHuge       = "huge"        // a body of several MiB, sent every -huge-every (not drawn from the mix)
	kindMalformed  = "malformed"   // invalid JSON: 400 expected
	kindSlowRead   = "slow_read"   // a stream read a few bytes at a time
	kindSlowSend   = "slow_send"   // a body sent in pieces over about two seconds
)

var mix = []struct {
	kind   string
	weight int
}{
	{kindChat, 420}, {kindChatStream, 300}, {kindDeterm, 233},
	{kindMalformed, 12}, {kindSlowRead, 20}, {kindSlowSend, 15},
}

// Sizes of the load.
const (
	systemPrompts  = 6    // shared system prompts
	systemWords    = 1200 // words per system prompt (about as many tokens)
	conversations  = 48   // chats in progress
	turnsPerChat   = 8    // turns before a chat starts over
	determPool     = 40   // distinct deterministic requests
	hugeBodyBytes  = 4 << 20
	requestTimeout = 60 * time.Second
)

// Classes of outcome.
const (
	classOK          = iota // a 2xx answer read to its end
	classRejected           // an expected refusal: a 4xx for a malformed body
	classFailPre            // no 2xx answer: a transport error or an unexpected status
	classFailMid            // a 2xx answer cut short, or not what it should be
	classFailMidDead        // classFailMid on an engine that was killed meanwhile (set by the analysis)
)

// outcome is what one request went through.
type outcome struct {
	kind       string
	start, end time.Duration // from the start of the load
	class      int
	status     int
	backend    string // X-Kvroute-Backend
	cache      string // X-Cache
	determ     int    // index in the deterministic pool; -1 for the other kinds
	err        string
}

// loader sends the mix and keeps the outcomes. Safe for concurrent use.
type loader struct {
	targets []string // proxies' roots, http://127.0.0.1:PORT
	model   string
	client  *http.Client
	t0      time.Time

	mu       sync.Mutex
	rng      *rand.Rand
	chats    []chatState
	outcomes []outcome
	next     int // the next target
}

type chatState struct {
	system int
	turns  []map[string]string
}

func newLoader(targets []string, model string, seed int64, t0 time.Time) *loader {
	// Idle connections close after 5 s, so that the connections (and the proxy's goroutines
	// serving them) a burst of slow answers opened do not linger as if a fault had leaked them.
	tr := &http.Transport{MaxIdleConnsPerHost: 64, DisableCompression: true, IdleConnTimeout: 5 * time.Second}
	l := &loader{targets: targets, model: model, t0: t0, client: &http.Client{Transport: tr},
		rng: rand.New(rand.NewPCG(uint64(seed), 0x50a6))}
	l.chats = make([]chatState, conversations)
	for i := range l.chats {
		l.chats[i].system = i % systemPrompts
	}
	return l
}

// systemPrompt returns shared system prompt i: systemWords words, the same on every call.
func systemPrompt(i int) string {
	r := rand.New(rand.NewPCG(uint64(i), 7))
	words := []string{"route", "cache", "prefix", "engine", "token", "block", "replica", "latency", "model", "answer",
		"request", "stream", "policy", "tenant", "budget", "index", "event", "backend", "health", "memory"}
	var b strings.Builder
	fmt.Fprintf(&b, "You are assistant %d of the kvroute soak. Follow these rules.", i)
	for range systemWords {
		b.WriteByte(' ')
		b.WriteString(words[r.IntN(len(words))])
	}
	return b.String()
}

var systemPromptCache = func() []string {
	s := make([]string, systemPrompts)
	for i := range s {
		s[i] = systemPrompt(i)
	}
	return s
}()

// request is one request of the mix, ready to send.
type request struct {
	kind   string
	target string
	body   []byte
	stream bool
	determ int
	chat   int // index of the chat whose turn this is; -1 otherwise
}

// pick draws the next request of the mix; kind, when set, is the kind to make instead.
func (l *loader) pick(kind string) request {
	l.mu.Lock()
	defer l.mu.Unlock()
	target := l.targets[l.next%len(l.targets)]
	l.next++
	if kind == "" {
		n := l.rng.IntN(1000)
		kind = mix[len(mix)-1].kind
		for _, m := range mix {
			if n < m.weight {
				kind = m.kind
				break
			}
			n -= m.weight
		}
	}
	r := request{kind: kind, target: target, determ: -1, chat: -1}
	maxTokens := 8 + l.rng.IntN(40)
	switch kind {
	case kindChat, kindChatStream, kindSlowRead, kindSlowSend:
		r.chat = l.rng.IntN(len(l.chats))
		c := &l.chats[r.chat]
		if len(c.turns) >= 2*turnsPerChat {
			c.turns, c.system = nil, l.rng.IntN(systemPrompts)
		}
		c.turns = append(c.turns, map[string]string{"role": "user",
			"content": fmt.Sprintf("Turn %d of chat %d: tell me about %x.", len(c.turns)/2, r.chat, l.rng.Uint64())})
		msgs := append([]map[string]string{{"role": "system", "content": systemPromptCache[c.system]}}, c.turns...)
		r.stream = kind != kindChat && kind != kindSlowSend
		r.body = mustJSON(map[string]any{"model": l.model, "messages": msgs, "max_tokens": maxTokens,
			"temperature": 0.7, "stream": r.stream})
		c.turns = append(c.turns, map[string]string{"role": "assistant", "content": "An answer of the simulated engine."})
	case kindDeterm:
		r.determ = l.rng.IntN(determPool)
		r.body = mustJSON(map[string]any{"model": l.model, "temperature": 0, "max_tokens": 16, "messages": []map[string]string{
			{"role": "system", "content": systemPromptCache[r.determ%systemPrompts]},
			{"role": "user", "content": fmt.Sprintf("Deterministic question %d.", r.determ)}}})
	case kindHuge:
		doc := strings.Repeat("A long pasted document line for the soak's huge body. ", hugeBodyBytes/56)
		r.body = mustJSON(map[string]any{"model": l.model, "max_tokens": 4, "messages": []map[string]string{
			{"role": "system", "content": systemPromptCache[0]}, {"role": "user", "content": doc}}})
	case kindMalformed:
		bad := []string{`{"model":"m","messages":[{"role":"user","content":"unterminated`, `{"messages": 42}`,
			`[1,2,3`, `{"model":"m","messages":[],"max_tokens":-1}`}
		r.body = []byte(bad[l.rng.IntN(len(bad))])
	}
	return r
}

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // only maps of strings and numbers
	}
	return b
}

// do sends r and records its outcome.
func (l *loader) do(parent context.Context, r request) {
	ctx, cancel := context.WithTimeout(parent, requestTimeout)
	defer cancel()
	o := outcome{kind: r.kind, determ: r.determ, start: time.Since(l.t0)}
	o.class, o.status, o.backend, o.cache, o.err = l.send(ctx, r)
	o.end = time.Since(l.t0)
	if o.class != classOK && parent.Err() != nil {
		return // the run was interrupted under it: not the proxy's doing
	}
	l.mu.Lock()
	l.outcomes = append(l.outcomes, o)
	l.mu.Unlock()
}

// send performs r: its class, status, backend, X-Cache and error text.
func (l *loader) send(ctx context.Context, r request) (class, status int, backend, cache, errText string) {
	var body io.Reader = bytes.NewReader(r.body)
	if r.kind == kindSlowSend {
		pr, pw := io.Pipe()
		go func() {
			const pieces = 16
			step := (len(r.body) + pieces - 1) / pieces
			for i := 0; i < len(r.body); i += step {
				if _, err := pw.Write(r.body[i:min(i+step, len(r.body))]); err != nil {
					return
				}
				select {
				case <-ctx.Done():
					pw.CloseWithError(ctx.Err())
					return
				case <-time.After(150 * time.Millisecond):
				}
			}
			pw.Close()
		}()
		body = pr
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.target+"/v1/chat/completions", body)
	if err != nil {
		return classFailPre, 0, "", "", err.Error()
	}
	req.ContentLength = int64(len(r.body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := l.client.Do(req)
	if err != nil {
		return classFailPre, 0, "", "", err.Error()
	}
	defer resp.Body.Close()
	status, backend, cache = resp.StatusCode, resp.Header.Get("X-Kvroute-Backend"), resp.Header.Get("X-Cache")
	if r.kind == kindMalformed || (r.kind == kindHuge && status == http.StatusBadRequest) {
		// A malformed body is the proxy's to refuse; a huge one the engine's (over its context
		// length), as vLLM does, relayed by the proxy.
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
		if status == http.StatusBadRequest {
			return classRejected, status, backend, cache, ""
		}
		return classFailPre, status, backend, cache, fmt.Sprintf("malformed body answered %d, want 400: %s", status, bytes.TrimSpace(b))
	}
	if status < 200 || status > 299 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return classFailPre, status, backend, cache, fmt.Sprintf("status %d: %s", status, bytes.TrimSpace(b))
	}
	if r.stream {
		err = readStream(ctx, resp.Body, r.kind == kindSlowRead)
	} else {
		var v struct{ Choices []json.RawMessage }
		err = json.NewDecoder(resp.Body).Decode(&v)
		if err == nil && len(v.Choices) == 0 {
			err = fmt.Errorf("an answer without choices")
		}
	}
	if err != nil {
		return classFailMid, status, backend, cache, err.Error()
	}
	return classOK, status, backend, cache, ""
}

// readStream reads an SSE stream to its "data: [DONE]"; slowly, it reads 64 bytes every 50 ms.
func readStream(ctx context.Context, body io.Reader, slowly bool) error {
	if slowly {
		body = &slowReader{ctx: ctx, r: body}
	}
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if strings.TrimSpace(sc.Text()) == "data: [DONE]" {
			return nil
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	return io.ErrUnexpectedEOF
}

type slowReader struct {
	ctx context.Context
	r   io.Reader
}

func (s *slowReader) Read(p []byte) (int, error) {
	select {
	case <-s.ctx.Done():
		return 0, s.ctx.Err()
	case <-time.After(50 * time.Millisecond):
	}
	return s.r.Read(p[:min(len(p), 64)])
}

// runLoad sends requests at rate per second from now until ctx ends or until stop, and a huge
// body every hugeEvery (none when 0), then waits for those in flight.
func (l *loader) runLoad(ctx context.Context, rate float64, hugeEvery, stop time.Duration) {
	var wg sync.WaitGroup
	if hugeEvery > 0 {
		wg.Go(func() {
			for at := hugeEvery / 2; at < stop; at += hugeEvery {
				select {
				case <-ctx.Done():
					return
				case <-time.After(time.Until(l.t0.Add(at))):
				}
				r := l.pick(kindHuge)
				wg.Go(func() { l.do(ctx, r) })
			}
		})
	}
	interval := time.Duration(float64(time.Second) / rate)
	for i := 0; ; i++ {
		at := time.Duration(i) * interval
		if at >= stop {
			break
		}
		select {
		case <-ctx.Done():
			wg.Wait()
			return
		case <-time.After(time.Until(l.t0.Add(at))):
		}
		r := l.pick("")
		wg.Go(func() { l.do(ctx, r) })
	}
	wg.Wait()
}

// stalled is the stall fault's attacker: n connections to addr each announce an 8 MiB chat body,
// send one byte and stall for at most hold. It returns when every connection has ended and how
// many the proxy closed (or answered) before hold.
func stalled(ctx context.Context, addr string, n int, hold time.Duration) (closedByProxy int, lastClose time.Duration) {
	start := time.Now()
	var (
		mu sync.Mutex
		wg sync.WaitGroup
	)
	for range n {
		wg.Go(func() {
			c, err := net.DialTimeout("tcp", addr, 2*time.Second)
			if err != nil {
				return
			}
			defer c.Close()
			fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n{", addr, 8<<20)
			_ = c.SetReadDeadline(time.Now().Add(hold))
			stop := context.AfterFunc(ctx, func() { _ = c.SetReadDeadline(time.Now()) })
			defer stop()
			_, err = io.Copy(io.Discard, c) // until the proxy closes, or the deadline
			mu.Lock()
			defer mu.Unlock()
			if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
				closedByProxy++
				lastClose = max(lastClose, time.Since(start))
			}
		})
	}
	wg.Wait()
	return closedByProxy, lastClose
}
