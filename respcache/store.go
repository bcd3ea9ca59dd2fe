package respcache

import (
	"context"
	"errors"
	"time"
)

// CacheStore stores serialized responses under string keys: kvroute's CacheStore (get, set with
// TTL, delete, clear, stats). Implementations: *MemoryStore, *TieredStore, and in their own
// packages *redisstore.Store (with automatic in-memory fallback) and *s3store.Store. Every method
// is safe for concurrent use and honours ctx for I/O (a memory store ignores it).
//
// Get returns, case by case:
//   - (value, true, nil): a hit; value belongs to the caller (the store keeps no reference to it);
//   - (nil, false, nil): a miss (absent or expired);
//   - (nil, false, err): the store could not answer; callers treat it as a miss and count it.
//
// Set stores value for ttl (ttl ≤ 0 means the store's default TTL); the store copies value or
// keeps no reference after returning. An error means the value may not be stored; callers log,
// count and go on. Delete removes key (absent is not an error). Clear removes every entry the store
// owns (only under its own key prefix for shared stores) and returns how many it removed (-1 when
// the store cannot count). Stats never fails; ctx bounds any I/O it does.
type CacheStore interface {
	Get(ctx context.Context, key string) ([]byte, bool, error)
	Set(ctx context.Context, key string, value []byte, ttl time.Duration) error
	Delete(ctx context.Context, key string) error
	Clear(ctx context.Context) (int, error)
	Stats(ctx context.Context) StoreStats
}

// StoreStats describes a store for kvroute's GET /admin/response-cache/stats. Fields a store does
// not track are zero; nested sections are nil when they do not apply.
type StoreStats struct {
	Backend   string            `json:"backend_type"` // kvroute's: "memory", "redis", "s3", "tiered"; yours: its own name
	Entries   int               `json:"entries"`      // -1 when unknown
	Capacity  int               `json:"capacity"`
	SizeBytes int64             `json:"size_bytes"`
	Evictions uint64            `json:"evictions"`
	Hits      uint64            `json:"hits"`
	Misses    uint64            `json:"misses"`
	Errors    map[string]uint64 `json:"errors,omitempty"` // by type: connection, timeout, other
	// Remote is the section of a store backed by a server (connections, fallback, errors); nil
	// for a local store. The stats endpoint shows Redis's as "redis", another's as "remote".
	Remote *RemoteStats `json:"remote,omitempty"`
	L1     *StoreStats  `json:"l1,omitempty"` // tiered only
	L2     *StoreStats  `json:"l2,omitempty"` // tiered only
}

// RemoteStats describes the connection of a store to its server (redisstore.Store fills it; a
// store of your own on another server may too).
type RemoteStats struct {
	Connections    Connections       `json:"connections"`
	FallbackActive bool              `json:"fallback_active"` // serving from a local fallback while the server is away
	Errors         map[string]uint64 `json:"errors"`          // connection, timeout, other (ErrorTypeOf)
}

// Connections counts a client's connections to its server.
type Connections struct {
	Active int `json:"active"`
	Idle   int `json:"idle"`
}

// Errors callers branch on.
var (
	ErrInvalidConfig = errors.New("respcache: invalid config")
	ErrClosed        = errors.New("respcache: store closed")
	// ErrUnavailable wraps failures of a remote store (connection refused, time-out); ErrorTypeOf
	// counts it as a connection error.
	ErrUnavailable = errors.New("respcache: store unavailable")
)
