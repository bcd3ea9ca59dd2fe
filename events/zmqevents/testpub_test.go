package zmqevents

// Test-only helpers, exported so that the zmqevents_test package (e2e and examples) can use them:
// a fake engine publishing vLLM KV events over ZeroMQ (a zmq4 PUB socket sending [topic, seq,
// msgpack payload], plus a ROUTER replay responder keeping the last batches). The recording Sink
// is events/internal/eventstest's.

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvroute/kvroute/events/internal/eventstest"
)

// FakePublisherConfig configures a FakePublisher.
type FakePublisherConfig struct {
	Topic string
	// Connect makes the PUB socket dial this address (the consumer binds: centralized mode);
	// otherwise it binds 127.0.0.1 on a free port (or on Port).
	Connect string
	Port    int
	// Replay starts a ROUTER replay responder (on a free port, or ReplayPort) keeping the last
	// ReplayKeep batches (default 10,000).
	Replay     bool
	ReplayPort int
	ReplayKeep int
	// ReplayFault, when set, breaks every replay answer at the batch of sequence number
	// ReplayFaultAt: "hole" leaves the batch out, "corrupt" sends a payload that is not msgpack
	// in its place, "end" sends the end marker instead (and nothing more), "stall" sends nothing
	// more (no end marker either), "close" closes the replay socket instead of sending it.
	ReplayFault   string
	ReplayFaultAt uint64
	// FirstSeq is the first sequence number (vLLM starts at 0, some publishers at 1).
	FirstSeq uint64
	// Rank, when set, is sent as the batch's data_parallel_rank.
	Rank *int
}

// FakePublisher is a fake engine KV-event publisher speaking the vLLM wire format. Safe for
// concurrent use.
type FakePublisher struct {
	t   testing.TB
	cfg FakePublisherConfig

	Endpoint       string // the PUB's address as "tcp://127.0.0.1:port" ("" when it dials)
	ReplayEndpoint string // "" without replay

	mu       sync.Mutex
	pub      zmq4.Socket
	router   zmq4.Socket
	next     uint64
	buf      []fakeBatch
	replays  int
	routerWG sync.WaitGroup
	closed   bool
}

type fakeBatch struct {
	seq     uint64
	payload []byte
}

// NewFakePublisher starts a publisher; it is closed by t.Cleanup.
func NewFakePublisher(t testing.TB, cfg FakePublisherConfig) *FakePublisher {
	t.Helper()
	if cfg.ReplayKeep == 0 {
		cfg.ReplayKeep = 10000
	}
	p := &FakePublisher{t: t, cfg: cfg, next: cfg.FirstSeq}
	p.start()
	t.Cleanup(p.Close)
	return p
}

func (p *FakePublisher) start() {
	p.t.Helper()
	ctx := context.Background()
	pub := zmq4.NewPub(ctx, zmq4.WithLogger(discardStdLogger()), zmq4.WithDialerRetry(20*time.Millisecond), zmq4.WithDialerMaxRetries(200))
	if p.cfg.Connect != "" {
		require.NoError(p.t, pub.Dial(p.cfg.Connect))
	} else {
		require.NoError(p.t, listenRetry(pub, fmt.Sprintf("tcp://127.0.0.1:%d", p.cfg.Port)))
		p.cfg.Port = pub.Addr().(*net.TCPAddr).Port
		p.Endpoint = fmt.Sprintf("tcp://127.0.0.1:%d", p.cfg.Port)
	}
	p.pub = pub
	if p.cfg.Replay {
		router := zmq4.NewRouter(ctx, zmq4.WithLogger(discardStdLogger()))
		require.NoError(p.t, listenRetry(router, fmt.Sprintf("tcp://127.0.0.1:%d", p.cfg.ReplayPort)))
		p.cfg.ReplayPort = router.Addr().(*net.TCPAddr).Port
		p.ReplayEndpoint = fmt.Sprintf("tcp://127.0.0.1:%d", p.cfg.ReplayPort)
		p.router = router
		p.routerWG.Add(1)
		go p.serveReplay(router)
	}
}

