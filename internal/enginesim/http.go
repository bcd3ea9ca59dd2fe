package enginesim

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/zeebo/xxh3"

	"github.com/kvroute/kvroute/prefixkey"
)

const maxBody = 32 << 20

// Response headers that report what the engine did (real vLLM sends none of them).
const (
	HeaderEngine       = "X-Enginesim-Engine"        // Config.Name
	HeaderCachedTokens = "X-Enginesim-Cached-Tokens" // Result.CachedTokens
	HeaderPrefill      = "X-Enginesim-Prefill-Us"    // Result.Prefill in µs (virtual)
	HeaderDecode       = "X-Enginesim-Decode-Us"     // Result.Decode in µs (virtual)
	HeaderQueued       = "X-Enginesim-Queued-Us"     // Result.Queued in µs (wall clock)
	// HeaderStorageTokens is Result.StorageTokens, HeaderStorageLoad Result.StorageLoad in µs
	// (virtual); both sent only by an engine with Config.Storage.
	HeaderStorageTokens = "X-Enginesim-Storage-Tokens"
	HeaderStorageLoad   = "X-Enginesim-Storage-Load-Us"
)

// Handler returns the engine's HTTP API:
//
//	POST /v1/chat/completions   OpenAI chat (stream or not)
//	POST /v1/completions        OpenAI completions (stream or not)
//	POST /v1/messages           Anthropic messages (stream or not)
//	POST /tokenize              vLLM's tokenize: {"prompt"} or {"messages"} → {"count","max_model_len","tokens","token_strs"}
//	GET  /v1/models             the served model
//	GET  /metrics               Prometheus text: vllm:* gauges and counters
//	GET  /health                200, empty body
//	GET  /v1/kv_events          SSE KV events (Events.SSE)
//
// While SetDown(true), after Kill and after Close every request gets 503. The handler may be
// mounted on any server; Close waits for its in-flight requests.
func (e *Engine) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		e.serveGenerate(w, r, prefixkey.FormatOpenAIChat)
	})
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) {
		e.serveGenerate(w, r, prefixkey.FormatOpenAICompletion)
	})
	mux.HandleFunc("POST /v1/messages", func(w http.ResponseWriter, r *http.Request) {
		e.serveGenerate(w, r, prefixkey.FormatAnthropicMessages)
	})
	mux.HandleFunc("POST /tokenize", e.handleTokenize)
	mux.HandleFunc("GET /v1/models", e.handleModels)
	mux.HandleFunc("GET /metrics", e.handleMetrics)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.HandleFunc("GET /v1/kv_events", e.handleKVEvents)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.mu.Lock()
		if e.closed || e.killed || e.down || e.draining {
			e.mu.Unlock()
			writeOpenAIError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", "engine is unavailable")
			return
		}
		e.handlers.Add(1)
		e.mu.Unlock()
		defer e.handlers.Done()
		w.Header().Set(HeaderEngine, e.cfg.Name)
		mux.ServeHTTP(w, r)
	})
}

// openAIError is vLLM's error body.
type openAIError struct {
	Error struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Param   any    `json:"param"`
		Code    int    `json:"code"`
	} `json:"error"`
}

func writeOpenAIError(w http.ResponseWriter, status int, typ, msg string) {
	var b openAIError
	b.Error.Message, b.Error.Type, b.Error.Code = msg, typ, status
	writeJSON(w, status, b)
}

func writeAnthropicError(w http.ResponseWriter, status int, typ, msg string) {
	writeJSON(w, status, map[string]any{"type": "error", "error": map[string]string{"type": typ, "message": msg}})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

func readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	if err != nil {
		writeOpenAIError(w, http.StatusBadRequest, "BadRequestError", "reading the body: "+err.Error())
		return nil, false
	}
	return body, true
}

// transferField is the request's kv_transfer_params.
type transferField struct {
	KVTransferParams *KVTransferParams `json:"kv_transfer_params"`
}

// streamOptions are the fields prefixkey does not parse.
type streamOptions struct {
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
}

// genMeta is what a response is made of besides the engine's Result.
type genMeta struct {
	format  prefixkey.Format
	model   string
	id      string
	created int64
	seed    uint64 // content seed
	n       int    // choices
	usage   bool   // stream_options.include_usage
	limited bool   // max tokens set: finish "length"
}

