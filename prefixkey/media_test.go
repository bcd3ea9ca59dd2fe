package prefixkey

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/zeebo/xxh3"

	"github.com/kvroute/kvroute/events"
)

// TestMediaHashVectors pins the identities of media items. The values were computed once
// (TestMediaHashes checks the definitions); a change of seed, of what is hashed, or of the hash
// breaks them.
func TestMediaHashVectors(t *testing.T) {
	for _, v := range []struct {
		name string
		got  uint64
		want string
	}{
		{"url", MediaURLHash("https://example.com/cat.png"), "dfff687e8a20c09e"},
		{"url-empty", MediaURLHash(""), "028d0e85eeb2d812"},
		{"data", MediaDataHash("iVBORw0KGgo="), "04e780eea0201201"},
		{"data-uri", MediaURLHash("data:image/png;base64,iVBORw0KGgo="), "04e780eea0201201"},
		{"uuid", MediaUUIDHash("sku-1234-a"), "b498a27a787cf0b3"},
		{"other", mediaOtherHash([]byte(`{"file_id":"f"}`)), "93bec9147c9c3aed"},
	} {
		t.Run(v.name, func(t *testing.T) {
			require.Equal(t, v.want, fmt.Sprintf("%016x", v.got))
		})
	}
}

func TestMediaHashes(t *testing.T) {
	// The documented definitions.
	require.Equal(t, xxh3.HashStringSeed("https://x/a.png", 0x6b76722d75726c20), MediaURLHash("https://x/a.png"))
	require.Equal(t, xxh3.HashStringSeed("QUJD", 0x6b76722d64617461), MediaDataHash("QUJD"))
	// A uuid folds as the engine's multimodal identifiers do, so that spans built from it match
	// the extra keys of vLLM's BlockStored events.
	require.Equal(t, events.ExtraKeyHash("sku-1234-a"), MediaUUIDHash("sku-1234-a"))
	// The sources are kept apart: the same string as URL, data and uuid gives three identities.
	s := "https://x/a.png"
	require.NotEqual(t, MediaURLHash(s), MediaDataHash(s))
	require.NotEqual(t, MediaURLHash(s), MediaUUIDHash(s))
	require.NotEqual(t, MediaDataHash(s), MediaUUIDHash(s))
	require.NotEqual(t, MediaURLHash("https://x/a.png"), MediaURLHash("https://x/b.png"))

	for _, tc := range []struct {
		uri     string
		payload string
		ok      bool
	}{
		{"data:image/png;base64,QUJD", "QUJD", true},
		{"DATA:image/png;BASE64,QUJD", "QUJD", true},
		{"data:;base64,", "", true},
		{"data:image/png;charset=x;base64,QU,JD", "QU,JD", true},
		{"data:text/plain,QUJD", "", false}, // not base64: hashed as a URL
		{"data:image/png;base64QUJD", "", false},
		{"https://x/data:;base64,QUJD", "", false},
		{"data", "", false},
	} {
		t.Run(tc.uri, func(t *testing.T) {
			p, ok := dataURIPayload(tc.uri)
			require.Equal(t, tc.ok, ok)
			require.Equal(t, tc.payload, p)
			if ok {
				require.Equal(t, MediaDataHash(tc.payload), MediaURLHash(tc.uri))
			} else {
				require.Equal(t, xxh3.HashStringSeed(tc.uri, seedMediaURL), MediaURLHash(tc.uri))
			}
		})
	}
}

