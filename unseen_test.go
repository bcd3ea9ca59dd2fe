package kvroute

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/scorer"
)

func TestSpreadUnseen(t *testing.T) {
	cand := func(pending, weight float64, healthy bool) scorer.Candidate {
		return scorer.Candidate{PendingPrefillWork: pending, Weight: weight, Healthy: healthy}
	}
	for _, tc := range []struct {
		name  string
		cands []scorer.Candidate
		u     float64
		want  []float64
	}{
		{"two idle share it", []scorer.Candidate{cand(0, 1, true), cand(400, 1, true), cand(0, 1, true), cand(100, 1, true)},
			150, []float64{75, 400, 75, 100}},
		{"the level reaches a busier one", []scorer.Candidate{cand(0, 1, true), cand(400, 1, true), cand(0, 1, true), cand(100, 1, true)},
			500, []float64{200, 400, 200, 200}},
		{"above every one", []scorer.Candidate{cand(0, 1, true), cand(400, 1, true), cand(0, 1, true), cand(100, 1, true)},
			10_000, []float64{2625, 2625, 2625, 2625}},
		{"by weight", []scorer.Candidate{cand(0, 2, true), cand(0, 1, true)}, 30, []float64{20, 10}},
		{"an unhealthy one takes none", []scorer.Candidate{cand(0, 1, false), cand(50, 1, true)}, 10, []float64{0, 60}},
		{"nothing unseen", []scorer.Candidate{cand(0, 1, true), cand(50, 1, true)}, 0, []float64{0, 50}},
		{"NaN", []scorer.Candidate{cand(0, 1, true), cand(50, 1, true)}, math.NaN(), []float64{0, 50}},
		{"Inf", []scorer.Candidate{cand(0, 1, true), cand(50, 1, true)}, math.Inf(1), []float64{0, 50}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spreadUnseen(tc.cands, tc.u, nil)
			for i, c := range tc.cands {
				assert.InDelta(t, tc.want[i], c.PendingPrefillWork, 1e-9, "candidate %d", i)
			}
		})
	}
}

func TestCapUnseen(t *testing.T) {
	u, n := capUnseen(800, 8, 16)
	assert.Equal(t, [2]float64{800, 8}, [2]float64{u, n}, "fewer unseen decisions than candidates")
	u, n = capUnseen(8000, 80, 16)
	assert.Equal(t, [2]float64{1600, 16}, [2]float64{u, n}, "at most one per candidate, at their mean work")
	u, n = capUnseen(0, 0, 0)
	assert.Equal(t, [2]float64{0, 0}, [2]float64{u, n})
}

// The peers' unseen work is their decayed rate of routed prefill work times twice PeerDelay, and
// their unseen decisions likewise; a negative PeerDelay turns them off, and without peers'
// decisions there are none.
func TestUnseenPeerWork(t *testing.T) {
	for _, delay := range []time.Duration{0, 50 * time.Millisecond, -1} {
		clock := newStepClock()
		r := newRouter(t, Config{Backends: backends(2), Now: clock.Now, PeerDelay: delay,
			KV: &KVConfig{Index: newMemIndex(t), Speculation: SpeculationOff}})
		check := func(wantWork, wantN float64, what string) {
			t.Helper()
			w, n := r.unseenPeerWork(r.since(clock.Now()))
			assert.InDelta(t, wantWork, w, 1e-9, "PeerDelay %v, %s: work", delay, what)
			assert.InDelta(t, wantN, n, 1e-9, "PeerDelay %v, %s: decisions", delay, what)
		}
		check(0, 0, "no peers' decisions yet")
		r.ApplyPeerEvent("replica-b", PeerEvent{Kind: PeerRouted, ID: 1, Backend: backends(2)[1].Name, PrefillTokens: 1000})
		work := float64(r.peerWork(1000, 0))
		d := map[time.Duration]time.Duration{0: DefaultPeerDelay, 50 * time.Millisecond: 50 * time.Millisecond, -1: 0}[delay]
		f := 2 * d.Seconds() / unseenWindow.Seconds()
		check(work*f, f, "one decision")
		clock.advance(unseenWindow)
		check(work*f/math.E, f/math.E, "one window later")
		r.ApplyPeerEvent("replica-b", PeerEvent{Kind: PeerRouted, ID: 2, Backend: backends(2)[0].Name, PrefillTokens: 1000})
		check(work*f*(1/math.E+1), f*(1/math.E+1), "a second decision")
	}
	_, err := New(Config{PeerDelay: 2 * time.Minute})
	assert.ErrorIs(t, err, ErrInvalidConfig)
}

