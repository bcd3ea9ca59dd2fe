// Package prefixkey turns an LLM request body into the keys a KV-cache-aware router routes on.
//
// It does three things:
//
//   - Parsing. ParseOpenAIChat (POST /v1/chat/completions), ParseOpenAICompletion
//     (POST /v1/completions) and ParseAnthropicMessages (POST /v1/messages), or Parse with a Format,
//     read a body into one Request: model, system prompt, messages, sampling parameters, vLLM's
//     cache_salt, and the identities of the messages' images and audio (Request.Media). Errors wrap
//     ErrMalformed. InjectAnthropicCacheControl rewrites an Anthropic body so that its system
//     prompt ends with a prompt-caching breakpoint (cache_control), for gateways that forward to
//     Anthropic's API.
//   - Prefix keys. Request.PrefixKey hashes a request's anchor — its system prompt, else its first message
//     — into a 128-bit Key, which a consistent-hash ring (package chwbl) maps to a preferred
//     backend. It needs no tokens.
//   - Block keys. Request.BlockKeys and AppendBlockKeys hash a request's token IDs into one chained
//     64-bit key per full KV-cache block, the keys a KV-cache index (package kvindex) stores per
//     backend; NextBlockKey re-keys the blocks of an engine's BlockStored event the same way.
//
// All functions are safe for concurrent use and the hashing functions do not allocate (a dst with
// enough capacity given). The package holds no state.
//
// # Prefix key
//
// A Key is the XXH3-128 hash (xxHash specification, github.com/Cyan4973/xxHash, doc/xxhash_spec.md;
// seed 0, default secret) of
//
//	model ‖ 0x00 ‖ tag ‖ TruncateUTF8(anchor, maxPrefixLength)
//
// model is Request.Model as UTF-8 bytes; 0x00 ends it (model names hold no NUL byte), so that model
// "ab" with text "c" and model "a" with text "bc" differ; tag is 'S' (0x53) when the anchor is the
// system prompt and 'M' (0x4D) when it is the first non-system message (or the first completions
// prompt), so that the same text in the two roles differs; the anchor is cut to maxPrefixLength
// bytes (DefaultMaxPrefixLength, 1,024, when <= 0) without splitting a UTF-8 character. The Key's 16
// bytes are the hash in canonical (big-endian) order, high half first; Key.String is their lowercase
// hex and Key.Uint64 the low half. This is kvroute's prefix-key layout with SHA-256 replaced by
// XXH3-128.
//
// A request with a cache salt, or whose anchor is its first message and holds media items within
// the covered bytes, gets the extended key instead (ExtendedKey), which adds the salt and each
// item's text offset and identity:
//
//	model ‖ 0x00 ‖ tag|0x20 ‖ le64(len(salt)) ‖ salt ‖ le64(len(t)) ‖ t ‖ le64(n) ‖ (le64(offset) ‖ le64(hash))ⁿ
//
// The lower-case tag ('s', 'm') keeps these inputs apart from the plain layout's, whose keys (of
// unsalted, text-only anchors) are unchanged.
//
// # Block keys
//
// Block keys follow vLLM's automatic prefix caching: a block's key commits to its tokens and to
// every block before it, so "block i is cached" implies "blocks 0..i are". With le32 and le64
// unsigned little-endian integers of 4 and 8 bytes, and XXH3-64 (seed 0, default secret):
//
//	root    = XXH3-64( le64(len(name)) ‖ name ‖ le64(len(salt)) ‖ salt )
//	key[0]  = XXH3-64( le64(root)     ‖ le32(t[0])  ‖ … ‖ le32(t[B-1])   ‖ le64(x[0]) ‖ … )
//	key[i]  = XXH3-64( le64(key[i-1]) ‖ le32(t[iB]) ‖ … ‖ le32(t[iB+B-1]) ‖ le64(x[0]) ‖ … )
//
// name is the LoRA adapter's name when the request runs on one (vLLM's lora_name, Request.Adapter),
// otherwise the model name; salt is the cache salt (vLLM's cache_salt, "" for none): requests that
// must not share KV cache get disjoint chains. B is the block size (DefaultBlockSize, 16, when
// <= 0); only full blocks have keys, as engines cache only full blocks. The x are block i's extra
// keys: the Hash of every MultiModalSpan whose placeholder tokens overlap the block, in the order of
// Request.MultiModal, so that the same placeholder tokens standing for different images differ.
//
// These keys are kvroute's own. vLLM's block hashes cannot be recomputed outside the engine (their
// root is random per process unless PYTHONHASHSEED is set), so an index maps each engine's hashes to
// these keys, computed from the token_ids of its BlockStored events.
//
// # Cache salt and multimodal content
//
// vLLM's cache_salt (a top-level string of OpenAI chat and completions bodies; non-empty, at most
// MaxCacheSaltLength bytes, else a *FieldError naming "cache_salt") fills Request.CacheSalt. It
// roots the block keys (BlockRoot), so salted chains match only engine events with the same salt
// (vLLM puts it in block 0's extra keys); it enters the prefix key, since no backend holds one
// salt's prefix for another, and the response-cache key. Anthropic bodies keep it in Params.Other.
//
// The media of the messages — OpenAI image_url, input_audio and vLLM's video_url and audio_url
// parts, Anthropic image blocks (also in tool results) — are listed in Request.Media with an
// identity Hash: MediaUUIDHash of vLLM's per-part "uuid" when given, else MediaURLHash of the
// URL, or MediaDataHash of inline base64 data (a data: URI's payload, an Anthropic base64 source,
// input_audio's data), undecoded. kvroute fetches nothing: the same image behind two URLs has two
// identities and different images behind one URL have one; equal bytes sent inline have one
// identity in every form. The identities reach:
//
//   - the prefix key, for the items of an anchor message (above);
//   - the response-cache key, through Part.Data, which holds the part's URL or data (and its
//     uuid);
//   - block keys, only through Request.MultiModal. Where an item's placeholder tokens sit, and how
//     many there are, only the engine's multimodal processor knows: /tokenize returns the tokens
//     without spans, and EngineTokenizer sends text only. A caller that knows them (its own
//     processor) sets TokenIDs and one MultiModalSpan per item; otherwise the request has no block
//     keys (Request.MediaPlaced, Request.BlockKeys, EngineTokenizer returns no tokens), because
//     the text-only keys of two requests that differ in an image are equal, and the router routes
//     it on tier 1 by its media-aware prefix key. EstimateTokenizer, whose pseudo-tokens are
//     kvroute's own, writes each item's identity into them where the item sits.
//
// Against vLLM's own keys: vLLM hashes each processed item (its mm_hash, over the decoded pixels or
// samples and the processor's options) unless the request gives the item a uuid, and lists
// [identifier, offset] pairs in the extra keys of the blocks its placeholders cover; package
// events folds each identifier to XXH3-64 (events.ExtraKeyHash). A request's block keys equal the
// re-keyed event's when it carries the same tokens, placeholders included, and spans with those
// digests: with vLLM's uuid as identifier (MediaUUIDHash is that digest) or with the engine's own
// mm_hash when the caller computes it. URL and data identities are kvroute's: they match the
// router's own speculated entries and other requests, never vLLM's content hashes. Salted
// requests, and text-only ones, match vLLM's events exactly.
//
// # Why XXH3
//
// Keys are computed on every request (a prefix key over up to 1 KiB, a block key per 16 tokens), so
// speed matters: XXH3 hashes at several GB/s with no allocation. They need no cryptographic
// strength: a collision only sends a request to a backend that lacks its cache, which costs a
// cache miss, never a wrong answer. (Response-cache keys, where a collision would return another
// tenant's response, use SHA-256 in package respcache.)
//
// # Use
//
//	req, err := prefixkey.ParseOpenAIChat(body)
//	if err != nil {
//		return err // errors.Is(err, prefixkey.ErrMalformed): answer 400
//	}
//	if key, ok := req.PrefixKey(prefixkey.DefaultMaxPrefixLength); ok {
//		preferred, _, err = ring.Candidate(key.Uint64()) // a *chwbl.Ring
//	} // else: no anchor, take the fallback path
//	req.TokenIDs = tokens // the engine's token IDs, when known (and req.MultiModal, with media)
//	blocks := req.BlockKeys(nil, prefixkey.DefaultBlockSize)
//	// look blocks up in a kvindex: each backend's longest cached run of them
package prefixkey
