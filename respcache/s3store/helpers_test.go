package s3store_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/redisstore"
	"github.com/kvroute/kvroute/respcache/s3store"
)

// Integration helpers of the store, tiered and fault tests.
//
// Environment: S3_ENDPOINT, S3_ACCESS_KEY, S3_SECRET_KEY, S3_BUCKET (an existing bucket the tests
// may write to, under unique key prefixes they delete), REDIS_ADDR (host:port of a Redis 7, for the
// tiered store with a Redis L1), and KVROUTE_REQUIRE_INTEGRATION=1 to turn every skip for a missing
// server or binary (versitygw, for the private server of the fault tests) into a failure.

// skipOrFail skips t with why, or fails it under KVROUTE_REQUIRE_INTEGRATION=1.
func skipOrFail(t testing.TB, why string) {
	t.Helper()
	if os.Getenv("KVROUTE_REQUIRE_INTEGRATION") == "1" {
		t.Fatalf("KVROUTE_REQUIRE_INTEGRATION=1: %s", why)
	}
	t.Skip(why)
}

// redisAddr returns REDIS_ADDR, or skips.
func redisAddr(t testing.TB) string {
	t.Helper()
	addr := os.Getenv("REDIS_ADDR")
	if addr == "" {
		skipOrFail(t, "REDIS_ADDR not set: no Redis to test against (e.g. REDIS_ADDR=127.0.0.1:6379)")
	}
	return addr
}

// randHex returns 12 random hex digits.
func randHex() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// freePort returns a TCP port on 127.0.0.1 that nothing listens on (at the time of the call).
func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	return port
}

// s3TestConfig returns a Config from S3_ENDPOINT, S3_ACCESS_KEY, S3_SECRET_KEY and S3_BUCKET,
// under a fresh key prefix, or skips.
func s3TestConfig(t testing.TB) s3store.Config {
	t.Helper()
	cfg := s3store.Config{
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

// newTestS3 returns a Store on the S3 of the environment under a fresh prefix; cleanup clears the
// prefix and closes the store.
func newTestS3(t testing.TB, cfg s3store.Config) *s3store.Store {
	t.Helper()
	s, err := s3store.New(cfg)
	if err != nil {
		t.Fatalf("New(%v) = %v", cfg, err)
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

// newTestRedis returns a redisstore.Store on REDIS_ADDR under a fresh key prefix; cleanup clears
// the prefix and closes the store.
func newTestRedis(t testing.TB) *redisstore.Store {
	t.Helper()
	s, err := redisstore.New(redisstore.Config{URL: "redis://" + redisAddr(t), KeyPrefix: "kvroute-test:tiered:" + randHex() + ":"})
	if err != nil {
		t.Fatalf("redisstore.New: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, err := s.Clear(ctx); err != nil {
			t.Errorf("cleanup Clear: %v", err)
		}
		_ = s.Close()
	})
	return s
}

func mustTiered(t testing.TB, cfg respcache.TieredConfig) *respcache.TieredStore {
	t.Helper()
	s, err := respcache.NewTiered(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func mustMemory(t testing.TB, cfg respcache.MemoryConfig) *respcache.MemoryStore {
	t.Helper()
	m, err := respcache.NewMemory(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// storeGoroutines returns the stacks of live goroutines that belong to a store or its client
// (minio-go, net/http connections, this package's store), ignoring unrelated ones.
func storeGoroutines() []string {
	buf := make([]byte, 4<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		for _, marker := range []string{"minio-go", "net/http.(*persistConn)", "s3store.(*Store)"} {
			if strings.Contains(g, marker) {
				out = append(out, g)
				break
			}
		}
	}
	return out
}

// requireNoStoreGoroutines fails t when store goroutines (see storeGoroutines) outlive a Close by
// more than a few seconds; before is what storeGoroutines returned before the store was made.
func requireNoStoreGoroutines(t *testing.T, before []string) {
	t.Helper()
	var left []string
	for deadline := time.Now().Add(3 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if left = storeGoroutines(); len(left) <= len(before) {
			return
		}
		if time.Now().After(deadline) {
			break
		}
	}
	t.Fatalf("%d store goroutines left after Close (%d before):\n%s", len(left), len(before), strings.Join(left, "\n\n"))
}

// load runs Set/Get loops from several goroutines until stop is closed, counting calls and errors.
type load struct {
	calls, failures atomic.Int64
	firstErr        atomic.Value // error
	stop            chan struct{}
	wg              sync.WaitGroup
}

func startLoad(s respcache.CacheStore, goroutines int) *load {
	l := &load{stop: make(chan struct{})}
	for g := range goroutines {
		l.wg.Go(func() {
			ctx := context.Background()
			for i := 0; ; i++ {
				select {
				case <-l.stop:
					return
				default:
				}
				k := fmt.Sprintf("load-%d-%d", g, i%50)
				var err error
				if i%2 == 0 {
					err = s.Set(ctx, k, []byte("value "+k), time.Minute)
				} else {
					_, _, err = s.Get(ctx, k)
				}
				l.calls.Add(1)
				if err != nil {
					l.failures.Add(1)
					l.firstErr.CompareAndSwap(nil, err)
				}
				time.Sleep(time.Millisecond) // 2 cores shared: a steady trickle, not a flood
			}
		})
	}
	return l
}

// Stop ends the loops and returns (calls, failures, first error).
func (l *load) Stop() (int64, int64, error) {
	close(l.stop)
	l.wg.Wait()
	err, _ := l.firstErr.Load().(error)
	return l.calls.Load(), l.failures.Load(), err
}

// versityGW is a private versitygw (posix backend) on its own port.
type versityGW struct {
	t                                *testing.T
	bin, root, addr                  string
	endpoint, bucket, access, secret string
	cmd                              *exec.Cmd
}

// startVersityGW starts a private versitygw; skips when the binary is absent (versitygw on PATH
// or in $HOME/go/bin).
func startVersityGW(t *testing.T) *versityGW {
	t.Helper()
	bin, err := exec.LookPath("versitygw")
	if err != nil {
		home, _ := os.UserHomeDir()
		bin = filepath.Join(home, "go", "bin", "versitygw")
		if _, err := os.Stat(bin); err != nil {
			skipOrFail(t, "versitygw not found (PATH or ~/go/bin): cannot start a private S3")
		}
	}
	root := t.TempDir()
	g := &versityGW{t: t, bin: bin, root: root, bucket: "fault", access: "faultkey", secret: "faultsecret"}
	require.NoError(t, os.MkdirAll(filepath.Join(root, g.bucket), 0o755))
	g.addr = "127.0.0.1:" + strconv.Itoa(freePort(t))
	g.endpoint = "http://" + g.addr
	g.start()
	t.Cleanup(g.kill)
	return g
}

func (g *versityGW) start() {
	g.t.Helper()
	cmd := exec.Command(g.bin, "--port", g.addr, "posix", g.root)
	cmd.Env = append(os.Environ(), "ROOT_ACCESS_KEY="+g.access, "ROOT_SECRET_KEY="+g.secret)
	require.NoError(g.t, cmd.Start())
	g.cmd = cmd
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", g.addr, 100*time.Millisecond)
		if err == nil {
			_ = c.Close()
			return
		}
		if time.Now().After(deadline) {
			g.t.Fatalf("versitygw on %s did not listen within 10s", g.addr)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (g *versityGW) kill() {
	if g.cmd == nil {
		return
	}
	_ = g.cmd.Process.Kill()
	_ = g.cmd.Wait()
	g.cmd = nil
}
