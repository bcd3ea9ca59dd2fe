package natsync

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/natsync/natstest"
	"github.com/kvroute/kvroute/prefixkey"
)

// Bounds of the tests' waits: generous, so that a loaded machine or the race detector does not
// fail them; they pass as soon as the condition holds.
const (
	waitFor = 20 * time.Second
	tick    = 10 * time.Millisecond
)

const testModel = "llama-3-8b"

var testBackends = []kvroute.Backend{{Name: "a"}, {Name: "b"}, {Name: "c"}}

// replica is a router with its Sync.
type replica struct {
	r *kvroute.DefaultRouter
	s *Sync
}

// fastConfig is a Sync's Config with a short heartbeat and peer timeout.
func fastConfig(url, id string) Config {
	return Config{URL: url, ReplicaID: id, Group: "test", Heartbeat: 50 * time.Millisecond, PeerTimeout: 500 * time.Millisecond}
}

// newReplica builds a replica in kvroute's order: the Sync, the router with the Sync as its
// Peers, then Start with the router.
func newReplica(t *testing.T, cfg Config, rcfg kvroute.Config) replica {
	t.Helper()
	if cfg.Logger == nil {
		w := &testWriter{t: t}
		t.Cleanup(w.stop) // registered first, so it runs after the Sync's Close
		cfg.Logger = slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	s, err := New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	if rcfg.Backends == nil {
		rcfg.Backends = testBackends
	}
	rcfg.Peers = s
	r, err := kvroute.New(rcfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	require.NoError(t, s.Start(context.Background(), r))
	return replica{r, s}
}

// testWriter sends a Sync's logs to the test's log, until the test ends.
type testWriter struct {
	mu   sync.Mutex
	t    *testing.T
	done bool
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.t.Log(strings.TrimSuffix(string(p), "\n"))
	}
	return len(p), nil
}

func (w *testWriter) stop() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.done = true
}

// hears reports whether s has heard from the replica named id.
func hears(s *Sync, id string) bool {
	return slices.ContainsFunc(s.Stats().Peers, func(p PeerInfo) bool { return p.Replica == id })
}

// waitPeers waits until every replica hears every other.
func waitPeers(t *testing.T, rs ...replica) {
	t.Helper()
	require.Eventually(t, func() bool {
		for _, x := range rs {
			for _, y := range rs {
				if x.s != y.s && !hears(x.s, y.s.ReplicaID()) {
					return false
				}
			}
		}
		return true
	}, waitFor, tick, "the replicas do not hear each other")
}

func chatReq(system string) *prefixkey.Request {
	return &prefixkey.Request{Format: prefixkey.FormatOpenAIChat, Model: testModel, System: system, HasSystem: true,
		Messages: []prefixkey.Message{{Role: "user", Text: "q"}}}
}

func tokReq(tokens []uint32) *prefixkey.Request {
	r := chatReq("sys")
	r.TokenIDs = tokens
	return r
}

func promptTokens(seed, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32((seed*7919 + i*2654435761) % 128256)
	}
	return out
}

func loads(r *kvroute.DefaultRouter) (own, external map[string]int) {
	own, external = map[string]int{}, map[string]int{}
	st, _ := r.Stats(context.Background())
	for _, b := range st.Backends {
		own[b.Name], external[b.Name] = b.InFlight, b.ExternalLoad
	}
	return own, external
}

// peerStats is what r knows of its peers (kvroute.Stats.Peers).
func peerStats(r *kvroute.DefaultRouter) kvroute.PeerStats {
	st, _ := r.Stats(context.Background())
	return st.Peers
}

func externalLoads(r *kvroute.DefaultRouter) map[string]int {
	_, ext := loads(r)
	return ext
}

func ownLoads(r *kvroute.DefaultRouter) map[string]int {
	own, _ := loads(r)
	return own
}

var idle = map[string]int{"a": 0, "b": 0, "c": 0}

func route(t *testing.T, r *kvroute.DefaultRouter, req *prefixkey.Request) *kvroute.Decision {
	t.Helper()
	d, err := r.Route(context.Background(), req)
	require.NoError(t, err)
	return d
}

func finish(ds ...*kvroute.Decision) {
	for _, d := range ds {
		d.FirstToken()
		d.Done(kvroute.Outcome{})
	}
}

