package filestore

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvroute/kvroute/respcache"
)

// Defaults of Config.
const (
	DefaultMaxEntries    = 100_000
	DefaultMaxBytes      = 1 << 30  // 1 GiB
	DefaultMaxEntryBytes = 32 << 20 // 32 MiB: above respcache's 10 MiB stream buffer
)

// ErrCorrupt is wrapped by Get's error for an entry file that is not one this package wrote for the
// key (truncated, overwritten, renamed); the file is removed.
var ErrCorrupt = errors.New("filestore: corrupt entry")

// Config configures a Store. Dir is required; every other zero field means its default.
type Config struct {
	// Dir is the directory the Store owns; it is created with mode 0700 when missing.
	Dir string
	// DefaultTTL is the TTL of a Set with ttl ≤ 0; 0 means respcache.DefaultTTL.
	DefaultTTL time.Duration
	// MaxEntries bounds the number of entries; 0 means DefaultMaxEntries.
	MaxEntries int
	// MaxBytes bounds the bytes of all the entry files; 0 means DefaultMaxBytes.
	MaxBytes int64
	// MaxEntryBytes bounds one entry file (a 20-byte header, the key and the value); 0 means
	// DefaultMaxEntryBytes. It is at most MaxBytes.
	MaxEntryBytes int64
	// Now is the clock of the expiries; nil means time.Now. It must be safe for concurrent use.
	Now func() time.Time
}

// Store is a respcache.CacheStore on the local filesystem (see the package doc). All its methods
// are safe for concurrent use: reads of entries run in parallel, and changes of the directory (a
// Set's rename, Delete, Clear, eviction) one at a time. It starts no goroutine; Close releases the
// directory. Make one with New.
type Store struct {
	cfg  Config
	root *os.Root

	mu     sync.RWMutex // guards idx, size, closed and the entry files' names (not their writing)
	idx    map[string]*entry
	size   int64
	closed bool

	clock                   atomic.Uint64 // recency ticks
	hits, misses, evictions atomic.Uint64
	errs                    respcache.ErrorCounts
}

// entry is what the Store keeps in memory of one file.
type entry struct {
	size    int64
	expires int64         // Unix nanoseconds; live while now < expires
	lastUse atomic.Uint64 // Store.clock at the last Set or hit
}

var _ respcache.CacheStore = (*Store)(nil)

const (
	magic     = "kvrfile1"
	headerLen = len(magic) + 8 + 4 // magic, le64 expiry, le32 key length; then key and value
	suffix    = ".kvr"
	tmpPrefix = ".tmp-"
	// evictionSample is how many entries eviction looks at to find one to drop.
	evictionSample = 16
)

// New opens (or creates) cfg.Dir and indexes the entries already there, removing expired and
// corrupt ones and temporary files a crash left. The error wraps respcache.ErrInvalidConfig for a
// field out of range or a directory others may write, and is the filesystem's error otherwise.
func New(cfg Config) (*Store, error) {
	switch {
	case cfg.Dir == "":
		return nil, fmt.Errorf("%w: filestore: Dir is empty", respcache.ErrInvalidConfig)
	case cfg.DefaultTTL < 0 || cfg.MaxEntries < 0 || cfg.MaxBytes < 0 || cfg.MaxEntryBytes < 0:
		return nil, fmt.Errorf("%w: filestore: negative limit in %+v", respcache.ErrInvalidConfig, cfg)
	}
	if cfg.DefaultTTL == 0 {
		cfg.DefaultTTL = respcache.DefaultTTL
	}
	if cfg.MaxEntries == 0 {
		cfg.MaxEntries = DefaultMaxEntries
	}
	if cfg.MaxBytes == 0 {
		cfg.MaxBytes = DefaultMaxBytes
	}
	if cfg.MaxEntryBytes == 0 {
		cfg.MaxEntryBytes = min(DefaultMaxEntryBytes, cfg.MaxBytes)
	}
	if cfg.MaxEntryBytes > cfg.MaxBytes {
		return nil, fmt.Errorf("%w: filestore: MaxEntryBytes %d > MaxBytes %d", respcache.ErrInvalidConfig, cfg.MaxEntryBytes, cfg.MaxBytes)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, err
	}
	fi, err := os.Stat(cfg.Dir)
	if err != nil {
		return nil, err
	}
	if runtime.GOOS != "windows" && fi.Mode().Perm()&0o022 != 0 {
		return nil, fmt.Errorf("%w: filestore: %s is writable by its group or others (mode %v): they could plant responses",
			respcache.ErrInvalidConfig, cfg.Dir, fi.Mode().Perm())
	}
	root, err := os.OpenRoot(cfg.Dir)
	if err != nil {
		return nil, err
	}
	s := &Store{cfg: cfg, root: root, idx: map[string]*entry{}}
	if err := s.load(); err != nil {
		root.Close()
		return nil, err
	}
	return s, nil
}

