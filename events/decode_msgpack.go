package events

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"unsafe"

	"github.com/zeebo/xxh3"
)

// Causes of decode failures. Callers branch on ErrMalformed, which every returned error wraps;
// these only make the messages precise and are never returned unwrapped.
var (
	errTruncated     = errors.New("truncated value")
	errBadFormat     = errors.New("invalid msgpack type byte")
	errTooLong       = errors.New("length exceeds the payload")
	errTrailing      = errors.New("trailing bytes after the batch")
	errNotBatch      = errors.New("not a batch (want an array of at least 2 or a map)")
	errNoEvents      = errors.New("batch has no events list")
	errWantArray     = errors.New("want an array")
	errWantInt       = errors.New("want an integer")
	errWantNumber    = errors.New("want a number")
	errWantString    = errors.New("want a string")
	errWantHash      = errors.New("want an integer or a byte string hash")
	errIntRange      = errors.New("integer out of range")
	errTokenRange    = errors.New("token id out of uint32 range")
	errNotEvent      = errors.New("event is neither an array nor a map")
	errUnknownType   = errors.New("unknown event type")
	errMissingField  = errors.New("missing required field")
	errBlockSize     = errors.New("token_ids do not hold block_size tokens per block")
	errExtraKeysSize = errors.New("extra_keys does not have one entry per block")
	errAmplified     = errors.New("decoded batch would exceed its allocation budget")
)

// Allocation budget of one DecodeMsgpackBatch call: the decoded form of a payload of n bytes may
// take at most decodeFactor × n + decodeSlack bytes. Every slice and string the decoder could
// allocate is charged against it before it is allocated, at its full size, whether or not the
// Batch's reused storage already has room: the charge depends on the payload alone, so that a
// fresh and a reused Batch accept the same payloads.
//
// The per-event cost is what binds: an Event slot is eventSize (184) bytes, and the shortest
// event the decoder keeps is minEventBytes (["BlockRemoved", []]), so a batch of minimal events
// would decode to 12× its size. Real batches stay well under the factor: a BlockStored event of
// 16 blocks of 16 tokens is about 1 KiB on the wire and 0.5 KiB decoded; a single-block
// BlockRemoved with a 64-bit hash, the densest real event, 28 bytes and 192 — the slack covers
// about 13,000 of them in a batch of nothing else.
const (
	decodeFactor  = 4
	decodeSlack   = 1 << 20
	eventSize     = int(unsafe.Sizeof(Event{}))
	minEventBytes = 15 // array header, fixstr "BlockRemoved", empty block_hashes
)

// MessagePack type bytes (https://github.com/msgpack/msgpack/blob/master/spec.md).
const (
	mpPosFixintMax = 0x7f
	mpFixmap       = 0x80 // 0x80-0x8f
	mpFixarray     = 0x90 // 0x90-0x9f
	mpFixstr       = 0xa0 // 0xa0-0xbf
	mpNil          = 0xc0
	mpUnused       = 0xc1
	mpFalse        = 0xc2
	mpTrue         = 0xc3
	mpBin8         = 0xc4
	mpBin16        = 0xc5
	mpBin32        = 0xc6
	mpExt8         = 0xc7
	mpExt16        = 0xc8
	mpExt32        = 0xc9
	mpFloat32      = 0xca
	mpFloat64      = 0xcb
	mpUint8        = 0xcc
	mpUint16       = 0xcd
	mpUint32       = 0xce
	mpUint64       = 0xcf
	mpInt8         = 0xd0
	mpInt16        = 0xd1
	mpInt32        = 0xd2
	mpInt64        = 0xd3
	mpFixext1      = 0xd4
	mpFixext2      = 0xd5
	mpFixext4      = 0xd6
	mpFixext8      = 0xd7
	mpFixext16     = 0xd8
	mpStr8         = 0xd9
	mpStr16        = 0xda
	mpStr32        = 0xdb
	mpArray16      = 0xdc
	mpArray32      = 0xdd
	mpMap16        = 0xde
	mpMap32        = 0xdf
	mpNegFixintMin = 0xe0 // 0xe0-0xff
)

