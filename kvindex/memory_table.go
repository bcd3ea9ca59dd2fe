package kvindex

import (
	"math/bits"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/kvroute/kvroute/events"
)

// This file holds the block table of MemoryIndex: shards of ordered linear-probing hash tables
// keyed by the mixed block key, read under a seqlock and written under a mutex.
//
// Layout. A shard has a probe array of 8-byte words and a slab of 24-byte bodies. A word is a
// 40-bit fingerprint of the block's mixed key (its high bits) and the 24-bit index of the block's
// body. A body is a 16-byte pair that lookups read — the key's next 22 bits (which, with the
// fingerprint, confirm a match), the evidence epoch and the holders on the GPU tier (bit i =
// backend id i) — and a word that writers read: the parent's key. Probing walks dense words (a
// probe sequence stays within one or two cache lines) and then reads one pair: the holders of a
// block that only GPUs hold are two lines away. Blocks that need more — holders on the CPU or
// storage tier, or speculative holders — have a 32-byte cold part in another slab, which their
// body names (see pair). Bodies do not move: inserting or deleting shifts 8-byte words only, and
// a resize rebuilds only the probe array.
//
// Order. A word's home slot is a multiply-shift ("fastrange") of its high 32 bits, monotone in
// the word, and every run of occupied slots is kept sorted: the ordered hash table of O. Amble and
// D. E. Knuth ("Ordered hash tables", The Computer Journal 17(2), 1974), which is Robin Hood
// hashing with ties broken by key. A probe scans from the home slot while the words are smaller:
// one comparison per step, and a miss stops at the first larger word or an empty slot. Arrays do
// not wrap: probe sequences run into a pad past the last home slot, and an array whose pad fills
// up grows. Deletion shifts the following displaced words back (no tombstones). The occupied
// slots of an array are therefore sorted: scans that list blocks walk the array in key order.
//
// Sizing. Probe arrays are not powers of two: one grows by about a seventh when it would pass 7/8
// full, so that it stays between about 76% and 87.5% full once past its first growths. Bodies
// are allocated in chunks of 256, cold parts in chunks of 64, both reused through free lists.
//
// Concurrency. Writers hold shard.mu and bracket every mutation with two increments of shard.seq
// (odd while writing). Readers take no lock: they read seq, probe, read seq again, and retry when
// it changed or was odd. Every word is an atomic so that these optimistic reads are not data
// races (see storeWord). A resize, or a new chunk of bodies or cold parts, publishes a new table
// value with one pointer store inside a write bracket.

// pair is the part of a block's body that lookups read: 16 bytes, four per cache line. The low 32
// bits of hx hold two layout flags, bits 2–23 of the block's mixed key (the fingerprint of its
// probe word holds bits 24–63, and with four shards or more the shard gives bits 0–1 back, see
// MemoryIndex.shardOf), liveBit and a 7-bit fingerprint of an engine hash that stands for the
// block (see engineFP); its high 32 bits hold a tick (see clock). The flags say what g and the
// body's other word, pc, hold:
//
//   - neither: hx's tick is the evidence epoch, g the confirmed GPU holders and pc the parent's
//     key. The block needs nothing else: this is every block of an index fed by GPU events only.
//   - flagSpec: no backend has confirmed the block. hx's tick is the speculative expiry, g the
//     speculative holders, pc's low half the evidence epoch (the speculation that created the
//     block) and its high half the cold index + 1 of a cold part holding the parent's key, or 0
//     when the parent is unknown: every block of an index fed by Speculate only.
//   - flagCold: hx's tick is the evidence epoch, g the confirmed GPU holders, pc's low half the
//     speculative expiry and its high half the cold index + 1 of a cold part holding the CPU,
//     storage and speculative holders and the parent's key.
type pair struct {
	hx atomic.Uint64
	g  atomic.Uint64
}

// cold is the cold part of a block that needs one (see pair).
type cold struct {
	cpu     atomic.Uint64 // confirmed holders on the CPU tier
	storage atomic.Uint64 // confirmed holders on the storage tier
	spec    atomic.Uint64 // speculative holders (GPU tier) beside confirmed ones
	parent  atomic.Uint64 // mixed key of the block's parent; 0 when unknown
}

// The low 32 bits of pair.hx.
const (
	flagCold = 1
	flagSpec = 2
	flagMask = flagCold | flagSpec
	keyBits  = (1<<24 - 1) &^ flagMask // the bits of the mixed key a body holds
	liveBit  = 1 << 24                 // set in every live body: a free body's hx is 0
	fpShift  = 25                      // the engine-hash fingerprint: bits 25–31
)

// body is a handle on one block's body in a table value; p is nil for none. Writers take it from
// the shard's current table value, which names every cold part.
type body struct {
	p  *pair
	pc *atomic.Uint64
	t  *table
}

