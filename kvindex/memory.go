package kvindex

import (
	"context"
	"fmt"
	"math/bits"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/prefixkey"
)

// Defaults of MemoryConfig not shared with other implementations.
const (
	// DefaultMaxPrefixEntries is MemoryConfig.MaxPrefixEntries when zero: kvroute's
	// kv_cache_index.max_entries.
	DefaultMaxPrefixEntries = 100_000
	// DefaultLookupStride is MemoryConfig.LookupStride's default: Lookup probes every 16th key.
	DefaultLookupStride = 16
	// MaxTTL bounds the TTLs of MemoryConfig: the index's clock ticks (2²² ns ≈ 4.2 ms) wrap
	// after about 208 days and ages are compared as signed 32-bit differences.
	MaxTTL = 90 * 24 * time.Hour
)

// MemoryConfig configures a MemoryIndex. Its zero value means the defaults.
//
// kvroute's YAML (kv_cache_index) maps onto it as: max_entries → MaxPrefixEntries,
// entry_ttl_seconds → EntryTTL, storage_offloading.enabled → StorageOffloading,
// storage_offloading.treat_eviction_as_offload → TreatEvictionAsOffload (the YAML's default is
// true; the proxy sets it), gpu/storage_tier_weight → TierWeights.
type MemoryConfig struct {
	// BlockSize is the number of tokens per block key (DefaultBlockSize, 16, when 0). Engines'
	// blocks must be a multiple of it: an engine block of 64 tokens becomes 4 of our blocks.
	// Callers must compute request keys with the same size (prefixkey.AppendBlockKeys).
	BlockSize int
	// DefaultModel roots the block keys of a BlockStored event whose event names no LoRA and
	// whose Batch names no Model.
	DefaultModel string
	// MaxEntries is the most blocks the table holds (DefaultMaxEntries when 0; at most 2³¹). The
	// table is split into up to 256 shards (about one per 4,096 blocks), each holding its share of
	// MaxEntries; a full shard evicts its least recently refreshed eighth (see EntryTTL; ordered at
	// EntryTTL/64 granularity, found by two sequential scans of the shard, O(1) amortised per
	// insertion), so that the table never holds more than MaxEntries blocks. Blocks are evicted
	// with all their holders; chains lose their tails first.
	MaxEntries int
	// EntryTTL is how long a block stays held after its last evidence (DefaultEntryTTL when 0; at
	// most MaxTTL): a BlockStored of the block, or of any of its descendants (an engine that
	// stores a child holds the parent's whole chain, so storing a block refreshes its ancestors:
	// a hot prefix the engine keeps without re-announcing it stays fresh). Blocks expire between
	// EntryTTL and EntryTTL × 65/64 after their evidence; the evidence is per block, so a
	// backend's membership lasts as long as any holder's. A prefix entry expires exactly EntryTTL
	// after its last event. Expired entries count as absent at once and are removed by the sweep
	// (until then, Stats counts them).
	EntryTTL time.Duration
	// SweepInterval is the period of the goroutine that removes expired entries and reclaims
	// cleared backends (DefaultSweepInterval when 0). A negative value starts no goroutine:
	// expired confirmed and prefix entries then leave only when evicted or overwritten (for
	// tests and for callers that run their own schedule). Speculative entries do not wait for
	// the sweep (see SpeculativeTTL).
	SweepInterval time.Duration
	// SpeculativeTTL is the lifetime of a speculative entry when Speculate is given ttl 0
	// (DefaultSpeculativeTTL when 0; at most MaxTTL). Expired speculative entries count as
	// absent at once, and leave the table without waiting for the sweep: each Speculate drops
	// its backend's expired entries about as fast as it adds new ones, and Stats drops them all
	// before counting (see Speculate and Stats).
	SpeculativeTTL time.Duration
	// ApproximateCapacityBlocks, when > 0, caps each backend's speculative blocks: past it, the
	// backend's oldest speculative blocks (those soonest to expire) are dropped first. In
	// approximate mode (no events), set it to the engine's real cache size in blocks of
	// BlockSize tokens (GPU plus offload tiers), so that the index forgets what the engine has
	// evicted. 0 means no cap.
	ApproximateCapacityBlocks int
	// TierWeights weight a matched block by the best tier it is held on; the zero value means
	// DefaultTierWeights. Each weight must be in [0, 1].
	TierWeights TierWeights
	// StorageOffloading tracks the storage tier of prefix entries (kvroute's
	// storage_offloading.enabled): cache_offloaded moves an entry to TierStorage. When false,
	// the index tracks GPU residency only and cache_offloaded removes the entry.
	StorageOffloading bool
	// TreatEvictionAsOffload makes cache_evicted move a prefix entry to TierStorage instead of
	// removing it. It applies only with StorageOffloading.
	TreatEvictionAsOffload bool
	// MaxBackends is the most backends tracked at once (DefaultMaxBackends, 64, when 0; at most
	// MaxMemoryBackends). A block's holders are one 64-bit set per tier. Events of a backend
	// beyond the limit are dropped and counted (Dropped["too_many_backends"]). Cleared backends'
	// slots are reused after the next sweep (or at once, by a synchronous sweep, when needed).
	MaxBackends int
	// MaxPrefixEntries is the most prefix-granular entries (prefixes) held
	// (DefaultMaxPrefixEntries when 0); a full store evicts its least recently updated tenth.
	MaxPrefixEntries int
	// LookupStride makes Lookup a jump search (the default, DefaultLookupStride when 0): it
	// probes every LookupStride-th key of the request (and the last), and takes a candidate that
	// holds a probed key on the same best tier as the previous probed key to hold every key
	// between them on that tier; a candidate that lost a probed key, or whose best tier changed,
	// is resolved exactly by probing that stride key by key; so is, on the storage tier, a
	// candidate that held the previous probed key there but not this one (Match.StoredBlocks:
	// the storage copies of a candidate's blocks are taken to form a prefix too). A lookup then
	// costs about len(keys)/LookupStride probes plus LookupStride per place where some
	// candidate's match (or stored prefix) ends or changes tier, instead of one probe per matched
	// key (BenchmarkLookup: about 10× fewer nanoseconds for a 512-block request). The result is
	// exact when each candidate's cached blocks within the request form a prefix whose tiers
	// change monotonically along it, and its storage copies a prefix of that — what
	// engines' eviction orders leave (vLLM frees a sequence's blocks tail first, so a parent is
	// never evicted before its children; SGLang evicts radix-tree leaves), and what this index's
	// own expiry and eviction keep (storing a block refreshes its ancestors, so descendants go
	// first). An event stream that removes a middle block while keeping its descendants (no
	// engine we know sends one) leaves a hole strictly between two probes, which is missed: the
	// match is reported longer. 1 means exact: every key is probed in order.
	LookupStride int
	// Now is the clock (time.Now when nil). The index works in ticks of 2²² ns (≈4.2 ms).
	Now func() time.Time
}

