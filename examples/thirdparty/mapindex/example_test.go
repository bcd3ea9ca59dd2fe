package mapindex_test

import (
	"context"
	"fmt"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/prefixkey"

	"example.com/thirdparty/mapindex"
)

// An engine's BlockStored event, re-keyed by the index, matches the block keys of a request with
// the same prompt.
func Example() {
	ctx := context.Background()
	ix, err := mapindex.New(mapindex.Config{BlockSize: 16})
	if err != nil {
		panic(err)
	}
	prompt := make([]uint32, 48) // three blocks of 16 tokens
	for i := range prompt {
		prompt[i] = uint32(100 + i)
	}
	// What vLLM publishes: its own block hashes and the tokens; the first two blocks on GPU.
	stored := events.Event{Kind: events.KindBlockStored, BlockHashes: []uint64{0xa1, 0xa2}, TokenIDs: prompt[:32], BlockSize: 16}
	if err := ix.Apply(ctx, "engine-1", &events.Batch{Model: "llama", Events: []events.Event{stored}}); err != nil {
		panic(err)
	}
	// What the router computes for a request.
	keys := prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot("llama", ""), prompt, 16, nil)
	ms, err := ix.Lookup(ctx, keys, []string{"engine-1", "engine-2"}, nil)
	if err != nil {
		panic(err)
	}
	for _, m := range ms {
		fmt.Printf("%s: %d of %d blocks, %d tokens, tier %v\n", m.Backend, m.Blocks, len(keys), m.Tokens, m.Tier)
	}
	// Output:
	// engine-1: 2 of 3 blocks, 32 tokens, tier gpu
	// engine-2: 0 of 3 blocks, 0 tokens, tier gpu
}
