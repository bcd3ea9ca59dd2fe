package kvindex

import (
	"context"
	"fmt"
	"math/bits"
	"math/rand/v2"
	"testing"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/prefixkey"
)

// checkShard verifies a shared-map shard against ref ((id, hash) → key): every mapping of ref is
// found, in exactly one place (the id's own entry or one group entry holding it); a group entry
// has two holders or more and a key no own entry of its hash shares; nothing else is there.
func checkShard(t *testing.T, s *seShard, ref map[[2]uint64]uint64, step int) {
	t.Helper()
	seen := 0
	for _, e := range s.own.slots {
		if e.h == 0 {
			continue
		}
		seen++
		id := e.h&0xff - 1
		if want, ok := ref[[2]uint64{id, e.h &^ 0xff}]; !ok || want != e.key {
			t.Fatalf("step %d: own entry %x → %x, reference %x %v", step, e.h, e.key, want, ok)
		}
	}
	for _, g := range s.group.slots {
		if g.tag == 0 {
			continue
		}
		if bits.OnesCount64(g.holders) < 2 {
			t.Fatalf("step %d: group entry %x of %d holders", step, g.tag, bits.OnesCount64(g.holders))
		}
		for x := g.holders; x != 0; x &= x - 1 {
			seen++
			id := uint64(bits.TrailingZeros64(x))
			if want, ok := ref[[2]uint64{id, g.tag &^ 0xff}]; !ok || want != g.key {
				t.Fatalf("step %d: group entry %x holds %d → %x, reference %x %v", step, g.tag, id, g.key, want, ok)
			}
		}
		for _, e := range s.own.slots {
			if e.h != 0 && e.h>>8 == g.tag>>8 && e.key == g.key {
				t.Fatalf("step %d: own entry %x maps to group %x's key", step, e.h, g.tag)
			}
		}
	}
	if seen != len(ref) {
		t.Fatalf("step %d: %d mappings stored, %d in the reference", step, seen, len(ref))
	}
	for k, want := range ref {
		if got, ok := s.get(k[1], uint8(k[0])); !ok || got != want {
			t.Fatalf("step %d: get(%x, %d) = %x %v, want %x", step, k[1], k[0], got, ok, want)
		}
	}
}

// TestSharedShardRandomOps drives a shard of the shared map through random puts, removals and
// prunings by several backends, on few hashes and few keys so that backends often map a hash
// alike (and join or leave group entries), against a reference.
func TestSharedShardRandomOps(t *testing.T) {
	for seed := range uint64(6) {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) { sharedShardRandomOps(t, seed) })
	}
}

func sharedShardRandomOps(t *testing.T, seed uint64) {
	var s seShard
	ref := map[[2]uint64]uint64{}
	r := rand.New(rand.NewPCG(11, seed))
	hs := make([]uint64, 40)
	for i := range hs {
		hs[i] = mix(uint64(i)+1) &^ 0xff // one shard: the low byte is the shard's
	}
	keys := []uint64{101, 202, 303}
	for step := range 20000 {
		id := uint8(r.IntN(8))
		h := hs[r.IntN(len(hs))]
		k := [2]uint64{uint64(id), h}
		switch op := r.IntN(10); {
		case op < 6:
			key := keys[r.IntN(len(keys))]
			_, had := ref[k]
			if added := s.put(h, id, key); added == had {
				t.Fatalf("step %d: put added %v, had %v", step, added, had)
			}
			ref[k] = key
		case op < 9:
			_, had := ref[k]
			if got := s.del(h, id); got != had {
				t.Fatalf("step %d: del = %v, want %v", step, got, had)
			}
			delete(ref, k)
		default:
			drop := keys[r.IntN(len(keys))]
			gone := uint64(1) << r.IntN(8)
			s.retain(func(key, holders uint64) uint64 {
				if key == drop {
					return holders &^ gone
				}
				return holders
			})
			for k, key := range ref {
				if key == drop && gone == 1<<k[0] {
					delete(ref, k)
				}
			}
		}
		if step%31 == 0 {
			checkShard(t, &s, ref, step)
		}
	}
	checkShard(t, &s, ref, -1)
}