// DecodeMsgpackBatch decodes one vLLM/SGLang KV-event payload (ZMQ frame 3) into b, reusing b's
// storage (b.Events and the slices inside are overwritten; b.Seq and b.Model are left alone for
// the caller to set). It sets b.TS, b.DPRank, b.HasDPRank and b.Events.
//
// Both encodings are accepted: the batch as an array [ts, events] or [ts, events,
// data_parallel_rank] or as a map {"ts", "events", "data_parallel_rank"} (unknown keys and
// extra trailing elements ignored; in the map form "attn_dp_rank" stands in for a missing
// "data_parallel_rank"), each event as a tagged array ["BlockStored", …] or as a map with a
// "type" key. Block hashes may be integers of any width and sign or byte strings; see Event.
//
// Events that are individually malformed or of an unknown type are skipped and counted in the
// returned int; the others keep their order. A payload that is not a batch at all (not an array
// or map, truncated, trailing bytes, no events list) returns skipped 0 and an error wrapping
// ErrMalformed, and leaves b.Events empty.
//
// Allocation is bounded by the payload: the decoded form may take at most 4 × len(payload) +
// 1 MiB. Every count is checked against the bytes left before anything is sized by it (an
// element takes at least one byte, an event at least 15), each slice is allocated once at its
// final size (the event slots too), and its size is charged against that budget first; a
// payload that would exceed it — minimal events, whose 184-byte Event slots would take 12× the
// wire bytes, or long arrays of 1-byte hashes — is rejected as a whole (an error wrapping
// ErrMalformed) before the allocation. Real batches decode to about their own size. The charge
// depends on the payload alone, so a fresh and a reused b accept the same payloads.
//
// In steady state (b reused for payloads of similar shape) it allocates nothing: event slots,
// their hash, token and extra-key slices, and LoRA-name and cache-salt strings equal to the
// slot's previous ones are reused. The returned events' slices alias b's storage and are valid
// until b is decoded into again. It does not retain payload.
//
// Safe for concurrent use on distinct batches; b must not be used concurrently.
func DecodeMsgpackBatch(payload []byte, b *Batch) (skipped int, err error) {
	r := mpReader{buf: payload, budget: math.MaxInt}
	if len(payload) < (math.MaxInt-decodeSlack)/decodeFactor {
		r.budget = decodeFactor*len(payload) + decodeSlack
	}
	b.TS, b.DPRank, b.HasDPRank = 0, 0, false
	b.Events = b.Events[:0]
	skipped, err = r.batch(b)
	if err == nil && r.off != len(payload) {
		err = errTrailing
	}
	if err != nil {
		b.Events = b.Events[:0]
		return 0, fmt.Errorf("%w: msgpack batch: %w (at byte %d of %d)", ErrMalformed, err, r.off, len(payload))
	}
	return skipped, nil
}

// ExtraKeyHash folds a multimodal identifier string into the uint64 used in Event.ExtraKeys
// (xxh3-64 of the string) — exported so request-side code builds identical MultiModalSpan.Hash
// values. Prompt-embedding digests (byte strings on the wire) fold the same way: xxh3-64 of their
// bytes. It is a pure function, safe for concurrent use.
func ExtraKeyHash(identifier string) uint64 {
	return xxh3.HashString(identifier)
}

// mpReader is a cursor over one msgpack value. Every read checks bounds and returns an error on
// short input; lengths are checked against the remaining bytes before anything is sized by them,
// so a hostile header cannot make the decoder allocate more than a small multiple of the payload.
type mpReader struct {
	buf []byte
	off int

	budget int  // bytes the decoded form may still take (see decodeFactor)
	over   bool // the budget was exceeded: the whole batch fails
}

// charge takes n bytes from the allocation budget, before they are allocated. Past the budget it
// fails, and the failure is sticky: the batch is rejected, not just the current event.
func (r *mpReader) charge(n int) error {
	if r.over || n > r.budget {
		r.over = true
		return errAmplified
	}
	r.budget -= n
	return nil
}

// peek returns the next type byte without consuming it.
func (r *mpReader) peek() (byte, error) {
	if r.off >= len(r.buf) {
		return 0, errTruncated
	}
	return r.buf[r.off], nil
}

// readNil consumes a nil and reports true when the next value is nil.
func (r *mpReader) readNil() bool {
	if r.off < len(r.buf) && r.buf[r.off] == mpNil {
		r.off++
		return true
	}
	return false
}

// uintN reads an n-byte big-endian unsigned integer (n is 1, 2, 4 or 8) after the type byte.
func (r *mpReader) uintN(n int) (uint64, error) {
	if len(r.buf)-r.off < n {
		return 0, errTruncated
	}
	p := r.buf[r.off : r.off+n]
	r.off += n
	switch n {
	case 1:
		return uint64(p[0]), nil
	case 2:
		return uint64(binary.BigEndian.Uint16(p)), nil
	case 4:
		return uint64(binary.BigEndian.Uint32(p)), nil
	default:
		return binary.BigEndian.Uint64(p), nil
	}
}

