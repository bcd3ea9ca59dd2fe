package prefixkey

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/big"
	"slices"
	"strings"
	"testing"

	"github.com/zeebo/xxh3"
)

// refBlockRoot, refNextBlockKey and refAppendBlockKeys are independent, straightforward versions of
// the block-key functions: they build the documented layouts in a bytes.Buffer and hash in one shot.
func refBlockRoot(name, salt string) uint64 {
	var b bytes.Buffer
	binary.Write(&b, binary.LittleEndian, uint64(len(name)))
	b.WriteString(name)
	binary.Write(&b, binary.LittleEndian, uint64(len(salt)))
	b.WriteString(salt)
	return xxh3.Hash(b.Bytes())
}

func refNextBlockKey(parent uint64, tokens []uint32, extra []uint64) uint64 {
	content := refContentHash(tokens, extra)
	// The chain step as documented: (hi ^ lo) of the 128-bit product, plus parent ^ content.
	a, c := new(big.Int).SetUint64(parent^0x6a09e667f3bcc909), new(big.Int).SetUint64(content^0xbb67ae8584caa73b)
	prod := new(big.Int).Mul(a, c)
	lo := new(big.Int).And(prod, new(big.Int).SetUint64(^uint64(0))).Uint64()
	hi := new(big.Int).Rsh(prod, 64).Uint64()
	return (hi ^ lo) + (parent ^ content)
}

func refContentHash(tokens []uint32, extra []uint64) uint64 {
	var b bytes.Buffer
	for _, t := range tokens {
		binary.Write(&b, binary.LittleEndian, t)
	}
	for _, x := range extra {
		binary.Write(&b, binary.LittleEndian, x)
	}
	return xxh3.Hash(b.Bytes())
}

func refAppendBlockKeys(dst []uint64, root uint64, tokens []uint32, blockSize int, mm []MultiModalSpan) []uint64 {
	if blockSize <= 0 {
		blockSize = 16
	}
	parent := root
	for start := 0; start+blockSize <= len(tokens); start += blockSize {
		var extra []uint64
		for _, s := range mm {
			// token t is in the span when s.Offset <= t < s.Offset+s.Length
			for t := start; t < start+blockSize; t++ {
				if s.Offset <= t && t-s.Offset < s.Length {
					extra = append(extra, s.Hash)
					break
				}
			}
		}
		parent = refNextBlockKey(parent, tokens[start:start+blockSize], extra)
		dst = append(dst, parent)
	}
	return dst
}

// testTokens returns n deterministic token IDs in a Llama-3-sized vocabulary.
func testTokens(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32((i*2654435761 + 12345) % 128256)
	}
	return out
}

func hex64(xs ...uint64) []string {
	out := make([]string, len(xs))
	for i, x := range xs {
		out[i] = fmt.Sprintf("%016x", x)
	}
	return out
}

const llama = "meta-llama/Llama-3.1-8B-Instruct"

// Pinned vectors: computed once with the reference functions above; a change of the byte layouts
// breaks them.
var rootVectors = []struct {
	name, model, salt string
	want              string
}{
	{"empty", "", "", "d0a66a65c7528968"},
	{"model", llama, "", "2d83ef55920c2f56"},
	{"lora", "sql-lora", "", "1ceea241acfeb5f1"},
	{"model-salt", llama, "tenant-42", "c680cd34522b8475"},
	{"streamed-long-name", strings.Repeat("n", 300), "s", "f6e49fd32f9fa289"},
}

func TestBlockRootVectors(t *testing.T) {
	for _, v := range rootVectors {
		t.Run(v.name, func(t *testing.T) {
			got, ref := BlockRoot(v.model, v.salt), refBlockRoot(v.model, v.salt)
			if got != ref {
				t.Errorf("BlockRoot = %016x, reference = %016x", got, ref)
			}
			if s := fmt.Sprintf("%016x", got); s != v.want {
				t.Errorf("BlockRoot = %s, pinned %s (reference: %016x)", s, v.want, ref)
			}
		})
	}
	// Length prefixes keep the fields apart.
	if BlockRoot("ab", "c") == BlockRoot("a", "bc") || BlockRoot("m", "") == BlockRoot("", "m") {
		t.Error("BlockRoot fields are not separated")
	}
}

