package s3store

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	"go.opentelemetry.io/otel/metric"

	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/internal/storeutil"
)

// Defaults of Config, from kvroute's response_cache.l2 section.
const (
	// DefaultKeyPrefix is the folder of the bucket the store owns (l2.key_prefix).
	DefaultKeyPrefix = "response-cache/"
	// DefaultRegion is the region used for signing (l2.region).
	DefaultRegion = "us-east-1"
	// DefaultOpTimeout bounds each S3 request.
	DefaultOpTimeout = 5 * time.Second
	// DefaultCooldown is how long the store fails fast after S3 was found unreachable.
	DefaultCooldown = 5 * time.Second
)

// ExpiresMeta is the user-metadata key (sent as the header X-Amz-Meta-Kvroute-Expires) holding an
// object's expiry in Unix milliseconds: S3 has no per-object TTL.
const ExpiresMeta = "Kvroute-Expires"

// maxReapQueue bounds the expired objects waiting for background deletion.
const maxReapQueue = 128

// Config configures a Store (any S3-compatible service: AWS S3, VAST, MinIO, versitygw…).
// Endpoint and Bucket are required; the rest has defaults. String redacts the keys.
type Config struct {
	// Endpoint is "https://host[:port]" or "http://host[:port]", or "host[:port]" with Secure
	// choosing TLS. A path or user information in the URL is rejected.
	Endpoint string
	// Secure selects HTTPS for an Endpoint without a scheme.
	Secure bool
	// Bucket is the pre-created bucket; New checks that it exists.
	Bucket string
	// KeyPrefix is the folder of the bucket the store owns: objects are KeyPrefix + the key
	// (escaped, see Store); Clear removes everything under it. "" means DefaultKeyPrefix.
	KeyPrefix string
	// Region is the signing region; "" means DefaultRegion.
	Region string
	// AccessKey and SecretKey are static credentials; both empty means anonymous access. They are
	// redacted from String and from every error the store returns.
	AccessKey string
	SecretKey string

	// DefaultTTL is the TTL of a Set with ttl ≤ 0; 0 means respcache.DefaultTTL.
	DefaultTTL time.Duration
	// TTLOverride, when > 0, is the TTL of every Set whatever its ttl argument (l2.ttl_override).
	TTLOverride time.Duration
	// OpTimeout bounds each S3 request on top of the caller's ctx (also dial and response-header
	// timeouts of the built-in transport); 0 means DefaultOpTimeout.
	OpTimeout time.Duration
	// Cooldown: after a connection failure or a timeout the store fails fast with
	// respcache.ErrUnavailable for Cooldown, then lets one request through as a probe; a success
	// closes the circuit. It keeps an unreachable S3 from costing every request an OpTimeout. 0
	// means DefaultCooldown; negative disables it.
	Cooldown time.Duration

	// Transport, when non-nil, carries the HTTP requests (proxies, custom CAs); nil means a
	// built-in transport without proxy, bounded by OpTimeout, closed by Close.
	Transport http.RoundTripper
	// Now is the clock of object expiry; nil means time.Now. It must be safe for concurrent use.
	Now func() time.Time
	// MeterProvider receives the store's metrics (telemetry.MetricCacheS3Latency, telemetry.MetricCacheS3Errors); nil means none.
	MeterProvider metric.MeterProvider
	// Logger receives warnings (S3 unreachable at start); nil means no logging.
	Logger *slog.Logger
}

// String describes the configuration with AccessKey and SecretKey redacted.
func (c Config) String() string {
	return fmt.Sprintf("s3store.Config{Endpoint:%q Secure:%t Bucket:%q KeyPrefix:%q Region:%q AccessKey:%s SecretKey:%s "+
		"DefaultTTL:%v TTLOverride:%v OpTimeout:%v Cooldown:%v}",
		storeutil.RedactURL(c.Endpoint), c.Secure, c.Bucket, c.KeyPrefix, c.Region,
		storeutil.Presence(c.AccessKey), storeutil.Presence(c.SecretKey), c.DefaultTTL, c.TTLOverride, c.OpTimeout, c.Cooldown)
}

