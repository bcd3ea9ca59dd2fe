package events

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
	"github.com/zeebo/xxh3"
)

// updateGolden regenerates testdata/*.msgpack from the fixture table below (encoded with
// vmihailenco/msgpack, independently of the decoder) and testdata/*.golden.json from the decoder's
// output: go test ./events -run 'TestMsgpackFixtures|TestMsgpackGolden' -update. Review the diff.
// The flag is shared with any other test of the package that defines -update first.
var updateGolden = boolFlag("update", "regenerate testdata fixtures and golden files")

// boolFlag defines a bool flag, or reuses one of that name another test file defined first.
func boolFlag(name, usage string) *bool {
	if f := flag.Lookup(name); f != nil {
		if g, ok := f.Value.(flag.Getter); ok {
			if p, ok := g.Get().(bool); ok {
				v := p
				return &v
			}
		}
	}
	return flag.Bool(name, false, usage)
}

// The fixture DSL: a Go value tree that mpEncode writes with the msgpack/v5 encoder. Plain int
// and uint64 take the smallest encoding (as msgspec and every engine write them); the named
// types below force one exact encoding.
type (
	mpI8  int8
	mpI16 int16
	mpI32 int32
	mpI64 int64
	mpU8  uint8
	mpU16 uint16
	mpU32 uint32
	mpU64 uint64
	mpF32 float32
	mpRaw []byte // appended verbatim: for payloads no encoder would write
	mpMap []mpKV // a map with its keys in this order
	mpKV  struct {
		K any
		V any
	}
)

// mpEncode encodes v with vmihailenco/msgpack.
func mpEncode(t testing.TB, v any) []byte {
	t.Helper()
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	mpWrite(t, enc, &buf, v)
	return buf.Bytes()
}

func mpWrite(t testing.TB, enc *msgpack.Encoder, buf *bytes.Buffer, v any) {
	t.Helper()
	var err error
	switch v := v.(type) {
	case nil:
		err = enc.EncodeNil()
	case bool:
		err = enc.EncodeBool(v)
	case int:
		err = enc.EncodeInt(int64(v))
	case uint64:
		err = enc.EncodeUint(v)
	case mpI8:
		err = enc.EncodeInt8(int8(v))
	case mpI16:
		err = enc.EncodeInt16(int16(v))
	case mpI32:
		err = enc.EncodeInt32(int32(v))
	case mpI64:
		err = enc.EncodeInt64(int64(v))
	case mpU8:
		err = enc.EncodeUint8(uint8(v))
	case mpU16:
		err = enc.EncodeUint16(uint16(v))
	case mpU32:
		err = enc.EncodeUint32(uint32(v))
	case mpU64:
		err = enc.EncodeUint64(uint64(v))
	case float64:
		err = enc.EncodeFloat64(v)
	case mpF32:
		err = enc.EncodeFloat32(float32(v))
	case string:
		err = enc.EncodeString(v)
	case []byte:
		err = enc.EncodeBytes(v)
	case mpRaw:
		buf.Write(v)
	case []any:
		err = enc.EncodeArrayLen(len(v))
		for _, e := range v {
			mpWrite(t, enc, buf, e)
		}
	case mpMap:
		err = enc.EncodeMapLen(len(v))
		for _, kv := range v {
			mpWrite(t, enc, buf, kv.K)
			mpWrite(t, enc, buf, kv.V)
		}
	default:
		t.Fatalf("mpEncode: unsupported %T", v)
	}
	if err != nil {
		t.Fatalf("mpEncode: %v", err)
	}
}

// arr builds a msgpack array.
func mpArr(v ...any) []any { return v }

// mpToks returns n realistic token ids (a 152k vocabulary: every msgpack width from fixint to
// uint32 occurs), deterministic in seed.
func mpToks(seed, n int) []any {
	out := make([]any, n)
	for i := range out {
		switch i % 4 {
		case 0:
			out[i] = (seed*31 + i) % 128 // fixint
		case 1:
			out[i] = 128 + (seed*7+i)%128 // uint8
		case 2:
			out[i] = 1000 + (seed*7919+i*104729)%60000 // uint16
		default:
			out[i] = 70000 + (seed*7919+i*104729)%82000 // uint32
		}
	}
	return out
}

// mpToksU32 is mpToks as the decoder should return them.
func mpToksU32(seed, n int) []uint32 {
	var out []uint32
	for _, v := range mpToks(seed, n) {
		out = append(out, uint32(v.(int)))
	}
	return out
}

// digest returns a 32-byte digest, as vLLM's sha256 block hashes.
func sha256Digest(s string) []byte {
	d := sha256.Sum256([]byte(s))
	return d[:]
}

// beLast8 reads the last 8 bytes of p big-endian, independently of the decoder's digest64.
func beLast8(p []byte) uint64 {
	var v uint64
	for _, c := range p[len(p)-8:] {
		v = v<<8 | uint64(c)
	}
	return v
}

// mpFixture is one testdata payload: name.msgpack, with name.golden.json its decoded form.
type mpFixture struct {
	name string
	v    any
}

// mpValidBatch is a small well-formed batch, the base of the truncated and trailing fixtures.
func mpValidBatch() any {
	return mpArr(1718000000.5, mpArr(
		mpArr("BlockStored", mpArr(11, 12), nil, mpToks(1, 8), 4, nil, "GPU"),
		mpArr("BlockRemoved", mpArr(11), "GPU"),
	), 0)
}

