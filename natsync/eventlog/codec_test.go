package eventlog_test

import (
	"bytes"
	"encoding/hex"
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/natsync/eventlog"
)

// typicalBatch is a vLLM batch: 16 blocks of 16 tokens stored after a parent, 4 blocks removed.
func typicalBatch() *events.Batch {
	hashes := make([]uint64, 16)
	toks := make([]uint32, 16*16)
	for i := range hashes {
		hashes[i] = 0x9e3779b97f4a7c15 * uint64(i+1)
	}
	for i := range toks {
		toks[i] = uint32(1000 + i*37%120000)
	}
	return &events.Batch{Model: "llama-3-8b", Seq: 4711, TS: 1767225600.25, Events: []events.Event{
		{Kind: events.KindBlockStored, BlockHashes: hashes, Parent: 42, HasParent: true, TokenIDs: toks, BlockSize: 16},
		{Kind: events.KindBlockRemoved, BlockHashes: []uint64{7, 8, 9, 10}, Tier: events.TierCPU},
	}}
}

func codecCases() []struct {
	name string
	m    eventlog.Message
} {
	return []struct {
		name string
		m    eventlog.Message
	}{
		{"typical", eventlog.Message{Backend: "vllm-0", Batch: *typicalBatch()}},
		{"clear_only", eventlog.Message{Backend: "10.0.0.1:8000", Clear: true}},
		{"every_field", eventlog.Message{Backend: "b", Clear: true, Batch: events.Batch{
			Model: "m", Seq: math.MaxUint64, TS: -1.5, DPRank: 3, HasDPRank: true,
			Events: []events.Event{
				{Kind: events.KindBlockStored, BlockHashes: []uint64{1, math.MaxUint64}, Parent: math.MaxUint64, HasParent: true,
					TokenIDs: []uint32{0, math.MaxUint32, 5, 6}, BlockSize: 2, LoRAName: "adapter", Tier: events.TierStorage,
					ExtraKeys: [][]uint64{{11, 12}, {13}}, CacheSalt: "salt", GroupIdx: -2},
				{Kind: events.KindAllBlocksCleared},
				{Kind: events.KindPrefix, PrefixOp: events.PrefixOffloaded, PrefixHash: "00ff", TokenCount: -7},
				{Kind: 200}, // unknown kinds travel: the index counts them
			}}}},
	}
}

// Every field survives the trip, and the encoding is deterministic.
func TestMessageRoundTrip(t *testing.T) {
	var got eventlog.Message
	for _, tc := range codecCases() {
		t.Run(tc.name, func(t *testing.T) {
			data, err := eventlog.AppendMessage(nil, &tc.m)
			require.NoError(t, err)
			again, err := eventlog.AppendMessage([]byte("prefix"), &tc.m)
			require.NoError(t, err)
			assert.Equal(t, data, again[len("prefix"):], "deterministic, appended")
			require.NoError(t, eventlog.DecodeMessage(data, &got))
			assert.Equal(t, tc.m.Backend, got.Backend)
			assert.Equal(t, tc.m.Clear, got.Clear)
			want := tc.m.Batch
			if len(want.Events) == 0 {
				want.Events = got.Batch.Events[:0] // the decoder's storage
			}
			assert.Equal(t, want, got.Batch)
		})
	}
}

// Pinned bytes of a small message: the wire format is versioned, and a change to it must be
// deliberate (bridges and consumers of several versions share a stream).
func TestMessagePinned(t *testing.T) {
	m := eventlog.Message{Backend: "v", Batch: events.Batch{Model: "m", Seq: 1, Events: []events.Event{
		{Kind: events.KindBlockRemoved, BlockHashes: []uint64{2}},
	}}}
	data, err := eventlog.AppendMessage(nil, &m)
	require.NoError(t, err)
	assert.Equal(t, "4b564501"+"00"+"0176"+"016d"+"01"+"0000000000000000"+"00"+"01"+
		"02"+"01"+"01"+"0200000000000000", hex.EncodeToString(data))
}

