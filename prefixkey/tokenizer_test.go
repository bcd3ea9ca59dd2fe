package prefixkey

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/zeebo/xxh3"
)

// fakeEngine is a vLLM-like /tokenize endpoint. It answers one token per byte of content sent
// (chat: role and content of each message; completions: the prompt), after delay, and counts
// its calls. status, when not 200, is answered instead; raw, when set, is the answer body.
type fakeEngine struct {
	t      *testing.T
	calls  atomic.Int64
	delay  time.Duration
	status int
	raw    string

	mu     sync.Mutex
	bodies []map[string]any
	header http.Header
}

func (f *fakeEngine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.calls.Add(1)
	if r.Method != http.MethodPost || r.URL.Path != "/tokenize" {
		http.Error(w, "not found", http.StatusNotFound)
		return
	}
	var body map[string]any
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	f.mu.Lock()
	f.bodies = append(f.bodies, body)
	f.header = r.Header.Clone()
	f.mu.Unlock()
	if f.delay > 0 {
		select {
		case <-time.After(f.delay):
		case <-r.Context().Done():
			return
		}
	}
	if f.status != 0 && f.status != http.StatusOK {
		http.Error(w, `{"error":"engine exploded"}`, f.status)
		return
	}
	if f.raw != "" {
		_, _ = io.WriteString(w, f.raw)
		return
	}
	var content strings.Builder
	if msgs, ok := body["messages"].([]any); ok {
		for _, m := range msgs {
			m := m.(map[string]any)
			content.WriteString(m["role"].(string))
			content.WriteString(m["content"].(string))
		}
	} else {
		content.WriteString(body["prompt"].(string))
	}
	tokens := make([]uint32, content.Len())
	for i, c := range []byte(content.String()) {
		tokens[i] = uint32(c)
	}
	_ = json.NewEncoder(w).Encode(map[string]any{"tokens": tokens, "count": len(tokens), "max_model_len": 4096})
}

func (f *fakeEngine) lastBody() map[string]any {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.bodies) == 0 {
		return nil
	}
	return f.bodies[len(f.bodies)-1]
}

