package prefixkey

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// Format names the wire format a Request was parsed from.
type Format uint8

const (
	// FormatOpenAIChat is an OpenAI chat completions body (POST /v1/chat/completions).
	FormatOpenAIChat Format = iota + 1
	// FormatOpenAICompletion is an OpenAI completions body (POST /v1/completions).
	FormatOpenAICompletion
	// FormatAnthropicMessages is an Anthropic messages body (POST /v1/messages).
	FormatAnthropicMessages
)

// FormatOfPath returns the format of the LLM API endpoint whose URL path ends path:
// "/v1/chat/completions" OpenAI chat, "/v1/completions" OpenAI completions, "/v1/messages"
// Anthropic messages; 0 for any other path.
func FormatOfPath(path string) Format {
	switch {
	case strings.HasSuffix(path, "/v1/chat/completions"):
		return FormatOpenAIChat
	case strings.HasSuffix(path, "/v1/completions"):
		return FormatOpenAICompletion
	case strings.HasSuffix(path, "/v1/messages"):
		return FormatAnthropicMessages
	}
	return 0
}

// String returns the format's short name ("openai_chat", "openai_completion", "anthropic_messages").
func (f Format) String() string {
	switch f {
	case FormatOpenAIChat:
		return "openai_chat"
	case FormatOpenAICompletion:
		return "openai_completion"
	case FormatAnthropicMessages:
		return "anthropic_messages"
	default:
		return fmt.Sprintf("format(%d)", uint8(f))
	}
}

// ErrMalformed is wrapped by every parse error: the body is not a valid request of the format.
// The wrapping *FieldError names the field and the reason.
var ErrMalformed = errors.New("prefixkey: malformed request")

// FieldError says which field of a request body is malformed and why. It wraps ErrMalformed, so
// errors.Is(err, ErrMalformed) holds for every parse error.
type FieldError struct {
	Field  string // JSON path of the field, e.g. "messages[2].content"; "" for the body itself
	Reason string // what is wrong, e.g. "must be a string or an array of content parts"
}

func (e *FieldError) Error() string {
	if e.Field == "" {
		return "prefixkey: malformed request: " + e.Reason
	}
	return "prefixkey: malformed request: " + e.Field + ": " + e.Reason
}

// Unwrap returns ErrMalformed.
func (e *FieldError) Unwrap() error { return ErrMalformed }

// Opt is an optional value whose presence is kept: an absent field is not the same as a zero one.
type Opt[T any] struct {
	V   T
	Set bool
}

// Some returns a present Opt holding v.
func Some[T any](v T) Opt[T] { return Opt[T]{V: v, Set: true} }

// Part is one part of a message's content: a text part, or a non-text part (image, audio, tool call,
// tool result, thinking) whose Data holds what identifies it (a URL, a digest, a tool call's JSON).
type Part struct {
	Type string // "text", "image_url", "input_audio", "image", "tool_use", "tool_result", "thinking", …
	Text string // the text of a text part (also of "thinking"); "" otherwise
	Data string // the identifying payload of a non-text part: canonical JSON (compact, keys sorted) or a URL
}

// Message is one chat message. Text concatenates the text of its parts in order (a string content is
// one text part); Parts keeps the structure for callers that need it.
type Message struct {
	Role  string // "user", "assistant", "tool", "function" (system and developer go to Request.System)
	Text  string
	Parts []Part
	// Extra holds the message's fields other than role and content (tool_calls, tool_call_id, name)
	// as compact JSON, so that the response-cache key can cover them; nil when there are none.
	Extra json.RawMessage
}

