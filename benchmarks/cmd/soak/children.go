package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// readyTimeout bounds the wait for a started process to serve.
const readyTimeout = 30 * time.Second

// proc is a child process that may be killed and started again with the same command line; its
// output is appended to a log file of the run's directory.
type proc struct {
	name string
	bin  string
	args []string
	log  string // path of its log file
	// ready reports whether the started process serves; polled until it does.
	ready func(ctx context.Context) error

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has exited
}

// start starts the process and waits until it is ready.
func (p *proc) start(ctx context.Context) error {
	logf, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	cmd := exec.Command(p.bin, p.args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = childSysProcAttr()
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s: %w", p.name, err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		logf.Close()
		close(done)
	}()
	p.mu.Lock()
	p.cmd, p.done = cmd, done
	p.mu.Unlock()
	deadline := time.Now().Add(readyTimeout)
	for {
		err := p.ready(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-done:
			return fmt.Errorf("%s exited before serving:\n%s", p.name, logTail(p.log))
		case <-ctx.Done():
			p.kill()
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			p.kill()
			return fmt.Errorf("%s did not serve within %v (%v):\n%s", p.name, readyTimeout, err, logTail(p.log))
		}
	}
}

// pid returns the running process's id, 0 when none runs.
func (p *proc) pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return 0
	}
	select {
	case <-p.done:
		return 0
	default:
		return p.cmd.Process.Pid
	}
}

// kill kills the process (SIGKILL: no goodbye) and waits for it to exit. Idempotent.
func (p *proc) kill() {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Kill()
	<-done
}

// logTail returns the last lines of a log file.
func logTail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > 20 {
		lines = lines[len(lines)-20:]
	}
	return "  " + strings.Join(lines, "\n  ")
}

// freePort returns a loopback TCP port nobody listens on now.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// httpReady is a ready function: GET url answers 200.
func httpReady(url string) func(context.Context) error {
	client := &http.Client{Timeout: time.Second}
	return func(ctx context.Context) error {
		body, err := get(ctx, client, url)
		if err == nil {
			body.Close()
		}
		return err
	}
}

// redisReady is a ready function: PING answers PONG.
func redisReady(addr string) func(context.Context) error {
	return func(context.Context) error {
		_, err := redisCommand(addr, "PING")
		return err
	}
}

// redisCommand sends one command to the Redis server at addr and returns its reply's first line
// without the type byte (a simple string, an integer or an error).
func redisCommand(addr string, args ...string) (string, error) {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := c.Write([]byte(b.String())); err != nil {
		return "", err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "", err
	}
	line = strings.TrimRight(line, "\r\n")
	if line == "" {
		return "", errors.New("redis: empty reply")
	}
	if line[0] == '-' {
		return "", fmt.Errorf("redis: %s", line[1:])
	}
	return line[1:], nil
}

// tcpReady is a ready function: the address accepts a connection.
func tcpReady(addr string) func(context.Context) error {
	return func(context.Context) error {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
		}
		return err
	}
}

// natsCommand is the first argument that makes this program a NATS server with JetStream:
//
//	soak nats -port P -store DIR
//
// It serves on 127.0.0.1:P, keeps JetStream's data in DIR (so that what it stored survives a
// restart on the same DIR), prints "nats ready" and serves until killed or interrupted.
const natsCommand = "nats"

func natsMain(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("soak nats", flag.ContinueOnError)
	fs.SetOutput(stderr)
	port := fs.Int("port", 4222, "client port on 127.0.0.1")
	store := fs.String("store", "", "JetStream store directory")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *store == "" {
		return errors.New("nats: -store is required")
	}
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: *port, JetStream: true,
		StoreDir: filepath.Clean(*store), NoSigs: true, NoLog: true})
	if err != nil {
		return err
	}
	go srv.Start()
	if !srv.ReadyForConnections(readyTimeout) {
		srv.Shutdown()
		return fmt.Errorf("nats: not ready within %v", readyTimeout)
	}
	fmt.Fprintln(stdout, "nats ready")
	<-ctx.Done()
	srv.Shutdown()
	srv.WaitForShutdown()
	return nil
}
