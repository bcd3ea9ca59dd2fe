package prefixkey

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"math/bits"
	"slices"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
	"unsafe"
)

// This file holds Parse and the JSON reader shared by the three parsers.
//
// The reader is a small pull parser over the body: it validates as it goes (RFC 8259 grammar,
// the same nesting limit as encoding/json), decodes strings the way encoding/json does (invalid
// UTF-8 and lone surrogates become U+FFFD), never panics and does linear work: every byte is
// scanned a small constant number of times, and JSON-valued fields are canonicalised through a
// flat tape so that sorting object keys never re-scans a subtree. Decoded text is collected into
// per-request arenas (message text, system prompt, part data, Message.Extra), which become the
// Request's strings without a copy, so a parse costs a couple of dozen allocations whatever its
// number of messages, and about the body's size in bytes (BenchmarkParseBodySize).
//
// Strings that reach the Request must be valid UTF-8 without unpaired surrogate escapes: the
// lossy decoding of encoding/json (U+FFFD) would give different bodies the same keys.

// ErrUnknownFormat is returned by Parse for a Format it does not know. It is a programmer error,
// not a property of the body, so it does not wrap ErrMalformed.
var ErrUnknownFormat = errors.New("prefixkey: unknown request format")

// Parse parses body as a request of format f, dispatching to ParseOpenAIChat,
// ParseOpenAICompletion or ParseAnthropicMessages. It is safe for concurrent use; body is only
// read, but the returned Request may share its bytes: body must not be modified while the
// Request is in use (copy it first to reuse its buffer).
//
// A body is not valid when a string that reaches the Request is not valid UTF-8 (or holds an
// unpaired surrogate escape), or when temperature (OpenAI [0, 2], Anthropic [0, 1]), top_p
// ([0, 1]), max_tokens, max_completion_tokens or n (at least 1) is out of range.
//
// It returns a non-nil Request and a nil error, or a nil Request and an error: a *FieldError
// wrapping ErrMalformed when the body is not a valid request of the format, or an error wrapping
// ErrUnknownFormat when f is not one of the Format constants.
//
// A message's text (and its text part's), the system prompt or a completions prompt that is one
// JSON string of at least 64 bytes written without escapes is not copied: the Request's string
// refers to body, so that a large prompt is held once, not twice. The other message, part and
// prompt text of a parsed Request share one allocation of at most the size of body (the decoded
// text: its size when most text is copied), its system prompt another and its Part.Data values a
// third, and its Message.Extra values share a fourth (each slice capped at its length, so
// appending to one copies it): keeping any of them alive keeps that allocation, or body, alive.
// Bodies longer than 1 GiB are refused.
func Parse(f Format, body []byte) (*Request, error) {
	switch f {
	case FormatOpenAIChat:
		return ParseOpenAIChat(body)
	case FormatOpenAICompletion:
		return ParseOpenAICompletion(body)
	case FormatAnthropicMessages:
		return ParseAnthropicMessages(body)
	default:
		return nil, &unknownFormatError{f}
	}
}

type unknownFormatError struct{ f Format }

func (e *unknownFormatError) Error() string { return ErrUnknownFormat.Error() + ": " + e.f.String() }
func (e *unknownFormatError) Unwrap() error { return ErrUnknownFormat }

// maxJSONDepth is the deepest nesting of arrays and objects accepted, as in encoding/json.
const maxJSONDepth = 10000

// jstr is a scanned JSON string: its content buf[lo:hi] without the quotes. plain means the raw
// bytes are the decoded value (no escapes, valid UTF-8).
type jstr struct {
	lo, hi int
	plain  bool
}

// keyRef locates a decoded object key: d.buf[lo:hi] when the key is plain, else d.keys[lo:hi].
// Offsets rather than slices keep the decoder's scratch slices pointer-free (cheap to allocate).
type keyRef struct {
	lo, hi  int
	decoded bool
}

// member is one member of an object read with recordMembers.
type member struct {
	key  keyRef
	val  int  // offset of the value in the body
	kind byte // first byte of the value: '"', '{', '[', 'n' (null), 't', 'f', '-' or a digit
	s    jstr // the string value, when kind == '"'
}

// tapeEnt is one token of a value being canonicalised.
type tapeEnt struct {
	kind  byte  // '{', '[', '"', or 'v' (number or literal)
	plain bool  // strings: the raw content is canonical
	lo    int32 // strings: content span; others: literal span
	hi    int32
	end   int32 // containers: index of the first entry after the subtree
}

// sortEnt is an object member being sorted by key during canonicalisation.
type sortEnt struct {
	key keyRef
	ref int // tape index of the key (tape objects) or body offset of the value (members)
}

// partRef is a Part whose strings are offsets into the decoder's arenas.
type partRef struct {
	typ        partKind
	view       bool  // the text is d.buf[tlo:thi], not in d.text
	tylo, tyhi int32 // the type name in d.data, when typ == kindOther
	tlo, thi   int32 // in d.text (or d.buf: view)
	dlo, dhi   int32 // in d.data
}

// msgRef is a Message whose strings are offsets into the decoder's arenas.
type msgRef struct {
	role     msgRole
	view     bool  // the text is d.buf[tlo:thi], not in d.text
	tlo, thi int32 // in d.text (or d.buf: view)
	plo, phi int32 // in d.parts
	xlo, xhi int32 // in d.raw
}

// addMsg appends a message whose text is d.text[tlo:], parts d.parts[plo:] and extra d.raw[xlo:xhi].
// When that text is a string of the body as written (no escapes: noteText), the message and its
// text part refer to the body instead, and d.text gives the bytes back.
func (d *decoder) addMsg(role string, tlo, plo, xlo, xhi int) {
	m := msgRef{role: roleOf(role), tlo: int32(tlo), thi: int32(len(d.text)),
		plo: int32(plo), phi: int32(len(d.parts)), xlo: int32(xlo), xhi: int32(xhi)}
	if lo, hi, ok := d.textView(tlo); ok {
		m.view, m.tlo, m.thi = true, int32(lo), int32(hi)
		for i := range d.parts[plo:] {
			p := &d.parts[plo+i]
			if int(p.tlo) == tlo && int(p.thi) == len(d.text) {
				p.view, p.tlo, p.thi = true, int32(lo), int32(hi)
			} else { // empty (the message's text is this one string): keep it in range
				p.tlo, p.thi = int32(tlo), int32(tlo)
			}
		}
		d.text = d.text[:tlo]
	}
	d.textEnd = len(d.text)
	d.msgs = append(grow(d.msgs), m)
}

// viewMin is the shortest text kept as a view into the body rather than copied: a view keeps
// the whole body alive, which a short copy need not.
const viewMin = 64

