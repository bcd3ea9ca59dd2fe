package respcache

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"sync/atomic"
	"time"
)

// Defaults of TieredConfig, from kvroute's response_cache.l1 and tiered sections.
const (
	// DefaultL1MaxValueSize is the largest value stored in L1 (l1.max_value_size); larger values
	// go to L2 only.
	DefaultL1MaxValueSize = 1 << 20
	// DefaultL1PromotionTTL is the L1 TTL of an entry promoted from L2 (tiered.l1_promotion_ttl).
	DefaultL1PromotionTTL = 5 * time.Minute
)

// tierGuards is the number of write guards of a TieredStore (keys share them by hash).
const tierGuards = 256

// TieredConfig configures a TieredStore: a fast L1 (a MemoryStore or a redisstore.Store) in front
// of a large, durable L2 (an s3store.Store). L1 and L2 are required; the rest has defaults.
type TieredConfig struct {
	// L1 and L2 are the tiers. The TieredStore does not own them: close them after it is done.
	L1, L2 CacheStore
	// L1MaxValueSize is the largest value Set or promoted into L1; 0 means DefaultL1MaxValueSize.
	L1MaxValueSize int
	// DisablePromotion stops copying L2 hits into L1. The zero value (promotion on) is kvroute's
	// promote_on_hit: true.
	DisablePromotion bool
	// L1PromotionTTL is the L1 TTL of a promoted entry; 0 means DefaultL1PromotionTTL.
	L1PromotionTTL time.Duration
	// L2TTL, when > 0, is the TTL of every L2 write (l2.ttl_override); 0 means the ttl given to Set.
	L2TTL time.Duration
}

// TieredStore is a two-level CacheStore: Get tries L1, then L2, and promotes an L2 hit into L1 (for
// L1PromotionTTL, values up to L1MaxValueSize); Set writes L1 (small values only; a larger value
// deletes the key from L1 so that an older small value cannot shadow it) and then L2; Delete and
// Clear act on both. All methods are safe for concurrent use; it starts no goroutine and needs no
// Close.
//
// A tier that fails is counted (StoreStats.Errors, by ErrorTypeOf) and treated as a miss: a Get
// fails only when both tiers fail, a Set only when no tier stored the value. Delete and Clear
// report any tier's failure, since an entry may then survive. A promotion that races with a Set,
// Delete or Clear of the same key is undone, so that a promotion never resurrects a deleted or
// replaced value; the cost is at most one extra L1 miss. Concurrent Sets of one key may leave L1
// and L2 with different values of those Sets (equivalent responses, for a response cache).
//
// A promoted entry may outlive its L2 original by up to L1PromotionTTL (L2's remaining TTL is not
// known); Delete removes both.
type TieredStore struct {
	l1, l2     CacheStore
	maxL1      int
	promote    bool
	promoTTL   time.Duration
	l2TTL      time.Duration
	seed       maphash.Seed
	guards     [tierGuards]tierGuard
	hits1      atomic.Uint64
	hits2      atomic.Uint64
	misses     atomic.Uint64
	promotions atomic.Uint64
	errs       ErrorCounts
}

// tierGuard lets a promotion detect a concurrent write of a key sharing the guard: writers raise
// active and bump version before they touch the tiers, bump version again and lower active after.
type tierGuard struct {
	active  atomic.Int64
	version atomic.Uint64
}

var _ CacheStore = (*TieredStore)(nil)

// NewTiered validates cfg and returns the store. Errors wrap ErrInvalidConfig: a nil tier, the same
// store as both tiers, or a negative size or duration.
func NewTiered(cfg TieredConfig) (*TieredStore, error) {
	switch {
	case cfg.L1 == nil || cfg.L2 == nil:
		return nil, fmt.Errorf("%w: tiered: L1 and L2 are required", ErrInvalidConfig)
	case cfg.L1 == cfg.L2:
		return nil, fmt.Errorf("%w: tiered: L1 and L2 are the same store", ErrInvalidConfig)
	case cfg.L1MaxValueSize < 0, cfg.L1PromotionTTL < 0, cfg.L2TTL < 0:
		return nil, fmt.Errorf("%w: tiered: negative size or duration", ErrInvalidConfig)
	}
	s := &TieredStore{
		l1:       cfg.L1,
		l2:       cfg.L2,
		maxL1:    cfg.L1MaxValueSize,
		promote:  !cfg.DisablePromotion,
		promoTTL: cfg.L1PromotionTTL,
		l2TTL:    cfg.L2TTL,
		seed:     maphash.MakeSeed(),
	}
	if s.maxL1 == 0 {
		s.maxL1 = DefaultL1MaxValueSize
	}
	if s.promoTTL == 0 {
		s.promoTTL = DefaultL1PromotionTTL
	}
	return s, nil
}

func (s *TieredStore) guard(key string) *tierGuard {
	return &s.guards[maphash.String(s.seed, key)%tierGuards]
}

func (g *tierGuard) begin() {
	g.active.Add(1)
	g.version.Add(1)
}

func (g *tierGuard) end() {
	g.version.Add(1)
	g.active.Add(-1)
}

// tierErr counts a tier's error unless it is the caller's cancellation.
func (s *TieredStore) tierErr(err error) {
	s.errs.Add(ErrorTypeOf(err))
}