// Bodies come in chunks of chunkSize, cold parts in chunks of coldChunkSize.
const (
	chunkShift     = 8
	chunkSize      = 1 << chunkShift
	coldChunkShift = 6
	coldChunkSize  = 1 << coldChunkShift
	// maxBodies is the most bodies a shard can index: word indexes are 24 bits, 1-based. A
	// shard's limit is at most maxEntriesLimit/256 = 2²³ blocks.
	maxBodies = 1<<24 - 1
	idxMask   = 1<<24 - 1
)

// Compile-time check that a shard's blocks fit its word indexes.
const _ = uint(maxBodies - maxEntriesLimit/256)

// chunk holds chunkSize bodies: their pairs, then their pc words.
type chunk struct {
	p  [chunkSize]pair
	pc [chunkSize]atomic.Uint64
}

type coldChunk [coldChunkSize]cold

// table is one shard's published state: the probe array (n home slots + the pad), the body
// chunks and the cold chunks. All are shared by successive table values; a new value is
// published when one is replaced or a chunk is added.
type table struct {
	keys   []atomic.Uint64 // fingerprint<<24 | (body index + 1), sorted within runs; 0 = empty
	n      uint64
	chunks []*chunk
	colds  []*coldChunk
}

// tablePad is the number of slots past the last home slot; a probe array whose last run would
// need more grows instead.
func tablePad(n uint64) uint64 { return min(128, 8+n/8) }

// newKeys returns a probe array of n home slots (n ≥ 1).
func newKeys(n uint64) []atomic.Uint64 { return make([]atomic.Uint64, n+tablePad(n)) }

// home is the slot where the probe sequence of h (a mixed key, or a word) starts; monotone.
func (t *table) home(h uint64) uint64 {
	return ((h >> 32) * t.n) >> 32
}

// body returns the body of word w; its pair is nil when w names none (possible only in a torn
// read).
func (t *table) body(w uint64) body {
	return t.bodyAt(w&idxMask - 1)
}

// bodyAt returns body i; its pair is nil when there is none (possible only in a torn read).
func (t *table) bodyAt(i uint64) body {
	if c := i >> chunkShift; c < uint64(len(t.chunks)) {
		ch := t.chunks[c]
		return body{&ch.p[i&(chunkSize-1)], &ch.pc[i&(chunkSize-1)], t}
	}
	return body{}
}

// cold returns the cold part of reference r (cold index + 1), or nil when there is none (r = 0,
// or a torn read).
func (t *table) cold(r uint64) *cold {
	if c := (r - 1) >> coldChunkShift; c < uint64(len(t.colds)) {
		return &t.colds[c][(r-1)&(coldChunkSize-1)]
	}
	return nil
}

// sameKey reports whether a live body's hx holds h's bits. With the fingerprint of the word that
// named the body it identifies h but for the flag bits, which the shard gives back in tables of
// four shards or more; a smaller table takes two keys that differ in them alone, one pair in 2⁶²,
// for one block.
func sameKey(hx, h uint64) bool { return (hx^(h|liveBit))&(keyBits|liveBit) == 0 }

// fullKey returns the mixed key, flag bits cleared, of the block of word w and body b.
func fullKey(w uint64, b body) uint64 { return w&^idxMask | b.p.hx.Load()&keyBits }

// find returns the probe position and the body of h (≠ 0) in t, or -1 and no body. Safe under the
// seqlock (a torn read may give a wrong answer, which the reader discards) and under mu.
func (t *table) find(h uint64) (int, body) {
	keys := t.keys
	lo := h &^ idxMask // the smallest word with h's fingerprint
	for pos := t.home(h); pos < uint64(len(keys)); pos++ {
		w := keys[pos].Load()
		if w-1 < lo-1 { // occupied by a smaller fingerprint: keep going
			continue
		}
		// Empty, or the first word with a fingerprint ≥ h's: check the words with h's.
		for w>>24 == h>>24 {
			if b := t.body(w); b.p != nil && sameKey(b.p.hx.Load(), h) {
				return int(pos), b
			}
			if pos++; pos >= uint64(len(keys)) {
				break
			}
			w = keys[pos].Load()
		}
		return -1, body{}
	}
	return -1, body{}
}

// slotVal is a plain copy of a block's data, for writers. Its h has the flag bits cleared; a
// copy loaded from a body has only the bits the body holds (keyBits), which is all a write back
// needs.
type slotVal struct {
	h      uint64
	tiers  [events.NumTiers]uint64
	spec   uint64
	times  uint64 // lo: evidence epoch; hi: speculative expiry tick (meaningful when spec ≠ 0)
	parent uint64
	efp    uint8 // engineFP of the engine hash of the first backend that stored the block; 0: none
}

// live reports whether b is a block's body (not a free one).
func (b body) live() bool { return b.p.hx.Load()&liveBit != 0 }

// stamp returns the evidence epoch of b's block.
func (b body) stamp() uint32 {
	if hx := b.p.hx.Load(); hx&flagMask != flagSpec {
		return uint32(hx >> 32)
	}
	return uint32(b.pc.Load())
}

