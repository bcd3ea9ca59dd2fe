package main

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/enginesim"
	"github.com/kvroute/kvroute/natsync/natstest"
)

// replicaConfig is fleetConfig for one router replica of a group that shares over the NATS
// server at natsURL, with short heartbeats.
func replicaConfig(t *testing.T, f *enginesim.Fleet, natsURL, id string, edit func(*config.Config)) *config.Config {
	t.Helper()
	return fleetConfig(t, f, func(c *config.Config) {
		c.ResponseCache.Enabled = false
		c.Replicas = config.ReplicasConfig{Enabled: true, NATSURL: config.Secret(natsURL), ReplicaID: id,
			Group: "proxy-test", Heartbeat: config.Duration(100 * time.Millisecond), PeerTimeout: config.Duration(time.Second)}
		if edit != nil {
			edit(c)
		}
	})
}

// replicasBody is the JSON of GET /admin/replicas/stats that the tests read.
type replicasBody struct {
	Enabled bool `json:"enabled"`
	Sync    struct {
		Connected bool   `json:"connected"`
		Applied   uint64 `json:"applied"`
		Peers     []struct {
			Replica string `json:"replica"`
		} `json:"peers"`
	} `json:"sync"`
	Peers struct {
		Peers    int    `json:"peers"`
		InFlight int    `json:"in_flight"`
		Applied  uint64 `json:"applied"`
	} `json:"peers"`
	EventLog struct {
		Consumer struct {
			LastSeq uint64 `json:"last_seq"`
		} `json:"consumer"`
		Snapshotter struct {
			Snapshots uint64 `json:"snapshots"`
			Last      struct {
				Seq uint64 `json:"seq"`
			} `json:"last"`
		} `json:"snapshotter"`
		Restore struct {
			Found    bool   `json:"found"`
			Restored bool   `json:"restored"`
			StartSeq uint64 `json:"start_seq"`
		} `json:"restore"`
	} `json:"event_log"`
}

func replicasOf(t *testing.T, p *testProxy) replicasBody {
	t.Helper()
	var b replicasBody
	getJSON(t, p.URL+"/admin/replicas/stats", &b)
	return b
}

// externalLoad sums the backends' external load in p's /admin/prefix-routing/stats.
func externalLoad(t *testing.T, p *testProxy) int {
	t.Helper()
	var st struct {
		Backends []struct {
			ExternalLoad int `json:"external_load"`
		} `json:"backend_distribution"`
	}
	getJSON(t, p.URL+"/admin/prefix-routing/stats", &st)
	n := 0
	for _, b := range st.Backends {
		n += b.ExternalLoad
	}
	return n
}

