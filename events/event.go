package events

import (
	"context"
	"errors"
	"strings"
)

// Tier is where a KV block lives on a backend, fastest first. The zero value is TierGPU.
type Tier uint8

const (
	TierGPU     Tier = iota // GPU memory (vLLM medium "GPU" or nil)
	TierCPU                 // CPU memory offload (medium "CPU")
	TierStorage             // disk, shared or external storage (any other medium)

	// NumTiers is the number of tiers; arrays indexed by Tier have this length.
	NumTiers = 3
)

// String returns "gpu", "cpu" or "storage".
func (t Tier) String() string {
	switch t {
	case TierGPU:
		return "gpu"
	case TierCPU:
		return "cpu"
	default:
		return "storage"
	}
}

// ParseMedium maps a vLLM/SGLang medium to a tier, case-insensitively: "" and "gpu" → TierGPU,
// "cpu" → TierCPU, anything else (disk, lmcache, shared storage…) → TierStorage.
func ParseMedium(medium string) Tier {
	switch {
	case medium == "" || strings.EqualFold(medium, "gpu"):
		return TierGPU
	case strings.EqualFold(medium, "cpu"):
		return TierCPU
	default:
		return TierStorage
	}
}

// Kind is an event's type.
type Kind uint8

const (
	KindBlockStored      Kind = iota + 1 // blocks entered the cache (BlockStored)
	KindBlockRemoved                     // blocks left a tier (BlockRemoved)
	KindAllBlocksCleared                 // the engine dropped its whole cache (AllBlocksCleared)
	KindPrefix                           // a prefix-granular SSE event (cache_created, …)
)

// String returns the wire name of the kind.
func (k Kind) String() string {
	switch k {
	case KindBlockStored:
		return "BlockStored"
	case KindBlockRemoved:
		return "BlockRemoved"
	case KindAllBlocksCleared:
		return "AllBlocksCleared"
	case KindPrefix:
		return "prefix"
	default:
		return "unknown"
	}
}

// PrefixOp is what a prefix-granular (SSE) event says happened to a prefix on a backend.
type PrefixOp uint8

const (
	PrefixCreated   PrefixOp = iota + 1 // cache_created: now on GPU
	PrefixEvicted                       // cache_evicted: removed, or to storage when eviction is treated as offload
	PrefixOffloaded                     // cache_offloaded: moved to external storage
	PrefixReloaded                      // cache_reloaded: back on GPU
	PrefixPurged                        // cache_purged: removed from every tier
)

// String returns the SSE event name ("cache_created", …).
func (op PrefixOp) String() string {
	switch op {
	case PrefixCreated:
		return "cache_created"
	case PrefixEvicted:
		return "cache_evicted"
	case PrefixOffloaded:
		return "cache_offloaded"
	case PrefixReloaded:
		return "cache_reloaded"
	case PrefixPurged:
		return "cache_purged"
	default:
		return "unknown"
	}
}

// ParsePrefixOp maps an SSE event name to its op; ok is false for an unknown name.
func ParsePrefixOp(name string) (op PrefixOp, ok bool) {
	switch name {
	case "cache_created":
		return PrefixCreated, true
	case "cache_evicted":
		return PrefixEvicted, true
	case "cache_offloaded":
		return PrefixOffloaded, true
	case "cache_reloaded":
		return PrefixReloaded, true
	case "cache_purged":
		return PrefixPurged, true
	}
	return 0, false
}

