package kvhttp

import (
	"bytes"
	"net/http"
	"sync/atomic"
)

// writer is the ResponseWriter of one attempt: it notes whether the response started, tells the
// Lease when the first byte of a 2xx answer goes out, reads the answer's cached tokens and a
// stream's terminal event as they pass, and keeps the client's write error. It supports Flush
// and http.ResponseController through Unwrap.
type writer struct {
	http.ResponseWriter
	a           *attempt
	wroteHeader bool
	status      int // the status written, 0 before WriteHeader (an implicit 200)
	firstByte   bool
	writeErr    error
	scan        AnswerScanner // the 2xx answer's bytes: cached tokens, a stream's terminal event
	ended       atomic.Bool   // a stream's terminal event was written
}

// tailLen is how many of a write's last bytes are kept to find a terminal event or a cached-token
// count that the next write completes: more than the longest of them
// (`"cache_read_input_tokens": ` and nine digits, with a few spaces).
const tailLen = 48

// Terminal events of the OpenAI and Anthropic streams.
var (
	openAIDone     = []byte("data: [DONE]")
	anthropicFinal = []byte("event: message_stop")
)

// WriteHeader implements http.ResponseWriter.
func (w *writer) WriteHeader(code int) {
	if code >= 200 && !w.wroteHeader {
		w.wroteHeader, w.status = true, code
	}
	w.ResponseWriter.WriteHeader(code)
}

// Write implements http.ResponseWriter.
func (w *writer) Write(p []byte) (int, error) {
	w.wroteHeader = true
	ok := w.status < 300 // 0: an implicit 200
	if !w.firstByte && len(p) > 0 {
		w.firstByte = true
		// Only a success's first byte is a first token: an engine's error comes at once and
		// would teach tier 4 a prefill rate far above the engine's.
		if ok {
			w.a.lease.FirstToken()
		}
	}
	n, err := w.ResponseWriter.Write(p)
	if err != nil && w.writeErr == nil {
		w.writeErr = err
	}
	if ok && n > 0 {
		w.note(p[:n])
	}
	return n, err
}

// note reads p, the next bytes of a 2xx answer: its cached tokens and, for a stream, its
// terminal event.
func (w *writer) note(p []byte) {
	w.scan.write(p, w.a.stream)
	if w.a.stream && w.scan.Terminal() {
		w.ended.Store(true)
	}
}

// AnswerScanner reads an LLM answer's body as it passes, a write at a time, without holding it:
// the cached-token count of its usage (OpenAI's and vLLM's prompt_tokens_details.cached_tokens,
// Anthropic's cache_read_input_tokens), and whether a stream's terminal event (OpenAI's
// "data: [DONE]", Anthropic's "event: message_stop") went by. A key or event split across two
// writes is found. It keeps a few dozen bytes, whatever the answer's length. The zero value is
// ready; an AnswerScanner is not safe for concurrent use. The Handler scans every 2xx answer
// with one; a gateway that relays answers itself (an Envoy external processor, a Caddy module)
// feeds it the body it sees and reports Result-like outcomes from it.
type AnswerScanner struct {
	cached   int           // the last cached-token count seen, plus one: 0 means none yet
	tail     [tailLen]byte // the last bytes written (ntail of them), for matches across writes
	ntail    int
	terminal bool
}

// Write reads p, the answer's next bytes. It never fails.
func (s *AnswerScanner) Write(p []byte) (int, error) {
	s.write(p, true)
	return len(p), nil
}

// write reads p, looking for the terminal event only with events: a plain answer has none, and
// its bytes are then searched once, for the cached tokens.
func (s *AnswerScanner) write(p []byte, events bool) {
	var buf [2 * tailLen]byte
	seam := append(append(buf[:0], s.tail[:s.ntail]...), p[:min(len(p), tailLen)]...)
	if events && !s.terminal && (terminal(p) || terminal(seam)) {
		s.terminal = true
	}
	if c := lastCachedTokens(seam); c >= 0 {
		s.cached = c + 1
	}
	if c := lastCachedTokens(p); c >= 0 {
		s.cached = c + 1
	}
	if len(p) >= tailLen {
		s.ntail = copy(s.tail[:], p[len(p)-tailLen:])
		return
	}
	keep := min(s.ntail, tailLen-len(p))
	copy(s.tail[:], s.tail[s.ntail-keep:s.ntail])
	s.ntail = keep + copy(s.tail[keep:], p)
}

// CachedTokens returns the last cached-token count read, or -1 when none was.
func (s *AnswerScanner) CachedTokens() int { return s.cached - 1 }

// Terminal reports whether a stream's terminal event was read.
func (s *AnswerScanner) Terminal() bool { return s.terminal }

// terminal reports whether b holds a terminal event.
func terminal(b []byte) bool {
	return bytes.Contains(b, openAIDone) || bytes.Contains(b, anthropicFinal)
}

// Keys of the usage's cached tokens: OpenAI's and vLLM's prompt_tokens_details.cached_tokens,
// Anthropic's cache_read_input_tokens. Both begin with `"cache`.
var (
	cacheKey       = []byte(`"cache`)
	openAICached   = []byte(`d_tokens"`)
	anthropicCache = []byte(`_read_input_tokens"`)
)

// lastCachedTokens returns the value of the last cached-token key in b ("cached_tokens" or
// "cache_read_input_tokens" followed by a colon and a number), or -1 when b holds none. The
// quote before a key cannot be inside a JSON string, where it would be escaped: a prompt that
// mentions the key does not match.
func lastCachedTokens(b []byte) int {
	n := -1
	for {
		i := bytes.Index(b, cacheKey)
		if i < 0 {
			return n
		}
		b = b[i+len(cacheKey):]
		rest := b
		switch {
		case bytes.HasPrefix(rest, openAICached):
			rest = rest[len(openAICached):]
		case bytes.HasPrefix(rest, anthropicCache):
			rest = rest[len(anthropicCache):]
		default:
			continue
		}
		rest = skipSpace(rest)
		if len(rest) == 0 || rest[0] != ':' {
			continue
		}
		rest = skipSpace(rest[1:])
		v, k := 0, 0
		for ; k < len(rest) && rest[k] >= '0' && rest[k] <= '9'; k++ {
			v = v*10 + int(rest[k]-'0')
		}
		if k > 0 && k <= 9 { // more digits: no count of tokens
			n = v
		}
	}
}

// skipSpace returns b without its leading JSON whitespace.
func skipSpace(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t' || b[0] == '\n' || b[0] == '\r') {
		b = b[1:]
	}
	return b
}

// Flush implements http.Flusher.
func (w *writer) Flush() { _ = http.NewResponseController(w.ResponseWriter).Flush() }

// FlushError flushes, reporting the error (http.ResponseController uses it).
func (w *writer) FlushError() error {
	return http.NewResponseController(w.ResponseWriter).Flush()
}

// Unwrap returns the wrapped ResponseWriter.
func (w *writer) Unwrap() http.ResponseWriter { return w.ResponseWriter }
