package chwbl

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
)

const (
	// DefaultVirtualNodes is the number of virtual nodes a backend of weight 1 gets when
	// Config.VirtualNodes is 0.
	DefaultVirtualNodes = 150
	// DefaultLoadFactorEpsilon is the load-bound slack used when Config.LoadFactorEpsilon is 0: a
	// backend may hold at most about 25% more than its weighted share of the in-flight requests.
	DefaultLoadFactorEpsilon = 0.25

	// MaxVirtualNodes is the largest accepted Config.VirtualNodes.
	MaxVirtualNodes = 10000
	// MinLoadFactorEpsilon and MaxLoadFactorEpsilon delimit the accepted range of
	// Config.LoadFactorEpsilon (0 means DefaultLoadFactorEpsilon).
	MinLoadFactorEpsilon = 0.01
	MaxLoadFactorEpsilon = 10.0
	// MaxBackendVirtualNodes caps round(VirtualNodes·weight): Add rejects a weight that would give a
	// backend more virtual nodes than this.
	MaxBackendVirtualNodes = 1 << 20
)

// ErrNoBackend, ErrUnknownBackend and ErrDuplicate are returned unwrapped (compare with == or
// errors.Is); ErrInvalidConfig is wrapped with the offending value (use errors.Is).
var (
	// ErrNoBackend is returned by Acquire and Candidate when the ring has no healthy backend, and
	// by AcquireAvoiding when it has none outside the avoided ones.
	ErrNoBackend = errors.New("chwbl: no healthy backend")
	// ErrUnknownBackend is returned when a named backend is not a member of the ring.
	ErrUnknownBackend = errors.New("chwbl: unknown backend")
	// ErrDuplicate is returned by Add when the name is already a member.
	ErrDuplicate = errors.New("chwbl: backend already present")
	// ErrInvalidConfig is returned (wrapped, with details) by New for an out-of-range Config and by Add
	// for an empty name or an invalid weight.
	ErrInvalidConfig = errors.New("chwbl: invalid config")
)

// Config configures a Ring. Its zero value means the documented defaults.
type Config struct {
	// VirtualNodes is the number of points a backend of weight 1 gets on the ring; a backend of
	// weight w gets round(VirtualNodes·w), at least 1. 0 means DefaultVirtualNodes; otherwise it must
	// be in [1, MaxVirtualNodes].
	VirtualNodes int
	// LoadFactorEpsilon is the bound's slack ε: a backend of weight w may hold at most
	// ceil((1+ε)·(T+1)·w/W) requests (see the package documentation). 0 means DefaultLoadFactorEpsilon;
	// otherwise it must be in [MinLoadFactorEpsilon, MaxLoadFactorEpsilon].
	LoadFactorEpsilon float64
}

func (c Config) withDefaults() (Config, error) {
	if c.VirtualNodes == 0 {
		c.VirtualNodes = DefaultVirtualNodes
	}
	if c.LoadFactorEpsilon == 0 {
		c.LoadFactorEpsilon = DefaultLoadFactorEpsilon
	}
	if c.VirtualNodes < 1 || c.VirtualNodes > MaxVirtualNodes {
		return c, fmt.Errorf("%w: VirtualNodes %d not in [1, %d]", ErrInvalidConfig, c.VirtualNodes, MaxVirtualNodes)
	}
	// The negated form also rejects NaN.
	if !(c.LoadFactorEpsilon >= MinLoadFactorEpsilon && c.LoadFactorEpsilon <= MaxLoadFactorEpsilon) {
		return c, fmt.Errorf("%w: LoadFactorEpsilon %v not in [%v, %v]", ErrInvalidConfig, c.LoadFactorEpsilon, MinLoadFactorEpsilon, MaxLoadFactorEpsilon)
	}
	return c, nil
}

// Reason says why Acquire or Candidate chose a backend.
type Reason uint8

const (
	// ReasonNone accompanies an error: nothing was chosen.
	ReasonNone Reason = iota
	// ReasonPrefixHash: the first healthy backend clockwise from the key took the request.
	ReasonPrefixHash
	// ReasonOverflow: the first healthy backend was at its bound; a later one on the walk took it.
	ReasonOverflow
	// ReasonForced: another policy chose the backend (AcquireBackend). The ring never returns it
	// itself; it exists so that callers label such decisions with the same type.
	ReasonForced
)