// containerLen reads an array (wantMap false) or map header and returns its element count.
// ok is false, with the cursor unchanged, when the next value is of another type. The count is
// checked against the remaining bytes (every element takes at least one byte).
func (r *mpReader) containerLen(wantMap bool) (n int, ok bool, err error) {
	c, err := r.peek()
	if err != nil {
		return 0, false, err
	}
	var size int
	switch {
	case !wantMap && c&0xf0 == mpFixarray:
		r.off++
		n = int(c & 0x0f)
	case wantMap && c&0xf0 == mpFixmap:
		r.off++
		n = int(c & 0x0f)
	case !wantMap && c == mpArray16, wantMap && c == mpMap16:
		size = 2
	case !wantMap && c == mpArray32, wantMap && c == mpMap32:
		size = 4
	default:
		return 0, false, nil
	}
	if size != 0 {
		r.off++
		v, err := r.uintN(size)
		if err != nil {
			return 0, false, err
		}
		if v > uint64(len(r.buf)-r.off) { // checked before int conversion: int may be 32 bits
			return 0, false, errTooLong
		}
		n = int(v)
	}
	if n > len(r.buf)-r.off || wantMap && 2*n > len(r.buf)-r.off {
		return 0, false, errTooLong
	}
	return n, true, nil
}

// arrayLen reads an array header; any other type is an error.
func (r *mpReader) arrayLen() (int, error) {
	n, ok, err := r.containerLen(false)
	if err == nil && !ok {
		err = errWantArray
	}
	return n, err
}

// raw reads a str (when str is true) or bin (when bin is true) value and returns its bytes,
// which alias the payload. ok is false, with the cursor unchanged, when the next value is of
// another type.
func (r *mpReader) raw(str, bin bool) (p []byte, ok bool, err error) {
	c, err := r.peek()
	if err != nil {
		return nil, false, err
	}
	var n, size int
	switch {
	case str && c&0xe0 == mpFixstr:
		n = int(c & 0x1f)
	case str && c == mpStr8, bin && c == mpBin8:
		size = 1
	case str && c == mpStr16, bin && c == mpBin16:
		size = 2
	case str && c == mpStr32, bin && c == mpBin32:
		size = 4
	default:
		return nil, false, nil
	}
	r.off++
	if size != 0 {
		v, err := r.uintN(size)
		if err != nil {
			return nil, false, err
		}
		if v > uint64(len(r.buf)-r.off) {
			return nil, false, errTooLong
		}
		n = int(v)
	}
	if n > len(r.buf)-r.off {
		return nil, false, errTooLong
	}
	p = r.buf[r.off : r.off+n : r.off+n]
	r.off += n
	return p, true, nil
}

// str reads a str value; any other type is an error.
func (r *mpReader) str() ([]byte, error) {
	p, ok, err := r.raw(true, false)
	if err == nil && !ok {
		err = errWantString
	}
	return p, err
}

// intBits reads an integer of any msgpack width and sign. It returns the value's 64-bit
// two's-complement bits and whether it is negative (so that uint64 values above MaxInt64 and
// negative int64 values, which share bit patterns, stay distinguishable). ok is false, with the
// cursor unchanged, when the next value is not an integer.
func (r *mpReader) intBits() (bits uint64, neg, ok bool, err error) {
	c, err := r.peek()
	if err != nil {
		return 0, false, false, err
	}
	switch {
	case c <= mpPosFixintMax:
		r.off++
		return uint64(c), false, true, nil
	case c >= mpNegFixintMin:
		r.off++
		return uint64(int64(int8(c))), true, true, nil
	case c >= mpUint8 && c <= mpUint64:
		r.off++
		v, err := r.uintN(1 << (c - mpUint8))
		return v, false, err == nil, err
	case c >= mpInt8 && c <= mpInt64:
		r.off++
		n := 1 << (c - mpInt8)
		v, err := r.uintN(n)
		if err != nil {
			return 0, false, false, err
		}
		// Sign-extend from n bytes.
		shift := 64 - 8*uint(n)
		s := int64(v<<shift) >> shift
		return uint64(s), s < 0, true, nil
	}
	return 0, false, false, nil
}

// int reads an integer that fits in an int.
func (r *mpReader) int() (int, error) {
	bits, neg, ok, err := r.intBits()
	switch {
	case err != nil:
		return 0, err
	case !ok:
		return 0, errWantInt
	case !neg && bits > math.MaxInt64, int64(bits) != int64(int(int64(bits))):
		return 0, errIntRange
	}
	return int(int64(bits)), nil
}

