package mapindex_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/kvindex/indextest"
	"github.com/kvroute/kvroute/prefixkey"

	"example.com/thirdparty/mapindex"
)

func TestConformance(t *testing.T) {
	indextest.Run(t, func(t *testing.T, o indextest.Options) kvindex.KvCacheIndex {
		ix, err := mapindex.New(mapindex.Config{
			BlockSize:              o.BlockSize,
			DefaultModel:           o.DefaultModel,
			EntryTTL:               o.EntryTTL,
			SpeculativeTTL:         o.SpeculativeTTL,
			TierWeights:            o.TierWeights,
			StorageOffloading:      o.StorageOffloading,
			TreatEvictionAsOffload: o.TreatEvictionAsOffload,
			Now:                    o.Now,
		})
		if err != nil {
			t.Fatal(err)
		}
		return ix
	})
}

// clock is a manual clock.
type clock struct{ t time.Time }

func (c *clock) Now() time.Time { return c.t }

func TestSweep(t *testing.T) {
	ctx := context.Background()
	clk := &clock{t: time.Unix(1_700_000_000, 0)}
	ix, err := mapindex.New(mapindex.Config{EntryTTL: time.Minute, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	toks := make([]uint32, 4*16)
	for i := range toks {
		toks[i] = uint32(i)
	}
	b := &events.Batch{Model: "m", Events: []events.Event{
		{Kind: events.KindBlockStored, BlockHashes: []uint64{1, 2, 3, 4}, TokenIDs: toks, BlockSize: 16},
		{Kind: events.KindPrefix, PrefixOp: events.PrefixCreated, PrefixHash: "ABCD", TokenCount: 64},
	}}
	if err := ix.Apply(ctx, "a", b); err != nil {
		t.Fatal(err)
	}
	if err := ix.Speculate(ctx, "b", []uint64{42}, time.Second); err != nil {
		t.Fatal(err)
	}
	if n := ix.Sweep(); n != 0 {
		t.Errorf("Sweep of a fresh index removed %d", n)
	}
	m, _ := ix.LookupPrefix(ctx, "abcd", []string{"a"}, nil)
	if m[0].Tokens != 64 {
		t.Errorf("prefix hashes are case-insensitive: %+v", m[0])
	}
	clk.t = clk.t.Add(2 * time.Minute)
	if n := ix.Sweep(); n != 6 {
		t.Errorf("Sweep removed %d, want 6 (4 blocks, 1 prefix, 1 speculative)", n)
	}
	// The engine hashes went with the blocks: a child of them is unplaceable.
	child := events.Event{Kind: events.KindBlockStored, BlockHashes: []uint64{5}, TokenIDs: toks[:16], BlockSize: 16,
		Parent: 4, HasParent: true}
	if err := ix.Apply(ctx, "a", &events.Batch{Model: "m", Events: []events.Event{child}}); err != nil {
		t.Fatal(err)
	}
	s, _ := ix.Stats(ctx)
	if s.Entries != 0 || s.Expired != 6 || s.Dropped[kvindex.DropUnknownParent.String()] != 1 {
		t.Errorf("Stats after Sweep: %+v", s)
	}
	if _, err := mapindex.New(mapindex.Config{BlockSize: -1}); !errors.Is(err, mapindex.ErrInvalidConfig) {
		t.Errorf("New(BlockSize -1) = %v", err)
	}
}

// The index behind a default Router's tier 4: an engine's event decides where the next request
// with that prompt goes, and the Router's speculation is visible to the next one before any event.
func TestWithDefaultRouter(t *testing.T) {
	ctx := context.Background()
	ix, err := mapindex.New(mapindex.Config{})
	if err != nil {
		t.Fatal(err)
	}
	r, err := kvroute.New(kvroute.Config{
		Backends: []kvroute.Backend{{Name: "a"}, {Name: "b"}, {Name: "c"}},
		KV:       &kvroute.KVConfig{Index: ix},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	prompt := make([]uint32, 32*16)
	for i := range prompt {
		prompt[i] = uint32(1000 + i)
	}
	// Engine b reports the prompt's blocks as stored, in engine blocks of 64 tokens.
	ev := events.Event{Kind: events.KindBlockStored, BlockHashes: []uint64{11, 12, 13, 14, 15, 16, 17, 18},
		TokenIDs: prompt, BlockSize: 64}
	if err := ix.Apply(ctx, "b", &events.Batch{Model: "llama", Events: []events.Event{ev}}); err != nil {
		t.Fatal(err)
	}
	d, err := r.Route(ctx, &prefixkey.Request{Model: "llama", TokenIDs: prompt})
	if err != nil {
		t.Fatal(err)
	}
	if d.Backend != "b" || d.Reason != kvroute.ReasonKVAware || d.ExpectedCachedTokens != len(prompt) {
		t.Errorf("Route = %s (%s, %d cached); want b, kv_aware, %d", d.Backend, d.Reason, d.ExpectedCachedTokens, len(prompt))
	}
	d.Done(kvroute.Outcome{})

	other := make([]uint32, 8*16)
	for i := range other {
		other[i] = uint32(5000 + i)
	}
	first, err := r.Route(ctx, &prefixkey.Request{Model: "llama", TokenIDs: other})
	if err != nil {
		t.Fatal(err)
	}
	first.Done(kvroute.Outcome{})
	second, err := r.Route(ctx, &prefixkey.Request{Model: "llama", TokenIDs: other})
	if err != nil {
		t.Fatal(err)
	}
	second.Done(kvroute.Outcome{})
	if second.Backend != first.Backend || second.Reason != kvroute.ReasonKVAware {
		t.Errorf("a new prompt went to %s, then %s (%s): speculation did not reach the index",
			first.Backend, second.Backend, second.Reason)
	}
	st, err := r.Stats(ctx)
	if err != nil || st.Index == nil || st.Index.Backend != "map" || st.Index.SpeculativeCount == 0 {
		t.Errorf("Stats().Index = %+v, %v", st.Index, err)
	}
}

// An engine that stores a child holds the chain before it: storing the child keeps the ancestors,
// which the engine does not announce again, as fresh as the child.
func TestChildRefreshesAncestors(t *testing.T) {
	ctx := context.Background()
	clk := &clock{t: time.Unix(1_700_000_000, 0)}
	ix, err := mapindex.New(mapindex.Config{EntryTTL: time.Minute, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	toks := make([]uint32, 6*16)
	for i := range toks {
		toks[i] = uint32(7 * i)
	}
	apply := func(ev events.Event) {
		t.Helper()
		if err := ix.Apply(ctx, "a", &events.Batch{Model: "m", Events: []events.Event{ev}}); err != nil {
			t.Fatal(err)
		}
	}
	apply(events.Event{Kind: events.KindBlockStored, BlockHashes: []uint64{1, 2, 3}, TokenIDs: toks[:48], BlockSize: 16})
	clk.t = clk.t.Add(40 * time.Second)
	apply(events.Event{Kind: events.KindBlockStored, BlockHashes: []uint64{4}, TokenIDs: toks[48:64], BlockSize: 16, Parent: 3, HasParent: true})
	clk.t = clk.t.Add(30 * time.Second)
	apply(events.Event{Kind: events.KindBlockStored, BlockHashes: []uint64{5, 6}, TokenIDs: toks[64:], BlockSize: 16, Parent: 4, HasParent: true})
	clk.t = clk.t.Add(50 * time.Second) // 120 s after the first event, 50 s after the last
	keys := prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot("m", ""), toks, 16, nil)
	ms, _ := ix.Lookup(ctx, keys, []string{"a"}, nil)
	if ms[0].Blocks != 6 {
		t.Errorf("%d blocks held, want 6: the ancestors expired under a fresh child", ms[0].Blocks)
	}
}
