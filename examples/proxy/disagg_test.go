package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go"
	aoption "github.com/anthropics/anthropic-sdk-go/option"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/internal/enginesim"
	"github.com/kvroute/kvroute/kvhttp"
	"github.com/kvroute/kvroute/prefixkey"
)

// longPrompt is a chat body whose prompt is about words tokens (the engines' tokenizer makes a
// token of each word), distinct per seed.
func longPrompt(seed string, words int, extra string) string {
	return chatBody(longSystemPrompt(seed, words), "Summarise the "+seed+" policy.", extra)
}

// Each routing path is taken when its condition holds, with the three routing-path headers:
//
//   - a cold long prompt: prefill_then_decode; the decode engine loads the prompt's KV from S3
//     (its cached tokens come from the transfer);
//   - the same prompt again: fast_decode on the decode engine that holds it (local_hit);
//   - a prompt whose blocks are only in S3: fast_decode to a decode engine that loads them
//     (storage_hit);
//   - a short prompt: conditional disaggregation skips the prefill (short_prompt);
//   - a prompt the prefill engine refuses (too long): its 400 reaches the client.
func TestDisaggPaths(t *testing.T) {
	// 100 blocks per engine: one long prompt (77 blocks) fits, a second one evicts the first.
	f := startPDFleet(t, 1, 3, 1, func(c *enginesim.Config) { c.CapacityBlocks = 100 })
	p := startProxy(t, pdConfig(t, f, nil))
	prefill := f.prefill[0]

	cold := longPrompt("cold", 1200, `"max_tokens":8`)
	var holder string
	t.Run("cold long prompt: prefill_then_decode", func(t *testing.T) {
		r := postPD(t, p, cold)
		if r.status != 200 || r.path != "prefill_then_decode" || r.prefill != prefill || !slices.Contains(f.decode, r.decode) ||
			r.backend != r.decode || r.engine != r.decode || r.route != "cache_miss" {
			t.Fatalf("%v: %s", r, r.body)
		}
		// The decode engine computed nothing it could load: the prompt's full blocks came from S3.
		if r.storageTokens < 1100 || r.cachedTokens < r.storageTokens {
			t.Errorf("decode engine loaded %d tokens from S3 and reports %d cached, want ≥ 1100", r.storageTokens, r.cachedTokens)
		}
		if st := f.engine(t, prefill).Stats(); st.PrefillHandoffs != 1 || st.StorageBlocksWritten == 0 {
			t.Errorf("prefill engine: %d handoffs, %d blocks written", st.PrefillHandoffs, st.StorageBlocksWritten)
		}
		if st := f.engine(t, r.decode).Stats(); st.DecodeHandoffs != 1 {
			t.Errorf("decode engine: %d handoffs (requests with the prefill's kv_transfer_params), want 1", st.DecodeHandoffs)
		}
		holder = r.decode
	})
	if holder == "" {
		t.FailNow()
	}

	t.Run("same prompt: fast_decode on its holder", func(t *testing.T) {
		waitFor(t, 10*time.Second, "the index to place the prompt on "+holder, func() bool {
			m := p.match(t, cold, holder)
			return m.Tokens >= 1100 && m.Tier == events.TierGPU
		})
		r := postPD(t, p, cold)
		if r.status != 200 || r.path != "fast_decode" || r.prefill != "" || r.decode != holder || r.backend != holder ||
			r.engine != holder || r.route != "local_hit" {
			t.Fatalf("%v: %s", r, r.body)
		}
		if r.storageTokens != 0 || r.cachedTokens < 1100 {
			t.Errorf("holder loaded %d tokens and reports %d cached: want 0 and ≥ 1100", r.storageTokens, r.cachedTokens)
		}
	})

	t.Run("prefix only in S3: fast_decode storage hit", func(t *testing.T) {
		// The prefill engine writes the prompt to S3 (asked directly, as a proxy would), then a
		// second long prompt evicts it from the prefill engine's GPU: the index keeps the blocks
		// on the storage tier only, where every decode engine can read them.
		stored := longPrompt("stored", 1200, `"max_tokens":4`)
		for _, seed := range []string{"stored", "evictor"} {
			body := longPrompt(seed, 1200, `"max_tokens":1,"stream":false,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false}`)
			resp, b := post(t, f.engine(t, prefill).URL()+"/v1/chat/completions", body)
			if resp.StatusCode != 200 || !strings.Contains(string(b), `"remote_block_keys"`) {
				t.Fatalf("direct prefill of %s: %d %s", seed, resp.StatusCode, b)
			}
		}
		waitFor(t, 10*time.Second, "the index to see the prompt on the storage tier only", func() bool {
			m := p.match(t, stored, prefill)
			return m.Tokens >= 1100 && m.Tier == events.TierStorage
		})
		before := disaggStats(t, p).Requests.Reasons.StorageHit
		r := postPD(t, p, stored)
		if r.status != 200 || r.path != "fast_decode" || r.prefill != "" || !slices.Contains(f.decode, r.decode) ||
			r.engine != r.decode || r.route != "storage_hit" {
			t.Fatalf("%v: %s", r, r.body)
		}
		if r.storageTokens < 1100 || r.cachedTokens < r.storageTokens {
			t.Errorf("decode engine loaded %d tokens from S3 by itself and reports %d cached, want ≥ 1100", r.storageTokens, r.cachedTokens)
		}
		if after := disaggStats(t, p).Requests.Reasons.StorageHit; after != before+1 {
			t.Errorf("storage_hit count %d → %d", before, after)
		}
	})

	t.Run("short prompt: conditional disaggregation skips the prefill", func(t *testing.T) {
		handoffs := f.engine(t, prefill).Stats().PrefillHandoffs
		r := postPD(t, p, longPrompt("short", 200, `"max_tokens":4`))
		if r.status != 200 || r.path != "fast_decode" || r.prefill != "" || !slices.Contains(f.decode, r.decode) ||
			r.engine != r.decode || r.route != "short_prompt" {
			t.Fatalf("%v: %s", r, r.body)
		}
		if got := f.engine(t, prefill).Stats().PrefillHandoffs; got != handoffs {
			t.Errorf("the prefill engine ran %d prefills for a short prompt", got-handoffs)
		}
	})

	t.Run("prompt the prefill engine refuses: its answer is relayed", func(t *testing.T) {
		// 2,000 tokens do not fit a 100-block (1,600-token) KV cache: every engine answers 400.
		r := postPD(t, p, longPrompt("huge", 2000, `"max_tokens":4`))
		if r.status != http.StatusBadRequest || r.path != "prefill_then_decode" || r.backend != prefill || r.engine != prefill {
			t.Fatalf("%v: %s", r, r.body)
		}
		var e struct {
			Error struct{ Message string } `json:"error"`
		}
		if err := json.Unmarshal(r.body, &e); err != nil || !strings.Contains(e.Error.Message, "too long") {
			t.Errorf("body %s", r.body)
		}
	})

	st := disaggStats(t, p)
	if st.Requests.PrefillThenDecode != 2 || st.Requests.FastDecode != 3 || st.Requests.Fallback != 0 || st.Requests.PrefillFailures != 0 {
		t.Errorf("requests by path: %+v", st.Requests)
	}
}

