package main

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go"
	aoption "github.com/anthropics/anthropic-sdk-go/option"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/admin"
	"github.com/kvroute/kvroute/prefixkey"
)

func openaiClient(p *testProxy) openai.Client {
	return openai.NewClient(option.WithBaseURL(p.URL+"/v1/"), option.WithAPIKey("test-key"),
		option.WithMaxRetries(0), option.WithHTTPClient(httpClient))
}

func anthropicClient(p *testProxy) anthropic.Client {
	return anthropic.NewClient(aoption.WithBaseURL(p.URL), aoption.WithAPIKey("test-key"),
		aoption.WithMaxRetries(0), aoption.WithHTTPClient(httpClient))
}

// The official OpenAI SDK through the proxy: chat and completions, streaming and not; an
// identical temperature-0 request twice is a response-cache HIT the second time.
func TestE2EOpenAISDK(t *testing.T) {
	f := startFleet(t, 4, true)
	p := startProxy(t, fleetConfig(t, f, nil))
	client := openaiClient(p)
	ctx := t.Context()

	params := openai.ChatCompletionNewParams{
		Model: openai.ChatModel(testModel),
		Messages: []openai.ChatCompletionMessageParamUnion{
			openai.SystemMessage(longSystemPrompt("SDK", 40)),
			openai.UserMessage("What is the refund policy?"),
		},
		Temperature: openai.Float(0),
		MaxTokens:   openai.Int(8),
	}
	t.Run("chat", func(t *testing.T) {
		var r1, r2 *http.Response
		c1, err := client.Chat.Completions.New(ctx, params, option.WithResponseInto(&r1))
		if err != nil {
			t.Fatal(err)
		}
		c2, err := client.Chat.Completions.New(ctx, params, option.WithResponseInto(&r2))
		if err != nil {
			t.Fatal(err)
		}
		if got := r1.Header.Get("X-Cache"); got != "MISS" {
			t.Errorf("first X-Cache = %q, want MISS", got)
		}
		if got := r2.Header.Get("X-Cache"); got != "HIT" {
			t.Errorf("second X-Cache = %q, want HIT", got)
		}
		if r1.Header.Get(HeaderBackend) == "" || r1.Header.Get(HeaderRoute) == "" {
			t.Errorf("routing headers missing: %v", r1.Header)
		}
		if c1.Choices[0].Message.Content == "" || c1.Choices[0].Message.Content != c2.Choices[0].Message.Content || c1.ID != c2.ID {
			t.Errorf("cached answer differs: %q/%s vs %q/%s", c1.Choices[0].Message.Content, c1.ID, c2.Choices[0].Message.Content, c2.ID)
		}
		if c1.Usage.CompletionTokens != 8 {
			t.Errorf("completion tokens = %d, want 8", c1.Usage.CompletionTokens)
		}
	})
	t.Run("chat-stream", func(t *testing.T) {
		sp := params
		sp.Messages = []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("Stream test."), openai.UserMessage("Count to three.")}
		var texts [2]string
		for i := range 2 {
			var resp *http.Response
			stream := client.Chat.Completions.NewStreaming(ctx, sp, option.WithResponseInto(&resp))
			acc := openai.ChatCompletionAccumulator{}
			chunks := 0
			for stream.Next() {
				acc.AddChunk(stream.Current())
				chunks++
			}
			if err := stream.Err(); err != nil {
				t.Fatalf("stream %d: %v", i, err)
			}
			if chunks < 2 {
				t.Errorf("stream %d: %d chunks", i, chunks)
			}
			want := []string{"MISS", "HIT"}[i]
			if got := resp.Header.Get("X-Cache"); got != want {
				t.Errorf("stream %d: X-Cache = %q, want %q", i, got, want)
			}
			if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
				t.Errorf("stream %d: Content-Type %q", i, ct)
			}
			texts[i] = acc.Choices[0].Message.Content
		}
		if texts[0] == "" || texts[0] != texts[1] {
			t.Errorf("streamed texts differ: %q vs %q", texts[0], texts[1])
		}
	})
	t.Run("completions", func(t *testing.T) {
		cp := openai.CompletionNewParams{
			Model:       openai.CompletionNewParamsModel(testModel),
			Prompt:      openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once upon a time there was a router")},
			MaxTokens:   openai.Int(6),
			Temperature: openai.Float(0.7), // not cacheable
		}
		var resp *http.Response
		c, err := client.Completions.New(ctx, cp, option.WithResponseInto(&resp))
		if err != nil {
			t.Fatal(err)
		}
		if c.Choices[0].Text == "" || resp.Header.Get("X-Cache") != "BYPASS" {
			t.Errorf("completion %q, X-Cache %q", c.Choices[0].Text, resp.Header.Get("X-Cache"))
		}
		stream := client.Completions.NewStreaming(ctx, cp)
		n := 0
		for stream.Next() {
			n++
		}
		if err := stream.Err(); err != nil || n == 0 {
			t.Errorf("completions stream: %d chunks, %v", n, err)
		}
	})
}

