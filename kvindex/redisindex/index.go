package redisindex

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/rueidis"
	"github.com/zeebo/xxh3"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

// Defaults of Config; the defaults shared with the in-memory index (block size, entry and
// speculative TTLs, tier weights) are kvindex's.
const (
	// DefaultKeyPrefix starts every key of an index whose Config.KeyPrefix is "".
	DefaultKeyPrefix = "kvroute:kvidx:"
	// DefaultConnectTimeout bounds dialling the client New creates.
	DefaultConnectTimeout = 3 * time.Second
	// DefaultCommandTimeout bounds each Lookup, LookupPrefix and Speculate: Route waits on
	// them, so a slow or unreachable Redis costs a request at most this long before the Router
	// falls back to consistent hashing.
	DefaultCommandTimeout = 50 * time.Millisecond
	// DefaultWriteTimeout bounds each round trip of Apply, ClearBackend, Stats and Clear,
	// which run off the request path and may carry large pipelines.
	DefaultWriteTimeout = 2 * time.Second
	// DefaultUnavailableBackoff is how long calls fail fast with kvindex.ErrUnavailable after a
	// connection failure before one call probes Redis again.
	DefaultUnavailableBackoff = 500 * time.Millisecond
	// DefaultEngineCacheSize is the number of engine-hash → our-key mappings each backend
	// keeps in process memory (about 80 bytes each).
	DefaultEngineCacheSize = 1 << 15
	// DefaultMaxBackends is the number of backend ids (slots per block) a key prefix hands
	// out; ids of backends idle for longer than EntryTTL (plus a minute) are reused.
	DefaultMaxBackends = 1024
	// DefaultLookupChunk is the number of blocks one Lookup round trip reads; a request with
	// more blocks costs one more round trip per chunk, only while some candidate still matches.
	DefaultLookupChunk = 1024
	// DefaultStatsExactLimit is the number of live memberships up to which Stats counts
	// distinct blocks and speculative entries exactly.
	DefaultStatsExactLimit = 50_000

	// keySpaceTag follows KeyPrefix in the name of every key that names or holds kvroute block
	// keys (blocks, engine-hash maps, per-backend member sets, prefix entries): the version of
	// the block-key function (prefixkey.KeySpace), so that routers of two versions sharing a
	// server during an upgrade never read each other's keys as their own; the old version's
	// keys expire with their TTL. The backend id registry (KeyPrefix ids, seen, idseq, epoch)
	// does not depend on it and is shared.
	keySpaceTag = "k" + string(rune('0'+prefixkey.KeySpace)) + ":"
	_           = uint(9 - prefixkey.KeySpace) // one digit

	// redisMaxTTL bounds EntryTTL.
	redisMaxTTL = 365 * 24 * time.Hour
	// redisIDReuseMargin is added to EntryTTL before an idle backend's id is reused: the
	// tolerated clock skew between replicas.
	redisIDReuseMargin = time.Minute
)

