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
// vllm:num_requests_running, vllm:num_requests_waiting, vllm:gpu_cache_usage_perc, …), /health,
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
// first block —, token_ids, block_size, lora_id nil, medium "GPU" or "CPU"), BlockRemoved
// (block_hashes, medium) and AllBlocksCleared (Reset). Each engine step (a request admitted, or
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
// SSE events (the seeds' form, Events.SSE) are prefix-granular: "event: cache_created" with
// {"event", "prefix_hash" (kvroute's prefix key of the request: prefixkey.PrefixKey(req,
// 1024).String()), "token_count"} where token_count is the number of leading tokens of the last
// such request's full blocks the engine holds; it is published again when evictions shorten it.
// cache_offloaded reports a prefix whose leading blocks are only on the CPU tier, cache_reloaded
// its return, cache_evicted its loss from the GPU with no CPU copy, cache_purged its loss from the
// CPU tier. A new stream starts with the current state of every prefix.
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
//		// in.URL: backend; in.ZMQEndpoint, in.ReplayEndpoint, in.Topic: events.ZMQEndpoint
//	}
//
// Every goroutine the package starts (accept, dial and connection loops, HTTP serving, the flush
// timer) is stopped by Engine.Close (or Fleet.Close), which is idempotent.
package enginesim