// optInt reads nil (present false) or an integer that fits in an int.
func (r *mpReader) optInt() (v int, present bool, err error) {
	if r.readNil() {
		return 0, false, nil
	}
	v, err = r.int()
	return v, err == nil, err
}

// number reads a float32, float64 or integer as a float64.
func (r *mpReader) number() (float64, error) {
	c, err := r.peek()
	if err != nil {
		return 0, err
	}
	switch c {
	case mpFloat32:
		r.off++
		v, err := r.uintN(4)
		return float64(math.Float32frombits(uint32(v))), err
	case mpFloat64:
		r.off++
		v, err := r.uintN(8)
		return math.Float64frombits(v), err
	}
	bits, neg, ok, err := r.intBits()
	switch {
	case err != nil:
		return 0, err
	case !ok:
		return 0, errWantNumber
	case neg:
		return float64(int64(bits)), nil
	default:
		return float64(bits), nil
	}
}

// hash reads a block hash: an integer of any width and sign (its 64-bit two's-complement value)
// or a str/bin digest (its last 8 bytes big-endian, left-padded with zeros when shorter).
func (r *mpReader) hash() (uint64, error) {
	if r.off < len(r.buf) && r.buf[r.off] <= mpPosFixintMax {
		v := uint64(r.buf[r.off])
		r.off++
		return v, nil
	}
	bits, _, ok, err := r.intBits()
	if err != nil {
		return 0, err
	}
	if ok {
		return bits, nil
	}
	p, ok, err := r.raw(true, true)
	if err != nil {
		return 0, err
	}
	if !ok {
		return 0, errWantHash
	}
	return digest64(p), nil
}

// digest64 folds a digest to its last 8 bytes read big-endian; shorter digests are left-padded
// with zeros.
func digest64(p []byte) uint64 {
	if len(p) >= 8 {
		return binary.BigEndian.Uint64(p[len(p)-8:])
	}
	var v uint64
	for _, c := range p {
		v = v<<8 | uint64(c)
	}
	return v
}

// skip consumes one value of any type, however deeply nested. It is iterative (a count of
// values still to skip), so nesting depth costs no stack; the count is bounded by the remaining
// bytes, so a hostile header fails fast instead of looping.
func (r *mpReader) skip() error {
	for pending := 1; pending > 0; pending-- {
		c, err := r.peek()
		if err != nil {
			return err
		}
		r.off++
		var n int // bytes of payload to jump over
		switch {
		case c <= mpPosFixintMax, c >= mpNegFixintMin, c == mpNil, c == mpFalse, c == mpTrue:
		case c&0xf0 == mpFixmap:
			pending += 2 * int(c&0x0f)
		case c&0xf0 == mpFixarray:
			pending += int(c & 0x0f)
		case c&0xe0 == mpFixstr:
			n = int(c & 0x1f)
		case c == mpUnused:
			r.off--
			return errBadFormat
		case c == mpBin8, c == mpStr8, c == mpExt8,
			c == mpBin16, c == mpStr16, c == mpExt16,
			c == mpBin32, c == mpStr32, c == mpExt32:
			size := 1
			switch c {
			case mpBin16, mpStr16, mpExt16:
				size = 2
			case mpBin32, mpStr32, mpExt32:
				size = 4
			}
			v, err := r.uintN(size)
			if err != nil {
				return err
			}
			if v > uint64(len(r.buf)-r.off) {
				return errTruncated
			}
			n = int(v)
		case c == mpFloat32:
			n = 4
		case c == mpFloat64:
			n = 8
		case c >= mpUint8 && c <= mpUint64:
			n = 1 << (c - mpUint8)
		case c >= mpInt8 && c <= mpInt64:
			n = 1 << (c - mpInt8)
		case c >= mpFixext1 && c <= mpFixext16:
			n = 1 << (c - mpFixext1)
		case c == mpArray16, c == mpMap16, c == mpArray32, c == mpMap32:
			size := 2
			if c == mpArray32 || c == mpMap32 {
				size = 4
			}
			v, err := r.uintN(size)
			if err != nil {
				return err
			}
			if c == mpMap16 || c == mpMap32 {
				v *= 2
			}
			if v > uint64(len(r.buf)-r.off) {
				return errTooLong
			}
			pending += int(v)
		}
		if c >= mpExt8 && c <= mpExt32 || c >= mpFixext1 && c <= mpFixext16 {
			n++ // the extension type byte
		}
		if n > len(r.buf)-r.off {
			return errTruncated
		}
		r.off += n
		if pending-1 > len(r.buf)-r.off {
			return errTooLong
		}
	}
	return nil
}

