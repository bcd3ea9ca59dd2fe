package prefixkey

import (
	"cmp"
	"encoding/binary"
	"math/bits"
	"slices"
	"unsafe"

	"github.com/zeebo/xxh3"
)

// DefaultBlockSize is the number of tokens per KV-cache block when the caller passes a blockSize <= 0
// (vLLM's default).
const DefaultBlockSize = 16

// BlockRoot returns the parent of a chain's block 0: xxh3-64 over
//
//	le64(len(modelOrAdapter)) ‖ modelOrAdapter ‖ le64(len(cacheSalt)) ‖ cacheSalt
//
// where le64 is an unsigned 64-bit little-endian integer. modelOrAdapter is the LoRA adapter's name
// when the request runs on one (vLLM's lora_name), otherwise the model name; cacheSalt is vLLM's
// cache_salt ("" for none). Both fields are length-prefixed, so no two (name, salt) pairs share an
// input. It does not allocate and is safe for concurrent use.
func BlockRoot(modelOrAdapter, cacheSalt string) uint64 {
	const bufSize = 256
	n := 16 + len(modelOrAdapter) + len(cacheSalt)
	if n > bufSize {
		var h xxh3.Hasher
		var l [8]byte
		binary.LittleEndian.PutUint64(l[:], uint64(len(modelOrAdapter)))
		h.Write(l[:])
		h.WriteString(modelOrAdapter)
		binary.LittleEndian.PutUint64(l[:], uint64(len(cacheSalt)))
		h.Write(l[:])
		h.WriteString(cacheSalt)
		return h.Sum64()
	}
	var buf [bufSize]byte
	binary.LittleEndian.PutUint64(buf[0:], uint64(len(modelOrAdapter)))
	i := 8 + copy(buf[8:], modelOrAdapter)
	binary.LittleEndian.PutUint64(buf[i:], uint64(len(cacheSalt)))
	copy(buf[i+8:], cacheSalt)
	return xxh3.Hash(buf[:n])
}

// KeySpace is the version of the block-key function (NextBlockKey, AppendBlockKeys): a store that
// keeps block keys beyond one process (kvindex/redisindex's key names, the event log's
// snapshots) records it, so that a router of one version never reads another version's keys as
// valid. Version 2 chains a content hash per block with one multiply; version 1 hashed the parent
// key and the tokens together.
const KeySpace = 2

// Stack-buffer sizes for the content hash of a block with extra keys, le32 tokens ‖ le64 extras.
// The small buffer holds a 16-token block with up to 8 extra keys; the large one up to 256 tokens,
// or a 128-token block with up to 64 extra keys. Larger inputs are streamed through an
// xxh3.Hasher, which measured slower than the large buffer (BenchmarkNextBlockKeyPaths).
const (
	smallBlockBuf = 4*16 + 8*8 // 128 bytes
	largeBlockBuf = 1024
)

// Constants of the chain step (ChainBlockKey): two odd 64-bit words with no pattern (the
// fractional digits of √2 and √3).
const (
	chainA = 0x6a09e667f3bcc909
	chainB = 0xbb67ae8584caa73b
)

// NextBlockKey returns the key of a block whose parent key is parent (BlockRoot for block 0):
//
//	ChainBlockKey(parent, BlockContentHash(tokens, extra))
//
// The key therefore commits to the whole chain before it. tokens are the block's token IDs (a full
// block, normally); extra are its extra keys (multimodal content hashes of the items whose
// placeholders overlap the block, in order), nil for none.
//
// kvindex re-keys an engine's BlockStored event with it: block i of the event has the previous block's
// key as parent and tokens token_ids[i*block_size:(i+1)*block_size].
//
// It does not allocate and is safe for concurrent use.
func NextBlockKey(parent uint64, tokens []uint32, extra []uint64) uint64 {
	return ChainBlockKey(parent, BlockContentHash(tokens, extra))
}

// ChainBlockKey is the chain step of the block keys: with a = parent ⊕ 0x6a09e667f3bcc909 and
// b = content ⊕ 0xbb67ae8584caa73b, the key is (hi ⊕ lo) + (parent ⊕ content) modulo 2⁶⁴, where
// hi:lo is the 128-bit product a·b. content is the block's BlockContentHash. The step is one
// multiply long, so that the chain of a long prompt costs about one multiply per block beyond
// hashing the blocks, which do not depend on one another; the added term keeps the key a
// function of both inputs where the product is degenerate (a or b zero).
//
// Block keys are not a cryptographic commitment: a client that chooses its tokens can make its
// own keys collide with a key it knows. A collision only steers routing (an engine checks its
// own cache); tenants whose prompts must not share keys are kept apart by their cache salts
// (BlockRoot).
func ChainBlockKey(parent, content uint64) uint64 {
	hi, lo := bits.Mul64(parent^chainA, content^chainB)
	return (hi ^ lo) + (parent ^ content)
}

