package natsync_test

import (
	"context"
	"log"
	"log/slog"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/natsync"
)

// A router replica shares its decisions with the other replicas of its fleet. The order matters:
// the router needs the Sync as its Peers, and the Sync needs the router to apply the peers'
// events to, so the Sync is built first and started with the router. (This example needs a NATS
// server, so it is compiled but not run.)
func Example() {
	ctx := context.Background()
	s, err := natsync.New(natsync.Config{
		URL:    "nats://127.0.0.1:4222",
		Group:  "chat-fleet", // the replicas routing to the same backends
		Logger: slog.Default(),
	})
	if err != nil {
		log.Fatal(err)
	}
	r, err := kvroute.New(kvroute.Config{
		Backends: []kvroute.Backend{{Name: "vllm-0"}, {Name: "vllm-1"}},
		Peers:    s,
	})
	if err != nil {
		log.Fatal(err)
	}
	defer r.Close()
	if err := s.Start(ctx, r); err != nil {
		log.Fatal(err)
	}
	defer s.Close() // runs before r.Close: the peers forget this replica at once

	// ... serve: r.Route, Decision.FirstToken, Decision.Done ...
	time.Sleep(time.Second)
	for _, p := range s.Stats().Peers {
		log.Printf("peer %s, last heard %v ago", p.Replica, time.Since(p.LastHeard))
	}
}
