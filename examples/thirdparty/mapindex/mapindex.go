package mapindex

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
)

// ErrInvalidConfig is wrapped by New's errors.
var ErrInvalidConfig = errors.New("mapindex: invalid config")

// Config configures an Index. The zero value means kvindex's defaults.
type Config struct {
	// BlockSize is the tokens per block key; 0 means kvindex.DefaultBlockSize. Requests' keys must
	// be computed with the same size (KVConfig.BlockSize).
	BlockSize int
	// DefaultModel roots the keys of a BlockStored whose event names no LoRA and whose batch no model.
	DefaultModel string
	// EntryTTL is how long a block or prefix entry is held after its last event; 0 means
	// kvindex.DefaultEntryTTL.
	EntryTTL time.Duration
	// SpeculativeTTL is the lifetime of a speculative entry Speculate is given no TTL for; 0 means
	// kvindex.DefaultSpeculativeTTL.
	SpeculativeTTL time.Duration
	// TierWeights weigh a cached block by its tier; the zero value means kvindex.DefaultTierWeights.
	TierWeights kvindex.TierWeights
	// StorageOffloading and TreatEvictionAsOffload choose what cache_offloaded and cache_evicted do
	// to a prefix entry (kvindex.PrefixRule).
	StorageOffloading      bool
	TreatEvictionAsOffload bool
	// Now is the index's clock; nil means time.Now.
	Now func() time.Time
}

// Index is a kvindex.KvCacheIndex in Go maps (see the package doc). It is safe for concurrent use;
// its methods never block on anything but its own lock, ignore their ctx and return no error. Make
// one with New.
type Index struct {
	cfg Config

	mu        sync.RWMutex
	backends  map[string]*backend
	mutations [kvindex.NumMutations]uint64
	dropped   [kvindex.NumDropReasons]uint64
	expired   uint64
	scratch   []uint64

	lookups atomic.Uint64
}

// backend is what the index holds of one backend.
type backend struct {
	blocks   map[uint64]block       // index key → membership
	engine   map[uint64]engineBlock // engine hash → its index keys and parent
	prefixes map[string]prefixEntry // lowercase hex prefix key → entry
}

// engineBlock is what an engine hash stands for on one backend.
type engineBlock struct {
	keys      []uint64 // the index keys of the engine block, in order
	parent    uint64   // the engine hash of the block before it
	hasParent bool
}

// block is one backend's membership of one index block.
type block struct {
	tiers     uint8 // bit t: stored on tier t by an event
	expires   int64 // the stored tiers are held until then (Unix ns)
	specUntil int64 // a speculative entry is held until then (Unix ns); 0: none
}

type prefixEntry struct {
	tier    kvindex.Tier
	tokens  int
	expires int64
}

var _ kvindex.KvCacheIndex = (*Index)(nil)