// (a) One replica's requests weigh on the other's backends until they end, and the other decides
// as the first would.
func TestSharesLoad(t *testing.T) {
	srv := natstest.Start(t)
	a := newReplica(t, fastConfig(srv.URL(), "replica-a"), kvroute.Config{})
	b := newReplica(t, fastConfig(srv.URL(), "replica-b"), kvroute.Config{})
	waitPeers(t, a, b)

	req := chatReq("one shared system prompt")
	var ds []*kvroute.Decision
	for range 8 {
		ds = append(ds, route(t, a.r, req))
	}
	own := ownLoads(a.r)
	require.Eventually(t, func() bool { return assert.ObjectsAreEqual(own, externalLoads(b.r)) }, waitFor, tick,
		"b's external load is a's in-flight requests")
	assert.Equal(t, kvroute.PeerStats{Peers: 1, InFlight: 8, Applied: 8}, peerStats(b.r))

	// a's ninth request for the prefix would overflow its owner, at its bound; b's does too.
	p, err := a.r.Probe(context.Background(), req)
	require.NoError(t, err)
	require.Equal(t, kvroute.ReasonOverflow, p.Reason)
	db := route(t, b.r, req)
	assert.Equal(t, kvroute.ReasonOverflow, db.Reason, "b decides as a would")
	assert.Equal(t, p.Backend, db.Backend)
	finish(db)

	finish(ds...)
	require.Eventually(t, func() bool { return assert.ObjectsAreEqual(idle, externalLoads(b.r)) && peerStats(b.r).InFlight == 0 },
		waitFor, tick, "a's requests leave b's backends when they end")
	require.Eventually(t, func() bool { return assert.ObjectsAreEqual(idle, externalLoads(a.r)) }, waitFor, tick)
	st := b.s.Stats()
	assert.Equal(t, uint64(8*3), st.Applied, "routed, first token and done of each")
	assert.Zero(t, st.DecodeErrors)
	assert.Zero(t, st.Gaps)
	assert.Zero(t, st.Dropped)
	assert.Equal(t, uint64(3), a.s.Stats().Applied, "b's one decision, its first token and its end")
}

// (b) With tier 4, a's decision's block keys are speculated on b: b routes the same prompt to a's
// backend by its KV index.
func TestSpeculates(t *testing.T) {
	srv := natstest.Start(t)
	kv := func() *kvroute.KVConfig {
		ix, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: testModel})
		require.NoError(t, err)
		t.Cleanup(func() { _ = ix.Close() })
		// A speculation TTL that a slow test run cannot outlast.
		return &kvroute.KVConfig{Index: ix, SpeculativeTTL: time.Minute}
	}
	a := newReplica(t, fastConfig(srv.URL(), "replica-a"), kvroute.Config{KV: kv()})
	b := newReplica(t, fastConfig(srv.URL(), "replica-b"), kvroute.Config{KV: kv()})
	waitPeers(t, a, b)

	tokens := promptTokens(3, 2048)
	da := route(t, a.r, tokReq(tokens))
	// The router counts a's decision, then speculates its blocks: wait for both.
	require.Eventually(t, func() bool {
		p, err := b.r.Probe(context.Background(), tokReq(tokens))
		return err == nil && p.Reason == kvroute.ReasonKVAware && peerStats(b.r).InFlight == 1
	}, waitFor, tick)
	db := route(t, b.r, tokReq(tokens))
	assert.Equal(t, kvroute.ReasonKVAware, db.Reason)
	assert.Equal(t, da.Backend, db.Backend)
	assert.Equal(t, 1, externalLoads(b.r)[da.Backend])
	finish(da, db)
	require.Eventually(t, func() bool { return peerStats(b.r).InFlight == 0 && peerStats(a.r).InFlight == 0 }, waitFor, tick)
}

