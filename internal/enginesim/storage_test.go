package enginesim

import (
	"bytes"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestStorageKeyVectors pins the storage block keys: engines of different builds or versions in
// one fleet must find each other's blocks.
func TestStorageKeyVectors(t *testing.T) {
	tests := []struct {
		name   string
		model  string
		bs     int
		tokens []uint32
		want   []string
	}{
		{"one block", "m", 4, []uint32{1, 2, 3, 4}, []string{"696d3b31d6d21a8f"}},
		{"two blocks and a partial one", "m", 4, []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9}, []string{"696d3b31d6d21a8f", "1dca158ea9bf31f0"}},
		{"other model", "meta-llama/Llama-3.1-8B-Instruct", 4, []uint32{1, 2, 3, 4}, []string{"1ea4174fe2032541"}},
		{"other block size", "m", 2, []uint32{1, 2, 3, 4}, []string{"f7414a67068aca09", "0713f4db0e74fc7c"}},
		{"no full block", "m", 4, []uint32{1, 2, 3}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got []string
			for _, k := range storageKeys(nil, tt.model, tt.bs, tt.tokens) {
				got = append(got, formatKey(k))
			}
			assert.Equal(t, tt.want, got)
		})
	}
}

func TestStorageKeysIndependentOfEngineSeed(t *testing.T) {
	tokens := seqTokens(100, 40)
	a := newTestEngine(t, Config{Model: "m", BlockSize: 8, HashSeed: 1})
	b := newTestEngine(t, Config{Model: "m", BlockSize: 8, HashSeed: 2})
	assert.NotEqual(t, a.cache.hashes(nil, tokens), b.cache.hashes(nil, tokens), "engine hashes differ by seed")
	keys := storageKeys(nil, "m", 8, tokens)
	require.Len(t, keys, 5)
	// Chained: a block's key depends on every block before it.
	other := append(seqTokens(999, 8), tokens[8:]...)
	assert.NotEqual(t, keys[1:], storageKeys(nil, "m", 8, other)[1:])
}

func TestFormatParseKey(t *testing.T) {
	for _, k := range []uint64{0, 1, 0xabc, 1 << 63, ^uint64(0)} {
		s := formatKey(k)
		assert.Len(t, s, 16)
		got, ok := parseKey(s)
		assert.True(t, ok)
		assert.Equal(t, k, got)
	}
	for _, bad := range []string{"", "abc", "0123456789abcdefg", "zzzzzzzzzzzzzzzz", "+123456789abcdef"} {
		_, ok := parseKey(bad)
		assert.False(t, ok, bad)
	}
}

func TestBlockObjectRoundTrip(t *testing.T) {
	tokens := seqTokens(10, 12)
	keys := storageKeys(nil, "m", 4, tokens)
	for i := range keys {
		obj := encodeBlock(keys, i, tokens[i*4:(i+1)*4])
		require.NoError(t, checkBlock(obj, keys, i, tokens[i*4:(i+1)*4]), "block %d", i)
	}
	good := encodeBlock(keys, 1, tokens[4:8])
	corrupt := func(f func(b []byte) []byte) []byte { return f(bytes.Clone(good)) }
	tests := []struct {
		name string
		obj  []byte
		i    int
	}{
		{"truncated", good[:len(good)-1], 1},
		{"empty", nil, 1},
		{"bad magic", corrupt(func(b []byte) []byte { b[0] = 'X'; return b }), 1},
		{"bad version", corrupt(func(b []byte) []byte { b[4] = 9; return b }), 1},
		{"other key", corrupt(func(b []byte) []byte { b[8] ^= 1; return b }), 1},
		{"other parent", corrupt(func(b []byte) []byte { b[16] ^= 1; return b }), 1},
		{"no parent flag", corrupt(func(b []byte) []byte { b[5] = 0; return b }), 1},
		{"other token", corrupt(func(b []byte) []byte { b[len(b)-1] ^= 1; return b }), 1},
		{"another block's object", encodeBlock(keys, 2, tokens[8:12]), 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.ErrorIs(t, checkBlock(tt.obj, keys, tt.i, tokens[4:8]), errBadBlock)
		})
	}
}