// Config configures an Index. The zero value of every field means its documented default; New
// needs one of Addr or URL.
//
// The connection fields (Addr, URL, Username, Password, TLS and ConnectTimeout) configure the
// client New creates; NewWithClient, which uses the caller's client, rejects them.
//
// kvroute's YAML (kv_cache_index with backend: redis) maps onto it as for kvindex.MemoryConfig:
// entry_ttl_seconds → EntryTTL, storage_offloading.enabled → StorageOffloading,
// storage_offloading.treat_eviction_as_offload → TreatEvictionAsOffload (the YAML's default is
// true; the proxy sets it), gpu/storage_tier_weight → TierWeights; the Redis URL and key prefix
// (kvroute's cr:kvidx:) → URL and KeyPrefix.
type Config struct {
	// Addr is the host:port of a Redis or Valkey server (or of one node of a cluster). URL is a
	// redis:// or rediss:// URL (rueidis.ParseURL); set at most one of them. Username, Password and
	// TLS, when set, override what the URL says.
	Addr     string
	URL      string
	Username string
	Password string
	TLS      *tls.Config
	// ConnectTimeout bounds dialling (default DefaultConnectTimeout). When Redis cannot be
	// reached at construction, New still succeeds for a single address (Addr or URL): the
	// index then talks to it as a standalone server and dials again on later calls. A Redis
	// Cluster deployment that must start while Redis is down should use NewWithClient.
	ConnectTimeout time.Duration
	// CommandTimeout is the deadline of one Lookup, LookupPrefix or Speculate, all of which run on
	// the routing path (default DefaultCommandTimeout, 50 ms). The caller's ctx deadline wins
	// when it is earlier. A call that misses it returns an error wrapping kvindex.ErrUnavailable.
	CommandTimeout time.Duration
	// WriteTimeout is the deadline of each round trip of Apply, ClearBackend, Stats and Clear
	// (default DefaultWriteTimeout).
	WriteTimeout time.Duration
	// UnavailableBackoff is how long every call fails fast with kvindex.ErrUnavailable after a
	// connection failure or timeout, before one call probes Redis again (default
	// DefaultUnavailableBackoff). It keeps a dead Redis from costing every request CommandTimeout.
	UnavailableBackoff time.Duration

	// KeyPrefix starts every key the index writes (default DefaultKeyPrefix). It must not
	// contain the glob characters * ? [ ] or a backslash, since Clear deletes the keys matching
	// KeyPrefix*. In Redis Cluster the keys of one lookup must live in one hash slot: put a hash
	// tag in the prefix, e.g. "kvroute:{kvidx}:" (New rejects a cluster client without one);
	// the whole index then lives on one shard. Give each index sharing a server its own prefix.
	// Entries live under KeyPrefix followed by the block-key version, "k2:" for
	// prefixkey.KeySpace 2: a router of another version neither reads nor counts them.
	KeyPrefix string
	// BlockSize is the number of tokens per kvroute block (default kvindex.DefaultBlockSize). Every
	// replica sharing a KeyPrefix must use the same.
	BlockSize int
	// DefaultModel roots the block keys of events from batches that name no model and no LoRA.
	DefaultModel string
	// EntryTTL is how long an entry lives after the last event that stored or refreshed it
	// (default kvindex.DefaultEntryTTL).
	EntryTTL time.Duration
	// SpeculativeTTL is the lifetime of Speculate's entries when it is passed 0 (default
	// kvindex.DefaultSpeculativeTTL). Speculative entries live at most EntryTTL.
	SpeculativeTTL time.Duration
	// TierWeights weight matched blocks (and prefix entries) by tier; all zero means
	// kvindex.DefaultTierWeights. Each must be in [0, 1].
	TierWeights kvindex.TierWeights
	// StorageOffloading tracks the storage tier of prefix entries (kvroute's
	// storage_offloading.enabled): cache_offloaded moves an entry to TierStorage. When false,
	// cache_offloaded removes the entry. Block events carry their own tier and are unaffected.
	StorageOffloading bool
	// TreatEvictionAsOffload makes cache_evicted move a prefix entry to TierStorage instead of
	// removing it. It applies only with StorageOffloading.
	TreatEvictionAsOffload bool
	// EngineCacheSize is the number of engine-hash → our-key mappings kept in process memory per
	// backend (default DefaultEngineCacheSize); a miss costs one extra read round trip.
	EngineCacheSize int
	// MaxBackends is the number of backend ids the key prefix hands out (default
	// DefaultMaxBackends, at most 65536). Every block string is 14 bytes × (highest id + 1).
	// Events and speculation of a backend beyond the limit are dropped (Dropped
	// ["too_many_backends"]). Every replica sharing a KeyPrefix should use the same.
	MaxBackends int
	// Now is the clock of entry expiry and of stats (default time.Now). Expiry times are written
	// into Redis as unix milliseconds of this clock and compared with the reader's clock, so every
	// replica sharing a KeyPrefix needs a synchronised clock (NTP); Redis key TTLs (in real time)
	// only reclaim memory.
	Now func() time.Time
}

