package chwbl_test

import (
	"errors"
	"fmt"

	"github.com/kvroute/kvroute/chwbl"
)

func Example() {
	ring, err := chwbl.New(chwbl.Config{}) // 150 virtual nodes, ε = 0.25
	if err != nil {
		panic(err)
	}
	for _, name := range []string{"pod-a", "pod-b", "pod-c"} {
		if err := ring.Add(name, 1); err != nil {
			panic(err)
		}
	}

	var h chwbl.Handle
	reason, err := ring.Acquire(&h, 0x5eed) // the request's prefix hash
	if err != nil {
		panic(err) // chwbl.ErrNoBackend: nothing healthy
	}
	fmt.Println(h.Backend(), reason, ring.TotalInFlight())

	h.Release() // when the response is done
	fmt.Println(ring.TotalInFlight())
	// Output:
	// pod-a prefix_hash 1
	// 0
}

// A hot prefix stays on its backend until that backend reaches its bound; the excess overflows
// clockwise to the next backends.
func ExampleRing_Acquire_overflow() {
	ring, _ := chwbl.New(chwbl.Config{LoadFactorEpsilon: 0.25})
	for _, name := range []string{"pod-a", "pod-b", "pod-c", "pod-d"} {
		_ = ring.Add(name, 1)
	}
	handles := make([]chwbl.Handle, 8)
	for i := range handles {
		reason, _ := ring.Acquire(&handles[i], 42) // the same prefix every time
		// Bound(1): what the next request's backend may reach, ceil(1.25·(T+1)/4).
		fmt.Printf("request %d → %s (%v), bound now %d\n", i, handles[i].Backend(), reason, ring.Bound(1))
	}
	for i := range handles {
		handles[i].Release()
	}
	// Output:
	// request 0 → pod-c (prefix_hash), bound now 1
	// request 1 → pod-b (overflow), bound now 1
	// request 2 → pod-a (overflow), bound now 2
	// request 3 → pod-c (prefix_hash), bound now 2
	// request 4 → pod-b (overflow), bound now 2
	// request 5 → pod-a (overflow), bound now 3
	// request 6 → pod-c (prefix_hash), bound now 3
	// request 7 → pod-b (overflow), bound now 3
}

// request is a caller's per-request state. Embedding the Handle makes routing allocation-free.
type request struct {
	prefixHash uint64
	slot       chwbl.Handle
}

func ExampleHandle() {
	ring, _ := chwbl.New(chwbl.Config{})
	_ = ring.Add("pod-a", 1)
	_ = ring.Add("pod-b", 2) // twice the keys and twice the share of the bound

	req := &request{prefixHash: 7}
	if _, err := ring.Acquire(&req.slot, req.prefixHash); err != nil {
		panic(err)
	}
	fmt.Println(req.slot.Held())
	fmt.Println(req.slot.Release(), req.slot.Release()) // idempotent: only the first frees the slot
	fmt.Println(req.slot.Held(), ring.TotalInFlight())
	// Output:
	// true
	// true false
	// false 0
}

// Another policy (e.g. a KV-cache-overlap scorer) picked the backend: take the slot without the
// bound check so the ring's accounting stays complete.
func ExampleRing_AcquireBackend() {
	ring, _ := chwbl.New(chwbl.Config{})
	_ = ring.Add("pod-a", 1)
	_ = ring.Add("pod-b", 1)

	var h chwbl.Handle
	if err := ring.AcquireBackend(&h, "pod-b"); err != nil {
		panic(err)
	}
	defer h.Release()
	n, _ := ring.InFlight("pod-b")
	fmt.Println(h.Backend(), chwbl.ReasonForced, n)

	err := ring.AcquireBackend(new(chwbl.Handle), "pod-z")
	fmt.Println(errors.Is(err, chwbl.ErrUnknownBackend))
	// Output:
	// pod-b forced 1
	// true
}

func ExampleRing_Loads() {
	ring, _ := chwbl.New(chwbl.Config{})
	_ = ring.Add("pod-a", 1)
	_ = ring.Add("pod-b", 2)
	_ = ring.SetHealthy("pod-a", false)

	var h chwbl.Handle
	_, _ = ring.Acquire(&h, 1) // pod-a is skipped
	defer h.Release()

	loads := make([]chwbl.Load, 0, 8) // reuse across calls: no allocation
	for _, l := range ring.Loads(loads) {
		fmt.Printf("%s weight=%v in_flight=%d healthy=%v\n", l.Name, l.Weight, l.InFlight, l.Healthy)
	}
	// Output:
	// pod-a weight=1 in_flight=0 healthy=false
	// pod-b weight=2 in_flight=1 healthy=true
}
