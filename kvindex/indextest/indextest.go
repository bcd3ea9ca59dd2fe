// Package indextest is a conformance suite for implementations of kvindex.KvCacheIndex, in the
// manner of testing/slogtest: call Run from a test with a constructor for your index.
//
//	func TestMyIndex(t *testing.T) {
//		indextest.Run(t, func(t *testing.T, opts indextest.Options) kvindex.KvCacheIndex {
//			ix, err := myindex.New(myindex.Config{
//				BlockSize:    opts.BlockSize,
//				DefaultModel: opts.DefaultModel,
//				EntryTTL:     opts.EntryTTL,
//				Now:          opts.Now,
//				// … the other Options fields
//			})
//			if err != nil {
//				t.Fatal(err)
//			}
//			t.Cleanup(func() { ix.Close() })
//			return ix
//		})
//	}
//
// Every subtest calls the constructor once with its own *testing.T and builds events.Event values
// directly (no decoder involved). The constructor must return an empty index configured by opts,
// isolated from every other index it returned (a remote index: a fresh key prefix), and release
// it through t.Cleanup. When it cannot honour opts (a remote store whose TTLs follow the server's
// clock cannot follow Options.Now), it calls t.Skip, which skips that subtest only.
//
// # What the suite requires
//
// Beyond the method contracts documented in package kvindex, the suite fixes these behaviours,
// which every implementation shares:
//
//   - Block keys are prefixkey's chained keys with Options.BlockSize; a BlockStored event is
//     re-keyed from its tokens, block i chained to block i−1 and block 0 to the event's parent
//     (the key the same backend's earlier event gave that engine hash) or, with no parent, to
//     prefixkey.BlockRoot(LoRA name, else Batch.Model, else Options.DefaultModel; cache salt).
//     Engine hashes are per backend: a parent known only on another backend is unknown.
//   - An engine block of r × BlockSize tokens is r keys; BlockRemoved of it removes all r.
//   - A BlockStored without tokens adds its tier to blocks that backend already stored (vLLM's
//     offloading connector announces CPU copies so); otherwise it is dropped.
//   - A block is held on every tier it was stored on and not removed from: Match.Tier counts it at
//     its best tier, Match.StoredBlocks on TierStorage when it is there, faster tiers or not (a
//     prefill engine's GPU blocks written to external storage).
//   - Events of attention groups other than 0 change nothing.
//   - Prefix-granular (SSE) entries follow kvroute's table: cache_created and cache_reloaded →
//     GPU; cache_offloaded → storage when StorageOffloading, else removed; cache_evicted →
//     storage when StorageOffloading and TreatEvictionAsOffload, else removed; cache_purged →
//     removed. LookupPrefix reports Tokens = the token count, Blocks = Tokens / BlockSize, Score =
//     Tokens × tier weight.
//   - Stats: Entries counts (block, backend) memberships (speculative ones included) plus
//     (prefix, backend) entries; Blocks distinct blocks; PerBackend the entries per live backend
//     (a cleared backend has none); Dropped["unknown_parent"] counts events dropped for an
//     unknown parent; SpeculativeCount the speculative memberships not yet expired or confirmed.
//
// The suite uses kvindex.DefaultTierWeights.
package indextest

import (
	"context"
	"fmt"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

// Options configure the index a subtest needs. The constructor maps them onto its own config.
type Options struct {
	// BlockSize is the index's block size in tokens (16 in every subtest).
	BlockSize int
	// DefaultModel roots events whose batch names no model and which name no LoRA.
	DefaultModel string
	// StorageOffloading and TreatEvictionAsOffload are kvroute's storage_offloading settings for
	// prefix-granular entries.
	StorageOffloading      bool
	TreatEvictionAsOffload bool
	// EntryTTL and SpeculativeTTL are the index's TTLs (never zero here).
	EntryTTL       time.Duration
	SpeculativeTTL time.Duration
	// TierWeights are the index's tier weights (kvindex.DefaultTierWeights).
	TierWeights kvindex.TierWeights
	// Now is the suite's fake clock; the index must read time only through it.
	Now func() time.Time
	// AdvancesClock reports that the subtest moves Now forward and expects TTLs to follow it.
	// A constructor that cannot honour that may t.Skip.
	AdvancesClock bool
}

// NewIndexFunc returns a new, empty index configured by opts (see the package doc).
type NewIndexFunc func(t *testing.T, opts Options) kvindex.KvCacheIndex

// Suite constants.
const (
	blockSize    = 16
	defaultModel = "indextest-default"
	model        = "indextest-model"
	entryTTL     = 60 * time.Second
	specTTL      = 2 * time.Second
)

// Run runs the whole suite, one subtest per behaviour, in parallel where they are independent.
func Run(t *testing.T, newIndex NewIndexFunc) {
	t.Helper()
	tests := []struct {
		name string
		fn   func(*testing.T, NewIndexFunc)
	}{
		{"StoreAndLookup", testStoreAndLookup},
		{"ConsecutiveOnly", testConsecutiveOnly},
		{"LongRequest", testLongRequest},
		{"ParentAcrossEvents", testParentAcrossEvents},
		{"UnknownParent", testUnknownParent},
		{"MultiBlockEventChaining", testMultiBlockChaining},
		{"EngineBlockMultiple", testEngineBlockMultiple},
		{"TierDowngrade", testTierDowngrade},
		{"StoredPrefix", testStoredPrefix},
		{"TokenlessStore", testTokenlessStore},
		{"AllBlocksCleared", testAllBlocksCleared},
		{"ClearBackend", testClearBackend},
		{"Roots", testRoots},
		{"ExtraKeys", testExtraKeys},
		{"GroupIdx", testGroupIdx},
		{"PrefixTransitions", testPrefixTransitions},
		{"Speculative", testSpeculative},
		{"EntryTTL", testEntryTTL},
		{"UnknownCandidates", testUnknownCandidates},
		{"Clear", testClear},
		{"Stats", testStats},
		{"Concurrent", testConcurrent},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { tc.fn(t, newIndex) })
	}
}

// fakeClock is the suite's clock: it moves only when told.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// env is one subtest's index and helpers.
type env struct {
	t     *testing.T
	ix    kvindex.KvCacheIndex
	clock *fakeClock
	opts  Options
}