// The same bytes have one identity across the APIs and source forms.
func TestMediaIdentityAcrossFormats(t *testing.T) {
	const png = "iVBORw0KGgoAAAANSUhEUgAAAAE="
	oa := mustParse(t, FormatOpenAIChat, `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,`+png+`"}}]}]}`)
	an := mustParse(t, FormatAnthropicMessages, `{"model":"m","messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","media_type":"image/png","data":"`+png+`"}}]}]}`)
	au := mustParse(t, FormatOpenAIChat, `{"model":"m","messages":[{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"`+png+`","format":"wav"}}]}]}`)
	require.Len(t, oa.Media, 1)
	require.Equal(t, MediaDataHash(png), oa.Media[0].Hash)
	require.Equal(t, oa.Media[0].Hash, an.Media[0].Hash)
	require.Equal(t, oa.Media[0].Hash, au.Media[0].Hash)
	ou := mustParse(t, FormatOpenAIChat, `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/a.png"}}]}]}`)
	uu := mustParse(t, FormatAnthropicMessages, `{"model":"m","messages":[{"role":"user","content":[{"type":"image","source":{"type":"url","url":"https://x/a.png"}}]}]}`)
	require.Equal(t, ou.Media[0].Hash, uu.Media[0].Hash)
}

func mustParse(t testing.TB, f Format, body string) *Request {
	t.Helper()
	r, err := Parse(f, []byte(body))
	require.NoError(t, err, body)
	return r
}

// chatWith returns an OpenAI chat body whose first message is content (JSON), with system prompt
// sys when not empty, and extra top-level members.
func chatWith(sys, content, extra string) string {
	msgs := `{"role":"user","content":` + content + `}`
	if sys != "" {
		msgs = `{"role":"system","content":"` + sys + `"},` + msgs
	}
	return `{"model":"m",` + extra + `"messages":[` + msgs + `,{"role":"assistant","content":"ok"}]}`
}

func imagePart(url string) string {
	return `{"type":"image_url","image_url":{"url":"` + url + `"}}`
}

// refExtendedKey is an independent ExtendedKey: the documented layout in a bytes.Buffer, hashed in
// one shot.
func refExtendedKey(model string, tag byte, text string, max int, salt string, media []Media) Key {
	if max <= 0 {
		max = DefaultMaxPrefixLength
	}
	le := func(b *bytes.Buffer, v uint64) { _ = binary.Write(b, binary.LittleEndian, v) }
	var b bytes.Buffer
	b.WriteString(model)
	b.WriteByte(0)
	b.WriteByte(tag | 0x20)
	le(&b, uint64(len(salt)))
	b.WriteString(salt)
	t := refTruncateUTF8(text, max)
	le(&b, uint64(len(t)))
	b.WriteString(t)
	var in []Media
	for _, m := range media {
		if m.Message == 0 && m.Offset < max {
			in = append(in, m)
		}
	}
	le(&b, uint64(len(in)))
	for _, m := range in {
		le(&b, uint64(m.Offset))
		le(&b, m.Hash)
	}
	return Key(xxh3.Hash128(b.Bytes()).Bytes())
}

func TestExtendedKeyVectors(t *testing.T) {
	media := []Media{
		{Kind: MediaImage, Message: 0, Offset: 0, Hash: MediaURLHash("https://x/a.png")},
		{Kind: MediaAudio, Message: 0, Offset: 12, Hash: MediaDataHash("UklGRg==")},
		{Kind: MediaImage, Message: 0, Offset: 2000, Hash: 1}, // past the covered text
		{Kind: MediaImage, Message: 1, Offset: 0, Hash: 2},    // not the anchor message
	}
	for _, v := range []struct {
		name  string
		tag   byte
		text  string
		max   int
		salt  string
		media []Media
		want  string
	}{
		{"salt-only-system", 'S', "You are a helpful assistant.", 0, "tenant-a", nil, "a2757686b0a4f018961c86828389739a"},
		{"media-first-message", 'M', "Describe this image.", 0, "", media, "e8776bb39ca38b913e15244e65ab9ec1"},
		{"salt-and-media-truncated", 'M', long5000, 100, "t", media, "45781ae5d1eab71129a8ed075a6ef3f0"},
	} {
		t.Run(v.name, func(t *testing.T) {
			got := ExtendedKey("meta-llama/Llama-3.1-8B-Instruct", v.tag, v.text, v.max, v.salt, v.media)
			ref := refExtendedKey("meta-llama/Llama-3.1-8B-Instruct", v.tag, v.text, v.max, v.salt, v.media)
			require.Equal(t, ref, got)
			require.Equal(t, v.want, got.String())
		})
	}
}