var nextVectors = []struct {
	name   string
	parent uint64
	tokens []uint32
	extra  []uint64
	want   string
}{
	{"no-tokens", 0, nil, nil, "3bd6ea3df5ce6fcf"},
	{"16-tokens", 0x0123456789abcdef, testTokens(16), nil, "63c1ed1cf6566410"},
	{"16-tokens-2-extra", 0x0123456789abcdef, testTokens(16), []uint64{0xdeadbeef, 0xfeedface}, "fe0a241222bdf7de"},
	{"128-tokens-large-buffer", 42, testTokens(128), nil, "367c89babf570530"},
	{"300-tokens-streamed", 42, testTokens(300), []uint64{7}, "8478f6013d2b4cde"},
}

func TestNextBlockKeyVectors(t *testing.T) {
	for _, v := range nextVectors {
		t.Run(v.name, func(t *testing.T) {
			got, ref := NextBlockKey(v.parent, v.tokens, v.extra), refNextBlockKey(v.parent, v.tokens, v.extra)
			if got != ref {
				t.Errorf("NextBlockKey = %016x, reference = %016x", got, ref)
			}
			if s := fmt.Sprintf("%016x", got); s != v.want {
				t.Errorf("NextBlockKey = %s, pinned %s (reference: %016x)", s, v.want, ref)
			}
		})
	}
}

// TestNextBlockKeyMatchesReference crosses the small, large and streaming paths at their boundaries.
func TestNextBlockKeyMatchesReference(t *testing.T) {
	toks := testTokens(2000)
	extras := []uint64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20}
	for _, nt := range []int{0, 1, 15, 16, 17, 29, 30, 31, 32, 64, 128, 200, 253, 254, 255, 256, 512, 1000, 2000} {
		for _, ne := range []int{0, 1, 7, 8, 20} {
			got := NextBlockKey(99, toks[:nt], extras[:ne])
			if want := refNextBlockKey(99, toks[:nt], extras[:ne]); got != want {
				t.Fatalf("%d tokens, %d extra: got %016x, want %016x", nt, ne, got, want)
			}
		}
	}
}

// 4 full blocks of 16 plus a partial block of 5 tokens.
var tokens69 = testTokens(69)

var mmSpans = []MultiModalSpan{
	{Offset: 10, Length: 30, Hash: 0x1111111111111111}, // tokens 10..39: blocks 0, 1, 2
	{Offset: 40, Length: 5, Hash: 0x2222222222222222},  // tokens 40..44: block 2
	{Offset: 64, Length: 5, Hash: 0x3333333333333333},  // partial block only: no key
	{Offset: 20, Length: 0, Hash: 0x4444444444444444},  // empty: overlaps nothing
}

var appendVectors = []struct {
	name      string
	root      uint64
	blockSize int
	mm        []MultiModalSpan
	want      []string
}{
	{"model-root", BlockRoot(llama, ""), 16, nil,
		[]string{"eeac8a81a1e66a5e", "2434cbc1fec82d04", "4cba00ee522c31db", "e9829b911323a78d"}},
	{"default-block-size", BlockRoot(llama, ""), 0, nil,
		[]string{"eeac8a81a1e66a5e", "2434cbc1fec82d04", "4cba00ee522c31db", "e9829b911323a78d"}},
	{"lora-root", BlockRoot("sql-lora", ""), 16, nil,
		[]string{"06bf293a91480789", "6de5104152f2b235", "f039f3d0876207ae", "18bbeae8c55d2e95"}},
	{"model-root-salt", BlockRoot(llama, "tenant-42"), 16, nil,
		[]string{"837fdc2b39f542a3", "eb349e90f0030e1c", "d1cf9bf29f61d64b", "69048aa61f41ba00"}},
	{"multimodal", BlockRoot(llama, ""), 16, mmSpans,
		[]string{"d4ca5cc07845206d", "9bd51bf6e4082390", "81535408b96234eb", "c5e7694f08066fa7"}},
	{"block-size-32", BlockRoot(llama, ""), 32, mmSpans,
		[]string{"a9e9baf5204398a6", "27e256e2f3b59684"}},
}