// load indexes the directory's entry files.
func (s *Store) load() error {
	d, err := s.root.Open(".")
	if err != nil {
		return err
	}
	defer d.Close()
	now := s.cfg.Now().UnixNano()
	for {
		des, err := d.ReadDir(1024)
		for _, de := range des {
			name := de.Name()
			switch {
			case !de.Type().IsRegular():
				continue // not ours
			case strings.HasPrefix(name, tmpPrefix):
				_ = s.root.Remove(name) // a Set interrupted by a crash
			case isEntryName(name):
				size, expires, err := s.readHeader(name)
				if err != nil || expires <= now {
					_ = s.root.Remove(name)
					continue
				}
				s.idx[name] = &entry{size: size, expires: expires}
				s.size += size
			}
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
	}
	s.evict("", now)
	return nil
}

// readHeader returns the size and expiry of entry file name, checking that it holds the key its
// name is the digest of.
func (s *Store) readHeader(name string) (size, expires int64, err error) {
	f, err := s.open(name)
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return 0, 0, err
	}
	var h [headerLen]byte
	if _, err := io.ReadFull(f, h[:]); err != nil {
		return 0, 0, err
	}
	klen := int64(binary.LittleEndian.Uint32(h[16:]))
	if string(h[:8]) != magic || int64(headerLen)+klen > fi.Size() {
		return 0, 0, ErrCorrupt
	}
	key := make([]byte, klen)
	if _, err := io.ReadFull(f, key); err != nil {
		return 0, 0, err
	}
	if fileName(string(key)) != name {
		return 0, 0, ErrCorrupt
	}
	return fi.Size(), int64(binary.LittleEndian.Uint64(h[8:])), nil
}

// fileName is the name of key's entry file.
func fileName(key string) string {
	sum := sha256.Sum256([]byte(key))
	return hex.EncodeToString(sum[:]) + suffix
}

func isEntryName(name string) bool {
	hexPart, ok := strings.CutSuffix(name, suffix)
	if !ok || len(hexPart) != 2*sha256.Size {
		return false
	}
	for _, c := range []byte(hexPart) {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// open opens entry file name for reading, refusing anything but a regular file: a FIFO planted
// under an entry's name would block a reader, a device would never end.
func (s *Store) open(name string) (*os.File, error) {
	if fi, err := s.root.Lstat(name); err != nil {
		return nil, err
	} else if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%w: %s is not a regular file", ErrCorrupt, name)
	}
	f, err := s.root.Open(name)
	if err != nil {
		return nil, err
	}
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("%w: %s is not a regular file", ErrCorrupt, name)
	}
	return f, nil
}