// serveGenerate is the common path of the three generation endpoints.
func (e *Engine) serveGenerate(w http.ResponseWriter, r *http.Request, f prefixkey.Format) {
	fail := writeOpenAIError
	if f == prefixkey.FormatAnthropicMessages {
		fail = func(w http.ResponseWriter, status int, typ, msg string) {
			at := "invalid_request_error"
			switch status {
			case http.StatusNotFound:
				at = "not_found_error"
			case http.StatusServiceUnavailable:
				at = "overloaded_error"
			}
			writeAnthropicError(w, status, at, msg)
		}
	}
	body, ok := readBody(w, r)
	if !ok {
		return
	}
	req, err := prefixkey.Parse(f, body)
	if err != nil {
		fail(w, http.StatusBadRequest, "BadRequestError", err.Error())
		return
	}
	if req.Model != e.cfg.Model {
		fail(w, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The model `%s` does not exist.", req.Model))
		return
	}
	in := e.InputOf(req)
	meta := e.meta(req, in)
	if f != prefixkey.FormatAnthropicMessages && req.Params.Stream {
		var so streamOptions
		_ = json.Unmarshal(body, &so)
		meta.usage = so.StreamOptions != nil && so.StreamOptions.IncludeUsage
	}
	if bytes.Contains(body, []byte(`"kv_transfer_params"`)) {
		var tf transferField
		if err := json.Unmarshal(body, &tf); err != nil {
			fail(w, http.StatusBadRequest, "BadRequestError", "kv_transfer_params: "+err.Error())
			return
		}
		in.KVTransfer = tf.KVTransferParams
		if in.KVTransfer != nil && in.KVTransfer.DoRemoteDecode && req.Params.Stream {
			fail(w, http.StatusBadRequest, "BadRequestError", ErrBadTransferParams.Error()+
				": do_remote_decode needs \"stream\": false (the response carries the decode's kv_transfer_params)")
			return
		}
	}

	ctx := r.Context()
	j, err := e.begin(ctx, in)
	if err != nil {
		switch {
		case errors.Is(err, ErrTooLong):
			fail(w, http.StatusBadRequest, "BadRequestError", err.Error())
		case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
			// the client is gone
		default:
			fail(w, http.StatusServiceUnavailable, "ServiceUnavailableError", err.Error())
		}
		return
	}
	defer j.finish()
	j.res.CompletionTokens = in.OutputTokens * meta.n
	h := w.Header()
	h.Set(HeaderCachedTokens, strconv.Itoa(j.res.CachedTokens))
	h.Set(HeaderPrefill, strconv.FormatInt(j.res.Prefill.Microseconds(), 10))
	h.Set(HeaderDecode, strconv.FormatInt(j.res.Decode.Microseconds(), 10))
	h.Set(HeaderQueued, strconv.FormatInt(j.res.Queued.Microseconds(), 10))
	if e.store != nil {
		h.Set(HeaderStorageTokens, strconv.Itoa(j.res.StorageTokens))
		h.Set(HeaderStorageLoad, strconv.FormatInt(j.res.StorageLoad.Microseconds(), 10))
	}

	if req.Params.Stream {
		e.stream(w, r, j, meta, in)
		return
	}
	if err := j.sleep(ctx, j.res.StorageLoad+j.res.Prefill, true); err != nil {
		e.sleepFailed(w, err, fail)
		return
	}
	if err := j.handOff(ctx, in.Tokens); err != nil {
		if errors.Is(err, ErrStorageUnavailable) {
			fail(w, http.StatusServiceUnavailable, "ServiceUnavailableError", err.Error())
			return
		}
		e.sleepFailed(w, err, fail)
		return
	}
	if err := j.sleep(ctx, j.res.Decode, false); err != nil {
		e.sleepFailed(w, err, fail)
		return
	}
	if err := j.flushDebt(ctx); err != nil {
		e.sleepFailed(w, err, fail)
		return
	}
	writeJSON(w, http.StatusOK, e.body(meta, j.res, in.OutputTokens))
}

func (e *Engine) sleepFailed(w http.ResponseWriter, err error, fail func(http.ResponseWriter, int, string, string)) {
	if errors.Is(err, ErrClosed) {
		fail(w, http.StatusServiceUnavailable, "ServiceUnavailableError", "engine stopped")
	}
}

// meta derives a response's identity. At temperature 0 the id, created and content are functions
// of the model, format, prompt tokens and lengths (XXH3-128 of them): identical requests give
// byte-identical bodies. Otherwise the id is random, created is Config.Now, and the content is
// random unless the request sets a seed.
func (e *Engine) meta(req *prefixkey.Request, in Input) genMeta {
	m := genMeta{format: req.Format, model: req.Model, n: 1}
	if req.Params.N.Set && req.Params.N.V > 1 && req.Format != prefixkey.FormatAnthropicMessages {
		m.n = int(min(req.Params.N.V, 16))
	}
	m.limited = req.Params.MaxTokens.Set || req.Params.MaxCompletionTokens.Set
	var hh xxh3.Hasher
	var b [8]byte
	_, _ = hh.Write([]byte{byte(req.Format)})
	_, _ = hh.WriteString(req.Model)
	for _, t := range in.Tokens {
		binary.LittleEndian.PutUint32(b[:4], t)
		_, _ = hh.Write(b[:4])
	}
	binary.LittleEndian.PutUint64(b[:], uint64(in.OutputTokens)<<8|uint64(m.n))
	_, _ = hh.Write(b[:])
	sum := hh.Sum128()
	det := req.Params.Temperature.Set && req.Params.Temperature.V == 0
	prefix := map[prefixkey.Format]string{prefixkey.FormatOpenAIChat: "chatcmpl-", prefixkey.FormatOpenAICompletion: "cmpl-",
		prefixkey.FormatAnthropicMessages: "msg_"}[req.Format]
	if det {
		var id [16]byte
		binary.BigEndian.PutUint64(id[:8], sum.Hi)
		binary.BigEndian.PutUint64(id[8:], sum.Lo)
		m.id = prefix + hex.EncodeToString(id[:])
		m.created = 1_700_000_000 + int64(sum.Lo%100_000_000)
		m.seed = sum.Lo
	} else {
		var id [16]byte
		_, _ = io.ReadFull(rand.Reader, id[:])
		m.id = prefix + hex.EncodeToString(id[:])
		m.created = e.cfg.Now().Unix()
		m.seed = binary.LittleEndian.Uint64(id[:8])
		if req.Params.Seed.Set {
			m.seed = sum.Lo ^ uint64(req.Params.Seed.V)
		}
	}
	return m
}

// outputWords are the words completions are made of (a read-only table).
var outputWords = [...]string{
	"the", "cache", "router", "block", "prefix", "token", "engine", "request", "model", "latency",
	"is", "a", "of", "and", "to", "in", "for", "with", "on", "that",
	"fast", "warm", "cold", "hit", "miss", "route", "score", "load", "queue", "batch",
	"key", "hash", "chain", "tier", "memory", "GPU", "CPU", "event", "stream", "reply",
	"simple", "shared", "system", "prompt", "user", "answer", "data", "value", "time", "step",
	"first", "next", "last", "more", "less", "each", "every", "some", "many", "few",
	"yes", "no", "here", "there",
}

// word returns completion token i of choice c.
func word(seed uint64, c, i int) string {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], seed+uint64(c)*0x9e3779b97f4a7c15)
	binary.LittleEndian.PutUint64(b[8:], uint64(i))
	return outputWords[xxh3.Hash(b[:])%uint64(len(outputWords))]
}