func TestAppendBlockKeysVectors(t *testing.T) {
	for _, v := range appendVectors {
		t.Run(v.name, func(t *testing.T) {
			got := AppendBlockKeys(nil, v.root, tokens69, v.blockSize, v.mm)
			ref := refAppendBlockKeys(nil, v.root, tokens69, v.blockSize, v.mm)
			if !slices.Equal(got, ref) {
				t.Errorf("AppendBlockKeys = %q, reference = %q", hex64(got...), hex64(ref...))
			}
			if !slices.Equal(hex64(got...), v.want) {
				t.Errorf("AppendBlockKeys = %#v, pinned %q", hex64(got...), v.want)
			}
		})
	}
}

func TestAppendBlockKeysStructure(t *testing.T) {
	root := BlockRoot(llama, "")
	keys := AppendBlockKeys(nil, root, tokens69, 16, nil)
	if len(keys) != 4 {
		t.Fatalf("%d keys for 69 tokens in blocks of 16, want 4 (no key for the partial block)", len(keys))
	}
	// The chain: key i = NextBlockKey(key i-1, block i).
	parent := root
	for i, k := range keys {
		if want := NextBlockKey(parent, tokens69[16*i:16*i+16], nil); k != want {
			t.Errorf("key %d = %016x, want NextBlockKey(parent, block %d) = %016x", i, k, i, want)
		}
		parent = k
	}
	// Appends to dst.
	prefix := []uint64{1, 2}
	if got := AppendBlockKeys(prefix, root, tokens69, 16, nil); !slices.Equal(got[:2], prefix) || !slices.Equal(got[2:], keys) {
		t.Errorf("AppendBlockKeys did not append: %x", got)
	}
	// Fewer tokens than a block: dst unchanged.
	if got := AppendBlockKeys(prefix, root, tokens69[:15], 16, nil); !slices.Equal(got, prefix) {
		t.Errorf("15 tokens: %x, want dst unchanged", got)
	}
	// Roots separate chains.
	for _, other := range []uint64{BlockRoot("sql-lora", ""), BlockRoot(llama, "salt")} {
		if o := AppendBlockKeys(nil, other, tokens69, 16, nil); o[0] == keys[0] || o[3] == keys[3] {
			t.Error("a different root gave the same chain")
		}
	}
	// Multimodal hashes change exactly the blocks they overlap, and the chain after them.
	mm := []MultiModalSpan{{Offset: 40, Length: 5, Hash: 9}} // block 2
	withMM := AppendBlockKeys(nil, root, tokens69, 16, mm)
	if withMM[0] != keys[0] || withMM[1] != keys[1] || withMM[2] == keys[2] || withMM[3] == keys[3] {
		t.Errorf("span in block 2: keys %x, plain %x", withMM, keys)
	}
	// A span touching only the partial block, or empty, changes nothing.
	for _, s := range []MultiModalSpan{{Offset: 64, Length: 5, Hash: 9}, {Offset: 20, Length: 0, Hash: 9}, {Offset: 100, Length: 5, Hash: 9}} {
		if got := AppendBlockKeys(nil, root, tokens69, 16, []MultiModalSpan{s}); !slices.Equal(got, keys) {
			t.Errorf("span %+v changed the keys", s)
		}
	}
	// Span boundaries: [15,16) is in block 0 only; [16,17) in block 1 only; a huge Length does not overflow.
	for _, tt := range []struct {
		s       MultiModalSpan
		changed []bool
	}{
		{MultiModalSpan{Offset: 15, Length: 1, Hash: 9}, []bool{true, true, true, true}},
		{MultiModalSpan{Offset: 16, Length: 1, Hash: 9}, []bool{false, true, true, true}},
		{MultiModalSpan{Offset: 47, Length: 1 << 62, Hash: 9}, []bool{false, false, true, true}},
		{MultiModalSpan{Offset: 48, Length: int(^uint(0) >> 1), Hash: 9}, []bool{false, false, false, true}},
		{MultiModalSpan{Offset: -10, Length: 11, Hash: 9}, []bool{true, true, true, true}},
		{MultiModalSpan{Offset: -10, Length: 10, Hash: 9}, []bool{false, false, false, false}},
	} {
		got := AppendBlockKeys(nil, root, tokens69, 16, []MultiModalSpan{tt.s})
		for i := range got {
			if (got[i] != keys[i]) != tt.changed[i] {
				t.Errorf("span %+v: key %d changed = %v, want %v", tt.s, i, got[i] != keys[i], tt.changed[i])
			}
		}
		if ref := refAppendBlockKeys(nil, root, tokens69, 16, []MultiModalSpan{tt.s}); !slices.Equal(got, ref) {
			t.Errorf("span %+v: %x, reference %x", tt.s, got, ref)
		}
	}
	// mm order matters: two items in one block in the other order are different content.
	a := AppendBlockKeys(nil, root, tokens69, 16, []MultiModalSpan{{0, 4, 1}, {4, 4, 2}})
	b := AppendBlockKeys(nil, root, tokens69, 16, []MultiModalSpan{{4, 4, 2}, {0, 4, 1}})
	if a[0] == b[0] {
		t.Error("mm order does not change the key")
	}
}