// mpFixtures lists every testdata payload. Changing it requires -update.
func mpFixtures(t testing.TB) []mpFixture {
	valid := mpEncode(t, mpValidBatch())
	return []mpFixture{
		{"array_three_kinds", mpArr(1718000000.25, mpArr(
			mpArr("BlockStored", mpArr(uint64(0x8a6f3e2d1c0b0a09), uint64(0x1122334455667788)), nil,
				mpToks(1, 32), 16, nil, "GPU", nil, nil, 0, "full_attention", nil),
			mpArr("BlockRemoved", mpArr(uint64(0x8a6f3e2d1c0b0a09)), "GPU", 0),
			mpArr("AllBlocksCleared"),
		), 0)},
		{"array_old_two_element", mpArr(1718000001.5, mpArr(
			mpArr("BlockStored", mpArr(7, 8, 9), 6, mpToks(2, 12), 4, nil),
			mpArr("BlockRemoved", mpArr(7)),
		))},
		{"map_form", mpMap{
			{"ts", 1718000002.0},
			{"events", mpArr(
				mpMap{{"type", "BlockStored"}, {"block_hashes", mpArr(uint64(1)<<40, 77)},
					{"parent_block_hash", nil}, {"token_ids", mpToks(3, 8)}, {"block_size", 4},
					{"lora_id", nil}, {"medium", "GPU"}, {"lora_name", nil}},
				mpMap{{"block_hashes", mpArr(500)}, {"token_ids", mpToks(4, 4)}, {"parent_block_hash", 77},
					{"type", "BlockStored"}}, // type last, block_size and medium omitted
				mpMap{{"type", "BlockRemoved"}, {"block_hashes", mpArr(500, 77)}, {"medium", "CPU"}},
				mpMap{{"type", "AllBlocksCleared"}},
			)},
			{"data_parallel_rank", 1},
		}},
		{"hash_widths", mpArr(mpF32(1718000003.0), mpArr(
			mpArr("BlockStored", mpArr(
				5, mpU8(200), mpU16(60000), mpU32(4000000000), mpU64(1<<63+12345),
				-3, mpI8(-100), mpI16(-30000), mpI32(-2000000000), mpI64(-(1<<62)-7),
				mpI64(42), mpU64(7),
			), mpI64(-1), mpToks(5, 12), 1),
			mpArr("BlockRemoved", mpArr(-3, mpI64(math.MinInt64), uint64(math.MaxUint64)), nil),
		), nil)},
		{"bytes_hashes", mpArr(1718000004, mpArr(
			mpArr("BlockStored", mpArr(sha256Digest("block-0"), sha256Digest("block-1")), sha256Digest("parent"), mpToks(6, 8), 4),
			mpArr("BlockStored", mpArr([]byte{0xde, 0xad, 0xbe, 0xef}, string(sha256Digest("str")[:16]), []byte{}), nil, mpToks(7, 3), 1),
			mpArr("BlockRemoved", mpArr(sha256Digest("block-0"))),
		))},
		{"parent_zero_and_nil", mpArr(1718000005.0, mpArr(
			mpArr("BlockStored", mpArr(21), 0, mpToks(8, 4), 4),
			mpArr("BlockStored", mpArr(22), nil, mpToks(9, 4), 4),
			mpArr("BlockStored", mpArr(23), mpU64(0), mpToks(10, 4), 4),
			mpMap{{"type", "BlockStored"}, {"block_hashes", mpArr(24)}, {"token_ids", mpToks(11, 4)}},
			mpArr("BlockStored", mpArr(25), 24, mpToks(12, 4), 4),
		))},
		{"trailing_fields_missing", mpArr(1718000006.0, mpArr(
			mpArr("BlockStored", mpArr(31, 32), 30, mpToks(13, 8)), // block_size inferred
			mpArr("BlockStored", mpArr(33), 32, mpToks(14, 16), 16),
			mpArr("BlockStored", mpArr(34), 33, mpToks(15, 16), 16, nil, "CPU"),
			mpArr("BlockRemoved", mpArr(31)),
			mpArr("BlockRemoved", mpArr(32), "CPU"),
		))},
		{"unknown_fields", mpMap{
			{"future_field", mpMap{{"nested", mpArr(1, 2, mpMap{{"x", []byte{1, 2, 3}}}, mpRaw{0xd4, 0x01, 0x02})}}},
			{"ts", 1718000007},
			{7, "non-string key"},
			{"events", mpArr(
				mpMap{{"type", "BlockStored"}, {"foo", mpArr(1, mpArr(2, 3))}, {"block_hashes", mpArr(41)},
					{"token_ids", mpToks(16, 4)}, {"block_size", 4}, {"kv_cache_spec_kind", "sliding_window"},
					{"kv_cache_spec_sliding_window", 4096}, {3, 4}, {"group_idx", 1}},
				mpArr("BlockStored", mpArr(42), 41, mpToks(17, 4), 4, nil, "GPU", nil, nil, 2, "full_attention", nil,
					"future-1", mpMap{{"future", true}}),
				mpArr("BlockRemoved", mpArr(42), "GPU", 2, "future"),
				mpArr("AllBlocksCleared", "future"),
			)},
			{"data_parallel_rank", nil},
			{"session_id", "abc"},
		}},
		{"array_extra_batch_fields", mpArr(mpF32(1.5), mpArr(mpArr("AllBlocksCleared")), 3, "future", mpMap{{"a", 1}})},
		{"medium_variants", mpArr(1718000008.0, mpArr(
			mpArr("BlockRemoved", mpArr(1), "cpu"),
			mpArr("BlockRemoved", mpArr(2), "CPU"),
			mpArr("BlockRemoved", mpArr(3), "disk"),
			mpArr("BlockRemoved", mpArr(4), nil),
			mpArr("BlockRemoved", mpArr(5), "GPU"),
			mpArr("BlockRemoved", mpArr(6), "gpu"),
			mpArr("BlockRemoved", mpArr(7), "LMCache"),
			mpArr("BlockRemoved", mpArr(8), []byte("Cpu")),
			mpMap{{"type", "BlockStored"}, {"block_hashes", mpArr(9)}, {"token_ids", mpToks(18, 2)}, {"medium", "Cpu"}},
		))},
		{"extra_keys", mpArr(1718000009.0, mpArr(
			mpArr("BlockStored", mpArr(51, 52, 53), nil, mpToks(19, 12), 4, nil, "GPU", "sql-lora", mpArr(
				mpArr("sql-lora", mpArr("img-abc", 0), "salt-42"),
				mpArr(mpArr("img-abc", 4), sha256Digest("prompt-embeds")),
				nil,
			)),
			mpArr("BlockStored", mpArr(54, 55), 53, mpToks(20, 8), 4, nil, "GPU", nil, mpArr(nil, nil)),
			mpArr("BlockStored", mpArr(56, 57), nil, mpToks(21, 8), 4, nil, nil, nil, mpArr(
				mpArr(123, mpArr("a", "b", "c"), mpMap{{"k", 1}}, mpArr("id", "not-an-offset"), true, "tenant-salt"),
				mpArr("ignored-after-block-0", mpArr("img-xyz", 0)),
			)),
			mpArr("BlockStored", mpArr(58), nil, mpToks(22, 4), 4, nil, nil, nil, mpArr("not-a-list")),
			mpMap{{"type", "BlockStored"}, {"extra_keys", mpArr(mpArr("my-lora", "my-salt"))},
				{"block_hashes", mpArr(59)}, {"token_ids", mpToks(23, 4)}, {"lora_name", "my-lora"}},
		))},
		{"sglang_nine_field", mpMap{
			{"ts", 1718000010.0},
			{"events", mpArr(
				mpArr("BlockStored", mpArr(61, 62), nil, mpToks(24, 32), 16, nil, "GPU", nil, nil),
				mpArr("BlockRemoved", mpArr(61), "GPU"),
			)},
			{"attn_dp_rank", 2},
			{"cache_salt", "tenant-a"},
			{"session_id", "sess-1"},
		}},
		{"malformed_events", mpArr(1718000011.0, mpArr(
			mpArr("BlockStored", mpArr(71), nil, mpToks(25, 4), 4), // good
			42,                              // not an event
			mpArr(),                         // no tag
			mpArr(7, mpArr(1)),              // tag not a string
			mpArr("BlockFrobbed", mpArr(1)), // unknown type
			mpArr("BlockStored", mpArr(1, 2), nil, mpToks(26, 31), 16),      // token count mismatch
			mpArr("BlockStored", mpArr(1), nil, mpArr(1, -1), 2),            // negative token
			mpArr("BlockStored", mpArr(1), nil, mpArr(1, uint64(1)<<33), 2), // token beyond uint32
			mpArr("BlockStored", mpArr(nil), nil, mpToks(27, 4), 4),         // nil hash
			mpArr("BlockStored", mpArr(1.5), nil, mpToks(28, 4), 4),         // float hash
			mpArr("BlockRemoved"), // no hashes
			mpArr("BlockStored", mpArr(1, 2), nil, mpToks(29, 8), 4, nil, 7),                                              // medium not a string
			mpArr("BlockStored", mpArr(1, 2), nil, mpToks(30, 8), 4, nil, nil, nil, mpArr(nil)),                           // extra_keys size
			mpArr("BlockStored", mpArr(1), nil, mpArr(), 0),                                                               // block_size 0
			mpArr("BlockStored", mpArr(1), nil, mpToks(31, 4), -4),                                                        // negative block_size
			mpArr("BlockStored", mpArr(1), nil, mpToks(32, 4), uint64(1)<<63),                                             // block_size out of range
			mpArr("BlockStored", mpArr(1), nil, mpToks(33, 4), 4, nil, nil, 5),                                            // lora_name not a string
			mpArr("BlockStored", mpArr(1, 2), nil, mpToks(34, 7)),                                                         // cannot infer block_size
			mpArr("BlockStored", mpArr(1), nil, nil, 4),                                                                   // token_ids nil
			mpMap{{"type", "BlockStored"}},                                                                                // no hashes nor tokens
			mpMap{{"block_hashes", mpArr(1)}},                                                                             // no type
			mpMap{{"type", 3}, {"block_hashes", mpArr(1)}},                                                                // type not a string
			mpArr("BlockStored", mpArr(1), nil, mpToks(35, 4), 4, nil, nil, nil, mpArr(mpArr(mpArr("x", 1, 2))), mpI8(1)), // group_idx fine, bad mm ignored
			mpArr("AllBlocksCleared"),                                                                                     // good
		), 0)},
		{"bad_empty", mpRaw{}},
		{"bad_not_a_batch", "hello"},
		{"bad_one_element", mpArr(1.0)},
		{"bad_events_not_list", mpArr(1.0, 5)},
		{"bad_events_nil", mpArr(1.0, nil)},
		{"bad_ts_string", mpArr("now", mpArr())},
		{"bad_dp_rank_string", mpArr(1.0, mpArr(), "zero")},
		{"bad_map_no_events", mpMap{{"ts", 1.0}}},
		{"bad_truncated", mpRaw(valid[:len(valid)-5])},
		{"bad_trailing_bytes", mpRaw(append(append([]byte(nil), valid...), 0xc0))},
		{"bad_length_overflow", mpArr(1.0, mpRaw{0xdd, 0xff, 0xff, 0xff, 0xff})},
		{"bad_reserved_byte", mpArr(1.0, mpArr(mpRaw{0xc1}))},
		{"bad_nested_overflow", mpArr(1.0, mpArr(mpArr("BlockStored", mpRaw{0xdf, 0x7f, 0xff, 0xff, 0xff})))},
	}
}

