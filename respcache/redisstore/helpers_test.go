package redisstore_test

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// Integration helpers of the store and fault tests.
//
// Environment: REDIS_ADDR (host:port of a Redis 7 the tests may write to, under unique key prefixes
// they delete), and KVROUTE_REQUIRE_INTEGRATION=1 to turn every skip for a missing server or
// binary (redis-server, for the private servers of the fault tests) into a failure.

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

// uniquePrefix returns a fresh Redis key prefix for one test, free of glob characters.
func uniquePrefix(kind string) string { return "kvroute-test:" + kind + ":" + randHex() + ":" }

func itoa(i int) string { return strconv.Itoa(i) }

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

// redisProc is a private redis-server started by a test: its own process on its own port, no
// persistence. Kill and Start may be called repeatedly; t.Cleanup kills it.
type redisProc struct {
	t    testing.TB
	bin  string
	dir  string
	Port int

	mu  sync.Mutex
	cmd *exec.Cmd
}

// startRedis starts a private redis-server on port (0: a free port) and waits until it answers.
// It skips when redis-server is not on PATH (fails under KVROUTE_REQUIRE_INTEGRATION=1).
func startRedis(t testing.TB, port int) *redisProc {
	t.Helper()
	p := newRedisProc(t, port)
	p.Start()
	return p
}

// newRedisProc prepares a private redis-server on port (0: a free port) without starting it.
func newRedisProc(t testing.TB, port int) *redisProc {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		skipOrFail(t, "redis-server not on PATH: cannot start a private Redis")
	}
	if port == 0 {
		port = freePort(t)
	}
	p := &redisProc{t: t, bin: bin, dir: t.TempDir(), Port: port}
	t.Cleanup(p.Kill)
	return p
}

// Addr is the server's host:port.
func (p *redisProc) Addr() string { return "127.0.0.1:" + strconv.Itoa(p.Port) }

// URL is the server's redis:// URL.
func (p *redisProc) URL() string { return "redis://" + p.Addr() }

// Start starts the server (again) on its port and waits until it answers PING.
func (p *redisProc) Start() {
	p.t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil {
		p.t.Fatal("redisProc: already running")
	}
	cmd := exec.Command(p.bin, "--port", strconv.Itoa(p.Port), "--bind", "127.0.0.1", "--save", "",
		"--appendonly", "no", "--dir", p.dir, "--logfile", "")
	cmd.Stdout, cmd.Stderr = nil, nil
	if err := cmd.Start(); err != nil {
		p.t.Fatalf("start redis-server: %v", err)
	}
	p.cmd = cmd
	deadline := time.Now().Add(10 * time.Second)
	for {
		if pingRaw(p.Addr()) == nil {
			return
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("redis-server on %s did not answer within 10s", p.Addr())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Kill sends SIGKILL and reaps the process (no-op when not running).
func (p *redisProc) Kill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return
	}
	resumeProcess(p.cmd.Process) // a stopped process must run to die promptly
	_ = p.cmd.Process.Kill()
	_ = p.cmd.Wait()
	p.cmd = nil
}

// Signal sends sig to the running server (SIGSTOP/SIGCONT to make it hang and resume).
func (p *redisProc) Signal(sig os.Signal) {
	p.t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		p.t.Fatal("redisProc: not running")
	}
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatal(err)
	}
}

// storeGoroutines returns the stacks of live goroutines that belong to a store or its client
// (rueidis, this package's store), ignoring unrelated ones.
func storeGoroutines() []string {
	buf := make([]byte, 4<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		for _, marker := range []string{"redis/rueidis", "redisstore.(*Store)"} {
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

// pingRaw sends an inline PING over a fresh connection and expects +PONG.
func pingRaw(addr string) error {
	c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(500 * time.Millisecond))
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	buf := make([]byte, 16)
	n, err := c.Read(buf)
	if err != nil {
		return err
	}
	if !strings.HasPrefix(string(buf[:n]), "+PONG") {
		return fmt.Errorf("unexpected reply %q", buf[:n])
	}
	return nil
}