// withDefaults validates c and fills in its defaults.
func (c MemoryConfig) withDefaults() (MemoryConfig, error) {
	invalid := func(format string, args ...any) (MemoryConfig, error) {
		return c, fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	if c.BlockSize == 0 {
		c.BlockSize = DefaultBlockSize
	}
	if c.LookupStride == 0 {
		c.LookupStride = DefaultLookupStride
	}
	if c.MaxEntries == 0 {
		c.MaxEntries = DefaultMaxEntries
	}
	if c.EntryTTL == 0 {
		c.EntryTTL = DefaultEntryTTL
	}
	if c.SweepInterval == 0 {
		c.SweepInterval = DefaultSweepInterval
	}
	if c.SpeculativeTTL == 0 {
		c.SpeculativeTTL = DefaultSpeculativeTTL
	}
	if c.TierWeights == (TierWeights{}) {
		c.TierWeights = DefaultTierWeights()
	}
	if c.MaxBackends == 0 {
		c.MaxBackends = DefaultMaxBackends
	}
	if c.MaxPrefixEntries == 0 {
		c.MaxPrefixEntries = DefaultMaxPrefixEntries
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	switch {
	case c.BlockSize < 1 || c.BlockSize > 1<<16:
		return invalid("BlockSize %d not in [1, 65536]", c.BlockSize)
	case c.MaxEntries < 1 || c.MaxEntries > maxEntriesLimit:
		return invalid("MaxEntries %d not in [1, %d]", c.MaxEntries, maxEntriesLimit)
	case c.EntryTTL < 0 || c.EntryTTL > MaxTTL:
		return invalid("EntryTTL %v not in (0, %v]", c.EntryTTL, MaxTTL)
	case c.SpeculativeTTL < 0 || c.SpeculativeTTL > MaxTTL:
		return invalid("SpeculativeTTL %v not in (0, %v]", c.SpeculativeTTL, MaxTTL)
	case c.ApproximateCapacityBlocks < 0:
		return invalid("ApproximateCapacityBlocks %d < 0", c.ApproximateCapacityBlocks)
	case c.MaxBackends < 1 || c.MaxBackends > MaxMemoryBackends:
		return invalid("MaxBackends %d not in [1, %d]", c.MaxBackends, MaxMemoryBackends)
	case c.LookupStride < 0 || c.LookupStride > 1<<16:
		return invalid("LookupStride %d not in [0, 65536]", c.LookupStride)
	case c.MaxPrefixEntries < 1:
		return invalid("MaxPrefixEntries %d < 1", c.MaxPrefixEntries)
	}
	for t, w := range c.TierWeights {
		if !(w >= 0 && w <= 1) {
			return invalid("TierWeights[%v] = %v not in [0, 1]", events.Tier(t), w)
		}
	}
	return c, nil
}

// bodyBytes is the size of one block's body in the table's slab, coldBytes of a cold part.
const (
	bodyBytes = 24
	coldBytes = 32
)

// maxEntriesLimit bounds MaxEntries: 256 shards of at most maxBodies blocks.
const maxEntriesLimit = 1 << 31

// tickShift: one tick is 2^tickShift ns (≈4.19 ms).
const tickShift = 22

// MemoryIndex is the in-memory KvCacheIndex: a sharded hash table from kvroute's chained block
// keys to the set of backends holding each block, per tier. Every method is safe for concurrent
// use. Lookup takes no lock and allocates nothing: it reads shards optimistically (seqlock) and
// retries only a probe that raced with a writer of that shard; writers lock one shard per block.
// Create it with NewMemory; the zero value is not usable. Close stops its sweep goroutine.
//
// Memory: per block, a 24-byte body (its GPU holders, its parent) and an 8-byte probe word in an
// array kept 76–87.5% full, and a 32-byte cold part for a block held on the CPU or storage tier or
// by speculative holders; per (block, backend) membership confirmed by an event, a 16-byte
// engine-hash map entry, the maps kept 81–90% full. With blocks held by 2.7 backends on average
// that is about 32 bytes per membership (BenchmarkMemoryPerMembership). Backends whose engines
// report the same block hash for the same block (vLLM engines started with one PYTHONHASHSEED)
// share one 24-byte engine-hash entry per block instead (see memory_shared.go): about 23 bytes per
// membership. Per speculative membership, an 8-byte entry in its backend's expiry queue (16 when
// queued out of order), kept until the entry's expiry even when a BlockStored confirms it sooner.
type MemoryIndex struct {
	cfg       MemoryConfig
	epoch     time.Time // the clock's origin
	epochNs   int64     // length of an evidence epoch (EntryTTL/64, at least 1 ms)
	ttlEpochs uint32
	ttlTicks  uint32
	specTicks uint32
	weights   TierWeights

	shards    []shard
	shardMask uint64
	ids       [MaxMemoryBackends]idCounters
	reg       registry
	engines   sharedEngines
	prefix    prefixStore
	// storageIDs are the ids that have stored a block on the storage tier since they were
	// assigned: Lookup searches only their stored prefixes. Cleared when the ids are freed.
	storageIDs atomic.Uint64

	lookups   [16]paddedCounter
	evictions atomic.Uint64
	expired   atomic.Uint64
	mut       [NumMutations]atomic.Uint64
	dropped   [NumDropReasons]atomic.Uint64

	reclaimMu sync.Mutex

	closed    atomic.Bool
	closeOnce sync.Once
	stop      chan struct{}
	done      chan struct{}
}

var _ KvCacheIndex = (*MemoryIndex)(nil)

type paddedCounter struct {
	n atomic.Uint64
	_ [56]byte
}

// NewMemory returns an in-memory index configured by cfg. It validates cfg (errors wrap
// ErrInvalidConfig) and, unless cfg.SweepInterval < 0, starts the sweep goroutine that Close
// stops.
func NewMemory(cfg MemoryConfig) (*MemoryIndex, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	epochNs := max(int64(cfg.EntryTTL)/64, int64(time.Millisecond))
	m := &MemoryIndex{
		cfg:       cfg,
		epoch:     cfg.Now(),
		epochNs:   epochNs,
		ttlEpochs: uint32((int64(cfg.EntryTTL) + epochNs - 1) / epochNs),
		ttlTicks:  durTicks(cfg.EntryTTL),
		specTicks: durTicks(cfg.SpeculativeTTL),
		weights:   cfg.TierWeights,
	}
	// About 4,096 blocks per shard, from 1 to 256 shards.
	ns := 1
	for ns < 256 && ns*2*4096 <= cfg.MaxEntries {
		ns *= 2
	}
	m.shards = make([]shard, ns)
	m.shardMask = uint64(ns - 1)
	for i := range m.shards {
		sh := &m.shards[i]
		sh.limit = cfg.MaxEntries / ns
		if i < cfg.MaxEntries%ns {
			sh.limit++
		}
		sh.tab.Store(emptyTable())
	}
	m.reg.init(cfg.MaxBackends)
	m.prefix.init()
	if cfg.SweepInterval > 0 {
		m.stop = make(chan struct{})
		m.done = make(chan struct{})
		go m.sweepLoop(cfg.SweepInterval)
	}
	return m, nil
}

// durTicks converts d to ticks, rounding up, at least 1.
func durTicks(d time.Duration) uint32 {
	return uint32(max(1, (int64(d)+1<<tickShift-1)>>tickShift))
}

// clock returns the current tick and epoch, and the TTLs.
func (m *MemoryIndex) clock() clock {
	d := int64(m.cfg.Now().Sub(m.epoch))
	return clock{now: uint32(d >> tickShift), epoch: uint32(d / m.epochNs), ttl: m.ttlEpochs, ttlTick: m.ttlTicks}
}

// mix is a bijective 64-bit finaliser (MurmurHash3's fmix64): block keys are xxh3 outputs, but
// callers may pass anything, and shard and slot choice need well-spread bits. The four keys mixing
// to 0–3 (which bodies, ignoring the flag bits, would take for free) are moved to another
// constant.
func mix(k uint64) uint64 {
	k ^= k >> 33
	k *= 0xff51afd7ed558ccd
	k ^= k >> 33
	k *= 0xc4ceb9fe1a85ec53
	k ^= k >> 33
	if k <= flagMask {
		k = 0x9e3779b97f4a7c15
	}
	return k
}

func (m *MemoryIndex) shardOf(h uint64) *shard { return &m.shards[h&m.shardMask] }

// lockShard locks h's shard and loads the retired ids into c (they must be read under the lock,
// see registry).
func (m *MemoryIndex) lockShard(h uint64, c *clock) *shard {
	sh := m.shardOf(h)
	sh.mu.Lock()
	c.retired = m.reg.retired.Load()
	return sh
}

func (m *MemoryIndex) drop(reason DropReason, n int) { m.dropped[reason].Add(uint64(n)) }

// acquire returns backend's state, registering it, with its life lock held shared; nil when no
// backend slot is free.
func (m *MemoryIndex) acquire(backend string) *backendState {
	for {
		bs := m.reg.lookup(backend)
		if bs == nil {
			bs = m.reg.register(backend)
			if bs == nil {
				// Out of ids: reclaim the cleared backends' ids now, then retry once.
				if m.reg.retired.Load() == 0 {
					return nil
				}
				m.reclaim()
				if bs = m.reg.register(backend); bs == nil {
					return nil
				}
			}
		}
		bs.life.RLock()
		if !bs.retired {
			return bs
		}
		bs.life.RUnlock()
	}
}

// Apply applies every event of b as coming from backend (events.Sink). It returns ErrClosed after
// Close and nil otherwise: unplaceable events are counted in Stats().Dropped.
//
//   - BlockStored (group 0 only): each engine block is re-keyed with prefixkey.NextBlockKey from
//     its tokens, chained to the previous block of the event, the first to the event's parent
//     (through the backend's engine-hash map; an unknown parent drops the event, counted as
//     "unknown_parent") or, without a parent, to prefixkey.BlockRoot(LoRA name, else b.Model,
//     else DefaultModel; cache salt). An engine block of r × BlockSize tokens gives r keys, each
//     folding in the engine block's extra keys (exact when a multimodal item covers the engine
//     block; otherwise such blocks may not match, which under-reports). A BlockStored without
//     tokens (vLLM's offloading connector announces CPU copies so) adds its tier to blocks the
//     backend already stored, and is otherwise dropped ("unknown_block").
//   - BlockRemoved (group 0 only): removes the tier; the engine-hash mapping goes when the
//     backend holds the block on no tier.
//   - AllBlocksCleared: as ClearBackend.
//   - Prefix events: kvroute's tier table (see MemoryConfig.StorageOffloading).
//
// Apply holds the backend's engine-map mutex for the batch and one shard lock per block write.
func (m *MemoryIndex) Apply(_ context.Context, backend string, b *events.Batch) error {
	if m.closed.Load() {
		return ErrClosed
	}
	if len(b.Events) == 0 {
		return nil
	}
	bs := m.acquire(backend)
	if bs == nil {
		m.drop(DropTooManyBackends, len(b.Events))
		return nil
	}
	bs.emu.Lock()
	c := m.clock()
	bs.lastActive.Store(c.now)
	for i := range b.Events {
		ev := &b.Events[i]
		switch ev.Kind {
		case events.KindBlockStored:
			m.applyStored(bs, b, ev, c)
		case events.KindBlockRemoved:
			m.applyRemoved(bs, ev, c)
		case events.KindAllBlocksCleared:
			bs.emu.Unlock()
			bs.life.RUnlock()
			m.retire(backend)
			if bs = m.acquire(backend); bs == nil {
				m.drop(DropTooManyBackends, len(b.Events)-i-1)
				return nil
			}
			bs.emu.Lock()
			bs.lastActive.Store(c.now)
		case events.KindPrefix:
			m.applyPrefix(bs.id, ev, c.now)
		default:
			m.drop(DropUnknownKind, 1)
		}
	}
	bs.emu.Unlock()
	bs.life.RUnlock()
	return nil
}

// applyStored applies one BlockStored event. Under bs.emu and bs.life (shared).
func (m *MemoryIndex) applyStored(bs *backendState, b *events.Batch, ev *events.Event, c clock) {
	if ev.GroupIdx != 0 {
		m.drop(DropGroup, 1)
		return
	}
	n := len(ev.BlockHashes)
	if n == 0 {
		m.drop(DropBadTokens, 1)
		return
	}
	tier := ev.Tier
	if tier >= events.NumTiers {
		tier = events.TierStorage
	}
	if len(ev.TokenIDs) == 0 {
		m.addTierToKnown(bs, ev.BlockHashes, tier, c)
		return
	}
	bsz := ev.BlockSize
	if bsz <= 0 {
		bsz = len(ev.TokenIDs) / n
	}
	if bsz <= 0 || len(ev.TokenIDs) != bsz*n {
		m.drop(DropBadTokens, 1)
		return
	}
	our := m.cfg.BlockSize
	if bsz%our != 0 {
		m.drop(DropBadBlockSize, 1)
		return
	}
	r := bsz / our
	bs.subKeys = max(bs.subKeys, r)
	var parent, parentH uint64 // parent key, and its mixed form (0: a root, not a block)
	if ev.HasParent {
		p, ok := m.engineGet(bs, mix(ev.Parent))
		if !ok {
			m.drop(DropUnknownParent, 1)
			return
		}
		parent, parentH = p, mix(p)
	} else {
		name := ev.LoRAName
		if name == "" {
			name = b.Model
		}
		if name == "" {
			name = m.cfg.DefaultModel
		}
		parent = prefixkey.BlockRoot(name, ev.CacheSalt)
	}
	// Keys are computed a batch at a time; then one pass touches the probe-array slot of every
	// key and the engine-map slot of every hash, so that their cache misses overlap, before the
	// locked writes.
	var w ingestBatch
	w.parentH = parentH
	for i, eh := range ev.BlockHashes {
		var extra []uint64
		if i < len(ev.ExtraKeys) {
			extra = ev.ExtraKeys[i]
		}
		toks := ev.TokenIDs[i*bsz : (i+1)*bsz]
		ehm := mix(eh)
		for j := 0; j < r; j++ {
			parent = prefixkey.NextBlockKey(parent, toks[j*our:(j+1)*our], extra)
			mk := ehm
			if j < r-1 {
				mk = derive(ehm, r-1-j)
			}
			if w.add(parent, mk) {
				m.flush(bs, &w, tier, c)
			}
		}
	}
	m.flush(bs, &w, tier, c)
	m.mut[MutationStored].Add(uint64(n * r))
	if parentH != 0 {
		// The engine stored a child of the event's parent: it holds the parent's whole chain.
		m.refreshAncestors(parentH, uint64(1)<<bs.id, c)
	}
}

// ingestBatch is a run of consecutive blocks of one BlockStored event awaiting their writes.
type ingestBatch struct {
	n       int
	parentH uint64 // mixed key of the parent of the first block (0: a root)
	keys    [ingestBatchSize]uint64
	hs      [ingestBatchSize]uint64 // mixed keys
	mks     [ingestBatchSize]uint64 // engine-map keys
}

const ingestBatchSize = 32

// add appends a block; it reports whether the batch is full.
func (w *ingestBatch) add(key, mk uint64) bool {
	w.keys[w.n], w.hs[w.n], w.mks[w.n] = key, mix(key), mk
	w.n++
	return w.n == ingestBatchSize
}

// flush writes the batch's blocks for bs (see applyStored) and empties it.
func (m *MemoryIndex) flush(bs *backendState, w *ingestBatch, tier events.Tier, c clock) {
	var touched uint64
	for i := range w.n {
		t := m.shardOf(w.hs[i]).tab.Load()
		touched += t.keys[t.home(w.hs[i])].Load()
		touched += bs.em.touch(w.mks[i])
	}
	for i := range w.n {
		if same := m.store(w.hs[i], w.parentH, bs.id, tier, engineFP(w.mks[i]), c); same != 0 {
			m.noteShared(bs, same)
		}
		w.parentH = w.hs[i]
		m.emPut(bs, w.mks[i], w.keys[i], c)
	}
	if touched == 1 {
		runtime.KeepAlive(touched) // keeps the prefetching loads
	}
	w.n = 0
}

// maxAncestorWalk bounds refreshAncestors (a chain of 2^20 blocks is 16M tokens).
const maxAncestorWalk = 1 << 20

// refreshAncestors brings the evidence epoch of block h and its ancestors to the current epoch,
// walking parent links until an ancestor is current (whose own ancestors then are too) or
// absent. Each block is thus walked at most once per epoch: O(1) amortised per store.
func (m *MemoryIndex) refreshAncestors(h, bit uint64, c clock) {
	for range maxAncestorWalk {
		if h == 0 {
			return
		}
		cc := c
		sh := m.lockShard(h, &cc)
		h = m.refresh(sh, h, bit, cc)
		sh.mu.Unlock()
	}
}

// store adds backend id's membership of block h (mixed key), child of parentH, on tier, under an
// engine hash of fingerprint efp (0: none); it returns addConfirmed's evidence on sharing.
func (m *MemoryIndex) store(h, parentH uint64, id uint8, tier events.Tier, efp uint8, c clock) (same int) {
	if bit := uint64(1) << id; tier == events.TierStorage && m.storageIDs.Load()&bit == 0 {
		m.storageIDs.Or(bit) // before the block is visible to lookups
	}
	sh := m.lockShard(h, &c)
	_, same = m.addConfirmed(sh, h, parentH, id, tier, efp, c)
	sh.mu.Unlock()
	return same
}

// emPut maps engine hash h (mixed) to key in bs's map. When the map holds more than 3 entries per
// membership the backend has in the block table (plus a floor), and twice as many as after the
// last pruning, most of them dangle (their blocks were evicted or expired, which no BlockRemoved
// reports): it drops them first, probing the table once per entry — O(1) amortised per insert,
// and the map stays within a few times its live size. A backend on the shared map writes there
// instead (sharedPut). Under bs.emu.
func (m *MemoryIndex) emPut(bs *backendState, h, key uint64, c clock) {
	if !bs.shared && bs.em.count >= max(bs.em.pruneAt, 3*int(m.ids[bs.id].members.Load())+minPrune) {
		bit := uint64(1) << bs.id
		bs.em.retain(func(_, key uint64) bool {
			return m.heldConfirmed(mix(key), bit, c)
		})
		// Live entries can outnumber memberships (two engine hashes for one block): never prune
		// again before the map has doubled.
		bs.em.pruneAt = 2 * bs.em.count
	}
	if bs.sharedEver {
		m.enginePut(bs, h, key, c)
		return
	}
	bs.em.put(h, key)
}

// minPrune is the smallest engine map emPut prunes.
const minPrune = 4096

// heldConfirmed reports, without locking, whether the backends of bit hold block h on some tier.
func (m *MemoryIndex) heldConfirmed(h, bit uint64, c clock) bool {
	v, ok := m.shardOf(h).read(h)
	return ok && v.confirmed()&bit != 0 && c.fresh(&v)
}

// keysOf appends to dst the keys engine hash h (mixed) maps to in bs's map: the last sub-key
// first. Under bs.emu.
func (m *MemoryIndex) keysOf(dst []uint64, bs *backendState, h uint64) []uint64 {
	k, ok := m.engineGet(bs, h)
	if !ok {
		return dst
	}
	return m.subKeysOf(append(dst, k), bs, h)
}

// subKeysOf appends to dst the keys before the last that engine hash h (mixed) maps to in bs's
// map. Under bs.emu.
func (m *MemoryIndex) subKeysOf(dst []uint64, bs *backendState, h uint64) []uint64 {
	for j := 1; j < bs.subKeys; j++ {
		k, ok := m.engineGet(bs, derive(h, j))
		if !ok {
			break
		}
		dst = append(dst, k)
	}
	return dst
}

// addTierToKnown adds tier to the blocks the engine hashes map to (a BlockStored without tokens).
func (m *MemoryIndex) addTierToKnown(bs *backendState, hashes []uint64, tier events.Tier, c clock) {
	var buf [16]uint64
	stored := 0
	for _, eh := range hashes {
		keys := m.keysOf(buf[:0], bs, mix(eh))
		if len(keys) == 0 {
			m.drop(DropUnknownBlock, 1)
			continue
		}
		for _, k := range keys {
			m.store(mix(k), 0, bs.id, tier, 0, c)
		}
		stored += len(keys)
	}
	m.mut[MutationStored].Add(uint64(stored))
}

// applyRemoved applies one BlockRemoved event. Under bs.emu and bs.life (shared).
func (m *MemoryIndex) applyRemoved(bs *backendState, ev *events.Event, c clock) {
	if ev.GroupIdx != 0 {
		m.drop(DropGroup, 1)
		return
	}
	tier := ev.Tier
	if tier >= events.NumTiers {
		tier = events.TierStorage
	}
	var buf [16]uint64
	removed := 0
	for _, eh := range ev.BlockHashes {
		h := mix(eh)
		if i := bs.em.find(h); i >= 0 && bs.subKeys <= 1 {
			// One key, in the backend's own map: the common case.
			kh := mix(bs.em.slots[i].key)
			cc := c
			sh := m.lockShard(kh, &cc)
			still := m.removeTier(sh, kh, bs.id, tier, cc)
			sh.mu.Unlock()
			removed++
			if !still {
				bs.em.delAt(i) // the map has not changed since find
			}
			continue
		}
		keys := m.keysOf(buf[:0], bs, h)
		if len(keys) == 0 {
			m.drop(DropUnknownBlock, 1)
			continue
		}
		still := false
		for _, k := range keys {
			kh := mix(k)
			cc := c
			sh := m.lockShard(kh, &cc)
			if m.removeTier(sh, kh, bs.id, tier, cc) {
				still = true
			}
			sh.mu.Unlock()
		}
		removed += len(keys)
		if !still {
			m.engineDel(bs, h)
			for j := 1; j < len(keys); j++ {
				m.engineDel(bs, derive(h, j))
			}
		}
	}
	m.mut[MutationRemoved].Add(uint64(removed))
}

// ClearBackend forgets everything the index holds for backend (events.Sink): its blocks on every
// tier, its speculative and prefix entries and its engine-hash map. It is O(1) in the size of the
// table: the backend's id is retired (lookups stop seeing its blocks at once) and its bits are
// cleared from the table by the next sweep, which then frees the id; until then Stats().Blocks
// still counts blocks held only by it. It returns ErrClosed after Close, nil otherwise.
func (m *MemoryIndex) ClearBackend(_ context.Context, backend string) error {
	if m.closed.Load() {
		return ErrClosed
	}
	m.retire(backend)
	return nil
}

// retire unlinks backend and waits for its current writers.
func (m *MemoryIndex) retire(backend string) {
	bs := m.reg.unlink(backend)
	if bs == nil {
		return
	}
	bs.life.Lock()
	bs.retired = true
	bs.life.Unlock()
	bs.emu.Lock()
	bs.em = engineMap{}
	bs.emu.Unlock()
	bs.resetSpec()
	m.mut[MutationCleared].Add(1)
}

// reclaim clears the retired ids' bits from every shard and prefix entry, then frees the ids.
// It also drops expired entries on the way (it is a full sweep).
func (m *MemoryIndex) reclaim() { m.sweep() }

// sweep removes expired entries from every shard and the prefix store, clears the bits of
// retired backends and frees their ids, empties the speculative queues of their due entries
// (compacting them), and retires idle empty backends.
func (m *MemoryIndex) sweep() {
	m.reclaimMu.Lock()
	defer m.reclaimMu.Unlock()
	mask := m.reg.retired.Load()
	c := m.clock()
	c.retired = mask
	expired := 0
	for i := range m.shards {
		sh := &m.shards[i]
		sh.mu.Lock()
		expired += m.sweepShard(sh, c)
		sh.mu.Unlock()
	}
	expired += m.sweepPrefixes(c)
	m.expired.Add(uint64(expired))
	if mask != 0 {
		for x := mask; x != 0; x &= x - 1 {
			ic := &m.ids[bits.TrailingZeros64(x)]
			ic.members.Store(0)
			ic.specs.Store(0)
			ic.prefix.Store(0)
		}
		m.storageIDs.And(^mask)
		m.engines.dropIDs(mask)
		m.reg.release(mask)
	}
	// The shards swept, the queues' due entries name memberships already dropped: they are
	// discarded without shard locks. Compacting drops the confirmed entries not yet due.
	for _, bs := range m.reg.active() {
		m.settleSpec(bs, c, true)
	}
	// Backends that hold nothing and sent nothing for an EntryTTL give their id back: a fleet
	// whose pods come and go under new names never runs out of ids.
	for _, bs := range m.reg.active() {
		if m.idle(bs, c.now) {
			m.retireIdle(bs, c.now)
		}
	}
}

// idle reports whether bs holds nothing and was last active an EntryTTL ago.
func (m *MemoryIndex) idle(bs *backendState, now uint32) bool {
	ic := &m.ids[bs.id]
	return ic.members.Load() == 0 && ic.prefix.Load() == 0 &&
		int32(now-bs.lastActive.Load()) >= int32(m.ttlTicks)
}

// retireIdle retires bs if it is still idle once no Apply or Speculate uses it.
func (m *MemoryIndex) retireIdle(bs *backendState, now uint32) {
	bs.life.Lock()
	if bs.retired || !m.idle(bs, now) || !m.reg.unlinkState(bs) {
		bs.life.Unlock()
		return
	}
	bs.retired = true
	bs.life.Unlock()
	bs.emu.Lock()
	bs.em = engineMap{}
	bs.emu.Unlock()
	bs.resetSpec()
}

func (m *MemoryIndex) sweepLoop(every time.Duration) {
	defer close(m.done)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-m.stop:
			return
		case <-t.C:
			m.sweep()
		}
	}
}

