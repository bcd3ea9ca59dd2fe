// Package events turns the KV-cache events that model servers publish into a small event model
// and delivers them to a Sink (the KV index implements it). It imports nothing else from kvroute.
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
// decoder: ZMQConfig.MaxFrameBytes (DefaultMaxFrameBytes, 16 MiB) per batch payload and
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
// The transports feed the decoders and deliver every batch to a Sink, one goroutine per source
// at a time. Their goroutines run between Start and Close; Status reports each source.
//
//   - ZMQ: a SUB socket connects to each engine's PUB endpoint (tcp://host:5557, one port per
//     data-parallel rank), or binds one or more addresses that engines connect to (one per
//     engine or per data-parallel rank, each with its own placement rules; one consumer owns
//     them all, so a backend reached through several addresses is still applied in order by one
//     goroutine). Messages are
//     [topic, seq (8-byte big-endian), payload]; the topic kv@<pod>@<model> names the model. A
//     jump in seq means lost batches: the consumer asks the engine's replay (ROUTER) endpoint for
//     the missing ones when it has one, and otherwise calls Sink.ClearBackend so that the index
//     forgets that backend's possibly stale state instead of over-reporting it. On each new
//     connection it also catches up: before the first batch it asks the replay endpoint for the
//     batches the engine still keeps from before (ZMQConfig.CatchUpBatches, vLLM keeps
//     10,000), so that the index learns what the engine cached before the subscription. A
//     batch over ZMQConfig.MaxFrameBytes is dropped undecoded and handled as a lost one.
//     A Sink that can lose what it was given without being told (a Redis index whose server
//     restarted empty) implements LossReporter: each backend's worker asks it every
//     ZMQConfig.LossCheckInterval (1 s) whether the backend was lost, and heals a lost one at
//     once, as it answers a failed Apply but without waiting for the engine's next batch — it
//     clears the backend and catches each of its chains up on the batches through the last one
//     applied. A backend that receives no traffic and whose engine publishes nothing is thus
//     relearnt all the same. The same check performs a clear that a failed Apply left pending.
//   - SSE: an HTTP client reads GET <engine>/v1/kv_events with a 1 MiB line and event cap
//     (SSEConfig.MaxEventSize) and reconnects with exponential backoff from 1 s to 60 s.
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
