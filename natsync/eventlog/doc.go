// Package eventlog makes a fleet's KV events durable on NATS JetStream, so that router replicas
// share one ordered log of them and a new or restarted replica recovers its KV index from a
// snapshot and the events after it, instead of starting empty until the engines happen to
// publish again.
//
// # Parts
//
//   - Publisher, the bridge: an events.Sink that an events transport (zmqevents, the SSE
//     consumer) writes engines' batches to. It encodes each batch (a versioned, bounded binary
//     format: AppendMessage, DecodeMessage) and publishes it asynchronously to the stream
//     Config.Stream, subject <SubjectPrefix>.<SubjectToken(backend)>.
//   - Consumer, one per replica: an ordered JetStream consumer from a start sequence that
//     decodes each message and applies it to the replica's index (a kvindex.KvCacheIndex).
//   - Snapshotter: every minute, a snapshot of an index, with the stream sequence it reflects, to
//     the Object Store bucket Config.Bucket (object Config.Fleet). Restore loads it into a new
//     replica's index and says where its Consumer starts.
//   - Reset: purges the stream and deletes the snapshots, to start over.
//
// # Use
//
//	nc, _ := nats.Connect(url, nats.MaxReconnects(-1))
//	js, _ := jetstream.New(nc)
//	cfg := eventlog.Config{JetStream: js, Fleet: "llama-fleet"}
//	// The bridge, next to the engines: zmqevents.New(zmqevents.Config{Sink: pub, …}).
//	pub, _ := eventlog.NewPublisher(cfg, eventlog.PublisherOptions{})
//	_ = pub.Start(ctx)
//	// Each router replica:
//	ix, _ := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: "llama-3-8b"})
//	res, _ := eventlog.Restore(ctx, cfg, ix)
//	c, _ := eventlog.NewConsumer(cfg, eventlog.ConsumerOptions{Sink: ix, StartSeq: res.StartSeq})
//	_ = c.Start(ctx)
//	snap, _ := eventlog.NewSnapshotter(cfg, eventlog.SnapshotterOptions{Exporter: ix, Seq: c})
//	_ = snap.Start(ctx) // in one replica, or in each
//
// # Topology
//
// Two ways to feed the stream: one bridge per fleet (or per group of engines), which subscribes
// to the engines' ZMQ sockets and publishes; or every replica bridging, each publishing what it
// receives. We recommend the first. With N replicas bridging, every engine batch is published N
// times; the Publisher gives a batch with an engine sequence number a Nats-Msg-Id derived from
// its encoding (which is deterministic: backend, model, sequence, timestamp, events), and the
// stream stores one copy of a message ID per Config.Duplicates window (2 minutes by default), so
// the duplicates are dropped on the server — after N times the publishing traffic. What
// deduplication cannot merge is a bridge's own view of its losses: a bridge that missed
// batches (a ZMQ gap it could not replay, a full queue, a failed publish) clears the backend in
// the log, and that clear, published by one of the N bridges only, wipes in every replica what
// the others delivered. Several bridges of one engine thus make the log as lossy as the worst of
// them. One bridge per engine keeps one view; to make it highly available, run two with
// deduplication as a warm pair, accepting those clears, or one under leader election. Batches
// without an engine sequence (SSE prefix events) carry no ID and are not deduplicated.
//
// # Guarantees
//
// The stream orders every backend's messages as its bridge published them, and every Consumer
// applies them in stream order, one at a time: replicas that applied the same prefix of the
// stream hold the same index, but for what expiry and eviction (each index's own clock and
// limits) and speculation (each replica's routing) change. A Consumer's LastSeq is the last
// message applied; on a lost connection or a server restart the ordered consumer resumes after
// it. Messages that do not decode, or that name a backend other than their subject's, are
// counted (ConsumerStats.DecodeErrors) and skipped. A jump in the stream sequence (messages the
// stream's limits removed before the consumer read them) is counted as a gap.
//
// The Publisher never blocks the events transport: Apply encodes and queues (PublisherOptions.
// QueueSize), and drops what does not fit. A dropped, oversized, failed or unacknowledged
// (AckTimeout) batch marks its backend, and the backend's next message carries a clear: replicas
// drop what they hold of it and rebuild from the events that follow, as the events package does
// for a sequence gap — they never build on a hole. A publish that timed out may still reach the
// stream later, before that clear.
//
// # Snapshots and restore
//
// A snapshot holds, per backend, the index's confirmed blocks (key, parent, tiers, expiry), its
// engine-hash map (each engine block hash with the block keys it stands for) and its
// prefix-granular entries: what kvindex.Exporter lists and kvindex.Restorer takes back. The
// engine-hash map is what makes a restored index able to apply the events after the snapshot: a
// BlockStored names its parent, and a BlockRemoved its blocks, by engine hash. The Snapshotter
// reads the Consumer's LastSeq before the export starts, so the snapshot shows at least every
// event up to that sequence; Restore returns StartSeq = Seq+1, and the replay may apply again
// events the snapshot already shows. That is harmless: an event sets or clears what it names,
// so the last event touching an entry decides it whether the snapshot had it or not.
//
// What a restore does not bring back: speculative entries (a replica's own predictions,
// seconds long); the exact evidence epochs (an entry expires when the exported one would have, to
// the index's epoch of EntryTTL/64, and by the wall clock, so replicas' clocks should agree);
// blocks whose key a single-shard index cannot tell (see kvindex.MemoryIndex.Export); and the
// index's counters. Events replayed get their lifetimes from the replay time, not from when they
// were published: keep replays short (snapshots every minute), and the stream's MaxAge a few
// snapshot intervals at least, so that Restore finds the events after its snapshot (a snapshot
// older than the stream's first message is reported Stale, and its replay has a gap). A
// snapshot is written through a pipe into ObjectStore.Put, a frame of about 32 KiB at a time,
// each frame checksummed (CRC-32C) and checked before its records are restored; a damaged or
// truncated snapshot fails Restore, which clears what it restored, and the replica replays the
// whole stream.
//
// # Limits and sizing
//
// Messages are at most MaxMessageBytes (1 MiB, the NATS server's default max_payload) with
// strings of at most MaxStringBytes; a typical vLLM batch (16 blocks of 16 tokens stored, 4
// removed) takes about 730 bytes, so a fleet publishing 10,000 batches a second writes some 7 MB/s,
// and the default limits (MaxAge 1 h, MaxBytes 1 GiB, whichever comes first) keep about two and a
// half minutes of it: raise MaxBytes with the rate (rate × MaxAge), or snapshot more often. A
// snapshot costs 27 bytes per block plus 18 per engine hash, about 45 bytes per cached block of
// vLLM's 16 tokens: 4.5 MB for 100,000 blocks. The Object Store keeps one object per fleet. Every
// replica's Consumer reads the whole stream.
//
// # Reset
//
// Reset purges the stream and deletes the snapshot objects that follow it, like a router's
// "reset states" option: use it to start over after changing the block size or the model's
// tokenizer, or to drop a log that went wrong. It leaves running replicas' indexes alone: stop
// them first, or restart them after (they restore nothing, and replay what is published from
// then on). Sequence numbers go on after a purge, so running consumers see no gap.
package eventlog