// text returns the completion of choice c: k words separated by spaces.
func text(seed uint64, c, k int) string {
	var sb strings.Builder
	for i := range k {
		if i > 0 {
			sb.WriteByte(' ')
		}
		sb.WriteString(word(seed, c, i))
	}
	return sb.String()
}

// delta returns token i of choice c as streamed: the word, preceded by a space after the first.
func delta(seed uint64, c, i int) string {
	if i == 0 {
		return word(seed, c, i)
	}
	return " " + word(seed, c, i)
}

func (m *genMeta) finishReason() string {
	if m.limited {
		return "length"
	}
	return "stop"
}

func (m *genMeta) anthropicStop() string {
	if m.limited {
		return "max_tokens"
	}
	return "end_turn"
}

// Response bodies. Field order follows vLLM's.

type usageBody struct {
	PromptTokens        int          `json:"prompt_tokens"`
	TotalTokens         int          `json:"total_tokens"`
	CompletionTokens    int          `json:"completion_tokens"`
	PromptTokensDetails *usageDetail `json:"prompt_tokens_details"`
}

type usageDetail struct {
	CachedTokens int `json:"cached_tokens"`
}

func usageOf(res Result) *usageBody {
	return &usageBody{PromptTokens: res.PromptTokens, TotalTokens: res.PromptTokens + res.CompletionTokens,
		CompletionTokens: res.CompletionTokens, PromptTokensDetails: &usageDetail{CachedTokens: res.CachedTokens}}
}

