package s3store_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/cachetest"
	"github.com/kvroute/kvroute/respcache/internal/storetest"
	"github.com/kvroute/kvroute/respcache/s3store"
)

const (
	s3AccessSecret = "AKIA-NOT-TO-BE-SHOWN"
	s3SecretSecret = "wJalrXUtnFEMI-secret-key"
)

func TestNewValidation(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  s3store.Config
	}{
		{"no_endpoint", s3store.Config{Bucket: "bucket"}},
		{"no_bucket", s3store.Config{Endpoint: "127.0.0.1:9000"}},
		{"scheme", s3store.Config{Endpoint: "ftp://127.0.0.1:9000", Bucket: "bucket"}},
		{"path", s3store.Config{Endpoint: "http://127.0.0.1:9000/base", Bucket: "bucket"}},
		{"query", s3store.Config{Endpoint: "http://127.0.0.1:9000?x=1", Bucket: "bucket"}},
		{"no_host", s3store.Config{Endpoint: "http://", Bucket: "bucket"}},
		{"credentials_in_url", s3store.Config{Endpoint: "http://key:" + s3SecretSecret + "@127.0.0.1:9000", Bucket: "bucket"}},
		{"host_with_path", s3store.Config{Endpoint: "127.0.0.1:9000/x", Bucket: "bucket"}},
		{"credentials_without_scheme", s3store.Config{Endpoint: "key:" + s3SecretSecret + "@127.0.0.1:9000", Bucket: "bucket"}},
		{"absolute_prefix", s3store.Config{Endpoint: "127.0.0.1:9000", Bucket: "bucket", KeyPrefix: "/abs/"}},
		{"negative_ttl", s3store.Config{Endpoint: "127.0.0.1:9000", Bucket: "bucket", DefaultTTL: -time.Second}},
		{"negative_timeout", s3store.Config{Endpoint: "127.0.0.1:9000", Bucket: "bucket", OpTimeout: -time.Second}},
		{"invalid_bucket_name", s3store.Config{Endpoint: "127.0.0.1:1", Bucket: "Bad_Bucket!", OpTimeout: 100 * time.Millisecond}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.SecretKey = s3SecretSecret
			s, err := s3store.New(tc.cfg)
			if s != nil {
				_ = s.Close()
			}
			require.ErrorIs(t, err, respcache.ErrInvalidConfig)
			require.NotContains(t, err.Error(), s3SecretSecret)
		})
	}
}

func TestSecretsRedacted(t *testing.T) {
	cfg := s3store.Config{Endpoint: "http://127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)), Bucket: "bucket",
		AccessKey: s3AccessSecret, SecretKey: s3SecretSecret, OpTimeout: 200 * time.Millisecond}
	var logBuf bytes.Buffer
	slog.New(slog.NewJSONHandler(&logBuf, nil)).Info("config", "s3", cfg)
	for _, out := range []string{cfg.String(), fmt.Sprint(cfg), fmt.Sprintf("%+v", cfg), fmt.Sprintf("%#v", cfg), logBuf.String()} {
		require.NotContains(t, out, s3AccessSecret)
		require.NotContains(t, out, s3SecretSecret)
		require.Contains(t, out, "127.0.0.1")
	}
	s, err := s3store.New(cfg) // unreachable: starts with its circuit open
	require.NoError(t, err)
	defer s.Close()
	out := fmt.Sprintf("%v %+v %#v %s", s, s, s, s)
	require.NotContains(t, out, s3SecretSecret)
	require.NotContains(t, out, s3AccessSecret)
	_, _, err = s.Get(context.Background(), "k")
	require.ErrorIs(t, err, respcache.ErrUnavailable)
	require.NotContains(t, err.Error(), s3SecretSecret)
	require.NotContains(t, err.Error(), s3AccessSecret)
}