// Close stops the sweep goroutine and waits for it to return. Later calls of every method except
// Stats and Close return ErrClosed. Close is idempotent and always returns nil.
func (m *MemoryIndex) Close() error {
	m.closeOnce.Do(func() {
		m.closed.Store(true)
		if m.stop != nil {
			close(m.stop)
			<-m.done
		}
	})
	return nil
}

// LookupPrefix fills out[i] for candidates[i] from the prefix-granular entries of prefix
// (PrefixLookuper): Tokens is the entry's token count, Blocks Tokens / BlockSize, Score Tokens ×
// the weight of its tier; StoredTokens and StoredBlocks equal Tokens and Blocks for an entry on
// TierStorage. Candidates without a live entry get a zero Match. It takes one shard's
// read lock, allocates nothing, ignores ctx, and returns ErrClosed after Close. It panics if
// len(out) < len(candidates).
func (m *MemoryIndex) LookupPrefix(_ context.Context, prefix string, candidates []string, out []Match) ([]Match, error) {
	if m.closed.Load() {
		return out[:0], ErrClosed
	}
	out = out[:len(candidates)]
	m.lookups[rand.Uint32()%uint32(len(m.lookups))].n.Add(1)
	for i, name := range candidates {
		out[i] = Match{Backend: name}
	}
	if m.prefix.count.Load() == 0 {
		return out, nil
	}
	names := *m.reg.names.Load()
	c := m.clock()
	sh := m.prefix.shard(prefix)
	sh.mu.RLock()
	defer sh.mu.RUnlock()
	e := sh.m[prefix]
	if e == nil {
		return out, nil
	}
	for i, name := range candidates {
		bs := names[name]
		if bs == nil {
			continue
		}
		for _, h := range e.holders {
			if h.id != bs.id || int32(c.now-h.stamp) >= int32(c.ttlTick) {
				continue
			}
			out[i].Tokens = h.tokens
			out[i].Blocks = h.tokens / m.cfg.BlockSize
			out[i].WeightedBlocks = float64(h.tokens) * m.weights[h.tier]
			out[i].Tier = h.tier
			if h.tier == events.TierStorage {
				out[i].StoredTokens = h.tokens
				out[i].StoredBlocks = out[i].Blocks
			}
			break
		}
	}
	return out, nil
}

