package kvindex_test

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

// tokens returns n made-up token IDs.
func tokens(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(1000 + i*7%5000)
	}
	return out
}

// A vLLM engine announces the blocks it cached; a lookup finds how much of a request each
// backend holds.
func ExampleMemoryIndex() {
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: "llama-3-8b"})
	if err != nil {
		panic(err)
	}
	defer ix.Close()
	ctx := context.Background()

	prompt := tokens(100) // 6 full blocks of 16 tokens, and 4 tokens more
	// vllm-0 cached the first 4 blocks (engine hashes are the engine's own), then 2 more.
	_ = ix.Apply(ctx, "vllm-0", &events.Batch{Model: "llama-3-8b", Events: []events.Event{
		{Kind: events.KindBlockStored, BlockHashes: []uint64{11, 12, 13, 14}, TokenIDs: prompt[:64], BlockSize: 16},
		{Kind: events.KindBlockStored, BlockHashes: []uint64{15, 16}, TokenIDs: prompt[64:96], BlockSize: 16,
			Parent: 14, HasParent: true},
	}})
	// vllm-1 cached 2 blocks, and offloaded a copy of them to CPU memory.
	_ = ix.Apply(ctx, "vllm-1", &events.Batch{Model: "llama-3-8b", Events: []events.Event{
		{Kind: events.KindBlockStored, BlockHashes: []uint64{91, 92}, TokenIDs: prompt[:32], BlockSize: 16},
		{Kind: events.KindBlockStored, BlockHashes: []uint64{91, 92}, Tier: events.TierCPU},
		{Kind: events.KindBlockRemoved, BlockHashes: []uint64{92}}, // evicted from the GPU
	}})

	req := &prefixkey.Request{Model: "llama-3-8b", TokenIDs: prompt}
	keys := req.BlockKeys(nil, kvindex.DefaultBlockSize)
	backends := []string{"vllm-0", "vllm-1", "vllm-2"}
	matches, _ := ix.Lookup(ctx, keys, backends, make([]kvindex.Match, len(backends)))
	for _, m := range matches {
		fmt.Printf("%s: %d blocks, %d tokens, score %.1f, slowest tier %v\n", m.Backend, m.Blocks, m.Tokens, m.WeightedBlocks, m.Tier)
	}
	// Output:
	// vllm-0: 6 blocks, 96 tokens, score 6.0, slowest tier gpu
	// vllm-1: 2 blocks, 32 tokens, score 1.8, slowest tier cpu
	// vllm-2: 0 blocks, 0 tokens, score 0.0, slowest tier gpu
}

// Right after routing a request, the router records that the chosen backend will soon hold its
// blocks, so that the next request with the same prefix goes there too, before the engine's
// events arrive.
func ExampleMemoryIndex_Speculate() {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{
		DefaultModel: "llama-3-8b",
		Now:          func() time.Time { return now }, // a fake clock, for the example
	})
	if err != nil {
		panic(err)
	}
	defer ix.Close()
	ctx := context.Background()

	req := &prefixkey.Request{Model: "llama-3-8b", TokenIDs: tokens(64)}
	keys := req.BlockKeys(nil, kvindex.DefaultBlockSize)
	_ = ix.Speculate(ctx, "vllm-1", keys, 0) // SpeculativeTTL, 2 s by default
	out := make([]kvindex.Match, 1)
	m, _ := ix.Lookup(ctx, keys, []string{"vllm-1"}, out)
	fmt.Println("predicted:", m[0].Blocks)

	now = now.Add(3 * time.Second) // no BlockStored came
	m, _ = ix.Lookup(ctx, keys, []string{"vllm-1"}, out)
	fmt.Println("after 3 s:", m[0].Blocks)
	// Output:
	// predicted: 4
	// after 3 s: 0
}

// Prefix-granular events (the SSE form) move an entry between the GPU and storage tiers.
func ExampleMemoryIndex_LookupPrefix() {
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{StorageOffloading: true, TreatEvictionAsOffload: true})
	if err != nil {
		panic(err)
	}
	defer ix.Close()
	ctx := context.Background()
	apply := func(op events.PrefixOp) {
		_ = ix.Apply(ctx, "vllm-0", &events.Batch{Events: []events.Event{
			{Kind: events.KindPrefix, PrefixOp: op, PrefixHash: "9f2c41", TokenCount: 2048}}})
	}
	out := make([]kvindex.Match, 1)
	for _, op := range []events.PrefixOp{events.PrefixCreated, events.PrefixEvicted, events.PrefixReloaded, events.PrefixPurged} {
		apply(op)
		m, _ := ix.LookupPrefix(ctx, "9f2c41", []string{"vllm-0"}, out)
		fmt.Printf("%-15s tokens %4d, tier %-7v score %.0f\n", op, m[0].Tokens, m[0].Tier, m[0].WeightedBlocks)
	}
	// Output:
	// cache_created   tokens 2048, tier gpu     score 2048
	// cache_evicted   tokens 2048, tier storage score 1229
	// cache_reloaded  tokens 2048, tier gpu     score 2048
	// cache_purged    tokens    0, tier gpu     score 0
}

// An index of one's own re-keys a BlockStored event by the rules the built-in indexes follow: the
// keys it stores are the keys a request with the same tokens looks up, whatever the engine's
// block hashes and block size.
func ExampleAppendStoredKeys() {
	prompt := tokens(128)
	ev := &events.Event{Kind: events.KindBlockStored, BlockHashes: []uint64{0xa1, 0xa2}, TokenIDs: prompt, BlockSize: 64}
	perBlock, reason, ok := kvindex.CheckStored(ev, kvindex.DefaultBlockSize)
	if !ok {
		fmt.Println("dropped:", reason) // count it in Stats.Dropped[reason.String()]
		return
	}
	// No parent: the chain starts at the model's root (with a parent, at the last key the
	// backend's earlier event gave ev.Parent).
	root := kvindex.StoredRoot(ev, "llama-3-8b", "")
	keys := kvindex.AppendStoredKeys(nil, ev, root, kvindex.DefaultBlockSize, perBlock)
	// Engine block i holds keys[i*perBlock : (i+1)*perBlock] on kvindex.EventTier(ev.Tier).
	req := &prefixkey.Request{Model: "llama-3-8b", TokenIDs: prompt}
	fmt.Println(perBlock, len(keys), slices.Equal(keys, req.BlockKeys(nil, kvindex.DefaultBlockSize)))
	// Output:
	// 4 8 true
}