type chatMessage struct {
	Role      string `json:"role"`
	Content   string `json:"content"`
	ToolCalls []any  `json:"tool_calls"`
}

type chatChoice struct {
	Index        int         `json:"index"`
	Message      chatMessage `json:"message"`
	Logprobs     any         `json:"logprobs"`
	FinishReason string      `json:"finish_reason"`
	StopReason   any         `json:"stop_reason"`
}

type chatBody struct {
	ID               string            `json:"id"`
	Object           string            `json:"object"`
	Created          int64             `json:"created"`
	Model            string            `json:"model"`
	Choices          []chatChoice      `json:"choices"`
	Usage            *usageBody        `json:"usage"`
	PromptLogprobs   any               `json:"prompt_logprobs"`
	KVTransferParams *KVTransferParams `json:"kv_transfer_params,omitempty"`
}

type textChoice struct {
	Index          int     `json:"index"`
	Text           string  `json:"text"`
	Logprobs       any     `json:"logprobs"`
	FinishReason   *string `json:"finish_reason"`
	StopReason     any     `json:"stop_reason"`
	PromptLogprobs any     `json:"prompt_logprobs,omitempty"`
}

type textBody struct {
	ID               string            `json:"id"`
	Object           string            `json:"object"`
	Created          int64             `json:"created"`
	Model            string            `json:"model"`
	Choices          []textChoice      `json:"choices"`
	Usage            *usageBody        `json:"usage,omitempty"`
	KVTransferParams *KVTransferParams `json:"kv_transfer_params,omitempty"`
}

type anthropicBlock struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

type anthropicUsage struct {
	InputTokens              int `json:"input_tokens"`
	CacheCreationInputTokens int `json:"cache_creation_input_tokens"`
	CacheReadInputTokens     int `json:"cache_read_input_tokens"`
	OutputTokens             int `json:"output_tokens"`
}

type anthropicBody struct {
	ID               string            `json:"id"`
	Type             string            `json:"type"`
	Role             string            `json:"role"`
	Model            string            `json:"model"`
	Content          []anthropicBlock  `json:"content"`
	StopReason       *string           `json:"stop_reason"`
	StopSequence     *string           `json:"stop_sequence"`
	Usage            anthropicUsage    `json:"usage"`
	KVTransferParams *KVTransferParams `json:"kv_transfer_params,omitempty"`
}

// anthropicUsageOf follows Anthropic's accounting: input_tokens excludes the tokens read from the
// cache, which cache_read_input_tokens reports.
func anthropicUsageOf(res Result, out int) anthropicUsage {
	return anthropicUsage{InputTokens: res.PromptTokens - res.CachedTokens, CacheReadInputTokens: res.CachedTokens, OutputTokens: out}
}

// body returns the non-streaming response.
func (e *Engine) body(m genMeta, res Result, k int) any {
	switch m.format {
	case prefixkey.FormatOpenAICompletion:
		b := textBody{ID: m.id, Object: "text_completion", Created: m.created, Model: m.model, Usage: usageOf(res),
			KVTransferParams: res.KVTransfer}
		fr := m.finishReason()
		for c := range m.n {
			b.Choices = append(b.Choices, textChoice{Index: c, Text: text(m.seed, c, k), FinishReason: &fr})
		}
		return b
	case prefixkey.FormatAnthropicMessages:
		sr := m.anthropicStop()
		return anthropicBody{ID: m.id, Type: "message", Role: "assistant", Model: m.model,
			Content: []anthropicBlock{{Type: "text", Text: text(m.seed, 0, k)}}, StopReason: &sr,
			Usage: anthropicUsageOf(res, k), KVTransferParams: res.KVTransfer}
	default:
		b := chatBody{ID: m.id, Object: "chat.completion", Created: m.created, Model: m.model, Usage: usageOf(res),
			KVTransferParams: res.KVTransfer}
		for c := range m.n {
			b.Choices = append(b.Choices, chatChoice{Index: c, FinishReason: m.finishReason(),
				Message: chatMessage{Role: "assistant", Content: text(m.seed, c, k), ToolCalls: []any{}}})
		}
		return b
	}
}