func TestStorageConfigValidation(t *testing.T) {
	ok := StorageConfig{Endpoint: "http://127.0.0.1:9000", Bucket: "b"}
	tests := []struct {
		name string
		edit func(c *StorageConfig)
		want string // "" = valid
	}{
		{"minimal", func(*StorageConfig) {}, ""},
		{"https", func(c *StorageConfig) { c.Endpoint = "https://s3.example.com" }, ""},
		{"no bucket", func(c *StorageConfig) { c.Bucket = "" }, "Bucket is required"},
		{"no endpoint", func(c *StorageConfig) { c.Endpoint = "" }, "Endpoint is required"},
		{"no scheme", func(c *StorageConfig) { c.Endpoint = "127.0.0.1:9000" }, "want http"},
		{"path", func(c *StorageConfig) { c.Endpoint = "http://h:1/bucket" }, "host[:port] only"},
		{"user info", func(c *StorageConfig) { c.Endpoint = "http://ak:sk@h:1" }, "credentials in the URL"},
		{"negative bytes", func(c *StorageConfig) { c.BytesPerToken = -1 }, "BytesPerToken"},
		{"negative bandwidth", func(c *StorageConfig) { c.BandwidthBytesPerSec = -1 }, "BandwidthBytesPerSec"},
		{"dot-dot namespace", func(c *StorageConfig) { c.Namespace = "a/../b" }, "path segment"},
		{"empty segment", func(c *StorageConfig) { c.Namespace = "a//b" }, "path segment"},
		{"lookup", func(c *StorageConfig) { c.Lookup = 7 }, "Lookup"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sc := ok
			tt.edit(&sc)
			e, err := New(Config{Storage: &sc})
			if tt.want == "" {
				require.NoError(t, err)
				defer e.Close()
				got := e.Config().Storage
				assert.Equal(t, DefaultKVNamespace, got.Namespace)
				assert.Equal(t, int64(DefaultBytesPerToken), got.BytesPerToken)
				assert.Equal(t, float64(DefaultStorageBandwidth), got.BandwidthBytesPerSec)
				assert.Equal(t, DefaultStorageOpTimeout, got.OpTimeout)
				assert.Equal(t, DefaultStorageRegion, got.Region)
				assert.Empty(t, sc.Namespace, "the caller's StorageConfig is not modified")
				return
			}
			assert.ErrorIs(t, err, ErrInvalidConfig)
			assert.ErrorContains(t, err, tt.want)
		})
	}
	_, err := New(Config{Role: 9})
	assert.ErrorIs(t, err, ErrInvalidConfig)
	sc := ok
	sc.Namespace = "/team/kv/"
	e, err := New(Config{Storage: &sc})
	require.NoError(t, err)
	defer e.Close()
	assert.Equal(t, "team/kv", e.Config().Storage.Namespace)
}

func TestStorageConfigRedactsCredentials(t *testing.T) {
	sc := &StorageConfig{Endpoint: "http://127.0.0.1:9000", Bucket: "b", AccessKey: "AKIA-visible-id", SecretKey: "s3cr3t-value"}
	var logged bytes.Buffer
	slog.New(slog.NewTextHandler(&logged, nil)).Info("storage", "cfg", sc, "value", *sc)
	for name, s := range map[string]string{
		"String":           sc.String(),
		"%v":               fmt.Sprintf("%v", sc),
		"%+v":              fmt.Sprintf("%+v", *sc),
		"%#v":              fmt.Sprintf("%#v", *sc),
		"Config %+v":       fmt.Sprintf("%+v", Config{Storage: sc}),
		"Config %v":        fmt.Sprintf("%v", Config{Storage: sc}),
		"slog":             logged.String(),
		"validation error": fmt.Sprint(func() error { _, err := New(Config{Storage: sc, BlockSize: -1}); return err }()),
	} {
		assert.NotContains(t, s, "AKIA-visible-id", name)
		assert.NotContains(t, s, "s3cr3t-value", name)
	}
	assert.Contains(t, sc.String(), "[REDACTED]")
	assert.Contains(t, StorageConfig{}.String(), `AccessKey:""`, "an empty credential shows as empty")
}

