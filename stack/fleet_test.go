package stack_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/natsync/natstest"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/stack"
)

// replicaYAML is a configuration of one replica of group "stack-test" on the NATS server at url,
// with short heartbeats, in front of two backends that no test sends to.
func replicaYAML(url, id, extra string) string {
	return fmt.Sprintf(`replicas:
  enabled: true
  nats_url: %q
  group: stack-test
  replica_id: %s
  heartbeat: 100ms
  peer_timeout: 1s
%s`, url, id, extra) + backendsYAML("m", "http://127.0.0.1:1", "http://127.0.0.1:2")
}

// replica is a Fleet with the Router it feeds, built and started as a front end does.
type replica struct {
	fleet  *stack.Fleet
	router *kvroute.DefaultRouter
	index  kvindex.KvCacheIndex
}

// startReplica builds cfg's index (when kv_cache_index is on), Fleet and Router, hands the Router
// to the Fleet and starts it; all close at the end of the test.
func startReplica(t *testing.T, cfg *config.Config) *replica {
	t.Helper()
	o := config.Options{Logger: slog.New(slog.DiscardHandler)}
	r := &replica{}
	if cfg.KVCacheIndex.Enabled {
		ix, closeIndex, err := cfg.NewKVIndex()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = closeIndex() })
		r.index = ix
	}
	f, err := stack.NewFleet(cfg, o, stack.FleetOptions{Index: r.index})
	if err != nil {
		t.Fatalf("NewFleet: %v", err)
	}
	t.Cleanup(func() {
		if err := f.Close(); err != nil {
			t.Errorf("Fleet.Close: %v", err)
		}
	})
	r.fleet = f
	rcfg, err := cfg.RouterConfig(o)
	if err != nil {
		t.Fatal(err)
	}
	rcfg.KV, rcfg.Peers = cfg.KVConfig(r.index, nil), f.Peers()
	if r.router, err = kvroute.New(rcfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.router.Close() })
	f.SetRouter(r.router)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := f.Start(ctx); err != nil {
		t.Fatalf("Start: %v", err)
	}
	return r
}

// Two replicas' Fleets on one NATS server: a decision one Router makes weighs on the other
// Router until it is done, and each Fleet's Stats shows the other.
func TestFleetReplicasShareDecisions(t *testing.T) {
	ns := natstest.Start(t)
	a := startReplica(t, parse(t, replicaYAML(ns.URL(), "replica-a", "")))
	b := startReplica(t, parse(t, replicaYAML(ns.URL(), "replica-b", "")))
	waitFor(t, 10*time.Second, "the replicas to hear each other", func() bool {
		sa, sb := a.fleet.Stats(), b.fleet.Stats()
		return sa.Sync != nil && sb.Sync != nil && len(sa.Sync.Peers) == 1 && len(sb.Sync.Peers) == 1
	})
	if st := a.fleet.Stats(); !st.Enabled || st.Sync.Replica != "replica-a" || st.EventLog != nil || st.EngineMetrics != nil {
		t.Errorf("a's stats %+v: want replicas on, replica-a, no event log, no scrapes", st)
	}

	d, err := a.router.Route(context.Background(), &prefixkey.Request{Format: prefixkey.FormatOpenAIChat, Model: "m",
		HasSystem: true, System: strings.Repeat("a shared system prompt ", 40), Messages: []prefixkey.Message{{Role: "user", Text: "Hi."}}})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "b to see a's decision in flight", func() bool { return b.fleet.Stats().Peers.InFlight == 1 })
	if st := b.fleet.Stats().Peers; st.Peers != 1 {
		t.Errorf("b's peers %+v, want a's one decision", st)
	}
	d.Done(kvroute.Outcome{})
	waitFor(t, 10*time.Second, "b to see a's decision end", func() bool { return b.fleet.Stats().Peers.InFlight == 0 })
	if st := a.fleet.Stats().Peers; st.InFlight != 0 || st.Applied != 0 {
		t.Errorf("a's peers %+v, want nothing of b's (b routed nothing)", st)
	}
}

