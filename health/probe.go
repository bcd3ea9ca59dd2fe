package health

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
)

// loop is the probing goroutine started by Start.
func (m *Monitor) loop() {
	defer close(m.done)
	for {
		start := m.clock.Now()
		m.Probe(m.ctx)
		wait := m.probe.Interval - m.clock.Now().Sub(start)
		if wait <= 0 {
			if m.ctx.Err() != nil {
				return
			}
			continue
		}
		tick := make(chan struct{})
		stop := m.clock.AfterFunc(wait, func() { close(tick) })
		select {
		case <-m.ctx.Done():
			stop()
			return
		case <-tick:
		}
	}
}

// Probe probes every backend once, concurrently, and waits for the answers; each probe is bounded
// by Probe.Timeout. Start calls it on its schedule; tests and callers with a schedule of their
// own may call it directly. A probe ended by ctx or by Close is not counted. Probe does nothing
// when probes are disabled. Safe for concurrent use.
func (m *Monitor) Probe(ctx context.Context) {
	if m.probe.Disabled {
		return
	}
	var wg sync.WaitGroup
	for _, b := range m.backends() {
		wg.Go(func() { m.probeOne(ctx, b) })
	}
	wg.Wait()
}

// probeOne probes b and folds the result into its verdict.
func (m *Monitor) probeOne(parent context.Context, b *backend) {
	ctx, cancel := context.WithTimeout(parent, m.probe.Timeout)
	defer cancel()
	stop := context.AfterFunc(m.ctx, cancel) // Close aborts the probe
	defer stop()
	err := m.get(ctx, b.url+m.probe.Path)
	if m.ctx.Err() != nil || parent.Err() != nil {
		return // aborted by Close or the caller: no verdict
	}
	m.observeProbe(b, err)
}

// get sends one probe to u: nil for a 2xx answer, otherwise the error.
func (m *Monitor) get(ctx context.Context, u string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return err
	}
	resp, err := m.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxProbeBody))
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return &statusError{code: resp.StatusCode}
	}
	return nil
}

// observeProbe folds one probe result into b's verdict.
func (m *Monitor) observeProbe(b *backend, err error) {
	var lines []logLine
	b.mu.Lock()
	if b.removed {
		b.mu.Unlock()
		return
	}
	b.lastProbe = m.clock.Now()
	if err == nil {
		b.okRun++
		b.badRun = 0
		b.lastErr = ""
		if !b.probeOK && b.okRun >= m.probe.HealthyThreshold {
			b.probeOK = true
			lines = append(lines, logLine{slog.LevelInfo, "backend healthy again", []any{"backend", b.name, "probes", b.okRun}})
			// The backend was down and is up again: its open circuit gets its trial now
			// rather than at the end of the recovery timeout.
			if b.brk.halfOpen(b.brk.gen) {
				lines = append(lines, logLine{slog.LevelInfo, "circuit half-open", []any{"backend", b.name,
					"trials", m.breaker.HalfOpenMaxRequests, "cause", "probes_healthy"}})
			}
		}
	} else {
		b.badRun++
		b.okRun = 0
		b.lastErr = err.Error()
		if b.probeOK && b.badRun >= m.probe.UnhealthyThreshold {
			b.probeOK = false
			lines = append(lines, logLine{slog.LevelWarn, "backend unhealthy", []any{"backend", b.name,
				"failed_probes", b.badRun, "err", err}})
		}
	}
	b.mu.Unlock()
	for _, l := range lines {
		m.log.Log(context.Background(), l.level, l.msg, l.attrs...)
	}
	m.sync(b) // also retries a verdict the Target refused before

}

// statusError is a probe's non-2xx answer.
type statusError struct{ code int }

// Error returns "HTTP <code> <text>".
func (e *statusError) Error() string {
	return "HTTP " + strconv.Itoa(e.code) + " " + http.StatusText(e.code)
}
