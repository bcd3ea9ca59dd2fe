package disagg

import "sync/atomic"

// Counters counts routed requests by path and reason, plus the requests no path could serve and
// the prefills that failed. The zero value is ready to use; all methods are safe for concurrent use
// and allocate nothing. A Counters must not be copied after first use.
//
// The Planner does not count (Plan is pure, and a caller may plan a request more than once); the
// caller records the plan it acted on.
type Counters struct {
	paths           [numPaths]atomic.Uint64
	reasons         [numReasons]atomic.Uint64
	noBackend       atomic.Uint64
	prefillFailures atomic.Uint64
	decodeFailures  atomic.Uint64
}

// Record counts one request served by plan. Plans with an unknown path or reason count only in
// what is known.
func (c *Counters) Record(plan Plan) {
	if plan.Path > 0 && plan.Path < numPaths {
		c.paths[plan.Path].Add(1)
	}
	if plan.Reason > 0 && plan.Reason < numReasons {
		c.reasons[plan.Reason].Add(1)
	}
}

// RecordNoBackend counts one request that no path could serve (Plan returned ErrNoBackend).
func (c *Counters) RecordNoBackend() { c.noBackend.Add(1) }

// RecordPrefillFailure counts one remote prefill that failed.
func (c *Counters) RecordPrefillFailure() { c.prefillFailures.Add(1) }

// RecordDecodeFailure counts one decode phase whose backend failed before answering.
func (c *Counters) RecordDecodeFailure() { c.decodeFailures.Add(1) }

// Reset zeroes every counter.
func (c *Counters) Reset() {
	for i := range c.paths {
		c.paths[i].Store(0)
	}
	for i := range c.reasons {
		c.reasons[i].Store(0)
	}
	c.noBackend.Store(0)
	c.prefillFailures.Store(0)
	c.decodeFailures.Store(0)
}

// Snapshot returns the counters. They are read one by one, so a snapshot taken under load may be
// off by the requests recorded while it was taken.
func (c *Counters) Snapshot() Stats {
	s := Stats{
		FastDecode:        c.paths[PathFastDecode].Load(),
		PrefillThenDecode: c.paths[PathPrefillThenDecode].Load(),
		Unified:           c.paths[PathUnified].Load(),
		Fallback:          c.paths[PathFallback].Load(),
		Reasons: ReasonCounts{
			LocalHit:        c.reasons[ReasonLocalHit].Load(),
			StorageHit:      c.reasons[ReasonStorageHit].Load(),
			ShortPrompt:     c.reasons[ReasonShortPrompt].Load(),
			CacheMiss:       c.reasons[ReasonCacheMiss].Load(),
			Disabled:        c.reasons[ReasonDisabled].Load(),
			NoPools:         c.reasons[ReasonNoPools].Load(),
			PoolUnavailable: c.reasons[ReasonPoolUnavailable].Load(),
			PrefillFailed:   c.reasons[ReasonPrefillFailed].Load(),
			DecodeFailed:    c.reasons[ReasonDecodeFailed].Load(),
		},
		NoBackend:       c.noBackend.Load(),
		PrefillFailures: c.prefillFailures.Load(),
		DecodeFailures:  c.decodeFailures.Load(),
	}
	s.Total = s.FastDecode + s.PrefillThenDecode + s.Unified + s.Fallback
	return s
}

// Stats is a snapshot of Counters, in the form of an admin endpoint's JSON body.
type Stats struct {
	// Total counts the routed requests (the sum of the four paths).
	Total             uint64       `json:"total"`
	FastDecode        uint64       `json:"fast_decode"`
	PrefillThenDecode uint64       `json:"prefill_then_decode"`
	Unified           uint64       `json:"unified"`
	Fallback          uint64       `json:"fallback"`
	Reasons           ReasonCounts `json:"reasons"`
	// NoBackend counts requests no path could serve; PrefillFailures the remote prefills that
	// failed (each is also counted under its fallback, when one served it).
	NoBackend       uint64 `json:"no_backend"`
	PrefillFailures uint64 `json:"prefill_failures"`
	// DecodeFailures counts decode phases whose backend failed before answering (each also
	// counted under its fallback, when one served it).
	DecodeFailures uint64 `json:"decode_failures"`
}

// Path returns the count of one path; 0 for an unknown one.
func (s Stats) Path(p Path) uint64 {
	switch p {
	case PathFastDecode:
		return s.FastDecode
	case PathPrefillThenDecode:
		return s.PrefillThenDecode
	case PathUnified:
		return s.Unified
	case PathFallback:
		return s.Fallback
	}
	return 0
}

// ReasonCounts counts routed requests by Reason.
type ReasonCounts struct {
	LocalHit        uint64 `json:"local_hit"`
	StorageHit      uint64 `json:"storage_hit"`
	ShortPrompt     uint64 `json:"short_prompt"`
	CacheMiss       uint64 `json:"cache_miss"`
	Disabled        uint64 `json:"disabled"`
	NoPools         uint64 `json:"no_pools"`
	PoolUnavailable uint64 `json:"pool_unavailable"`
	PrefillFailed   uint64 `json:"prefill_failed"`
	DecodeFailed    uint64 `json:"decode_failed"`
}