// batch decodes the batch envelope and its events into b.
func (r *mpReader) batch(b *Batch) (skipped int, err error) {
	n, ok, err := r.containerLen(false)
	if err != nil {
		return 0, err
	}
	if ok {
		if n < 2 {
			return 0, errNotBatch
		}
		if b.TS, err = r.number(); err != nil {
			return 0, err
		}
		if skipped, err = r.events(b); err != nil {
			return 0, err
		}
		if n >= 3 {
			if b.DPRank, b.HasDPRank, err = r.optInt(); err != nil {
				return 0, err
			}
		}
		for i := 3; i < n; i++ {
			if err := r.skip(); err != nil {
				return 0, err
			}
		}
		return skipped, nil
	}

	n, ok, err = r.containerLen(true)
	if err != nil {
		return 0, err
	}
	if !ok {
		return 0, errNotBatch
	}
	var sawEvents, sawDP bool
	attnRank, hasAttnRank := 0, false
	for i := 0; i < n; i++ {
		key, ok, err := r.raw(true, false)
		if err != nil {
			return 0, err
		}
		if !ok { // a non-string key: skip it and its value
			if err := r.skip(); err != nil {
				return 0, err
			}
			key = nil
		}
		switch string(key) {
		case "ts":
			b.TS, err = r.number()
		case "events":
			sawEvents = true
			skipped, err = r.events(b)
		case "data_parallel_rank":
			sawDP = true
			b.DPRank, b.HasDPRank, err = r.optInt()
		case "attn_dp_rank":
			attnRank, hasAttnRank, err = r.optInt()
		default:
			err = r.skip()
		}
		if err != nil {
			return 0, err
		}
	}
	if !sawEvents {
		return 0, errNoEvents
	}
	if !sawDP && hasAttnRank {
		b.DPRank, b.HasDPRank = attnRank, true
	}
	return skipped, nil
}

// events decodes the events list into b.Events, reusing its slots. A malformed event is skipped
// by re-reading it from its start as an opaque value; only a payload-level error (the event
// cannot even be skipped) aborts.
func (r *mpReader) events(b *Batch) (skipped int, err error) {
	n, err := r.arrayLen()
	if err != nil {
		return 0, err
	}
	// Size the slots once, for as many events as the header announces and the remaining bytes
	// can hold (the skipped ones hold none): appending would allocate up to 5× the final array.
	slots := min(n, (len(r.buf)-r.off)/minEventBytes)
	if err := r.charge(slots * eventSize); err != nil {
		return 0, err
	}
	evs := b.Events[:0]
	if cap(evs) < slots {
		evs = make([]Event, 0, slots)
		copy(evs[:cap(b.Events)], b.Events[:cap(b.Events)]) // keep the old slots' storage
	}
	for i := 0; i < n; i++ {
		if len(evs) == cap(evs) { // only if an event were shorter than minEventBytes
			if err := r.charge(eventSize); err != nil {
				return 0, err
			}
			evs = append(evs, Event{})[:len(evs)]
		}
		ev := &evs[:len(evs)+1][len(evs)]
		start := r.off
		if err := r.event(ev); err != nil {
			if r.over {
				return 0, err
			}
			r.off = start
			if err := r.skip(); err != nil {
				b.Events = evs
				return 0, err
			}
			skipped++
			continue
		}
		evs = evs[:len(evs)+1]
	}
	b.Events = evs
	return skipped, nil
}

// eventState carries what an event's fields said until the event can be validated as a whole.
type eventState struct {
	haveHashes, haveTokens bool
	blockSize              int
	haveBlockSize          bool
	extraOff               int // offset of extra_keys, or -1
	loraName               []byte
	haveLoRA               bool
	oldLoRA, oldSalt       string // the slot's previous strings, reused when equal
}

// event decodes one event (array or map form) into ev, keeping ev's slices' storage.
func (r *mpReader) event(ev *Event) error {
	st := eventState{extraOff: -1, oldLoRA: ev.LoRAName, oldSalt: ev.CacheSalt}
	*ev = Event{
		BlockHashes: ev.BlockHashes[:0],
		TokenIDs:    ev.TokenIDs[:0],
		ExtraKeys:   ev.ExtraKeys[:0],
	}
	n, ok, err := r.containerLen(false)
	if err != nil {
		return err
	}
	if ok {
		err = r.eventArray(n, ev, &st)
	} else {
		n, ok, err = r.containerLen(true)
		if err != nil {
			return err
		}
		if !ok {
			return errNotEvent
		}
		err = r.eventMap(n, ev, &st)
	}
	if err != nil {
		return err
	}
	return r.finish(ev, &st)
}

