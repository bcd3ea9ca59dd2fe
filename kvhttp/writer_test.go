package kvhttp

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kvroute/kvroute"
)

// note spots a stream's terminal event however the writes cut it, and only a terminal event.
func TestNoteStream(t *testing.T) {
	streams := []struct {
		text  string
		ended bool
	}{
		{"data: {\"choices\":[]}\n\ndata: [DONE]\n\n", true},
		{"event: content_block_delta\ndata: {}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n", true},
		{"data: {\"choices\":[]}\n\ndata: [DON", false},
		{"event: message_sto", false},
		{"data: {\"content\":\"data: [DONE\"}\n\n", false},
	}
	for _, s := range streams {
		// Every way of cutting the stream in three writes.
		for i := 0; i <= len(s.text); i++ {
			for j := i; j <= len(s.text); j++ {
				w := &writer{a: &attempt{stream: true}}
				for _, p := range []string{s.text[:i], s.text[i:j], s.text[j:]} {
					w.note([]byte(p))
				}
				if w.ended.Load() != s.ended {
					t.Fatalf("%q cut at %d and %d: ended %v, want %v", s.text, i, j, w.ended.Load(), s.ended)
				}
			}
		}
		// One byte at a time.
		w := &writer{a: &attempt{stream: true}}
		for k := range len(s.text) {
			w.note([]byte{s.text[k]})
		}
		if w.ended.Load() != s.ended {
			t.Errorf("%q byte by byte: ended %v, want %v", s.text, w.ended.Load(), s.ended)
		}
	}
}

// countLease counts FirstToken calls.
type countLease struct{ first int }

func (l *countLease) FirstToken()          { l.first++ }
func (l *countLease) Done(kvroute.Outcome) {}

// A streamed response's first byte is a first token only for a success: an engine's error comes
// at once and would teach tier 4 a prefill rate far above the engine's.
func TestFirstTokenOnlyForSuccess(t *testing.T) {
	for _, tc := range []struct {
		status int // 0: no WriteHeader (an implicit 200)
		want   int
	}{{0, 1}, {http.StatusOK, 1}, {http.StatusBadRequest, 0}, {http.StatusInternalServerError, 0}} {
		l := &countLease{}
		a := &attempt{lease: l, stream: true}
		w := &writer{ResponseWriter: httptest.NewRecorder(), a: a}
		if tc.status != 0 {
			w.WriteHeader(tc.status)
		}
		_, _ = w.Write([]byte("data: {}\n\n"))
		_, _ = w.Write([]byte("data: {}\n\n"))
		if l.first != tc.want {
			t.Errorf("status %d: %d FirstToken calls, want %d", tc.status, l.first, tc.want)
		}
	}
}

// lastCachedTokens reads the cached-token counts of OpenAI's, vLLM's and Anthropic's usage, the
// last one when there are several, and nothing else.
func TestLastCachedTokens(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int
	}{
		{`{"usage":{"prompt_tokens_details":{"cached_tokens":32}}}`, 32},
		{`{"usage":{"prompt_tokens_details": {"cached_tokens" :` + "\n\t" + ` 7}}}`, 7},
		{`{"usage":{"cache_creation_input_tokens":5,"cache_read_input_tokens":48}}`, 48},
		{`data: {"usage":{"cached_tokens":1}}` + "\n\n" + `data: {"usage":{"cached_tokens":2}}`, 2},
		{`{"usage":{"cached_tokens":0}}`, 0},
		{`{"usage":{"prompt_tokens_details":null}}`, -1},
		{`{"usage":{"cached_tokens":null}}`, -1},
		{`{"content":"say \"cached_tokens\": 99"}`, -1},
		{`{"cache_creation_input_tokens":5}`, -1},
		{`"cached_tokens"`, -1},
		{`{"cached_tokens":12345678901234}`, -1},
	} {
		if got := lastCachedTokens([]byte(tc.in)); got != tc.want {
			t.Errorf("%s: %d, want %d", tc.in, got, tc.want)
		}
	}
}

// FuzzLastCachedTokens: lastCachedTokens never panics, and a match is a number it read.
func FuzzLastCachedTokens(f *testing.F) {
	f.Add([]byte(`{"usage":{"prompt_tokens_details":{"cached_tokens":32}}}`))
	f.Add([]byte(`{"cache_read_input_tokens": 48`))
	f.Fuzz(func(t *testing.T, b []byte) {
		if n := lastCachedTokens(b); n < -1 || n > 999999999 {
			t.Fatalf("%q: %d", b, n)
		}
	})
}

// TestAnswerScannerAcrossWrites feeds an answer a byte at a time and in one write: the usage's
// cached tokens and a stream's terminal event are found however the writes cut them.
func TestAnswerScannerAcrossWrites(t *testing.T) {
	answers := map[string]struct {
		body     string
		cached   int
		terminal bool
	}{
		"openai stream": {"data: {\"choices\":[]}\n\ndata: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\": 48}}}\n\ndata: [DONE]\n\n", 48, true},
		"anthropic":     {"event: message_start\ndata: {\"usage\":{\"cache_read_input_tokens\":7}}\n\nevent: message_stop\ndata: {}\n\n", 7, true},
		"json answer":   {`{"usage":{"prompt_tokens_details":{"cached_tokens":16}}}`, 16, false},
		"prompt quotes": {`{"content":"say \"cached_tokens\": 99"}`, -1, false},
	}
	for name, a := range answers {
		t.Run(name, func(t *testing.T) {
			var whole, bytewise AnswerScanner
			if whole.CachedTokens() != -1 || whole.Terminal() {
				t.Fatal("a new scanner has seen something")
			}
			whole.Write([]byte(a.body))
			for i := range len(a.body) {
				bytewise.Write([]byte{a.body[i]})
			}
			for _, s := range []*AnswerScanner{&whole, &bytewise} {
				if s.CachedTokens() != a.cached || s.Terminal() != a.terminal {
					t.Errorf("cached %d terminal %v, want %d %v", s.CachedTokens(), s.Terminal(), a.cached, a.terminal)
				}
			}
		})
	}
}
