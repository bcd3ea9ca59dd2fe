package kvindex

import (
	"math/bits"
	"sync"
)

// This file holds the engine-hash map that backends share when their engines report the same
// block hash for the same block.
//
// vLLM hashes a block from its parent's hash, its tokens and its extra keys, the first block's
// parent being a root drawn from PYTHONHASHSEED: engines started with the same seed (as llm-d
// requires for its own hashing) report the same hash for the same block of a model, and each
// backend's own engine-hash map repeats those of the other backends that hold the same blocks.
// The shared map keeps one entry per (engine hash, block key) for all the backends that map that
// hash to that key, with the set of those backends: 24 bytes for a block however many backends
// hold it under one hash, instead of 16 bytes per backend. A hash that one backend alone maps
// costs 16 bytes, as in a backend's own map.
//
// Exactness does not depend on the engines' seeds: an entry names the backends it stands for, a
// lookup finds the calling backend's mapping only, and two models' identical token blocks, which
// vLLM hashes alike but kvroute keys apart (the model roots the key chain), never share an entry:
// entries are shared by hash and key. A backend's removal drops that backend from the entry and
// leaves the others theirs.
//
// Which map a backend uses. A backend starts with its own map, which its mutex guards (no lock
// per entry). Every block body records a 7-bit fingerprint of the engine hash the block was first
// stored under (engineFP); when a backend stores a block that others already hold, the two
// fingerprints agreeing or not is evidence of whether its engine hashes blocks as theirs do. A
// backend whose evidence leans to agreement (shareScore) moves its entries to the shared map and
// writes there from then on, at the cost of a shard lock per entry it writes, reads or removes;
// one whose evidence turns goes back to its own map (its shared entries stay there until
// removed). Either way each (backend, hash) mapping is in exactly one of the two maps.

// seShards is the number of shards of the shared map: the shard of a mixed engine hash is its
// low 8 bits, which its entries' tags therefore need not hold.
const seShards = 256

// sharedEngines is the shared engine-hash map: per shard, under the shard's mutex, a map of the
// hashes one backend maps (tag: ownTag) and a map of those several backends map alike (tag: the
// hash's high 56 bits and a sequence number, with the set of those backends).
type sharedEngines struct {
	shards [seShards]seShard
}

type seShard struct {
	mu      sync.Mutex
	own     engineMap // ownTag(h, id) → key
	group   groupMap  // h's high 56 bits | sequence number → key, holders
	pruneAt int       // the entry count below which put does not prune
	_       [64]byte
}

// The fingerprint evidence of engine hashes agreeing (see addConfirmed) moves a backend to the
// shared map at shareOn and back to its own at shareOff; its score is kept within ±shareCap.
const (
	shareOn  = 32
	shareOff = -32
	shareCap = 64
	// minSharedPrune is the fewest entries of a shard that its pruning of dangling entries
	// considers.
	minSharedPrune = 64
)

// engineFP returns the 7-bit fingerprint (1–127) of engine hash h (mixed) kept in block bodies.
func engineFP(h uint64) uint8 { return uint8(max(h>>57, 1)) }

func (se *sharedEngines) shard(h uint64) *seShard { return &se.shards[h&(seShards-1)] }

// ownTag returns the tag of backend id's entry for engine hash h (mixed).
func ownTag(h uint64, id uint8) uint64 { return h&^0xff | uint64(id) + 1 }

// get returns the key backend id maps engine hash h (mixed) to. Under s.mu.
func (s *seShard) get(h uint64, id uint8) (uint64, bool) {
	if i := s.own.find(ownTag(h, id)); i >= 0 {
		return s.own.slots[i].key, true
	}
	if i := s.group.holder(h, 1<<id); i >= 0 {
		return s.group.slots[i].key, true
	}
	return 0, false
}