// kindOf maps a wire type tag to a Kind; 0 for an unknown tag.
func kindOf(tag []byte) Kind {
	switch string(tag) {
	case "BlockStored":
		return KindBlockStored
	case "BlockRemoved":
		return KindBlockRemoved
	case "AllBlocksCleared":
		return KindAllBlocksCleared
	}
	return 0
}

// Field numbers: the positions of the array form's BlockStored fields, also used to dispatch
// map keys.
const (
	fBlockHashes = iota + 1
	fParent
	fTokenIDs
	fBlockSize
	fLoRAID
	fMedium
	fLoRAName
	fExtraKeys
	fGroupIdx
	fOther // kv_cache_spec_kind, kv_cache_spec_sliding_window, anything unknown
)

// eventArray decodes the tagged array form: [tag, field1, field2, …].
func (r *mpReader) eventArray(n int, ev *Event, st *eventState) error {
	if n == 0 {
		return errUnknownType
	}
	tag, err := r.str()
	if err != nil {
		return err
	}
	if ev.Kind = kindOf(tag); ev.Kind == 0 {
		return errUnknownType
	}
	for i := 1; i < n; i++ {
		f := fOther
		switch ev.Kind {
		case KindBlockStored:
			if i < fOther {
				f = i
			}
		case KindBlockRemoved: // ["BlockRemoved", block_hashes, medium, group_idx]
			switch i {
			case 1:
				f = fBlockHashes
			case 2:
				f = fMedium
			case 3:
				f = fGroupIdx
			}
		}
		if err := r.field(f, ev, st); err != nil {
			return err
		}
	}
	return nil
}

// eventMap decodes the map form: {"type": tag, "block_hashes": …, …}; unknown keys are skipped.
func (r *mpReader) eventMap(n int, ev *Event, st *eventState) error {
	haveType := false
	for i := 0; i < n; i++ {
		key, ok, err := r.raw(true, false)
		if err != nil {
			return err
		}
		if !ok {
			if err := r.skip(); err != nil {
				return err
			}
			if err := r.skip(); err != nil {
				return err
			}
			continue
		}
		f := fOther
		switch string(key) {
		case "type":
			tag, err := r.str()
			if err != nil {
				return err
			}
			ev.Kind, haveType = kindOf(tag), true
			continue
		case "block_hashes":
			f = fBlockHashes
		case "parent_block_hash":
			f = fParent
		case "token_ids":
			f = fTokenIDs
		case "block_size":
			f = fBlockSize
		case "lora_id":
			f = fLoRAID
		case "medium":
			f = fMedium
		case "lora_name":
			f = fLoRAName
		case "extra_keys":
			f = fExtraKeys
		case "group_idx":
			f = fGroupIdx
		}
		if err := r.field(f, ev, st); err != nil {
			return err
		}
	}
	if !haveType || ev.Kind == 0 {
		return errUnknownType
	}
	return nil
}

// field decodes one field's value into ev or st.
func (r *mpReader) field(f int, ev *Event, st *eventState) error {
	var err error
	switch f {
	case fBlockHashes:
		st.haveHashes = true
		ev.BlockHashes, err = r.hashes(ev.BlockHashes[:0])
	case fParent:
		if !r.readNil() {
			ev.Parent, err = r.hash()
			ev.HasParent = ev.Parent != 0
		}
	case fTokenIDs:
		st.haveTokens = true
		ev.TokenIDs, err = r.tokens(ev.TokenIDs[:0])
	case fBlockSize:
		st.blockSize, st.haveBlockSize, err = r.optInt()
	case fMedium:
		if !r.readNil() {
			m, ok, e := r.raw(true, true)
			if e == nil && !ok {
				e = errWantString
			}
			ev.Tier, err = parseMediumBytes(m), e
		}
	case fLoRAName:
		st.loraName, st.haveLoRA = nil, false
		if !r.readNil() {
			st.loraName, err = r.str()
			st.haveLoRA = err == nil
		}
	case fExtraKeys:
		st.extraOff = r.off
		err = r.skip()
	case fGroupIdx:
		ev.GroupIdx, _, err = r.optInt()
	default: // lora_id (deprecated), kv_cache_spec_*, unknown
		err = r.skip()
	}
	return err
}

// parseMediumBytes is ParseMedium on wire bytes, without allocating for short media.
func parseMediumBytes(m []byte) Tier {
	if len(m) > 16 { // longer than any spelling of "gpu" or "cpu", folded or not
		return TierStorage
	}
	return ParseMedium(string(m))
}

