package chwbl

import (
	"errors"
	"fmt"
	"math"
	"math/big"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"

	"github.com/zeebo/xxh3"
)

// ---- helpers ---------------------------------------------------------------------------------

func newRing(t testing.TB, cfg Config, names ...string) *Ring {
	t.Helper()
	r, err := New(cfg)
	if err != nil {
		t.Fatalf("New(%+v): %v", cfg, err)
	}
	for _, n := range names {
		if err := r.Add(n, 1); err != nil {
			t.Fatalf("Add(%q): %v", n, err)
		}
	}
	return r
}

func podNames(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = "pod-" + strconv.Itoa(i)
	}
	return out
}

func randomKeys(n int, seed uint64) []uint64 {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	keys := make([]uint64, n)
	for i := range keys {
		keys[i] = rng.Uint64()
	}
	return keys
}

// owners returns Candidate(key) for every key; the ring must be idle (no slots held) for this to
// be the pure consistent-hash owner.
func owners(t testing.TB, r *Ring, keys []uint64) []string {
	t.Helper()
	out := make([]string, len(keys))
	for i, k := range keys {
		name, reason, err := r.Candidate(k)
		if err != nil {
			t.Fatalf("Candidate(%#x): %v", k, err)
		}
		if reason != ReasonPrefixHash {
			t.Fatalf("Candidate(%#x) on an idle ring: reason %v, want prefix_hash", k, reason)
		}
		out[i] = name
	}
	return out
}

// exactBound computes ceil((1+ε)·(T+1)·w/W) in exact rational arithmetic on the float64 inputs.
func exactBound(eps float64, total int, w, sumW float64) int {
	x := new(big.Rat).SetFloat64(1 + eps)
	x.Mul(x, new(big.Rat).SetInt64(int64(total+1)))
	x.Mul(x, new(big.Rat).SetFloat64(w))
	x.Quo(x, new(big.Rat).SetFloat64(sumW))
	q, rem := new(big.Int).QuoRem(x.Num(), x.Denom(), new(big.Int))
	if rem.Sign() > 0 {
		q.Add(q, big.NewInt(1))
	}
	return int(q.Int64())
}

// withinBound reports whether inflight ≤ ceil(x), x = (1+ε)·(T+1)·w/W, i.e. x > inflight−1. It
// decides in float64 and falls back to exactBound only when x is within 1e-6 of inflight−1.
func withinBound(eps float64, total int, w, sumW float64, inflight int) bool {
	x := (1 + eps) * float64(total+1) * w / sumW
	d := x - float64(inflight-1)
	if d > 1e-6 || d < -1e-6 {
		return d > 0
	}
	return inflight <= exactBound(eps, total, w, sumW)
}

// checkLocked recomputes T, W and the healthy count from the members and compares them with the
// ring's incremental counters. Requires r.mu.
func (r *Ring) checkLocked() error {
	total, n, w := 0, 0, 0.0
	for _, m := range r.order {
		if m.inflight < 0 {
			return fmt.Errorf("%s: negative in-flight %d", m.name, m.inflight)
		}
		if m.removed {
			return fmt.Errorf("%s: removed but still listed", m.name)
		}
		if m.healthy {
			total += m.inflight
			n++
			w += m.weight
		}
	}
	if total != r.total {
		return fmt.Errorf("T = %d, members sum to %d", r.total, total)
	}
	if n != r.healthy {
		return fmt.Errorf("healthy = %d, members say %d", r.healthy, n)
	}
	if math.Abs(w-r.weight) > 1e-9*w {
		return fmt.Errorf("W = %v, members sum to %v", r.weight, w)
	}
	if s := r.snap.Load(); len(s.members) != len(r.order) {
		return fmt.Errorf("snapshot has %d members, ring %d", len(s.members), len(r.order))
	}
	return nil
}

func checkInvariants(t testing.TB, r *Ring) {
	t.Helper()
	r.mu.Lock()
	err := r.checkLocked()
	r.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
}

// installBoundCheck makes every Acquire verify, inside its critical section, that the backend's
// in-flight count after the increment is within the bound computed (exactly) from the state
// before it, and that the counters are consistent. Violations are reported with t.Errorf, which
// is safe from any goroutine. It returns a counter of checked acquisitions.
func installBoundCheck(t testing.TB, r *Ring) *int {
	checked := new(int)
	r.testAcquired = func(m *member, reason Reason) {
		*checked++ // under r.mu
		if err := r.checkLocked(); err != nil {
			t.Errorf("after acquire on %s: %v", m.name, err)
		}
		if reason == ReasonForced {
			return
		}
		if !m.healthy {
			t.Errorf("acquired unhealthy backend %s", m.name)
		}
		before := r.total - 1
		if !withinBound(r.cfg.LoadFactorEpsilon, before, m.weight, r.weight, m.inflight) {
			t.Errorf("%s: in-flight %d > bound %d (T before = %d, W = %v)", m.name, m.inflight,
				exactBound(r.cfg.LoadFactorEpsilon, before, m.weight, r.weight), before, r.weight)
		}
	}
	r.testReleased = func(m *member) {
		if m.inflight < 0 {
			t.Errorf("%s: negative in-flight %d after release", m.name, m.inflight)
		}
		if err := r.checkLocked(); err != nil {
			t.Errorf("after release on %s: %v", m.name, err)
		}
	}
	return checked
}

// ---- configuration and small types -----------------------------------------------------------

