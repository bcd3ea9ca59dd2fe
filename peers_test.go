package kvroute

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/scorer"
)

// relay delivers one replica's peer events to others at once, as a bus with no delay would.
type relay struct {
	mu     sync.Mutex
	from   string
	to     []*DefaultRouter
	events []PeerEvent
	held   bool // keep events instead of delivering them
}

func (l *relay) PublishPeerEvent(ev PeerEvent) {
	ev.BlockKeys = slices.Clone(ev.BlockKeys)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.events = append(l.events, ev)
	if l.held {
		return
	}
	for _, r := range l.to {
		r.ApplyPeerEvent(l.from, ev)
	}
}

func externalLoads(r *DefaultRouter) map[string]int {
	out := map[string]int{}
	st, _ := r.Stats(context.Background())
	for _, b := range st.Backends {
		out[b.Name] = b.ExternalLoad
	}
	return out
}

func TestPeerEventsShareLoad(t *testing.T) {
	backends := []Backend{{Name: "a"}, {Name: "b"}, {Name: "c"}}
	rb, err := New(Config{Backends: backends})
	require.NoError(t, err)
	ra, err := New(Config{Backends: backends, Peers: &relay{from: "replica-a", to: []*DefaultRouter{rb}}})
	require.NoError(t, err)

	// Replica a routes eight requests of one prefix: tier 1 spreads them within the bound.
	var ds []*Decision
	for range 8 {
		d, err := ra.Route(context.Background(), chatReq("one shared system prompt", "q"))
		require.NoError(t, err)
		ds = append(ds, d)
	}
	own := map[string]int{}
	for _, l := range statsOf(t, ra).Backends {
		own[l.Name] = l.InFlight
	}
	assert.Equal(t, own, externalLoads(rb), "b's external load is a's in-flight requests")
	assert.Equal(t, PeerStats{Peers: 1, InFlight: 8, Applied: 8}, statsOf(t, rb).Peers)

	// b's own decision for the same prefix sees a's load: the prefix's owner is at its bound
	// (T counts a's eight), so b's request overflows, as a's ninth would.
	ca, ra1, err := ra.ring.Candidate(chatKey(t, ra))
	require.NoError(t, err)
	db, err := rb.Route(context.Background(), chatReq("one shared system prompt", "q"))
	require.NoError(t, err)
	assert.Equal(t, ReasonOverflow.String(), ra1.String(), "a's ninth would overflow")
	assert.Equal(t, ReasonOverflow, db.Reason, "b decides as a would")
	assert.Equal(t, ca, db.Backend)
	db.Done(Outcome{})

	for _, d := range ds {
		d.FirstToken()
		d.Done(Outcome{})
	}
	assert.Equal(t, map[string]int{"a": 0, "b": 0, "c": 0}, externalLoads(rb))
	st := statsOf(t, rb).Peers
	assert.Equal(t, 0, st.InFlight)
	assert.Equal(t, 0, st.Peers)
	assert.Equal(t, uint64(8*3), st.Applied, "routed, first token and done of each")
}

func TestPeerEventsSpeculateAndTrackActive(t *testing.T) {
	sc, active := tracked(t)
	kvb := &KVConfig{Index: newMemIndex(t), Scorer: sc}
	backends := []Backend{{Name: "a"}, {Name: "b"}, {Name: "c"}}
	rb, err := New(Config{Backends: backends, KV: kvb})
	require.NoError(t, err)
	ra, err := New(Config{Backends: backends, KV: &KVConfig{Index: newMemIndex(t)},
		Peers: &relay{from: "replica-a", to: []*DefaultRouter{rb}}})
	require.NoError(t, err)

	tokens := promptTokens(3, 40*16)
	da, err := ra.Route(context.Background(), tokReq("sys", tokens))
	require.NoError(t, err)
	// b never saw the engines' events, but a's decision speculated the blocks on its backend:
	// b routes the same prompt there, by the KV index.
	db, err := rb.Route(context.Background(), tokReq("sys", tokens))
	require.NoError(t, err)
	assert.Equal(t, da.Backend, db.Backend)
	assert.Equal(t, ReasonKVAware, db.Reason)
	db.Done(Outcome{})

	// a's request is an active sequence on b's tracker until a's Done.
	cands := []scorer.Candidate{{Backend: da.Backend}}
	active.Fill(cands)
	assert.Positive(t, cands[0].ActiveDecodeBlocks)
	assert.Equal(t, 40*16, pendingPrefill(rb, da.Backend), "a's prefill tokens are on b's backlog")
	da.FirstToken()
	assert.Zero(t, pendingPrefill(rb, da.Backend))
	da.Done(Outcome{})
	cands[0] = scorer.Candidate{Backend: da.Backend}
	active.Fill(cands)
	assert.Zero(t, cands[0].ActiveDecodeBlocks)
}

