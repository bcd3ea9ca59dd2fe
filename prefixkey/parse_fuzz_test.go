package prefixkey

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

// fuzzParse checks the parser contract on arbitrary bytes: no panic; an error wraps ErrMalformed
// and is a *FieldError; a Request has a model; the result does not depend on the body buffer
// after the call; and the parser agrees with encoding/json that the body is valid JSON whenever
// it accepts it.
func fuzzParse(t *testing.T, parse func([]byte) (*Request, error), body []byte) {
	r, err := parse(body)
	if err != nil {
		if r != nil {
			t.Fatalf("non-nil Request with error %v", err)
		}
		if !errors.Is(err, ErrMalformed) {
			t.Fatalf("error %v does not wrap ErrMalformed", err)
		}
		var fe *FieldError
		if !errors.As(err, &fe) {
			t.Fatalf("error %v is not a *FieldError", err)
		}
		return
	}
	if r == nil || r.Model == "" {
		t.Fatalf("accepted with no model: %+v", r)
	}
	if !json.Valid(body) {
		t.Fatalf("accepted invalid JSON %q", body)
	}
	checkMedia(t, r)
	// A message's text is its parts' texts in order, whether it is a view into body or a copy.
	for i, m := range r.Messages {
		var cat strings.Builder
		for _, p := range m.Parts {
			cat.WriteString(p.Text)
		}
		if cat.String() != m.Text {
			t.Fatalf("message %d: text %q, parts' text %q", i, m.Text, cat.String())
		}
	}
	// Parsing is deterministic, whether or not the Request shares body's bytes.
	again, err := parse(append([]byte(nil), body...))
	if err != nil {
		t.Fatalf("second parse failed: %v", err)
	}
	if !requestsEqual(r, again) {
		t.Fatalf("two parses differ:\n%+v\n%+v", r, again)
	}
}

// checkMedia checks that r's media items point into its messages, in order, and that its keys
// can be computed: a prefix key and, with spans unknown, no block keys.
func checkMedia(t *testing.T, r *Request) {
	t.Helper()
	prevMsg, prevOff := 0, 0
	for i, m := range r.Media {
		if m.Message < 0 || m.Message >= len(r.Messages) {
			t.Fatalf("media %d: message %d of %d", i, m.Message, len(r.Messages))
		}
		msg := &r.Messages[m.Message]
		if m.Part < 0 || m.Part >= len(msg.Parts) || m.Offset < 0 || m.Offset > len(msg.Text) {
			t.Fatalf("media %d: part %d of %d, offset %d of %d", i, m.Part, len(msg.Parts), m.Offset, len(msg.Text))
		}
		if m.Message < prevMsg || m.Message == prevMsg && m.Offset < prevOff {
			t.Fatalf("media %d out of order: %+v", i, r.Media)
		}
		if m.Kind != MediaImage && m.Kind != MediaAudio && m.Kind != MediaVideo {
			t.Fatalf("media %d: kind %q", i, m.Kind)
		}
		prevMsg, prevOff = m.Message, m.Offset
	}
	if len(r.CacheSalt) > MaxCacheSaltLength {
		t.Fatalf("cache_salt of %d bytes", len(r.CacheSalt))
	}
	r.PrefixKey(0)
	if len(r.Media) > 0 {
		c := *r
		c.TokenIDs = make([]uint32, 64)
		if keys := c.BlockKeys(nil, 16); len(keys) != 0 {
			t.Fatalf("block keys for media without spans: %v", keys)
		}
	}
}

func requestsEqual(a, b *Request) bool {
	ja, err1 := json.Marshal(a)
	jb, err2 := json.Marshal(b)
	return err1 == nil && err2 == nil && string(ja) == string(jb)
}

func fuzzSeeds(f *testing.F, cases []parseCase, errs ...[]errCase) {
	for _, c := range cases {
		f.Add([]byte(c.body))
	}
	for _, cs := range errs {
		for _, c := range cs {
			f.Add([]byte(c.body))
		}
	}
}