func FuzzExtendedKey(f *testing.F) {
	f.Add("m", byte('M'), "hello", 0, "salt", 3, uint64(7))
	f.Add("", byte('S'), long5000, 4000, "", 5000, uint64(0))
	f.Fuzz(func(t *testing.T, model string, tag byte, text string, max int, salt string, off int, h uint64) {
		media := []Media{{Offset: off, Hash: h}, {Message: 1, Hash: h}}
		if got, want := ExtendedKey(model, tag, text, max, salt, media), refExtendedKey(model, tag, text, max, salt, media); got != want {
			t.Fatalf("ExtendedKey = %s, reference = %s", got, want)
		}
	})
}

// Salt and media change the prefix key exactly where they should; requests without either keep
// the keys they had (ComputeKey).
func TestPrefixKeySaltAndMedia(t *testing.T) {
	key := func(body string) Key {
		t.Helper()
		k, ok := mustParse(t, FormatOpenAIChat, body).PrefixKey(0)
		require.True(t, ok)
		return k
	}
	text := `"Describe the picture."`
	withImage := func(url string) string { return `[{"type":"text","text":"Describe "},` + imagePart(url) + `]` }

	// Unsalted text-only: unchanged layout.
	require.Equal(t, ComputeKey("m", 'M', "Describe the picture.", 0), key(chatWith("", text, "")))
	require.Equal(t, ComputeKey("m", 'S', "sys", 0), key(chatWith("sys", text, "")))

	// Salts: isolated from each other and from no salt, the same salt shares.
	plain, a, b := key(chatWith("sys", text, "")), key(chatWith("sys", text, `"cache_salt":"tenant-a",`)), key(chatWith("sys", text, `"cache_salt":"tenant-b",`))
	require.NotEqual(t, plain, a)
	require.NotEqual(t, a, b)
	require.Equal(t, a, key(chatWith("sys", `"another question"`, `"cache_salt":"tenant-a",`)))
	require.Equal(t, ExtendedKey("m", 'S', "sys", 0, "tenant-a", nil), a)

	// Images in the anchor message: different images differ, the same image shares, and the
	// text-only request differs from both.
	imgA, imgB := key(chatWith("", withImage("https://x/a.png"), "")), key(chatWith("", withImage("https://x/b.png"), ""))
	require.NotEqual(t, imgA, imgB)
	require.Equal(t, imgA, key(chatWith("", withImage("https://x/a.png"), "")))
	require.NotEqual(t, imgA, key(chatWith("", `"Describe "`, "")))
	// Data URIs: by content.
	d1 := key(chatWith("", withImage("data:image/png;base64,QUJD"), ""))
	require.NotEqual(t, d1, key(chatWith("", withImage("data:image/png;base64,QUJE"), "")))
	require.Equal(t, d1, key(chatWith("", withImage("data:image/jpeg;base64,QUJD"), "")))
	// Where the image sits matters.
	after := `[{"type":"text","text":"Describe "},` + imagePart("https://x/a.png") + `]`
	before := `[` + imagePart("https://x/a.png") + `,{"type":"text","text":"Describe "}]`
	require.NotEqual(t, key(chatWith("", after, "")), key(chatWith("", before, "")))

	// With a system prompt the anchor is the system prompt: images of later messages do not enter
	// the key (the backend holding the system prompt's cache is still the right one).
	require.Equal(t, key(chatWith("sys", withImage("https://x/a.png"), "")), key(chatWith("sys", withImage("https://x/b.png"), "")))

	// An image past the covered text does not enter the key.
	long := `[{"type":"text","text":"` + strings.Repeat("x", 2000) + `"},`
	require.Equal(t, key(chatWith("", long+imagePart("https://x/a.png")+`]`, "")), key(chatWith("", long+imagePart("https://x/b.png")+`]`, "")))
	require.Equal(t, ComputeKey("m", 'M', strings.Repeat("x", 2000), 0), key(chatWith("", long+imagePart("https://x/a.png")+`]`, "")))

	// Anthropic: the same rules.
	ak := func(url string) Key {
		k, _ := mustParse(t, FormatAnthropicMessages, `{"model":"m","messages":[{"role":"user","content":[{"type":"image","source":{"type":"url","url":"`+url+`"}},{"type":"text","text":"What is it?"}]}]}`).PrefixKey(0)
		return k
	}
	require.NotEqual(t, ak("https://x/a.png"), ak("https://x/b.png"))
}

