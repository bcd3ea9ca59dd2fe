package prefixkey

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Fields the parser does not model still reach Params.Other, canonical and sorted, so that the
// response-cache key covers them; output-neutral fields and nulls do not.
func TestParamsOther(t *testing.T) {
	cases := []struct {
		name string
		f    Format
		body string
		want string
	}{
		{"openai logprobs and reasoning", FormatOpenAIChat,
			`{"model":"m","messages":[{"role":"user","content":"x"}],"top_logprobs":3,"logprobs":true,"user":"u1","reasoning_effort":"low","metadata":{"a":1},"seed":null}`,
			`{"logprobs":true,"reasoning_effort":"low","top_logprobs":3}`},
		{"openai none", FormatOpenAIChat, `{"model":"m","messages":[],"user":"u1","service_tier":"auto","store":true,"echo":null}`, ``},
		{"completions echo", FormatOpenAICompletion, `{"model":"m","prompt":"p","echo":true,"best_of":2}`, `{"best_of":2,"echo":true}`},
		{"anthropic nested canonical", FormatAnthropicMessages,
			`{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"x"}],"thinking":{"type":"enabled","budget_tokens":10},"top_k":5,"top_k":7}`,
			`{"thinking":{"budget_tokens":10,"type":"enabled"},"top_k":7}`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r, err := Parse(tc.f, []byte(tc.body))
			require.NoError(t, err)
			assert.Equal(t, tc.want, string(r.Params.Other))
		})
	}
}
