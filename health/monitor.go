package health

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// Target is what a Monitor keeps informed: SetHealthy puts a backend in rotation (true) or takes
// it out (false). The Monitor calls it only when a backend's verdict changes, never while it
// holds a lock, and never concurrently for the same backend. An error is logged, and the call
// is made again after the backend's next probe or state change. *kvroute.DefaultRouter
// satisfies Target.
type Target interface {
	SetHealthy(name string, healthy bool) error
}

// TargetFunc adapts a function to Target.
type TargetFunc func(name string, healthy bool) error

// SetHealthy calls f(name, healthy).
func (f TargetFunc) SetHealthy(name string, healthy bool) error { return f(name, healthy) }

// nopTarget is a Target that ignores every call; a Config with a nil Target uses it.
type nopTarget struct{}

// SetHealthy does nothing and returns nil.
func (nopTarget) SetHealthy(string, bool) error { return nil }

var (
	_ Target = TargetFunc(nil)
	_ Target = nopTarget{}
)

// Clock is a Monitor's source of time. Its methods must be safe for concurrent use.
type Clock interface {
	// Now returns the current time.
	Now() time.Time
	// AfterFunc calls f in its own goroutine once d has passed, unless stop is called first;
	// stop reports whether it prevented the call, as time.Timer.Stop does.
	AfterFunc(d time.Duration, f func()) (stop func() bool)
}

// systemClock is the Clock of the time package.
type systemClock struct{}

func (systemClock) Now() time.Time { return time.Now() }

func (systemClock) AfterFunc(d time.Duration, f func()) func() bool { return time.AfterFunc(d, f).Stop }

var _ Clock = systemClock{}

// Errors of AddBackend and RemoveBackend.
var (
	// ErrUnknownBackend is wrapped by RemoveBackend's error for a name the Monitor does not watch.
	ErrUnknownBackend = errors.New("health: unknown backend")
	// ErrDuplicateBackend is wrapped by AddBackend's error for a name the Monitor already watches.
	ErrDuplicateBackend = errors.New("health: backend already present")
)

// Monitor keeps track of the health of a set of backends and tells its Target which ones are in
// rotation. Its methods are safe for concurrent use. Start runs one goroutine that probes the
// backends; the circuit breakers' recovery timers run on the Clock; Close stops both. The set
// starts as Config.Backends and changes with AddBackend and RemoveBackend, while the probes run.
//
// A backend is in rotation when its probes say healthy and its circuit breaker is not open. Every
// backend starts in rotation, as a new Router has it, with a closed circuit; the Target is told
// only about changes.
//
// Create Monitors with New; the zero Monitor is not usable.
type Monitor struct {
	target  Target
	log     *slog.Logger
	clock   Clock
	client  *http.Client
	probe   ProbeConfig
	breaker BreakerConfig

	set   atomic.Pointer[backendSet] // replaced, never modified, under setMu
	setMu sync.Mutex

	ctx    context.Context // ended by Close: aborts the probes in flight
	cancel context.CancelFunc

	mu        sync.Mutex // guards started and running, and orders timer callbacks against Close
	started   bool
	running   bool           // the probing goroutine was started
	done      chan struct{}  // closed when the probing goroutine has returned, or at Close if none ran
	closed    atomic.Bool    // set under mu
	callbacks sync.WaitGroup // recovery timers and first probes of added backends in progress
	closeOnce sync.Once
}

// backendSet is an immutable snapshot of the watched backends: readers load it without a lock.
type backendSet struct {
	list   []*backend // in configuration order, then the order of AddBackend
	byName map[string]*backend
}

// backend is the state of one backend; mu guards every field below it.
type backend struct {
	name, url string

	mu        sync.Mutex
	probeOK   bool // the probes' verdict: true until UnhealthyThreshold failures in a row
	okRun     int  // consecutive successful probes
	badRun    int  // consecutive failed probes
	lastProbe time.Time
	lastErr   string
	brk       breaker
	stopTimer func() bool // stops the pending recovery timer, if any

	told      bool          // the verdict the Target last accepted (initially true)
	applying  bool          // a goroutine is bringing the Target in line with inRotation()
	applyDone chan struct{} // closed when the goroutine applying is done; nil when none is
	removed   bool          // RemoveBackend took it out: its probes, outcomes and timers count for nothing
}

// inRotation is the current verdict. Under b.mu.
func (b *backend) inRotation() bool { return b.probeOK && b.brk.state != CircuitOpen }