// The identical request twice gives byte-identical bodies, streamed or not.
func TestE2ECacheHitIsByteIdentical(t *testing.T) {
	f := startFleet(t, 2, true)
	p := startProxy(t, fleetConfig(t, f, nil))
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			body := chatBody("Byte identity.", "Say something.", fmt.Sprintf(`"temperature":0,"max_tokens":12,"stream":%v`, stream))
			r1, b1 := post(t, p.URL+"/v1/chat/completions", body)
			r2, b2 := post(t, p.URL+"/v1/chat/completions", body)
			if r1.StatusCode != 200 || r2.StatusCode != 200 {
				t.Fatalf("status %d %d: %s", r1.StatusCode, r2.StatusCode, b1)
			}
			if r1.Header.Get("X-Cache") != "MISS" || r2.Header.Get("X-Cache") != "HIT" {
				t.Errorf("X-Cache %q then %q", r1.Header.Get("X-Cache"), r2.Header.Get("X-Cache"))
			}
			if string(b1) != string(b2) {
				t.Errorf("bodies differ:\n%s\n%s", b1, b2)
			}
			if stream && !strings.HasSuffix(strings.TrimSpace(string(b2)), "data: [DONE]") {
				t.Errorf("replayed stream does not end with [DONE]: %q", b2)
			}
		})
	}
}

// The official Anthropic SDK through the proxy, streaming and not.
func TestE2EAnthropicSDK(t *testing.T) {
	f := startFleet(t, 2, true)
	p := startProxy(t, fleetConfig(t, f, nil))
	client := anthropicClient(p)
	ctx := t.Context()
	params := anthropic.MessageNewParams{
		Model:       anthropic.Model(testModel),
		MaxTokens:   8,
		System:      []anthropic.TextBlockParam{{Text: longSystemPrompt("Anthropic", 40)}},
		Messages:    []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Hello there"))},
		Temperature: anthropic.Float(0),
	}
	var r1, r2 *http.Response
	m1, err := client.Messages.New(ctx, params, aoption.WithResponseInto(&r1))
	if err != nil {
		t.Fatal(err)
	}
	m2, err := client.Messages.New(ctx, params, aoption.WithResponseInto(&r2))
	if err != nil {
		t.Fatal(err)
	}
	if len(m1.Content) == 0 || m1.Content[0].Text == "" || m1.Content[0].Text != m2.Content[0].Text {
		t.Errorf("answers: %+v / %+v", m1.Content, m2.Content)
	}
	if r1.Header.Get("X-Cache") != "MISS" || r2.Header.Get("X-Cache") != "HIT" {
		t.Errorf("X-Cache %q then %q", r1.Header.Get("X-Cache"), r2.Header.Get("X-Cache"))
	}

	params.Messages = []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Stream, please"))}
	var texts [2]string
	for i := range 2 {
		var resp *http.Response
		stream := client.Messages.NewStreaming(ctx, params, aoption.WithResponseInto(&resp))
		var msg anthropic.Message
		for stream.Next() {
			if err := msg.Accumulate(stream.Current()); err != nil {
				t.Fatal(err)
			}
		}
		if err := stream.Err(); err != nil {
			t.Fatalf("stream %d: %v", i, err)
		}
		if want := []string{"MISS", "HIT"}[i]; resp.Header.Get("X-Cache") != want {
			t.Errorf("stream %d: X-Cache %q, want %s", i, resp.Header.Get("X-Cache"), want)
		}
		if len(msg.Content) > 0 {
			texts[i] = msg.Content[0].Text
		}
	}
	if texts[0] == "" || texts[0] != texts[1] {
		t.Errorf("streamed texts %q vs %q", texts[0], texts[1])
	}
}

// Requests sharing a long system prompt land on one engine, and the engine reports the shared
// prefix as cached.
func TestE2ESharedSystemPromptSticks(t *testing.T) {
	f := startFleet(t, 4, true)
	p := startProxy(t, fleetConfig(t, f, nil))
	client := openaiClient(p)
	sys := longSystemPrompt("ACME support", 300)
	backends := map[string]int{}
	var cached []int64
	for i := range 6 {
		var resp *http.Response
		c, err := client.Chat.Completions.New(t.Context(), openai.ChatCompletionNewParams{
			Model:       openai.ChatModel(testModel),
			Messages:    []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(sys), openai.UserMessage(fmt.Sprintf("Question number %d?", i))},
			Temperature: openai.Float(0.5), // distinct answers, no response cache
			MaxTokens:   openai.Int(4),
		}, option.WithResponseInto(&resp))
		if err != nil {
			t.Fatal(err)
		}
		backends[resp.Header.Get(HeaderBackend)]++
		cached = append(cached, c.Usage.PromptTokensDetails.CachedTokens)
		t.Logf("request %d: backend %s route %s cached_tokens %d", i, resp.Header.Get(HeaderBackend), resp.Header.Get(HeaderRoute), c.Usage.PromptTokensDetails.CachedTokens)
	}
	if len(backends) != 1 {
		t.Errorf("requests spread over %v, want one backend", backends)
	}
	for i, c := range cached[1:] {
		if c <= 0 {
			t.Errorf("request %d: cached_tokens %d, want > 0", i+1, c)
		}
	}
}