// put maps engine hash h (mixed) to key for backend id, replacing its mapping of h; it reports
// whether id had none. When other backends map h to key alone, they and id share one entry from
// then on. Under s.mu.
func (s *seShard) put(h uint64, id uint8, key uint64) (added bool) {
	bit, tag := uint64(1)<<id, ownTag(h, id)
	// One pass over h's group entries (contiguous: their tags differ in the low byte only): id's
	// entry, the entry of key, and the first free sequence number.
	gi, gk, seq := -1, -1, uint64(1)
	if s.group.count > 0 {
		for i := s.group.first(h &^ 0xff); i < len(s.group.slots); i++ {
			g := &s.group.slots[i]
			if g.tag == 0 || g.tag>>8 != h>>8 {
				break
			}
			if g.holders&bit != 0 {
				gi = i
			}
			if g.key == key {
				gk = i
			}
			if g.tag&0xff == seq {
				seq++
			}
		}
	}
	switch {
	case gi >= 0 && gi == gk:
		return false
	case gk >= 0:
		if gi >= 0 {
			s.leave(gi, bit)
			gk = s.group.withKey(h, key) // leave moved the entries
		} else {
			added = !s.own.del(tag)
		}
		s.group.slots[gk].holders |= bit
		return added
	case gi >= 0:
		s.leave(gi, bit)
		added = false
	default:
		added = true
	}
	// One pass over h's own entries: id's, and the other backends' that map h to key.
	var others uint64
	oi, other := -1, -1
	for i := s.own.first(h &^ 0xff); i < len(s.own.slots); i++ {
		e := s.own.slots[i]
		if e.h == 0 || e.h>>8 != h>>8 {
			break
		}
		switch {
		case e.h == tag:
			oi = i
		case e.key == key:
			others |= 1 << (e.h&0xff - 1)
			other = i
		}
	}
	if oi >= 0 {
		if s.own.slots[oi].key == key {
			return false
		}
		added = false
		if others == 0 {
			s.own.slots[oi].key = key
			return added
		}
		s.own.delAt(oi)
		other = -1 // moved
	}
	if others == 0 || seq > 0xff {
		s.own.put(tag, key)
		return added
	}
	if others&(others-1) == 0 && other >= 0 {
		s.own.delAt(other)
	} else {
		for x := others; x != 0; x &= x - 1 {
			s.own.del(ownTag(h, uint8(bits.TrailingZeros64(x))))
		}
	}
	s.group.put(grpSlot{tag: h&^0xff | seq, key: key, holders: others | bit})
	return added
}

// del removes backend id's mapping of engine hash h (mixed); it reports whether there was one.
// Under s.mu.
func (s *seShard) del(h uint64, id uint8) bool {
	if i := s.own.find(ownTag(h, id)); i >= 0 {
		s.own.delAt(i)
		return true
	}
	if i := s.group.holder(h, 1<<id); i >= 0 {
		s.leave(i, 1<<id)
		return true
	}
	return false
}

// leave removes the backends of bit from group entry i; an entry left with one backend becomes
// that backend's own entry, one left with none goes. Under s.mu.
func (s *seShard) leave(i int, bit uint64) {
	g := s.group.slots[i]
	g.holders &^= bit
	if g.holders&(g.holders-1) != 0 {
		s.group.slots[i].holders = g.holders
		return
	}
	s.group.delAt(i)
	if g.holders != 0 {
		s.own.put(ownTag(g.tag, uint8(bits.TrailingZeros64(g.holders))), g.key)
	}
}

// retain keeps, of every mapping, the backends for which keep(key, backends) returns a bit:
// keep returns the subset of backends to keep. Under s.mu.
func (s *seShard) retain(keep func(key, holders uint64) uint64) {
	s.own.retain(func(tag, key uint64) bool { return keep(key, 1<<(tag&0xff-1)) != 0 })
	var single []emSlot
	s.group.retain(func(g *grpSlot) bool {
		g.holders = keep(g.key, g.holders)
		if g.holders&(g.holders-1) != 0 {
			return true
		}
		if g.holders != 0 {
			single = append(single, emSlot{h: ownTag(g.tag, uint8(bits.TrailingZeros64(g.holders))), key: g.key})
		}
		return false
	})
	for _, e := range single {
		s.own.put(e.h, e.key)
	}
}

// count returns the number of entries of s. Under s.mu.
func (s *seShard) count() int { return s.own.count + s.group.count }

// bytes returns the memory held by the shared map.
func (se *sharedEngines) bytes() int64 {
	var n int64
	for i := range se.shards {
		s := &se.shards[i]
		s.mu.Lock()
		n += s.own.bytes() + s.group.bytes()
		s.mu.Unlock()
	}
	return n
}

// clear empties the shared map.
func (se *sharedEngines) clear() {
	for i := range se.shards {
		s := &se.shards[i]
		s.mu.Lock()
		s.own, s.group, s.pruneAt = engineMap{}, groupMap{}, 0
		s.mu.Unlock()
	}
}

// dropIDs removes every mapping of the backends of mask (retired ids).
func (se *sharedEngines) dropIDs(mask uint64) {
	for i := range se.shards {
		s := &se.shards[i]
		s.mu.Lock()
		if s.count() > 0 {
			s.retain(func(_, holders uint64) uint64 { return holders &^ mask })
		}
		s.mu.Unlock()
	}
}

// engineGet returns the key bs maps engine hash h (mixed) to, in its own map or the shared one.
// Under bs.emu.
func (m *MemoryIndex) engineGet(bs *backendState, h uint64) (uint64, bool) {
	if k, ok := bs.em.get(h); ok {
		return k, true
	}
	if !bs.sharedEver {
		return 0, false
	}
	s := m.engines.shard(h)
	s.mu.Lock()
	k, ok := s.get(h, bs.id)
	s.mu.Unlock()
	return k, ok
}