// (c) The server stops mid-flow: routing goes on without blocking, the peers are forgotten after
// the timeout, and sharing resumes when the server is back.
func TestSurvivesServerRestart(t *testing.T) {
	srv := natstest.Start(t)
	a := newReplica(t, fastConfig(srv.URL(), "replica-a"), kvroute.Config{})
	b := newReplica(t, fastConfig(srv.URL(), "replica-b"), kvroute.Config{})
	waitPeers(t, a, b)

	var before []*kvroute.Decision
	for i := range 3 {
		before = append(before, route(t, a.r, chatReq(string(rune('x'+i)))))
	}
	require.Eventually(t, func() bool { return peerStats(b.r).InFlight == 3 }, waitFor, tick)

	srv.Stop()
	require.Eventually(t, func() bool { return !a.s.Stats().Connected && !b.s.Stats().Connected }, waitFor, tick)

	// Routing while the server is down: nothing waits for it.
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 500 {
			d, err := a.r.Route(context.Background(), chatReq(strings.Repeat("p", i%7+1)))
			if err == nil {
				finish(d)
			}
		}
		finish(before...)
	}()
	require.Eventually(t, func() bool {
		select {
		case <-done:
			return true
		default:
			return false
		}
	}, waitFor, tick, "Route blocked while NATS was down")

	// Neither hears the other: each forgets the other, and its load.
	require.Eventually(t, func() bool {
		return peerStats(b.r).Peers == 0 && len(b.s.Stats().Peers) == 0 && len(a.s.Stats().Peers) == 0
	}, waitFor, tick)
	assert.Equal(t, idle, externalLoads(b.r))
	assert.Equal(t, uint64(1), b.s.Stats().TimedOut)
	assert.Equal(t, "RECONNECTING", a.s.Stats().Connection)

	srv.Restart()
	require.Eventually(t, func() bool { return a.s.Stats().Connected && b.s.Stats().Connected }, waitFor, tick)
	waitPeers(t, a, b)
	// What a buffered while the server was down reached b in the end, or was lost; either way
	// its requests have ended and weigh nothing on b.
	require.Eventually(t, func() bool { return assert.ObjectsAreEqual(idle, externalLoads(b.r)) }, waitFor, tick)

	var after []*kvroute.Decision
	for i := range 4 {
		after = append(after, route(t, a.r, chatReq(string(rune('a'+i)))))
	}
	own := ownLoads(a.r)
	require.Eventually(t, func() bool { return assert.ObjectsAreEqual(own, externalLoads(b.r)) }, waitFor, tick,
		"a's new decisions reach b")
	finish(after...)
	require.Eventually(t, func() bool { return assert.ObjectsAreEqual(idle, externalLoads(b.r)) }, waitFor, tick)
}

// (d) A replica that closes says goodbye: the others forget it at once, not after its timeout.
func TestGoodbye(t *testing.T) {
	srv := natstest.Start(t)
	slow := fastConfig(srv.URL(), "replica-b")
	slow.PeerTimeout = time.Hour // only a goodbye can make b forget a
	a := newReplica(t, fastConfig(srv.URL(), "replica-a"), kvroute.Config{})
	b := newReplica(t, slow, kvroute.Config{})
	waitPeers(t, a, b)

	d1, d2 := route(t, a.r, chatReq("x")), route(t, a.r, chatReq("y"))
	require.Eventually(t, func() bool { return peerStats(b.r).InFlight == 2 }, waitFor, tick)

	require.NoError(t, a.s.Close())
	require.Eventually(t, func() bool { return peerStats(b.r).Peers == 0 && !hears(b.s, "replica-a") }, waitFor, tick)
	assert.Equal(t, idle, externalLoads(b.r))
	assert.Equal(t, uint64(1), b.s.Stats().Goodbyes)
	assert.Zero(t, b.s.Stats().TimedOut)
	assert.Equal(t, kvroute.PeerStats{Forgot: 2, Applied: 2}, peerStats(b.r))

	// a's router outlives its Sync: its events are dropped, and a second Close is harmless.
	finish(d1, d2)
	assert.Equal(t, uint64(4), a.s.Stats().Dropped, "the first tokens and ends")
	require.NoError(t, a.s.Close())
	assert.Equal(t, "CLOSED", a.s.Stats().Connection)
	assert.Zero(t, peerStats(a.r).Peers)
}

// rawConn is a plain NATS connection for publishing by hand.
func rawConn(t *testing.T, url string) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return nc
}

