package events

import (
	"encoding/json"
	"errors"
	"fmt"
)

// maxPrefixHashLen caps prefix_hash: 128 hex digits is a 512-bit digest, larger than any key
// kvroute or an engine produces.
const maxPrefixHashLen = 128

var (
	errNotJSONObject  = errors.New("data is not a JSON object")
	errNoEventName    = errors.New("no event name (neither an SSE event: field nor a JSON \"event\")")
	errNoPrefixHash   = errors.New("missing prefix_hash")
	errBadPrefixHash  = errors.New("prefix_hash is not a hex string of 1 to 128 digits")
	errBadTokenCount  = errors.New("token_count is not an integer")
	errNegTokenCount  = errors.New("negative token_count")
	errBadEventString = errors.New("JSON \"event\" is not a string")
)

// DecodeSSEEvent decodes one SSE event of kvroute's form: eventField is the SSE "event:"
// line's value ("" when absent) and data the JSON of its "data:" line(s), e.g.
//
//	event: cache_created
//	data: {"event":"cache_created","prefix_hash":"9f2c…","token_count":2048}
//
// The event: field wins over the JSON "event" field; an event: field of "" or "message" (the
// SSE default type) defers to the JSON one. It fills ev as a KindPrefix event (PrefixOp,
// PrefixHash lowercased, TokenCount, every other field cleared; ev's slices keep their storage).
// Unknown JSON keys are ignored; a missing or null token_count is 0.
//
// Errors wrap ErrMalformed: data not a JSON object, unknown or missing event name, missing or
// invalid prefix_hash (it must be a string of 1 to 128 hex digits), token_count not an integer
// or negative. On error ev is left unchanged. It does not retain data; safe for concurrent use
// on distinct events.
func DecodeSSEEvent(eventField string, data []byte, ev *Event) error {
	var f sseFields
	if err := f.parse(data); err != nil {
		return fmt.Errorf("%w: sse event: %w", ErrMalformed, err)
	}
	var op PrefixOp
	var ok bool
	if eventField == "" || eventField == "message" {
		if !f.haveEvent {
			return fmt.Errorf("%w: sse event: %w", ErrMalformed, errNoEventName)
		}
		if op, ok = ParsePrefixOp(string(f.event)); !ok {
			return fmt.Errorf("%w: sse event: unknown event name %q", ErrMalformed, f.event)
		}
	} else if op, ok = ParsePrefixOp(eventField); !ok {
		return fmt.Errorf("%w: sse event: unknown event name %q", ErrMalformed, eventField)
	}
	if f.hash == nil {
		return fmt.Errorf("%w: sse event: %w", ErrMalformed, errNoPrefixHash)
	}
	hash, err := lowerHex(f.hash, ev.PrefixHash)
	if err != nil {
		return fmt.Errorf("%w: sse event: %w", ErrMalformed, err)
	}
	*ev = Event{
		Kind:        KindPrefix,
		BlockHashes: ev.BlockHashes[:0],
		TokenIDs:    ev.TokenIDs[:0],
		ExtraKeys:   ev.ExtraKeys[:0],
		PrefixOp:    op,
		PrefixHash:  hash,
		TokenCount:  f.tokenCount,
	}
	return nil
}

// lowerHex validates p as 1 to maxPrefixHashLen hex digits and returns it lowercased, reusing
// old when equal.
func lowerHex(p []byte, old string) (string, error) {
	if len(p) == 0 || len(p) > maxPrefixHashLen {
		return "", errBadPrefixHash
	}
	var buf [maxPrefixHashLen]byte
	for i, c := range p {
		switch {
		case c >= '0' && c <= '9', c >= 'a' && c <= 'f':
		case c >= 'A' && c <= 'F':
			c += 'a' - 'A'
		default:
			return "", errBadPrefixHash
		}
		buf[i] = c
	}
	return reuseString(old, buf[:len(p)]), nil
}

// sseFields are the keys DecodeSSEEvent reads from the JSON object. The byte slices alias data
// (or a decoded copy when the JSON string had escapes).
type sseFields struct {
	event      []byte
	haveEvent  bool
	hash       []byte // nil when absent or null
	tokenCount int
}