// A prefill engine killed in the middle of a stream of requests (concurrent clients, each prompt
// cold and long): no request fails. Those that lose their prefill, and those routed after the
// kill, are served by the unified engine (path fallback); the health checks take the dead engine
// out of rotation.
func TestDisaggPrefillKilled(t *testing.T) {
	f := startPDFleet(t, 1, 2, 1, nil)
	p := startProxy(t, pdConfig(t, f, nil))
	prefill := f.engine(t, f.prefill[0])

	const clients, perClient, killAt = 3, 8, 6
	var (
		sent    atomic.Int32
		killing atomic.Bool // set just before the kill starts
		killed  atomic.Bool // set once the engine is down
		once    sync.Once
		mu      sync.Mutex
		before  []pdResult // finished before the kill
		after   []pdResult // started after the kill
		failed  []string
	)
	var wg sync.WaitGroup
	for c := range clients {
		wg.Go(func() {
			for i := range perClient {
				if n := sent.Add(1); n == killAt {
					once.Do(func() { killing.Store(true); prefill.Kill(); killed.Store(true) })
				}
				startedAfter := killed.Load()
				resp, b := post(t, p.URL+"/v1/chat/completions", longPrompt(fmt.Sprintf("kill-%d-%d", c, i), 700, `"max_tokens":4`))
				r := readPD(resp, b)
				finishedBefore := !killing.Load() // a request in flight across the kill only has to succeed
				mu.Lock()
				switch {
				case r.status != 200:
					failed = append(failed, fmt.Sprintf("%v: %s", r, b))
				case startedAfter:
					after = append(after, r)
				case finishedBefore:
					before = append(before, r)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if len(failed) > 0 {
		t.Fatalf("%d of %d requests failed:\n%s", len(failed), clients*perClient, strings.Join(failed, "\n"))
	}
	if len(before) == 0 || len(after) == 0 {
		t.Fatalf("%d requests before the kill, %d after", len(before), len(after))
	}
	for _, r := range before {
		if r.path != "prefill_then_decode" || r.prefill != prefill.Name() {
			t.Errorf("before the kill: %v", r)
		}
	}
	unified := f.unified[0]
	for _, r := range after {
		if r.path != "fallback" || r.prefill != "" || r.decode != unified || r.backend != unified || r.engine != unified {
			t.Errorf("after the kill: %v", r)
		}
	}
	st := disaggStats(t, p)
	if st.Requests.PrefillFailures == 0 || st.Requests.Fallback < uint64(len(after)) || st.Requests.NoBackend != 0 {
		t.Errorf("requests: %+v", st.Requests)
	}
	waitFor(t, 10*time.Second, "the health checks to take the killed prefill engine out of rotation", func() bool {
		return !p.health.InRotation(prefill.Name())
	})
	r := postPD(t, p, longPrompt("after-health", 700, `"max_tokens":4`))
	if r.status != 200 || r.path != "fallback" || r.decode != unified {
		t.Errorf("with the prefill pool empty: %v", r)
	}
	if got := disaggStats(t, p).Requests.Reasons.PoolUnavailable; got == 0 {
		t.Errorf("pool_unavailable count %d", got)
	}
}

// The two-phase flow through the official SDKs: OpenAI chat and Anthropic messages, streamed and
// not. The decode engine gets the client's own parameters (max_completion_tokens, stream,
// stream_options) and reports the prompt as cached (loaded from S3).
func TestDisaggSDKs(t *testing.T) {
	f := startPDFleet(t, 1, 2, 1, nil)
	p := startProxy(t, pdConfig(t, f, nil))
	oc, ac := openaiClient(p), anthropicClient(p)
	ctx := t.Context()
	checkHeaders := func(t *testing.T, h http.Header) {
		t.Helper()
		if h.Get(disagg.HeaderRoutingPath) != "prefill_then_decode" || h.Get(disagg.HeaderPrefillBackend) != f.prefill[0] ||
			!slices.Contains(f.decode, h.Get(disagg.HeaderDecodeBackend)) || h.Get(HeaderBackend) != h.Get(disagg.HeaderDecodeBackend) ||
			h.Get(enginesim.HeaderEngine) != h.Get(HeaderBackend) {
			t.Errorf("headers: path %q prefill %q decode %q backend %q engine %q", h.Get(disagg.HeaderRoutingPath),
				h.Get(disagg.HeaderPrefillBackend), h.Get(disagg.HeaderDecodeBackend), h.Get(HeaderBackend), h.Get(enginesim.HeaderEngine))
		}
	}
	chat := func(seed string) openai.ChatCompletionNewParams {
		return openai.ChatCompletionNewParams{
			Model: openai.ChatModel(testModel),
			Messages: []openai.ChatCompletionMessageParamUnion{
				openai.SystemMessage(longSystemPrompt(seed, 900)), openai.UserMessage("What is the policy?")},
			MaxCompletionTokens: openai.Int(7),
		}
	}
	t.Run("openai chat", func(t *testing.T) {
		var resp *http.Response
		c, err := oc.Chat.Completions.New(ctx, chat("sdk-chat"), option.WithResponseInto(&resp))
		if err != nil {
			t.Fatal(err)
		}
		checkHeaders(t, resp.Header)
		if c.Choices[0].Message.Content == "" || c.Usage.CompletionTokens != 7 || c.Usage.PromptTokensDetails.CachedTokens < 800 {
			t.Errorf("content %q, %d completion tokens (want 7), %d cached", c.Choices[0].Message.Content,
				c.Usage.CompletionTokens, c.Usage.PromptTokensDetails.CachedTokens)
		}
	})
	t.Run("openai chat stream", func(t *testing.T) {
		params := chat("sdk-stream")
		params.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
		var resp *http.Response
		stream := oc.Chat.Completions.NewStreaming(ctx, params, option.WithResponseInto(&resp))
		acc := openai.ChatCompletionAccumulator{}
		chunks := 0
		for stream.Next() {
			acc.AddChunk(stream.Current())
			chunks++
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		checkHeaders(t, resp.Header)
		if !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") || chunks < 3 {
			t.Errorf("Content-Type %q, %d chunks", resp.Header.Get("Content-Type"), chunks)
		}
		if acc.Choices[0].Message.Content == "" || acc.Usage.CompletionTokens != 7 || acc.Usage.PromptTokensDetails.CachedTokens < 800 {
			t.Errorf("content %q, usage %+v", acc.Choices[0].Message.Content, acc.Usage)
		}
	})
	anth := func(seed string) anthropic.MessageNewParams {
		return anthropic.MessageNewParams{
			Model:     anthropic.Model(testModel),
			MaxTokens: 6,
			System:    []anthropic.TextBlockParam{{Text: longSystemPrompt(seed, 900)}},
			Messages:  []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("What is the policy?"))},
		}
	}
	t.Run("anthropic messages", func(t *testing.T) {
		var resp *http.Response
		m, err := ac.Messages.New(ctx, anth("sdk-anthropic"), aoption.WithResponseInto(&resp))
		if err != nil {
			t.Fatal(err)
		}
		checkHeaders(t, resp.Header)
		if len(m.Content) == 0 || m.Content[0].Text == "" || m.Usage.OutputTokens != 6 || m.Usage.CacheReadInputTokens < 800 {
			t.Errorf("content %+v, usage %+v", m.Content, m.Usage)
		}
	})
	t.Run("anthropic messages stream", func(t *testing.T) {
		var resp *http.Response
		stream := ac.Messages.NewStreaming(ctx, anth("sdk-anthropic-stream"), aoption.WithResponseInto(&resp))
		var msg anthropic.Message
		for stream.Next() {
			if err := msg.Accumulate(stream.Current()); err != nil {
				t.Fatal(err)
			}
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		checkHeaders(t, resp.Header)
		if len(msg.Content) == 0 || msg.Content[0].Text == "" || msg.Usage.OutputTokens != 6 || msg.Usage.CacheReadInputTokens < 800 {
			t.Errorf("content %+v, usage %+v", msg.Content, msg.Usage)
		}
	})
	if st := f.engine(t, f.prefill[0]).Stats(); st.PrefillHandoffs != 4 {
		t.Errorf("prefill engine: %d handoffs, want 4", st.PrefillHandoffs)
	}
	var handoffs uint64
	for _, d := range f.decode {
		handoffs += f.engine(t, d).Stats().DecodeHandoffs
	}
	if handoffs != 4 {
		t.Errorf("decode engines: %d handoffs, want 4", handoffs)
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
			out, err := prefillBody(&kvhttp.Request{Format: tc.format, Parsed: req, Body: []byte(tc.in)})
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
