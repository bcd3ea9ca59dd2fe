package disagg

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/kvroute/kvroute/chwbl"
	"github.com/kvroute/kvroute/scorer"
)

// Defaults of Config. The timeouts are the configuration's (disaggregated_serving); the
// thresholds of conditional disaggregation and the load slack are kvroute's.
const (
	// DefaultPrefillTimeout bounds the remote prefill phase (prefill_timeout).
	DefaultPrefillTimeout = 60 * time.Second
	// DefaultKVTransferTimeout bounds the transfer of KV tensors between storage and a backend
	// (kv_transfer_timeout).
	DefaultKVTransferTimeout = 15 * time.Second
	// DefaultMaxUncachedTokens: a decode backend computes an uncached part of at most this many
	// tokens itself instead of sending the prompt to a prefill backend.
	DefaultMaxUncachedTokens = 512
	// DefaultMaxUncachedRatio: … or an uncached part of at most this fraction of the prompt.
	DefaultMaxUncachedRatio = 0.1
)

// Errors callers branch on with errors.Is.
var (
	// ErrInvalidConfig is wrapped by New and ParseRole for a value they cannot accept.
	ErrInvalidConfig = errors.New("disagg: invalid config")
	// ErrNoBackend is wrapped by Plan when no healthy backend can serve the request by any path
	// the configuration allows (the pools it needs are unavailable and fallback to unified is off,
	// or no unified backend is healthy either). A gateway answers 503.
	ErrNoBackend = errors.New("disagg: no backend can serve the request")
)

// Config configures a Planner: the configuration's disaggregated_serving section plus
// conditional disaggregation. Its zero value means the defaults: disaggregation on, fallback to
// unified on, the Default* timeouts, thresholds and slack, no default storage (engines transfer
// KV directly), and the composite scorer for choosing prefill and unified backends.
type Config struct {
	// Disabled turns disaggregation off (enabled: false): every request takes the unified path.
	Disabled bool
	// DisableFallback turns fallback_to_unified off: when a pool the request needs has no healthy
	// backend, Plan fails with ErrNoBackend instead of choosing a unified backend.
	DisableFallback bool
	// PrefillTimeout (prefill_timeout) and KVTransferTimeout (kv_transfer_timeout) are for the
	// gateway that runs the two phases: it bounds the prefill request by the first and each KV
	// load by the second. 0 means the default; negative is an error. The Planner itself does no
	// I/O.
	PrefillTimeout    time.Duration
	KVTransferTimeout time.Duration
	// DefaultStorage is default_external_storage: the storage of every backend that names none.
	DefaultStorage ExternalStorage
	// DisableConditional turns conditional disaggregation off: any reusable prefix on a decode
	// backend means fast_decode and no reusable prefix means prefill_then_decode, however long or
	// short the uncached part.
	DisableConditional bool
	// MaxUncachedTokens and MaxUncachedRatio are the thresholds of conditional disaggregation.
	// The remote prefill is skipped (the decode backend computes the uncached part itself) when
	// uncached ≤ MaxUncachedTokens or uncached/prompt ≤ MaxUncachedRatio: the prompt goes to a
	// prefill backend only when its uncached part is long by both measures. 0 means the default;
	// a negative value turns that test off (it never skips). MaxUncachedRatio must be ≤ 1.
	MaxUncachedTokens int
	MaxUncachedRatio  float64
	// LoadFactorEpsilon is the load slack ε of the prefill and decode pools: a backend of weight w
	// may take a phase while its phases in flight + 1 ≤ ceil((1+ε)·(T+1)·w/W) over its pool
	// (CHWBL's bound). 0 means chwbl.DefaultLoadFactorEpsilon (0.25). Valid: 0.01 to 10.
	LoadFactorEpsilon float64
	// Scorer ranks prefill candidates (with each one's prefill load as its in-flight count) and
	// unified candidates; nil means scorer.NewComposite's defaults (overlap 0.6, load 0.3, health
	// 0.1).
	Scorer scorer.BackendScorer
}

func (c Config) withDefaults() (Config, error) {
	if c.PrefillTimeout == 0 {
		c.PrefillTimeout = DefaultPrefillTimeout
	}
	if c.KVTransferTimeout == 0 {
		c.KVTransferTimeout = DefaultKVTransferTimeout
	}
	if c.MaxUncachedTokens == 0 {
		c.MaxUncachedTokens = DefaultMaxUncachedTokens
	}
	if c.MaxUncachedRatio == 0 {
		c.MaxUncachedRatio = DefaultMaxUncachedRatio
	}
	if c.LoadFactorEpsilon == 0 {
		c.LoadFactorEpsilon = chwbl.DefaultLoadFactorEpsilon
	}
	switch {
	case c.PrefillTimeout < 0:
		return c, fmt.Errorf("%w: prefill_timeout %v is negative", ErrInvalidConfig, c.PrefillTimeout)
	case c.KVTransferTimeout < 0:
		return c, fmt.Errorf("%w: kv_transfer_timeout %v is negative", ErrInvalidConfig, c.KVTransferTimeout)
	case math.IsNaN(c.MaxUncachedRatio) || c.MaxUncachedRatio > 1:
		return c, fmt.Errorf("%w: MaxUncachedRatio %v is not ≤ 1", ErrInvalidConfig, c.MaxUncachedRatio)
	case math.IsNaN(c.LoadFactorEpsilon) || c.LoadFactorEpsilon < 0.01 || c.LoadFactorEpsilon > 10:
		return c, fmt.Errorf("%w: LoadFactorEpsilon %v not in [0.01, 10]", ErrInvalidConfig, c.LoadFactorEpsilon)
	}
	if c.Scorer == nil {
		comp, err := scorer.NewComposite(scorer.CompositeConfig{})
		if err != nil {
			return c, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
		}
		c.Scorer = comp
	}
	return c, nil
}