// noteText records that d.text[at:] was just appended from the string s of the body.
func (d *decoder) noteText(s jstr, at int) {
	if s.plain && s.hi-s.lo >= viewMin {
		d.src, d.srcAt = s, at
	}
}

// textView reports whether d.text[tlo:] is exactly the last string noteText recorded, written in
// the body without escapes, and returns its span in the body.
func (d *decoder) textView(tlo int) (lo, hi int, ok bool) {
	s := d.src
	if d.srcAt != tlo || s.hi-s.lo != len(d.text)-tlo || s.hi <= s.lo || !bytes.Equal(d.text[tlo:], d.buf[s.lo:s.hi]) {
		return 0, 0, false
	}
	return s.lo, s.hi, true
}

// grow makes room for one more element in s, doubling its capacity when it is full: the
// arrays a parse grows cost at most about twice their final size in all, where append's
// growth by 1.25 for large slices would cost five times.
func grow[S ~[]E, E any](s S) S {
	if len(s) < cap(s) {
		return s
	}
	return slices.Grow(s, max(16, len(s)))
}

// decoder is the per-call parsing state. It is never shared.
type decoder struct {
	buf []byte
	pos int

	text []byte // arena: message, part and prompt text
	sys  []byte // arena: the system prompt

	// Views: a text that is one string of the body without escapes refers to the body rather
	// than to a copy. src is the last plain string appended to d.text, at d.text[srcAt:];
	// textEnd is where the last message added ends in d.text; sysView, when hi > lo, is the
	// system prompt's span in the body (d.sys then unused).
	src     jstr
	srcAt   int
	textEnd int
	sysView jstr
	data    []byte // arena: Part.Data
	raw     []byte // arena: Message.Extra

	parts   []partRef
	msgs    []msgRef
	prompts []jstr // completions: spans in d.text, or in d.buf when plain
	members []member
	tape    []tapeEnt
	sorted  []sortEnt
	keyBuf  []byte // strBytes' decoded string
	keys    []byte // decoded escaped keys of members and sort entries

	lax     bool // skipping: strings need not be valid UTF-8
	countCC bool // count non-null "cache_control" members while skipping
	ccCount int

	other []otherField // unmodelled top-level members, for Params.Other

	media []mediaRef // Request.Media
}

// ---- errors ----

func fieldErr(field, reason string) *FieldError { return &FieldError{Field: field, Reason: reason} }

// at prefixes the field path of err (a *FieldError) with prefix: a key or an "[i]" index.
func atField(err error, prefix string) error {
	fe, ok := err.(*FieldError)
	if !ok {
		return err
	}
	switch {
	case fe.Field == "":
		fe.Field = prefix
	case fe.Field[0] == '[':
		fe.Field = prefix + fe.Field
	default:
		fe.Field = prefix + "." + fe.Field
	}
	return fe
}

func atIndex(err error, i int) error { return atField(err, "["+strconv.Itoa(i)+"]") }

func (d *decoder) syntaxErr(what string) error {
	return &FieldError{Reason: "invalid JSON: " + what + " at offset " + strconv.Itoa(d.pos)}
}

// unexpected reports the byte at d.pos (or the end of input) as a syntax error.
func (d *decoder) unexpected(want string) error {
	if d.pos >= len(d.buf) {
		return d.syntaxErr("unexpected end of input, want " + want)
	}
	c := d.buf[d.pos]
	var got string
	if c >= 0x20 && c < 0x7f {
		got = strconv.QuoteRune(rune(c))
	} else {
		got = "byte 0x" + strconv.FormatUint(uint64(c), 16)
	}
	return d.syntaxErr("unexpected " + got + ", want " + want)
}

// ---- lexing ----

func (d *decoder) ws() {
	for d.pos < len(d.buf) {
		switch d.buf[d.pos] {
		case ' ', '\t', '\n', '\r':
			d.pos++
		default:
			return
		}
	}
}

// peek skips whitespace and returns the next byte, or 0 at the end of input.
func (d *decoder) peek() byte {
	d.ws()
	if d.pos < len(d.buf) {
		return d.buf[d.pos]
	}
	return 0
}

// end checks that only whitespace follows the top-level value.
func (d *decoder) end() error {
	d.ws()
	if d.pos != len(d.buf) {
		return d.unexpected("end of input after the top-level value")
	}
	return nil
}

const (
	swarLSB = 0x0101010101010101
	swarMSB = 0x8080808080808080
)

// special returns a non-zero value when a byte of w is a control character, '"' or '\\'.
// Bytes >= 0x80 are not flagged; the boolean result is exact.
func swarSpecial(w uint64) uint64 {
	q := w ^ (swarLSB * '"')
	b := w ^ (swarLSB * '\\')
	return ((w-swarLSB*0x20) & ^w | (q-swarLSB) & ^q | (b-swarLSB) & ^b) & swarMSB
}

// scanString scans the string starting at d.pos (a '"') and leaves d.pos after it.
func (d *decoder) scanString() (jstr, error) {
	buf := d.buf
	lo := d.pos + 1
	i := lo
	var high uint64
	esc := false
	for {
		// Skip to the next '"', '\\' or control character, eight bytes at a time. The lowest
		// flagged byte of a word is always a real match. high collects the bytes seen (perhaps a
		// few past the match, which only costs a needless UTF-8 check).
		for i+8 <= len(buf) {
			w := binary.LittleEndian.Uint64(buf[i:])
			high |= w
			if m := swarSpecial(w); m != 0 {
				i += bits.TrailingZeros64(m) >> 3
				break
			}
			i += 8
		}
		for i < len(buf) && i+8 > len(buf) {
			if c := buf[i]; c < 0x20 || c == '"' || c == '\\' {
				break
			} else if c >= 0x80 {
				high |= swarMSB
			}
			i++
		}
		if i >= len(buf) {
			d.pos = i
			return jstr{}, d.syntaxErr("unexpected end of input in string")
		}
		c := buf[i]
		switch {
		case c == '"':
			s := jstr{lo: lo, hi: i, plain: !esc}
			if high&swarMSB != 0 && !utf8.Valid(buf[lo:i]) {
				if !d.lax {
					d.pos = lo
					return jstr{}, errBadUTF8()
				}
				s.plain = false
			}
			d.pos = i + 1
			return s, nil
		case c == '\\':
			esc = true
			if i+1 >= len(buf) {
				d.pos = len(buf)
				return jstr{}, d.syntaxErr("unexpected end of input in string")
			}
			switch buf[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				for k := i + 2; k < i+6; k++ {
					if k >= len(buf) {
						d.pos = k
						return jstr{}, d.syntaxErr("unexpected end of input in string")
					}
					if !isHex(buf[k]) {
						d.pos = k
						return jstr{}, d.syntaxErr("invalid \\u escape in string")
					}
				}
				if r := hex4(buf[i+2:]); utf16.IsSurrogate(r) && !d.lax {
					// Only a high surrogate followed by a low one is a character: an unpaired
					// one would decode to U+FFFD like any other, so two different bodies
					// would read the same.
					if r >= 0xdc00 || i+12 > len(buf) || buf[i+6] != '\\' || buf[i+7] != 'u' ||
						!isHex(buf[i+8]) || !isHex(buf[i+9]) || !isHex(buf[i+10]) || !isHex(buf[i+11]) ||
						!isLowSurrogate(hex4(buf[i+8:])) {
						d.pos = lo
						return jstr{}, fieldErr("", "must be valid Unicode: unpaired UTF-16 surrogate escape \\u"+string(buf[i+2:i+6]))
					}
					i += 6
				}
				i += 6
			default:
				d.pos = i + 1
				return jstr{}, d.syntaxErr("invalid escape in string")
			}
		default: // c < 0x20
			d.pos = i
			return jstr{}, d.syntaxErr("control character in string")
		}
	}
}