// New validates cfg, applies its defaults and returns an empty Index. The error wraps
// ErrInvalidConfig for a negative size or TTL, or a negative or non-finite tier weight.
func New(cfg Config) (*Index, error) {
	if cfg.BlockSize < 0 || cfg.EntryTTL < 0 || cfg.SpeculativeTTL < 0 {
		return nil, fmt.Errorf("%w: negative BlockSize or TTL", ErrInvalidConfig)
	}
	for _, w := range cfg.TierWeights {
		if !(w >= 0) || w > 1e300 {
			return nil, fmt.Errorf("%w: tier weights %v", ErrInvalidConfig, cfg.TierWeights)
		}
	}
	if cfg.BlockSize == 0 {
		cfg.BlockSize = kvindex.DefaultBlockSize
	}
	if cfg.EntryTTL == 0 {
		cfg.EntryTTL = kvindex.DefaultEntryTTL
	}
	if cfg.SpeculativeTTL == 0 {
		cfg.SpeculativeTTL = kvindex.DefaultSpeculativeTTL
	}
	if cfg.TierWeights == (kvindex.TierWeights{}) {
		cfg.TierWeights = kvindex.DefaultTierWeights()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Index{cfg: cfg, backends: map[string]*backend{}}, nil
}

// live reports whether the membership holds at now, and its best tier and whether it is on storage.
func (b block) live(now int64) (ok bool, best kvindex.Tier, stored bool) {
	stuck := b.tiers != 0 && now < b.expires
	spec := now < b.specUntil
	switch {
	case stuck:
		best = kvindex.Tier(bits.TrailingZeros8(b.tiers))
		if spec {
			best = events.TierGPU // a speculative entry is a GPU one
		}
		return true, best, b.tiers&(1<<events.TierStorage) != 0
	case spec:
		return true, events.TierGPU, false
	}
	return false, 0, false
}

// confirmed reports whether an event stored the block and it has not expired.
func (b block) confirmed(now int64) bool { return b.tiers != 0 && now < b.expires }

func (x *Index) backend(name string) *backend {
	b := x.backends[name]
	if b == nil {
		b = &backend{blocks: map[uint64]block{}, engine: map[uint64]engineBlock{}, prefixes: map[string]prefixEntry{}}
		x.backends[name] = b
	}
	return b
}

// Apply implements events.Sink: it applies b's events in order, as kvindex's rules say, counting
// what it skips in Stats.Dropped. It keeps no reference to b.
func (x *Index) Apply(_ context.Context, name string, b *events.Batch) error {
	now := x.cfg.Now().UnixNano()
	x.mu.Lock()
	defer x.mu.Unlock()
	for i := range b.Events {
		ev := &b.Events[i]
		switch ev.Kind {
		case events.KindBlockStored:
			x.stored(name, b.Model, ev, now)
		case events.KindBlockRemoved:
			if ev.GroupIdx != 0 {
				x.dropped[kvindex.DropGroup]++
				continue
			}
			x.removed(name, ev)
		case events.KindAllBlocksCleared:
			x.clearBackend(name)
		case events.KindPrefix:
			x.prefix(name, ev, now)
		default:
			x.dropped[kvindex.DropUnknownKind]++
		}
	}
	return nil
}

// stored applies a BlockStored event. x.mu is held.
func (x *Index) stored(name, model string, ev *events.Event, now int64) {
	perBlock, reason, ok := kvindex.CheckStored(ev, x.cfg.BlockSize)
	if !ok {
		x.dropped[reason]++
		return
	}
	tier := kvindex.EventTier(ev.Tier)
	expires := now + int64(x.cfg.EntryTTL)
	be := x.backend(name)
	if perBlock == 0 { // no tokens: another tier for blocks the backend stored before
		for _, h := range ev.BlockHashes {
			eb, ok := be.engine[h]
			if !ok {
				x.dropped[kvindex.DropUnknownBlock]++
				continue
			}
			keys := eb.keys
			for _, k := range keys {
				bl := be.blocks[k]
				bl.tiers |= 1 << tier
				bl.expires = expires
				be.blocks[k] = bl
			}
			x.mutations[kvindex.MutationStored] += uint64(len(keys))
		}
		return
	}
	parent := kvindex.StoredRoot(ev, model, x.cfg.DefaultModel)
	if ev.HasParent {
		eb, ok := be.engine[ev.Parent]
		if !ok {
			x.dropped[kvindex.DropUnknownParent]++
			return
		}
		parent = eb.keys[len(eb.keys)-1]
		// An engine that stores a child holds its whole chain: the ancestors are fresh again.
		x.refresh(be, ev.Parent, expires)
	}
	x.scratch = kvindex.AppendStoredKeys(x.scratch[:0], ev, parent, x.cfg.BlockSize, perBlock)
	for i, h := range ev.BlockHashes {
		eb := engineBlock{keys: append([]uint64(nil), x.scratch[i*perBlock:(i+1)*perBlock]...), parent: ev.Parent, hasParent: ev.HasParent}
		if i > 0 {
			eb.parent, eb.hasParent = ev.BlockHashes[i-1], true
		}
		be.engine[h] = eb
	}
	for _, k := range x.scratch {
		bl := be.blocks[k]
		if !bl.confirmed(now) {
			bl.tiers = 0 // tiers of an expired membership are stale
		}
		bl.tiers |= 1 << tier
		bl.expires = expires
		bl.specUntil = 0 // confirmed: an ordinary entry now
		be.blocks[k] = bl
	}
	x.mutations[kvindex.MutationStored] += uint64(len(x.scratch))
}

// refresh holds the blocks of engine hash h and its ancestors until expires, walking up until an
// ancestor already is (its own ancestors then are too: every store refreshes the whole chain) or
// is unknown. x.mu is held.
func (x *Index) refresh(be *backend, h uint64, expires int64) {
	for {
		eb, ok := be.engine[h]
		if !ok {
			return
		}
		current := true
		for _, k := range eb.keys {
			if bl, ok := be.blocks[k]; ok && bl.tiers != 0 && bl.expires < expires {
				bl.expires, current = expires, false
				be.blocks[k] = bl
			}
		}
		if current || !eb.hasParent {
			return
		}
		h = eb.parent
	}
}

// removed applies a BlockRemoved event of group 0. x.mu is held.
func (x *Index) removed(name string, ev *events.Event) {
	tier := kvindex.EventTier(ev.Tier)
	be := x.backends[name]
	for _, h := range ev.BlockHashes {
		var keys []uint64
		if be != nil {
			keys = be.engine[h].keys
		}
		if keys == nil {
			x.dropped[kvindex.DropUnknownBlock]++
			continue
		}
		held := false
		for _, k := range keys {
			bl, ok := be.blocks[k]
			if !ok {
				continue
			}
			if bl.tiers&(1<<tier) != 0 {
				bl.tiers &^= 1 << tier
				x.mutations[kvindex.MutationRemoved]++
			}
			if tier == events.TierGPU {
				bl.specUntil = 0 // the engine freed it: no prediction stands either
			}
			if bl.tiers == 0 && bl.specUntil == 0 {
				delete(be.blocks, k)
			} else {
				be.blocks[k] = bl
			}
			held = held || bl.tiers != 0
		}
		if !held { // on no tier any more: forgotten, with its engine hash
			delete(be.engine, h)
		}
	}
}

// prefix applies a prefix-granular event. x.mu is held.
func (x *Index) prefix(name string, ev *events.Event, now int64) {
	c, ok := kvindex.PrefixRule(ev.PrefixOp, x.cfg.StorageOffloading, x.cfg.TreatEvictionAsOffload)
	if !ok || ev.PrefixHash == "" {
		x.dropped[kvindex.DropBadPrefix]++
		return
	}
	x.mutations[c.Mutation]++
	h := strings.ToLower(ev.PrefixHash)
	be := x.backend(name)
	if c.Remove {
		delete(be.prefixes, h)
		return
	}
	e, had := be.prefixes[h]
	tokens := ev.TokenCount
	if tokens <= 0 {
		if !had || now >= e.expires {
			return // no count to keep: nothing to create
		}
		tokens = e.tokens
	}
	be.prefixes[h] = prefixEntry{tier: c.Tier, tokens: tokens, expires: now + int64(x.cfg.EntryTTL)}
}

// ClearBackend implements events.Sink: it forgets everything the index holds of the backend, its
// engine hashes included.
func (x *Index) ClearBackend(_ context.Context, name string) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.clearBackend(name)
	return nil
}

