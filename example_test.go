package kvroute_test

import (
	"context"
	"fmt"
	"math"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/scorer"
)

// A gateway parses the body, routes, forwards to the chosen backend and reports the outcome.
func ExampleDefaultRouter_Route() {
	router, err := kvroute.New(kvroute.Config{
		Backends: []kvroute.Backend{{Name: "vllm-1"}, {Name: "vllm-2"}, {Name: "vllm-3"}},
	})
	if err != nil {
		panic(err)
	}
	defer router.Close()

	body := []byte(`{"model":"llama-3-8b","messages":[
		{"role":"system","content":"You are the ACME support assistant."},
		{"role":"user","content":"Where is my order?"}]}`)
	req, err := prefixkey.ParseOpenAIChat(body)
	if err != nil {
		panic(err) // a gateway answers 400 here
	}
	d, err := router.Route(context.Background(), req)
	if err != nil {
		panic(err) // ErrNoBackend: a gateway answers 503
	}
	// … forward body to d.Backend …
	d.Done(kvroute.Outcome{})

	// A second request with the same system prompt meets the same, now warm, backend.
	req2, _ := prefixkey.ParseOpenAIChat([]byte(`{"model":"llama-3-8b","messages":[
		{"role":"system","content":"You are the ACME support assistant."},
		{"role":"user","content":"Can I change my address?"}]}`))
	d2, _ := router.Route(context.Background(), req2)
	defer d2.Done(kvroute.Outcome{})
	fmt.Println(d.Reason, d2.Reason, d.Backend == d2.Backend)
	// Output: prefix_hash prefix_hash true
}

// A scorer of your own plugs into tier 4 through KVConfig.Scorer: here one that prefers the
// backend holding the most of the prompt and breaks ties by load. kvroute calls it through
// scorer.ScoreSafely (a wrong answer costs a fallback decision), and scorer/scorertest checks it.
func ExampleKVConfig_scorer() {
	mostCached := scorer.Func(func(_ scorer.Request, cands []scorer.Candidate, out []float64) []float64 {
		for i, c := range cands {
			out[i] = math.Inf(-1)
			if c.Healthy {
				out[i] = float64(c.CachedTokens) - float64(c.InFlight)/1000
			}
		}
		return out[:len(cands)]
	})
	index, err := kvindex.NewMemory(kvindex.MemoryConfig{BlockSize: 16, DefaultModel: "llama-3-8b"})
	if err != nil {
		panic(err)
	}
	defer index.Close()
	router, err := kvroute.New(kvroute.Config{
		Backends: []kvroute.Backend{{Name: "vllm-1"}, {Name: "vllm-2"}},
		KV:       &kvroute.KVConfig{Index: index, BlockSize: 16, Scorer: mostCached, Speculation: kvroute.SpeculationOff},
	})
	if err != nil {
		panic(err)
	}
	defer router.Close()

	// vllm-2 reports (as a vLLM KV event would) that it holds the prompt's first 4 blocks.
	prompt := make([]uint32, 64)
	for i := range prompt {
		prompt[i] = uint32(1000 + i)
	}
	_ = index.Apply(context.Background(), "vllm-2", &events.Batch{Model: "llama-3-8b", Events: []events.Event{{
		Kind: events.KindBlockStored, BlockHashes: []uint64{1, 2, 3, 4}, TokenIDs: prompt, BlockSize: 16}}})

	req := &prefixkey.Request{Model: "llama-3-8b", TokenIDs: prompt}
	d, err := router.Route(context.Background(), req)
	if err != nil {
		panic(err)
	}
	defer d.Done(kvroute.Outcome{})
	fmt.Println(d.Backend, d.Reason, d.ExpectedCachedTokens)
	// Output: vllm-2 kv_aware 64
}