func isLowSurrogate(r rune) bool { return 0xdc00 <= r && r <= 0xdfff }

// errBadUTF8 is scanString's error for a string that is not valid UTF-8. Such a string is
// rejected rather than decoded with U+FFFD for the bad bytes, as encoding/json does: that would
// give two bodies that differ only in their invalid bytes the same prefix and cache keys while
// their bodies, forwarded unchanged, ask different things.
func errBadUTF8() *FieldError { return fieldErr("", "must be valid UTF-8") }

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

func hex4(b []byte) rune {
	var r rune
	for _, c := range b[:4] {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c = c - 'a' + 10
		default:
			c = c - 'A' + 10
		}
		r = r<<4 | rune(c)
	}
	return r
}

// appendUnescaped appends the decoded value of a scanned string's content (escapes known to be
// well formed), replacing invalid UTF-8 and unpaired surrogates with U+FFFD as encoding/json does.
// With canon, it appends the canonical JSON encoding of that value instead (without the quotes):
// only '"', '\\' and control characters escaped, with the short escapes where JSON has them.
func appendUnescaped(dst, src []byte, canon bool) []byte {
	for i := 0; i < len(src); {
		// Copy the run of plain ASCII up to the next escape or non-ASCII byte in one go.
		j := i
		for j+8 <= len(src) {
			w := binary.LittleEndian.Uint64(src[j:])
			bs := w ^ (swarLSB * '\\')
			if m := ((bs-swarLSB)&^bs | w) & swarMSB; m != 0 {
				j += bits.TrailingZeros64(m) >> 3
				break
			}
			j += 8
		}
		for j < len(src) && src[j] != '\\' && src[j] < utf8.RuneSelf {
			j++
		}
		dst = append(dst, src[i:j]...)
		if i = j; i >= len(src) {
			break
		}
		c := src[i]
		switch {
		case c == '\\':
			e := src[i+1]
			i += 2
			switch e {
			case 'b', 'f', 'n', 'r', 't':
				if canon {
					dst = append(dst, '\\', e)
				} else {
					dst = append(dst, unescapeShort(e))
				}
			case 'u':
				r := hex4(src[i:])
				i += 4
				if utf16.IsSurrogate(r) {
					r2 := rune(-1)
					if i+6 <= len(src) && src[i] == '\\' && src[i+1] == 'u' {
						r2 = hex4(src[i+2:])
					}
					if dec := utf16.DecodeRune(r, r2); dec != utf8.RuneError {
						i += 6
						r = dec
					} else {
						r = utf8.RuneError
					}
				}
				if canon && r < utf8.RuneSelf {
					dst = appendCanonicalASCII(dst, byte(r))
				} else {
					dst = utf8.AppendRune(dst, r)
				}
			default: // '"', '\\', '/'
				if canon && e != '/' {
					dst = append(dst, '\\', e)
				} else {
					dst = append(dst, e)
				}
			}
		case c < utf8.RuneSelf:
			// A raw ASCII byte of a JSON string needs no escaping.
			dst = append(dst, c)
			i++
		default:
			r, size := utf8.DecodeRune(src[i:])
			if r == utf8.RuneError && size == 1 {
				dst = utf8.AppendRune(dst, utf8.RuneError)
			} else {
				dst = append(dst, src[i:i+size]...)
			}
			i += size
		}
	}
	return dst
}

func unescapeShort(e byte) byte {
	switch e {
	case 'b':
		return '\b'
	case 'f':
		return '\f'
	case 'n':
		return '\n'
	case 'r':
		return '\r'
	default:
		return '\t'
	}
}

// appendCanonicalASCII appends the canonical JSON encoding of the ASCII character c.
func appendCanonicalASCII(dst []byte, c byte) []byte {
	switch c {
	case '"', '\\':
		return append(dst, '\\', c)
	case '\b':
		return append(dst, '\\', 'b')
	case '\f':
		return append(dst, '\\', 'f')
	case '\n':
		return append(dst, '\\', 'n')
	case '\r':
		return append(dst, '\\', 'r')
	case '\t':
		return append(dst, '\\', 't')
	}
	if c < 0x20 {
		const hex = "0123456789abcdef"
		return append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
	}
	return append(dst, c)
}

// appendStr appends the decoded value of s.
func (d *decoder) appendStr(dst []byte, s jstr) []byte {
	if s.plain {
		return append(dst, d.buf[s.lo:s.hi]...)
	}
	return appendUnescaped(dst, d.buf[s.lo:s.hi], false)
}

// strBytes returns the decoded value of s, valid until the next call.
func (d *decoder) strBytes(s jstr) []byte {
	if s.plain {
		return d.buf[s.lo:s.hi]
	}
	d.keyBuf = appendUnescaped(d.keyBuf[:0], d.buf[s.lo:s.hi], false)
	return d.keyBuf
}

// appendQuoted appends the canonical JSON encoding of the decoded string v.
func appendQuoted(dst, v []byte) []byte {
	dst = append(dst, '"')
	start := 0
	for i, c := range v {
		if c >= 0x20 && c != '"' && c != '\\' {
			continue
		}
		dst = append(dst, v[start:i]...)
		dst = appendCanonicalASCII(dst, c)
		start = i + 1
	}
	dst = append(dst, v[start:]...)
	return append(dst, '"')
}

