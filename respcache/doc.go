// Package respcache serves repeated deterministic LLM requests from a cache: the response cache
// (tier 2) and the contract of its stores (tier 3), CacheStore, with the stores that need no
// client library (MemoryStore, and TieredStore over any two). The Redis/Valkey store is package
// respcache/redisstore and the S3 store package respcache/s3store, so that a user of the
// in-memory cache compiles neither client.
//
// A request that is eligible (an explicit temperature 0, at most one choice) is keyed by a SHA-256
// digest of everything that changes its response, its tenant included (by default a digest of the
// caller's credential); a stored response under that key is replayed without contacting any backend, as JSON or, for a streaming request, as the
// Server-Sent Events stream that was recorded. Everything is safe for concurrent use, holds no
// package-level state and starts no goroutine (the remote stores' packages document theirs: the
// Redis store's health monitor, the S3 store's reaper, each stopped by an idempotent Close).
//
// # Use
//
//	store, err := respcache.NewMemory(respcache.MemoryConfig{Capacity: 5000})
//	if err != nil {
//		return err
//	}
//	cache, err := respcache.New(respcache.Config{Store: store, TTL: 30 * time.Minute})
//	if err != nil {
//		return err
//	}
//	defer cache.Close()
//	http.Handle("/v1/", cache.Middleware(proxy)) // X-Cache: HIT, MISS or BYPASS
//
// Or, without the middleware: parse the body with package prefixkey, check Eligible, look
// KeyOf(req).String() up in any CacheStore, and Set the response after a MISS.
//
// # Stores
//
// CacheStore is kvroute's store contract (get, set with TTL, delete, clear, stats); every
// implementation passes the conformance suite in package respcache/cachetest, which users can run
// against their own. MemoryStore is an in-process LRU with a TTL per entry, bounded in entries and
// optionally in bytes, optionally sharded. TieredStore puts a fast L1 (memory or Redis) in front
// of a large L2 (S3) and promotes L2 hits into L1. In their own packages: redisstore.Store keeps
// entries in Redis or Valkey under a key prefix (SET … PX, so the server expires them) and falls
// back to an in-memory store while the server is unreachable; s3store.Store keeps entries as
// objects in an S3-compatible bucket, with the expiry in the object's metadata (an expired object
// is a miss).
//
// A store of one's own implements CacheStore and reports its errors in StoreStats.Errors by the
// types ErrorTypeOf gives (ErrorCounts keeps the counts), wrapping ErrUnavailable when its server
// cannot be reached, so that a TieredStore and the stats endpoint treat it like the stores here.
//
// # Cache key
//
// KeyOf follows kvroute's layout — SHA-256 over the model, a pre-hash of the messages and every
// output-changing parameter, optional ones tagged SOME/NONE so that an absent parameter differs
// from a zero one — with every variable-length field length-prefixed, so that no two ways of
// splitting the same bytes into fields collide (model "ab" with system "c" is not model "a" with
// system "bc"). SHA-256 (FIPS 180-4) rather than a fast non-cryptographic hash because a collision
// here would serve one tenant another's response: keys must resist adversarial inputs. With le32
// and le64 unsigned little-endian integers, str(s) = le64(len(s)) ‖ s, opt(x) = 0x00 when x is
// absent and 0x01 ‖ x when present (strings as str), floats as le64 of their IEEE-754 bits (−0 as
// +0) and integers as le64 of their two's complement:
//
//	conv = SHA-256( opt(system) ‖ le64(#messages) ‖ message… ‖ le64(#prompts) ‖ str(prompt)…
//	                ‖ le64(#prompt tokens) ‖ le32(token)… )
//	message = str(role) ‖ le64(#parts) ‖ ( str(type) ‖ str(text) ‖ str(data) )… ‖ opt(extra)
//	key  = SHA-256( "kvroute/respcache/key/v2" ‖ 0x00 ‖ str(model) ‖ 0x00 ‖ conv ‖ 0x00
//	                ‖ u8(format) ‖ str(adapter) ‖ opt(tenant) ‖ str(cache_salt) ‖ u8(stream)
//	                ‖ opt(temperature) ‖ opt(top_p) ‖ opt(max_tokens) ‖ opt(max_completion_tokens)
//	                ‖ opt(n) ‖ opt(seed) ‖ opt(presence_penalty) ‖ opt(frequency_penalty)
//	                ‖ opt(le64(#stop) ‖ str(stop)…) ‖ opt(response_format) ‖ opt(logit_bias)
//	                ‖ opt(tools) ‖ opt(tool_choice) ‖ opt(other)
//	                ‖ le64(#spans) ‖ ( le64(offset) ‖ le64(length) ‖ le64(hash) )… )
//
// The fields are those of prefixkey.Request: the system prompt is its own section (absent differs
// from empty); a message with no Parts counts as one text part holding its Text; extra, tools,
// tool_choice, response_format and logit_bias are the canonical JSON prefixkey produces (object
// keys sorted), so key order in the body does not matter; an empty tenant is NONE; format is
// prefixkey.Format (chat, completions and Anthropic messages never share entries); stream is in
// the key because a streamed and a non-streamed response differ on the wire. TokenIDs are not keyed
// (they follow from the prompt). other is prefixkey's Params.Other: the body's remaining top-level
// fields (logprobs, top_k, reasoning_effort, thinking, …) as canonical JSON, so requests that
// differ only in them never share an entry; fields that never change the output (user, metadata,
// service_tier, store) are left out of it, so they do not split the cache. Key.String gives the 64-digit hex form stores
// use; a layout change changes the version string, so routers of different versions sharing a
// store never confuse keys.
//
// # Eligibility
//
// Policy decides, with short stable reasons usable as metric labels, whether a request may be
// served from and stored into the cache (Policy.Request: temperature 0, n absent or ≤ 1,
// streaming only when CacheStreaming is set) and whether a response may be stored
// (Policy.CheckResponse: status 200, at most MaxResponseSize bytes, or MaxStreamBufferSize for a
// buffered stream). Eligible applies the default Cache's policy.
//
// Only an explicit "temperature": 0 makes a request deterministic: OpenAI and Anthropic both
// default an absent temperature to 1, so a request without one samples, and caching it would
// replay one sample to every later caller (X-Cache: BYPASS, reason "temperature"). A seed, top_p
// or any other parameter does not make a sampled request cacheable, and n > 1 never is. A fleet
// whose engines decode greedily by default can set Policy.AssumeGreedyDefault
// (Config.AssumeGreedyDefault) to treat an absent temperature as 0, as kvroute did before.
//
// # Tenants
//
// A cached response is only ever served to the tenant that paid for it: the tenant is part of
// the key, and so of the coalescing of concurrent requests too. By default (Config.Tenant nil) the
// tenant is CredentialTenant, a SHA-256 digest of the caller's Authorization, X-Api-Key and
// api-key (Azure OpenAI's) headers: callers with different API keys never share an entry, and the
// key holds neither the credential nor anything from which to recover it. Requests with none of
// these headers share one anonymous tenant. HeaderTenant names the tenant by a header that an
// authenticating gateway in front sets (X-Tenant-Id), and any func(*http.Request) string will do;
// Config.SharedAcrossTenants turns isolation off, for a cache serving a single trusted client.
// Code that keys requests itself (KeyOf, KeyFor) sets prefixkey.Request.Tenant the same way.
//
// # Streaming record and replay
//
// A streaming response is relayed to the client as it arrives and recorded on the side, up to
// MaxStreamBufferSize; only a complete stream — its terminal event seen (OpenAI "data: [DONE]",
// Anthropic "event: message_stop") and no error event — is stored. The recorder follows the WHATWG
// HTML Server-Sent Events parsing rules, whatever the pieces the stream arrives in. A hit on a
// streaming request replays the stored bytes as an SSE response.
//
// # Coalescing
//
// Concurrent eligible requests with the same key (so of the same tenant) make one call to the backend, a singleflight
// specialised for HTTP responses: the first request leads, the others wait for its response (a
// finished body is shared; a stream is followed live, each waiter receiving every piece as the
// leader's handler writes it). Waiters fall back to calling the backend themselves when the
// response turns out not to be shareable, and leave at once when their own context ends.
//
// # Middleware
//
// Cache.Middleware wraps an http.Handler (typically an httputil.ReverseProxy): it parses the body
// of a POST to an OpenAI or Anthropic path, keys it (with the tenant of the caller's credential,
// or the one Config.Tenant names), answers a hit from the store, and otherwise calls the wrapped handler, storing a
// cacheable response. Every response carries X-Cache: HIT, MISS or BYPASS. Cache.Stats gives the
// kvroute's GET /admin/response-cache/stats document and Cache.Invalidate its POST
// /admin/response-cache/invalidate; metrics go through an injected OpenTelemetry MeterProvider.
package respcache
