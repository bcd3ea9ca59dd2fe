package stack

import (
	"context"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/natsync/eventlog"
	"github.com/kvroute/kvroute/natsync/natstest"
)

// While NATS is down for the outage tee, it indexes the engines' events itself, and the same
// batches reach the stream once NATS is back: the event-log consumer gets them again. Against a
// real JetStream (the tee's view of the connection is forced to down while the server is up, so
// that every batch of the "outage" is delivered again): with the replay guard the duplicates are
// skipped and counted, and the index counts no drop; without it, the removes applied a second
// time count as unknown_block and the store whose parent went as unknown_parent — drops that are
// no loss.
func TestOutageReplayNotCountedAsDrops(t *testing.T) {
	for _, guarded := range []bool{true, false} {
		t.Run(map[bool]string{true: "guard", false: "no guard"}[guarded], func(t *testing.T) {
			ns := natstest.Start(t)
			nc, err := nats.Connect(ns.URL())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(nc.Close)
			js, err := jetstream.New(nc)
			if err != nil {
				t.Fatal(err)
			}
			cfg := eventlog.Config{JetStream: js, Fleet: "outage", Logger: slog.New(slog.DiscardHandler)}
			ix, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: "m"})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = ix.Close() })
			pub, err := eventlog.NewPublisher(cfg, eventlog.PublisherOptions{})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = pub.Close() })
			ctx := context.Background()
			if err := pub.Start(ctx); err != nil {
				t.Fatal(err)
			}
			var guard *replayGuard
			var sink events.Sink = ix
			if guarded {
				guard = newReplayGuard(ix)
				sink = guard
			}
			cons, err := eventlog.NewConsumer(cfg, eventlog.ConsumerOptions{Sink: sink, RetryInterval: 50 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = cons.Close() })
			if err := cons.Start(ctx); err != nil {
				t.Fatal(err)
			}
			var up atomic.Bool
			up.Store(true)
			tee := &outageTee{pub: pub, index: ix, connected: up.Load, guard: guard}

			toks := make([]uint32, 4*16)
			for i := range toks {
				toks[i] = uint32(i)
			}
			var seq uint64
			batch := func(kind events.Kind, from, to int) *events.Batch {
				seq++
				hs := make([]uint64, to-from)
				for i := range hs {
					hs[i] = 500 + uint64(from+i)
				}
				ev := events.Event{Kind: kind, BlockHashes: hs}
				if kind == events.KindBlockStored {
					ev.TokenIDs, ev.BlockSize = toks[from*16:to*16], 16
					if from > 0 {
						ev.Parent, ev.HasParent = 500+uint64(from-1), true
					}
				}
				return &events.Batch{Model: "m", Seq: seq, Events: []events.Event{ev}}
			}
			apply := func(b *events.Batch) {
				if err := tee.Apply(ctx, "vllm-0", b); err != nil {
					t.Fatal(err)
				}
			}
			waitStream := func() {
				fctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				defer cancel()
				if err := pub.Flush(fctx); err != nil {
					t.Fatal(err)
				}
				if err := cons.WaitSeq(fctx, pub.Stats().LastSeq); err != nil {
					t.Fatal(err, cons.Stats())
				}
			}

			apply(batch(events.KindBlockStored, 0, 2)) // blocks 0 and 1, through the stream
			waitStream()
			up.Store(false)                            // the outage, as the tee sees it
			apply(batch(events.KindBlockStored, 2, 3)) // block 2 (parent 1)
			apply(batch(events.KindBlockRemoved, 2, 3))
			apply(batch(events.KindBlockRemoved, 1, 2))
			up.Store(true)
			waitStream()                               // the stream brings the three outage batches again
			apply(batch(events.KindBlockStored, 1, 2)) // after the outage: applied
			waitStream()

			st, err := ix.Stats(ctx)
			if err != nil {
				t.Fatal(err)
			}
			drops := st.Dropped["unknown_block"] + st.Dropped["unknown_parent"]
			if !guarded {
				if drops == 0 {
					t.Fatalf("no drop without the guard (dropped %v): the test does not replay the outage", st.Dropped)
				}
				return
			}
			if drops != 0 {
				t.Errorf("dropped %v: the outage's batches were applied again", st.Dropped)
			}
			if gs := guard.stats(); gs.DuplicateBatches != 3 || gs.DuplicateEvents != 3 {
				t.Errorf("guard %+v, want the 3 outage batches skipped", gs)
			}
			if st.PerBackend["vllm-0"] != 2 {
				t.Errorf("vllm-0 holds %d entries, want blocks 0 and 1 (%+v)", st.PerBackend["vllm-0"], st)
			}
		})
	}
}

// countSink counts the batches that reach it.
type countSink struct{ seqs []uint64 }

func (c *countSink) Apply(_ context.Context, _ string, b *events.Batch) error {
	c.seqs = append(c.seqs, b.Seq)
	return nil
}

func (c *countSink) ClearBackend(context.Context, string) error { return nil }

// The guard skips only the span the tee applied: a batch the stream still owed from before the
// outage (a lower sequence) is applied, the outage's are skipped, and the first one past them is
// applied and ends the watch.
func TestReplayGuardSkipsOnlyTheOutage(t *testing.T) {
	ctx := context.Background()
	idx := &countSink{}
	g := newReplayGuard(idx)
	for _, s := range []uint64{5, 6, 7} {
		g.appliedDirectly("vllm-0", &events.Batch{Seq: s})
	}
	for _, s := range []uint64{4, 5, 6, 7, 8, 5} {
		if err := g.Apply(ctx, "vllm-0", &events.Batch{Seq: s, Events: make([]events.Event, 1)}); err != nil {
			t.Fatal(err)
		}
	}
	// 5 after 8: the watch ended at 8, so an engine that restarted its count is indexed.
	want := []uint64{4, 8, 5}
	if len(idx.seqs) != len(want) {
		t.Fatalf("applied %v, want %v", idx.seqs, want)
	}
	for i := range want {
		if idx.seqs[i] != want[i] {
			t.Fatalf("applied %v, want %v", idx.seqs, want)
		}
	}
	if gs := g.stats(); gs.DuplicateBatches != 3 || gs.DuplicateEvents != 3 {
		t.Errorf("guard %+v, want 5, 6 and 7 skipped", gs)
	}
}
