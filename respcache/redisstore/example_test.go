package redisstore_test

import (
	"context"
	"log"
	"time"

	"github.com/redis/rueidis"

	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/redisstore"
)

// A response cache on Redis, falling back to memory while Redis is unreachable.
func ExampleNew() {
	store, err := redisstore.New(redisstore.Config{
		URL:       "redis://127.0.0.1:6379/0",
		KeyPrefix: "myapp:resp:",
	})
	if err != nil {
		log.Fatal(err) // respcache.ErrInvalidConfig: a bad URL, prefix or password
	}
	defer store.Close()
	cache, err := respcache.New(respcache.Config{Store: store, TTL: 30 * time.Minute})
	if err != nil {
		log.Fatal(err)
	}
	defer cache.Close()
	_ = cache // cache.Middleware(proxy) serves repeated deterministic requests
}

// One client for the response cache and for other users of the same Redis (the KV index takes it
// as redisindex.NewWithClient(client, cfg)): the store uses it and leaves closing it to its owner.
func ExampleNewWithClient() {
	client, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{"127.0.0.1:6379"}})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close() // after the store
	store, err := redisstore.NewWithClient(client, redisstore.Config{KeyPrefix: "myapp:resp:"})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	ctx := context.Background()
	if err := store.Set(ctx, "key", []byte("response"), time.Minute); err != nil {
		log.Print(err)
	}
}
