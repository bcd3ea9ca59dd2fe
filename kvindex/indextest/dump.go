package indextest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
)

// RunDump runs the conformance suite of kvindex.Dumper against indexes from newIndex, which must
// implement it (the suite fails otherwise): one subtest per behaviour, with the Options and the
// isolation that Run's constructor honours.
//
// It requires, beyond the Dumper contract: a block stored by events is listed with its block key
// (prefixkey's, of Options.BlockSize), every tier it is held on and an Expires about EntryTTL
// after its last event; a speculative block with Speculative set, no tiers and a
// SpeculativeExpires about SpeculativeTTL after Speculate; a prefix entry with its prefix, token
// count, tier and Expires; blocks before prefix entries, each once; nothing of another backend,
// of an expired entry or of a cleared backend.
func RunDump(t *testing.T, newIndex NewIndexFunc) {
	t.Helper()
	tests := []struct {
		name string
		fn   func(*testing.T, NewIndexFunc)
	}{
		{"Entries", testDumpEntries},
		{"Limit", testDumpLimit},
		{"CallbackError", testDumpCallbackError},
		{"Expiry", testDumpExpiry},
		{"ClearedBackend", testDumpCleared},
		{"CanceledContext", testDumpCanceled},
		{"JSON", testDumpJSON},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { tc.fn(t, newIndex) })
	}
}

// dumpFixture holds, for backend "a", three GPU blocks also on storage, two CPU blocks, two
// speculative ones and a prefix entry; backend "b" holds one block. It returns the keys of each
// group.
type dumpFixture struct {
	*env
	both, cpu, spec []uint64
	stored          time.Time // when the events were applied
}

func setupDump(t *testing.T, newIndex NewIndexFunc, edit func(*Options)) *dumpFixture {
	t.Helper()
	e := setup(t, newIndex, edit)
	if _, ok := e.ix.(kvindex.Dumper); !ok {
		t.Fatalf("indextest: %T does not implement kvindex.Dumper", e.ix)
	}
	f := &dumpFixture{env: e, stored: e.clock.Now()}
	a, b, c := tokens(40, 3*blockSize), tokens(41, 2*blockSize), tokens(42, 2*blockSize)
	f.both, f.cpu, f.spec = keys(model, "", a), keys(model, "", b), keys(model, "", c)
	e.apply("a", stored(hashes(100, 3), a, blockSize, events.TierGPU))
	e.apply("a", events.Event{Kind: events.KindBlockStored, BlockHashes: hashes(100, 3), Tier: events.TierStorage})
	e.apply("a", stored(hashes(200, 2), b, blockSize, events.TierCPU))
	e.apply("a", prefixEv(events.PrefixCreated, "beef", 512))
	e.apply("b", stored(hashes(300, 1), tokens(43, blockSize), blockSize, events.TierGPU))
	if err := e.ix.Speculate(context.Background(), "a", f.spec, 0); err != nil {
		t.Fatalf("Speculate: %v", err)
	}
	return f
}

// dump returns backend's entries, limit at most.
func (e *env) dump(backend string, limit int) []kvindex.DumpEntry {
	e.t.Helper()
	var out []kvindex.DumpEntry
	err := e.ix.(kvindex.Dumper).Dump(context.Background(), backend, limit, func(d kvindex.DumpEntry) error {
		out = append(out, d)
		return nil
	})
	if err != nil {
		e.t.Fatalf("Dump(%q, %d): %v", backend, limit, err)
	}
	return out
}

// near reports whether got is within slack of want.
func near(got, want time.Time, slack time.Duration) bool {
	d := got.Sub(want)
	return d >= -slack && d <= slack
}