// listenRetry binds, retrying briefly: a port just released (Restart) may still be busy.
func listenRetry(s zmq4.Socket, ep string) error {
	var err error
	for range 100 {
		if err = s.Listen(ep); err == nil {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return err
}

// serveReplay answers replay requests ["", start] with every kept batch ≥ start, then the end
// marker (ReplayFault aside).
func (p *FakePublisher) serveReplay(router zmq4.Socket) {
	defer p.routerWG.Done()
serve:
	for {
		msg, err := router.Recv()
		if err != nil {
			return
		}
		if len(msg.Frames) != 3 || len(msg.Frames[2]) != 8 {
			continue
		}
		id, start := msg.Frames[0], binary.BigEndian.Uint64(msg.Frames[2])
		p.mu.Lock()
		p.replays++
		kept := slices.Clone(p.buf)
		p.mu.Unlock()
		for _, b := range kept {
			if b.seq < start {
				continue
			}
			payload := b.payload
			if p.cfg.ReplayFault != "" && b.seq == p.cfg.ReplayFaultAt {
				switch p.cfg.ReplayFault {
				case "hole":
					continue
				case "corrupt":
					payload = []byte{0xc1}
				case "end":
					if router.Send(zmq4.NewMsgFrom(id, []byte{}, seqFrame(ReplayEndSeq), []byte{})) != nil {
						return
					}
					continue serve
				case "stall":
					continue serve
				case "close":
					router.Close()
					return
				}
			}
			if router.Send(zmq4.NewMsgFrom(id, []byte{}, seqFrame(b.seq), payload)) != nil {
				continue serve // the requester left (a consumer may stop reading a replay): drop the rest, as a ROUTER socket does
			}
		}
		_ = router.Send(zmq4.NewMsgFrom(id, []byte{}, seqFrame(ReplayEndSeq), []byte{}))
	}
}

func seqFrame(v uint64) []byte {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], v)
	return b[:]
}

// WaitSubscribed waits until a subscriber's subscription matching the topic reached the PUB
// socket (a PUB drops messages nobody subscribed to).
func (p *FakePublisher) WaitSubscribed() {
	p.t.Helper()
	require.Eventually(p.t, func() bool {
		p.mu.Lock()
		pub := p.pub
		p.mu.Unlock()
		for _, topic := range pub.(zmq4.Topics).Topics() {
			if strings.HasPrefix(p.cfg.Topic, topic) {
				return true
			}
		}
		return false
	}, 10*time.Second, 5*time.Millisecond, "no subscriber reached the publisher")
}

// Publish sends one batch of events (built with StoredEvent, RemovedEvent, ClearedEvent) and
// returns its sequence number.
func (p *FakePublisher) Publish(evs ...any) uint64 {
	p.t.Helper()
	return p.send(EncodeFakeBatch(p.cfg.Rank, evs...), true)
}

// PublishRaw sends an arbitrary payload with the next sequence number.
func (p *FakePublisher) PublishRaw(payload []byte) uint64 {
	p.t.Helper()
	return p.send(payload, true)
}

// Lose takes the next sequence number for a batch that the replay responder keeps but the PUB
// never sends: a message lost in transit.
func (p *FakePublisher) Lose(evs ...any) uint64 {
	p.t.Helper()
	return p.send(EncodeFakeBatch(p.cfg.Rank, evs...), false)
}

// LoseRaw is Lose with an arbitrary payload.
func (p *FakePublisher) LoseRaw(payload []byte) uint64 {
	p.t.Helper()
	return p.send(payload, false)
}

// SendFrames sends arbitrary frames (malformed-framing tests); no sequence number is taken.
func (p *FakePublisher) SendFrames(frames ...[]byte) {
	p.t.Helper()
	p.mu.Lock()
	pub := p.pub
	p.mu.Unlock()
	require.NoError(p.t, pub.Send(zmq4.NewMsgFrom(frames...)))
}