// TestMsgpackFixtures checks that testdata/*.msgpack hold exactly what the fixture table encodes
// (or rewrites them with -update).
func TestMsgpackFixtures(t *testing.T) {
	for _, fx := range mpFixtures(t) {
		t.Run(fx.name, func(t *testing.T) {
			want := mpEncode(t, fx.v)
			path := filepath.Join("testdata", fx.name+".msgpack")
			if *updateGolden {
				require.NoError(t, os.MkdirAll("testdata", 0o755))
				require.NoError(t, os.WriteFile(path, want, 0o644))
				return
			}
			got, err := os.ReadFile(path)
			require.NoError(t, err, "run with -update to create it")
			if !bytes.Equal(want, got) {
				t.Fatalf("%s differs from its definition; run with -update\nwant % x\ngot  % x", path, want, got)
			}
		})
	}
}

// goldenBatch is the reviewable JSON form of a decode result.
type goldenBatch struct {
	Error   string        `json:"error,omitempty"`
	Skipped int           `json:"skipped"`
	TS      float64       `json:"ts"`
	DPRank  *int          `json:"dp_rank"` // null when the batch has none
	Events  []goldenEvent `json:"events"`
}

type goldenEvent struct {
	Kind        string     `json:"kind"`
	BlockHashes []string   `json:"block_hashes,omitempty"` // 0x%016x
	Parent      string     `json:"parent,omitempty"`       // only when HasParent
	TokenIDs    []uint32   `json:"token_ids,omitempty"`
	BlockSize   int        `json:"block_size,omitempty"`
	LoRAName    string     `json:"lora_name,omitempty"`
	Tier        string     `json:"tier,omitempty"` // omitted for AllBlocksCleared
	ExtraKeys   [][]string `json:"extra_keys,omitempty"`
	CacheSalt   string     `json:"cache_salt,omitempty"`
	GroupIdx    int        `json:"group_idx,omitempty"`
}