// load returns a copy of b's data. Under the seqlock a torn read may give garbage, which the
// reader discards.
func (b body) load() slotVal {
	hx, g, pc := b.p.hx.Load(), b.p.g.Load(), b.pc.Load()
	v := slotVal{h: hx & keyBits, efp: uint8(hx >> fpShift & 0x7f)}
	tick := hx >> 32
	switch hx & flagMask {
	case 0:
		v.tiers[events.TierGPU], v.parent, v.times = g, pc, tick
	case flagSpec:
		v.spec, v.times = g, tick<<32|pc&0xffffffff
		if c := b.t.cold(pc >> 32); c != nil {
			v.parent = c.parent.Load()
		}
	default:
		v.tiers[events.TierGPU], v.times = g, tick|pc<<32
		if c := b.t.cold(pc >> 32); c != nil {
			v.tiers[events.TierCPU] = c.cpu.Load()
			v.tiers[events.TierStorage] = c.storage.Load()
			v.spec = c.spec.Load()
			v.parent = c.parent.Load()
		}
	}
	return v
}

// layout returns the flags of v's body and whether it needs a cold part (see pair).
func (v *slotVal) layout() (flags uint64, needsCold bool) {
	switch {
	case v.tiers[events.TierCPU]|v.tiers[events.TierStorage] != 0 || v.spec != 0 && v.tiers[events.TierGPU] != 0:
		return flagCold, true
	case v.spec != 0:
		return flagSpec, v.parent != 0
	}
	return 0, false
}

// store writes v to b, using cold part ci (an index) when v needs one (ci is ignored otherwise).
// Writers call it under mu, inside a write bracket when b is published; b.t names ci.
func (b body) store(v *slotVal, ci uint64) {
	if v.tiers[events.TierCPU]|v.tiers[events.TierStorage]|v.spec == 0 {
		// GPU holders only: every block of an index fed by GPU events.
		storeWord(&b.p.hx, v.times<<32|uint64(v.efp&0x7f)<<fpShift|liveBit|v.h&keyBits)
		storeWord(&b.p.g, v.tiers[events.TierGPU])
		storeWord(b.pc, v.parent)
		return
	}
	flags, needsCold := v.layout()
	ref := uint64(0)
	if needsCold {
		ref = ci + 1
		c := b.t.cold(ref)
		storeWord(&c.cpu, v.tiers[events.TierCPU])
		storeWord(&c.storage, v.tiers[events.TierStorage])
		storeWord(&c.spec, v.spec)
		storeWord(&c.parent, v.parent)
	}
	epoch, specExp := v.times&0xffffffff, v.times>>32
	hx, g, pc := epoch<<32, v.tiers[events.TierGPU], v.parent
	switch flags {
	case flagSpec:
		hx, g, pc = specExp<<32, v.spec, ref<<32|epoch
	case flagCold:
		pc = ref<<32 | specExp
	}
	storeWord(&b.p.hx, hx|uint64(v.efp&0x7f)<<fpShift|liveBit|v.h&keyBits|flags)
	storeWord(&b.p.g, g)
	storeWord(b.pc, pc)
}

// coldIndex returns the index of b's cold part and true, or false when it has none. Under mu.
func (b body) coldIndex() (uint64, bool) {
	hx := b.p.hx.Load()
	if hx&liveBit == 0 || hx&flagMask == 0 {
		return 0, false
	}
	if r := b.pc.Load() >> 32; r != 0 {
		return r - 1, true
	}
	return 0, false
}

// confirmed returns the holders of v on any tier.
func (v *slotVal) confirmed() uint64 { return v.tiers[0] | v.tiers[1] | v.tiers[2] }

func (v *slotVal) stamp() uint32   { return uint32(v.times) }
func (v *slotVal) specExp() uint32 { return uint32(v.times >> 32) }
func (v *slotVal) setStamp(t uint32) {
	v.times = v.times&^0xffffffff | uint64(t)
}
func (v *slotVal) setSpecExp(t uint32) {
	v.times = v.times&0xffffffff | uint64(t)<<32
}

// insertWord places word w (absent) at its place in its run, shifting the larger words of the run
// right by one. It returns false, changing nothing, when the run would overflow the pad. Writers
// call it inside a write bracket when the array is published.
func (t *table) insertWord(w uint64) bool {
	keys := t.keys
	size := uint64(len(keys))
	pos := t.home(w)
	for pos < size {
		if k := keys[pos].Load(); k == 0 || k > w {
			break
		}
		pos++
	}
	e := pos
	for e < size && keys[e].Load() != 0 {
		e++
	}
	if e >= size {
		return false
	}
	for j := e; j > pos; j-- {
		storeWord(&keys[j], keys[j-1].Load())
	}
	storeWord(&keys[pos], w)
	return true
}