// Get implements respcache.CacheStore: (value, true, nil) for a live entry, (nil, false, nil) for
// an absent or expired one, (nil, false, err) when the file cannot be read (err wraps ErrCorrupt
// for a file that is not the key's entry, which is then removed), the Store is closed
// (respcache.ErrClosed) or ctx has ended before the read (ctx.Err()). The value belongs to the
// caller.
func (s *Store) Get(ctx context.Context, key string) ([]byte, bool, error) {
	if err := ctx.Err(); err != nil {
		return nil, false, err
	}
	name := fileName(key)
	now := s.cfg.Now().UnixNano()
	s.mu.RLock()
	if s.closed {
		s.mu.RUnlock()
		return nil, false, respcache.ErrClosed
	}
	e := s.idx[name]
	if e == nil {
		s.mu.RUnlock()
		s.misses.Add(1)
		return nil, false, nil
	}
	if e.expires <= now {
		s.mu.RUnlock()
		s.dropIf(name, e)
		s.misses.Add(1)
		return nil, false, nil
	}
	data, err := s.read(name)
	s.mu.RUnlock()
	if errors.Is(err, fs.ErrNotExist) { // removed behind the Store's back
		s.dropIf(name, e)
		s.misses.Add(1)
		return nil, false, nil
	}
	if err == nil {
		err = check(data, key)
	}
	if err != nil {
		s.errs.Add(respcache.ErrorTypeOf(err))
		if errors.Is(err, ErrCorrupt) {
			s.dropIf(name, e)
		}
		return nil, false, fmt.Errorf("filestore: get: %w", err)
	}
	if int64(binary.LittleEndian.Uint64(data[8:])) <= now {
		s.misses.Add(1)
		return nil, false, nil
	}
	e.lastUse.Store(s.clock.Add(1))
	s.hits.Add(1)
	return data[headerLen+len(key):], true, nil
}

// read reads entry file name whole, at most MaxEntryBytes of it.
func (s *Store) read(name string) ([]byte, error) {
	f, err := s.open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, s.cfg.MaxEntryBytes+1))
	if err == nil && int64(len(data)) > s.cfg.MaxEntryBytes {
		err = fmt.Errorf("%w: over MaxEntryBytes", ErrCorrupt)
	}
	return data, err
}

// check verifies that data is the entry file of key.
func check(data []byte, key string) error {
	if len(data) < headerLen || string(data[:8]) != magic {
		return fmt.Errorf("%w: bad header", ErrCorrupt)
	}
	klen := int(binary.LittleEndian.Uint32(data[16:]))
	if klen != len(key) || len(data)-headerLen < klen || string(data[headerLen:headerLen+klen]) != key {
		return fmt.Errorf("%w: the file holds another key", ErrCorrupt)
	}
	return nil
}

// Set implements respcache.CacheStore: it stores value under key for ttl (ttl ≤ 0: DefaultTTL),
// evicting entries when the Store goes over its limits. The error wraps respcache.ErrTooLarge when
// the entry alone exceeds MaxEntryBytes (the key's previous value is then removed), is
// respcache.ErrClosed after Close, ctx.Err() when ctx has ended before the write, and the
// filesystem's error otherwise. The Store keeps no reference to value.
func (s *Store) Set(ctx context.Context, key string, value []byte, ttl time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.RLock()
	closed := s.closed
	s.mu.RUnlock()
	if closed {
		return respcache.ErrClosed
	}
	if ttl <= 0 {
		ttl = s.cfg.DefaultTTL
	}
	now := s.cfg.Now()
	expires := now.Add(ttl).UnixNano()
	name := fileName(key)
	size := int64(headerLen) + int64(len(key)) + int64(len(value))
	if size > s.cfg.MaxEntryBytes {
		err := s.Delete(ctx, key)
		return errors.Join(fmt.Errorf("filestore: %w: %d bytes with its key and header, MaxEntryBytes %d",
			respcache.ErrTooLarge, size, s.cfg.MaxEntryBytes), err)
	}
	tmp, err := s.writeTemp(key, value, expires)
	if err != nil {
		s.errs.Add(respcache.ErrorTypeOf(err))
		return fmt.Errorf("filestore: set: %w", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return respcache.ErrClosed // closed while writing: the next New removes the temporary file
	}
	if err := s.root.Rename(tmp, name); err != nil {
		_ = s.root.Remove(tmp)
		s.errs.Add(respcache.ErrorTypeOf(err))
		return fmt.Errorf("filestore: set: %w", err)
	}
	if old := s.idx[name]; old != nil {
		s.size -= old.size
	}
	e := &entry{size: size, expires: expires}
	e.lastUse.Store(s.clock.Add(1))
	s.idx[name] = e
	s.size += size
	s.evict(name, now.UnixNano())
	return nil
}

// writeTemp writes the entry file of key to a new temporary file and returns its name.
func (s *Store) writeTemp(key string, value []byte, expires int64) (string, error) {
	var f *os.File
	var name string
	for range 10 {
		name = fmt.Sprintf("%s%016x", tmpPrefix, rand.Uint64())
		var err error
		if f, err = s.root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600); err == nil {
			break
		} else if !errors.Is(err, fs.ErrExist) {
			return "", err
		}
	}
	if f == nil {
		return "", errors.New("no free temporary file name")
	}
	var h [headerLen]byte
	copy(h[:], magic)
	binary.LittleEndian.PutUint64(h[8:], uint64(expires))
	binary.LittleEndian.PutUint32(h[16:], uint32(len(key)))
	_, err := io.Copy(f, io.MultiReader(bytes.NewReader(h[:]), strings.NewReader(key), bytes.NewReader(value)))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = s.root.Remove(name)
		return "", err
	}
	return name, nil
}

