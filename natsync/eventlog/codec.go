package eventlog

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/kvroute/kvroute/events"
)

// Limits of the message encoding. AppendMessage refuses a message beyond them (ErrTooLarge) and
// DecodeMessage a payload beyond them (ErrMalformed): a decoder never allocates more than a few
// times the payload's size.
const (
	// MaxMessageBytes is the largest encoded message. Keep it within the NATS server's
	// max_payload (1 MiB by default): a larger publish is refused by the server.
	MaxMessageBytes = 1 << 20
	// MaxStringBytes bounds each string of a message (backend, model, LoRA name, cache salt,
	// prefix hash).
	MaxStringBytes = 4096
	// MaxBlockSize bounds an event's BlockSize.
	MaxBlockSize = 1 << 20
)

// Errors callers branch on.
var (
	// ErrMalformed is wrapped by every DecodeMessage error, and by the snapshot reader's for a
	// corrupt snapshot.
	ErrMalformed = errors.New("eventlog: malformed message")
	// ErrTooLarge is wrapped by AppendMessage's error for a message beyond the encoding's limits.
	ErrTooLarge = errors.New("eventlog: message too large")
)

// Wire format, version 1 (integers little-endian; uv = unsigned varint, sv = signed varint,
// str = uv length + bytes):
//
//	"KVE" 0x01
//	uv flags            bit 0: clear the backend before the events; bit 1: DPRank is set
//	str backend, str model
//	uv seq, 8 bytes ts (float64 bits), sv dp_rank
//	uv event count, then per event:
//	  1 byte kind, uv field mask, then the fields present, in mask order:
//	  0x001 hashes: uv n, n × 8 bytes       0x040 extra keys: uv sets, per set uv n, n × 8 bytes
//	  0x002 parent: 8 bytes                 0x080 cache salt: str
//	  0x004 tokens: uv n, n × uv            0x100 group: sv
//	  0x008 block size: uv                  0x200 prefix op: 1 byte
//	  0x010 LoRA name: str                  0x400 prefix hash: str
//	  0x020 tier: 1 byte                    0x800 token count: sv
//
// The encoding of a batch is deterministic, so that bridges relaying one engine's batch publish
// the same bytes (see the Nats-Msg-Id of Publisher).
const (
	wireMagic   = "KVE"
	wireVersion = 1
)

const (
	flagClear = 1 << iota
	flagDPRank
	flagsKnown = flagClear | flagDPRank
)

const (
	fHashes = 1 << iota
	fParent
	fTokens
	fBlockSize
	fLoRA
	fTier
	fExtra
	fSalt
	fGroup
	fPrefixOp
	fPrefixHash
	fTokenCount
	fKnown = 1<<iota - 1
)

// Message is one record of the event log: a batch of one backend's events, and whether the
// backend is to be cleared before them (events.Sink.ClearBackend; a clear alone has no events).
//
// A Message decoded by DecodeMessage keeps its events' slices in storage of its own that the next
// decode into it reuses: they are valid until then. A Message is not safe for concurrent use.
type Message struct {
	Backend string
	Clear   bool
	Batch   events.Batch

	hashes []uint64
	tokens []uint32
	extras [][]uint64
}

