package prefixkey

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
)

// bodySizes are the body sizes of BenchmarkParseBodySize: a long conversation, a large document,
// and a body near the reference proxy's default limit (server.max_body_bytes, 8 MiB).
var bodySizes = []struct {
	name string
	n    int
}{{"64KiB", 64 << 10}, {"1MiB", 1 << 20}, {"8MiB", 8 << 20}}

// sizedChatBody returns an OpenAI chat body of at least size bytes, built in linear time: a
// system prompt, then user/assistant/tool turns (string content, text and image parts,
// tool_calls in Extra) whose user turns each carry a paragraph of about 2 KiB, as a pasted
// document would.
func sizedChatBody(size int) []byte {
	var b bytes.Buffer
	b.Grow(size + 8<<10)
	b.WriteString(`{"model":"meta-llama/Llama-3.1-8B-Instruct","temperature":0.2,"max_tokens":512,"stream":true,"tools":`)
	b.WriteString(parseBenchTools)
	b.WriteString(`,"messages":[{"role":"system","content":`)
	b.Write(parseMustJSON(parseBenchSystem))
	b.WriteString(`}`)
	para := strings.Repeat("The quick brown fox jumps over the lazy dog; \"quoted\" text, tabs\tand\nnewlines. ", 24)
	for i := 0; b.Len() < size; i++ {
		for _, m := range parseBenchTurn(i) {
			if i%2 == 0 && m["role"] == "user" {
				m["content"] = fmt.Sprintf("Document %d:\n%s", i, para)
			}
			b.WriteByte(',')
			b.Write(parseMustJSON(m))
		}
	}
	b.WriteString(`]}`)
	return b.Bytes()
}

// sizedAnthropicBody returns an Anthropic messages body of at least size bytes, built like
// sizedChatBody.
func sizedAnthropicBody(size int) []byte {
	var b bytes.Buffer
	b.Grow(size + 8<<10)
	b.WriteString(`{"model":"claude-sonnet-4-5","max_tokens":1024,"system":[{"type":"text","text":`)
	b.Write(parseMustJSON(parseBenchSystem))
	b.WriteString(`,"cache_control":{"type":"ephemeral"}}],"messages":[{"role":"user","content":"Hello!"}`)
	para := strings.Repeat("The quick brown fox jumps over the lazy dog; \"quoted\" text, tabs\tand\nnewlines. ", 24)
	for i := 0; b.Len() < size; i++ {
		msgs := []any{
			map[string]any{"role": "user", "content": fmt.Sprintf("Document %d:\n%s", i, para)},
			map[string]any{"role": "assistant", "content": []any{
				map[string]any{"type": "thinking", "thinking": fmt.Sprintf("The user asks about document %d; call the tool.", i), "signature": "c2lnbmF0dXJl"},
				map[string]any{"type": "tool_use", "id": fmt.Sprintf("toolu_%d", i), "name": "get_weather", "input": map[string]any{"city": fmt.Sprintf("City %d", i)}},
			}},
			map[string]any{"role": "user", "content": []any{
				map[string]any{"type": "tool_result", "tool_use_id": fmt.Sprintf("toolu_%d", i), "content": fmt.Sprintf(`{"temperature": %d}`, 10+i)},
			}},
			map[string]any{"role": "assistant", "content": fmt.Sprintf("It is %d°C in city %d.", 10+i, i)},
		}
		for _, m := range msgs {
			b.WriteByte(',')
			b.Write(parseMustJSON(m))
		}
	}
	b.WriteString(`]}`)
	return b.Bytes()
}

// BenchmarkParseBodySize parses bodies of 64 KiB to 8 MiB and takes their prefix key, as the
// reference proxy does per request. B/op over the body size is the allocation amplification.
func BenchmarkParseBodySize(b *testing.B) {
	formats := []struct {
		name string
		f    Format
		gen  func(int) []byte
	}{{"openai_chat", FormatOpenAIChat, sizedChatBody}, {"anthropic_messages", FormatAnthropicMessages, sizedAnthropicBody}}
	for _, fm := range formats {
		for _, size := range bodySizes {
			body := fm.gen(size.n)
			if _, err := Parse(fm.f, body); err != nil {
				b.Fatal(err)
			}
			b.Run("format="+fm.name+"/size="+size.name, func(b *testing.B) {
				b.ReportAllocs()
				b.SetBytes(int64(len(body)))
				for b.Loop() {
					r, err := Parse(fm.f, body)
					if err != nil {
						b.Fatal(err)
					}
					sinkKey, _ = r.PrefixKey(DefaultMaxPrefixLength)
				}
			})
		}
	}
}

// TestParseBytesPerBody pins the bytes a parse allocates against the body's size, for a body of
// a few large messages (a pasted document): about the body once, for the Request's text.
func TestParseBytesPerBody(t *testing.T) {
	if testing.Short() || raceEnabled {
		t.Skip("allocation sizes")
	}
	para := strings.Repeat("A long document line with \"quotes\" and a tab\t, then a newline.\n", 1000)
	var b bytes.Buffer
	b.WriteString(`{"model":"m","max_tokens":16,"messages":[{"role":"system","content":"You are helpful."}`)
	for b.Len() < 7_500_000 {
		b.WriteString(`,{"role":"user","content":`)
		b.Write(parseMustJSON(para))
		b.WriteString(`}`)
	}
	b.WriteString(`]}`)
	body := b.Bytes()
	res := testing.Benchmark(func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := ParseOpenAIChat(body); err != nil {
				b.Fatal(err)
			}
		}
	})
	ratio := float64(res.AllocedBytesPerOp()) / float64(len(body))
	t.Logf("ParseOpenAIChat(%d bytes): %d B/op, %.2f× the body", len(body), res.AllocedBytesPerOp(), ratio)
	if ratio > 1.5 {
		t.Errorf("a parse allocates %.2f× the body, want <= 1.5×", ratio)
	}
}