// Speculate records that backend will soon hold keys on the GPU tier (Speculator): each key it
// does not already hold becomes a speculative entry until ttl (SpeculativeTTL when ttl ≤ 0)
// passes, unless a BlockStored confirms it first. Speculative entries count in lookups like
// ordinary GPU entries. One expiry is kept per block: a backend speculating again on a block
// restarts its entry's TTL; when several backends speculate on one block, each entry lasts until
// the latest of their expiries. With ApproximateCapacityBlocks set, the backend's oldest
// speculative blocks (soonest to expire) beyond that cap are dropped.
//
// Each backend's speculative entries are queued in order of expiry, and each call drops from the
// table (and from the counters Stats reports) up to as many of the backend's expired entries as
// it wrote, plus a few: expired speculation leaves about as fast as it arrives; the table holds
// little more than the live speculation, and the queue little more than the entries queued
// within the last TTL (confirmed ones stay queued until due). Keys already held cost a lock-free
// read each; new ones a shard lock each, then, at their expiry, a lock-free read and, if still
// speculative, a shard lock. The backend's queue mutex is taken once per call that queues or
// finds an expired entry (and once per 64 queued entries). Once the queue has grown to its
// steady size, Speculate allocates nothing. It returns ErrClosed after Close, nil otherwise (a
// backend beyond MaxBackends is counted as dropped).
func (m *MemoryIndex) Speculate(_ context.Context, backend string, keys []uint64, ttl time.Duration) error {
	if m.closed.Load() {
		return ErrClosed
	}
	if len(keys) == 0 {
		return nil
	}
	bs := m.acquire(backend)
	if bs == nil {
		m.drop(DropTooManyBackends, 1)
		return nil
	}
	defer bs.life.RUnlock()
	exp := m.specTicks
	if ttl > 0 {
		exp = durTicks(min(ttl, MaxTTL))
	}
	c := m.clock()
	bs.lastActive.Store(c.now)
	exp += c.now
	bit := uint64(1) << bs.id
	// Entries to queue are batched, so that the queue's mutex is taken once per batch.
	var batch [specBatch]uint64
	nb, queued, added, written := 0, 0, 0, 0
	var parentH uint64
	for _, k := range keys {
		h := mix(k)
		ph := parentH
		parentH = h
		if m.heldConfirmed(h, bit, c) {
			continue
		}
		cc := c
		sh := m.lockShard(h, &cc)
		isNew, queue := m.speculate(sh, h, ph, bs.id, exp, cc)
		sh.mu.Unlock()
		written++
		if isNew {
			added++
		}
		if queue {
			batch[nb] = h
			if nb++; nb == len(batch) {
				bs.specMu.Lock()
				bs.queueSpec(batch[:nb], exp)
				bs.specMu.Unlock()
				queued += nb
				nb = 0
			}
		}
	}
	m.mut[MutationSpeculated].Add(uint64(added))
	if queued+nb == 0 && !bs.specDueAt(c.now) {
		return nil
	}
	bs.specMu.Lock()
	bs.queueSpec(batch[:nb], exp)
	// Each key written pays for one entry's expiry: its own, or the requeueing of an entry it
	// extended.
	m.expireSpecs(bs, c, written+specExpireSlack)
	if capBlocks := m.cfg.ApproximateCapacityBlocks; capBlocks > 0 {
		m.trimSpeculative(bs, capBlocks, c)
	}
	bs.noteSpecDue()
	bs.specMu.Unlock()
	return nil
}