// appendCanonicalStr appends s in canonical form.
func (d *decoder) appendCanonicalStr(dst []byte, s jstr) []byte {
	if s.plain {
		dst = append(dst, '"')
		dst = append(dst, d.buf[s.lo:s.hi]...)
		return append(dst, '"')
	}
	dst = append(dst, '"')
	dst = appendUnescaped(dst, d.buf[s.lo:s.hi], true)
	return append(dst, '"')
}

// scanNumber scans the number at d.pos and returns its span.
func (d *decoder) scanNumber() (lo, hi int, err error) {
	buf := d.buf
	lo = d.pos
	i := lo
	if i < len(buf) && buf[i] == '-' {
		i++
	}
	digits := func() bool {
		start := i
		for i < len(buf) && '0' <= buf[i] && buf[i] <= '9' {
			i++
		}
		return i > start
	}
	switch {
	case i < len(buf) && buf[i] == '0':
		i++
	case i < len(buf) && '1' <= buf[i] && buf[i] <= '9':
		digits()
	default:
		d.pos = i
		return 0, 0, d.unexpected("a digit")
	}
	if i < len(buf) && buf[i] == '.' {
		i++
		if !digits() {
			d.pos = i
			return 0, 0, d.unexpected("a digit")
		}
	}
	if i < len(buf) && (buf[i] == 'e' || buf[i] == 'E') {
		i++
		if i < len(buf) && (buf[i] == '+' || buf[i] == '-') {
			i++
		}
		if !digits() {
			d.pos = i
			return 0, 0, d.unexpected("a digit")
		}
	}
	d.pos = i
	return lo, i, nil
}

// scanLiteral scans true, false or null at d.pos.
func (d *decoder) scanLiteral() error {
	var lit string
	switch d.buf[d.pos] {
	case 't':
		lit = "true"
	case 'f':
		lit = "false"
	default:
		lit = "null"
	}
	if !bytes.HasPrefix(d.buf[d.pos:], []byte(lit)) {
		return d.syntaxErr("invalid literal")
	}
	d.pos += len(lit)
	return nil
}

// next advances to the next member of the object whose '{' has been consumed. It returns the
// member's key with d.pos at its value, or more == false once the closing brace is consumed.
func (d *decoder) next(first *bool) (key jstr, more bool, err error) {
	c := d.peek()
	if *first {
		*first = false
		if c == '}' {
			d.pos++
			return jstr{}, false, nil
		}
	} else {
		if c == '}' {
			d.pos++
			return jstr{}, false, nil
		}
		if c != ',' {
			return jstr{}, false, d.unexpected("',' or '}'")
		}
		d.pos++
		c = d.peek()
	}
	if c != '"' {
		return jstr{}, false, d.unexpected("an object key")
	}
	if key, err = d.scanString(); err != nil {
		return jstr{}, false, err
	}
	if d.peek() != ':' {
		return jstr{}, false, d.unexpected("':'")
	}
	d.pos++
	d.ws()
	return key, true, nil
}

// nextElem advances to the next element of the array whose '[' has been consumed. more is false
// once the closing bracket is consumed.
func (d *decoder) nextElem(first *bool) (more bool, err error) {
	c := d.peek()
	if c == ']' {
		d.pos++
		return false, nil
	}
	if *first {
		*first = false
		return true, nil
	}
	if c != ',' {
		return false, d.unexpected("',' or ']'")
	}
	d.pos++
	d.ws()
	if d.pos < len(d.buf) && d.buf[d.pos] == ']' {
		return false, d.unexpected("a value")
	}
	return true, nil
}

// skipValue validates and skips the value at d.pos. depth is the number of enclosing containers.
// What it skips reaches no key, so its strings need not be valid UTF-8 (encoding/json's rule);
// whatever is read later (a member canonicalised from its offset) is checked then.
func (d *decoder) skipValue(depth int) error {
	if d.lax {
		return d.skipAny(depth)
	}
	d.lax = true
	err := d.skipAny(depth)
	d.lax = false
	return err
}

func (d *decoder) skipAny(depth int) error {
	switch c := d.peek(); {
	case c == '"':
		_, err := d.scanString()
		return err
	case c == '{':
		if depth >= maxJSONDepth {
			return d.syntaxErr("nesting too deep")
		}
		d.pos++
		first := true
		for {
			k, more, err := d.next(&first)
			if err != nil || !more {
				return err
			}
			if d.countCC && d.pos < len(d.buf) && d.buf[d.pos] != 'n' && string(d.strBytes(k)) == "cache_control" {
				d.ccCount++
			}
			if err := d.skipAny(depth + 1); err != nil {
				return err
			}
		}
	case c == '[':
		if depth >= maxJSONDepth {
			return d.syntaxErr("nesting too deep")
		}
		d.pos++
		first := true
		for {
			more, err := d.nextElem(&first)
			if err != nil || !more {
				return err
			}
			if err := d.skipAny(depth + 1); err != nil {
				return err
			}
		}
	case c == 't' || c == 'f' || c == 'n':
		return d.scanLiteral()
	case c == '-' || '0' <= c && c <= '9':
		_, _, err := d.scanNumber()
		return err
	default:
		return d.unexpected("a value")
	}
}

// ---- canonical JSON ----

// appendCanonical validates the value at d.pos, advances past it and appends its canonical form:
// no insignificant whitespace, object keys sorted bytewise by their decoded value with duplicate
// keys reduced to the last one (as a decoder into a map would), strings re-encoded with minimal
// escaping, numbers and literals as sent.
func (d *decoder) appendCanonical(dst []byte, depth int) ([]byte, error) {
	if d.tape == nil {
		d.tape = make([]tapeEnt, 0, 16)
	}
	t0, start := len(d.tape), d.pos
	if err := d.tapeValue(depth); err != nil {
		d.tape = d.tape[:t0]
		return dst, err
	}
	// The canonical form is rarely longer than the value as sent: make room once, doubling the
	// arena when it is full so that its growth costs about its final size.
	if need := d.pos - start; cap(dst)-len(dst) < need {
		dst = slices.Grow(dst, max(need, len(dst)))
	}
	dst, _ = d.emit(dst, t0)
	d.tape = d.tape[:t0]
	return dst, nil
}

// canonicalAt is appendCanonical for the value at body offset pos; d.pos is left unchanged.
func (d *decoder) canonicalAt(dst []byte, pos, depth int) ([]byte, error) {
	saved := d.pos
	d.pos = pos
	dst, err := d.appendCanonical(dst, depth)
	d.pos = saved
	return dst, err
}