// Index is a kvindex.KvCacheIndex kept in Redis or Valkey, shared by every router replica that uses
// the same server and KeyPrefix. All its methods are safe for concurrent use. Apply and
// ClearBackend of one backend are serialised by a per-backend mutex held across their round trips;
// Lookups take no lock besides a read lock on the backend table and never wait on writers in
// process.
//
// # Layout
//
// Backends are interned to small integer ids shared by every replica. With P the key prefix, b a
// backend name, k a kvroute block key and h an engine block hash (both 16 lowercase hex digits)
// and x a prefix key's hex:
//
//	P ids        HASH    b → id (assigned by a script: the id of the backend idle the longest when
//	                     idle for over EntryTTL + 1 min, else the next one; -1 for a backend with
//	                     prefix entries only)
//	P seen       ZSET    b, score = its last write (ms): the idle test of id reuse
//	P idseq      STRING  the next new id
//	P epoch      STRING  a random token that lives as long as the index's state (no TTL)
//	P b:<k>      STRING  one 14-byte slot per backend id, at offset 14·id:
//	                     bytes 0–5   big-endian expiry ms of the speculative (GPU) entry
//	                     bytes 6–7   the owner's tag: 16 bits of xxh3(backend name)
//	                     bytes 8–13  big-endian tiers<<44 | expiry ms of the confirmed entry
//	P e:<b>      HASH    h → tier mask digit ‖ our keys' hex (several when engine blocks are larger)
//	P mb:<b>     ZSET    k, score = confirmed expiry: b's confirmed blocks
//	P ms:<b>     ZSET    k, score = speculative expiry: b's speculative blocks
//	P p:<x>      ZSET    b, score = token count (kvroute's prefix entry: ZADD + EXPIRE pipelined,
//	                     read with ZREVRANGEBYSCORE +inf -inf WITHSCORES)
//	P pt:<x>     HASH    b → "<tier>:<expiry ms>"
//	P mp:<b>     ZSET    x, score = expiry: b's prefix entries
//
// A slot is written with SETRANGE — whole, or its tag with one half — from the tiers the writer
// knows the block is on (its in-process engine-hash cache, or the engine-hash map): writes are
// blind and idempotent, so replicas that all apply the same engine's events converge, and no
// write needs a script. A block on GPU and CPU removed from GPU stays on CPU (the slot's tier mask
// loses one bit; the remaining tiers' expiry is refreshed). Entries expire on the expiry in their
// slot, checked by readers with their own clock; every key also has a Redis TTL of EntryTTL from
// its last write, which reclaims the memory. The membership sets count entries for Stats, let
// ClearBackend find a backend's blocks without a keyspace scan, and are pruned of expired members
// by every Apply (ZREMRANGEBYSCORE).
//
// Readers ignore a slot whose tag is not the candidate's, so a slot written under a stale id
// (Redis restarted without persistence while replicas kept their cached ids, say) is never
// credited to another backend; every write pipeline also re-reads the writer's id and drops its
// cached id when Redis disagrees, and a cached id is re-read when unused for EntryTTL/2.
//
// # Losing Redis
//
// A Redis that restarts without persistence (or fails over to a replica that had not seen the
// writes, or is flushed) loses every entry, while the engines keep their caches and publish
// nothing about the blocks they already hold. The registry epoch P epoch tells: every write
// pipeline (Apply, Speculate, the last round trip of ClearBackend) ends with SET P epoch
// <random> NX and GET P epoch, and Lookup, LookupPrefix and BackendLost read it with a GET in the
// round trip they make anyway. The first epoch a process sees is adopted; after that, an epoch
// that a write had to create, or that is missing or changed, means the state was lost, whichever
// call comes first after the loss. The process then counts a new loss generation: every backend
// it has written for is lost until its next ClearBackend — Apply refuses its batches with
// kvindex.ErrBackendLost, and BackendLost (events.LossReporter) reports it, so that the events
// consumers clear it and catch up from the engine's replay buffer even when it receives neither
// traffic nor events. Another replica that recreated the epoch first changed it, so every
// replica notices. A Redis that reloads a snapshot keeps the snapshot's epoch: the writes made
// after the snapshot are lost unnoticed, until the engines store those blocks again or they
// expire.
//
// # Costs
//
// Lookup is one round trip for up to DefaultLookupChunk blocks: HMGET of the candidates' ids and
// GET of the epoch pipelined with MGET of the block strings; the walk (longest consecutive prefix
// per candidate, best tier per block) runs in Go. Redis does O(blocks) work whatever the number of
// candidates. Apply is one pipelined round trip of two commands per block (SETRANGE, PEXPIRE) and a
// few per event, plus one read round trip (HMGET of the engine-hash map, and the backend's id when
// this process has not used it lately) only when an event's parent or a removed block is neither in
// the batch nor in the in-process cache. Speculate is one round trip of two commands per block.
// ClearBackend costs one round trip per 512 of the backend's entries (ZPOPMIN of its membership
// sets, pipelined with the zeroing of the previous page's slots). Clear scans the keyspace (SCAN
// MATCH P*, UNLINK). Memory: 14 bytes × (highest backend id + 1) per block string plus Redis's
// per-key overhead, and one membership member per (block, backend).
//
// Stats counters (lookups, mutations, dropped events, expired memberships) are per process;
// sizes are read from the membership sets.
type Index struct {
	client    rueidis.Client
	ownClient bool
	closeOnce sync.Once
	closed    atomic.Bool

	base           string // Config.KeyPrefix (P): the backend id registry and Clear's scope
	prefix         string // P k<KeySpace>: every key that names or holds a block key
	idsKey         string // P ids
	seenKey        string // P seen
	idSeqKey       string // P idseq
	blockSize      int
	defaultModel   string
	entryTTL       time.Duration
	specTTL        time.Duration
	cmdTimeout     time.Duration
	writeTimeout   time.Duration
	backoff        time.Duration
	weights        kvindex.TierWeights
	evictOffload   bool
	offloading     bool
	engineCacheCap int
	maxBackends    int
	now            func() time.Time

	assignScript, statsScript redisScript

	mu       sync.RWMutex // guards backends
	backends map[string]*redisBackend

	// downUntil is the unix-nano time until which calls fail fast (0: Redis believed up).
	downUntil atomic.Int64

	// The registry epoch (redis_epoch.go). epochMu serialises the changes of epochKnown, epochVer
	// and lossGen; the fast path reads them without it.
	epochKey       string // P epoch
	epochMu        sync.Mutex
	epochKnown     atomic.Pointer[string] // the epoch this process knows; nil or "" when none yet
	epochVer       atomic.Uint64          // changes of epochKnown so far (adoptions and losses)
	lossGen        atomic.Uint64          // losses detected so far
	epochCheckedAt atomic.Int64           // unix nanos of the last verdict

	counters redisCounters
}

