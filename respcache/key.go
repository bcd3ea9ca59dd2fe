package respcache

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"math"
	"unsafe"

	"github.com/kvroute/kvroute/prefixkey"
)

// Key is a response-cache key: the SHA-256 digest that KeyOf computes over everything in a request
// that changes its response (see the package doc, "Cache key", for the exact layout). It is a
// comparable value, safe for concurrent use; stores take it as its 64-digit hex String.
type Key [sha256.Size]byte

// String returns the key as 64 lowercase hex digits, the form stores use.
func (k Key) String() string {
	return hex.EncodeToString(k[:])
}

// AppendText appends the key's 64 lowercase hex digits to b (encoding.TextAppender), for building a
// prefixed store key without an intermediate string. It never fails.
func (k Key) AppendText(b []byte) ([]byte, error) {
	return hex.AppendEncode(b, k[:]), nil
}

// MarshalText returns the key's 64 lowercase hex digits (encoding.TextMarshaler). It never fails.
func (k Key) MarshalText() ([]byte, error) {
	return k.AppendText(make([]byte, 0, 2*len(k)))
}

// keyVersion opens every key's input: a new layout gets a new version, so that stores shared by
// routers of different versions never confuse the two.
const keyVersion = "kvroute/respcache/key/v2\x00"

// Tags of the SOME/NONE encoding of an optional field.
const (
	tagNone = 0x00
	tagSome = 0x01
)

// scratchFlush is the fill level at which KeyOf hands its scratch buffer to the hasher; strings
// longer than directWrite bypass the scratch buffer. Their sum stays under the buffer's size.
const (
	scratchSize  = 512
	scratchFlush = scratchSize - 128
	directWrite  = 64
)