const (
	// specBatch is the most entries Speculate queues at once.
	specBatch = 64
	// specExpireSlack is how many due entries Speculate expires beyond as many as it wrote:
	// enough to catch up with a backlog (a burst, a clock jump) in a few calls.
	specExpireSlack = 32
	// specCompactSlack is how far a backend's queue may outgrow twice its speculative entries
	// before the sweep compacts it.
	specCompactSlack = 1024
)

// queueSpec queues blocks hs (mixed) expiring at tick exp. Under bs.specMu.
func (bs *backendState) queueSpec(hs []uint64, exp uint32) {
	for _, h := range hs {
		bs.spec.push(h, exp)
	}
}

// noteSpecDue publishes the soonest expiry of bs's queue in specDue. Under bs.specMu.
func (bs *backendState) noteSpecDue() {
	if exp, ok := bs.spec.next(); ok {
		bs.specDue.Store(1<<32 | uint64(exp))
	} else {
		bs.specDue.Store(0)
	}
}

// specDueAt reports whether bs's queue may hold entries due at tick now.
func (bs *backendState) specDueAt(now uint32) bool {
	d := bs.specDue.Load()
	return d != 0 && int32(uint32(d)-now) <= 0
}

// resetSpec empties bs's queue.
func (bs *backendState) resetSpec() {
	bs.specMu.Lock()
	bs.spec = specQueue{}
	bs.specDue.Store(0)
	bs.specMu.Unlock()
}

