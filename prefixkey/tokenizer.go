package prefixkey

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	lru "github.com/hashicorp/golang-lru/v2"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/zeebo/xxh3"
)

// Tokenizer returns a request's prompt tokens as the engine would see them.
//
// Tokenize returns the token IDs of r's prompt (chat template applied, for chat requests), or
// nil and a nil error when r has nothing to tokenize. An error means the tokens are unknown: the
// caller routes without block keys. Implementations honour ctx's deadline and cancellation, are
// safe for concurrent use, and may return a slice shared with r or with a cache: callers must
// treat it as read-only.
type Tokenizer interface {
	Tokenize(ctx context.Context, r *Request) ([]uint32, error)
}

// TokenizerFunc adapts a function to Tokenizer.
type TokenizerFunc func(ctx context.Context, r *Request) ([]uint32, error)

// Tokenize calls f.
func (f TokenizerFunc) Tokenize(ctx context.Context, r *Request) ([]uint32, error) { return f(ctx, r) }

var (
	_ Tokenizer = TokenizerFunc(nil)
	_ Tokenizer = (*EngineTokenizer)(nil)
	_ Tokenizer = EstimateTokenizer{}
)

// knownTokens returns the tokens r carries: TokenIDs, else the token-array prompt of a completions
// request (PromptTokens), else nil.
func knownTokens(r *Request) []uint32 {
	if r.TokenIDs != nil {
		return r.TokenIDs
	}
	return r.PromptTokens
}

// tokenizeMode says what a request sends to /tokenize.
type tokenizeMode uint8

const (
	modeNone   tokenizeMode = iota // nothing to tokenize
	modeChat                       // {"messages": [system?, messages...]}
	modePrompt                     // {"prompt": Prompt[0]}
)

func modeOf(r *Request) tokenizeMode {
	chat := r.HasSystem || len(r.Messages) > 0
	switch {
	case r.Format == FormatOpenAICompletion || !chat:
		if len(r.Prompt) > 0 {
			return modePrompt
		}
		return modeNone
	default:
		return modeChat
	}
}

// ErrTokenize is wrapped by every error of EngineTokenizer.Tokenize: the engine could not be
// reached, answered with a status other than 200 or with a body that is not a tokenize answer, or
// did not answer in time. Time-outs also satisfy errors.Is(err, context.DeadlineExceeded), and a
// cancelled ctx errors.Is(err, context.Canceled).
var ErrTokenize = errors.New("prefixkey: tokenize failed")

// Defaults of EngineTokenizerConfig.
const (
	// DefaultTokenizeTimeout bounds one /tokenize call (on top of the caller's ctx).
	DefaultTokenizeTimeout = 50 * time.Millisecond
	// DefaultTokenizeCacheSize is the number of recent results an EngineTokenizer keeps.
	DefaultTokenizeCacheSize = 4096
	// DefaultTokenizeCacheBytes bounds the token IDs an EngineTokenizer keeps (4 bytes each):
	// 64 MiB, 16M tokens. Long prompts fill it before DefaultTokenizeCacheSize entries.
	DefaultTokenizeCacheBytes = 64 << 20
)

// maxTokenizeResponse caps the body read from /tokenize (a 128k-token prompt answers ~1 MiB).
const maxTokenizeResponse = 16 << 20

// EngineTokenizerConfig configures an EngineTokenizer. Only BaseURL is required.
type EngineTokenizerConfig struct {
	// BaseURL is the engine's (or a tokenizer sidecar's) root URL, e.g. "http://vllm-0:8000";
	// requests go to BaseURL + "/tokenize". Scheme http or https.
	BaseURL string
	// Client sends the requests; nil means http.DefaultClient.
	Client *http.Client
	// Timeout bounds each call, layered on the caller's ctx (the earlier deadline wins); 0 means
	// DefaultTokenizeTimeout (50 ms); negative is an error.
	Timeout time.Duration
	// CacheSize is the number of recent results kept, keyed by model and content; 0 means
	// DefaultTokenizeCacheSize (4096); negative disables the cache.
	CacheSize int
	// CacheBytes bounds the bytes of the token IDs kept (4 per token); 0 means
	// DefaultTokenizeCacheBytes (64 MiB); negative means no bound beyond CacheSize.
	CacheBytes int64
	// Header is added to every request (e.g. Authorization for an engine started with --api-key);
	// nil for none. It is not modified.
	Header http.Header
}

