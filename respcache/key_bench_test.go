package respcache

import (
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/prefixkey"
)

// benchRequest parses an OpenAI chat body of about size bytes: a system prompt, alternating user
// and assistant turns of ~500 bytes each, one tool and a few parameters.
func benchRequest(size int) *prefixkey.Request {
	msgs := []map[string]any{{"role": "system", "content": "You are a helpful assistant. " + strings.Repeat("Answer briefly. ", 8)}}
	body := func() []byte {
		b, err := json.Marshal(map[string]any{
			"model": "meta-llama/Llama-3.1-8B-Instruct", "temperature": 0, "max_tokens": 256, "seed": 1,
			"messages": msgs,
			"tools": []any{map[string]any{"type": "function", "function": map[string]any{
				"name": "lookup", "parameters": map[string]any{"type": "object", "properties": map[string]any{"q": map[string]any{"type": "string"}}},
			}}},
		})
		if err != nil {
			panic(err)
		}
		return b
	}
	for i := 0; len(body()) < size; i++ {
		role := []string{"user", "assistant"}[i%2]
		msgs = append(msgs, map[string]any{"role": role, "content": fmt.Sprintf("turn %d: %s", i, strings.Repeat("lorem ipsum dolor sit amet ", 18))})
	}
	r, err := prefixkey.ParseOpenAIChat(body())
	if err != nil {
		panic(err)
	}
	return r
}

// requestBytes is about how many bytes KeyOf hashes for r: its text and JSON.
func requestBytes(r *prefixkey.Request) int {
	n := len(r.System) + len(r.Params.Tools)
	for _, m := range r.Messages {
		n += len(m.Text) + len(m.Extra)
	}
	return n
}

// BenchmarkKey measures KeyOf on parsed chat requests; size is the JSON body's. "floor" is one
// sha256.Sum256 over as many bytes as KeyOf hashes: the cost of the hash alone.
func BenchmarkKey(b *testing.B) {
	for _, size := range []int{1 << 10, 8 << 10, 64 << 10} {
		r := benchRequest(size)
		n := requestBytes(r)
		b.Run(fmt.Sprintf("size=%dKiB", size>>10), func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(n))
			for b.Loop() {
				_ = KeyOf(r)
			}
		})
		b.Run(fmt.Sprintf("size=%dKiB/floor", size>>10), func(b *testing.B) {
			buf := make([]byte, n)
			b.ReportAllocs()
			b.SetBytes(int64(n))
			for b.Loop() {
				_ = sha256.Sum256(buf)
			}
		})
	}
	b.Run("size=8KiB/hex", func(b *testing.B) {
		r := benchRequest(8 << 10)
		b.ReportAllocs()
		for b.Loop() {
			_ = KeyOf(r).String()
		}
	})
}