// TestNewBucketMissing: a bucket that does not exist is a configuration error naming it.
func TestNewBucketMissing(t *testing.T) {
	cfg := s3TestConfig(t)
	cfg.Bucket = "kvroute-no-such-bucket-" + testenv.RandHex()
	_, err := s3store.New(cfg)
	require.ErrorIs(t, err, respcache.ErrInvalidConfig)
	require.Contains(t, err.Error(), fmt.Sprintf("bucket %q does not exist", cfg.Bucket))
}

// TestNewBadCredentials: rejected credentials are a configuration error without the secret.
func TestNewBadCredentials(t *testing.T) {
	cfg := s3TestConfig(t)
	cfg.SecretKey = s3SecretSecret
	_, err := s3store.New(cfg)
	require.ErrorIs(t, err, respcache.ErrInvalidConfig)
	require.NotContains(t, err.Error(), s3SecretSecret)
	t.Log(err)
}

// minioFor returns a plain minio client on the test S3.
func minioFor(t *testing.T, cfg s3store.Config) *minio.Client {
	t.Helper()
	u, err := url.Parse(cfg.Endpoint)
	require.NoError(t, err)
	c, err := minio.New(u.Host, &minio.Options{Creds: credentials.NewStaticV4(cfg.AccessKey, cfg.SecretKey, ""),
		Secure: u.Scheme == "https", Region: "us-east-1"})
	require.NoError(t, err)
	return c
}

// TestExpiryMetadata: Set writes the expiry in the object's metadata (TTLOverride wins over
// ttl); an expired object is a miss and is deleted in the background; a Set right after such a
// miss survives.
func TestExpiryMetadata(t *testing.T) {
	cfg := s3TestConfig(t)
	clk := cachetest.NewClock(time.Time{})
	cfg.Now = clk.Now
	s := newTestS3(t, cfg)
	mc := minioFor(t, cfg)
	ctx := context.Background()

	require.NoError(t, s.Set(ctx, "k", []byte("v"), 90*time.Second))
	info, err := mc.StatObject(ctx, cfg.Bucket, cfg.KeyPrefix+"k", minio.StatObjectOptions{})
	require.NoError(t, err)
	require.Equal(t, strconv.FormatInt(clk.Now().Add(90*time.Second).UnixMilli(), 10), info.UserMetadata[s3store.ExpiresMeta])

	clk.Advance(91 * time.Second)
	_, ok, err := s.Get(ctx, "k")
	require.NoError(t, err)
	require.False(t, ok)
	require.Eventually(t, func() bool {
		_, err := mc.StatObject(ctx, cfg.Bucket, cfg.KeyPrefix+"k", minio.StatObjectOptions{})
		return minio.ToErrorResponse(err).Code == minio.NoSuchKey && s.ReaperIdle()
	}, 5*time.Second, 20*time.Millisecond, "expired object not deleted in the background")

	for i := range 20 { // expired miss, then an immediate Set: the fresh value must survive the reaper
		k := "again-" + strconv.Itoa(i)
		require.NoError(t, s.Set(ctx, k, []byte("old"), time.Second))
		clk.Advance(2 * time.Second)
		_, ok, err := s.Get(ctx, k)
		require.NoError(t, err)
		require.False(t, ok)
		require.NoError(t, s.Set(ctx, k, []byte("new"), time.Hour))
		time.Sleep(5 * time.Millisecond)
		v, ok, err := s.Get(ctx, k)
		require.NoError(t, err)
		require.True(t, ok, "fresh value deleted by the expired-object reaper")
		require.Equal(t, "new", string(v))
	}

	over := cfg
	over.KeyPrefix = s3TestConfig(t).KeyPrefix
	over.TTLOverride = 7 * 24 * time.Hour
	so := newTestS3(t, over)
	require.NoError(t, so.Set(ctx, "k", []byte("v"), time.Minute))
	info, err = mc.StatObject(ctx, cfg.Bucket, over.KeyPrefix+"k", minio.StatObjectOptions{})
	require.NoError(t, err)
	require.Equal(t, strconv.FormatInt(clk.Now().Add(over.TTLOverride).UnixMilli(), 10), info.UserMetadata[s3store.ExpiresMeta])
}

