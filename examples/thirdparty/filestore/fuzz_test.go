package filestore_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"testing"
	"time"

	"example.com/thirdparty/filestore"
)

// FuzzEntryFile plants arbitrary bytes as the entry file of a key (its name is the key's SHA-256,
// as the package doc says): Get must not panic, and a hit must return the end of the file, never
// more than it holds.
func FuzzEntryFile(f *testing.F) {
	dir := filepath.Join(f.TempDir(), "cache")
	s, err := filestore.New(filestore.Config{Dir: dir, MaxEntryBytes: 1 << 16, MaxBytes: 1 << 20})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { s.Close() })
	sum := sha256.Sum256([]byte("k"))
	name := filepath.Join(dir, hex.EncodeToString(sum[:])+".kvr")
	if err := s.Set(ctx, "k", []byte("value"), time.Hour); err != nil {
		f.Fatal(err)
	}
	valid, err := os.ReadFile(name)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(valid)
	f.Add(valid[:len(valid)-1])
	f.Add(valid[:20])
	f.Add([]byte{})
	f.Add(append(bytes.Clone(valid[:16]), 0xff, 0xff, 0xff, 0xff))
	f.Fuzz(func(t *testing.T, data []byte) {
		if err := s.Set(ctx, "k", []byte("value"), time.Hour); err != nil { // indexed again
			t.Fatal(err)
		}
		if err := os.WriteFile(name, data, 0o600); err != nil {
			t.Fatal(err)
		}
		v, ok, err := s.Get(ctx, "k")
		if ok && (err != nil || !bytes.HasSuffix(data, v) || len(v) > len(data)-21) {
			t.Errorf("Get = %q, %v, %v from file %q", v, ok, err, data)
		}
		if !ok && v != nil {
			t.Errorf("a miss with a value: %q, %v", v, err)
		}
	})
}
