package kvindex

import (
	"context"
	"math/bits"
	"math/rand/v2"
	"runtime"

	"github.com/kvroute/kvroute/events"
)

// Lookup's prefetch batches: the first is small (most lookups of unrelated prompts stop at block
// 0), the next ones as large as the CPU's outstanding misses usefully go.
const (
	lookupFirstBatch = 4
	lookupBatch      = 16
)

// lookupState accumulates one lookup's results per backend id: the depth of the match, its
// blocks whose best tier is CPU and storage, and the depth of the prefix held on storage.
type lookupState struct {
	depth, nCPU, nStorage, stored [MaxMemoryBackends]int32
}

// Lookup fills out[i] for candidates[i] with the longest consecutive prefix of keys that the
// candidate holds on any tier (Lookuper), and with the longest one it holds on the storage tier
// (Match.StoredBlocks). Expired entries count as absent. It takes no lock, allocates nothing,
// ignores ctx, and returns ErrClosed after Close. It panics if len(out) < len(candidates).
//
// By default it is a jump search (MemoryConfig.LookupStride, which says when it is exact; the
// storage prefix is searched likewise, under the same assumption). With LookupStride 1 keys are
// probed in order, one table probe per key answering for every candidate at once, until no
// remaining candidate holds the next key. Only candidates that have stored some block on the
// storage tier since their id was assigned are searched for a storage prefix: the others cost
// nothing more.
func (m *MemoryIndex) Lookup(_ context.Context, keys []uint64, candidates []string, out []Match) ([]Match, error) {
	if m.closed.Load() {
		return out[:0], ErrClosed
	}
	out = out[:len(candidates)]
	m.lookups[rand.Uint32()%uint32(len(m.lookups))].n.Add(1)
	names := *m.reg.names.Load()
	var want uint64
	for i, name := range candidates {
		out[i] = Match{Backend: name}
		if bs := names[name]; bs != nil {
			want |= 1 << bs.id
			out[i].Blocks = int(bs.id) + 1 // the id, until the results are filled in
		}
	}
	if want == 0 || len(keys) == 0 {
		for i := range out {
			out[i].Blocks = 0
		}
		return out, nil
	}
	c := m.clock()
	var st lookupState
	stored := want & m.storageIDs.Load()
	if m.cfg.LookupStride > 1 && len(keys) > m.cfg.LookupStride {
		m.scanJump(keys, want, stored, &st, c)
	} else {
		m.scanExact(keys, want, stored, &st, c)
	}
	w := &m.weights
	for i := range out {
		if out[i].Blocks == 0 {
			continue
		}
		id := out[i].Blocks - 1
		d, nc, ns := int(st.depth[id]), int(st.nCPU[id]), int(st.nStorage[id])
		out[i].Blocks = d
		out[i].Tokens = d * m.cfg.BlockSize
		out[i].WeightedBlocks = w[events.TierGPU]*float64(d-nc-ns) + w[events.TierCPU]*float64(nc) + w[events.TierStorage]*float64(ns)
		sd := int(st.stored[id])
		out[i].StoredBlocks = sd
		out[i].StoredTokens = sd * m.cfg.BlockSize
		switch {
		case ns > 0:
			out[i].Tier = events.TierStorage
		case nc > 0:
			out[i].Tier = events.TierCPU
		}
	}
	return out, nil
}

