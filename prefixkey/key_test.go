package prefixkey

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"testing/quick"
	"unicode/utf8"

	"github.com/zeebo/xxh3"
)

// refTruncateUTF8 is an independent TruncateUTF8: it walks s character by character (an invalid byte
// is a one-byte character) and stops before the first one that would end past n.
func refTruncateUTF8(s string, n int) string {
	end := 0
	for end < len(s) {
		_, size := utf8.DecodeRuneInString(s[end:])
		if end+size > n {
			break
		}
		end += size
	}
	return s[:end]
}

// refComputeKey is an independent, straightforward ComputeKey: it builds the documented layout in a
// bytes.Buffer and hashes it in one shot.
func refComputeKey(model string, tag byte, text string, maxPrefixLength int) Key {
	if maxPrefixLength <= 0 {
		maxPrefixLength = 1024
	}
	var b bytes.Buffer
	b.WriteString(model)
	b.WriteByte(0x00)
	b.WriteByte(tag)
	b.WriteString(refTruncateUTF8(text, maxPrefixLength))
	return Key(xxh3.Hash128(b.Bytes()).Bytes())
}

var (
	ascii1023 = strings.Repeat("a", 1023)
	long5000  = strings.Repeat("The quick brown fox jumps over the lazy dog. ", 112) // 5,040 bytes
)

// keyVectors pin ComputeKey's byte layout. The hex values were computed once with refComputeKey; a
// change of the layout (separator, tag, order, truncation, hash) breaks them.
var keyVectors = []struct {
	name  string
	model string
	tag   byte
	text  string
	max   int
	want  string
}{
	{"system", "meta-llama/Llama-3.1-8B-Instruct", 'S', "You are a helpful assistant.", 0,
		"fa7c2d530f28fdf74eacad6a4adbde4f"},
	{"first-message", "meta-llama/Llama-3.1-8B-Instruct", 'M', "You are a helpful assistant.", 0,
		"c8199565482a093f147643bb16db17bd"},
	{"empty-text", "meta-llama/Llama-3.1-8B-Instruct", 'S', "", 0,
		"85ea63c817f6691313719f2c295ed720"},
	{"empty-model-empty-text", "", 'M', "", 0,
		"4bd411fb0897c4a7dd722c723305c185"},
	{"1023-ascii-then-3-byte-char-dropped", "m", 'S', ascii1023 + "€tail", 0,
		"baa780193221cd950964f5009f2c8e18"},
	{"1023-ascii-then-3-byte-char-kept", "m", 'S', ascii1023 + "€tail", 1026,
		"89fa800127aac9ebc5b06560c4dbb2f1"},
	{"japanese-cut-at-10", "qwen", 'M', "こんにちは世界", 10,
		"b1dc8665dd420ab1412bb21e37787e07"},
	{"emoji-cut-at-5", "qwen", 'M', "🦀🦀", 5,
		"888122cf9878c2cdf100a1e7f9f3e9b5"},
	{"streamed-4096", "gpt-4o", 'S', long5000, 4096,
		"d92a54366e485c515939c88b58ed7410"},
}

func TestComputeKeyVectors(t *testing.T) {
	for _, v := range keyVectors {
		t.Run(v.name, func(t *testing.T) {
			ref := refComputeKey(v.model, v.tag, v.text, v.max)
			got := ComputeKey(v.model, v.tag, v.text, v.max)
			if got != ref {
				t.Errorf("ComputeKey = %s, reference implementation = %s", got, ref)
			}
			if got.String() != v.want {
				t.Errorf("ComputeKey = %s, pinned %s (reference: %s)", got, v.want, ref)
			}
		})
	}
}

func TestComputeKeyTruncation(t *testing.T) {
	// A 1023-byte ASCII run followed by a 3-byte character: the default 1,024-byte cut drops the
	// character entirely, so the key equals that of the ASCII run alone.
	dropped := ComputeKey("m", 'S', ascii1023+"€tail", 0)
	if want := ComputeKey("m", 'S', ascii1023, 0); dropped != want {
		t.Errorf("cut inside '€': key %s, want the key of the 1023-byte run %s", dropped, want)
	}
	if kept := ComputeKey("m", 'S', ascii1023+"€tail", 1026); kept == dropped {
		t.Error("maxPrefixLength 1026 should keep '€' and change the key")
	}
	// Text beyond maxPrefixLength does not matter.
	a := ComputeKey("m", 'M', long5000, 100)
	b := ComputeKey("m", 'M', long5000[:100]+"something else", 100)
	if a != b {
		t.Errorf("bytes past maxPrefixLength changed the key: %s vs %s", a, b)
	}
	// maxPrefixLength <= 0 means DefaultMaxPrefixLength.
	if ComputeKey("m", 'M', long5000, -5) != ComputeKey("m", 'M', long5000, DefaultMaxPrefixLength) {
		t.Error("negative maxPrefixLength is not DefaultMaxPrefixLength")
	}
}

