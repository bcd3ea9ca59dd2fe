package prefixkey

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"testing/iotest"
)

// The streamed /tokenize body is the JSON encoding/json would write (up to its HTML escapes),
// read in any chunk sizes, and its announced length is exact.
func TestTokenizeBodyEncoding(t *testing.T) {
	tricky := "quotes \" backslash \\ newline \n tab \t cr \r nul \x00 bell \x07 del \x7f é 日本 😀 bad \xff\xfe end"
	reqs := []*Request{
		chatRequest("m", "sys "+tricky, "user "+tricky, "assistant ok"),
		chatRequest("", "", tricky),
		{Format: FormatOpenAICompletion, Model: "m", Prompt: []string{tricky, "second"}},
	}
	for i, r := range reqs {
		mode := modeOf(r)
		var want []byte
		if mode == modeChat {
			type msg struct {
				Role    string `json:"role"`
				Content string `json:"content"`
			}
			var msgs []msg
			if r.HasSystem {
				msgs = append(msgs, msg{"system", r.System})
			}
			for _, m := range r.Messages {
				msgs = append(msgs, msg{m.Role, m.Text})
			}
			want, _ = json.Marshal(struct {
				Model    string `json:"model,omitempty"`
				Messages []msg  `json:"messages"`
			}{r.Model, msgs})
		} else {
			want, _ = json.Marshal(struct {
				Model  string `json:"model,omitempty"`
				Prompt string `json:"prompt"`
			}{r.Model, r.Prompt[0]})
		}
		var wantV, gotV any
		if err := json.Unmarshal(want, &wantV); err != nil {
			t.Fatal(err)
		}
		for _, wrap := range []func(io.Reader) io.Reader{
			func(r io.Reader) io.Reader { return r }, iotest.OneByteReader, iotest.HalfReader,
		} {
			body, size := tokenizeBody(r, mode)
			got, err := io.ReadAll(wrap(body))
			if err != nil {
				t.Fatal(err)
			}
			if int64(len(got)) != size {
				t.Errorf("request %d: %d bytes read, %d announced", i, len(got), size)
			}
			if !json.Valid(got) {
				t.Fatalf("request %d: invalid JSON %q", i, got)
			}
			if err := json.Unmarshal(got, &gotV); err != nil {
				t.Fatal(err)
			}
			if g, w := mustJSON(t, gotV), mustJSON(t, wantV); g != w {
				t.Errorf("request %d:\ngot  %s\nwant %s", i, g, w)
			}
		}
	}
	// Every buffer size, for the escapes and multi-byte characters split across reads.
	r := chatRequest("m", tricky)
	whole, _ := io.ReadAll(func() io.Reader { b, _ := tokenizeBody(r, modeChat); return b }())
	for n := 1; n <= 8; n++ {
		body, _ := tokenizeBody(r, modeChat)
		var got bytes.Buffer
		buf := make([]byte, n)
		for {
			k, err := body.Read(buf)
			got.Write(buf[:k])
			if err == io.EOF {
				break
			}
		}
		if !bytes.Equal(got.Bytes(), whole) {
			t.Errorf("reads of %d bytes: %q, want %q", n, got.Bytes(), whole)
		}
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// Tokenizing an 8 MiB prompt does not build its /tokenize body in memory: the bytes Tokenize
// allocates (the engine here reads the body into io.Discard) are far below the prompt's size.
func TestTokenizeStreamsTheBody(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector's allocations blur the measure")
	}
	var got int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got, _ = io.Copy(io.Discard, r.Body)
		_, _ = io.WriteString(w, `{"tokens":[1,2,3],"count":3}`)
	}))
	defer srv.Close()
	tok, err := NewEngineTokenizer(EngineTokenizerConfig{BaseURL: srv.URL, Client: srv.Client(), Timeout: 30e9, CacheSize: -1})
	if err != nil {
		t.Fatal(err)
	}
	doc := strings.Repeat("A line of a pasted document, \"quoted\".\n", (8<<20)/40)
	r := chatRequest("m", "system", doc)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	if _, err := tok.Tokenize(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	runtime.ReadMemStats(&after)
	if got < int64(len(doc)) {
		t.Fatalf("the engine read %d bytes", got)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 2<<20 {
		t.Errorf("tokenizing a %d-byte prompt allocated %d bytes, want ≤ 2 MiB", len(doc), alloc)
	}
}
