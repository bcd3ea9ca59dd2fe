package testenv

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// RedisServer is a private redis-server started by a test: its own process on its own loopback
// port, no persistence, so that killing, hanging or flushing it harms no other test and the shared
// server of REDIS_ADDR is never touched. It keeps its port across restarts. Its methods are safe
// for concurrent use; t.Cleanup kills it.
type RedisServer struct {
	t    testing.TB
	bin  string
	dir  string
	port int

	mu  sync.Mutex
	cmd *exec.Cmd // nil when not running
}

// StartRedisServer starts a private redis-server on a free port and waits until it answers. It
// skips t when redis-server is not on PATH (see SkipOrFail).
func StartRedisServer(t testing.TB) *RedisServer {
	t.Helper()
	p := NewRedisServer(t)
	p.Start()
	return p
}

// NewRedisServer prepares a private redis-server on a free port without starting it (a server that
// is down until the test calls Start). It skips t when redis-server is not on PATH (see
// SkipOrFail).
func NewRedisServer(t testing.TB) *RedisServer {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		SkipOrFail(t, fmt.Sprintf("redis-server not on PATH: %s cannot start a private Redis", t.Name()))
	}
	p := &RedisServer{t: t, bin: bin, dir: t.TempDir(), port: FreePort(t)}
	t.Cleanup(p.Kill)
	return p
}

// Port is the server's port on 127.0.0.1.
func (p *RedisServer) Port() int { return p.port }

// Addr is the server's host:port.
func (p *RedisServer) Addr() string { return "127.0.0.1:" + strconv.Itoa(p.port) }

// URL is the server's redis:// URL.
func (p *RedisServer) URL() string { return "redis://" + p.Addr() }

// Start starts the server, empty, on its port and waits until it answers PING; it fails the test
// when the server is already running or does not answer within 10 s.
func (p *RedisServer) Start() {
	p.t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil {
		p.t.Fatal("testenv.RedisServer: already running")
	}
	cmd := exec.Command(p.bin, "--port", strconv.Itoa(p.port), "--bind", "127.0.0.1", "--save", "",
		"--appendonly", "no", "--dir", p.dir, "--logfile", "")
	if err := cmd.Start(); err != nil {
		p.t.Fatalf("start redis-server: %v", err)
	}
	p.cmd = cmd
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if p.Command("PING") == "+PONG" {
			return
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("redis-server on %s did not answer within 10s", p.Addr())
		}
	}
}

// Kill sends SIGKILL and reaps the process: what the server held is lost. It does nothing when the
// server is not running.
func (p *RedisServer) Kill() {
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

// Signal sends sig to the running server (SIGSTOP and SIGCONT make it hang and resume); it fails
// the test when the server is not running.
func (p *RedisServer) Signal(sig os.Signal) {
	p.t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		p.t.Fatal("testenv.RedisServer: not running")
	}
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatal(err)
	}
}

// Command sends an inline command (PING, FLUSHALL, CONFIG SET …) on a fresh connection and
// returns the first line of the reply without its CRLF ("+PONG", "+OK"), or "" on a network error.
func (p *RedisServer) Command(cmd string) string {
	c, err := net.DialTimeout("tcp", p.Addr(), 200*time.Millisecond)
	if err != nil {
		return ""
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(time.Second))
	if _, err := fmt.Fprint(c, cmd+"\r\n"); err != nil {
		return ""
	}
	line, _ := bufio.NewReader(c).ReadString('\n')
	return strings.TrimRight(line, "\r\n")
}
