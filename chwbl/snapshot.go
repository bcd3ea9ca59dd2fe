package chwbl

import (
	"encoding/binary"
	"math/bits"
	"slices"
	"strings"

	"github.com/zeebo/xxh3"
)

// snapshot is an immutable ring: len(pos) virtual nodes sorted by (position, backend name, replica
// index), with parallel owner (index into members) and replica slices. A Ring replaces its snapshot
// on every membership change and never mutates one in place, so it may be searched without a lock.
type snapshot struct {
	pos     []uint64
	owner   []int32
	replica []uint32
	members []*member // every current member, each owning at least one vnode

	// Search accelerator: the vnodes whose position has top bits b (b = p >> shift) are
	// pos[bucket[b]:bucket[b+1]]. With two to four vnodes per bucket a search costs a table
	// lookup and one or two probes instead of a dozen dependent loads of a full binary search.
	bucket []uint32
	shift  uint
}

// index builds the bucket table; called once on a new snapshot.
func (s *snapshot) index() *snapshot {
	n := len(s.pos)
	k := max(bits.Len(uint(n))-2, 0) // 2^k buckets, n/2^k in [2, 4)
	s.shift = 64 - uint(k)
	s.bucket = make([]uint32, 1<<k+1)
	i := 0
	for b := range s.bucket {
		for i < n && s.pos[i]>>s.shift < uint64(b) { // uint64(b) ≤ 2^k: no overflow
			i++
		}
		s.bucket[b] = uint32(i)
	}
	return s
}

// search returns the index of the first vnode at or after position p, wrapping to 0 past the end
// (and 0 for an empty ring).
func (s *snapshot) search(p uint64) int {
	if len(s.pos) == 0 {
		return 0
	}
	b := p >> s.shift // shift = 64 with one bucket: Go defines the result as 0
	lo, hi := int(s.bucket[b]), int(s.bucket[b+1])
	// Every vnode before lo is in an earlier bucket (< p), every one from hi on in a later one
	// (> p): the answer is in [lo, hi]. Binary search, so that a pathological bucket stays
	// logarithmic; with xxh3 positions it holds about three vnodes.
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		if s.pos[mid] < p {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	if lo == len(s.pos) {
		return 0
	}
	return lo
}

// vnode is a virtual node being placed.
type vnode struct {
	pos     uint64
	replica uint32
	m       *member
}

// cmpVnode orders virtual nodes by (position, backend name, replica index): a total, deterministic
// order even when two positions collide, independent of the order backends were added.
func cmpVnode(a, b vnode) int {
	switch {
	case a.pos < b.pos:
		return -1
	case a.pos > b.pos:
		return 1
	}
	if c := strings.Compare(a.m.name, b.m.name); c != 0 {
		return c
	}
	switch {
	case a.replica < b.replica:
		return -1
	case a.replica > b.replica:
		return 1
	}
	return 0
}

func (s *snapshot) at(i int) vnode {
	return vnode{pos: s.pos[i], replica: s.replica[i], m: s.members[s.owner[i]]}
}

// with returns a new snapshot holding s's vnodes plus nv vnodes of m, merged in order.
func (s *snapshot) with(m *member, nv int, hash func(string, uint32) uint64) *snapshot {
	add := make([]vnode, nv)
	for i := range add {
		add[i] = vnode{pos: hash(m.name, uint32(i)), replica: uint32(i), m: m}
	}
	slices.SortFunc(add, cmpVnode)

	n := len(s.pos) + nv
	out := &snapshot{
		pos:     make([]uint64, 0, n),
		owner:   make([]int32, 0, n),
		replica: make([]uint32, 0, n),
		members: append(slices.Clip(s.members), m), // clip: never write into s's backing array
	}
	mi := int32(len(s.members))
	push := func(v vnode, owner int32) {
		out.pos = append(out.pos, v.pos)
		out.owner = append(out.owner, owner)
		out.replica = append(out.replica, v.replica)
	}
	i, j := 0, 0
	for i < len(s.pos) && j < len(add) {
		if v := s.at(i); cmpVnode(v, add[j]) <= 0 {
			push(v, s.owner[i])
			i++
		} else {
			push(add[j], mi)
			j++
		}
	}
	for ; i < len(s.pos); i++ {
		push(s.at(i), s.owner[i])
	}
	for ; j < len(add); j++ {
		push(add[j], mi)
	}
	return out.index()
}

// without returns a new snapshot holding s's vnodes except m's. m must be in s.
func (s *snapshot) without(m *member) *snapshot {
	k := int32(slices.Index(s.members, m))
	members := make([]*member, 0, len(s.members)-1)
	members = append(members, s.members[:k]...)
	members = append(members, s.members[k+1:]...)
	n := len(s.pos)
	out := &snapshot{
		pos:     make([]uint64, 0, n),
		owner:   make([]int32, 0, n),
		replica: make([]uint32, 0, n),
		members: members,
	}
	for i, o := range s.owner {
		if o == k {
			continue
		}
		if o > k {
			o--
		}
		out.pos = append(out.pos, s.pos[i])
		out.owner = append(out.owner, o)
		out.replica = append(out.replica, s.replica[i])
	}
	return out.index()
}

// vnodePosition places virtual node number replica of backend name at
//
//	xxh3-64(uvarint(len(name)) ‖ name ‖ uint32-big-endian(replica))
//
// The length prefix makes the encoding injective, so ("pod-1", 10) and ("pod-11", 0), which plain
// concatenation would both turn into "pod-110", get independent positions.
func vnodePosition(name string, replica uint32) uint64 {
	var stack [64]byte
	b := binary.AppendUvarint(stack[:0], uint64(len(name)))
	b = append(b, name...)
	b = binary.BigEndian.AppendUint32(b, replica)
	return xxh3.Hash(b)
}

// mix64 is MurmurHash3's 64-bit finalizer: a bijection that spreads small or sequential keys
// over the ring while leaving already-uniform hashes uniform.
func mix64(k uint64) uint64 {
	k ^= k >> 33
	k *= 0xff51afd7ed558ccd
	k ^= k >> 33
	k *= 0xc4ceb9fe1a85ec53
	k ^= k >> 33
	return k
}