// namedRelay is a relay that names its replica (ReplicaID), as natsync.Sync does.
type namedRelay struct{ *relay }

func (l namedRelay) ReplicaID() string { return l.from }

// Two replicas with alike views route a burst of different cold prompts while their decisions
// have not reached each other. Without the estimate of peers' unseen work they choose alike, the
// k-th prompt of one on the same backend as the k-th of the other; with it, the prompts spread
// over the backends that the peers' unseen work fills, by a hash of the prompt; and replicas that
// know their names take different shares of those backends, so that no two choose alike.
func TestReplicasSpreadABurst(t *testing.T) {
	collisions := func(delay time.Duration, named bool) int {
		clock := newStepClock()
		bs := backends(8)
		var rs [2]*DefaultRouter
		links := [2]*relay{{from: "replica-a"}, {from: "replica-b"}}
		for i := range rs {
			var pub PeerPublisher = links[i]
			if named {
				pub = namedRelay{links[i]}
			}
			rs[i] = newRouter(t, Config{Backends: bs, Now: clock.Now, Peers: pub, PeerDelay: delay,
				KV: &KVConfig{Index: newMemIndex(t), Speculation: SpeculationOff}})
		}
		links[0].to, links[1].to = []*DefaultRouter{rs[1]}, []*DefaultRouter{rs[0]}
		ctx := context.Background()
		// A busy second: each replica routes prompts that the other sees at once; all but the
		// last of each end.
		for k := range 40 {
			d, err := rs[k%2].Route(ctx, tokReq("warm", promptTokens(1000+k, 4096)))
			require.NoError(t, err)
			if k < 38 {
				d.Done(Outcome{})
			}
			clock.advance(25 * time.Millisecond)
		}
		// The burst: the two replicas' decisions stay on the bus.
		links[0].held, links[1].held = true, true
		n := 0
		for k := range 6 {
			var got [2]string
			for i, r := range rs {
				d, err := r.Route(ctx, tokReq("burst", promptTokens(2000+2*k+i, 4096)))
				require.NoError(t, err)
				require.Equal(t, ReasonLeastWork, d.Reason)
				got[i] = d.Backend
			}
			if got[0] == got[1] {
				n++
			}
		}
		return n
	}
	assert.Equal(t, 6, collisions(-1, false), "without the estimate the replicas choose alike")
	assert.Equal(t, 6, collisions(-1, true), "without the estimate names change nothing")
	assert.LessOrEqual(t, collisions(500*time.Millisecond, false), 2, "with it the prompts spread")
	assert.Zero(t, collisions(500*time.Millisecond, true), "named replicas take their own shares")
}

// nameOnly is a PeerPublisher that names its replica and sends nothing.
type nameOnly string

func (nameOnly) PublishPeerEvent(PeerEvent) {}
func (n nameOnly) ReplicaID() string        { return string(n) }

