package natsync

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/kvroute/kvroute"
)

// Wire format, version 1 (see the package documentation's "Wire format"). Every message is
//
//	version  1 byte, WireVersion
//	type     1 byte: 1 events, 2 heartbeat, 3 goodbye
//	replica  uvarint length (1 to MaxReplicaIDLen), then the sender's replica id
//	sequence 8 bytes, little endian: the sender's message count, from 1
//
// and, for an events message, one or more events until the end of the message:
//
//	kind     1 byte: 1 routed, 2 first_token, 3 done (kvroute.PeerEventKind)
//	id       uvarint
//	routed only:
//	  backend  uvarint length (0 to MaxBackendLen), then the backend's name
//	  keys     uvarint count (0 to MaxKeysPerEvent), then 8 bytes per key, little endian
//	  cached   uvarint, at most the key count
//	  prefill  uvarint, at most math.MaxInt32
//
// Heartbeats and goodbyes have no body. Block keys are hashes, as wide as their 64 bits, so they
// are written whole rather than as varints.

// WireVersion is the version byte that starts every message natsync sends. A message of another
// version is counted as a decode error and dropped: replicas of one group must speak the same
// version.
const WireVersion = 1

// Decoding limits. A message beyond them is malformed; PublishPeerEvent keeps within them (see
// Sync.PublishPeerEvent).
const (
	// MaxReplicaIDLen is the longest replica id, in bytes.
	MaxReplicaIDLen = 255
	// MaxBackendLen is the longest backend name an event may carry, in bytes.
	MaxBackendLen = 1024
	// MaxKeysPerEvent is the most block keys one event carries: 1 Mi tokens of 16-token blocks.
	MaxKeysPerEvent = 1 << 16
	// MaxEventsPerMessage is the most events one message carries.
	MaxEventsPerMessage = 1 << 14
)

// Message types.
const (
	msgEvents    byte = 1
	msgHeartbeat byte = 2
	msgGoodbye   byte = 3
)

// seqLen is the width of the sequence number: fixed, so that a Sync's header has one length and
// a batch can be encoded behind room left for it.
const seqLen = 8

// Decoding errors. They are counted (Stats.DecodeErrors), never returned to a caller.
var (
	errShort    = errors.New("truncated message")
	errVersion  = errors.New("unsupported wire version")
	errType     = errors.New("unknown message type")
	errReplica  = errors.New("replica id length out of range")
	errKind     = errors.New("unknown event kind")
	errBackend  = errors.New("backend name too long")
	errKeys     = errors.New("too many block keys")
	errCached   = errors.New("cached blocks above the key count")
	errPrefill  = errors.New("prefill tokens out of range")
	errTrailing = errors.New("bytes after the end of the message")
	errEmpty    = errors.New("events message without events")
	errEvents   = errors.New("too many events")
	errVarint   = errors.New("malformed varint")
)

// headerLen is the length of a message header from replica.
func headerLen(replica string) int {
	return 2 + uvarintLen(uint64(len(replica))) + len(replica) + seqLen
}

// putHeader writes a message header into b[:headerLen(replica)].
func putHeader(b []byte, typ byte, replica string, seq uint64) {
	b[0], b[1] = WireVersion, typ
	n := 2 + binary.PutUvarint(b[2:], uint64(len(replica)))
	n += copy(b[n:], replica)
	binary.LittleEndian.PutUint64(b[n:], seq)
}

// eventSize is the encoded length of ev with nkeys of its block keys.
func eventSize(ev *kvroute.PeerEvent, nkeys int) int {
	n := 1 + uvarintLen(ev.ID)
	if ev.Kind == kvroute.PeerRouted {
		cached, prefill := routedCounts(ev, nkeys)
		n += uvarintLen(uint64(len(ev.Backend))) + len(ev.Backend) +
			uvarintLen(uint64(nkeys)) + 8*nkeys + uvarintLen(cached) + uvarintLen(prefill)
	}
	return n
}

// routedCounts are ev's cached blocks and prefill tokens as the wire carries them: the cached
// blocks within [0, nkeys], the prefill tokens within [0, math.MaxInt32].
func routedCounts(ev *kvroute.PeerEvent, nkeys int) (cached, prefill uint64) {
	return uint64(min(max(ev.CachedBlocks, 0), nkeys)), uint64(min(max(ev.PrefillTokens, 0), math.MaxInt32))
}

// appendEvent appends ev, with the first nkeys of its block keys, to b. The fields a FirstToken
// or Done does not use are not written.
func appendEvent(b []byte, ev *kvroute.PeerEvent, nkeys int) []byte {
	b = append(b, byte(ev.Kind))
	b = binary.AppendUvarint(b, ev.ID)
	if ev.Kind != kvroute.PeerRouted {
		return b
	}
	cached, prefill := routedCounts(ev, nkeys)
	b = binary.AppendUvarint(b, uint64(len(ev.Backend)))
	b = append(b, ev.Backend...)
	b = binary.AppendUvarint(b, uint64(nkeys))
	for _, k := range ev.BlockKeys[:nkeys] {
		b = binary.LittleEndian.AppendUint64(b, k)
	}
	b = binary.AppendUvarint(b, cached)
	return binary.AppendUvarint(b, prefill)
}