// hashes reads an array of block hashes into dst.
func (r *mpReader) hashes(dst []uint64) ([]uint64, error) {
	n, err := r.arrayLen()
	if err != nil {
		return dst, err
	}
	if err := r.charge(8 * n); err != nil {
		return dst, err
	}
	if cap(dst) < n {
		dst = make([]uint64, 0, n)
	}
	dst = dst[:n]
	for i := range dst {
		// Fast path: a full-width hash, what 64-bit hashes nearly always need.
		if off := r.off; off+9 <= len(r.buf) && r.buf[off] == mpUint64 {
			dst[i] = binary.BigEndian.Uint64(r.buf[off+1:])
			r.off = off + 9
			continue
		}
		if dst[i], err = r.hash(); err != nil {
			return dst[:0], err
		}
	}
	return dst, nil
}

// tokens reads an array of token ids (integers in uint32 range) into dst.
func (r *mpReader) tokens(dst []uint32) ([]uint32, error) {
	n, err := r.arrayLen()
	if err != nil {
		return dst, err
	}
	if err := r.charge(4 * n); err != nil {
		return dst, err
	}
	if cap(dst) < n {
		dst = make([]uint32, 0, n)
	}
	dst = dst[:n]
	for i := 0; i < n; {
		k, off := tokensFast(r.buf, r.off, dst[i:])
		i += k
		r.off = off
		if i == n {
			break
		}
		// A token tokensFast leaves: uint64, a signed encoding, or one near the payload's end.
		bits, neg, ok, err := r.intBits()
		switch {
		case err != nil:
			return dst[:0], err
		case !ok:
			return dst[:0], errWantInt
		case neg || bits > math.MaxUint32:
			return dst[:0], errTokenRange
		}
		dst[i] = uint32(bits)
		i++
	}
	return dst, nil
}

// tokensFast decodes positive fixint, uint8, uint16 and uint32 tokens into dst from buf[off:]
// until dst is full, another encoding comes, or fewer than 5 bytes remain. It returns how many
// it decoded and the offset after them.
//
// Token ids mix uint16 and uint32 encodings unpredictably, so the width is computed rather than
// branched on: read the 4 bytes after the type byte, keep the first 1, 2 or 4. That costs a
// dependency from each type byte to the next token's offset, but no mispredictions; it measured
// faster than a switch on the type byte on realistic (non-repeating) data.
func tokensFast(buf []byte, off int, dst []uint32) (int, int) {
	for i := range dst {
		if off < 0 || off+5 > len(buf) {
			return i, off
		}
		p := buf[off : off+5 : off+5]
		c := p[0]
		if c <= mpPosFixintMax {
			dst[i] = uint32(c)
			off++
			continue
		}
		if c-mpUint8 > mpUint32-mpUint8 {
			return i, off
		}
		w := 1 << (c & 3) // width in bytes: 1, 2, 4 for uint8 (0xcc), uint16 (0xcd), uint32 (0xce)
		v := uint32(p[1])<<24 | uint32(p[2])<<16 | uint32(p[3])<<8 | uint32(p[4])
		dst[i] = v >> ((32 - 8*w) & 31)
		off += 1 + w
	}
	return len(dst), off
}

// finish validates an event as a whole, fills what depends on several fields (block size,
// extra keys, LoRA name) and clears what its kind does not use.
func (r *mpReader) finish(ev *Event, st *eventState) error {
	switch ev.Kind {
	case KindAllBlocksCleared:
		*ev = Event{
			Kind:        KindAllBlocksCleared,
			BlockHashes: ev.BlockHashes[:0],
			TokenIDs:    ev.TokenIDs[:0],
			ExtraKeys:   ev.ExtraKeys[:0],
		}
		return nil
	case KindBlockRemoved:
		if !st.haveHashes {
			return errMissingField
		}
		ev.Parent, ev.HasParent, ev.BlockSize = 0, false, 0
		ev.TokenIDs = ev.TokenIDs[:0]
		return nil
	}

	// KindBlockStored.
	if !st.haveHashes || !st.haveTokens {
		return errMissingField
	}
	nb, nt := len(ev.BlockHashes), len(ev.TokenIDs)
	switch {
	case st.haveBlockSize:
		if st.blockSize < 0 || nb == 0 && nt != 0 || nb != 0 && (st.blockSize == 0 || nt%nb != 0 || nt/nb != st.blockSize) {
			return errBlockSize
		}
		ev.BlockSize = st.blockSize
	case nb == 0:
		if nt != 0 {
			return errBlockSize
		}
	default:
		if nt == 0 || nt%nb != 0 {
			return errBlockSize
		}
		ev.BlockSize = nt / nb
	}
	if st.haveLoRA {
		if err := r.charge(len(st.loraName)); err != nil {
			return err
		}
		ev.LoRAName = reuseString(st.oldLoRA, st.loraName)
	}
	if st.extraOff >= 0 {
		return r.extraKeys(ev, st)
	}
	return nil
}