// expireSpecs pops bs's queued entries that are due at c.now, at most budget of them (all when
// budget < 0). An entry whose block bs still speculates on is either expired — the membership is
// dropped under the shard lock, with the counters, as normalize drops it — or was extended since
// it was queued: it is queued again with the block's expiry. Other entries (confirmed, evicted,
// dropped, cleared) are discarded after a lock-free read. Every speculative membership of bs has
// a queued entry no later than its expiry (Speculate queues new memberships and shortened
// expiries; expiries otherwise only grow), so that once the due entries are popped, the
// counters hold no expired speculation of bs. Under bs.specMu and bs.life (shared), bs not
// retired.
//
// Due entries are taken a batch at a time, whose blocks are touched first, so that their cache
// misses overlap.
func (m *MemoryIndex) expireSpecs(bs *backendState, c clock, budget int) {
	q := &bs.spec
	bit := uint64(1) << bs.id
	var due [expireBatch]uint64
	for budget != 0 {
		n := 0
		for ; n < len(due) && budget != 0; budget-- {
			if exp, ok := q.next(); !ok || int32(exp-c.now) > 0 {
				break
			}
			due[n], _, _ = q.pop()
			n++
		}
		if n == 0 {
			break
		}
		m.touchBlocks(due[:n])
		for _, h := range due[:n] {
			v, ok := m.shardOf(h).read(h)
			if !ok || v.spec&bit == 0 {
				continue
			}
			if c.specLive(&v) {
				q.push(h, v.specExp())
				continue
			}
			cc := c
			sh := m.lockShard(h, &cc)
			exp, live := m.dropExpiredSpec(sh, h, bit, cc)
			sh.mu.Unlock()
			if live {
				q.push(h, exp)
			}
		}
		if n < len(due) {
			break
		}
	}
}