// GoString is String, so that %#v redacts too.
func (c Config) GoString() string { return c.String() }

// LogValue is String, so that slog redacts too.
func (c Config) LogValue() slog.Value { return slog.StringValue(c.String()) }

// Store is a respcache.CacheStore on an S3 bucket (minio-go), meant as the durable L2 of a
// respcache.TieredStore. All methods are safe for concurrent use.
//
// Objects: key k is stored as KeyPrefix + escape(k), where escape keeps [A-Za-z0-9_-] and writes
// every other byte as %XX (so hex cache keys are stored as they are, and no key makes a "/" or a
// "." path segment); an escaped key longer than 200 bytes is replaced by "~" + the SHA-256 of k.
// The empty key is stored as "%".
//
// Expiry: S3 has no per-object TTL, so Set writes the expiry (Unix ms) in the user metadata
// ExpiresMeta; Get reads object and metadata with one GET, checks the metadata before reading
// the body, and answers a miss for an expired object, which a background goroutine then deletes
// (queue of 128; when full, the object is left to the next Get or to a bucket lifecycle rule, which
// is recommended anyway). The deleter re-reads the metadata first, and a Set through this store
// waits for a deletion of its object in progress, so a fresh value is not deleted (S3 has no
// conditional delete: a Set by another process in the milliseconds between that re-read and the
// delete can still be lost, which costs one miss). Objects without the metadata never expire.
//
// Availability: every request is bounded by OpTimeout; after a connection failure or a timeout the
// store fails fast (errors wrapping respcache.ErrUnavailable) for Cooldown, then probes again.
// New does not fail when S3 is unreachable (the store starts failing fast and recovers by itself).
//
// Close stops the deletion goroutine; it is idempotent. After Close every method but Stats returns
// respcache.ErrClosed.
type Store struct {
	cfg       Config
	client    *minio.Client
	core      minio.Core
	transport *http.Transport // built-in transport, closed by Close; nil when cfg.Transport
	secrets   []string
	desc      string
	log       *slog.Logger

	openUntil atomic.Int64 // circuit: unix ns until which requests fail fast; 0 = closed

	hits, misses atomic.Uint64
	errs         respcache.ErrorCounts
	metrics      *storeutil.Instruments

	reap      chan string
	reapMu    sync.Mutex
	reapQueue map[string]struct{} // queued in reap, not yet taken by the reaper
	reapCur   string              // object the reaper is deleting, "" when idle
	reapDone  chan struct{}       // closed when the reaper is done with reapCur
	ctx       context.Context     // cancelled by Close: aborts background deletions
	cancel    context.CancelFunc
	closed    atomic.Bool
	closeOnce sync.Once
	wg        sync.WaitGroup
}

var _ respcache.CacheStore = (*Store)(nil)

