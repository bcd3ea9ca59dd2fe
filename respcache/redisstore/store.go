package redisstore

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/rueidis"
	"go.opentelemetry.io/otel/metric"

	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/internal/storeutil"
)

// Defaults of Config, from kvroute's response_cache.redis section.
const (
	// DefaultURL is the server a zero Config connects to.
	DefaultURL = "redis://127.0.0.1:6379"
	// DefaultKeyPrefix namespaces every key the store writes (key_prefix).
	DefaultKeyPrefix = "kvroute:resp:"
	// DefaultPoolSize is the connection pool size (pool_size).
	DefaultPoolSize = 8
	// DefaultConnectTimeout bounds a connection attempt (connect_timeout_ms).
	DefaultConnectTimeout = 3 * time.Second
	// DefaultCommandTimeout bounds each command (command_timeout_ms).
	DefaultCommandTimeout = time.Second
	// DefaultFallbackCapacity is the entry capacity of the in-memory fallback (fallback_capacity).
	DefaultFallbackCapacity = 1000
	// DefaultFallbackMaxBytes bounds the in-memory fallback's accounted size, so that an outage
	// cannot turn large cached responses into unbounded heap growth.
	DefaultFallbackMaxBytes = 64 << 20
	// DefaultFallbackTTL caps the TTL of entries stored in the fallback (fallback_ttl_seconds).
	DefaultFallbackTTL = 300 * time.Second
	// DefaultHealthInterval is the period of the health monitor.
	DefaultHealthInterval = 30 * time.Second
	// recoveryInterval bounds the health monitor's period while the fallback is active.
	recoveryInterval = time.Second
	// DefaultClientCacheTTL is the longest time a read is served from the client-side cache.
	DefaultClientCacheTTL = time.Minute
	// DefaultClientCacheBytes is the client-side cache size per connection.
	DefaultClientCacheBytes = 32 << 20
)

// Config configures a Store. The zero value means the documented defaults: a server at
// DefaultURL, key prefix DefaultKeyPrefix, fallback on. Durations and sizes must not be negative.
// String redacts the password.
//
// The connection fields (URL, TLS, TLSConfig, Username, Password, PoolSize, ConnectTimeout and
// ClientCacheBytes) configure the client New creates; NewWithClient, which uses the caller's
// client, rejects them.
type Config struct {
	// URL is redis://[user:password@]host:port[/db] or rediss://… for TLS (valkey:// and
	// valkeys:// are accepted too, and unix:///path/to/redis.sock[?db=N]; rueidis query options such
	// as ?dial_timeout= apply). "" means DefaultURL.
	URL string
	// TLS forces TLS with a redis:// URL. TLSConfig, when non-nil, is used for TLS (a custom CA,
	// client certificates); nil means TLS 1.2+ with the URL's host as ServerName.
	TLS       bool
	TLSConfig *tls.Config
	// Username and Password, when non-empty, replace the URL's user information.
	Username string
	Password string

	// KeyPrefix namespaces the store's keys; Clear removes only keys under it. It must not contain
	// glob characters (* ? [ ] \) because Clear matches on it. "" means DefaultKeyPrefix.
	KeyPrefix string
	// PoolSize is the connection pool size (rueidis' BlockingPoolSize). Ordinary commands are
	// auto-pipelined over a few shared connections, so PoolSize bounds the pool, not the number of
	// concurrent commands. 0 means DefaultPoolSize.
	PoolSize int
	// ConnectTimeout bounds a connection attempt; 0 means DefaultConnectTimeout.
	ConnectTimeout time.Duration
	// CommandTimeout bounds each command, on top of the caller's ctx; when it fires the store falls
	// back. 0 means DefaultCommandTimeout.
	CommandTimeout time.Duration
	// DefaultTTL is the TTL of a Set with ttl ≤ 0; 0 means respcache.DefaultTTL.
	DefaultTTL time.Duration

	// ClientSideCaching turns on server-assisted client-side caching (RESP3 CLIENT TRACKING, Redis
	// 6+): a Get is served from a local cache after the first read, for at most ClientCacheTTL, and
	// the server invalidates the local copy when the key changes. Writes of this store wait for
	// their own invalidation (each is pipelined with a PTTL of its key), so the store reads its own
	// writes; writes of other clients become visible once their invalidation arrives (normally well
	// under a millisecond). On a single server the store then uses one multiplexed connection.
	// With NewWithClient, Gets are cached only when the caller's client has client-side caching on
	// (otherwise each is a round trip), and the store reads its own writes at once only when that
	// client uses one connection per server (PipelineMultiplex -1, as New sets).
	ClientSideCaching bool
	// ClientCacheTTL bounds how long a locally cached value is served; 0 means
	// DefaultClientCacheTTL.
	ClientCacheTTL time.Duration
	// ClientCacheBytes is the local cache size per connection; 0 means DefaultClientCacheBytes.
	ClientCacheBytes int

	// DisableFallback turns the in-memory fallback off: an unreachable Redis then makes operations
	// fail with respcache.ErrUnavailable, and New fails when Redis is down. The zero value
	// (fallback on) is kvroute's fallback_to_memory: true.
	DisableFallback bool
	// FallbackCapacity is the fallback's entry capacity; 0 means DefaultFallbackCapacity.
	FallbackCapacity int
	// FallbackMaxBytes bounds the fallback's size (see respcache.MemoryConfig.MaxBytes); 0 means
	// DefaultFallbackMaxBytes.
	FallbackMaxBytes int64
	// FallbackTTL caps the TTL of fallback entries; 0 means DefaultFallbackTTL.
	FallbackTTL time.Duration
	// HealthInterval is the period of the health monitor (a PING under CommandTimeout) while
	// Redis serves; while the fallback is active the monitor looks every second when this is
	// longer. 0 means DefaultHealthInterval.
	HealthInterval time.Duration

	// MeterProvider receives the store's metrics (Metric* constants); nil means none.
	MeterProvider metric.MeterProvider
	// Logger receives fallback transitions (Warn when the fallback activates, Info when Redis is
	// back); nil means no logging. It is never called with a lock held.
	Logger *slog.Logger
}

