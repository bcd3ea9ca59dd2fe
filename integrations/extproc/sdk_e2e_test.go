package extproc_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvroute/kvroute/integrations/extproc"
	"github.com/kvroute/kvroute/integrations/extproc/app"
	"github.com/kvroute/kvroute/integrations/extproc/envoysim"
	"github.com/kvroute/kvroute/internal/enginesim"
)

// The answer headers the test reads: where the picker sent the request and why (set by the
// picker on the response), and which engine answered (set by the engine itself).
const (
	headerBackend = "X-Kvroute-Backend"
	headerRoute   = "X-Kvroute-Route"
	headerEngine  = enginesim.HeaderEngine
)

// sdkPool is three simulated vLLM engines with KV events over ZMQ, and kvroute-epp built from
// the configuration the way the command builds it, serving ext_proc on a loopback port.
type sdkPool struct {
	app  *app.App
	conn *grpc.ClientConn
}

// startSDKPool starts the engines and the picker; everything stops when the test ends.
func startSDKPool(t *testing.T) *sdkPool {
	t.Helper()
	fleet, err := enginesim.StartFleet(t.Context(), enginesim.FleetConfig{N: 3, ZMQ: true,
		Base: enginesim.Config{Latency: enginesim.Latency{SpeedFactor: 0}}})
	if err != nil {
		t.Fatalf("engines: %v", err)
	}
	t.Cleanup(func() { _ = fleet.Close() })

	a, err := app.New(app.DemoConfig(fleet.Info()), app.Options{})
	if err != nil {
		t.Fatalf("app.New: %v", err)
	}
	t.Cleanup(func() { _ = a.Close() })
	grpcLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	healthLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		_ = grpcLn.Close()
		t.Fatal(err)
	}
	if err := a.Start(t.Context()); err != nil {
		_, _ = grpcLn.Close(), healthLn.Close()
		t.Fatalf("app.Start: %v", err)
	}
	serveCtx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- a.Serve(serveCtx, app.Listeners{GRPC: grpcLn, Health: healthLn}) }()
	t.Cleanup(func() {
		stop()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})

	conn, err := grpc.NewClient(grpcLn.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return &sdkPool{app: a, conn: conn}
}

// gateway returns the OpenAI SDK's client of an envoysim gateway in front of the pool's picker,
// with the request and response bodies sent over ext_proc in mode.
func (p *sdkPool) gateway(t *testing.T, mode extproc.BodyMode) openai.Client {
	t.Helper()
	fw, err := envoysim.New(envoysim.Config{Client: extprocv3.NewExternalProcessorClient(p.conn),
		RequestBodyMode: mode, ResponseBodyMode: mode})
	if err != nil {
		t.Fatal(err)
	}
	gw := httptest.NewServer(fw)
	t.Cleanup(gw.Close)
	return openai.NewClient(option.WithBaseURL(gw.URL+"/v1/"), option.WithAPIKey("test-key"),
		option.WithMaxRetries(0), option.WithHTTPClient(gw.Client()))
}

// rawBody is an SDK middleware that keeps a copy of the answer's body as the SDK reads it, so
// that the test sees the bytes on the wire (the SSE stream's last event) behind the SDK's types.
type rawBody struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (rb *rawBody) middleware(req *http.Request, next option.MiddlewareNext) (*http.Response, error) {
	resp, err := next(req)
	if err != nil {
		return resp, err
	}
	resp.Body = struct {
		io.Reader
		io.Closer
	}{io.TeeReader(resp.Body, lockedWriter{rb}), resp.Body}
	return resp, nil
}

func (rb *rawBody) String() string {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	return rb.buf.String()
}

type lockedWriter struct{ rb *rawBody }

func (w lockedWriter) Write(p []byte) (int, error) {
	w.rb.mu.Lock()
	defer w.rb.mu.Unlock()
	return w.rb.buf.Write(p)
}

// checkRouted fails unless the answer says the picker chose a backend and that backend's engine
// answered: the request went where the picker sent it.
func checkRouted(t *testing.T, resp *http.Response) {
	t.Helper()
	if resp == nil {
		t.Fatal("no HTTP response recorded")
	}
	backend, engine := resp.Header.Get(headerBackend), resp.Header.Get(headerEngine)
	if backend == "" || resp.Header.Get(headerRoute) == "" {
		t.Errorf("the answer lacks the picker's %s and %s headers: %v", headerBackend, headerRoute, resp.Header)
	}
	if engine != backend {
		t.Errorf("%s %q answered a request the picker sent to %q", headerEngine, engine, backend)
	}
}

