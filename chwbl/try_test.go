package chwbl

import (
	"errors"
	"testing"
)

func TestTryAcquireBackendKeepsBound(t *testing.T) {
	r := newRing(t, Config{Epsilon: 0.25}, "a", "b", "c", "d")
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