// setup builds an index with the default options, changed by edit.
func setup(t *testing.T, newIndex NewIndexFunc, edit func(*Options)) *env {
	t.Helper()
	clk := &fakeClock{t: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
	opts := Options{
		BlockSize:      blockSize,
		DefaultModel:   defaultModel,
		EntryTTL:       entryTTL,
		SpeculativeTTL: specTTL,
		TierWeights:    kvindex.DefaultTierWeights(),
		Now:            clk.Now,
	}
	if edit != nil {
		edit(&opts)
	}
	ix := newIndex(t, opts)
	if ix == nil {
		t.Fatal("indextest: constructor returned a nil index")
	}
	return &env{t: t, ix: ix, clock: clk, opts: opts}
}

// tokens returns n deterministic tokens; seed varies the sequence.
func tokens(seed, n int) []uint32 {
	out := make([]uint32, n)
	x := uint64(seed)*0x9e3779b97f4a7c15 + 1
	for i := range out {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		out[i] = uint32(x % 128000)
	}
	return out
}

// keys returns the request-side block keys of toks under root (name, salt).
func keys(name, salt string, toks []uint32) []uint64 {
	return prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot(name, salt), toks, blockSize, nil)
}

// hashes returns n engine hashes base, base+1, ….
func hashes(base uint64, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = base + uint64(i)
	}
	return out
}

// stored returns a BlockStored event of len(hs) engine blocks of ebs tokens each.
func stored(hs []uint64, toks []uint32, ebs int, tier events.Tier) events.Event {
	return events.Event{Kind: events.KindBlockStored, BlockHashes: hs, TokenIDs: toks, BlockSize: ebs, Tier: tier}
}

// child is stored with a parent.
func child(parent uint64, hs []uint64, toks []uint32, ebs int, tier events.Tier) events.Event {
	ev := stored(hs, toks, ebs, tier)
	ev.Parent, ev.HasParent = parent, true
	return ev
}

func removed(hs []uint64, tier events.Tier) events.Event {
	return events.Event{Kind: events.KindBlockRemoved, BlockHashes: hs, Tier: tier}
}

func prefixEv(op events.PrefixOp, hash string, tokenCount int) events.Event {
	return events.Event{Kind: events.KindPrefix, PrefixOp: op, PrefixHash: hash, TokenCount: tokenCount}
}

// apply applies evs as one batch of model (the suite's model when ""), from backend.
func (e *env) apply(backend string, evs ...events.Event) {
	e.applyModel(backend, model, evs...)
}

func (e *env) applyModel(backend, batchModel string, evs ...events.Event) {
	e.t.Helper()
	b := &events.Batch{Model: batchModel, Events: evs}
	if err := e.ix.Apply(context.Background(), backend, b); err != nil {
		e.t.Fatalf("Apply(%q): %v", backend, err)
	}
}

// lookup returns the matches of candidates for ks.
func (e *env) lookup(ks []uint64, candidates ...string) []kvindex.Match {
	e.t.Helper()
	out := make([]kvindex.Match, len(candidates)+2)
	got, err := e.ix.Lookup(context.Background(), ks, candidates, out)
	if err != nil {
		e.t.Fatalf("Lookup: %v", err)
	}
	if len(got) != len(candidates) {
		e.t.Fatalf("Lookup returned %d matches for %d candidates", len(got), len(candidates))
	}
	for i, m := range got {
		if m.Backend != candidates[i] {
			e.t.Fatalf("Lookup: match %d is for %q, want %q", i, m.Backend, candidates[i])
		}
	}
	return got
}

// blocks returns each candidate's matched block count.
func (e *env) blocks(ks []uint64, candidates ...string) []int {
	e.t.Helper()
	ms := e.lookup(ks, candidates...)
	out := make([]int, len(ms))
	for i, m := range ms {
		out[i] = m.Blocks
	}
	return out
}

// wantBlocks checks each candidate's matched block count.
func (e *env) wantBlocks(what string, ks []uint64, candidates []string, want ...int) {
	e.t.Helper()
	got := e.blocks(ks, candidates...)
	for i := range want {
		if got[i] != want[i] {
			e.t.Errorf("%s: %s matched %d blocks, want %d (all: %v, want %v)", what, candidates[i], got[i], want[i], got, want)
			return
		}
	}
}

// wantMatch checks one candidate's full match.
func (e *env) wantMatch(what string, got, want kvindex.Match) {
	e.t.Helper()
	if got.Backend != want.Backend || got.Blocks != want.Blocks || got.Tokens != want.Tokens ||
		got.Tier != want.Tier || math.Abs(got.WeightedBlocks-want.WeightedBlocks) > 1e-9 ||
		got.StoredBlocks != want.StoredBlocks || got.StoredTokens != want.StoredTokens {
		e.t.Errorf("%s: got %+v, want %+v", what, got, want)
	}
}

func (e *env) stats() kvindex.Stats {
	e.t.Helper()
	s, err := e.ix.Stats(context.Background())
	if err != nil {
		e.t.Fatalf("Stats: %v", err)
	}
	return s
}

func gpuMatch(backend string, n int) kvindex.Match {
	return kvindex.Match{Backend: backend, Blocks: n, Tokens: n * blockSize, WeightedBlocks: float64(n), Tier: events.TierGPU}
}

func testStoreAndLookup(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	toks := tokens(1, 10*blockSize)
	e.apply("a", stored(hashes(100, 8), toks[:8*blockSize], blockSize, events.TierGPU))
	e.apply("b", stored(hashes(200, 4), toks[:4*blockSize], blockSize, events.TierGPU))
	ks := keys(model, "", toks)
	got := e.lookup(ks, "a", "b", "c")
	e.wantMatch("a", got[0], gpuMatch("a", 8))
	e.wantMatch("b", got[1], gpuMatch("b", 4))
	e.wantMatch("c (unknown)", got[2], kvindex.Match{Backend: "c"})
	// Order of candidates is the caller's; a shorter request is bounded by its length.
	e.wantBlocks("reordered", ks[:6], []string{"b", "a"}, 4, 6)
	// A request for other tokens matches nothing.
	e.wantBlocks("other tokens", keys(model, "", tokens(2, 4*blockSize)), []string{"a", "b"}, 0, 0)
	// The same engine hashes on two backends are independent.
	e.apply("c", stored(hashes(100, 2), toks[:2*blockSize], blockSize, events.TierGPU))
	e.wantBlocks("shared engine hashes", ks, []string{"a", "b", "c"}, 8, 4, 2)
}

