package prefixkey_test

import (
	"fmt"

	"github.com/kvroute/kvroute/prefixkey"
)

func ExampleRequest_PrefixKey() {
	req := &prefixkey.Request{
		Model:     "meta-llama/Llama-3.1-8B-Instruct",
		HasSystem: true,
		System:    "You are a helpful assistant.",
		Messages:  []prefixkey.Message{{Role: "user", Text: "Hello!"}},
	}
	key, ok := req.PrefixKey(prefixkey.DefaultMaxPrefixLength)
	fmt.Println(ok, key)

	// The same text as the first message instead of the system prompt gets another key.
	req.HasSystem, req.System = false, ""
	req.Messages[0].Text = "You are a helpful assistant."
	other, _ := req.PrefixKey(0)
	fmt.Println(other != key)

	// A request with neither system prompt nor message has no key: route it another way.
	_, ok = (&prefixkey.Request{Model: "m"}).PrefixKey(0)
	fmt.Println(ok)
	// Output:
	// true fa7c2d530f28fdf74eacad6a4adbde4f
	// true
	// false
}

func ExampleAppendBlockKeys() {
	// 40 prompt tokens in blocks of 16: two full blocks; the last 8 tokens have no key.
	tokens := make([]uint32, 40)
	for i := range tokens {
		tokens[i] = uint32(1000 + i)
	}
	root := prefixkey.BlockRoot("meta-llama/Llama-3.1-8B-Instruct", "")
	keys := prefixkey.AppendBlockKeys(nil, root, tokens, 16, nil)
	for _, k := range keys {
		fmt.Printf("%016x\n", k)
	}

	// An image whose placeholder covers tokens 10..19 is folded into both blocks it overlaps.
	mm := []prefixkey.MultiModalSpan{{Offset: 10, Length: 10, Hash: 0xfeedface}}
	withImage := prefixkey.AppendBlockKeys(nil, root, tokens, 16, mm)
	fmt.Println(withImage[0] != keys[0], withImage[1] != keys[1])

	// An engine's BlockStored event is re-keyed block by block from its tokens.
	fmt.Println(prefixkey.NextBlockKey(root, tokens[:16], nil) == keys[0])
	// Output:
	// 62e57594da00d044
	// c2d55fda56ab1015
	// true true
	// true
}

func ExampleRequest_BlockKeys() {
	req := &prefixkey.Request{
		Model:     "meta-llama/Llama-3.1-8B-Instruct",
		Adapter:   "sql-lora", // roots the chain instead of Model
		CacheSalt: "tenant-42",
		TokenIDs:  make([]uint32, 100),
	}
	keys := req.BlockKeys(make([]uint64, 0, 8), prefixkey.DefaultBlockSize)
	fmt.Println(len(keys))
	// Output:
	// 6
}

func ExampleRequest_MediaPlaced() {
	body := `{"model":"Qwen/Qwen2.5-VL-7B-Instruct","cache_salt":"tenant-a","messages":[{"role":"user","content":[
		{"type":"image_url","image_url":{"url":"https://example.com/cat.png"}},
		{"type":"text","text":"What is in the picture?"}]}]}`
	req, err := prefixkey.ParseOpenAIChat([]byte(body))
	if err != nil {
		panic(err)
	}
	m := req.Media[0]
	fmt.Println(req.CacheSalt, m.Kind, m.Hash == prefixkey.MediaURLHash("https://example.com/cat.png"))

	// The engine's tokens alone cannot tell this image from another: no block keys...
	req.TokenIDs = make([]uint32, 64)
	fmt.Println(req.MediaPlaced(), len(req.BlockKeys(nil, 16)))

	// ...until the caller says where the processor put the image's placeholder tokens.
	req.MultiModal = []prefixkey.MultiModalSpan{{Offset: 3, Length: 40, Hash: m.Hash}}
	fmt.Println(req.MediaPlaced(), len(req.BlockKeys(nil, 16)))
	// Output:
	// tenant-a image true
	// false 0
	// true 4
}
