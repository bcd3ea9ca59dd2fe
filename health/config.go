package health

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"time"
)

// Defaults of the zero Config.
const (
	DefaultProbeInterval       = 10 * time.Second
	DefaultProbeTimeout        = 5 * time.Second
	DefaultUnhealthyThreshold  = 3
	DefaultHealthyThreshold    = 2
	DefaultProbePath           = "/health"
	DefaultFailureThreshold    = 5
	DefaultRecoveryTimeout     = 30 * time.Second
	DefaultHalfOpenMaxRequests = 1
)

// maxProbeBody is how much of a probe's answer is read (and discarded) so that the connection can
// be reused; the rest is left unread when the body is closed.
const maxProbeBody = 64 << 10

// ErrInvalidConfig is wrapped by the error New returns for a Config it cannot use.
var ErrInvalidConfig = errors.New("health: invalid config")

// Backend is one backend the Monitor watches.
type Backend struct {
	// Name is the backend's name, as the Target knows it. Names are unique and non-empty.
	Name string
	// URL is the backend's base URL (scheme http or https); the probe GETs URL+ProbeConfig.Path.
	// It may be empty when probes are disabled.
	URL string
}

// ProbeConfig configures the active health probes. Zero fields take the Default* values.
type ProbeConfig struct {
	// Disabled turns the probes off: every backend then counts as healthy for the probes, and
	// only its circuit breaker takes it out of rotation.
	Disabled bool
	// Interval is the time from the start of one round of probes to the start of the next
	// (DefaultProbeInterval). A round longer than Interval is followed at once by the next.
	Interval time.Duration
	// Timeout bounds one probe, connection, headers and body (DefaultProbeTimeout).
	Timeout time.Duration
	// UnhealthyThreshold consecutive failed probes take a backend out of rotation
	// (DefaultUnhealthyThreshold); HealthyThreshold consecutive successful ones bring it back
	// (DefaultHealthyThreshold). A probe succeeds when the answer's status is 2xx.
	UnhealthyThreshold int
	HealthyThreshold   int
	// Path is the path probed with GET (DefaultProbePath); it starts with "/".
	Path string
}

// BreakerConfig configures the per-backend circuit breakers. Zero fields take the Default*
// values.
type BreakerConfig struct {
	// Disabled turns the breakers off: Admit always admits and outcomes count for nothing.
	Disabled bool
	// FailureThreshold consecutive failed requests open a closed circuit
	// (DefaultFailureThreshold); a success in between starts the count again.
	FailureThreshold int
	// RecoveryTimeout is how long a circuit stays open before it turns half-open
	// (DefaultRecoveryTimeout).
	RecoveryTimeout time.Duration
	// HalfOpenMaxRequests is how many trial requests a half-open circuit admits
	// (DefaultHalfOpenMaxRequests); when that many have succeeded the circuit closes, and when one
	// fails it opens again.
	HalfOpenMaxRequests int
}

// Config configures a Monitor. The zero value of every field but Backends is usable.
type Config struct {
	// Backends lists the backends, in the order Statuses reports them.
	Backends []Backend
	// Target is told when a backend enters or leaves rotation; nil is NopTarget (the Monitor's
	// own InRotation still answers). *kvroute.DefaultRouter satisfies Target.
	Target Target
	// Client sends the probes; nil uses a client whose Timeout is Probe.Timeout. Each probe is
	// bounded by Probe.Timeout whatever the client.
	Client *http.Client
	// Probe configures the health probes.
	Probe ProbeConfig
	// Breaker configures the circuit breakers.
	Breaker BreakerConfig
	// Logger receives the state changes ("backend unhealthy", "circuit opened", ...); nil
	// discards them.
	Logger *slog.Logger
	// Clock is the source of time: timestamps, the probe schedule and the recovery timers. Nil
	// uses the system clock; tests inject a fake one.
	Clock Clock
}

// withDefaults returns c with its zero fields set to the defaults, or an error wrapping
// ErrInvalidConfig.
func (c Config) withDefaults() (Config, error) {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }

	p := &c.Probe
	p.Interval = orDefault(p.Interval, DefaultProbeInterval, "probe interval", bad)
	p.Timeout = orDefault(p.Timeout, DefaultProbeTimeout, "probe timeout", bad)
	p.UnhealthyThreshold = orDefault(p.UnhealthyThreshold, DefaultUnhealthyThreshold, "unhealthy threshold", bad)
	p.HealthyThreshold = orDefault(p.HealthyThreshold, DefaultHealthyThreshold, "healthy threshold", bad)
	if p.Path == "" {
		p.Path = DefaultProbePath
	} else if !strings.HasPrefix(p.Path, "/") {
		bad("probe path %q does not start with /", p.Path)
	}
	b := &c.Breaker
	b.FailureThreshold = orDefault(b.FailureThreshold, DefaultFailureThreshold, "failure threshold", bad)
	b.RecoveryTimeout = orDefault(b.RecoveryTimeout, DefaultRecoveryTimeout, "recovery timeout", bad)
	b.HalfOpenMaxRequests = orDefault(b.HalfOpenMaxRequests, DefaultHalfOpenMaxRequests, "half-open max requests", bad)

	seen := make(map[string]bool, len(c.Backends))
	for i, be := range c.Backends {
		switch {
		case be.Name == "":
			bad("backend %d has no name", i)
		case seen[be.Name]:
			bad("backend %q listed twice", be.Name)
		}
		seen[be.Name] = true
		if p.Disabled {
			continue
		}
		if err := checkURL(be.URL); err != nil {
			bad("backend %q: %w", be.Name, err)
		}
	}
	if len(errs) > 0 {
		return c, fmt.Errorf("%w: %w", ErrInvalidConfig, errors.Join(errs...))
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Clock == nil {
		c.Clock = systemClock{}
	}
	if c.Target == nil {
		c.Target = nopTarget{}
	}
	if c.Client == nil {
		c.Client = &http.Client{Timeout: p.Timeout}
	}
	return c, nil
}

// checkURL checks that u is an absolute http(s) URL, as a backend's URL must be when it is probed.
func checkURL(u string) error {
	pu, err := url.Parse(u)
	if err != nil || (pu.Scheme != "http" && pu.Scheme != "https") || pu.Host == "" {
		return fmt.Errorf("URL %q is not an absolute http(s) URL", u)
	}
	return nil
}

// orDefault returns def for a zero v, v for a positive one, and reports a negative one.
func orDefault[T int | time.Duration](v, def T, what string, bad func(string, ...any)) T {
	switch {
	case v == 0:
		return def
	case v < 0:
		bad("negative %s %v", what, v)
	}
	return v
}
