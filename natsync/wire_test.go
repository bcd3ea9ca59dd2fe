package natsync

import (
	"encoding/binary"
	"encoding/hex"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute"
)

// keys returns n block keys that look like hashes.
func keys(seed uint64, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		seed = seed*6364136223846793005 + 1442695040888963407
		out[i] = seed
	}
	return out
}

func sampleEvents() []kvroute.PeerEvent {
	return []kvroute.PeerEvent{
		{Kind: kvroute.PeerRouted, ID: 1, Backend: "vllm-0", BlockKeys: keys(1, 128), CachedBlocks: 100, PrefillTokens: 448},
		{Kind: kvroute.PeerRouted, ID: 2, Backend: "b"},
		{Kind: kvroute.PeerFirstToken, ID: 1},
		{Kind: kvroute.PeerDone, ID: 1},
		{Kind: kvroute.PeerRouted, ID: 1 << 63, Backend: "", BlockKeys: []uint64{0, ^uint64(0)}, CachedBlocks: 2, PrefillTokens: 1<<31 - 1},
		{Kind: kvroute.PeerDone, ID: ^uint64(0)},
	}
}

func decodeAll(t *testing.T, msg []byte) (header, []kvroute.PeerEvent) {
	t.Helper()
	h, body, err := decodeHeader(msg)
	require.NoError(t, err)
	var evs []kvroute.PeerEvent
	if h.typ == msgEvents {
		evs, err = decodeEvents(body, nil, nil)
		require.NoError(t, err)
	}
	return h, evs
}

func TestWireRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		name   string
		typ    byte
		events []kvroute.PeerEvent
	}{
		{"events", msgEvents, sampleEvents()},
		{"one done", msgEvents, []kvroute.PeerEvent{{Kind: kvroute.PeerDone, ID: 7}}},
		{"heartbeat", msgHeartbeat, nil},
		{"goodbye", msgGoodbye, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			msg := encodeMessage(tc.typ, "replica-a", 42, tc.events)
			h, evs := decodeAll(t, msg)
			assert.Equal(t, tc.typ, h.typ)
			assert.Equal(t, "replica-a", string(h.replica))
			assert.Equal(t, uint64(42), h.seq)
			assert.Equal(t, tc.events, evs)
		})
	}
}

// The encoding only writes what the wire carries: a routed event's counts within their ranges,
// nothing but the id of a first token or done.
func TestWireCanonicalises(t *testing.T) {
	in := []kvroute.PeerEvent{
		{Kind: kvroute.PeerRouted, ID: 1, Backend: "a", BlockKeys: keys(2, 3), CachedBlocks: 9, PrefillTokens: -5},
		{Kind: kvroute.PeerDone, ID: 1, Backend: "a", BlockKeys: keys(2, 3), CachedBlocks: 9, PrefillTokens: 5},
	}
	_, evs := decodeAll(t, encodeMessage(msgEvents, "r", 1, in))
	assert.Equal(t, []kvroute.PeerEvent{
		{Kind: kvroute.PeerRouted, ID: 1, Backend: "a", BlockKeys: keys(2, 3), CachedBlocks: 3},
		{Kind: kvroute.PeerDone, ID: 1},
	}, evs)
}

// The version 1 encoding, pinned: a change to it must be deliberate (and bump WireVersion).
func TestWirePinned(t *testing.T) {
	msg := encodeMessage(msgEvents, "r1", 258, []kvroute.PeerEvent{
		{Kind: kvroute.PeerRouted, ID: 300, Backend: "a", BlockKeys: []uint64{0x0102030405060708}, CachedBlocks: 1, PrefillTokens: 200},
		{Kind: kvroute.PeerDone, ID: 300},
	})
	assert.Equal(t, "0101"+"02"+"7231"+"0201000000000000"+ // header: version, type, "r1", seq 258
		"01"+"ac02"+"01"+"61"+"01"+"0807060504030201"+"01"+"c801"+ // routed 300 to "a", 1 key, cached 1, prefill 200
		"03"+"ac02", // done 300
		hex.EncodeToString(msg))
	assert.Equal(t, "0102027231ffffffffffffffff", hex.EncodeToString(encodeMessage(msgHeartbeat, "r1", ^uint64(0), nil)))
	assert.Equal(t, "0103027231"+"0100000000000000", hex.EncodeToString(encodeMessage(msgGoodbye, "r1", 1, nil)))
}