// engineDel removes bs's mapping of engine hash h (mixed), in its own map or the shared one.
// Under bs.emu.
func (m *MemoryIndex) engineDel(bs *backendState, h uint64) {
	if !bs.em.del(h) && bs.sharedEver {
		m.sharedDel(bs, h)
	}
}

// sharedDel removes bs's mapping of engine hash h (mixed) from the shared map. Under bs.emu.
func (m *MemoryIndex) sharedDel(bs *backendState, h uint64) {
	s := m.engines.shard(h)
	s.mu.Lock()
	s.del(h, bs.id)
	s.mu.Unlock()
}

// enginePut maps engine hash h (mixed) to key for bs in the map it writes to, and removes its
// mapping of h from the other. Under bs.emu.
func (m *MemoryIndex) enginePut(bs *backendState, h, key uint64, c clock) {
	if bs.shared {
		if bs.em.count > 0 {
			bs.em.del(h)
		}
		m.sharedPut(bs, h, key, c)
		return
	}
	if bs.sharedEver {
		m.sharedDel(bs, h)
	}
	bs.em.put(h, key)
}

// sharedPut maps engine hash h (mixed) to key for bs in the shared map, pruning the shard's
// dangling entries when it has grown well past the memberships behind it (as emPut does for a
// backend's own map). Under bs.emu.
func (m *MemoryIndex) sharedPut(bs *backendState, h, key uint64, c clock) {
	s := m.engines.shard(h)
	s.mu.Lock()
	if s.put(h, bs.id, key) && s.count() >= max(s.pruneAt, minSharedPrune) {
		m.pruneShared(s, c)
	}
	s.mu.Unlock()
}

// pruneShared drops from s the mappings whose backend no longer holds their block (evicted or
// expired blocks, which no BlockRemoved reported), when s holds more than 3 entries per
// membership of its share of the table (plus a floor); it then waits for s to double before
// pruning again: O(1) amortised per entry written. Under s.mu.
func (m *MemoryIndex) pruneShared(s *seShard, c clock) {
	var members int64
	for i := range m.ids {
		members += m.ids[i].members.Load()
	}
	floor := 3*int(members/seShards) + minSharedPrune
	if s.count() < floor {
		s.pruneAt = floor
		return
	}
	retired := m.reg.retired.Load()
	s.retain(func(key, holders uint64) uint64 {
		h := mix(key)
		v, ok := m.shardOf(h).read(h)
		if !ok || !c.fresh(&v) {
			return 0
		}
		return holders & v.confirmed() &^ retired
	})
	s.pruneAt = max(2*s.count(), floor)
}

// noteShared takes the evidence of one store (see addConfirmed) that bs's engine hashes blocks
// as the other backends' do (same = 1) or not (-1), and moves bs to the shared map or back as
// its score crosses shareOn or shareOff. Under bs.emu.
func (m *MemoryIndex) noteShared(bs *backendState, same int) {
	bs.shareScore = min(max(bs.shareScore+same, -shareCap), shareCap)
	switch {
	case !bs.shared && bs.shareScore >= shareOn:
		m.shareEngines(bs)
	case bs.shared && bs.shareScore <= shareOff:
		bs.shared = false
	}
}

// shareEngines moves bs's own entries to the shared map, which it writes from then on. Under
// bs.emu.
func (m *MemoryIndex) shareEngines(bs *backendState) {
	bs.shared, bs.sharedEver = true, true
	for _, e := range bs.em.slots {
		if e.h == 0 {
			continue
		}
		s := m.engines.shard(e.h)
		s.mu.Lock()
		s.put(e.h, bs.id, e.key)
		s.mu.Unlock()
	}
	bs.em = engineMap{}
}

// engineSlots returns a copy of bs's mappings (engine hash, mixed → key), from its own map and
// the shared one. It takes bs.emu.
func (m *MemoryIndex) engineSlots(bs *backendState) []emSlot {
	bs.emu.Lock()
	defer bs.emu.Unlock()
	out := make([]emSlot, 0, bs.em.count)
	for _, e := range bs.em.slots {
		if e.h != 0 {
			out = append(out, e)
		}
	}
	if !bs.sharedEver {
		return out
	}
	bit := uint64(1) << bs.id
	for i := range m.engines.shards {
		s := &m.engines.shards[i]
		low := uint64(i)
		s.mu.Lock()
		for _, e := range s.own.slots {
			if e.h != 0 && e.h&0xff == uint64(bs.id)+1 {
				out = append(out, emSlot{h: e.h&^0xff | low, key: e.key})
			}
		}
		for _, g := range s.group.slots {
			if g.tag != 0 && g.holders&bit != 0 {
				out = append(out, emSlot{h: g.tag&^0xff | low, key: g.key})
			}
		}
		s.mu.Unlock()
	}
	return out
}