// TestAppendBlockKeysManySpans exercises the streaming path for a block overlapped by more spans
// than fit on the stack.
func TestAppendBlockKeysManySpans(t *testing.T) {
	toks := testTokens(256)
	for _, n := range []int{maxStackExtras - 1, maxStackExtras, maxStackExtras + 1, 100} {
		unsorted := make([]MultiModalSpan, n)
		for i := range unsorted {
			unsorted[i] = MultiModalSpan{Offset: i % 40, Length: 3, Hash: uint64(i) * 0x9e3779b97f4a7c15}
		}
		sorted := slices.Clone(unsorted)
		slices.SortStableFunc(sorted, func(a, b MultiModalSpan) int { return a.Offset - b.Offset })
		cases := map[string][]MultiModalSpan{
			"unsorted": unsorted,
			"sorted":   sorted,
			// sorted, with a long span first and empty and overlapping ones among them
			"sorted-long-first": append([]MultiModalSpan{{Offset: 0, Length: 200, Hash: 1}, {Offset: 0, Length: 0, Hash: 2}}, manySpans(n, 7, 12)...),
		}
		for name, mm := range cases {
			for _, bs := range []int{16, 64, 256} {
				got := AppendBlockKeys(nil, 5, toks, bs, mm)
				if want := refAppendBlockKeys(nil, 5, toks, bs, mm); !slices.Equal(got, want) {
					t.Errorf("%s, %d spans, block size %d: %x, want %x", name, n, bs, got, want)
				}
			}
		}
	}
}

// TestBlockKeysPrefixProperty: changing any token of block j changes keys j..end and no key before j.
func TestBlockKeysPrefixProperty(t *testing.T) {
	const bs = 16
	toks := testTokens(bs*12 + 7)
	root := BlockRoot(llama, "")
	base := AppendBlockKeys(nil, root, toks, bs, nil)
	for pos := 0; pos < len(toks); pos++ {
		mod := slices.Clone(toks)
		mod[pos] ^= 1
		got := AppendBlockKeys(nil, root, mod, bs, nil)
		j := pos / bs
		for i := range got {
			if changed := got[i] != base[i]; changed != (i >= j && j < len(base)) {
				t.Fatalf("token %d (block %d) flipped: key %d changed = %v", pos, j, i, changed)
			}
		}
	}
}