func TestComputeKeyProperties(t *testing.T) {
	const text = "You are a helpful assistant."
	if ComputeKey("m", 'S', text, 0) == ComputeKey("m", 'M', text, 0) {
		t.Error("same text as system prompt and as first message gave the same key")
	}
	if ComputeKey("ab", 'S', "c", 0) == ComputeKey("a", 'S', "bc", 0) {
		t.Error(`model "ab" + "c" and model "a" + "bc" gave the same key (0x00 separator missing?)`)
	}
	if ComputeKey("model-a", 'S', text, 0) == ComputeKey("model-b", 'S', text, 0) {
		t.Error("different models gave the same key")
	}
	if ComputeKey("m", 'S', text, 0).IsZero() {
		t.Error("a computed key is zero")
	}
}

// TestComputeKeyMatchesReference crosses the stack-buffer and streaming paths at their boundary.
func TestComputeKeyMatchesReference(t *testing.T) {
	for _, modelLen := range []int{0, 1, 126, 127, 128, 300, 2000} {
		for _, textLen := range []int{0, 1, 15, 16, 17, 128, 129, 240, 241, 253, 254, 255, 1023, 1024, 1025, 1100, 5000} {
			for _, max := range []int{0, 16, 1024, 1100, 4096} {
				model := strings.Repeat("M", modelLen)
				text := long5000[:min(textLen, len(long5000))]
				got, want := ComputeKey(model, 'S', text, max), refComputeKey(model, 'S', text, max)
				if got != want {
					t.Fatalf("model %d B, text %d B, max %d: got %s, want %s", modelLen, textLen, max, got, want)
				}
			}
		}
	}
}

func TestPrefixKey(t *testing.T) {
	tests := []struct {
		name   string
		req    Request
		tag    byte
		anchor string
		ok     bool
	}{
		{"system", Request{Model: "m", HasSystem: true, System: "sys", Messages: []Message{{Role: "user", Text: "hi"}}}, 'S', "sys", true},
		{"empty-system", Request{Model: "m", HasSystem: true, Messages: []Message{{Role: "user", Text: "hi"}}}, 'S', "", true},
		{"first-message", Request{Model: "m", Messages: []Message{{Role: "user", Text: "hi"}, {Role: "assistant", Text: "yo"}}}, 'M', "hi", true},
		{"prompt", Request{Model: "m", Prompt: []string{"p1", "p2"}}, 'M', "p1", true},
		{"adapter-ignored", Request{Model: "m", Adapter: "lora", Messages: []Message{{Text: "hi"}}}, 'M', "hi", true},
		{"no-anchor", Request{Model: "m"}, 0, "", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k, ok := tt.req.PrefixKey(0)
			if ok != tt.ok {
				t.Fatalf("ok = %v, want %v", ok, tt.ok)
			}
			if !ok {
				if !k.IsZero() {
					t.Errorf("no anchor: key %s, want zero", k)
				}
				return
			}
			if want := ComputeKey("m", tt.tag, tt.anchor, 0); k != want {
				t.Errorf("key %s, want ComputeKey(%q, %q, %q) = %s", k, "m", tt.tag, tt.anchor, want)
			}
		})
	}
}

