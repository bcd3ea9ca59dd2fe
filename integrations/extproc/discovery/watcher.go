package discovery

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"slices"
	"sync"
	"time"

	"go.opentelemetry.io/otel/metric"

	"github.com/kvroute/kvroute/config"
)

// DefaultMaxEndpoints is the most endpoints a Watcher accepts from one resolve when
// Options.MaxEndpoints is 0.
const DefaultMaxEndpoints = 1024

// emptyConfirmations is how many consecutive resolves must find no address before the endpoints
// are removed.
const emptyConfirmations = 2

// Errors of New and Sync.
var (
	// ErrInvalidConfig is wrapped by New's error for a configuration without discovery, a nil
	// Membership or a negative Options.MaxEndpoints.
	ErrInvalidConfig = errors.New("discovery: invalid config")
	// ErrTooManyEndpoints is wrapped by Sync's error when the name resolves to more addresses than
	// Options.MaxEndpoints; the endpoints then stay as they were.
	ErrTooManyEndpoints = errors.New("discovery: too many endpoints")
	// ErrMembership is wrapped by Sync's error when the Membership refused a change; the change is
	// tried again at the next resolve.
	ErrMembership = errors.New("discovery: membership change failed")
	// ErrClosed is returned by Sync after Close.
	ErrClosed = errors.New("discovery: watcher closed")
)

// Membership is what a Watcher keeps in line with DNS: the set of backends kvroute routes to.
// Members is kvroute's; a test or another gateway may supply its own.
//
// AddBackend adds backend b, with the KV-event sources of its engine (none when the discovery has
// no zmq_endpoint). It is all or nothing: an error means b was not added, and the Watcher calls
// AddBackend again at the next resolve. RemoveBackend removes the backend named name; it returns
// nil for a name that is not (or no longer) a member, so that a removal that failed half-way
// completes when the Watcher retries it. The Watcher calls them from one goroutine at a time, and
// never for a name whose previous change failed until that change is retried and succeeds.
type Membership interface {
	AddBackend(b config.BackendConfig, sources []config.EventSourceConfig) error
	RemoveBackend(name string) error
}

// Resolver looks up the addresses of a name; *net.Resolver implements it (network "ip": the A
// and AAAA records). A name without records must be reported as a *net.DNSError whose IsNotFound
// is true (or as no address and no error); any other error is taken for a failure of DNS.
type Resolver interface {
	LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error)
}

// ResolverFunc adapts a function to Resolver.
type ResolverFunc func(ctx context.Context, network, host string) ([]netip.Addr, error)

// LookupNetIP calls f(ctx, network, host).
func (f ResolverFunc) LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error) {
	return f(ctx, network, host)
}

var (
	_ Resolver = (*net.Resolver)(nil)
	_ Resolver = ResolverFunc(nil)
)

// Options configures a Watcher beyond the configuration's discovery section. The zero value is
// usable.
type Options struct {
	// Resolver looks the name up; nil is net.DefaultResolver.
	Resolver Resolver
	// Logger receives the changes (Info), resolver failures (Warn) and Membership errors (Error);
	// nil discards them.
	Logger *slog.Logger
	// MeterProvider receives the Watcher's metrics (MetricResolves, MetricEndpoints,
	// MetricMembershipErrors); nil records none.
	MeterProvider metric.MeterProvider
	// MaxEndpoints is the most addresses one resolve may return (0: DefaultMaxEndpoints).
	MaxEndpoints int
	// ResolveTimeout bounds one resolve (0: the discovery interval).
	ResolveTimeout time.Duration
}

// Stats is a snapshot of a Watcher's work since New.
type Stats struct {
	// DNSName is the name resolved.
	DNSName string `json:"dns_name"`
	// Resolves counts the resolves; Failures those that failed (resolver errors and too many
	// addresses: the endpoints were kept); Empty those that found no address.
	Resolves uint64 `json:"resolves"`
	Failures uint64 `json:"failures"`
	Empty    uint64 `json:"empty"`
	// Added and Removed count the endpoints added and removed; MembershipErrors the changes the
	// Membership refused (each retried at the next resolve).
	Added            uint64 `json:"added"`
	Removed          uint64 `json:"removed"`
	MembershipErrors uint64 `json:"membership_errors"`
	// LastError is the last resolve or Membership error ("" when none), at LastErrorAt.
	LastError   string    `json:"last_error,omitempty"`
	LastErrorAt time.Time `json:"last_error_at,omitzero"`
	// LastResolve is when the last resolve ended; LastChange when the endpoints last changed.
	LastResolve time.Time `json:"last_resolve,omitzero"`
	LastChange  time.Time `json:"last_change,omitzero"`
	// Endpoints is the number of endpoints now; Pending the changes waiting for a retry.
	Endpoints int `json:"endpoints"`
	Pending   int `json:"pending"`
}

