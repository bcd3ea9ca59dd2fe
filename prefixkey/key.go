package prefixkey

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"unicode/utf8"

	"github.com/zeebo/xxh3"
)

// DefaultMaxPrefixLength is the number of anchor bytes a prefix key covers when the caller passes a
// maxPrefixLength <= 0.
const DefaultMaxPrefixLength = 1024

// ErrBadKey is wrapped by the errors of ParseKey and Key.UnmarshalText: the text is not the 32-digit hex
// form of a Key.
var ErrBadKey = errors.New("prefixkey: bad prefix key")

// Key is a prefix key: the xxh3-128 hash (canonical big-endian byte order: high half first) of
//
//	model ‖ 0x00 ‖ tag ‖ TruncateUTF8(text, maxPrefixLength)
//
// where tag is 'S' when text is the system prompt and 'M' when it is the first message (see
// Request.Anchor). The zero Key is what Request.PrefixKey returns when a request has no anchor; a real key is
// zero with probability 2⁻¹²⁸.
//
// A Key is a comparable value, usable as a map key; it is safe for concurrent use.
type Key [16]byte

// String returns the key as 32 lowercase hex digits (the "prefix_hash" of SSE KV events).
func (k Key) String() string {
	return hex.EncodeToString(k[:])
}

// AppendText appends the key's 32 lowercase hex digits to b (encoding.TextAppender). It never fails.
func (k Key) AppendText(b []byte) ([]byte, error) {
	return hex.AppendEncode(b, k[:]), nil
}

// MarshalText returns the key's 32 lowercase hex digits (encoding.TextMarshaler), so that a Key
// encodes as a JSON string and works as a JSON object key. It never fails.
func (k Key) MarshalText() ([]byte, error) {
	return k.AppendText(make([]byte, 0, 2*len(k)))
}

// UnmarshalText parses the form MarshalText writes (encoding.TextUnmarshaler). On error, which wraps
// ErrBadKey, k is left unchanged.
func (k *Key) UnmarshalText(text []byte) error {
	var out Key
	if len(text) != 2*len(out) {
		return fmt.Errorf("%w: %d characters, want %d", ErrBadKey, len(text), 2*len(out))
	}
	if _, err := hex.Decode(out[:], text); err != nil {
		return fmt.Errorf("%w: %w", ErrBadKey, err)
	}
	*k = out
	return nil
}

// ParseKey parses the 32 hex digits String writes (upper-case digits are accepted too). The error
// wraps ErrBadKey when s has the wrong length or a non-hex character.
func ParseKey(s string) (Key, error) {
	var k Key
	if len(s) != 2*len(k) {
		return Key{}, fmt.Errorf("%w: %q has %d characters, want %d", ErrBadKey, s, len(s), 2*len(k))
	}
	for i := range k {
		hi, ok1 := fromHex(s[2*i])
		lo, ok2 := fromHex(s[2*i+1])
		if !ok1 || !ok2 {
			return Key{}, fmt.Errorf("%w: %q is not hexadecimal", ErrBadKey, s)
		}
		k[i] = hi<<4 | lo
	}
	return k, nil
}

