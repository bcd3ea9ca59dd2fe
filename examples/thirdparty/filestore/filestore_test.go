package filestore_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/cachetest"

	"example.com/thirdparty/filestore"
)

func newStore(t *testing.T, cfg filestore.Config) *filestore.Store {
	t.Helper()
	if cfg.Dir == "" {
		cfg.Dir = filepath.Join(t.TempDir(), "cache")
	}
	s, err := filestore.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func TestConformance(t *testing.T) {
	clk := cachetest.NewClock(time.Time{})
	cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
		return newStore(t, filestore.Config{Now: clk.Now, DefaultTTL: 3 * time.Minute})
	}, cachetest.Options{Advance: clk.Advance, DefaultTTL: 3 * time.Minute})
}

var ctx = context.Background()

func mustGet(t *testing.T, s respcache.CacheStore, key string) string {
	t.Helper()
	v, ok, err := s.Get(ctx, key)
	if err != nil || !ok {
		t.Fatalf("Get(%q) = %q, %v, %v; want a hit", key, v, ok, err)
	}
	return string(v)
}

// Entries outlive the Store: a new one on the same directory finds them, without the expired ones
// and the temporary file of an interrupted Set.
func TestPersistence(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "cache")
	clk := cachetest.NewClock(time.Time{})
	s := newStore(t, filestore.Config{Dir: dir, Now: clk.Now})
	for k, ttl := range map[string]time.Duration{"long": time.Hour, "short": time.Minute} {
		if err := s.Set(ctx, k, []byte("value of "+k), ttl); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, _, err := s.Get(ctx, "long"); !errors.Is(err, respcache.ErrClosed) {
		t.Errorf("Get after Close: %v", err)
	}
	if err := os.WriteFile(filepath.Join(dir, ".tmp-0123456789abcdef"), []byte("half a Set"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "README"), []byte("not an entry"), 0o600); err != nil {
		t.Fatal(err)
	}
	clk.Advance(2 * time.Minute)

	s2 := newStore(t, filestore.Config{Dir: dir, Now: clk.Now})
	if got := mustGet(t, s2, "long"); got != "value of long" {
		t.Errorf("after reopening: %q", got)
	}
	if st := s2.Stats(ctx); st.Entries != 1 {
		t.Errorf("reopened store: %d entries, want 1 (the expired one removed)", st.Entries)
	}
	names := dirNames(t, dir)
	if len(names) != 2 || names[0] != "README" || !strings.HasSuffix(names[1], ".kvr") {
		t.Errorf("directory after reopening: %v; want one entry and the README", names)
	}
}

func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	des, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, de := range des {
		out = append(out, de.Name())
	}
	return out
}

// Keys are data, never paths: whatever they hold, every file stays in the directory under a
// digest's name.
func TestHostileKeys(t *testing.T) {
	parent := t.TempDir()
	dir := filepath.Join(parent, "cache")
	s := newStore(t, filestore.Config{Dir: dir})
	keys := []string{"../escape", "../../../../../../tmp/x", "/etc/passwd", `..\..\windows`, "a/b/c", "CON", "NUL.txt",
		"nul\x00byte", ".", "..", "", strings.Repeat("k", 100_000), "é\u202etxt.exe", ".tmp-0000000000000000"}
	for i, k := range keys {
		if err := s.Set(ctx, k, []byte{byte(i)}, time.Hour); err != nil {
			t.Fatalf("Set(%.20q): %v", k, err)
		}
	}
	for i, k := range keys {
		if got := mustGet(t, s, k); got != string([]byte{byte(i)}) {
			t.Errorf("Get(%.20q) = %q", k, got)
		}
	}
	if names := dirNames(t, parent); len(names) != 1 || names[0] != "cache" {
		t.Errorf("files appeared beside the directory: %v", names)
	}
	for _, name := range dirNames(t, dir) {
		if len(name) != 64+len(".kvr") {
			t.Errorf("entry file %q is not named by a digest", name)
		}
	}
	if n, err := s.Clear(ctx); err != nil || n != len(keys) {
		t.Errorf("Clear = %d, %v; want %d", n, err, len(keys))
	}
}

