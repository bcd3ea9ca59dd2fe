package disagg

import (
	"fmt"
	"slices"
	"strings"

	"github.com/kvroute/kvroute/events"
)

// Role is what a backend does in a disaggregated fleet. The zero value is RoleUnified, so a backend
// without a role serves whole requests as before.
type Role uint8

const (
	// RoleUnified serves both phases of a request on one backend (no disaggregation). It is the
	// pool that fallback paths use.
	RoleUnified Role = iota
	// RolePrefill computes the KV cache of prompts and writes it where decode backends can read
	// it (the engine's KV producer).
	RolePrefill
	// RoleDecode generates tokens from KV cache it holds or loads (the engine's KV consumer). It
	// may also compute a short uncached part of a prompt itself (conditional disaggregation).
	RoleDecode
	numRoles
)

// String returns "unified", "prefill" or "decode" (the configuration's spelling).
func (r Role) String() string {
	switch r {
	case RoleUnified:
		return "unified"
	case RolePrefill:
		return "prefill"
	case RoleDecode:
		return "decode"
	default:
		return fmt.Sprintf("role(%d)", uint8(r))
	}
}

// Valid reports whether r is one of the three roles.
func (r Role) Valid() bool { return r < numRoles }

// MarshalText implements encoding.TextMarshaler with String's spelling; an invalid role is an
// error.
func (r Role) MarshalText() ([]byte, error) {
	if !r.Valid() {
		return nil, fmt.Errorf("disagg: invalid role %d", uint8(r))
	}
	return []byte(r.String()), nil
}

// UnmarshalText implements encoding.TextUnmarshaler with ParseRole.
func (r *Role) UnmarshalText(b []byte) error {
	v, err := ParseRole(string(b))
	if err != nil {
		return err
	}
	*r = v
	return nil
}

// ParseRole parses a backend's role as the configuration spells it: "prefill", "decode" or
// "unified", case-insensitively and ignoring surrounding spaces. The empty string is RoleUnified (a
// backend without a role). Anything else is an error wrapping ErrInvalidConfig.
func ParseRole(s string) (Role, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "unified":
		return RoleUnified, nil
	case "prefill":
		return RolePrefill, nil
	case "decode":
		return RoleDecode, nil
	}
	return 0, fmt.Errorf("%w: role %q is not one of prefill, decode, unified", ErrInvalidConfig, s)
}

// Path is the way a request is served: the values of the X-Kvroute-Routing-Path header.
type Path uint8

const (
	// PathFastDecode: a decode backend serves the request directly, with no remote prefill. It
	// holds the prompt's prefix in its own memory, or loads it from external storage, or computes
	// the short uncached part itself (Plan.Reason says which).
	PathFastDecode Path = iota + 1
	// PathPrefillThenDecode: a prefill backend computes the prompt's KV cache and writes it to
	// external storage; a decode backend then loads it and generates the tokens.
	PathPrefillThenDecode
	// PathUnified: a unified backend serves the whole request because disaggregation is off or the
	// fleet has no prefill/decode pools.
	PathUnified
	// PathFallback: a unified backend serves the whole request because the disaggregated pools
	// could not (no healthy backend in a pool the request needs, or its prefill failed) and
	// fallback to unified is on.
	PathFallback
	numPaths
)

var allPaths = [...]Path{PathFastDecode, PathPrefillThenDecode, PathUnified, PathFallback}

// Paths returns every path, in the order of their constants (a new slice each call).
func Paths() []Path { return slices.Clone(allPaths[:]) }

// String returns "fast_decode", "prefill_then_decode", "unified" or "fallback"; "" for the zero
// Path.
func (p Path) String() string {
	switch p {
	case PathFastDecode:
		return "fast_decode"
	case PathPrefillThenDecode:
		return "prefill_then_decode"
	case PathUnified:
		return "unified"
	case PathFallback:
		return "fallback"
	case 0:
		return ""
	default:
		return fmt.Sprintf("path(%d)", uint8(p))
	}
}