func testConsecutiveOnly(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	toks := tokens(3, 8*blockSize)
	ks := keys(model, "", toks)
	e.apply("a", stored(hashes(100, 8), toks, blockSize, events.TierGPU))
	e.apply("b", stored(hashes(100, 8), toks, blockSize, events.TierGPU))
	e.apply("a", removed([]uint64{103}, events.TierGPU)) // a hole at block 3
	e.apply("b", removed([]uint64{100}, events.TierGPU)) // b lacks block 0
	e.wantBlocks("hole stops the match", ks, []string{"a", "b"}, 3, 0)
	// Filling the hole restores the whole chain.
	e.apply("a", child(102, []uint64{103}, toks[3*blockSize:4*blockSize], blockSize, events.TierGPU))
	e.wantBlocks("hole filled", ks, []string{"a"}, 8)
}

// storeLong stores the 16-token blocks of toks for backend in events of 16 blocks, engine hashes
// base, base+1, ….
func (e *env) storeLong(backend string, toks []uint32, base uint64, tier events.Tier) {
	e.t.Helper()
	n := len(toks) / blockSize
	for start := 0; start < n; start += 16 {
		end := min(start+16, n)
		ev := stored(hashes(base+uint64(start), end-start), toks[start*blockSize:end*blockSize], blockSize, tier)
		if start > 0 {
			ev = child(base+uint64(start-1), ev.BlockHashes, ev.TokenIDs, blockSize, tier)
		}
		e.apply(backend, ev)
	}
}

// testLongRequest checks exactness far into a long request: a hole at block 137 of 300, and a
// CPU-only island of 3 blocks, must show however the index searches.
func testLongRequest(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	toks := tokens(30, 300*blockSize)
	ks := keys(model, "", toks)
	w := kvindex.DefaultTierWeights()
	e.storeLong("full", toks, 1000, events.TierGPU)
	e.storeLong("hole", toks, 1000, events.TierGPU)
	e.apply("hole", removed([]uint64{1000 + 137}, events.TierGPU))
	e.storeLong("island", toks, 1000, events.TierGPU)
	e.storeLong("island", toks[:260*blockSize], 1000, events.TierCPU)
	e.apply("island", removed([]uint64{1000 + 201, 1000 + 202, 1000 + 203}, events.TierGPU))
	got := e.lookup(ks, "full", "hole", "island")
	e.wantMatch("full", got[0], gpuMatch("full", 300))
	e.wantMatch("hole at 137", got[1], gpuMatch("hole", 137))
	e.wantMatch("CPU island at 201..203", got[2], kvindex.Match{Backend: "island", Blocks: 300, Tokens: 300 * blockSize,
		WeightedBlocks: 297*w[events.TierGPU] + 3*w[events.TierCPU], Tier: events.TierCPU})
	// Shorter requests end inside the chain.
	e.wantBlocks("prefix of 150", ks[:150], []string{"full", "hole", "island"}, 150, 137, 150)
}

func testParentAcrossEvents(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	toks := tokens(4, 12*blockSize)
	ks := keys(model, "", toks)
	// Two batches.
	e.apply("a", stored(hashes(100, 4), toks[:4*blockSize], blockSize, events.TierGPU))
	e.apply("a", child(103, hashes(104, 4), toks[4*blockSize:8*blockSize], blockSize, events.TierGPU))
	e.wantBlocks("two batches", ks, []string{"a"}, 8)
	// Two events of one batch, the second chained to the first.
	e.apply("b",
		stored(hashes(500, 6), toks[:6*blockSize], blockSize, events.TierGPU),
		child(505, hashes(506, 6), toks[6*blockSize:], blockSize, events.TierGPU))
	e.wantBlocks("one batch", ks, []string{"b"}, 12)
	// A parent of 0 from a publisher that means "no parent" is not a parent: HasParent decides.
	e.apply("c", events.Event{Kind: events.KindBlockStored, BlockHashes: hashes(900, 2),
		TokenIDs: toks[:2*blockSize], BlockSize: blockSize, Parent: 0, HasParent: false})
	e.wantBlocks("no parent", ks, []string{"c"}, 2)
}

func testUnknownParent(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	toks := tokens(5, 8*blockSize)
	ks := keys(model, "", toks)
	e.apply("a", stored(hashes(100, 4), toks[:4*blockSize], blockSize, events.TierGPU))
	before := e.stats()
	e.apply("a", child(0xdead, hashes(104, 4), toks[4*blockSize:], blockSize, events.TierGPU))
	e.wantBlocks("unknown parent", ks, []string{"a"}, 4)
	// A parent known only on another backend is unknown here: engine hashes are per backend.
	e.apply("b", child(103, hashes(104, 4), toks[4*blockSize:], blockSize, events.TierGPU))
	e.wantBlocks("parent of another backend", ks[4:], []string{"b"}, 0)
	after := e.stats()
	if after.Entries != before.Entries {
		t.Errorf("Entries went from %d to %d: an unplaceable event was placed", before.Entries, after.Entries)
	}
	if got := after.Dropped["unknown_parent"] - before.Dropped["unknown_parent"]; got != 2 {
		t.Errorf(`Dropped["unknown_parent"] grew by %d, want 2`, got)
	}
}

func testMultiBlockChaining(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	toks := tokens(6, 16*blockSize)
	ks := keys(model, "", toks)
	e.apply("a", stored(hashes(100, 8), toks[:8*blockSize], blockSize, events.TierGPU))
	// Block i of an event chains to block i−1, not to the event's parent.
	e.apply("a", child(107, hashes(108, 8), toks[8*blockSize:], blockSize, events.TierGPU))
	e.wantBlocks("multi-block events", ks, []string{"a"}, 16)
	// Every block is individually removable by its engine hash.
	e.apply("a", removed([]uint64{112}, events.TierGPU))
	e.wantBlocks("after removing block 12", ks, []string{"a"}, 12)
}