// TokenizerStats are an EngineTokenizer's counters since it was created.
type TokenizerStats struct {
	// Calls counts Tokenize calls that needed the engine's tokens: those with neither tokens
	// already set nor an empty prompt. Calls − CacheHits requests were sent to the engine.
	Calls uint64
	// CacheHits counts calls answered from the cache.
	CacheHits uint64
	// Errors counts calls that returned an error, time-outs included.
	Errors uint64
	// Timeouts counts calls whose error was a deadline (the call's Timeout or ctx's deadline).
	Timeouts uint64
}

// EngineTokenizer is a client of a vLLM-compatible POST /tokenize endpoint. A chat request is sent
// as {"model", "messages": [{"role", "content"}, ...]} — the system prompt (role "system") first,
// then each message's role and Text — so that the engine applies its own chat template; a
// completions request as {"model", "prompt"} with its first prompt. The answer's "tokens" are
// returned. Non-text parts are not sent, so a request with media items (Request.Media) is not
// tokenized at all: its text-only tokens would be those of every request that differs from it
// only in an image, and their block keys would match each other's cache. It gets no tokens (nil,
// nil), hence no block keys: the router routes it by its prefix key, which covers its media.
//
// Recent results are kept in an LRU cache keyed by (model, XXH3-128 of the content sent), so that a
// repeated request costs a hash and no round trip. Requests that already carry tokens (TokenIDs,
// or a completions prompt given as token IDs) are answered with them, without cache or network.
//
// An EngineTokenizer is safe for concurrent use and starts no goroutine. The zero value is not
// usable: create one with NewEngineTokenizer.
type EngineTokenizer struct {
	endpoint string
	client   *http.Client
	timeout  time.Duration
	header   http.Header
	cache    *tokenCache // nil: disabled

	calls, hits, errs, timeouts atomic.Uint64
}

// NewEngineTokenizer validates cfg and returns the tokenizer. It fails when BaseURL is not an
// absolute http or https URL, or Timeout is negative.
func NewEngineTokenizer(cfg EngineTokenizerConfig) (*EngineTokenizer, error) {
	u, err := url.Parse(cfg.BaseURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("prefixkey: EngineTokenizerConfig.BaseURL %q: want an absolute http(s) URL", cfg.BaseURL)
	}
	if cfg.Timeout < 0 {
		return nil, fmt.Errorf("prefixkey: EngineTokenizerConfig.Timeout %v: want ≥ 0", cfg.Timeout)
	}
	t := &EngineTokenizer{
		endpoint: strings.TrimRight(cfg.BaseURL, "/") + "/tokenize",
		client:   cfg.Client,
		timeout:  cfg.Timeout,
		header:   cfg.Header,
	}
	if t.client == nil {
		t.client = http.DefaultClient
	}
	if t.timeout == 0 {
		t.timeout = DefaultTokenizeTimeout
	}
	maxBytes := cfg.CacheBytes
	if maxBytes == 0 {
		maxBytes = DefaultTokenizeCacheBytes
	}
	switch {
	case cfg.CacheSize == 0:
		t.cache = newTokenCache(DefaultTokenizeCacheSize, maxBytes)
	case cfg.CacheSize > 0:
		t.cache = newTokenCache(cfg.CacheSize, maxBytes)
	}
	return t, nil
}

// Stats returns the tokenizer's counters. Safe for concurrent use.
func (t *EngineTokenizer) Stats() TokenizerStats {
	return TokenizerStats{Calls: t.calls.Load(), CacheHits: t.hits.Load(), Errors: t.errs.Load(), Timeouts: t.timeouts.Load()}
}

// Tokenize returns r's prompt tokens.
//
//  1. r carries tokens (TokenIDs, else PromptTokens): they are returned as is, err nil.
//  2. r has no prompt (no system prompt, message or completions prompt), or has media items
//     (Request.Media, whose placeholders /tokenize would not place): nil, nil.
//  3. The cache holds r's content for its model: the cached tokens, err nil.
//  4. Otherwise one POST /tokenize under the earlier of ctx's deadline and Timeout; on success
//     the tokens are cached and returned. Every failure returns nil and an error wrapping
//     ErrTokenize (and context.DeadlineExceeded for a time-out, or ctx's error when ctx was
//     cancelled). Errors are not cached.
//
// The returned slice is shared with r or the cache: treat it as read-only. Safe for concurrent
// use.
func (t *EngineTokenizer) Tokenize(ctx context.Context, r *Request) ([]uint32, error) {
	if tok := knownTokens(r); tok != nil {
		return tok, nil
	}
	mode := modeOf(r)
	if mode == modeNone || len(r.Media) > 0 {
		return nil, nil
	}
	t.calls.Add(1)
	key := tokenCacheKey{model: r.Model, h: contentHash(r, mode)}
	if t.cache != nil {
		if tok, ok := t.cache.c.Get(key); ok {
			t.hits.Add(1)
			return tok, nil
		}
	}
	tok, err := t.post(ctx, r, mode)
	if err != nil {
		t.errs.Add(1)
		if errors.Is(err, context.DeadlineExceeded) {
			t.timeouts.Add(1)
		}
		return nil, err
	}
	if t.cache != nil {
		tok = t.cache.add(key, tok)
	}
	return tok, nil
}

