package chwbl

import (
	"errors"
	"fmt"
	"testing"
)

// Owner names the backend Acquire takes while it is under its bound, whatever the load: the
// first healthy backend clockwise; Candidate agrees with it until the owner is full, then with
// Acquire's overflow. Neither takes a slot.
func TestOwnerIsReadOnly(t *testing.T) {
	r := newRing(t, Config{LoadFactorEpsilon: 0.25}, "a", "b", "c", "d")
	for key := range uint64(200) {
		owner, err := r.Owner(key)
		if err != nil {
			t.Fatal(err)
		}
		name, why, err := r.Candidate(key)
		if err != nil || name != owner || why != ReasonPrefixHash {
			t.Fatalf("key %d: candidate %q %v %v, owner %q", key, name, why, err, owner)
		}
	}
	if r.TotalInFlight() != 0 {
		t.Fatalf("Owner or Candidate took slots: %d in flight", r.TotalInFlight())
	}

	const key = 42
	owner, _ := r.Owner(key)
	var held []*Handle
	defer func() {
		for _, h := range held {
			h.Release()
		}
	}()
	for range 8 { // load the owner to its bound
		h := &Handle{}
		if ok, _ := r.TryAcquireBackend(h, owner); !ok {
			break
		}
		held = append(held, h)
	}
	name, why, _ := r.Candidate(key)
	if got, _ := r.Owner(key); got != owner {
		t.Fatalf("owner moved with load: %q, want %q", got, owner)
	}
	if name == owner || why != ReasonOverflow {
		t.Fatalf("candidate at the owner's bound: %q %v", name, why)
	}
	h := &Handle{}
	if why2, _ := r.Acquire(h, key); h.Backend() != name || why2 != why {
		t.Fatalf("Acquire chose %q %v, Candidate said %q %v", h.Backend(), why2, name, why)
	}
	held = append(held, h)

	// An unhealthy owner passes ownership clockwise; none healthy is ErrNoBackend.
	if err := r.SetHealthy(owner, false); err != nil {
		t.Fatal(err)
	}
	if got, _ := r.Owner(key); got == owner || got == "" {
		t.Fatalf("owner of %d with %q unhealthy: %q", key, owner, got)
	}
	for _, n := range []string{"a", "b", "c", "d"} {
		_ = r.SetHealthy(n, false)
	}
	if got, err := r.Owner(key); !errors.Is(err, ErrNoBackend) || got != "" {
		t.Fatalf("no healthy backend: %q %v", got, err)
	}
}

// BoundWithin is the bound TryAcquireBackendWithin enforces: a backend takes slots exactly while
// its in-flight count is below it.
func TestBoundWithinMatchesTryAcquire(t *testing.T) {
	for _, eps := range []float64{0.25, 1, 3} {
		t.Run(fmt.Sprintf("epsilon=%v", eps), func(t *testing.T) {
			r := newRing(t, Config{LoadFactorEpsilon: 0.25}, "a", "b", "c")
			if err := r.Add("w", 2); err != nil {
				t.Fatal(err)
			}
			var held []*Handle
			defer func() {
				for _, h := range held {
					h.Release()
				}
			}()
			for _, name := range []string{"b", "c", "b"} {
				h := &Handle{}
				_ = r.AcquireBackend(h, name)
				held = append(held, h)
			}
			for _, name := range []string{"a", "w"} {
				w := 1.0
				if name == "w" {
					w = 2
				}
				for range 50 { // a loose epsilon lets a heavy backend take every slot
					n, _ := r.InFlight(name)
					bound := r.BoundWithin(w, eps)
					h := &Handle{}
					ok, _ := r.TryAcquireBackendWithin(h, name, eps)
					if ok != (n < bound) {
						t.Fatalf("%s: in flight %d, BoundWithin %d, TryAcquireBackendWithin %v", name, n, bound, ok)
					}
					if !ok {
						break
					}
					held = append(held, h)
				}
			}
			if got, want := r.BoundWithin(1, -1), r.Bound(1); got != want {
				t.Fatalf("negative epsilon: %d, want the ring's %d", got, want)
			}
			if got, want := r.BoundWithin(1, 0.25), r.Bound(1); got != want {
				t.Fatalf("the ring's epsilon: %d, want %d", got, want)
			}
		})
	}
}