// TestKeyEscaping: awkward keys round-trip, and every object stays one flat name under the prefix.
func TestKeyEscaping(t *testing.T) {
	cfg := s3TestConfig(t)
	s := newTestS3(t, cfg)
	ctx := context.Background()
	keys := []string{"", "a/b/c", "..", ".", "../../etc/passwd", "tenant:alice|model=gpt", "ключ-日本",
		"%41", "A", "with space", strings.Repeat("x", 1000), strings.Repeat("/", 300), "\x00\xff"}
	for i, k := range keys {
		require.NoError(t, s.Set(ctx, k, []byte("v"+strconv.Itoa(i)), time.Minute), "key %q", k)
	}
	for i, k := range keys {
		v, ok, err := s.Get(ctx, k)
		require.NoError(t, err, "key %q", k)
		require.True(t, ok, "key %q", k)
		require.Equal(t, "v"+strconv.Itoa(i), string(v), "key %q", k)
	}
	mc := minioFor(t, cfg)
	n := 0
	for obj := range mc.ListObjects(ctx, cfg.Bucket, minio.ListObjectsOptions{Prefix: cfg.KeyPrefix, Recursive: true}) {
		require.NoError(t, obj.Err)
		rest := strings.TrimPrefix(obj.Key, cfg.KeyPrefix)
		require.NotContains(t, rest, "/")
		require.LessOrEqual(t, len(rest), 200)
		n++
	}
	require.Equal(t, len(keys), n)
	cleared, err := s.Clear(ctx)
	require.NoError(t, err)
	require.Equal(t, len(keys), cleared)
}

// TestCloseIdempotent: Close twice, then methods return ErrClosed; Stats still answers.
func TestCloseIdempotent(t *testing.T) {
	s, err := s3store.New(s3store.Config{Endpoint: "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)), Bucket: "bucket",
		OpTimeout: 100 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, s.Close())
	require.NoError(t, s.Close())
	ctx := context.Background()
	storetest.RequireClosed(t, s)
	require.Equal(t, "s3", s.Stats(ctx).Backend)
}

// TestStats: hits and misses are counted; Entries is -1.
func TestStats(t *testing.T) {
	s := newTestS3(t, s3TestConfig(t))
	ctx := context.Background()
	require.NoError(t, s.Set(ctx, "k", []byte("v"), time.Minute))
	_, _, _ = s.Get(ctx, "k")
	_, _, _ = s.Get(ctx, "absent")
	st := s.Stats(ctx)
	require.Equal(t, respcache.StoreStats{Backend: "s3", Entries: -1, Hits: 1, Misses: 1,
		Errors: map[string]uint64{"connection": 0, "timeout": 0, "other": 0}}, st)
}

// TestCloseReleasesGoroutines: after real traffic (an expired object queued for deletion
// included), Close leaves no goroutine behind.
func TestCloseReleasesGoroutines(t *testing.T) {
	cfg := s3TestConfig(t)
	clk := cachetest.NewClock(time.Time{})
	cfg.Now = clk.Now
	before := storeGoroutines()
	s, err := s3store.New(cfg)
	require.NoError(t, err)
	ctx := context.Background()
	for i := range 10 {
		k := "g" + strconv.Itoa(i)
		require.NoError(t, s.Set(ctx, k, []byte("v"), time.Second))
	}
	clk.Advance(time.Minute)
	for i := range 10 {
		_, ok, err := s.Get(ctx, "g"+strconv.Itoa(i))
		require.NoError(t, err)
		require.False(t, ok)
	}
	_, err = s.Clear(ctx)
	require.NoError(t, err)
	require.NoError(t, s.Close())
	requireNoStoreGoroutines(t, before)
}
