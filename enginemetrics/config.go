package enginemetrics

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"time"

	"go.opentelemetry.io/otel/metric"
)

// Defaults and bounds of Config.
const (
	// DefaultInterval is the time between two scrapes of one target. Keep the Router's
	// EngineLoadMaxAge at a few intervals (its default, 10 s, is five).
	DefaultInterval = 2 * time.Second
	// MinInterval and MaxInterval bound Config.Interval.
	MinInterval = 10 * time.Millisecond
	MaxInterval = 10 * time.Minute
	// DefaultTimeout bounds one scrape: connection, headers and body. When Interval is at most
	// DefaultTimeout, the default is Interval/2 instead.
	DefaultTimeout = time.Second
	// DefaultMaxBodyBytes is the largest metrics body read. A vLLM or SGLang engine's is tens of
	// kilobytes (a few hundred series); a data-parallel engine with many LoRA adapters a few
	// hundred.
	DefaultMaxBodyBytes = 4 << 20
	// MaxMaxBodyBytes bounds Config.MaxBodyBytes.
	MaxMaxBodyBytes = 256 << 20
	// LogEvery is the shortest time between two warnings about one target's failing scrapes;
	// the failures in between are counted in the next warning.
	LogEvery = time.Minute
)

var (
	// ErrInvalidConfig is wrapped by the errors of New and SetTargets for a configuration they
	// reject.
	ErrInvalidConfig = errors.New("enginemetrics: invalid config")
	// ErrClosed is returned by Start and SetTargets after Close.
	ErrClosed = errors.New("enginemetrics: scraper closed")
	// ErrStarted is returned by a second Start.
	ErrStarted = errors.New("enginemetrics: scraper already started")
)

// Config configures a Scraper. The zero value of every field but Targets means its documented
// default; an empty Targets is valid (SetTargets adds them later).
type Config struct {
	// Targets maps each backend's name, as the Sink knows it, to its engine's metrics URL (an
	// absolute http or https URL, usually http://host:port/metrics). Names are non-empty. New
	// copies the map.
	Targets map[string]string
	// Interval is the time between two scrapes of one target (default DefaultInterval), in
	// [MinInterval, MaxInterval].
	Interval time.Duration
	// Timeout bounds one scrape, whatever HTTPClient's own timeout (default DefaultTimeout, or
	// Interval/2 when Interval ≤ DefaultTimeout). It must be shorter than Interval.
	Timeout time.Duration
	// MaxBodyBytes is the largest body read from a target, after any gzip decoding (default
	// DefaultMaxBodyBytes, at most MaxMaxBodyBytes). A larger body fails the scrape (result
	// too_large) without being read further.
	MaxBodyBytes int64
	// HTTPClient sends the scrapes. Nil means a client of the Scraper's own, with Timeout as its
	// timeout, a transport cloned from http.DefaultTransport, and redirects followed only to the
	// same host (never from https to http), at most 5; Close closes its idle connections.
	HTTPClient *http.Client
	// Model, when set, keeps only the series whose model_name label equals it: for an endpoint
	// that reports several models. When empty, every series of a metric is summed (the engine's
	// data-parallel ranks, each a series of its own).
	Model string
	// MeterProvider receives the Scraper's metrics (the Metric* constants); nil means none.
	MeterProvider metric.MeterProvider
	// Logger receives a warning when a target's scrapes fail (at most one per target every
	// LogEvery) and a note when they recover; nil discards them.
	Logger *slog.Logger
	// Now is the clock of EngineLoad.At, of Stats' times and of the warnings' rate limit (default
	// time.Now). The scrape schedule runs on real timers. The Sink compares At with its own clock
	// (the Router's Config.Now), so the two must agree.
	Now func() time.Time
}

// withDefaults returns c with its zero fields set to their defaults and Targets copied, or an
// error wrapping ErrInvalidConfig.
func (c Config) withDefaults() (Config, error) {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	switch {
	case c.Interval == 0:
		c.Interval = DefaultInterval
	case c.Interval < MinInterval || c.Interval > MaxInterval:
		bad("interval %v not in [%v, %v]", c.Interval, MinInterval, MaxInterval)
	}
	switch {
	case c.Timeout == 0:
		c.Timeout = min(DefaultTimeout, c.Interval/2)
	case c.Timeout < 0:
		bad("negative timeout %v", c.Timeout)
	case c.Timeout >= c.Interval:
		bad("timeout %v not shorter than the interval %v", c.Timeout, c.Interval)
	}
	switch {
	case c.MaxBodyBytes == 0:
		c.MaxBodyBytes = DefaultMaxBodyBytes
	case c.MaxBodyBytes < 0 || c.MaxBodyBytes > MaxMaxBodyBytes:
		bad("max body bytes %d not in [1, %d]", c.MaxBodyBytes, MaxMaxBodyBytes)
	}
	targets, err := checkTargets(c.Targets)
	if err != nil {
		errs = append(errs, err)
	}
	c.Targets = targets
	if len(errs) > 0 {
		return c, fmt.Errorf("%w: %w", ErrInvalidConfig, errors.Join(errs...))
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c, nil
}

// checkTargets returns a copy of targets, or an error (not wrapped) listing every bad entry in
// backend order.
func checkTargets(targets map[string]string) (map[string]string, error) {
	out := make(map[string]string, len(targets))
	var errs []error
	names := make([]string, 0, len(targets))
	for name := range targets {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		raw := targets[name]
		if name == "" {
			errs = append(errs, errors.New("a target has an empty backend name"))
			continue
		}
		u, err := url.Parse(raw)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			errs = append(errs, fmt.Errorf("target %q: %q is not an absolute http(s) URL", name, redact(raw)))
			continue
		}
		out[name] = raw
	}
	return out, errors.Join(errs...)
}

// redact returns raw with any password replaced, for logs and stats.
func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "<unparsable URL>"
	}
	return u.Redacted()
}

// newClient returns the Scraper's own HTTP client (Config.HTTPClient nil).
func newClient(timeout time.Duration) *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = 2
	return &http.Client{
		Timeout:   timeout,
		Transport: tr,
		CheckRedirect: func(req *http.Request, via []*http.Request) error {
			first := via[0].URL
			switch {
			case len(via) >= 5:
				return errors.New("stopped after 5 redirects")
			case req.URL.Host != first.Host:
				return fmt.Errorf("redirect to another host (%s) refused", req.URL.Host)
			case first.Scheme == "https" && req.URL.Scheme != "https":
				return errors.New("redirect from https to http refused")
			}
			return nil
		},
	}
}