func goldenHex(v uint64) string { return fmt.Sprintf("0x%016x", v) }

func toGolden(b *Batch, skipped int, err error) goldenBatch {
	g := goldenBatch{Skipped: skipped, TS: b.TS, Events: []goldenEvent{}}
	if err != nil {
		g.Error = err.Error()
	}
	if b.HasDPRank {
		r := b.DPRank
		g.DPRank = &r
	}
	for _, ev := range b.Events {
		ge := goldenEvent{Kind: ev.Kind.String(), BlockSize: ev.BlockSize, LoRAName: ev.LoRAName,
			CacheSalt: ev.CacheSalt, GroupIdx: ev.GroupIdx, TokenIDs: ev.TokenIDs}
		if ev.Kind != KindAllBlocksCleared {
			ge.Tier = ev.Tier.String()
		}
		for _, h := range ev.BlockHashes {
			ge.BlockHashes = append(ge.BlockHashes, goldenHex(h))
		}
		if ev.HasParent {
			ge.Parent = goldenHex(ev.Parent)
		}
		for _, keys := range ev.ExtraKeys {
			s := []string{}
			for _, k := range keys {
				s = append(s, goldenHex(k))
			}
			ge.ExtraKeys = append(ge.ExtraKeys, s)
		}
		g.Events = append(g.Events, ge)
	}
	return g
}

// TestMsgpackGolden decodes every fixture's testdata/<name>.msgpack and compares the result with
// testdata/<name>.golden.json (or rewrites that with -update).
func TestMsgpackGolden(t *testing.T) {
	for _, fx := range mpFixtures(t) {
		name, path := fx.name, filepath.Join("testdata", fx.name+".msgpack")
		t.Run(name, func(t *testing.T) {
			payload, err := os.ReadFile(path)
			require.NoError(t, err)
			var b Batch
			skipped, err := DecodeMsgpackBatch(payload, &b)
			if strings.HasPrefix(name, "bad_") {
				require.ErrorIs(t, err, ErrMalformed)
				require.Empty(t, b.Events)
			} else {
				require.NoError(t, err)
			}
			checkBatchInvariants(t, &b)
			got, err := json.MarshalIndent(toGolden(&b, skipped, err), "", "  ")
			require.NoError(t, err)
			got = append(got, '\n')
			golden := filepath.Join("testdata", name+".golden.json")
			if *updateGolden {
				require.NoError(t, os.WriteFile(golden, got, 0o644))
				return
			}
			want, err := os.ReadFile(golden)
			require.NoError(t, err, "run with -update to create it")
			require.Equal(t, string(want), string(got))
		})
	}
}