// BlockContentHash returns xxh3-64 (seed 0) over
//
//	le32(tokens[0]) ‖ … ‖ le32(tokens[n-1]) ‖ le64(extra[0]) ‖ … ‖ le64(extra[m-1])
//
// where le32 and le64 are unsigned little-endian integers: the content of one block, without its
// parent. Since xxh3 hashes the input's length, blocks of different sizes never share an input;
// a chain must still use one block size throughout to match an engine's.
//
// It does not allocate and is safe for concurrent use.
func BlockContentHash(tokens []uint32, extra []uint64) uint64 {
	if len(extra) == 0 && littleEndian() {
		if len(tokens) == 16 {
			return hash64B(tokenBytes(tokens))
		}
		return xxh3.Hash(tokenBytes(tokens))
	}
	n := 4*len(tokens) + 8*len(extra)
	switch {
	case n <= smallBlockBuf:
		var buf [smallBlockBuf]byte
		return xxh3.Hash(encodeBlock(buf[:n], tokens, extra))
	case n <= largeBlockBuf:
		return contentHashLarge(n, tokens, extra)
	default:
		return contentHashStream(tokens, extra)
	}
}

// xxh3's default secret, its first 64 bytes as little-endian words, and its 64-bit prime 1: what
// xxh3-64 with seed 0 mixes a 64-byte input with.
const (
	xxSecret0   = 0xbe4ba423396cfeb8
	xxSecret1   = 0x1cad21f72c81017c
	xxSecret2   = 0xdb979083e96dd4de
	xxSecret3   = 0x1f67b3b7a4a44072
	xxSecret4   = 0x78e5c0cc4ee679cb
	xxSecret5   = 0x2172ffcc7dd05a82
	xxSecret6   = 0x8e2443f7744608b8
	xxSecret7   = 0x4c263a81e69035e0
	xxPrime64_1 = 0x9e3779b185ebca87
)

// hash64B is xxh3-64 (seed 0) of b, which must be 64 bytes long: xxh3's path for inputs of 17 to
// 128 bytes at length 64, written out for the one size that a 16-token block of uint32 token IDs
// has, so that hashing a prompt's blocks costs no call into the general function and no copy
// (TestHash64BIsXXH3 and FuzzHash64B hold it equal to xxh3.Hash).
func hash64B(b []byte) uint64 {
	b = b[:64:64]
	le := binary.LittleEndian
	acc := uint64(64 * xxPrime64_1 % (1 << 64))
	acc += mulFold(le.Uint64(b[0:])^xxSecret0, le.Uint64(b[8:])^xxSecret1)
	acc += mulFold(le.Uint64(b[48:])^xxSecret2, le.Uint64(b[56:])^xxSecret3)
	acc += mulFold(le.Uint64(b[16:])^xxSecret4, le.Uint64(b[24:])^xxSecret5)
	acc += mulFold(le.Uint64(b[32:])^xxSecret6, le.Uint64(b[40:])^xxSecret7)
	acc ^= acc >> 37
	acc *= 0x165667919e3779f9
	return acc ^ acc>>32
}

// mulFold returns the high and low words of the 128-bit product a·b, xored.
func mulFold(a, b uint64) uint64 {
	hi, lo := bits.Mul64(a, b)
	return hi ^ lo
}

// contentHashLarge keeps the 1 KiB buffer out of BlockContentHash's frame, which then stays small
// (and cheap to zero) for typical blocks.
//
//go:noinline
func contentHashLarge(n int, tokens []uint32, extra []uint64) uint64 {
	var buf [largeBlockBuf]byte
	return xxh3.Hash(encodeBlock(buf[:n], tokens, extra))
}

// encodeBlock writes BlockContentHash's input into b, which must be exactly
// 4*len(tokens)+8*len(extra) bytes long, and returns b.
func encodeBlock(b []byte, tokens []uint32, extra []uint64) []byte {
	putTokens(b[:4*len(tokens)], tokens)
	e := b[4*len(tokens):]
	for i, x := range extra {
		binary.LittleEndian.PutUint64(e[8*i:], x)
	}
	return b
}

