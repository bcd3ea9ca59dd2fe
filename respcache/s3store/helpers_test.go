package s3store_test

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/respcache/internal/storetest"
	"github.com/kvroute/kvroute/respcache/redisstore"
	"github.com/kvroute/kvroute/respcache/s3store"
)

// Integration helpers of the store, tiered and fault tests. The environment is internal/testenv's:
// S3_ENDPOINT, S3_ACCESS_KEY, S3_SECRET_KEY, S3_BUCKET (an existing bucket the tests may write to,
// under unique key prefixes they delete), REDIS_ADDR (a Redis 7, for the tiered store with a Redis
// L1), and KVROUTE_REQUIRE_INTEGRATION=1 to turn every skip for a missing server or binary
// (versitygw, for the private server of the fault tests) into a failure.

// storeMarkers pick out the goroutines of a store and its client (minio-go, net/http connections,
// this package's store).
var storeMarkers = []string{"minio-go", "net/http.(*persistConn)", "s3store.(*Store)"}

// storeGoroutines returns the stacks of live goroutines that belong to a store or its client.
func storeGoroutines() []string { return storetest.Goroutines(storeMarkers...) }

// requireNoStoreGoroutines fails t when store goroutines outlive a Close by more than a few
// seconds; before is what storeGoroutines returned before the store was made.
func requireNoStoreGoroutines(t *testing.T, before []string) {
	t.Helper()
	storetest.RequireNoGoroutines(t, before, storeMarkers...)
}

// s3TestConfig returns a Config from S3_ENDPOINT, S3_ACCESS_KEY, S3_SECRET_KEY and S3_BUCKET,
// under a fresh key prefix, or skips.
func s3TestConfig(t testing.TB) s3store.Config {
	t.Helper()
	env := testenv.S3(t)
	return s3store.Config{Endpoint: env.Endpoint, AccessKey: env.AccessKey, SecretKey: env.SecretKey, Bucket: env.Bucket,
		KeyPrefix: "kvroute-test/" + testenv.RandHex() + "/"}
}

// newTestS3 returns a Store on the S3 of the environment under a fresh prefix; cleanup clears the
// prefix and closes the store.
func newTestS3(t testing.TB, cfg s3store.Config) *s3store.Store {
	t.Helper()
	s, err := s3store.New(cfg)
	if err != nil {
		t.Fatalf("New(%v) = %v", cfg, err)
	}
	storetest.ClearAndClose(t, s, 10*time.Second)
	return s
}

// newTestRedis returns a redisstore.Store on REDIS_ADDR under a fresh key prefix; cleanup clears
// the prefix and closes the store.
func newTestRedis(t testing.TB) *redisstore.Store {
	t.Helper()
	s, err := redisstore.New(redisstore.Config{URL: "redis://" + testenv.RedisAddr(t), KeyPrefix: "kvroute-test:tiered:" + testenv.RandHex() + ":"})
	if err != nil {
		t.Fatalf("redisstore.New: %v", err)
	}
	storetest.ClearAndClose(t, s, 5*time.Second)
	return s
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
			testenv.SkipOrFail(t, "versitygw not found (PATH or ~/go/bin): "+t.Name()+" cannot start a private S3")
		}
	}
	root := t.TempDir()
	g := &versityGW{t: t, bin: bin, root: root, bucket: "fault", access: "faultkey", secret: "faultsecret"}
	require.NoError(t, os.MkdirAll(filepath.Join(root, g.bucket), 0o755))
	g.addr = "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t))
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
