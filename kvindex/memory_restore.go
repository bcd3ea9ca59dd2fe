package kvindex

import (
	"context"
	"slices"
	"strings"
	"time"

	"github.com/kvroute/kvroute/events"
)

// This file holds the export and re-import of an index's confirmed state, for snapshots that a
// new or restarted router replica restores before it replays the events published since (package
// natsync/eventlog). A Dump lists what a backend holds, but not what the events to come build
// on: a BlockStored names its parent by the engine's block hash, and a BlockRemoved its blocks
// so, and only the engine-hash map turns those into block keys. The state records therefore
// carry, besides each block's key, tiers and expiry, its parent (for the refresh of ancestors)
// and every engine hash the backend's map knows, with the keys it stands for.

// StateKind says what a StateRecord describes.
type StateKind uint8

const (
	// StateBlock is a block the backend holds by confirmed entries: Key, Parent, Tiers, Expires.
	StateBlock StateKind = iota + 1
	// StateEngineHash is one engine block of the backend: Hash, the engine's block hash, and
	// Keys, the block keys it stands for in chain order (one per BlockSize tokens of the engine
	// block).
	StateEngineHash
	// StatePrefix is a prefix-granular entry: Prefix, Tokens, Tiers (one tier), Expires.
	StatePrefix
)

// String returns "block", "engine_hash", "prefix" or "unknown".
func (k StateKind) String() string {
	switch k {
	case StateBlock:
		return "block"
	case StateEngineHash:
		return "engine_hash"
	case StatePrefix:
		return "prefix"
	default:
		return "unknown"
	}
}

// TierSet is a set of tiers: bit t holds Tier(t). The zero value is the empty set.
type TierSet uint8

// TierSetOf returns the set of tiers; tiers past TierStorage count as TierStorage.
func TierSetOf(tiers ...Tier) TierSet {
	var s TierSet
	for _, t := range tiers {
		s |= 1 << min(t, events.TierStorage)
	}
	return s
}

// Has reports whether t is in s.
func (s TierSet) Has(t Tier) bool { return t < events.NumTiers && s&(1<<t) != 0 }

// Tiers returns the tiers of s, fastest first.
func (s TierSet) Tiers() []Tier { return tiersOf(uint8(s) & (1<<events.NumTiers - 1)) }

// StateRecord is one record of an index's exportable state (Exporter, Restorer). Which fields
// are meaningful depends on Kind (see StateKind). Keys is only valid during the call that
// passes the record: a Restorer does not keep it, and an Exporter reuses it.
type StateRecord struct {
	Kind StateKind
	// Key is a block's chained block key; Parent the key of the block before it in its chain (0
	// when it is the first, or unknown).
	Key, Parent uint64
	// Tiers are the tiers the backend holds the block on; a prefix entry has one.
	Tiers TierSet
	// Expires is when the entry expires unless an event refreshes it; zero means one EntryTTL
	// from the restore.
	Expires time.Time
	// Hash is an engine block hash, Keys the block keys it stands for, in chain order.
	Hash uint64
	Keys []uint64
	// Prefix is a prefix entry's prefix key (lowercase hex), Tokens its token count.
	Prefix string
	Tokens int
}

// Exporter lists an index's restorable state: what Restorer takes back.
//
// Export calls fn with every backend's records: for each backend, in order of name, its blocks,
// then its engine hashes, then its prefix entries. rec is reused between calls: fn copies what it
// keeps. It returns nil once it has listed everything, fn's first error (at which it stops),
// ctx.Err() when ctx ends first (checked between slices of the listing), or an error of the index
// (ErrClosed after Close). The listing is no snapshot: entries written while it runs may be
// listed or not, and each entry as it was at some moment of the call. A caller that replays the
// events applied since it started — from a sequence number it read before calling Export — gets
// back a faithful state, as every record is a value that a replayed event overwrites. It never
// calls fn with a lock held. Safe for concurrent use.
type Exporter interface {
	Export(ctx context.Context, fn func(backend string, rec *StateRecord) error) error
}