func (x *Index) clearBackend(name string) {
	delete(x.backends, name)
	x.mutations[kvindex.MutationCleared]++
}

// Lookup implements kvindex.Lookuper: for each candidate, the longest run of keys from the first
// that the backend holds, its tier-weighted score, its slowest tier and the part of it held on
// storage. out is grown when shorter than candidates.
func (x *Index) Lookup(_ context.Context, keys []uint64, candidates []string, out []kvindex.Match) ([]kvindex.Match, error) {
	if cap(out) < len(candidates) {
		out = make([]kvindex.Match, len(candidates))
	}
	out = out[:len(candidates)]
	now := x.cfg.Now().UnixNano()
	x.lookups.Add(1)
	x.mu.RLock()
	defer x.mu.RUnlock()
	for i, c := range candidates {
		m := kvindex.Match{Backend: c}
		if be := x.backends[c]; be != nil {
			onStorage := true
			for _, k := range keys {
				ok, best, stored := be.blocks[k].live(now)
				if !ok {
					break
				}
				m.Blocks++
				m.WeightedBlocks += x.cfg.TierWeights[best]
				m.Tier = max(m.Tier, best)
				if onStorage = onStorage && stored; onStorage {
					m.StoredBlocks++
				}
			}
			m.Tokens, m.StoredTokens = m.Blocks*x.cfg.BlockSize, m.StoredBlocks*x.cfg.BlockSize
		}
		out[i] = m
	}
	return out, nil
}

// LookupPrefix implements kvindex.PrefixLookuper: each candidate's entry for prefix, with Tokens
// its token count, Blocks Tokens / BlockSize and Score Tokens × its tier's weight.
func (x *Index) LookupPrefix(_ context.Context, prefix string, candidates []string, out []kvindex.Match) ([]kvindex.Match, error) {
	if cap(out) < len(candidates) {
		out = make([]kvindex.Match, len(candidates))
	}
	out = out[:len(candidates)]
	h := strings.ToLower(prefix)
	now := x.cfg.Now().UnixNano()
	x.lookups.Add(1)
	x.mu.RLock()
	defer x.mu.RUnlock()
	for i, c := range candidates {
		m := kvindex.Match{Backend: c}
		if be := x.backends[c]; be != nil {
			if e, ok := be.prefixes[h]; ok && now < e.expires {
				m.Tokens, m.Blocks, m.Tier = e.tokens, e.tokens/x.cfg.BlockSize, e.tier
				m.WeightedBlocks = float64(e.tokens) * x.cfg.TierWeights[e.tier]
				if e.tier == events.TierStorage {
					m.StoredTokens, m.StoredBlocks = m.Tokens, m.Blocks
				}
			}
		}
		out[i] = m
	}
	return out, nil
}

