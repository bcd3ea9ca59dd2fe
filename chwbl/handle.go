package chwbl

import "sync/atomic"

// Handle is one in-flight slot taken by Ring.Acquire or Ring.AcquireBackend. It is caller-owned
// storage: embed it in your own per-request struct so that routing allocates nothing. The zero
// Handle holds no slot.
//
// Release is idempotent and safe to call from any goroutine, also concurrently with Backend, Held
// and other calls to Release; exactly one call frees the slot. Acquiring into a Handle must not
// race with any other use of the same Handle. A Handle must not be copied once used (go vet's
// copylocks check reports copies).
type Handle struct {
	m    atomic.Pointer[member] // the slot's backend; nil when no slot is held
	name string                 // the backend of the last successful acquisition
}

// Backend returns the name of the backend chosen by the handle's last successful acquisition, or ""
// when it has none (zero Handle, or the last Acquire failed). The name stays readable after Release,
// for logging; use Held to ask whether a slot is still held. Safe to call concurrently with Release.
func (h *Handle) Backend() string { return h.name }

// Held reports whether the handle currently holds a slot (acquired and not yet released); false
// for a nil Handle. Safe to call concurrently with Release.
func (h *Handle) Held() bool { return h != nil && h.m.Load() != nil }

// Release frees the slot the handle holds and reports whether this call freed it: true the first
// time after an acquisition, false afterwards and for a zero or nil Handle. It is safe from any
// goroutine and with the backend already removed from its ring (then only that backend's own
// counter is decremented). It does not allocate.
func (h *Handle) Release() bool {
	if h == nil {
		return false
	}
	m := h.m.Swap(nil)
	if m == nil {
		return false
	}
	m.ring.release(m)
	return true
}

// reset releases any slot h still holds and clears it, before a new acquisition.
func (h *Handle) reset() {
	if h.m.Load() != nil { // a plain load first: the common, empty case needs no atomic exchange
		if m := h.m.Swap(nil); m != nil {
			m.ring.release(m)
		}
	}
	h.name = ""
}

// set records a slot just taken on m.
func (h *Handle) set(m *member) {
	h.name = m.name
	h.m.Store(m)
}

// release frees one slot of m.
func (r *Ring) release(m *member) {
	r.mu.Lock()
	m.inflight--
	if m.counted() {
		r.total--
	}
	if r.testReleased != nil {
		r.testReleased(m)
	}
	r.mu.Unlock()
}
