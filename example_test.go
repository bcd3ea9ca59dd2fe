package kvroute_test

import (
	"context"
	"fmt"
	"math"
	"time"

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

// Stats is one snapshot of the Router: decisions by reason, each backend's load and observed
// averages, and (with tier 4, peers or disaggregation) their counters. The counters only grow: a
// monitoring system takes differences between two snapshots. Package admin turns a snapshot into
// the admin endpoints' JSON.
func ExampleDefaultRouter_Stats() {
	router, err := kvroute.New(kvroute.Config{
		Backends: []kvroute.Backend{{Name: "vllm-1"}, {Name: "vllm-2", Weight: 2}},
	})
	if err != nil {
		panic(err)
	}
	defer router.Close()
	ctx := context.Background()
	for _, system := range []string{"support bot", "coding bot", "support bot"} {
		d, err := router.Route(ctx, &prefixkey.Request{Model: "llama-3-8b", System: system, HasSystem: true})
		if err != nil {
			panic(err)
		}
		d.Done(kvroute.Outcome{Latency: 40 * time.Millisecond})
	}

	st, err := router.Stats(ctx) // ctx bounds the KV index's own stats call, with tier 4 on
	if err != nil {
		panic(err)
	}
	fmt.Println(st.Decisions.Total(), st.Decisions.PrefixHash, st.UniquePrefixes)
	for _, b := range st.Backends {
		fmt.Println(b.Name, b.Role, b.Weight, b.InFlight, b.SuccessRate)
	}
	fmt.Println(st.Index == nil, st.Disagg == nil) // tier 4 and disaggregation are off
	// Output:
	// 3 3 2
	// vllm-1 unified 1 0 1
	// vllm-2 unified 2 0 1
	// true true
}