// scanExact probes every key in order until no candidate of alive holds the next one. The
// candidates of stored (a subset of alive) are also followed on the storage tier: the first key
// one of them lacks there ends its stored prefix.
//
// Keys are probed in batches. A first pass loads the home key slot of every key of the batch:
// the loads are independent, so their cache misses overlap instead of following one another (a
// 10M-membership table is far larger than the caches). The seqlocked probes then run on warm
// lines. Batches start small, so that a lookup that stops early wastes little.
func (m *MemoryIndex) scanExact(keys []uint64, alive, stored uint64, st *lookupState, c clock) {
	shards, smask := m.shards, m.shardMask
	var hs [lookupBatch]uint64
	var touched uint64
	base, next, size := 0, 0, lookupFirstBatch
	for i := range keys {
		if i == next {
			base = i
			end := min(i+size, len(keys))
			for j := i; j < end; j++ {
				h := mix(keys[j])
				hs[j-i] = h
				t := shards[h&smask].tab.Load()
				touched += t.keys[t.home(h)].Load()
			}
			next, size = end, lookupBatch
		}
		g, cpu, sto := m.probe(hs[i-base], c)
		held := g | cpu | sto
		if sLost := stored &^ sto; sLost != 0 {
			for ; sLost != 0; sLost &= sLost - 1 {
				st.stored[bits.TrailingZeros64(sLost)] = int32(i)
			}
			stored &= sto
		}
		if lost := alive &^ held; lost != 0 {
			for ; lost != 0; lost &= lost - 1 {
				st.depth[bits.TrailingZeros64(lost)] = int32(i)
			}
			alive &= held
			if alive == 0 {
				break
			}
		}
		for x := alive & cpu &^ g; x != 0; x &= x - 1 {
			st.nCPU[bits.TrailingZeros64(x)]++
		}
		for x := alive & sto &^ (g | cpu); x != 0; x &= x - 1 {
			st.nStorage[bits.TrailingZeros64(x)]++
		}
	}
	for ; alive != 0; alive &= alive - 1 {
		st.depth[bits.TrailingZeros64(alive)] = int32(len(keys))
	}
	for ; stored != 0; stored &= stored - 1 {
		st.stored[bits.TrailingZeros64(stored)] = int32(len(keys))
	}
	if touched == 1 {
		runtime.KeepAlive(touched) // keeps the prefetching loads
	}
}

// probe returns the live holders of block h by best tier: GPU (with speculative holders), CPU
// and storage (a holder may be in several). It takes no lock.
func (m *MemoryIndex) probe(h uint64, c clock) (g, cpu, sto uint64) {
	sh := &m.shards[h&m.shardMask]
	for spins := 0; ; spins++ {
		s1 := sh.seq.Load()
		if s1&1 == 0 {
			t := sh.tab.Load()
			g, cpu, sto = 0, 0, 0
			if _, b := t.find(h); b.p != nil {
				g, cpu, sto = b.holders(c)
			}
			if sh.seq.Load() == s1 {
				return g, cpu, sto
			}
		}
		if spins&63 == 63 {
			runtime.Gosched()
		}
	}
}

// holders returns b's live holders by tier, speculative ones with the GPU's. It reads only the
// pair of a block without a cold part. Readers call it under the seqlock.
func (b body) holders(c clock) (g, cpu, sto uint64) {
	hx := b.p.hx.Load()
	tick := uint32(hx >> 32)
	switch hx & flagMask {
	case 0:
		if int32(c.epoch-tick) <= int32(c.ttl) {
			g = b.p.g.Load()
		}
	case flagSpec:
		if int32(tick-c.now) > 0 {
			g = b.p.g.Load()
		}
	default:
		pc := b.pc.Load()
		cd := b.t.cold(pc >> 32)
		if cd == nil {
			return 0, 0, 0 // torn
		}
		if int32(c.epoch-tick) <= int32(c.ttl) {
			g, cpu, sto = b.p.g.Load(), cd.cpu.Load(), cd.storage.Load()
		}
		if int32(uint32(pc)-c.now) > 0 {
			g |= cd.spec.Load()
		}
	}
	return g, cpu, sto
}

