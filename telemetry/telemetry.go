// Package telemetry names every OpenTelemetry instrument, span and span attribute that kvroute's
// packages record, in one place: for dashboards, alerts and tests that look them up. It is a leaf
// package of constants; importing it compiles nothing else.
//
// Names are in OpenTelemetry style. A Prometheus exporter turns "kvroute.prefix_routing.requests"
// into kvroute_prefix_routing_requests_total (counters get _total, histograms in seconds get
// _seconds, and dots become underscores). Each package records its instruments under its own
// import path as the instrumentation scope.
package telemetry

// The Router (package kvroute), through Config.MeterProvider. Decision counters carry the
// attribute "strategy" (the decision's reason label) or "backend".
const (
	// MetricPrefixRoutingRequests counts decisions by reason (attribute "strategy").
	MetricPrefixRoutingRequests = "kvroute.prefix_routing.requests"
	// MetricPrefixRoutingDistribution counts decisions by backend (attribute "backend").
	MetricPrefixRoutingDistribution = "kvroute.prefix_routing.backend_distribution"
	// MetricPrefixRoutingCardinality is the approximate count of unique prefix keys seen.
	MetricPrefixRoutingCardinality = "kvroute.prefix_routing.prefix_cardinality"
	// MetricDecisionsExpired counts the decisions whose Done had not come after
	// Config.MaxDecisionAge, whose slots the Router reclaimed (Prometheus:
	// kvroute_decisions_expired_total).
	MetricDecisionsExpired = "kvroute.decisions.expired"

	// MetricKVRoutingDecisions counts tier 4's decisions by outcome.
	MetricKVRoutingDecisions = "kvroute.kv_index.routing_decisions"
	// MetricKVQueryLatency is the KV index lookup's duration, in seconds.
	MetricKVQueryLatency = "kvroute.kv_index.query_latency"
	// MetricKVOverlapScore is the best overlap a lookup found, in [0, 1].
	MetricKVOverlapScore = "kvroute.kv_index.overlap_score"

	// Disaggregated serving (registered only with Config.Disagg): requests by path and reason,
	// requests no path could serve, failed remote prefills, and phases in flight per prefill or
	// decode backend.
	MetricDisaggRequests        = "kvroute.disagg.requests"
	MetricDisaggNoBackend       = "kvroute.disagg.no_backend"
	MetricDisaggPrefillFailures = "kvroute.disagg.prefill_failures"
	MetricDisaggInFlight        = "kvroute.disagg.in_flight"
)

// Spans of the Router, recorded through Config.TracerProvider (OpenTelemetry's trace API; without
// a provider, or with the API's no-op one, the Router records none and allocates nothing for
// them). SpanRoute is a child of the span in Route's context, the others children of SpanRoute.
// DisaggRouter.Route records the same spans, one kvroute.route per call whatever the path:
// AttrReason is the plan's reason (local_hit, storage_hit, short_prompt, cache_miss), or on the
// unified and fallback paths the unified decision's; AttrBackend the decode (or unified) backend;
// AttrRoutingPath the path and AttrPrefillBackend the prefill backend, when there is one;
// AttrExpectedCachedTokens the plan's with tier 4 on; its kvroute.kv_index.lookup asks about
// every backend, and on the unified and fallback paths Route's own tokenize and lookup follow.
//
//	kvroute.route              Route: AttrReason, AttrBackend, AttrPrefixKey when the request has one,
//	                           AttrExpectedCachedTokens when tier 4 decided (Reason.FromKVIndex),
//	                           AttrBestOverlap when the KV index was asked; status Error with the
//	                           error Route returned
//	  kvroute.tokenize         KVConfig.Tokenizer's call: AttrTokens; status Error with its error
//	  kvroute.kv_index.lookup  the KV index's Lookup (or LookupPrefix): AttrBlocks, AttrBackends;
//	                           status Error with its error
const (
	SpanRoute    = "kvroute.route"
	SpanTokenize = "kvroute.tokenize"
	SpanKVLookup = "kvroute.kv_index.lookup"
)