func (p *FakePublisher) send(payload []byte, deliver bool) uint64 {
	p.mu.Lock()
	seq := p.next
	p.next++
	p.buf = append(p.buf, fakeBatch{seq, payload})
	if len(p.buf) > p.cfg.ReplayKeep {
		p.buf = slices.Delete(p.buf, 0, len(p.buf)-p.cfg.ReplayKeep)
	}
	pub := p.pub
	p.mu.Unlock()
	if deliver {
		require.NoError(p.t, pub.Send(zmq4.NewMsgFrom([]byte(p.cfg.Topic), seqFrame(seq), payload)))
	}
	return seq
}

// ResetSeq makes next the sequence number of the next batch, without reconnecting.
func (p *FakePublisher) ResetSeq(next uint64) {
	p.mu.Lock()
	p.next = next
	p.mu.Unlock()
}

// Replays returns how many replay requests the responder answered.
func (p *FakePublisher) Replays() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.replays
}

// Restart closes the sockets and opens new ones on the same ports with the sequence back to
// FirstSeq and an empty replay buffer: an engine restart.
func (p *FakePublisher) Restart() {
	p.t.Helper()
	p.closeSockets()
	p.mu.Lock()
	p.next, p.buf = p.cfg.FirstSeq, nil
	p.mu.Unlock()
	p.start()
}

// Stop closes the sockets without restarting them: the engine went away.
func (p *FakePublisher) Stop() { p.closeSockets() }

func (p *FakePublisher) closeSockets() {
	p.mu.Lock()
	pub, router := p.pub, p.router
	p.pub, p.router = nil, nil
	p.mu.Unlock()
	if pub != nil {
		pub.Close()
	}
	if router != nil {
		router.Close()
	}
	p.routerWG.Wait()
}

// Close stops the publisher; idempotent.
func (p *FakePublisher) Close() {
	p.mu.Lock()
	closed := p.closed
	p.closed = true
	p.mu.Unlock()
	if !closed {
		p.closeSockets()
	}
}

// StoredEvent builds a vLLM array-form BlockStored event: [tag, block_hashes, parent, token_ids,
// block_size, lora_id, medium, lora_name]. parent < 0 means nil.
func StoredEvent(hashes []uint64, parent int64, tokens []uint32, blockSize int, medium string) []any {
	var par any
	if parent >= 0 {
		par = uint64(parent)
	}
	var med any
	if medium != "" {
		med = medium
	}
	return []any{"BlockStored", hashes, par, tokens, blockSize, nil, med, nil}
}

// RemovedEvent builds a vLLM array-form BlockRemoved event.
func RemovedEvent(hashes []uint64, medium string) []any {
	var med any
	if medium != "" {
		med = medium
	}
	return []any{"BlockRemoved", hashes, med}
}

// ClearedEvent builds an AllBlocksCleared event.
func ClearedEvent() []any { return []any{"AllBlocksCleared"} }

// EncodeFakeBatch encodes a vLLM array-form batch [ts, events, data_parallel_rank] with the
// smallest integer encodings, as Python's msgpack does.
func EncodeFakeBatch(rank *int, evs ...any) []byte {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	var r any
	if rank != nil {
		r = *rank
	}
	if err := enc.Encode([]any{float64(time.Now().UnixNano()) / 1e9, evs, r}); err != nil {
		panic(err)
	}
	return buf.Bytes()
}

// CheckGoroutines returns a function that waits (bounded) until the number of goroutines is
// back to what it was when CheckGoroutines was called, and fails the test otherwise. Goroutines
// of the zmq4 sockets the fake publishers use are not counted: zmq4 never stops a PUB socket's
// writer goroutine (socket.Close does not close its pubMWriter), a leak of the test's publisher,
// not of the consumers.
func CheckGoroutines(t testing.TB) func() {
	t.Helper()
	return eventstest.CheckGoroutines(t, publisherGoroutine)
}

// publisherGoroutine reports whether a goroutine's stack is the test publishers' or their zmq4
// sockets' (and not a consumer's).
func publisherGoroutine(stack string) bool {
	return strings.Contains(stack, "zmqevents.(*FakePublisher)") ||
		strings.Contains(stack, "go-zeromq/zmq4") && !strings.Contains(stack, "zmqevents.(*Consumer)")
}

func discardStdLogger() *log.Logger { return log.New(io.Discard, "", 0) }