// (e) Malformed messages on the subject are counted and dropped; nothing of them is applied.
func TestMalformedMessages(t *testing.T) {
	srv := natstest.Start(t)
	b := newReplica(t, fastConfig(srv.URL(), "replica-b"), kvroute.Config{})
	nc := rawConn(t, srv.URL())

	routed := encodeMessage(msgEvents, "x", 1, []kvroute.PeerEvent{{Kind: kvroute.PeerRouted, ID: 1, Backend: "a"}})
	garbage := [][]byte{
		nil,
		[]byte("hello"),
		append([]byte{2}, routed[1:]...), // another version
		routed[:len(routed)-1],           // truncated
		append(slices.Clone(routed), 0),  // trailing byte
		{1, 1, 0},                        // no replica id
	}
	for _, g := range garbage {
		require.NoError(t, nc.Publish(b.s.Subject(), g))
	}
	require.NoError(t, nc.Flush())
	require.Eventually(t, func() bool { return b.s.Stats().DecodeErrors == uint64(len(garbage)) }, waitFor, tick)
	st := b.s.Stats()
	assert.Zero(t, st.Received)
	assert.Zero(t, st.Applied)
	assert.Empty(t, st.Peers)
	assert.Equal(t, kvroute.PeerStats{}, peerStats(b.r))
	assert.Equal(t, idle, externalLoads(b.r))

	// A well-formed message still goes through.
	require.NoError(t, nc.Publish(b.s.Subject(), routed))
	require.Eventually(t, func() bool { return externalLoads(b.r)["a"] == 1 }, waitFor, tick)
	assert.Equal(t, uint64(1), b.s.Stats().Applied)
}

// A gap in a peer's sequence means lost messages, perhaps a decision's end: the peer's decisions
// are forgotten rather than left to weigh on their backends for PeerMaxAge.
func TestSequenceGapForgets(t *testing.T) {
	srv := natstest.Start(t)
	cfg := fastConfig(srv.URL(), "replica-b")
	cfg.PeerTimeout = time.Hour
	b := newReplica(t, cfg, kvroute.Config{})
	nc := rawConn(t, srv.URL())
	pub := func(typ byte, seq uint64, evs ...kvroute.PeerEvent) {
		require.NoError(t, nc.Publish(b.s.Subject(), encodeMessage(typ, "x", seq, evs)))
	}

	pub(msgEvents, 7, kvroute.PeerEvent{Kind: kvroute.PeerRouted, ID: 1, Backend: "a"}) // first contact: any sequence
	pub(msgHeartbeat, 8)
	pub(msgEvents, 9, kvroute.PeerEvent{Kind: kvroute.PeerRouted, ID: 2, Backend: "b"})
	require.Eventually(t, func() bool { return peerStats(b.r).InFlight == 2 }, waitFor, tick)
	assert.Zero(t, b.s.Stats().Gaps)

	pub(msgHeartbeat, 11) // 10 was lost
	require.Eventually(t, func() bool { return b.s.Stats().Gaps == 1 }, waitFor, tick)
	assert.Equal(t, idle, externalLoads(b.r))
	pub(msgEvents, 12, kvroute.PeerEvent{Kind: kvroute.PeerRouted, ID: 3, Backend: "c"})
	require.Eventually(t, func() bool { return externalLoads(b.r)["c"] == 1 }, waitFor, tick)

	// A replica restarted under the same id starts its sequence again: a gap too.
	pub(msgHeartbeat, 1)
	require.Eventually(t, func() bool { return b.s.Stats().Gaps == 2 }, waitFor, tick)
	assert.Equal(t, idle, externalLoads(b.r))
}

// Two Syncs may share the caller's connection, which echoes their messages: each ignores its own,
// and Close leaves the connection open.
func TestSharedConnection(t *testing.T) {
	srv := natstest.Start(t)
	nc := rawConn(t, srv.URL())
	cfg := func(id string) Config {
		c := fastConfig("", id)
		c.Conn = nc
		return c
	}
	a := newReplica(t, cfg("replica-a"), kvroute.Config{})
	b := newReplica(t, cfg("replica-b"), kvroute.Config{})
	waitPeers(t, a, b)
	d := route(t, a.r, chatReq("x"))
	require.Eventually(t, func() bool { return peerStats(b.r).InFlight == 1 }, waitFor, tick)
	assert.Zero(t, peerStats(a.r).InFlight, "a ignores its own messages")
	assert.Len(t, a.s.Stats().Peers, 1)
	finish(d)

	require.NoError(t, a.s.Close())
	require.NoError(t, b.s.Close())
	assert.True(t, nc.IsConnected(), "the caller's connection stays open")
}