type chatDelta struct {
	Role    string `json:"role,omitempty"`
	Content string `json:"content"`
}

type chunkChoice struct {
	Index        int       `json:"index"`
	Delta        chatDelta `json:"delta"`
	Logprobs     any       `json:"logprobs"`
	FinishReason *string   `json:"finish_reason"`
}

type chatChunk struct {
	ID      string        `json:"id"`
	Object  string        `json:"object"`
	Created int64         `json:"created"`
	Model   string        `json:"model"`
	Choices []chunkChoice `json:"choices"`
	Usage   *usageBody    `json:"usage,omitempty"`
}

// sseWriter writes one streamed response.
type sseWriter struct {
	w   http.ResponseWriter
	fl  http.Flusher
	buf []byte
	err error
}

func (s *sseWriter) event(name string, v any) {
	if s.err != nil {
		return
	}
	d, err := json.Marshal(v)
	if err != nil {
		s.err = err
		return
	}
	if name != "" {
		s.buf = append(s.buf, "event: "...)
		s.buf = append(s.buf, name...)
		s.buf = append(s.buf, '\n')
	}
	s.buf = append(s.buf, "data: "...)
	s.buf = append(s.buf, d...)
	s.buf = append(s.buf, "\n\n"...)
}

func (s *sseWriter) raw(line string) {
	s.buf = append(s.buf, line...)
}

func (s *sseWriter) flush() error {
	if s.err != nil {
		return s.err
	}
	if len(s.buf) > 0 {
		_, s.err = s.w.Write(s.buf)
		s.buf = s.buf[:0]
		if s.err == nil && s.fl != nil {
			s.fl.Flush()
		}
	}
	return s.err
}

// stream writes a streaming response: the prefill, then one chunk (one event for Anthropic) per
// completion token, each written after its decode time.
func (e *Engine) stream(w http.ResponseWriter, r *http.Request, j *job, m genMeta, in Input) {
	ctx := r.Context()
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	fl, _ := w.(http.Flusher)
	s := &sseWriter{w: w, fl: fl}
	k := in.OutputTokens
	per := e.cfg.Latency.PerOutputToken
	// tokens sleeps each token's decode time and writes it with emit; false when the client or
	// the engine went away.
	tokens := func(emit func(i int)) bool {
		for i := range k {
			if j.sleep(ctx, per, false) != nil {
				return false
			}
			emit(i)
			if j.debt == 0 && s.flush() != nil { // flush when the sleep was taken, else batch
				return false
			}
		}
		return j.flushDebt(ctx) == nil
	}
	if m.format == prefixkey.FormatAnthropicMessages {
		s.event("message_start", map[string]any{"type": "message_start", "message": anthropicBody{
			ID: m.id, Type: "message", Role: "assistant", Model: m.model, Content: []anthropicBlock{},
			Usage: anthropicUsageOf(j.res, 1)}})
		if s.flush() != nil || j.sleep(ctx, j.res.StorageLoad+j.res.Prefill, true) != nil || j.flushDebt(ctx) != nil {
			return
		}
		s.event("content_block_start", map[string]any{"type": "content_block_start", "index": 0,
			"content_block": anthropicBlock{Type: "text", Text: ""}})
		s.event("ping", map[string]string{"type": "ping"})
		if !tokens(func(i int) {
			s.event("content_block_delta", map[string]any{"type": "content_block_delta", "index": 0,
				"delta": map[string]string{"type": "text_delta", "text": delta(m.seed, 0, i)}})
		}) {
			return
		}
		s.event("content_block_stop", map[string]any{"type": "content_block_stop", "index": 0})
		s.event("message_delta", map[string]any{"type": "message_delta",
			"delta": map[string]any{"stop_reason": m.anthropicStop(), "stop_sequence": nil},
			"usage": map[string]int{"output_tokens": k}})
		s.event("message_stop", map[string]string{"type": "message_stop"})
		_ = s.flush()
		return
	}
	if j.sleep(ctx, j.res.StorageLoad+j.res.Prefill, true) != nil || j.flushDebt(ctx) != nil {
		return
	}
	fr := m.finishReason()
	if m.format == prefixkey.FormatOpenAICompletion {
		chunk := func(ch textChoice, u *usageBody) {
			cs := []textChoice{}
			if u == nil {
				cs = append(cs, ch)
			}
			s.event("", textBody{ID: m.id, Object: "text_completion", Created: m.created, Model: m.model, Choices: cs, Usage: u})
		}
		if !tokens(func(i int) {
			for c := range m.n {
				ch := textChoice{Index: c, Text: delta(m.seed, c, i)}
				if i == k-1 {
					ch.FinishReason = &fr
				}
				chunk(ch, nil)
			}
		}) {
			return
		}
		if k == 0 {
			for c := range m.n {
				chunk(textChoice{Index: c, FinishReason: &fr}, nil)
			}
		}
		if m.usage {
			chunk(textChoice{}, usageOf(j.res))
		}
	} else {
		chunk := func(ch chunkChoice, u *usageBody) {
			cs := []chunkChoice{}
			if u == nil {
				cs = append(cs, ch)
			}
			s.event("", chatChunk{ID: m.id, Object: "chat.completion.chunk", Created: m.created, Model: m.model, Choices: cs, Usage: u})
		}
		for c := range m.n {
			chunk(chunkChoice{Index: c, Delta: chatDelta{Role: "assistant"}}, nil)
		}
		if !tokens(func(i int) {
			for c := range m.n {
				ch := chunkChoice{Index: c, Delta: chatDelta{Content: delta(m.seed, c, i)}}
				if i == k-1 {
					ch.FinishReason = &fr
				}
				chunk(ch, nil)
			}
		}) {
			return
		}
		if k == 0 {
			for c := range m.n {
				chunk(chunkChoice{Index: c, FinishReason: &fr}, nil)
			}
		}
		if m.usage {
			chunk(chunkChoice{}, usageOf(j.res))
		}
	}
	s.raw("data: [DONE]\n\n")
	_ = s.flush()
}