// AppendMessage appends the encoding of m to dst and returns the extended buffer. The error wraps
// ErrTooLarge when m is beyond the limits (MaxMessageBytes, MaxStringBytes, MaxBlockSize); dst is
// then returned unchanged.
func AppendMessage(dst []byte, m *Message) ([]byte, error) {
	start := len(dst)
	fail := func(format string, args ...any) ([]byte, error) {
		return dst[:start], fmt.Errorf("%w: "+format, append([]any{ErrTooLarge}, args...)...)
	}
	b := &m.Batch
	var flags uint64
	if m.Clear {
		flags |= flagClear
	}
	if b.HasDPRank {
		flags |= flagDPRank
	}
	dst = append(dst, wireMagic...)
	dst = append(dst, wireVersion)
	dst = binary.AppendUvarint(dst, flags)
	if len(m.Backend) > MaxStringBytes || len(b.Model) > MaxStringBytes {
		return fail("backend or model name over %d bytes", MaxStringBytes)
	}
	dst = appendString(dst, m.Backend)
	dst = appendString(dst, b.Model)
	dst = binary.AppendUvarint(dst, b.Seq)
	dst = binary.LittleEndian.AppendUint64(dst, math.Float64bits(b.TS))
	dst = binary.AppendVarint(dst, int64(b.DPRank))
	dst = binary.AppendUvarint(dst, uint64(len(b.Events)))
	for i := range b.Events {
		ev := &b.Events[i]
		if len(ev.LoRAName) > MaxStringBytes || len(ev.CacheSalt) > MaxStringBytes || len(ev.PrefixHash) > MaxStringBytes {
			return fail("event %d: a string over %d bytes", i, MaxStringBytes)
		}
		if ev.BlockSize < 0 || ev.BlockSize > MaxBlockSize {
			return fail("event %d: block size %d", i, ev.BlockSize)
		}
		var mask uint64
		set := func(bit uint64, on bool) {
			if on {
				mask |= bit
			}
		}
		set(fHashes, len(ev.BlockHashes) > 0)
		set(fParent, ev.HasParent)
		set(fTokens, len(ev.TokenIDs) > 0)
		set(fBlockSize, ev.BlockSize != 0)
		set(fLoRA, ev.LoRAName != "")
		set(fTier, ev.Tier != 0)
		set(fExtra, len(ev.ExtraKeys) > 0)
		set(fSalt, ev.CacheSalt != "")
		set(fGroup, ev.GroupIdx != 0)
		set(fPrefixOp, ev.PrefixOp != 0)
		set(fPrefixHash, ev.PrefixHash != "")
		set(fTokenCount, ev.TokenCount != 0)
		dst = append(dst, byte(ev.Kind))
		dst = binary.AppendUvarint(dst, mask)
		if mask&fHashes != 0 {
			dst = appendUint64s(dst, ev.BlockHashes)
		}
		if mask&fParent != 0 {
			dst = binary.LittleEndian.AppendUint64(dst, ev.Parent)
		}
		if mask&fTokens != 0 {
			dst = binary.AppendUvarint(dst, uint64(len(ev.TokenIDs)))
			for _, t := range ev.TokenIDs {
				dst = binary.AppendUvarint(dst, uint64(t))
			}
		}
		if mask&fBlockSize != 0 {
			dst = binary.AppendUvarint(dst, uint64(ev.BlockSize))
		}
		if mask&fLoRA != 0 {
			dst = appendString(dst, ev.LoRAName)
		}
		if mask&fTier != 0 {
			dst = append(dst, byte(ev.Tier))
		}
		if mask&fExtra != 0 {
			dst = binary.AppendUvarint(dst, uint64(len(ev.ExtraKeys)))
			for _, ks := range ev.ExtraKeys {
				dst = appendUint64s(dst, ks)
			}
		}
		if mask&fSalt != 0 {
			dst = appendString(dst, ev.CacheSalt)
		}
		if mask&fGroup != 0 {
			dst = binary.AppendVarint(dst, int64(ev.GroupIdx))
		}
		if mask&fPrefixOp != 0 {
			dst = append(dst, byte(ev.PrefixOp))
		}
		if mask&fPrefixHash != 0 {
			dst = appendString(dst, ev.PrefixHash)
		}
		if mask&fTokenCount != 0 {
			dst = binary.AppendVarint(dst, int64(ev.TokenCount))
		}
		if len(dst)-start > MaxMessageBytes {
			return fail("over %d bytes", MaxMessageBytes)
		}
	}
	return dst, nil
}

func appendString(dst []byte, s string) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(s)))
	return append(dst, s...)
}

func appendUint64s(dst []byte, v []uint64) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(v)))
	for _, x := range v {
		dst = binary.LittleEndian.AppendUint64(dst, x)
	}
	return dst
}

// reader reads a payload; the first error sticks and every later read returns zero values.
type reader struct {
	b   []byte
	err error
}

func (r *reader) fail(format string, args ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: "+format, append([]any{ErrMalformed}, args...)...)
	}
	r.b = nil
}

func (r *reader) uvarint(what string) uint64 {
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail("%s: bad varint", what)
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) varint(what string) int64 {
	v, n := binary.Varint(r.b)
	if n <= 0 {
		r.fail("%s: bad varint", what)
		return 0
	}
	r.b = r.b[n:]
	return v
}

// int reads a signed varint in [lo, hi].
func (r *reader) int(what string, lo, hi int64) int {
	v := r.varint(what)
	if v < lo || v > hi {
		r.fail("%s %d out of range", what, v)
		return 0
	}
	return int(v)
}

// count reads a count of items of at least size bytes each, which must fit in what is left.
func (r *reader) count(what string, size int) int {
	n := r.uvarint(what)
	if n > uint64(len(r.b)/size) {
		r.fail("%s: %d items in %d bytes", what, n, len(r.b))
		return 0
	}
	return int(n)
}

