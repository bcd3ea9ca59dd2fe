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
	"path/filepath"
	"regexp"
	"strings"
	"time"
)

// startTimeout bounds the child's start: exec to its "serving" log line.
const startTimeout = 30 * time.Second

// moduleRoot returns repo, or the root of the working directory's module, checked to be
// github.com/kvroute/kvroute.
func moduleRoot(ctx context.Context, repo string) (string, error) {
	if repo == "" {
		out, err := exec.CommandContext(ctx, "go", "env", "GOMOD").Output()
		if err != nil {
			return "", fmt.Errorf("go env GOMOD: %w", err)
		}
		gomod := strings.TrimSpace(string(out))
		if gomod == "" || gomod == os.DevNull {
			return "", errors.New("not in a Go module: run from the kvroute checkout or pass -repo")
		}
		repo = filepath.Dir(gomod)
	}
	mod, err := os.ReadFile(filepath.Join(repo, "go.mod"))
	if err != nil {
		return "", err
	}
	if !regexp.MustCompile(`(?m)^module\s+github\.com/kvroute/kvroute\s*$`).Match(mod) {
		return "", fmt.Errorf("%s is not the github.com/kvroute/kvroute module", repo)
	}
	return repo, nil
}

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