func (d *decoder) tapeValue(depth int) error {
	switch c := d.peek(); {
	case c == '"':
		s, err := d.scanString()
		if err != nil {
			return err
		}
		d.tape = append(grow(d.tape), tapeEnt{kind: '"', plain: s.plain, lo: int32(s.lo), hi: int32(s.hi)})
		return nil
	case c == '{' || c == '[':
		if depth >= maxJSONDepth {
			return d.syntaxErr("nesting too deep")
		}
		idx := len(d.tape)
		d.tape = append(grow(d.tape), tapeEnt{kind: c})
		d.pos++
		first := true
		for {
			var more bool
			var err error
			if c == '{' {
				var k jstr
				k, more, err = d.next(&first)
				if err == nil && more {
					d.tape = append(grow(d.tape), tapeEnt{kind: '"', plain: k.plain, lo: int32(k.lo), hi: int32(k.hi)})
				}
			} else {
				more, err = d.nextElem(&first)
			}
			if err != nil {
				return err
			}
			if !more {
				d.tape[idx].end = int32(len(d.tape))
				return nil
			}
			if err := d.tapeValue(depth + 1); err != nil {
				return err
			}
		}
	case c == 't' || c == 'f' || c == 'n':
		lo := d.pos
		if err := d.scanLiteral(); err != nil {
			return err
		}
		d.tape = append(grow(d.tape), tapeEnt{kind: 'v', lo: int32(lo), hi: int32(d.pos)})
		return nil
	case c == '-' || '0' <= c && c <= '9':
		lo, hi, err := d.scanNumber()
		if err != nil {
			return err
		}
		d.tape = append(grow(d.tape), tapeEnt{kind: 'v', lo: int32(lo), hi: int32(hi)})
		return nil
	default:
		return d.unexpected("a value")
	}
}

// after returns the tape index following the value at tape index j.
func (d *decoder) after(j int) int {
	if e := d.tape[j]; e.kind == '{' || e.kind == '[' {
		return int(e.end)
	}
	return j + 1
}

func (d *decoder) tapeStr(j int) jstr {
	e := d.tape[j]
	return jstr{lo: int(e.lo), hi: int(e.hi), plain: e.plain}
}

// decodedKey returns a reference to the decoded value of the key s.
func (d *decoder) decodedKey(s jstr) keyRef {
	if s.plain {
		return keyRef{lo: s.lo, hi: s.hi}
	}
	lo := len(d.keys)
	d.keys = appendUnescaped(d.keys, d.buf[s.lo:s.hi], false)
	return keyRef{lo: lo, hi: len(d.keys), decoded: true}
}

// keyOf returns the bytes of a decoded key.
func (d *decoder) keyOf(k keyRef) []byte {
	if k.decoded {
		return d.keys[k.lo:k.hi]
	}
	return d.buf[k.lo:k.hi]
}

// sortAndDedup sorts d.sorted[base:] stably by key and keeps the last of equal keys. It returns
// the number of entries kept, which are at d.sorted[base:base+n].
func (d *decoder) sortAndDedup(base int) int {
	s := d.sorted[base:]
	cmp := func(a, b sortEnt) int { return bytes.Compare(d.keyOf(a.key), d.keyOf(b.key)) }
	if !slices.IsSortedFunc(s, cmp) {
		slices.SortStableFunc(s, cmp)
	}
	n := 0
	for i := range s {
		if i+1 < len(s) && bytes.Equal(d.keyOf(s[i].key), d.keyOf(s[i+1].key)) {
			continue
		}
		s[n] = s[i]
		n++
	}
	return n
}

// emit appends the canonical form of the tape value at index i and returns the next index.
func (d *decoder) emit(dst []byte, i int) ([]byte, int) {
	if d.sorted == nil {
		d.sorted = make([]sortEnt, 0, 16)
	}
	e := d.tape[i]
	switch e.kind {
	case '"':
		return d.appendCanonicalStr(dst, d.tapeStr(i)), i + 1
	case '[':
		dst = append(dst, '[')
		for j := i + 1; j < int(e.end); {
			if j > i+1 {
				dst = append(dst, ',')
			}
			dst, j = d.emit(dst, j)
		}
		return append(dst, ']'), int(e.end)
	case '{':
		base := len(d.sorted)
		for j := i + 1; j < int(e.end); j = d.after(j + 1) {
			d.sorted = append(d.sorted, sortEnt{key: d.decodedKey(d.tapeStr(j)), ref: j})
		}
		n := d.sortAndDedup(base)
		dst = append(dst, '{')
		for k := range n {
			if k > 0 {
				dst = append(dst, ',')
			}
			j := d.sorted[base+k].ref
			dst = d.appendCanonicalStr(dst, d.tapeStr(j))
			dst = append(dst, ':')
			dst, _ = d.emit(dst, j+1)
		}
		d.sorted = d.sorted[:base]
		return append(dst, '}'), int(e.end)
	default:
		return append(dst, d.buf[e.lo:e.hi]...), i + 1
	}
}

// canonObj flags select the members canonicalObject leaves out.
const (
	dropNull         = 1 << iota // members whose value is null
	dropType                     // "type"
	dropCacheControl             // "cache_control"
	dropContent                  // "content"
)

// canonicalObject appends the canonical JSON object of the members ms (minus those the flags drop)
// and returns how many members it wrote.
func (d *decoder) canonicalObject(dst []byte, ms []member, flags int, depth int) ([]byte, int, error) {
	if d.sorted == nil {
		d.sorted = make([]sortEnt, 0, 16)
	}
	base := len(d.sorted)
	for _, m := range ms {
		switch {
		case flags&dropNull != 0 && m.kind == 'n',
			flags&dropType != 0 && string(d.keyOf(m.key)) == "type",
			flags&dropCacheControl != 0 && string(d.keyOf(m.key)) == "cache_control",
			flags&dropContent != 0 && string(d.keyOf(m.key)) == "content":
			continue
		}
		d.sorted = append(d.sorted, sortEnt{key: m.key, ref: m.val})
	}
	n := d.sortAndDedup(base)
	dst = append(dst, '{')
	var err error
	for k := range n {
		if k > 0 {
			dst = append(dst, ',')
		}
		se := d.sorted[base+k]
		dst = appendQuoted(dst, d.keyOf(se.key))
		dst = append(dst, ':')
		if dst, err = d.canonicalAt(dst, se.ref, depth+1); err != nil {
			err = atField(err, string(d.keyOf(se.key)))
			break
		}
	}
	d.sorted = d.sorted[:base]
	return append(dst, '}'), n, err
}