// removeWord deletes the word at pos and shifts the following displaced words back by one; it
// returns the deleted word.
func (t *table) removeWord(pos uint64) uint64 {
	keys := t.keys
	w := keys[pos].Load()
	size := uint64(len(keys))
	for {
		next := pos + 1
		if next == size {
			break
		}
		k := keys[next].Load()
		if k == 0 || t.home(k) == next {
			break
		}
		storeWord(&keys[pos], k)
		pos = next
	}
	storeWord(&keys[pos], 0)
	return w
}

// fillKeys places the words of old, in order, into t's empty probe array; it returns false when
// the last run overflows the pad.
func (t *table) fillKeys(old []atomic.Uint64) bool {
	next := uint64(0) // first free position
	size := uint64(len(t.keys))
	for i := range old {
		w := old[i].Load()
		if w == 0 {
			continue
		}
		pos := max(t.home(w), next)
		if pos >= size {
			return false
		}
		storeWord(&t.keys[pos], w)
		next = pos + 1
	}
	return true
}

// idCounters are the per-backend-id counts that table operations maintain.
type idCounters struct {
	members atomic.Int64 // (block, backend) memberships: confirmed on some tier, or speculative
	specs   atomic.Int64 // speculative memberships
	prefix  atomic.Int64 // prefix-granular entries
	_       [40]byte
}

// shard is one lock domain of the block table.
type shard struct {
	mu  sync.Mutex
	seq atomic.Uint64
	tab atomic.Pointer[table]

	// Under mu.
	count    int      // live blocks
	limit    int      // max live blocks (this shard's share of MaxEntries)
	used     uint32   // bodies handed out from the chunks (live or free)
	free     []uint32 // freed body indexes
	marks    []uint64 // a bitset of body indexes, for evict and sweepShard
	coldUsed uint32   // cold parts handed out from the cold chunks (live or free)
	coldFree []uint32 // freed cold indexes
	ages     []uint32

	blocks atomic.Int64 // = count, readable without mu
	_      [64]byte
}

func (sh *shard) begin() { sh.seq.Add(1) }
func (sh *shard) end()   { sh.seq.Add(1) }

// read returns a consistent copy of h's body (ok false when absent) without locking.
func (sh *shard) read(h uint64) (v slotVal, ok bool) {
	for spins := 0; ; spins++ {
		s1 := sh.seq.Load()
		if s1&1 == 0 {
			_, b := sh.tab.Load().find(h)
			if b.p != nil {
				v = b.load()
				v.h = h &^ flagMask
			}
			if sh.seq.Load() == s1 {
				return v, b.p != nil
			}
		}
		if spins&63 == 63 {
			runtime.Gosched()
		}
	}
}

// clock is what table operations need to judge expiry.
//
// Speculative expiries are in ticks (2²² ns). Confirmed entries carry an evidence epoch instead:
// epochs are EntryTTL/64 long, and an entry has expired once more than ttl (≈64) epochs have
// passed since its evidence, so it expires between EntryTTL and EntryTTL × 65/64 after it. The
// evidence of a block is its last store or the last store of a descendant on the same chain:
// storing a block refreshes its ancestors (see refreshAncestors), whose epoch therefore never
// trails a descendant's. Hot prefixes, which engines keep without re-announcing them, stay
// fresh while their continuations keep being stored; and expiry or eviction by age never cuts
// a chain in the middle.
type clock struct {
	now     uint32 // current tick
	epoch   uint32 // current epoch
	ttl     uint32 // EntryTTL in epochs
	ttlTick uint32 // EntryTTL in ticks (prefix entries, which keep exact stamps)
	retired uint64 // ids retired and not yet reclaimed: their bits are garbage
}

// fresh reports whether v's confirmed holders have not expired.
func (c clock) fresh(v *slotVal) bool { return int32(c.epoch-v.stamp()) <= int32(c.ttl) }

// specLive reports whether v's speculative holders have not expired.
func (c clock) specLive(v *slotVal) bool { return int32(v.specExp()-c.now) > 0 }

// normalize drops from v the holders that have expired or belong to retired ids, fixing the
// counters, and reports how many memberships expired.
func (m *MemoryIndex) normalize(v *slotVal, c clock) (expired int) {
	conf := v.confirmed()
	if conf != 0 && !c.fresh(v) {
		expired += bits.OnesCount64(conf &^ c.retired)
		m.decMembers(conf&^c.retired, 0)
		v.tiers = [events.NumTiers]uint64{}
		conf = 0
	}
	if v.spec != 0 && !c.specLive(v) {
		expired += bits.OnesCount64(v.spec &^ c.retired)
		m.decMembers(v.spec&^c.retired, v.spec&^c.retired)
		v.spec = 0
	}
	if r := (conf | v.spec) & c.retired; r != 0 {
		for i := range v.tiers {
			v.tiers[i] &^= r
		}
		v.spec &^= r
	}
	return expired
}

// decMembers decrements the membership count of every id in members and the speculative count of
// every id in specs.
func (m *MemoryIndex) decMembers(members, specs uint64) {
	for members != 0 {
		m.ids[bits.TrailingZeros64(members)].members.Add(-1)
		members &= members - 1
	}
	for specs != 0 {
		m.ids[bits.TrailingZeros64(specs)].specs.Add(-1)
		specs &= specs - 1
	}
}

