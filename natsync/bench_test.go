package natsync

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/natsync/natstest"
)

// benchSizes are block-key counts: a request without tokens, a 2k-token prompt and a 32k-token
// one, in 16-token blocks.
var benchSizes = []int{0, 128, 2048}

func routedEvent(nkeys int) kvroute.PeerEvent {
	return kvroute.PeerEvent{Kind: kvroute.PeerRouted, ID: 123456, Backend: "vllm-decode-7", BlockKeys: keys(9, nkeys),
		CachedBlocks: nkeys / 2, PrefillTokens: nkeys * 8}
}

// BenchmarkPublishPeerEvent is the cost on the request path: the event's encoding into the batch
// being filled. The buffer is emptied every 32 events, as the sending goroutine would.
func BenchmarkPublishPeerEvent(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(fmt.Sprintf("routed/keys=%d", n), func(b *testing.B) {
			s := unstarted(b, Config{})
			ev := routedEvent(n)
			b.SetBytes(int64(eventSize(&ev, n)))
			b.ReportAllocs()
			every := max(1, 4096/max(n, 1)) // about 32 KiB
			for i := 0; b.Loop(); i++ {
				s.PublishPeerEvent(ev)
				if i%every == every-1 {
					batches, _ := s.takePending()
					s.recycle(batches)
				}
			}
			if s.Stats().Dropped > 0 {
				b.Fatal("dropped events")
			}
		})
	}
	b.Run("done", func(b *testing.B) {
		s := unstarted(b, Config{})
		ev := kvroute.PeerEvent{Kind: kvroute.PeerDone, ID: 123456}
		b.ReportAllocs()
		for i := 0; b.Loop(); i++ {
			s.PublishPeerEvent(ev)
			if i%1024 == 1023 {
				batches, _ := s.takePending()
				s.recycle(batches)
			}
		}
	})
	b.Run("parallel/keys=128", func(b *testing.B) {
		s := unstarted(b, Config{})
		ev := routedEvent(128)
		var count atomic.Uint64
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				s.PublishPeerEvent(ev)
				if count.Add(1)%32 == 0 {
					batches, _ := s.takePending()
					s.recycle(batches)
				}
			}
		})
	})
	// Against a real server, with the Sync's own sending goroutine. A tight loop publishes far
	// faster than one connection carries, so most events are dropped (dropped/op): sent/s is the
	// rate one Sync sustains.
	b.Run("nats/keys=128", func(b *testing.B) {
		srv := natstest.Start(b)
		s, err := New(Config{URL: srv.URL()})
		if err != nil {
			b.Fatal(err)
		}
		defer func() { _ = s.Close() }()
		if err := s.Start(context.Background(), NopApplier{}); err != nil {
			b.Fatal(err)
		}
		ev := routedEvent(128)
		b.ReportAllocs()
		for b.Loop() {
			s.PublishPeerEvent(ev)
		}
		b.StopTimer()
		st := s.Stats()
		b.ReportMetric(float64(st.Dropped)/float64(b.N), "dropped/op")
		b.ReportMetric(float64(st.Published)/b.Elapsed().Seconds(), "sent/s")
		time.Sleep(10 * time.Millisecond)
	})
}

func BenchmarkEncode(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(fmt.Sprintf("keys=%d", n), func(b *testing.B) {
			ev := routedEvent(n)
			buf := make([]byte, 0, 64<<10)
			b.SetBytes(int64(eventSize(&ev, n)))
			b.ReportAllocs()
			for b.Loop() {
				buf = appendEvent(buf[:0], &ev, n)
			}
		})
	}
}

func BenchmarkDecode(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(fmt.Sprintf("keys=%d", n), func(b *testing.B) {
			msg := encodeMessage(msgEvents, "replica-a", 1, []kvroute.PeerEvent{routedEvent(n)})
			names := map[string]string{}
			intern := func(b []byte) string {
				if s, ok := names[string(b)]; ok {
					return s
				}
				s := string(b)
				names[s] = s
				return s
			}
			var evs []kvroute.PeerEvent
			b.SetBytes(int64(len(msg)))
			b.ReportAllocs()
			for b.Loop() {
				_, body, err := decodeHeader(msg)
				if err != nil {
					b.Fatal(err)
				}
				if evs, err = decodeEvents(body, evs, intern); err != nil || len(evs) != 1 {
					b.Fatal(err)
				}
			}
		})
	}
}