// Attribute keys of the Router's spans.
const (
	// AttrReason is the decision's Reason label (prefix_hash, kv_aware, …).
	AttrReason = "kvroute.reason"
	// AttrBackend is the chosen backend.
	AttrBackend = "kvroute.backend"
	// AttrPrefixKey is the request's prefix key, in hex (prefixkey.Key.String).
	AttrPrefixKey = "kvroute.prefix_key"
	// AttrExpectedCachedTokens is Decision.ExpectedCachedTokens.
	AttrExpectedCachedTokens = "kvroute.expected_cached_tokens"
	// AttrBestOverlap is the largest share of the request's blocks (tier-weighted) that one
	// healthy backend holds by the KV index, in [0, 1]; 1 when it holds a prefix entry.
	AttrBestOverlap = "kvroute.best_overlap"
	// AttrTokens is the number of prompt tokens the tokenizer returned.
	AttrTokens = "kvroute.tokens"
	// AttrBlocks is the number of the request's block keys looked up (0 for a prefix entry).
	AttrBlocks = "kvroute.blocks"
	// AttrBackends is the number of backends the index was asked about: Route asks about the
	// healthy ones, DisaggRouter.Route about every backend (a prefix an unhealthy one wrote to
	// shared storage is still there).
	AttrBackends = "kvroute.backends"
	// AttrRoutingPath is a DisaggRouter.Route decision's routing path (disagg.Path: fast_decode,
	// prefill_then_decode, unified, fallback).
	AttrRoutingPath = "kvroute.routing_path"
	// AttrPrefillBackend is a prefill_then_decode decision's prefill backend.
	AttrPrefillBackend = "kvroute.prefill_backend"
)

// KV event sources (package events and events/zmqevents). Every instrument carries a "backend"
// attribute; the source-status gauge also carries "status" (one of events.SourceState's values, 1
// for the current state and 0 for the others).
const (
	MetricEventReceived      = "kvroute.kv_event.received"
	MetricEventProcessed     = "kvroute.kv_event.processed"
	MetricEventDropped       = "kvroute.kv_event.dropped"
	MetricConsumerConnected  = "kvroute.kv_consumer.connected"
	MetricConsumerReconnects = "kvroute.kv_consumer.reconnects"
	MetricConsumerGaps       = "kvroute.kv_consumer.sequence_gaps"
	MetricEventSourceStatus  = "kvroute.kv_index.event_source_status"
)

// What the KV event sources dropped or refused, beyond the counts above (package events and
// events/zmqevents), so that an alert on lost events fires where the events were lost.
const (
	// MetricConsumerResets counts the clears of a backend's index entries that its event sources
	// caused (a gap that could not be replayed, a publisher restart, a lost connection), by
	// "backend".
	MetricConsumerResets = "kvroute.kv_consumer.resets"
	// MetricConsumerResetsLimited counts the resets a backend's publishers asked for beyond its
	// reset budget (zmqevents.Config.MaxResetsPerMinute), not made, by "backend".
	MetricConsumerResetsLimited = "kvroute.kv_consumer.resets_limited"
	// MetricConsumerListenerMessages counts the messages a bound address (ZMQ bind mode)
	// received, by "endpoint" (the bound address as configured) and "outcome": placed (on a
	// backend: its source counts the events), unplaced (the topic maps to no backend, or
	// MaxTopics was reached: dropped) or malformed (bad framing, the topic unknown: dropped).
	// Their sum is the address's received messages.
	MetricConsumerListenerMessages = "kvroute.kv_consumer.listener_messages"
)

// Engine metrics scraping (package enginemetrics).
const (
	// MetricEngineScrapes counts scrapes by backend and result: ok, error (connection, timeout,
	// status other than 200), too_large (body over MaxBodyBytes) or parse_error (malformed, or
	// without the engine's load gauges).
	MetricEngineScrapes = "kvroute.engine_metrics.scrapes"
	// MetricEngineScrapeDuration is the duration of scrapes by backend, in seconds: request, body
	// and parse.
	MetricEngineScrapeDuration = "kvroute.engine_metrics.scrape_duration"
	// MetricEngineReportErrors counts the loads the Sink refused, by backend (a backend the Router
	// does not have, say).
	MetricEngineReportErrors = "kvroute.engine_metrics.report_errors"
)