// New validates cfg, creates the client, checks the bucket and starts the expired-object deletion
// goroutine (stopped by Close). Errors wrap respcache.ErrInvalidConfig for a bad field, a bucket
// that does not exist ("bucket %q does not exist"), or credentials the server rejects. When S3
// cannot be reached, New still returns the store (its circuit open, see Store) and no error. An
// error from the MeterProvider is returned as is. Secrets never appear in the error.
func New(cfg Config) (*Store, error) {
	host, secure, err := normalise(&cfg)
	if err != nil {
		return nil, err
	}
	s := &Store{
		cfg:       cfg,
		secrets:   storeutil.Secrets(cfg.AccessKey, cfg.SecretKey),
		log:       storeutil.Logger(cfg.Logger),
		reap:      make(chan string, maxReapQueue),
		reapQueue: make(map[string]struct{}),
	}
	s.desc = fmt.Sprintf("s3store.Store{Endpoint:%q Bucket:%q KeyPrefix:%q}", host, cfg.Bucket, cfg.KeyPrefix)
	rt := cfg.Transport
	if rt == nil {
		s.transport = &http.Transport{
			DialContext:           (&net.Dialer{Timeout: cfg.OpTimeout, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:          256,
			MaxIdleConnsPerHost:   64,
			IdleConnTimeout:       time.Minute,
			TLSHandshakeTimeout:   cfg.OpTimeout,
			ResponseHeaderTimeout: cfg.OpTimeout,
			ExpectContinueTimeout: time.Second,
			DisableCompression:    true, // bodies are stored bytes, never decoded
		}
		rt = s.transport
	}
	var creds *credentials.Credentials
	if cfg.AccessKey != "" || cfg.SecretKey != "" {
		creds = credentials.NewStaticV4(cfg.AccessKey, cfg.SecretKey, "")
	} else {
		creds = credentials.New(&credentials.Static{Value: credentials.Value{SignerType: credentials.SignatureAnonymous}})
	}
	s.client, err = minio.New(host, &minio.Options{
		Creds:      creds,
		Secure:     secure,
		Region:     cfg.Region,
		Transport:  rt,
		MaxRetries: 1, // the circuit, not retries, handles an unreachable S3
	})
	if err != nil {
		return nil, fmt.Errorf("%w: s3: %w", respcache.ErrInvalidConfig, storeutil.Redact(err, s.secrets))
	}
	s.core = minio.Core{Client: s.client}
	s.metrics, err = newStoreMetrics(cfg.MeterProvider)
	if err != nil {
		return nil, err
	}

	ctx, cancel := context.WithTimeout(context.Background(), cfg.OpTimeout)
	ok, err := s.client.BucketExists(ctx, cfg.Bucket)
	cancel()
	switch typ := errorType(err); {
	case err == nil && !ok:
		s.closeTransport()
		return nil, fmt.Errorf("%w: s3: bucket %q does not exist", respcache.ErrInvalidConfig, cfg.Bucket)
	case storeutil.Unavailable(typ):
		s.errs.Add(typ)
		s.metrics.CountError(typ)
		s.trip()
		s.log.Warn("s3store: s3 unreachable at start; failing fast until it answers",
			"store", s.desc, "error", storeutil.Redact(err, s.secrets).Error())
	case err != nil:
		s.closeTransport()
		if minio.ToErrorResponse(err).StatusCode == http.StatusForbidden {
			return nil, fmt.Errorf("%w: s3: bucket %q: access denied (check the credentials; the store needs "+
				"s3:ListBucket, s3:GetObject, s3:PutObject and s3:DeleteObject): %w", respcache.ErrInvalidConfig, cfg.Bucket,
				storeutil.Redact(err, s.secrets))
		}
		return nil, fmt.Errorf("%w: s3: bucket %q: %w", respcache.ErrInvalidConfig, cfg.Bucket, storeutil.Redact(err, s.secrets))
	}

	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.wg.Add(1)
	go s.reaper()
	return s, nil
}

// normalise applies the defaults and validates cfg; it returns the host[:port] and TLS choice.
func normalise(cfg *Config) (host string, secure bool, err error) {
	switch {
	case cfg.DefaultTTL < 0, cfg.TTLOverride < 0, cfg.OpTimeout < 0:
		return "", false, fmt.Errorf("%w: s3: negative duration in %v", respcache.ErrInvalidConfig, cfg)
	case cfg.Bucket == "":
		return "", false, fmt.Errorf("%w: s3: Bucket is required", respcache.ErrInvalidConfig)
	case cfg.Endpoint == "":
		return "", false, fmt.Errorf("%w: s3: Endpoint is required", respcache.ErrInvalidConfig)
	}
	host, secure = cfg.Endpoint, cfg.Secure
	if strings.Contains(cfg.Endpoint, "://") {
		u, err := url.Parse(cfg.Endpoint)
		if err != nil {
			var ue *url.Error
			if errors.As(err, &ue) {
				err = ue.Err
			}
			return "", false, fmt.Errorf("%w: s3 endpoint: %v", respcache.ErrInvalidConfig, err)
		}
		switch {
		case u.Scheme != "http" && u.Scheme != "https":
			return "", false, fmt.Errorf("%w: s3 endpoint scheme %q: want http or https", respcache.ErrInvalidConfig, u.Scheme)
		case u.User != nil:
			return "", false, fmt.Errorf("%w: s3 endpoint: credentials in the URL are not supported; use AccessKey and SecretKey", respcache.ErrInvalidConfig)
		case u.Path != "" && u.Path != "/", u.RawQuery != "", u.Fragment != "":
			return "", false, fmt.Errorf("%w: s3 endpoint %q: want scheme://host[:port] only", respcache.ErrInvalidConfig, u.Redacted())
		case u.Host == "":
			return "", false, fmt.Errorf("%w: s3 endpoint %q has no host", respcache.ErrInvalidConfig, u.Redacted())
		}
		host, secure = u.Host, u.Scheme == "https"
	} else if strings.ContainsAny(host, "/?#@") {
		return "", false, fmt.Errorf("%w: s3 endpoint: want host[:port] or scheme://host[:port], without path, query or credentials", respcache.ErrInvalidConfig)
	}
	if cfg.KeyPrefix == "" {
		cfg.KeyPrefix = DefaultKeyPrefix
	}
	if strings.HasPrefix(cfg.KeyPrefix, "/") {
		return "", false, fmt.Errorf("%w: s3 key prefix %q must not start with /", respcache.ErrInvalidConfig, cfg.KeyPrefix)
	}
	if cfg.Region == "" {
		cfg.Region = DefaultRegion
	}
	if cfg.DefaultTTL == 0 {
		cfg.DefaultTTL = respcache.DefaultTTL
	}
	if cfg.OpTimeout == 0 {
		cfg.OpTimeout = DefaultOpTimeout
	}
	if cfg.Cooldown == 0 {
		cfg.Cooldown = DefaultCooldown
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return host, secure, nil
}

// String describes the store (endpoint, bucket, prefix; never the keys).
func (s *Store) String() string { return s.desc }

// GoString is String, so that %#v cannot print the keys.
func (s *Store) GoString() string { return s.desc }

// objectName maps a cache key to its object name (see Store).
func (s *Store) objectName(key string) string {
	const hexdigits = "0123456789ABCDEF"
	if key == "" {
		return s.cfg.KeyPrefix + "%"
	}
	b := make([]byte, 0, len(s.cfg.KeyPrefix)+len(key))
	b = append(b, s.cfg.KeyPrefix...)
	for i := 0; i < len(key); i++ {
		c := key[i]
		if 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_' {
			b = append(b, c)
		} else {
			b = append(b, '%', hexdigits[c>>4], hexdigits[c&15])
		}
	}
	if len(b)-len(s.cfg.KeyPrefix) > 200 {
		sum := sha256.Sum256([]byte(key))
		return s.cfg.KeyPrefix + "~" + hex.EncodeToString(sum[:])
	}
	return string(b)
}

// allow reports whether a request may go to S3: the circuit is closed, or its cooldown is over and
// this caller wins the probe (the others keep failing fast until the probe's outcome is known).
func (s *Store) allow() bool {
	until := s.openUntil.Load()
	if until == 0 {
		return true
	}
	now := time.Now().UnixNano()
	if now < until {
		return false
	}
	return s.openUntil.CompareAndSwap(until, now+int64(s.cfg.Cooldown))
}

// trip opens the circuit for Cooldown (no-op when Cooldown < 0).
func (s *Store) trip() {
	if s.cfg.Cooldown > 0 {
		s.openUntil.Store(time.Now().Add(s.cfg.Cooldown).UnixNano())
	}
}

// succeeded closes the circuit.
func (s *Store) succeeded() {
	if s.openUntil.Load() != 0 {
		s.openUntil.Store(0)
	}
}

var errCircuitOpen = errors.New("s3 unreachable recently; failing fast until the cooldown ends")

// begin checks the store is usable: respcache.ErrClosed, or a respcache.ErrUnavailable error while
// the circuit is open.
func (s *Store) begin(op string) error {
	if s.closed.Load() {
		return respcache.ErrClosed
	}
	if !s.allow() {
		return fmt.Errorf("%w: s3 %s: %w", respcache.ErrUnavailable, op, errCircuitOpen)
	}
	return nil
}

// failed counts err, opens the circuit when S3 is unreachable, and wraps err for the caller.
func (s *Store) failed(ctx context.Context, op string, err error) error {
	err = storeutil.Redact(err, s.secrets)
	typ := errorType(err)
	if typ == "" || (typ == respcache.ErrorTypeTimeout && ctx.Err() != nil) {
		// The caller gave up: not S3's fault, no circuit change.
		return fmt.Errorf("s3store: %s: %w", op, err)
	}
	s.errs.Add(typ)
	s.metrics.CountError(typ)
	if storeutil.Unavailable(typ) {
		s.trip()
		return fmt.Errorf("%w: s3 %s: %w", respcache.ErrUnavailable, op, err)
	}
	s.succeeded() // S3 answered, if with an error
	return fmt.Errorf("s3store: %s: %w", op, err)
}

// isNotFound reports an S3 "no such key" answer.
func isNotFound(err error) bool {
	r := minio.ToErrorResponse(err)
	return r.Code == minio.NoSuchKey || r.StatusCode == http.StatusNotFound
}

// expiry returns the object's expiry from its user metadata; ok is false without a valid one.
func expiry(meta map[string]string) (ms int64, present, valid bool) {
	v, present := meta[ExpiresMeta]
	if !present {
		for k, val := range meta { // servers differ in the case they return
			if strings.EqualFold(k, ExpiresMeta) {
				v, present = val, true
				break
			}
		}
	}
	if !present {
		return 0, false, false
	}
	ms, err := strconv.ParseInt(v, 10, 64)
	return ms, true, err == nil
}

// Get reads key's object with one GET, checks its expiry metadata, then reads the body. Cases:
// (value, true, nil) a live object, the slice is the caller's; (nil, false, nil) absent, expired
// (then queued for deletion) or with an invalid expiry; (nil, false, err) otherwise: err wraps
// respcache.ErrUnavailable when S3 is unreachable or the circuit is open, the caller's ctx error
// when ctx ended first, an S3 error response otherwise, or is respcache.ErrClosed. Bounded by ctx
// and OpTimeout. Safe for concurrent use.
func (s *Store) Get(ctx context.Context, key string) ([]byte, bool, error) {
	if err := s.begin("get"); err != nil {
		return nil, false, err
	}
	octx, cancel := context.WithTimeout(ctx, s.cfg.OpTimeout)
	defer cancel()
	start := time.Now()
	name := s.objectName(key)
	v, ok, err := s.get(octx, name)
	s.metrics.Latency(ctx, storeutil.OpGet, start)
	if err != nil {
		return nil, false, s.failed(ctx, "get", err)
	}
	s.succeeded()
	if ok {
		s.hits.Add(1)
	} else {
		s.misses.Add(1)
	}
	return v, ok, nil
}

func (s *Store) get(ctx context.Context, name string) ([]byte, bool, error) {
	body, info, _, err := s.core.GetObject(ctx, s.cfg.Bucket, name, minio.GetObjectOptions{})
	if err != nil {
		if isNotFound(err) {
			return nil, false, nil
		}
		return nil, false, err
	}
	defer body.Close()
	if ms, present, valid := expiry(info.UserMetadata); present && (!valid || s.cfg.Now().UnixMilli() >= ms) {
		_, _ = io.CopyN(io.Discard, body, 64<<10) // let a small body's connection be reused
		if valid {
			s.queueReap(name)
		}
		return nil, false, nil
	}
	var v []byte
	if info.Size >= 0 && info.Size < 1<<31 {
		v = make([]byte, info.Size)
		if _, err := io.ReadFull(body, v); err != nil {
			return nil, false, err
		}
	} else if v, err = io.ReadAll(body); err != nil {
		return nil, false, err
	}
	return v, true, nil
}

// Set writes value as key's object with its expiry in the metadata: now + TTLOverride when set,
// else ttl, else Config.DefaultTTL. It returns nil when S3 stored it; an error wraps
// respcache.ErrUnavailable (S3 unreachable, circuit open), the caller's ctx error, or an S3 error
// response, or is respcache.ErrClosed. value is not retained after Set returns. Bounded by ctx and
// OpTimeout. Safe for concurrent use.
func (s *Store) Set(ctx context.Context, key string, value []byte, ttl time.Duration) error {
	if err := s.begin("set"); err != nil {
		return err
	}
	switch {
	case s.cfg.TTLOverride > 0:
		ttl = s.cfg.TTLOverride
	case ttl <= 0:
		ttl = s.cfg.DefaultTTL
	}
	exp := s.cfg.Now().Add(ttl).UnixMilli()
	octx, cancel := context.WithTimeout(ctx, s.cfg.OpTimeout)
	defer cancel()
	name := s.objectName(key)
	s.cancelReap(octx, name)
	start := time.Now()
	_, err := s.client.PutObject(octx, s.cfg.Bucket, name, bytes.NewReader(value), int64(len(value)),
		minio.PutObjectOptions{
			ContentType:  "application/octet-stream",
			UserMetadata: map[string]string{ExpiresMeta: strconv.FormatInt(exp, 10)},
		})
	s.metrics.Latency(ctx, storeutil.OpSet, start)
	if err != nil {
		return s.failed(ctx, "set", err)
	}
	s.succeeded()
	return nil
}

// Delete removes key's object (absent is not an error). Errors as for Set. Safe for concurrent use.
func (s *Store) Delete(ctx context.Context, key string) error {
	if err := s.begin("delete"); err != nil {
		return err
	}
	octx, cancel := context.WithTimeout(ctx, s.cfg.OpTimeout)
	defer cancel()
	start := time.Now()
	err := s.client.RemoveObject(octx, s.cfg.Bucket, s.objectName(key), minio.RemoveObjectOptions{})
	s.metrics.Latency(ctx, storeutil.OpDelete, start)
	if err != nil && !isNotFound(err) {
		return s.failed(ctx, "delete", err)
	}
	s.succeeded()
	return nil
}

// Clear lists the objects under KeyPrefix and removes them with multi-object deletes; it returns
// how many were removed (also when it stops early with an error). Each request is bounded by the
// transport's timeouts (OpTimeout with the built-in transport); the whole Clear only by ctx.
// Errors as for Set. Safe for concurrent use; objects written during a Clear may survive it.
func (s *Store) Clear(ctx context.Context) (int, error) {
	if err := s.begin("clear"); err != nil {
		return 0, err
	}
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		listErr error
		sent    int // objects fed to RemoveObjects, which reports only failures
		wg      sync.WaitGroup
	)
	feed := make(chan minio.ObjectInfo)
	wg.Go(func() {
		defer close(feed)
		for obj := range s.client.ListObjects(lctx, s.cfg.Bucket, minio.ListObjectsOptions{Prefix: s.cfg.KeyPrefix, Recursive: true}) {
			if obj.Err != nil {
				if listErr == nil {
					listErr = obj.Err
				}
				cancel() // stops the listing; the loop drains its channel
				continue
			}
			select {
			case feed <- obj:
				sent++
			case <-lctx.Done():
			}
		}
	})
	failed := 0
	var rmErr error
	for e := range s.client.RemoveObjects(lctx, s.cfg.Bucket, feed, minio.RemoveObjectsOptions{}) {
		failed++
		if rmErr == nil && e.Err != nil && !isNotFound(e.Err) {
			rmErr = e.Err
		}
	}
	cancel() // should RemoveObjects stop reading early, unblock the feeder
	wg.Wait()
	n := max(sent-failed, 0)
	err := listErr
	if err == nil {
		err = rmErr
	}
	if err == nil {
		err = ctx.Err()
	}
	if err != nil {
		return n, s.failed(ctx, "clear", err)
	}
	s.succeeded()
	return n, nil
}

// Stats reports Backend "s3", Entries -1 (counting would list the bucket), the hits and misses of
// Get, and errors by type. It does no I/O; ctx is ignored. Safe for concurrent use, also after
// Close.
func (s *Store) Stats(context.Context) respcache.StoreStats {
	return respcache.StoreStats{
		Backend: "s3",
		Entries: -1,
		Hits:    s.hits.Load(),
		Misses:  s.misses.Load(),
		Errors:  s.errs.Snapshot(),
	}
}

// Close stops the deletion goroutine (aborting a deletion in progress), waits for it and closes
// the built-in transport's idle connections. It is idempotent, safe for concurrent use and returns
// nil.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		s.closed.Store(true)
		s.cancel()
		s.wg.Wait()
		s.closeTransport()
	})
	return nil
}