// Compile-time check that Index implements kvindex.KvCacheIndex.
var _ kvindex.KvCacheIndex = (*Index)(nil)

// redisBackend is the per-process state of one backend.
type redisBackend struct {
	mu    sync.Mutex // serialises Apply and ClearBackend of the backend; guards cache and w
	cache *redisEngineCache
	w     redisWriter  // Apply's buffers, reused
	id    atomic.Int64 // slot index; -1 until known (or when every id is taken)
	tag   uint16       // redisTag(name)
	idAt  atomic.Int64 // when id was last confirmed by a write, unix ms of the index clock
	// gen is the loss generation (Index.lossGen) the backend's state in Redis belongs to,
	// and dirty says that it has some: this process wrote for the backend (or may have) since it
	// last cleared it. The backend is lost while it is dirty and gen is older than the index's.
	gen   atomic.Uint64
	dirty atomic.Bool

	name        string
	engineKey   string // P e:<b>
	blocksKey   string // P mb:<b>
	specKey     string // P ms:<b>
	prefixesKey string // P mp:<b>
}

// New returns an index on the Redis or Valkey server that cfg's Addr or URL names, through a
// client of its own (client-side caching off: entries change with every engine event), which
// Close closes. It validates cfg (errors wrap kvindex.ErrInvalidConfig, also for a cfg without
// Addr and URL) and connects within ConnectTimeout; an unreachable single server is not an error
// (see Config.ConnectTimeout), other client errors wrap kvindex.ErrUnavailable. The index starts
// no goroutine besides the client's own.
func New(cfg Config) (*Index, error) {
	if cfg.Addr == "" && cfg.URL == "" {
		return nil, fmt.Errorf("%w: one of Addr or URL is required", kvindex.ErrInvalidConfig)
	}
	x, err := newIndex(cfg)
	if err != nil {
		return nil, err
	}
	connect := cfg.ConnectTimeout
	if connect == 0 {
		connect = DefaultConnectTimeout
	}
	c, err := newRedisClient(cfg, connect)
	if err != nil {
		return nil, err
	}
	x.client, x.ownClient = c, true
	if err := x.checkCluster(); err != nil {
		c.Close()
		return nil, err
	}
	return x, nil
}

// NewWithClient returns an index on the caller's client, for example one shared with the
// response cache's redisstore.Store (redisstore.NewWithClient) on the same server: one client per
// Redis URL. The index never closes client: close it after the index. cfg's connection fields
// (Addr, URL, Username, Password, TLS, ConnectTimeout) must be zero, since they describe a client
// New would create; the rest apply as for New. A client with client-side caching on works but
// gains nothing (the index reads no key twice between writes). NewWithClient does no I/O: an
// unreachable Redis is noticed by the first call. Errors wrap
// kvindex.ErrInvalidConfig: a nil client, a connection field set, a bad field, or a Redis
// Cluster client with a KeyPrefix without a hash tag.
func NewWithClient(client rueidis.Client, cfg Config) (*Index, error) {
	if client == nil {
		return nil, fmt.Errorf("%w: NewWithClient needs a client", kvindex.ErrInvalidConfig)
	}
	var set []string
	for _, f := range []struct {
		name string
		set  bool
	}{
		{"Addr", cfg.Addr != ""}, {"URL", cfg.URL != ""}, {"Username", cfg.Username != ""},
		{"Password", cfg.Password != ""}, {"TLS", cfg.TLS != nil}, {"ConnectTimeout", cfg.ConnectTimeout != 0},
	} {
		if f.set {
			set = append(set, f.name)
		}
	}
	if len(set) > 0 {
		return nil, fmt.Errorf("%w: %s configure a client of the index's own; set them on the client passed to NewWithClient",
			kvindex.ErrInvalidConfig, strings.Join(set, ", "))
	}
	x, err := newIndex(cfg)
	if err != nil {
		return nil, err
	}
	x.client = client
	if err := x.checkCluster(); err != nil {
		return nil, err
	}
	return x, nil
}