// checkBatchInvariants asserts what every decoded batch guarantees.
func checkBatchInvariants(t testing.TB, b *Batch) {
	t.Helper()
	for i, ev := range b.Events {
		if ev.HasParent != (ev.Parent != 0) {
			t.Fatalf("event %d: HasParent %v with Parent %#x", i, ev.HasParent, ev.Parent)
		}
		switch ev.Kind {
		case KindBlockStored:
			if len(ev.TokenIDs) != ev.BlockSize*len(ev.BlockHashes) {
				t.Fatalf("event %d: %d tokens for %d blocks of %d", i, len(ev.TokenIDs), len(ev.BlockHashes), ev.BlockSize)
			}
			if ev.BlockSize < 0 || len(ev.BlockHashes) > 0 && ev.BlockSize == 0 {
				t.Fatalf("event %d: block size %d", i, ev.BlockSize)
			}
			if len(ev.ExtraKeys) != 0 && len(ev.ExtraKeys) != len(ev.BlockHashes) {
				t.Fatalf("event %d: %d extra-key entries for %d blocks", i, len(ev.ExtraKeys), len(ev.BlockHashes))
			}
		case KindBlockRemoved:
			if len(ev.TokenIDs) != 0 || ev.HasParent || ev.BlockSize != 0 || len(ev.ExtraKeys) != 0 ||
				ev.LoRAName != "" || ev.CacheSalt != "" {
				t.Fatalf("event %d: BlockRemoved with BlockStored fields: %+v", i, ev)
			}
		case KindAllBlocksCleared:
			if len(ev.BlockHashes) != 0 || len(ev.TokenIDs) != 0 || ev.HasParent || ev.BlockSize != 0 ||
				len(ev.ExtraKeys) != 0 || ev.LoRAName != "" || ev.CacheSalt != "" || ev.Tier != 0 || ev.GroupIdx != 0 {
				t.Fatalf("event %d: AllBlocksCleared with fields: %+v", i, ev)
			}
		default:
			t.Fatalf("event %d: kind %v", i, ev.Kind)
		}
		if ev.PrefixOp != 0 || ev.PrefixHash != "" || ev.TokenCount != 0 {
			t.Fatalf("event %d: prefix fields set: %+v", i, ev)
		}
	}
}

// norm returns evs with empty slices as nil, so expectations can leave them out.
func normEvents(evs []Event) []Event {
	out := make([]Event, len(evs))
	for i, ev := range evs {
		if len(ev.BlockHashes) == 0 {
			ev.BlockHashes = nil
		}
		if len(ev.TokenIDs) == 0 {
			ev.TokenIDs = nil
		}
		if len(ev.ExtraKeys) == 0 {
			ev.ExtraKeys = nil
		}
		for j, k := range ev.ExtraKeys {
			if len(k) == 0 {
				ev.ExtraKeys[j] = nil
			}
		}
		out[i] = ev
	}
	return out
}