// chatKey is the ring key of TestPeerEventsShareLoad's requests.
func chatKey(t *testing.T, r *DefaultRouter) uint64 {
	k, ok := chatReq("one shared system prompt", "q").PrefixKey(r.cfg.MaxPrefixLength)
	require.True(t, ok)
	return k.Uint64()
}

func pendingPrefill(r *DefaultRouter, backend string) int {
	return int(r.set.Load().byName[backend].backlog.Load())
}

func TestPeerEventsLostOrStale(t *testing.T) {
	now := time.Unix(1000, 0)
	var mu sync.Mutex
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	r, err := New(Config{Backends: []Backend{{Name: "a"}, {Name: "b"}}, Now: clock, PeerMaxAge: time.Minute})
	require.NoError(t, err)

	// Events of decisions never seen, of unknown backends, and a repeated Routed are ignored.
	r.ApplyPeerEvent("p", PeerEvent{Kind: PeerDone, ID: 7})
	r.ApplyPeerEvent("p", PeerEvent{Kind: PeerRouted, ID: 1, Backend: "zz"})
	r.ApplyPeerEvent("p", PeerEvent{Kind: PeerRouted, ID: 1, Backend: "a", PrefillTokens: 100})
	r.ApplyPeerEvent("p", PeerEvent{Kind: PeerRouted, ID: 1, Backend: "a", PrefillTokens: 100})
	r.ApplyPeerEvent("p", PeerEvent{Kind: 99, ID: 1})
	assert.Equal(t, uint64(4), statsOf(t, r).Peers.Ignored)
	assert.Equal(t, 1, externalLoads(r)["a"])
	assert.Equal(t, 100, pendingPrefill(r, "a"))

	// A Done that never comes: the decision expires PeerMaxAge after it arrived.
	mu.Lock()
	now = now.Add(30 * time.Second)
	mu.Unlock()
	r.ApplyPeerEvent("q", PeerEvent{Kind: PeerRouted, ID: 1, Backend: "b"})
	mu.Lock()
	now = now.Add(31 * time.Second)
	mu.Unlock()
	st := statsOf(t, r).Peers
	assert.Equal(t, uint64(1), st.Expired)
	assert.Equal(t, 1, st.InFlight)
	assert.Equal(t, map[string]int{"a": 0, "b": 1}, externalLoads(r))
	assert.Zero(t, pendingPrefill(r, "a"))

	// A replica that stopped is forgotten at once.
	r.ApplyPeerEvent("q", PeerEvent{Kind: PeerRouted, ID: 2, Backend: "b"})
	assert.Equal(t, 2, r.ForgetPeer("q"))
	assert.Zero(t, r.ForgetPeer("q"))
	assert.Equal(t, map[string]int{"a": 0, "b": 0}, externalLoads(r))
	assert.Equal(t, uint64(2), statsOf(t, r).Peers.Forgot)
	assert.Equal(t, 0, statsOf(t, r).Peers.Peers)
}

