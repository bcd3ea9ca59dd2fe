package enginesim

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// The ZMQ side of the engine: a PUB socket and a replay ROUTER socket, each spoken directly over
// TCP connections (ZMTP 3.0, rfc.zeromq.org/spec/23, NULL mechanism). go-zeromq/zmq4's sockets
// are not used: its PUB socket keeps a writer goroutine alive after Close and its Close may leak
// readers, so an engine built on them could not promise that Close stops everything. Only its
// connection codec (zmq4.Open: greeting and READY handshake) is used, as package events does;
// frames are written and read here, with deadlines, and every goroutine is stopped by Close.

const (
	zmqHandshakeTimeout = 5 * time.Second
	zmqWriteTimeout     = 10 * time.Second
	zmqMaxInFrame       = 1 << 20 // bytes: subscriptions and replay requests are tiny
	zmqMaxInFrames      = 16
	zmqDialMinBackoff   = 50 * time.Millisecond
	zmqDialMaxBackoff   = 2 * time.Second
)

// record is one published batch.
type record struct {
	seq     uint64
	payload []byte
}

// bus numbers batches, keeps the replay ring and fans batches out to the PUB connections. It is
// safe for concurrent use.
type bus struct {
	topic []byte
	hwm   int

	mu   sync.Mutex
	seq  uint64
	ring []record // circular, cap = replay buffer
	head int      // index of the oldest record
	n    int
	subs map[*subConn]struct{}

	published atomic.Uint64
	dropped   atomic.Uint64 // messages dropped at a subscriber's high-water mark
}

func newBus(topic string, ringSize, hwm int) *bus {
	return &bus{topic: []byte(topic), hwm: hwm, ring: make([]record, ringSize), subs: make(map[*subConn]struct{})}
}

// publish assigns the next sequence number to payload, keeps it for replay and queues it to
// every subscribed connection (dropping it for a connection whose queue is full).
func (b *bus) publish(payload []byte) {
	b.mu.Lock()
	defer b.mu.Unlock()
	r := record{seq: b.seq, payload: payload}
	b.seq++
	if len(b.ring) > 0 {
		if b.n < len(b.ring) {
			b.ring[(b.head+b.n)%len(b.ring)] = r
			b.n++
		} else {
			b.ring[b.head] = r
			b.head = (b.head + 1) % len(b.ring)
		}
	}
	b.published.Add(1)
	for s := range b.subs {
		if !s.subscribed(b.topic) {
			continue
		}
		select {
		case s.q <- r:
		default:
			b.dropped.Add(1)
		}
	}
}

// since returns the kept batches with seq ≥ start, oldest first.
func (b *bus) since(start uint64) []record {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []record
	for i := range b.n {
		r := b.ring[(b.head+i)%len(b.ring)]
		if r.seq >= start {
			out = append(out, r)
		}
	}
	return out
}

// restart forgets every batch and starts the sequence at 0 again (a new engine process).
func (b *bus) restart() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.seq, b.head, b.n = 0, 0, 0
	clear(b.ring)
}

func (b *bus) add(s *subConn) {
	b.mu.Lock()
	b.subs[s] = struct{}{}
	b.mu.Unlock()
}

func (b *bus) remove(s *subConn) {
	b.mu.Lock()
	delete(b.subs, s)
	b.mu.Unlock()
}

// subscribers returns the number of connections with at least one subscription.
func (b *bus) subscribers() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for s := range b.subs {
		s.mu.Lock()
		if len(s.prefixes) > 0 {
			n++
		}
		s.mu.Unlock()
	}
	return n
}

// subConn is one subscriber connection of the PUB socket.
type subConn struct {
	raw      net.Conn
	q        chan record
	mu       sync.Mutex
	prefixes [][]byte
}

func (s *subConn) subscribed(topic []byte) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range s.prefixes {
		if len(p) <= len(topic) && string(topic[:len(p)]) == string(p) {
			return true
		}
	}
	return false
}

// subscription applies a ZMTP 3.0 subscription message: first byte 1 subscribes to the prefix
// that follows, 0 cancels one such subscription.
func (s *subConn) subscription(m []byte) {
	if len(m) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch m[0] {
	case 1:
		s.prefixes = append(s.prefixes, append([]byte(nil), m[1:]...))
	case 0:
		for i, p := range s.prefixes {
			if string(p) == string(m[1:]) {
				s.prefixes = append(s.prefixes[:i], s.prefixes[i+1:]...)
				break
			}
		}
	}
}

