// Package chwbl implements consistent hashing with bounded loads (CHWBL): a consistent-hash ring
// whose backends each accept at most a bounded share of the requests in flight, the excess
// overflowing clockwise to the next backend.
//
// The algorithm is from V. Mirrokni, M. Thorup and M. Zadimoghaddam, "Consistent Hashing with
// Bounded Loads", SODA 2018 (arXiv:1608.01350). kvroute uses it to send requests that share a
// prompt prefix to the same model server, where its KV cache already holds that prefix, without
// letting a popular prefix overload one server.
//
// # Ring
//
// Each backend of weight w gets round(VirtualNodes·w) virtual nodes (at least 1), placed at
// xxh3-64(uvarint(len(name)) ‖ name ‖ uint32-big-endian(replica index)). The length prefix keeps
// names such as "pod-1" and "pod-11" from producing the same virtual-node keys. Virtual nodes are
// sorted by (position, backend name, replica index), so even a 64-bit position collision orders
// deterministically. A request key (a 64-bit hash, e.g. of the prompt prefix) is passed through a
// bijective mixer and lands on the first virtual node at or after it, wrapping around. Adding or
// removing one of N backends moves only about 1/N of the keys.
//
// # Bound
//
// Let T be the number of requests in flight on healthy backends and W the sum of the healthy
// backends' weights. A healthy backend b of weight w_b may take a new request only while
//
//	inflight(b) + 1 ≤ ceil((1+ε) · (T+1) · w_b / W)
//
// which with equal weights is ceil((1+ε)(T+1)/n) for n healthy backends: the paper's bound, with
// T+1 counting the request being placed. A backend's load may include requests this ring's handles do not
// hold (Ring.SetExternalLoad: other router replicas' requests, or its engine's own count): they
// count in inflight(b) and in T alike, so replicas sharing their loads share one bound. ε
// (Config.LoadFactorEpsilon, default 0.25) trades cache affinity for balance. The ceiling is taken with a relative tolerance of 1e-9 so that float rounding of an
// exact product (1.1 × 10) does not add a slot. Ring.Bound reports the current value.
//
// # Overflow walk
//
// Ring.Acquire starts at the key's virtual node and walks clockwise, considering each distinct
// backend at most once and skipping unhealthy ones, and takes a slot on the first backend under
// its bound. The reason is ReasonPrefixHash when that was the first healthy backend met, and
// ReasonOverflow otherwise. Because the bounds of the healthy backends sum to more than T, some
// backend always has room (the proof is in ring.go), so Acquire fails only with ErrNoBackend, when
// no backend is healthy. Unhealthy backends' in-flight requests leave T while they are unhealthy;
// a removed backend's outstanding slots leave T at removal and, when released later, decrement
// only that backend's own counter.
//
// # Concurrency
//
// A Ring is safe for concurrent use. The bound check and the increment happen in one critical
// section (one mutex, held for the walk only; finding the key's position runs before it, on an
// immutable snapshot of the virtual nodes), so concurrent requests never overshoot a bound. Releases take the
// same lock. Add and Remove build a new snapshot outside it and swap it in. A Handle is
// caller-owned storage for one slot; Handle.Release is idempotent and safe from any goroutine.
// Acquire, Candidate and Release do not allocate. The package has no global state and starts no
// goroutines.
//
// # Use
//
//	ring, err := chwbl.New(chwbl.Config{}) // 150 virtual nodes, ε = 0.25
//	if err != nil {
//		return err
//	}
//	ring.Add("pod-a", 1)
//	ring.Add("pod-b", 2) // twice the keys, twice the share of the bound
//
//	var h chwbl.Handle // usually a field of the caller's request struct
//	reason, err := ring.Acquire(&h, prefixHash)
//	if err != nil {
//		return err // chwbl.ErrNoBackend: nothing healthy
//	}
//	defer h.Release()
//	forward(h.Backend(), reason) // reason: prefix_hash or overflow
package chwbl