// A file planted under an entry's name, a symbolic link out of the directory or another entry's
// file, is not served.
func TestPlantedFiles(t *testing.T) {
	parent := t.TempDir()
	dir := filepath.Join(parent, "cache")
	s := newStore(t, filestore.Config{Dir: dir})
	secret := filepath.Join(parent, "secret")
	if err := os.WriteFile(secret, []byte("the host's secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"victim", "other"} {
		if err := s.Set(ctx, k, []byte("value of "+k), time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	entry := func(key string) string { // the entry file of key: the one that changed
		before := dirNames(t, dir)
		if err := s.Set(ctx, key, []byte("probe"), time.Hour); err != nil {
			t.Fatal(err)
		}
		for _, n := range dirNames(t, dir) {
			if !contains(before, n) {
				return filepath.Join(dir, n)
			}
		}
		t.Fatalf("no file for %q", key)
		return ""
	}
	victim, other := entry("victim2"), entry("other2")

	// Another entry's file renamed onto the victim's name.
	if err := os.Rename(other, victim); err != nil {
		t.Fatal(err)
	}
	if v, ok, err := s.Get(ctx, "victim2"); ok || !errors.Is(err, filestore.ErrCorrupt) {
		t.Errorf("Get of a swapped file = %q, %v, %v; want ErrCorrupt", v, ok, err)
	}
	// A symbolic link out of the directory.
	victim3 := entry("victim3")
	if err := os.Remove(victim3); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(secret, victim3); err != nil {
		t.Skipf("no symbolic links here: %v", err)
	}
	if v, ok, err := s.Get(ctx, "victim3"); ok || err == nil || bytes.Contains(v, []byte("secret")) {
		t.Errorf("Get through a planted symlink = %q, %v, %v; want an error", v, ok, err)
	}
	if st := s.Stats(ctx); st.Errors[respcache.ErrorTypeOther] != 2 {
		t.Errorf("errors counted: %v, want 2 other", st.Errors)
	}
	if got := mustGet(t, s, "victim"); got != "value of victim" {
		t.Errorf("untouched entry: %q", got)
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func TestLimits(t *testing.T) {
	t.Run("entries", func(t *testing.T) {
		s := newStore(t, filestore.Config{MaxEntries: 4})
		for _, k := range []string{"a", "b", "c", "d"} {
			if err := s.Set(ctx, k, []byte(k), time.Hour); err != nil {
				t.Fatal(err)
			}
		}
		mustGet(t, s, "a") // a is now more recent than b, c and d
		if err := s.Set(ctx, "e", []byte("e"), time.Hour); err != nil {
			t.Fatal(err)
		}
		st := s.Stats(ctx)
		if st.Entries != 4 || st.Evictions != 1 {
			t.Errorf("after a 5th Set: %d entries, %d evictions; want 4, 1", st.Entries, st.Evictions)
		}
		mustGet(t, s, "a") // with 4 entries every one is in the sample: exactly LRU
		mustGet(t, s, "e")
	})
	t.Run("bytes", func(t *testing.T) {
		s := newStore(t, filestore.Config{MaxBytes: 1000, MaxEntryBytes: 500})
		for _, k := range []string{"a", "b", "c"} {
			if err := s.Set(ctx, k, bytes.Repeat([]byte{'x'}, 400), time.Hour); err != nil {
				t.Fatal(err)
			}
		}
		if st := s.Stats(ctx); st.SizeBytes > 1000 || st.Entries != 2 {
			t.Errorf("Stats = %+v; want 2 entries within 1000 bytes", st)
		}
		if err := s.Set(ctx, "c", make([]byte, 600), time.Hour); !errors.Is(err, respcache.ErrTooLarge) {
			t.Errorf("Set over MaxEntryBytes = %v; want respcache.ErrTooLarge", err)
		}
		if _, ok, _ := s.Get(ctx, "c"); ok {
			t.Errorf("the refused Set left the key's previous value")
		}
	})
	t.Run("config", func(t *testing.T) {
		world := filepath.Join(t.TempDir(), "world")
		if err := os.Mkdir(world, 0o777); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(world, 0o777); err != nil {
			t.Fatal(err)
		}
		for _, cfg := range []filestore.Config{
			{},
			{Dir: t.TempDir(), MaxEntries: -1},
			{Dir: t.TempDir(), MaxBytes: 10, MaxEntryBytes: 11},
			{Dir: world},
		} {
			if _, err := filestore.New(cfg); !errors.Is(err, respcache.ErrInvalidConfig) {
				t.Errorf("New(%+v) = %v; want respcache.ErrInvalidConfig", cfg, err)
			}
		}
	})
}

// The response cache's middleware over a filestore: the second identical request is served from
// disk, and so is a request after a restart.
func TestMiddleware(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "cache")
	var calls atomic.Int32
	backend := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"chatcmpl-1","choices":[{"message":{"role":"assistant","content":"4"}}]}`)
	})
	serve := func(h http.Handler) (string, string) {
		body := `{"model":"m","temperature":0,"messages":[{"role":"user","content":"2+2?"}]}`
		req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer tenant-key")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != http.StatusOK {
			t.Fatalf("status %d: %s", rec.Code, rec.Body)
		}
		return rec.Header().Get("X-Cache"), rec.Body.String()
	}
	for run, want := range [][]string{{respcache.XCacheMiss, respcache.XCacheHit}, {respcache.XCacheHit}} {
		store := newStore(t, filestore.Config{Dir: dir})
		cache, err := respcache.New(respcache.Config{Store: store, TTL: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		h := cache.Middleware(backend)
		for _, w := range want {
			if got, body := serve(h); got != w || !strings.Contains(body, `"content":"4"`) {
				t.Errorf("run %d: X-Cache %s, body %s; want %s", run, got, body, w)
			}
		}
		cache.Close()
		store.Close()
	}
	if n := calls.Load(); n != 1 {
		t.Errorf("the backend answered %d times, want 1", n)
	}
}