// Speculate implements kvindex.Speculator: the backend holds keys on the GPU tier for ttl
// (SpeculativeTTL when ttl ≤ 0), unless an event stores them first.
func (x *Index) Speculate(_ context.Context, name string, keys []uint64, ttl time.Duration) error {
	if ttl <= 0 {
		ttl = x.cfg.SpeculativeTTL
	}
	until := x.cfg.Now().Add(ttl).UnixNano()
	x.mu.Lock()
	defer x.mu.Unlock()
	be := x.backend(name)
	for _, k := range keys {
		bl := be.blocks[k]
		bl.specUntil = max(bl.specUntil, until)
		be.blocks[k] = bl
	}
	x.mutations[kvindex.MutationSpeculated] += uint64(len(keys))
	return nil
}

// Stats implements kvindex.KvCacheIndex with Backend "map": live memberships and prefix entries,
// distinct blocks, speculative memberships not yet confirmed, per-backend entries, lookups, the
// entries Sweep removed as Expired, and the Mutations and Dropped counters.
func (x *Index) Stats(context.Context) (kvindex.Stats, error) {
	now := x.cfg.Now().UnixNano()
	s := kvindex.Stats{Backend: "map", Lookups: x.lookups.Load(), PerBackend: map[string]int{},
		Mutations: map[string]uint64{}, Dropped: map[string]uint64{}}
	distinct := map[uint64]struct{}{}
	x.mu.RLock()
	defer x.mu.RUnlock()
	for name, be := range x.backends {
		n := 0
		for k, bl := range be.blocks {
			if ok, _, _ := bl.live(now); ok {
				n++
				distinct[k] = struct{}{}
				if !bl.confirmed(now) {
					s.SpeculativeCount++
				}
			}
		}
		for _, e := range be.prefixes {
			if now < e.expires {
				n++
				s.PrefixCount++
			}
		}
		s.Entries += n
		s.PerBackend[name] = n
	}
	s.Blocks = len(distinct)
	s.Expired = x.expired
	for m := range kvindex.NumMutations {
		s.Mutations[m.String()] = x.mutations[m]
	}
	for r := range kvindex.NumDropReasons {
		s.Dropped[r.String()] = x.dropped[r]
	}
	return s, nil
}

// Clear implements kvindex.KvCacheIndex: it drops every backend's entries and engine hashes and
// returns the live entries it dropped (Stats.Entries before it).
func (x *Index) Clear(context.Context) (int, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	now := x.cfg.Now().UnixNano()
	n := 0
	for _, be := range x.backends {
		for _, bl := range be.blocks {
			if ok, _, _ := bl.live(now); ok {
				n++
			}
		}
		for _, e := range be.prefixes {
			if now < e.expires {
				n++
			}
		}
	}
	clear(x.backends)
	x.mutations[kvindex.MutationCleared]++
	return n, nil
}

// Sweep removes the entries that have expired, the engine hashes whose blocks are all gone, and
// backends left empty, and returns how many memberships and prefix entries it removed (counted in
// Stats.Expired). The index calls it never: its owner does, every minute or so.
func (x *Index) Sweep() int {
	now := x.cfg.Now().UnixNano()
	x.mu.Lock()
	defer x.mu.Unlock()
	n := 0
	for name, be := range x.backends {
		for k, bl := range be.blocks {
			if ok, _, _ := bl.live(now); !ok {
				delete(be.blocks, k)
				n++
			}
		}
		for h, eb := range be.engine {
			held := false
			for _, k := range eb.keys {
				if _, ok := be.blocks[k]; ok {
					held = true
					break
				}
			}
			if !held {
				delete(be.engine, h)
			}
		}
		for h, e := range be.prefixes {
			if now >= e.expires {
				delete(be.prefixes, h)
				n++
			}
		}
		if len(be.blocks) == 0 && len(be.engine) == 0 && len(be.prefixes) == 0 {
			delete(x.backends, name)
		}
	}
	x.expired += uint64(n)
	return n
}