func newEngine(t *testing.T, f *fakeEngine, cfg EngineTokenizerConfig) *EngineTokenizer {
	t.Helper()
	f.t = t
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	cfg.BaseURL = srv.URL + "/"
	cfg.Client = srv.Client()
	tok, err := NewEngineTokenizer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func chatRequest(model, system string, msgs ...string) *Request {
	r := &Request{Format: FormatOpenAIChat, Model: model, System: system, HasSystem: system != ""}
	for i, m := range msgs {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		r.Messages = append(r.Messages, Message{Role: role, Text: m, Parts: []Part{{Type: "text", Text: m}}})
	}
	return r
}

func bytesAsTokens(s string) []uint32 {
	out := make([]uint32, len(s))
	for i := range len(s) {
		out[i] = uint32(s[i])
	}
	return out
}

func TestNewEngineTokenizer(t *testing.T) {
	tests := []struct {
		name     string
		cfg      EngineTokenizerConfig
		endpoint string
		wantErr  bool
	}{
		{name: "plain", cfg: EngineTokenizerConfig{BaseURL: "http://vllm:8000"}, endpoint: "http://vllm:8000/tokenize"},
		{name: "trailing slash", cfg: EngineTokenizerConfig{BaseURL: "https://vllm:8000/"}, endpoint: "https://vllm:8000/tokenize"},
		{name: "path prefix", cfg: EngineTokenizerConfig{BaseURL: "http://gw/engines/a"}, endpoint: "http://gw/engines/a/tokenize"},
		{name: "empty", cfg: EngineTokenizerConfig{}, wantErr: true},
		{name: "no scheme", cfg: EngineTokenizerConfig{BaseURL: "vllm:8000"}, wantErr: true},
		{name: "other scheme", cfg: EngineTokenizerConfig{BaseURL: "tcp://vllm:8000"}, wantErr: true},
		{name: "negative timeout", cfg: EngineTokenizerConfig{BaseURL: "http://vllm", Timeout: -1}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tok, err := NewEngineTokenizer(tt.cfg)
			if tt.wantErr {
				if err == nil {
					t.Fatal("err = nil, want an error")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if tok.endpoint != tt.endpoint || tok.timeout != DefaultTokenizeTimeout || tok.client != http.DefaultClient {
				t.Errorf("endpoint, timeout = %q, %v", tok.endpoint, tok.timeout)
			}
		})
	}
}

func TestEngineTokenizerRequests(t *testing.T) {
	tests := []struct {
		name  string
		req   *Request
		body  map[string]any // what the engine receives; nil: no call
		want  []uint32
		calls int64
	}{
		{
			name: "chat with system",
			req:  chatRequest("llama", "Be brief.", "Hi", "Hello!", "Bye"),
			body: map[string]any{"model": "llama", "messages": []any{
				map[string]any{"role": "system", "content": "Be brief."},
				map[string]any{"role": "user", "content": "Hi"},
				map[string]any{"role": "assistant", "content": "Hello!"},
				map[string]any{"role": "user", "content": "Bye"},
			}},
			want:  bytesAsTokens("systemBe brief.userHiassistantHello!userBye"),
			calls: 1,
		},
		{
			name: "chat without system",
			req:  chatRequest("llama", "", "Hi"),
			body: map[string]any{"model": "llama", "messages": []any{map[string]any{"role": "user", "content": "Hi"}}},
			want: bytesAsTokens("userHi"), calls: 1,
		},
		{
			name: "empty system prompt is sent",
			req:  &Request{Format: FormatAnthropicMessages, Model: "claude", HasSystem: true, Messages: []Message{{Role: "user", Text: "x"}}},
			body: map[string]any{"model": "claude", "messages": []any{
				map[string]any{"role": "system", "content": ""},
				map[string]any{"role": "user", "content": "x"},
			}},
			want: bytesAsTokens("systemuserx"), calls: 1,
		},
		{
			name: "completion sends the first prompt",
			req:  &Request{Format: FormatOpenAICompletion, Model: "llama", Prompt: []string{"Once upon", "ignored"}},
			body: map[string]any{"model": "llama", "prompt": "Once upon"},
			want: bytesAsTokens("Once upon"), calls: 1,
		},
		{
			name: "no model omitted",
			req:  &Request{Prompt: []string{"ab"}},
			body: map[string]any{"prompt": "ab"},
			want: bytesAsTokens("ab"), calls: 1,
		},
		{
			name: "token ids pass through",
			req:  &Request{Format: FormatOpenAIChat, Model: "llama", Messages: []Message{{Role: "user", Text: "Hi"}}, TokenIDs: []uint32{7, 8}},
			want: []uint32{7, 8},
		},
		{
			name: "prompt tokens pass through",
			req:  &Request{Format: FormatOpenAICompletion, Model: "llama", PromptTokens: []uint32{1, 2, 3}},
			want: []uint32{1, 2, 3},
		},
		{
			name: "nothing to tokenize",
			req:  &Request{Format: FormatOpenAIChat, Model: "llama"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := &fakeEngine{}
			tok := newEngine(t, f, EngineTokenizerConfig{Timeout: 5 * time.Second})
			got, err := tok.Tokenize(context.Background(), tt.req)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("tokens = %v, want %v", got, tt.want)
			}
			if f.calls.Load() != tt.calls {
				t.Errorf("engine calls = %d, want %d", f.calls.Load(), tt.calls)
			}
			if tt.body != nil && !reflect.DeepEqual(f.lastBody(), tt.body) {
				t.Errorf("engine received %v, want %v", f.lastBody(), tt.body)
			}
		})
	}
}

func TestEngineTokenizerCache(t *testing.T) {
	f := &fakeEngine{}
	tok := newEngine(t, f, EngineTokenizerConfig{Timeout: 5 * time.Second})
	ctx := context.Background()
	steps := []struct {
		name  string
		req   *Request
		calls int64
	}{
		{"first", chatRequest("m", "sys", "hello"), 1},
		{"identical: cached", chatRequest("m", "sys", "hello"), 1},
		{"another model", chatRequest("m2", "sys", "hello"), 2},
		{"another message", chatRequest("m", "sys", "hello!"), 3},
		{"system moved into a message", chatRequest("m", "", "sys", "hello"), 4},
		{"completion of the same text", &Request{Format: FormatOpenAICompletion, Model: "m", Prompt: []string{"hello"}}, 5},
		{"identical again: cached", chatRequest("m", "sys", "hello"), 5},
	}
	var first []uint32
	for _, s := range steps {
		got, err := tok.Tokenize(ctx, s.req)
		if err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		if first == nil {
			first = got
		}
		if f.calls.Load() != s.calls {
			t.Errorf("%s: engine calls = %d, want %d", s.name, f.calls.Load(), s.calls)
		}
	}
	want := TokenizerStats{Calls: 7, CacheHits: 2}
	if got := tok.Stats(); got != want {
		t.Errorf("Stats = %+v, want %+v", got, want)
	}
	again, _ := tok.Tokenize(ctx, chatRequest("m", "sys", "hello"))
	if &again[0] != &first[0] {
		t.Error("a cache hit did not return the cached slice")
	}
}

func TestEngineTokenizerCacheBounds(t *testing.T) {
	tests := []struct {
		name  string
		size  int
		calls int64 // engine calls for a, b, a
	}{
		{"size one evicts", 1, 3},
		{"size two keeps", 2, 2},
		{"disabled", -1, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := &fakeEngine{}
			tok := newEngine(t, f, EngineTokenizerConfig{CacheSize: tt.size, Timeout: 5 * time.Second})
			for _, p := range []string{"a", "b", "a"} {
				if _, err := tok.Tokenize(context.Background(), &Request{Prompt: []string{p}}); err != nil {
					t.Fatal(err)
				}
			}
			if f.calls.Load() != tt.calls {
				t.Errorf("engine calls = %d, want %d", f.calls.Load(), tt.calls)
			}
		})
	}
}