// With every section off, a Fleet has no part: no Peers (a nil interface, so that the Router
// shares nothing), EventsSink is the sink itself, and its methods do nothing and fail not.
func TestFleetOff(t *testing.T) {
	cfg := parse(t, "kv_cache_index: {enabled: true}\n"+backendsYAML("m", "http://127.0.0.1:1"))
	ix, closeIndex, err := cfg.NewKVIndex()
	if err != nil {
		t.Fatal(err)
	}
	defer closeIndex()
	f, err := stack.NewFleet(cfg, config.Options{}, stack.FleetOptions{Index: ix})
	if err != nil {
		t.Fatal(err)
	}
	if p := f.Peers(); p != nil {
		t.Errorf("Peers() = %#v with replicas off, want nil", p)
	}
	if s := f.EventsSink(); s != events.Sink(ix) {
		t.Errorf("EventsSink() = %T, want the index", s)
	}
	if _, ok := f.OutageReplay(); ok {
		t.Error("OutageReplay reports counters without an event log")
	}
	if err := f.SetMetricsTargets(map[string]string{"b0": "not a URL"}); err != nil {
		t.Errorf("SetMetricsTargets with engine_metrics off: %v", err)
	}
	if err := f.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	if st := f.Stats(); st.Enabled || st.Sync != nil || st.EventLog != nil || st.EngineMetrics != nil {
		t.Errorf("stats %+v, want every part off", st)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// engine_metrics: the Fleet scrapes the engines' metrics endpoints and reports their load to the
// Router in force; SetMetricsTargets replaces the targets, and keeps them when it refuses one.
func TestFleetEngineMetrics(t *testing.T) {
	e0 := startEngine(t, "e0", "m")
	cfg := parse(t, "engine_metrics: {enabled: true, interval: 100ms, timeout: 50ms}\n"+backendsYAML("m", e0.URL, "http://127.0.0.1:1"))
	if got := stack.MetricsTargets(cfg)["b0"]; got != e0.URL+"/metrics" {
		t.Fatalf("b0's target %q, want %q", got, e0.URL+"/metrics")
	}
	r := startReplica(t, cfg)
	waitFor(t, 10*time.Second, "the Router to get b0's load", func() bool {
		return r.fleet.Stats().Peers.EngineReports > 0 && e0.calls["/metrics"].Load() > 0
	})
	if err := r.fleet.SetMetricsTargets(map[string]string{"b0": "ftp://127.0.0.1/metrics"}); err == nil ||
		!strings.HasPrefix(err.Error(), "engine_metrics: ") {
		t.Errorf("an ftp target: err %v, want engine_metrics's refusal", err)
	}
	if err := r.fleet.SetMetricsTargets(map[string]string{"b0": e0.URL + "/metrics"}); err != nil {
		t.Fatal(err)
	}
	if st := r.fleet.Stats().EngineMetrics; len(st) != 1 || st[0].Backend != "b0" {
		t.Errorf("targets after SetMetricsTargets %+v, want b0's alone", st)
	}
}

// The event log: the events a replica receives go through the stream to its index; a replica
// started later restores the fleet's snapshot into its index in NewFleet, before any stream
// message.
func TestFleetEventLog(t *testing.T) {
	ns := natstest.Start(t)
	eventLog := "  event_log: {enabled: true, snapshot_interval: 1s}\n"
	bridge := startReplica(t, parse(t, replicaYAML(ns.URL(), "bridge", eventLog)+
		"kv_cache_index:\n  enabled: true\n  event_sources: [{backend_name: b0, endpoint: \"tcp://127.0.0.1:1\"}]\n"))
	if _, ok := bridge.fleet.OutageReplay(); !ok {
		t.Fatal("no outage-replay counters with the event log on")
	}
	toks := make([]uint32, 2*16)
	for i := range toks {
		toks[i] = uint32(i + 1)
	}
	b := &events.Batch{Model: "m", Seq: 1, Events: []events.Event{{Kind: events.KindBlockStored,
		BlockHashes: []uint64{101, 102}, TokenIDs: toks, BlockSize: 16}}}
	ctx := context.Background()
	if err := bridge.fleet.EventsSink().Apply(ctx, "b0", b); err != nil {
		t.Fatal(err)
	}
	entries := func(ix kvindex.KvCacheIndex) int {
		st, err := ix.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return st.PerBackend["b0"]
	}
	waitFor(t, 10*time.Second, "the stream to feed the bridge's index", func() bool { return entries(bridge.index) == 2 })
	waitFor(t, 15*time.Second, "a snapshot of the bridge's index", func() bool {
		el := bridge.fleet.Stats().EventLog
		return el != nil && el.Snapshotter != nil && el.Snapshotter.Last.Seq >= el.Consumer.LastSeq && el.Consumer.LastSeq > 0
	})
	if el := bridge.fleet.Stats().EventLog; el.Publisher == nil || el.Publisher.LastSeq == 0 || el.OutageReplay == nil {
		t.Errorf("the bridge's event log %+v: want its Publisher's and the outage counters", el)
	}

	lateCfg := parse(t, replicaYAML(ns.URL(), "late", eventLog)+"kv_cache_index: {enabled: true}\n")
	ix, closeIndex, err := lateCfg.NewKVIndex()
	if err != nil {
		t.Fatal(err)
	}
	defer closeIndex()
	late, err := stack.NewFleet(lateCfg, config.Options{}, stack.FleetOptions{Index: ix})
	if err != nil {
		t.Fatal(err)
	}
	defer late.Close()
	if n := entries(ix); n != 2 {
		t.Errorf("the late replica's index holds %d entries of b0 before Start, want the snapshot's 2", n)
	}
	el := late.Stats().EventLog
	if el == nil || el.Restore == nil || !el.Restore.Restored || el.Publisher != nil {
		t.Errorf("the late replica's event log %+v: want a restore and no Publisher (no event sources)", el)
	}
	if s := late.EventsSink(); s != events.Sink(ix) {
		t.Errorf("the late replica's EventsSink is %T, want its index (no event sources)", s)
	}

}

func TestNewFleetBadInput(t *testing.T) {
	if _, err := stack.NewFleet(nil, config.Options{}, stack.FleetOptions{}); err == nil {
		t.Error("a nil configuration: no error")
	}
}

// While NATS is down, the events a replica with event sources receives still reach its own
// index through EventsSink (they cannot reach the stream).
func TestFleetEventLogNATSDown(t *testing.T) {
	ns := natstest.Start(t)
	r := startReplica(t, parse(t, replicaYAML(ns.URL(), "bridge", "  event_log: {enabled: true}\n")+
		"kv_cache_index:\n  enabled: true\n  event_sources: [{backend_name: b0, endpoint: \"tcp://127.0.0.1:1\"}]\n"))
	ns.Stop()
	waitFor(t, 10*time.Second, "the replica to see NATS gone", func() bool { return !r.fleet.Stats().Sync.Connected })
	toks := make([]uint32, 16)
	b := &events.Batch{Model: "m", Seq: 1, Events: []events.Event{{Kind: events.KindBlockStored,
		BlockHashes: []uint64{7}, TokenIDs: toks, BlockSize: 16}}}
	ctx := context.Background()
	if err := r.fleet.EventsSink().Apply(ctx, "b0", b); err != nil {
		t.Fatal(err)
	}
	st, err := r.index.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.PerBackend["b0"] != 1 {
		t.Errorf("b0 holds %d entries in the index during the outage, want the batch's 1", st.PerBackend["b0"])
	}
}
