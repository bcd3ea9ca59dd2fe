package zmqevents

// Test-only helpers, exported so that the zmqevents_test package (e2e and examples) can use them:
// a fake engine publishing vLLM KV events over ZeroMQ (a zmq4 PUB socket sending [topic, seq,
// msgpack payload], plus a ROUTER replay responder keeping the last batches), and a recording
// Sink.

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvroute/kvroute/events"
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

// RecordingSink is a Sink that records what it receives. Block makes Apply wait until Unblock;
// Fail makes Apply and ClearBackend fail, FailApplies only the next Applies. Safe for concurrent
// use.
type RecordingSink struct {
	mu        sync.Mutex
	applied   []RecordedBatch
	clears    map[string]int
	fail      error
	failNext  int // Applies still to fail with failApply
	failApply error
	block     chan struct{}
	entered   chan struct{}
}

// RecordedBatch is a copy of an applied batch.
type RecordedBatch struct {
	Backend string
	Model   string
	Seq     uint64
	Kinds   []events.Kind
	Hashes  [][]uint64
	Prefix  []string // PrefixOp:hash:tokens of prefix events
}

// NewRecordingSink returns an empty sink.
func NewRecordingSink() *RecordingSink {
	return &RecordingSink{clears: make(map[string]int)}
}

// Apply records b.
func (s *RecordingSink) Apply(ctx context.Context, backend string, b *events.Batch) error {
	s.mu.Lock()
	block, entered, fail := s.block, s.entered, s.fail
	if fail == nil && s.failNext > 0 {
		s.failNext--
		fail = s.failApply
	}
	s.mu.Unlock()
	if block != nil {
		select {
		case entered <- struct{}{}:
		default:
		}
		select {
		case <-block:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if fail != nil {
		return fail
	}
	rb := RecordedBatch{Backend: backend, Model: b.Model, Seq: b.Seq}
	for _, ev := range b.Events {
		rb.Kinds = append(rb.Kinds, ev.Kind)
		rb.Hashes = append(rb.Hashes, slices.Clone(ev.BlockHashes))
		if ev.Kind == events.KindPrefix {
			rb.Prefix = append(rb.Prefix, fmt.Sprintf("%s:%s:%d", ev.PrefixOp, ev.PrefixHash, ev.TokenCount))
		}
	}
	s.mu.Lock()
	s.applied = append(s.applied, rb)
	s.mu.Unlock()
	return nil
}

// FailApplies makes the next n Applies fail with err (ClearBackend still succeeds), as a store
// that lost what it held and says so on the next write.
func (s *RecordingSink) FailApplies(n int, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failNext, s.failApply = n, err
}

// ClearBackend records a clear.
func (s *RecordingSink) ClearBackend(_ context.Context, backend string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fail != nil {
		return s.fail
	}
	s.clears[backend]++
	s.applied = append(s.applied, RecordedBatch{Backend: backend, Seq: ^uint64(0)}) // a marker
	return nil
}

// Block makes Apply wait until Unblock; Entered receives when an Apply starts waiting.
func (s *RecordingSink) Block() (entered <-chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.block, s.entered = make(chan struct{}), make(chan struct{}, 1)
	return s.entered
}

// Unblock releases blocked and future Apply calls.
func (s *RecordingSink) Unblock() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.block != nil {
		close(s.block)
		s.block = nil
	}
}

// SetFail makes Apply and ClearBackend return err (nil: succeed again).
func (s *RecordingSink) SetFail(err error) {
	s.mu.Lock()
	s.fail = err
	s.mu.Unlock()
}

// Clears returns how many times backend was cleared.
func (s *RecordingSink) Clears(backend string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.clears[backend]
}

// Applied returns the applied batches of backend (all backends for ""), clears excluded.
func (s *RecordingSink) Applied(backend string) []RecordedBatch {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []RecordedBatch
	for _, b := range s.applied {
		if (backend == "" || b.Backend == backend) && b.Seq != ^uint64(0) {
			out = append(out, b)
		}
	}
	return out
}

// Seqs returns the sequence numbers of backend's applied batches, with -1 for each clear.
func (s *RecordingSink) Seqs(backend string) []int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []int64
	for _, b := range s.applied {
		if b.Backend == backend {
			out = append(out, int64(b.Seq))
		}
	}
	return out
}

var _ events.Sink = (*RecordingSink)(nil)

// errSinkDown is a sink failure for tests.
var errSinkDown = errors.New("sink down")

// CheckGoroutines returns a function that waits (bounded) until the number of goroutines is
// back to what it was when CheckGoroutines was called, and fails the test otherwise. Goroutines
// of the zmq4 sockets the fake publishers use are not counted: zmq4 never stops a PUB socket's
// writer goroutine (socket.Close does not close its pubMWriter), a leak of the test's publisher,
// not of the consumers.
func CheckGoroutines(t testing.TB) func() {
	t.Helper()
	before, _ := countGoroutines()
	return func() {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		n, dump := countGoroutines()
		for n > before && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
			n, dump = countGoroutines()
		}
		if n > before {
			t.Fatalf("goroutines: %d before, %d after Close\n%s", before, n, dump)
		}
	}
}

// countGoroutines counts the goroutines that are not the test publishers' zmq4 internals, and
// returns their stacks.
func countGoroutines() (int, string) {
	buf := make([]byte, 4<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var kept []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		switch {
		case strings.Contains(g, "zmqevents.(*FakePublisher)"):
		case strings.Contains(g, "go-zeromq/zmq4") && !strings.Contains(g, "zmqevents.(*Consumer)"):
		default:
			kept = append(kept, g)
		}
	}
	return len(kept), strings.Join(kept, "\n\n")
}

func discardStdLogger() *log.Logger { return log.New(io.Discard, "", 0) }