// reuseString returns old when it equals p, else a new string of p: a slot that sees the same
// name batch after batch allocates it once.
func reuseString(old string, p []byte) string {
	if old == string(p) {
		return old
	}
	return string(p)
}

// extraKeys decodes the extra_keys field saved at st.extraOff: nil, or one entry per block, each
// nil or a list of items. A str item equal to the LoRA name is ignored; another str item in
// block 0 is the cache salt (the last one wins: vLLM lists the LoRA name before the salt); a
// [identifier, offset] pair is a multimodal item (ExtraKeyHash of the identifier); a bin item
// is a prompt-embedding digest (xxh3-64 of its bytes). Other items are ignored. When no block
// has a key, ev.ExtraKeys is left empty.
func (r *mpReader) extraKeys(ev *Event, st *eventState) error {
	sub := mpReader{buf: r.buf, off: st.extraOff, budget: r.budget, over: r.over}
	defer func() { r.budget, r.over = sub.budget, sub.over }()
	if sub.readNil() {
		return nil
	}
	n, err := sub.arrayLen()
	if err != nil {
		return err
	}
	if n != len(ev.BlockHashes) {
		return errExtraKeysSize
	}
	// One allocation for the per-block slices and at most one per block, each charged first:
	// an entry costs a 24-byte slice header however short it is on the wire.
	if err := sub.charge(n * int(unsafe.Sizeof([]uint64(nil)))); err != nil {
		return err
	}
	ek := ev.ExtraKeys[:0]
	if cap(ek) < n {
		ek = make([][]uint64, 0, n)
		copy(ek[:cap(ev.ExtraKeys)], ev.ExtraKeys[:cap(ev.ExtraKeys)]) // keep the old blocks' storage
	}
	var salt []byte
	haveSalt, found := false, false
	for blk := 0; blk < n; blk++ {
		ek = ek[:blk+1]
		ek[blk] = ek[blk][:0]
		if sub.readNil() {
			continue
		}
		m, ok, err := sub.containerLen(false)
		if err != nil {
			return err
		}
		if !ok { // an entry of an unknown shape
			if err := sub.skip(); err != nil {
				return err
			}
			continue
		}
		if m > 0 {
			if err := sub.charge(8 * m); err != nil {
				return err
			}
			if cap(ek[blk]) < m {
				ek[blk] = make([]uint64, 0, m)
			}
		}
		for j := 0; j < m; j++ {
			if s, ok, err := sub.raw(true, false); err != nil {
				return err
			} else if ok {
				if (!st.haveLoRA || string(s) != string(st.loraName)) && blk == 0 {
					salt, haveSalt = s, true
				}
				continue
			}
			if p, ok, err := sub.raw(false, true); err != nil {
				return err
			} else if ok {
				ek[blk] = append(ek[blk], xxh3.Hash(p))
				found = true
				continue
			}
			h, ok, err := sub.multimodal()
			if err != nil {
				return err
			}
			if ok {
				ek[blk] = append(ek[blk], h)
				found = true
			}
		}
	}
	if found {
		ev.ExtraKeys = ek
	} else {
		ev.ExtraKeys = ek[:0]
	}
	if haveSalt {
		if err := sub.charge(len(salt)); err != nil {
			return err
		}
		ev.CacheSalt = reuseString(st.oldSalt, salt)
	}
	return nil
}

// multimodal reads one extra-key item and reports whether it is an [identifier, offset] pair
// (identifier str or bin, offset an integer), returning ExtraKeyHash(identifier). Any other item
// is skipped with ok false.
func (r *mpReader) multimodal() (h uint64, ok bool, err error) {
	start := r.off
	n, isArray, err := r.containerLen(false)
	if err != nil {
		return 0, false, err
	}
	if isArray && n == 2 {
		id, isRaw, err := r.raw(true, true)
		if err != nil {
			return 0, false, err
		}
		if isRaw {
			if _, _, isInt, err := r.intBits(); err != nil {
				return 0, false, err
			} else if isInt {
				return xxh3.Hash(id), true, nil
			}
		}
	}
	r.off = start
	return 0, false, r.skip()
}