// applyAll applies events of model to backend.
func applyAll(t testing.TB, m *MemoryIndex, backend, model string, evs ...events.Event) {
	t.Helper()
	if err := m.Apply(context.Background(), backend, &events.Batch{Model: model, Events: evs}); err != nil {
		t.Fatal(err)
	}
}

// storedChain returns BlockStored events of toks in 16-block events, engine hashes base+i.
func storedChain(toks []uint32, base uint64) []events.Event {
	var evs []events.Event
	n := len(toks) / 16
	for start := 0; start < n; start += 16 {
		end := min(start+16, n)
		hs := make([]uint64, end-start)
		for i := range hs {
			hs[i] = base + uint64(start+i)
		}
		ev := events.Event{Kind: events.KindBlockStored, BlockHashes: hs, TokenIDs: toks[start*16 : end*16], BlockSize: 16}
		if start > 0 {
			ev.Parent, ev.HasParent = base+uint64(start-1), true
		}
		evs = append(evs, ev)
	}
	return evs
}

// sharedCounts counts the shared map's own entries and group entries.
func sharedCounts(m *MemoryIndex) (own, group int) {
	for i := range m.engines.shards {
		s := &m.engines.shards[i]
		s.mu.Lock()
		own += s.own.count
		group += s.group.count
		s.mu.Unlock()
	}
	return own, group
}

// Backends whose engines hash alike share one engine-hash entry per block; each still removes and
// continues its own blocks, a removal by one leaves the others' mappings, and another model's
// identical token blocks under the same engine hashes keep entries of their own.
func TestSharedEnginesFleet(t *testing.T) {
	m, _ := newTestIndex(t, MemoryConfig{LookupStride: 1})
	m.reg.shareAll = true
	toks := testTokens(21, 48*16)
	for _, b := range []string{"a", "b", "c"} {
		applyAll(t, m, b, testModel, storedChain(toks[:32*16], 7000)...)
	}
	if own, group := sharedCounts(m); own != 0 || group != 32 {
		t.Fatalf("three backends, one chain of 32 blocks: %d own and %d group entries, want 0 and 32", own, group)
	}
	// Another model's backend, same tokens, same engine hashes (vLLM does not hash the model).
	applyAll(t, m, "y", "other-model", storedChain(toks[:32*16], 7000)...)
	if own, group := sharedCounts(m); own != 32 || group != 32 {
		t.Fatalf("with another model's backend: %d own and %d group entries, want 32 and 32", own, group)
	}
	keys := testKeys(toks)
	keysY := prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot("other-model", ""), toks, DefaultBlockSize, nil)

	// b drops its last 8 blocks; a and c keep theirs and remove them later by the same hashes.
	rm := func(backend string, from, to uint64) {
		hs := []uint64{}
		for h := to - 1; h >= from; h-- {
			hs = append(hs, h)
		}
		applyAll(t, m, backend, testModel, events.Event{Kind: events.KindBlockRemoved, BlockHashes: hs})
	}
	rm("b", 7024, 7032)
	if got := blocksOf(t, m, keys, "a", "b", "c"); got[0] != 32 || got[1] != 24 || got[2] != 32 {
		t.Fatalf("after b's removal: %v, want [32 24 32]", got)
	}
	rm("a", 7028, 7032)
	// Continuations from a shared parent: c's and y's resolve to their own models' keys.
	cont := events.Event{Kind: events.KindBlockStored, BlockHashes: []uint64{7032, 7033}, TokenIDs: toks[32*16 : 34*16],
		BlockSize: 16, Parent: 7031, HasParent: true}
	applyAll(t, m, "c", testModel, cont)
	applyAll(t, m, "y", "other-model", cont)
	// b no longer maps 7031: its continuation has an unknown parent.
	applyAll(t, m, "b", testModel, cont)
	if got := blocksOf(t, m, keys, "a", "b", "c", "y"); got[0] != 28 || got[1] != 24 || got[2] != 34 || got[3] != 0 {
		t.Fatalf("after continuations: %v, want [28 24 34 0]", got)
	}
	if got := blocksOf(t, m, keysY, "a", "y"); got[0] != 0 || got[1] != 34 {
		t.Fatalf("other model's chain: %v, want [0 34]", got)
	}
	s, _ := m.Stats(context.Background())
	if s.Dropped[DropUnknownBlock.String()] != 0 || s.Dropped[DropUnknownParent.String()] != 1 {
		t.Fatalf("dropped %v, want one unknown parent (b's continuation) only", s.Dropped)
	}
	checkConsistency(t, m)

	// ClearBackend of c: after the sweep its old id has no mapping left, and a's still resolve.
	if err := m.ClearBackend(context.Background(), "c"); err != nil {
		t.Fatal(err)
	}
	m.sweep()
	cid := uint64(m.reg.lookup("a").id) // any live id; the cleared one is free again
	for i := range m.engines.shards {
		sh := &m.engines.shards[i]
		for _, g := range sh.group.slots {
			if g.tag != 0 && g.holders&^(1<<cid|1<<uint64(m.reg.lookup("b").id)|1<<uint64(m.reg.lookup("y").id)) != 0 {
				t.Fatalf("group entry %x holds a cleared backend: %x", g.tag, g.holders)
			}
		}
	}
	rm("a", 7000, 7028)
	if got := blocksOf(t, m, keys, "a", "b"); got[0] != 0 || got[1] != 24 {
		t.Fatalf("after a's removal of its chain: %v, want [0 24]", got)
	}
	if s, _ := m.Stats(context.Background()); s.Dropped[DropUnknownBlock.String()] != 0 {
		t.Fatalf("a's removals found no block: %v", s.Dropped)
	}
	checkConsistency(t, m)
}