func TestReportEngineLoad(t *testing.T) {
	now := time.Unix(1000, 0)
	var mu sync.Mutex
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	r, err := New(Config{Backends: []Backend{{Name: "a"}, {Name: "b"}}, EngineLoadMaxAge: 2 * time.Second, Now: clock})
	require.NoError(t, err)
	d, err := r.Route(context.Background(), chatReq("sys", "q"))
	require.NoError(t, err)
	defer d.Done(Outcome{})

	// The engine counts this Router's request too: only what it reports beyond it is external.
	require.NoError(t, r.ReportEngineLoad(d.Backend, EngineLoad{Running: 3, Waiting: 2, KVCacheUsage: 0.5}))
	assert.Equal(t, 4, externalLoads(r)[d.Backend])
	var got *EngineLoad
	for _, b := range statsOf(t, r).Backends {
		if b.Name == d.Backend {
			got = b.Engine
		}
	}
	require.NotNil(t, got)
	assert.Equal(t, 3, got.Running)

	// Peers' load counts when it is the larger.
	for i := range 6 {
		r.ApplyPeerEvent("p", PeerEvent{Kind: PeerRouted, ID: uint64(i + 1), Backend: d.Backend})
	}
	assert.Equal(t, 6, externalLoads(r)[d.Backend])
	r.ForgetPeer("p")
	assert.Equal(t, 4, externalLoads(r)[d.Backend])

	// A report too old on arrival is not applied; a report that ages out, by the Router's clock,
	// stops counting at the next Route.
	require.NoError(t, r.ReportEngineLoad(d.Backend, EngineLoad{Running: 50, At: clock().Add(-3 * time.Second)}))
	assert.Equal(t, 4, externalLoads(r)[d.Backend])
	advance(1999 * time.Millisecond)
	d2, err := r.Route(context.Background(), chatReq("sys", "q"))
	require.NoError(t, err)
	d2.Done(Outcome{})
	assert.Equal(t, 4, externalLoads(r)[d.Backend], "still fresh 1.999 s after")
	advance(time.Millisecond)
	d3, err := r.Route(context.Background(), chatReq("sys", "q"))
	require.NoError(t, err)
	d3.Done(Outcome{})
	assert.Equal(t, 0, r.ring.Loads(nil)[backendIndex(r, d.Backend)].External, "stale 2 s after, by Config.Now")
	st := statsOf(t, r).Peers
	assert.Equal(t, uint64(1), st.EngineReports)
	assert.Equal(t, uint64(2), st.EngineStale)
	assert.ErrorIs(t, r.ReportEngineLoad("zz", EngineLoad{}), ErrUnknownBackend)
}

// backendIndex is backend's index in r's ring loads.
func backendIndex(r *DefaultRouter, backend string) int {
	for i, l := range r.ring.Loads(nil) {
		if l.Name == backend {
			return i
		}
	}
	return -1
}

func TestPeerConfigValidated(t *testing.T) {
	_, err := New(Config{PeerMaxAge: -time.Second})
	assert.ErrorIs(t, err, ErrInvalidConfig)
	_, err = New(Config{EngineLoadMaxAge: 2 * time.Hour})
	assert.ErrorIs(t, err, ErrInvalidConfig)
}

func TestPeerAndEngineBounds(t *testing.T) {
	now := time.Unix(1000, 0)
	var mu sync.Mutex
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	r, err := New(Config{Backends: []Backend{{Name: "a"}, {Name: "b"}}, Now: clock, PeerMaxAge: time.Minute})
	require.NoError(t, err)

	// Huge reported counts are capped: the ring's total cannot overflow, and routing goes on.
	require.NoError(t, r.ReportEngineLoad("a", EngineLoad{Running: 1 << 62, Waiting: 1 << 62}))
	require.NoError(t, r.ReportEngineLoad("b", EngineLoad{Running: 1 << 62, Waiting: 1 << 62}))
	d, err := r.Route(context.Background(), chatReq("sys", "q"))
	require.NoError(t, err)
	d.Done(Outcome{})
	assert.Equal(t, 1<<30, externalLoads(r)["a"])

	// A peer decision's prefill tokens are capped too.
	r.ApplyPeerEvent("p", PeerEvent{Kind: PeerRouted, ID: 1, Backend: "b", PrefillTokens: 1<<62 + 5})
	assert.Equal(t, maxReportedLoad, pendingPrefill(r, "b"))

	// A peer decision whose end never comes expires at the next Route after PeerMaxAge, with no
	// other peer event or stats call.
	mu.Lock()
	now = now.Add(2 * time.Minute)
	mu.Unlock()
	d, err = r.Route(context.Background(), chatReq("sys", "q"))
	require.NoError(t, err)
	d.Done(Outcome{})
	assert.Zero(t, pendingPrefill(r, "b"), "expired by Route")
	assert.Equal(t, uint64(1), r.peers.expired.Load())
}