func testEngineBlockMultiple(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	const ebs = 4 * blockSize // engine blocks of 64 tokens
	toks := tokens(7, 4*ebs)
	ks := keys(model, "", toks)
	e.apply("a", stored(hashes(100, 2), toks[:2*ebs], ebs, events.TierGPU))
	got := e.lookup(ks, "a")
	e.wantMatch("two engine blocks", got[0], gpuMatch("a", 8))
	e.apply("a", child(101, hashes(102, 1), toks[2*ebs:3*ebs], ebs, events.TierGPU))
	e.wantBlocks("chained to an engine block", ks, []string{"a"}, 12)
	// Removing engine block 1 removes our blocks 4..7.
	e.apply("a", removed([]uint64{101}, events.TierGPU))
	e.wantBlocks("after removing engine block 1", ks, []string{"a"}, 4)
	// An engine block that is not a multiple of the index's block size is not placed.
	e.apply("b", stored(hashes(300, 1), toks[:24], 24, events.TierGPU))
	e.wantBlocks("engine block of 24 tokens", ks, []string{"b"}, 0)
	// A token count that does not match the hashes is not placed either.
	e.apply("b", stored(hashes(300, 2), toks[:3*blockSize], blockSize, events.TierGPU))
	e.wantBlocks("bad token count", ks, []string{"b"}, 0)
}

func testTierDowngrade(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	toks := tokens(8, 4*blockSize)
	ks := keys(model, "", toks)
	w := kvindex.DefaultTierWeights()
	e.apply("a", stored(hashes(100, 4), toks, blockSize, events.TierGPU))
	e.apply("a", stored(hashes(100, 4), toks, blockSize, events.TierCPU))
	e.wantMatch("GPU+CPU", e.lookup(ks, "a")[0], gpuMatch("a", 4))

	e.apply("a", removed([]uint64{102}, events.TierGPU))
	e.wantMatch("block 2 on CPU only", e.lookup(ks, "a")[0], kvindex.Match{
		Backend: "a", Blocks: 4, Tokens: 4 * blockSize, WeightedBlocks: 3*w[events.TierGPU] + w[events.TierCPU], Tier: events.TierCPU})

	e.apply("a", removed(hashes(100, 4), events.TierGPU))
	e.wantMatch("CPU only", e.lookup(ks, "a")[0], kvindex.Match{
		Backend: "a", Blocks: 4, Tokens: 4 * blockSize, WeightedBlocks: 4 * w[events.TierCPU], Tier: events.TierCPU})

	// Removing a tier the block is not on changes nothing.
	e.apply("a", removed(hashes(100, 4), events.TierStorage))
	e.wantBlocks("remove absent tier", ks, []string{"a"}, 4)

	e.apply("a", removed(hashes(100, 4), events.TierCPU))
	e.wantBlocks("removed from every tier", ks, []string{"a"}, 0)
	// Its engine hashes are forgotten: a child of them is unplaceable.
	e.apply("a", child(103, hashes(104, 1), tokens(9, blockSize), blockSize, events.TierGPU))
	if s := e.stats(); s.PerBackend["a"] != 0 {
		t.Errorf("PerBackend[a] = %d after removing everything, want 0", s.PerBackend["a"])
	}

	// Storage tier, and the slowest tier of a mixed prefix.
	e.apply("b", stored(hashes(200, 2), toks[:2*blockSize], blockSize, events.TierCPU))
	e.apply("b", child(201, hashes(202, 2), toks[2*blockSize:], blockSize, events.TierStorage))
	e.wantMatch("CPU then storage", e.lookup(ks, "b")[0], kvindex.Match{
		Backend: "b", Blocks: 4, Tokens: 4 * blockSize, WeightedBlocks: 2*w[events.TierCPU] + 2*w[events.TierStorage], Tier: events.TierStorage})
}

// storedMatch is a match of n blocks, the first gpu of them on GPU and the rest on storage only,
// whose first stored blocks are on storage (their faster copies aside).
func storedMatch(backend string, n, gpu, stored int) kvindex.Match {
	w := kvindex.DefaultTierWeights()
	m := kvindex.Match{Backend: backend, Blocks: n, Tokens: n * blockSize, Tier: events.TierGPU,
		StoredBlocks: stored, StoredTokens: stored * blockSize}
	m.WeightedBlocks = float64(gpu)*w[events.TierGPU] + float64(n-gpu)*w[events.TierStorage]
	if gpu < n {
		m.Tier = events.TierStorage
	}
	return m
}