// Restorer takes back what an Exporter listed.
//
// Restore adds recs to backend's state: a block record makes the backend hold the block on its
// tiers until its Expires (merged with what the backend already holds: tiers are added, the later
// expiry kept), an engine-hash record maps the hash to its keys for the events to come, a prefix
// record sets the backend's prefix entry. Records already expired, and records of an unknown
// kind, are skipped. It clears nothing: call ClearBackend first to replace a backend's state. The
// error is ErrClosed after Close, ctx.Err() when ctx ends between records (some were restored),
// or an index's own failure; records it cannot place (too many backends) are counted in
// Stats().Dropped as Apply counts them. Safe for concurrent use; like Apply, one goroutine per
// backend at a time.
type Restorer interface {
	Restore(ctx context.Context, backend string, recs []StateRecord) error
}

// RestorerFunc adapts a function to Restorer.
type RestorerFunc func(ctx context.Context, backend string, recs []StateRecord) error

// Restore calls f(ctx, backend, recs).
func (f RestorerFunc) Restore(ctx context.Context, backend string, recs []StateRecord) error {
	return f(ctx, backend, recs)
}

var (
	_ Exporter = (*MemoryIndex)(nil)
	_ Restorer = (*MemoryIndex)(nil)
	_ Restorer = RestorerFunc(nil)
)

// BlockSize returns the number of tokens per block key: a snapshot restores into an index of the
// same block size only.
func (m *MemoryIndex) BlockSize() int { return m.cfg.BlockSize }

// exportBlock is a block Export found, copied out of its shard.
type exportBlock struct {
	h, parent uint64 // mixed keys; h without the flag bits
	tiers     uint8
	stamp     uint32
	low       uint64 // the flag bits of h when its shard gives them, else 4
}

// Export lists every backend's confirmed blocks, engine hashes and prefix entries (Exporter).
// Speculative entries are not listed: they are a replica's own predictions, seconds long.
//
// Blocks are read as Dump reads them, each shard under its lock dumpSlice blocks at a time;
// expiries are exact to the index's epochs (EntryTTL/64). The engine-hash map of a backend is
// copied under its mutex (16 bytes per entry; its entries in the shared map too, one shard lock
// at a time), which holds off that backend's Apply for the copy. A table of fewer than four
// shards (MaxEntries < 16,384) finds its block keys in the engine-hash maps and parent links (see
// Dump); a block found in neither is not listed.
func (m *MemoryIndex) Export(ctx context.Context, fn func(backend string, rec *StateRecord) error) error {
	if m.closed.Load() {
		return ErrClosed
	}
	active := m.reg.active()
	names := make([]string, 0, len(active))
	for name := range active {
		names = append(names, name)
	}
	slices.Sort(names)
	var rec StateRecord
	for _, name := range names {
		bs := active[name]
		if err := m.exportBackend(ctx, bs, &rec, fn); err != nil {
			return err
		}
	}
	return nil
}

// exportBackend lists bs's records.
func (m *MemoryIndex) exportBackend(ctx context.Context, bs *backendState, rec *StateRecord,
	fn func(string, *StateRecord) error) error {
	// The engine map first: a table of few shards needs it for keys, and the records come after
	// the blocks.
	slots := m.engineSlots(bs)

	var keys map[uint64]uint64 // few shards: mixed key without the flag bits → block key
	if len(m.shards) < minKeyedShards {
		keys = make(map[uint64]uint64, len(slots))
		for _, s := range slots {
			keys[mix(s.key)&^flagMask] = s.key
		}
	}
	bit := uint64(1) << bs.id
	var buf []exportBlock
	for i := range m.shards {
		if keys != nil {
			// Parent links name the full mixed key of blocks the map may have lost.
			m.exportParents(&m.shards[i], bit, keys)
		}
		for after := uint64(0); ; {
			if err := ctx.Err(); err != nil {
				return err
			}
			var more, gone bool
			var now time.Time
			buf, after, more, gone, now = m.exportShard(&m.shards[i], i, bs, bit, after, buf[:0])
			if gone {
				return nil // cleared meanwhile
			}
			c := m.clockAt(now)
			// The blocks come in key order: scattered, as the engine hashes below are, so that a
			// restore does not insert ascending keys.
			step := strideFor(len(buf))
			for i, j := 0, 0; i < len(buf); i, j = i+1, (j+step)%len(buf) {
				b := buf[j]
				key := unmix(b.h | b.low)
				if b.low > flagMask {
					k, ok := keys[b.h]
					if !ok {
						continue
					}
					key = k
				}
				*rec = StateRecord{Kind: StateBlock, Key: key, Tiers: TierSet(b.tiers),
					Expires: m.epochTime(now, c, b.stamp+c.ttl+1)}
				if b.parent != 0 {
					rec.Parent = unmix(b.parent)
				}
				if err := fn(bs.name, rec); err != nil {
					return err
				}
			}
			if !more {
				break
			}
		}
	}
	if err := m.exportEngineHashes(ctx, bs, slots, rec, fn); err != nil {
		return err
	}
	return m.exportPrefixes(bs, rec, fn)
}