// The cache salt roots block keys: salted chains are disjoint from unsalted ones and each other.
func TestBlockKeysSalt(t *testing.T) {
	tokens := testTokens(64)
	keys := func(extra string) []uint64 {
		r := mustParse(t, FormatOpenAICompletion, `{"model":"m","prompt":"p"`+extra+`}`)
		r.TokenIDs = tokens
		return r.BlockKeys(nil, 16)
	}
	plain, a, b := keys(""), keys(`,"cache_salt":"tenant-a"`), keys(`,"cache_salt":"tenant-b"`)
	require.Len(t, a, 4)
	require.Equal(t, AppendBlockKeys(nil, BlockRoot("m", "tenant-a"), tokens, 16, nil), a)
	require.Equal(t, keys(`,"cache_salt":"tenant-a"`), a)
	for i := range plain {
		require.NotEqual(t, plain[i], a[i])
		require.NotEqual(t, a[i], b[i])
	}
}

// Media without spans give no block keys; with spans, the items' identities are folded in.
func TestBlockKeysMedia(t *testing.T) {
	body := func(url string) *Request {
		return mustParse(t, FormatOpenAIChat, chatWith("sys", `[{"type":"text","text":"Describe "},`+imagePart(url)+`]`, ""))
	}
	tokens := testTokens(64)
	ra, rb := body("https://x/a.png"), body("https://x/b.png")
	ra.TokenIDs, rb.TokenIDs = tokens, tokens
	require.False(t, ra.MediaPlaced())
	require.Empty(t, ra.BlockKeys(nil, 16), "media without spans must give no block keys")
	dst := make([]uint64, 0, 8)
	require.Len(t, ra.BlockKeys(dst, 16), 0)

	// The caller knows the placeholders: tokens 20..39 stand for the image.
	ra.MultiModal = []MultiModalSpan{{Offset: 20, Length: 20, Hash: ra.Media[0].Hash}}
	rb.MultiModal = []MultiModalSpan{{Offset: 20, Length: 20, Hash: rb.Media[0].Hash}}
	require.True(t, ra.MediaPlaced())
	ka, kb := ra.BlockKeys(nil, 16), rb.BlockKeys(nil, 16)
	require.Len(t, ka, 4)
	require.Equal(t, ka[0], kb[0], "block 0 precedes the image")
	for i := 1; i < 4; i++ {
		require.NotEqual(t, ka[i], kb[i], "block %d holds or follows the image", i)
	}
	// Text-only requests are unaffected.
	plain := mustParse(t, FormatOpenAIChat, chatWith("sys", `"Describe"`, ""))
	require.True(t, plain.MediaPlaced())
	plain.TokenIDs = tokens
	require.Len(t, plain.BlockKeys(nil, 16), 4)
}

func TestPrefixKeyAllocsSaltMedia(t *testing.T) {
	r := mustParse(t, FormatOpenAIChat, chatWith("", `[{"type":"text","text":"Describe "},`+imagePart("https://x/a.png")+`]`, `"cache_salt":"tenant-a",`))
	s := mustParse(t, FormatOpenAIChat, chatWith("sys", `"q"`, `"cache_salt":"tenant-a",`))
	var sink Key
	require.Zero(t, testing.AllocsPerRun(100, func() { sink, _ = r.PrefixKey(0) }))
	require.Zero(t, testing.AllocsPerRun(100, func() { sink, _ = s.PrefixKey(0) }))
	_ = sink
}