// testStoredPrefix checks Match.StoredBlocks: the longest prefix a backend holds on the storage
// tier, whether or not it also holds it on a faster one (a prefill engine of disaggregated serving
// keeps a prompt on its GPU and writes it to external storage: a BlockStored on GPU, then one on
// storage), ended by the first block missing from storage. Tier and Score stay those of each
// block's best tier.
func testStoredPrefix(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	toks := tokens(40, 300*blockSize)
	ks := keys(model, "", toks)
	// 300 blocks on GPU, the first 137 (ending inside a run of 16) written to storage too.
	e.storeLong("prefill", toks, 1000, events.TierGPU)
	e.storeLong("prefill", toks[:137*blockSize], 1000, events.TierStorage)
	// 100 blocks on storage only.
	e.storeLong("storage", toks[:100*blockSize], 1000, events.TierStorage)
	// 300 blocks on GPU, and another prompt on storage.
	e.storeLong("elsewhere", toks, 1000, events.TierGPU)
	e.storeLong("elsewhere", tokens(41, 40*blockSize), 5000, events.TierStorage)
	// A prefix on storage whose first block is on CPU only (no stored prefix).
	e.storeLong("cpu-first", toks[:blockSize], 1000, events.TierCPU)
	e.apply("cpu-first", child(1000, hashes(1001, 31), toks[blockSize:32*blockSize], blockSize, events.TierStorage))
	got := e.lookup(ks, "prefill", "storage", "elsewhere", "cpu-first", "unknown")
	e.wantMatch("GPU 300, storage 137", got[0], storedMatch("prefill", 300, 300, 137))
	e.wantMatch("storage only", got[1], storedMatch("storage", 100, 0, 100))
	e.wantMatch("storage for another prompt", got[2], storedMatch("elsewhere", 300, 300, 0))
	w := kvindex.DefaultTierWeights()
	e.wantMatch("CPU block 0, then storage", got[3], kvindex.Match{Backend: "cpu-first", Blocks: 32, Tokens: 32 * blockSize,
		WeightedBlocks: w[events.TierCPU] + 31*w[events.TierStorage], Tier: events.TierStorage})
	e.wantMatch("unknown backend", got[4], kvindex.Match{Backend: "unknown"})

	// A shorter request bounds the stored prefix.
	for _, n := range []int{137, 100, 20, 9} {
		got := e.lookup(ks[:n], "prefill", "storage")
		e.wantMatch(fmt.Sprintf("prefill, request of %d", n), got[0], storedMatch("prefill", n, n, n))
		e.wantMatch(fmt.Sprintf("storage, request of %d", n), got[1], storedMatch("storage", min(n, 100), 0, min(n, 100)))
	}
	// The rest written to storage too; then the GPU copies of the last 100 blocks freed.
	e.storeLong("prefill", toks, 1000, events.TierStorage)
	e.wantMatch("all on GPU and storage", e.lookup(ks, "prefill")[0], storedMatch("prefill", 300, 300, 300))
	e.apply("prefill", removed(hashes(1200, 100), events.TierGPU))
	e.wantMatch("last 100 on storage only", e.lookup(ks, "prefill")[0], storedMatch("prefill", 300, 200, 300))

	// A hole in the storage copy ends the stored prefix, not the match.
	short := tokens(42, 8*blockSize)
	sk := keys(model, "", short)
	e.apply("hole", stored(hashes(7000, 8), short, blockSize, events.TierGPU))
	e.apply("hole", stored(hashes(7000, 8), short, blockSize, events.TierStorage))
	e.wantMatch("8 on GPU and storage", e.lookup(sk, "hole")[0], storedMatch("hole", 8, 8, 8))
	e.apply("hole", removed([]uint64{7005}, events.TierStorage))
	e.wantMatch("storage hole at 5", e.lookup(sk, "hole")[0], storedMatch("hole", 8, 8, 5))
	e.apply("hole", removed([]uint64{7000}, events.TierStorage))
	e.wantMatch("storage hole at 0", e.lookup(sk, "hole")[0], storedMatch("hole", 8, 8, 0))
	// A hole on every tier ends both.
	e.apply("hole", stored(hashes(7000, 8), short, blockSize, events.TierStorage))
	e.apply("hole", removed([]uint64{7002}, events.TierGPU), removed([]uint64{7002}, events.TierStorage))
	e.wantMatch("hole at 2", e.lookup(sk, "hole")[0], storedMatch("hole", 2, 2, 2))
}

func testTokenlessStore(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	toks := tokens(10, 4*blockSize)
	ks := keys(model, "", toks)
	e.apply("a", stored(hashes(100, 4), toks, blockSize, events.TierGPU))
	// vLLM's offloading connector announces the CPU copy with hashes only.
	e.apply("a", events.Event{Kind: events.KindBlockStored, BlockHashes: hashes(100, 4), Tier: events.TierCPU})
	e.apply("a", removed(hashes(100, 4), events.TierGPU))
	got := e.lookup(ks, "a")[0]
	if got.Blocks != 4 || got.Tier != events.TierCPU {
		t.Errorf("after a tokenless CPU store and GPU removal: %+v, want 4 blocks on CPU", got)
	}
	// Hashes the backend never stored with tokens cannot be placed.
	e.apply("b", events.Event{Kind: events.KindBlockStored, BlockHashes: hashes(100, 4), Tier: events.TierCPU})
	e.wantBlocks("tokenless unknown", ks, []string{"b"}, 0)
}

func testAllBlocksCleared(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	toks := tokens(11, 8*blockSize)
	ks := keys(model, "", toks)
	e.apply("a", stored(hashes(100, 4), toks[:4*blockSize], blockSize, events.TierGPU))
	e.apply("a", stored(hashes(100, 4), toks[:4*blockSize], blockSize, events.TierCPU))
	e.apply("a", prefixEv(events.PrefixCreated, "abcd", 64))
	e.apply("b", stored(hashes(100, 4), toks[:4*blockSize], blockSize, events.TierGPU))
	e.apply("a", events.Event{Kind: events.KindAllBlocksCleared})
	e.wantBlocks("after AllBlocksCleared", ks, []string{"a", "b"}, 0, 4)
	if m := e.lookupPrefix("abcd", "a")[0]; m.Tokens != 0 {
		t.Errorf("prefix entry survived AllBlocksCleared: %+v", m)
	}
	if s := e.stats(); s.PerBackend["a"] != 0 {
		t.Errorf("PerBackend[a] = %d after AllBlocksCleared, want 0", s.PerBackend["a"])
	}
	// The cleared backend's engine hashes are forgotten.
	e.apply("a", child(103, hashes(104, 4), toks[4*blockSize:], blockSize, events.TierGPU))
	e.wantBlocks("child of a cleared block", ks[4:], []string{"a"}, 0)
	// Events after AllBlocksCleared in the same batch apply to the emptied state.
	e.apply("b",
		events.Event{Kind: events.KindAllBlocksCleared},
		stored(hashes(100, 2), toks[:2*blockSize], blockSize, events.TierGPU))
	e.wantBlocks("store after clear in one batch", ks, []string{"b"}, 2)
	// And the backend starts again from a root.
	e.apply("a", stored(hashes(700, 8), toks, blockSize, events.TierGPU))
	e.wantBlocks("restored", ks, []string{"a"}, 8)
}

func (e *env) lookupPrefix(prefix string, candidates ...string) []kvindex.Match {
	e.t.Helper()
	out := make([]kvindex.Match, len(candidates))
	got, err := e.ix.LookupPrefix(context.Background(), prefix, candidates, out)
	if err != nil {
		e.t.Fatalf("LookupPrefix: %v", err)
	}
	if len(got) != len(candidates) {
		e.t.Fatalf("LookupPrefix returned %d matches for %d candidates", len(got), len(candidates))
	}
	return got
}