// engineSpec configures a fakeEngine in a test table (a fakeEngine itself must not be copied).
type engineSpec struct {
	delay  time.Duration
	status int
	raw    string
}

func TestEngineTokenizerErrors(t *testing.T) {
	tests := []struct {
		name         string
		engine       engineSpec
		timeout      time.Duration
		ctx          func() (context.Context, context.CancelFunc)
		wantDeadline bool
		wantCanceled bool
		wantIn       string
	}{
		{name: "status 500", engine: engineSpec{status: 500}, wantIn: "status 500"},
		{name: "status 404", engine: engineSpec{status: 404}, wantIn: "status 404"},
		{name: "bad JSON", engine: engineSpec{raw: `{"tokens": [1, 2`}, wantIn: "bad answer"},
		{name: "negative token", engine: engineSpec{raw: `{"tokens": [1, -2]}`}, wantIn: "bad answer"},
		{name: "no tokens", engine: engineSpec{raw: `{"count": 0}`}, wantIn: "no \"tokens\""},
		{name: "count mismatch", engine: engineSpec{raw: `{"tokens": [1, 2], "count": 3}`}, wantIn: "count 3"},
		{name: "slow engine", engine: engineSpec{delay: 10 * time.Second}, timeout: 30 * time.Millisecond, wantDeadline: true, wantIn: "within 30ms"},
		{
			name: "caller deadline first", engine: engineSpec{delay: 10 * time.Second}, timeout: 10 * time.Second, wantDeadline: true,
			ctx: func() (context.Context, context.CancelFunc) {
				return context.WithTimeout(context.Background(), 30*time.Millisecond)
			},
		},
		{
			name: "caller cancelled", engine: engineSpec{}, timeout: time.Second, wantCanceled: true,
			ctx: func() (context.Context, context.CancelFunc) {
				ctx, cancel := context.WithCancel(context.Background())
				cancel()
				return ctx, cancel
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := &fakeEngine{delay: tt.engine.delay, status: tt.engine.status, raw: tt.engine.raw}
			timeout := tt.timeout
			if timeout == 0 {
				timeout = 5 * time.Second
			}
			tok := newEngine(t, f, EngineTokenizerConfig{Timeout: timeout})
			ctx, cancel := context.Background(), context.CancelFunc(func() {})
			if tt.ctx != nil {
				ctx, cancel = tt.ctx()
			}
			defer cancel()
			start := time.Now()
			got, err := tok.Tokenize(ctx, chatRequest("m", "sys", "hi"))
			elapsed := time.Since(start)
			if got != nil || !errors.Is(err, ErrTokenize) {
				t.Fatalf("Tokenize = %v, %v, want nil and ErrTokenize", got, err)
			}
			if errors.Is(err, context.DeadlineExceeded) != tt.wantDeadline {
				t.Errorf("errors.Is(err, DeadlineExceeded) = %v, want %v (%v)", !tt.wantDeadline, tt.wantDeadline, err)
			}
			if errors.Is(err, context.Canceled) != tt.wantCanceled {
				t.Errorf("errors.Is(err, Canceled) = %v, want %v (%v)", !tt.wantCanceled, tt.wantCanceled, err)
			}
			if !strings.Contains(err.Error(), tt.wantIn) {
				t.Errorf("err = %q, want it to contain %q", err, tt.wantIn)
			}
			if tt.wantDeadline && elapsed > time.Second {
				t.Errorf("returned after %v, want about the 30 ms deadline", elapsed)
			}
			timeouts := uint64(0)
			if tt.wantDeadline {
				timeouts = 1
			}
			if st := tok.Stats(); st.Calls != 1 || st.Errors != 1 || st.Timeouts != timeouts || st.CacheHits != 0 {
				t.Errorf("Stats = %+v, want 1 call, 1 error, %d time-outs", st, timeouts)
			}
			// Errors are not cached: the next call asks again.
			before := f.calls.Load()
			_, _ = tok.Tokenize(ctx, chatRequest("m", "sys", "hi"))
			if tt.ctx == nil && f.calls.Load() != before+1 {
				t.Errorf("engine calls = %d after a retry, want %d", f.calls.Load(), before+1)
			}
		})
	}
}