func testDumpEntries(t *testing.T, newIndex NewIndexFunc) {
	f := setupDump(t, newIndex, nil)
	got := f.dump("a", 100)
	want := map[uint64][]kvindex.Tier{}
	for _, k := range f.both {
		want[k] = []kvindex.Tier{events.TierGPU, events.TierStorage}
	}
	for _, k := range f.cpu {
		want[k] = []kvindex.Tier{events.TierCPU}
	}
	seen := map[uint64]bool{}
	prefixes := 0
	for i, d := range got {
		if d.Backend != "a" {
			t.Errorf("entry %d is of backend %q: %+v", i, d.Backend, d)
		}
		if d.Prefix != "" {
			prefixes++
			if d.Prefix != "beef" || d.Tokens != 512 || !slices.Equal(d.Tiers, []kvindex.Tier{events.TierGPU}) ||
				!near(d.Expires, f.stored.Add(entryTTL), entryTTL/32) {
				t.Errorf("prefix entry %+v, want beef, 512 tokens, gpu, expiring about %v", d, f.stored.Add(entryTTL))
			}
			continue
		}
		if prefixes > 0 {
			t.Errorf("block entry %d after a prefix entry", i)
		}
		if seen[d.Key] {
			t.Errorf("block %016x listed twice", d.Key)
		}
		seen[d.Key] = true
		switch {
		case slices.Contains(f.spec, d.Key):
			if !d.Speculative || len(d.Tiers) != 0 || !d.Expires.IsZero() ||
				!near(d.SpeculativeExpires, f.stored.Add(specTTL), time.Second) {
				t.Errorf("speculative block %+v, want speculative until about %v, no tiers", d, f.stored.Add(specTTL))
			}
		case want[d.Key] != nil:
			if d.Speculative || !slices.Equal(d.Tiers, want[d.Key]) || !near(d.Expires, f.stored.Add(entryTTL), entryTTL/32) {
				t.Errorf("block %016x: %+v, want tiers %v, expiring about %v", d.Key, d, want[d.Key], f.stored.Add(entryTTL))
			}
		default:
			t.Errorf("unexpected block %+v", d)
		}
	}
	if len(seen) != len(f.both)+len(f.cpu)+len(f.spec) || prefixes != 1 {
		t.Errorf("listed %d blocks and %d prefix entries, want %d and 1: %+v", len(seen), prefixes,
			len(f.both)+len(f.cpu)+len(f.spec), got)
	}
	if b := f.dump("b", 0); len(b) != 1 || b[0].Backend != "b" || !slices.Equal(b[0].Tiers, []kvindex.Tier{events.TierGPU}) {
		t.Errorf("backend b (default limit): %+v, want its one GPU block", b)
	}
	if n := f.dump("nobody", 10); len(n) != 0 {
		t.Errorf("unknown backend: %+v, want nothing", n)
	}
}

func testDumpLimit(t *testing.T, newIndex NewIndexFunc) {
	f := setupDump(t, newIndex, nil)
	for _, limit := range []int{1, 3, 7, 8, 9} {
		want := min(limit, 8)
		if got := f.dump("a", limit); len(got) != want {
			t.Errorf("limit %d: %d entries, want %d", limit, len(got), want)
		}
	}
	if got := f.dump("a", 0); len(got) != 8 {
		t.Errorf("limit 0 (DefaultDumpLimit): %d entries, want 8", len(got))
	}
}

func testDumpCallbackError(t *testing.T, newIndex NewIndexFunc) {
	f := setupDump(t, newIndex, nil)
	stop := errors.New("stop")
	calls := 0
	err := f.ix.(kvindex.Dumper).Dump(context.Background(), "a", 100, func(kvindex.DumpEntry) error {
		if calls++; calls == 2 {
			return stop
		}
		return nil
	})
	if !errors.Is(err, stop) || calls != 2 {
		t.Errorf("Dump returned %v after %d calls, want the callback's error after 2", err, calls)
	}
}

func testDumpExpiry(t *testing.T, newIndex NewIndexFunc) {
	f := setupDump(t, newIndex, func(o *Options) { o.AdvancesClock = true })
	f.clock.Advance(specTTL + time.Second)
	for _, d := range f.dump("a", 100) {
		if d.Speculative || slices.Contains(f.spec, d.Key) {
			t.Errorf("expired speculative entry listed: %+v", d)
		}
	}
	f.clock.Advance(entryTTL + entryTTL/32 + time.Second)
	if got := f.dump("a", 100); len(got) != 0 {
		t.Errorf("after EntryTTL: %+v, want nothing", got)
	}
}

func testDumpCleared(t *testing.T, newIndex NewIndexFunc) {
	f := setupDump(t, newIndex, nil)
	if err := f.ix.ClearBackend(context.Background(), "a"); err != nil {
		t.Fatal(err)
	}
	if got := f.dump("a", 100); len(got) != 0 {
		t.Errorf("cleared backend: %+v, want nothing", got)
	}
	if got := f.dump("b", 100); len(got) != 1 {
		t.Errorf("the other backend after a's clear: %+v, want its block", got)
	}
}

func testDumpCanceled(t *testing.T, newIndex NewIndexFunc) {
	f := setupDump(t, newIndex, nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	n := 0
	err := f.ix.(kvindex.Dumper).Dump(ctx, "a", 100, func(kvindex.DumpEntry) error { n++; return nil })
	if !errors.Is(err, context.Canceled) {
		t.Errorf("Dump with an ended ctx: %v (after %d entries), want context.Canceled", err, n)
	}
}

func testDumpJSON(t *testing.T, newIndex NewIndexFunc) {
	f := setupDump(t, newIndex, nil)
	for _, d := range f.dump("a", 100) {
		b, err := json.Marshal(d)
		if err != nil {
			t.Fatal(err)
		}
		var back kvindex.DumpEntry
		if err := json.Unmarshal(b, &back); err != nil {
			t.Fatalf("%s: %v", b, err)
		}
		if fmt.Sprint(back.Key, back.Tiers, back.Speculative, back.Prefix, back.Tokens) != fmt.Sprint(d.Key, d.Tiers, d.Speculative, d.Prefix, d.Tokens) ||
			!back.Expires.Equal(d.Expires) || !back.SpeculativeExpires.Equal(d.SpeculativeExpires) {
			t.Errorf("JSON round trip: %s decoded to %+v, want %+v", b, back, d)
		}
	}
}