// A backend moves to the shared map once its engine hashes agree with the other backends' for
// the blocks they both hold, and its entries move with it; backends whose engines hash apart keep
// their own maps.
func TestSharedEnginesEvidence(t *testing.T) {
	m, _ := newTestIndex(t, MemoryConfig{})
	toks := testTokens(22, 64*16)
	for _, b := range []string{"a", "b"} { // alike
		applyAll(t, m, b, testModel, storedChain(toks, 1000)...)
	}
	for i, b := range []string{"c", "d"} { // apart
		applyAll(t, m, b, testModel, storedChain(toks, uint64(5000+1000*i))...)
	}
	for _, tc := range []struct {
		name   string
		shared bool
	}{{"a", false}, {"b", true}, {"c", false}, {"d", false}} {
		bs := m.reg.lookup(tc.name)
		bs.emu.Lock()
		shared, own := bs.shared, bs.em.count
		bs.emu.Unlock()
		if shared != tc.shared {
			t.Errorf("%s: shared %v, want %v", tc.name, shared, tc.shared)
		}
		if shared && own != 0 {
			t.Errorf("%s: %d entries left in its own map", tc.name, own)
		}
	}
	// a holds the blocks first: its evidence comes when it stores blocks b holds.
	applyAll(t, m, "b", testModel, storedChain(testTokens(23, 64*16), 9000)...)
	applyAll(t, m, "a", testModel, storedChain(testTokens(23, 64*16), 9000)...)
	if bs := m.reg.lookup("a"); !bs.shared {
		t.Errorf("a: not shared after storing 64 of b's blocks under the same hashes")
	}
	if own, group := sharedCounts(m); group != 128 || own != 0 {
		t.Errorf("%d own and %d group entries, want 0 and 128 (a's first chain moved and joined b's)", own, group)
	}
	keys := testKeys(toks)
	if got := blocksOf(t, m, keys, "a", "b", "c", "d"); got[0] != 64 || got[1] != 64 || got[2] != 64 || got[3] != 64 {
		t.Errorf("lookups %v, want 64 each", got)
	}
	checkConsistency(t, m)
}

