// Package replay measures routing quality: it replays a request trace, or a generated workload,
// on a simulated fleet of engines in virtual time, routing every request through kvroute's own
// packages under one policy, and reports the token hit ratio, per-engine load, TTFT and
// throughput against two oracles. Command benchmarks/cmd/replay runs it; BENCHMARKS.md shows the
// results.
//
// # Workloads
//
// ReadTrace reads the Mooncake trace format (FAST '25, "Mooncake: A KVCache-centric
// Disaggregated Architecture for LLM Serving"; one JSON object per line with timestamp in ms,
// input_length, output_length and hash_ids, one id per 512-token block; gzip detected by its
// magic bytes). SharedPrefix generates groups of users sharing a system prompt, each user with a
// fixed question; MultiTurn generates chats whose every turn resends the whole history. A request
// is a list of segments (a hash id, a prompt, a message); the k-th token of a segment is a
// function of the seed, the segment and k, so the engines' block hashes and kvroute's block keys
// see exactly the sharing the workload describes. The prefix key's anchor (the system prompt)
// names the first segment: 1 KiB of text, about 256 tokens, lies inside it.
//
// # Fleet
//
// Each engine is an enginesim.VirtualEngine: internal/enginesim's paged block cache (prefix
// caching, LRU eviction, blocks reserved for a request's prompt and completion at admission), its
// FIFO admission under a concurrency limit and free blocks, and its latency model
// (prefill = base + per-token·uncached + quadratic·(n²−cached²), decode = per-output-token·k). By
// default the engine also models compute: one prefill at a time per engine, decodes overlapping
// (Config.ParallelPrefill restores enginesim's unlimited compute). TTFT is the wait for admission
// and compute plus the prefill; throughput is output tokens over the makespan.
//
// A single goroutine drains a heap of timestamped events — arrival, first token, finish, KV-event
// delivery — so a run is deterministic for its seed. The router and the index read the virtual
// clock (kvroute.Config.Now, kvindex.MemoryConfig.Now); Decision.FirstToken and Decision.Done
// (with the virtual latency) are called at the virtual first token and finish; each engine step's
// KV events reach the index Config.EventLag later, in order.
//
// # Arrival rate
//
// Arrivals are scaled by one factor (TimeScale) so that the offered load, counted as if no
// request hit any cache, is Config.Utilisation of the fleet's capacity: the busiest of its
// compute (prefill seconds), its concurrency slots and its KV blocks. One factor keeps bursts as
// they are in the timestamps — simultaneous requests stay simultaneous — and only stretches or
// shrinks the gaps.
//
// # Policies and oracles
//
// random (a seeded uniform choice), round_robin and least_loaded (kvroute strategies, prefix
// routing off), chwbl (tier 1), approximate (tier 4 fed by its own routing decisions, default
// scorer), precise (tier 4 fed by KV events, the composite overlap/load/health scorer, no
// speculation), cost (tier 4 fed by KV events, prefill+decode cost scorer with active-sequence
// tracking), kvroute (what the README recommends: tier 1 plus tier 4 fed by KV events, every
// setting at its default, the expected-TTFT scorer among them). The tier-4 policies other than
// kvroute fall back to least_loaded; all of them share the Router's queued-work estimate and its
// least-work choice below the overlap threshold. The oracles: one engine with the whole fleet's cache,
// slots and compute (a global LRU, load spread ideally), and an infinite cache (the ceiling of
// the workload's reuse; its TTFT is the prefill at that hit without queueing).
//
// Beside each policy's hit ratio the report gives its reachable hit ratio: the hit ratio had
// every request gone to the engine that held the most of its prompt when it arrived, on the
// caches that policy's routing built. The gap between the two is what routing turned away; the
// gap between reachable and the global LRU is what the partitioned caches' contents cost.
//
// # Router replicas
//
// Config.Replicas runs each policy with router state (every one but random and the oracles) as
// that many kvroute.DefaultRouter instances, as a gateway with several router replicas behind a
// load balancer does. Arrivals go to a replica drawn at random from the seed (Config.Spread; an L4
// load balancer's spread) or round robin. Every replica has its own KV index, and every engine's
// KV events reach each of them after Config.EventLag; what else they know is Config.Sync's:
//
//   - SyncNone: only their own decisions (in-flight counts, prefill backlogs, speculation).
//   - SyncMetrics: every Config.ScrapePeriod of virtual time (replica j's phase j/Replicas of it),
//     each replica reports every engine's running and waiting requests at that instant with
//     ReportEngineLoad, as a scrape of vLLM's or SGLang's metrics would.
//   - SyncPeers: each replica's kvroute.PeerEvents (routed, first token, done) are delivered to
//     the others through the event queue Config.SyncDelay after it published them, and applied
//     with ApplyPeerEvent.
//   - SyncBoth: both.
//
// One replica is the single router exactly, whatever it syncs. A replica's engine reports count
// for five scrape periods of virtual time (EngineLoadMaxAge, aged by Config.Now, the simulation's
// clock); the next scrape replaces each well before.
//
// # Grid
//
// RunGrid replays workloads over every combination of engines, cache sizes and utilisations
// (Grid), for each seed and policy; GridPoints judges one policy at each point against the best
// of the other non-oracle policies on the hit ratio and the TTFT p99 (Verdict: a loss within the
// seeds' spread is a tie), and WriteGridTable prints the judgement as one table.
//
// # Prefill/decode disaggregation
//
// RunPD replays a workload on a fleet of prefill and decode engines (PDConfig) routed by
// kvroute's DisaggRouter (PolicyPD): a prefill engine computes the prompt and writes its blocks to
// an enginesim.VirtualStorage (announced as storage-tier KV events), a decode engine reads the
// blocks it lacks and decodes; transfers take bytes over bandwidth. PDComparison runs P/D fleets
// against unified fleets of as many engines at the same arrival times.
//
// # Use
//
//	w, err := replay.ReadTraceFile("trace.jsonl.gz")
//	if err != nil {
//		return err
//	}
//	var rs []replay.Result
//	for _, p := range replay.AllPolicies {
//		r, err := replay.Run(w, replay.Config{Engines: 8, Utilisation: 0.8, Seed: 1}, p)
//		if err != nil {
//			return err
//		}
//		rs = append(rs, r)
//	}
//	return replay.WriteTable(os.Stdout, replay.Summarise(rs))
package replay