func TestParseRoleAndLookup(t *testing.T) {
	for s, want := range map[string]Role{"": RoleUnified, "unified": RoleUnified, "Prefill": RolePrefill, "DECODE": RoleDecode} {
		got, err := ParseRole(s)
		require.NoError(t, err, s)
		assert.Equal(t, want, got, s)
		if s != "" {
			assert.Equal(t, strings.ToLower(s), got.String())
		}
	}
	_, err := ParseRole("both")
	assert.ErrorIs(t, err, ErrInvalidConfig)
	for s, want := range map[string]StorageLookup{"": StorageLookupAuto, "auto": StorageLookupAuto, "on": StorageLookupOn, "off": StorageLookupOff} {
		got, err := ParseStorageLookup(s)
		require.NoError(t, err, s)
		assert.Equal(t, want, got, s)
	}
	_, err = ParseStorageLookup("sometimes")
	assert.ErrorIs(t, err, ErrInvalidConfig)
}

func TestTransferTime(t *testing.T) {
	assert.Equal(t, time.Duration(0), transferTime(0, 1e9))
	assert.Equal(t, time.Second, transferTime(1e9, 1e9))
	assert.Equal(t, 16*time.Millisecond, transferTime(16000, 1e6))
	// A 16-token block of the default size at the default bandwidth.
	assert.Equal(t, 209715*time.Nanosecond, transferTime(16*DefaultBytesPerToken, DefaultStorageBandwidth))
}

// TestInsertLoaded checks the placement of loaded blocks: after the cached prefix, as evictable
// GPU blocks with GPU events, never evicting the prompt's own blocks, stopping when full.
func TestInsertLoaded(t *testing.T) {
	tokens := seqTokens(1, 24) // 6 blocks of 4
	t.Run("after a cached prefix", func(t *testing.T) {
		c := newBlockCache(4, 16, 0, 7)
		l := c.admit(ptr(c.makePlan(tokens[:8], 0)))
		c.release(l)
		c.ops = nil
		assert.Equal(t, 3, c.insertLoaded(tokens, 2, 5))
		gpu, _ := c.lookup(tokens)
		assert.Equal(t, 5, gpu)
		require.Len(t, c.ops, 1)
		o := c.ops[0]
		assert.Equal(t, TierGPU, o.tier)
		assert.Equal(t, c.hashes(nil, tokens)[2:5], o.hashes)
		assert.True(t, o.hasParent)
		assert.Equal(t, c.hashes(nil, tokens)[1], o.parent)
		assert.Equal(t, tokens[8:20], o.tokens)
		assert.Equal(t, 0, c.held(), "placed blocks are evictable")
	})
	t.Run("gap before the run", func(t *testing.T) {
		c := newBlockCache(4, 16, 0, 7)
		assert.Zero(t, c.insertLoaded(tokens, 2, 5))
		assert.Empty(t, c.ops)
	})
	t.Run("cache too small keeps the prefix", func(t *testing.T) {
		c := newBlockCache(4, 4, 0, 7)
		l := c.admit(ptr(c.makePlan(tokens[:8], 0)))
		c.release(l)
		c.ops = nil
		assert.Equal(t, 2, c.insertLoaded(tokens, 2, 6), "two free blocks, the prefix pinned")
		gpu, _ := c.lookup(tokens)
		assert.Equal(t, 4, gpu)
	})
	t.Run("blocks already held are skipped", func(t *testing.T) {
		c := newBlockCache(4, 16, 0, 7)
		l := c.admit(ptr(c.makePlan(tokens[:12], 0)))
		c.release(l)
		c.ops = nil
		assert.Equal(t, 2, c.insertLoaded(tokens, 2, 5), "block 2 held, 3 and 4 placed")
		require.Len(t, c.ops, 1)
		assert.Equal(t, c.hashes(nil, tokens)[3:5], c.ops[0].hashes)
	})
}

func ptr[T any](v T) *T { return &v }
