package kvindex

import (
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/prefixkey"
)

// The event rules every implementation follows (see "Other stores" in the package doc), and the
// names of its Stats counters.

// Mutation is a kind of change an index counts in Stats.Mutations, under its String.
type Mutation uint8

// Mutations, counted per index block for block events and Speculate, per call or event otherwise.
const (
	MutationStored          Mutation = iota // blocks stored (BlockStored), or given a tier
	MutationRemoved                         // blocks taken off a tier (BlockRemoved), per block that leaves one
	MutationCleared                         // ClearBackend, AllBlocksCleared and Clear
	MutationSpeculated                      // blocks speculated (Speculate)
	MutationPrefixCreated                   // cache_created
	MutationPrefixEvicted                   // cache_evicted
	MutationPrefixOffloaded                 // cache_offloaded
	MutationPrefixReloaded                  // cache_reloaded
	MutationPrefixPurged                    // cache_purged
	NumMutations                            // the number of mutations; not one itself
)

// String returns m's key in Stats.Mutations ("stored", "prefix_created", …), or "unknown".
func (m Mutation) String() string {
	switch m {
	case MutationStored:
		return "stored"
	case MutationRemoved:
		return "removed"
	case MutationCleared:
		return "cleared"
	case MutationSpeculated:
		return "speculated"
	case MutationPrefixCreated:
		return "prefix_created"
	case MutationPrefixEvicted:
		return "prefix_evicted"
	case MutationPrefixOffloaded:
		return "prefix_offloaded"
	case MutationPrefixReloaded:
		return "prefix_reloaded"
	case MutationPrefixPurged:
		return "prefix_purged"
	}
	return "unknown"
}

// DropReason is why an index skipped an event, counted in Stats.Dropped under its String.
type DropReason uint8

// Drop reasons, counted per event skipped; DropUnknownBlock per unknown engine hash, and
// DropTooManyBackends per Speculate call.
const (
	DropUnknownParent   DropReason = iota // BlockStored whose parent the backend's map lacks
	DropUnknownBlock                      // BlockRemoved or tokenless BlockStored, unknown hash
	DropBadTokens                         // BlockStored without blocks, or tokens ≠ size × blocks
	DropBadBlockSize                      // engine block size not a multiple of the index's
	DropGroup                             // block event of an attention group other than 0
	DropTooManyBackends                   // the index has no room for another backend
	DropUnknownKind                       // an event kind this version does not know
	DropBadPrefix                         // prefix event without a prefix, or of an unknown op
	NumDropReasons                        // the number of reasons; not one itself
)

// String returns r's key in Stats.Dropped ("unknown_parent", "non_full_attention_group", …), or
// "unknown".
func (r DropReason) String() string {
	switch r {
	case DropUnknownParent:
		return "unknown_parent"
	case DropUnknownBlock:
		return "unknown_block"
	case DropBadTokens:
		return "bad_tokens"
	case DropBadBlockSize:
		return "bad_block_size"
	case DropGroup:
		return "non_full_attention_group"
	case DropTooManyBackends:
		return "too_many_backends"
	case DropUnknownKind:
		return "unknown_kind"
	case DropBadPrefix:
		return "bad_prefix"
	}
	return "unknown"
}

// EventTier returns the tier a block event's blocks go on or leave: t, or TierStorage for a tier
// beyond the ones this version knows (a newer engine's medium).
func EventTier(t Tier) Tier {
	if t >= events.NumTiers {
		return events.TierStorage
	}
	return t
}

// CheckStored validates BlockStored event ev for an index of blockSize tokens per block. It
// returns ok false, and the reason to count the event under, when the event must be skipped:
//
//   - ev.GroupIdx ≠ 0: DropGroup (only the full-attention group decides prefix reuse);
//   - no block hashes: DropBadTokens;
//   - tokens present but not ev.BlockSize × len(ev.BlockHashes) (with ev.BlockSize 0 meaning
//     len(ev.TokenIDs) / len(ev.BlockHashes)): DropBadTokens;
//   - an engine block size that is not a multiple of blockSize: DropBadBlockSize.
//
// Otherwise ok is true and perBlock is the number of index blocks per engine block (≥ 1), or 0
// for an event without tokens, which names blocks the backend stored before (vLLM's offloading
// connector announces CPU copies so; see "Other stores" in the package doc). blockSize must be
// ≥ 1. It allocates nothing and is safe for concurrent use.
func CheckStored(ev *events.Event, blockSize int) (perBlock int, reason DropReason, ok bool) {
	if ev.GroupIdx != 0 {
		return 0, DropGroup, false
	}
	n := len(ev.BlockHashes)
	if n == 0 {
		return 0, DropBadTokens, false
	}
	if len(ev.TokenIDs) == 0 {
		return 0, 0, true
	}
	bs := ev.BlockSize
	if bs <= 0 {
		bs = len(ev.TokenIDs) / n
	}
	if bs <= 0 || len(ev.TokenIDs) != bs*n {
		return 0, DropBadTokens, false
	}
	if bs%blockSize != 0 {
		return 0, DropBadBlockSize, false
	}
	return bs / blockSize, 0, true
}

