// Package kvroute routes LLM requests to the model-server replica ("backend") that already holds
// the most of the request's KV cache, without overloading any replica. A gateway imports it, calls
// Route for each request, forwards the request to Decision.Backend, and calls Decision.Done when
// the request ends.
//
// kvroute composes four tiers, each in its own package:
//
//  1. Prefix-aware sticky routing (this package with prefixkey and chwbl): a prefix key is hashed
//     from the model and the system prompt (or the first message) of an OpenAI or Anthropic
//     request, and placed on a consistent-hash ring with bounded loads, so that requests sharing
//     a prefix meet a warm KV cache while no backend exceeds (1+ε) times the average load.
//  2. A response cache for deterministic requests, streaming included (respcache).
//  3. Shared stores behind one CacheStore interface: memory and tiered (respcache), Redis/Valkey
//     with automatic fallback (respcache/redisstore), S3 as a second level (respcache/s3store).
//  4. A precise KV-block index fed by the engines' KV events, tier-aware and scored together
//     with load and health (kvindex, events, scorer).
//
// The default Router (New) implements tier 1 with a fallback selection strategy (round_robin,
// least_loaded, random or least_latency) for requests that carry no prefix key, and tier 4 when
// Config.KV names a kvindex.KvCacheIndex: the request's block keys (from its tokens, or a
// prefixkey.Tokenizer) are looked up among the healthy backends, and when the best overlap
// reaches min_overlap_threshold the scorer picks the backend under tier 4's load bound
// (Decision.Reason kv_aware, or load_bound when it passes the backends holding enough). The
// default scorer, scorer.ExpectedTTFT, weighs each backend by when the request's first token
// would come there — the prefill work queued ahead of it, then its own, in a transformer's cost
// (scorer.PrefillWork: linear in the uncached tokens, quadratic in their context) — plus six
// times its own prefill work, what recomputing a cached prefix costs the rest of the fleet; a
// backend taking more than 1.1 times its share of the recent requests has its cached prefix
// discounted, so a hot prefix family warms a second backend instead of piling onto one. The
// Router estimates the queued work from the requests it routed there that have no first token
// yet, less the progress made since the head of that queue began, at the prefill rate the
// backend's first tokens showed. KVConfig.Scorer set to scorer.NewComposite's selects the
// composite overlap/load/health scorer (kv_overlap) instead. Below the threshold the backend with the least prefill work ahead
// of the request takes it (least_work: the same queued work, plus this request's own), because
// the ring's bound counts requests, not their length; KVConfig.RingFallback gives the decision
// to the ring instead. Every decision holds an in-flight slot on its backend until Done; the slots are what the load bounds count:
// CHWBL's (1+ε)·mean for the ring, and for tier 4 its own, looser KVConfig.LoadFactorEpsilon
// (under the expected-TTFT scorer, which weighs each backend's queued prefill itself, a safety net
// at six times the mean; under the others twice the mean), because a backend that holds the
// prompt's KV cache is worth more than an even spread. Decision.FirstToken tells the Router a prefill has ended.
// The response cache (tiers 2 and 3) is respcache's HTTP middleware, in front of Route.
//
// Disaggregated prefill/decode serving is on when Config.Disagg is set and backends carry a
// prefill or decode Role (package disagg). DefaultRouter.Disagg().Route then plans each request: fast_decode on a
// decode backend that holds the prompt's prefix or loads it from shared storage (or computes a
// short uncached part itself), prefill_then_decode on a prefill backend chosen by its cached prefix
// and prefill load and a decode backend chosen by decode load, or unified/fallback through Route
// when the pools cannot serve. Each phase holds a slot on its pool's own bounded-load ring until
// DisaggDecision.PrefillDone and Done; PrefillFailed re-routes the request to a unified backend.
// Route itself never chooses a prefill or decode backend.
//
// Use:
//
//	router, err := kvroute.New(kvroute.Config{
//		Backends: []kvroute.Backend{{Name: "vllm-1"}, {Name: "vllm-2"}},
//	})
//	if err != nil { … }
//	req, err := prefixkey.ParseOpenAIChat(body) // malformed bodies: errors.Is(err, prefixkey.ErrMalformed)
//	if err != nil { … }
//	d, err := router.Route(ctx, req)
//	if err != nil { … } // ErrNoBackend when every backend is unhealthy
//	var forwardErr error
//	defer func() { d.Done(kvroute.Outcome{Err: forwardErr}) }() // mandatory, on every path
//	forwardErr = forward(d.Backend, body)
//
// A Decision whose Done never comes (a forgotten call, a goroutine that died) holds its slot until
// Config.MaxDecisionAge (30 minutes by default) reclaims it, counts it
// (kvroute_decisions_expired_total) and logs it: a safety net, checked as Route, Stats and the
// metrics' collection run.
//
// The library holds no package-level state, reads no environment variable and starts no
// goroutine: two Routers in one process are independent. Metrics go to the OpenTelemetry
// MeterProvider given in Config (none by default); DefaultRouter.Stats returns one snapshot of the
// Router's counters and backends, which package admin turns into the admin endpoints' JSON.
//
// # Router replicas
//
// A gateway that runs several router replicas gives each one a DefaultRouter, and each sees only
// the requests it routed itself: with K replicas, its in-flight counts, prefill backlogs, active
// sequences and speculative index entries are about 1/K of the truth. Two sources complete the
// picture, and the Router blends them into the load its bounds and scorers use:
//
//   - Peer events (Config.Peers, ApplyPeerEvent): each replica publishes what it decides (a request
//     routed to a backend with its block keys and prefill tokens, its first token, its end), and
//     applies the others'. Package natsync carries them over NATS.
//   - Engine-reported load (ReportEngineLoad): the engines' own running and waiting request
//     counts, read from their metrics endpoints (package enginemetrics scrapes vLLM's and
//     SGLang's), which count every replica's requests.
//
// A backend's external load, the requests no handle of this Router holds, is the larger of its
// peers' in-flight requests and what its engine reports beyond this Router's own in-flight
// requests at the time of the report; it counts in the backend's bound (tier 1's and tier 4's) and
// in tier 4's candidates like the Router's own requests. Peers' prefill tokens join the backend's
// prefill backlog, their block keys its speculative entries (with the Router's own speculation
// TTL) and, with a scorer that tracks them (scorer.SequenceTracker), its active
// sequences.
//
// Peers' decisions arrive late (Config.PeerDelay: the sync's batching and the network), and in
// the meantime the replicas route by views that do not yet hold each other's latest decisions.
// Alike views send a burst of arrivals at every replica to the same least-busy backend. Tier 4
// therefore estimates the peers' work that a decision cannot see: their recent rate of routed
// prefill work times twice PeerDelay (the peers' decisions of the last PeerDelay have not reached
// this Router, and its own will not reach them for the next), at most one decision per backend.
// It puts that work on the backends that look least busy, raising the least pending work to a
// common level. When at least one of the peers' decisions is expected unseen, it also breaks the
// ties among the best backends apart from the other replicas, rather than by the in-flight counts
// that all of them share and would break alike. Tied backends whose in-flight requests are
// within the unseen decisions of the least loaded's count as loaded alike; among those, a replica
// whose Config.Peers names it (a ReplicaID method, as natsync.Sync has) takes the less loaded in
// its own share — with K replicas holding decisions in flight here, in the order of their names,
// the i-th replica's share is every K-th backend, in the order of the backends' names, from the
// i-th — when there are at least 2K backends and its share holds one; otherwise the first from a
// hash of the request. Each replica counts K as it sees it (its peers with decisions in flight
// and itself), so shares may overlap for a while when one replica is idle. Without peers'
// decisions nothing changes. Set PeerDelay to the delay of your sync (natsync: FlushInterval plus
// the network's one-way delay); a peer that reports too much work (a fault, a hostile peer) can
// make the backends' pending work look alike, as its decisions in flight already can.
//
// Lost messages cost accuracy, never correctness: a peer decision whose end never arrives is
// dropped Config.PeerMaxAge after it arrived, a peer that falls silent is dropped with ForgetPeer,
// and an engine report older than Config.EngineLoadMaxAge no longer counts (both by Config.Now,
// checked by Route). What peers and engines can make a Router hold is bounded: at most 1,048,576
// peer decisions in flight (beyond it the oldest is dropped, counted as expired), and a peer's
// prefill tokens or an engine's running or waiting requests at most 2^30 each. DisaggRouter's decisions are not shared.
package kvroute
