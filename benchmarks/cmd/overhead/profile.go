package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"time"
)

// With -cpuprofile DIR the relay and the proxies serve net/http/pprof (-pprof 127.0.0.1:0) and
// each run of targets (b) to (e) records a CPU profile of the process serving it, for the run's
// whole seconds, into DIR/<target>-<n>conn-round<r>.pprof; the profiles of one target and load
// merge with
//
//	go tool pprof -top DIR/c-1conn-round*.pprof
//
// Profiling costs the profiled process CPU, so a profiled run's latencies are not the table's.

// pprofAddrRE finds the pprof listener in the proxy's log (log/slog text or JSON).
var pprofAddrRE = regexp.MustCompile(`msg"?[=:]"?pprof"?[ ,]"?addr"?[=:]"?(127\.0\.0\.1:\d+)`)

// pprofAddr waits (up to childStartTimeout) for the child c to log its pprof address.
func pprofAddr(ctx context.Context, c *child) (string, error) {
	deadline := time.Now().Add(childStartTimeout)
	for {
		b, err := os.ReadFile(c.log.Name())
		if err != nil {
			return "", err
		}
		if m := pprofAddrRE.FindSubmatch(b); m != nil {
			return string(m[1]), nil
		}
		if err := c.exited(); err != nil {
			return "", err
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return "", fmt.Errorf("%s logged no pprof address within %v", c.name, childStartTimeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// profiler records CPU profiles of the relay and the proxies: addr[i] is the pprof address of the process
// with index i in the run's cpuMeter ("" for one without).
type profiler struct {
	dir  string
	addr []string
}

// start begins a profile of t's front process for d's whole seconds (at least one) and returns
// a function that waits for it and writes it to name; a no-op when p is nil or the process has
// no pprof address.
func (p *profiler) start(ctx context.Context, t *target, d time.Duration, name string) func() error {
	if p == nil || p.addr[t.front] == "" {
		return func() error { return nil }
	}
	secs := max(int(d/time.Second), 1)
	url := fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", p.addr[t.front], secs)
	done := make(chan error, 1)
	go func() {
		done <- func() error {
			ctx, cancel := context.WithTimeout(ctx, time.Duration(secs)*time.Second+30*time.Second)
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
			if err != nil {
				return err
			}
			resp, err := (&http.Client{Transport: &http.Transport{Proxy: nil}}).Do(req)
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("%s: status %d", url, resp.StatusCode)
			}
			f, err := os.Create(filepath.Join(p.dir, name))
			if err != nil {
				return err
			}
			_, err = io.Copy(f, resp.Body)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			return err
		}()
	}()
	return func() error { return <-done }
}