// String returns the routing-decision label: "none", "prefix_hash", "overflow" or "forced".
func (r Reason) String() string {
	switch r {
	case ReasonNone:
		return "none"
	case ReasonPrefixHash:
		return "prefix_hash"
	case ReasonOverflow:
		return "overflow"
	case ReasonForced:
		return "forced"
	}
	return "Reason(" + strconv.Itoa(int(r)) + ")"
}

// Load is a snapshot of one member's state, as returned by Ring.Loads.
type Load struct {
	Name     string
	Weight   float64 // effective weight (an Add weight of 0 reads as 1)
	InFlight int     // slots held, including those taken with AcquireBackend
	// External is the load set with SetExternalLoad: requests other routers sent there.
	External int
	Healthy  bool
}

// member is one backend. name, weight and ring are immutable; every other field is guarded by
// ring.mu.
type member struct {
	ring   *Ring
	name   string
	weight float64

	inflight int
	external int    // SetExternalLoad's: load the bound counts that no handle of this ring holds
	visit    uint32 // == ring.epoch when the current walk has already considered this member
	healthy  bool
	removed  bool // Remove ran: this member's slots no longer count in ring.total
}

// counted reports whether m's in-flight requests are part of T. Requires ring.mu.
func (m *member) counted() bool { return m.healthy && !m.removed }

// Ring is a consistent-hash ring with bounded loads. Create it with New; the zero Ring is not usable
// (it has no configuration). A Ring is safe for concurrent use by any number of goroutines: routing
// (Acquire, Candidate, AcquireBackend) and releases serialise on one short critical section;
// membership changes (Add, Remove) build the new vnode array outside that section and swap it in.
type Ring struct {
	cfg  Config
	eps1 float64 // 1+ε

	// addMu serialises Add and Remove, so that each builds on the current snapshot.
	addMu sync.Mutex

	// snap is the current immutable vnode array. It is replaced only with mu held, so a snapshot
	// loaded under mu is consistent with members, byName and the counters below.
	snap atomic.Pointer[snapshot]

	mu      sync.Mutex
	byName  map[string]*member
	order   []*member // members in the order they were added
	healthy int       // healthy members
	weight  float64   // W: sum of the weights of healthy members
	total   int       // T: sum of inflight over healthy members
	epoch   uint32    // walk counter for member.visit

	// vnodeHash places virtual nodes; tests replace it to force position collisions.
	vnodeHash func(name string, replica uint32) uint64
	// Test hooks, called with mu held; nil outside tests.
	testAcquired func(m *member, r Reason)
	testReleased func(m *member)
	testVisit    func(m *member)
}

// New returns an empty Ring configured by cfg (zero fields take their defaults). The error wraps
// ErrInvalidConfig when a field is out of range.
func New(cfg Config) (*Ring, error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	r := &Ring{
		cfg:       c,
		eps1:      1 + c.LoadFactorEpsilon,
		byName:    make(map[string]*member),
		epoch:     1,
		vnodeHash: vnodePosition,
	}
	r.snap.Store((&snapshot{}).index())
	return r, nil
}

// Config returns the ring's configuration with the defaults filled in. Safe for concurrent use.
func (r *Ring) Config() Config { return r.cfg }

// Add makes name a healthy member with the given weight (0 means 1). The weight scales both the
// backend's virtual-node count, round(VirtualNodes·weight) but at least 1, and its share w/W of the
// load bound. Safe for concurrent use; requests in flight are unaffected, and only the keys that
// the new backend's virtual nodes now own move to it.
//
// Errors: ErrDuplicate when name is already a member; an error wrapping ErrInvalidConfig when name
// is empty or weight is negative, NaN, infinite or so large that the backend would get more than
// MaxBackendVirtualNodes virtual nodes.
func (r *Ring) Add(name string, weight float64) error {
	if name == "" {
		return fmt.Errorf("%w: empty backend name", ErrInvalidConfig)
	}
	if weight == 0 {
		weight = 1
	}
	if !(weight > 0) || math.IsInf(weight, 0) {
		return fmt.Errorf("%w: backend %q weight %v", ErrInvalidConfig, name, weight)
	}
	nv := math.Round(float64(r.cfg.VirtualNodes) * weight)
	if nv > MaxBackendVirtualNodes {
		return fmt.Errorf("%w: backend %q weight %v gives %v virtual nodes, more than %d",
			ErrInvalidConfig, name, weight, nv, MaxBackendVirtualNodes)
	}
	if nv < 1 {
		nv = 1
	}

	r.addMu.Lock()
	defer r.addMu.Unlock()
	// byName is written only with addMu (and mu) held, so reading it under addMu is safe.
	if _, ok := r.byName[name]; ok {
		return ErrDuplicate
	}
	m := &member{ring: r, name: name, weight: weight, healthy: true}
	next := r.snap.Load().with(m, int(nv), r.vnodeHash)

	r.mu.Lock()
	r.byName[name] = m
	r.order = append(r.order, m)
	r.snap.Store(next)
	r.recount()
	r.mu.Unlock()
	return nil
}