func FuzzParseOpenAIChat(f *testing.F) {
	fuzzSeeds(f, openAIChatCases, commonErrCases, openAIChatErrCases)
	f.Add([]byte(`{"model":"m","cache_salt":"s","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"input_audio","input_audio":{"data":"x"}},{"type":"image_url","image_url":{"url":"data:;base64,"}}]}]}`))
	f.Add(parseBenchChatBody(1 << 10))
	// Texts long enough to stay views into the body, beside copies, media and duplicate keys.
	long := strings.Repeat("plain words without escapes ", 4)
	f.Add([]byte(`{"model":"m","messages":[{"role":"system","content":"` + long + `"},{"role":"developer","content":"` + long + `"},` +
		`{"role":"user","content":"` + long + `"},{"role":"user","content":"esc\n` + long + `"},{"role":"assistant","content":[{"type":"text","text":"` + long + `"}]},` +
		`{"role":"user","content":[{"type":"text","text":"` + long + `"},{"type":"image_url","image_url":{"url":"https://x/y.png"}},{"type":"text","text":""}]},` +
		`{"role":"user","content":"` + long + `","content":"short"}]}`))
	f.Fuzz(func(t *testing.T, body []byte) { fuzzParse(t, ParseOpenAIChat, body) })
}

func FuzzParseOpenAICompletion(f *testing.F) {
	fuzzSeeds(f, openAICompletionCases, commonErrCases, openAICompletionErrCases)
	long := strings.Repeat("plain words without escapes ", 4)
	f.Add([]byte(`{"model":"m","prompt":["` + long + `","esc\t` + long + `","short"]}`))
	f.Fuzz(func(t *testing.T, body []byte) { fuzzParse(t, ParseOpenAICompletion, body) })
}

func FuzzParseAnthropicMessages(f *testing.F) {
	fuzzSeeds(f, anthropicCases, commonErrCases, anthropicErrCases)
	f.Add(parseBenchAnthropicBody(1 << 10))
	long := strings.Repeat("plain words without escapes ", 4)
	f.Add([]byte(`{"model":"m","max_tokens":1,"system":"` + long + `","messages":[{"role":"user","content":"` + long + `"},` +
		`{"role":"assistant","content":[{"type":"text","text":"` + long + `"},{"type":"tool_use","id":"t","name":"n","input":{}}]},` +
		`{"role":"user","content":[{"type":"image","source":{"type":"url","url":"https://x/y.png"}},{"type":"text","text":"` + long + `"}]}]}`))
	f.Fuzz(func(t *testing.T, body []byte) { fuzzParse(t, ParseAnthropicMessages, body) })
}

// FuzzInjectAnthropicCacheControl checks: no panic; errors wrap ErrMalformed; the output is valid
// JSON, parses to the same Request as the input, and a second injection changes nothing.
func FuzzInjectAnthropicCacheControl(f *testing.F) {
	fuzzSeeds(f, anthropicCases, commonErrCases, anthropicErrCases)
	f.Add([]byte(`{"system":[{"type":"text","text":"a"},{}],"model":"c","messages":[]}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		out, err := InjectAnthropicCacheControl(body)
		if err != nil {
			if out != nil || !errors.Is(err, ErrMalformed) {
				t.Fatalf("bad error result: %q, %v", out, err)
			}
			return
		}
		if !json.Valid(out) {
			t.Fatalf("invalid JSON output %q from %q", out, body)
		}
		again, err := InjectAnthropicCacheControl(out)
		if err != nil || string(again) != string(out) {
			t.Fatalf("not idempotent: %q -> %q (%v)", out, again, err)
		}
		want, werr := ParseAnthropicMessages(body)
		got, gerr := ParseAnthropicMessages(out)
		if (werr == nil) != (gerr == nil) || werr == nil && !requestsEqual(want, got) {
			t.Fatalf("injection changed the request:\n%q: %+v %v\n%q: %+v %v", body, want, werr, out, got, gerr)
		}
	})
}

// FuzzJSONReader checks the JSON reader against encoding/json: the same validity, and a
// canonical form that means the same value and is a fixed point.
func FuzzJSONReader(f *testing.F) {
	for _, s := range []string{`{"b":[1,"x\u00e9",{"d":null,"c":true}],"a":-1.5e3}`, `"\ud83d\ude00\ud800"`, "\"\xff\"", `[1,]`, `{"a":1,"a":2}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) { parseCheckAgainstStdlib(t, b) })
}
