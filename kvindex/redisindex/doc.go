// Package redisindex is a kvindex.KvCacheIndex kept in Redis or Valkey through the rueidis client,
// shared by every router replica that uses the same server and key prefix: kvroute's
// kv_cache_index with backend: redis.
//
// It applies engines' KV events by the rules package kvindex exports for every implementation
// (kvindex.CheckStored, StoredRoot, AppendStoredKeys, PrefixRule): block keys are kvroute's
// chained keys (package prefixkey), re-keyed from each BlockStored event's tokens, so that one
// index serves engines whose block hashes differ. Each block is one Redis string holding a
// 14-byte slot per backend (its tiers and expiry, and a speculative expiry); a lookup is one
// pipelined round trip (HMGET of the candidates' ids, MGET of the request's block strings) and the
// longest-prefix walk runs in Go. Writes are blind, idempotent SETRANGEs, so replicas that all
// apply the same engine's events converge. Index documents the key layout and the costs.
//
// # A lost Redis
//
// A Redis that restarts empty (or fails over to a replica that had not seen the writes, or is
// flushed) loses the entries while the engines keep their caches, and a cache hit publishes
// nothing, so events alone never bring them back. The index notices from a registry epoch that
// every round trip it makes anyway reads (see Index): every backend this process had written for
// is then lost until its next ClearBackend — Apply refuses its batches with
// kvindex.ErrBackendLost, and Index.BackendLost (events.LossReporter) reports it; asked when no
// other call has read the epoch lately, BackendLost reads it itself, at most every
// DefaultLossCheckInterval. The events consumers (the ZMQ consumer of events/zmqevents) ask for
// every backend they feed once a second and heal a lost one at once — clear, then catch up from
// the engine's replay buffer — whether or not it receives traffic or publishes events.
//
// # Clients
//
// The index dials Redis itself (New, from an address or URL) or uses a caller's client
// (NewWithClient), so that one client per server can serve the KV index and the response cache
// (respcache/redisstore.NewWithClient) alike. Errors wrap kvindex's sentinels
// (kvindex.ErrInvalidConfig, ErrUnavailable, ErrClosed, ErrBackendLost). A Router treats a failed
// lookup as "no KV information" and routes by consistent hashing alone; Config.CommandTimeout
// (50 ms) bounds what a slow Redis costs a request.
//
//	ix, err := redisindex.New(redisindex.Config{URL: "redis://127.0.0.1:6379/0", DefaultModel: "llama-3-8b"})
//	if err != nil {
//		return err
//	}
//	defer ix.Close()
//	// An events transport delivers each engine's batches: ix.Apply(ctx, "vllm-0", batch).
//	backends := []string{"vllm-0", "vllm-1"}
//	keys := req.BlockKeys(nil, ix.BlockSize()) // req: a *prefixkey.Request with TokenIDs
//	matches, err := ix.Lookup(ctx, keys, backends, make([]kvindex.Match, len(backends)))
//	// … choose a backend; then
//	_ = ix.Speculate(ctx, chosen, keys, 0)
//
// Importing this package costs the rueidis client; a user of the in-memory index alone imports
// kvindex only.
package redisindex