// String describes the configuration with the password redacted (in the URL and in Password).
func (c Config) String() string {
	u := c.URL
	if u == "" {
		u = DefaultURL
	}
	return fmt.Sprintf("redisstore.Config{URL:%s TLS:%t Username:%q Password:%s KeyPrefix:%q PoolSize:%d "+
		"ConnectTimeout:%v CommandTimeout:%v DefaultTTL:%v ClientSideCaching:%t DisableFallback:%t "+
		"FallbackCapacity:%d FallbackTTL:%v HealthInterval:%v}",
		storeutil.RedactURL(u), c.TLS, c.Username, storeutil.Presence(c.Password), c.KeyPrefix, c.PoolSize,
		c.ConnectTimeout, c.CommandTimeout, c.DefaultTTL, c.ClientSideCaching, c.DisableFallback,
		c.FallbackCapacity, c.FallbackTTL, c.HealthInterval)
}

// GoString is String, so that %#v redacts too.
func (c Config) GoString() string { return c.String() }

// LogValue is String, so that slog redacts too.
func (c Config) LogValue() slog.Value { return slog.StringValue(c.String()) }

// Store is a respcache.CacheStore on Redis or Valkey (rueidis client) with an automatic in-memory
// fallback. All methods are safe for concurrent use. Keys are KeyPrefix+key; values are stored
// with SET key value PX ttl, so Redis expires them.
//
// Fallback: when a command fails with a connection error or a timeout (CommandTimeout fired), the
// store switches at once to an in-memory respcache.MemoryStore; the failing call itself is
// answered by the fallback (a Get is then a miss, a Set is stored there), so no request fails.
// While the fallback is active, every operation goes to it without touching the network. A health
// monitor goroutine PINGs Redis every HealthInterval (also when Redis is healthy, so that an
// outage is noticed between requests), and every second at most while the fallback is active, so
// that what is stored after Redis is back reaches Redis (and the other replicas) within about a
// second; on success it replays the Deletes (and a Clear) made
// during the outage and switches back to Redis. Entries Set during the outage stay in the
// fallback and are not copied to Redis. The fallback is emptied when it activates and again when
// Redis is back, so it never serves an entry from an earlier outage. A caller's cancelled or
// expired ctx never triggers the fallback. Server error replies (WRONGTYPE, NOAUTH, OOM…) are
// returned, not fallen back from, except replies that mean "not ready" (LOADING, MASTERDOWN,
// TRYAGAIN, CLUSTERDOWN, BUSY).
//
// New does not fail when Redis is down and the fallback is on: the store starts in fallback and
// the monitor keeps trying to connect. Close stops the monitor and closes the client the store
// created (never a caller's, see NewWithClient); it is idempotent. After Close every method
// returns respcache.ErrClosed (Stats still answers).
type Store struct {
	cfg       Config // normalised
	opt       rueidis.ClientOption
	ownClient bool // the store created the client and closes it
	secrets   []string
	desc      string
	log       *slog.Logger

	client   atomic.Pointer[redisClient] // nil until connected
	fallback *respcache.MemoryStore      // nil when DisableFallback
	active   atomic.Bool                 // fallback active
	closed   atomic.Bool
	inflight atomic.Int64

	// Operations to replay on Redis when it is back (guarded by pendingMu).
	pendingMu    sync.Mutex
	pendingDel   map[string]struct{}
	pendingClear bool
	pendingLost  bool

	hits, misses atomic.Uint64
	errs         respcache.ErrorCounts
	metrics      *storeMetrics

	closeOnce sync.Once
	stop      chan struct{}
	wg        sync.WaitGroup
}