func TestMessageLimits(t *testing.T) {
	long := strings.Repeat("x", eventlog.MaxStringBytes+1)
	for _, m := range []eventlog.Message{
		{Backend: long},
		{Backend: "b", Batch: events.Batch{Model: long}},
		{Backend: "b", Batch: events.Batch{Events: []events.Event{{Kind: events.KindBlockStored, LoRAName: long}}}},
		{Backend: "b", Batch: events.Batch{Events: []events.Event{{Kind: events.KindBlockStored, BlockSize: -1}}}},
		{Backend: "b", Batch: events.Batch{Events: []events.Event{{Kind: events.KindBlockStored, TokenIDs: make([]uint32, eventlog.MaxMessageBytes)}}}},
	} {
		out, err := eventlog.AppendMessage([]byte("keep"), &m)
		assert.ErrorIs(t, err, eventlog.ErrTooLarge)
		assert.Equal(t, "keep", string(out))
	}
}

// Every truncation and every single-byte corruption of a valid message is an error or a valid
// message, never a panic; truncations are always errors.
func TestDecodeMalformed(t *testing.T) {
	var m eventlog.Message
	for _, tc := range codecCases() {
		data, err := eventlog.AppendMessage(nil, &tc.m)
		require.NoError(t, err)
		for n := range len(data) {
			assert.ErrorIs(t, eventlog.DecodeMessage(data[:n], &m), eventlog.ErrMalformed, "%s cut at %d", tc.name, n)
		}
		for i := range data {
			c := bytes.Clone(data)
			c[i] ^= 0xa5
			_ = eventlog.DecodeMessage(c, &m)
		}
		assert.ErrorIs(t, eventlog.DecodeMessage(append(bytes.Clone(data), 0), &m), eventlog.ErrMalformed, "trailing byte")
	}
	for name, data := range map[string][]byte{
		"empty":         nil,
		"other magic":   []byte("KVX\x01\x00"),
		"version 2":     []byte("KVE\x02\x00"),
		"unknown flags": []byte("KVE\x01\x80\x01"),
		"huge count":    []byte("KVE\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\xff\xff\xff\xff\x0f"),
		"oversized":     make([]byte, eventlog.MaxMessageBytes+1),
	} {
		assert.ErrorIs(t, eventlog.DecodeMessage(data, &m), eventlog.ErrMalformed, name)
	}
}

// FuzzDecodeBatch decodes arbitrary payloads: no panic, and whatever decodes encodes to the same
// bytes (the encoding is canonical, but for the zero-valued optional fields it leaves out).
func FuzzDecodeBatch(f *testing.F) {
	for _, tc := range codecCases() {
		data, err := eventlog.AppendMessage(nil, &tc.m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	f.Add([]byte("KVE\x01"))
	f.Fuzz(func(t *testing.T, data []byte) {
		var m eventlog.Message
		if err := eventlog.DecodeMessage(data, &m); err != nil {
			return
		}
		out, err := eventlog.AppendMessage(nil, &m)
		if err != nil {
			t.Fatalf("decoded message does not encode: %v", err)
		}
		var m2 eventlog.Message
		if err := eventlog.DecodeMessage(out, &m2); err != nil {
			t.Fatalf("re-encoded message does not decode: %v", err)
		}
		out2, _ := eventlog.AppendMessage(nil, &m2)
		if !bytes.Equal(out, out2) {
			t.Fatalf("encoding not stable:\n%x\n%x", out, out2)
		}
	})
}

func TestSubjectToken(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"vllm-0", "vllm-0"},
		{"pod_A-1", "pod_A-1"},
		{"", "~"},
		{"10.0.0.1:8000", "10~2e0~2e0~2e1~3a8000"},
		{"a.b", "a~2eb"},
		{"*>", "~2a~3e"},
		{"x y", "x~20y"},
		{"~", "~7e"},
		{"é", "~c3~a9"},
	} {
		t.Run(tc.want, func(t *testing.T) {
			got := eventlog.SubjectToken(tc.in)
			assert.Equal(t, tc.want, got)
			back, ok := eventlog.ParseSubjectToken(got)
			assert.True(t, ok)
			assert.Equal(t, tc.in, back)
		})
	}
	for _, bad := range []string{"", "~2", "~zz", "~61", "a~", "a.b", "a~2E"} {
		_, ok := eventlog.ParseSubjectToken(bad)
		assert.False(t, ok, bad)
	}
}