// Remove deletes name from the ring. Safe for concurrent use, including with requests in flight on
// name: their handles stay valid, and releasing them later decrements only the removed backend's
// own counter (its in-flight requests stop counting in T at Remove, exactly once). Only the keys
// name owned move. The error is ErrUnknownBackend when name is not a member.
func (r *Ring) Remove(name string) error {
	r.addMu.Lock()
	defer r.addMu.Unlock()
	m, ok := r.byName[name]
	if !ok {
		return ErrUnknownBackend
	}
	next := r.snap.Load().without(m)

	r.mu.Lock()
	if m.counted() {
		r.total -= m.inflight + m.external
	}
	m.removed = true
	delete(r.byName, name)
	for i, o := range r.order {
		if o == m {
			copy(r.order[i:], r.order[i+1:])
			r.order[len(r.order)-1] = nil
			r.order = r.order[:len(r.order)-1]
			break
		}
	}
	r.snap.Store(next)
	r.recount()
	r.mu.Unlock()
	return nil
}

// SetHealthy marks name healthy or unhealthy. Acquire, Candidate and the bound skip unhealthy
// backends: their in-flight requests leave T and their weight leaves W until they are healthy
// again (slots they hold stay held and are released normally). Safe for concurrent use; setting
// the current state again is a no-op. The error is ErrUnknownBackend when name is not a member.
func (r *Ring) SetHealthy(name string, healthy bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	m, ok := r.byName[name]
	if !ok {
		return ErrUnknownBackend
	}
	if m.healthy == healthy {
		return nil
	}
	if healthy {
		r.total += m.inflight + m.external
	} else {
		r.total -= m.inflight + m.external
	}
	m.healthy = healthy
	r.recount()
	return nil
}

// recount recomputes the healthy count and W from scratch (no float drift across changes).
// Requires mu.
func (r *Ring) recount() {
	n, w := 0, 0.0
	for _, m := range r.order {
		if m.healthy {
			n++
			w += m.weight
		}
	}
	r.healthy, r.weight = n, w
}

// Len returns the number of members, healthy or not. Safe for concurrent use.
func (r *Ring) Len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.order)
}

// Healthy returns the number of healthy members. Safe for concurrent use.
func (r *Ring) Healthy() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.healthy
}

// boundTolerance is the relative slack subtracted before rounding the bound up, so that float
// rounding of a product that is mathematically an integer (1.1·10 = 11.000000000000002) does not
// add a slot. It is far below MinLoadFactorEpsilon, so the proof in pick still holds.
const boundTolerance = 1e-9

// boundOf returns ceil(x) for x = (1+ε)·(T+1)·w/W given as factor·w, at least 1.
func boundOf(factor, w float64) int {
	x := factor * w
	b := math.Ceil(x - x*boundTolerance)
	if b < 1 {
		return 1
	}
	if b >= math.MaxInt32 {
		return math.MaxInt32
	}
	return int(b)
}

// factor returns (1+ε)·(T+1)/W. Requires mu and W > 0.
func (r *Ring) factor() float64 {
	return r.eps1 * float64(r.total+1) / r.weight
}

// Bound returns the bound a healthy backend of the given weight (0 means 1) would have right now:
//
//	ceil((1+ε)·(T+1)·weight/W)
//
// with T the in-flight requests on healthy members and W the sum of their weights; that is, a
// backend may take a new request while its in-flight count plus one is at most this. It returns 0
// when the ring has no healthy member or weight is negative or NaN. Safe for concurrent use; the
// value can be stale as soon as it returns.
func (r *Ring) Bound(weight float64) int {
	return r.boundWithin(weight, r.eps1)
}

// BoundWithin is Bound with a load factor of its own in place of the ring's ε, as
// TryAcquireBackendWithin applies it: ceil((1+epsilon)·(T+1)·weight/W), so that a backend of that
// weight takes a request there while its in-flight count plus one is at most this. NaN or a
// negative epsilon means the ring's ε. It returns 0 when the ring has no healthy member or weight
// is negative or NaN. Safe for concurrent use; the value can be stale as soon as it returns.
func (r *Ring) BoundWithin(weight, epsilon float64) int {
	if !(epsilon >= 0) {
		return r.boundWithin(weight, r.eps1)
	}
	return r.boundWithin(weight, 1+epsilon)
}

