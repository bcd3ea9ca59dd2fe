package prefixkey

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// parseBenchTools is a realistic tools array: two functions with JSON-schema parameters.
const parseBenchTools = `[{"type":"function","function":{"name":"get_weather","description":"Get the current weather for a city.","parameters":{"type":"object","properties":{"city":{"type":"string","description":"City name, e.g. Paris"},"unit":{"type":"string","enum":["celsius","fahrenheit"]}},"required":["city"]}}},{"type":"function","function":{"name":"search_docs","description":"Full-text search over the product documentation.","parameters":{"type":"object","properties":{"query":{"type":"string"},"limit":{"type":"integer","minimum":1,"maximum":50}},"required":["query"]}}}]`

// parseBenchSystem is a system prompt of about 1.2 KiB with escapes and non-ASCII text.
var parseBenchSystem = strings.Repeat("You are a helpful, careful assistant for ACME Corp. Answer \"precisely\"; cite sources.\n", 12) +
	"Réponds en français si on te parle français — 日本語もOK."

// parseBenchSystemFor returns the system prompt for a body of about size bytes.
func parseBenchSystemFor(size int) string {
	if size < 4096 {
		return parseBenchSystem[:300]
	}
	return parseBenchSystem
}

// parseBenchTurn returns the i-th user/assistant exchange of a benchmark conversation.
func parseBenchTurn(i int) []map[string]any {
	user := map[string]any{"role": "user", "content": fmt.Sprintf("Question %d: what is the weather like in city number %d, and can you search the docs for \"rate limits\" too? Please be thorough.", i, i)}
	if i%3 == 1 && i/3 < MaxMediaItems { // a request may carry at most MaxMediaItems images
		user["content"] = []any{
			map[string]any{"type": "text", "text": fmt.Sprintf("Look at picture %d and describe it.", i)},
			map[string]any{"type": "image_url", "image_url": map[string]any{"url": fmt.Sprintf("https://example.com/img/%d.png", i), "detail": "low"}},
		}
	}
	call := map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{
		"id": fmt.Sprintf("call_%d", i), "type": "function",
		"function": map[string]any{"name": "get_weather", "arguments": fmt.Sprintf(`{"city":"City %d","unit":"celsius"}`, i)},
	}}}
	tool := map[string]any{"role": "tool", "tool_call_id": fmt.Sprintf("call_%d", i), "content": fmt.Sprintf(`{"temperature": %d, "conditions": "partly cloudy"}`, 10+i)}
	answer := map[string]any{"role": "assistant", "content": fmt.Sprintf("In city %d it is %d°C and partly cloudy. The docs say the default rate limit is 60 requests per minute.", i, 10+i)}
	return []map[string]any{user, call, tool, answer}
}

// parseBenchChatBody returns an OpenAI chat body of about size bytes (at least the fixed part).
func parseBenchChatBody(size int) []byte {
	var tools any
	if err := json.Unmarshal([]byte(parseBenchTools), &tools); err != nil {
		panic(err)
	}
	msgs := []map[string]any{{"role": "system", "content": parseBenchSystemFor(size)}}
	body := map[string]any{"model": "meta-llama/Llama-3.1-8B-Instruct", "temperature": 0.2, "max_tokens": 512, "stream": true, "stop": []string{"\n\nUser:"}}
	if size >= 4096 {
		body["tools"] = tools
		body["tool_choice"] = "auto"
	}
	for i := 0; ; i++ {
		body["messages"] = msgs
		b, err := json.Marshal(body)
		if err != nil {
			panic(err)
		}
		if len(b) >= size || i > 1000 {
			return b
		}
		turn := parseBenchTurn(i)
		if size < 4096 {
			turn = turn[:1]
		}
		for _, m := range turn {
			msgs = append(msgs, m)
			body["messages"] = msgs
			if b, _ := json.Marshal(body); len(b) >= size {
				return b
			}
		}
	}
}