// transport runs the engine's ZMQ sockets between start and stop: the PUB side (an accept loop,
// or a dial loop) and the replay ROUTER's accept loop, plus two goroutines per PUB connection
// and one per replay connection. All of them are tracked and stopped by close.
type transport struct {
	bus    *bus
	log    *slog.Logger
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	conns   map[net.Conn]struct{}
	pubLn   net.Listener
	rLn     net.Listener
	pubEP   string // the PUB endpoint as bound or dialled
	replyEP string
}

// startTransport binds or dials the PUB endpoint and binds the replay endpoint (either may be "").
func startTransport(ctx context.Context, b *bus, log *slog.Logger, pubEP string, bind bool, replayEP string) (*transport, error) {
	t := &transport{bus: b, log: log, conns: make(map[net.Conn]struct{})}
	t.ctx, t.cancel = context.WithCancel(context.Background())
	var lc net.ListenConfig
	if pubEP != "" {
		addr, wildcard, err := splitTCP(pubEP)
		if err != nil {
			return nil, err
		}
		if bind || wildcard {
			ln, err := lc.Listen(ctx, "tcp", addr)
			if err != nil {
				return nil, fmt.Errorf("enginesim: bind %s: %w", pubEP, err)
			}
			t.pubLn, t.pubEP = ln, "tcp://"+ln.Addr().String()
			t.goTracked(func() { t.acceptLoop(ln, func(c net.Conn, server bool) { t.servePub(c, server) }) })
		} else {
			t.pubEP = pubEP
			t.goTracked(func() { t.dialLoop(addr) })
		}
	}
	if replayEP != "" {
		addr, _, err := splitTCP(replayEP)
		if err == nil {
			var ln net.Listener
			if ln, err = lc.Listen(ctx, "tcp", addr); err == nil {
				t.rLn, t.replyEP = ln, "tcp://"+ln.Addr().String()
				t.goTracked(func() { t.acceptLoop(ln, t.serveReplay) })
			}
		}
		if err != nil {
			t.close()
			return nil, fmt.Errorf("enginesim: bind replay %s: %w", replayEP, err)
		}
	}
	return t, nil
}

func (t *transport) goTracked(f func()) {
	t.wg.Add(1)
	go func() {
		defer t.wg.Done()
		f()
	}()
}

// track registers a connection so that close can close it; false when closing.
func (t *transport) track(c net.Conn) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ctx.Err() != nil {
		return false
	}
	t.conns[c] = struct{}{}
	return true
}

func (t *transport) untrack(c net.Conn) {
	t.mu.Lock()
	delete(t.conns, c)
	t.mu.Unlock()
	c.Close()
}

// close stops every goroutine and closes every socket, waiting for them. Idempotent.
func (t *transport) close() {
	t.mu.Lock()
	t.cancel()
	if t.pubLn != nil {
		t.pubLn.Close()
	}
	if t.rLn != nil {
		t.rLn.Close()
	}
	for c := range t.conns {
		c.Close()
	}
	t.mu.Unlock()
	t.wg.Wait()
}

func (t *transport) acceptLoop(ln net.Listener, serve func(net.Conn, bool)) {
	for {
		c, err := ln.Accept()
		if err != nil {
			if t.ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			t.log.Debug("enginesim: accept", "err", err)
			select {
			case <-t.ctx.Done():
				return
			case <-time.After(20 * time.Millisecond):
			}
			continue
		}
		if !t.track(c) {
			c.Close()
			return
		}
		t.goTracked(func() {
			defer t.untrack(c)
			serve(c, true)
		})
	}
}

// dialLoop connects the PUB socket to a binding subscriber, reconnecting with backoff.
func (t *transport) dialLoop(addr string) {
	backoff := zmqDialMinBackoff
	for {
		d := net.Dialer{Timeout: zmqHandshakeTimeout}
		c, err := d.DialContext(t.ctx, "tcp", addr)
		if err == nil {
			if !t.track(c) {
				c.Close()
				return
			}
			ok := t.servePub(c, false)
			t.untrack(c)
			if ok {
				backoff = zmqDialMinBackoff
			}
		}
		if t.ctx.Err() != nil {
			return
		}
		t.log.Debug("enginesim: zmq connect", "addr", addr, "err", err)
		select {
		case <-t.ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, zmqDialMaxBackoff)
	}
}

// handshake runs the ZMTP 3.0 greeting and NULL READY exchange as typ.
func handshake(c net.Conn, typ zmq4.SocketType, server bool) error {
	if err := c.SetDeadline(time.Now().Add(zmqHandshakeTimeout)); err != nil {
		return err
	}
	if _, err := zmq4.Open(c, null.Security(), typ, nil, server, nil); err != nil {
		return err
	}
	return c.SetDeadline(time.Time{})
}