// boundWithin returns the bound of load factor eps1 (1+ε) for weight (0 means 1).
func (r *Ring) boundWithin(weight, eps1 float64) int {
	if weight == 0 {
		weight = 1
	}
	if !(weight > 0) {
		return 0
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.healthy == 0 {
		return 0
	}
	return boundOf(eps1*float64(r.total+1)/r.weight, weight)
}

// Loads appends a snapshot of every member, in the order they were added, to dst and returns the
// extended slice. It does not allocate when dst has enough capacity. Safe for concurrent use; the
// snapshot is consistent (taken in one critical section).
func (r *Ring) Loads(dst []Load) []Load {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, m := range r.order {
		dst = append(dst, Load{Name: m.name, Weight: m.weight, InFlight: m.inflight, External: m.external, Healthy: m.healthy})
	}
	return dst
}

// InFlight returns the slots name holds and true, or 0 and false when name is not a member.
// Safe for concurrent use.
func (r *Ring) InFlight(name string) (int, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	m, ok := r.byName[name]
	if !ok {
		return 0, false
	}
	return m.inflight, true
}

// SetExternalLoad sets the load on name that this ring's handles do not hold: requests other
// router replicas sent there, or what the backend's engine reports beyond this ring's own slots.
// It counts like held slots in name's bound check and in T (while name is healthy), and is
// reported as Load.External; n < 0 counts as 0, and n above 1<<30 as 1<<30 (T cannot overflow).
// Setting it again replaces the previous value. Safe for concurrent use. The error is
// ErrUnknownBackend when name is not a member.
func (r *Ring) SetExternalLoad(name string, n int) error {
	n = min(max(n, 0), 1<<30)
	r.mu.Lock()
	defer r.mu.Unlock()
	m, ok := r.byName[name]
	if !ok {
		return ErrUnknownBackend
	}
	if m.counted() {
		r.total += n - m.external
	}
	m.external = n
	return nil
}

// TotalInFlight returns T: the slots held on healthy members plus their external load
// (SetExternalLoad); unhealthy members' and removed backends' are not included. Safe for
// concurrent use.
func (r *Ring) TotalInFlight() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.total
}

// Acquire routes key: it finds key's position on the ring, walks clockwise visiting each distinct
// backend at most once, skips unhealthy ones, and takes a slot on the first backend b with
// inflight(b)+1 ≤ ceil((1+ε)·(T+1)·w_b/W). The bound check and the increment are one critical
// section, so concurrent Acquires never overshoot a bound. On success h holds the slot (release it
// with h.Release) and the reason is ReasonPrefixHash when the first healthy backend met took it,
// ReasonOverflow otherwise. The only error is ErrNoBackend (with ReasonNone, h left empty), when
// no member is healthy: with one healthy member the walk always succeeds (see pick).
//
// If h still holds a slot from an earlier acquisition, that slot is released first. key should be
// a hash (for example a prefix key); it is passed through a bijective 64-bit mixer, so small or
// sequential keys spread as well. Acquire does not allocate. Safe for concurrent use, but a given
// h must not be acquired concurrently from two goroutines.
func (r *Ring) Acquire(h *Handle, key uint64) (Reason, error) {
	return r.AcquireAvoiding(h, key, nil)
}

// AcquireAvoiding is Acquire for a caller that must not use the members named in avoid (a
// gateway's retry after those backends failed the request): the walk passes over them as it
// passes over unhealthy members, so the first healthy member clockwise that is not avoided and is
// under its bound takes the slot (ReasonPrefixHash when it is the first healthy, not avoided
// member met, ReasonOverflow otherwise). The bounds are the ring's own, T and W still counting the
// avoided members, so the walk can find every member it may use at its bound; it then takes a slot
// on the least loaded of them (in-flight plus external load per unit of weight), with
// ReasonOverflow, rather than fail a request some backend can serve. The only error is
// ErrNoBackend (with ReasonNone, h left empty), when no healthy member is outside avoid. Names in
// avoid that are not members are ignored; a nil or empty avoid makes it Acquire. It does not
// allocate, and it scans avoid once per member met, so keep avoid short (the backends that failed
// one request). Safe for concurrent use, but a given h must not be acquired concurrently from two
// goroutines.
func (r *Ring) AcquireAvoiding(h *Handle, key uint64, avoid []string) (Reason, error) {
	h.reset()
	pos := mix64(key)
	for {
		s := r.snap.Load()
		i := s.search(pos) // outside the lock: s is immutable
		r.mu.Lock()
		if r.snap.Load() != s { // membership changed meanwhile: search again
			r.mu.Unlock()
			continue
		}
		if r.healthy == 0 {
			r.mu.Unlock()
			return ReasonNone, ErrNoBackend
		}
		m, reason := r.pick(s, i, avoid)
		if m == nil && len(avoid) > 0 {
			m, reason = r.leastLoadedAvoiding(avoid), ReasonOverflow
		}
		if m == nil { // no healthy member outside avoid (without avoid, unreachable: see pick)
			r.mu.Unlock()
			return ReasonNone, ErrNoBackend
		}
		m.inflight++
		r.total++
		if r.testAcquired != nil {
			r.testAcquired(m, reason)
		}
		r.mu.Unlock()
		h.set(m)
		return reason, nil
	}
}

