package kvindex

// engineMap maps one backend's engine block hashes (mixed by mix) to our block keys (raw, as
// prefixkey computes them). It is an ordered linear-probing table like the block table's (see
// memory_table.go), unsynchronised: its backend's mutex guards it. 16 bytes per entry, about
// 81–90% full once past its first growths (see emLoadNum).
//
// An engine block of r > 1 of our blocks has r entries: the hash itself maps to the last sub-key
// (the parent of the engine's next block) and derive(h, j), j = 1..r−1, to the sub-key j places
// before it, so that BlockRemoved finds them all without a variable-length value.
//
// Entries whose block has left the block table by eviction or expiry (no BlockRemoved said so)
// dangle; MemoryIndex.emPut drops them when the map holds several times more entries than the
// backend has memberships. A backend whose engine hashes agree with other backends' keeps them
// in the shared map instead (see memory_shared.go), whose shards hold such maps of tags.
type engineMap struct {
	slots []emSlot // n home slots + pad
	n     uint64
	count int
	// pruneAt is the count below which MemoryIndex.emPut does not prune.
	pruneAt int
}

type emSlot struct {
	h   uint64 // mixed engine hash; 0 = empty
	key uint64 // our block key
}

// derive returns the map key of sub-key j (1 ≤ j) before the last of engine hash h (mixed).
func derive(h uint64, j int) uint64 {
	return mix(h ^ uint64(j)*0x9e3779b97f4a7c15)
}

func (e *engineMap) home(h uint64) uint64 { return ((h >> 32) * e.n) >> 32 }

// find returns h's position or -1.
func (e *engineMap) find(h uint64) int {
	s := e.slots
	for pos := e.home(h); pos < uint64(len(s)); pos++ {
		if k := s[pos].h; k-1 >= h-1 { // empty, or a key ≥ h: the run of smaller keys ended
			if k == h {
				return int(pos)
			}
			return -1
		}
	}
	return -1
}

// first returns the position of the first slot, from lo's home, that is empty or holds a key not
// below lo.
func (e *engineMap) first(lo uint64) int {
	s := e.slots
	pos := e.home(lo)
	for pos < uint64(len(s)) && s[pos].h != 0 && s[pos].h < lo {
		pos++
	}
	return int(pos)
}

// touch loads h's home slot (to bring it into the cache ahead of a write) and returns it.
func (e *engineMap) touch(h uint64) uint64 {
	if e.n == 0 {
		return 0
	}
	return e.slots[e.home(h)].h
}

// get returns the key mapped to h.
func (e *engineMap) get(h uint64) (uint64, bool) {
	if i := e.find(h); i >= 0 {
		return e.slots[i].key, true
	}
	return 0, false
}

// put maps h to key, replacing any previous mapping. One scan from h's home slot finds either
// h or its place in its run; the larger keys of the run then shift right by one.
func (e *engineMap) put(h, key uint64) {
	for {
		sl := e.slots
		size := uint64(len(sl))
		pos := e.home(h)
		for pos < size && sl[pos].h-1 < h-1 { // occupied by a smaller key
			pos++
		}
		if pos < size && sl[pos].h == h {
			sl[pos].key = key
			return
		}
		end := pos
		for end < size && sl[end].h != 0 {
			end++
		}
		if end >= size || uint64(e.count+1)*emLoadDen > e.n*emLoadNum {
			e.resize(emGrownSize(e.n))
			continue
		}
		copy(sl[pos+1:end+1], sl[pos:end])
		sl[pos] = emSlot{h: h, key: key}
		e.count++
		return
	}
}

// del removes h; it reports whether it was present.
func (e *engineMap) del(h uint64) bool {
	i := e.find(h)
	if i < 0 {
		return false
	}
	e.delAt(i)
	return true
}

// delAt removes the entry at position i (a find result, the map unchanged since) and shifts the
// following displaced entries back by one.
func (e *engineMap) delAt(i int) {
	sl := e.slots
	pos := uint64(i)
	end := pos + 1
	for end < uint64(len(sl)) && sl[end].h != 0 && e.home(sl[end].h) < end {
		end++
	}
	copy(sl[pos:end-1], sl[pos+1:end])
	sl[end-1] = emSlot{}
	e.count--
}

// resize rebuilds the map with at least n home slots, keeping the entries for which keep (when
// not nil) returns true.
func (e *engineMap) rebuild(n uint64, keep func(key uint64) bool) {
	old := e.slots
	for {
		e.n = max(n, 8)
		e.slots = make([]emSlot, e.n+tablePad(e.n))
		e.count = 0
		if e.fill(old, keep) {
			return
		}
		n = emGrownSize(e.n)
	}
}

func (e *engineMap) resize(n uint64) { e.rebuild(n, nil) }

// fill places old's kept entries, in order, into the empty map; false when the pad overflows.
func (e *engineMap) fill(old []emSlot, keep func(key uint64) bool) bool {
	sl, n := e.slots, e.n
	next, size, count := uint64(0), uint64(len(sl)), 0
	for _, s := range old {
		if s.h == 0 || (keep != nil && !keep(s.key)) {
			continue
		}
		pos := max(((s.h>>32)*n)>>32, next)
		if pos >= size {
			return false
		}
		sl[pos] = s
		next = pos + 1
		count++
	}
	e.count += count
	return true
}

// retain keeps only the entries for which keep returns true. It compacts the map in place (kept
// entries only move towards their home slots), so a pruning allocates nothing and the map keeps
// its size, room for the entries to come.
func (e *engineMap) retain(keep func(h, key uint64) bool) {
	sl := e.slots
	next := uint64(0) // first position not yet rewritten
	e.count = 0
	for i := range uint64(len(sl)) {
		s := sl[i]
		if s.h == 0 {
			continue
		}
		sl[i] = emSlot{}
		if !keep(s.h, s.key) {
			continue
		}
		pos := max(e.home(s.h), next) // ≤ i: the order and every home ≤ i are kept
		sl[pos] = s
		next = pos + 1
		e.count++
	}
}

// A map grows by about a ninth when it would pass 9/10 full, so that it stays between about 81%
// and 90% full once past its first growths: a denser map than the block table's probe arrays,
// whose insertions shift 16-byte slots under no reader's eyes.
const (
	emLoadNum = 9
	emLoadDen = 10
)

func emGrownSize(n uint64) uint64 { return max(n+n/9, n+16) }

// bytes returns the memory held by the map's slots.
func (e *engineMap) bytes() int64 { return int64(len(e.slots)) * 16 }