// tokenizeBody returns the /tokenize body of r as a stream, and its length: {"model", "messages":
// [{"role", "content"}, ...]} for chat (model left out when empty), {"model", "prompt"} for a
// completions prompt. The prompt's text is escaped as it is read, not copied into a buffer.
func tokenizeBody(r *Request, mode tokenizeMode) (io.Reader, int64) {
	pieces := make([]jsonPiece, 0, 4+4*len(r.Messages)+4)
	raw := func(s string) { pieces = append(pieces, jsonPiece{s: s}) }
	str := func(s string) { pieces = append(pieces, jsonPiece{s: s, quoted: true}) }
	raw("{")
	if r.Model != "" {
		raw(`"model":`)
		str(r.Model)
		raw(",")
	}
	if mode == modeChat {
		raw(`"messages":[`)
		sep := ""
		if r.HasSystem {
			raw(`{"role":"system","content":`)
			str(r.System)
			raw("}")
			sep = ","
		}
		for i := range r.Messages {
			raw(sep + `{"role":`)
			str(r.Messages[i].Role)
			raw(`,"content":`)
			str(r.Messages[i].Text)
			raw("}")
			sep = ","
		}
		raw("]}")
	} else {
		raw(`"prompt":`)
		str(r.Prompt[0])
		raw("}")
	}
	return newJSONStream(pieces)
}

type tokenizeAnswer struct {
	Tokens []uint32 `json:"tokens"`
	Count  *int     `json:"count"`
}

// post sends one /tokenize request.
func (t *EngineTokenizer) post(ctx context.Context, r *Request, mode tokenizeMode) ([]uint32, error) {
	body, size := tokenizeBody(r, mode)
	cctx, cancel := context.WithTimeout(ctx, t.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(cctx, http.MethodPost, t.endpoint, body)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrTokenize, err)
	}
	req.ContentLength = size
	req.GetBody = func() (io.ReadCloser, error) { // for the transport to send it again
		b, _ := tokenizeBody(r, mode)
		return io.NopCloser(b), nil
	}
	for k, vs := range t.header {
		for _, v := range vs {
			req.Header.Add(k, v)
		}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json")

	resp, err := t.client.Do(req)
	if err != nil {
		return nil, t.failure(ctx, cctx, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		snippet, _ := io.ReadAll(io.LimitReader(resp.Body, 256))
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // let the connection be reused
		return nil, fmt.Errorf("%w: POST %s: status %d: %s", ErrTokenize, t.endpoint, resp.StatusCode, bytes.TrimSpace(snippet))
	}
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxTokenizeResponse+1))
	if err != nil {
		return nil, t.failure(ctx, cctx, err)
	}
	if len(data) > maxTokenizeResponse {
		return nil, fmt.Errorf("%w: POST %s: answer larger than %d bytes", ErrTokenize, t.endpoint, maxTokenizeResponse)
	}
	var ans tokenizeAnswer
	if err := json.Unmarshal(data, &ans); err != nil {
		return nil, fmt.Errorf("%w: POST %s: bad answer: %w", ErrTokenize, t.endpoint, err)
	}
	if ans.Tokens == nil {
		return nil, fmt.Errorf("%w: POST %s: answer has no \"tokens\"", ErrTokenize, t.endpoint)
	}
	if ans.Count != nil && *ans.Count != len(ans.Tokens) {
		return nil, fmt.Errorf("%w: POST %s: answer has %d tokens but count %d", ErrTokenize, t.endpoint, len(ans.Tokens), *ans.Count)
	}
	return ans.Tokens, nil
}

