package s3store_test

import (
	"log"
	"os"
	"time"

	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/s3store"
)

// A tiered response cache: an in-memory L1 in front of a durable S3 L2 shared by every replica.
func ExampleNew() {
	l2, err := s3store.New(s3store.Config{
		Endpoint:  "https://s3.us-east-1.amazonaws.com",
		Bucket:    "llm-response-cache", // must exist
		AccessKey: os.Getenv("S3_ACCESS_KEY"),
		SecretKey: os.Getenv("S3_SECRET_KEY"),
	})
	if err != nil {
		log.Fatal(err) // respcache.ErrInvalidConfig: a bad field, a missing bucket, rejected keys
	}
	defer l2.Close()
	l1, err := respcache.NewMemory(respcache.MemoryConfig{Capacity: 5000})
	if err != nil {
		log.Fatal(err)
	}
	store, err := respcache.NewTiered(respcache.TieredConfig{L1: l1, L2: l2})
	if err != nil {
		log.Fatal(err)
	}
	cache, err := respcache.New(respcache.Config{Store: store, TTL: 24 * time.Hour})
	if err != nil {
		log.Fatal(err)
	}
	defer cache.Close()
	_ = cache // cache.Middleware(proxy) serves repeated deterministic requests
}
