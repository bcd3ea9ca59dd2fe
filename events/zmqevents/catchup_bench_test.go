package zmqevents_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvroute/kvroute/events/zmqevents"
	"github.com/kvroute/kvroute/kvindex"
)

// BenchmarkZMQCatchUp measures one catch-up of 10,000 batches (vLLM's default replay buffer)
// into a MemoryIndex over loopback: from the live batch that triggers it to that batch applied
// (request, receive, decode and apply every replayed batch). Each batch stores one chained event
// of `blocks` blocks of 16 tokens (ids from a 150k vocabulary) and removes two older blocks, the
// shape of a busy engine's scheduler steps. The replay server is the tests' zmq4 ROUTER. It
// backs DefaultCatchUpTimeout.
func BenchmarkZMQCatchUp(b *testing.B) {
	const batches, bs = 10000, 16
	for _, blocks := range []int{8, 64, 256} {
		b.Run(fmt.Sprintf("batches=%d/blocks=%d", batches, blocks), func(b *testing.B) {
			rng := rand.New(rand.NewPCG(1, uint64(blocks)))
			payloads := make([][]byte, batches)
			h, size, nev := uint64(0), 0, 0
			for i := range payloads {
				hashes := make([]uint64, blocks)
				parent := int64(h)
				if h == 0 {
					parent = -1
				}
				for j := range hashes {
					h++
					hashes[j] = h
				}
				tokens := make([]uint32, blocks*bs)
				for j := range tokens {
					tokens[j] = rng.Uint32N(150000)
				}
				evs := []any{zmqevents.StoredEvent(hashes, parent, tokens, bs, "GPU")}
				if h > 20 {
					evs = append(evs, zmqevents.RemovedEvent([]uint64{h - 20, h - 19}, "GPU"))
				}
				payloads[i] = zmqevents.EncodeFakeBatch(nil, evs...)
				size += len(payloads[i])
				nev += len(evs)
			}
			live := zmqevents.EncodeFakeBatch(nil, zmqevents.StoredEvent([]uint64{1 << 40}, -1, make([]uint32, bs), bs, "GPU"))
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				b.StopTimer()
				pub := zmqevents.NewFakePublisher(b, zmqevents.FakePublisherConfig{Replay: true, ReplayKeep: batches + 1})
				for _, p := range payloads {
					pub.LoseRaw(p) // the history: kept for replay, never sent
				}
				idx, err := kvindex.NewMemory(kvindex.MemoryConfig{BlockSize: bs, SweepInterval: -1})
				if err != nil {
					b.Fatal(err)
				}
				c, err := zmqevents.New(zmqevents.Config{Sink: idx, CatchUpTimeout: time.Minute,
					Endpoints: []zmqevents.Endpoint{{Backend: "e", Endpoint: pub.Endpoint, ReplayEndpoint: pub.ReplayEndpoint}}})
				if err != nil {
					b.Fatal(err)
				}
				if err := c.Start(context.Background()); err != nil {
					b.Fatal(err)
				}
				pub.WaitSubscribed()
				b.StartTimer()
				pub.PublishRaw(live)
				for c.Status()[0].Events.Processed < uint64(nev+1) {
					time.Sleep(50 * time.Microsecond)
				}
				b.StopTimer()
				if st := c.Status()[0].Sequence; st.CatchUps != 1 || st.CaughtUpBatches != batches {
					b.Fatalf("catch-up: %+v", st)
				}
				c.Close()
				idx.Close()
				pub.Close()
				b.StartTimer()
			}
		})
	}
}
