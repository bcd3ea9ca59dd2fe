package prefixkey

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestInjectAnthropicCacheControl(t *testing.T) {
	const marker = `"cache_control":{"type":"ephemeral"}`
	cases := []struct {
		name string
		body string
		want string // "" means: returned unchanged (the same slice)
	}{
		{
			name: "string system becomes one marked text block",
			body: `{"model":"c","system":"Be brief.","messages":[{"role":"user","content":"x"}]}`,
			want: `{"model":"c","system":[{"type":"text","text":"Be brief.",` + marker + `}],"messages":[{"role":"user","content":"x"}]}`,
		},
		{
			name: "string literal kept byte for byte, whitespace and unknown fields kept",
			body: "{ \"x_unknown\" : [1, {\"b\":2,\"a\":1}],\n  \"system\" : \"caf\\u00e9 \\\"q\\\"\" , \"model\":\"c\" }",
			want: "{ \"x_unknown\" : [1, {\"b\":2,\"a\":1}],\n  \"system\" : [{\"type\":\"text\",\"text\":\"caf\\u00e9 \\\"q\\\"\"," + marker + "}] , \"model\":\"c\" }",
		},
		{
			name: "last block of array system gets the marker",
			body: `{"system":[{"type":"text","text":"a"},{"type":"text","text":"b"}],"model":"c"}`,
			want: `{"system":[{"type":"text","text":"a"},{"type":"text","text":"b",` + marker + `}],"model":"c"}`,
		},
		{
			name: "marker goes after the last member, before whitespace",
			body: "{\"system\":[ {\"type\":\"text\", \"text\":\"a\" \n } ]}",
			want: "{\"system\":[ {\"type\":\"text\", \"text\":\"a\"," + marker + " \n } ]}",
		},
		{
			name: "earlier blocks with cache_control are left alone",
			body: `{"system":[{"type":"text","text":"a","cache_control":{"type":"ephemeral","ttl":"1h"}},{"type":"text","text":"b"}]}`,
			want: `{"system":[{"type":"text","text":"a","cache_control":{"type":"ephemeral","ttl":"1h"}},{"type":"text","text":"b",` + marker + `}]}`,
		},
		{
			name: "last block already marked",
			body: `{"system":[{"type":"text","text":"a"},{"type":"text","text":"b","cache_control":{"type":"ephemeral","ttl":"1h"}}]}`,
		},
		{
			name: "last block with explicit null cache_control is left alone",
			body: `{"system":[{"type":"text","text":"b","cache_control":null}]}`,
		},
		{
			name: "empty block gets the marker without a comma",
			body: `{"system":[{}]}`,
			want: `{"system":[{` + marker + `}]}`,
		},
		{name: "no system", body: `{"model":"c","messages":[{"role":"user","content":"x"}]}`},
		{name: "null system", body: `{"model":"c","system":null}`},
		{name: "empty string system", body: `{"model":"c","system":""}`},
		{name: "empty array system", body: `{"model":"c","system":[ ]}`},
		{
			name: "breakpoint limit already reached",
			body: `{"system":"s","tools":[{"name":"t","cache_control":{"type":"ephemeral"}}],"messages":[{"role":"user","content":[
				{"type":"text","text":"a","cache_control":{"type":"ephemeral"}},
				{"type":"text","text":"b","cache_control":{"type":"ephemeral"}},
				{"type":"text","text":"c","cache_control":{"type":"ephemeral"}}]}]}`,
		},
		{
			name: "three breakpoints leave room for one",
			body: `{"system":"s","messages":[{"role":"user","content":[
				{"type":"text","text":"a","cache_control":{"type":"ephemeral"}},{"type":"text","text":"b","cache_control":null},
				{"type":"text","text":"c","cache_control":{"type":"ephemeral"}},{"type":"text","text":"d","cache_control":{"type":"ephemeral"}}]}]}`,
			want: `{"system":[{"type":"text","text":"s",` + marker + `}],"messages":[{"role":"user","content":[
				{"type":"text","text":"a","cache_control":{"type":"ephemeral"}},{"type":"text","text":"b","cache_control":null},
				{"type":"text","text":"c","cache_control":{"type":"ephemeral"}},{"type":"text","text":"d","cache_control":{"type":"ephemeral"}}]}]}`,
		},
		{
			name: "duplicate system keys: the last is rewritten",
			body: `{"system":"a","system":"b"}`,
			want: `{"system":"a","system":[{"type":"text","text":"b",` + marker + `}]}`,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			body := []byte(tc.body)
			got, err := InjectAnthropicCacheControl(body)
			require.NoError(t, err)
			if tc.want == "" {
				require.Equal(t, tc.body, string(got))
				require.Same(t, &body[0], &got[0], "an unchanged body is returned as is")
				return
			}
			require.Equal(t, tc.want, string(got))
			require.True(t, json.Valid(got), "output is not valid JSON")
			require.Equal(t, tc.body, string(body), "input modified")
			// The rewrite is idempotent and the parsed system prompt is unchanged.
			again, err := InjectAnthropicCacheControl(got)
			require.NoError(t, err)
			require.Equal(t, string(got), string(again))
		})
	}
}

func TestInjectAnthropicCacheControlKeepsRequest(t *testing.T) {
	for _, tc := range anthropicCases {
		t.Run(tc.name, func(t *testing.T) {
			out, err := InjectAnthropicCacheControl([]byte(tc.body))
			require.NoError(t, err)
			got, err := ParseAnthropicMessages(out)
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestInjectAnthropicCacheControlErrors(t *testing.T) {
	cases := []errCase{
		{"empty", ``, "", "body is empty"},
		{"not an object", `[]`, "", "must be a JSON object"},
		{"invalid JSON", `{"system":"a",}`, "", "want an object key"},
		{"trailing garbage", `{"system":"a"} {}`, "", "want end of input"},
		{"invalid JSON in another field", `{"system":"a","messages":[1,]}`, "messages", "want a value"},
		{"system number", `{"system":1}`, "system", "must be a string or an array of content blocks"},
		{"system object", `{"system":{"type":"text"}}`, "system", "must be a string or an array of content blocks"},
		{"system block not an object", `{"system":[{"type":"text","text":"a"},"b"]}`, "system[1]", "must be a content block object"},
		{"bad string escape in system", `{"system":"\q"}`, "system", "invalid escape"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := InjectAnthropicCacheControl([]byte(tc.body))
			require.Nil(t, got)
			require.ErrorIs(t, err, ErrMalformed)
			var fe *FieldError
			require.ErrorAs(t, err, &fe)
			require.Equal(t, tc.field, fe.Field, "error: %v", err)
			require.True(t, strings.Contains(fe.Reason, tc.reason), "error: %v", err)
		})
	}
}
