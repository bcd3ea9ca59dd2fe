package respcache_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/cachetest"
)

// s3TestConfig returns an S3Config from S3_ENDPOINT, S3_ACCESS_KEY, S3_SECRET_KEY and S3_BUCKET,
// under a fresh key prefix, or skips.
func s3TestConfig(t testing.TB) respcache.S3Config {
	t.Helper()
	cfg := respcache.S3Config{
		Endpoint:  os.Getenv("S3_ENDPOINT"),
		AccessKey: os.Getenv("S3_ACCESS_KEY"),
		SecretKey: os.Getenv("S3_SECRET_KEY"),
		Bucket:    os.Getenv("S3_BUCKET"),
	}
	if cfg.Endpoint == "" || cfg.Bucket == "" {
		skipOrFail(t, "S3_ENDPOINT or S3_BUCKET not set: no S3 to test against "+
			"(e.g. a versitygw: S3_ENDPOINT=http://127.0.0.1:7070 S3_ACCESS_KEY=… S3_SECRET_KEY=… S3_BUCKET=…)")
	}
	cfg.KeyPrefix = "kvroute-test/" + randHex() + "/"
	return cfg
}

// newTestS3 returns an S3Store on the S3 of the environment under a fresh prefix; cleanup clears
// the prefix and closes the store.
func newTestS3(t testing.TB, cfg respcache.S3Config) *respcache.S3Store {
	t.Helper()
	s, err := respcache.NewS3(cfg)
	if err != nil {
		t.Fatalf("NewS3(%v) = %v", cfg, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := s.Clear(ctx); err != nil {
			t.Errorf("cleanup Clear: %v", err)
		}
		_ = s.Close()
	})
	return s
}

// TestS3Conformance runs the CacheStore suite against a real S3-compatible server, with the
// expiry clock under the suite's control.
func TestS3Conformance(t *testing.T) {
	base := s3TestConfig(t)
	clk := cachetest.NewClock(time.Time{})
	cachetest.RunOptions(t, func(t *testing.T) respcache.CacheStore {
		cfg := base
		cfg.KeyPrefix = s3TestConfig(t).KeyPrefix
		cfg.Now = clk.Now
		return newTestS3(t, cfg)
	}, cachetest.Options{Advance: clk.Advance, DefaultTTL: respcache.DefaultTTL})
}
