// Package natsync keeps kvroute's router replicas in step over NATS core publish/subscribe
// (github.com/nats-io/nats.go): each replica publishes its routing decisions and applies the
// others', so that every replica's load bounds and KV scoring count the whole fleet's requests,
// not a K-th of them. See "Router replicas" in package kvroute for what a Router does with its
// peers' events.
//
// # Use
//
// The router needs the Sync as its Config.Peers, and the Sync needs the router to apply the
// peers' events to: build the Sync, then the router, then Start the Sync with the router.
//
//	s, err := natsync.New(natsync.Config{URL: "nats://nats:4222", Group: "chat-fleet"})
//	if err != nil { ... }
//	r, err := kvroute.New(kvroute.Config{Backends: backends, KV: kv, Peers: s})
//	if err != nil { ... }
//	if err := s.Start(ctx, r); err != nil { ... }
//	defer r.Close()
//	defer s.Close() // runs first: goodbye to the peers
//
// # What is shared
//
// Every decision event of kvroute.PeerEvent: a request routed (its backend, its block keys, the
// blocks the backend held of it, the prompt tokens it must prefill), its first token, its end.
// A replica applies them with kvroute.DefaultRouter.ApplyPeerEvent: a peer's request is external
// load on its backend until its end, its prefill tokens join the backend's prefill backlog until
// its first token, and its block keys are speculated in the replica's KV index (with tier 4 on),
// so that the next request with the same prompt goes where the first went. The KV index itself,
// health and engine-reported load are not shared: the engines' KV events, the health checks and
// package enginemetrics give each replica those.
//
// An event waits up to Config.FlushInterval (5 ms) for others to share its message, then crosses
// the network: the router's kvroute.Config.PeerDelay (5 ms by default) should be that delay as
// you measure it, for the router counts the peers' work of twice that time, which it cannot have
// seen yet, on its least-busy backends. A Sync names its replica (ReplicaID): while peers'
// decisions are expected unseen, a router whose Config.Peers it is prefers, among the backends
// that look equally idle, those in its own share of the fleet, so that the replicas' decisions in
// that time land apart (see "Router replicas" in package kvroute).
//
// # Guarantees
//
// Delivery is at most once, in order per sender. A lost message costs accuracy, never
// correctness, and for a bounded time:
//
//   - A peer silent for Config.PeerTimeout (3 heartbeats by default) is forgotten
//     (Applier.ForgetPeer): its requests no longer weigh on the backends. A replica that closes
//     says goodbye, and the others forget it at once.
//   - Every message carries its sender's sequence number. A gap (messages dropped by the server
//     or by a slow receiver, a send that failed, events PublishPeerEvent dropped) makes the
//     receiver forget the sender's decisions and start again from the next message: a lost end
//     would otherwise weigh on its backend for kvroute's PeerMaxAge, while forgetting costs only
//     the sender's requests in flight, until they end.
//   - A routed event whose end never comes expires in the router after Config.PeerMaxAge.
//
// While the NATS connection is down, routing goes on: PublishPeerEvent never waits for the
// network. Events sent meanwhile wait in nats.go's reconnect buffer (8 MiB by default), and go
// out when the connection is back, or are lost when it overflows. The peers, unheard, are
// forgotten after PeerTimeout (correctly: their load is unknown), and heard again after the
// reconnection. A Sync that dials Config.URL reconnects forever; a caller-supplied connection
// should too (nats.MaxReconnects(-1)).
//
// # Subjects
//
// One subject per group of replicas, "<SubjectPrefix>.<Group>" ("kvroute.replicas.default" by
// default), carries events, heartbeats and goodbyes; every replica of the group publishes and
// subscribes to it. Replicas of another group (another fleet of backends) use another Group.
// Messages a replica receives from itself are ignored.
//
// # Trust
//
// A Sync believes every message on its subject: replica ids are not authenticated. Whoever can
// publish there can make backends look loaded (routed events), make the replicas forget a peer's
// requests (a goodbye in its name, or a gap in its sequence), and cost the receivers memory up to
// the Router's bounds (1,048,576 peer decisions in flight). Restrict the subject to the routers: a NATS user
// or account of theirs whose publish and subscribe permissions cover <SubjectPrefix>.>, and TLS.
//
// # Wire format
//
// A compact binary encoding, version 1 (WireVersion). Every message starts with a header: the
// version byte, a type byte (1 events, 2 heartbeat, 3 goodbye), the sender's replica id (uvarint
// length, then its bytes) and its sequence number (8 bytes, little endian). An events message then
// holds one or more events until its end, each a kind byte (kvroute.PeerEventKind) and the
// decision's id (uvarint); a routed event adds its backend's name (uvarint length, bytes), its
// block keys (uvarint count, then 8 bytes each, little endian), its cached blocks and its prefill
// tokens (uvarints). Heartbeats and goodbyes are the header alone. Decoding is bounded
// (MaxReplicaIDLen, MaxBackendLen, MaxKeysPerEvent, MaxEventsPerMessage) and refuses truncated
// messages, unknown versions, types and kinds, and trailing bytes; a malformed message is
// counted (Stats.DecodeErrors) and dropped whole.
//
// # Batching and sizing
//
// PublishPeerEvent encodes the event into the batch being filled (no allocation; about 130 ns for
// a 2k-token prompt's 128 block keys); the sending goroutine sends a batch FlushInterval (5 ms)
// after its first event, or at once when it reaches MaxMessageBytes (64 KiB). A routed event of a
// 2k-token prompt is about 1 KiB, its first token and end a few bytes each. A fleet routing F
// requests per second of such prompts thus sends each replica about F KiB/s, and the server
// sends K·F KiB/s to K replicas: 2,000 requests per second to 4 replicas is 2 MiB/s into each,
// 8 MiB/s out of the server. Each replica also sends a heartbeat (about 30 bytes) every Heartbeat
// and at most one message per FlushInterval. The buffer (BufferSize events, BufferBytes) covers
// bursts while the sender is busy; one Sync sends about 200,000 such events per second (200 MB/s,
// BenchmarkPublishPeerEvent/nats) before it drops any.
//
// # Metrics
//
// With Config.MeterProvider, a Sync reports telemetry.MetricNatsyncEvents, telemetry.MetricNatsyncMessages, telemetry.MetricNatsyncGaps,
// telemetry.MetricNatsyncPeersForgotten, telemetry.MetricNatsyncPeers and telemetry.MetricNatsyncConnected, read from the counts Stats returns.
package natsync