// Candidate returns the backend Acquire(key) would choose right now, and why, without taking a
// slot; the answer can be stale as soon as it returns. The only error is ErrNoBackend, with "" and
// ReasonNone. It does not allocate. Safe for concurrent use.
func (r *Ring) Candidate(key uint64) (name string, reason Reason, err error) {
	pos := mix64(key)
	for {
		s := r.snap.Load()
		i := s.search(pos)
		r.mu.Lock()
		if r.snap.Load() != s {
			r.mu.Unlock()
			continue
		}
		if r.healthy == 0 {
			r.mu.Unlock()
			return "", ReasonNone, ErrNoBackend
		}
		m, reason := r.pick(s, i, nil)
		r.mu.Unlock()
		if m == nil {
			return "", ReasonNone, ErrNoBackend
		}
		return m.name, reason, nil
	}
}

// Owner returns the backend that owns key: the first healthy backend clockwise from key's
// position, whatever its load. Acquire(key) takes a slot there while it is under its bound and
// overflows past it otherwise; Candidate says which of the two it would do now. Owner takes no
// slot and changes nothing; the answer can be stale as soon as it returns. The only error is
// ErrNoBackend, with "", when no member is healthy. It does not allocate. Safe for concurrent use.
func (r *Ring) Owner(key uint64) (string, error) {
	pos := mix64(key)
	for {
		s := r.snap.Load()
		i := s.search(pos)
		r.mu.Lock()
		if r.snap.Load() != s {
			r.mu.Unlock()
			continue
		}
		name := ""
		if r.healthy > 0 {
			for n := len(s.pos); n > 0; n-- {
				if m := s.members[s.owner[i]]; m.healthy {
					name = m.name
					break
				}
				if i++; i == len(s.pos) {
					i = 0
				}
			}
		}
		r.mu.Unlock()
		if name == "" {
			return "", ErrNoBackend
		}
		return name, nil
	}
}

// AcquireBackend takes a slot on the named backend regardless of its bound and of its health (for
// when another policy has already chosen it) and fills h; the slot counts in T only while the
// backend is healthy. If h still holds a slot, that slot is released first. The error is
// ErrUnknownBackend (h left empty) when name is not a member. It does not allocate. Safe for
// concurrent use, but a given h must not be acquired concurrently from two goroutines.
func (r *Ring) AcquireBackend(h *Handle, name string) error {
	h.reset()
	r.mu.Lock()
	m, ok := r.byName[name]
	if !ok {
		r.mu.Unlock()
		return ErrUnknownBackend
	}
	m.inflight++
	if m.healthy {
		r.total++
	}
	if r.testAcquired != nil {
		r.testAcquired(m, ReasonForced)
	}
	r.mu.Unlock()
	h.set(m)
	return nil
}

// TryAcquireBackend takes a slot on the named backend only if it is healthy and under its bound
// (inflight+1 ≤ Bound), checked and taken in one critical section, like Acquire. It returns
// (true, nil) when it took the slot and filled h, (false, nil) when the backend is unhealthy or at
// its bound (h is left empty), and (false, ErrUnknownBackend) for a name that is not a member.
// Policies that choose a backend by other means (KV overlap) use it to keep the CHWBL bound.
// Safe for concurrent use.
func (r *Ring) TryAcquireBackend(h *Handle, name string) (bool, error) {
	return r.tryAcquire(h, name, r.eps1)
}