// parseBenchAnthropicBody returns an Anthropic messages body of about size bytes.
func parseBenchAnthropicBody(size int) []byte {
	var tools any
	if err := json.Unmarshal([]byte(`[{"name":"get_weather","description":"Get the weather.","input_schema":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}]`), &tools); err != nil {
		panic(err)
	}
	body := map[string]any{
		"model":      "claude-sonnet-4-5",
		"max_tokens": 1024,
		"system":     []any{map[string]any{"type": "text", "text": parseBenchSystemFor(size), "cache_control": map[string]any{"type": "ephemeral"}}},
	}
	if size >= 4096 {
		body["tools"] = tools
	}
	msgs := []any{map[string]any{"role": "user", "content": "Hello!"}}
	for i := 0; ; i++ {
		body["messages"] = msgs
		b, err := json.Marshal(body)
		if err != nil {
			panic(err)
		}
		if len(b) >= size || i > 1000 {
			return b
		}
		msgs = append(msgs,
			map[string]any{"role": "user", "content": fmt.Sprintf("Question %d: what is the weather in city %d? Please be thorough and cite the docs.", i, i)},
			map[string]any{"role": "assistant", "content": []any{
				map[string]any{"type": "thinking", "thinking": fmt.Sprintf("The user asks about city %d; call the tool.", i), "signature": "c2lnbmF0dXJl"},
				map[string]any{"type": "tool_use", "id": fmt.Sprintf("toolu_%d", i), "name": "get_weather", "input": map[string]any{"city": fmt.Sprintf("City %d", i)}},
			}},
			map[string]any{"role": "user", "content": []any{
				map[string]any{"type": "tool_result", "tool_use_id": fmt.Sprintf("toolu_%d", i), "content": fmt.Sprintf(`{"temperature": %d}`, 10+i)},
			}},
			map[string]any{"role": "assistant", "content": fmt.Sprintf("It is %d°C in city %d.", 10+i, i)},
		)
	}
}

func BenchmarkParseOpenAIChat(b *testing.B) {
	for _, size := range []int{1 << 10, 8 << 10} {
		body := parseBenchChatBody(size)
		b.Run(fmt.Sprintf("size=%dKiB", size>>10), func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				if _, err := ParseOpenAIChat(body); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkParseOpenAIChatStdlib is the baseline: encoding/json into a typed struct (no
// canonicalisation, no content-part handling), for comparison only.
func BenchmarkParseOpenAIChatStdlib(b *testing.B) {
	type msg struct {
		Role       string          `json:"role"`
		Content    json.RawMessage `json:"content"`
		ToolCalls  json.RawMessage `json:"tool_calls"`
		ToolCallID string          `json:"tool_call_id"`
		Name       string          `json:"name"`
	}
	type req struct {
		Model       string          `json:"model"`
		Messages    []msg           `json:"messages"`
		Temperature *float64        `json:"temperature"`
		MaxTokens   *int64          `json:"max_tokens"`
		Stream      bool            `json:"stream"`
		Stop        json.RawMessage `json:"stop"`
		Tools       json.RawMessage `json:"tools"`
		ToolChoice  json.RawMessage `json:"tool_choice"`
	}
	for _, size := range []int{1 << 10, 8 << 10} {
		body := parseBenchChatBody(size)
		b.Run(fmt.Sprintf("size=%dKiB", size>>10), func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				var r req
				if err := json.Unmarshal(body, &r); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkParseOpenAICompletion(b *testing.B) {
	body := []byte(`{"model":"m","prompt":` + string(parseMustJSON(strings.Repeat("lorem ipsum dolor sit amet ", 300))) + `,"max_tokens":16,"temperature":0}`)
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if _, err := ParseOpenAICompletion(body); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkParseAnthropicMessages(b *testing.B) {
	for _, size := range []int{1 << 10, 8 << 10} {
		body := parseBenchAnthropicBody(size)
		b.Run(fmt.Sprintf("size=%dKiB", size>>10), func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				if _, err := ParseAnthropicMessages(body); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkInjectAnthropicCacheControl(b *testing.B) {
	body := parseBenchAnthropicBody(8 << 10)
	body = []byte(strings.Replace(string(body), `"cache_control":{"type":"ephemeral"},`, "", 1))
	if out, err := InjectAnthropicCacheControl(body); err != nil || len(out) == len(body) {
		b.Fatalf("the benchmark body is not rewritten (%v)", err)
	}
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if _, err := InjectAnthropicCacheControl(body); err != nil {
			b.Fatal(err)
		}
	}
}

func parseMustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}