func testClearBackend(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	ctx := context.Background()
	toks := tokens(12, 8*blockSize)
	ks := keys(model, "", toks)
	e.apply("a", stored(hashes(100, 8), toks, blockSize, events.TierGPU))
	e.apply("b", stored(hashes(100, 8), toks, blockSize, events.TierGPU))
	if err := e.ix.Speculate(ctx, "a", keys(model, "", tokens(13, 4*blockSize)), 0); err != nil {
		t.Fatal(err)
	}
	if err := e.ix.ClearBackend(ctx, "a"); err != nil {
		t.Fatalf("ClearBackend: %v", err)
	}
	e.wantBlocks("after ClearBackend", ks, []string{"a", "b"}, 0, 8)
	e.wantBlocks("speculative entries cleared", keys(model, "", tokens(13, 4*blockSize)), []string{"a"}, 0)
	if s := e.stats(); s.PerBackend["a"] != 0 || s.PerBackend["b"] != 8 {
		t.Errorf("PerBackend after ClearBackend(a) = %v, want a:0 b:8", s.PerBackend)
	}
	if err := e.ix.ClearBackend(ctx, "never-seen"); err != nil {
		t.Errorf("ClearBackend of an unknown backend: %v", err)
	}
	// A cleared backend can be filled again; its old engine hashes are gone.
	e.apply("a", child(103, hashes(104, 1), toks[4*blockSize:5*blockSize], blockSize, events.TierGPU))
	e.wantBlocks("old parent", ks[4:], []string{"a"}, 0)
	e.apply("a", stored(hashes(100, 3), toks[:3*blockSize], blockSize, events.TierGPU))
	e.wantBlocks("refilled", ks, []string{"a", "b"}, 3, 8)
}

func testRoots(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	toks := tokens(14, 4*blockSize)
	byModel := stored(hashes(100, 4), toks, blockSize, events.TierGPU)
	byLoRA := byModel
	byLoRA.LoRAName = "adapter-x"
	bySalt := byModel
	bySalt.CacheSalt = "tenant-salt"
	e.applyModel("model", model, byModel)
	e.applyModel("lora", model, byLoRA)
	e.applyModel("salt", model, bySalt)
	e.applyModel("default", "", byModel)
	cands := []string{"model", "lora", "salt", "default"}
	e.wantBlocks("model root", keys(model, "", toks), cands, 4, 0, 0, 0)
	e.wantBlocks("LoRA root", keys("adapter-x", "", toks), cands, 0, 4, 0, 0)
	e.wantBlocks("salted root", keys(model, "tenant-salt", toks), cands, 0, 0, 4, 0)
	e.wantBlocks("default model root", keys(defaultModel, "", toks), cands, 0, 0, 0, 4)
	// A child inherits its parent's root.
	more := tokens(15, 2*blockSize)
	e.applyModel("lora", "", child(103, hashes(104, 2), more, blockSize, events.TierGPU))
	e.wantBlocks("LoRA child", keys("adapter-x", "", append(append([]uint32{}, toks...), more...)), []string{"lora"}, 6)
}

func testExtraKeys(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	toks := tokens(16, 4*blockSize)
	img := events.ExtraKeyHash("image-sha256-1")
	ev := stored(hashes(100, 4), toks, blockSize, events.TierGPU)
	ev.ExtraKeys = [][]uint64{nil, {img}, {img}, nil}
	e.apply("a", ev)
	root := prefixkey.BlockRoot(model, "")
	withImage := prefixkey.AppendBlockKeys(nil, root, toks, blockSize,
		[]prefixkey.MultiModalSpan{{Offset: blockSize + 3, Length: blockSize, Hash: img}})
	other := prefixkey.AppendBlockKeys(nil, root, toks, blockSize,
		[]prefixkey.MultiModalSpan{{Offset: blockSize + 3, Length: blockSize, Hash: events.ExtraKeyHash("image-sha256-2")}})
	e.wantBlocks("same image", withImage, []string{"a"}, 4)
	e.wantBlocks("other image", other, []string{"a"}, 1)
	e.wantBlocks("no image", keys(model, "", toks), []string{"a"}, 1)
}

func testGroupIdx(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	toks := tokens(17, 4*blockSize)
	ks := keys(model, "", toks)
	sw := stored(hashes(100, 4), toks, blockSize, events.TierGPU)
	sw.GroupIdx = 1
	e.apply("a", sw)
	e.wantBlocks("group 1 stored", ks, []string{"a"}, 0)
	e.apply("a", stored(hashes(100, 4), toks, blockSize, events.TierGPU))
	rm := removed(hashes(100, 4), events.TierGPU)
	rm.GroupIdx = 1
	e.apply("a", rm)
	e.wantBlocks("group 1 removed", ks, []string{"a"}, 4)
}