// The response cache (package respcache).
const (
	// MetricResponseCacheRequests counts lookups by result: "hit", "miss", "skip" (attribute
	// "result").
	MetricResponseCacheRequests = "kvroute.response_cache.requests"
	// MetricResponseCacheEntries is the store's entry count (gauge).
	MetricResponseCacheEntries = "kvroute.response_cache.entries"
	// MetricResponseCacheSize is the store's approximate size in bytes (gauge).
	MetricResponseCacheSize = "kvroute.response_cache.size"
	// MetricResponseCacheEvictions is the store's eviction count (observable counter).
	MetricResponseCacheEvictions = "kvroute.response_cache.evictions"
	// MetricResponseCacheHitRate is hits / (hits + misses) since the Cache was built (gauge, 0 to 1).
	MetricResponseCacheHitRate = "kvroute.response_cache.hit_rate"
	// MetricResponseCacheCoalesced counts requests served by another request's call (coalescing).
	MetricResponseCacheCoalesced = "kvroute.response_cache.coalesced"
	// MetricResponseCacheStoreErrors counts failed store operations and corrupt entries (attribute
	// "op": get, set, delete, clear, corrupt).
	MetricResponseCacheStoreErrors = "kvroute.response_cache.store_errors"

	// SpanResponseCacheLookup is the span of the Cache's store lookup for an eligible request, a
	// child of the request context's span: AttrResponseCacheHit tells whether the store held the
	// response; status Error with a store error or a corrupt entry (both a miss). A request a
	// concurrent identical one then answers (coalescing) shows as a miss here.
	SpanResponseCacheLookup = "respcache.lookup"
	// AttrResponseCacheHit is SpanResponseCacheLookup's attribute: true when the store held the
	// response.
	AttrResponseCacheHit = "respcache.hit"
)

// The shared response-cache stores (packages respcache/redisstore and respcache/s3store).
const (
	MetricCacheRedisLatency     = "kvroute.cache.redis.latency"     // histogram, s, {operation=get|set|delete}
	MetricCacheRedisErrors      = "kvroute.cache.redis.errors"      // counter, {type=connection|timeout|other}
	MetricCacheRedisConnections = "kvroute.cache.redis.connections" // gauge, {state=active|idle}
	MetricCacheFallbackActive   = "kvroute.cache.fallback_active"   // gauge, 1 while the fallback serves
	MetricCacheBackendType      = "kvroute.cache.backend_type"      // gauge, {backend=redis|memory}: 1 = serving
	MetricCacheS3Latency        = "kvroute.cache.s3.latency"        // histogram, s, {operation=get|set|delete}
	MetricCacheS3Errors         = "kvroute.cache.s3.errors"         // counter, {type=connection|timeout|other}
)

// Router replicas over NATS (module github.com/kvroute/kvroute/natsync). Each instrument carries
// the attribute group (natsync.Config.Group).
const (
	// MetricNatsyncEvents counts events by outcome: published, dropped, truncated and applied.
	MetricNatsyncEvents = "kvroute.natsync.events"
	// MetricNatsyncMessages counts messages by direction and outcome: sent, send_error, received,
	// decode_error.
	MetricNatsyncMessages = "kvroute.natsync.messages"
	// MetricNatsyncGaps counts the peers' sequence gaps.
	MetricNatsyncGaps = "kvroute.natsync.sequence_gaps"
	// MetricNatsyncPeersForgotten counts the peers forgotten, by reason: timeout, goodbye.
	MetricNatsyncPeersForgotten = "kvroute.natsync.peers_forgotten"
	// MetricNatsyncPeers is the number of peers heard from within the peer timeout.
	MetricNatsyncPeers = "kvroute.natsync.peers"
	// MetricNatsyncConnected is 1 while the NATS connection is up, 0 otherwise.
	MetricNatsyncConnected = "kvroute.natsync.connected"
)

// The KV event log over NATS JetStream (package natsync/eventlog); attribute "stream". Sequences,
// sizes and ages are gauges, the rest observable counters.
const (
	MetricEventlogApplied          = "kvroute.eventlog.applied"
	MetricEventlogDecodeErrors     = "kvroute.eventlog.decode_errors"
	MetricEventlogApplyErrors      = "kvroute.eventlog.apply_errors"
	MetricEventlogGaps             = "kvroute.eventlog.sequence_gaps"
	MetricEventlogAppliedSeq       = "kvroute.eventlog.applied_sequence"
	MetricEventlogPublished        = "kvroute.eventlog.published"
	MetricEventlogDuplicates       = "kvroute.eventlog.duplicates"
	MetricEventlogDropped          = "kvroute.eventlog.dropped"
	MetricEventlogPublishFailures  = "kvroute.eventlog.publish_failures"
	MetricEventlogPublishedSeq     = "kvroute.eventlog.published_sequence"
	MetricEventlogSnapshots        = "kvroute.eventlog.snapshots"
	MetricEventlogSnapshotFailures = "kvroute.eventlog.snapshot_failures"
	MetricEventlogSnapshotSeq      = "kvroute.eventlog.snapshot_sequence"
	MetricEventlogSnapshotSize     = "kvroute.eventlog.snapshot_size"
	MetricEventlogSnapshotAge      = "kvroute.eventlog.snapshot_age"
)