// recordMembers reads the object at d.pos (a '{') and appends its members to d.members.
// depth is the object's own nesting depth.
func (d *decoder) recordMembers(depth int) error {
	if d.members == nil {
		d.members = make([]member, 0, 8)
	}
	if depth > maxJSONDepth {
		return d.syntaxErr("nesting too deep")
	}
	d.pos++
	first := true
	for {
		k, more, err := d.next(&first)
		if err != nil || !more {
			return err
		}
		m := member{key: d.decodedKey(k), val: d.pos}
		if d.pos < len(d.buf) {
			m.kind = d.buf[d.pos]
		}
		if m.kind == '"' {
			m.s, err = d.scanString()
		} else {
			err = d.skipValue(depth)
		}
		if err != nil {
			return atField(err, string(d.keyOf(m.key)))
		}
		d.members = append(d.members, m)
	}
}

// findMember returns the last of the members ms named key, or nil.
func (d *decoder) findMember(ms []member, key string) *member {
	for i := len(ms) - 1; i >= 0; i-- {
		if string(d.keyOf(ms[i].key)) == key {
			return &ms[i]
		}
	}
	return nil
}

// ---- typed values ----

func isNumStart(c byte) bool { return c == '-' || '0' <= c && c <= '9' }

// readNull consumes a null at d.pos and reports whether there was one.
func (d *decoder) readNull() (bool, error) {
	if d.peek() != 'n' {
		return false, nil
	}
	return true, d.scanLiteral()
}

// readFloat reads a number; null reports an explicit null.
func (d *decoder) readFloat() (v float64, null bool, err error) {
	c := d.peek()
	if c == 'n' {
		return 0, true, d.scanLiteral()
	}
	if !isNumStart(c) {
		return 0, false, fieldErr("", "must be a number")
	}
	lo, hi, err := d.scanNumber()
	if err != nil {
		return 0, false, err
	}
	v, err = strconv.ParseFloat(string(d.buf[lo:hi]), 64)
	if err != nil {
		return 0, false, fieldErr("", "number "+string(d.buf[lo:hi])+" is out of range")
	}
	return v, false, nil
}

// readInt reads an integer (a number with an integral value, such as 3 or 3.0); null reports an
// explicit null.
func (d *decoder) readInt() (v int64, null bool, err error) {
	c := d.peek()
	if c == 'n' {
		return 0, true, d.scanLiteral()
	}
	if !isNumStart(c) {
		return 0, false, fieldErr("", "must be an integer")
	}
	lo, hi, err := d.scanNumber()
	if err != nil {
		return 0, false, err
	}
	lit := d.buf[lo:hi]
	if !bytes.ContainsAny(lit, ".eE") {
		v, err = strconv.ParseInt(string(lit), 10, 64)
		if err != nil {
			return 0, false, fieldErr("", "integer "+string(lit)+" is out of range")
		}
		return v, false, nil
	}
	f, err := strconv.ParseFloat(string(lit), 64)
	if err != nil || f != math.Trunc(f) {
		return 0, false, fieldErr("", "must be an integer")
	}
	if f < -(1<<63) || f >= 1<<63 {
		return 0, false, fieldErr("", "integer "+string(lit)+" is out of range")
	}
	return int64(f), false, nil
}

// readTokenID reads a token ID: an integer in [0, 2^32).
func (d *decoder) readTokenID() (uint32, error) {
	v, null, err := d.readInt()
	if err == nil && (null || v < 0 || v > math.MaxUint32) {
		err = fieldErr("", "must be a token ID in [0, 4294967295]")
	}
	if err != nil {
		if fe, ok := err.(*FieldError); ok && fe.Reason == "must be an integer" {
			fe.Reason = "must be a token ID in [0, 4294967295]"
		}
		return 0, err
	}
	return uint32(v), nil
}

// readBool reads a boolean; null reads as false.
func (d *decoder) readBool() (bool, error) {
	switch d.peek() {
	case 't':
		return true, d.scanLiteral()
	case 'f', 'n':
		return false, d.scanLiteral()
	default:
		return false, fieldErr("", "must be a boolean")
	}
}

// readStop reads a stop value: a string or an array of strings (null is absent). arrayOnly
// rejects a lone string (Anthropic stop_sequences).
func (d *decoder) readStop(arrayOnly bool) ([]string, error) {
	switch c := d.peek(); {
	case c == 'n':
		return nil, d.scanLiteral()
	case c == '"' && !arrayOnly:
		s, err := d.scanString()
		if err != nil {
			return nil, err
		}
		return []string{string(d.strBytes(s))}, nil
	case c == '[':
		d.pos++
		out := []string{}
		first := true
		for i := 0; ; i++ {
			more, err := d.nextElem(&first)
			if err != nil {
				return nil, err
			}
			if !more {
				return out, nil
			}
			if d.peek() != '"' {
				return nil, atIndex(fieldErr("", "must be a string"), i)
			}
			s, err := d.scanString()
			if err != nil {
				return nil, atIndex(err, i)
			}
			out = append(out, string(d.strBytes(s)))
		}
	default:
		if arrayOnly {
			return nil, fieldErr("", "must be an array of strings")
		}
		return nil, fieldErr("", "must be a string or an array of strings")
	}
}

// readJSON reads a JSON-valued parameter as canonical JSON; null is absent (nil). kinds lists
// the accepted first bytes ('{', '[', '"') and what names them in the error.
func (d *decoder) readJSON(kinds string, what string, depth int) ([]byte, error) {
	c := d.peek()
	if c == 'n' {
		return nil, d.scanLiteral()
	}
	if c == 0 || strings.IndexByte(kinds, c) < 0 {
		return nil, fieldErr("", "must be "+what)
	}
	return d.appendCanonical(nil, depth)
}

// param reads the sampling parameter named key into p, for format f. It reports false, with
// nothing consumed, when key is not a parameter of f.
func (d *decoder) param(p *Params, k jstr, f Format) (bool, error) {
	key := d.strBytes(k) // valid until the next strBytes: only for the switches
	var err error
	var null bool
	anthropic := f == FormatAnthropicMessages
	switch string(key) {
	case "temperature":
		p.Temperature.V, null, err = d.readFloat()
		p.Temperature.Set = !null
	case "top_p":
		p.TopP.V, null, err = d.readFloat()
		p.TopP.Set = !null
	case "max_tokens":
		p.MaxTokens.V, null, err = d.readInt()
		p.MaxTokens.Set = !null
	case "stream":
		p.Stream, err = d.readBool()
	case "tools":
		p.Tools, err = d.readJSON("[", "an array", 1)
	case "tool_choice":
		if anthropic {
			p.ToolChoice, err = d.readJSON("{", "an object", 1)
		} else {
			p.ToolChoice, err = d.readJSON("{\"", "a string or an object", 1)
		}
	case "stop_sequences":
		if !anthropic {
			return false, nil
		}
		p.Stop, err = d.readStop(true)
	default:
		if anthropic {
			return false, nil
		}
		switch string(key) {
		case "max_completion_tokens":
			p.MaxCompletionTokens.V, null, err = d.readInt()
			p.MaxCompletionTokens.Set = !null
		case "n":
			p.N.V, null, err = d.readInt()
			p.N.Set = !null
		case "seed":
			p.Seed.V, null, err = d.readInt()
			p.Seed.Set = !null
		case "presence_penalty":
			p.PresencePenalty.V, null, err = d.readFloat()
			p.PresencePenalty.Set = !null
		case "frequency_penalty":
			p.FrequencyPenalty.V, null, err = d.readFloat()
			p.FrequencyPenalty.Set = !null
		case "stop":
			p.Stop, err = d.readStop(false)
		case "response_format":
			p.ResponseFormat, err = d.readJSON("{", "an object", 1)
		case "logit_bias":
			p.LogitBias, err = d.readJSON("{", "an object", 1)
		default:
			return false, nil
		}
	}
	if err != nil {
		return true, atField(err, d.keyString(k))
	}
	return true, nil
}