func TestDecodeMsgpackBatch(t *testing.T) {
	emb := sha256Digest("embedding")
	tests := []struct {
		name    string
		payload any
		skipped int
		want    Batch // Seq and Model are never set by the decoder
		wantErr bool
	}{
		{
			name:    "array form with rank",
			payload: mpArr(12.5, mpArr(mpArr("BlockStored", mpArr(1, 2), 9, mpToks(1, 8), 4, nil, "GPU")), 3),
			want: Batch{TS: 12.5, DPRank: 3, HasDPRank: true, Events: []Event{{Kind: KindBlockStored,
				BlockHashes: []uint64{1, 2}, Parent: 9, HasParent: true, TokenIDs: mpToksU32(1, 8), BlockSize: 4}}},
		},
		{
			name:    "old two-element batch",
			payload: mpArr(1, mpArr(mpArr("AllBlocksCleared"))),
			want:    Batch{TS: 1, Events: []Event{{Kind: KindAllBlocksCleared}}},
		},
		{
			name:    "array form rank nil",
			payload: mpArr(mpF32(0.5), mpArr(), nil),
			want:    Batch{TS: 0.5, Events: []Event{}},
		},
		{
			name: "map form with attn_dp_rank standing in",
			payload: mpMap{{"events", mpArr(mpMap{{"type", "BlockRemoved"}, {"block_hashes", mpArr(5)}, {"group_idx", 1}})},
				{"ts", mpU64(7)}, {"attn_dp_rank", 4}},
			want: Batch{TS: 7, DPRank: 4, HasDPRank: true, Events: []Event{{Kind: KindBlockRemoved, BlockHashes: []uint64{5}, GroupIdx: 1}}},
		},
		{
			name:    "map form data_parallel_rank wins over attn_dp_rank",
			payload: mpMap{{"attn_dp_rank", 4}, {"events", mpArr()}, {"data_parallel_rank", 0}},
			want:    Batch{HasDPRank: true, Events: []Event{}},
		},
		{
			name: "hash of every integer width",
			payload: mpArr(0, mpArr(mpArr("BlockRemoved", mpArr(127, mpU8(255), mpU16(65535), mpU32(math.MaxUint32),
				mpU64(math.MaxUint64), -1, -32, mpI8(-128), mpI16(math.MinInt16), mpI32(math.MinInt32),
				mpI64(math.MinInt64), mpI64(math.MaxInt64), mpI8(5))))),
			want: Batch{Events: []Event{{Kind: KindBlockRemoved, BlockHashes: []uint64{127, 255, 65535, math.MaxUint32,
				math.MaxUint64, math.MaxUint64, 1<<64 - 32, 1<<64 - 128, 1<<64 - 1<<15, 1<<64 - 1<<31,
				1 << 63, math.MaxInt64, 5}}}},
		},
		{
			name: "hash digests",
			payload: mpArr(0, mpArr(mpArr("BlockStored", mpArr(sha256Digest("x"), []byte{1, 2, 3}, "abcdefghij", []byte{}),
				sha256Digest("p"), mpToks(2, 4), 1))),
			want: Batch{Events: []Event{{Kind: KindBlockStored,
				BlockHashes: []uint64{beLast8(sha256Digest("x")), 0x010203, beLast8([]byte("abcdefghij")), 0},
				Parent:      beLast8(sha256Digest("p")), HasParent: true, TokenIDs: mpToksU32(2, 4), BlockSize: 1}}},
		},
		{
			name:    "parent zero is no parent",
			payload: mpArr(0, mpArr(mpArr("BlockStored", mpArr(1), mpI64(0), mpToks(3, 2), 2))),
			want:    Batch{Events: []Event{{Kind: KindBlockStored, BlockHashes: []uint64{1}, TokenIDs: mpToksU32(3, 2), BlockSize: 2}}},
		},
		{
			name:    "negative parent",
			payload: mpArr(0, mpArr(mpArr("BlockStored", mpArr(1), -2, mpToks(3, 2), 2))),
			want: Batch{Events: []Event{{Kind: KindBlockStored, BlockHashes: []uint64{1}, Parent: math.MaxUint64 - 1,
				HasParent: true, TokenIDs: mpToksU32(3, 2), BlockSize: 2}}},
		},
		{
			name:    "block size inferred",
			payload: mpArr(0, mpArr(mpArr("BlockStored", mpArr(1, 2, 3), nil, mpToks(4, 48)))),
			want: Batch{Events: []Event{{Kind: KindBlockStored, BlockHashes: []uint64{1, 2, 3},
				TokenIDs: mpToksU32(4, 48), BlockSize: 16}}},
		},
		{
			name:    "token widths",
			payload: mpArr(0, mpArr(mpArr("BlockStored", mpArr(1), nil, mpArr(0, mpU8(1), mpU16(2), mpU32(math.MaxUint32), mpU64(4), mpI8(5), mpI16(6), mpI32(7), mpI64(8)), 9))),
			want: Batch{Events: []Event{{Kind: KindBlockStored, BlockHashes: []uint64{1},
				TokenIDs: []uint32{0, 1, 2, math.MaxUint32, 4, 5, 6, 7, 8}, BlockSize: 9}}},
		},
		{
			name: "media",
			payload: mpArr(0, mpArr(mpArr("BlockRemoved", mpArr(1), "CPU"), mpArr("BlockRemoved", mpArr(1), "cpu"),
				mpArr("BlockRemoved", mpArr(1), "disk"), mpArr("BlockRemoved", mpArr(1), nil), mpArr("BlockRemoved", mpArr(1), "Gpu"),
				mpArr("BlockRemoved", mpArr(1), strings.Repeat("x", 40)))),
			want: Batch{Events: []Event{
				{Kind: KindBlockRemoved, BlockHashes: []uint64{1}, Tier: TierCPU},
				{Kind: KindBlockRemoved, BlockHashes: []uint64{1}, Tier: TierCPU},
				{Kind: KindBlockRemoved, BlockHashes: []uint64{1}, Tier: TierStorage},
				{Kind: KindBlockRemoved, BlockHashes: []uint64{1}},
				{Kind: KindBlockRemoved, BlockHashes: []uint64{1}},
				{Kind: KindBlockRemoved, BlockHashes: []uint64{1}, Tier: TierStorage},
			}},
		},
		{
			name: "extra keys: lora ignored, salt, multimodal, embeddings",
			payload: mpArr(0, mpArr(mpArr("BlockStored", mpArr(1, 2), nil, mpToks(5, 8), 4, 3, "GPU", "lora-a",
				mpArr(mpArr("lora-a", mpArr("img", 0), "salt"), mpArr(mpArr("img", 4), emb, "not-salt-in-block-1")), 0))),
			want: Batch{Events: []Event{{Kind: KindBlockStored, BlockHashes: []uint64{1, 2}, TokenIDs: mpToksU32(5, 8),
				BlockSize: 4, LoRAName: "lora-a", CacheSalt: "salt",
				ExtraKeys: [][]uint64{{ExtraKeyHash("img")}, {ExtraKeyHash("img"), xxh3.Hash(emb)}}}}},
		},
		{
			name: "extra keys: only salt leaves ExtraKeys empty",
			payload: mpArr(0, mpArr(mpArr("BlockStored", mpArr(1, 2), nil, mpToks(6, 8), 4, nil, nil, nil,
				mpArr(mpArr("first", "salt"), nil)))),
			want: Batch{Events: []Event{{Kind: KindBlockStored, BlockHashes: []uint64{1, 2}, TokenIDs: mpToksU32(6, 8),
				BlockSize: 4, CacheSalt: "salt"}}},
		},
		{
			name: "extra keys before lora_name in map form",
			payload: mpArr(0, mpArr(mpMap{{"extra_keys", mpArr(mpArr("L", mpArr([]byte("bin-id"), mpI64(-1))))}, {"lora_name", "L"},
				{"token_ids", mpToks(7, 2)}, {"block_hashes", mpArr(3)}, {"type", "BlockStored"}})),
			want: Batch{Events: []Event{{Kind: KindBlockStored, BlockHashes: []uint64{3}, TokenIDs: mpToksU32(7, 2),
				BlockSize: 2, LoRAName: "L", ExtraKeys: [][]uint64{{ExtraKeyHash("bin-id")}}}}},
		},
		{
			name: "malformed events skipped, order kept",
			payload: mpArr(0, mpArr(mpArr("BlockRemoved", mpArr(1)), mpArr("Nope"), "str", mpArr("BlockStored", mpArr(1), nil, mpToks(1, 3), 2),
				mpArr("BlockRemoved", mpArr(2)))),
			skipped: 3,
			want: Batch{Events: []Event{{Kind: KindBlockRemoved, BlockHashes: []uint64{1}},
				{Kind: KindBlockRemoved, BlockHashes: []uint64{2}}}},
		},
		{name: "not a batch: int", payload: 5, wantErr: true},
		{name: "not a batch: empty map", payload: mpMap{}, wantErr: true},
		{name: "not a batch: trailing", payload: mpRaw(append(mpEncode(t, mpArr(0, mpArr())), 0x01)), wantErr: true},
		{name: "not a batch: huge map", payload: mpRaw{0xdf, 0xff, 0xff, 0xff, 0xff}, wantErr: true},
		{name: "not a batch: truncated float", payload: mpRaw{0x92, 0xcb, 0, 0}, wantErr: true},
		{name: "not a batch: truncated event", payload: mpArr(0, mpArr(mpRaw{0x92, 0xa1, 'x'})), wantErr: true},
		{name: "not a batch: truncated tokens", payload: mpArr(0, mpArr(mpArr("BlockStored", mpArr(1), nil, mpRaw{0x92, 0xce, 0}))), wantErr: true},
		{name: "not a batch: events map", payload: mpArr(0, mpMap{}), wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := Batch{Seq: 99, Model: "m"}
			skipped, err := DecodeMsgpackBatch(mpEncode(t, tt.payload), &b)
			require.Equal(t, uint64(99), b.Seq)
			require.Equal(t, "m", b.Model)
			if tt.wantErr {
				require.ErrorIs(t, err, ErrMalformed)
				require.Zero(t, skipped)
				require.Empty(t, b.Events)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.skipped, skipped)
			checkBatchInvariants(t, &b)
			require.Equal(t, tt.want.TS, b.TS)
			require.Equal(t, tt.want.DPRank, b.DPRank)
			require.Equal(t, tt.want.HasDPRank, b.HasDPRank)
			require.Equal(t, normEvents(tt.want.Events), normEvents(b.Events))
		})
	}
}