func testPrefixTransitions(t *testing.T, newIndex NewIndexFunc) {
	const (
		created   = events.PrefixCreated
		evicted   = events.PrefixEvicted
		offloaded = events.PrefixOffloaded
		reloaded  = events.PrefixReloaded
		purged    = events.PrefixPurged
	)
	type state int
	const (
		absent state = iota
		gpu
		storage
	)
	settings := []struct {
		name                   string
		storageOffloading      bool
		treatEvictionAsOffload bool
	}{
		{"offloading/evict_as_offload", true, true},
		{"offloading/evict_removes", true, false},
		{"no_offloading/evict_as_offload", false, true},
		{"no_offloading", false, false},
	}
	for _, st := range settings {
		// What evicted and offloaded lead to under these settings.
		onOffload, onEvict := absent, absent
		if st.storageOffloading {
			onOffload = storage
			if st.treatEvictionAsOffload {
				onEvict = storage
			}
		}
		cases := []struct {
			name string
			ops  []events.PrefixOp
			want state
		}{
			{"created", []events.PrefixOp{created}, gpu},
			{"offloaded", []events.PrefixOp{created, offloaded}, onOffload},
			{"reloaded", []events.PrefixOp{created, offloaded, reloaded}, gpu},
			{"evicted", []events.PrefixOp{created, evicted}, onEvict},
			{"purged", []events.PrefixOp{created, purged}, absent},
			{"offloaded_then_purged", []events.PrefixOp{created, offloaded, purged}, absent},
			{"evicted_then_reloaded", []events.PrefixOp{created, evicted, reloaded}, gpu},
			{"evicted_twice", []events.PrefixOp{created, evicted, evicted}, onEvict},
		}
		t.Run(st.name, func(t *testing.T) {
			e := setup(t, newIndex, func(o *Options) {
				o.StorageOffloading = st.storageOffloading
				o.TreatEvictionAsOffload = st.treatEvictionAsOffload
			})
			w := kvindex.DefaultTierWeights()
			for i, tc := range cases {
				prefix := fmt.Sprintf("9f2c%04x", i)
				for _, op := range tc.ops {
					e.apply("a", prefixEv(op, prefix, 2048))
				}
				e.apply("b", prefixEv(created, prefix, 512)) // another backend, untouched
				got := e.lookupPrefix(prefix, "a", "b", "c")
				want := kvindex.Match{Backend: "a"}
				switch tc.want {
				case gpu:
					want = kvindex.Match{Backend: "a", Blocks: 2048 / blockSize, Tokens: 2048, WeightedBlocks: 2048 * w[events.TierGPU], Tier: events.TierGPU}
				case storage:
					want = kvindex.Match{Backend: "a", Blocks: 2048 / blockSize, Tokens: 2048, WeightedBlocks: 2048 * w[events.TierStorage], Tier: events.TierStorage,
						StoredBlocks: 2048 / blockSize, StoredTokens: 2048}
				}
				e.wantMatch(tc.name, got[0], want)
				e.wantMatch(tc.name+" (other backend)", got[1], kvindex.Match{Backend: "b", Blocks: 32, Tokens: 512, WeightedBlocks: 512, Tier: events.TierGPU})
				e.wantMatch(tc.name+" (unknown backend)", got[2], kvindex.Match{Backend: "c"})
			}
			// A later event updates the token count.
			e.apply("a", prefixEv(created, "beef", 512), prefixEv(created, "beef", 1024))
			if got := e.lookupPrefix("beef", "a")[0]; got.Tokens != 1024 {
				t.Errorf("token count after an update = %d, want 1024", got.Tokens)
			}
			if got := e.lookupPrefix("unknown-prefix", "a")[0]; got != (kvindex.Match{Backend: "a"}) {
				t.Errorf("unknown prefix: %+v", got)
			}
		})
	}
}

func testSpeculative(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, func(o *Options) { o.AdvancesClock = true })
	ctx := context.Background()
	toks := tokens(18, 8*blockSize)
	ks := keys(model, "", toks)

	if err := e.ix.Speculate(ctx, "a", ks[:4], 0); err != nil {
		t.Fatalf("Speculate: %v", err)
	}
	e.wantMatch("speculative", e.lookup(ks, "a")[0], gpuMatch("a", 4))
	if s := e.stats(); s.SpeculativeCount != 4 || s.PerBackend["a"] != 4 {
		t.Errorf("after speculating 4 blocks: SpeculativeCount %d, PerBackend[a] %d; want 4, 4", s.SpeculativeCount, s.PerBackend["a"])
	}
	e.clock.Advance(specTTL + time.Second)
	e.wantBlocks("speculative expired", ks, []string{"a"}, 0)

	// Confirmed by a BlockStored: an ordinary entry, which outlives the speculative TTL.
	if err := e.ix.Speculate(ctx, "b", ks[:4], 0); err != nil {
		t.Fatal(err)
	}
	e.apply("b", stored(hashes(100, 4), toks[:4*blockSize], blockSize, events.TierGPU))
	if s := e.stats(); s.SpeculativeCount != 0 || s.PerBackend["b"] != 4 {
		t.Errorf("after confirmation: SpeculativeCount %d, PerBackend[b] %d; want 0, 4", s.SpeculativeCount, s.PerBackend["b"])
	}
	e.clock.Advance(specTTL + time.Second)
	e.wantBlocks("confirmed", ks, []string{"b"}, 4)

	// Speculation extends a confirmed prefix; the extension expires, the prefix stays.
	if err := e.ix.Speculate(ctx, "b", ks, 0); err != nil {
		t.Fatal(err)
	}
	e.wantBlocks("extended", ks, []string{"b"}, 8)
	e.clock.Advance(specTTL + time.Second)
	e.wantBlocks("extension expired", ks, []string{"b"}, 4)

	// An explicit TTL.
	if err := e.ix.Speculate(ctx, "c", ks[:2], 10*time.Second); err != nil {
		t.Fatal(err)
	}
	e.clock.Advance(5 * time.Second)
	e.wantBlocks("explicit ttl, alive", ks, []string{"c"}, 2)
	e.clock.Advance(6 * time.Second)
	e.wantBlocks("explicit ttl, expired", ks, []string{"c"}, 0)
}

func testEntryTTL(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, func(o *Options) { o.AdvancesClock = true })
	toks := tokens(19, 4*blockSize)
	ks := keys(model, "", toks)
	e.apply("a", stored(hashes(100, 4), toks, blockSize, events.TierGPU))
	e.apply("a", prefixEv(events.PrefixCreated, "cafe", 256))
	e.clock.Advance(entryTTL / 2)
	e.wantBlocks("within the TTL", ks, []string{"a"}, 4)
	if got := e.lookupPrefix("cafe", "a")[0]; got.Tokens != 256 {
		t.Errorf("prefix entry within the TTL: %+v, want its 256 tokens", got)
	}
	e.clock.Advance(entryTTL/2 + 5*time.Second) // implementations may round expiry up a little
	e.wantBlocks("past the TTL", ks, []string{"a"}, 0)
	if got := e.lookupPrefix("cafe", "a")[0]; got.Tokens != 0 {
		t.Errorf("prefix entry past the TTL: %+v", got)
	}
	// Stored again: held again.
	e.apply("a", stored(hashes(100, 4), toks, blockSize, events.TierGPU))
	e.wantBlocks("stored again", ks, []string{"a"}, 4)
}

