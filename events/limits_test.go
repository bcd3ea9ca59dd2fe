package events

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// ampFactor is the allocation bound the decoder promises (DecodeMsgpackBatch: 4 × the payload);
// ampOverhead covers what does not scale with the frame (the Batch, an error message).
const (
	ampFactor   = 4
	ampOverhead = 64 << 10
)

// Minimal events, array form: the shortest encodings the decoder keeps.
var (
	ampRemovedEmpty = append(append([]byte{0x92, 0xa0 | 12}, "BlockRemoved"...), 0x90)                    // 15 bytes
	ampRemovedOne   = append(append([]byte{0x92, 0xa0 | 12}, "BlockRemoved"...), 0x91, 0x01)              // 16 bytes
	ampStoredEmpty  = append(append([]byte{0x94, 0xa0 | 11}, "BlockStored"...), 0x90, 0xc0, 0x90)         // 16 bytes
	ampCleared      = append([]byte{0x91, 0xa0 | 16}, "AllBlocksCleared"...)                              // 18 bytes
	ampBatchHead    = []byte{0x92, 0xcb, 0x41, 0xd9, 0x97, 0x6a, 0x80, 0x07, 0xdf, 0x3b, mpArray32}       // [ts, events…
	ampEventTag     = map[bool][]byte{true: []byte("\xabBlockStored"), false: []byte("\xacBlockRemoved")} // fixstr tags
)

// ampArray32 appends an array32 header of n elements.
func ampArray32(buf []byte, n int) []byte {
	return binary.BigEndian.AppendUint32(append(buf, mpArray32), uint32(n))
}

// ampRepeated returns a batch [ts, [event, event, …]] of about size bytes.
func ampRepeated(event []byte, size int) []byte {
	n := (size - len(ampBatchHead) - 4) / len(event)
	buf := binary.BigEndian.AppendUint32(bytes.Clone(ampBatchHead), uint32(n))
	for range n {
		buf = append(buf, event...)
	}
	return buf
}

// ampOneEvent returns a batch of one event of about size bytes, its arrays filled with the
// 1-byte integer 1: hashes (BlockRemoved), or hashes and tokens (BlockStored, block_size 1,
// with extra_keys entries of one empty bin item each when extra is set), or one block of
// tokens (BlockStored, block_size = the token count).
func ampOneEvent(shape string, size int) []byte {
	buf := binary.BigEndian.AppendUint32(bytes.Clone(ampBatchHead), 1)
	ones := func(buf []byte, n int) []byte {
		buf = ampArray32(buf, n)
		return append(buf, bytes.Repeat([]byte{1}, n)...)
	}
	switch shape {
	case "removed-hashes":
		buf = append(append(buf, 0x92), ampEventTag[false]...)
		return ones(buf, size)
	case "stored-tokens":
		buf = append(append(buf, 0x95), ampEventTag[true]...)
		buf = append(buf, 0x91, 0x01, 0xc0)
		buf = ones(buf, size)
		return binary.BigEndian.AppendUint32(append(buf, mpUint32), uint32(size))
	case "stored-extra-keys":
		n := size / 5
		buf = append(append(buf, 0x99), ampEventTag[true]...)
		buf = append(ones(buf, n), 0xc0)
		buf = append(ones(buf, n), 0x01, 0xc0, 0xc0, 0xc0)
		buf = ampArray32(buf, n)
		for range n {
			buf = append(buf, 0x91, mpBin8, 0x00)
		}
		return buf
	}
	panic(shape)
}

// decodeAllocated decodes payload into a fresh Batch and returns the bytes the heap grew by.
func decodeAllocated(payload []byte) (alloc uint64, skipped, events int, err error) {
	var m0, m1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m0)
	b := new(Batch)
	skipped, err = DecodeMsgpackBatch(payload, b)
	runtime.ReadMemStats(&m1)
	return m1.TotalAlloc - m0.TotalAlloc, skipped, len(b.Events), err
}

// TestDecodeAmplification decodes large frames of minimal or densely packed events into a fresh
// Batch and checks that the decoder allocated at most 4× the frame: frames that would decode
// to more are rejected before the allocation, the others decoded within the bound.
func TestDecodeAmplification(t *testing.T) {
	size := 16 << 20
	if raceEnabled || testing.Short() {
		size = 2 << 20
	}
	for _, tc := range []struct {
		name    string
		payload []byte
		reject  bool
	}{
		{"minimal/removed-empty", ampRepeated(ampRemovedEmpty, size), true},
		{"minimal/removed-one-hash", ampRepeated(ampRemovedOne, size), true},
		{"minimal/stored-empty", ampRepeated(ampStoredEmpty, size), true},
		{"minimal/cleared", ampRepeated(ampCleared, size), true},
		{"dense/removed-hashes", ampOneEvent("removed-hashes", size), true},
		{"dense/stored-extra-keys", ampOneEvent("stored-extra-keys", size), true},
		{"dense/stored-tokens", ampOneEvent("stored-tokens", size), false},
		{"real/stored-16x16", storedBatchPayload(t, size/1100, false, 1), false},
		{"real/stored-16x16-map", storedBatchPayload(t, size/1400, true, 1), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			alloc, skipped, n, err := decodeAllocated(tc.payload)
			ratio := float64(alloc) / float64(len(tc.payload))
			t.Logf("%d-byte frame: %d bytes allocated (%.2f×), %d events, %d skipped, err %v", len(tc.payload), alloc, ratio, n, skipped, err)
			if tc.reject {
				require.ErrorIs(t, err, ErrMalformed)
				assert.ErrorContains(t, err, "allocation budget")
			} else {
				require.NoError(t, err)
				assert.Zero(t, skipped)
				assert.NotZero(t, n)
			}
			assert.LessOrEqual(t, alloc, uint64(ampFactor*len(tc.payload)+ampOverhead))
		})
	}
}