// redisClient boxes the client interface for atomic.Pointer.
type redisClient struct{ c rueidis.Client }

var _ respcache.CacheStore = (*Store)(nil)

// New validates cfg, connects to Redis with a client of its own and, unless DisableFallback,
// starts the health monitor goroutine (stopped by Close, which also closes the client). Errors:
// respcache.ErrInvalidConfig (wrapped) for a bad field, URL or glob key prefix, or when the server
// refuses the connection settings (wrong password, no RESP3 for client-side caching);
// respcache.ErrUnavailable (wrapped) when Redis cannot be reached and the fallback is off. With
// the fallback on, an unreachable Redis is not an error: the store starts in fallback. An error
// from the MeterProvider is returned as is.
func New(cfg Config) (*Store, error) {
	if err := normalise(&cfg); err != nil {
		return nil, err
	}
	applyClientDefaults(&cfg)
	opt, err := clientOptions(cfg)
	if err != nil {
		return nil, err
	}
	s, err := newStore(cfg, true, storeutil.Secrets(opt.Password),
		fmt.Sprintf("redisstore.Store{URL:%s KeyPrefix:%q}", storeutil.RedactURL(cfg.URL), cfg.KeyPrefix))
	if err != nil {
		return nil, err
	}
	s.opt = opt
	c, err := rueidis.NewClient(opt)
	if err != nil {
		err = storeutil.Redact(err, s.secrets)
		typ := errorType(err)
		switch {
		case !storeutil.Unavailable(typ):
			s.metrics.close()
			return nil, fmt.Errorf("%w: redis: %w", respcache.ErrInvalidConfig, err)
		case s.fallback == nil:
			s.metrics.close()
			return nil, fmt.Errorf("%w: redis: %w", respcache.ErrUnavailable, err)
		}
		s.errs.Add(typ)
		s.metrics.CountError(typ)
		s.active.Store(true)
		s.log.Warn("redisstore: redis unreachable at start; in-memory fallback active",
			"store", s.desc, "error", err.Error())
	} else {
		s.client.Store(&redisClient{c})
	}
	s.startMonitor()
	return s, nil
}

// NewWithClient validates cfg and returns a store on the caller's client, for example one shared
// with a redisindex.Index on the same server. The store never closes client: close it after the
// store. cfg's connection fields (URL, TLS, TLSConfig, Username, Password, PoolSize,
// ConnectTimeout, ClientCacheBytes) must be zero, since they describe a client New would create;
// the rest apply as for New. NewWithClient does no I/O: an unreachable Redis is noticed by the
// first command or the health monitor's first PING, and then handled as by New's store (fallback,
// or respcache.ErrUnavailable with DisableFallback). Unless DisableFallback, it starts the health
// monitor goroutine, stopped by Close. A client with retries on falls back only when
// CommandTimeout fires; New's client has them off, so that a failure falls back at once.
//
// Stats and the connections gauge report Idle 0: the store does not know the caller's pool.
// Errors: respcache.ErrInvalidConfig (wrapped) for a nil client, a connection field set, or a bad
// field; an error from the MeterProvider is returned as is.
func NewWithClient(client rueidis.Client, cfg Config) (*Store, error) {
	if client == nil {
		return nil, fmt.Errorf("%w: redis: NewWithClient needs a client", respcache.ErrInvalidConfig)
	}
	var set []string
	for _, f := range []struct {
		name string
		set  bool
	}{
		{"URL", cfg.URL != ""}, {"TLS", cfg.TLS}, {"TLSConfig", cfg.TLSConfig != nil},
		{"Username", cfg.Username != ""}, {"Password", cfg.Password != ""}, {"PoolSize", cfg.PoolSize != 0},
		{"ConnectTimeout", cfg.ConnectTimeout != 0}, {"ClientCacheBytes", cfg.ClientCacheBytes != 0},
	} {
		if f.set {
			set = append(set, f.name)
		}
	}
	if len(set) > 0 {
		return nil, fmt.Errorf("%w: redis: %s configure a client of the store's own; set them on the client passed to NewWithClient",
			respcache.ErrInvalidConfig, strings.Join(set, ", "))
	}
	if err := normalise(&cfg); err != nil {
		return nil, err
	}
	s, err := newStore(cfg, false, nil, fmt.Sprintf("redisstore.Store{Client:caller's KeyPrefix:%q}", cfg.KeyPrefix))
	if err != nil {
		return nil, err
	}
	s.client.Store(&redisClient{client})
	s.startMonitor()
	return s, nil
}