func (r *reader) byte(what string) byte {
	if len(r.b) < 1 {
		r.fail("%s: truncated", what)
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

func (r *reader) uint64(what string) uint64 {
	if len(r.b) < 8 {
		r.fail("%s: truncated", what)
		return 0
	}
	v := binary.LittleEndian.Uint64(r.b)
	r.b = r.b[8:]
	return v
}

// bytes reads a length-prefixed string of at most MaxStringBytes; the result aliases the payload.
func (r *reader) bytes(what string) []byte {
	n := r.uvarint(what)
	if n > MaxStringBytes || n > uint64(len(r.b)) {
		r.fail("%s: length %d", what, n)
		return nil
	}
	s := r.b[:n]
	r.b = r.b[n:]
	return s
}

// str reads a string, reusing prev when equal (no allocation).
func (r *reader) str(what, prev string) string {
	b := r.bytes(what)
	if string(b) == prev {
		return prev
	}
	return string(b)
}

// DecodeMessage decodes data, an AppendMessage encoding, into m, reusing m's storage. The error
// wraps ErrMalformed: the payload is not a message of a known version, is truncated, has trailing
// bytes, or breaks a limit (MaxMessageBytes, MaxStringBytes, MaxBlockSize); m's content is then
// undefined. It never panics, and allocates at most a few times len(data).
func DecodeMessage(data []byte, m *Message) error {
	if len(data) > MaxMessageBytes {
		return fmt.Errorf("%w: %d bytes, over %d", ErrMalformed, len(data), MaxMessageBytes)
	}
	if len(data) < len(wireMagic)+1 || string(data[:len(wireMagic)]) != wireMagic {
		return fmt.Errorf("%w: not an event-log message", ErrMalformed)
	}
	if v := data[len(wireMagic)]; v != wireVersion {
		return fmt.Errorf("%w: version %d, want %d", ErrMalformed, v, wireVersion)
	}
	r := reader{b: data[len(wireMagic)+1:]}
	flags := r.uvarint("flags")
	if flags&^flagsKnown != 0 {
		r.fail("unknown flags %#x", flags)
	}
	m.Clear = flags&flagClear != 0
	m.Backend = r.str("backend", m.Backend)
	b := &m.Batch
	b.Model = r.str("model", b.Model)
	b.Seq = r.uvarint("seq")
	b.TS = math.Float64frombits(r.uint64("ts"))
	b.DPRank = r.int("dp rank", math.MinInt32, math.MaxInt32)
	b.HasDPRank = flags&flagDPRank != 0
	n := r.count("events", 2)
	if r.err != nil {
		return r.err
	}
	if cap(b.Events) < n {
		b.Events = make([]events.Event, n)
	}
	b.Events = b.Events[:n]
	m.hashes, m.tokens, m.extras = m.hashes[:0], m.tokens[:0], m.extras[:0]
	for i := range b.Events {
		ev := &b.Events[i]
		lora, salt, prefix := ev.LoRAName, ev.CacheSalt, ev.PrefixHash
		*ev = events.Event{Kind: events.Kind(r.byte("kind"))}
		mask := r.uvarint("field mask")
		if mask&^fKnown != 0 {
			r.fail("event %d: unknown fields %#x", i, mask)
		}
		if mask&fHashes != 0 {
			ev.BlockHashes = m.readUint64s(&r, "block hashes")
		}
		if mask&fParent != 0 {
			ev.Parent, ev.HasParent = r.uint64("parent"), true
		}
		if mask&fTokens != 0 {
			k := r.count("tokens", 1)
			from := len(m.tokens)
			for range k {
				t := r.uvarint("token")
				if t > math.MaxUint32 {
					r.fail("token %d over 32 bits", t)
				}
				m.tokens = append(m.tokens, uint32(t))
			}
			ev.TokenIDs = m.tokens[from:len(m.tokens):len(m.tokens)]
		}
		if mask&fBlockSize != 0 {
			bs := r.uvarint("block size")
			if bs > MaxBlockSize {
				r.fail("block size %d over %d", bs, MaxBlockSize)
			}
			ev.BlockSize = int(bs)
		}
		if mask&fLoRA != 0 {
			ev.LoRAName = r.str("lora name", lora)
		}
		if mask&fTier != 0 {
			ev.Tier = events.Tier(r.byte("tier"))
		}
		if mask&fExtra != 0 {
			k := r.count("extra keys", 1)
			from := len(m.extras)
			for range k {
				m.extras = append(m.extras, m.readUint64s(&r, "extra key set"))
			}
			ev.ExtraKeys = m.extras[from:len(m.extras):len(m.extras)]
		}
		if mask&fSalt != 0 {
			ev.CacheSalt = r.str("cache salt", salt)
		}
		if mask&fGroup != 0 {
			ev.GroupIdx = r.int("group", math.MinInt32, math.MaxInt32)
		}
		if mask&fPrefixOp != 0 {
			ev.PrefixOp = events.PrefixOp(r.byte("prefix op"))
		}
		if mask&fPrefixHash != 0 {
			ev.PrefixHash = r.str("prefix hash", prefix)
		}
		if mask&fTokenCount != 0 {
			ev.TokenCount = r.int("token count", math.MinInt32, math.MaxInt32)
		}
		if r.err != nil {
			return r.err
		}
	}
	if len(r.b) != 0 {
		return fmt.Errorf("%w: %d trailing bytes", ErrMalformed, len(r.b))
	}
	return nil
}

// readUint64s reads a counted run of 8-byte values into m's hash storage.
func (m *Message) readUint64s(r *reader, what string) []uint64 {
	k := r.count(what, 8)
	from := len(m.hashes)
	for range k {
		m.hashes = append(m.hashes, r.uint64(what))
	}
	return m.hashes[from:len(m.hashes):len(m.hashes)]
}