// TestDecodeMsgpackBatchReuse decodes different batches into one Batch and checks that nothing
// leaks from one decode into the next.
func TestDecodeMsgpackBatchReuse(t *testing.T) {
	rich := mpEncode(t, mpArr(1, mpArr(
		mpArr("BlockStored", mpArr(1, 2), 9, mpToks(1, 8), 4, nil, "CPU", "lora", mpArr(mpArr(mpArr("img", 0), "salt"), mpArr(sha256Digest("e")))),
		mpArr("BlockStored", mpArr(3, 4, 5, 6), 2, mpToks(2, 16), 4, nil, "disk", nil, nil, 3),
		mpArr("BlockRemoved", mpArr(7, 8, 9), "CPU", 1),
	), 5))
	plain := mpEncode(t, mpArr(2, mpArr(
		mpArr("AllBlocksCleared"),
		mpArr("BlockStored", mpArr(10), nil, mpToks(3, 4), 4),
		mpArr("BlockRemoved", mpArr(11)),
	)))
	garbage := mpEncode(t, mpArr(3, mpArr(mpArr("BlockStored", mpArr(1), nil, mpToks(4, 5), 4))))

	fresh := func(payload []byte) Batch {
		var b Batch
		_, err := DecodeMsgpackBatch(payload, &b)
		require.NoError(t, err)
		return b
	}
	var b Batch
	for i, payload := range [][]byte{rich, plain, rich, garbage, plain, rich} {
		t.Run(fmt.Sprintf("decode=%d", i), func(t *testing.T) {
			_, err := DecodeMsgpackBatch(payload, &b)
			require.NoError(t, err)
			want := fresh(payload)
			require.Equal(t, want.TS, b.TS)
			require.Equal(t, want.HasDPRank, b.HasDPRank)
			require.Equal(t, want.DPRank, b.DPRank)
			require.Equal(t, normEvents(want.Events), normEvents(b.Events))
		})
	}
	t.Run("error leaves no events", func(t *testing.T) {
		_, err := DecodeMsgpackBatch([]byte{0x92}, &b)
		require.ErrorIs(t, err, ErrMalformed)
		require.Empty(t, b.Events)
		require.False(t, b.HasDPRank)
	})
}

