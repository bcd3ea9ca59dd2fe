// Package prefixkey turns an LLM request body into the keys a KV-cache-aware router routes on.
//
// It does three things:
//
//   - Parsing. ParseOpenAIChat (POST /v1/chat/completions), ParseOpenAICompletion
//     (POST /v1/completions) and ParseAnthropicMessages (POST /v1/messages), or Parse with a Format,
//     read a body into one Request: model, system prompt, messages, sampling parameters. Errors wrap
//     ErrMalformed. InjectAnthropicCacheControl rewrites an Anthropic body so that its system
//     prompt ends with a prompt-caching breakpoint (cache_control), for gateways that forward to
//     Anthropic's API.
//   - Prefix keys. PrefixKey hashes a request's anchor — its system prompt, else its first message
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
//	if key, ok := prefixkey.PrefixKey(req, prefixkey.DefaultMaxPrefixLength); ok {
//		preferred, _, err = ring.Candidate(key.Uint64()) // a *chwbl.Ring
//	} // else: no anchor, take the fallback path
//	req.TokenIDs = tokens // the engine's token IDs, when known
//	blocks := req.BlockKeys(nil, prefixkey.DefaultBlockSize)
//	// look blocks up in a kvindex: each backend's longest cached run of them
package prefixkey
