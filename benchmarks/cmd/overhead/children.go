package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

// childStartTimeout bounds a child's start: exec to the line giving its address.
const childStartTimeout = 30 * time.Second

// goVersion returns the output of go version.
func goVersion(ctx context.Context) (string, error) {
	out, err := exec.CommandContext(ctx, "go", "version").Output()
	if err != nil {
		return "", fmt.Errorf("go version: %w", err)
	}
	return strings.TrimSpace(string(out)), nil
}

// child is a process this program started: the relay or a proxy. Its output goes to a log file
// in the run's temporary directory, shown when it fails.
type child struct {
	name     string
	announce string // the rest of the line that announced it: an HTTP root, or the engine's JSON
	url      string // its HTTP root (the relay and the proxies)
	cmd      *exec.Cmd
	log      *os.File
	done     chan struct{} // closed when the process has exited
	err      error         // Wait's result, set before done is closed
}

// startChild starts bin with args, its output logged to logDir/name.log, and waits (up to
// childStartTimeout) for the stdout line "<banner><announce>"; with isURL, announce must be
// http://127.0.0.1:PORT, and becomes the child's url. The child is killed when ctx ends or Stop
// is called.
func startChild(ctx context.Context, name, logDir, bin string, args []string, banner string, isURL bool) (*child, error) {
	logf, err := os.Create(filepath.Join(logDir, name+".log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Stderr = logf
	cmd.SysProcAttr = childSysProcAttr()
	cmd.WaitDelay = 5 * time.Second
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		logf.Close()
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	c := &child{name: name, cmd: cmd, log: logf, done: make(chan struct{})}
	found := make(chan string, 1)
	var copying sync.WaitGroup
	copying.Add(1)
	go func() { // read stdout to the banner, then copy the rest to the log
		defer copying.Done()
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			line := sc.Text()
			fmt.Fprintln(logf, line)
			if rest, ok := strings.CutPrefix(strings.TrimSpace(line), banner); ok {
				found <- strings.TrimSpace(rest)
				break
			}
		}
		_, _ = io.Copy(logf, stdout)
	}()
	go func() {
		copying.Wait() // Wait closes stdout: read it all first
		c.err = cmd.Wait()
		close(c.done)
	}()
	t := time.NewTimer(childStartTimeout)
	defer t.Stop()
	select {
	case c.announce = <-found:
		if isURL {
			if !strings.HasPrefix(c.announce, "http://127.0.0.1:") {
				c.Stop()
				return nil, fmt.Errorf("%s announced %q: want http://127.0.0.1:PORT", name, c.announce)
			}
			c.url = c.announce
		}
		return c, nil
	case <-c.done:
		return nil, fmt.Errorf("%s exited before serving: %v\n%s", name, c.err, c.logTail())
	case <-t.C:
		c.Stop()
		return nil, fmt.Errorf("%s did not announce its address within %v\n%s", name, childStartTimeout, c.logTail())
	case <-ctx.Done():
		c.Stop()
		return nil, ctx.Err()
	}
}

// Stop kills the child and waits for it to exit. Idempotent.
func (c *child) Stop() {
	select {
	case <-c.done:
	default:
		_ = c.cmd.Process.Kill()
		<-c.done
	}
	c.log.Close()
}

// exited reports the child's exit, when it has exited.
func (c *child) exited() error {
	select {
	case <-c.done:
		return fmt.Errorf("%s exited: %v\n%s", c.name, c.err, c.logTail())
	default:
		return nil
	}
}

// logTail returns the last lines of the child's log.
func (c *child) logTail() string {
	b, err := os.ReadFile(c.log.Name())
	if err != nil {
		return ""
	}
	lines := bytes.Split(bytes.TrimSpace(b), []byte("\n"))
	if len(lines) > 20 {
		lines = lines[len(lines)-20:]
	}
	return "  " + string(bytes.Join(lines, []byte("\n  ")))
}

// proxyBanner opens the line in which the proxy gives its address.
const proxyBanner = "kvroute proxy listening on "

// proxyConfig returns the YAML configuration of a proxy in front of the engine e: tier 1 only,
// or, with allTiers, also the in-memory response cache and the in-memory KV index fed by e's
// ZMQ events. Health checks are off: the engine does not fail, and probes would be noise.
func proxyConfig(e engineInfo, allTiers bool, tokenizer string) string {
	return routerConfig(e, allTiers, allTiers, tokenizer)
}

// pickerConfig returns the YAML configuration of kvroute's picker in front of the engine e: that
// of the proxy with tier 1 only, or, with kv, that of the proxy with all tiers but the response
// cache, which an endpoint picker does not have.
func pickerConfig(e engineInfo, kv bool, tokenizer string) string {
	return routerConfig(e, false, kv, tokenizer)
}

// routerConfig returns kvroute's YAML configuration for the engine e: tier 1, with cache the
// in-memory response cache, with kv the in-memory KV index fed by e's ZMQ events; health checks
// off.
func routerConfig(e engineInfo, cache, kv bool, tokenizer string) string {
	q := strconv.Quote
	var b strings.Builder
	fmt.Fprintf(&b, "server:\n  bind_address: \"127.0.0.1\"\n  port: 0\n")
	fmt.Fprintf(&b, "prefix_routing:\n  enabled: true\n")
	if cache {
		fmt.Fprintf(&b, "response_cache:\n  enabled: true\n  backend: memory\n  capacity: 10000\n  ttl: \"10m\"\n")
	}
	if kv {
		fmt.Fprintf(&b, "kv_cache_index:\n  enabled: true\n  backend: memory\n  block_size: %d\n  tokenizer: %s\n",
			e.BlockSize, tokenizer)
		fmt.Fprintf(&b, "  event_sources:\n    - backend_name: %s\n      endpoint: %s\n      replay_endpoint: %s\n      model: %s\n",
			q(e.Name), q(e.ZMQEndpoint), q(e.ReplayEndpoint), q(e.Model))
	}
	fmt.Fprintf(&b, "backends:\n  - name: %s\n    url: %s\n    model: %s\n", q(e.Name), q(e.URL), q(e.Model))
	fmt.Fprintf(&b, "health_checks:\n  enabled: false\n")
	return b.String()
}