// systemPrompt returns a system prompt of some 30 words × n, unique to tag, that spans several
// KV blocks.
func systemPrompt(tag string, n int) string {
	var b strings.Builder
	b.WriteString("You are the support assistant of " + tag + ".")
	for range n {
		b.WriteString(" Answer briefly and politely, quote the order number the customer gives, never invent one," +
			" and offer to pass the question to a colleague when the answer is not in the shop's published policies.")
	}
	return b.String()
}

// The official OpenAI Go SDK through an Envoy stand-in whose ext_proc filter asks kvroute-epp,
// in front of three simulated engines, with the bodies sent in full-duplex and in buffered mode:
// chat completions whole, a streamed chat that ends with its [DONE] event, a completion; a
// repeated conversation sent by the KV index to the engine that cached its prefix; a malformed
// request answered 400 by the picker as an OpenAI error the SDK decodes.
func TestSDKEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("starts three simulated engines, kvroute-epp and a gateway")
	}
	pool := startSDKPool(t)
	const maxTokens = 12
	for _, mode := range []struct {
		name string
		mode extproc.BodyMode
	}{{"full_duplex", extproc.BodyFullDuplex}, {"buffered", extproc.BodyBuffered}} {
		t.Run(mode.name, func(t *testing.T) {
			client := pool.gateway(t, mode.mode)
			ctx := t.Context()
			chat := openai.ChatCompletionNewParams{
				Model: openai.ChatModel(enginesim.DefaultModel),
				Messages: []openai.ChatCompletionMessageParamUnion{
					openai.SystemMessage(systemPrompt("the chat test in "+mode.name, 2)),
					openai.UserMessage("Where is my order 1234?"),
				},
				Temperature: openai.Float(0),
				MaxTokens:   openai.Int(maxTokens),
			}

			t.Run("chat", func(t *testing.T) {
				var resp *http.Response
				c, err := client.Chat.Completions.New(ctx, chat, option.WithResponseInto(&resp))
				if err != nil {
					t.Fatalf("chat: %v", err)
				}
				checkRouted(t, resp)
				if len(c.Choices) != 1 {
					t.Fatalf("%d choices, want 1", len(c.Choices))
				}
				ch := c.Choices[0]
				if words := len(strings.Fields(ch.Message.Content)); words != maxTokens || ch.FinishReason != "length" {
					t.Errorf("answer of %d words ending %q, want %d ending \"length\": %q", words, ch.FinishReason, maxTokens, ch.Message.Content)
				}
				if c.ID == "" || c.Usage.CompletionTokens != maxTokens || c.Usage.PromptTokens == 0 {
					t.Errorf("id %q, usage %+v: want an id, %d completion tokens and the prompt's", c.ID, c.Usage, maxTokens)
				}
			})

			t.Run("chat_stream", func(t *testing.T) {
				sp := chat
				sp.Messages = []openai.ChatCompletionMessageParamUnion{
					openai.SystemMessage(systemPrompt("the streaming test in "+mode.name, 1)),
					openai.UserMessage("Count to twelve."),
				}
				sp.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
				var resp *http.Response
				raw := &rawBody{}
				stream := client.Chat.Completions.NewStreaming(ctx, sp, option.WithResponseInto(&resp), option.WithMiddleware(raw.middleware))
				acc := openai.ChatCompletionAccumulator{}
				chunks := 0
				for stream.Next() {
					acc.AddChunk(stream.Current())
					chunks++
				}
				if err := stream.Err(); err != nil {
					t.Fatalf("stream: %v", err)
				}
				_ = stream.Close()
				checkRouted(t, resp)
				if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
					t.Errorf("Content-Type %q, want text/event-stream", ct)
				}
				if chunks < maxTokens {
					t.Errorf("%d chunks, want at least %d (one per token)", chunks, maxTokens)
				}
				if len(acc.Choices) != 1 {
					t.Fatalf("%d choices accumulated, want 1", len(acc.Choices))
				}
				if words := len(strings.Fields(acc.Choices[0].Message.Content)); words != maxTokens || acc.Choices[0].FinishReason != "length" {
					t.Errorf("streamed answer of %d words ending %q, want %d ending \"length\": %q",
						words, acc.Choices[0].FinishReason, maxTokens, acc.Choices[0].Message.Content)
				}
				if acc.Usage.CompletionTokens != maxTokens {
					t.Errorf("usage in the last chunk %+v, want %d completion tokens", acc.Usage, maxTokens)
				}
				if body := raw.String(); !strings.HasSuffix(strings.TrimRight(body, "\n"), "data: [DONE]") {
					t.Errorf("the stream does not end with its [DONE] event; its last bytes: %q", body[max(len(body)-120, 0):])
				}
			})

			t.Run("completions", func(t *testing.T) {
				var resp *http.Response
				c, err := client.Completions.New(ctx, openai.CompletionNewParams{
					Model:       openai.CompletionNewParamsModel(enginesim.DefaultModel),
					Prompt:      openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once upon a time, in " + mode.name + " mode, there was a router")},
					MaxTokens:   openai.Int(maxTokens),
					Temperature: openai.Float(0),
				}, option.WithResponseInto(&resp))
				if err != nil {
					t.Fatalf("completions: %v", err)
				}
				checkRouted(t, resp)
				if len(c.Choices) != 1 || len(strings.Fields(c.Choices[0].Text)) != maxTokens || c.Usage.CompletionTokens != maxTokens {
					t.Errorf("completion %+v, usage %+v: want one choice of %d words", c.Choices, c.Usage, maxTokens)
				}
			})

			t.Run("kv_aware", func(t *testing.T) {
				conv := chat
				conv.Messages = []openai.ChatCompletionMessageParamUnion{
					openai.SystemMessage(systemPrompt("the KV test in "+mode.name, 6)),
					openai.UserMessage("What is your refund policy for opened books?"),
				}
				var first *http.Response
				if _, err := client.Chat.Completions.New(ctx, conv, option.WithResponseInto(&first)); err != nil {
					t.Fatalf("first turn: %v", err)
				}
				checkRouted(t, first)
				cachedOn := first.Header.Get(headerEngine)
				if route := first.Header.Get(headerRoute); route == "kv_aware" {
					t.Fatalf("the first turn of a new conversation was routed kv_aware: no engine held its prefix yet")
				}
				// The engine's KV events reach the index asynchronously: repeat the conversation
				// until the index routes it (each repeat must still land on the same engine).
				var resp *http.Response
				var c *openai.ChatCompletion
				deadline := time.Now().Add(15 * time.Second)
				for {
					var err error
					if c, err = client.Chat.Completions.New(ctx, conv, option.WithResponseInto(&resp)); err != nil {
						t.Fatalf("repeat: %v", err)
					}
					checkRouted(t, resp)
					if resp.Header.Get(headerRoute) == "kv_aware" || time.Now().After(deadline) {
						break
					}
					time.Sleep(50 * time.Millisecond)
				}
				if route := resp.Header.Get(headerRoute); route != "kv_aware" {
					t.Fatalf("the repeated conversation is still routed %q, want kv_aware (the engines' KV events never reached the index?)", route)
				}
				if got := resp.Header.Get(headerEngine); got != cachedOn {
					t.Errorf("the repeated conversation went to %s, want %s, the engine that cached its prefix", got, cachedOn)
				}
				if c.Usage.PromptTokensDetails.CachedTokens == 0 {
					t.Errorf("the engine reports no cached prompt tokens for the repeated conversation: usage %+v", c.Usage)
				}
			})

			t.Run("bad_request", func(t *testing.T) {
				before := pool.app.Server.Stats().Answered[400]
				_, err := client.Chat.Completions.New(ctx, chat, option.WithJSONSet("messages", "not a list of messages"))
				var apiErr *openai.Error
				if !errors.As(err, &apiErr) {
					t.Fatalf("error %v (%T), want an *openai.Error", err, err)
				}
				if apiErr.StatusCode != http.StatusBadRequest || apiErr.Type != "invalid_request_error" || apiErr.Message == "" {
					t.Errorf("status %d, type %q, message %q: want 400, invalid_request_error and a message",
						apiErr.StatusCode, apiErr.Type, apiErr.Message)
				}
				if after := pool.app.Server.Stats().Answered[400]; after != before+1 {
					t.Errorf("the picker answered 400 %d times for the malformed request, want once (an engine answered it?)", after-before)
				}
			})
		})
	}
}