// New returns a Monitor for cfg, or an error wrapping ErrInvalidConfig. Call Start to begin the
// probes and Close to release the Monitor.
func New(cfg Config) (*Monitor, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	m := &Monitor{
		target:  cfg.Target,
		log:     cfg.Logger,
		clock:   cfg.Clock,
		client:  cfg.Client,
		probe:   cfg.Probe,
		breaker: cfg.Breaker,
		done:    make(chan struct{}),
	}
	m.ctx, m.cancel = context.WithCancel(context.Background())
	set := &backendSet{list: make([]*backend, 0, len(cfg.Backends)), byName: make(map[string]*backend, len(cfg.Backends))}
	for _, be := range cfg.Backends {
		b := m.newBackend(be)
		set.list = append(set.list, b)
		set.byName[be.Name] = b
	}
	m.set.Store(set)
	return m, nil
}

// newBackend returns the state of a new backend: in rotation, with a closed circuit.
func (m *Monitor) newBackend(be Backend) *backend {
	return &backend{name: be.Name, url: be.URL, probeOK: true, told: true, brk: newBreaker(m.breaker)}
}

// backends returns the current set's backends, in order. The slice must not be modified.
func (m *Monitor) backends() []*backend { return m.set.Load().list }

// lookup returns the backend named name, or nil.
func (m *Monitor) lookup(name string) *backend { return m.set.Load().byName[name] }

// AddBackend starts watching backend be: it enters the set in rotation, with a closed circuit,
// as a backend of Config.Backends does, and Statuses lists it last. The Target is not called: the
// caller adds the backend to the Target (a Router's AddBackend puts it in rotation) and then to the
// Monitor. While the probing goroutine runs, be gets its first probe at once, in a goroutine Close
// waits for, and then one every round.
//
// It returns an error wrapping ErrDuplicateBackend when the name is already watched, or
// ErrInvalidConfig for an empty name or, with probes enabled, a URL that is not an absolute
// http(s) URL; the set is then unchanged. Safe for concurrent use, also with the probes and
// requests in progress; after Close the backend is added but never probed.
func (m *Monitor) AddBackend(be Backend) error {
	if be.Name == "" {
		return fmt.Errorf("%w: backend has no name", ErrInvalidConfig)
	}
	if !m.probe.Disabled {
		if err := checkURL(be.URL); err != nil {
			return fmt.Errorf("%w: backend %q: %w", ErrInvalidConfig, be.Name, err)
		}
	}
	m.setMu.Lock()
	old := m.set.Load()
	if _, ok := old.byName[be.Name]; ok {
		m.setMu.Unlock()
		return fmt.Errorf("%w: %q", ErrDuplicateBackend, be.Name)
	}
	b := m.newBackend(be)
	next := &backendSet{list: append(append(make([]*backend, 0, len(old.list)+1), old.list...), b),
		byName: make(map[string]*backend, len(old.byName)+1)}
	for k, v := range old.byName {
		next.byName[k] = v
	}
	next.byName[be.Name] = b
	m.set.Store(next)
	m.setMu.Unlock()

	m.mu.Lock()
	probeNow := m.running && !m.closed.Load()
	if probeNow {
		m.callbacks.Add(1)
	}
	m.mu.Unlock()
	if probeNow {
		go func() {
			defer m.callbacks.Done()
			m.probeOne(m.ctx, b)
		}()
	}
	return nil
}

// RemoveBackend stops watching the backend named name: it leaves the set, its probes in flight
// and its requests' outcomes (Ticket.Done) then count for nothing, its recovery timer is stopped,
// and its circuit breaker's state is dropped (a backend added again under the name starts afresh,
// in rotation with a closed circuit). The Target is not called: the caller removes the backend from
// the Target too. RemoveBackend waits for a Target.SetHealthy call in progress for the backend to
// return, so that none is made for it once RemoveBackend has returned (a Target must therefore not
// call RemoveBackend itself). Admit then treats the name as unknown.
//
// It returns an error wrapping ErrUnknownBackend when no backend of that name is watched. Safe
// for concurrent use, also with the probes and requests in progress.
func (m *Monitor) RemoveBackend(name string) error {
	m.setMu.Lock()
	old := m.set.Load()
	gone, ok := old.byName[name]
	if !ok {
		m.setMu.Unlock()
		return fmt.Errorf("%w: %q", ErrUnknownBackend, name)
	}
	next := &backendSet{list: make([]*backend, 0, len(old.list)-1), byName: make(map[string]*backend, len(old.byName)-1)}
	for _, b := range old.list {
		if b != gone {
			next.list = append(next.list, b)
			next.byName[b.name] = b
		}
	}
	m.set.Store(next)
	m.setMu.Unlock()

	gone.mu.Lock()
	gone.removed = true
	stop := gone.stopTimer
	gone.stopTimer = nil
	applying := gone.applyDone
	gone.mu.Unlock()
	if stop != nil {
		stop()
	}
	if applying != nil {
		<-applying
	}
	return nil
}