// failure wraps a transport error: a deadline (the call's or ctx's) as context.DeadlineExceeded,
// a cancelled ctx as its error.
func (t *EngineTokenizer) failure(ctx, cctx context.Context, err error) error {
	switch {
	case errors.Is(cctx.Err(), context.DeadlineExceeded):
		if ctx.Err() == nil { // our own Timeout fired
			return fmt.Errorf("%w: POST %s: no answer within %v: %w", ErrTokenize, t.endpoint, t.timeout, context.DeadlineExceeded)
		}
		return fmt.Errorf("%w: POST %s: %w", ErrTokenize, t.endpoint, context.DeadlineExceeded)
	case ctx.Err() != nil:
		return fmt.Errorf("%w: POST %s: %w", ErrTokenize, t.endpoint, ctx.Err())
	default:
		return fmt.Errorf("%w: POST %s: %w", ErrTokenize, t.endpoint, err)
	}
}

// contentHash is XXH3-128 over the content /tokenize is sent, each field length-prefixed (le64):
// for chat, 'C' then role and text of the system prompt (role "system") and of each message; for a
// completions prompt, 'P' then the prompt.
func contentHash(r *Request, mode tokenizeMode) xxh3.Uint128 {
	var h xxh3.Hasher
	field := func(s string) {
		var l [8]byte
		binary.LittleEndian.PutUint64(l[:], uint64(len(s)))
		_, _ = h.Write(l[:])
		_, _ = h.WriteString(s)
	}
	if mode == modeChat {
		_, _ = h.Write([]byte{'C'})
		if r.HasSystem {
			field("system")
			field(r.System)
		}
		for i := range r.Messages {
			field(r.Messages[i].Role)
			field(r.Messages[i].Text)
		}
	} else {
		_, _ = h.Write([]byte{'P'})
		field(r.Prompt[0])
	}
	return h.Sum128()
}

// tokenCacheKey keys a tokenize result by model and content hash.
type tokenCacheKey struct {
	model string
	h     xxh3.Uint128
}

// tokenCache is the LRU of tokenize results (golang-lru/v2's Cache: locked), bounded by entries
// and by the bytes of their token IDs. Safe for concurrent use.
type tokenCache struct {
	c        *lru.Cache[tokenCacheKey, []uint32]
	maxBytes int64        // negative: no bound
	bytes    atomic.Int64 // of the token IDs held
	mu       sync.Mutex   // serialises add, so that a key is counted once
}

// newTokenCache returns a cache of size entries (size > 0) and maxBytes bytes of token IDs
// (negative: no bound).
func newTokenCache(size int, maxBytes int64) *tokenCache {
	tc := &tokenCache{maxBytes: maxBytes}
	tc.c, _ = lru.NewWithEvict(size, func(_ tokenCacheKey, tok []uint32) { tc.bytes.Add(-4 * int64(len(tok))) })
	return tc
}

// add keeps tok for key, in a slice of its own length (a decoded JSON array has up to twice the
// room), evicting the least recent results while the bytes are over the bound. A result larger
// than the bound is not kept. It returns the slice kept (tok when none).
func (tc *tokenCache) add(key tokenCacheKey, tok []uint32) []uint32 {
	n := 4 * int64(len(tok))
	if tc.maxBytes >= 0 && n > tc.maxBytes {
		return tok
	}
	if cap(tok) > len(tok) {
		tok = append(make([]uint32, 0, len(tok)), tok...)
	}
	tc.mu.Lock()
	defer tc.mu.Unlock()
	if tc.c.Contains(key) {
		return tok
	}
	tc.bytes.Add(n)
	tc.c.Add(key, tok)
	for tc.maxBytes >= 0 && tc.bytes.Load() > tc.maxBytes {
		if _, _, ok := tc.c.RemoveOldest(); !ok {
			break
		}
	}
	return tok
}

// DefaultBytesPerToken is EstimateTokenizer.BytesPerToken when left 0: about the bytes per token
// of English text under common BPE vocabularies.
const DefaultBytesPerToken = 4

// MaxBytesPerToken is the largest EstimateTokenizer.BytesPerToken; larger values are clamped.
const MaxBytesPerToken = 64