// scanJump is the jump search of MemoryConfig.LookupStride: it probes every stride-th key (and the
// last). A candidate that holds the probed key on the same best tier as the previous probed key
// is taken to hold every key between them on that tier. The others — candidates that lost the
// probed key, or whose best tier changed — are resolved exactly by probing the stride key by key.
//
// The candidates of stored (a subset of alive) are followed on the storage tier alike: one that
// holds the probed key on storage, as it held the previous probed key, is taken to hold every key
// between them there; one that lacks the probed key on storage has its stored prefix end inside
// the stride, found key by key (along with the others' refinement: when it holds the probed key
// on the same best tier, these are the only extra probes). A candidate whose best tier changed is
// checked key by key on storage too, since its stride is probed anyway.
func (m *MemoryIndex) scanJump(keys []uint64, alive, stored uint64, st *lookupState, c clock) {
	n := len(keys)
	stride := m.cfg.LookupStride
	pos := -1                   // last probed index
	var prevCPU, prevSto uint64 // candidates whose best tier at pos was CPU, storage
	for alive != 0 && pos < n-1 {
		next := min(pos+stride, n-1)
		g, cpu, sto := m.probe(mix(keys[next]), c)
		held := g | cpu | sto
		curCPU := alive & cpu &^ g
		curSto := alive & sto &^ (g | cpu)
		lost := alive &^ held
		changed := alive & held & ((curCPU ^ prevCPU) | (curSto ^ prevSto))
		sLost := stored &^ sto
		if lost|changed|sLost != 0 {
			// Changed candidates with a hole in the window end there, as lost ones do.
			ended, sEnded := m.refine(keys, pos+1, next, lost, changed, sLost, stored&changed&^sLost, st, c)
			stored &^= sEnded
			held &^= ended
			changed &^= ended
			curCPU &^= ended
			curSto &^= ended
		}
		alive &= held
		// The window (pos, next] of the unchanged candidates is on the probed key's tier; the
		// changed ones had their window counted key by key but for the probed key itself.
		w := int32(next - pos)
		for x := curCPU &^ changed; x != 0; x &= x - 1 {
			st.nCPU[bits.TrailingZeros64(x)] += w
		}
		for x := curSto &^ changed; x != 0; x &= x - 1 {
			st.nStorage[bits.TrailingZeros64(x)] += w
		}
		for x := curCPU & changed; x != 0; x &= x - 1 {
			st.nCPU[bits.TrailingZeros64(x)]++
		}
		for x := curSto & changed; x != 0; x &= x - 1 {
			st.nStorage[bits.TrailingZeros64(x)]++
		}
		prevCPU, prevSto = curCPU, curSto
		pos = next
	}
	for ; alive != 0; alive &= alive - 1 {
		st.depth[bits.TrailingZeros64(alive)] = int32(n)
	}
	for ; stored != 0; stored &= stored - 1 {
		st.stored[bits.TrailingZeros64(stored)] = int32(n)
	}
}

// refine probes keys[lo:hi] in order. The candidates of lost, which hold keys[lo-1] (or lo is
// 0) but not keys[hi], get their exact depth and tier counts; those of changed, which hold
// keys[hi], get their exact tier counts for keys[lo:hi]; those of them that lack a key there get
// their depth as lost ones do, and are returned as ended.
//
// On the storage tier likewise: the candidates of sLost, which hold keys[lo-1] (or lo is 0) on
// storage but not keys[hi], get the exact depth of their stored prefix; those of sCheck, which
// hold both on storage, are checked for a key of keys[lo:hi] they lack there, which ends their
// stored prefix. Every candidate whose stored prefix ended is returned in sEnded.
func (m *MemoryIndex) refine(keys []uint64, lo, hi int, lost, changed, sLost, sCheck uint64, st *lookupState, c clock) (ended, sEnded uint64) {
	open := lost | changed
	sOpen := sLost | sCheck
	for j := lo; j < hi && open|sOpen != 0; j++ {
		g, cpu, sto := m.probe(mix(keys[j]), c)
		held := g | cpu | sto
		if x := sOpen &^ sto; x != 0 {
			sEnded |= x
			sOpen &= sto
			for ; x != 0; x &= x - 1 {
				st.stored[bits.TrailingZeros64(x)] = int32(j)
			}
		}
		for x := open &^ held; x != 0; x &= x - 1 {
			st.depth[bits.TrailingZeros64(x)] = int32(j)
		}
		ended |= changed & open &^ held
		open &= held
		for x := open & cpu &^ g; x != 0; x &= x - 1 {
			st.nCPU[bits.TrailingZeros64(x)]++
		}
		for x := open & sto &^ (g | cpu); x != 0; x &= x - 1 {
			st.nStorage[bits.TrailingZeros64(x)]++
		}
	}
	for x := open & lost; x != 0; x &= x - 1 {
		st.depth[bits.TrailingZeros64(x)] = int32(hi)
	}
	for x := sOpen & sLost; x != 0; x &= x - 1 {
		st.stored[bits.TrailingZeros64(x)] = int32(hi)
	}
	return ended, sEnded | sLost
}