// Table growth: a table grows by about a seventh when it would pass 7/8 full, so that it stays
// between about 76% and 87.5% full once past its first growths.
const (
	maxLoadNum = 7
	maxLoadDen = 8
)

func grownSize(n uint64) uint64 { return max(n+n/7, n+16) }

// ensureRoom makes room for one more block in sh: it evicts when the shard is at its limit and
// grows the probe array when it is too full. Under mu.
func (m *MemoryIndex) ensureRoom(sh *shard, c clock) {
	if sh.count >= sh.limit {
		m.evict(sh, c)
	}
	t := sh.tab.Load()
	if uint64(sh.count+1)*maxLoadDen > t.n*maxLoadNum {
		m.resize(sh, max(grownSize(t.n), uint64(sh.count+1)*maxLoadDen/maxLoadNum+1))
	}
}

// resize rebuilds sh's probe array with at least n home slots (more if its pad overflows). The
// bodies stay where they are. Under mu.
func (m *MemoryIndex) resize(sh *shard, n uint64) {
	old := sh.tab.Load()
	nt := &table{keys: newKeys(n), n: n, chunks: old.chunks, colds: old.colds}
	for !nt.fillKeys(old.keys) {
		n = grownSize(n)
		nt.keys, nt.n = newKeys(n), n
	}
	sh.publish(nt)
}

// maybeShrink rebuilds a sparse shard smaller: its probe array, and its bodies and cold parts
// when most are free (copying the live ones into new chunks, in probe order). Under mu.
func (m *MemoryIndex) maybeShrink(sh *shard) {
	t := sh.tab.Load()
	if t.n > 64 && uint64(sh.count)*4 < t.n {
		m.resize(sh, max(grownSize(uint64(sh.count)*maxLoadDen/maxLoadNum), 16))
		t = sh.tab.Load()
	}
	colds := int(sh.coldUsed) - len(sh.coldFree)
	if int(sh.used) <= 4*sh.count+chunkSize && int(sh.coldUsed) <= 4*colds+coldChunkSize {
		return
	}
	nt := &table{keys: newKeys(t.n), n: t.n, chunks: make([]*chunk, 0, (sh.count+chunkSize-1)/chunkSize),
		colds: make([]*coldChunk, 0, (colds+coldChunkSize-1)/coldChunkSize)}
	next, nextCold := uint32(0), uint32(0)
	for i := range t.keys {
		w := t.keys[i].Load()
		if w == 0 {
			continue
		}
		if next%chunkSize == 0 {
			nt.chunks = append(nt.chunks, new(chunk))
		}
		v := t.body(w).load()
		ci := uint64(0)
		if _, needsCold := v.layout(); needsCold {
			if nextCold%coldChunkSize == 0 {
				nt.colds = append(nt.colds, new(coldChunk))
			}
			ci = uint64(nextCold)
			nextCold++
		}
		nt.bodyAt(uint64(next)).store(&v, ci)
		next++
		storeWord(&nt.keys[i], w&^idxMask|uint64(next)) // same position: same order and home
	}
	sh.begin()
	sh.tab.Store(nt)
	sh.end()
	sh.used, sh.free = next, nil
	sh.coldUsed, sh.coldFree = nextCold, nil
}

// publish makes nt sh's table value, inside a write bracket. Under mu.
func (sh *shard) publish(nt *table) {
	sh.begin()
	sh.tab.Store(nt)
	sh.end()
}

// allocCold returns a free cold index, adding a cold chunk (and publishing a table value that has
// it) when none is free. Under mu, outside write brackets.
func (sh *shard) allocCold() uint64 {
	if n := len(sh.coldFree); n > 0 {
		ci := sh.coldFree[n-1]
		sh.coldFree = sh.coldFree[:n-1]
		return uint64(ci)
	}
	ci := sh.coldUsed
	sh.coldUsed++
	if t := sh.tab.Load(); int(ci>>coldChunkShift) == len(t.colds) {
		// Readers of the old value never see a body naming the new chunk (bodies are written in
		// brackets, which send them back here).
		sh.publish(&table{keys: t.keys, n: t.n, chunks: t.chunks, colds: append(t.colds, new(coldChunk))})
	}
	return uint64(ci)
}

// deleteAt removes the block at probe position pos inside a write bracket, and frees its body
// (whose key it zeroes: slab scans skip it) and its cold part. Under mu.
func (sh *shard) deleteAt(t *table, pos int) {
	sh.begin()
	w := t.removeWord(uint64(pos))
	b := t.body(w)
	ci, hasCold := b.coldIndex()
	storeWord(&b.p.hx, 0)
	sh.end()
	sh.free = append(sh.free, uint32(w&idxMask-1))
	if hasCold {
		sh.coldFree = append(sh.coldFree, uint32(ci))
	}
	sh.count--
	sh.blocks.Add(-1)
}

