// Package s3store is a respcache.CacheStore on a bucket of any S3-compatible service (AWS S3,
// MinIO, VAST, versitygw…), through the minio-go client: kvroute's response_cache.l2 store, meant
// as the large, durable L2 of a respcache.TieredStore.
//
// An entry is one object, KeyPrefix followed by the key escaped to a flat name. S3 has no
// per-object TTL, so the expiry travels in the object's user metadata (ExpiresMeta): a Get reads
// object and metadata with one GET (Amazon S3 API Reference, GetObject) and answers an expired
// object as a miss, and a background goroutine deletes it; a bucket lifecycle rule on the prefix
// is still recommended. After a connection failure or a timeout the store fails fast with
// respcache.ErrUnavailable for a cooldown, then lets one request probe (a circuit breaker), so an
// unreachable S3 does not cost every request a timeout. Close stops the goroutine.
//
//	l2, err := s3store.New(s3store.Config{Endpoint: "http://127.0.0.1:7070", Bucket: "llm-cache",
//		AccessKey: key, SecretKey: secret})
//	if err != nil {
//		return err
//	}
//	defer l2.Close()
//	l1, _ := respcache.NewMemory(respcache.MemoryConfig{Capacity: 5000})
//	store, err := respcache.NewTiered(respcache.TieredConfig{L1: l1, L2: l2})
//	if err != nil {
//		return err
//	}
//	cache, err := respcache.New(respcache.Config{Store: store, TTL: 24 * time.Hour})
//
// Importing this package costs the minio-go client; a user of the in-memory store alone imports
// respcache only.
package s3store