// checkRanges checks the numeric parameters of p, once the whole body is read (the last of
// duplicate keys is the one kept and checked), against the ranges the provider's API accepts:
// temperature in [0, 2] (OpenAI) or [0, 1] (Anthropic), top_p in [0, 1], max_tokens,
// max_completion_tokens and n at least 1. The error names the field.
func checkRanges(p *Params, f Format) error {
	maxTemp, tempReason := 2.0, "must be between 0 and 2"
	if f == FormatAnthropicMessages {
		maxTemp, tempReason = 1, "must be between 0 and 1"
	}
	switch {
	case p.Temperature.Set && (p.Temperature.V < 0 || p.Temperature.V > maxTemp):
		return fieldErr("temperature", tempReason)
	case p.TopP.Set && (p.TopP.V < 0 || p.TopP.V > 1):
		return fieldErr("top_p", "must be between 0 and 1")
	case p.MaxTokens.Set && p.MaxTokens.V < 1:
		return fieldErr("max_tokens", "must be at least 1")
	case p.MaxCompletionTokens.Set && p.MaxCompletionTokens.V < 1:
		return fieldErr("max_completion_tokens", "must be at least 1")
	case p.N.Set && p.N.V < 1:
		return fieldErr("n", "must be at least 1")
	}
	return nil
}

// ---- shared request structure ----

// begin consumes the opening brace of the body.
func (d *decoder) begin() error {
	if len(d.buf) > maxBodyLen {
		return fieldErr("", "body is longer than 1 GiB")
	}
	switch d.peek() {
	case '{':
		d.pos++
		return nil
	case 0:
		if d.pos >= len(d.buf) {
			return fieldErr("", "body is empty")
		}
	}
	return fieldErr("", "body must be a JSON object")
}

// readModel reads the model name; null reads as "" (absent).
func (d *decoder) readModel() (string, error) {
	switch d.peek() {
	case 'n':
		return "", d.scanLiteral()
	case '"':
		s, err := d.scanString()
		if err != nil {
			return "", atField(err, "model")
		}
		return string(d.strBytes(s)), nil
	default:
		return "", fieldErr("model", "must be a string")
	}
}

// outputNeutral lists top-level fields that never change what the model answers (caller
// identification, billing); they are left out of Params.Other.
var outputNeutral = [...]string{"user", "metadata", "service_tier", "store", "safety_identifier", "prompt_cache_key"}

// otherField is one top-level member the parser does not model, kept for Params.Other.
type otherField struct {
	key string
	val []byte // canonical JSON
}

// skipUnknown reads the value of a top-level member the parser does not model: it is kept, as
// canonical JSON, for Params.Other (so that the response-cache key covers fields such as logprobs
// or top_k), unless it is null or listed in outputNeutral.
func (d *decoder) skipUnknown(k jstr) error {
	key := d.keyString(k)
	if slices.Contains(outputNeutral[:], key) || d.peek() == 'n' {
		if err := d.skipValue(1); err != nil {
			return atField(err, key)
		}
		return nil
	}
	val, err := d.appendCanonical(nil, 1)
	if err != nil {
		return atField(err, key)
	}
	d.other = append(d.other, otherField{key: key, val: val}) // duplicates: see otherJSON
	return nil
}

// otherJSON returns the kept unknown members as one canonical JSON object, or nil.
func (d *decoder) otherJSON() []byte {
	if len(d.other) == 0 {
		return nil
	}
	// Sorting stably, then keeping the last of equal keys, makes the last duplicate win in
	// O(n log n): a body of many unknown keys costs no quadratic search.
	slices.SortStableFunc(d.other, func(a, b otherField) int { return strings.Compare(a.key, b.key) })
	out := []byte{'{'}
	for i, f := range d.other {
		if i+1 < len(d.other) && d.other[i+1].key == f.key {
			continue
		}
		if len(out) > 1 {
			out = append(out, ',')
		}
		out = appendQuoted(out, []byte(f.key))
		out = append(out, ':')
		out = append(out, f.val...)
	}
	return append(out, '}')
}

// keyString returns the decoded key k as a new string (for error paths).
func (d *decoder) keyString(k jstr) string {
	if k.plain {
		return string(d.buf[k.lo:k.hi])
	}
	return string(appendUnescaped(nil, d.buf[k.lo:k.hi], false))
}

// resetMessages forgets what an earlier "messages" member filled (a duplicate key: last wins).
func (d *decoder) resetMessages() {
	d.text, d.data, d.raw = d.text[:0], d.data[:0], d.raw[:0]
	d.parts, d.msgs, d.media = d.parts[:0], d.msgs[:0], d.media[:0]
	d.textEnd = 0
}

// addExtra canonicalises d.members[base:] (null members dropped) into d.raw and returns its span.
func (d *decoder) addExtra(base, depth int) (lo, hi int, err error) {
	lo = len(d.raw)
	if len(d.members) == base {
		return lo, lo, nil
	}
	var n int
	d.raw, n, err = d.canonicalObject(d.raw, d.members[base:], dropNull, depth)
	if n == 0 {
		d.raw = d.raw[:lo]
	}
	return lo, len(d.raw), err
}

// init sizes the text arena for body: the decoded text of a body is at most as long as the body
// (strings are valid UTF-8, and decoding never lengthens them), so it never grows. The other
// arrays grow with what the body holds (see grow).
func (d *decoder) init(body []byte) {
	d.buf = body
	if len(body) <= maxBodyLen {
		d.text = make([]byte, 0, len(body))
		n := len(body)/1024 + 8 // a guess on the low side: grow doubles
		d.msgs = make([]msgRef, 0, n)
		d.parts = make([]partRef, 0, n)
	}
}