// MarshalText implements encoding.TextMarshaler with String's labels.
func (p Path) MarshalText() ([]byte, error) { return []byte(p.String()), nil }

// ParsePath parses a label as String writes it (for a gateway reading the routing-path header
// back). Anything else is an error.
func ParsePath(s string) (Path, error) {
	for _, p := range allPaths {
		if s == p.String() {
			return p, nil
		}
	}
	return 0, fmt.Errorf("disagg: unknown routing path %q", s)
}

// Reason says why a Plan took its path.
type Reason uint8

const (
	// ReasonLocalHit: a decode backend holds the prompt's prefix in its own memory (GPU, or its CPU
	// offload), and what it lacks is short enough to compute itself (fast_decode).
	ReasonLocalHit Reason = iota + 1
	// ReasonStorageHit: the prefix is in external storage that a decode backend reads; the
	// least-loaded such backend loads it (fast_decode).
	ReasonStorageHit
	// ReasonShortPrompt: no usable cache, but the prompt is short enough for a decode backend to
	// compute itself: conditional disaggregation skipped the remote prefill (fast_decode).
	ReasonShortPrompt
	// ReasonCacheMiss: no decode backend can reuse enough of the prompt; a prefill backend
	// computes it (prefill_then_decode).
	ReasonCacheMiss
	// ReasonDisabled: disaggregation is turned off (unified).
	ReasonDisabled
	// ReasonNoPools: the fleet has no prefill or decode backend at all (unified).
	ReasonNoPools
	// ReasonPoolUnavailable: a pool the request needs has no healthy backend (fallback).
	ReasonPoolUnavailable
	// ReasonPrefillFailed: the request's remote prefill failed and it was sent to a unified
	// backend instead (fallback).
	ReasonPrefillFailed
	// ReasonDecodeFailed: the decode backend failed before answering and the request was sent to
	// a unified backend (fallback).
	ReasonDecodeFailed
	numReasons
)

// Reasons returns every reason, in the order of their constants (a new slice each call).
func Reasons() []Reason { return slices.Clone(allReasons[:]) }

var allReasons = [...]Reason{ReasonLocalHit, ReasonStorageHit, ReasonShortPrompt, ReasonCacheMiss,
	ReasonDisabled, ReasonNoPools, ReasonPoolUnavailable, ReasonPrefillFailed, ReasonDecodeFailed}

// String returns the reason's label: "local_hit", "storage_hit", "short_prompt", "cache_miss",
// "disabled", "no_pools", "pool_unavailable", "prefill_failed" or "decode_failed"; "" for the zero
// Reason.
func (r Reason) String() string {
	switch r {
	case ReasonLocalHit:
		return "local_hit"
	case ReasonStorageHit:
		return "storage_hit"
	case ReasonShortPrompt:
		return "short_prompt"
	case ReasonCacheMiss:
		return "cache_miss"
	case ReasonDisabled:
		return "disabled"
	case ReasonNoPools:
		return "no_pools"
	case ReasonPoolUnavailable:
		return "pool_unavailable"
	case ReasonPrefillFailed:
		return "prefill_failed"
	case ReasonDecodeFailed:
		return "decode_failed"
	case 0:
		return ""
	default:
		return fmt.Sprintf("reason(%d)", uint8(r))
	}
}

// MarshalText implements encoding.TextMarshaler with String's labels.
func (r Reason) MarshalText() ([]byte, error) { return []byte(r.String()), nil }

// Tier is where a backend holds the matched prefix, fastest first: kvindex's tiers
// (Match.Tier: the slowest tier among the matched blocks). The zero value is TierGPU.
type Tier = events.Tier

// The tiers, as package events defines them.
const (
	TierGPU     = events.TierGPU     // the backend's GPU memory
	TierCPU     = events.TierCPU     // the backend's CPU memory offload
	TierStorage = events.TierStorage // disk or external storage
)

// localTier reports whether t is the backend's own memory (GPU or CPU): a prefix held there is
// reused by that backend alone, without a transfer.
func localTier(t Tier) bool { return t == TierGPU || t == TierCPU }