// EstimateTokenizer makes deterministic pseudo-tokens from a request's text, with no network, for
// approximate (routing-fed) KV-aware routing when no engine tokenizer is reachable: the index is
// then fed by the router's own decisions, so the tokens need only be consistent, not the engine's.
//
// It packs the UTF-8 bytes of the same content EngineTokenizer would send — for chat, each of the
// system prompt and the messages as the marker "<|" + role + "|>" followed by its Text; for
// completions, the first prompt — into one pseudo-token per BytesPerToken bytes: the bytes
// themselves, little-endian, when BytesPerToken ≤ 4, else the low 32 bits of their XXH3-64 hash.
// The last chunk may be shorter. Identical content prefixes therefore give identical pseudo-token
// prefixes, hence identical block keys. Each media item (Request.Media) is written into its
// message's text at its Offset as the byte 0xFF followed by le64(Hash) — 0xFF never occurs in UTF-8
// text — so that the pseudo-tokens, hence the block keys, of two requests part where their images
// differ.
//
// BytesPerToken ≤ 0 means DefaultBytesPerToken (4); values above MaxBytesPerToken (64) are
// clamped. An EstimateTokenizer is a plain value: safe for concurrent use.
type EstimateTokenizer struct {
	BytesPerToken int
}

// Tokenize returns r's tokens when it carries them (TokenIDs, else PromptTokens), else
// AppendTokens(nil, r) — nil when r has no prompt. The error is always nil; ctx is not used.
func (e EstimateTokenizer) Tokenize(_ context.Context, r *Request) ([]uint32, error) {
	if tok := knownTokens(r); tok != nil {
		return tok, nil
	}
	return e.AppendTokens(nil, r), nil
}

// AppendTokens appends r's pseudo-tokens to dst and returns the extended slice, ignoring any tokens
// r carries. It allocates only to grow dst (ceil(content bytes / BytesPerToken) tokens). Safe for
// concurrent use.
func (e EstimateTokenizer) AppendTokens(dst []uint32, r *Request) []uint32 {
	b := e.BytesPerToken
	switch {
	case b <= 0:
		b = DefaultBytesPerToken
	case b > MaxBytesPerToken:
		b = MaxBytesPerToken
	}
	p := pseudoPacker{dst: dst, size: b}
	switch modeOf(r) {
	case modeChat:
		if r.HasSystem {
			p.message("system", r.System)
		}
		media := r.Media
		for i := range r.Messages {
			text := r.Messages[i].Text
			for len(media) > 0 && media[0].Message < i { // out of order: not placed
				media = media[1:]
			}
			if len(media) == 0 || media[0].Message != i {
				p.message(r.Messages[i].Role, text)
				continue
			}
			p.message(r.Messages[i].Role, "")
			at := 0
			for ; len(media) > 0 && media[0].Message == i; media = media[1:] {
				off := min(max(media[0].Offset, at), len(text))
				p.write(text[at:off])
				p.media(media[0].Hash)
				at = off
			}
			p.write(text[at:])
		}
	case modePrompt:
		p.write(r.Prompt[0])
	}
	p.flush()
	return p.dst
}

// pseudoPacker cuts a byte stream into pseudo-tokens of size bytes.
type pseudoPacker struct {
	dst  []uint32
	size int
	n    int
	buf  [MaxBytesPerToken]byte
}

func (p *pseudoPacker) message(role, text string) {
	p.write("<|")
	p.write(role)
	p.write("|>")
	p.write(text)
}

// media writes the marker of a media item: 0xFF ‖ le64(hash).
func (p *pseudoPacker) media(hash uint64) {
	var b [9]byte
	b[0] = 0xff
	binary.LittleEndian.PutUint64(b[1:], hash)
	p.write(string(b[:]))
}

func (p *pseudoPacker) write(s string) {
	for len(s) > 0 {
		if p.n == 0 && len(s) >= p.size && p.size >= 4 { // whole chunks straight from s
			for len(s) >= p.size {
				var tok uint32
				if p.size == 4 {
					tok = uint32(s[0]) | uint32(s[1])<<8 | uint32(s[2])<<16 | uint32(s[3])<<24
				} else {
					tok = uint32(xxh3.HashString(s[:p.size]))
				}
				p.dst = append(p.dst, tok)
				s = s[p.size:]
			}
			continue
		}
		c := copy(p.buf[p.n:p.size], s)
		p.n += c
		s = s[c:]
		if p.n == p.size {
			p.emit()
		}
	}
}

func (p *pseudoPacker) flush() {
	if p.n > 0 {
		p.emit()
	}
}

func (p *pseudoPacker) emit() {
	chunk := p.buf[:p.n]
	var tok uint32
	if p.size <= 4 {
		for i := len(chunk) - 1; i >= 0; i-- {
			tok = tok<<8 | uint32(chunk[i])
		}
	} else {
		tok = uint32(xxh3.Hash(chunk))
	}
	p.dst = append(p.dst, tok)
	p.n = 0
}