// slowFleet is a fleet of n engines that take 100 ms per generated token.
func slowFleet(t *testing.T, n int) *enginesim.Fleet {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	f, err := enginesim.StartFleet(ctx, enginesim.FleetConfig{N: n, ZMQ: true, Base: enginesim.Config{BlockSize: 16, CapacityBlocks: 2048,
		Latency: enginesim.Latency{Base: time.Millisecond, PerOutputToken: 100 * time.Millisecond, SpeedFactor: 1}}})
	if err != nil {
		t.Fatalf("StartFleet: %v", err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return f
}

// Two replicas on one NATS server: the requests one routes weigh on the other's view of the
// backends (their external load), from the moment they are routed until they end.
func TestE2EReplicasShareLoad(t *testing.T) {
	t.Parallel() // its own NATS server, engines and proxies
	ns := natstest.Start(t)
	f := slowFleet(t, 3)
	a := startProxy(t, replicaConfig(t, f, ns.URL(), "replica-a", nil))
	b := startProxy(t, replicaConfig(t, f, ns.URL(), "replica-b", nil))
	waitFor(t, 10*time.Second, "the replicas to hear each other", func() bool {
		return len(replicasOf(t, a).Sync.Peers) == 1 && len(replicasOf(t, b).Sync.Peers) == 1
	})

	const n = 6
	var wg sync.WaitGroup
	var failed atomic.Int32
	for i := range n {
		wg.Go(func() {
			r, _ := post(t, a.URL+"/v1/chat/completions", chatBody(longSystemPrompt(fmt.Sprint("shared load ", i), 40), "Hi.", `"max_tokens":30`))
			if r.StatusCode != http.StatusOK {
				failed.Add(1)
			}
		})
	}
	waitFor(t, 10*time.Second, "b to see a's requests in flight", func() bool { return externalLoad(t, b) == n })
	if st := replicasOf(t, b); st.Peers.InFlight != n || st.Peers.Peers != 1 {
		t.Errorf("b's peer state %+v, want %d decisions of one peer", st.Peers, n)
	}
	if got := externalLoad(t, a); got != 0 {
		t.Errorf("a counts %d external requests, want 0 (its own are in flight, not external)", got)
	}
	wg.Wait()
	if failed.Load() != 0 {
		t.Fatalf("%d requests failed", failed.Load())
	}
	waitFor(t, 10*time.Second, "b to see a's requests end", func() bool { return externalLoad(t, b) == 0 })
}

// A replica started later, with the event log and no event sources of its own, restores the
// fleet's index from the snapshot and the stream: its first request for a prefix an engine holds
// goes there by the KV index.
func TestE2EReplicasEventLogRestore(t *testing.T) {
	t.Parallel() // its own NATS server, engines and proxies
	ns := natstest.Start(t)
	f := startFleet(t, 3, true)
	eventLog := config.EventLogConfig{Enabled: true, SnapshotInterval: config.Duration(time.Second)}
	a := startProxy(t, replicaConfig(t, f, ns.URL(), "bridge", func(c *config.Config) { c.Replicas.EventLog = eventLog }))
	sys := longSystemPrompt("event log", 100)
	body := chatBody(sys, "A question.", `"temperature":0.5,"max_tokens":2`)
	holder := warmNonOwner(t, a, f, body, chatBody(sys, "Warm-up.", `"max_tokens":1`))
	seq := replicasOf(t, a).EventLog.Consumer.LastSeq
	waitFor(t, 15*time.Second, "a snapshot of what the bridge applied", func() bool {
		return replicasOf(t, a).EventLog.Snapshotter.Last.Seq >= seq
	})

	late := startProxy(t, replicaConfig(t, f, ns.URL(), "late", func(c *config.Config) {
		c.Replicas.EventLog = eventLog
		c.KVCacheIndex.EventSources = nil
		c.KVCacheIndex.Tokenizer = config.TokenizerEngine
		c.KVCacheIndex.Speculation = "speculate"
	}))
	if st := replicasOf(t, late).EventLog.Restore; !st.Found || !st.Restored || st.StartSeq <= seq {
		t.Errorf("the late replica's restore: %+v, want a snapshot restored", st)
	}
	expectKVRouted(t, late, body, holder, "the late replica's first request")
}

// With the event log, the replica that receives the engines' events keeps indexing them while
// NATS is down: a prefix an engine stored during the outage is routed to it by the KV index.
func TestE2EReplicasEventLogNATSDown(t *testing.T) {
	ns := natstest.Start(t)
	f := startFleet(t, 3, true)
	a := startProxy(t, replicaConfig(t, f, ns.URL(), "bridge", func(c *config.Config) {
		c.Replicas.EventLog = config.EventLogConfig{Enabled: true}
	}))
	ns.Stop()
	waitFor(t, 10*time.Second, "the replica to see NATS gone", func() bool { return !replicasOf(t, a).Sync.Connected })
	sys := longSystemPrompt("outage", 100)
	body := chatBody(sys, "A question.", `"temperature":0.5,"max_tokens":2`)
	holder := warmNonOwner(t, a, f, body, chatBody(sys, "Warm-up.", `"max_tokens":1`))
	expectKVRouted(t, a, body, holder, "during the outage")
}

// NATS stops and comes back while requests flow through two replicas: no request fails, and the
// replicas share again once it is back.
func TestE2EReplicasSurviveNATSRestart(t *testing.T) {
	t.Parallel() // its own NATS server, engines and proxies
	ns := natstest.Start(t)
	f := startFleet(t, 3, true)
	a := startProxy(t, replicaConfig(t, f, ns.URL(), "replica-a", nil))
	b := startProxy(t, replicaConfig(t, f, ns.URL(), "replica-b", nil))
	waitFor(t, 10*time.Second, "the replicas to hear each other", func() bool {
		return len(replicasOf(t, b).Sync.Peers) == 1
	})

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var sent, failed atomic.Int32
	for _, p := range []*testProxy{a, b} {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				sent.Add(1)
				r, _ := post(t, p.URL+"/v1/chat/completions", chatBody(longSystemPrompt(fmt.Sprint("restart ", i%5), 40), "Hi.", `"max_tokens":2`))
				if r.StatusCode != http.StatusOK {
					failed.Add(1)
				}
				time.Sleep(20 * time.Millisecond)
			}
		})
	}
	waitFor(t, 10*time.Second, "requests through both replicas", func() bool { return sent.Load() >= 6 })
	ns.Stop()
	// Down for longer than the peer timeout: each forgets the other.
	waitFor(t, 10*time.Second, "each replica to forget the other", func() bool {
		return len(replicasOf(t, a).Sync.Peers) == 0 && len(replicasOf(t, b).Sync.Peers) == 0
	})
	ns.Restart()
	before := replicasOf(t, b).Peers.Applied
	waitFor(t, 20*time.Second, "b to apply a's decisions again", func() bool {
		st := replicasOf(t, b)
		return st.Sync.Connected && st.Peers.Applied > before
	})
	close(stop)
	wg.Wait()
	if failed.Load() != 0 || sent.Load() == 0 {
		t.Errorf("%d of %d requests failed across the NATS restart", failed.Load(), sent.Load())
	}
}