// A backend on the shared map whose evidence turns (its engine hashes blocks apart from the
// others now, as after a restart with another seed) writes its own map again, and still finds,
// replaces and removes the mappings it left in the shared one.
func TestSharedEnginesBackToOwn(t *testing.T) {
	m, _ := newTestIndex(t, MemoryConfig{LookupStride: 1})
	m.reg.shareAll = true
	toks := testTokens(24, 40*16)
	applyAll(t, m, "a", testModel, storedChain(toks[:32*16], 1000)...)
	applyAll(t, m, "b", testModel, storedChain(toks[:32*16], 1000)...)
	m.reg.shareAll = false
	// c, on its own map, holds 64 blocks that b then stores under other hashes.
	other := testTokens(25, 64*16)
	applyAll(t, m, "c", testModel, storedChain(other, 50_000)...)
	applyAll(t, m, "b", testModel, storedChain(other, 90_000)...)
	bs := m.reg.lookup("b")
	if bs.shared || !bs.sharedEver {
		t.Fatalf("b: shared %v, shared once %v; want false, true", bs.shared, bs.sharedEver)
	}
	// b continues its first chain from a mapping it left in the shared map, re-stores block 0
	// under a hash of its own map, and removes its blocks 0–15 by their hashes.
	applyAll(t, m, "b", testModel, events.Event{Kind: events.KindBlockStored, BlockHashes: []uint64{1032, 1033},
		TokenIDs: toks[32*16 : 34*16], BlockSize: 16, Parent: 1031, HasParent: true})
	keys := testKeys(toks)
	if got := blocksOf(t, m, keys, "a", "b"); got[0] != 32 || got[1] != 34 {
		t.Fatalf("after b's continuation: %v, want [32 34]", got)
	}
	hs := []uint64{}
	for h := uint64(1015); h >= 1000; h-- {
		hs = append(hs, h)
	}
	applyAll(t, m, "b", testModel, events.Event{Kind: events.KindBlockRemoved, BlockHashes: hs})
	if got := blocksOf(t, m, keys, "a", "b"); got[0] != 32 || got[1] != 0 {
		t.Fatalf("after b's removal of blocks 0–15: %v, want [32 0]", got)
	}
	// A mapping b replaces goes from the shared map: the hash of block 16 now stands for another
	// block, and removing it leaves block 16 held.
	applyAll(t, m, "b", testModel, events.Event{Kind: events.KindBlockStored, BlockHashes: []uint64{1016},
		TokenIDs: other[:16], BlockSize: 16})
	applyAll(t, m, "b", testModel, events.Event{Kind: events.KindBlockRemoved, BlockHashes: []uint64{1016}})
	if v, ok := m.shardOf(mix(keys[16])).read(mix(keys[16])); !ok || v.confirmed()&(1<<bs.id) == 0 {
		t.Fatalf("block 16 no longer held by b after the removal of a hash that stands for another block")
	}
	if s, _ := m.Stats(context.Background()); s.Dropped[DropUnknownBlock.String()] != 0 || s.Dropped[DropUnknownParent.String()] != 0 {
		t.Fatalf("dropped %v", s.Dropped)
	}
	checkConsistency(t, m)
}

// A flood of blocks never removed, from backends on the shared map: the table stays within
// MaxEntries and the shared map within a few times its live entries (dangling ones are pruned).
func TestSharedEnginesFloodBounded(t *testing.T) {
	const maxEntries = 4096
	m, _ := newTestIndex(t, MemoryConfig{MaxEntries: maxEntries})
	m.reg.shareAll = true
	for round := range 3 {
		for i := range 4 {
			toks := testTokens(round*100+i, 10*maxEntries/4*16)
			for _, b := range []string{fmt.Sprintf("a%d", i), fmt.Sprintf("b%d", i)} {
				applyAll(t, m, b, testModel, storedChain(toks, uint64(round)<<32|uint64(i)<<24)...)
			}
		}
	}
	own, group := sharedCounts(m)
	if s, _ := m.Stats(context.Background()); s.Blocks > maxEntries || own+group > 4*maxEntries+seShards*minSharedPrune {
		t.Errorf("%d blocks, %d own and %d group entries after 30× MaxEntries", s.Blocks, own, group)
	}
	checkConsistency(t, m)
}