// newIndex returns an index configured by cfg (defaults applied and validated), without a client.
func newIndex(cfg Config) (*Index, error) {
	x := &Index{
		prefix:         cfg.KeyPrefix,
		blockSize:      cfg.BlockSize,
		defaultModel:   cfg.DefaultModel,
		entryTTL:       cfg.EntryTTL,
		specTTL:        cfg.SpeculativeTTL,
		cmdTimeout:     cfg.CommandTimeout,
		writeTimeout:   cfg.WriteTimeout,
		backoff:        cfg.UnavailableBackoff,
		weights:        cfg.TierWeights,
		evictOffload:   cfg.TreatEvictionAsOffload,
		offloading:     cfg.StorageOffloading,
		engineCacheCap: cfg.EngineCacheSize,
		maxBackends:    cfg.MaxBackends,
		now:            cfg.Now,
		backends:       make(map[string]*redisBackend),
		assignScript:   newRedisScript(luaAssignID, false),
		statsScript:    newRedisScript(luaStats, true),
	}
	if err := x.applyDefaults(cfg); err != nil {
		return nil, err
	}
	x.base = x.prefix
	x.idsKey, x.seenKey, x.idSeqKey = x.base+"ids", x.base+"seen", x.base+"idseq"
	x.epochKey = x.base + "epoch"
	x.prefix = x.base + keySpaceTag
	return x, nil
}

// checkCluster rejects a Redis Cluster client when the key prefix has no hash tag: the keys of
// one lookup must live in one slot.
func (x *Index) checkCluster() error {
	if x.client.Mode() == rueidis.ClientModeCluster && !redisHasHashTag(x.base) {
		return fmt.Errorf("%w: KeyPrefix %q needs a hash tag such as {kvidx} for Redis Cluster", kvindex.ErrInvalidConfig, x.base)
	}
	return nil
}

// applyDefaults fills in defaults and validates cfg.
func (x *Index) applyDefaults(cfg Config) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", kvindex.ErrInvalidConfig, fmt.Sprintf(format, args...))
	}
	if cfg.Addr != "" && cfg.URL != "" {
		return bad("set Addr or URL, not both")
	}
	if x.prefix == "" {
		x.prefix = DefaultKeyPrefix
	}
	if strings.ContainsAny(x.prefix, "*?[]\\") {
		return bad("KeyPrefix %q contains a glob character (* ? [ ] \\)", x.prefix)
	}
	if x.blockSize == 0 {
		x.blockSize = kvindex.DefaultBlockSize
	}
	if x.blockSize < 1 || x.blockSize > 1<<16 {
		return bad("BlockSize %d not in [1, 65536]", x.blockSize)
	}
	for _, d := range []struct {
		name string
		v    *time.Duration
		def  time.Duration
	}{
		{"EntryTTL", &x.entryTTL, kvindex.DefaultEntryTTL},
		{"SpeculativeTTL", &x.specTTL, kvindex.DefaultSpeculativeTTL},
		{"CommandTimeout", &x.cmdTimeout, DefaultCommandTimeout},
		{"WriteTimeout", &x.writeTimeout, DefaultWriteTimeout},
		{"UnavailableBackoff", &x.backoff, DefaultUnavailableBackoff},
	} {
		if *d.v == 0 {
			*d.v = d.def
		}
		if *d.v < 0 {
			return bad("%s %v < 0", d.name, *d.v)
		}
	}
	if cfg.ConnectTimeout < 0 {
		return bad("ConnectTimeout %v < 0", cfg.ConnectTimeout)
	}
	if x.entryTTL < time.Millisecond || x.specTTL < time.Millisecond {
		return bad("EntryTTL and SpeculativeTTL must be at least 1ms")
	}
	if x.entryTTL > redisMaxTTL {
		return bad("EntryTTL %v > %v", x.entryTTL, redisMaxTTL)
	}
	x.specTTL = min(x.specTTL, x.entryTTL)
	if x.weights == (kvindex.TierWeights{}) {
		x.weights = kvindex.DefaultTierWeights()
	}
	for t, w := range x.weights {
		if !(w >= 0 && w <= 1) {
			return bad("TierWeights[%s] = %v is outside [0, 1]", kvindex.Tier(t), w)
		}
	}
	if x.engineCacheCap == 0 {
		x.engineCacheCap = DefaultEngineCacheSize
	}
	if x.engineCacheCap < 0 {
		return bad("EngineCacheSize %d < 0", x.engineCacheCap)
	}
	if x.maxBackends == 0 {
		x.maxBackends = DefaultMaxBackends
	}
	if x.maxBackends < 1 || x.maxBackends > 1<<16 {
		return bad("MaxBackends %d not in [1, 65536]", x.maxBackends)
	}
	if x.now == nil {
		x.now = time.Now
	}
	return nil
}

// redisHasHashTag reports whether s holds a Redis Cluster hash tag: a '{' followed later by '}'
// with at least one byte between them.
func redisHasHashTag(s string) bool {
	i := strings.IndexByte(s, '{')
	if i < 0 {
		return false
	}
	j := strings.IndexByte(s[i+1:], '}')
	return j > 0
}