// putTokens writes tokens into b (len(b) == 4*len(tokens)) as le32 values: on little-endian
// machines by copying the tokens' own memory in one move.
func putTokens(b []byte, tokens []uint32) {
	if len(tokens) > 0 && littleEndian() {
		copy(b, tokenBytes(tokens))
		return
	}
	putTokensPortable(b, tokens)
}

// putTokensPortable is putTokens for any byte order. It stores two tokens per 64-bit word: xxh3
// loads 8-byte words, and a load that straddles two 4-byte stores cannot be forwarded from them and
// stalls (with one store per token, the stalls cost more than the hash).
func putTokensPortable(b []byte, tokens []uint32) {
	for len(tokens) >= 2 && len(b) >= 8 {
		binary.LittleEndian.PutUint64(b, uint64(tokens[0])|uint64(tokens[1])<<32)
		tokens, b = tokens[2:], b[8:]
	}
	if len(tokens) == 1 && len(b) >= 4 {
		binary.LittleEndian.PutUint32(b, tokens[0])
	}
}

// tokenBytes returns the memory of tokens as bytes (their le32 encoding on a little-endian machine).
func tokenBytes(tokens []uint32) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(tokens))), 4*len(tokens))
}

// littleEndian reports whether the machine is little-endian; the compiler folds it to a constant.
func littleEndian() bool {
	var b [2]byte
	binary.NativeEndian.PutUint16(b[:], 1)
	return b[0] == 1
}

// contentHashStream hashes BlockContentHash's input through a streaming xxh3.Hasher, which gives
// the same value as the one-shot hash of the whole input.
//
//go:noinline
func contentHashStream(tokens []uint32, extra []uint64) uint64 {
	var h xxh3.Hasher
	writeTokens(&h, tokens)
	var b [8]byte
	for _, x := range extra {
		binary.LittleEndian.PutUint64(b[:], x)
		h.Write(b[:])
	}
	return h.Sum64()
}

// writeTokens writes tokens to h as le32 values.
func writeTokens(h *xxh3.Hasher, tokens []uint32) {
	if littleEndian() {
		h.Write(tokenBytes(tokens))
		return
	}
	var chunk [512]byte
	for len(tokens) > 0 {
		m := min(len(tokens), len(chunk)/4)
		putTokensPortable(chunk[:4*m], tokens[:m])
		h.Write(chunk[:4*m])
		tokens = tokens[m:]
	}
}

// maxStackExtras is how many multimodal hashes AppendBlockKeys gathers for one block on the stack;
// a block overlapped by more items is hashed by the streaming path.
const maxStackExtras = 16

// AppendBlockKeys appends to dst the chained keys of the full blocks of tokens and returns the
// extended slice: key 0 is NextBlockKey(root, tokens[0:blockSize], extra₀), key i is
// NextBlockKey(key i−1, tokens[i*blockSize:(i+1)*blockSize], extraᵢ). A trailing partial block has no
// key (engines cache full blocks only). blockSize <= 0 means DefaultBlockSize.
//
// extraᵢ lists, in the order of mm, the Hash of every span whose tokens [Offset, Offset+Length)
// overlap block i's tokens [i*blockSize, (i+1)*blockSize); spans with Length <= 0 overlap nothing.
// An item spanning several blocks is thus folded into each of them.
//
// It allocates only when dst lacks capacity for len(tokens)/blockSize more keys, and is safe for
// concurrent use (the inputs are only read).
func AppendBlockKeys(dst []uint64, root uint64, tokens []uint32, blockSize int, mm []MultiModalSpan) []uint64 {
	if blockSize <= 0 {
		blockSize = DefaultBlockSize
	}
	nblocks := len(tokens) / blockSize
	if nblocks == 0 {
		return dst
	}
	dst = slices.Grow(dst, nblocks)
	parent := root
	if len(mm) == 0 {
		if blockSize == 16 && littleEndian() {
			return appendKeys16(dst, root, tokens[:16*nblocks])
		}
		for i := 0; i < nblocks; i++ {
			parent = NextBlockKey(parent, tokens[i*blockSize:(i+1)*blockSize], nil)
			dst = append(dst, parent)
		}
		return dst
	}
	// When mm is sorted by Offset (the usual case), a block only needs the spans from the first one
	// that has not ended before it up to the first one that starts after it: the loop is then linear
	// in blocks + spans instead of their product.
	sorted := slices.IsSortedFunc(mm, func(a, b MultiModalSpan) int { return cmp.Compare(a.Offset, b.Offset) })
	first := 0
	for i := 0; i < nblocks; i++ {
		lo, hi := i*blockSize, (i+1)*blockSize
		window := mm
		if sorted {
			for first < len(mm) && endsBy(mm[first], lo) {
				first++
			}
			window = mm[first:]
		}
		parent = blockKeyMM(parent, tokens[lo:hi], lo, window, sorted)
		dst = append(dst, parent)
	}
	return dst
}

