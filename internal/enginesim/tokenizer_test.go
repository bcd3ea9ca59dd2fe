package enginesim

import (
	"context"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/prefixkey"
)

func TestTokenizePieces(t *testing.T) {
	tests := []struct {
		name string
		text string
		want []string // pieces, specials as their marker
	}{
		{"empty", "", nil},
		{"words", "Hello world", []string{"Hello", " world"}},
		{"punctuation", "Hi, you!", []string{"Hi", ",", " you", "!"}},
		{"newlines", "a\nb", []string{"a", "\n", "b"}},
		{"double space", "a  b", []string{"a", " ", " b"}},
		{"long word", "internationalization", []string{"internat", "ionaliza", "tion"}},
		{"long spaced word", " internationalization", []string{" interna", "tionaliz", "ation"}},
		{"special", "<|user|>\nhi", []string{"<|user|>", "\n", "hi"}},
		{"not special", "<|a b|>", []string{"<", "|", "a", " b", "|", ">"}},
		{"utf8", "héllo wörld", []string{"héllo", " wörld"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var want []uint32
			for _, p := range tt.want {
				if strings.HasPrefix(p, "<|") && len(p) > 4 {
					want = append(want, specialID(p))
				} else {
					want = append(want, pieceID(p))
				}
			}
			assert.Equal(t, want, Tokenize(tt.text))
		})
	}
}

// TestTokenizeVectors pins the tokenizer: engines of different builds must agree.
func TestTokenizeVectors(t *testing.T) {
	assert.Equal(t, []uint32{BOS, tokSystem, tokUser, tokAssistant}, Tokenize("<|begin_of_text|><|system|><|user|><|assistant|>"))
	got := Tokenize("The quick brown fox.")
	require.Len(t, got, 5)
	for _, id := range got {
		assert.Less(t, id, uint32(SpecialBase))
	}
	assert.Equal(t, pieceID(" quick"), got[1])
	assert.Equal(t, []uint32{67663, 2849, 44838, 97400, 29395}, got, "pinned vector changed: the tokenizer is part of the wire contract")
}

func TestTokenizePrefixStable(t *testing.T) {
	a := "You are a helpful assistant. Answer briefly"
	for _, b := range []string{" and politely.", "\nSecond line", " <|user|> x", ""} {
		whole := Tokenize(a + b)
		assert.Equal(t, append(Tokenize(a), Tokenize(b)...), whole, "b=%q", b)
	}
}

func FuzzTokenizePrefixStable(f *testing.F) {
	f.Add("hello world", " again")
	f.Add("a\n", "\nb")
	f.Add("<|ab", " <|user|>")
	f.Fuzz(func(t *testing.T, a, b string) {
		whole := Tokenize(a + b)
		for _, id := range whole {
			if id >= VocabSize {
				t.Fatalf("token %d out of the vocabulary", id)
			}
		}
		aOK := a == "" || isWordByte(a[len(a)-1]) || a[len(a)-1] == '\n'
		bOK := b != "" && (b[0] == ' ' || b[0] == '\n' || specialLen(b) > 0)
		if aOK && bOK && !slices.Equal(whole, append(Tokenize(a), Tokenize(b)...)) {
			t.Fatalf("not prefix-stable: %q + %q", a, b)
		}
	})
}

func TestChatTokensMultiTurnExtends(t *testing.T) {
	turn1 := &prefixkey.Request{Format: prefixkey.FormatOpenAIChat, Model: "m", System: "Be terse.", HasSystem: true,
		Messages: []prefixkey.Message{{Role: "user", Text: "What is a KV cache?"}}}
	turn2 := &prefixkey.Request{Format: prefixkey.FormatOpenAIChat, Model: "m", System: "Be terse.", HasSystem: true,
		Messages: []prefixkey.Message{{Role: "user", Text: "What is a KV cache?"}, {Role: "assistant", Text: "Saved attention state."},
			{Role: "user", Text: "Why route on it?"}}}
	t1, t2 := PromptTokens(turn1), PromptTokens(turn2)
	require.Greater(t, len(t2), len(t1))
	assert.Equal(t, t1, t2[:len(t1)], "turn 2's prompt must extend turn 1's (generation prompt = start of the assistant message)")
	assert.Equal(t, uint32(BOS), t1[0])
	assert.Equal(t, []uint32{tokAssistant, pieceID("\n")}, t1[len(t1)-2:])
}

// TestTokenizeEndpointMatchesEngine checks that kvroute's engine tokenizer client, pointed at the
// engine's /tokenize, gets exactly the tokens the engine processes the request with.
func TestTokenizeEndpointMatchesEngine(t *testing.T) {
	e := newTestEngine(t, Config{})
	srv := httptest.NewServer(e.Handler())
	defer srv.Close()
	tok, err := prefixkey.NewEngineTokenizer(prefixkey.EngineTokenizerConfig{BaseURL: srv.URL, CacheSize: -1})
	require.NoError(t, err)
	bodies := []struct {
		f    prefixkey.Format
		body string
	}{
		{prefixkey.FormatOpenAIChat, `{"model":"` + DefaultModel + `","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Hello there, engine!"}]}`},
		{prefixkey.FormatOpenAIChat, `{"model":"` + DefaultModel + `","messages":[{"role":"developer","content":"Rule one."},{"role":"system","content":"Rule two."},{"role":"user","content":[{"type":"text","text":"part one"},{"type":"text","text":" part two"}]},{"role":"assistant","content":"ok"},{"role":"user","content":"more"}]}`},
		{prefixkey.FormatOpenAIChat, `{"model":"` + DefaultModel + `","messages":[{"role":"user","content":"no system"}]}`},
		{prefixkey.FormatOpenAICompletion, `{"model":"` + DefaultModel + `","prompt":"Once upon a time"}`},
		{prefixkey.FormatAnthropicMessages, `{"model":"` + DefaultModel + `","max_tokens":5,"system":[{"type":"text","text":"Sys A"},{"type":"text","text":"Sys B"}],"messages":[{"role":"user","content":"hey"}]}`},
	}
	for _, b := range bodies {
		req, err := prefixkey.Parse(b.f, []byte(b.body))
		require.NoError(t, err)
		got, err := tok.Tokenize(context.Background(), req)
		require.NoError(t, err, b.body)
		assert.Equal(t, PromptTokens(req), got, b.body)
		assert.Equal(t, e.InputOf(req).Tokens, got)
	}
}
