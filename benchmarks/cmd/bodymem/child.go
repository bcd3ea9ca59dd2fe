package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"time"
)

// startTimeout bounds the child's start: exec to its "serving" log line.
const startTimeout = 30 * time.Second

// child is the running proxy.
type child struct {
	cmd       *exec.Cmd
	addr      string // host:port it serves on
	pprofAddr string // host:port of its net/http/pprof listener; "" without one
	done      chan struct{}
}

func (c *child) pid() int { return c.cmd.Process.Pid }

// stop kills the child and waits for it.
func (c *child) stop() {
	_ = c.cmd.Process.Kill()
	<-c.done
}

// startChild starts the proxy binary bin with the configuration at cfg on a free port of
// 127.0.0.1, and returns once it serves. With pprof, the child also serves net/http/pprof on
// another free port of 127.0.0.1 (child.pprofAddr). env is added to the child's environment.
func startChild(ctx context.Context, bin, cfg string, pprof bool, env []string) (*child, error) {
	args := []string{"-config", cfg, "-addr", "127.0.0.1:0", "-log-format", "json"}
	if pprof {
		args = append(args, "-pprof", "127.0.0.1:0")
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
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
	pprofc := make(chan string, 1)
	var logTail []string
	go func() {
		defer close(c.done)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			var line struct{ Msg, Addr string }
			if json.Unmarshal(sc.Bytes(), &line) == nil && line.Addr != "" {
				switch line.Msg {
				case "serving":
					select {
					case addrc <- line.Addr:
					default:
					}
				case "pprof":
					select {
					case pprofc <- line.Addr:
					default:
					}
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
		if pprof { // logged before "serving"
			select {
			case c.pprofAddr = <-pprofc:
			default:
				c.stop()
				return nil, errors.New("the proxy serves but logged no pprof address")
			}
		}
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
