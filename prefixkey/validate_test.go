package prefixkey

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// badUnicode are strings, as JSON string contents, that encoding/json decodes lossily: invalid
// UTF-8 and unpaired surrogate escapes all read as U+FFFD. Any two of them (and U+FFFD itself)
// must never give one key.
var badUnicode = []string{"\xff", "\xfe", "\xc0\xaf", "\xe6\x97", "\xed\xa0\x80", `\ud800`, `\udc00`, `\ud83d\u0041`, `\ud83dx`}

// unicodeFields are bodies with one string the keys depend on replaced by %s, and the field an
// error must name.
var unicodeFields = []struct {
	name  string
	f     Format
	body  string
	field string
}{
	{"openai content", FormatOpenAIChat, `{"model":"m","messages":[{"role":"user","content":"a%sb"}]}`, "messages[0].content"},
	{"openai text part", FormatOpenAIChat, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a%sb"}]}]}`, "messages[0].content[0].text"},
	{"openai system", FormatOpenAIChat, `{"model":"m","messages":[{"role":"system","content":"s%s"},{"role":"user","content":"u"}]}`, "messages[0].content"},
	{"openai second message", FormatOpenAIChat, `{"model":"m","messages":[{"role":"user","content":"u"},{"role":"assistant","content":"%s"}]}`, "messages[1].content"},
	{"openai tool call arguments", FormatOpenAIChat, `{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"%s"}}]}]}`, "messages[0].tool_calls"},
	{"openai image url", FormatOpenAIChat, `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x/%s"}}]}]}`, "messages[0].content[0].image_url"},
	{"openai cache_salt", FormatOpenAIChat, `{"model":"m","messages":[],"cache_salt":"t%s"}`, "cache_salt"},
	{"completions cache_salt", FormatOpenAICompletion, `{"model":"m","prompt":"p","cache_salt":"%s"}`, "cache_salt"},
	{"openai image uuid", FormatOpenAIChat, `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"},"uuid":"%s"}]}]}`, "messages[0].content[0].uuid"},
	{"anthropic image url", FormatAnthropicMessages, `{"model":"c","messages":[{"role":"user","content":[{"type":"image","source":{"type":"url","url":"u%s"}}]}]}`, "messages[0].content[0].source"},
	{"openai model", FormatOpenAIChat, `{"model":"m%s","messages":[]}`, "model"},
	{"openai stop", FormatOpenAIChat, `{"model":"m","messages":[],"stop":["%s"]}`, "stop[0]"},
	{"openai tools", FormatOpenAIChat, `{"model":"m","messages":[],"tools":[{"type":"function","function":{"name":"f","description":"%s"}}]}`, "tools"},
	{"openai unknown field", FormatOpenAIChat, `{"model":"m","messages":[],"reasoning_effort":"%s"}`, "reasoning_effort"},
	{"openai key of a message member", FormatOpenAIChat, `{"model":"m","messages":[{"role":"user","content":"u","x%s":1}]}`, "messages[0]"},
	{"completions prompt", FormatOpenAICompletion, `{"model":"m","prompt":"p%s"}`, "prompt"},
	{"completions second prompt", FormatOpenAICompletion, `{"model":"m","prompt":["p","%s"]}`, "prompt[1]"},
	{"anthropic system string", FormatAnthropicMessages, `{"model":"c","system":"%s","messages":[]}`, "system"},
	{"anthropic system block", FormatAnthropicMessages, `{"model":"c","system":[{"type":"text","text":"%s"}],"messages":[]}`, "system[0].text"},
	{"anthropic content", FormatAnthropicMessages, `{"model":"c","messages":[{"role":"user","content":"%s"}]}`, "messages[0].content"},
	{"anthropic text block", FormatAnthropicMessages, `{"model":"c","messages":[{"role":"user","content":[{"type":"text","text":"%s"}]}]}`, "messages[0].content[0].text"},
	{"anthropic tool_result text", FormatAnthropicMessages, `{"model":"c","messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"%s"}]}]}`, "messages[0].content[0].content"},
	{"anthropic tool_result nested text", FormatAnthropicMessages, `{"model":"c","messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"%s"}]}]}]}`, "messages[0].content[0].content[0].text"},
	{"anthropic tool_use input", FormatAnthropicMessages, `{"model":"c","messages":[{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"f","input":{"q":"%s"}}]}]}`, "messages[0].content[0].input"},
	{"anthropic stop_sequences", FormatAnthropicMessages, `{"model":"c","messages":[],"stop_sequences":["%s"]}`, "stop_sequences[0]"},
}

// Bodies that differ only in their invalid UTF-8 (or unpaired surrogates) never share a prefix
// key or a Request (what the response-cache key is computed from): both are rejected, naming the
// field. Before, all of them decoded to U+FFFD and read the same.
func TestInvalidUnicodeNeverSharesAKey(t *testing.T) {
	for _, tc := range unicodeFields {
		t.Run(tc.name, func(t *testing.T) {
			type result struct {
				in  string
				req *Request
			}
			var accepted []result
			for _, bad := range append([]string{`\ufffd`, "\uFFFD"}, badUnicode...) {
				body := strings.Replace(tc.body, "%s", bad, 1)
				r, err := Parse(tc.f, []byte(body))
				if err != nil {
					fe, ok := errors.AsType[*FieldError](err)
					require.True(t, ok, "%q: %v", body, err)
					require.Equal(t, tc.field, fe.Field, "%q: %v", body, err)
					require.True(t, fe.Reason == "must be valid UTF-8" || strings.Contains(fe.Reason, "unpaired UTF-16 surrogate"), "%q: %v", body, err)
					continue
				}
				for _, a := range accepted {
					k1, _ := a.req.PrefixKey(0)
					k2, _ := r.PrefixKey(0)
					same := a.in == `\ufffd` && bad == "\uFFFD" // the same character, escaped or not
					if !same && requestsEqual(a.req, r) {
						t.Errorf("%q and %q parse to the same request (prefix keys %v, %v)", a.in, bad, k1, k2)
					}
				}
				accepted = append(accepted, result{bad, r})
			}
			require.Len(t, accepted, 2, "only the valid U+FFFD is accepted")
		})
	}
}

// What the parser skips reaches no key, and is not checked: encoding/json's leniency holds there.
func TestInvalidUnicodeInSkippedFields(t *testing.T) {
	for _, body := range []string{
		"{\"model\":\"m\",\"messages\":[],\"user\":\"\xff\",\"metadata\":{\"a\":\"\\ud800\"}}",
		"{\"model\":\"m\",\"messages\":[],\"store\":[\"\xfe\"],\"x\":null}",
	} {
		_, err := ParseOpenAIChat([]byte(body))
		require.NoError(t, err, "%q", body)
	}
}

// Out-of-range sampling parameters are refused with the field named, as the providers' APIs do.
func TestParamRanges(t *testing.T) {
	type rng struct {
		field  string
		bad    []string
		good   []string
		reason string
	}
	openai := []rng{
		{"temperature", []string{"-0.1", "2.01", "3", "-1e-9"}, []string{"0", "2", "1.5", "-0", "2.0"}, "must be between 0 and 2"},
		{"top_p", []string{"-0.5", "1.0001", "2"}, []string{"0", "1", "0.95"}, "must be between 0 and 1"},
		{"max_tokens", []string{"0", "-1", "-9223372036854775808"}, []string{"1", "4096"}, "must be at least 1"},
		{"max_completion_tokens", []string{"0", "-5"}, []string{"1", "100"}, "must be at least 1"},
		{"n", []string{"0", "-1"}, []string{"1", "4"}, "must be at least 1"},
	}
	anthropic := []rng{
		{"temperature", []string{"-0.1", "1.01", "2"}, []string{"0", "1", "0.7"}, "must be between 0 and 1"},
		{"top_p", []string{"-0.1", "1.5"}, []string{"0", "1", "0.9"}, "must be between 0 and 1"},
		{"max_tokens", []string{"0", "-1"}, []string{"1", "1024"}, "must be at least 1"},
	}
	formats := []struct {
		f      Format
		prefix string
		ranges []rng
	}{
		{FormatOpenAIChat, `{"model":"m","messages":[{"role":"user","content":"x"}],`, openai},
		{FormatOpenAICompletion, `{"model":"m","prompt":"x",`, openai},
		{FormatAnthropicMessages, `{"model":"c","messages":[{"role":"user","content":"x"}],`, anthropic},
	}
	for _, fm := range formats {
		for _, r := range fm.ranges {
			for _, v := range r.bad {
				t.Run(fm.f.String()+"/"+r.field+"="+v, func(t *testing.T) {
					got, err := Parse(fm.f, []byte(fm.prefix+`"`+r.field+`":`+v+`}`))
					require.Nil(t, got)
					require.ErrorIs(t, err, ErrMalformed)
					fe, ok := errors.AsType[*FieldError](err)
					require.True(t, ok)
					require.Equal(t, r.field, fe.Field)
					require.Equal(t, r.reason, fe.Reason)
				})
			}
			for _, v := range append(r.good, "null") {
				t.Run(fm.f.String()+"/"+r.field+"="+v, func(t *testing.T) {
					_, err := Parse(fm.f, []byte(fm.prefix+`"`+r.field+`":`+v+`}`))
					require.NoError(t, err)
				})
			}
		}
	}
	// The last of duplicate keys is the one checked, as it is the one kept.
	_, err := ParseOpenAIChat([]byte(`{"model":"m","messages":[],"temperature":5,"temperature":1}`))
	require.NoError(t, err)
}