// exportParents adds to keys the parents named by sh's blocks held by bit (tables of few shards).
func (m *MemoryIndex) exportParents(sh *shard, bit uint64, keys map[uint64]uint64) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	t := sh.tab.Load()
	for b := range t.bodies(sh.used) {
		if !b.live() {
			continue
		}
		v := b.load()
		if v.confirmed()&bit == 0 {
			continue
		}
		if p := v.parent; p != 0 {
			if _, ok := keys[p&^flagMask]; !ok {
				keys[p&^flagMask] = unmix(p)
			}
		}
	}
}

// exportShard copies, under sh's lock, bs's live confirmed blocks among the next dumpSlice
// blocks of sh after probe word after into buf. Same results as dumpShard.
func (m *MemoryIndex) exportShard(sh *shard, i int, bs *backendState, bit uint64, after uint64,
	buf []exportBlock) (_ []exportBlock, last uint64, more, gone bool, now time.Time) {
	low := m.lowBits(i)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if m.reg.retired.Load()&bit != 0 || m.reg.lookup(bs.name) != bs {
		return buf, after, false, true, now
	}
	now = m.cfg.Now()
	c := m.clockAt(now)
	t := sh.tab.Load()
	read := 0
	for w, b := range t.blocks(after) {
		if read == dumpSlice {
			return buf, after, true, false, now
		}
		read++
		after = w
		v := b.load()
		if v.confirmed()&bit == 0 || !c.fresh(&v) {
			continue
		}
		var tiers uint8
		for tier, holders := range v.tiers {
			if holders&bit != 0 {
				tiers |= 1 << tier
			}
		}
		buf = append(buf, exportBlock{h: fullKey(w, b), parent: v.parent, tiers: tiers, stamp: v.stamp(), low: low})
	}
	return buf, after, false, false, now
}

// exportEngineHashes lists the engine blocks of bs's map (slots, copied): an engine block of r
// keys has its hash's entry (the last key) and r−1 derived entries (see engineMap), told apart
// here by deriving from every entry.
func (m *MemoryIndex) exportEngineHashes(ctx context.Context, bs *backendState, slots []emSlot,
	rec *StateRecord, fn func(string, *StateRecord) error) error {
	byHash := make(map[uint64]uint64, len(slots))
	for _, s := range slots {
		byHash[s.h] = s.key
	}
	derived := make(map[uint64]struct{})
	for _, s := range slots {
		for j := 1; ; j++ {
			d := derive(s.h, j)
			if _, ok := byHash[d]; !ok {
				break
			}
			derived[d] = struct{}{}
		}
	}
	// The slots are in the map's order, ascending hashes: restored in that order, they would
	// fill the low end of the new map's hash range first, far denser than its load factor (long
	// runs, quadratic insertion). A stride coprime with their number lists them in a scattered
	// order.
	n := len(slots)
	step := strideFor(n)
	var keys []uint64
	for i, j := 0, 0; i < n; i, j = i+1, (j+step)%n {
		s := slots[j]
		if _, ok := derived[s.h]; ok {
			continue
		}
		if i%dumpSlice == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		keys = append(keys[:0], s.key)
		for j := 1; ; j++ {
			k, ok := byHash[derive(s.h, j)]
			if !ok {
				break
			}
			keys = append(keys, k)
		}
		slices.Reverse(keys) // chain order: the hash's own entry is the last key
		*rec = StateRecord{Kind: StateEngineHash, Hash: unmix(s.h), Keys: keys}
		if err := fn(bs.name, rec); err != nil {
			return err
		}
	}
	return nil
}