// Start starts the probing goroutine: it probes every backend at once (Start does not wait for
// the answers) and then every Probe.Interval, until Close. Start is idempotent; it does nothing
// when probes are disabled or after Close.
func (m *Monitor) Start() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.started || m.closed.Load() {
		return
	}
	m.started = true
	if m.probe.Disabled {
		return
	}
	m.running = true
	go m.loop()
}

// Close stops the probing goroutine (aborting the probes in flight) and the recovery timers, and
// waits for them to return. It is idempotent. After Close, Start does nothing and open circuits
// stay open, but Admit, Ticket.Done and the read methods still work.
func (m *Monitor) Close() {
	m.closeOnce.Do(func() {
		m.mu.Lock()
		m.closed.Store(true)
		if !m.running {
			close(m.done)
		}
		m.mu.Unlock()
		m.cancel()
		for _, b := range m.backends() {
			b.mu.Lock()
			stop := b.stopTimer
			b.stopTimer = nil
			b.mu.Unlock()
			if stop != nil {
				stop()
			}
		}
	})
	<-m.done
	m.callbacks.Wait()
}

// Admit asks backend's circuit breaker whether a request may be sent to it now. When ok is true
// the caller sends the request and ends the Ticket with Done (or Cancel); when ok is false the
// circuit is open, or half-open with every trial slot taken, and the caller should pick another
// backend. For an unknown backend, or with breakers disabled, Admit returns a Ticket that counts
// nothing and true. Safe for concurrent use; Admit does no I/O.
func (m *Monitor) Admit(name string) (t Ticket, ok bool) {
	b := m.lookup(name)
	if b == nil || m.breaker.Disabled {
		return Ticket{}, true
	}
	b.mu.Lock()
	gen, ok := b.brk.admit()
	b.mu.Unlock()
	if !ok {
		return Ticket{}, false
	}
	return Ticket{&ticket{m: m, b: b, gen: gen}}, true
}

// Ticket is one admitted request's claim on its backend's circuit breaker, returned by Admit.
// End it with exactly one call to Done or Cancel: the first call counts and later ones do
// nothing. A half-open circuit's trial slot stays taken until then. Its methods are safe for
// concurrent use. The zero Ticket counts nothing.
type Ticket struct{ t *ticket }

type ticket struct {
	m     *Monitor
	b     *backend
	gen   uint64
	ended atomic.Bool
}

// Done records the request's outcome: a nil err is a success, any other a failure (the caller
// decides what fails: a connection error or a 5xx answer, typically). The outcome counts only if
// the circuit is still in the state, and generation, that admitted the request: a request
// admitted before the circuit opened cannot close it.
func (t Ticket) Done(err error) {
	if t.t == nil || !t.t.ended.CompareAndSwap(false, true) {
		return
	}
	t.t.m.outcome(t.t.b, t.t.gen, err)
}

// Cancel ends the ticket without an outcome (the client left before the backend answered, say):
// nothing is counted, and a half-open circuit's trial slot is given back.
func (t Ticket) Cancel() {
	if t.t == nil || !t.t.ended.CompareAndSwap(false, true) {
		return
	}
	b := t.t.b
	b.mu.Lock()
	b.brk.cancel(t.t.gen)
	b.mu.Unlock()
}

