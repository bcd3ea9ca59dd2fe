package enginemetrics

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvroute/kvroute"
)

// Sink receives the engine-reported loads. *kvroute.DefaultRouter implements it.
type Sink interface {
	// ReportEngineLoad records backend's load as its engine reported it at l.At. An error (an
	// unknown backend, say) is counted (telemetry.MetricEngineReportErrors) and shown in Stats; the Scraper goes
	// on. It is called from the target's own goroutine: one call at a time per backend, and
	// concurrently for different backends. It should not block (a slow Sink delays that
	// backend's next scrape) and must not call the Scraper's SetTargets or Close.
	ReportEngineLoad(backend string, l kvroute.EngineLoad) error
}

// SinkFunc adapts a function to a Sink.
type SinkFunc func(backend string, l kvroute.EngineLoad) error

// ReportEngineLoad calls f(backend, l).
func (f SinkFunc) ReportEngineLoad(backend string, l kvroute.EngineLoad) error { return f(backend, l) }

var (
	_ Sink = (*kvroute.DefaultRouter)(nil)
	_ Sink = SinkFunc(nil)
)

// acceptHeader asks for the Prometheus text format: both engines' prometheus_client serves it
// unless OpenMetrics is asked for.
const acceptHeader = "text/plain;version=0.0.4"

// keepBuffer is the largest body buffer a target keeps between scrapes.
const keepBuffer = 1 << 20

// TargetStats is what a Scraper knows of one target; its JSON encoding suits an admin endpoint.
type TargetStats struct {
	Backend string `json:"backend"`
	URL     string `json:"url"` // its password, if any, redacted
	// Engine is the engine its last successful scrape came from.
	Engine Engine `json:"engine,omitempty"`
	// Scrapes and Failures count its scrapes since it was added, and the failed ones;
	// ConsecutiveFailures the failures since the last success.
	Scrapes             uint64 `json:"scrapes"`
	Failures            uint64 `json:"failures"`
	ConsecutiveFailures int    `json:"consecutive_failures"`
	// LastAttempt, LastSuccess and LastFailure are when its last scrape, last successful one and
	// last failed one ended; zero for never.
	LastAttempt time.Time `json:"last_attempt,omitzero"`
	LastSuccess time.Time `json:"last_success,omitzero"`
	LastFailure time.Time `json:"last_failure,omitzero"`
	// LastError is the error of its last failed scrape, kept after a success.
	LastError string `json:"last_error,omitempty"`
	// LastLoad is the load of its last successful scrape, nil before the first.
	LastLoad *kvroute.EngineLoad `json:"last_load,omitempty"`
	// LastReportError is the Sink's error for its last load, "" when the Sink took it.
	LastReportError string `json:"last_report_error,omitempty"`
}

// Scraper scrapes the metrics endpoints of a fleet of vLLM or SGLang engines and reports each
// engine's load to a Sink. All its methods are safe for concurrent use.
//
// New builds it idle; Start runs one goroutine per target, which scrapes its target every
// Config.Interval (the first time after a random delay in [0, Interval), so that the targets
// spread over the interval), each with its own timeout, so that a slow or hanging target delays
// no other. SetTargets adds and removes targets at run time. Close, or the end of Start's
// context, stops every goroutine; Close also waits for them.
type Scraper struct {
	cfg    Config
	sink   Sink
	client *http.Client
	own    bool // client is the Scraper's: Close closes its idle connections
	m      *instruments

	ctl    sync.Mutex // serialises Start, SetTargets and Close
	ctx    context.Context
	cancel context.CancelFunc
	closed bool

	mu      sync.Mutex // guards targets
	targets map[string]*target
}

// target is one backend's endpoint and the state of its goroutine.
type target struct {
	backend, url string
	attrs        *targetAttrs
	cancel       context.CancelFunc // nil until started
	done         chan struct{}      // closed when its goroutine returns
	buf          bytes.Buffer       // its goroutine's body buffer

	mu         sync.Mutex // guards the fields below
	st         TargetStats
	lastWarn   time.Time // zero: the next failure warns at once
	suppressed int       // failures not logged since lastWarn
}

// New returns an idle Scraper of cfg's targets reporting to sink; Start starts it. The error wraps
// ErrInvalidConfig for a Config it rejects or a nil sink; an error of the MeterProvider is
// returned as is.
func New(cfg Config, sink Sink) (*Scraper, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if sink == nil {
		return nil, fmt.Errorf("%w: nil sink", ErrInvalidConfig)
	}
	m, err := newInstruments(cfg.MeterProvider)
	if err != nil {
		return nil, err
	}
	s := &Scraper{cfg: cfg, sink: sink, client: cfg.HTTPClient, m: m, targets: make(map[string]*target, len(cfg.Targets))}
	if s.client == nil {
		s.client, s.own = newClient(cfg.Timeout), true
	}
	for name, u := range cfg.Targets {
		s.targets[name] = newTarget(name, u)
	}
	s.cfg.Targets = nil // the targets live in s.targets
	return s, nil
}