// newRedisClient creates the index's own client. When the first connection fails for a network
// reason and cfg names a single server, it returns a single-server client that dials again on each
// later call instead of failing: a router must start while Redis is down.
func newRedisClient(cfg Config, connectTimeout time.Duration) (rueidis.Client, error) {
	var opt rueidis.ClientOption
	if cfg.URL != "" {
		o, err := rueidis.ParseURL(cfg.URL)
		if err != nil {
			return nil, fmt.Errorf("%w: URL: %v", kvindex.ErrInvalidConfig, err)
		}
		opt = o
	} else {
		opt.InitAddress = []string{cfg.Addr}
	}
	if cfg.Username != "" {
		opt.Username = cfg.Username
	}
	if cfg.Password != "" {
		opt.Password = cfg.Password
	}
	if cfg.TLS != nil {
		opt.TLSConfig = cfg.TLS
	}
	opt.Dialer.Timeout = connectTimeout
	opt.DisableCache = true // no client-side caching: entries change with every engine event
	c, err := rueidis.NewClient(opt)
	if err == nil {
		return c, nil
	}
	if _, isRedis := rueidis.IsRedisErr(err); isRedis || len(opt.InitAddress) != 1 || opt.Sentinel.MasterSet != "" {
		return nil, fmt.Errorf("%w: %w", kvindex.ErrUnavailable, err)
	}
	// Unreachable: build a lazily connecting single-server client. Its constructor dials once more;
	// make that attempt fail at once so that construction costs one ConnectTimeout, not two.
	var constructed atomic.Bool
	opt.ForceSingleClient = true
	opt.DialCtxFn = func(ctx context.Context, addr string, d *net.Dialer, tc *tls.Config) (net.Conn, error) {
		if !constructed.Load() {
			return nil, err
		}
		if tc != nil {
			td := tls.Dialer{NetDialer: d, Config: tc}
			return td.DialContext(ctx, "tcp", addr)
		}
		return d.DialContext(ctx, "tcp", addr)
	}
	c, err2 := rueidis.NewClient(opt)
	constructed.Store(true)
	if c == nil {
		return nil, fmt.Errorf("%w: %w", kvindex.ErrUnavailable, errors.Join(err, err2))
	}
	return c, nil
}

// Close releases the client when New created it (NewWithClient's client is left open). Later calls
// of any method return kvindex.ErrClosed. It is idempotent, safe for concurrent use, and returns
// nil.
func (x *Index) Close() error {
	x.closeOnce.Do(func() {
		x.closed.Store(true)
		if x.ownClient {
			x.client.Close()
		}
	})
	return nil
}

// BlockSize returns the number of tokens per block the index keys by.
func (x *Index) BlockSize() int { return x.blockSize }

// ---- round trips, deadlines and the fail-fast breaker ----

// redisNoCancel is the CancelFunc of a context that needed no deadline of its own.
func redisNoCancel() {}

// redisWithTimeout returns ctx bounded by d, unless ctx already ends sooner.
func redisWithTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= d {
		return ctx, redisNoCancel
	}
	return context.WithTimeout(ctx, d)
}

// errRedisBackingOff is the cause of fail-fast errors while the breaker is open.
var errRedisBackingOff = errors.New("backing off after a connection failure")

// admit returns nil when a call may go to Redis: the breaker is closed, or it is open, its backoff
// has passed and this caller won the right to probe (every other caller keeps failing fast until
// the probe answers or another backoff passes).
func (x *Index) admit() error {
	if x.closed.Load() {
		return kvindex.ErrClosed
	}
	until := x.downUntil.Load()
	if until == 0 {
		return nil
	}
	now := time.Now().UnixNano()
	if now >= until && x.downUntil.CompareAndSwap(until, now+int64(x.backoff)) {
		return nil
	}
	return fmt.Errorf("%w: %w", kvindex.ErrUnavailable, errRedisBackingOff)
}

// observe updates the breaker with the outcome of a round trip made under parent: a success closes
// it; a connection failure or a deadline of our own opens it for the backoff. Errors caused by
// parent ending are the caller's, not Redis's, and leave it alone.
func (x *Index) observe(parent context.Context, err error) {
	if err == nil {
		if x.downUntil.Load() != 0 {
			x.downUntil.Store(0)
		}
		return
	}
	if _, isRedis := rueidis.IsRedisErr(err); isRedis || parent.Err() != nil {
		return
	}
	x.downUntil.Store(time.Now().UnixNano() + int64(x.backoff))
}

// unavailable wraps err (not nil) as the error of a failed call.
func redisUnavailable(op string, err error) error {
	if errors.Is(err, kvindex.ErrUnavailable) || errors.Is(err, kvindex.ErrClosed) {
		return err
	}
	return fmt.Errorf("%w: %s: %w", kvindex.ErrUnavailable, op, err)
}

// doMulti sends cmds in one round trip under a deadline of timeout and returns their results. err
// is the first connection-level error (every result is then unusable); Redis error replies stay in
// their results. The breaker is updated.
func (x *Index) doMulti(ctx context.Context, timeout time.Duration, cmds []rueidis.Completed) ([]rueidis.RedisResult, error) {
	cctx, cancel := redisWithTimeout(ctx, timeout)
	defer cancel()
	return x.doMultiIn(ctx, cctx, cmds)
}