// Watcher keeps a Membership in line with the addresses of endpoint_picker.discovery.dns_name.
// Its methods are safe for concurrent use. Resolves (Sync and the loop Start runs) take turns, and
// the Membership is called by the resolve whose turn it is, holding only that turn: a Membership
// may call Endpoints and Stats, but not Sync or Close, which would wait for their turn forever.
//
// Why two empty answers: NXDOMAIN or an empty answer removes every endpoint, and with them every
// request's destination (the picker then answers 503), so it must be the pool's state and not a
// passing one. One empty answer can be passing: during a rolling update every pod of a small pool
// may be briefly unready; DNS caches (CoreDNS's cache plugin, NodeLocal DNSCache) may hold a
// negative answer from a moment when the Service had no endpoints while the pods were already
// back; and kube-dns replicas converge at different times. Waiting for a second answer, one
// interval later, costs that interval when a pool is really drained (its pods are gone: requests
// sent to them fail anyway and the health probes take them out of rotation) and avoids answering
// 503 to every request for an interval after a blip. A non-empty answer is applied at once.
//
// Create Watchers with New; the zero Watcher is not usable.
type Watcher struct {
	cfg      *config.Config
	name     string
	interval time.Duration
	timeout  time.Duration
	max      int
	m        Membership
	resolver Resolver
	log      *slog.Logger
	inst     *instruments

	syncMu     sync.Mutex            // one resolve at a time; guards the fields up to mu
	current    map[string]netip.Addr // endpoints the Membership holds
	removing   map[string]bool       // removals that failed, retried first
	emptyCount int                   // consecutive resolves without an address

	mu      sync.Mutex // guards stats and the loop's state
	stats   Stats
	names   []string // sorted endpoints, for Endpoints
	started bool
	closed  bool
	cancel  context.CancelFunc
	done    chan struct{}
}

// New returns a Watcher of cfg's endpoint_picker.discovery that keeps m in line. cfg must have
// its defaults applied and be valid (config.Parse and config.Load do both); New keeps the
// pointer and only reads it. It returns an error wrapping ErrInvalidConfig when cfg is nil or
// has no discovery.dns_name, when m is nil, or for negative options. New does no I/O: call Sync
// for the first resolve, and Start for the periodic ones.
func New(cfg *config.Config, m Membership, o Options) (*Watcher, error) {
	switch {
	case cfg == nil:
		return nil, fmt.Errorf("%w: nil config", ErrInvalidConfig)
	case !cfg.EndpointPicker.Discovery.Enabled():
		return nil, fmt.Errorf("%w: endpoint_picker.discovery.dns_name is not set", ErrInvalidConfig)
	case m == nil:
		return nil, fmt.Errorf("%w: nil Membership", ErrInvalidConfig)
	case o.MaxEndpoints < 0:
		return nil, fmt.Errorf("%w: negative MaxEndpoints %d", ErrInvalidConfig, o.MaxEndpoints)
	case o.ResolveTimeout < 0:
		return nil, fmt.Errorf("%w: negative ResolveTimeout %v", ErrInvalidConfig, o.ResolveTimeout)
	}
	d := cfg.EndpointPicker.Discovery
	interval := time.Duration(d.Interval)
	if interval <= 0 {
		interval = config.DefaultDiscoveryInterval
	}
	w := &Watcher{cfg: cfg, name: d.DNSName, interval: interval, timeout: o.ResolveTimeout, max: o.MaxEndpoints, m: m,
		resolver: o.Resolver, log: o.Logger, current: map[string]netip.Addr{}, removing: map[string]bool{}}
	if w.timeout == 0 {
		w.timeout = interval
	}
	if w.max == 0 {
		w.max = DefaultMaxEndpoints
	}
	if w.resolver == nil {
		w.resolver = net.DefaultResolver
	}
	if w.log == nil {
		w.log = slog.New(slog.DiscardHandler)
	}
	w.log = w.log.With("dns_name", w.name)
	w.stats.DNSName = w.name
	inst, err := newInstruments(o.MeterProvider, w)
	if err != nil {
		return nil, err
	}
	w.inst = inst
	return w, nil
}