// groupMap is the map of the engine hashes several backends map alike: an ordered linear-probing
// table of 24-byte slots, like engineMap's, keyed by tag (the hash's high 56 bits and a sequence
// number telling apart the keys several groups of backends map that hash to).
type groupMap struct {
	slots []grpSlot // n home slots + pad
	n     uint64
	count int
}

type grpSlot struct {
	tag     uint64 // 0 = empty
	key     uint64 // our block key
	holders uint64 // the backends (bit = id) that map the hash to key; two or more
}

func (g *groupMap) home(tag uint64) uint64 { return ((tag >> 32) * g.n) >> 32 }

// first returns the position of the first slot, from lo's home, whose tag is empty or not below
// lo: where the entries of lo's hash start when lo is the hash with a zero low byte.
func (g *groupMap) first(lo uint64) int {
	s := g.slots
	pos := g.home(lo)
	for pos < uint64(len(s)) && s[pos].tag != 0 && s[pos].tag < lo {
		pos++
	}
	return int(pos)
}

// holder returns the position of the entry of engine hash h (mixed) whose holders include bit,
// or -1.
func (g *groupMap) holder(h, bit uint64) int {
	if g.count == 0 {
		return -1
	}
	for i := g.first(h &^ 0xff); i < len(g.slots) && g.slots[i].tag != 0 && g.slots[i].tag>>8 == h>>8; i++ {
		if g.slots[i].holders&bit != 0 {
			return i
		}
	}
	return -1
}

// withKey returns the position of the entry of engine hash h (mixed) mapping to key, or -1.
func (g *groupMap) withKey(h, key uint64) int {
	if g.count == 0 {
		return -1
	}
	for i := g.first(h &^ 0xff); i < len(g.slots) && g.slots[i].tag != 0 && g.slots[i].tag>>8 == h>>8; i++ {
		if g.slots[i].key == key {
			return i
		}
	}
	return -1
}

// put inserts e (its tag absent), shifting the larger tags of its run right by one.
func (g *groupMap) put(e grpSlot) {
	for {
		s := g.slots
		size := uint64(len(s))
		pos := uint64(g.first(e.tag))
		end := pos
		for end < size && s[end].tag != 0 {
			end++
		}
		if end >= size || uint64(g.count+1)*emLoadDen > g.n*emLoadNum {
			g.rebuild(emGrownSize(g.n))
			continue
		}
		copy(s[pos+1:end+1], s[pos:end])
		s[pos] = e
		g.count++
		return
	}
}

// delAt removes the entry at position i and shifts the following displaced entries back by one.
func (g *groupMap) delAt(i int) {
	s := g.slots
	pos := uint64(i)
	end := pos + 1
	for end < uint64(len(s)) && s[end].tag != 0 && g.home(s[end].tag) < end {
		end++
	}
	copy(s[pos:end-1], s[pos+1:end])
	s[end-1] = grpSlot{}
	g.count--
}

// rebuild rebuilds the map with at least n home slots.
func (g *groupMap) rebuild(n uint64) {
	old := g.slots
	for {
		g.n = max(n, 8)
		g.slots = make([]grpSlot, g.n+tablePad(g.n))
		if g.fill(old) {
			return
		}
		n = emGrownSize(g.n)
	}
}

// fill places old's entries, in order, into the empty map; false when the pad overflows.
func (g *groupMap) fill(old []grpSlot) bool {
	next, size := uint64(0), uint64(len(g.slots))
	g.count = 0
	for _, e := range old {
		if e.tag == 0 {
			continue
		}
		pos := max(g.home(e.tag), next)
		if pos >= size {
			return false
		}
		g.slots[pos] = e
		next = pos + 1
		g.count++
	}
	return true
}

// retain keeps only the entries for which keep returns true (keep may change an entry's holders),
// compacting the map in place as engineMap.retain does.
func (g *groupMap) retain(keep func(*grpSlot) bool) {
	s := g.slots
	next := uint64(0)
	g.count = 0
	for i := range uint64(len(s)) {
		if s[i].tag == 0 || !keep(&s[i]) {
			s[i] = grpSlot{}
			continue
		}
		e := s[i]
		s[i] = grpSlot{}
		pos := max(g.home(e.tag), next)
		s[pos] = e
		next = pos + 1
		g.count++
	}
}

// bytes returns the memory held by the map's slots.
func (g *groupMap) bytes() int64 { return int64(len(g.slots)) * 24 }
