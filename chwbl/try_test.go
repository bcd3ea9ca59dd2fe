package chwbl

import (
	"errors"
	"testing"
)

func TestTryAcquireBackendKeepsBound(t *testing.T) {
	r := newRing(t, Config{LoadFactorEpsilon: 0.25}, "a", "b", "c", "d")
	var held []*Handle
	// With only "a" taking requests, it may hold n while n ≤ ceil(1.25·n/4) … i.e. just 1 slot
	// (T=0 → bound ceil(1.25/4)=1; T=1 → ceil(2.5/4)=1).
	h := &Handle{}
	ok, err := r.TryAcquireBackend(h, "a")
	if err != nil || !ok || h.Backend() != "a" {
		t.Fatalf("first try: ok=%v err=%v backend=%q", ok, err, h.Backend())
	}
	held = append(held, h)
	h2 := &Handle{}
	ok, err = r.TryAcquireBackend(h2, "a")
	if err != nil || ok || h2.Held() {
		t.Fatalf("second try must be refused at the bound: ok=%v err=%v", ok, err)
	}
	// Load the others: the bound grows and "a" may take more, never beyond it.
	for _, name := range []string{"b", "c", "d", "b", "c", "d"} {
		hh := &Handle{}
		if err := r.AcquireBackend(hh, name); err != nil {
			t.Fatal(err)
		}
		held = append(held, hh)
	}
	for {
		hh := &Handle{}
		ok, err := r.TryAcquireBackend(hh, "a")
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			break
		}
		held = append(held, hh)
		n, _ := r.InFlight("a")
		if n > r.Bound(1) {
			t.Fatalf("a holds %d > bound %d", n, r.Bound(1))
		}
	}
	if _, err := r.TryAcquireBackend(&Handle{}, "nope"); !errors.Is(err, ErrUnknownBackend) {
		t.Fatalf("unknown backend: %v", err)
	}
	if err := r.SetHealthy("b", false); err != nil {
		t.Fatal(err)
	}
	if ok, _ := r.TryAcquireBackend(&Handle{}, "b"); ok {
		t.Fatal("unhealthy backend accepted")
	}
	for _, hh := range held {
		hh.Release()
	}
	if r.TotalInFlight() != 0 {
		t.Fatalf("total in flight %d after release", r.TotalInFlight())
	}
}

// TestTryAcquireBackendWithin: a looser epsilon lets one backend take exactly as many slots as
// its own bound allows, and a negative epsilon is the ring's.
func TestTryAcquireBackendWithin(t *testing.T) {
	r := newRing(t, Config{LoadFactorEpsilon: 0.25}, "a", "b", "c", "d")
	var held []*Handle
	defer func() {
		for _, h := range held {
			h.Release()
		}
	}()
	for _, name := range []string{"b", "c", "d", "b", "c", "d", "b", "c", "d"} {
		h := &Handle{}
		if err := r.AcquireBackend(h, name); err != nil {
			t.Fatal(err)
		}
		held = append(held, h)
	}
	// With epsilon 1, the n-th slot on "a" needs n ≤ ceil(2·(T+1)/4) with T = 9 + n−1 before it,
	// i.e. n ≤ ceil((9+n)/2): true for n = 10 (ceil(9.5) = 10), false for n = 11 (ceil(10) = 10).
	n := 0
	for {
		h := &Handle{}
		ok, err := r.TryAcquireBackendWithin(h, "a", 1)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			break
		}
		held = append(held, h)
		n++
		if n > 100 {
			t.Fatal("no bound")
		}
	}
	if want := 10; n != want {
		t.Fatalf("a took %d slots with epsilon 1, want %d", n, want)
	}
	// The ring's own ε refuses "a" far earlier: it is already over its bound.
	if ok, _ := r.TryAcquireBackendWithin(&Handle{}, "a", -1); ok {
		t.Fatal("negative epsilon did not fall back to the ring's ε")
	}
	if ok, _ := r.TryAcquireBackend(&Handle{}, "a"); ok {
		t.Fatal("TryAcquireBackend passed the ring's bound")
	}
	if _, err := r.TryAcquireBackendWithin(&Handle{}, "nope", 1); !errors.Is(err, ErrUnknownBackend) {
		t.Fatalf("unknown backend: %v", err)
	}
}