func testUnknownCandidates(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	toks := tokens(20, 4*blockSize)
	ks := keys(model, "", toks)
	got := e.lookup(ks, "x", "y")
	for _, m := range got {
		e.wantMatch("empty index", m, kvindex.Match{Backend: m.Backend})
	}
	e.apply("a", stored(hashes(100, 4), toks, blockSize, events.TierGPU))
	got = e.lookup(ks, "x", "a", "x")
	e.wantMatch("unknown", got[0], kvindex.Match{Backend: "x"})
	e.wantMatch("known", got[1], gpuMatch("a", 4))
	e.wantMatch("unknown repeated", got[2], kvindex.Match{Backend: "x"})
	// No keys, no candidates.
	for _, m := range e.lookup(nil, "a") {
		e.wantMatch("no keys", m, kvindex.Match{Backend: "a"})
	}
	if got := e.lookup(ks); len(got) != 0 {
		t.Errorf("no candidates: %d matches", len(got))
	}
	// Stale values in out are overwritten.
	out := []kvindex.Match{{Backend: "junk", Blocks: 9, Tokens: 9, WeightedBlocks: 9, Tier: events.TierStorage}}
	res, err := e.ix.Lookup(context.Background(), ks, []string{"x"}, out)
	if err != nil || len(res) != 1 || res[0] != (kvindex.Match{Backend: "x"}) {
		t.Errorf("reused out: %+v, %v", res, err)
	}
}

func testClear(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	toks := tokens(21, 4*blockSize)
	ks := keys(model, "", toks)
	e.apply("a", stored(hashes(100, 4), toks, blockSize, events.TierGPU))
	e.apply("b", stored(hashes(100, 2), toks[:2*blockSize], blockSize, events.TierGPU))
	e.apply("a", prefixEv(events.PrefixCreated, "f00d", 128))
	want := e.stats().Entries
	n, err := e.ix.Clear(context.Background())
	if err != nil {
		t.Fatalf("Clear: %v", err)
	}
	if n != want || want != 7 {
		t.Errorf("Clear dropped %d entries, Stats said %d, want 7", n, want)
	}
	e.wantBlocks("after Clear", ks, []string{"a", "b"}, 0, 0)
	if got := e.lookupPrefix("f00d", "a")[0]; got.Tokens != 0 {
		t.Errorf("prefix after Clear: %+v", got)
	}
	if s := e.stats(); s.Entries != 0 || s.PrefixCount != 0 {
		t.Errorf("after Clear: Entries %d, PrefixCount %d", s.Entries, s.PrefixCount)
	}
	// Engine maps are cleared too: a child of a cleared block is unplaceable.
	e.apply("a", child(103, hashes(104, 1), tokens(22, blockSize), blockSize, events.TierGPU))
	if s := e.stats(); s.Entries != 0 {
		t.Errorf("child of a cleared block was placed: Entries %d", s.Entries)
	}
}

func testStats(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	toks := tokens(23, 8*blockSize)
	ks := keys(model, "", toks)
	s := e.stats()
	if s.Backend == "" || s.Blocks != 0 || s.Entries != 0 {
		t.Errorf("empty index stats: %+v", s)
	}
	e.apply("a", stored(hashes(100, 8), toks, blockSize, events.TierGPU))
	e.apply("a", stored(hashes(100, 8), toks, blockSize, events.TierCPU)) // same memberships, another tier
	e.apply("b", stored(hashes(100, 4), toks[:4*blockSize], blockSize, events.TierGPU))
	e.apply("b", prefixEv(events.PrefixCreated, "abba", 64))
	e.lookup(ks, "a", "b")
	s = e.stats()
	if s.Blocks != 8 || s.Entries != 13 || s.PrefixCount != 1 ||
		s.PerBackend["a"] != 8 || s.PerBackend["b"] != 5 || s.Lookups < 1 {
		t.Errorf("stats: Blocks %d (want 8), Entries %d (13), PrefixCount %d (1), PerBackend %v (a:8 b:5), Lookups %d (≥1)",
			s.Blocks, s.Entries, s.PrefixCount, s.PerBackend, s.Lookups)
	}
}

func testConcurrent(t *testing.T, newIndex NewIndexFunc) {
	e := setup(t, newIndex, nil)
	ctx := context.Background()
	const (
		writers = 4
		rounds  = 50
		blocks  = 16
	)
	toks := make([][]uint32, writers)
	ks := make([][]uint64, writers)
	for w := range writers {
		toks[w] = tokens(100+w, blocks*blockSize)
		ks[w] = keys(model, "", toks[w])
	}
	names := []string{"w0", "w1", "w2", "w3"}
	var wg sync.WaitGroup
	errs := make(chan error, 3*writers)
	for w := range writers {
		wg.Add(3)
		go func() { // events
			defer wg.Done()
			for r := range rounds {
				b := &events.Batch{Model: model, Events: []events.Event{
					stored(hashes(1000, blocks/2), toks[w][:blocks/2*blockSize], blockSize, events.TierGPU),
					child(1000+blocks/2-1, hashes(1000+blocks/2, blocks/2), toks[w][blocks/2*blockSize:], blockSize, events.TierGPU),
				}}
				if r%10 == 9 {
					b.Events = append(b.Events, removed(hashes(1000+blocks/2, blocks/2), events.TierGPU))
				}
				if err := e.ix.Apply(ctx, names[w], b); err != nil {
					errs <- err
					return
				}
			}
			// Leave the whole chain stored.
			b := &events.Batch{Model: model, Events: []events.Event{stored(hashes(1000, blocks), toks[w], blockSize, events.TierGPU)}}
			if err := e.ix.Apply(ctx, names[w], b); err != nil {
				errs <- err
			}
		}()
		go func() { // lookups
			defer wg.Done()
			out := make([]kvindex.Match, len(names))
			for range rounds {
				got, err := e.ix.Lookup(ctx, ks[w], names, out)
				if err != nil {
					errs <- err
					return
				}
				for _, m := range got {
					if m.Blocks < 0 || m.Blocks > blocks || m.WeightedBlocks > float64(m.Blocks)+1e-9 {
						errs <- fmt.Errorf("impossible match %+v", m)
						return
					}
				}
			}
		}()
		go func() { // speculation and stats
			defer wg.Done()
			for range rounds {
				if err := e.ix.Speculate(ctx, names[(w+1)%writers], ks[w][:4], time.Millisecond); err != nil {
					errs <- err
					return
				}
				if _, err := e.ix.Stats(ctx); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for w := range writers {
		e.wantBlocks(fmt.Sprintf("final state of %s", names[w]), ks[w], names[w:w+1], blocks)
	}
}