// tokenizeRequest is vLLM's /tokenize body.
type tokenizeRequest struct {
	Model               string          `json:"model"`
	Prompt              *string         `json:"prompt"`
	Messages            json.RawMessage `json:"messages"`
	AddGenerationPrompt *bool           `json:"add_generation_prompt"`
	AddSpecialTokens    *bool           `json:"add_special_tokens"`
}

type tokenizeResponse struct {
	Count       int      `json:"count"`
	MaxModelLen int      `json:"max_model_len"`
	Tokens      []uint32 `json:"tokens"`
	TokenStrs   []string `json:"token_strs"`
}

// handleTokenize serves POST /tokenize. {"messages": […]} is parsed as an OpenAI chat body and
// templated by ChatTokens (add_generation_prompt defaults to true), so that its tokens are
// exactly those a chat completion with the same messages is processed with; {"prompt": "…"} gives
// <|begin_of_text|> (unless add_special_tokens is false) followed by the prompt's tokens.
func (e *Engine) handleTokenize(w http.ResponseWriter, r *http.Request) {
	body, ok := readBody(w, r)
	if !ok {
		return
	}
	var tr tokenizeRequest
	if err := json.Unmarshal(body, &tr); err != nil {
		writeOpenAIError(w, http.StatusBadRequest, "BadRequestError", "malformed tokenize request: "+err.Error())
		return
	}
	if tr.Model != "" && tr.Model != e.cfg.Model {
		writeOpenAIError(w, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The model `%s` does not exist.", tr.Model))
		return
	}
	var tokens []uint32
	switch {
	case len(tr.Messages) > 0 && string(tr.Messages) != "null":
		chat, _ := json.Marshal(struct {
			Model    string          `json:"model"`
			Messages json.RawMessage `json:"messages"`
		}{e.cfg.Model, tr.Messages})
		req, err := prefixkey.ParseOpenAIChat(chat)
		if err != nil {
			writeOpenAIError(w, http.StatusBadRequest, "BadRequestError", err.Error())
			return
		}
		tokens = ChatTokens(req, tr.AddGenerationPrompt == nil || *tr.AddGenerationPrompt)
	case tr.Prompt != nil:
		if tr.AddSpecialTokens == nil || *tr.AddSpecialTokens {
			tokens = []uint32{BOS}
		}
		tokens = AppendTokens(tokens, *tr.Prompt)
	default:
		writeOpenAIError(w, http.StatusBadRequest, "BadRequestError", "tokenize needs \"prompt\" or \"messages\"")
		return
	}
	if tokens == nil {
		tokens = []uint32{}
	}
	writeJSON(w, http.StatusOK, tokenizeResponse{Count: len(tokens), MaxModelLen: e.cfg.MaxModelLen, Tokens: tokens})
}

func (e *Engine) handleModels(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": []map[string]any{{
		"id": e.cfg.Model, "object": "model", "created": e.cfg.Now().Unix(), "owned_by": "vllm",
		"root": e.cfg.Model, "parent": nil, "max_model_len": e.cfg.MaxModelLen,
	}}})
}