// TestDecodeMsgpackBatchAllocs checks that a reused Batch decodes without allocating.
func TestDecodeMsgpackBatchAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates")
	}
	for _, tt := range []struct {
		name    string
		payload []byte
	}{
		{"array form", storedBatchPayload(t, 16, false, 1)},
		{"map form", storedBatchPayload(t, 16, true, 1)},
		{"lora salt and multimodal", mpEncode(t, mpArr(1, mpArr(
			mpArr("BlockStored", mpArr(1, 2), 9, mpToks(1, 8), 4, nil, "CPU", "lora-name", mpArr(mpArr("lora-name", mpArr("img", 0), "salt"), mpArr(sha256Digest("e")))),
			mpMap{{"type", "BlockStored"}, {"block_hashes", mpArr(sha256Digest("a"))}, {"token_ids", mpToks(2, 4)}, {"medium", "shared-storage-tier"},
				{"lora_name", "another-lora"}, {"extra_keys", mpArr(mpArr("tenant-salt"))}},
			mpArr("BlockRemoved", mpArr(7, 8, 9), "cpu", 1),
			mpArr("AllBlocksCleared"),
		), 0))},
		{"skipped events", mpEncode(t, mpArr(1, mpArr(mpArr("Nope", 1), mpArr("BlockStored", mpArr(1), nil, mpToks(1, 3), 2), mpArr("AllBlocksCleared"))))},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var b Batch
			_, err := DecodeMsgpackBatch(tt.payload, &b)
			require.NoError(t, err)
			allocs := testing.AllocsPerRun(100, func() {
				if _, err := DecodeMsgpackBatch(tt.payload, &b); err != nil {
					t.Fatal(err)
				}
			})
			require.Zero(t, allocs)
		})
	}
}

func TestExtraKeyHash(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want uint64
	}{
		{"", 0x2d06800538d394c2}, // XXH3-64 of the empty input, from the reference test vectors
		{"img-abc", xxh3.Hash([]byte("img-abc"))},
	} {
		t.Run(fmt.Sprintf("%q", tt.in), func(t *testing.T) {
			require.Equal(t, tt.want, ExtraKeyHash(tt.in))
		})
	}
}

// TestDecodeMsgpackBatchVsEncoderStructs encodes batches from Go structs shaped like vLLM's
// msgspec classes (array_like with the tag first, and the map form with omitted defaults), so
// the fixtures are not only hand-built trees.
func TestDecodeMsgpackBatchVsEncoderStructs(t *testing.T) {
	type storedMap struct {
		Type            string   `msgpack:"type"`
		BlockHashes     []uint64 `msgpack:"block_hashes"`
		ParentBlockHash *uint64  `msgpack:"parent_block_hash"`
		TokenIDs        []uint32 `msgpack:"token_ids"`
		BlockSize       int      `msgpack:"block_size"`
		LoraID          *int     `msgpack:"lora_id"`
		Medium          *string  `msgpack:"medium"`
		LoraName        *string  `msgpack:"lora_name"`
		GroupIdx        int      `msgpack:"group_idx,omitempty"`
	}
	type batchMap struct {
		TS     float64     `msgpack:"ts"`
		Events []storedMap `msgpack:"events"`
		DPRank *int        `msgpack:"data_parallel_rank"`
	}
	parent, medium := uint64(1<<63+5), "CPU"
	in := batchMap{TS: 3.25, Events: []storedMap{
		{Type: "BlockStored", BlockHashes: []uint64{math.MaxUint64, 1}, ParentBlockHash: &parent,
			TokenIDs: mpToksU32(9, 32), BlockSize: 16, Medium: &medium, GroupIdx: 2},
		{Type: "BlockStored", BlockHashes: []uint64{2}, TokenIDs: mpToksU32(10, 16), BlockSize: 16},
	}}
	for _, compact := range []bool{false, true} {
		t.Run(fmt.Sprintf("compact_ints=%v", compact), func(t *testing.T) {
			var buf bytes.Buffer
			enc := msgpack.NewEncoder(&buf)
			enc.UseCompactInts(compact)
			require.NoError(t, enc.Encode(in))
			var b Batch
			skipped, err := DecodeMsgpackBatch(buf.Bytes(), &b)
			require.NoError(t, err)
			require.Zero(t, skipped)
			require.False(t, b.HasDPRank)
			require.Equal(t, 3.25, b.TS)
			require.Equal(t, normEvents([]Event{
				{Kind: KindBlockStored, BlockHashes: []uint64{math.MaxUint64, 1}, Parent: parent, HasParent: true,
					TokenIDs: mpToksU32(9, 32), BlockSize: 16, Tier: TierCPU, GroupIdx: 2},
				{Kind: KindBlockStored, BlockHashes: []uint64{2}, TokenIDs: mpToksU32(10, 16), BlockSize: 16},
			}), normEvents(b.Events))
		})
	}
}