// doMultiIn is doMulti under cctx, a context derived from the caller's ctx with the deadline of a
// whole multi-round-trip call.
func (x *Index) doMultiIn(ctx, cctx context.Context, cmds []rueidis.Completed) ([]rueidis.RedisResult, error) {
	if err := x.admit(); err != nil {
		return nil, err
	}
	res := x.client.DoMulti(cctx, cmds...)
	var err error
	for i := range res {
		if e := res[i].NonRedisError(); e != nil {
			err = e
			break
		}
	}
	x.observe(ctx, err)
	return res, err
}

// do is doMulti for one command; err also holds a Redis error reply.
func (x *Index) do(ctx context.Context, timeout time.Duration, cmd rueidis.Completed) (rueidis.RedisResult, error) {
	if err := x.admit(); err != nil {
		return rueidis.RedisResult{}, err
	}
	cctx, cancel := redisWithTimeout(ctx, timeout)
	res := x.client.Do(cctx, cmd)
	cancel()
	err := res.Error()
	x.observe(ctx, res.NonRedisError())
	return res, err
}

// evalsha builds an EVALSHA (EVALSHA_RO for a read-only script) of s.
func (x *Index) evalsha(s *redisScript, keys, args []string) rueidis.Completed {
	if s.readOnly {
		return x.client.B().EvalshaRo().Sha1(s.sha).Numkeys(int64(len(keys))).Key(keys...).Arg(args...).Build()
	}
	return x.client.B().Evalsha().Sha1(s.sha).Numkeys(int64(len(keys))).Key(keys...).Arg(args...).Build()
}

// eval builds an EVAL (EVAL_RO) of s, for the NOSCRIPT fallback.
func (x *Index) eval(s *redisScript, keys, args []string) rueidis.Completed {
	if s.readOnly {
		return x.client.B().EvalRo().Script(s.src).Numkeys(int64(len(keys))).Key(keys...).Arg(args...).Build()
	}
	return x.client.B().Eval().Script(s.src).Numkeys(int64(len(keys))).Key(keys...).Arg(args...).Build()
}

// redisIsNoScript reports whether err is Redis's NOSCRIPT reply.
func redisIsNoScript(err error) bool {
	re, ok := rueidis.IsRedisErr(err)
	return ok && re.IsNoScript()
}

// redisScriptCall is one call of a script.
type redisScriptCall struct {
	keys, args []string
}

// runScript runs calls of s in one round trip (EVALSHA), and the ones that got NOSCRIPT again with
// EVAL in a second. It returns one result per call, or the connection-level error.
func (x *Index) runScript(ctx context.Context, timeout time.Duration, s *redisScript, calls []redisScriptCall) ([]rueidis.RedisResult, error) {
	cmds := make([]rueidis.Completed, len(calls))
	for i, c := range calls {
		cmds[i] = x.evalsha(s, c.keys, c.args)
	}
	res, err := x.doMulti(ctx, timeout, cmds)
	if err != nil {
		return nil, err
	}
	var retry []int
	for i := range res {
		if redisIsNoScript(res[i].Error()) {
			retry = append(retry, i)
		}
	}
	if len(retry) == 0 {
		return res, nil
	}
	cmds = cmds[:0]
	for _, i := range retry {
		cmds = append(cmds, x.eval(s, calls[i].keys, calls[i].args))
	}
	res2, err := x.doMulti(ctx, timeout, cmds)
	if err != nil {
		return nil, err
	}
	for j, i := range retry {
		res[i] = res2[j]
	}
	return res, nil
}

// ---- key names and backends ----

const redisHexDigits = "0123456789abcdef"

// redisAppendHex16 appends v as 16 lowercase hex digits.
func redisAppendHex16(b []byte, v uint64) []byte {
	for s := 60; s >= 0; s -= 4 {
		b = append(b, redisHexDigits[(v>>uint(s))&15])
	}
	return b
}

// redisParseHex16 parses 16 hex digits.
func redisParseHex16(s string) (uint64, bool) {
	if len(s) != 16 {
		return 0, false
	}
	v, err := strconv.ParseUint(s, 16, 64)
	return v, err == nil
}

// redisBlockKeyLen is the length of the name "P b:<16 hex>".
func (x *Index) redisBlockKeyLen() int { return len(x.prefix) + 2 + 16 }

// appendRedisBlockKey appends the name of block k's string.
func (x *Index) appendRedisBlockKey(b []byte, k uint64) []byte {
	b = append(b, x.prefix...)
	b = append(b, "b:"...)
	return redisAppendHex16(b, k)
}