// put writes v to the body of b's block inside a write bracket, giving it a cold part or freeing
// its own as v needs. Under mu.
func (sh *shard) put(b body, v slotVal) {
	ci, had := b.coldIndex()
	_, need := v.layout()
	if need && !had {
		ci = sh.allocCold()
	}
	b.t = sh.tab.Load() // names ci
	sh.begin()
	b.store(&v, ci)
	sh.end()
	if had && !need {
		sh.coldFree = append(sh.coldFree, uint32(ci))
	}
}

// add inserts block v (absent from sh), making room first. Under mu.
func (m *MemoryIndex) add(sh *shard, v slotVal, c clock) {
	m.ensureRoom(sh, c)
	ci := uint64(0)
	if _, needsCold := v.layout(); needsCold {
		ci = sh.allocCold()
	}
	t := sh.tab.Load()
	var idx uint32
	if n := len(sh.free); n > 0 {
		idx, sh.free = sh.free[n-1], sh.free[:n-1]
	} else {
		idx = sh.used
		sh.used++
		if int(idx>>chunkShift) == len(t.chunks) {
			// A new chunk: publish a table value that has it. Readers of the old value never see
			// a word naming it (words are written in brackets, which send them back here).
			nt := &table{keys: t.keys, n: t.n, chunks: append(t.chunks, new(chunk)), colds: t.colds}
			sh.publish(nt)
			t = nt
		}
	}
	w := v.h&^idxMask | uint64(idx+1)
	b := t.bodyAt(uint64(idx))
	for {
		sh.begin()
		b.store(&v, ci)
		ok := t.insertWord(w)
		sh.end()
		if ok {
			break
		}
		m.resize(sh, grownSize(t.n))
		t = sh.tab.Load()
	}
	sh.count++
	sh.blocks.Add(1)
}

// addConfirmed records that backend id holds block h, child of block parent (mixed; 0 when
// unknown), on tier, stored under an engine hash of fingerprint efp (0: none). It returns whether
// the membership is new and, when the block was already held by other backends, whether the
// engine hash of the first that stored it has the same fingerprint (same = 1) or not (-1); else
// same is 0. Under mu.
func (m *MemoryIndex) addConfirmed(sh *shard, h, parent uint64, id uint8, tier events.Tier, efp uint8,
	c clock) (isNew bool, same int) {
	bit := uint64(1) << id
	t := sh.tab.Load()
	pos, b := t.find(h)
	if pos < 0 {
		v := slotVal{h: h, parent: parent, efp: efp}
		v.tiers[tier] = bit
		v.setStamp(c.epoch)
		m.add(sh, v, c)
		m.ids[id].members.Add(1)
		return true, 0
	}
	v := b.load()
	if exp := m.normalize(&v, c); exp != 0 {
		m.expired.Add(uint64(exp))
	}
	isNew = (v.confirmed()|v.spec)&bit == 0
	switch {
	case efp == 0:
	case v.efp == 0:
		v.efp = efp
	case isNew && v.confirmed() != 0:
		same = -1
		if v.efp == efp {
			same = 1
		}
	}
	if v.spec&bit != 0 {
		v.spec &^= bit // confirmed: an ordinary entry now
		m.ids[id].specs.Add(-1)
	}
	v.tiers[tier] |= bit
	v.setStamp(c.epoch)
	if parent != 0 {
		v.parent = parent
	}
	sh.put(b, v)
	if isNew {
		m.ids[id].members.Add(1)
	}
	return isNew, same
}

// refresh brings the evidence epoch of block h to c.epoch, as a descendant of it was just stored
// by the backends of bit: they hold it. If h had expired, only their memberships are revived. It
// returns h's parent, or 0 when the walk up the chain should stop: h absent, not held by bit, or
// already current. Under mu.
func (m *MemoryIndex) refresh(sh *shard, h, bit uint64, c clock) (parent uint64) {
	t := sh.tab.Load()
	pos, b := t.find(h)
	if pos < 0 {
		return 0
	}
	v := b.load()
	conf := v.confirmed()
	if conf&bit == 0 || int32(c.epoch-v.stamp()) <= 0 {
		return 0
	}
	if !c.fresh(&v) {
		// Expired, but the new evidence is about bit only: drop the others.
		others := conf &^ bit &^ c.retired
		m.decMembers(others, 0)
		m.expired.Add(uint64(bits.OnesCount64(others)))
		for i := range v.tiers {
			v.tiers[i] &= bit
		}
	}
	v.setStamp(c.epoch)
	sh.put(b, v)
	return v.parent
}