// KeyOf returns r's response-cache key. It is a pure function of r (safe for concurrent use, r is
// only read), does not allocate, and costs about one SHA-256 pass over the request's text and JSON
// parameters. A nil r panics.
//
// Two requests get the same key exactly when they agree on the model, the format, the adapter, the
// tenant, the cache salt, streaming, the system prompt (absent differs from empty), every message
// (role, each part's type, text and data, the message's extra JSON), the completions prompt or its
// tokens, the multimodal spans and every parameter of prefixkey.Params, an absent parameter
// differing from a zero one. JSON-valued parameters and Message.Extra are compared as the canonical
// JSON prefixkey produces, so object key order in the body does not matter. A message with no Parts
// keys as one text part holding its Text.
func KeyOf(r *prefixkey.Request) Key {
	// The bytes go through a stack scratch buffer so that the many small fields (length prefixes,
	// tags) do not each cost a Write; long strings are written directly. The helpers (put, flush)
	// are pure functions of the scratch: h never leaves this function, so the compiler knows its
	// type and keeps it, and the scratch, on the stack.
	var sc [scratchSize]byte
	var w1, w2 []byte
	b := sc[:0]

	// Inner digest: the conversation.
	h := sha256.New()
	if r.HasSystem {
		b = append(b, tagSome)
		if b, w1, w2 = put(b, r.System); w1 != nil {
			h.Write(w1)
			h.Write(w2)
			b = sc[:0]
		}
	} else {
		b = append(b, tagNone)
	}
	b = appendLen(b, len(r.Messages))
	for i := range r.Messages {
		m := &r.Messages[i]
		if b, w1, w2 = put(b, m.Role); w1 != nil {
			h.Write(w1)
			h.Write(w2)
			b = sc[:0]
		}
		if len(m.Parts) == 0 {
			b = appendLen(b, 1)
			b = appendStr(b, "text")
			if b, w1, w2 = put(b, m.Text); w1 != nil {
				h.Write(w1)
				h.Write(w2)
				b = sc[:0]
			}
			b = appendLen(b, 0) // Data
		} else {
			b = appendLen(b, len(m.Parts))
		}
		for j := range m.Parts {
			p := &m.Parts[j]
			if b, w1, w2 = put(b, p.Type); w1 != nil {
				h.Write(w1)
				h.Write(w2)
				b = sc[:0]
			}
			if b, w1, w2 = put(b, p.Text); w1 != nil {
				h.Write(w1)
				h.Write(w2)
				b = sc[:0]
			}
			if b, w1, w2 = put(b, p.Data); w1 != nil {
				h.Write(w1)
				h.Write(w2)
				b = sc[:0]
			}
		}
		if m.Extra == nil {
			b = append(b, tagNone)
		} else {
			b = append(b, tagSome)
			if b, w1, w2 = put(b, bytesString(m.Extra)); w1 != nil {
				h.Write(w1)
				h.Write(w2)
				b = sc[:0]
			}
		}
	}
	b = appendLen(b, len(r.Prompt))
	for _, p := range r.Prompt {
		if b, w1, w2 = put(b, p); w1 != nil {
			h.Write(w1)
			h.Write(w2)
			b = sc[:0]
		}
	}
	b = appendLen(b, len(r.PromptTokens))
	for _, t := range r.PromptTokens {
		if len(b) > scratchFlush {
			h.Write(b)
			b = sc[:0]
		}
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	h.Write(b)
	var conv [sha256.Size]byte
	h.Sum(conv[:0])

	// Outer digest: model, conversation digest, parameters.
	h.Reset()
	b = append(sc[:0], keyVersion...)
	if b, w1, w2 = put(b, r.Model); w1 != nil {
		h.Write(w1)
		h.Write(w2)
		b = sc[:0]
	}
	b = append(b, 0)
	b = append(b, conv[:]...)
	b = append(b, 0)

	b = append(b, byte(r.Format))
	if b, w1, w2 = put(b, r.Adapter); w1 != nil {
		h.Write(w1)
		h.Write(w2)
		b = sc[:0]
	}
	if r.Tenant == "" {
		b = append(b, tagNone)
	} else {
		b = append(b, tagSome)
		if b, w1, w2 = put(b, r.Tenant); w1 != nil {
			h.Write(w1)
			h.Write(w2)
			b = sc[:0]
		}
	}
	if b, w1, w2 = put(b, r.CacheSalt); w1 != nil {
		h.Write(w1)
		h.Write(w2)
		b = sc[:0]
	}
	if len(b) > scratchFlush {
		h.Write(b)
		b = sc[:0]
	}

	p := &r.Params
	if p.Stream {
		b = append(b, 1)
	} else {
		b = append(b, 0)
	}
	b = appendOptFloat(b, p.Temperature)
	b = appendOptFloat(b, p.TopP)
	b = appendOptInt(b, p.MaxTokens)
	b = appendOptInt(b, p.MaxCompletionTokens)
	b = appendOptInt(b, p.N)
	b = appendOptInt(b, p.Seed)
	b = appendOptFloat(b, p.PresencePenalty)
	b = appendOptFloat(b, p.FrequencyPenalty) // at most 73 bytes since the last flush check
	if p.Stop == nil {
		b = append(b, tagNone)
	} else {
		b = append(b, tagSome)
		b = appendLen(b, len(p.Stop))
		for _, s := range p.Stop {
			if b, w1, w2 = put(b, s); w1 != nil {
				h.Write(w1)
				h.Write(w2)
				b = sc[:0]
			}
		}
	}
	for _, raw := range [...][]byte{p.ResponseFormat, p.LogitBias, p.Tools, p.ToolChoice, p.Other} {
		if raw == nil {
			b = append(b, tagNone)
		} else {
			b = append(b, tagSome)
			if b, w1, w2 = put(b, bytesString(raw)); w1 != nil {
				h.Write(w1)
				h.Write(w2)
				b = sc[:0]
			}
		}
	}
	b = appendLen(b, len(r.MultiModal))
	for _, s := range r.MultiModal {
		if len(b) > scratchFlush {
			h.Write(b)
			b = sc[:0]
		}
		b = binary.LittleEndian.AppendUint64(b, uint64(s.Offset))
		b = binary.LittleEndian.AppendUint64(b, uint64(s.Length))
		b = binary.LittleEndian.AppendUint64(b, s.Hash)
	}
	h.Write(b)
	var k Key
	h.Sum(k[:0])
	return k
}

// put appends le64(len(s)) ‖ s to the scratch b and says what the caller must write to the hasher
// before going on, resetting the scratch: nothing (w1 == nil); the full scratch (w1, w2 == nil);
// or, for a string longer than directWrite, the scratch holding its length and then s itself,
// which is not copied. Every call leaves at most scratchFlush+directWrite+17 bytes in the scratch.
func put(b []byte, s string) (_, w1, w2 []byte) {
	b = appendLen(b, len(s))
	if len(s) > directWrite {
		return b, b, stringBytes(s)
	}
	b = append(b, s...)
	if len(b) > scratchFlush {
		return b, b, nil
	}
	return b, nil, nil
}

func appendLen(b []byte, n int) []byte {
	return binary.LittleEndian.AppendUint64(b, uint64(n))
}

// appendStr appends le64(len(s)) ‖ s, for the short constant strings KeyOf writes itself.
func appendStr(b []byte, s string) []byte {
	b = appendLen(b, len(s))
	return append(b, s...)
}

func appendOptFloat(b []byte, o prefixkey.Opt[float64]) []byte {
	if !o.Set {
		return append(b, tagNone)
	}
	v := o.V
	if v == 0 {
		v = 0 // -0 and +0 mean the same parameter
	}
	b = append(b, tagSome)
	return binary.LittleEndian.AppendUint64(b, math.Float64bits(v))
}

func appendOptInt(b []byte, o prefixkey.Opt[int64]) []byte {
	if !o.Set {
		return append(b, tagNone)
	}
	b = append(b, tagSome)
	return binary.LittleEndian.AppendUint64(b, uint64(o.V))
}

// stringBytes views s as a byte slice, for the hasher, which only reads it.
func stringBytes(s string) []byte {
	return unsafe.Slice(unsafe.StringData(s), len(s))
}

// bytesString views b as a string; b must not change while the string is in use.
func bytesString(b []byte) string {
	return unsafe.String(unsafe.SliceData(b), len(b))
}
