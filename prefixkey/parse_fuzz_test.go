package prefixkey

import (
	"encoding/json"
	"errors"
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
	// Parsing is deterministic, and the Request does not alias body.
	again, err := parse(append([]byte(nil), body...))
	if err != nil {
		t.Fatalf("second parse failed: %v", err)
	}
	if !requestsEqual(r, again) {
		t.Fatalf("two parses differ:\n%+v\n%+v", r, again)
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
	f.Add(parseBenchChatBody(1 << 10))
	f.Fuzz(func(t *testing.T, body []byte) { fuzzParse(t, ParseOpenAIChat, body) })
}

func FuzzParseOpenAICompletion(f *testing.F) {
	fuzzSeeds(f, openAICompletionCases, commonErrCases, openAICompletionErrCases)
	f.Fuzz(func(t *testing.T, body []byte) { fuzzParse(t, ParseOpenAICompletion, body) })
}

func FuzzParseAnthropicMessages(f *testing.F) {
	fuzzSeeds(f, anthropicCases, commonErrCases, anthropicErrCases)
	f.Add(parseBenchAnthropicBody(1 << 10))
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