// Breaking ties apart from the other replicas does not send cold prompts to backends with many
// more requests in flight than the unseen peer decisions could explain: with a name (whose share
// holds the busy backends) and without, at a high peer rate and after it has died down.
func TestUnseenKeepsLoadApart(t *testing.T) {
	for _, name := range []string{"", "m"} {
		for _, rate := range []int{0, 4} {
			clock := newStepClock()
			bs := backends(4)
			cfg := Config{Backends: bs, Now: clock.Now, KV: &KVConfig{Index: newMemIndex(t), Speculation: SpeculationOff}}
			if name != "" {
				cfg.Peers = nameOnly(name)
			}
			r := newRouter(t, cfg)
			// Peer "a" has 12 requests decoding on vllm-2 and 12 on vllm-4 (their prefill over).
			for i := range 24 {
				r.ApplyPeerEvent("a", PeerEvent{Kind: PeerRouted, ID: uint64(i + 1), Backend: bs[1+2*(i%2)].Name, PrefillTokens: 500})
				r.ApplyPeerEvent("a", PeerEvent{Kind: PeerFirstToken, ID: uint64(i + 1)})
			}
			clock.advance(10 * time.Second) // the rate of those decisions has died down
			busy, id := 0, uint64(1000)
			for k := range 40 {
				for range rate { // peer "b"'s short decisions, ended at once: 400 a second
					id++
					r.ApplyPeerEvent("b", PeerEvent{Kind: PeerRouted, ID: id, Backend: bs[int(id%4)].Name, PrefillTokens: 500})
					r.ApplyPeerEvent("b", PeerEvent{Kind: PeerDone, ID: id})
				}
				d, err := r.Route(context.Background(), tokReq("c", promptTokens(7000+k, 512)))
				require.NoError(t, err)
				if d.Backend == bs[1].Name || d.Backend == bs[3].Name {
					busy++
				}
				d.Done(Outcome{})
				clock.advance(10 * time.Millisecond)
			}
			_, n := r.unseenPeerWork(r.since(clock.Now()))
			if rate > 0 {
				require.GreaterOrEqual(t, n, 1.0, "the peers' rate makes ties go apart")
			}
			assert.Zero(t, busy, "name %q, %d peer decisions per 10 ms: cold prompts sent to the busy backends", name, rate)
		}
	}
}

// A named replica's share follows the peers with decisions in flight here, in the order of
// their names: place and count.
func TestReplicaShare(t *testing.T) {
	r := newRouter(t, Config{Backends: backends(2), Peers: nameOnly("m")})
	share := func() [2]int {
		sh := r.peers.share.Load()
		return [2]int{int(uint32(sh)), int(sh >> 32)}
	}
	b := backends(2)[0].Name
	assert.Equal(t, [2]int{0, 0}, share(), "no peers yet")
	r.ApplyPeerEvent("z", PeerEvent{Kind: PeerRouted, ID: 1, Backend: b})
	assert.Equal(t, [2]int{0, 2}, share(), "m before z")
	r.ApplyPeerEvent("a", PeerEvent{Kind: PeerRouted, ID: 1, Backend: b})
	r.ApplyPeerEvent("a", PeerEvent{Kind: PeerRouted, ID: 2, Backend: b})
	assert.Equal(t, [2]int{1, 3}, share(), "a, m, z")
	r.ApplyPeerEvent("m", PeerEvent{Kind: PeerRouted, ID: 1, Backend: b})
	assert.Equal(t, [2]int{1, 3}, share(), "a peer using this replica's name does not count")
	r.ApplyPeerEvent("a", PeerEvent{Kind: PeerDone, ID: 1})
	assert.Equal(t, [2]int{1, 3}, share(), "a still has a decision in flight")
	r.ApplyPeerEvent("a", PeerEvent{Kind: PeerDone, ID: 2})
	assert.Equal(t, [2]int{0, 2}, share(), "a has none left")
	assert.Equal(t, 1, r.ForgetPeer("z"))
	assert.Equal(t, [2]int{0, 1}, share(), "z forgotten")
}

// The rate decays by the clock even after the clock went back.
func TestUnseenClockBack(t *testing.T) {
	clock := newStepClock()
	r := newRouter(t, Config{Backends: backends(2), Now: clock.Now, PeerDelay: 50 * time.Millisecond,
		KV: &KVConfig{Index: newMemIndex(t), Speculation: SpeculationOff}})
	name := backends(2)[0].Name
	clock.advance(time.Hour)
	r.ApplyPeerEvent("a", PeerEvent{Kind: PeerRouted, ID: 1, Backend: name, PrefillTokens: 100})
	clock.advance(-time.Hour)
	r.ApplyPeerEvent("a", PeerEvent{Kind: PeerRouted, ID: 2, Backend: name, PrefillTokens: 100})
	clock.advance(time.Minute)
	w, n := r.unseenPeerWork(r.since(clock.Now()))
	assert.Less(t, n, 1e-20, "a minute of silence after the clock went back")
	assert.Less(t, w, 1e-15)
}
