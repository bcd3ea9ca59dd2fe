package prefixkey

import (
	"fmt"
	"strings"
	"testing"
)

var (
	sinkKey Key
	sinkU64 uint64
)

var promptSizes = []struct {
	name string
	n    int
}{{"64B", 64}, {"1KiB", 1024}, {"4KiB", 4096}}

// BenchmarkPrefixKey: the prefix key of a request whose system prompt has the given size, with the
// default maxPrefixLength (1 KiB), so 4 KiB hashes the same 1,024 bytes as 1 KiB.
func BenchmarkPrefixKey(b *testing.B) {
	for _, size := range promptSizes {
		b.Run("system="+size.name, func(b *testing.B) {
			r := &Request{Model: llama, HasSystem: true, System: strings.Repeat("x", size.n)}
			b.ReportAllocs()
			b.SetBytes(int64(min(size.n, DefaultMaxPrefixLength)))
			for b.Loop() {
				sinkKey, _ = r.PrefixKey(0)
			}
		})
	}
	// The extended key (ExtendedKey): a salted request, and a first message with two images.
	text := strings.Repeat("x", 1024)
	for _, tc := range []struct {
		name string
		r    *Request
	}{
		{"system=1KiB/salted", &Request{Model: llama, HasSystem: true, System: text, CacheSalt: "tenant-0123456789abcdef"}},
		{"message=1KiB/images=2", &Request{Model: llama, Messages: []Message{{Role: "user", Text: text}},
			Media: []Media{{Kind: MediaImage, Offset: 10, Hash: 1}, {Kind: MediaImage, Offset: 500, Hash: 2}}}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(DefaultMaxPrefixLength)
			for b.Loop() {
				sinkKey, _ = tc.r.PrefixKey(0)
			}
		})
	}
}

// BenchmarkComputeKeyPaths puts ComputeKey's ways of hashing model ‖ 0x00 ‖ tag ‖ text side by
// side: "stack" is ComputeKey (a stack buffer of smallKeyBuf or keyBufSize bytes, hashed in one
// shot), "stack-large" always uses the keyBufSize buffer, "stream" writes the parts to an
// xxh3.Hasher128 on the stack (ComputeKey's path for inputs longer than keyBufSize).
func BenchmarkComputeKeyPaths(b *testing.B) {
	for _, size := range promptSizes[:2] { // 4 KiB is cut to 1 KiB
		text := strings.Repeat("x", size.n)
		b.Run("path=stack/system="+size.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(text)))
			for b.Loop() {
				sinkKey = ComputeKey(llama, 'S', text, 0)
			}
		})
		if len(llama)+2+len(text) > smallKeyBuf {
			b.Run("path=stack-large/system="+size.name, func(b *testing.B) {
				b.ReportAllocs()
				b.SetBytes(int64(len(text)))
				for b.Loop() {
					sinkKey = computeKeyBuf(len(llama)+2+len(text), llama, 'S', text)
				}
			})
		}
		b.Run("path=stream/system="+size.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(text)))
			for b.Loop() {
				sinkKey = computeKeyStream(llama, 'S', text)
			}
		})
	}
}

func BenchmarkBlockKeys(b *testing.B) {
	toks := testTokens(8192)
	for _, c := range []struct {
		name string
		bs   int
		mm   []MultiModalSpan
	}{
		{"tokens=8192/block=16", 16, nil},
		{"tokens=8192/block=16/mm=4", 16, []MultiModalSpan{{10, 576, 1}, {1000, 576, 2}, {3000, 576, 3}, {6000, 576, 4}}},
		{"tokens=8192/block=16/mm=256", 16, manySpans(256, 32, 8)},
		{"tokens=8192/block=64", 64, nil},
	} {
		b.Run(c.name, func(b *testing.B) {
			r := &Request{Model: llama, TokenIDs: toks, MultiModal: c.mm}
			dst := make([]uint64, 0, len(toks)/c.bs)
			b.ReportAllocs()
			b.SetBytes(int64(4 * len(toks)))
			for b.Loop() {
				dst = r.BlockKeys(dst[:0], c.bs)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(dst)), "ns/block")
		})
	}
}

func BenchmarkNextBlockKey(b *testing.B) {
	toks := testTokens(1024)
	for _, n := range []int{16, 64, 256, 1024} {
		b.Run(fmt.Sprintf("tokens=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(8 + 4*n))
			for b.Loop() {
				sinkU64 = NextBlockKey(sinkU64, toks[:n], nil)
			}
		})
	}
}

func BenchmarkBlockRoot(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		sinkU64 = BlockRoot(llama, "tenant-42")
	}
}

// BenchmarkContentHashPaths puts BlockContentHash's ways of hashing a block with one extra key
// side by side: "stack" encodes into a 128-byte stack buffer (up to 16 tokens and 8 extra keys),
// "large" into a 1 KiB one, "stream" writes to an xxh3.Hasher on the stack; "direct" is a block
// without extra keys, hashed in place (hash64B for 16 tokens, else xxh3.Hash of the tokens' memory).
func BenchmarkContentHashPaths(b *testing.B) {
	toks := testTokens(1024)
	extra := []uint64{7}
	for _, n := range []int{16, 32, 64, 128, 248} {
		in := toks[:n]
		size := 4*n + 8
		b.Run(fmt.Sprintf("path=direct/tokens=%d", n), func(b *testing.B) {
			b.SetBytes(int64(4 * n))
			for b.Loop() {
				sinkU64 += BlockContentHash(in, nil)
			}
		})
		if size <= smallBlockBuf {
			b.Run(fmt.Sprintf("path=stack/tokens=%d", n), func(b *testing.B) {
				b.SetBytes(int64(size))
				for b.Loop() {
					sinkU64 += BlockContentHash(in, extra)
				}
			})
		}
		b.Run(fmt.Sprintf("path=large/tokens=%d", n), func(b *testing.B) {
			b.SetBytes(int64(size))
			for b.Loop() {
				sinkU64 += contentHashLarge(size, in, extra)
			}
		})
		b.Run(fmt.Sprintf("path=stream/tokens=%d", n), func(b *testing.B) {
			b.SetBytes(int64(size))
			for b.Loop() {
				sinkU64 += contentHashStream(in, extra)
			}
		})
	}
}

// manySpans returns n sorted spans of length tokens, one every stride tokens (video frames, say).
func manySpans(n, stride, length int) []MultiModalSpan {
	mm := make([]MultiModalSpan, n)
	for i := range mm {
		mm[i] = MultiModalSpan{Offset: i * stride, Length: length, Hash: uint64(i)}
	}
	return mm
}