// removeTier drops backend id's membership of block h on tier. It returns whether id still holds
// the block on another tier. Under mu.
func (m *MemoryIndex) removeTier(sh *shard, h uint64, id uint8, tier events.Tier, c clock) (stillHeld bool) {
	bit := uint64(1) << id
	t := sh.tab.Load()
	pos, b := t.find(h)
	if pos < 0 {
		return false
	}
	v := b.load()
	if exp := m.normalize(&v, c); exp != 0 {
		m.expired.Add(uint64(exp))
	}
	had := v.confirmed()&bit != 0
	v.tiers[tier] &^= bit
	stillHeld = v.confirmed()&bit != 0
	if had && !stillHeld {
		m.ids[id].members.Add(-1)
	}
	if v.confirmed()|v.spec == 0 {
		sh.deleteAt(t, pos)
		return false
	}
	sh.put(b, v)
	return stillHeld
}

// speculate records that backend id will soon hold block h (child of parent, mixed), until tick
// exp. It returns whether the speculative membership is new, and whether the caller must queue
// (h, exp) on the backend's specQueue: the membership is new, or its expiry moved earlier (a
// sole speculator's shorter TTL), so that its queued entries would come too late. Under mu.
func (m *MemoryIndex) speculate(sh *shard, h, parent uint64, id uint8, exp uint32, c clock) (isNew, queue bool) {
	bit := uint64(1) << id
	t := sh.tab.Load()
	pos, b := t.find(h)
	if pos < 0 {
		v := slotVal{h: h, parent: parent, spec: bit}
		v.setStamp(c.epoch)
		v.setSpecExp(exp)
		m.add(sh, v, c)
		m.ids[id].members.Add(1)
		m.ids[id].specs.Add(1)
		return true, true
	}
	v := b.load()
	if e := m.normalize(&v, c); e != 0 {
		m.expired.Add(uint64(e))
	}
	conf := v.confirmed()
	if conf&bit != 0 {
		return false, false // already an ordinary entry
	}
	if conf == 0 && v.spec == 0 {
		v.setStamp(c.epoch)
	}
	if v.parent == 0 {
		v.parent = parent
	}
	isNew = v.spec&bit == 0
	old := v.specExp()
	v.spec |= bit
	if v.spec == bit || before(v.specExp(), exp) {
		v.setSpecExp(exp)
	}
	sh.put(b, v)
	if isNew {
		m.ids[id].members.Add(1)
		m.ids[id].specs.Add(1)
	}
	return isNew, isNew || before(v.specExp(), old)
}

// dropExpiredSpec drops the speculative membership of the backends of bit in block h if it has
// expired, with every other expired holder of h (normalize), and deletes h when nothing is left.
// When bit's speculation on h is live (extended since it was queued) it returns the block's
// speculative expiry and true. Under mu.
func (m *MemoryIndex) dropExpiredSpec(sh *shard, h, bit uint64, c clock) (exp uint32, live bool) {
	t := sh.tab.Load()
	pos, b := t.find(h)
	if pos < 0 {
		return 0, false
	}
	v := b.load()
	if v.spec&bit == 0 {
		return 0, false
	}
	if c.specLive(&v) {
		return v.specExp(), true
	}
	m.expired.Add(uint64(m.normalize(&v, c)))
	if v.confirmed()|v.spec == 0 {
		sh.deleteAt(t, pos)
	} else {
		sh.put(b, v)
	}
	return 0, false
}

// unspeculate drops backend id's speculative membership of h, if any. Under mu.
func (m *MemoryIndex) unspeculate(sh *shard, h uint64, id uint8) bool {
	bit := uint64(1) << id
	t := sh.tab.Load()
	pos, b := t.find(h)
	if pos < 0 {
		return false
	}
	v := b.load()
	if v.spec&bit == 0 {
		return false
	}
	v.spec &^= bit
	m.ids[id].members.Add(-1)
	m.ids[id].specs.Add(-1)
	if v.confirmed()|v.spec == 0 {
		sh.deleteAt(t, pos)
		return true
	}
	sh.put(b, v)
	return true
}

// evict removes the least recently stored eighth of sh (at least one block). Under mu.
//
// Recency is the slot's evidence epoch: the last store of the block or of a descendant, or the
// speculation that created a block no backend had confirmed. Since ancestors are at least as
// recent as their descendants, this evicts chains from their tails. One scan finds the age
// threshold of the oldest eighth by selection, a second collects them; the cost, O(limit) per
// limit/8 insertions, is O(1) amortised. The victims are marked in the slab, then deleted by a
// scan of the probe array.
func (m *MemoryIndex) evict(sh *shard, c clock) {
	t := sh.tab.Load()
	ages := sh.ages[:0]
	for b := range t.bodies(sh.used) {
		if b.live() {
			ages = append(ages, tickAge(c.epoch, b.stamp()))
		}
	}
	sh.ages = ages[:0]
	if len(ages) == 0 {
		return
	}
	k := min(max(1, sh.limit/8), len(ages))
	thr := kthLargest(ages, k) // the k-th largest age
	marks := sh.resetMarks()
	n, ties := 0, 0
	for i := uint64(0); i < uint64(sh.used) && n < k; i++ {
		b := t.bodyAt(i)
		if !b.live() {
			continue
		}
		switch a := tickAge(c.epoch, b.stamp()); {
		case a > thr:
		case a == thr && ties < k:
			ties++
		default:
			continue
		}
		marks[i/64] |= 1 << (i % 64)
		n++
	}
	sh.deleteMarked(marks, n, func(b body) {
		v := b.load()
		m.dropSlotCounts(&v, c)
		m.evictions.Add(1)
	})
}

