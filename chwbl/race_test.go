package chwbl

import (
	"errors"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
)

// TestConcurrentBoundAtomicity hammers a few hot keys from 64 goroutines. Inside the critical
// section of every Acquire, the hook installed by installBoundCheck recomputes T and W from the
// members and checks in-flight-after-increment ≤ ceil((1+ε)·(T_before+1)·w/W), exactly. Run it
// with -race. Each goroutine keeps up to four slots open so that bounds bind and keys overflow.
func TestConcurrentBoundAtomicity(t *testing.T) {
	const goroutines = 64
	ops := 20_000
	if testing.Short() {
		ops = 2_000
	}
	r := newRing(t, Config{LoadFactorEpsilon: 0.25})
	for i, name := range podNames(6) {
		if err := r.Add(name, float64(1+i%2)); err != nil {
			t.Fatal(err)
		}
	}
	checked := installBoundCheck(t, r)
	hot := []uint64{1, 2, 3}

	var overflows, total atomic.Int64
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 99))
			var hs [4]Handle
			var over int64
			for i := range ops {
				h := &hs[i%len(hs)]
				h.Release()
				key := hot[rng.IntN(len(hot))]
				if rng.IntN(8) == 0 {
					key = rng.Uint64()
				}
				reason, err := r.Acquire(h, key)
				if err != nil {
					t.Errorf("Acquire: %v", err)
					return
				}
				if reason == ReasonOverflow {
					over++
				}
			}
			for i := range hs {
				hs[i].Release()
			}
			overflows.Add(over)
			total.Add(int64(ops))
		})
	}
	wg.Wait()

	r.mu.Lock()
	n := *checked
	r.mu.Unlock()
	if int64(n) != total.Load() {
		t.Fatalf("checked %d acquisitions, made %d", n, total.Load())
	}
	if overflows.Load() == 0 {
		t.Fatal("no overflow: the bound never bound")
	}
	t.Logf("%d acquisitions checked, %d overflowed", n, overflows.Load())
	checkInvariants(t, r)
	if r.TotalInFlight() != 0 {
		t.Fatalf("TotalInFlight = %d at the end", r.TotalInFlight())
	}
	for _, l := range r.Loads(nil) {
		if l.InFlight != 0 {
			t.Fatalf("%s holds %d at the end", l.Name, l.InFlight)
		}
	}
}

// TestConcurrentMembership acquires and releases while another goroutine adds, removes and flips
// the health of backends. "s0" stays healthy throughout, so Acquire must never fail.
func TestConcurrentMembership(t *testing.T) {
	ops := 5_000
	if testing.Short() {
		ops = 500
	}
	r := newRing(t, Config{VirtualNodes: 40}, "s0", "s1", "s2")
	installBoundCheck(t, r)

	stop := make(chan struct{})
	var churn sync.WaitGroup
	churn.Go(func() {
		rng := rand.New(rand.NewPCG(1, 2))
		for {
			select {
			case <-stop:
				return
			default:
			}
			name := "c" + strconv.Itoa(rng.IntN(6))
			switch rng.IntN(5) {
			case 0, 1:
				if err := r.Add(name, float64(rng.IntN(3))); err != nil && !errors.Is(err, ErrDuplicate) {
					t.Errorf("Add: %v", err)
				}
			case 2:
				if err := r.Remove(name); err != nil && !errors.Is(err, ErrUnknownBackend) {
					t.Errorf("Remove: %v", err)
				}
			case 3:
				if err := r.SetHealthy(name, rng.IntN(2) == 0); err != nil && !errors.Is(err, ErrUnknownBackend) {
					t.Errorf("SetHealthy: %v", err)
				}
			case 4:
				_ = r.SetHealthy("s"+strconv.Itoa(1+rng.IntN(2)), rng.IntN(2) == 0)
			}
		}
	})

	var wg sync.WaitGroup
	handed := make(chan *Handle, 64) // slots released by another goroutine
	for g := range 16 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			var hs [3]Handle
			var loads []Load
			for i := range ops {
				h := &hs[i%len(hs)]
				h.Release()
				switch rng.IntN(10) {
				case 0:
					if err := r.AcquireBackend(h, "s0"); err != nil {
						t.Errorf("AcquireBackend: %v", err)
					}
				case 1:
					if _, _, err := r.Candidate(rng.Uint64()); err != nil {
						t.Errorf("Candidate: %v", err)
					}
				case 2:
					loads = r.Loads(loads[:0])
					_ = r.Bound(1)
					_, _ = r.InFlight("c1")
					_ = r.TotalInFlight()
					_, _ = r.Len(), r.Healthy()
				case 3:
					other := new(Handle)
					if _, err := r.Acquire(other, rng.Uint64()%4); err != nil {
						t.Errorf("Acquire: %v", err)
					}
					select {
					case handed <- other:
					default:
						other.Release()
					}
				default:
					if _, err := r.Acquire(h, rng.Uint64()%16); err != nil {
						t.Errorf("Acquire: %v", err)
					}
				}
			}
			for i := range hs {
				hs[i].Release()
			}
		})
	}
	var releaser sync.WaitGroup
	releaser.Go(func() {
		for h := range handed {
			h.Release()
			h.Release() // idempotent
		}
	})
	wg.Wait()
	close(handed)
	releaser.Wait()
	close(stop)
	churn.Wait()

	checkInvariants(t, r)
	if got := r.TotalInFlight(); got != 0 {
		t.Fatalf("TotalInFlight = %d at the end", got)
	}
	for _, l := range r.Loads(nil) {
		if l.InFlight != 0 {
			t.Fatalf("%s holds %d at the end", l.Name, l.InFlight)
		}
	}
}

// TestConcurrentRelease releases every handle from two goroutines at once: exactly one Release
// per handle reports true, and the counters end at zero.
func TestConcurrentRelease(t *testing.T) {
	r := newRing(t, Config{}, podNames(4)...)
	installBoundCheck(t, r)
	hs := make([]Handle, 2000)
	for i := range hs {
		if _, err := r.Acquire(&hs[i], uint64(i)); err != nil {
			t.Fatal(err)
		}
	}
	var freed atomic.Int64
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			for i := range hs {
				_ = hs[i].Backend()
				if hs[i].Release() {
					freed.Add(1)
				}
			}
		})
	}
	// Remove a backend while the releases run.
	if err := r.Remove("pod-2"); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if freed.Load() != int64(len(hs)) {
		t.Fatalf("%d releases reported true, want %d", freed.Load(), len(hs))
	}
	checkInvariants(t, r)
	if r.TotalInFlight() != 0 {
		t.Fatalf("TotalInFlight = %d", r.TotalInFlight())
	}
}
