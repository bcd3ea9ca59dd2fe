package redisindex_test

import (
	"context"
	"log"
	"time"

	"github.com/redis/rueidis"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/events/zmqevents"
	"github.com/kvroute/kvroute/kvindex/redisindex"
	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/redisstore"
)

// A KV index shared by every router replica that uses the same Redis and key prefix, fed by the
// engines' ZMQ events. The ZMQ consumer asks the index every second whether Redis lost what it
// held (a restart without persistence) and then replays what the engines still cache.
func ExampleNew() {
	index, err := redisindex.New(redisindex.Config{
		URL:          "redis://127.0.0.1:6379/0",
		KeyPrefix:    "myapp:kvidx:",
		DefaultModel: "meta-llama/Llama-3.1-8B-Instruct",
	})
	if err != nil {
		log.Fatal(err) // kvindex.ErrInvalidConfig; an unreachable Redis is not an error
	}
	defer index.Close()
	c, err := zmqevents.New(zmqevents.Config{
		Sink: index,
		Endpoints: []zmqevents.Endpoint{
			{Backend: "vllm-0", Endpoint: "tcp://vllm-0:5557", ReplayEndpoint: "tcp://vllm-0:5558"},
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := c.Start(context.Background()); err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	cfg := kvroute.KVConfig{Index: index} // the Router's tier 4; a failed lookup routes by hashing
	_ = cfg
}

// One client per Redis server for the KV index and the response cache: each uses it under its
// own key prefix, and neither closes it.
func ExampleNewWithClient() {
	client, err := rueidis.NewClient(rueidis.ClientOption{
		InitAddress:  []string{"127.0.0.1:6379"},
		DisableCache: true,
	})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close() // after the index and the store
	index, err := redisindex.NewWithClient(client, redisindex.Config{KeyPrefix: "myapp:kvidx:"})
	if err != nil {
		log.Fatal(err)
	}
	defer index.Close()
	store, err := redisstore.NewWithClient(client, redisstore.Config{KeyPrefix: "myapp:resp:"})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	cache, err := respcache.New(respcache.Config{Store: store, TTL: 30 * time.Minute})
	if err != nil {
		log.Fatal(err)
	}
	defer cache.Close()
	// … kvroute.KVConfig{Index: index}; cache.Middleware(proxy).
}