// blockKeyNames returns the names of keys' block strings, substrings of one allocation.
func (x *Index) blockKeyNames(keys []uint64) []string {
	kl := x.redisBlockKeyLen()
	buf := make([]byte, 0, kl*len(keys))
	for _, k := range keys {
		buf = x.appendRedisBlockKey(buf, k)
	}
	all := string(buf)
	names := make([]string, len(keys))
	for i := range names {
		names[i] = all[i*kl : (i+1)*kl]
	}
	return names
}

// backend returns the per-process state of backend, creating it on first use.
func (x *Index) backend(name string) *redisBackend {
	x.mu.RLock()
	st := x.backends[name]
	x.mu.RUnlock()
	if st != nil {
		return st
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if st = x.backends[name]; st == nil {
		st = &redisBackend{
			name:        name,
			cache:       newRedisEngineCache(x.engineCacheCap),
			engineKey:   x.prefix + "e:" + name,
			blocksKey:   x.prefix + "mb:" + name,
			specKey:     x.prefix + "ms:" + name,
			prefixesKey: x.prefix + "mp:" + name,
		}
		st.id.Store(-1)
		st.gen.Store(x.lossGen.Load())
		st.tag = redisTag(name)
		x.backends[name] = st
	}
	return st
}

// ---- slots ----

// Slot layout: [spec 6 | tag 2 | confirmed 6]. Writes cover spec+tag, tag+confirmed or the whole
// slot, so that every write also stamps the owner's tag.
const (
	redisSlotSize  = 14
	redisTagOff    = 6
	redisConfOff   = 8
	redisExpBits   = 44 // expiry ms < 2^44 (year 2527)
	redisExpMask   = 1<<redisExpBits - 1
	redisTierShift = redisExpBits
)

// redisTag is the 16-bit owner tag of backend name's slots.
func redisTag(name string) uint16 { return uint16(xxh3.HashString(name)) }

// redisPut48 writes v's low 48 bits big-endian into b[:6].
func redisPut48(b []byte, v uint64) {
	_ = b[5]
	b[0], b[1], b[2], b[3], b[4], b[5] = byte(v>>40), byte(v>>32), byte(v>>24), byte(v>>16), byte(v>>8), byte(v)
}

// redisGet48 reads 48 bits big-endian from s[off:off+6].
func redisGet48(s string, off int) uint64 {
	_ = s[off+5]
	return uint64(s[off])<<40 | uint64(s[off+1])<<32 | uint64(s[off+2])<<24 |
		uint64(s[off+3])<<16 | uint64(s[off+4])<<8 | uint64(s[off+5])
}

// redisSlot returns a whole slot: speculative expiry, tag, and the confirmed word of tiers and
// expiry (tiers 0: no confirmed entry).
func redisSlot(spec int64, tag uint16, tiers uint8, exp int64) [redisSlotSize]byte {
	var b [redisSlotSize]byte
	redisPut48(b[:], uint64(spec))
	b[redisTagOff], b[redisTagOff+1] = byte(tag>>8), byte(tag)
	if tiers&7 != 0 {
		redisPut48(b[redisConfOff:], uint64(tiers&7)<<redisTierShift|uint64(exp)&redisExpMask)
	}
	return b
}

// redisSlotTier decodes the slot of backend id (tag tag) in block string v at time now (ms):
// whether the backend holds the block, its best tier (a live confirmed entry wins over a
// speculative one, which counts as GPU), and whether it holds the block on TierStorage (a live
// confirmed entry whose tiers include storage, whatever its best tier). A slot stamped with
// another tag is not the backend's.
func redisSlotTier(v string, id int, tag uint16, now int64) (best kvindex.Tier, storage, ok bool) {
	off := id * redisSlotSize
	if id < 0 || len(v) < off+redisConfOff { // a speculative write may end the string at the tag
		return 0, false, false
	}
	if uint16(v[off+redisTagOff])<<8|uint16(v[off+redisTagOff+1]) != tag {
		return 0, false, false
	}
	var w uint64
	if len(v) >= off+redisSlotSize {
		w = redisGet48(v, off+redisConfOff)
	}
	if tiers := uint8(w >> redisTierShift); tiers&7 != 0 && int64(w&redisExpMask) > now {
		storage = tiers&(1<<events.TierStorage) != 0
		switch {
		case tiers&(1<<events.TierGPU) != 0:
			return events.TierGPU, storage, true
		case tiers&(1<<events.TierCPU) != 0:
			return events.TierCPU, storage, true
		default:
			return events.TierStorage, true, true
		}
	}
	if int64(redisGet48(v, off)) > now {
		return events.TierGPU, false, true
	}
	return 0, false, false
}

// ---- counters ----

// redisCounters are the per-process counters of Stats.
type redisCounters struct {
	lookups   atomic.Uint64
	expired   atomic.Uint64
	mutations [kvindex.NumMutations]atomic.Uint64
	dropped   [kvindex.NumDropReasons]atomic.Uint64
}
