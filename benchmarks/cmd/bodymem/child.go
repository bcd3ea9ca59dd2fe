package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os/exec"
	"strings"
	"time"
)

// startTimeout bounds the child's start: exec to its "serving" log line.
const startTimeout = 30 * time.Second

// child is the running proxy.
type child struct {
	cmd  *exec.Cmd
	addr string // host:port it serves on
	done chan struct{}
}

func (c *child) pid() int { return c.cmd.Process.Pid }

// stop kills the child and waits for it.
func (c *child) stop() {
	_ = c.cmd.Process.Kill()
	<-c.done
}

// startChild starts the proxy binary bin with the configuration at cfg on a free port of
// 127.0.0.1, and returns once it serves.
func startChild(ctx context.Context, bin, cfg string) (*child, error) {
	cmd := exec.Command(bin, "-config", cfg, "-addr", "127.0.0.1:0", "-log-format", "json")
	setDeathSignal(cmd)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	c := &child{cmd: cmd, done: make(chan struct{})}
	addrc := make(chan string, 1)
	var logTail []string
	go func() {
		defer close(c.done)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			var line struct{ Msg, Addr string }
			if json.Unmarshal(sc.Bytes(), &line) == nil && line.Msg == "serving" && line.Addr != "" {
				select {
				case addrc <- line.Addr:
				default:
				}
			}
			if len(logTail) < 20 {
				logTail = append(logTail, sc.Text())
			}
		}
		_, _ = io.Copy(io.Discard, stderr)
		_ = cmd.Wait()
	}()
	timer := time.NewTimer(startTimeout)
	defer timer.Stop()
	select {
	case c.addr = <-addrc:
		return c, nil
	case <-c.done:
		return nil, fmt.Errorf("the proxy exited before serving:\n%s", strings.Join(logTail, "\n"))
	case <-timer.C:
		c.stop()
		return nil, fmt.Errorf("the proxy did not serve within %v", startTimeout)
	case <-ctx.Done():
		c.stop()
		return nil, ctx.Err()
	}
}