func TestEngineTokenizerUnreachable(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	url := srv.URL
	srv.Close()
	tok, err := NewEngineTokenizer(EngineTokenizerConfig{BaseURL: url, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tok.Tokenize(context.Background(), &Request{Prompt: []string{"x"}}); !errors.Is(err, ErrTokenize) {
		t.Fatalf("err = %v, want ErrTokenize", err)
	}
}

func TestEngineTokenizerHeader(t *testing.T) {
	f := &fakeEngine{}
	h := http.Header{"Authorization": {"Bearer secret"}}
	tok := newEngine(t, f, EngineTokenizerConfig{Header: h, Timeout: 5 * time.Second})
	if _, err := tok.Tokenize(context.Background(), &Request{Prompt: []string{"x"}}); err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if got := f.header.Get("Authorization"); got != "Bearer secret" {
		t.Errorf("Authorization = %q", got)
	}
	if got := f.header.Get("Content-Type"); got != "application/json" {
		t.Errorf("Content-Type = %q", got)
	}
}

func TestEngineTokenizerConcurrent(t *testing.T) {
	f := &fakeEngine{}
	tok := newEngine(t, f, EngineTokenizerConfig{CacheSize: 8, Timeout: 5 * time.Second})
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 50 {
				p := fmt.Sprint((g + i) % 12)
				got, err := tok.Tokenize(context.Background(), &Request{Prompt: []string{p}})
				if err != nil || !reflect.DeepEqual(got, bytesAsTokens(p)) {
					t.Errorf("Tokenize(%q) = %v, %v", p, got, err)
				}
			}
		})
	}
	wg.Wait()
	if st := tok.Stats(); st.Calls != 400 || uint64(f.calls.Load()) != st.Calls-st.CacheHits {
		t.Errorf("Stats = %+v with %d engine calls", st, f.calls.Load())
	}
}

func TestTokenizerFuncAndKnownTokens(t *testing.T) {
	var tk Tokenizer = TokenizerFunc(func(_ context.Context, r *Request) ([]uint32, error) {
		return []uint32{uint32(len(r.Model))}, nil
	})
	if got, _ := tk.Tokenize(context.Background(), &Request{Model: "abc"}); !reflect.DeepEqual(got, []uint32{3}) {
		t.Errorf("TokenizerFunc = %v", got)
	}
	tests := []struct {
		req  *Request
		want []uint32
	}{
		{&Request{TokenIDs: []uint32{1}, PromptTokens: []uint32{2}}, []uint32{1}},
		{&Request{PromptTokens: []uint32{2}}, []uint32{2}},
		{chatRequest("m", "s", "x"), nil},
	}
	for i, tt := range tests {
		if got := knownTokens(tt.req); !reflect.DeepEqual(got, tt.want) {
			t.Errorf("%d: knownTokens = %v, want %v", i, got, tt.want)
		}
	}
}