// Sync resolves the name once and applies the answer to the Membership (see the package doc).
// ctx bounds the resolve (with Options.ResolveTimeout) but not the Membership's calls, which are
// made whatever ctx says once the answer is in; a resolve cut short by ctx is not counted and
// changes nothing. The error is nil when the endpoints are what the answer calls for (also when
// an empty answer is still waiting for its confirmation); otherwise it wraps the resolver's error
// or ctx's (the endpoints were kept), ErrTooManyEndpoints, or ErrMembership (joined with the
// Membership's errors: the failed changes are retried at the next Sync), or is ErrClosed after
// Close. Safe for concurrent use: concurrent calls take turns.
func (w *Watcher) Sync(ctx context.Context) error {
	w.syncMu.Lock()
	defer w.syncMu.Unlock()
	w.mu.Lock()
	closed := w.closed
	w.mu.Unlock()
	if closed {
		return ErrClosed
	}
	rctx, cancel := context.WithTimeout(ctx, w.timeout)
	addrs, err := w.resolver.LookupNetIP(rctx, "ip", w.name)
	cancel()
	now := time.Now()
	var dnsErr *net.DNSError
	switch {
	case err != nil && errors.As(err, &dnsErr) && dnsErr.IsNotFound:
		addrs, err = nil, nil
	case err != nil && ctx.Err() != nil:
		// The caller gave up (Close or shutdown): no verdict on DNS, nothing counted.
		return fmt.Errorf("discovery: resolving %s: %w", w.name, ctx.Err())
	case err != nil:
		err = fmt.Errorf("discovery: resolving %s: %w", w.name, err)
		w.resolveFailed(ctx, now, err)
		return err
	}
	want, n := w.endpoints(addrs)
	if n > w.max {
		err := fmt.Errorf("%w: %s resolves to %d addresses, more than %d; keeping the %d endpoints", ErrTooManyEndpoints,
			w.name, n, w.max, len(w.current))
		w.resolveFailed(ctx, now, err)
		return err
	}
	w.mu.Lock()
	w.stats.Resolves++
	w.stats.LastResolve = now
	w.mu.Unlock()
	if len(want) == 0 {
		w.mu.Lock()
		w.stats.Empty++
		w.mu.Unlock()
		w.inst.resolved(ctx, resultEmpty)
		w.emptyCount++
		if w.emptyCount < emptyConfirmations && len(w.current) > 0 {
			w.log.Warn("discovery found no address; keeping the endpoints until the next resolve confirms it",
				"endpoints", len(w.current))
			return w.retryRemovals()
		}
	} else {
		w.emptyCount = 0
		w.inst.resolved(ctx, resultOK)
	}
	return w.apply(want)
}

// resolveFailed records a failed resolve.
func (w *Watcher) resolveFailed(ctx context.Context, now time.Time, err error) {
	w.mu.Lock()
	w.stats.Resolves++
	w.stats.Failures++
	w.stats.LastResolve = now
	w.stats.LastError, w.stats.LastErrorAt = err.Error(), now
	w.mu.Unlock()
	w.inst.resolved(ctx, resultError)
	w.log.Warn("discovery failed; keeping the endpoints", "endpoints", len(w.current), "err", err)
}

// endpoints maps the resolved addresses to endpoint names, deduplicated; n is the number of
// distinct addresses.
func (w *Watcher) endpoints(addrs []netip.Addr) (want map[string]netip.Addr, n int) {
	want = make(map[string]netip.Addr, len(addrs))
	for _, a := range addrs {
		if !a.IsValid() {
			continue
		}
		a = a.Unmap().WithZone("")
		b, _ := w.cfg.DiscoveredBackend(a.String())
		want[b.Name] = a
	}
	return want, len(want)
}

// retryRemovals retries the removals that failed before. Under syncMu.
func (w *Watcher) retryRemovals() error {
	var errs []error
	for _, name := range slices.Sorted(maps.Keys(w.removing)) {
		if err := w.m.RemoveBackend(name); err != nil {
			errs = append(errs, w.membershipFailed("remove", name, err))
			continue
		}
		delete(w.removing, name)
		w.log.Info("endpoint removed", "endpoint", name, "retried", true)
		w.changed(0, 1)
	}
	w.publish()
	return joinMembership(errs)
}

