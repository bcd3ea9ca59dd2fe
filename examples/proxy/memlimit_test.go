package main

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"net"
	"os"
	"path/filepath"
	"runtime/debug"
	"testing"
	"time"

	"github.com/kvroute/kvroute/config"
)

// The proxy applies server.memory_limit to the Go runtime at start and on reload ("off" lifts
// it), and leaves a GOMEMLIMIT environment variable in force. Not parallel: the limit is the
// process's.
func TestMemoryLimitApplied(t *testing.T) {
	orig := debug.SetMemoryLimit(-1)
	t.Cleanup(func() { debug.SetMemoryLimit(orig) })
	t.Setenv("GOMEMLIMIT", "") // unset for the runtime's purposes: stack.ApplyMemoryLimit reads "" as absent
	up := newFakeUpstream(t, "a")
	path := filepath.Join(t.TempDir(), "proxy.yaml")
	write := func(limit string) {
		t.Helper()
		yaml := fmt.Sprintf("server: {memory_limit: %q}\nhealth_checks: {enabled: false}\nbackends:\n  - {name: a, url: %q}\n", limit, up.URL)
		if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("300MiB")
	l := &live{load: func() (*config.Config, error) { return config.Load(path) }, level: new(slog.LevelVar), log: slog.New(slog.DiscardHandler)}
	cfg, err := l.load()
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error, 1)
	go func() { runErr <- l.run(ctx, cfg, ln) }()
	defer func() {
		cancel()
		if err := <-runErr; err != nil {
			t.Errorf("run: %v", err)
		}
	}()
	waitFor(t, 10*time.Second, "the proxy to serve", func() bool {
		r, err := httpClient.Get("http://" + ln.Addr().String() + "/healthz")
		if err == nil {
			r.Body.Close()
		}
		return err == nil && r.StatusCode == 200
	})
	if got := debug.SetMemoryLimit(-1); got != 300<<20 {
		t.Fatalf("memory limit at start %d, want %d", got, 300<<20)
	}
	for _, c := range []struct {
		yaml string
		want int64
	}{{"200MiB", 200 << 20}, {"off", math.MaxInt64}, {"262144000", 262144000}} {
		write(c.yaml)
		if err := l.reload(); err != nil {
			t.Fatalf("reload to %s: %v", c.yaml, err)
		}
		if got := debug.SetMemoryLimit(-1); got != c.want {
			t.Errorf("memory limit after reload to %s: %d, want %d", c.yaml, got, c.want)
		}
	}
	t.Setenv("GOMEMLIMIT", "123MiB")
	debug.SetMemoryLimit(123 << 20) // what the runtime did at start
	write("100MiB")
	if err := l.reload(); err != nil {
		t.Fatal(err)
	}
	if got := debug.SetMemoryLimit(-1); got != 123<<20 {
		t.Errorf("with GOMEMLIMIT set: memory limit %d after a reload to 100MiB, want GOMEMLIMIT's %d", got, 123<<20)
	}
}
