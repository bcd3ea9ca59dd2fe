// Package kvindex is kvroute's KV-cache index: it learns from model servers' KV events which
// backend holds which KV-cache blocks, on which tier, and answers, for a request's block keys and
// a set of candidate backends, how long a consecutive prefix of the request each candidate
// already holds.
//
// KvCacheIndex is the interface; it embeds events.Sink (Apply, ClearBackend), Lookuper,
// PrefixLookuper and Speculator. MemoryIndex, from NewMemory, is the in-process default; package
// kvindex/redisindex keeps the index in Redis or Valkey, one view shared by router replicas.
// Package kvindex/indextest is the conformance suite every implementation passes. This package
// imports no client library: an index on another store is written against its exported API
// alone (see below).
//
// # Keys
//
// The index is keyed by kvroute's own chained block keys (package prefixkey): key i hashes block
// i's tokens with key i−1, the first with a root that names the model or LoRA adapter and the
// cache salt. Engines' block hashes cannot be recomputed outside the engine, so the index
// re-keys every BlockStored event from its token IDs — block i of an event chained to block i−1,
// the first to the key its parent's engine hash was given by the same backend's earlier event —
// and keeps, per backend, a map from engine hash to key for the BlockRemoved and BlockStored
// events to come. Engine blocks may be any multiple of the index's block size. Because a key
// commits to the whole chain before it, "block i is held" already implies "the same blocks
// 0..i−1 were stored"; a backend's match is the longest run of the request's keys it holds
// (a hole stops it), each block weighted by the best tier it is held on (TierWeights). A block
// held on several tiers is recorded on each: Match.StoredBlocks is the longest run the backend
// holds on the storage tier, faster copies or not — what a prefill engine that keeps a prompt on
// its GPU has already written to external storage, readable by backends sharing that storage.
//
// # MemoryIndex
//
// One hash table, split into up to 256 shards by key bits, maps a block key to its holders: one
// 64-bit set per tier (a bit per backend, so at most 64 backends) and the speculative holders.
// Shards are ordered linear-probing tables (O. Amble and D. E. Knuth, "Ordered hash tables",
// The Computer Journal 17(2), 1974) over 8-byte words, with the 56-byte block bodies in a slab
// beside them. Lookup is a jump search: it probes every 16th key of the request
// (MemoryConfig.LookupStride), one probe answering for every candidate, probes key by key only
// the stride where some candidate's match (or its run on the storage tier) ends or changes tier,
// and stops when no candidate holds the next key. That is exact when backends' holdings are prefixes with monotone tiers, as
// engines' eviction orders leave them and as this index's own expiry keeps them; LookupStride 1
// probes every key. Lookup takes no lock (a seqlock per shard) and allocates nothing. Writers
// lock one shard per block.
//
// Entries expire EntryTTL after their last evidence: the store of the block, or of a
// descendant — a BlockStored proves the engine holds the parent's whole chain, so storing a
// block refreshes its ancestors, and a hot prefix that the engine keeps without re-announcing it
// stays fresh. When the table reaches MaxEntries blocks it evicts its least recently refreshed
// eighth (per shard); chains thus lose their tails first. Speculative entries (Speculate, right
// after a routing decision) last SpeculativeTTL unless a BlockStored confirms them; in
// approximate mode, without events, they are the only entries, and ApproximateCapacityBlocks
// bounds each backend's share. Prefix-granular entries (the SSE events cache_created, …) are
// kept apart, per prefix key, with kvroute's tier transitions (MemoryConfig.StorageOffloading).
//
// # Other stores
//
// An index of one's own (on a database, a cache service, another process) follows the event rules
// this package exports, so that it answers as the built-in ones do and passes kvindex/indextest;
// package kvindex/redisindex is built on them and the rest of this package's exported API alone.
// A BlockStored event becomes entries so:
//
//  1. CheckStored validates it, or names the DropReason to count it under in Stats.Dropped.
//  2. A tokenless event (CheckStored's perBlock 0) adds EventTier(ev.Tier) to the blocks the
//     backend stored earlier under ev.BlockHashes; an unknown hash counts as DropUnknownBlock.
//  3. Otherwise the chain starts at StoredRoot when the event has no parent, else at the last key
//     the backend's earlier event gave engine hash ev.Parent: the index keeps, per backend, a map
//     from engine hash to its keys (bounded as it likes; a parent missing from it counts as
//     DropUnknownParent, and the event is skipped).
//  4. AppendStoredKeys computes the keys; the backend holds each on EventTier(ev.Tier) until
//     EntryTTL from now, which confirms a speculative entry of the same key, and the map records
//     engine block i → keys [i·perBlock, (i+1)·perBlock).
//  5. Storing a block also refreshes the EntryTTL of its ancestors on the same backend: engines
//     keep a hot prefix without announcing it again, so without the refresh block 0 of a hot
//     prefix would expire while its continuations are fresh, and every lookup would match
//     nothing (lookups stop at the first missing block). Keep, per backend, each key's parent,
//     and walk up from the first stored key while the stamps are older.
//
// A BlockRemoved (attention group 0) takes EventTier(ev.Tier) off each block its hashes map to
// (each unknown hash counts once as DropUnknownBlock; MutationRemoved counts each block that
// leaves a tier); a block on no tier any more is forgotten with its map entry. A BlockRemoved of
// the GPU tier also drops the backend's speculative entry for those blocks: the engine has said
// it does not hold them.
// An AllBlocksCleared is a ClearBackend between the events before and after it. A prefix event
// changes the backend's entry for its prefix as PrefixRule says. Block events of another attention
// group count as DropGroup, unknown kinds as DropUnknownKind; Mutation names the changes Stats
// counts. Errors wrap ErrUnavailable when the store cannot answer. An index that can lose entries
// behind its callers' back — a shared server that restarts empty, while the engines keep their
// caches and publish nothing about them — also implements events.LossReporter and returns
// ErrBackendLost from Apply until the lost backend is cleared: the events consumers then clear it
// and catch up from the engine's replay buffer (kvindex/redisindex detects the loss with a
// registry epoch).
//
// # Use
//
//	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: "llama-3-8b"})
//	if err != nil {
//		return err
//	}
//	defer ix.Close()
//	// An events transport delivers each engine's batches: ix.Apply(ctx, "vllm-0", batch).
//	backends := []string{"vllm-0", "vllm-1"}
//	matches := make([]kvindex.Match, len(backends))
//	keys := req.BlockKeys(nil, kvindex.DefaultBlockSize) // req: a *prefixkey.Request with TokenIDs
//	matches, err = ix.Lookup(ctx, keys, backends, matches)
//	// … choose a backend from matches[i].Score and Tokens, load and health; then
//	_ = ix.Speculate(ctx, chosen, keys, 0) // held until its BlockStored events confirm it
package kvindex