// TestDecodeHugeHeader: a container or string header announcing 2^31 (or 2^32-1) elements in a
// tiny frame is malformed, found before anything is sized by it.
func TestDecodeHugeHeader(t *testing.T) {
	ts := ampBatchHead[1:10]
	huge := func(c byte, n uint32) []byte { return binary.BigEndian.AppendUint32([]byte{c}, n) }
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	for _, n := range []uint32{1 << 31, 1<<32 - 1} {
		for _, tc := range []struct {
			name    string
			payload []byte
		}{
			{"batch-array", cat(huge(mpArray32, n), ts)},
			{"batch-map", cat(huge(mpMap32, n), []byte{0xa2}, []byte("ts"), ts)},
			{"events", cat([]byte{0x92}, ts, huge(mpArray32, n), []byte{0x90})},
			{"event", cat([]byte{0x92}, ts, []byte{0x91}, huge(mpArray32, n), ampEventTag[false])},
			{"block-hashes", cat([]byte{0x92}, ts, []byte{0x91, 0x92}, ampEventTag[false], huge(mpArray32, n), []byte{1})},
			{"token-ids", cat([]byte{0x92}, ts, []byte{0x91, 0x94}, ampEventTag[true], []byte{0x91, 1, 0xc0}, huge(mpArray32, n), []byte{1})},
			{"extra-keys", cat([]byte{0x92}, ts, []byte{0x91, 0x99}, ampEventTag[true], []byte{0x91, 1, 0xc0, 0x91, 1, 1, 0xc0, 0xc0, 0xc0}, huge(mpArray32, n), []byte{0xc0})},
			{"tag-str32", cat([]byte{0x92}, ts, []byte{0x91, 0x91}, huge(mpStr32, n), []byte("BlockRemoved"))},
			{"hash-bin32", cat([]byte{0x92}, ts, []byte{0x91, 0x92}, ampEventTag[false], []byte{0x91}, huge(mpBin32, n), []byte{1, 2})},
		} {
			t.Run(fmt.Sprintf("%s/%#x", tc.name, n), func(t *testing.T) {
				var b Batch
				skipped, err := DecodeMsgpackBatch(tc.payload, &b)
				if err == nil {
					// The bad event is skipped inside a batch that is otherwise well formed.
					assert.Equal(t, 1, skipped)
					assert.Empty(t, b.Events)
				} else {
					assert.ErrorIs(t, err, ErrMalformed)
				}
				const runs = 100
				var m0, m1 runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&m0)
				for range runs {
					b := new(Batch)
					DecodeMsgpackBatch(tc.payload, b)
				}
				runtime.ReadMemStats(&m1)
				perRun := (m1.TotalAlloc - m0.TotalAlloc) / runs
				assert.Less(t, perRun, uint64(1024), "bytes allocated per decode (the Batch and the error)")
			})
		}
	}
}

// BenchmarkDecodeAmplification decodes frames into a fresh Batch (the first batch of a source, or
// the first after its storage was pooled away: the worst case) and reports the bytes allocated
// per frame byte ("alloc/B"). Frames the decoder rejects as over budget allocate almost nothing.
func BenchmarkDecodeAmplification(b *testing.B) {
	for _, size := range []int{1 << 20, 16 << 20} {
		for _, shape := range []string{"minimal-removed", "minimal-cleared", "dense-tokens", "real-stored"} {
			var payload []byte
			switch shape {
			case "minimal-removed":
				payload = ampRepeated(ampRemovedEmpty, size)
			case "minimal-cleared":
				payload = ampRepeated(ampCleared, size)
			case "dense-tokens":
				payload = ampOneEvent("stored-tokens", size)
			case "real-stored":
				payload = storedBatchPayload(b, size/1100, false, 1)
			}
			b.Run(fmt.Sprintf("frame=%dMiB/events=%s", size>>20, shape), func(b *testing.B) {
				b.SetBytes(int64(len(payload)))
				b.ReportAllocs()
				var m0, m1 runtime.MemStats
				runtime.ReadMemStats(&m0)
				for b.Loop() {
					var batch Batch
					if _, err := DecodeMsgpackBatch(payload, &batch); err != nil && !errors.Is(err, ErrMalformed) {
						b.Fatal(err)
					}
				}
				runtime.ReadMemStats(&m1)
				b.ReportMetric(float64(m1.TotalAlloc-m0.TotalAlloc)/float64(b.N)/float64(len(payload)), "alloc/B")
			})
		}
	}
}