// evict removes entries, other than keep, until the Store is within its limits: each time the
// least recently used of up to evictionSample entries, an expired one first. s.mu is held.
func (s *Store) evict(keep string, now int64) {
	for len(s.idx) > s.cfg.MaxEntries || s.size > s.cfg.MaxBytes {
		var victim string
		var ve *entry
		n := 0
		for name, e := range s.idx { // map order is random: a sample
			if name == keep {
				continue
			}
			if e.expires <= now {
				victim, ve = name, e
				break
			}
			if ve == nil || e.lastUse.Load() < ve.lastUse.Load() {
				victim, ve = name, e
			}
			if n++; n == evictionSample {
				break
			}
		}
		if ve == nil {
			return // only keep is left
		}
		if ve.expires > now { // an expired entry is not counted as an eviction
			s.evictions.Add(1)
		}
		s.removeLocked(victim, ve)
	}
}

// removeLocked removes entry file name, whose entry is e. s.mu is held.
func (s *Store) removeLocked(name string, e *entry) {
	if err := s.root.Remove(name); err != nil && !errors.Is(err, fs.ErrNotExist) {
		s.errs.Add(respcache.ErrorTypeOf(err))
	}
	delete(s.idx, name)
	s.size -= e.size
}

// dropIf removes entry file name if its entry is still e (a Set may have replaced it since).
func (s *Store) dropIf(name string, e *entry) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.closed && s.idx[name] == e {
		s.removeLocked(name, e)
	}
}

// Delete implements respcache.CacheStore: it removes key's entry (absent is not an error). The
// error is respcache.ErrClosed after Close, or ctx.Err() when ctx has ended first.
func (s *Store) Delete(ctx context.Context, key string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	name := fileName(key)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return respcache.ErrClosed
	}
	if e := s.idx[name]; e != nil {
		s.removeLocked(name, e)
	}
	return nil
}

// Clear implements respcache.CacheStore: it removes every entry and returns how many it removed.
// Files in the directory that are not entries are left alone. The error is respcache.ErrClosed
// after Close, or ctx.Err() when ctx has ended first.
func (s *Store) Clear(ctx context.Context) (int, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, respcache.ErrClosed
	}
	n := len(s.idx)
	for name, e := range s.idx {
		s.removeLocked(name, e)
	}
	return n, nil
}

// Stats implements respcache.CacheStore with Backend "file": the live entries, the bytes of all
// entry files (expired ones not yet removed included), MaxEntries as Capacity, the evictions of
// live entries, hits, misses and errors by type. It reads no file and never fails.
func (s *Store) Stats(context.Context) respcache.StoreStats {
	now := s.cfg.Now().UnixNano()
	s.mu.RLock()
	live := 0
	for _, e := range s.idx {
		if e.expires > now {
			live++
		}
	}
	size := s.size
	s.mu.RUnlock()
	return respcache.StoreStats{
		Backend:   "file",
		Entries:   live,
		Capacity:  s.cfg.MaxEntries,
		SizeBytes: size,
		Evictions: s.evictions.Load(),
		Hits:      s.hits.Load(),
		Misses:    s.misses.Load(),
		Errors:    s.errs.Snapshot(),
	}
}

// Close releases the directory; the entries stay on disk for the next New. Later calls of Get,
// Set, Delete and Clear return respcache.ErrClosed; Stats still answers. It is idempotent.
func (s *Store) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	return s.root.Close()
}
