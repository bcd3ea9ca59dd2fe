package kvindex

import (
	"context"
	"errors"
	"time"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/prefixkey"
)

// Tier re-exports events.Tier: where a block lives on a backend.
type Tier = events.Tier

// TierWeights weight a cached block by the tier it is on, indexed by Tier.
type TierWeights [events.NumTiers]float64

// DefaultTierWeights returns the defaults: gpu 1.0, cpu 0.8, storage 0.6.
func DefaultTierWeights() TierWeights { return TierWeights{1.0, 0.8, 0.6} }

// Defaults shared by the implementations' Configs.
const (
	DefaultBlockSize       = prefixkey.DefaultBlockSize
	DefaultMaxEntries      = 1 << 20 // blocks (in-memory) — kvroute's max_entries counts prefix entries
	DefaultEntryTTL        = 600 * time.Second
	DefaultSpeculativeTTL  = 2 * time.Second
	DefaultApproximateTTL  = 120 * time.Second
	DefaultSweepInterval   = 30 * time.Second
	DefaultPrefixEntryTTL  = DefaultEntryTTL
	DefaultMaxPrefixScores = 64 // backends reported per prefix entry
)

// Match is one candidate backend's share of a request's cached prefix.
type Match struct {
	Backend string
	// Blocks is the length, in blocks, of the longest consecutive prefix of the request's block
	// keys that the backend holds (on any tier); Tokens is Blocks × the index's block size, or the
	// token count of a prefix-granular entry.
	Blocks int
	Tokens int
	// WeightedBlocks is the tier-weighted length: the sum over the matched blocks of the weight of the best
	// tier the backend holds each block on (≤ Blocks). For prefix entries: Tokens × tier weight.
	WeightedBlocks float64
	// Tier is the slowest tier among the matched blocks (TierGPU when Blocks == 0).
	Tier Tier
	// StoredBlocks is the length, in blocks, of the longest consecutive prefix of the request's
	// block keys that the backend holds on TierStorage, whether or not it also holds those blocks
	// on a faster tier (0 when it holds block 0 on no storage); StoredTokens is StoredBlocks × the
	// index's block size, or the token count of a prefix-granular entry on TierStorage. It never
	// exceeds Blocks. A prefill engine that keeps a prompt on its GPU and writes it to external
	// storage reports Tier GPU, yet StoredTokens tells that backends sharing its storage can read
	// the prefix from there.
	StoredBlocks int
	StoredTokens int
}

// BlockSizer is implemented by an index that knows its block size in tokens. kvroute.New checks
// that KVConfig.BlockSize agrees with it, and takes it when KVConfig.BlockSize is 0.
type BlockSizer interface {
	BlockSize() int
}

// Lookuper finds how much of a request's prefix each candidate backend holds.
//
// Lookup fills out[i] for candidates[i] (len(out) must be ≥ len(candidates); it returns out
// resliced to len(candidates)) with the longest consecutive cached prefix of keys, the request's
// block keys in order (prefixkey.AppendBlockKeys with the index's block size). Unknown candidates
// get a zero Match with their name. The error is non-nil only when the index could not answer (a
// remote index unreachable or ctx ended); out is then undefined. Safe for concurrent use; the
// in-memory index never blocks on writers for longer than one shard's update and allocates nothing.
type Lookuper interface {
	Lookup(ctx context.Context, keys []uint64, candidates []string, out []Match) ([]Match, error)
}

// PrefixLookuper answers for prefix-granular entries (kvroute's SSE events): prefix is the
// lowercase hex of a prefix key. Same contract as Lookuper.
type PrefixLookuper interface {
	LookupPrefix(ctx context.Context, prefix string, candidates []string, out []Match) ([]Match, error)
}

// Speculator records predicted entries: right after a routing decision the chosen backend will
// soon hold the request's blocks. Speculate marks keys as held by backend (GPU tier) for ttl
// (0 means the implementation's configured speculative TTL) unless a BlockStored confirms them,
// which makes them ordinary entries. In approximate mode (no events) this is the only source.
// Safe for concurrent use; the error is non-nil only for a remote index that failed.
type Speculator interface {
	Speculate(ctx context.Context, backend string, keys []uint64, ttl time.Duration) error
}

// KvCacheIndex is the KV-block index: it applies engines' KV events (events.Sink), answers
// lookups, takes speculative entries, and reports stats. Implementations: *MemoryIndex (the
// default) and redisindex.Index (package kvindex/redisindex, shared by several router replicas).
// Every method is safe for concurrent use.
//
// To write one on another store, follow the event rules of CheckStored, StoredRoot,
// AppendStoredKeys and PrefixRule, count Stats under the Mutation and DropReason names, wrap
// ErrUnavailable when the store cannot answer, and run kvindex/indextest against it. An index that
// can lose entries behind its callers' back (a shared server restarting empty) also implements
// events.LossReporter and returns ErrBackendLost from Apply until the lost backend is cleared.
type KvCacheIndex interface {
	events.Sink
	Lookuper
	PrefixLookuper
	Speculator
	Statser
	Clearer
}

// Statser is the part of an index that reports counters and sizes (kvroute's Stats.Index).
type Statser interface {
	// Stats returns counters and sizes; ctx bounds a remote index's I/O.
	Stats(ctx context.Context) (Stats, error)
}

// Clearer is the part of an index that drops its entries (kvroute's POST /admin/kv-index/clear).
type Clearer interface {
	// Clear drops every entry of every backend and returns how many entries it dropped.
	Clear(ctx context.Context) (int, error)
}

// Stats describes an index. Entries counts (block, backend) memberships plus prefix entries.
type Stats struct {
	Backend          string            `json:"backend"` // kvroute's "memory" or "redis"; another index its own name
	Blocks           int               `json:"block_count"`
	Entries          int               `json:"entry_count"`
	PrefixCount      int               `json:"prefix_count"`
	SpeculativeCount int               `json:"speculative_count"`
	Lookups          uint64            `json:"total_hits"` // lookups answered (kvroute's total_hits)
	Evictions        uint64            `json:"total_evictions"`
	Expired          uint64            `json:"expired"`
	Mutations        map[string]uint64 `json:"mutations"` // by type: stored, removed, cleared, prefix_created, …
	Dropped          map[string]uint64 `json:"dropped"`   // events not applied, by reason: unknown_parent, bad_tokens, …
	PerBackend       map[string]int    `json:"per_backend_entries"`
	MemoryBytes      int64             `json:"memory_bytes,omitempty"` // in-memory index: bytes held by its tables
}

// Errors callers branch on.
var (
	ErrInvalidConfig = errors.New("kvindex: invalid config")
	ErrClosed        = errors.New("kvindex: index closed")

	// ErrUnavailable is wrapped by every error of a remote index that could not reach its store
	// or got a failure from it (connection refused or lost, deadline exceeded, error reply). The
	// Router treats a failed lookup as "no KV information" and routes by consistent hashing alone.
	ErrUnavailable = errors.New("kvindex: index unavailable")

	// ErrBackendLost is returned by Apply of an index whose store lost the backend's entries
	// since its last ClearBackend without being told (a shared server that restarted empty; see
	// events.LossReporter). Such an index refuses the backend's batches until ClearBackend, since
	// they would build on a hole. The events consumers answer it as any failed Apply: they clear
	// the backend and, where the engine has a replay endpoint, replay what it still holds.
	ErrBackendLost = errors.New("kvindex: the backend's entries were lost")
)