func TestWireRejects(t *testing.T) {
	good := encodeMessage(msgEvents, "r", 1, sampleEvents()[:1])
	hdr := encodeMessage(msgEvents, "r", 1, nil)
	routed := func(rest ...byte) []byte { // a routed event's fields after its backend
		return append(append(append([]byte{}, hdr...), 1, 5, 1, 'a'), rest...)
	}
	for _, tc := range []struct {
		name string
		msg  []byte
		err  error
	}{
		{"empty", nil, errShort},
		{"version only", []byte{1}, errShort},
		{"version 2", []byte{2, 1, 1, 'r', 0, 0, 0, 0, 0, 0, 0, 0, 1, 1}, errVersion},
		{"type 0", []byte{1, 0, 1, 'r', 0, 0, 0, 0, 0, 0, 0, 0}, errType},
		{"type 4", []byte{1, 4, 1, 'r', 0, 0, 0, 0, 0, 0, 0, 0}, errType},
		{"no replica", []byte{1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0}, errReplica},
		{"replica too long", append([]byte{1, 2, 0x80, 2}, make([]byte, 256+8)...), errReplica},
		{"bad replica varint", []byte{1, 2, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80}, errVarint},
		{"short sequence", []byte{1, 2, 1, 'r', 0, 0, 0}, errShort},
		{"heartbeat with a body", append(encodeMessage(msgHeartbeat, "r", 1, nil), 0), errTrailing},
		{"events without events", hdr, errEmpty},
		{"kind 0", append(append([]byte{}, hdr...), 0, 1), errKind},
		{"kind 4", append(append([]byte{}, hdr...), 4, 1), errKind},
		{"no id", append(append([]byte{}, hdr...), 3), errShort},
		{"backend too long", append(append([]byte{}, hdr...), 1, 1, 0x81, 0x08), errBackend},
		{"short backend", append(append([]byte{}, hdr...), 1, 1, 5, 'a'), errShort},
		{"too many keys", routed(0x81, 0x80, 0x04), errKeys},
		{"huge key count", routed(0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01), errKeys},
		{"short keys", routed(2, 1, 2, 3, 4, 5, 6, 7, 8, 9), errShort},
		{"no counts", routed(0), errShort},
		{"cached above keys", routed(0, 1, 0), errCached},
		{"prefill too large", routed(0, 0, 0x80, 0x80, 0x80, 0x80, 0x08), errPrefill},
		{"trailing byte", append(append([]byte{}, good...), 9), errKind},
		{"truncated", good[:len(good)-1], errShort},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, body, err := decodeHeader(tc.msg)
			if err == nil && h.typ == msgEvents {
				var evs []kvroute.PeerEvent
				evs, err = decodeEvents(body, nil, nil)
				assert.Empty(t, evs)
			}
			assert.ErrorIs(t, err, tc.err)
		})
	}
}

func TestWireTooManyEvents(t *testing.T) {
	evs := make([]kvroute.PeerEvent, MaxEventsPerMessage+1)
	for i := range evs {
		evs[i] = kvroute.PeerEvent{Kind: kvroute.PeerDone, ID: uint64(i)}
	}
	_, body, err := decodeHeader(encodeMessage(msgEvents, "r", 1, evs))
	require.NoError(t, err)
	_, err = decodeEvents(body, nil, nil)
	assert.ErrorIs(t, err, errEvents)
	_, body, err = decodeHeader(encodeMessage(msgEvents, "r", 1, evs[:MaxEventsPerMessage]))
	require.NoError(t, err)
	got, err := decodeEvents(body, nil, nil)
	assert.NoError(t, err)
	assert.Len(t, got, MaxEventsPerMessage)
}

// FuzzDecode: decoding never panics, and whatever decodes encodes back to the same message.
func FuzzDecode(f *testing.F) {
	f.Add(encodeMessage(msgEvents, "replica-a", 1, sampleEvents()))
	f.Add(encodeMessage(msgHeartbeat, "b", 2, nil))
	f.Add(encodeMessage(msgGoodbye, "c", 3, nil))
	f.Add([]byte{1, 1, 1, 'r', 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0xff, 0xff, 0x03})
	f.Fuzz(func(t *testing.T, msg []byte) {
		h, body, err := decodeHeader(msg)
		if err != nil {
			return
		}
		var evs []kvroute.PeerEvent
		if h.typ == msgEvents {
			if evs, err = decodeEvents(body, nil, nil); err != nil {
				return
			}
		}
		again := encodeMessage(h.typ, string(h.replica), h.seq, evs)
		h2, body2, err := decodeHeader(again)
		require.NoError(t, err)
		assert.Equal(t, h, h2)
		if h.typ == msgEvents {
			evs2, err := decodeEvents(body2, nil, nil)
			require.NoError(t, err)
			assert.Equal(t, evs, evs2)
			assert.LessOrEqual(t, len(again), len(msg), "the encoding is minimal")
		}
	})
}

func TestHeaderLen(t *testing.T) {
	for _, n := range []int{1, 127, 128, MaxReplicaIDLen} {
		id := string(make([]byte, n))
		b := encodeMessage(msgHeartbeat, id, 1, nil)
		assert.Len(t, b, headerLen(id))
		assert.Equal(t, uint64(1), binary.LittleEndian.Uint64(b[len(b)-8:]))
	}
}