// TryAcquireBackendWithin is TryAcquireBackend with a load factor of its own in place of the
// ring's ε: the backend must be healthy and inflight+1 ≤ ceil((1+epsilon)·(T+1)·weight/W), with
// T and W as in Bound. A policy whose choice is worth more than an even spread (a backend that
// holds the request's KV cache) uses a looser epsilon than the ring's own. epsilon must be ≥ 0;
// NaN or a negative value means the ring's ε. Safe for concurrent use.
func (r *Ring) TryAcquireBackendWithin(h *Handle, name string, epsilon float64) (bool, error) {
	if !(epsilon >= 0) {
		return r.tryAcquire(h, name, r.eps1)
	}
	return r.tryAcquire(h, name, 1+epsilon)
}

// tryAcquire takes a slot on the named backend if it is healthy and under the bound of load
// factor eps1 (1+ε).
func (r *Ring) tryAcquire(h *Handle, name string, eps1 float64) (bool, error) {
	h.reset()
	r.mu.Lock()
	m, ok := r.byName[name]
	if !ok {
		r.mu.Unlock()
		return false, ErrUnknownBackend
	}
	if !m.healthy || m.inflight+m.external >= boundOf(eps1*float64(r.total+1)/r.weight, m.weight) {
		r.mu.Unlock()
		return false, nil
	}
	m.inflight++
	r.total++
	if r.testAcquired != nil {
		r.testAcquired(m, ReasonForced)
	}
	r.mu.Unlock()
	h.set(m)
	return true, nil
}

// pick walks the ring clockwise from vnode index start and returns the first healthy backend,
// not named in avoid, under its bound, with the reason. Requires mu, s == r.snap and
// r.healthy > 0. With members avoided the walk can fail (the proof below needs every healthy
// member); AcquireAvoiding then falls back on leastLoadedAvoiding.
//
// Each distinct backend is considered at most once: member.visit records the walk's epoch, so no
// map or allocation is needed. The walk stops after considering every member.
//
// Why the walk always succeeds when at least one member is healthy. Let H be the healthy members,
// T = Σ_{b∈H} inflight(b) (each member's in-flight slots plus its external load), W = Σ_{b∈H} w_b, and bound(b) = ceil((1+ε)(T+1)w_b/W). Every member
// owns at least one vnode and s holds exactly the current members (it is swapped under mu), so the
// walk considers every b ∈ H. Suppose every one refused: inflight(b)+1 > bound(b), i.e.
// inflight(b) ≥ bound(b) ≥ (1+ε)(T+1)w_b/W. Summing over H gives T ≥ (1+ε)(T+1) > T, a
// contradiction. In floating point the bound is ceil(x(1−δ)) with δ = boundTolerance plus rounding
// error of order 1e-15, so the sum gives T ≥ (1+ε)(1−δ')(T+1), still > T because ε ≥ MinLoadFactorEpsilon =
// 0.01 ≫ δ'. Hence some healthy backend accepts, and Acquire fails only with no healthy backend.
func (r *Ring) pick(s *snapshot, start int, avoid []string) (*member, Reason) {
	r.epoch++
	if r.epoch == 0 { // wrapped: forget old marks
		for _, m := range s.members {
			m.visit = 0
		}
		r.epoch = 1
	}
	epoch := r.epoch
	factor := r.factor()
	reason := ReasonPrefixHash
	left := len(s.members)
	n := len(s.pos)
	for i := start; ; {
		m := s.members[s.owner[i]]
		if m.visit != epoch {
			m.visit = epoch
			if r.testVisit != nil {
				r.testVisit(m)
			}
			if m.healthy && !named(avoid, m.name) {
				if m.inflight+m.external < boundOf(factor, m.weight) { // load+1 ≤ bound
					return m, reason
				}
				reason = ReasonOverflow
			}
			if left--; left == 0 {
				return nil, ReasonNone
			}
		}
		if i++; i == n {
			i = 0
		}
	}
}

// leastLoadedAvoiding returns the healthy member not named in avoid with the least in-flight
// plus external load per unit of weight (the first added among equals), or nil. Requires mu.
func (r *Ring) leastLoadedAvoiding(avoid []string) *member {
	var best *member
	bestLoad := 0.0
	for _, m := range r.order {
		if !m.healthy || m.removed || named(avoid, m.name) {
			continue
		}
		load := float64(m.inflight+m.external) / m.weight
		if best == nil || load < bestLoad {
			best, bestLoad = m, load
		}
	}
	return best
}

// named reports whether names holds name.
func named(names []string, name string) bool {
	for _, n := range names {
		if n == name {
			return true
		}
	}
	return false
}