// expireBatch is how many due entries expireSpecs touches at once.
const expireBatch = 16

// touchBlocks loads the probe-array home slots of blocks hs (mixed), then the bodies they name,
// so that the cache misses of reading the blocks overlap.
func (m *MemoryIndex) touchBlocks(hs []uint64) {
	var touched uint64
	for _, h := range hs {
		t := m.shardOf(h).tab.Load()
		touched += t.keys[t.home(h)].Load()
	}
	for _, h := range hs {
		t := m.shardOf(h).tab.Load()
		if b := t.body(t.keys[t.home(h)].Load()); b.p != nil {
			touched += b.p.hx.Load()
		}
	}
	if touched == 1 {
		runtime.KeepAlive(touched) // keeps the prefetching loads
	}
}

// trimSpeculative drops bs's speculative blocks soonest to expire (the oldest, but for those
// extended since they were queued) until it has at most capBlocks. Under bs.specMu and bs.life
// (shared).
func (m *MemoryIndex) trimSpeculative(bs *backendState, capBlocks int, c clock) {
	ic := &m.ids[bs.id]
	for ic.specs.Load() > int64(capBlocks) {
		h, _, ok := bs.spec.pop()
		if !ok {
			break
		}
		cc := c
		sh := m.lockShard(h, &cc)
		m.unspeculate(sh, h, bs.id)
		sh.mu.Unlock()
	}
	// Entries whose speculation ended otherwise (confirmed, evicted) linger in the queue until
	// due; compact it when they outnumber the cap.
	if bs.spec.len() > 2*capBlocks+16 {
		m.compactSpec(bs)
	}
}