// handleMetrics serves GET /metrics in the Prometheus text format, with vLLM's names, types and
// labels (engine, the engine index, and model_name). vllm:gpu_cache_usage_perc is the deprecated
// alias of vllm:kv_cache_usage_perc that vLLM 0.9.2 to 0.10 export beside it (hidden since 0.11),
// with vLLM's deprecation note.
func (e *Engine) handleMetrics(w http.ResponseWriter, _ *http.Request) {
	s := e.Stats()
	lbl := fmt.Sprintf(`{engine="0",model_name=%q}`, e.cfg.Model)
	var b strings.Builder
	metric := func(name, typ, help string, v float64) {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s %s\n%s%s %s\n", name, help, name, typ, name, lbl,
			strconv.FormatFloat(v, 'g', -1, 64))
	}
	metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", float64(s.Running))
	metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", float64(s.Waiting))
	metric("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.", s.Usage)
	metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", s.Usage)
	metric("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.", float64(s.PrefixCacheQueries))
	metric("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", float64(s.PrefixCacheHits))
	metric("vllm:external_prefix_cache_hits_total", "counter", "External prefix cache hits from KV connector (CPU tier and external storage), in tokens.", float64(s.ExternalCacheHits))
	metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", float64(s.PromptTokens))
	metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", float64(s.OutputTokens))
	metric("vllm:request_success_total", "counter", "Count of successfully processed requests.", float64(s.Requests))
	metric("vllm:kv_storage_blocks_written_total", "counter", "KV blocks written to external storage by prefills.", float64(s.StorageBlocksWritten))
	metric("vllm:kv_storage_blocks_skipped_total", "counter", "KV blocks a prefill found already in external storage (not rewritten).", float64(s.StorageBlocksSkipped))
	metric("vllm:kv_storage_bytes_written_total", "counter", "Simulated bytes of KV written to external storage.", float64(s.StorageBytesWritten))
	metric("vllm:kv_storage_blocks_read_total", "counter", "KV blocks loaded from external storage.", float64(s.StorageBlocksRead))
	metric("vllm:kv_storage_bytes_read_total", "counter", "Simulated bytes of KV loaded from external storage.", float64(s.StorageBytesRead))
	metric("vllm:kv_storage_write_seconds_total", "counter", "Simulated transfer time of KV writes to external storage.", s.StorageWriteTime.Seconds())
	metric("vllm:kv_storage_read_seconds_total", "counter", "Simulated transfer time of KV loads from external storage.", s.StorageReadTime.Seconds())
	metric("vllm:kv_storage_missing_blocks_total", "counter", "KV blocks listed in kv_transfer_params that could not be loaded and were computed locally.", float64(s.StorageMissingBlocks))
	metric("vllm:kv_storage_errors_total", "counter", "Failed external storage operations.", float64(s.StorageErrors))
	metric("vllm:kv_storage_lookups_total", "counter", "Requests that queried external storage for KV blocks.", float64(s.StorageLookups))
	metric("vllm:kv_transfer_prefill_handoffs_total", "counter", "Prefills answered with kv_transfer_params for a remote decode.", float64(s.PrefillHandoffs))
	metric("vllm:kv_transfer_decode_handoffs_total", "counter", "Requests served with do_remote_prefill.", float64(s.DecodeHandoffs))
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	_, _ = io.WriteString(w, b.String())
}