func TestRequestBlockKeys(t *testing.T) {
	toks := testTokens(100)
	mm := []MultiModalSpan{{Offset: 3, Length: 20, Hash: 77}}
	tests := []struct {
		name string
		req  Request
		root uint64
	}{
		{"model", Request{Model: llama, TokenIDs: toks, MultiModal: mm}, BlockRoot(llama, "")},
		{"adapter", Request{Model: llama, Adapter: "sql-lora", TokenIDs: toks, MultiModal: mm}, BlockRoot("sql-lora", "")},
		{"salt", Request{Model: llama, CacheSalt: "s", TokenIDs: toks, MultiModal: mm}, BlockRoot(llama, "s")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, bs := range []int{0, 16, 32} {
				got := tt.req.BlockKeys(nil, bs)
				if want := AppendBlockKeys(nil, tt.root, toks, bs, mm); !slices.Equal(got, want) {
					t.Errorf("block size %d: %x, want %x", bs, got, want)
				}
			}
		})
	}
	var empty Request
	if got := empty.BlockKeys(nil, 16); got != nil {
		t.Errorf("no tokens: %v, want nil", got)
	}
}

func TestBlockKeysAllocs(t *testing.T) {
	toks := testTokens(8192)
	mm := []MultiModalSpan{{Offset: 100, Length: 600, Hash: 1}, {Offset: 5000, Length: 64, Hash: 2}}
	dst := make([]uint64, 0, len(toks)/16)
	big := testTokens(1000)
	r := &Request{Model: llama, CacheSalt: "salt", TokenIDs: toks, MultiModal: mm}
	longName := strings.Repeat("x", 300)
	var sink uint64
	for _, tt := range []struct {
		name string
		fn   func()
	}{
		{"NextBlockKey/16", func() { sink = NextBlockKey(1, toks[:16], nil) }},
		{"NextBlockKey/16+extra", func() { sink = NextBlockKey(1, toks[:16], []uint64{1, 2}) }},
		{"NextBlockKey/128", func() { sink = NextBlockKey(1, toks[:128], nil) }},
		{"NextBlockKey/1000-streamed", func() { sink = NextBlockKey(1, big, nil) }},
		{"BlockRoot", func() { sink = BlockRoot(llama, "salt") }},
		{"BlockRoot/streamed", func() { sink = BlockRoot(longName, "salt") }},
		{"AppendBlockKeys", func() { dst = AppendBlockKeys(dst[:0], 1, toks, 16, nil) }},
		{"AppendBlockKeys/mm", func() { dst = AppendBlockKeys(dst[:0], 1, toks, 16, mm) }},
		{"Request.BlockKeys", func() { dst = r.BlockKeys(dst[:0], 16) }},
	} {
		if n := testing.AllocsPerRun(50, tt.fn); n != 0 {
			t.Errorf("%s: %v allocations per run, want 0", tt.name, n)
		}
	}
	_ = sink
}

func FuzzAppendBlockKeys(f *testing.F) {
	f.Add([]byte("some token bytes to split into blocks of four"), uint8(4), []byte{3, 10, 20, 5}, uint64(1))
	f.Add(make([]byte, 600), uint8(0), []byte{0, 255, 250, 0, 1, 1}, uint64(2))
	f.Fuzz(func(t *testing.T, raw []byte, bs uint8, spans []byte, h uint64) {
		toks := make([]uint32, len(raw)/2)
		for i := range toks {
			toks[i] = uint32(binary.LittleEndian.Uint16(raw[2*i:]))
		}
		// Each pair of bytes is a span (offset, signed length); sorting them exercises both paths.
		var mm []MultiModalSpan
		for i := 0; i+1 < len(spans); i += 2 {
			mm = append(mm, MultiModalSpan{Offset: int(spans[i]) - 8, Length: int(int8(spans[i+1])), Hash: h + uint64(i)})
		}
		for _, order := range []string{"given", "sorted"} {
			if order == "sorted" {
				slices.SortStableFunc(mm, func(a, b MultiModalSpan) int { return a.Offset - b.Offset })
			}
			got := AppendBlockKeys(nil, 3, toks, int(bs), mm)
			if want := refAppendBlockKeys(nil, 3, toks, int(bs), mm); !slices.Equal(got, want) {
				t.Fatalf("%s spans %v: %x, want %x", order, mm, got, want)
			}
		}
	})
}