// compactSpec drops from bs's queue the entries of blocks bs no longer speculates on. Expired
// speculative entries stay: popping them fixes the counters. Under bs.specMu and bs.life
// (shared).
func (m *MemoryIndex) compactSpec(bs *backendState) {
	bit := uint64(1) << bs.id
	bs.spec.retain(func(h uint64) bool {
		v, ok := m.shardOf(h).read(h)
		return ok && v.spec&bit != 0
	})
}

// settleSpec expires every due entry of bs's queue, compacts the queue when compact and it holds
// more than twice bs's speculative entries (plus specCompactSlack), gives back the memory of a
// queue that has shrunk (Speculate never does, so that a queue's size swinging with the load
// does not reallocate on the request path), and returns the queue's bytes. It takes bs.life
// (shared) and bs.specMu; it does nothing for a retired bs.
func (m *MemoryIndex) settleSpec(bs *backendState, c clock, compact bool) int64 {
	bs.life.RLock()
	defer bs.life.RUnlock()
	if bs.retired {
		return 0
	}
	bs.specMu.Lock()
	defer bs.specMu.Unlock()
	m.expireSpecs(bs, c, -1)
	if compact && bs.spec.len() > 2*int(m.ids[bs.id].specs.Load())+specCompactSlack {
		m.compactSpec(bs)
	}
	bs.spec.shrink()
	bs.noteSpecDue()
	return bs.spec.bytes()
}

// Stats returns the index's counters and sizes (KvCacheIndex). Entries counts the live
// backends' (block, backend) memberships, speculative ones included, plus their prefix entries;
// PerBackend the same per backend; SpeculativeCount the speculative memberships; Blocks the
// table's blocks; MemoryBytes the bytes of the block table, the engine-hash maps, the
// speculative queues and an estimate for the prefix entries.
//
// Speculative counts are exact at the call: Stats first drops every expired speculative entry
// (see Speculate), so that SpeculativeCount, and the speculative part of Entries and
// PerBackend, count the memberships neither expired nor confirmed. Confirmed memberships and
// prefix entries past EntryTTL count as absent in lookups at once, but stay in the counts until
// the sweep (or a write to their block) removes them: Entries, PerBackend and Blocks (which also
// counts blocks whose holders were all cleared) are upper bounds by that much.
//
// It takes each backend's queue mutex, a shard lock per expired speculative entry, each
// backend's maps briefly and the prefix shards (shared). The error is always nil.
func (m *MemoryIndex) Stats(context.Context) (Stats, error) {
	active := m.reg.active()
	c := m.clock()
	var bytes int64
	for _, bs := range active {
		bytes += m.settleSpec(bs, c, false)
	}
	s := Stats{
		Backend:    "memory",
		Mutations:  make(map[string]uint64, NumMutations),
		Dropped:    make(map[string]uint64, NumDropReasons),
		PerBackend: map[string]int{},
		Evictions:  m.evictions.Load(),
		Expired:    m.expired.Load(),
	}
	for i := range m.lookups {
		s.Lookups += m.lookups[i].n.Load()
	}
	for i := range m.mut {
		s.Mutations[Mutation(i).String()] = m.mut[i].Load()
	}
	for i := range m.dropped {
		s.Dropped[DropReason(i).String()] = m.dropped[i].Load()
	}
	for i := range m.shards {
		sh := &m.shards[i]
		s.Blocks += int(sh.blocks.Load())
		t := sh.tab.Load()
		bytes += int64(len(t.keys))*8 + int64(len(t.chunks))*chunkSize*bodyBytes +
			int64(len(t.colds))*coldChunkSize*coldBytes
	}
	for name, bs := range active {
		ic := &m.ids[bs.id]
		n := int(ic.members.Load() + ic.prefix.Load())
		s.PerBackend[name] = n
		s.Entries += n
		s.SpeculativeCount += int(ic.specs.Load())
		bs.emu.Lock()
		bytes += bs.em.bytes()
		bs.emu.Unlock()
	}
	bytes += m.engines.bytes()
	s.PrefixCount = int(m.prefix.count.Load())
	s.MemoryBytes = bytes + m.prefixBytes()
	return s, nil
}

// Clear drops every entry of every backend (KvCacheIndex): blocks, speculative and prefix
// entries, engine-hash maps. It returns how many entries it dropped, counted as Stats.Entries
// counts them. Entries applied concurrently with Clear may survive it. It locks each shard in
// turn and returns ErrClosed after Close.
func (m *MemoryIndex) Clear(context.Context) (int, error) {
	if m.closed.Load() {
		return 0, ErrClosed
	}
	// The speculative queues are emptied before the shards: a speculative membership created
	// meanwhile is queued after, or cleared with its shard.
	for _, bs := range m.reg.active() {
		bs.resetSpec()
	}
	n := 0
	c := m.clock()
	for i := range m.shards {
		sh := &m.shards[i]
		sh.mu.Lock()
		c.retired = m.reg.retired.Load()
		n += m.clearShard(sh, c)
		sh.mu.Unlock()
	}
	n += m.clearPrefixes(m.reg.retired.Load())
	for _, bs := range m.reg.active() {
		bs.emu.Lock()
		bs.em = engineMap{}
		bs.emu.Unlock()
	}
	m.engines.clear()
	m.mut[MutationCleared].Add(1)
	return n, nil
}