// resetMarks returns sh's bitset of body indexes, sized for its slab and cleared. Under mu.
func (sh *shard) resetMarks() []uint64 {
	n := (int(sh.used) + 63) / 64
	if cap(sh.marks) < n {
		sh.marks = make([]uint64, n)
	}
	sh.marks = sh.marks[:n]
	clear(sh.marks)
	return sh.marks
}

// deleteMarked deletes the n blocks whose body indexes are set in marks, calling before on each
// body first. It finds their words by one scan of the probe array. Under mu.
func (sh *shard) deleteMarked(marks []uint64, n int, before func(body)) {
	t := sh.tab.Load()
	keys := t.keys
	for pos := 0; pos < len(keys) && n > 0; {
		w := keys[pos].Load()
		if i := w&idxMask - 1; w == 0 || marks[i/64]&(1<<(i%64)) == 0 {
			pos++
			continue
		}
		before(t.body(w))
		sh.deleteAt(t, pos) // shifts the next words back: pos is read again
		n--
	}
}

// blocks iterates over the words of t's probe array greater than after, in order (key order),
// with their bodies.
func (t *table) blocks(after uint64) func(yield func(uint64, body) bool) {
	return func(yield func(uint64, body) bool) {
		for pos := t.home(after); pos < uint64(len(t.keys)); pos++ {
			if w := t.keys[pos].Load(); w > after && !yield(w, t.body(w)) {
				return
			}
		}
	}
}

// bodies iterates over the first used bodies of t's slab in memory order (freed ones are not
// live).
func (t *table) bodies(used uint32) func(yield func(body) bool) {
	return func(yield func(body) bool) {
		for i := range used {
			if !yield(t.bodyAt(uint64(i))) {
				return
			}
		}
	}
}

// dropSlotCounts adjusts the counters for the removal of every membership of v.
func (m *MemoryIndex) dropSlotCounts(v *slotVal, c clock) {
	live := (v.confirmed() | v.spec) &^ c.retired
	m.decMembers(live, v.spec&^c.retired)
}

// kthLargest returns the k-th largest value of a (1 ≤ k ≤ len(a)), reordering a.
func kthLargest(a []uint32, k int) uint32 {
	// Quickselect (Hoare partition, median-of-three pivot) for descending order.
	lo, hi := 0, len(a)-1
	want := k - 1
	for lo < hi {
		mid := lo + (hi-lo)/2
		p := median3(a[lo], a[mid], a[hi])
		i, j := lo, hi
		for i <= j {
			for a[i] > p {
				i++
			}
			for a[j] < p {
				j--
			}
			if i <= j {
				a[i], a[j] = a[j], a[i]
				i++
				j--
			}
		}
		switch {
		case want <= j:
			hi = j
		case want >= i:
			lo = i
		default:
			return a[want]
		}
	}
	return a[want]
}

func median3(a, b, c uint32) uint32 {
	s := [3]uint32{a, b, c}
	slices.Sort(s[:])
	return s[1]
}

// sweepShard drops the expired and retired holders of every block of sh and deletes the blocks
// left empty. It returns the number of expired memberships. Under mu.
func (m *MemoryIndex) sweepShard(sh *shard, c clock) (expired int) {
	t := sh.tab.Load()
	marks := sh.resetMarks()
	n := 0
	for i := range uint64(sh.used) {
		b := t.bodyAt(i)
		if !b.live() {
			continue
		}
		v := b.load()
		before := v
		expired += m.normalize(&v, c)
		if v == before {
			continue
		}
		if v.confirmed()|v.spec == 0 {
			marks[i/64] |= 1 << (i % 64)
			n++
			continue
		}
		sh.put(b, v)
	}
	sh.deleteMarked(marks, n, func(body) {})
	m.maybeShrink(sh)
	return expired
}

// clearShard empties sh, fixing the counters, and returns the memberships it held (retired ids
// excluded). Under mu.
func (m *MemoryIndex) clearShard(sh *shard, c clock) int {
	t := sh.tab.Load()
	n := 0
	for b := range t.bodies(sh.used) {
		if !b.live() {
			continue
		}
		v := b.load()
		n += bits.OnesCount64((v.confirmed() | v.spec) &^ c.retired)
		m.dropSlotCounts(&v, c)
	}
	sh.publish(emptyTable())
	sh.count, sh.used, sh.free = 0, 0, nil
	sh.coldUsed, sh.coldFree = 0, nil
	sh.blocks.Store(0)
	return n
}

// emptyTable returns the table of an empty shard.
func emptyTable() *table { return &table{keys: newKeys(8), n: 8} }
