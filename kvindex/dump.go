package kvindex

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/kvroute/kvroute/events"
)

// DefaultDumpLimit is the number of entries Dumper.Dump lists when its limit is 0 or less.
const DefaultDumpLimit = 1000

// DumpEntry is one entry of a KV index as Dumper lists it: a block a backend holds (Prefix "")
// or one of its prefix-granular entries (Prefix set). Its JSON encoding, one object per line of
// kvroute's GET /admin/kv-index/dump, is
//
//	{"backend":"vllm-0","key":"<16 hex>","tiers":["gpu","storage"],"expires_at":"…","speculative":false}
//	{"backend":"vllm-0","key":"<16 hex>","tiers":[],"speculative":true,"speculative_until":"…"}
//	{"backend":"vllm-0","prefix":"<hex>","tokens":512,"tiers":["gpu"],"expires_at":"…","speculative":false}
//
// with the times in RFC 3339 and the zero ones left out.
type DumpEntry struct {
	Backend string
	// Key is the block's key: kvroute's chained block key (prefixkey.AppendBlockKeys with the
	// index's block size), as a request's keys are computed. 0 for a prefix entry, or when the
	// index cannot tell it (MemoryIndex.Dump says when).
	Key uint64
	// Tiers are the tiers the backend holds the block on by live confirmed entries (engines'
	// events), fastest first; none for a block held only speculatively. A prefix entry has one.
	Tiers []Tier
	// Expires is when the confirmed entry (or the prefix entry) expires unless an event refreshes
	// it; zero when there is none. The index's clock reads it; MemoryIndex's is coarse (its entry
	// epochs are EntryTTL/64 long).
	Expires time.Time
	// Speculative reports a live speculative entry: a routing decision predicted that the backend
	// would hold the block (Speculator) and no event has confirmed it yet. SpeculativeExpires is
	// when it lapses.
	Speculative        bool
	SpeculativeExpires time.Time
	// Prefix is a prefix-granular entry's prefix key (lowercase hex), Tokens its token count.
	Prefix string
	Tokens int
}

// Dumper lists what an index holds for one backend, for debugging: kvroute's GET
// /admin/kv-index/dump. Routing does not need it; *MemoryIndex and redisindex.Index implement
// it, and DumperFunc adapts a function.
//
// Dump calls fn with each live entry of backend, its blocks first and then its prefix entries,
// at most limit times (DefaultDumpLimit when limit ≤ 0). It returns nil once it has listed every
// entry or limit of them; fn's first error, at which it stops; ctx.Err() (wrapped, for a remote
// index) when ctx ends first, which it checks between batches; or an error of the index (a
// remote one's wrap ErrUnavailable, ErrClosed after Close). An unknown backend has no entries.
// The listing is no snapshot: entries written while it runs may be listed or not. It is bounded
// by limit in memory and time, never calls fn with a lock held, and holds no lock that routing
// waits on for long. Safe for concurrent use.
type Dumper interface {
	Dump(ctx context.Context, backend string, limit int, fn func(DumpEntry) error) error
}

// DumperFunc adapts a function to the Dumper interface.
type DumperFunc func(ctx context.Context, backend string, limit int, fn func(DumpEntry) error) error

// Dump calls f(ctx, backend, limit, fn).
func (f DumperFunc) Dump(ctx context.Context, backend string, limit int, fn func(DumpEntry) error) error {
	return f(ctx, backend, limit, fn)
}

var (
	_ Dumper = (*MemoryIndex)(nil)
	_ Dumper = DumperFunc(nil)
)

// dumpJSON is DumpEntry's JSON shape.
type dumpJSON struct {
	Backend            string    `json:"backend"`
	Key                string    `json:"key,omitempty"`
	Prefix             string    `json:"prefix,omitempty"`
	Tokens             int       `json:"tokens,omitempty"`
	Tiers              []string  `json:"tiers"`
	Expires            time.Time `json:"expires_at,omitzero"`
	Speculative        bool      `json:"speculative"`
	SpeculativeExpires time.Time `json:"speculative_until,omitzero"`
}

// MarshalJSON encodes e as DumpEntry documents: the key as 16 lowercase hex digits (none for a
// prefix entry), the tiers by name.
func (e DumpEntry) MarshalJSON() ([]byte, error) {
	j := dumpJSON{Backend: e.Backend, Prefix: e.Prefix, Tokens: e.Tokens, Tiers: make([]string, len(e.Tiers)),
		Expires: e.Expires, Speculative: e.Speculative, SpeculativeExpires: e.SpeculativeExpires}
	if e.Prefix == "" {
		j.Key = fmt.Sprintf("%016x", e.Key)
	}
	for i, t := range e.Tiers {
		j.Tiers[i] = t.String()
	}
	return json.Marshal(j)
}

// UnmarshalJSON decodes what MarshalJSON encodes.
func (e *DumpEntry) UnmarshalJSON(b []byte) error {
	var j dumpJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return err
	}
	d := DumpEntry{Backend: j.Backend, Prefix: j.Prefix, Tokens: j.Tokens, Expires: j.Expires,
		Speculative: j.Speculative, SpeculativeExpires: j.SpeculativeExpires}
	if j.Key != "" {
		k, err := strconv.ParseUint(j.Key, 16, 64)
		if err != nil {
			return fmt.Errorf("kvindex: dump entry key %q: %w", j.Key, err)
		}
		d.Key = k
	}
	for _, name := range j.Tiers {
		t := events.ParseMedium(name)
		if t.String() != name {
			return fmt.Errorf("kvindex: dump entry tier %q is not gpu, cpu or storage", name)
		}
		d.Tiers = append(d.Tiers, t)
	}
	*e = d
	return nil
}

// tiersOf returns the tiers of mask (bit t: Tier(t)), fastest first.
func tiersOf(mask uint8) []Tier {
	out := make([]Tier, 0, events.NumTiers)
	for t := range Tier(events.NumTiers) {
		if mask&(1<<t) != 0 {
			out = append(out, t)
		}
	}
	return out
}