// apply brings the Membership to want: the failed removals first, then the endpoints gone, then
// the new ones (a pod whose removal has not completed is added back only once it has). Under
// syncMu.
func (w *Watcher) apply(want map[string]netip.Addr) error {
	var errs []error
	if err := w.retryRemovals(); err != nil {
		errs = append(errs, err)
	}
	for _, name := range byAddress(w.current) {
		if _, ok := want[name]; ok {
			continue
		}
		delete(w.current, name)
		if err := w.m.RemoveBackend(name); err != nil {
			w.removing[name] = true
			errs = append(errs, w.membershipFailed("remove", name, err))
			continue
		}
		w.log.Info("endpoint removed", "endpoint", name)
		w.changed(0, 1)
	}
	for _, name := range byAddress(want) {
		if _, ok := w.current[name]; ok || w.removing[name] {
			continue
		}
		b, sources := w.cfg.DiscoveredBackend(want[name].String())
		if err := w.m.AddBackend(b, sources); err != nil {
			errs = append(errs, w.membershipFailed("add", name, err))
			continue
		}
		w.current[name] = want[name]
		w.log.Info("endpoint added", "endpoint", name, "url", b.URL, "event_sources", len(sources))
		w.changed(1, 0)
	}
	w.publish()
	if len(errs) == 0 {
		return nil
	}
	return errors.Join(errs...)
}

// membershipFailed records a change the Membership refused and returns its error.
func (w *Watcher) membershipFailed(op, name string, err error) error {
	err = fmt.Errorf("%w: %s %s: %w", ErrMembership, op, name, err)
	now := time.Now()
	w.mu.Lock()
	w.stats.MembershipErrors++
	w.stats.LastError, w.stats.LastErrorAt = err.Error(), now
	w.mu.Unlock()
	w.inst.membershipError(op)
	w.log.Error("discovery could not apply a change; retrying at the next resolve", "op", op, "endpoint", name, "err", err)
	return err
}

// changed counts added and removed endpoints.
func (w *Watcher) changed(added, removed uint64) {
	w.mu.Lock()
	w.stats.Added += added
	w.stats.Removed += removed
	w.stats.LastChange = time.Now()
	w.mu.Unlock()
}

// publish makes the current endpoints visible to Endpoints and Stats. Under syncMu.
func (w *Watcher) publish() {
	names := byAddress(w.current)
	w.mu.Lock()
	w.names = names
	w.stats.Endpoints = len(names)
	w.stats.Pending = len(w.removing)
	w.mu.Unlock()
}

// byAddress returns the endpoint names of m in the order of their addresses (IPv4 before IPv6,
// numerically).
func byAddress(m map[string]netip.Addr) []string {
	names := slices.Collect(maps.Keys(m))
	slices.SortFunc(names, func(a, b string) int { return m[a].Compare(m[b]) })
	return names
}

// joinMembership joins the Membership errors of a retry (each already wraps ErrMembership).
func joinMembership(errs []error) error {
	if len(errs) == 0 {
		return nil
	}
	return errors.Join(errs...)
}

// Endpoints returns the endpoints the Membership holds, "ip:port" each, in the order of their
// addresses (IPv4 before IPv6, numerically). Safe for concurrent use; the slice is the caller's.
func (w *Watcher) Endpoints() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.names)
}

// Stats returns a snapshot of the Watcher's counters. Safe for concurrent use.
func (w *Watcher) Stats() Stats {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.stats
}

// Start starts the goroutine that calls Sync every discovery.interval (the first call one interval
// after Start: call Sync yourself first), until ctx is done or Close is called. Errors are logged
// and counted by Sync itself. Start is idempotent, and does nothing after Close.
func (w *Watcher) Start(ctx context.Context) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.started || w.closed {
		return
	}
	w.started = true
	ctx, w.cancel = context.WithCancel(ctx)
	w.done = make(chan struct{})
	go w.loop(ctx)
}

// loop is the goroutine of Start.
func (w *Watcher) loop(ctx context.Context) {
	defer close(w.done)
	t := time.NewTicker(w.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			_ = w.Sync(ctx) // logged and counted by Sync
		}
	}
}

// Close stops the goroutine of Start, waiting for a Sync in progress to end, and unregisters the
// Watcher's metrics. It leaves the Membership as it is: the endpoints stay. It is idempotent; after
// it Sync returns ErrClosed and Start does nothing, while Endpoints and Stats still answer.
func (w *Watcher) Close() {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return
	}
	w.closed = true
	cancel, done := w.cancel, w.done
	w.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
	w.syncMu.Lock() // a Sync called directly ends before Close returns
	w.inst.close()
	w.syncMu.Unlock()
}
