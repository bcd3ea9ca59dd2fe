// Package events turns the KV-cache events that model servers publish into a small event model
// and delivers them to a Sink (the KV index implements it). It imports nothing else from kvroute,
// and no client library: the ZMQ transport lives in package zmqevents.
//
// # Event model
//
// A Batch is one published message: the publisher's sequence number, timestamp, data-parallel
// rank and model, and its Events in order. An Event is one of
//
//   - KindBlockStored: full blocks entered a tier. BlockHashes are the engine's hashes (opaque;
//     kvroute recomputes its own chained keys from TokenIDs), Parent the engine hash of the block
//     before the first one, TokenIDs BlockSize tokens per block, plus LoRAName, Tier (from the
//     vLLM "medium"), per-block multimodal ExtraKeys, CacheSalt and the attention GroupIdx.
//   - KindBlockRemoved: blocks left a tier.
//   - KindAllBlocksCleared: the engine dropped its whole cache.
//   - KindPrefix: a prefix-granular event from an SSE stream (cache_created, cache_evicted,
//     cache_offloaded, cache_reloaded, cache_purged) with a prefix key and a token count.
//
// Tiers are ordered fastest first: TierGPU, TierCPU, TierStorage.
//
// # Decoders
//
// DecodeMsgpackBatch decodes the msgpack payload that vLLM and SGLang publish (the third ZMQ
// frame; format in vLLM's vllm/distributed/kv_events.py and SGLang's
// sglang/srt/disaggregation/kv_events.py). It accepts what real engines send: the batch and each
// event either as an array (msgspec array_like, tag first, trailing default fields omitted; old
// engines' two-element batch) or as a map (the 2026 form, default fields omitted, unknown keys
// ignored); block hashes as integers of any msgpack width and sign or as byte-string digests;
// "medium" in any case. It is a hand-written cursor over the bytes: no reflection, no
// allocation once the Batch's storage has grown to the traffic, bounds checked on every read.
// Malformed events are skipped and counted; a payload that is not a batch is an error wrapping
// ErrMalformed.
//
// One publisher must not be able to exhaust the router's memory, so the decoder's allocation is
// bounded by the payload: at most 4 × its size plus 1 MiB. Counts in headers are checked
// against the bytes left (an array announcing 2^31 elements in a tiny frame fails before
// anything is allocated), each slice is sized once, and a payload whose decoded form would
// exceed the budget (a frame of minimal 15-byte events would decode to 12× its size into
// 184-byte Event slots) is rejected whole as malformed. The transports cap what reaches the
// decoder: zmqevents.Config.MaxFrameBytes (16 MiB) per batch payload and
// SSEConfig.MaxEventSize (1 MiB) per SSE event; larger input is dropped and counted
// (Events.Malformed for ZMQ, Events.Oversized for SSE, both with LastError and a Warn at most
// once per source every 5 s), never a panic or a disconnection. BenchmarkDecodeAmplification
// measures the bytes allocated per frame byte. ExtraKeyHash is the fold of multimodal identifiers it uses, exported so that
// request-side code computes identical values.
//
// DecodeSSEEvent decodes one "event:"/"data:" pair of the SSE form
//
//	event: cache_created
//	data: {"event":"cache_created","prefix_hash":"9f2c…","token_count":2048}
//
// into a KindPrefix event.
//
// # Transports
//
// A transport feeds a decoder and delivers every batch to a Sink, one goroutine per backend at a
// time. Its goroutines run between Start and Close; Status reports each source.
//
//   - SSE (this package): an HTTP client reads GET <engine>/v1/kv_events with a 1 MiB line and
//     event cap (SSEConfig.MaxEventSize) and reconnects with exponential backoff from 1 s to
//     60 s.
//   - ZMQ (package zmqevents, which imports go-zeromq/zmq4 so that this package need not): SUB
//     sockets that connect to the engines' PUB endpoints or bind addresses the engines connect
//     to, with sequence tracking, replay of lost batches, catch-up on what an engine cached
//     before the subscription, and LossReporter checks.
//
// Another transport (NATS, Kafka, a message queue of your own) needs only this package's
// exported API, which the SSE and ZMQ transports use too:
//
//   - SourceSet holds its sources: Add returns a Source per engine stream or subscription,
//     Status lists their SourceStatus, RegisterMetrics reports them as the Metric* instruments
//     under scopeName, and Close marks them closed.
//   - Source is one source's counters and state: SetState as it connects, SetError, Touch
//     and the Received, Malformed, Gaps, … atomics as it receives, WarnDue to rate-limit its
//     logs.
//   - BackendWriter applies one backend's batches to the Sink and keeps the sink's view whole:
//     after a failed Apply, or a reset the transport requests (lost batches, a restarted
//     publisher), it clears the backend before it applies anything else, and counts each outcome
//     on the Source.
//   - A Sink that implements LossReporter can tell the transport that it lost a backend.
//
// The package example "Transport" shows one, in forty lines.
//
// # Use
//
//	var b events.Batch // reused for every message of this source
//	for msg := range messages { // e.g. ZMQ [topic, seq, payload]
//		skipped, err := events.DecodeMsgpackBatch(msg.Payload, &b)
//		if err != nil {
//			continue // errors.Is(err, events.ErrMalformed): count it and drop the message
//		}
//		_ = skipped // malformed events inside a good batch, already left out
//		b.Seq, b.Model = msg.Seq, "meta-llama/Llama-3.1-8B-Instruct"
//		if err := sink.Apply(ctx, "vllm-0", &b); err != nil {
//			log.Printf("index unavailable: %v", err)
//		}
//	}
//
// Nothing in this package holds package-level mutable state; the decoders are safe for
// concurrent use on distinct Batches and Events.
package events