// encodeMessage returns a whole message: the header, then events (for msgEvents). It is the
// reference encoder for tests; a Sync encodes its batches in place.
func encodeMessage(typ byte, replica string, seq uint64, events []kvroute.PeerEvent) []byte {
	b := make([]byte, headerLen(replica))
	putHeader(b, typ, replica, seq)
	for i := range events {
		b = appendEvent(b, &events[i], min(len(events[i].BlockKeys), MaxKeysPerEvent))
	}
	return b
}

// header is a decoded message header.
type header struct {
	typ     byte
	replica []byte // aliases the message
	seq     uint64
}

// decodeHeader parses the header of msg and returns it with the message's body.
func decodeHeader(msg []byte) (header, []byte, error) {
	var h header
	if len(msg) < 2 {
		return h, nil, errShort
	}
	if msg[0] != WireVersion {
		return h, nil, fmt.Errorf("%w %d", errVersion, msg[0])
	}
	h.typ = msg[1]
	if h.typ < msgEvents || h.typ > msgGoodbye {
		return h, nil, fmt.Errorf("%w %d", errType, h.typ)
	}
	n, rest, err := uvarint(msg[2:])
	if err != nil {
		return h, nil, err
	}
	if n == 0 || n > MaxReplicaIDLen {
		return h, nil, errReplica
	}
	if uint64(len(rest)) < n+seqLen {
		return h, nil, errShort
	}
	h.replica, rest = rest[:n], rest[n:]
	h.seq, rest = binary.LittleEndian.Uint64(rest), rest[seqLen:]
	if h.typ != msgEvents && len(rest) > 0 {
		return h, nil, errTrailing
	}
	return h, rest, nil
}

// decodeEvents parses an events message's body into dst[:0] and returns it. str makes the
// backend names' strings (nil: a plain conversion). Each event's BlockKeys is a slice of its own
// (nil when it has none). The whole body must be well-formed: on an error no event is returned.
func decodeEvents(body []byte, dst []kvroute.PeerEvent, str func([]byte) string) ([]kvroute.PeerEvent, error) {
	dst = dst[:0]
	if len(body) == 0 {
		return dst, errEmpty
	}
	for len(body) > 0 {
		if len(dst) == MaxEventsPerMessage {
			return dst[:0], errEvents
		}
		var ev kvroute.PeerEvent
		var err error
		ev.Kind = kvroute.PeerEventKind(body[0])
		if ev.Kind < kvroute.PeerRouted || ev.Kind > kvroute.PeerDone {
			return dst[:0], fmt.Errorf("%w %d", errKind, body[0])
		}
		if ev.ID, body, err = uvarint(body[1:]); err != nil {
			return dst[:0], err
		}
		if ev.Kind == kvroute.PeerRouted {
			if body, err = decodeRouted(body, &ev, str); err != nil {
				return dst[:0], err
			}
		}
		dst = append(dst, ev)
	}
	return dst, nil
}

// decodeRouted parses the fields of a routed event into ev and returns what follows them.
func decodeRouted(b []byte, ev *kvroute.PeerEvent, str func([]byte) string) ([]byte, error) {
	n, b, err := uvarint(b)
	if err != nil {
		return nil, err
	}
	if n > MaxBackendLen {
		return nil, errBackend
	}
	if uint64(len(b)) < n {
		return nil, errShort
	}
	if str != nil {
		ev.Backend = str(b[:n])
	} else {
		ev.Backend = string(b[:n])
	}
	b = b[n:]
	if n, b, err = uvarint(b); err != nil {
		return nil, err
	}
	if n > MaxKeysPerEvent {
		return nil, errKeys
	}
	if uint64(len(b)) < 8*n {
		return nil, errShort
	}
	if n > 0 {
		ks := make([]uint64, n)
		for i := range ks {
			ks[i] = binary.LittleEndian.Uint64(b[:8])
			b = b[8:]
		}
		ev.BlockKeys = ks
	}
	cached, b, err := uvarint(b)
	if err != nil {
		return nil, err
	}
	if cached > uint64(len(ev.BlockKeys)) {
		return nil, errCached
	}
	prefill, b, err := uvarint(b)
	if err != nil {
		return nil, err
	}
	if prefill > math.MaxInt32 {
		return nil, errPrefill
	}
	ev.CachedBlocks, ev.PrefillTokens = int(cached), int(prefill)
	return b, nil
}

// uvarint reads a uvarint from b and returns it with the rest of b.
func uvarint(b []byte) (uint64, []byte, error) {
	v, n := binary.Uvarint(b)
	switch {
	case n == 0:
		return 0, nil, errShort
	case n < 0:
		return 0, nil, errVarint
	}
	return v, b[n:], nil
}

// uvarintLen is the encoded length of v as a uvarint.
func uvarintLen(v uint64) int {
	n := 1
	for v >= 0x80 {
		v >>= 7
		n++
	}
	return n
}