// newStore builds the store around a normalised cfg: fallback and metrics, no client yet.
func newStore(cfg Config, ownClient bool, secrets []string, desc string) (*Store, error) {
	s := &Store{
		cfg:        cfg,
		ownClient:  ownClient,
		secrets:    secrets,
		desc:       desc,
		log:        storeutil.Logger(cfg.Logger),
		pendingDel: make(map[string]struct{}),
		stop:       make(chan struct{}),
	}
	if !cfg.DisableFallback {
		var err error
		s.fallback, err = respcache.NewMemory(respcache.MemoryConfig{Capacity: cfg.FallbackCapacity,
			MaxBytes: cfg.FallbackMaxBytes, DefaultTTL: cfg.FallbackTTL})
		if err != nil {
			return nil, err
		}
	}
	var err error
	if s.metrics, err = newStoreMetrics(cfg.MeterProvider, s); err != nil {
		return nil, err
	}
	return s, nil
}

// startMonitor starts the health monitor when there is a fallback to switch to and from.
func (s *Store) startMonitor() {
	if s.fallback != nil {
		s.wg.Add(1)
		go s.monitor()
	}
}

// normalise validates cfg and applies the defaults of the fields that do not configure the client.
func normalise(cfg *Config) error {
	switch {
	case cfg.PoolSize < 0, cfg.ConnectTimeout < 0, cfg.CommandTimeout < 0, cfg.DefaultTTL < 0,
		cfg.ClientCacheTTL < 0, cfg.ClientCacheBytes < 0, cfg.FallbackCapacity < 0,
		cfg.FallbackMaxBytes < 0, cfg.FallbackTTL < 0, cfg.HealthInterval < 0:
		return fmt.Errorf("%w: redis: negative size or duration in %v", respcache.ErrInvalidConfig, cfg)
	}
	if cfg.KeyPrefix == "" {
		cfg.KeyPrefix = DefaultKeyPrefix
	}
	if i := strings.IndexAny(cfg.KeyPrefix, `*?[]\`); i >= 0 {
		return fmt.Errorf("%w: redis key prefix %q contains the glob character %q", respcache.ErrInvalidConfig,
			cfg.KeyPrefix, cfg.KeyPrefix[i])
	}
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	def(&cfg.CommandTimeout, DefaultCommandTimeout)
	def(&cfg.DefaultTTL, respcache.DefaultTTL)
	def(&cfg.ClientCacheTTL, DefaultClientCacheTTL)
	def(&cfg.FallbackTTL, DefaultFallbackTTL)
	def(&cfg.HealthInterval, DefaultHealthInterval)
	if cfg.FallbackCapacity == 0 {
		cfg.FallbackCapacity = DefaultFallbackCapacity
	}
	if cfg.FallbackMaxBytes == 0 {
		cfg.FallbackMaxBytes = DefaultFallbackMaxBytes
	}
	return nil
}

// applyClientDefaults applies the defaults of the connection fields (New only).
func applyClientDefaults(cfg *Config) {
	if cfg.URL == "" {
		cfg.URL = DefaultURL
	}
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = DefaultConnectTimeout
	}
	if cfg.PoolSize == 0 {
		cfg.PoolSize = DefaultPoolSize
	}
	if cfg.ClientCacheBytes == 0 {
		cfg.ClientCacheBytes = DefaultClientCacheBytes
	}
}

// clientOptions builds the rueidis options. Parse errors never echo the URL (it may hold a password).
func clientOptions(cfg Config) (rueidis.ClientOption, error) {
	u, err := url.Parse(cfg.URL)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return rueidis.ClientOption{}, fmt.Errorf("%w: redis URL: %v", respcache.ErrInvalidConfig, err)
	}
	switch u.Scheme {
	case "redis", "rediss", "valkey", "valkeys", "unix":
	default:
		return rueidis.ClientOption{}, fmt.Errorf("%w: redis URL scheme %q: want redis, rediss, valkey, valkeys or unix",
			respcache.ErrInvalidConfig, u.Scheme)
	}
	opt, err := rueidis.ParseURL(cfg.URL)
	if err != nil {
		pw, _ := u.User.Password()
		return rueidis.ClientOption{}, fmt.Errorf("%w: redis URL: %w", respcache.ErrInvalidConfig,
			storeutil.Redact(err, storeutil.Secrets(pw)))
	}
	if cfg.TLS || cfg.TLSConfig != nil || opt.TLSConfig != nil {
		switch {
		case cfg.TLSConfig != nil:
			opt.TLSConfig = cfg.TLSConfig.Clone()
		case opt.TLSConfig == nil:
			opt.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12, ServerName: u.Hostname()}
		}
	}
	if cfg.Username != "" {
		opt.Username = cfg.Username
	}
	if cfg.Password != "" {
		opt.Password = cfg.Password
	}
	if !strings.Contains(u.RawQuery, "dial_timeout") {
		opt.Dialer.Timeout = cfg.ConnectTimeout
	}
	if !strings.Contains(u.RawQuery, "write_timeout") {
		opt.ConnWriteTimeout = max(cfg.ConnectTimeout, cfg.CommandTimeout)
	}
	opt.BlockingPoolSize = cfg.PoolSize
	opt.DisableRetry = true // a failure falls back at once instead of retrying until the deadline
	opt.DisableCache = !cfg.ClientSideCaching
	if cfg.ClientSideCaching {
		opt.CacheSizeEachConn = cfg.ClientCacheBytes
		opt.PipelineMultiplex = -1 // one connection: a write's invalidation reaches the cache it wrote through
	}
	return opt, nil
}

// String describes the store (server and key prefix, password redacted).
func (s *Store) String() string { return s.desc }

// GoString is String, so that %#v cannot print the configuration's password.
func (s *Store) GoString() string { return s.desc }

// FallbackActive reports whether the in-memory fallback is serving (Redis deemed unreachable).
// It is safe for concurrent use.
func (s *Store) FallbackActive() bool { return s.active.Load() }

// conn returns the client to use, or nil when the fallback serves.
func (s *Store) conn() rueidis.Client {
	if s.active.Load() {
		return nil
	}
	if c := s.client.Load(); c != nil {
		return c.c
	}
	return nil
}

func (s *Store) key(k string) string { return s.cfg.KeyPrefix + k }

// failed records a Redis error and decides what to do with it: it returns true when the caller
// should answer from the fallback (the fallback has just been activated, or already was), false
// when err must be returned (then wrapped for the caller).
func (s *Store) failed(ctx context.Context, op string, err error) (fallback bool, wrapped error) {
	err = storeutil.Redact(err, s.secrets)
	if s.closed.Load() {
		return false, respcache.ErrClosed
	}
	typ := errorType(err)
	if typ == "" { // the caller's cancellation
		return false, fmt.Errorf("redisstore: %s: %w", op, err)
	}
	s.errs.Add(typ)
	s.metrics.CountError(typ)
	if !storeutil.Unavailable(typ) {
		return false, fmt.Errorf("redisstore: %s: %w", op, err)
	}
	if ctx.Err() != nil { // the caller's deadline, not ours: answer, but do not blame Redis
		return false, fmt.Errorf("redisstore: %s: %w", op, err)
	}
	if s.fallback == nil {
		return false, fmt.Errorf("%w: redis %s: %w", respcache.ErrUnavailable, op, err)
	}
	s.activate(err)
	return true, nil
}

// activate switches to the fallback (no-op when already active).
func (s *Store) activate(cause error) {
	if s.fallback == nil || !s.active.CompareAndSwap(false, true) {
		return
	}
	_, _ = s.fallback.Clear(context.Background())
	s.log.Warn("redisstore: redis unavailable; in-memory fallback active", "store", s.desc, "error", cause.Error())
}

// Get returns key's value: from Redis (or its client-side cache), or from the fallback while it is
// active, or when this very call found Redis unreachable (then normally a miss). Cases:
// (value, true, nil) a hit, the slice is the caller's; (nil, false, nil) a miss; (nil, false, err)
// on a Redis error reply, on the caller's cancelled ctx (err wraps ctx.Err()), on a connection
// failure with DisableFallback (err wraps respcache.ErrUnavailable), or after Close
// (respcache.ErrClosed). ctx bounds the call together with CommandTimeout. Safe for concurrent use.
func (s *Store) Get(ctx context.Context, key string) ([]byte, bool, error) {
	if s.closed.Load() {
		return nil, false, respcache.ErrClosed
	}
	if c := s.conn(); c != nil {
		v, ok, err := s.redisGet(ctx, c, key)
		if err == nil {
			s.count(ok)
			return v, ok, nil
		}
		fb, werr := s.failed(ctx, "get", err)
		if !fb {
			return nil, false, werr
		}
	} else if s.fallback == nil {
		return nil, false, fmt.Errorf("%w: redis get: not connected", respcache.ErrUnavailable)
	}
	v, ok, err := s.fallback.Get(ctx, key)
	s.count(ok)
	return v, ok, err
}

func (s *Store) count(hit bool) {
	if hit {
		s.hits.Add(1)
	} else {
		s.misses.Add(1)
	}
}

func (s *Store) redisGet(ctx context.Context, c rueidis.Client, key string) ([]byte, bool, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.CommandTimeout)
	defer cancel()
	s.inflight.Add(1)
	start := time.Now()
	var (
		res    rueidis.RedisResult
		shared bool
	)
	if s.cfg.ClientSideCaching {
		res = c.DoCache(ctx, c.B().Get().Key(s.key(key)).Cache(), s.cfg.ClientCacheTTL)
		shared = true // the message is shared with the local cache
	} else {
		res = c.Do(ctx, c.B().Get().Key(s.key(key)).Build())
	}
	s.inflight.Add(-1)
	s.metrics.Latency(ctx, storeutil.OpGet, start)
	if err := res.Error(); err != nil {
		if rueidis.IsRedisNil(err) {
			return nil, false, nil
		}
		return nil, false, err
	}
	var v []byte
	if shared {
		str, err := res.ToString()
		if err != nil {
			return nil, false, err
		}
		v = []byte(str)
	} else {
		var err error
		if v, err = res.AsBytes(); err != nil {
			return nil, false, err
		}
	}
	if v == nil {
		v = []byte{}
	}
	return v, true, nil
}

// Set stores value under key for ttl (ttl ≤ 0: Config.DefaultTTL; Redis SET PX, rounded up to a
// whole millisecond). It returns nil when the value is stored in Redis, or in the fallback when it
// is active or this call found Redis unreachable (the fallback keeps it for at most FallbackTTL).
// An error wraps a Redis error reply, the caller's cancelled ctx, respcache.ErrUnavailable
// (DisableFallback), respcache.ErrTooLarge (a value larger than FallbackMaxBytes while in
// fallback) or is respcache.ErrClosed. value is not retained. Safe for concurrent use.
func (s *Store) Set(ctx context.Context, key string, value []byte, ttl time.Duration) error {
	if s.closed.Load() {
		return respcache.ErrClosed
	}
	if ttl <= 0 {
		ttl = s.cfg.DefaultTTL
	}
	if c := s.conn(); c != nil {
		k := s.key(key)
		err := s.redisWrite(ctx, c, storeutil.OpSet, k, c.B().Set().Key(k).Value(rueidis.BinaryString(value)).
			PxMilliseconds(ttlMillis(ttl)).Build())
		if err == nil {
			return nil
		}
		fb, werr := s.failed(ctx, "set", err)
		if !fb {
			return werr
		}
	} else if s.fallback == nil {
		return fmt.Errorf("%w: redis set: not connected", respcache.ErrUnavailable)
	}
	return s.fallback.Set(ctx, key, value, min(ttl, s.cfg.FallbackTTL))
}

func ttlMillis(ttl time.Duration) int64 {
	return int64((ttl + time.Millisecond - 1) / time.Millisecond)
}

// redisWrite runs a write command on key. With client-side caching the command is pipelined
// with a PTTL of the same key, which goes over the same connection: Redis sends that connection's
// invalidation of the key right after the write's reply, and the client applies it before it reads
// the PTTL's, so the store reads its own write afterwards.
func (s *Store) redisWrite(ctx context.Context, c rueidis.Client, op storeutil.Op, key string, cmd rueidis.Completed) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.CommandTimeout)
	defer cancel()
	s.inflight.Add(1)
	start := time.Now()
	var err error
	if s.cfg.ClientSideCaching {
		for _, r := range c.DoMulti(ctx, cmd, c.B().Pttl().Key(key).Build()) {
			if e := r.Error(); e != nil && err == nil {
				err = e
			}
		}
	} else {
		err = c.Do(ctx, cmd).Error()
	}
	s.inflight.Add(-1)
	s.metrics.Latency(ctx, op, start)
	return err
}

// Delete removes key (absent is not an error). While the fallback is active the key is removed from
// the fallback and remembered (up to FallbackCapacity keys), and the monitor deletes it from Redis
// when Redis is back, so that an invalidation made during an outage is not lost. Errors as for Set.
// Safe for concurrent use.
func (s *Store) Delete(ctx context.Context, key string) error {
	if s.closed.Load() {
		return respcache.ErrClosed
	}
	if c := s.conn(); c != nil {
		k := s.key(key)
		err := s.redisWrite(ctx, c, storeutil.OpDelete, k, c.B().Del().Key(k).Build())
		if err == nil {
			return nil
		}
		fb, werr := s.failed(ctx, "delete", err)
		if !fb {
			return werr
		}
	} else if s.fallback == nil {
		return fmt.Errorf("%w: redis delete: not connected", respcache.ErrUnavailable)
	}
	s.remember(key)
	return s.fallback.Delete(ctx, key)
}

// remember queues key for deletion on Redis when it is back.
func (s *Store) remember(key string) {
	s.pendingMu.Lock()
	if s.pendingClear {
		// Nothing to do: the whole prefix will be cleared.
	} else if len(s.pendingDel) < s.cfg.FallbackCapacity {
		s.pendingDel[key] = struct{}{}
	} else {
		s.pendingLost = true
	}
	s.pendingMu.Unlock()
}

// Clear removes every key under KeyPrefix (SCAN MATCH prefix* COUNT 1000, then UNLINK in batches;
// on a cluster, every node is scanned) and every fallback entry, and returns how many it removed.
// When Redis is unreachable (before or during the scan) the fallback is cleared, the Redis clear is
// deferred to the monitor's recovery, and the count covers what was removed so far; the error is
// then nil. Errors: a Redis error reply, the caller's cancelled ctx (err wraps ctx.Err(), with the
// count so far), respcache.ErrUnavailable without a fallback, respcache.ErrClosed. Each command
// is bounded by CommandTimeout; the whole Clear only by ctx. Keys written during a Clear may
// survive it. Safe for concurrent use.
func (s *Store) Clear(ctx context.Context) (int, error) {
	if s.closed.Load() {
		return 0, respcache.ErrClosed
	}
	n := 0
	if c := s.conn(); c != nil {
		m, err := s.clearRedis(ctx, c)
		n += m
		if err == nil {
			if s.fallback != nil {
				f, _ := s.fallback.Clear(ctx)
				n += f
			}
			return n, nil
		}
		fb, werr := s.failed(ctx, "clear", err)
		if !fb {
			return n, werr
		}
	} else if s.fallback == nil {
		return 0, fmt.Errorf("%w: redis clear: not connected", respcache.ErrUnavailable)
	}
	s.pendingMu.Lock()
	s.pendingClear = true
	clear(s.pendingDel)
	s.pendingMu.Unlock()
	f, _ := s.fallback.Clear(ctx)
	return n + f, nil
}

// clearRedis scans and unlinks the prefix's keys; it returns the number unlinked so far.
func (s *Store) clearRedis(ctx context.Context, c rueidis.Client) (int, error) {
	pattern := s.cfg.KeyPrefix + "*"
	nodes := map[string]rueidis.Client{"": c}
	cluster := c.Mode() == rueidis.ClientModeCluster
	if cluster {
		nodes = c.Nodes()
	}
	n := 0
	for _, node := range nodes {
		var cursor uint64
		for {
			cctx, cancel := context.WithTimeout(ctx, s.cfg.CommandTimeout)
			e, err := node.Do(cctx, node.B().Scan().Cursor(cursor).Match(pattern).Count(1000).Build()).AsScanEntry()
			cancel()
			if err != nil {
				return n, err
			}
			if len(e.Elements) > 0 {
				m, err := s.unlink(ctx, c, e.Elements, cluster)
				n += m
				if err != nil {
					return n, err
				}
			}
			cursor = e.Cursor
			if cursor == 0 {
				break
			}
		}
	}
	return n, nil
}

// unlink removes keys: one UNLINK on a single server, one UNLINK per key (pipelined, routed by
// slot) on a cluster. It returns how many keys existed.
func (s *Store) unlink(ctx context.Context, c rueidis.Client, keys []string, cluster bool) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.CommandTimeout)
	defer cancel()
	var cmds rueidis.Commands
	if cluster {
		for _, k := range keys {
			cmds = append(cmds, c.B().Unlink().Key(k).Build())
			if s.cfg.ClientSideCaching {
				cmds = append(cmds, c.B().Pttl().Key(k).Build()) // see redisWrite
			}
		}
	} else {
		cmds = append(cmds, c.B().Unlink().Key(keys...).Build())
		if s.cfg.ClientSideCaching {
			cmds = append(cmds, c.B().Pttl().Key(keys[0]).Build()) // one connection: see redisWrite
		}
	}
	total := 0
	for i, r := range c.DoMulti(ctx, cmds...) {
		if s.cfg.ClientSideCaching && i%2 == 1 {
			continue
		}
		n, err := r.AsInt64()
		if err != nil {
			return total, err
		}
		total += int(n)
	}
	return total, nil
}

// Stats reports Backend "redis", Entries -1 (Redis cannot count one prefix cheaply), the hits and
// misses of Get (Redis and fallback together), errors by type, and the Redis section:
// FallbackActive, the same error counts, and Connections — rueidis does not expose its pool, so
// Active is the number of commands this store has in flight and Idle is PoolSize − Active (never
// negative; 0 on a caller's client, see NewWithClient). It does no I/O; ctx is ignored. Safe for
// concurrent use, also after Close.
func (s *Store) Stats(context.Context) respcache.StoreStats {
	errs := s.errs.Snapshot()
	active := int(max(s.inflight.Load(), 0))
	return respcache.StoreStats{
		Backend: "redis",
		Entries: -1,
		Hits:    s.hits.Load(),
		Misses:  s.misses.Load(),
		Errors:  errs,
		Remote: &respcache.RemoteStats{
			Connections:    respcache.Connections{Active: active, Idle: max(s.cfg.PoolSize-active, 0)},
			FallbackActive: s.active.Load(),
			Errors:         s.errs.Snapshot(),
		},
	}
}

// Close stops the health monitor, waits for it, closes the Redis client the store created (a
// caller's client is left open) and unregisters the metrics. It is idempotent and safe for
// concurrent use; it always returns nil. Calls in flight when Close runs may return
// respcache.ErrClosed.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		s.closed.Store(true)
		close(s.stop)
		s.wg.Wait()
		if c := s.client.Load(); c != nil && s.ownClient {
			c.c.Close()
		}
		s.metrics.close()
	})
	return nil
}

// monitor is the health-monitor goroutine: every HealthInterval it connects when no client exists
// yet (New's store only), PINGs, activates the fallback on an unreachable Redis and, when Redis answers while the
// fallback is active, replays the outage's deletes and switches back.
func (s *Store) monitor() {
	defer s.wg.Done()
	// It wakes every second at most: every second in the fallback costs the other replicas what
	// this one stores, so while the fallback is active it looks for Redis at each wake-up.
	t := time.NewTicker(min(s.cfg.HealthInterval, recoveryInterval))
	defer t.Stop()
	last := time.Now()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
		if s.active.Load() || time.Since(last) >= s.cfg.HealthInterval {
			last = time.Now()
			s.check()
		}
	}
}

// check is one round of the monitor.
func (s *Store) check() {
	rc := s.client.Load()
	if rc == nil {
		c, err := rueidis.NewClient(s.opt)
		if err != nil {
			typ := errorType(storeutil.Redact(err, s.secrets))
			s.errs.Add(typ)
			s.metrics.CountError(typ)
			return
		}
		if s.closed.Load() { // Close is waiting for us; do not leak the new client
			c.Close()
			return
		}
		rc = &redisClient{c}
		s.client.Store(rc)
	}
	c := rc.c
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.CommandTimeout)
	err := c.Do(ctx, c.B().Ping().Build()).Error()
	cancel()
	if err != nil {
		err = storeutil.Redact(err, s.secrets)
		if typ := errorType(err); storeutil.Unavailable(typ) {
			if !s.active.Load() {
				s.errs.Add(typ)
				s.metrics.CountError(typ)
			}
			s.activate(err)
		}
		return
	}
	if !s.active.Load() {
		return
	}
	if err := s.replay(c); err != nil {
		return // stay in fallback; retry at the next tick
	}
	s.active.Store(false)
	_ = s.replay(c) // deletes that raced with the switch
	_, _ = s.fallback.Clear(context.Background())
	s.log.Info("redisstore: redis reachable again; fallback off", "store", s.desc)
}

// replay applies the Clear and Deletes made during the outage to Redis. On failure the pending work
// is kept.
func (s *Store) replay(c rueidis.Client) error {
	s.pendingMu.Lock()
	doClear, lost := s.pendingClear, s.pendingLost
	keys := make([]string, 0, len(s.pendingDel))
	for k := range s.pendingDel {
		keys = append(keys, s.key(k))
	}
	s.pendingMu.Unlock()
	if !doClear && len(keys) == 0 && !lost {
		return nil
	}
	ctx := context.Background()
	var err error
	if doClear {
		_, err = s.clearRedis(ctx, c)
	} else {
		cluster := c.Mode() == rueidis.ClientModeCluster
		for i := 0; i < len(keys) && err == nil; i += 1000 {
			_, err = s.unlink(ctx, c, keys[i:min(i+1000, len(keys))], cluster)
		}
	}
	if err != nil {
		return err
	}
	s.pendingMu.Lock()
	if doClear {
		s.pendingClear = false
	}
	for _, k := range keys {
		delete(s.pendingDel, strings.TrimPrefix(k, s.cfg.KeyPrefix))
	}
	s.pendingLost = false
	s.pendingMu.Unlock()
	if lost {
		s.log.Warn("redisstore: more deletes during the redis outage than FallbackCapacity; some were not replayed",
			"store", s.desc, "limit", strconv.Itoa(s.cfg.FallbackCapacity))
	}
	return nil
}