// appendKeys16 is AppendBlockKeys for 16-token blocks without extra keys on a little-endian
// machine (len(tokens) a multiple of 16, dst with room for the keys): the loop the Router runs
// per request, with the content hash and the chain step written inline. The blocks' hashes do not
// depend on one another, so the processor overlaps them; only the chain's one multiply per block
// is sequential.
func appendKeys16(dst []uint64, parent uint64, tokens []uint32) []uint64 {
	n := len(tokens) / 16
	base := len(dst)
	dst = dst[:base+n]
	out := dst[base:]
	all := tokenBytes(tokens)
	for i := range out {
		parent = ChainBlockKey(parent, hash64B(all[64*i:64*i+64]))
		out[i] = parent
	}
	return dst
}

// blockKeyMM is NextBlockKey with the hashes of the spans of mm that overlap tokens
// [lo, lo+len(block)) as extra keys. sorted says that mm is sorted by Offset, so that the scan can
// stop at the first span that starts after the block.
func blockKeyMM(parent uint64, block []uint32, lo int, mm []MultiModalSpan, sorted bool) uint64 {
	var stack [maxStackExtras]uint64
	extra := stack[:0]
	hi := lo + len(block)
	for _, s := range mm {
		if sorted && s.Offset >= hi {
			break
		}
		if !overlaps(s, lo, hi) {
			continue
		}
		if len(extra) == maxStackExtras {
			return blockKeyMMStream(parent, block, lo, mm)
		}
		extra = append(extra, s.Hash)
	}
	return NextBlockKey(parent, block, extra)
}

// blockKeyMMStream is blockKeyMM for a block overlapped by more than maxStackExtras spans.
//
//go:noinline
func blockKeyMMStream(parent uint64, block []uint32, lo int, mm []MultiModalSpan) uint64 {
	var h xxh3.Hasher
	var b [8]byte
	writeTokens(&h, block)
	hi := lo + len(block)
	for _, s := range mm {
		if overlaps(s, lo, hi) {
			binary.LittleEndian.PutUint64(b[:], s.Hash)
			h.Write(b[:])
		}
	}
	return ChainBlockKey(parent, h.Sum64())
}

// overlaps reports whether span s shares a token with [lo, hi).
func overlaps(s MultiModalSpan, lo, hi int) bool {
	return s.Offset < hi && !endsBy(s, lo)
}

// endsBy reports whether span s holds no token at or after position lo (an empty span never does).
func endsBy(s MultiModalSpan, lo int) bool {
	if s.Length <= 0 {
		return true
	}
	end := s.Offset + s.Length
	return end <= lo && end > s.Offset // end <= s.Offset: the sum overflowed, the span runs to the end
}

// BlockKeys is BlockKeysOf(dst, r.TokenIDs, blockSize).
func (r *Request) BlockKeys(dst []uint64, blockSize int) []uint64 {
	return r.BlockKeysOf(dst, r.TokenIDs, blockSize)
}

// BlockKeysOf appends to dst the block keys of tokens as r's prompt: AppendBlockKeys with the
// root BlockRoot(r.ModelOrAdapter(), r.CacheSalt) and the spans r.MultiModal (blockSize ≤ 0
// means DefaultBlockSize). tokens are r's own (TokenIDs, PromptTokens) or a tokenizer's. It
// returns dst unchanged when tokens hold no full block, and when r has media the caller did not
// place (r.MediaPlaced() is false): without spans, the keys of two requests that differ only in an
// image would be equal. It allocates only when dst lacks capacity, and is safe for concurrent use
// with other readers of r.
func (r *Request) BlockKeysOf(dst []uint64, tokens []uint32, blockSize int) []uint64 {
	if blockSize <= 0 {
		blockSize = DefaultBlockSize
	}
	if len(tokens) < blockSize || !r.MediaPlaced() {
		return dst
	}
	return AppendBlockKeys(dst, BlockRoot(r.ModelOrAdapter(), r.CacheSalt), tokens, blockSize, r.MultiModal)
}