func fromHex(c byte) (byte, bool) {
	switch {
	case '0' <= c && c <= '9':
		return c - '0', true
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10, true
	case 'A' <= c && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}

// IsZero reports whether k is the zero Key (no key).
func (k Key) IsZero() bool { return k == Key{} }

// Uint64 returns the low 64 bits of the 128-bit hash (bytes 8..15, big-endian): well-mixed bits for
// a hash ring or a shard index.
func (k Key) Uint64() uint64 { return binary.BigEndian.Uint64(k[8:]) }

// smallKeyBuf and keyBufSize size the stack buffers in which ComputeKey assembles its input before
// hashing it in one shot: a small buffer for short anchors (cheap to zero), keyBufSize bytes
// (DefaultMaxPrefixLength plus a model name of up to 126 bytes) otherwise. Longer inputs are
// streamed through an xxh3.Hasher128, which measured slower (BenchmarkComputeKeyPaths).
const (
	smallKeyBuf = 256
	keyBufSize  = DefaultMaxPrefixLength + 128
)

// ComputeKey returns the prefix key of one anchor: xxh3-128 over
// model ‖ 0x00 ‖ tag ‖ TruncateUTF8(text, maxPrefixLength). tag is 'S' (system prompt) or 'M' (first
// message); other values are hashed as given. maxPrefixLength <= 0 means DefaultMaxPrefixLength.
//
// It does not allocate and is safe for concurrent use.
func ComputeKey(model string, tag byte, text string, maxPrefixLength int) Key {
	if maxPrefixLength <= 0 {
		maxPrefixLength = DefaultMaxPrefixLength
	}
	text = TruncateUTF8(text, maxPrefixLength)
	n := len(model) + 2 + len(text)
	switch {
	case n <= smallKeyBuf:
		var buf [smallKeyBuf]byte
		return xxh3.Hash128(encodeKeyInput(buf[:n], model, tag, text)).Bytes()
	case n <= keyBufSize:
		return computeKeyBuf(n, model, tag, text)
	default:
		return computeKeyStream(model, tag, text)
	}
}

// computeKeyBuf keeps the large buffer out of ComputeKey's frame, which then stays cheap to zero
// for short anchors.
//
//go:noinline
func computeKeyBuf(n int, model string, tag byte, text string) Key {
	var buf [keyBufSize]byte
	return xxh3.Hash128(encodeKeyInput(buf[:n], model, tag, text)).Bytes()
}

// encodeKeyInput writes model ‖ 0x00 ‖ tag ‖ text into b, which must be exactly that long, and
// returns b.
func encodeKeyInput(b []byte, model string, tag byte, text string) []byte {
	i := copy(b, model)
	b[i] = 0
	b[i+1] = tag
	copy(b[i+2:], text)
	return b
}

// computeKeyStream is ComputeKey's path for inputs larger than keyBufSize. It gives the same hash as
// the one-shot path (xxh3's streaming and one-shot forms agree).
//
//go:noinline
func computeKeyStream(model string, tag byte, text string) Key {
	var h xxh3.Hasher128
	h.WriteString(model)
	sep := [2]byte{0, tag}
	h.Write(sep[:])
	h.WriteString(text)
	return h.Sum128().Bytes()
}

// PrefixKey returns the prefix key of r over the anchor that r.Anchor returns (the system prompt,
// else the first message or prompt): ComputeKey(r.Model, tag, text, maxPrefixLength) when r has no
// cache salt and no media item in the part of the anchor the key covers; otherwise ExtendedKey
// with r.CacheSalt and the identities of those media items (the anchor message's items preceded by
// fewer than maxPrefixLength bytes of its text). A salted request thus never shares a key with an
// unsalted one or one of another salt (vLLM's cache_salt isolates their KV cache: no backend holds
// the one's prefix for the other), and two requests whose first messages differ only in an image
// get different keys. ok is false, and k the zero Key, when r has no anchor: the caller then takes
// its fallback path.
//
// The key uses r.Model, not the adapter: it decides which backend a prefix prefers, while block keys
// (Request.BlockKeys) decide what is actually cached.
//
// It does not allocate and is safe for concurrent use with other readers of r.
func (r *Request) PrefixKey(maxPrefixLength int) (k Key, ok bool) {
	tag, text, ok := r.Anchor()
	if !ok {
		return Key{}, false
	}
	if maxPrefixLength <= 0 {
		maxPrefixLength = DefaultMaxPrefixLength
	}
	anchorMedia := tag == 'M' && !r.HasSystem && len(r.Messages) > 0 && len(r.Media) > 0
	if r.CacheSalt == "" && (!anchorMedia || !r.hasAnchorMedia(maxPrefixLength)) {
		return ComputeKey(r.Model, tag, text, maxPrefixLength), true
	}
	var media []Media
	if anchorMedia {
		media = r.Media
	}
	return extendedKey(r.Model, tag, text, maxPrefixLength, r.CacheSalt, media), true
}

// hasAnchorMedia reports whether an item of r.Media is in the first message within its first
// maxPrefixLength bytes of text.
func (r *Request) hasAnchorMedia(maxPrefixLength int) bool {
	for i := range r.Media {
		if inAnchor(&r.Media[i], maxPrefixLength) {
			return true
		}
	}
	return false
}

func inAnchor(m *Media, maxPrefixLength int) bool {
	return m.Message == 0 && m.Offset < maxPrefixLength
}

// ExtendedKey returns the prefix key of an anchor with a cache salt or media items: xxh3-128 over
//
//	model ‖ 0x00 ‖ tag|0x20 ‖ le64(len(salt)) ‖ salt ‖ le64(len(t)) ‖ t ‖ le64(n) ‖
//	le64(offset₁) ‖ le64(hash₁) ‖ … ‖ le64(offsetₙ) ‖ le64(hashₙ)
//
// where t is TruncateUTF8(text, maxPrefixLength), tag|0x20 the tag in lower case ('s' or 'm', so
// that no ComputeKey input of tag 'S' or 'M' is one of these), and the n (offset, hash) pairs are
// the Offset and Hash of the items of media with Message 0 and Offset < maxPrefixLength, in
// order. maxPrefixLength <= 0 means DefaultMaxPrefixLength. Request.PrefixKey calls it for salted requests
// and anchors with media (pass nil media for a system-prompt anchor).
//
// It does not allocate and is safe for concurrent use.
func ExtendedKey(model string, tag byte, text string, maxPrefixLength int, salt string, media []Media) Key {
	if maxPrefixLength <= 0 {
		maxPrefixLength = DefaultMaxPrefixLength
	}
	return extendedKey(model, tag, text, maxPrefixLength, salt, media)
}

func extendedKey(model string, tag byte, text string, maxPrefixLength int, salt string, media []Media) Key {
	var h xxh3.Hasher128
	var b [16]byte
	h.WriteString(model)
	b[0], b[1] = 0, tag|0x20
	h.Write(b[:2])
	binary.LittleEndian.PutUint64(b[:], uint64(len(salt)))
	h.Write(b[:8])
	h.WriteString(salt)
	text = TruncateUTF8(text, maxPrefixLength)
	binary.LittleEndian.PutUint64(b[:], uint64(len(text)))
	h.Write(b[:8])
	h.WriteString(text)
	n := 0
	for i := range media {
		if inAnchor(&media[i], maxPrefixLength) {
			n++
		}
	}
	binary.LittleEndian.PutUint64(b[:], uint64(n))
	h.Write(b[:8])
	for i := range media {
		if m := &media[i]; inAnchor(m, maxPrefixLength) {
			binary.LittleEndian.PutUint64(b[:8], uint64(m.Offset))
			binary.LittleEndian.PutUint64(b[8:], m.Hash)
			h.Write(b[:])
		}
	}
	return h.Sum128().Bytes()
}

// TruncateUTF8 returns the longest prefix of s of at most n bytes that does not end inside a
// multibyte UTF-8 character. n <= 0 gives "". Invalid bytes of s are treated as one-byte characters,
// so truncating valid UTF-8 always gives valid UTF-8. It does not allocate.
func TruncateUTF8(s string, n int) string {
	if n >= len(s) {
		return s
	}
	if n <= 0 {
		return ""
	}
	if utf8.RuneStart(s[n]) {
		return s[:n]
	}
	// s[n] continues a character: find where that character starts and cut before it, unless the
	// bytes there do not form a character that reaches past n (invalid input).
	for i := n - 1; i >= 0 && i > n-utf8.UTFMax; i-- {
		if utf8.RuneStart(s[i]) {
			if _, size := utf8.DecodeRuneInString(s[i:]); i+size > n {
				return s[:i]
			}
			return s[:n]
		}
	}
	return s[:n]
}