func TestConfig(t *testing.T) {
	nc := &nats.Conn{}
	for _, tc := range []struct {
		name string
		cfg  Config
		ok   bool
	}{
		{"conn", Config{Conn: nc}, true},
		{"nothing", Config{}, false},
		{"both", Config{Conn: nc, URL: "nats://x"}, false},
		{"options with conn", Config{Conn: nc, Options: []nats.Option{nats.NoEcho()}}, false},
		{"prefix", Config{Conn: nc, SubjectPrefix: "a.b-c_d", Group: "fleet-1"}, true},
		{"prefix wildcard", Config{Conn: nc, SubjectPrefix: "a.*"}, false},
		{"prefix tail", Config{Conn: nc, SubjectPrefix: "a.>"}, false},
		{"prefix empty token", Config{Conn: nc, SubjectPrefix: "a..b"}, false},
		{"prefix trailing dot", Config{Conn: nc, SubjectPrefix: "a."}, false},
		{"group dot", Config{Conn: nc, Group: "a.b"}, false},
		{"group space", Config{Conn: nc, Group: "a b"}, false},
		{"group tab", Config{Conn: nc, Group: "a\tb"}, false},
		{"group wildcard", Config{Conn: nc, Group: "*"}, false},
		{"replica id too long", Config{Conn: nc, ReplicaID: strings.Repeat("r", 256)}, false},
		{"replica id longest", Config{Conn: nc, ReplicaID: strings.Repeat("r", 255)}, true},
		{"heartbeat negative", Config{Conn: nc, Heartbeat: -1}, false},
		{"timeout below heartbeat", Config{Conn: nc, Heartbeat: time.Second, PeerTimeout: time.Second}, false},
		{"buffer negative", Config{Conn: nc, BufferSize: -1}, false},
		{"flush above heartbeat", Config{Conn: nc, FlushInterval: 2 * time.Second}, false},
		{"message too small", Config{Conn: nc, MaxMessageBytes: 100}, false},
		{"message too large", Config{Conn: nc, MaxMessageBytes: 2 << 20}, false},
		{"malformed URL", Config{URL: "nats://[::1"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := New(tc.cfg)
			if !tc.ok {
				assert.Error(t, err)
				if tc.name != "malformed URL" {
					assert.ErrorIs(t, err, ErrInvalidConfig)
				}
				return
			}
			require.NoError(t, err)
			assert.NotEmpty(t, s.ReplicaID())
		})
	}
	s, err := New(Config{Conn: nc})
	require.NoError(t, err)
	assert.Equal(t, "kvroute.replicas.default", s.Subject())
	assert.Len(t, s.ReplicaID(), 16)
	s2, err := New(Config{Conn: nc})
	require.NoError(t, err)
	assert.NotEqual(t, s.ReplicaID(), s2.ReplicaID(), "random ids")
}

func TestLifecycle(t *testing.T) {
	srv := natstest.Start(t)
	s, err := New(Config{URL: srv.URL()})
	require.NoError(t, err)
	require.NoError(t, s.Start(context.Background(), NopApplier{}))
	assert.ErrorIs(t, s.Start(context.Background(), NopApplier{}), ErrStarted)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() { assert.NoError(t, s.Close()) })
	}
	wg.Wait()
	assert.ErrorIs(t, s.Start(context.Background(), NopApplier{}), ErrClosed)
	assert.Equal(t, "CLOSED", s.Stats().Connection)

	// Closed before it started: the connection it dialled is closed all the same.
	s, err = New(Config{URL: srv.URL()})
	require.NoError(t, err)
	require.NoError(t, s.Close())
	assert.Equal(t, "CLOSED", s.Stats().Connection)
	assert.Error(t, s.Start(context.Background(), nil))

	// The server is down: New succeeds, and the connection keeps trying.
	srv.Stop()
	s, err = New(Config{URL: srv.URL()})
	require.NoError(t, err)
	assert.False(t, s.Stats().Connected)
	require.NoError(t, s.Start(context.Background(), NopApplier{}))
	srv.Restart()
	require.Eventually(t, func() bool { return s.Stats().Connected && s.Stats().Sent > 0 }, waitFor, tick)
	require.NoError(t, s.Close())
}
