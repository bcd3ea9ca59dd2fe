// Package enginesim is a simulated vLLM engine: the reference proxy's default backends (four
// in-process engines), the end-to-end tests' backends, and the replay harness's model of a
// replica. It speaks the real engines' wire formats, so that what kvroute does against it is what
// it does against vLLM.
//
// # What it simulates
//
//   - A paged KV cache with automatic prefix caching (vLLM's KVCacheManager): full blocks of
//     BlockSize tokens are hashed in a chain and cached; a request reuses the longest run of its
//     leading blocks that is cached, at most (n−1)/BlockSize blocks so that the last prompt token
//     is always computed, as vLLM does. A running request holds its prompt's blocks plus private
//     blocks for its partial last block and its completion (reserved at admission: there is no
//     preemption). When a request ends its blocks become evictable, tail first; allocation takes
//     empty blocks first, then evicts the least recently used evictable block. Blocks held by
//     running requests are never evicted. With CPUCapacityBlocks, evicted blocks move to an LRU
//     CPU tier, and a request whose prefix continues there loads them back (a hit, reported in
//     cached_tokens; CPULoadPerToken of latency each). A block is on one tier at a time.
//     Simplifications: blocks filled during decode are not cached, and empty blocks are preferred
//     to cached ones (vLLM takes the head of one free queue).
//   - A scheduler: at most MaxConcurrent requests run; the others wait first-come-first-served
//     (the head also waits for enough free blocks); MaxQueue bounds the queue (503 beyond).
//   - A latency model in virtual time: prefill = Base + PerToken·(n−p) + Quadratic·(n²−p²)
//     (+ CPULoadPerToken per token loaded from the CPU tier), decode = PerOutputToken per token,
//     slept SpeedFactor wall-clock seconds per virtual second (0: no sleeping; the durations are
//     still computed, returned in Result and in X-Enginesim-* response headers).
//
// # HTTP API (Engine.Handler)
//
// POST /v1/chat/completions, /v1/completions (OpenAI, streaming or not), /v1/messages
// (Anthropic, streaming or not), /tokenize (vLLM's), GET /v1/models, /metrics (Prometheus text,
// vLLM's names: vllm:prefix_cache_hits_total, vllm:prefix_cache_queries_total,
// vllm:num_requests_running, vllm:num_requests_waiting, vllm:gpu_cache_usage_perc, …, and
// vllm:kv_storage_* and vllm:kv_transfer_* counters of the external storage), /health,
// and GET /v1/kv_events (SSE events). Bodies follow vLLM's field order and shapes;
// usage.prompt_tokens_details.cached_tokens reports the prefix-cache hit, and for Anthropic
// usage.cache_read_input_tokens does (input_tokens then excludes it, as Anthropic counts). A
// request for another model than Config.Model gets 404, as from vLLM.
//
// Completions are made of words from a fixed list, one word per completion token: exactly
// max_tokens (max_completion_tokens) of them, finish_reason "length", or Config.OutputTokens and
// "stop" when the request sets no maximum. At temperature 0 the id, created and content are
// functions of the model, format, prompt tokens and lengths (XXH3-128), so two identical requests
// get bodies that are byte-identical except usage's cached_tokens, which reports each request's
// own hit (the first is cold, the next warm: real engines differ there too). Otherwise the id is
// random and created is the clock's time (real vLLM's behaviour), and the content random unless
// the request sets a seed.
//
// # Tokenizer and chat template
//
// The engine tokenizes with AppendTokens, a deterministic word-level tokenizer over a vocabulary of
// 128,256 IDs (ordinary pieces hash below 128,000; special tokens <|…|> above), prefix-stable at
// word boundaries, and formats chat requests with a simple template (ChatTokens):
//
//	<|begin_of_text|><|system|>\n{system}\n<|user|>\n{text}\n … <|assistant|>\n
//
// /tokenize returns exactly the tokens the engine processes a request with, so that
// prefixkey.EngineTokenizer pointed at an engine gives precise block keys. A conversation's next
// turn extends the previous turn's tokens (the generation prompt opens the assistant message).
//
// # KV events
//
// Block events go out over ZMQ in vLLM's wire format: messages [topic, seq as 8-byte big-endian,
// msgpack batch], seq from 0 per engine process; batches in array form [ts, events, dp_rank] or
// map form (MapForm); events BlockStored (block_hashes, parent_block_hash — nil for a chain's
// first block —, token_ids, block_size, lora_id nil, medium "GPU", "CPU", or "STORAGE" for a
// prefill's writes to external storage), BlockRemoved (block_hashes, medium) and
// AllBlocksCleared (Reset). Each engine step (a request admitted, or
// finished, or a Reset) is one batch unless BatchSize or FlushInterval say otherwise. The block
// hashes are the engine's own, from a random seed per process (HashSeed fixes it), so they are
// opaque: a consumer must re-key blocks from token_ids and parents, as kvroute does. An eviction
// to the CPU tier is published as BlockStored (medium CPU) then BlockRemoved (GPU); a load back
// as BlockStored (GPU) then BlockRemoved (CPU), so that a consumer never sees such a block on no
// tier. The PUB socket binds or connects (vLLM's rule: a "*" host binds); a ROUTER replay socket
// answers ["", start_seq] with every kept batch ≥ start_seq as ["", seq, payload] and then
// ["", 0xff…ff, ""], keeping the last ReplayBuffer batches.
//
// The ZMQ sockets are implemented here over TCP connections, ZMTP 3.0 with the NULL mechanism
// (the handshake by go-zeromq/zmq4's connection codec, as package events does; frames written and
// read here with deadlines). go-zeromq/zmq4's own PUB socket leaks its writer goroutine on Close
// (measured with runtime.NumGoroutine: one goroutine per socket left in (*pubMWriter).run after
// Close, on v0.17.0), which would break the "Close stops everything" promise and accumulate over
// Kill/Restart cycles. Subscriptions (ZMTP 3.0 messages starting with 1 or 0) filter by topic
// prefix; a subscriber's queue holds SubscriberHWM messages, beyond which messages are dropped for
// it (ZMQ's high-water mark; the consumer sees a sequence gap and replays).
//
// SSE events (kvroute's form, Events.SSE) are prefix-granular: "event: cache_created" with
// {"event", "prefix_hash" (kvroute's prefix key of the request: req.PrefixKey(1024)
// .String()), "token_count"} where token_count is the number of leading tokens of the last
// such request's full blocks the engine holds; it is published again when evictions shorten it.
// cache_offloaded reports a prefix whose leading blocks are only on the CPU tier, cache_reloaded
// its return, cache_evicted its loss from the GPU with no CPU copy, cache_purged its loss from the
// CPU tier. A new stream starts with the current state of every prefix.
//
// # Prefill and decode disaggregation
//
// Config.Role makes an engine a prefill engine (RolePrefill), a decode engine (RoleDecode) or a
// unified one (RoleUnified, the default, which plays either part when a request asks).
// Config.Storage is the external KV storage they share: an S3 bucket, under StorageConfig's
// Namespace. The protocol follows vLLM's disaggregated serving (the kv_transfer_params field
// names); a proxy runs it in two phases.
//
// Phase 1, prefill (proxy → prefill engine): the client's body, to the same endpoint
// (/v1/chat/completions, /v1/completions or /v1/messages, where it is a top-level field too),
// with "max_tokens": 1 (or "max_completion_tokens": 1 for a chat body that used it), "stream":
// false, stream_options removed, and
//
//	"kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}
//
// A prefill or unified engine with storage runs the prefill as usual (its prefix cache and
// latency model apply), then writes every full block of the prompt to the bucket as object
// <namespace>/<model>/<key>, where key is the block's storage key in 16 lowercase hex digits, and
// sleeps the write's simulated transfer time. A block this engine already wrote, or that a HEAD
// finds stored (written by any engine), is not rewritten. The blocks are announced as
// BlockStored events with medium "STORAGE" (package events maps it to its storage tier),
// carrying the engine's own block hashes, parents and token_ids as its GPU events do, once per
// process. The answer is the normal non-streamed response (one token) with a top-level
//
//	"kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
//	    "remote_engine_id": "<engine name>",
//	    "remote_storage": {"endpoint": "<S3 endpoint>", "bucket": "<bucket>", "namespace": "<namespace>"},
//	    "remote_block_keys": ["<key hex>", …], "num_prompt_tokens": N}
//
// remote_block_keys lists every full block of the prompt in order ([] for a prompt shorter than
// a block); no credentials are ever returned. When storage cannot be written (unreachable, an
// error answer, or within the cooldown after it was found unreachable) the prefill answers 503
// with an OpenAI-style error ({"error": {"message", "type": "ServiceUnavailableError", "param",
// "code": 503}}; Anthropic's shape on /v1/messages), so that the proxy can fall back. A request
// with do_remote_decode and "stream": true gets 400.
//
// Phase 2, decode (proxy → decode engine): the client's original body (its max_tokens, stream,
// stream_options…) plus the kv_transfer_params object the prefill returned, unchanged. A decode
// or unified engine reads the listed blocks the hit can use — at most (n−1)/BlockSize, as for
// its own cache — that it does not already hold (GPU or CPU tier), in prompt order, stopping at
// the first one that is absent, unreadable or not the prompt's (its key is recomputed from the
// request's tokens and the object's content is checked). It sleeps the simulated transfer time,
// places the blocks on its GPU as cached blocks (BlockStored events, medium "GPU", its own
// hashes), then serves the request: usage.prompt_tokens_details.cached_tokens (Anthropic:
// cache_read_input_tokens) counts the loaded blocks and those it already held, and
// X-Enginesim-Storage-Tokens the loaded ones. Blocks not loaded are computed locally and counted
// in Stats.StorageMissingBlocks; an engine that holds the prefix reads nothing. A remote_storage
// naming another bucket or namespace than the engine's own is not read (the endpoint is not
// compared: engines may reach one server under different addresses).
//
// Roles: a prefill engine serves a request without do_remote_decode normally, and ignores
// do_remote_prefill (it never reads storage); a decode engine serves a request with
// do_remote_decode normally, without writing and without kv_transfer_params in the answer. An
// engine without Storage ignores kv_transfer_params altogether (do_remote_prefill's blocks are
// counted missing): a 200 answer without kv_transfer_params to a prefill request means that no
// handoff took place.
//
// The storage path: a decode engine with storage (StorageConfig.Lookup: StorageLookupAuto turns
// it on for RoleDecode only; StorageLookupOn for unified engines too) that gets a request without
// kv_transfer_params (or with both flags false) looks the prompt's blocks up in storage beyond
// those it holds, by their keys, and loads those found, stopping at the first absent one — so a
// router can send a request whose prefix is in storage straight to a decode engine. It costs a
// storage request per request that misses locally.
//
// Storage keys are content-chained and independent of the engine's hash seed: key(i) =
// xxh3-64(le64(key(i−1)) ‖ le32 token IDs of block i), with key(−1) = xxh3-64("kvroute-enginesim-kv/v1"
// ‖ 0x00 ‖ model ‖ 0x00 ‖ le32(block size)). Every engine of a model and block size computes the
// same keys from the same tokens, across restarts and whatever its seed; sharing the engines'
// block-hash seed instead would make the engines' event hashes predictable (unlike vLLM's) and
// orphan every stored block at each Restart. The engine hashes stay in the events only. An
// object is a 32-byte header ("KVRB", version 1, flags, the key, the parent key, the token count)
// followed by the block's token IDs as le32; its simulated size is BlockSize × BytesPerToken
// (default 128 KiB per token, Llama-3.1-8B in bf16) and moving b bytes takes
// b / BandwidthBytesPerSec (default 10 GB/s) of virtual time, slept SpeedFactor times like every
// other delay and reported in Result.StorageLoad and StorageStore. Objects are never deleted by
// the engines (a bucket lifecycle rule should expire them), and the SSE events do not report the
// storage tier.
//
// # Faults
//
// SetDown (503 everywhere), SetStall (admitted requests hang before prefill), Kill (listeners and
// connections closed: connection refused; the cache lost) and Restart (a fresh process on the
// same addresses: empty cache, new hash seed, sequence from 0), Reset (AllBlocksCleared).
//
// # Use
//
//	f, err := enginesim.StartFleet(ctx, enginesim.FleetConfig{N: 4, ZMQ: true,
//		Base: enginesim.Config{Latency: enginesim.Latency{SpeedFactor: 1}}})
//	if err != nil {
//		return err
//	}
//	defer f.Close()
//	for _, in := range f.Info() {
//		// in.URL: backend; in.ZMQEndpoint, in.ReplayEndpoint, in.Topic: zmqevents.Endpoint
//	}
//
// A prefill/decode fleet sharing a bucket (the proxy then runs the two phases above):
//
//	storage := &enginesim.StorageConfig{Endpoint: "http://127.0.0.1:7070", Bucket: "kv",
//		AccessKey: ak, SecretKey: sk}
//	f, err := enginesim.StartFleet(ctx, enginesim.FleetConfig{N: 4, ZMQ: true,
//		Roles: []enginesim.Role{enginesim.RolePrefill, enginesim.RoleDecode, enginesim.RoleDecode, enginesim.RoleDecode},
//		Base:  enginesim.Config{Storage: storage}})
//
// Without an S3 server, StartMemoryS3 serves an in-memory bucket on a loopback port for such a
// fleet, and StartDemo starts the reference proxy's demo fleets (DemoDisagg: a prefill, decode
// and unified fleet over a MemoryS3) with the proxy configuration that fronts them.
//
// Every goroutine the package starts (accept, dial and connection loops, HTTP serving, the flush
// timer) is stopped by Engine.Close (or Fleet.Close), which is idempotent.
package enginesim
