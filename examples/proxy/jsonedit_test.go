package main

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/kvroute/kvroute/prefixkey"
)

func TestEditTopLevel(t *testing.T) {
	one, no := []byte("1"), []byte("false")
	tests := []struct {
		name, in string
		edits    []jsonEdit
		want     string
	}{
		{"replace and keep the rest byte for byte", `{"model":"m", "x":{"a":[1,"}"]},"stream":true ,"y":"<&>\u00e9"}`,
			[]jsonEdit{{"stream", no}}, `{"model":"m", "x":{"a":[1,"}"]},"stream":false ,"y":"<&>\u00e9"}`},
		{"append when absent", `{"model":"m"}`, []jsonEdit{{"max_tokens", one}}, `{"model":"m","max_tokens":1}`},
		{"append to an empty object", ` { } `, []jsonEdit{{"a", one}, {"b", no}}, ` {"a":1,"b":false} `},
		{"delete first, middle and last", `{"a":1,"b":2,"c":3}`, []jsonEdit{{"a", nil}, {"c", nil}}, `{"b":2}`},
		{"delete the only member", `{"stream_options":{"include_usage":true}}`, []jsonEdit{{"stream_options", nil}}, `{}`},
		{"delete an absent member", `{"a":1}`, []jsonEdit{{"zz", nil}}, `{"a":1}`},
		{"every duplicate replaced", `{"n":1,"n":2}`, []jsonEdit{{"n", []byte("3")}}, `{"n":3,"n":3}`},
		{"escaped key matched", `{"max\u005ftokens":99}`, []jsonEdit{{"max_tokens", one}}, `{"max\u005ftokens":1}`},
		{"key that contains quotes", `{"a\"b":1,"x":[{"\"":"\\"}]}`, []jsonEdit{{"x", nil}}, `{"a\"b":1}`},
		{"whitespace everywhere", "{\n \"a\" : 1 ,\n \"b\" :\t[ 2 ]\n}\n", []jsonEdit{{"b", one}}, "{\n \"a\" : 1 ,\n \"b\" :\t1\n}\n"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := editTopLevel([]byte(tc.in), tc.edits...)
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != tc.want {
				t.Errorf("got  %s\nwant %s", got, tc.want)
			}
			if !json.Valid(got) {
				t.Errorf("invalid JSON %s", got)
			}
		})
	}
	for _, bad := range []string{``, `[]`, `"x"`, `{"a":1`, `{"a":}`, `{"a" 1}`, `{"a":1,}`, `{"a":"x}`, `{"a":[1,2}`, `{a:1}`} {
		if _, err := editTopLevel([]byte(bad), jsonEdit{"a", []byte("1")}); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestTopLevelValue(t *testing.T) {
	body := []byte(`{"id":"x","choices":[{"kv_transfer_params":{"inner":true}}],"kv_transfer_params":{"do_remote_prefill":true,"remote_block_keys":["a"]}}`)
	v, ok, err := topLevelValue(body, "kv_transfer_params")
	if err != nil || !ok || string(v) != `{"do_remote_prefill":true,"remote_block_keys":["a"]}` {
		t.Errorf("%s %v %v", v, ok, err)
	}
	if _, ok, err := topLevelValue([]byte(`{"choices":[{"kv_transfer_params":{}}]}`), "kv_transfer_params"); ok || err != nil {
		t.Errorf("a nested member was taken for a top-level one: %v %v", ok, err)
	}
	if v, ok, _ := topLevelValue([]byte(`{"k":1,"k":null}`), "k"); !ok || string(v) != "null" {
		t.Errorf("duplicates: the last wins, got %s", v)
	}
}

// The prefill request is the client's body with max_tokens 1, not streamed, and the remote-decode
// transfer parameters; every other member is unchanged.
func TestPrefillBody(t *testing.T) {
	tests := []struct {
		name   string
		format prefixkey.Format
		in     string
		want   map[string]any
	}{
		{"chat with max_tokens, streamed", prefixkey.FormatOpenAIChat,
			`{"model":"m","messages":[{"role":"user","content":"hi <b>"}],"max_tokens":50,"stream":true,"stream_options":{"include_usage":true},"min_tokens":5,"vendor_x":{"k":[1]}}`,
			map[string]any{"model": "m", "messages": []any{map[string]any{"role": "user", "content": "hi <b>"}}, "max_tokens": 1.0,
				"stream": false, "vendor_x": map[string]any{"k": []any{1.0}},
				"kv_transfer_params": map[string]any{"do_remote_decode": true, "do_remote_prefill": false}}},
		{"chat with max_completion_tokens", prefixkey.FormatOpenAIChat,
			`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":50}`,
			map[string]any{"model": "m", "messages": []any{map[string]any{"role": "user", "content": "hi"}}, "max_completion_tokens": 1.0,
				"stream": false, "kv_transfer_params": map[string]any{"do_remote_decode": true, "do_remote_prefill": false}}},
		{"chat without a limit", prefixkey.FormatOpenAIChat,
			`{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
			map[string]any{"model": "m", "messages": []any{map[string]any{"role": "user", "content": "hi"}}, "max_tokens": 1.0,
				"stream": false, "kv_transfer_params": map[string]any{"do_remote_decode": true, "do_remote_prefill": false}}},
		{"anthropic messages, client's own transfer params replaced", prefixkey.FormatAnthropicMessages,
			`{"model":"m","system":"s","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"hi"}],"kv_transfer_params":{"x":1}}`,
			map[string]any{"model": "m", "system": "s", "max_tokens": 1.0, "stream": false,
				"messages":           []any{map[string]any{"role": "user", "content": "hi"}},
				"kv_transfer_params": map[string]any{"do_remote_decode": true, "do_remote_prefill": false}}},
		{"completions", prefixkey.FormatOpenAICompletion, `{"model":"m","prompt":"once","max_tokens":9}`,
			map[string]any{"model": "m", "prompt": "once", "max_tokens": 1.0, "stream": false,
				"kv_transfer_params": map[string]any{"do_remote_decode": true, "do_remote_prefill": false}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req, err := prefixkey.Parse(tc.format, []byte(tc.in))
			if err != nil {
				t.Fatal(err)
			}
			out, err := prefillBody(&parsedRequest{format: tc.format, req: req, body: []byte(tc.in)})
			if err != nil {
				t.Fatal(err)
			}
			var got map[string]any
			if err := json.Unmarshal(out, &got); err != nil {
				t.Fatalf("%v in %s", err, out)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got  %v\nwant %v", got, tc.want)
			}
			if strings.Contains(tc.in, "<b>") && !bytes.Contains(out, []byte(`"hi <b>"`)) {
				t.Errorf("untouched members re-encoded: %s", out)
			}
		})
	}
}

// editTopLevel on any JSON object yields a JSON object with exactly the edits applied.
func FuzzEditTopLevel(f *testing.F) {
	for _, s := range []string{`{}`, `{"a":1}`, `{"stream":true,"x":[{"y":"}\""}],"stream_options":null}`, "{\"a\" :\n\"\\u0022\"}"} {
		f.Add([]byte(s), "stream", []byte("false"), true)
	}
	f.Fuzz(func(t *testing.T, body []byte, key string, value []byte, del bool) {
		var before map[string]json.RawMessage
		if json.Unmarshal(body, &before) != nil || before == nil || !json.Valid(value) || !utf8.ValidString(key) {
			return
		}
		v := bytes.TrimSpace(value)
		if del {
			v = nil
		}
		out, err := editTopLevel(body, jsonEdit{key, v})
		if err != nil {
			t.Fatalf("%q: %v", body, err)
		}
		var after map[string]json.RawMessage
		if err := json.Unmarshal(out, &after); err != nil {
			t.Fatalf("%q → invalid %q: %v", body, out, err)
		}
		if del {
			delete(before, key)
		} else {
			before[key] = v
		}
		if len(after) != len(before) {
			t.Fatalf("%q → %q: %d members, want %d", body, out, len(after), len(before))
		}
		for k, bv := range before {
			if av, ok := after[k]; !ok || !jsonEqual(av, bv) {
				t.Fatalf("%q → %q: member %q is %s, want %s", body, out, k, av, bv)
			}
		}
	})
}

func jsonEqual(a, b []byte) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	return reflect.DeepEqual(x, y)
}