// InRotation reports whether the named backend is in rotation, as the Target was last told:
// false for an unknown backend. Safe for concurrent use.
func (m *Monitor) InRotation(name string) bool {
	b := m.lookup(name)
	if b == nil {
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.told
}

// HealthyCount returns how many backends are in rotation. Safe for concurrent use.
func (m *Monitor) HealthyCount() int {
	n := 0
	for _, b := range m.backends() {
		b.mu.Lock()
		if b.told {
			n++
		}
		b.mu.Unlock()
	}
	return n
}

// Status is one backend's health. Its JSON form is the reference proxy's /healthz entry.
type Status struct {
	Name       string       `json:"name"`
	URL        string       `json:"url"`
	InRotation bool         `json:"in_rotation"` // as the Target was last told
	ProbeOK    bool         `json:"probe_ok"`    // the probes' verdict
	Circuit    CircuitState `json:"circuit"`
	LastProbe  time.Time    `json:"last_probe,omitzero"` // when the last probe ended
	LastError  string       `json:"last_error,omitempty"`
	Opens      uint64       `json:"circuit_opens"`        // times the circuit opened
	Failures   int          `json:"consecutive_failures"` // closed circuit: failures in a row so far
}

// Statuses returns every backend's health, in configuration order (backends added by AddBackend
// last, in the order they were added). Safe for concurrent use.
func (m *Monitor) Statuses() []Status {
	list := m.backends()
	out := make([]Status, 0, len(list))
	for _, b := range list {
		b.mu.Lock()
		out = append(out, Status{Name: b.name, URL: b.url, InRotation: b.told, ProbeOK: b.probeOK,
			Circuit: b.brk.state, LastProbe: b.lastProbe, LastError: b.lastErr, Opens: b.brk.opens,
			Failures: b.brk.failures})
		b.mu.Unlock()
	}
	return out
}

// logLine is a log record decided under a lock and written after it is released.
type logLine struct {
	level slog.Level
	msg   string
	attrs []any
}

// outcome folds a request outcome of generation gen into b's breaker.
func (m *Monitor) outcome(b *backend, gen uint64, err error) {
	b.mu.Lock()
	if b.removed {
		b.mu.Unlock()
		return
	}
	from := b.brk.done(gen, err != nil)
	var line logLine
	arm := false
	switch {
	case from == "":
	case b.brk.state == CircuitOpen:
		line = logLine{slog.LevelWarn, "circuit opened", []any{"backend", b.name, "from", string(from),
			"recovery_timeout", m.breaker.RecoveryTimeout.String(), "err", err}}
		if from == CircuitClosed {
			line.attrs = append(line.attrs, "consecutive_failures", m.breaker.FailureThreshold)
		}
		arm = true
	default:
		line = logLine{slog.LevelInfo, "circuit closed", []any{"backend", b.name,
			"trials", m.breaker.HalfOpenMaxRequests}}
	}
	gen = b.brk.gen
	b.mu.Unlock()
	if from == "" {
		return
	}
	m.log.Log(context.Background(), line.level, line.msg, line.attrs...)
	if arm {
		m.armRecovery(b, gen)
	}
	m.sync(b)
}

// armRecovery starts the timer that turns b's circuit, opened in generation gen, half-open after
// the recovery timeout. A circuit left open receives no traffic, so no request could do it.
func (m *Monitor) armRecovery(b *backend, gen uint64) {
	if m.closed.Load() {
		return
	}
	stop := m.clock.AfterFunc(m.breaker.RecoveryTimeout, func() { m.recover(b, gen) })
	b.mu.Lock()
	if m.closed.Load() || b.brk.gen != gen || b.removed { // Close ran, the circuit has moved on, or b is gone
		b.mu.Unlock()
		stop()
		return
	}
	old := b.stopTimer
	b.stopTimer = stop
	b.mu.Unlock()
	if old != nil {
		old()
	}
}

// recover is the recovery timer of b's circuit opened in generation gen.
func (m *Monitor) recover(b *backend, gen uint64) {
	m.mu.Lock()
	if m.closed.Load() {
		m.mu.Unlock()
		return
	}
	m.callbacks.Add(1)
	m.mu.Unlock()
	defer m.callbacks.Done()

	b.mu.Lock()
	ok := !b.removed && b.brk.halfOpen(gen)
	if ok {
		b.stopTimer = nil
	}
	b.mu.Unlock()
	if !ok {
		return
	}
	m.log.Info("circuit half-open", "backend", b.name, "trials", m.breaker.HalfOpenMaxRequests, "cause", "recovery_timeout")
	m.sync(b)
}

// sync brings the Target in line with b's verdict. One goroutine at a time does it for a
// backend, without holding b.mu while the Target runs; it repeats until the verdict it last gave
// is current, so concurrent changes end with the latest verdict. A removed backend's Target is not
// called.
func (m *Monitor) sync(b *backend) {
	b.mu.Lock()
	if b.applying || b.removed {
		b.mu.Unlock()
		return // the goroutine applying will see the new verdict
	}
	b.applying = true
	b.applyDone = make(chan struct{})
	var failed error
	var failedWant bool
	for !b.removed {
		want := b.inRotation()
		if want == b.told {
			break
		}
		b.mu.Unlock()
		err := m.target.SetHealthy(b.name, want)
		b.mu.Lock()
		if err != nil {
			failed, failedWant = err, want
			break
		}
		b.told = want
	}
	b.applying = false
	close(b.applyDone)
	b.applyDone = nil
	b.mu.Unlock()
	if failed != nil {
		m.log.Error("cannot update backend health", "backend", b.name, "in_rotation", failedWant, "err", failed)
	}
}