// strideFor returns a step coprime with n (1 for n ≤ 1): i ↦ i·step mod n visits 0..n−1 in a
// scattered order.
func strideFor(n int) int {
	if n <= 1 {
		return 1
	}
	step := int(0x9e3779b97f4a7c15%uint64(n)) | 1
	for gcd(step, n) != 1 {
		step += 2
	}
	return step
}

func gcd(a, b int) int {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

// exportPrefixes lists bs's live prefix entries, one prefix shard at a time.
func (m *MemoryIndex) exportPrefixes(bs *backendState, rec *StateRecord, fn func(string, *StateRecord) error) error {
	if m.prefix.count.Load() == 0 {
		return nil
	}
	var buf []StateRecord
	for i := range m.prefix.shards {
		sh := &m.prefix.shards[i]
		now := m.cfg.Now()
		c := m.clockAt(now)
		buf = buf[:0]
		sh.mu.RLock()
		for prefix, e := range sh.m {
			for _, h := range e.holders {
				if h.id == bs.id && int32(c.now-h.stamp) < int32(c.ttlTick) {
					buf = append(buf, StateRecord{Kind: StatePrefix, Prefix: prefix, Tokens: h.tokens,
						Tiers: TierSetOf(h.tier), Expires: m.tickTime(now, c, h.stamp+c.ttlTick)})
					break
				}
			}
		}
		sh.mu.RUnlock()
		if m.reg.lookup(bs.name) != bs {
			return nil // cleared meanwhile
		}
		for j := range buf {
			*rec = buf[j]
			if err := fn(bs.name, rec); err != nil {
				return err
			}
		}
	}
	return nil
}

// Restore adds recs to backend's state (Restorer). A block record is inserted by key with its
// tiers, its parent link, and an evidence epoch that makes it expire at its Expires (clamped to
// one EntryTTL from now; the index's epochs are EntryTTL/64 long); a block the backend already
// holds keeps the later of the two expiries, and a speculative entry of the backend is confirmed.
// An engine-hash record maps the hash to its keys, replacing an earlier mapping; a prefix record
// sets the backend's entry for the prefix, keeping the later expiry. Restored entries count in
// Stats like applied ones but not as mutations. ctx is checked every 1,024 records.
func (m *MemoryIndex) Restore(ctx context.Context, backend string, recs []StateRecord) error {
	if m.closed.Load() {
		return ErrClosed
	}
	if len(recs) == 0 {
		return nil
	}
	bs := m.acquire(backend)
	if bs == nil {
		m.drop(DropTooManyBackends, len(recs))
		return nil
	}
	defer bs.life.RUnlock()
	now := m.cfg.Now()
	c := m.clockAt(now)
	bs.lastActive.Store(c.now)
	bit := uint64(1) << bs.id
	for i := range recs {
		if i%1024 == 1023 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		r := &recs[i]
		switch r.Kind {
		case StateBlock:
			tiers := uint8(r.Tiers) & (1<<events.NumTiers - 1)
			if tiers == 0 {
				continue
			}
			stamp, ok := m.restoreEpoch(now, c, r.Expires)
			if !ok {
				continue
			}
			if tiers&(1<<events.TierStorage) != 0 && m.storageIDs.Load()&bit == 0 {
				m.storageIDs.Or(bit) // before the block is visible to lookups
			}
			var parentH uint64
			if r.Parent != 0 {
				parentH = mix(r.Parent)
			}
			h := mix(r.Key)
			cc := c
			sh := m.lockShard(h, &cc)
			m.restoreBlock(sh, h, parentH, bs.id, tiers, stamp, cc)
			sh.mu.Unlock()
		case StateEngineHash:
			if len(r.Keys) == 0 {
				continue
			}
			eh := mix(r.Hash)
			last := len(r.Keys) - 1
			bs.emu.Lock()
			bs.subKeys = max(bs.subKeys, len(r.Keys))
			m.enginePut(bs, eh, r.Keys[last], c)
			for j := 1; j <= last; j++ {
				m.enginePut(bs, derive(eh, j), r.Keys[last-j], c)
			}
			bs.emu.Unlock()
		case StatePrefix:
			if r.Prefix == "" {
				continue
			}
			m.restorePrefix(bs.id, r, now, c)
		}
	}
	return nil
}

// restoreEpoch returns the evidence epoch that makes a confirmed entry expire at exp (zero: one
// EntryTTL from now), clamped to the current epoch; ok is false when exp has passed.
func (m *MemoryIndex) restoreEpoch(now time.Time, c clock, exp time.Time) (stamp uint32, ok bool) {
	if exp.IsZero() {
		return c.epoch, true
	}
	if !exp.After(now) {
		return 0, false
	}
	if exp.Sub(now) >= m.cfg.EntryTTL {
		return c.epoch, true
	}
	// Dump and Export report the start of epoch stamp+ttl+1.
	d := int64(exp.Sub(m.epoch))
	e := d / m.epochNs
	if d < 0 && e*m.epochNs != d {
		e-- // floor
	}
	stamp = uint32(e) - c.ttl - 1
	if int32(stamp-c.epoch) > 0 {
		stamp = c.epoch
	}
	return stamp, c.fresh(&slotVal{times: uint64(stamp)})
}

// restoreBlock makes backend id hold block h (child of parentH, mixed; 0 when unknown) on tiers,
// with evidence epoch stamp or a later one it has. Under mu.
func (m *MemoryIndex) restoreBlock(sh *shard, h, parentH uint64, id uint8, tiers uint8, stamp uint32, c clock) {
	bit := uint64(1) << id
	t := sh.tab.Load()
	pos, b := t.find(h)
	if pos < 0 {
		v := slotVal{h: h, parent: parentH}
		for tier := range v.tiers {
			if tiers&(1<<tier) != 0 {
				v.tiers[tier] = bit
			}
		}
		v.setStamp(stamp)
		m.add(sh, v, c)
		m.ids[id].members.Add(1)
		return
	}
	v := b.load()
	if exp := m.normalize(&v, c); exp != 0 {
		m.expired.Add(uint64(exp))
	}
	isNew := (v.confirmed()|v.spec)&bit == 0
	if v.spec&bit != 0 {
		v.spec &^= bit // confirmed: an ordinary entry now
		m.ids[id].specs.Add(-1)
	}
	if v.confirmed() == 0 || int32(stamp-v.stamp()) > 0 {
		v.setStamp(stamp)
	}
	for tier := range v.tiers {
		if tiers&(1<<tier) != 0 {
			v.tiers[tier] |= bit
		}
	}
	if v.parent == 0 {
		v.parent = parentH
	}
	sh.put(b, v)
	if isNew {
		m.ids[id].members.Add(1)
	}
}

// restorePrefix sets backend id's entry for r.Prefix from r.
func (m *MemoryIndex) restorePrefix(id uint8, r *StateRecord, now time.Time, c clock) {
	if !r.Expires.IsZero() && !r.Expires.After(now) {
		return
	}
	stamp := c.now
	if !r.Expires.IsZero() {
		if d := r.Expires.Sub(now); d < m.cfg.EntryTTL {
			stamp = c.now - (c.ttlTick - durTicks(d))
		}
	}
	tier := events.TierGPU
	if ts := r.Tiers.Tiers(); len(ts) > 0 {
		tier = ts[len(ts)-1]
	}
	p := &m.prefix
	sh := p.shard(r.Prefix)
	sh.mu.RLock()
	_, exists := sh.m[r.Prefix]
	sh.mu.RUnlock()
	if !exists && int(p.count.Load()) >= m.cfg.MaxPrefixEntries {
		m.evictPrefixes(c.now)
	}
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.m[r.Prefix]
	if e == nil {
		e = &prefixEntry{stamp: stamp}
		sh.m[strings.Clone(r.Prefix)] = e
		p.count.Add(1)
	}
	if int32(stamp-e.stamp) > 0 {
		e.stamp = stamp
	}
	for i := range e.holders {
		h := &e.holders[i]
		if h.id == id {
			if int32(stamp-h.stamp) > 0 {
				h.tier, h.stamp, h.tokens = tier, stamp, max(r.Tokens, 0)
			}
			return
		}
	}
	e.holders = append(e.holders, prefixHolder{id: id, tier: tier, stamp: stamp, tokens: max(r.Tokens, 0)})
	m.ids[id].prefix.Add(1)
}