// Params are the sampling parameters of a request. Absent fields have Set == false.
// JSON-valued parameters are kept as canonical JSON — compact, object keys sorted recursively, so
// that key order in the client's body does not matter — and nil when absent.
type Params struct {
	Temperature         Opt[float64]
	TopP                Opt[float64]
	MaxTokens           Opt[int64] // max_tokens (all formats)
	MaxCompletionTokens Opt[int64] // OpenAI chat max_completion_tokens
	N                   Opt[int64]
	Seed                Opt[int64]
	PresencePenalty     Opt[float64]
	FrequencyPenalty    Opt[float64]
	Stream              bool
	Stop                []string // stop (OpenAI, string or array) or stop_sequences (Anthropic); nil when absent
	ResponseFormat      json.RawMessage
	LogitBias           json.RawMessage
	Tools               json.RawMessage
	ToolChoice          json.RawMessage
	// Other holds the body's other top-level fields (logprobs, top_k, reasoning_effort, thinking,
	// stream_options, …) as one canonical JSON object with sorted keys, nil when there are none.
	// They may change the output, so the response-cache key covers them. Fields that never do
	// (user, metadata, service_tier, store) and null values are left out.
	Other json.RawMessage
}

// Request is a parsed LLM request, whatever its wire format. The parsers fill what the body holds;
// Tenant, Adapter (when the body does not name one), CacheSalt (when the body does not carry one),
// TokenIDs and MultiModal are for the caller to set when it knows them.
//
// A Request is a plain value: not safe for concurrent mutation, safe for concurrent reads.
type Request struct {
	Format Format
	// HasSystem tells an empty system prompt from none (see System). It sits beside Format, in
	// the same word.
	HasSystem bool
	Model     string
	Adapter   string // LoRA adapter name, when the request runs on one; it replaces Model in block-key roots
	Tenant    string // caller-supplied tenant; isolates response-cache entries

	// System is the system prompt: OpenAI "system" and "developer" messages joined by "\n" in order,
	// or Anthropic's top-level "system" (a string, or the text of its content blocks joined by "\n").
	System string

	// Messages are the non-system messages in order (OpenAI system/developer messages are in System).
	Messages []Message

	// Prompt holds an OpenAI completions prompt: one entry for a string prompt, several for an array of
	// strings. PromptTokens holds the token IDs when the prompt is given as token arrays (first prompt).
	Prompt       []string
	PromptTokens []uint32

	Params Params

	// TokenIDs are the request's prompt tokens as the engine tokenizes them, when the caller has them.
	// They drive block keys (precise KV-aware routing). Nil means "not known".
	TokenIDs []uint32
	// CacheSalt isolates KV-cache sharing (vLLM's cache_salt: only requests with the same salt
	// share cached blocks). The OpenAI parsers read it from the body's top-level "cache_salt". It
	// enters the block-key root, the prefix key and the response-cache key.
	CacheSalt string
	// Media lists the multimodal items of Messages (images, audio, video) in order, with their
	// identities; the parsers fill it. Those of the anchor message enter the prefix key.
	Media []Media
	// MultiModal lists multimodal placeholders by token span, folded into the block keys of the blocks
	// they overlap. The caller sets it with TokenIDs when it knows where the engine's processor puts
	// each item's placeholder tokens: one span per item of Media, in order, with the item's Hash
	// (or the digest of the engine's own identifier, events.ExtraKeyHash). While Media is non-empty
	// and MultiModal is not, the request has no block keys (see MediaPlaced).
	MultiModal []MultiModalSpan
}

// MultiModalSpan is a multimodal item's placeholder in the token sequence: tokens [Offset, Offset+Length)
// stand for the item whose content digest is Hash.
type MultiModalSpan struct {
	Offset int
	Length int
	Hash   uint64
}

// Anchor returns the text the prefix key is computed over and its tag: 'S' with the system prompt
// when the request has one, otherwise 'M' with the first non-system message's text (for completions:
// the first prompt). ok is false when there is no anchor (no system prompt and no message or prompt).
func (r *Request) Anchor() (tag byte, text string, ok bool) {
	if r.HasSystem {
		return 'S', r.System, true
	}
	if len(r.Messages) > 0 {
		return 'M', r.Messages[0].Text, true
	}
	if len(r.Prompt) > 0 {
		return 'M', r.Prompt[0], true
	}
	return 0, "", false
}

// ModelOrAdapter returns the adapter name when set, otherwise the model: the name that roots block keys.
func (r *Request) ModelOrAdapter() string {
	if r.Adapter != "" {
		return r.Adapter
	}
	return r.Model
}