// TestPutTokensPortable checks the byte-order-independent encoder (used on big-endian machines)
// against the reference layout.
func TestPutTokensPortable(t *testing.T) {
	for _, n := range []int{0, 1, 2, 3, 16, 17, 200} {
		toks := testTokens(n)
		got := make([]byte, 4*n)
		putTokensPortable(got, toks)
		var want bytes.Buffer
		binary.Write(&want, binary.LittleEndian, toks)
		if !bytes.Equal(got, want.Bytes()) {
			t.Errorf("%d tokens: % x, want % x", n, got, want.Bytes())
		}
	}
}

// hash64B is xxh3-64 of its 64 bytes, on structured and random inputs.
func TestHash64BIsXXH3(t *testing.T) {
	var b [64]byte
	check := func() {
		t.Helper()
		if got, want := hash64B(b[:]), xxh3.Hash(b[:]); got != want {
			t.Fatalf("hash64B(%x) = %016x, xxh3 %016x", b, got, want)
		}
	}
	check() // zeros
	for i := range b {
		b[i] = 0xff
	}
	check()
	for i := range 64 * 8 { // every single bit
		b = [64]byte{}
		b[i/8] = 1 << (i % 8)
		check()
	}
	x := uint64(0x9e3779b97f4a7c15)
	for range 10_000 {
		for i := 0; i < 64; i += 8 {
			x ^= x << 13
			x ^= x >> 7
			x ^= x << 17
			binary.LittleEndian.PutUint64(b[i:], x)
		}
		check()
	}
}

func FuzzHash64B(f *testing.F) {
	f.Add([]byte("sixteen tokens of four bytes each make one 64-byte block......."))
	f.Fuzz(func(t *testing.T, data []byte) {
		var b [64]byte
		copy(b[:], data)
		if got, want := hash64B(b[:]), xxh3.Hash(b[:]); got != want {
			t.Fatalf("hash64B(%x) = %016x, xxh3 %016x", b, got, want)
		}
	})
}

// The 16-token path reads the tokens in place: a slice that starts at any offset of its array
// gives the reference's keys.
func TestAppendBlockKeysUnaligned(t *testing.T) {
	toks := testTokens(16*9 + 3)
	for off := range 4 {
		in := toks[off : off+16*8+1]
		got := AppendBlockKeys(make([]uint64, 1, 2), 77, in, 16, nil)
		want := refAppendBlockKeys(make([]uint64, 1), 77, in, 16, nil)
		if !slices.Equal(got, want) {
			t.Fatalf("offset %d: %x, want %x", off, got, want)
		}
	}
}

// The chain step keeps both inputs where the product is degenerate.
func TestChainBlockKeyDegenerate(t *testing.T) {
	const a, b = 0x6a09e667f3bcc909, 0xbb67ae8584caa73b
	// content ⊕ b = 0: the product is 0, the key still depends on the parent.
	if ChainBlockKey(1, b) == ChainBlockKey(2, b) {
		t.Error("a degenerate content makes every parent's key the same")
	}
	// parent ⊕ a = 0: the key still depends on the content.
	if ChainBlockKey(a, 1) == ChainBlockKey(a, 2) {
		t.Error("a degenerate parent makes every content's key the same")
	}
	if NextBlockKey(5, testTokens(16), nil) != ChainBlockKey(5, BlockContentHash(testTokens(16), nil)) {
		t.Error("NextBlockKey is not ChainBlockKey of BlockContentHash")
	}
}