// maxBodyLen is the longest body the parsers accept: offsets into a body are kept as int32.
const maxBodyLen = 1<<30 - 1

// finish converts the arenas into the Request's strings and slices. The arenas are never
// written again: their strings share them rather than copy them (what strings.Builder does).
func (d *decoder) finish(r *Request) {
	r.Params.Other = d.otherJSON()
	r.Media = d.mediaOf()
	if cap(d.text)-len(d.text) > 64<<10 && len(d.text) < cap(d.text)/2 {
		// Most text stayed in the body: keep only what was copied, not the whole arena.
		d.text = bytes.Clone(d.text)
	}
	text, sys, data := arenaString(d.text), arenaString(d.sys), arenaString(d.data)
	body := arenaString(d.buf)
	d.text, d.sys, d.data = nil, nil, nil
	if len(sys) > 0 {
		r.System = sys
	}
	if v := d.sysView; v.hi > v.lo {
		r.System = body[v.lo:v.hi]
	}
	var parts []Part
	if len(d.parts) > 0 {
		parts = make([]Part, len(d.parts))
		for i, p := range d.parts {
			typ := p.typ.String()
			if p.typ == kindOther {
				typ = data[p.tylo:p.tyhi]
			}
			src := text
			if p.view {
				src = body
			}
			parts[i] = Part{Type: typ, Text: src[p.tlo:p.thi], Data: data[p.dlo:p.dhi]}
		}
	}
	if len(d.msgs) > 0 {
		r.Messages = make([]Message, len(d.msgs))
		for i, m := range d.msgs {
			msg := &r.Messages[i]
			msg.Role = m.role.String()
			if m.view {
				msg.Text = body[m.tlo:m.thi]
			} else {
				msg.Text = text[m.tlo:m.thi]
			}
			if m.phi > m.plo {
				msg.Parts = parts[m.plo:m.phi:m.phi]
			}
			if m.xhi > m.xlo {
				msg.Extra = d.raw[m.xlo:m.xhi:m.xhi]
			}
		}
	}
	if len(d.prompts) > 0 {
		r.Prompt = make([]string, len(d.prompts))
		for i, s := range d.prompts {
			if s.plain {
				r.Prompt[i] = body[s.lo:s.hi]
			} else {
				r.Prompt[i] = text[s.lo:s.hi]
			}
		}
	}
}

// arenaString returns b's bytes as a string without copying them; b must never be written again.
func arenaString(b []byte) string { return unsafe.String(unsafe.SliceData(b), len(b)) }

// partKind is a Part's type as a small code, so that partRef holds no pointer.
type partKind uint8

const (
	kindOther partKind = iota // the name is in d.data[tylo:tyhi]
	kindText
	kindRefusal
	kindImageURL
	kindInputAudio
	kindFile
	kindImage
	kindDocument
	kindToolUse
	kindToolResult
	kindThinking
	kindRedactedThinking
)

// String returns the type name of a known kind ("" for kindOther).
func (k partKind) String() string {
	switch k {
	case kindText:
		return "text"
	case kindRefusal:
		return "refusal"
	case kindImageURL:
		return "image_url"
	case kindInputAudio:
		return "input_audio"
	case kindFile:
		return "file"
	case kindImage:
		return "image"
	case kindDocument:
		return "document"
	case kindToolUse:
		return "tool_use"
	case kindToolResult:
		return "tool_result"
	case kindThinking:
		return "thinking"
	case kindRedactedThinking:
		return "redacted_thinking"
	}
	return ""
}

// kindOf returns the partKind named name (kindOther when unknown).
func kindOf(name string) partKind {
	switch name {
	case "text":
		return kindText
	case "refusal":
		return kindRefusal
	case "image_url":
		return kindImageURL
	case "input_audio":
		return kindInputAudio
	case "file":
		return kindFile
	case "image":
		return kindImage
	case "document":
		return kindDocument
	case "tool_use":
		return kindToolUse
	case "tool_result":
		return kindToolResult
	case "thinking":
		return kindThinking
	case "redacted_thinking":
		return kindRedactedThinking
	}
	return kindOther
}

// partType returns the part or block type named by b, without allocating for known types.
func partType(b []byte) string {
	if k := kindOf(string(b)); k != kindOther {
		return k.String()
	}
	return string(b)
}

// addPart appends a part of type typ with text d.text[tlo:thi] and data d.data[dlo:dhi].
func (d *decoder) addPart(typ string, tlo, thi, dlo, dhi int) {
	p := partRef{typ: kindOf(typ), tlo: int32(tlo), thi: int32(thi), dlo: int32(dlo), dhi: int32(dhi)}
	if p.typ == kindOther {
		p.tylo = int32(len(d.data))
		d.data = append(d.data, typ...)
		p.tyhi = int32(len(d.data))
	}
	d.parts = append(grow(d.parts), p)
}

// msgRole is a message role as a small code, so that msgRef holds no pointer.
type msgRole uint8

const (
	roleNone msgRole = iota
	roleSystem
	roleDeveloper
	roleUser
	roleAssistant
	roleTool
	roleFunction
)

// String returns the role's name.
func (r msgRole) String() string {
	switch r {
	case roleSystem:
		return "system"
	case roleDeveloper:
		return "developer"
	case roleUser:
		return "user"
	case roleAssistant:
		return "assistant"
	case roleTool:
		return "tool"
	case roleFunction:
		return "function"
	}
	return ""
}

// roleOf returns the msgRole named name (roleNone when unknown).
func roleOf(name string) msgRole {
	switch name {
	case "system":
		return roleSystem
	case "developer":
		return roleDeveloper
	case "user":
		return roleUser
	case "assistant":
		return roleAssistant
	case "tool":
		return roleTool
	case "function":
		return roleFunction
	}
	return roleNone
}

// typeOf returns the "type" member of a content part or block.
func (d *decoder) typeOf(ms []member) (string, error) {
	t := d.findMember(ms, "type")
	if t == nil || t.kind == 'n' {
		return "", fieldErr("type", "is required")
	}
	if t.kind != '"' {
		return "", fieldErr("type", "must be a string")
	}
	return partType(d.strBytes(t.s)), nil
}

// textMember appends the string member name of ms to d.text and returns its span.
func (d *decoder) textMember(ms []member, name string) (lo, hi int, err error) {
	m := d.findMember(ms, name)
	if m == nil || m.kind == 'n' {
		return 0, 0, fieldErr(name, "is required")
	}
	if m.kind != '"' {
		return 0, 0, fieldErr(name, "must be a string")
	}
	lo = len(d.text)
	d.text = d.appendStr(d.text, m.s)
	d.noteText(m.s, lo)
	return lo, len(d.text), nil
}
