package enginesim

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvroute/kvroute/disagg"
	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	"github.com/zeebo/xxh3"
)

// Role is an engine's part in prefill/decode disaggregation: the library's own roles
// (disagg.Role), so that a fleet's configuration names them once. The zero value is RoleUnified.
//
//   - RoleUnified serves whole requests; it also acts as a prefill engine for a request with
//     do_remote_decode and as a decode engine for one with do_remote_prefill.
//   - RolePrefill writes the KV blocks of requests with do_remote_decode to external storage.
//   - RoleDecode loads KV blocks from external storage: those listed by do_remote_prefill, and
//     (StorageConfig.Lookup) those of any prompt it finds there.
type Role = disagg.Role

// The roles.
const (
	RoleUnified = disagg.RoleUnified
	RolePrefill = disagg.RolePrefill
	RoleDecode  = disagg.RoleDecode
)

// ParseRole parses "unified" (or ""), "prefill" or "decode", case-insensitively; its error wraps
// ErrInvalidConfig.
func ParseRole(s string) (Role, error) {
	r, err := disagg.ParseRole(s)
	if err != nil {
		return 0, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	return r, nil
}

// StorageLookup says whether an engine looks a prompt's blocks up in external storage on a
// request without kv_transfer_params (the storage path: the router sends no prefill, the decode
// engine finds the prefix in storage by itself).
type StorageLookup uint8

const (
	// StorageLookupAuto (the zero value) looks up for RoleDecode only.
	StorageLookupAuto StorageLookup = iota
	// StorageLookupOn looks up whatever the role (a prefill engine never does: it computes).
	StorageLookupOn
	// StorageLookupOff never looks up: only kv_transfer_params make an engine read storage.
	StorageLookupOff
)

// String returns "auto", "on" or "off".
func (l StorageLookup) String() string {
	switch l {
	case StorageLookupAuto:
		return "auto"
	case StorageLookupOn:
		return "on"
	case StorageLookupOff:
		return "off"
	}
	return "StorageLookup(" + strconv.Itoa(int(l)) + ")"
}

// ParseStorageLookup parses "auto" (or ""), "on" or "off".
func ParseStorageLookup(s string) (StorageLookup, error) {
	switch strings.ToLower(s) {
	case "", "auto":
		return StorageLookupAuto, nil
	case "on", "true":
		return StorageLookupOn, nil
	case "off", "false":
		return StorageLookupOff, nil
	}
	return 0, fmt.Errorf("%w: storage lookup %q: want auto, on or off", ErrInvalidConfig, s)
}

// Defaults of StorageConfig.
const (
	// DefaultKVNamespace is the key prefix of the KV blocks in the bucket.
	DefaultKVNamespace = "inference/kv-cache"
	// DefaultStorageRegion is the S3 signing region.
	DefaultStorageRegion = "us-east-1"
	// DefaultBytesPerToken is the simulated KV size of one token: 2 (K and V) × 32 layers × 8 KV
	// heads × 128 dimensions × 2 bytes (bf16) = 128 KiB, Llama-3.1-8B's (DefaultModel). A 70B
	// model of the same family has 80 layers: 320 KiB.
	DefaultBytesPerToken = 128 << 10
	// DefaultStorageBandwidth is the simulated storage bandwidth of one engine, bytes per second:
	// 10 GB/s, a 100 Gb/s storage network at 80%. A 16-token block of DefaultBytesPerToken (2 MiB)
	// then moves in about 210 µs.
	DefaultStorageBandwidth = 10e9
	// DefaultStorageOpTimeout bounds each storage request.
	DefaultStorageOpTimeout = 5 * time.Second
	// DefaultStorageCooldown is how long an engine skips storage after finding it unreachable.
	DefaultStorageCooldown = 5 * time.Second
)

// StorageConfig is the external KV storage: an S3 bucket (any S3-compatible server). Endpoint and
// Bucket are required; the zero value of every other field means its Default* constant. String,
// GoString and LogValue redact AccessKey and SecretKey.
type StorageConfig struct {
	// Endpoint is "http://host:port" or "https://host:port" (no path, no user information).
	Endpoint string
	// Bucket is the pre-created bucket.
	Bucket string
	// Namespace is the key prefix of the blocks (surrounding "/" are trimmed): block objects are
	// <Namespace>/<model>/<block key as 16 hex digits>. Default DefaultKVNamespace.
	Namespace string
	// AccessKey and SecretKey are static credentials; both empty means anonymous access.
	AccessKey string
	SecretKey string
	// Region is the signing region. Default DefaultStorageRegion.
	Region string
	// BytesPerToken is the simulated KV size of a token: a block moves BlockSize × BytesPerToken
	// bytes (the objects themselves are small). Default DefaultBytesPerToken.
	BytesPerToken int64
	// BandwidthBytesPerSec is the simulated bandwidth of the engine's storage transfers: moving
	// b bytes takes b / BandwidthBytesPerSec of virtual time (slept Latency.SpeedFactor times).
	// Default DefaultStorageBandwidth.
	BandwidthBytesPerSec float64
	// Lookup selects the storage path for requests without kv_transfer_params; see StorageLookup.
	Lookup StorageLookup
	// OpTimeout bounds each storage request. Default DefaultStorageOpTimeout.
	OpTimeout time.Duration
	// Cooldown: after a connection failure or a timeout the engine skips storage (reads are
	// computed locally, prefills with do_remote_decode fail with 503) for Cooldown, then tries
	// again. Default DefaultStorageCooldown; negative disables it.
	Cooldown time.Duration
}

// String describes the configuration with AccessKey and SecretKey redacted.
func (c StorageConfig) String() string {
	return fmt.Sprintf("StorageConfig{Endpoint:%q Bucket:%q Namespace:%q AccessKey:%s SecretKey:%s Region:%q "+
		"BytesPerToken:%d BandwidthBytesPerSec:%g Lookup:%v OpTimeout:%v Cooldown:%v}",
		c.Endpoint, c.Bucket, c.Namespace, redacted(c.AccessKey), redacted(c.SecretKey), c.Region,
		c.BytesPerToken, c.BandwidthBytesPerSec, c.Lookup, c.OpTimeout, c.Cooldown)
}

// GoString is String, so that %#v redacts too.
func (c StorageConfig) GoString() string { return c.String() }

// LogValue is String, so that slog redacts too.
func (c StorageConfig) LogValue() slog.Value { return slog.StringValue(c.String()) }

// redacted shows whether a secret is set, never its value.
func redacted(s string) string {
	if s == "" {
		return `""`
	}
	return "[REDACTED]"
}

// withDefaults validates c and applies its defaults.
func (c StorageConfig) withDefaults() (StorageConfig, error) {
	switch {
	case c.Bucket == "":
		return c, errors.New("storage: Bucket is required")
	case c.Endpoint == "":
		return c, errors.New("storage: Endpoint is required")
	case c.BytesPerToken < 0:
		return c, fmt.Errorf("BytesPerToken %d: want ≥ 0", c.BytesPerToken)
	case c.BandwidthBytesPerSec < 0, math.IsNaN(c.BandwidthBytesPerSec), math.IsInf(c.BandwidthBytesPerSec, 0):
		return c, fmt.Errorf("BandwidthBytesPerSec %v: want a finite value ≥ 0", c.BandwidthBytesPerSec)
	case c.OpTimeout < 0:
		return c, fmt.Errorf("OpTimeout %v: want ≥ 0", c.OpTimeout)
	case c.Lookup > StorageLookupOff:
		return c, fmt.Errorf("Lookup %d unknown", c.Lookup)
	}
	if _, _, err := splitEndpoint(c.Endpoint); err != nil {
		return c, err
	}
	c.Namespace = strings.Trim(c.Namespace, "/")
	if c.Namespace == "" {
		c.Namespace = DefaultKVNamespace
	}
	for _, seg := range strings.Split(c.Namespace, "/") {
		if seg == "" || seg == "." || seg == ".." {
			return c, fmt.Errorf("storage: Namespace %q: empty, \".\" or \"..\" path segment", c.Namespace)
		}
	}
	if c.Region == "" {
		c.Region = DefaultStorageRegion
	}
	if c.BytesPerToken == 0 {
		c.BytesPerToken = DefaultBytesPerToken
	}
	if c.BandwidthBytesPerSec == 0 {
		c.BandwidthBytesPerSec = DefaultStorageBandwidth
	}
	if c.OpTimeout == 0 {
		c.OpTimeout = DefaultStorageOpTimeout
	}
	if c.Cooldown == 0 {
		c.Cooldown = DefaultStorageCooldown
	}
	return c, nil
}

// splitEndpoint parses "http(s)://host[:port]" into the host and the TLS choice.
func splitEndpoint(ep string) (host string, secure bool, err error) {
	u, err := url.Parse(ep)
	switch {
	case err != nil: // the URL is not printed: it may hold credentials
		return "", false, errors.New("storage: Endpoint is not a URL: want http://host[:port] or https://host[:port]")
	case u.Scheme != "http" && u.Scheme != "https":
		return "", false, fmt.Errorf("storage: Endpoint %q: want http://host[:port] or https://host[:port]", u.Redacted())
	case u.User != nil:
		return "", false, errors.New("storage: Endpoint: credentials in the URL are not supported; use AccessKey and SecretKey")
	case u.Host == "", u.Path != "" && u.Path != "/", u.RawQuery != "", u.Fragment != "":
		return "", false, fmt.Errorf("storage: Endpoint %q: want scheme://host[:port] only", u.Redacted())
	}
	return u.Host, u.Scheme == "https", nil
}

// transferTime is the virtual time of moving n bytes at bw bytes per second.
func transferTime(n int64, bw float64) time.Duration {
	if n <= 0 || bw <= 0 {
		return 0
	}
	return time.Duration(math.Round(float64(n) / bw * float64(time.Second)))
}

// Storage block keys. They are content-chained and independent of the engine's hash seed:
//
//	root    = xxh3-64("kvroute-enginesim-kv/v1" ‖ 0x00 ‖ model ‖ 0x00 ‖ le32(block size))
//	key(i)  = xxh3-64(le64(key(i−1), or root for block 0) ‖ le32 token IDs of block i)
//
// so that every engine serving the model with the same block size computes the same keys for the
// same tokens, whatever its seed and across restarts.
const storageKeyDomain = "kvroute-enginesim-kv/v1"

// storageRoot returns the parent of a chain's first storage key.
func storageRoot(model string, bs int) uint64 {
	var h xxh3.Hasher
	_, _ = h.WriteString(storageKeyDomain)
	_, _ = h.Write([]byte{0})
	_, _ = h.WriteString(model)
	var b [5]byte
	binary.LittleEndian.PutUint32(b[1:], uint32(bs))
	_, _ = h.Write(b[:])
	return h.Sum64()
}

// storageKeys appends the storage keys of the full blocks of tokens to dst.
func storageKeys(dst []uint64, model string, bs int, tokens []uint32) []uint64 {
	parent := storageRoot(model, bs)
	var b [8]byte
	for i := 0; i+bs <= len(tokens); i += bs {
		var h xxh3.Hasher
		binary.LittleEndian.PutUint64(b[:], parent)
		_, _ = h.Write(b[:])
		for _, t := range tokens[i : i+bs] {
			binary.LittleEndian.PutUint32(b[:4], t)
			_, _ = h.Write(b[:4])
		}
		parent = h.Sum64()
		dst = append(dst, parent)
	}
	return dst
}

// formatKey writes a storage key as 16 lowercase hex digits.
func formatKey(k uint64) string {
	s := strconv.FormatUint(k, 16)
	return strings.Repeat("0", 16-len(s)) + s
}

// parseKey parses 16 hex digits.
func parseKey(s string) (uint64, bool) {
	if len(s) != 16 {
		return 0, false
	}
	k, err := strconv.ParseUint(s, 16, 64)
	return k, err == nil
}

// Block objects: a 32-byte header then the block's token IDs.
//
//	0  "KVRB"                 magic
//	4  1                      version
//	5  flags                  bit 0: has a parent
//	6  0, 0                   reserved
//	8  le64 key               the object's storage key
//	16 le64 parent key        the previous block's key (0 without parent)
//	24 le32 token count       the block size
//	28 le32 0                 reserved
//	32 le32 × count           token IDs
const (
	blockMagic     = "KVRB"
	blockVersion   = 1
	blockHeaderLen = 32
)

// encodeBlock returns block i's object.
func encodeBlock(keys []uint64, i int, tokens []uint32) []byte {
	b := make([]byte, blockHeaderLen, blockHeaderLen+4*len(tokens))
	copy(b, blockMagic)
	b[4] = blockVersion
	binary.LittleEndian.PutUint64(b[8:], keys[i])
	if i > 0 {
		b[5] = 1
		binary.LittleEndian.PutUint64(b[16:], keys[i-1])
	}
	binary.LittleEndian.PutUint32(b[24:], uint32(len(tokens)))
	for _, t := range tokens {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	return b
}

// errBadBlock is a block object that does not hold the block asked for.
var errBadBlock = errors.New("block object does not match the prompt")

// checkBlock verifies that obj is block i of keys holding tokens.
func checkBlock(obj []byte, keys []uint64, i int, tokens []uint32) error {
	switch {
	case len(obj) != blockHeaderLen+4*len(tokens), string(obj[:4]) != blockMagic, obj[4] != blockVersion:
		return fmt.Errorf("%w: bad header or length", errBadBlock)
	case binary.LittleEndian.Uint64(obj[8:]) != keys[i], int(binary.LittleEndian.Uint32(obj[24:])) != len(tokens):
		return fmt.Errorf("%w: key or size", errBadBlock)
	case i > 0 && (obj[5]&1 == 0 || binary.LittleEndian.Uint64(obj[16:]) != keys[i-1]), i == 0 && obj[5]&1 != 0:
		return fmt.Errorf("%w: parent", errBadBlock)
	}
	for j, t := range tokens {
		if binary.LittleEndian.Uint32(obj[blockHeaderLen+4*j:]) != t {
			return fmt.Errorf("%w: tokens", errBadBlock)
		}
	}
	return nil
}

// kvStore is the engine's S3 client for block objects. Its methods are safe for concurrent use.
// After a connection failure or a timeout it fails fast with errStorageDown for the cooldown.
type kvStore struct {
	cfg       StorageConfig
	client    *minio.Client
	core      minio.Core
	transport *http.Transport
	prefix    string // <namespace>/<model>/
	secrets   []string
	openUntil atomic.Int64 // unix ns until which requests fail fast; 0: closed
}

// errStorageDown is returned while the circuit is open.
var errStorageDown = errors.New("external storage unreachable recently; skipped until the cooldown ends")

// newKVStore creates the client; it does no I/O.
func newKVStore(cfg StorageConfig, model string) (*kvStore, error) {
	host, secure, err := splitEndpoint(cfg.Endpoint)
	if err != nil {
		return nil, err
	}
	s := &kvStore{cfg: cfg, prefix: cfg.Namespace + "/" + model + "/"}
	for _, v := range []string{cfg.AccessKey, cfg.SecretKey} {
		if v != "" {
			s.secrets = append(s.secrets, v)
		}
	}
	s.transport = &http.Transport{
		DialContext:           (&net.Dialer{Timeout: cfg.OpTimeout, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:          64,
		MaxIdleConnsPerHost:   32,
		IdleConnTimeout:       time.Minute,
		TLSHandshakeTimeout:   cfg.OpTimeout,
		ResponseHeaderTimeout: cfg.OpTimeout,
		DisableCompression:    true,
	}
	var creds *credentials.Credentials
	if cfg.AccessKey != "" || cfg.SecretKey != "" {
		creds = credentials.NewStaticV4(cfg.AccessKey, cfg.SecretKey, "")
	} else {
		creds = credentials.New(&credentials.Static{Value: credentials.Value{SignerType: credentials.SignatureAnonymous}})
	}
	s.client, err = minio.New(host, &minio.Options{Creds: creds, Secure: secure, Region: cfg.Region,
		Transport: s.transport, MaxRetries: 1})
	if err != nil {
		return nil, s.redact(err)
	}
	s.core = minio.Core{Client: s.client}
	return s, nil
}

// objectName returns the object of a storage key.
func (s *kvStore) objectName(k uint64) string { return s.prefix + formatKey(k) }

// close releases the idle connections.
func (s *kvStore) close() { s.transport.CloseIdleConnections() }

// redact removes the credentials from err's text.
func (s *kvStore) redact(err error) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	red := msg
	for _, v := range s.secrets {
		red = strings.ReplaceAll(red, v, "[REDACTED]")
	}
	if red == msg {
		return err
	}
	return errors.New(red)
}

// allow reports whether a request may go to storage now: the circuit is closed, or its cooldown
// is over and this caller wins the probe.
func (s *kvStore) allow() bool {
	until := s.openUntil.Load()
	if until == 0 {
		return true
	}
	now := time.Now().UnixNano()
	return now >= until && s.openUntil.CompareAndSwap(until, now+int64(s.cfg.Cooldown))
}

// outcome updates the circuit after a request made under the caller's ctx: unreachable errors
// open it, answers close it. It returns err with the credentials redacted.
func (s *kvStore) outcome(ctx context.Context, err error) error {
	switch {
	case err == nil:
		s.openUntil.Store(0)
		return nil
	case ctx.Err() != nil:
		return ctx.Err() // the caller gave up: not storage's fault
	case unreachable(err):
		if s.cfg.Cooldown > 0 {
			s.openUntil.Store(time.Now().Add(s.cfg.Cooldown).UnixNano())
		}
	default:
		s.openUntil.Store(0) // storage answered, if with an error
	}
	return s.redact(err)
}

// unreachable reports a connection failure, a timeout or a 502/503/504.
func unreachable(err error) bool {
	var er minio.ErrorResponse
	if errors.As(err, &er) && er.StatusCode != 0 {
		return er.StatusCode == http.StatusBadGateway || er.StatusCode == http.StatusServiceUnavailable ||
			er.StatusCode == http.StatusGatewayTimeout
	}
	var ne net.Error
	var oe *net.OpError
	return errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) ||
		errors.As(err, &oe) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF)
}

// isNoSuchKey reports an S3 "no such key" answer.
func isNoSuchKey(err error) bool {
	r := minio.ToErrorResponse(err)
	return r.Code == minio.NoSuchKey || r.StatusCode == http.StatusNotFound
}

// get reads block object k: (obj, true, nil) when found, (nil, false, nil) when absent, an error
// otherwise (errStorageDown while the circuit is open).
func (s *kvStore) get(ctx context.Context, k uint64) ([]byte, bool, error) {
	if !s.allow() {
		return nil, false, errStorageDown
	}
	octx, cancel := context.WithTimeout(ctx, s.cfg.OpTimeout)
	defer cancel()
	body, _, _, err := s.core.GetObject(octx, s.cfg.Bucket, s.objectName(k), minio.GetObjectOptions{})
	if err != nil {
		if isNoSuchKey(err) {
			_ = s.outcome(ctx, nil)
			return nil, false, nil
		}
		return nil, false, s.outcome(ctx, err)
	}
	defer body.Close()
	obj, err := io.ReadAll(io.LimitReader(body, 1<<20))
	if err != nil {
		return nil, false, s.outcome(ctx, err)
	}
	return obj, true, s.outcome(ctx, nil)
}

// exists reports whether block object k is stored (a HEAD).
func (s *kvStore) exists(ctx context.Context, k uint64) (bool, error) {
	if !s.allow() {
		return false, errStorageDown
	}
	octx, cancel := context.WithTimeout(ctx, s.cfg.OpTimeout)
	defer cancel()
	_, err := s.client.StatObject(octx, s.cfg.Bucket, s.objectName(k), minio.StatObjectOptions{})
	if err != nil {
		if isNoSuchKey(err) {
			_ = s.outcome(ctx, nil)
			return false, nil
		}
		return false, s.outcome(ctx, err)
	}
	return true, s.outcome(ctx, nil)
}

// put writes block object k.
func (s *kvStore) put(ctx context.Context, k uint64, obj []byte) error {
	if !s.allow() {
		return errStorageDown
	}
	octx, cancel := context.WithTimeout(ctx, s.cfg.OpTimeout)
	defer cancel()
	_, err := s.client.PutObject(octx, s.cfg.Bucket, s.objectName(k), bytes.NewReader(obj), int64(len(obj)),
		minio.PutObjectOptions{ContentType: "application/octet-stream", DisableMultipart: true})
	return s.outcome(ctx, err)
}