func TestEstimateTokenizerPacking(t *testing.T) {
	prompt := func(s string) *Request { return &Request{Format: FormatOpenAICompletion, Prompt: []string{s}} }
	tests := []struct {
		name string
		e    EstimateTokenizer
		req  *Request
		want []uint32
	}{
		{name: "default four bytes", req: prompt("abcdef"), want: []uint32{0x64636261, 0x6665}},
		{name: "one byte", e: EstimateTokenizer{BytesPerToken: 1}, req: prompt("ab"), want: []uint32{'a', 'b'}},
		{name: "three bytes", e: EstimateTokenizer{BytesPerToken: 3}, req: prompt("abcd"), want: []uint32{0x636261, 0x64}},
		{name: "chat markers", e: EstimateTokenizer{BytesPerToken: 1}, req: chatRequest("m", "S", "u"),
			want: bytesAsTokens("<|system|>S<|user|>u")},
		{name: "chunks span messages", req: chatRequest("m", "", "ab", "c"),
			want: EstimateTokenizer{}.AppendTokens(nil, prompt("<|user|>ab<|assistant|>c"))},
		{name: "chunks span messages, hashed", e: EstimateTokenizer{BytesPerToken: 5}, req: chatRequest("m", "system prompt", "ab", "c"),
			want: EstimateTokenizer{BytesPerToken: 5}.AppendTokens(nil, prompt("<|system|>system prompt<|user|>ab<|assistant|>c"))},
		{name: "hashed chunks", e: EstimateTokenizer{BytesPerToken: 8}, req: prompt("abcdefghij"),
			want: []uint32{uint32(xxh3.HashString("abcdefgh")), uint32(xxh3.HashString("ij"))}},
		{name: "empty", req: &Request{}, want: nil},
		{name: "first prompt only", e: EstimateTokenizer{BytesPerToken: 1}, req: &Request{Prompt: []string{"a", "b"}}, want: []uint32{'a'}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.e.Tokenize(context.Background(), tt.req)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("tokens = %#x, want %#x", got, tt.want)
			}
		})
	}
}

func TestEstimateTokenizerPrefixes(t *testing.T) {
	system := strings.Repeat("You are a helpful assistant for ACME support. ", 20) // 920 bytes
	for _, bpt := range []int{0, 1, 2, 3, 4, 5, 8, 16, 64, 1000} {
		t.Run(fmt.Sprintf("bytes=%d", bpt), func(t *testing.T) {
			e := EstimateTokenizer{BytesPerToken: bpt}
			size := bpt
			switch {
			case size <= 0:
				size = DefaultBytesPerToken
			case size > MaxBytesPerToken:
				size = MaxBytesPerToken
			}
			a := e.AppendTokens(nil, chatRequest("m", system, "What is my order status?"))
			b := e.AppendTokens(nil, chatRequest("m", system, "Cancel my subscription, please."))
			c := e.AppendTokens(nil, chatRequest("m", "You are a pirate. "+system, "What is my order status?"))
			shared := len("<|system|>"+system+"<|user|>") / size // whole chunks before the messages differ
			if !reflect.DeepEqual(a[:shared], b[:shared]) {
				t.Error("a shared system prompt gave different leading pseudo-tokens")
			}
			if reflect.DeepEqual(a[:shared+1], b[:shared+1]) && size > 1 {
				t.Error("different messages gave identical pseudo-tokens past the shared prefix")
			}
			if i := len("<|system|>You are a ") / size; a[i] == c[i] {
				t.Errorf("different system prompts gave the same pseudo-token %d, where they first differ", i)
			}
			n := len("<|system|>" + system + "<|user|>What is my order status?")
			if want := (n + size - 1) / size; len(a) != want {
				t.Errorf("len = %d, want ceil(%d/%d) = %d", len(a), n, size, want)
			}
			again := e.AppendTokens(make([]uint32, 0, len(a)), chatRequest("m", system, "What is my order status?"))
			if !reflect.DeepEqual(a, again) {
				t.Error("not deterministic")
			}
			// Same prefix, same block keys.
			ka := (&Request{Model: "m", TokenIDs: a}).BlockKeys(nil, 16)
			kb := (&Request{Model: "m", TokenIDs: b}).BlockKeys(nil, 16)
			if blocks := shared / 16; blocks > 0 && !reflect.DeepEqual(ka[:blocks], kb[:blocks]) {
				t.Error("shared pseudo-token prefix gave different block keys")
			}
		})
	}
}