// parse reads a flat JSON object. json.Valid checks the syntax first, so the scanner below only
// walks well-formed JSON and needs no error paths of its own for structure.
func (f *sseFields) parse(data []byte) error {
	if !json.Valid(data) {
		return errNotJSONObject
	}
	s := jsonScanner{data: data}
	s.space()
	if s.i >= len(data) || data[s.i] != '{' {
		return errNotJSONObject
	}
	s.i++
	for {
		s.space()
		if data[s.i] == '}' {
			return nil
		}
		if data[s.i] == ',' {
			s.i++
			s.space()
		}
		key := s.str()
		s.space()
		s.i++ // ':'
		s.space()
		var err error
		switch string(key) {
		case "event":
			f.event, f.haveEvent, err = s.optStr(errBadEventString)
		case "prefix_hash":
			f.hash, _, err = s.optStr(errBadPrefixHash)
		case "token_count":
			f.tokenCount, err = s.optInt()
		default:
			s.skip()
		}
		if err != nil {
			return err
		}
	}
}

// jsonScanner walks JSON text already checked by json.Valid.
type jsonScanner struct {
	data []byte
	i    int
}

// space skips JSON whitespace.
func (s *jsonScanner) space() {
	for s.i < len(s.data) {
		switch s.data[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// skipStr consumes a string at the cursor and reports whether it holds escapes.
func (s *jsonScanner) skipStr() (escaped bool) {
	s.i++ // opening quote
	for s.data[s.i] != '"' {
		if s.data[s.i] == '\\' {
			escaped = true
			s.i++
		}
		s.i++
	}
	s.i++
	return escaped
}

// str consumes a string at the cursor and returns its contents, unescaped (only a string with
// escapes is copied).
func (s *jsonScanner) str() []byte {
	start := s.i
	if !s.skipStr() {
		return s.data[start+1 : s.i-1]
	}
	var v string
	if json.Unmarshal(s.data[start:s.i], &v) != nil {
		return nil // unreachable for valid JSON
	}
	return []byte(v)
}

// optStr consumes a string (ok true) or null (ok false); any other value is errWrong.
func (s *jsonScanner) optStr(errWrong error) (p []byte, ok bool, err error) {
	switch s.data[s.i] {
	case '"':
		return s.str(), true, nil
	case 'n':
		s.skip()
		return nil, false, nil
	}
	return nil, false, errWrong
}

// optInt consumes an integer or null (0). A fraction, an exponent or a value beyond int64 is
// errBadTokenCount; a negative value errNegTokenCount.
func (s *jsonScanner) optInt() (int, error) {
	c := s.data[s.i]
	if c == 'n' {
		s.skip()
		return 0, nil
	}
	if c != '-' && (c < '0' || c > '9') {
		return 0, errBadTokenCount
	}
	start := s.i
	s.skip()
	num := s.data[start:s.i]
	neg := num[0] == '-'
	if neg {
		num = num[1:]
	}
	var v int64
	for _, d := range num {
		if d < '0' || d > '9' {
			return 0, errBadTokenCount
		}
		if v > (1<<63-1-int64(d-'0'))/10 {
			return 0, errBadTokenCount
		}
		v = v*10 + int64(d-'0')
	}
	if neg && v != 0 {
		return 0, errNegTokenCount
	}
	if int64(int(v)) != v {
		return 0, errBadTokenCount
	}
	return int(v), nil
}

// skip consumes one value of any type.
func (s *jsonScanner) skip() {
	switch s.data[s.i] {
	case '"':
		s.skipStr()
	case '{', '[':
		depth := 0
		for {
			switch s.data[s.i] {
			case '"':
				s.skipStr()
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
			}
			s.i++
			if depth == 0 {
				return
			}
		}
	default: // number, true, false, null
		for s.i < len(s.data) {
			switch s.data[s.i] {
			case ',', '}', ']', ' ', '\t', '\n', '\r':
				return
			}
			s.i++
		}
	}
}