// StoredRoot returns the key that block 0 of BlockStored event ev, which has no parent, chains
// to: prefixkey.BlockRoot of ev's LoRA name, else model (the batch's, events.Batch.Model), else
// defaultModel (the index's), with ev's cache salt. A request's keys
// (prefixkey.AppendBlockKeys) start from the same root.
func StoredRoot(ev *events.Event, model, defaultModel string) uint64 {
	name := ev.LoRAName
	if name == "" {
		name = model
	}
	if name == "" {
		name = defaultModel
	}
	return prefixkey.BlockRoot(name, ev.CacheSalt)
}

// AppendStoredKeys appends to dst the len(ev.BlockHashes) × perBlock index keys of BlockStored
// event ev, which CheckStored accepted with perBlock ≥ 1, and returns the extended slice. Key 0
// chains to parent (StoredRoot, or the last key of the parent engine block) and key k to key k−1,
// each with prefixkey.NextBlockKey over its blockSize tokens; engine block i gives keys
// [i·perBlock, (i+1)·perBlock), each folding in ev.ExtraKeys[i] (exact when a multimodal item
// covers the whole engine block; otherwise such blocks may not match a request's keys, which
// under-reports). They equal the keys prefixkey.AppendBlockKeys gives a request with the same
// tokens. Safe for concurrent use.
func AppendStoredKeys(dst []uint64, ev *events.Event, parent uint64, blockSize, perBlock int) []uint64 {
	for i := range ev.BlockHashes {
		var extra []uint64
		if i < len(ev.ExtraKeys) {
			extra = ev.ExtraKeys[i]
		}
		for j := range perBlock {
			lo := (i*perBlock + j) * blockSize
			parent = prefixkey.NextBlockKey(parent, ev.TokenIDs[lo:lo+blockSize], extra)
			dst = append(dst, parent)
		}
	}
	return dst
}

// PrefixChange is what a prefix event does to the backend's entry for its prefix (PrefixRule).
type PrefixChange struct {
	// Remove drops the entry. Otherwise the entry is created or refreshed on Tier, with the
	// event's token count when it gives one (> 0), else the count it had, if any.
	Remove bool
	Tier   Tier
	// Mutation is what to count the event as.
	Mutation Mutation
}

// PrefixRule returns the change a prefix event of op makes, by kvroute's tier table:
// cache_created and cache_reloaded put the entry on TierGPU; cache_offloaded moves it to
// TierStorage when storageOffloading, else removes it; cache_evicted does the same when
// storageOffloading and evictionAsOffload, else removes it; cache_purged removes it. ok is false
// for an op it does not know (count DropBadPrefix).
func PrefixRule(op events.PrefixOp, storageOffloading, evictionAsOffload bool) (c PrefixChange, ok bool) {
	switch op {
	case events.PrefixCreated:
		return PrefixChange{Tier: events.TierGPU, Mutation: MutationPrefixCreated}, true
	case events.PrefixReloaded:
		return PrefixChange{Tier: events.TierGPU, Mutation: MutationPrefixReloaded}, true
	case events.PrefixOffloaded:
		return PrefixChange{Tier: events.TierStorage, Remove: !storageOffloading,
			Mutation: MutationPrefixOffloaded}, true
	case events.PrefixEvicted:
		return PrefixChange{Tier: events.TierStorage, Remove: !(storageOffloading && evictionAsOffload),
			Mutation: MutationPrefixEvicted}, true
	case events.PrefixPurged:
		return PrefixChange{Remove: true, Mutation: MutationPrefixPurged}, true
	}
	return PrefixChange{}, false
}