func TestEstimateTokenizerPassThrough(t *testing.T) {
	r := chatRequest("m", "s", "x")
	r.TokenIDs = []uint32{9, 9}
	if got, _ := (EstimateTokenizer{}).Tokenize(context.Background(), r); !reflect.DeepEqual(got, []uint32{9, 9}) {
		t.Errorf("Tokenize = %v, want the request's TokenIDs", got)
	}
}

func BenchmarkEngineTokenizerHit(b *testing.B) {
	srv := httptest.NewServer(&fakeEngine{})
	defer srv.Close()
	tok, err := NewEngineTokenizer(EngineTokenizerConfig{BaseURL: srv.URL, Client: srv.Client(), Timeout: 5 * time.Second})
	if err != nil {
		b.Fatal(err)
	}
	req := chatRequest("llama", strings.Repeat("system prompt ", 70), "What is the capital of France?")
	if _, err := tok.Tokenize(context.Background(), req); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(req.System) + len(req.Messages[0].Text)))
	b.ReportAllocs()
	for b.Loop() {
		_, _ = tok.Tokenize(context.Background(), req)
	}
}

func BenchmarkEstimateTokenizer(b *testing.B) {
	req := chatRequest("llama", strings.Repeat("system prompt ", 70), "What is the capital of France?")
	for _, bpt := range []int{4, 16} {
		b.Run(fmt.Sprintf("bytes_per_token=%d", bpt), func(b *testing.B) {
			e := EstimateTokenizer{BytesPerToken: bpt}
			dst := e.AppendTokens(nil, req)
			b.SetBytes(int64(len(req.System) + len(req.Messages[0].Text)))
			b.ReportAllocs()
			for b.Loop() {
				dst = e.AppendTokens(dst[:0], req)
			}
		})
	}
}

// The cache is bounded by the bytes of its token IDs too: prompts of 100 tokens (400 B) under a
// 1,000-byte bound keep two results, so a, b, c, a asks the engine four times (three without
// the bound); what it counts is what it holds, in slices of their own length.
func TestEngineTokenizerCacheBytes(t *testing.T) {
	for _, tc := range []struct {
		name  string
		bytes int64
		calls int64
	}{{"bound", 1000, 4}, {"no bound", -1, 3}, {"a result over the bound is not kept", 100, 4}} {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakeEngine{}
			tok := newEngine(t, f, EngineTokenizerConfig{CacheSize: 16, CacheBytes: tc.bytes, Timeout: 5 * time.Second})
			for _, p := range []string{"a", "b", "c", "a"} {
				if _, err := tok.Tokenize(context.Background(), &Request{Prompt: []string{strings.Repeat(p, 100)}}); err != nil {
					t.Fatal(err)
				}
			}
			if got := f.calls.Load(); got != tc.calls {
				t.Errorf("engine calls = %d, want %d", got, tc.calls)
			}
			var held int64
			for _, k := range tok.cache.c.Keys() {
				v, _ := tok.cache.c.Peek(k)
				if cap(v) != len(v) {
					t.Errorf("a cached result has room for %d tokens, holds %d", cap(v), len(v))
				}
				held += 4 * int64(len(v))
			}
			if got := tok.cache.bytes.Load(); got != held {
				t.Errorf("cache counts %d bytes, holds %d", got, held)
			}
			if tc.bytes >= 0 && held > tc.bytes {
				t.Errorf("cache holds %d bytes, over its bound %d", held, tc.bytes)
			}
		})
	}
}