func TestConfig(t *testing.T) {
	tests := []struct {
		name string
		in   Config
		want Config
		ok   bool
	}{
		{"zero means defaults", Config{}, Config{DefaultVirtualNodes, DefaultLoadFactorEpsilon}, true},
		{"explicit", Config{VirtualNodes: 10, LoadFactorEpsilon: 0.5}, Config{10, 0.5}, true},
		{"min", Config{VirtualNodes: 1, LoadFactorEpsilon: MinLoadFactorEpsilon}, Config{1, MinLoadFactorEpsilon}, true},
		{"max", Config{VirtualNodes: MaxVirtualNodes, LoadFactorEpsilon: MaxLoadFactorEpsilon}, Config{MaxVirtualNodes, MaxLoadFactorEpsilon}, true},
		{"negative vnodes", Config{VirtualNodes: -1}, Config{}, false},
		{"too many vnodes", Config{VirtualNodes: MaxVirtualNodes + 1}, Config{}, false},
		{"epsilon too small", Config{LoadFactorEpsilon: 0.005}, Config{}, false},
		{"epsilon negative", Config{LoadFactorEpsilon: -0.25}, Config{}, false},
		{"epsilon too large", Config{LoadFactorEpsilon: 10.5}, Config{}, false},
		{"epsilon NaN", Config{LoadFactorEpsilon: math.NaN()}, Config{}, false},
		{"epsilon Inf", Config{LoadFactorEpsilon: math.Inf(1)}, Config{}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r, err := New(tc.in)
			if !tc.ok {
				if !errors.Is(err, ErrInvalidConfig) {
					t.Fatalf("New(%+v) error = %v, want ErrInvalidConfig", tc.in, err)
				}
				return
			}
			if err != nil {
				t.Fatalf("New(%+v): %v", tc.in, err)
			}
			if got := r.Config(); got != tc.want {
				t.Fatalf("Config() = %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestReasonString(t *testing.T) {
	for r, want := range map[Reason]string{
		ReasonNone: "none", ReasonPrefixHash: "prefix_hash", ReasonOverflow: "overflow",
		ReasonForced: "forced", Reason(9): "Reason(9)",
	} {
		if got := r.String(); got != want {
			t.Errorf("Reason(%d).String() = %q, want %q", r, got, want)
		}
	}
}

func TestAddValidation(t *testing.T) {
	r := newRing(t, Config{}, "a")
	tests := []struct {
		name    string
		backend string
		weight  float64
		want    error
	}{
		{"duplicate", "a", 1, ErrDuplicate},
		{"empty name", "", 1, ErrInvalidConfig},
		{"negative weight", "b", -1, ErrInvalidConfig},
		{"NaN weight", "b", math.NaN(), ErrInvalidConfig},
		{"infinite weight", "b", math.Inf(1), ErrInvalidConfig},
		{"too many vnodes", "b", MaxBackendVirtualNodes, ErrInvalidConfig},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := r.Add(tc.backend, tc.weight)
			if !errors.Is(err, tc.want) {
				t.Fatalf("Add(%q, %v) = %v, want %v", tc.backend, tc.weight, err, tc.want)
			}
			if tc.want != ErrInvalidConfig && err != tc.want {
				t.Fatalf("Add returned %v, want the bare sentinel", err)
			}
			if r.Len() != 1 {
				t.Fatalf("Len() = %d after a failed Add", r.Len())
			}
		})
	}
	t.Run("unknown backend", func(t *testing.T) {
		if err := r.Remove("zz"); err != ErrUnknownBackend {
			t.Errorf("Remove = %v", err)
		}
		if err := r.SetHealthy("zz", false); err != ErrUnknownBackend {
			t.Errorf("SetHealthy = %v", err)
		}
		var h Handle
		if err := r.AcquireBackend(&h, "zz"); err != ErrUnknownBackend || h.Held() || h.Backend() != "" {
			t.Errorf("AcquireBackend = %v, held %v, backend %q", err, h.Held(), h.Backend())
		}
		if n, ok := r.InFlight("zz"); ok || n != 0 {
			t.Errorf("InFlight = %d, %v", n, ok)
		}
	})
}

func TestVirtualNodeCounts(t *testing.T) {
	r := newRing(t, Config{VirtualNodes: 10})
	for _, c := range []struct {
		name   string
		weight float64
		want   int
	}{{"w0", 0, 10}, {"w1", 1, 10}, {"w2", 2, 20}, {"w0.25", 0.25, 3}, {"w0.01", 0.01, 1}, {"w1.04", 1.04, 10}, {"w1.05", 1.05, 11}} {
		if err := r.Add(c.name, c.weight); err != nil {
			t.Fatal(err)
		}
		s := r.snap.Load()
		got := 0
		for _, o := range s.owner {
			if s.members[o].name == c.name {
				got++
			}
		}
		if got != c.want {
			t.Errorf("%s (weight %v): %d vnodes, want %d", c.name, c.weight, got, c.want)
		}
	}
	var loads []Load
	loads = r.Loads(loads)
	if loads[0].Weight != 1 {
		t.Errorf("weight 0 reads back as %v, want 1", loads[0].Weight)
	}
}

// ---- hashing ---------------------------------------------------------------------------------

func TestVnodePositionPinned(t *testing.T) {
	tests := []struct {
		name    string
		replica uint32
		want    uint64
	}{
		{"", 0, 0xe864e5893a273242},
		{"pod-1", 0, 0xfa66479b1a4f530f},
		{"pod-1", 10, 0x5923648aea267feb},
		{"pod-11", 0, 0xd8521f55830cef44},
		{"pod-110", 0, 0x3499a4aa2830b0d3},
		{"backend-a", 149, 0x7fcf9a098031eb04},
	}
	for _, tc := range tests {
		if got := vnodePosition(tc.name, tc.replica); got != tc.want {
			t.Errorf("vnodePosition(%q, %d) = %#016x, want %#016x", tc.name, tc.replica, got, tc.want)
		}
	}
	// The encoding spelled out: uvarint length, name, big-endian replica.
	if got, want := vnodePosition("pod-1", 10), xxh3.Hash([]byte("\x05pod-1\x00\x00\x00\x0a")); got != want {
		t.Errorf("encoding changed: %#x != %#x", got, want)
	}
	long := string(make([]byte, 300)) // longer than the stack buffer, two-byte uvarint
	if got, want := vnodePosition(long, 1), xxh3.Hash(append(append([]byte{0xac, 0x02}, long...), 0, 0, 0, 1)); got != want {
		t.Errorf("long name encoding: %#x != %#x", got, want)
	}
}

func TestMix64Pinned(t *testing.T) {
	for _, tc := range []struct{ in, want uint64 }{
		{0, 0},
		{1, 0xb456bcfc34c2cb2c},
		{2, 0x3abf2a20650683e7},
		{0xdeadbeef, 0xd24bd59f862a1dac},
		{^uint64(0), 0x64b5720b4b825f21},
	} {
		if got := mix64(tc.in); got != tc.want {
			t.Errorf("mix64(%#x) = %#016x, want %#016x", tc.in, got, tc.want)
		}
	}
}

// TestVnodeKeysDoNotCollide is the pitfall from ARCHITECTURE.md: with plain concatenation,
// ("pod-1", 10) and ("pod-11", 0) are both "pod-110".
func TestVnodeKeysDoNotCollide(t *testing.T) {
	pairs := [][2]struct {
		name    string
		replica uint32
	}{
		{{"pod-1", 10}, {"pod-11", 0}},
		{{"pod-1", 11}, {"pod-11", 1}},
		{{"pod-1", 100}, {"pod-110", 0}},
		{{"pod-11", 10}, {"pod-111", 0}},
		{{"a", 10}, {"a1", 0}},
	}
	for _, p := range pairs {
		a, b := p[0], p[1]
		if a.name+strconv.Itoa(int(a.replica)) != b.name+strconv.Itoa(int(b.replica)) {
			t.Fatalf("test case %v is not a concatenation collision", p)
		}
		if vnodePosition(a.name, a.replica) == vnodePosition(b.name, b.replica) {
			t.Errorf("vnodePosition%v == vnodePosition%v", a, b)
		}
	}

	// Over a fleet of similar names, naive keys collide by the hundreds; ours never.
	const vnodes = 150
	naive := map[string]bool{}
	naiveDup := 0
	seen := map[uint64]string{}
	for _, name := range podNames(200) {
		for i := range vnodes {
			k := name + strconv.Itoa(i)
			if naive[k] {
				naiveDup++
			}
			naive[k] = true
			p := vnodePosition(name, uint32(i))
			id := name + "#" + strconv.Itoa(i)
			if prev, ok := seen[p]; ok {
				t.Errorf("vnode %s and %s collide at %#x", prev, id, p)
			}
			seen[p] = id
		}
	}
	if naiveDup == 0 {
		t.Fatal("expected naive concatenation to collide on this fleet")
	}
	t.Logf("naive concatenation: %d colliding vnode keys; length-prefixed: 0", naiveDup)
}

// TestNeighbourNamesRemove builds rings whose names are prefixes of one another, removes one, and
// routes 200k keys: no panic, and every key lands on a current member.
func TestNeighbourNamesRemove(t *testing.T) {
	names := []string{"pod-1", "pod-11", "pod-110", "pod-2", "pod-21", "pod-1 10", "pod-"}
	keys := randomKeys(200_000, 1)
	for _, victim := range []string{"pod-1", "pod-11", "pod-110"} {
		t.Run("remove="+victim, func(t *testing.T) {
			r := newRing(t, Config{}, names...)
			if err := r.Remove(victim); err != nil {
				t.Fatal(err)
			}
			checkInvariants(t, r)
			members := map[string]bool{}
			for _, l := range r.Loads(nil) {
				members[l.Name] = true
			}
			if members[victim] || len(members) != len(names)-1 {
				t.Fatalf("members after Remove: %v", members)
			}
			var h Handle
			for _, k := range keys {
				if _, err := r.Acquire(&h, k); err != nil {
					t.Fatalf("Acquire(%#x): %v", k, err)
				}
				if !members[h.Backend()] {
					t.Fatalf("key %#x routed to %q, not a member", k, h.Backend())
				}
				h.Release()
			}
			checkInvariants(t, r)
			if r.TotalInFlight() != 0 {
				t.Fatalf("TotalInFlight = %d", r.TotalInFlight())
			}
		})
	}
}

// TestPositionCollisionTieBreak forces massive 64-bit position collisions with a degenerate vnode
// hash: the ring order must be total and independent of insertion order, and routing after a
// removal must still work.
func TestPositionCollisionTieBreak(t *testing.T) {
	degenerate := func(name string, replica uint32) uint64 { return uint64(replica%4) << 62 }
	build := func(order []string) *Ring {
		r, err := New(Config{VirtualNodes: 8})
		if err != nil {
			t.Fatal(err)
		}
		r.vnodeHash = degenerate
		for _, n := range order {
			if err := r.Add(n, 1); err != nil {
				t.Fatal(err)
			}
		}
		return r
	}
	layout := func(r *Ring) []string {
		s := r.snap.Load()
		out := make([]string, len(s.pos))
		for i := range s.pos {
			v := s.at(i)
			out[i] = fmt.Sprintf("%x/%s/%d", v.pos, v.m.name, v.replica)
		}
		return out
	}
	names := []string{"pod-1", "pod-11", "pod-10", "b", "a"}
	r1 := build(names)
	r2 := build([]string{"a", "pod-10", "b", "pod-11", "pod-1"})
	l1, l2 := layout(r1), layout(r2)
	if !slices.Equal(l1, l2) {
		t.Fatalf("layout depends on insertion order:\n%v\n%v", l1, l2)
	}
	s := r1.snap.Load()
	for i := 1; i < len(s.pos); i++ {
		if cmpVnode(s.at(i-1), s.at(i)) >= 0 {
			t.Fatalf("vnodes %d and %d out of order: %s, %s", i-1, i, l1[i-1], l1[i])
		}
	}
	if s.at(0).m.name != "a" || s.at(0).replica != 0 || s.at(1).replica != 4 {
		t.Fatalf("unexpected head of ring: %v", l1[:3])
	}
	keys := randomKeys(20_000, 2)
	if o1, o2 := owners(t, r1, keys), owners(t, r2, keys); !slices.Equal(o1, o2) {
		t.Fatal("routing depends on insertion order")
	}
	for _, r := range []*Ring{r1, r2} {
		if err := r.Remove("pod-11"); err != nil {
			t.Fatal(err)
		}
		checkInvariants(t, r)
		for _, o := range owners(t, r, keys) {
			if o == "pod-11" || o == "" {
				t.Fatalf("routed to %q after removal", o)
			}
		}
	}
	if !slices.Equal(layout(r1), layout(r2)) {
		t.Fatal("layout after removal depends on insertion order")
	}
}

// TestSearch compares the bucketed search with a plain binary search, including rings with
// colliding positions, tiny rings and keys at the extremes.
func TestSearch(t *testing.T) {
	rng := rand.New(rand.NewPCG(10, 11))
	ref := func(s *snapshot, p uint64) int {
		i, _ := slices.BinarySearch(s.pos, p)
		if i == len(s.pos) {
			return 0
		}
		return i
	}
	hashes := map[string]func(string, uint32) uint64{
		"xxh3":       vnodePosition,
		"collisions": func(_ string, replica uint32) uint64 { return uint64(replica%3) << 62 },
		"low":        func(name string, replica uint32) uint64 { return vnodePosition(name, replica) >> 40 },
		"high":       func(name string, replica uint32) uint64 { return ^(vnodePosition(name, replica) >> 40) },
	}
	for hname, hash := range hashes {
		for _, cfg := range []struct{ backends, vnodes int }{{1, 1}, {1, 2}, {2, 1}, {3, 3}, {5, 7}, {16, 150}, {70, 150}} {
			t.Run(fmt.Sprintf("%s/backends=%d/vnodes=%d", hname, cfg.backends, cfg.vnodes), func(t *testing.T) {
				s := (&snapshot{}).index()
				if got := s.search(12345); got != 0 {
					t.Fatalf("empty: %d", got)
				}
				for i := range cfg.backends {
					s = s.with(&member{name: "b" + strconv.Itoa(i)}, cfg.vnodes, hash)
				}
				probes := []uint64{0, 1, math.MaxUint64, math.MaxUint64 - 1, 1 << 63}
				for _, p := range s.pos {
					probes = append(probes, p, p-1, p+1)
				}
				for range 2000 {
					probes = append(probes, rng.Uint64())
				}
				for _, p := range probes {
					if got, want := s.search(p), ref(s, p); got != want {
						t.Fatalf("search(%#x) = %d, want %d", p, got, want)
					}
				}
				// without keeps the table right too.
				s = s.without(s.members[0])
				for _, p := range probes {
					if got, want := s.search(p), ref(s, p); got != want {
						t.Fatalf("after removal: search(%#x) = %d, want %d", p, got, want)
					}
				}
			})
		}
	}
}

// ---- consistent hashing quality ----------------------------------------------------------------

func TestMinimalMovement(t *testing.T) {
	keys := randomKeys(100_000, 3)
	for _, n := range []int{10, 20} {
		t.Run(fmt.Sprintf("N=%d/remove", n), func(t *testing.T) {
			names := podNames(n)
			r := newRing(t, Config{}, names...)
			before := owners(t, r, keys)
			victim := names[n/2]
			if err := r.Remove(victim); err != nil {
				t.Fatal(err)
			}
			after := owners(t, r, keys)
			moved := 0
			for i := range keys {
				if before[i] != after[i] {
					moved++
					if before[i] != victim {
						t.Fatalf("key %#x moved %s → %s though %s was removed", keys[i], before[i], after[i], victim)
					}
				} else if before[i] == victim {
					t.Fatalf("key %#x still on removed %s", keys[i], victim)
				}
			}
			checkFraction(t, moved, len(keys), n)
		})
		t.Run(fmt.Sprintf("N=%d/add", n), func(t *testing.T) {
			r := newRing(t, Config{}, podNames(n)...)
			before := owners(t, r, keys)
			if err := r.Add("newcomer", 1); err != nil {
				t.Fatal(err)
			}
			after := owners(t, r, keys)
			moved := 0
			for i := range keys {
				if before[i] != after[i] {
					moved++
					if after[i] != "newcomer" {
						t.Fatalf("key %#x moved %s → %s, not to the new backend", keys[i], before[i], after[i])
					}
				}
			}
			checkFraction(t, moved, len(keys), n+1)
		})
	}
}

func checkFraction(t *testing.T, moved, total, n int) {
	t.Helper()
	f := float64(moved) / float64(total)
	lo, hi := 0.5/float64(n), 1.6/float64(n)
	t.Logf("moved %d/%d = %.4f (1/N = %.4f)", moved, total, f, 1/float64(n))
	if f < lo || f > hi {
		t.Fatalf("moved fraction %.4f outside [%.4f, %.4f]", f, lo, hi)
	}
}

func TestDistribution(t *testing.T) {
	const n = 16
	r := newRing(t, Config{}, podNames(n)...)
	keys := randomKeys(200_000, 4)
	counts := map[string]int{}
	for _, o := range owners(t, r, keys) {
		counts[o]++
	}
	if len(counts) != n {
		t.Fatalf("%d backends got keys, want %d", len(counts), n)
	}
	mean := float64(len(keys)) / n
	lo, hi := len(keys), 0
	for _, c := range counts {
		lo, hi = min(lo, c), max(hi, c)
	}
	t.Logf("per-backend keys: min %d, max %d, mean %.0f, max/mean %.3f", lo, hi, mean, float64(hi)/mean)
	if float64(hi)/mean > 1.35 {
		t.Fatalf("max/mean = %.3f > 1.35", float64(hi)/mean)
	}

	// Sequential small keys spread too (the key mixer).
	seq := make([]uint64, 200_000)
	for i := range seq {
		seq[i] = uint64(i)
	}
	clear(counts)
	for _, o := range owners(t, r, seq) {
		counts[o]++
	}
	hi = 0
	for _, c := range counts {
		hi = max(hi, c)
	}
	if len(counts) != n || float64(hi)/mean > 1.35 {
		t.Fatalf("sequential keys: %d backends, max/mean %.3f", len(counts), float64(hi)/mean)
	}
}

func TestWeights(t *testing.T) {
	r := newRing(t, Config{})
	for i, name := range podNames(8) {
		w := 1.0
		if i%2 == 0 {
			w = 2
		}
		if err := r.Add(name, w); err != nil {
			t.Fatal(err)
		}
	}
	keys := randomKeys(200_000, 5)
	counts := map[string]int{}
	for _, o := range owners(t, r, keys) {
		counts[o]++
	}
	var heavy, light int
	for i, name := range podNames(8) {
		if i%2 == 0 {
			heavy += counts[name]
		} else {
			light += counts[name]
		}
	}
	ratio := float64(heavy) / float64(light)
	t.Logf("weight-2 backends got %.2f× the keys of weight-1 backends", ratio)
	if ratio < 1.7 || ratio > 2.3 {
		t.Fatalf("weight-2/weight-1 key ratio %.2f, want ≈ 2", ratio)
	}

	// Bounds: W = 12; hold 23 slots so T+1 = 24: weight 1 → ceil(1.25·24/12) = 3, weight 2 → 5.
	hs := make([]Handle, 23)
	for i := range hs {
		if err := r.AcquireBackend(&hs[i], "pod-"+strconv.Itoa(i%8)); err != nil {
			t.Fatal(err)
		}
	}
	if b1, b2 := r.Bound(1), r.Bound(2); b1 != 3 || b2 != 5 {
		t.Fatalf("Bound(1) = %d, Bound(2) = %d; want 3, 5", b1, b2)
	}
	// At T+1 = 48: 1.25·48/12 = 5 and 10, exactly twice.
	more := make([]Handle, 24)
	for i := range more {
		if err := r.AcquireBackend(&more[i], "pod-"+strconv.Itoa(i%8)); err != nil {
			t.Fatal(err)
		}
	}
	if b1, b2 := r.Bound(1), r.Bound(2); b1 != 5 || b2 != 10 {
		t.Fatalf("Bound(1) = %d, Bound(2) = %d; want 5, 10", b1, b2)
	}
	for i := range hs {
		hs[i].Release()
	}
	for i := range more {
		more[i].Release()
	}
	checkInvariants(t, r)
}

// ---- the bound ---------------------------------------------------------------------------------

func TestBoundFormula(t *testing.T) {
	tests := []struct {
		eps     float64
		weights []float64
		held    int
		query   float64
		want    int
	}{
		{0.25, []float64{1, 1, 1, 1}, 0, 1, 1},       // ceil(1.25·1/4)
		{0.25, []float64{1, 1, 1, 1}, 7, 1, 3},       // ceil(1.25·8/4) = ceil(2.5)
		{0.25, []float64{1, 1, 1, 1}, 15, 1, 5},      // ceil(1.25·16/4) = 5 exactly
		{0.25, []float64{1, 1}, 3, 1, 3},             // ceil(2.5)
		{0.1, []float64{1}, 9, 1, 11},                // 1.1·10 = 11, not 12 despite float rounding
		{0.1, []float64{1, 1, 1}, 29, 1, 11},         // ceil(1.1·30/3) = 11
		{0.01, []float64{1, 1}, 199, 1, 101},         // ceil(1.01·200/2) = 101
		{10, []float64{1, 1}, 0, 1, 6},               // ceil(11·1/2)
		{0.25, []float64{1, 2, 1}, 11, 2, 8},         // ceil(1.25·12·2/4) = 7.5 → 8
		{0.25, []float64{1, 2, 1}, 11, 1, 4},         // 3.75 → 4
		{0.25, []float64{0.5, 0.5}, 3, 0.5, 3},       // 2.5 → 3
		{0.25, []float64{1, 1}, 1000, 0, 626},        // weight 0 means 1: ceil(1.25·1001/2)
		{0.3, []float64{1, 1, 1}, 99, 1, 44},         // ceil(1.3·100/3) = ceil(43.33)
		{0.2, []float64{1, 1, 1, 1, 1}, 99, 1, 24},   // 1.2·100/5 = 24 exactly
		{0.7, []float64{1, 1, 1, 1, 1}, 999, 1, 340}, // 1.7·1000/5 = 340 exactly
	}
	for _, tc := range tests {
		name := fmt.Sprintf("eps=%v/weights=%v/T=%d/w=%v", tc.eps, tc.weights, tc.held, tc.query)
		t.Run(name, func(t *testing.T) {
			r := newRing(t, Config{LoadFactorEpsilon: tc.eps})
			for i, w := range tc.weights {
				if err := r.Add("b"+strconv.Itoa(i), w); err != nil {
					t.Fatal(err)
				}
			}
			hs := make([]Handle, tc.held)
			for i := range hs {
				if err := r.AcquireBackend(&hs[i], "b0"); err != nil {
					t.Fatal(err)
				}
			}
			if got := r.TotalInFlight(); got != tc.held {
				t.Fatalf("TotalInFlight = %d, want %d", got, tc.held)
			}
			if got := r.Bound(tc.query); got != tc.want {
				t.Fatalf("Bound(%v) = %d, want %d", tc.query, got, tc.want)
			}
			// The exact rational value differs only where float64(ε) is not the decimal ε.
			sumW := 0.0
			for _, w := range tc.weights {
				sumW += w
			}
			q := tc.query
			if q == 0 {
				q = 1
			}
			if ex := exactBound(tc.eps, tc.held, q, sumW); ex != tc.want && ex != tc.want+1 {
				t.Fatalf("exact bound %d vs %d", ex, tc.want)
			}
		})
	}
	t.Run("no healthy backend", func(t *testing.T) {
		r := newRing(t, Config{}, "a")
		if err := r.SetHealthy("a", false); err != nil {
			t.Fatal(err)
		}
		if b := r.Bound(1); b != 0 {
			t.Fatalf("Bound = %d, want 0", b)
		}
		if b := newRing(t, Config{}).Bound(1); b != 0 {
			t.Fatalf("empty ring Bound = %d, want 0", b)
		}
	})
	t.Run("invalid weight", func(t *testing.T) {
		r := newRing(t, Config{}, "a")
		if b := r.Bound(-1); b != 0 {
			t.Fatalf("Bound(-1) = %d", b)
		}
		if b := r.Bound(math.NaN()); b != 0 {
			t.Fatalf("Bound(NaN) = %d", b)
		}
	})
}

// TestBoundEnforced drives one hot key through every fill level on a few backends and checks,
// in the critical section of every Acquire, that in-flight ≤ the bound of the state before it.
func TestBoundEnforced(t *testing.T) {
	for _, eps := range []float64{0.01, 0.1, 0.25, 1, 10} {
		t.Run(fmt.Sprintf("eps=%v", eps), func(t *testing.T) {
			r := newRing(t, Config{LoadFactorEpsilon: eps})
			for i, name := range podNames(5) {
				if err := r.Add(name, float64(1+i%2)); err != nil {
					t.Fatal(err)
				}
			}
			checked := installBoundCheck(t, r)
			const hot = 0xfeed
			owner, _, _ := r.Candidate(hot)
			hs := make([]Handle, 400)
			var overflows int
			for i := range hs {
				reason, err := r.Acquire(&hs[i], hot)
				if err != nil {
					t.Fatal(err)
				}
				switch {
				case hs[i].Backend() == owner && reason != ReasonPrefixHash:
					t.Fatalf("owner %s took acquisition %d with reason %v", owner, i, reason)
				case hs[i].Backend() != owner && reason != ReasonOverflow:
					t.Fatalf("%s (not owner %s) took acquisition %d with reason %v", hs[i].Backend(), owner, i, reason)
				}
				if reason == ReasonOverflow {
					overflows++
				}
			}
			// W = 7 and w ≤ 2: with ε ≤ 1 the owner's share (1+ε)·w/W < 1, so it must overflow; with
			// ε = 10 its bound always exceeds T+1 and it never does.
			if (eps <= 1) != (overflows > 0) {
				t.Fatalf("eps %v: %d overflows", eps, overflows)
			}
			// Fill levels are balanced to within the bound at the end.
			for _, l := range r.Loads(nil) {
				if b := exactBound(eps, r.TotalInFlight()-1, l.Weight, 7); l.InFlight > b {
					t.Errorf("%s holds %d > %d", l.Name, l.InFlight, b)
				}
			}
			for i := range hs {
				hs[i].Release()
			}
			if *checked != len(hs) {
				t.Fatalf("checked %d acquisitions, want %d", *checked, len(hs))
			}
			if r.TotalInFlight() != 0 {
				t.Fatal("slots left")
			}
		})
	}
}

// ---- the overflow walk -------------------------------------------------------------------------

// distinctClockwise lists the members in the order a walk from key first meets them.
func distinctClockwise(r *Ring, key uint64) []string {
	s := r.snap.Load()
	start := s.search(mix64(key))
	var out []string
	for j := range s.pos {
		name := s.members[s.owner[(start+j)%len(s.pos)]].name
		if !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	return out
}

func TestOverflowWalk(t *testing.T) {
	// ε = 0.1 so that five equally loaded backends can all be over the bound.
	r := newRing(t, Config{VirtualNodes: 50, LoadFactorEpsilon: 0.1}, podNames(6)...)
	var visits []string
	r.testVisit = func(m *member) { visits = append(visits, m.name) }
	const key = 42
	order := distinctClockwise(r, key)
	if len(order) != 6 {
		t.Fatalf("clockwise order %v", order)
	}

	t.Run("idle: owner takes it", func(t *testing.T) {
		visits = visits[:0]
		var h Handle
		reason, err := r.Acquire(&h, key)
		if err != nil || reason != ReasonPrefixHash || h.Backend() != order[0] {
			t.Fatalf("Acquire = %v, %v, %q; want prefix_hash on %s", reason, err, h.Backend(), order[0])
		}
		if !slices.Equal(visits, order[:1]) {
			t.Fatalf("visits %v, want %v", visits, order[:1])
		}
		h.Release()
	})

	t.Run("first three full: fourth takes it", func(t *testing.T) {
		// Hold 8 on each of the first three: T = 24, bound = ceil(1.1·25/6) = 5 < 9.
		var held []*Handle
		for _, name := range order[:3] {
			for range 8 {
				h := new(Handle)
				if err := r.AcquireBackend(h, name); err != nil {
					t.Fatal(err)
				}
				held = append(held, h)
			}
		}
		visits = visits[:0]
		var h Handle
		reason, err := r.Acquire(&h, key)
		if err != nil || reason != ReasonOverflow || h.Backend() != order[3] {
			t.Fatalf("Acquire = %v, %v, %q; want overflow on %s", reason, err, h.Backend(), order[3])
		}
		if !slices.Equal(visits, order[:4]) {
			t.Fatalf("visits %v, want %v (each backend once, in clockwise order)", visits, order[:4])
		}
		name, reason, err := r.Candidate(key)
		if err != nil || reason != ReasonOverflow || name != order[3] {
			t.Fatalf("Candidate = %q, %v, %v", name, reason, err)
		}
		h.Release()

		t.Run("unhealthy owner skipped: still prefix_hash", func(t *testing.T) {
			for _, name := range order[:3] {
				if err := r.SetHealthy(name, false); err != nil {
					t.Fatal(err)
				}
			}
			visits = visits[:0]
			reason, err := r.Acquire(&h, key)
			if err != nil || reason != ReasonPrefixHash || h.Backend() != order[3] {
				t.Fatalf("Acquire = %v, %v, %q; want prefix_hash on %s", reason, err, h.Backend(), order[3])
			}
			if !slices.Equal(visits, order[:4]) {
				t.Fatalf("visits %v, want %v", visits, order[:4])
			}
			h.Release()
			for _, name := range order[:3] {
				if err := r.SetHealthy(name, true); err != nil {
					t.Fatal(err)
				}
			}
		})
		for _, h := range held {
			h.Release()
		}
	})

	t.Run("every backend visited at most once per walk", func(t *testing.T) {
		// Load everything heavily except the last backend in clockwise order, so the walk must go
		// all the way round; the walk must still meet each backend exactly once.
		// T = 150, bound = ceil(1.1·151/6) = 28 < 31.
		var held []*Handle
		for _, name := range order[:5] {
			for range 30 {
				h := new(Handle)
				if err := r.AcquireBackend(h, name); err != nil {
					t.Fatal(err)
				}
				held = append(held, h)
			}
		}
		visits = visits[:0]
		var h Handle
		reason, err := r.Acquire(&h, key)
		if err != nil || reason != ReasonOverflow || h.Backend() != order[5] {
			t.Fatalf("Acquire = %v, %v, %q; want overflow on %s", reason, err, h.Backend(), order[5])
		}
		if !slices.Equal(visits, order) {
			t.Fatalf("visits %v, want %v", visits, order)
		}
		h.Release()
		for _, h := range held {
			h.Release()
		}
	})
	checkInvariants(t, r)
}

func TestEpochWrap(t *testing.T) {
	r := newRing(t, Config{VirtualNodes: 20}, podNames(4)...)
	order := distinctClockwise(r, 7)
	var held []*Handle
	for range 10 {
		h := new(Handle)
		if err := r.AcquireBackend(h, order[0]); err != nil {
			t.Fatal(err)
		}
		held = append(held, h)
	}
	var visits []string
	r.testVisit = func(m *member) { visits = append(visits, m.name) }
	r.epoch = math.MaxUint32 - 2
	for i := range 6 { // crosses the wrap
		visits = visits[:0]
		var h Handle
		reason, err := r.Acquire(&h, 7)
		if err != nil || reason != ReasonOverflow || h.Backend() != order[1] {
			t.Fatalf("round %d (epoch %d): %v, %v, %q", i, r.epoch, reason, err, h.Backend())
		}
		if !slices.Equal(visits, order[:2]) {
			t.Fatalf("round %d: visits %v, want %v", i, visits, order[:2])
		}
		h.Release()
	}
	if r.epoch == 0 || r.epoch > 10 {
		t.Fatalf("epoch %d did not wrap", r.epoch)
	}
	for _, h := range held {
		h.Release()
	}
}

func TestNoHealthyBackend(t *testing.T) {
	r := newRing(t, Config{})
	var h Handle
	if reason, err := r.Acquire(&h, 1); !errors.Is(err, ErrNoBackend) || reason != ReasonNone || h.Held() {
		t.Fatalf("empty ring: %v, %v", reason, err)
	}
	for _, n := range podNames(3) {
		if err := r.Add(n, 1); err != nil {
			t.Fatal(err)
		}
		if err := r.SetHealthy(n, false); err != nil {
			t.Fatal(err)
		}
	}
	if r.Healthy() != 0 || r.Len() != 3 {
		t.Fatalf("Healthy %d, Len %d", r.Healthy(), r.Len())
	}
	if reason, err := r.Acquire(&h, 1); !errors.Is(err, ErrNoBackend) || reason != ReasonNone || h.Held() || h.Backend() != "" {
		t.Fatalf("all unhealthy: %v, %v, %q", reason, err, h.Backend())
	}
	if name, reason, err := r.Candidate(1); !errors.Is(err, ErrNoBackend) || reason != ReasonNone || name != "" {
		t.Fatalf("Candidate: %q, %v, %v", name, reason, err)
	}
	if err := r.SetHealthy("pod-2", true); err != nil {
		t.Fatal(err)
	}
	for k := range uint64(100) {
		if _, err := r.Acquire(&h, k); err != nil || h.Backend() != "pod-2" {
			t.Fatalf("only pod-2 healthy: %v, %q", err, h.Backend())
		}
	}
	h.Release()
}

// TestAlwaysFindsBackend checks the proof in pick: with random weights, ε and health, Acquire
// keeps succeeding as slots pile up without release.
func TestAlwaysFindsBackend(t *testing.T) {
	rng := rand.New(rand.NewPCG(6, 7))
	for trial := range 30 {
		eps := []float64{0.01, 0.05, 0.25, 2}[trial%4]
		r := newRing(t, Config{VirtualNodes: 1 + rng.IntN(40), LoadFactorEpsilon: eps})
		installBoundCheck(t, r)
		n := 1 + rng.IntN(8)
		for i := range n {
			if err := r.Add("b"+strconv.Itoa(i), 0.1+rng.Float64()*3); err != nil {
				t.Fatal(err)
			}
		}
		for i := range n - 1 {
			if rng.IntN(3) == 0 {
				_ = r.SetHealthy("b"+strconv.Itoa(i), false)
			}
		}
		hs := make([]Handle, 2000)
		for i := range hs {
			if _, err := r.Acquire(&hs[i], uint64(rng.IntN(3))); err != nil {
				t.Fatalf("trial %d: acquisition %d failed: %v", trial, i, err)
			}
		}
		for i := range hs {
			hs[i].Release()
		}
		checkInvariants(t, r)
	}
}

// ---- accounting: health, removal, handles ------------------------------------------------------

func TestHealthFlipKeepsT(t *testing.T) {
	r := newRing(t, Config{}, "a", "b", "c")
	installBoundCheck(t, r)
	take := func(name string, n int) []*Handle {
		var out []*Handle
		for range n {
			h := new(Handle)
			if err := r.AcquireBackend(h, name); err != nil {
				t.Fatal(err)
			}
			out = append(out, h)
		}
		return out
	}
	ha, hb := take("a", 4), take("b", 3)
	if r.TotalInFlight() != 7 {
		t.Fatalf("T = %d", r.TotalInFlight())
	}
	if err := r.SetHealthy("a", false); err != nil {
		t.Fatal(err)
	}
	if err := r.SetHealthy("a", false); err != nil { // no-op
		t.Fatal(err)
	}
	if r.TotalInFlight() != 3 || r.Healthy() != 2 {
		t.Fatalf("after a unhealthy: T = %d, healthy = %d", r.TotalInFlight(), r.Healthy())
	}
	ha = append(ha, take("a", 1)...) // forced onto an unhealthy backend: not in T
	if n, _ := r.InFlight("a"); n != 5 || r.TotalInFlight() != 3 {
		t.Fatalf("a holds %d, T = %d", n, r.TotalInFlight())
	}
	ha[0].Release()
	ha[1].Release()
	if r.TotalInFlight() != 3 {
		t.Fatalf("T = %d after releasing on the unhealthy backend", r.TotalInFlight())
	}
	if err := r.SetHealthy("a", true); err != nil {
		t.Fatal(err)
	}
	if r.TotalInFlight() != 6 {
		t.Fatalf("T = %d after a healthy again, want 3+3", r.TotalInFlight())
	}
	for _, h := range append(ha, hb...) {
		h.Release()
	}
	checkInvariants(t, r)
	if r.TotalInFlight() != 0 {
		t.Fatalf("T = %d", r.TotalInFlight())
	}
}

func TestRemoveWithInFlight(t *testing.T) {
	for _, unhealthyFirst := range []bool{false, true} {
		t.Run(fmt.Sprintf("unhealthy_first=%v", unhealthyFirst), func(t *testing.T) {
			r := newRing(t, Config{}, "a", "b", "victim")
			installBoundCheck(t, r)
			var victim, others []*Handle
			for range 10 {
				h := new(Handle)
				if err := r.AcquireBackend(h, "victim"); err != nil {
					t.Fatal(err)
				}
				victim = append(victim, h)
			}
			for _, name := range []string{"a", "a", "b"} {
				h := new(Handle)
				if err := r.AcquireBackend(h, name); err != nil {
					t.Fatal(err)
				}
				others = append(others, h)
			}
			if unhealthyFirst {
				if err := r.SetHealthy("victim", false); err != nil {
					t.Fatal(err)
				}
			}
			if err := r.Remove("victim"); err != nil {
				t.Fatal(err)
			}
			if got := r.TotalInFlight(); got != 3 {
				t.Fatalf("T = %d after Remove, want 3 (what a and b hold)", got)
			}
			if _, ok := r.InFlight("victim"); ok {
				t.Fatal("victim still reported")
			}
			// Re-adding the name gives a fresh backend that old handles must not touch.
			if err := r.Add("victim", 1); err != nil {
				t.Fatal(err)
			}
			for i, h := range victim {
				if h.Backend() != "victim" || !h.Held() {
					t.Fatalf("handle %d: %q held=%v", i, h.Backend(), h.Held())
				}
				if !h.Release() {
					t.Fatalf("handle %d: Release false", i)
				}
				if h.Release() {
					t.Fatalf("handle %d: second Release true", i)
				}
			}
			if got := r.TotalInFlight(); got != 3 {
				t.Fatalf("T = %d after releasing the removed backend's slots, want 3", got)
			}
			if n, ok := r.InFlight("victim"); !ok || n != 0 {
				t.Fatalf("re-added victim holds %d, %v", n, ok)
			}
			for _, l := range r.Loads(nil) {
				if l.InFlight < 0 {
					t.Fatalf("%s: negative in-flight", l.Name)
				}
			}
			for _, h := range others {
				h.Release()
			}
			checkInvariants(t, r)
			if r.TotalInFlight() != 0 {
				t.Fatalf("T = %d", r.TotalInFlight())
			}
		})
	}
}

func TestHandle(t *testing.T) {
	r := newRing(t, Config{}, "a", "b")
	t.Run("zero", func(t *testing.T) {
		var h Handle
		if h.Release() || h.Held() || h.Backend() != "" {
			t.Fatal("zero Handle not empty")
		}
		var nilH *Handle
		if nilH.Release() || nilH.Held() {
			t.Fatal("nil Handle")
		}
	})
	t.Run("double release", func(t *testing.T) {
		var h Handle
		if _, err := r.Acquire(&h, 5); err != nil {
			t.Fatal(err)
		}
		name := h.Backend()
		if !h.Held() || name == "" {
			t.Fatal("not held")
		}
		if !h.Release() {
			t.Fatal("first Release false")
		}
		for range 3 {
			if h.Release() {
				t.Fatal("later Release true")
			}
		}
		if h.Held() || h.Backend() != name {
			t.Fatalf("after Release: held %v, backend %q", h.Held(), h.Backend())
		}
		if r.TotalInFlight() != 0 {
			t.Fatalf("T = %d", r.TotalInFlight())
		}
	})
	t.Run("reuse", func(t *testing.T) {
		var h Handle
		for i := range uint64(100) {
			if _, err := r.Acquire(&h, i); err != nil {
				t.Fatal(err)
			}
			if r.TotalInFlight() != 1 {
				t.Fatalf("T = %d", r.TotalInFlight())
			}
			if i%2 == 0 {
				h.Release() // odd rounds re-acquire a held handle: the old slot is freed first
			}
		}
		h.Release()
		if err := r.AcquireBackend(&h, "b"); err != nil || h.Backend() != "b" {
			t.Fatal(err)
		}
		if err := r.AcquireBackend(&h, "zz"); err == nil || h.Held() || h.Backend() != "" {
			t.Fatal("failed AcquireBackend left the handle filled")
		}
		if r.TotalInFlight() != 0 {
			t.Fatalf("T = %d", r.TotalInFlight())
		}
	})
	t.Run("across rings", func(t *testing.T) {
		r2 := newRing(t, Config{}, "x")
		var h Handle
		if err := r.AcquireBackend(&h, "a"); err != nil {
			t.Fatal(err)
		}
		if _, err := r2.Acquire(&h, 1); err != nil || h.Backend() != "x" {
			t.Fatal(err)
		}
		if r.TotalInFlight() != 0 || r2.TotalInFlight() != 1 {
			t.Fatalf("T = %d, %d", r.TotalInFlight(), r2.TotalInFlight())
		}
		h.Release()
	})
}

func TestAcquireBackendIgnoresBound(t *testing.T) {
	r := newRing(t, Config{}, "a", "b")
	hs := make([]Handle, 50)
	for i := range hs {
		if err := r.AcquireBackend(&hs[i], "a"); err != nil {
			t.Fatal(err)
		}
	}
	if n, _ := r.InFlight("a"); n != 50 || n <= r.Bound(1) {
		t.Fatalf("a holds %d, bound %d", n, r.Bound(1))
	}
	for i := range hs {
		hs[i].Release()
	}
}

func TestLoads(t *testing.T) {
	r := newRing(t, Config{}, "z", "a", "m")
	if err := r.Add("w2", 2); err != nil {
		t.Fatal(err)
	}
	var h1, h2 Handle
	_ = r.AcquireBackend(&h1, "a")
	_ = r.AcquireBackend(&h2, "a")
	_ = r.SetHealthy("m", false)
	if err := r.Remove("z"); err != nil {
		t.Fatal(err)
	}
	want := []Load{{Name: "a", Weight: 1, InFlight: 2, Healthy: true}, {Name: "m", Weight: 1}, {Name: "w2", Weight: 2, Healthy: true}}
	dst := make([]Load, 0, 8)
	got := r.Loads(dst)
	if !slices.Equal(got, want) {
		t.Fatalf("Loads = %+v, want %+v", got, want)
	}
	prefix := []Load{{Name: "keep"}}
	if got := r.Loads(prefix); len(got) != 4 || got[0].Name != "keep" {
		t.Fatalf("Loads did not append: %+v", got)
	}
	if a := testing.AllocsPerRun(100, func() { dst = r.Loads(dst[:0]) }); a != 0 {
		t.Fatalf("Loads allocates %v with capacity", a)
	}
	h1.Release()
	h2.Release()
}

func TestZeroAllocs(t *testing.T) {
	r := newRing(t, Config{}, podNames(64)...)
	keys := randomKeys(1024, 8)
	var h Handle
	i := 0
	tests := []struct {
		name string
		fn   func()
	}{
		{"Acquire+Release", func() {
			_, _ = r.Acquire(&h, keys[i%len(keys)])
			h.Release()
			i++
		}},
		{"Candidate", func() {
			_, _, _ = r.Candidate(keys[i%len(keys)])
			i++
		}},
		{"AcquireBackend+Release", func() {
			_ = r.AcquireBackend(&h, "pod-7")
			h.Release()
		}},
		{"InFlight", func() { _, _ = r.InFlight("pod-3") }},
		{"Bound", func() { _ = r.Bound(1) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if a := testing.AllocsPerRun(1000, tc.fn); a != 0 {
				t.Fatalf("%v allocs per run", a)
			}
		})
	}
}

// FuzzRingOps interprets the input as a sequence of ring operations and checks the accounting
// invariants and the bound after each.
func FuzzRingOps(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11})
	f.Add([]byte{0, 0, 0, 3, 3, 3, 3, 3, 3, 2, 1, 5, 5, 5, 4, 4})
	f.Add([]byte{0, 3, 3, 3, 6, 3, 3, 7, 4, 4, 4, 4, 1, 0, 0, 3})
	f.Fuzz(func(t *testing.T, ops []byte) {
		r := newRing(t, Config{VirtualNodes: 7})
		installBoundCheck(t, r)
		var hs [16]Handle
		for i := 0; i+1 < len(ops); i += 2 {
			op, arg := ops[i]%8, ops[i+1]
			name := "b" + strconv.Itoa(int(arg%6))
			h := &hs[int(arg)%len(hs)]
			switch op {
			case 0:
				_ = r.Add(name, float64(arg%3))
			case 1:
				_ = r.Remove(name)
			case 2:
				_ = r.SetHealthy(name, arg%2 == 0)
			case 3, 6:
				_, err := r.Acquire(h, uint64(arg%5))
				if err != nil && r.Healthy() != 0 {
					t.Fatalf("Acquire failed with %d healthy: %v", r.Healthy(), err)
				}
			case 4:
				h.Release()
			case 5:
				_ = r.AcquireBackend(h, name)
			case 7:
				_, _, _ = r.Candidate(uint64(arg))
			}
			checkInvariants(t, r)
		}
		for i := range hs {
			hs[i].Release()
		}
		checkInvariants(t, r)
		for _, l := range r.Loads(nil) {
			if l.InFlight != 0 {
				t.Fatalf("%s holds %d after releasing everything", l.Name, l.InFlight)
			}
		}
	})
}

func TestSetExternalLoadCountsInBoundAndTotal(t *testing.T) {
	r, err := New(Config{LoadFactorEpsilon: 0.25})
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"a", "b"} {
		if err := r.Add(n, 1); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.SetExternalLoad("a", 6); err != nil {
		t.Fatal(err)
	}
	if got := r.TotalInFlight(); got != 6 {
		t.Fatalf("T = %d, want 6", got)
	}
	// bound = ceil(1.25·7/2) = 5: a, at 6, is over it; b is under.
	var h Handle
	if ok, _ := r.TryAcquireBackend(&h, "a"); ok {
		t.Fatal("a took a slot beyond its bound counting its external load")
	}
	if ok, _ := r.TryAcquireBackend(&h, "b"); !ok {
		t.Fatal("b refused")
	}
	h.Release()
	// Every key goes to b while a's external load keeps it over its bound.
	for k := range uint64(50) {
		name, _, err := r.Candidate(k)
		if err != nil || name != "b" {
			t.Fatalf("key %d: %q %v, want b", k, name, err)
		}
	}
	loads := r.Loads(nil)
	if loads[0].External != 6 || loads[0].InFlight != 0 {
		t.Fatalf("loads %+v", loads)
	}
	// Unhealthy: its external load leaves T; healthy again: it returns.
	if err := r.SetHealthy("a", false); err != nil {
		t.Fatal(err)
	}
	if got := r.TotalInFlight(); got != 0 {
		t.Fatalf("T with a unhealthy = %d, want 0", got)
	}
	if err := r.SetHealthy("a", true); err != nil {
		t.Fatal(err)
	}
	if err := r.SetExternalLoad("a", -3); err != nil { // negative reads as 0
		t.Fatal(err)
	}
	if got := r.TotalInFlight(); got != 0 {
		t.Fatalf("T after clearing = %d, want 0", got)
	}
	if err := r.Remove("a"); err != nil {
		t.Fatal(err)
	}
	if err := r.SetExternalLoad("a", 1); err != ErrUnknownBackend {
		t.Fatalf("unknown backend: %v", err)
	}
}
