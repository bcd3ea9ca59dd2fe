// Package testenv gives kvroute's tests the servers they need: those the environment names, and
// private redis-server processes that fault tests may kill, hang and restart.
//
// The environment:
//
//   - REDIS_ADDR: host:port of a Redis 7 the tests may write to, under unique key prefixes they
//     delete (RedisAddr).
//   - S3_ENDPOINT, S3_ACCESS_KEY, S3_SECRET_KEY, S3_BUCKET: an S3 server and an existing bucket the
//     tests may write to, under unique key prefixes (S3).
//   - KVROUTE_REQUIRE_INTEGRATION=1: every skip for a missing server or binary (SkipOrFail) fails
//     the test instead, so that CI, which provisions them all (.ci/run), cannot pass by skipping.
//   - KVROUTE_LONG_TESTS=1: the long tests run (SkipUnlessLong); without it they skip, so that the
//     README's test command stays short. .ci/run sets it.
//
// Each function takes the test's testing.TB, says which variable or binary is missing and which
// test needs it, and is safe for concurrent use by parallel tests.
//
//	func TestRedisThing(t *testing.T) {
//		addr := testenv.RedisAddr(t) // skips, or fails under KVROUTE_REQUIRE_INTEGRATION=1
//		...
//	}
//
//	func TestRedisOutage(t *testing.T) {
//		srv := testenv.StartRedisServer(t) // a private redis-server, killed at cleanup
//		s := newStore(t, srv.URL())
//		srv.Kill()
//		...
//		srv.Start() // empty, on the same port
//	}
package testenv

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
)

// RequireIntegration is the environment variable that, set to "1", turns every SkipOrFail skip
// into a failure.
const RequireIntegration = "KVROUTE_REQUIRE_INTEGRATION"

// SkipOrFail skips t with why, or fails it (t.Fatalf, "KVROUTE_REQUIRE_INTEGRATION=1: " + why)
// when KVROUTE_REQUIRE_INTEGRATION is "1".
func SkipOrFail(t testing.TB, why string) {
	t.Helper()
	if os.Getenv(RequireIntegration) == "1" {
		t.Fatalf("%s=1: %s", RequireIntegration, why)
	}
	t.Skip(why)
}

// LongTests is the environment variable that, set to "1", runs the tests that call SkipUnlessLong.
const LongTests = "KVROUTE_LONG_TESTS"

// SkipUnlessLong skips t unless KVROUTE_LONG_TESTS is "1"; why says what makes the test long. It
// is for the few tests that would stretch the README's test command on their own: CI runs them.
func SkipUnlessLong(t testing.TB, why string) {
	t.Helper()
	if os.Getenv(LongTests) != "1" {
		t.Skipf("%s: set %s=1 to run it (.ci/run does)", why, LongTests)
	}
}

// RedisAddr returns REDIS_ADDR, or skips t when it is unset (see SkipOrFail).
func RedisAddr(t testing.TB) string {
	t.Helper()
	addr := os.Getenv("REDIS_ADDR")
	if addr == "" {
		SkipOrFail(t, fmt.Sprintf("REDIS_ADDR not set: no Redis for %s to test against (e.g. REDIS_ADDR=127.0.0.1:6379)", t.Name()))
	}
	return addr
}

// S3Env is the S3 server of the environment.
type S3Env struct {
	Endpoint  string // S3_ENDPOINT, a URL (http://127.0.0.1:7070) or host:port
	AccessKey string // S3_ACCESS_KEY
	SecretKey string // S3_SECRET_KEY
	Bucket    string // S3_BUCKET, an existing bucket
}

// S3 returns the S3_* variables, or skips t when S3_ENDPOINT or S3_BUCKET is unset (see
// SkipOrFail); the keys may be empty (anonymous access).
func S3(t testing.TB) S3Env {
	t.Helper()
	e := S3Env{Endpoint: os.Getenv("S3_ENDPOINT"), AccessKey: os.Getenv("S3_ACCESS_KEY"),
		SecretKey: os.Getenv("S3_SECRET_KEY"), Bucket: os.Getenv("S3_BUCKET")}
	var missing []string
	if e.Endpoint == "" {
		missing = append(missing, "S3_ENDPOINT")
	}
	if e.Bucket == "" {
		missing = append(missing, "S3_BUCKET")
	}
	if len(missing) > 0 {
		SkipOrFail(t, fmt.Sprintf("%s not set: no S3 for %s to test against (e.g. a versitygw, as .ci/run starts: "+
			"S3_ENDPOINT=http://127.0.0.1:7070 S3_ACCESS_KEY=… S3_SECRET_KEY=… S3_BUCKET=…)", strings.Join(missing, " and "), t.Name()))
	}
	return e
}

// FreePort returns a TCP port on 127.0.0.1 that nothing listens on (at the time of the call).
func FreePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	return port
}

// RandHex returns 12 random hex digits, for key prefixes and names no other test or run uses.
func RandHex() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