func TestKeyText(t *testing.T) {
	k := ComputeKey("m", 'S', "x", 0)
	s := k.String()
	if len(s) != 32 || strings.ToLower(s) != s {
		t.Fatalf("String() = %q, want 32 lowercase hex digits", s)
	}
	for _, in := range []string{s, strings.ToUpper(s)} {
		got, err := ParseKey(in)
		if err != nil || got != k {
			t.Errorf("ParseKey(%q) = %s, %v; want %s, nil", in, got, err, k)
		}
	}
	for _, bad := range []string{"", s[:31], s + "0", "g" + s[1:], s[:30] + "-1", "0x" + s[2:]} {
		if _, err := ParseKey(bad); !errors.Is(err, ErrBadKey) {
			t.Errorf("ParseKey(%q) error = %v, want one wrapping ErrBadKey", bad, err)
		}
		var u Key
		if err := u.UnmarshalText([]byte(bad)); !errors.Is(err, ErrBadKey) || !u.IsZero() {
			t.Errorf("UnmarshalText(%q) = %v (key %s), want ErrBadKey and key unchanged", bad, err, u)
		}
	}

	b, err := json.Marshal(map[Key]Key{k: k})
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"` + s + `":"` + s + `"}`; string(b) != want {
		t.Errorf("JSON = %s, want %s", b, want)
	}
	var m map[Key]Key
	if err := json.Unmarshal(b, &m); err != nil || m[k] != k {
		t.Errorf("JSON round trip: %v, %v", m, err)
	}
}

func TestKeyUint64(t *testing.T) {
	in := "m\x00Sx"
	h := xxh3.HashString128(in)
	k := ComputeKey("m", 'S', "x", 0)
	if k.Uint64() != h.Lo {
		t.Errorf("Uint64 = %#x, want the low half of the xxh3-128 hash %#x", k.Uint64(), h.Lo)
	}
	if (Key{}).Uint64() != 0 || !(Key{}).IsZero() || k.IsZero() {
		t.Error("IsZero/Uint64 of the zero key")
	}
}

func TestTruncateUTF8(t *testing.T) {
	tests := []struct {
		s    string
		n    int
		want string
	}{
		{"", 0, ""},
		{"abc", -1, ""},
		{"abc", 0, ""},
		{"abc", 2, "ab"},
		{"abc", 3, "abc"},
		{"abc", 10, "abc"},
		{"a€b", 1, "a"},
		{"a€b", 2, "a"},
		{"a€b", 3, "a"},
		{"a€b", 4, "a€"},
		{"🦀x", 3, ""},
		{"🦀x", 4, "🦀"},
		{"é", 1, ""},
		{"\x80\x80\x80\x80\x80", 3, "\x80\x80\x80"}, // stray continuation bytes are kept whole
		{"a\x80b", 2, "a\x80"},
		{"\xe2\x82x", 1, "\xe2"}, // a truncated character is one invalid byte per byte
	}
	for _, tt := range tests {
		if got := TruncateUTF8(tt.s, tt.n); got != tt.want {
			t.Errorf("TruncateUTF8(%q, %d) = %q, want %q", tt.s, tt.n, got, tt.want)
		}
	}
}

func TestTruncateUTF8Quick(t *testing.T) {
	f := func(s string, n uint16) bool {
		m := int(n) % (len(s) + 2)
		got := TruncateUTF8(s, m)
		return utf8.ValidString(got) && len(got) <= max(m, 0) && strings.HasPrefix(s, got) &&
			got == refTruncateUTF8(s, m)
	}
	if err := quick.Check(f, &quick.Config{MaxCount: 5000}); err != nil {
		t.Error(err)
	}
}

func TestKeyAllocs(t *testing.T) {
	r := &Request{Model: "meta-llama/Llama-3.1-8B-Instruct", HasSystem: true, System: long5000}
	long := &Request{Model: "m", HasSystem: true, System: long5000}
	var sink Key
	for _, tt := range []struct {
		name string
		fn   func()
	}{
		{"PrefixKey", func() { sink, _ = r.PrefixKey(0) }},
		{"PrefixKey/streamed", func() { sink, _ = long.PrefixKey(4096) }},
		{"TruncateUTF8", func() { _ = TruncateUTF8(long5000, 1000) }},
	} {
		if n := testing.AllocsPerRun(100, tt.fn); n != 0 {
			t.Errorf("%s: %v allocations per run, want 0", tt.name, n)
		}
	}
	_ = sink
}

func FuzzComputeKey(f *testing.F) {
	f.Add("m", byte('S'), "hello", 0)
	f.Add("", byte('M'), ascii1023+"€", 1024)
	f.Add("ab", byte('S'), long5000, 4000)
	f.Fuzz(func(t *testing.T, model string, tag byte, text string, max int) {
		if got, want := ComputeKey(model, tag, text, max), refComputeKey(model, tag, text, max); got != want {
			t.Fatalf("ComputeKey = %s, reference = %s", got, want)
		}
		cut := TruncateUTF8(text, max)
		if utf8.ValidString(text) && !utf8.ValidString(cut) {
			t.Fatalf("TruncateUTF8(%q, %d) = %q is not valid UTF-8", text, max, cut)
		}
	})
}