func (s *Store) closeTransport() {
	if s.transport != nil {
		s.transport.CloseIdleConnections()
	}
}

// queueReap queues an expired object for deletion, unless it is queued already or the queue is
// full (then the next Get, or a bucket lifecycle rule, will remove it).
func (s *Store) queueReap(name string) {
	s.reapMu.Lock()
	defer s.reapMu.Unlock()
	if _, ok := s.reapQueue[name]; ok || len(s.reapQueue) >= maxReapQueue {
		return
	}
	select {
	case s.reap <- name:
		s.reapQueue[name] = struct{}{}
	default:
	}
}

// cancelReap keeps the reaper from deleting name once a Set rewrites it: it drops name from the
// queue and, when the reaper is deleting name right now, waits (bounded by ctx) until it is done.
func (s *Store) cancelReap(ctx context.Context, name string) {
	s.reapMu.Lock()
	delete(s.reapQueue, name)
	var wait chan struct{}
	if s.reapCur == name {
		wait = s.reapDone
	}
	s.reapMu.Unlock()
	if wait != nil {
		select {
		case <-wait:
		case <-ctx.Done():
		}
	}
}

// reaper deletes expired objects queued by Get, one at a time. Before deleting it re-reads the
// object's metadata, so that an object rewritten since (by another process) is kept; a Set through
// this store waits for a deletion of its object in progress (cancelReap).
func (s *Store) reaper() {
	defer s.wg.Done()
	for {
		var name string
		select {
		case <-s.ctx.Done():
			return
		case name = <-s.reap:
		}
		s.reapMu.Lock()
		_, queued := s.reapQueue[name]
		delete(s.reapQueue, name)
		if !queued || !s.allow() { // rewritten since, or S3 unreachable
			s.reapMu.Unlock()
			continue
		}
		done := make(chan struct{})
		s.reapCur, s.reapDone = name, done
		s.reapMu.Unlock()

		ctx, cancel := context.WithTimeout(s.ctx, s.cfg.OpTimeout)
		info, err := s.client.StatObject(ctx, s.cfg.Bucket, name, minio.StatObjectOptions{})
		if err == nil {
			if ms, present, valid := expiry(info.UserMetadata); present && valid && s.cfg.Now().UnixMilli() >= ms {
				err = s.client.RemoveObject(ctx, s.cfg.Bucket, name, minio.RemoveObjectOptions{})
			}
		}
		if err != nil && !isNotFound(err) && s.ctx.Err() == nil {
			_ = s.failed(ctx, "delete expired", err)
		}
		cancel()

		s.reapMu.Lock()
		s.reapCur, s.reapDone = "", nil
		s.reapMu.Unlock()
		close(done)
	}
}