// The engine tokenizer does not tokenize requests with media: their text-only tokens would be
// shared by requests with other images.
func TestEngineTokenizerSkipsMedia(t *testing.T) {
	var calls atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		_ = json.NewEncoder(w).Encode(map[string]any{"tokens": []int{1, 2, 3}, "count": 3})
	}))
	defer srv.Close()
	tok, err := NewEngineTokenizer(EngineTokenizerConfig{BaseURL: srv.URL})
	require.NoError(t, err)
	r := mustParse(t, FormatOpenAIChat, chatWith("sys", `[{"type":"text","text":"Describe "},`+imagePart("https://x/a.png")+`]`, ""))
	got, err := tok.Tokenize(context.Background(), r)
	require.NoError(t, err)
	require.Nil(t, got)
	require.Zero(t, calls.Load())
	// Tokens the caller set are still returned as they are.
	r.TokenIDs = []uint32{9}
	got, err = tok.Tokenize(context.Background(), r)
	require.NoError(t, err)
	require.Equal(t, []uint32{9}, got)
	// Text-only requests are tokenized.
	got, err = tok.Tokenize(context.Background(), mustParse(t, FormatOpenAIChat, chatWith("sys", `"Describe"`, "")))
	require.NoError(t, err)
	require.Equal(t, []uint32{1, 2, 3}, got)
}

// The estimating tokenizer writes each item's identity where it sits: pseudo-tokens are shared up
// to the image and part there.
func TestEstimateTokenizerMedia(t *testing.T) {
	prefix := strings.Repeat("Describe this picture in detail. ", 8)
	body := func(url string) *Request {
		return mustParse(t, FormatOpenAIChat, chatWith("sys", `[{"type":"text","text":"`+prefix+`"},`+imagePart(url)+`,{"type":"text","text":"Thanks."}]`, ""))
	}
	for _, size := range []int{1, 4, 7} {
		t.Run(fmt.Sprint("bytes=", size), func(t *testing.T) {
			e := EstimateTokenizer{BytesPerToken: size}
			a, b, a2 := e.AppendTokens(nil, body("https://x/a.png")), e.AppendTokens(nil, body("https://x/b.png")), e.AppendTokens(nil, body("https://x/a.png"))
			require.Equal(t, a, a2)
			require.NotEqual(t, a, b)
			common := 0
			for common < min(len(a), len(b)) && a[common] == b[common] {
				common++
			}
			textBefore := len("<|system|>sys<|user|>") + len(prefix)
			require.GreaterOrEqual(t, common, textBefore/size-1, "the text before the image is shared")
			require.Less(t, common, (textBefore+9)/size+1, "the tokens part at the image")
			// Without media the stream is the text alone, as before.
			plain := mustParse(t, FormatOpenAIChat, chatWith("sys", `"`+prefix+`Thanks."`, ""))
			require.Equal(t, e.AppendTokens(nil, plain), EstimateTokenizer{BytesPerToken: size}.AppendTokens(nil, &Request{Format: FormatOpenAIChat,
				Model: "m", HasSystem: true, System: "sys", Messages: []Message{{Role: "user", Text: prefix + "Thanks."}, {Role: "assistant", Text: "ok"}}}))
		})
	}
}

func TestMediaItemsCapped(t *testing.T) {
	parts := func(n int, part string) string {
		return "[" + strings.Repeat(part+",", n-1) + part + "]"
	}
	oa := imagePart("https://x/a.png")
	an := `{"type":"image","source":{"type":"url","url":"https://x/a.png"}}`
	r := mustParse(t, FormatOpenAIChat, chatWith("", parts(MaxMediaItems, oa), ""))
	require.Len(t, r.Media, MaxMediaItems)
	for f, body := range map[Format]string{
		FormatOpenAIChat:        chatWith("", parts(MaxMediaItems+1, oa), ""),
		FormatAnthropicMessages: `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":` + parts(MaxMediaItems+1, an) + `}]}`,
	} {
		_, err := Parse(f, []byte(body))
		require.Error(t, err, f)
		require.Contains(t, err.Error(), "more than 256 image, audio or video parts")
	}
}
