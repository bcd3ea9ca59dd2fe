// Package redisstore is a respcache.CacheStore on Redis or Valkey, through the rueidis client,
// with an automatic in-memory fallback: kvroute's response_cache.redis store.
//
// Entries are Redis strings under a key prefix, written with SET key value PX ttl so that the
// server expires them; Clear SCANs and UNLINKs the prefix (every node of a cluster). Optionally,
// reads are served from a local copy kept coherent by the server (client-side caching, RESP3
// CLIENT TRACKING: https://redis.io/docs/latest/develop/reference/client-side-caching/).
//
// When Redis cannot be reached (a connection error, or a command that outlives CommandTimeout)
// the store switches at once to a respcache.MemoryStore, so no request fails; a health monitor
// goroutine PINGs Redis, replays the deletes made during the outage and switches back. Close
// stops it. Errors wrap respcache's sentinels (ErrInvalidConfig, ErrUnavailable, ErrClosed).
//
// The store dials Redis itself (New) or uses a caller's client (NewWithClient), so that one
// client per server can serve the response cache and a KV index (kvindex/redisindex) alike.
//
//	store, err := redisstore.New(redisstore.Config{URL: "redis://127.0.0.1:6379/0"})
//	if err != nil {
//		return err
//	}
//	defer store.Close()
//	cache, err := respcache.New(respcache.Config{Store: store, TTL: 30 * time.Minute})
//	if err != nil {
//		return err
//	}
//	defer cache.Close()
//	http.Handle("/v1/", cache.Middleware(proxy))
//
// Importing this package costs the rueidis client; a user of the in-memory store alone imports
// respcache only.
package redisstore