func newTarget(backend, u string) *target {
	return &target{backend: backend, url: u, attrs: newTargetAttrs(backend),
		st: TargetStats{Backend: backend, URL: redact(u)}}
}

// Start starts scraping every target, each on a goroutine of its own, until ctx ends or Close is
// called. It returns at once: ErrStarted when called before, ErrClosed after Close, nil
// otherwise.
func (s *Scraper) Start(ctx context.Context) error {
	s.ctl.Lock()
	defer s.ctl.Unlock()
	switch {
	case s.closed:
		return ErrClosed
	case s.ctx != nil:
		return ErrStarted
	}
	s.ctx, s.cancel = context.WithCancel(ctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, t := range s.targets {
		s.startLocked(t)
	}
	return nil
}

// startLocked starts t's goroutine. Requires ctl, and a started Scraper.
func (s *Scraper) startLocked(t *target) {
	ctx, cancel := context.WithCancel(s.ctx)
	t.cancel, t.done = cancel, make(chan struct{})
	go s.run(ctx, t)
}

// SetTargets replaces the targets with targets (backend name → metrics URL, as Config.Targets):
// it starts scraping the new backends and those whose URL changed (whose stats start again), and
// stops scraping the backends no longer listed, waiting for their goroutines to end, so that no
// load of a removed backend reaches the Sink after it returns. Before Start it only replaces the
// targets. It changes nothing and returns an error wrapping ErrInvalidConfig for a bad entry, and
// ErrClosed after Close.
func (s *Scraper) SetTargets(targets map[string]string) error {
	checked, err := checkTargets(targets)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	s.ctl.Lock()
	defer s.ctl.Unlock()
	if s.closed {
		return ErrClosed
	}
	var gone, added []*target
	s.mu.Lock()
	next := make(map[string]*target, len(checked))
	for name, u := range checked {
		if t := s.targets[name]; t != nil && t.url == u {
			next[name] = t
			continue
		}
		t := newTarget(name, u)
		next[name] = t
		added = append(added, t)
	}
	for name, t := range s.targets {
		if next[name] != t {
			gone = append(gone, t)
		}
	}
	s.targets = next
	s.mu.Unlock()
	if s.ctx == nil {
		return nil
	}
	for _, t := range gone {
		t.cancel()
	}
	for _, t := range gone {
		<-t.done
	}
	for _, t := range added {
		s.startLocked(t)
	}
	return nil
}

// Close stops every target's goroutine, aborting the scrapes in flight, and waits for them; the
// Scraper reports nothing after it returns. It closes the idle connections of the Scraper's own
// HTTP client (not of Config.HTTPClient). It is idempotent and returns nil.
func (s *Scraper) Close() error {
	s.ctl.Lock()
	defer s.ctl.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	if s.cancel != nil {
		s.cancel()
		s.mu.Lock()
		ts := make([]*target, 0, len(s.targets))
		for _, t := range s.targets {
			ts = append(ts, t)
		}
		s.mu.Unlock()
		for _, t := range ts {
			<-t.done
		}
	}
	if s.own {
		s.client.CloseIdleConnections()
	}
	return nil
}

// Stats returns the stats of every target, by backend name.
func (s *Scraper) Stats() []TargetStats {
	s.mu.Lock()
	ts := make([]*target, 0, len(s.targets))
	for _, t := range s.targets {
		ts = append(ts, t)
	}
	s.mu.Unlock()
	out := make([]TargetStats, 0, len(ts))
	for _, t := range ts {
		t.mu.Lock()
		st := t.st
		t.mu.Unlock()
		if st.LastLoad != nil {
			l := *st.LastLoad
			st.LastLoad = &l
		}
		out = append(out, st)
	}
	slices.SortFunc(out, func(a, b TargetStats) int { return strings.Compare(a.Backend, b.Backend) })
	return out
}

// run scrapes t every Interval, the first time after a random delay, until ctx ends.
func (s *Scraper) run(ctx context.Context, t *target) {
	defer close(t.done)
	first := time.NewTimer(rand.N(s.cfg.Interval))
	select {
	case <-ctx.Done():
		first.Stop()
		return
	case <-first.C:
	}
	tick := time.NewTicker(s.cfg.Interval)
	defer tick.Stop()
	for {
		s.scrape(ctx, t)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// scrape scrapes t once, reports the load to the Sink when the scrape succeeded, and records the
// outcome. A scrape aborted because t was removed or the Scraper closed records nothing.
func (s *Scraper) scrape(ctx context.Context, t *target) {
	start := time.Now()
	l, eng, res, err := s.fetch(ctx, t)
	if ctx.Err() != nil {
		return
	}
	bg := context.Background()
	s.m.scrapes.Add(bg, 1, t.attrs.scrapes[res]...)
	s.m.duration.Record(bg, time.Since(start).Seconds(), t.attrs.backend...)
	if err != nil {
		s.failed(t, err)
		return
	}
	t.mu.Lock()
	st := &t.st
	recovered := st.ConsecutiveFailures
	st.Scrapes++
	st.ConsecutiveFailures = 0
	st.LastAttempt, st.LastSuccess = l.At, l.At
	st.Engine, st.LastLoad = eng, &l
	if recovered > 0 {
		t.lastWarn, t.suppressed = time.Time{}, 0
	}
	t.mu.Unlock()
	if recovered > 0 {
		s.cfg.Logger.Info("enginemetrics: scrapes recovered", "backend", t.backend, "url", st.URL, "failures", recovered)
	}

	rerr := s.sink.ReportEngineLoad(t.backend, l)
	if rerr != nil {
		s.m.reports.Add(bg, 1, t.attrs.reports...)
	}
	t.mu.Lock()
	st.LastReportError = ""
	warn := false
	if rerr != nil {
		st.LastReportError = rerr.Error()
		warn = s.shouldWarnLocked(t, l.At)
	}
	t.mu.Unlock()
	if warn {
		s.cfg.Logger.Warn("enginemetrics: sink refused the engine load", "backend", t.backend, "error", rerr)
	}
}

// failed records a failed scrape of t and logs it, at most once per LogEvery.
func (s *Scraper) failed(t *target, err error) {
	now := s.cfg.Now()
	t.mu.Lock()
	st := &t.st
	st.Scrapes++
	st.Failures++
	st.ConsecutiveFailures++
	st.LastAttempt, st.LastFailure, st.LastError = now, now, err.Error()
	n, suppressed := st.ConsecutiveFailures, t.suppressed
	warn := s.shouldWarnLocked(t, now)
	t.mu.Unlock()
	if warn {
		s.cfg.Logger.Warn("enginemetrics: scrape failed; the backend's engine load is not reported",
			"backend", t.backend, "url", st.URL, "error", err, "consecutive_failures", n, "not_logged", suppressed)
	}
}

// shouldWarnLocked reports whether a warning about t is due at now, and counts one suppressed
// when not. Requires t.mu.
func (s *Scraper) shouldWarnLocked(t *target, now time.Time) bool {
	if !t.lastWarn.IsZero() && now.Sub(t.lastWarn) < LogEvery {
		t.suppressed++
		return false
	}
	t.lastWarn, t.suppressed = now, 0
	return true
}

// fetch GETs t's endpoint within Timeout, reads its body up to MaxBodyBytes and parses it. The
// load's At is when the body was read.
func (s *Scraper) fetch(ctx context.Context, t *target) (kvroute.EngineLoad, Engine, result, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, t.url, nil)
	if err != nil {
		return kvroute.EngineLoad{}, "", resultError, err
	}
	req.Header.Set("Accept", acceptHeader)
	resp, err := s.client.Do(req)
	if err != nil {
		return kvroute.EngineLoad{}, "", resultError, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return kvroute.EngineLoad{}, "", resultError, fmt.Errorf("status %s", resp.Status)
	}
	limit := s.cfg.MaxBodyBytes
	if resp.ContentLength > limit {
		return kvroute.EngineLoad{}, "", resultTooLarge, fmt.Errorf("body of %d bytes over the limit of %d", resp.ContentLength, limit)
	}
	t.buf.Reset()
	defer func() {
		if t.buf.Cap() > keepBuffer {
			t.buf = bytes.Buffer{}
		}
	}()
	n, err := t.buf.ReadFrom(io.LimitReader(resp.Body, limit+1))
	if err != nil {
		return kvroute.EngineLoad{}, "", resultError, fmt.Errorf("reading the body: %w", err)
	}
	if n > limit {
		return kvroute.EngineLoad{}, "", resultTooLarge, fmt.Errorf("body over the limit of %d bytes", limit)
	}
	at := s.cfg.Now()
	l, eng, err := Parse(bytes.NewReader(t.buf.Bytes()), s.cfg.Model)
	if err != nil {
		return kvroute.EngineLoad{}, eng, resultParseError, err
	}
	l.At = at
	return l, eng, resultOK, nil
}