// servePub serves one subscriber connection until it fails or the transport closes. It reports
// whether the handshake succeeded.
func (t *transport) servePub(c net.Conn, server bool) bool {
	if err := handshake(c, zmq4.Pub, server); err != nil {
		t.log.Debug("enginesim: zmq pub handshake", "remote", c.RemoteAddr().String(), "err", err)
		return false
	}
	s := &subConn{raw: c, q: make(chan record, t.bus.hwm)}
	t.bus.add(s)
	defer t.bus.remove(s)
	done := make(chan struct{})
	t.goTracked(func() { // reader: subscriptions
		defer close(done)
		r := bufio.NewReader(c)
		for {
			frames, cmd, err := readMsg(r)
			if err != nil {
				c.Close()
				return
			}
			if !cmd && len(frames) == 1 {
				s.subscription(frames[0])
			}
		}
	})
	w := frameWriter{c: c}
	for {
		select {
		case <-done:
			return true
		case <-t.ctx.Done():
			c.Close()
			<-done
			return true
		case r := <-s.q:
			var seq [8]byte
			binary.BigEndian.PutUint64(seq[:], r.seq)
			if err := w.write(t.bus.topic, seq[:], r.payload); err != nil {
				c.Close()
				<-done
				return true
			}
		}
	}
}

// serveReplay answers replay requests ["", start_seq] on one ROUTER connection: one message
// ["", seq, payload] per kept batch with seq ≥ start, then ["", 0xff…ff, ""].
func (t *transport) serveReplay(c net.Conn, server bool) {
	if err := handshake(c, zmq4.Router, server); err != nil {
		t.log.Debug("enginesim: zmq replay handshake", "remote", c.RemoteAddr().String(), "err", err)
		return
	}
	r := bufio.NewReader(c)
	w := frameWriter{c: c}
	for {
		frames, cmd, err := readMsg(r)
		if err != nil {
			return
		}
		if cmd {
			continue
		}
		if len(frames) == 2 && len(frames[0]) == 0 {
			frames = frames[1:]
		}
		if len(frames) != 1 || len(frames[0]) != 8 {
			t.log.Debug("enginesim: bad replay request", "frames", len(frames))
			continue
		}
		start := binary.BigEndian.Uint64(frames[0])
		var seq [8]byte
		for _, rec := range t.bus.since(start) {
			binary.BigEndian.PutUint64(seq[:], rec.seq)
			if err := w.write(nil, seq[:], rec.payload); err != nil {
				return
			}
		}
		binary.BigEndian.PutUint64(seq[:], ^uint64(0))
		if err := w.write(nil, seq[:], nil); err != nil {
			return
		}
	}
}

// frameWriter writes ZMTP 3.0 messages.
type frameWriter struct {
	c   net.Conn
	hdr [3][9]byte
}

// write sends one 3-frame message [f0, f1, f2] in one write, under a deadline.
func (w *frameWriter) write(f0, f1, f2 []byte) error {
	frames := [3][]byte{f0, f1, f2}
	bufs := make(net.Buffers, 0, 6)
	for i, f := range frames {
		var flags byte
		if i < 2 {
			flags |= 0x01 // MORE
		}
		h := w.hdr[i][:0]
		if len(f) > 255 {
			h = append(h, flags|0x02)
			h = binary.BigEndian.AppendUint64(h, uint64(len(f)))
		} else {
			h = append(h, flags, byte(len(f)))
		}
		bufs = append(bufs, h)
		if len(f) > 0 {
			bufs = append(bufs, f)
		}
	}
	if err := w.c.SetWriteDeadline(time.Now().Add(zmqWriteTimeout)); err != nil {
		return err
	}
	_, err := bufs.WriteTo(w.c)
	return err
}

// readMsg reads one ZMTP 3.0 message (or command) of at most zmqMaxInFrames frames of at most
// zmqMaxInFrame bytes each.
func readMsg(r *bufio.Reader) (frames [][]byte, cmd bool, err error) {
	for {
		flags, err := r.ReadByte()
		if err != nil {
			return nil, false, err
		}
		var size uint64
		if flags&0x02 != 0 {
			var b [8]byte
			if _, err := io.ReadFull(r, b[:]); err != nil {
				return nil, false, err
			}
			size = binary.BigEndian.Uint64(b[:])
		} else {
			s, err := r.ReadByte()
			if err != nil {
				return nil, false, err
			}
			size = uint64(s)
		}
		if size > zmqMaxInFrame || len(frames) >= zmqMaxInFrames {
			return nil, false, fmt.Errorf("enginesim: oversized zmq message from peer")
		}
		f := make([]byte, size)
		if _, err := io.ReadFull(r, f); err != nil {
			return nil, false, err
		}
		frames = append(frames, f)
		if flags&0x04 != 0 {
			cmd = true
		}
		if flags&0x01 == 0 || cmd {
			return frames, cmd, nil
		}
	}
}