// Get returns key's value from L1, else from L2 (then promoted into L1 unless disabled or larger
// than L1MaxValueSize). Cases: (value, true, nil) a hit in either tier, the slice is the caller's;
// (nil, false, nil) a miss in both, or a miss in one and an error in the other (the error is
// counted); (nil, false, err) when both tiers failed (err joins both). ctx is passed to the tiers.
// Safe for concurrent use.
func (s *TieredStore) Get(ctx context.Context, key string) ([]byte, bool, error) {
	v, ok, err1 := s.l1.Get(ctx, key)
	if err1 == nil && ok {
		s.hits1.Add(1)
		return v, true, nil
	}
	if err1 != nil {
		s.tierErr(err1)
	}
	g := s.guard(key)
	promote := s.promote && g.active.Load() == 0
	ver := g.version.Load()
	v, ok, err2 := s.l2.Get(ctx, key)
	if err2 != nil {
		s.tierErr(err2)
		if err1 != nil {
			return nil, false, errors.Join(fmt.Errorf("respcache: tiered L1: %w", err1),
				fmt.Errorf("respcache: tiered L2: %w", err2))
		}
		s.misses.Add(1)
		return nil, false, nil
	}
	if !ok {
		s.misses.Add(1)
		return nil, false, nil
	}
	s.hits2.Add(1)
	if promote && err1 == nil && len(v) <= s.maxL1 {
		if err := s.l1.Set(ctx, key, v, s.promoTTL); err != nil {
			s.tierErr(err)
		} else if g.active.Load() != 0 || g.version.Load() != ver {
			// A write of this guard's keys ran meanwhile: our value may be stale.
			if err := s.l1.Delete(context.WithoutCancel(ctx), key); err != nil {
				s.tierErr(err)
			}
		} else {
			s.promotions.Add(1)
		}
	}
	return v, true, nil
}

// Set writes value to L1 (when len(value) ≤ L1MaxValueSize; otherwise the key is deleted from L1)
// with ttl, then to L2 with L2TTL (or ttl when L2TTL is 0); ttl ≤ 0 means each tier's default. It
// returns nil when at least one tier stored the value (a failing tier is counted), and an error
// joining the tiers' errors otherwise. value is not retained. Safe for concurrent use.
func (s *TieredStore) Set(ctx context.Context, key string, value []byte, ttl time.Duration) error {
	g := s.guard(key)
	g.begin()
	defer g.end()
	var err1 error
	stored := false
	if len(value) <= s.maxL1 {
		if err1 = s.l1.Set(ctx, key, value, ttl); err1 == nil {
			stored = true
		}
	} else {
		err1 = s.l1.Delete(ctx, key)
	}
	if err1 != nil {
		s.tierErr(err1)
	}
	l2ttl := ttl
	if s.l2TTL > 0 {
		l2ttl = s.l2TTL
	}
	err2 := s.l2.Set(ctx, key, value, l2ttl)
	if err2 != nil {
		s.tierErr(err2)
		if !stored {
			return errors.Join(wrapTier("L1", err1), fmt.Errorf("respcache: tiered L2: %w", err2))
		}
	}
	return nil
}

func wrapTier(tier string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("respcache: tiered %s: %w", tier, err)
}

// Delete removes key from both tiers (absent is not an error). Both are always tried; the error
// joins the failing tiers' errors (an entry may then survive in that tier). Safe for concurrent
// use.
func (s *TieredStore) Delete(ctx context.Context, key string) error {
	g := s.guard(key)
	g.begin()
	defer g.end()
	err1 := s.l1.Delete(ctx, key)
	err2 := s.l2.Delete(ctx, key)
	if err1 != nil {
		s.tierErr(err1)
	}
	if err2 != nil {
		s.tierErr(err2)
	}
	return errors.Join(wrapTier("L1", err1), wrapTier("L2", err2))
}

// Clear empties both tiers and returns the larger of their counts (an entry usually lives in both;
// L2 holds every entry), or -1 when either tier cannot count. Both are always tried; the error
// joins the failing tiers' errors, and the count then covers the tiers that answered. Safe for
// concurrent use; promotions in flight are undone.
func (s *TieredStore) Clear(ctx context.Context) (int, error) {
	for i := range s.guards {
		s.guards[i].begin()
	}
	defer func() {
		for i := range s.guards {
			s.guards[i].end()
		}
	}()
	n1, err1 := s.l1.Clear(ctx)
	n2, err2 := s.l2.Clear(ctx)
	if err1 != nil {
		s.tierErr(err1)
	}
	if err2 != nil {
		s.tierErr(err2)
	}
	n := max(n1, n2)
	if n1 == -1 || n2 == -1 {
		n = -1
	}
	return n, errors.Join(wrapTier("L1", err1), wrapTier("L2", err2))
}

// Stats reports Backend "tiered", Entries -1 (see L1 and L2), Hits (L1 and L2 hits of Get), Misses
// (both missed), the tier errors this store saw by type, and each tier's own Stats in L1 and L2.
// ctx is passed to the tiers. Safe for concurrent use.
func (s *TieredStore) Stats(ctx context.Context) StoreStats {
	l1 := s.l1.Stats(ctx)
	l2 := s.l2.Stats(ctx)
	return StoreStats{
		Backend: "tiered",
		Entries: -1,
		Hits:    s.hits1.Load() + s.hits2.Load(),
		Misses:  s.misses.Load(),
		Errors:  s.errs.Snapshot(),
		L1:      &l1,
		L2:      &l2,
	}
}

// TierCounts are a TieredStore's per-tier counters, beyond StoreStats.
type TierCounts struct {
	L1Hits, L2Hits, Misses, Promotions uint64
}

// Counts returns the per-tier hit counts and the number of promotions that stuck (not undone).
// Safe for concurrent use.
func (s *TieredStore) Counts() TierCounts {
	return TierCounts{L1Hits: s.hits1.Load(), L2Hits: s.hits2.Load(), Misses: s.misses.Load(),
		Promotions: s.promotions.Load()}
}
