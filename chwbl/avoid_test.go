package chwbl

import (
	"errors"
	"testing"
)

func TestAcquireAvoidingPassesOverAvoidedMembers(t *testing.T) {
	r := newRing(t, Config{}, "a", "b", "c")
	for key := range uint64(200) {
		owner, err := r.Owner(key)
		if err != nil {
			t.Fatal(err)
		}
		var h Handle
		if _, err := r.AcquireAvoiding(&h, key, []string{owner}); err != nil {
			t.Fatalf("key %d: %v", key, err)
		}
		if h.Backend() == owner || h.Backend() == "" {
			t.Fatalf("key %d: avoided owner %q, got %q", key, owner, h.Backend())
		}
		h.Release()
		var h2 Handle
		others := []string{"a", "b", "c"}
		for i, n := range others {
			if n == h.Backend() {
				others = append(others[:i:i], others[i+1:]...)
				break
			}
		}
		if _, err := r.AcquireAvoiding(&h2, key, others); err != nil || h2.Backend() != h.Backend() {
			t.Fatalf("key %d: avoiding %v got %q, %v; want %q", key, others, h2.Backend(), err, h.Backend())
		}
		h2.Release()
	}
	if r.TotalInFlight() != 0 {
		t.Fatalf("total in flight %d after release", r.TotalInFlight())
	}
}

func TestAcquireAvoidingEveryHealthyMember(t *testing.T) {
	r := newRing(t, Config{}, "a", "b", "c")
	if err := r.SetHealthy("c", false); err != nil {
		t.Fatal(err)
	}
	var h Handle
	reason, err := r.AcquireAvoiding(&h, 7, []string{"a", "b", "unknown"})
	if !errors.Is(err, ErrNoBackend) || reason != ReasonNone || h.Held() {
		t.Fatalf("got %v, %v, held %v; want ErrNoBackend", reason, err, h.Held())
	}
	if r.TotalInFlight() != 0 {
		t.Fatalf("total in flight %d", r.TotalInFlight())
	}
}

// With the avoided member's share of the bound missing, every member left can be at its bound:
// the request still gets a slot, on the least loaded of them.
func TestAcquireAvoidingOverflowsPastTheBounds(t *testing.T) {
	r := newRing(t, Config{LoadFactorEpsilon: 0.01}, "a", "b", "c")
	var held []*Handle
	for range 3 {
		for _, n := range []string{"b", "c"} {
			h := &Handle{}
			if err := r.AcquireBackend(h, n); err != nil {
				t.Fatal(err)
			}
			held = append(held, h)
		}
	}
	h := &Handle{} // one more on c: b is the less loaded
	if err := r.AcquireBackend(h, "c"); err != nil {
		t.Fatal(err)
	}
	held = append(held, h)
	for key := range uint64(50) {
		var h Handle
		reason, err := r.AcquireAvoiding(&h, key, []string{"a"})
		if err != nil || h.Backend() != "b" || reason != ReasonOverflow {
			t.Fatalf("key %d: got %q, %v, %v; want b, overflow", key, h.Backend(), reason, err)
		}
		h.Release()
	}
	for _, h := range held {
		h.Release()
	}
}

func TestAcquireAvoidingDoesNotAllocate(t *testing.T) {
	r := newRing(t, Config{}, "a", "b", "c")
	avoid := []string{"b"}
	var h Handle
	allocs := testing.AllocsPerRun(100, func() {
		if _, err := r.AcquireAvoiding(&h, 42, avoid); err != nil {
			t.Fatal(err)
		}
		h.Release()
	})
	if allocs != 0 {
		t.Fatalf("%v allocs per AcquireAvoiding", allocs)
	}
}