// Event is one decoded KV event. Which fields are meaningful depends on Kind:
//
//   - KindBlockStored: BlockHashes, Parent/HasParent, TokenIDs, BlockSize, LoRAName, Tier,
//     ExtraKeys, CacheSalt, GroupIdx.
//   - KindBlockRemoved: BlockHashes, Tier, GroupIdx.
//   - KindAllBlocksCleared: nothing.
//   - KindPrefix: PrefixOp, PrefixHash, TokenCount.
//
// The slices of events decoded into a Batch point into the Batch's reusable storage: they are
// valid until the Batch is decoded into again.
type Event struct {
	Kind Kind

	// BlockHashes are the engine's block hashes, opaque: integers of any width and sign are kept as
	// their 64-bit two's-complement value, byte strings as their last 8 bytes read big-endian.
	BlockHashes []uint64
	// Parent is the engine hash of the block before BlockHashes[0]; HasParent is false when the
	// event has none (nil, or 0 from publishers that send 0 for "no parent").
	Parent    uint64
	HasParent bool
	// TokenIDs holds BlockSize × len(BlockHashes) tokens.
	TokenIDs  []uint32
	BlockSize int
	// LoRAName, when set, replaces the model name in the block-key root.
	LoRAName string
	Tier     Tier
	// ExtraKeys has one entry per block (or is nil): the digests of the multimodal items that
	// overlap the block, each folded to uint64 as xxh3-64 of the item's identifier string (the
	// same digest a caller puts in prefixkey.MultiModalSpan.Hash).
	ExtraKeys [][]uint64
	// CacheSalt is the cache salt found in block 0's extra keys ("" when none).
	CacheSalt string
	// GroupIdx is the hybrid-attention layer group; only group 0 decides prefix reuse.
	GroupIdx int

	PrefixOp   PrefixOp
	PrefixHash string // lowercase hex of the prefix key
	TokenCount int
}

// Batch is one published message: a sequence number and its events.
type Batch struct {
	// Model is the model the publisher serves, from the topic (kv@<pod>@<model>) or the source's
	// configuration; it roots block keys when an event names no LoRA. "" means the sink's default.
	Model     string
	Seq       uint64  // publisher's batch sequence number (ZMQ frame 2); 0 for SSE
	TS        float64 // publisher's timestamp in seconds
	DPRank    int     // data-parallel rank, when HasDPRank
	HasDPRank bool
	Events    []Event
}

// Sink receives decoded batches. The KV index implements it.
//
// Apply applies every event of b as coming from backend, in order; it must not keep b or any of
// its slices after it returns. It returns an error only when the sink itself failed (a remote
// index unreachable); malformed or unplaceable events are counted by the sink and skipped, not
// returned. ClearBackend forgets everything the sink holds for backend (sequence gap without
// replay, engine restart). Both honour ctx only for remote I/O. Implementations are safe for
// concurrent use by several consumers, one goroutine per backend at a time.
type Sink interface {
	Apply(ctx context.Context, backend string, b *Batch) error
	ClearBackend(ctx context.Context, backend string) error
}

// LossReporter is implemented by a Sink that can lose what it was given without being told: a
// remote index shared by router replicas whose server restarted empty or failed over. A
// transport that checks for it (the ZMQ consumer of package zmqevents, every
// zmqevents.Config.LossCheckInterval) asks it about each backend it feeds and answers a loss as
// it answers a failed Apply: it clears the backend (BackendWriter.RequestReset) and, where the
// engine has a replay endpoint, catches up on what it still holds — also for a backend that
// publishes nothing.
//
// BackendLost reports whether entries the sink took for backend since its last ClearBackend may
// be gone; a lost backend stays lost until ClearBackend succeeds. The error is non-nil only when
// the sink could not tell (lost is then false); ctx bounds remote I/O. Implementations are safe
// for concurrent use and answer quickly (they may read a remote marker at most every second or
// so, sharing the answer between backends), and their Apply returns an error (kvindex's
// ErrBackendLost) for a lost backend until ClearBackend. The Redis index of package
// kvindex/redisindex implements it; admin.CountingSink forwards it.
type LossReporter interface {
	BackendLost(ctx context.Context, backend string) (lost bool, err error)
}

// ErrMalformed is wrapped by every decode error: the payload is not a valid batch or event.
var ErrMalformed = errors.New("events: malformed event")