// With KV events on, a request whose prefix one engine already holds goes to that engine, even
// when consistent hashing would have chosen another one.
func TestE2EKVAwareRoutesToHolder(t *testing.T) {
	f := startFleet(t, 4, true)
	cfg := fleetConfig(t, f, nil)
	p := startProxy(t, cfg)

	sys := longSystemPrompt("KV holder", 200)
	body := chatBody(sys, "First question about the warranty?", `"temperature":0.5,"max_tokens":4`)
	req, err := prefixkey.ParseOpenAIChat([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	// Which backend would the ring choose? A twin Router with the same backends answers.
	twin, err := kvroute.New(kvroute.Config{Backends: []kvroute.Backend{{Name: "enginesim-0"}, {Name: "enginesim-1"},
		{Name: "enginesim-2"}, {Name: "enginesim-3"}}})
	if err != nil {
		t.Fatal(err)
	}
	d, err := twin.Route(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	owner := d.Backend
	d.Done(kvroute.Outcome{})
	twin.Close()
	holderIdx := 0
	for i, in := range f.Info() {
		if in.Name != owner {
			holderIdx = i
			break
		}
	}
	holder := f.Info()[holderIdx]

	// Warm the holder directly, behind the proxy's back: only its KV events tell the proxy.
	awaitEvents(t, p, holder.URL, holder.Name, 10*time.Second)
	before := indexCreated(t, p, holder.Name)
	r, b := post(t, holder.URL+"/v1/chat/completions", chatBody(sys, "Warm-up.", `"max_tokens":1`))
	if r.StatusCode != 200 {
		t.Fatalf("warm-up: %d %s", r.StatusCode, b)
	}
	waitFor(t, 10*time.Second, "the holder's KV events", func() bool { return indexCreated(t, p, holder.Name) > before })

	r, b = post(t, p.URL+"/v1/chat/completions", body)
	if r.StatusCode != 200 {
		t.Fatalf("status %d: %s", r.StatusCode, b)
	}
	if got, route := r.Header.Get(HeaderBackend), r.Header.Get(HeaderRoute); got != holder.Name || route != "kv_aware" {
		t.Errorf("routed to %s (%s), want %s (kv_aware); the ring owner is %s", got, route, holder.Name, owner)
	}
	ct := r.Header.Get("X-Enginesim-Cached-Tokens")
	if ct == "" || ct == "0" {
		t.Errorf("engine reports %q cached tokens, want > 0", ct)
	}
	// The proxy's prediction of the chosen backend's cached prefix, in whole blocks of what the
	// engine reused.
	if pred, err := strconv.Atoi(r.Header.Get(HeaderCachedTokens)); err != nil || pred <= 0 {
		t.Errorf("%s %q, want the holder's predicted cached tokens (engine: %s)", HeaderCachedTokens, r.Header.Get(HeaderCachedTokens), ct)
	}
	var st admin.KVIndexStats
	getJSON(t, p.URL+"/admin/kv-index/stats", &st)
	if st.RoutingDecisions.KVAware == 0 {
		t.Errorf("kv-index stats: %+v", st.RoutingDecisions)
	}
}

// One engine killed: requests keep succeeding on the others.
func TestE2EEngineKilled(t *testing.T) {
	f := startFleet(t, 3, true)
	p := startProxy(t, fleetConfig(t, f, nil))
	// Find a prompt the first engine serves, then kill that engine.
	var sys string
	victim := f.Engines()[0]
	for i := range 50 {
		s := longSystemPrompt(fmt.Sprintf("victim-%d", i), 20)
		r, b := post(t, p.URL+"/v1/chat/completions", chatBody(s, "hi", `"temperature":0.9,"max_tokens":2`))
		if r.StatusCode != 200 {
			t.Fatalf("status %d: %s", r.StatusCode, b)
		}
		if r.Header.Get(HeaderBackend) == victim.Name() {
			sys = s
			break
		}
	}
	if sys == "" {
		t.Fatal("no prompt routed to the first engine")
	}
	victim.Kill()
	for i := range 20 {
		s := sys
		if i%2 == 1 {
			s = longSystemPrompt(fmt.Sprintf("other-%d", i), 20)
		}
		r, b := post(t, p.URL+"/v1/chat/completions", chatBody(s, fmt.Sprintf("q%d", i), `"temperature":0.9,"max_tokens":2`))
		if r.StatusCode != 200 {
			t.Fatalf("request %d after kill: status %d: %s", i, r.StatusCode, b)
		}
		if got := r.Header.Get(HeaderBackend); got == victim.Name() {
			t.Fatalf("request %d answered by the killed engine", i)
		}
	}
	waitFor(t, 5*time.Second, "the killed engine out of rotation", func() bool { return !p.health.InRotation(victim.Name()) })
	var hz struct {
		Status          string `json:"status"`
		HealthyBackends int    `json:"healthy_backends"`
	}
	if code := getJSON(t, p.URL+"/admin/backends", &hz); code != 200 || hz.HealthyBackends != 2 {
		t.Errorf("healthz %d %+v", code, hz)
	}
}
