package kvroute

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvroute/kvroute/chwbl"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/prefixkey"
)

// Router picks a backend for a request. Implementations are safe for concurrent use.
//
// Route returns a non-nil *Decision and a nil error, or a nil *Decision and an error: ErrNoBackend
// when no healthy backend exists, ErrNilRequest for a nil request, or ctx.Err() when ctx has ended
// before a backend was chosen. The caller must call Decision.Done exactly when the request ends
// (calling it more than once is harmless). Done is mandatory, on every path, errors and panics
// included: the decision holds a slot on its backend until then. Write it as go vet would have
// you write a context's cancel, right after the successful call:
//
//	d, err := router.Route(ctx, req)
//	if err != nil {
//		return err
//	}
//	defer func() { d.Done(outcome) }() // outcome: set as the request ends
//
// The default Router has a safety net (Config.MaxDecisionAge, 30 minutes by default): a decision
// whose Done has not come by then is reclaimed, counted and logged; it is a net for bugs, not a
// way to end requests.
//
// A retry that must not land on the backends that already failed the request passes
// WithAvoid(ctx, failed...) to Route; the default Router honours it, and a Router of your own
// should (Avoided reads the list).
type Router interface {
	Route(ctx context.Context, req *prefixkey.Request) (*Decision, error)
}

var _ Router = (*DefaultRouter)(nil)

// Errors returned by the default Router. Callers branch on them with errors.Is.
var (
	ErrNoBackend        = errors.New("kvroute: no healthy backend")
	ErrNilRequest       = errors.New("kvroute: nil request")
	ErrUnknownBackend   = errors.New("kvroute: unknown backend")
	ErrDuplicateBackend = errors.New("kvroute: backend already present")
	ErrInvalidConfig    = errors.New("kvroute: invalid config")
)

// Reason says why a Decision chose its backend. Its String values are kvroute's routing-decision
// labels, one vocabulary for the X-Kvroute-Route header, the prefix_routing_requests_total metric,
// Stats.Decisions and the admin endpoints:
//
//	prefix_hash  tier 1: the owner of the request's prefix key on the CHWBL ring
//	overflow     tier 1: the owner was at its load bound; the next backend clockwise
//	fallback     tier 1: the request had no prefix key; the selection strategy chose
//	strategy     prefix routing is off (Config.DisablePrefixRouting); the selection strategy chose
//	kv_aware     tier 4: the chosen backend holds at least MinOverlapThreshold of the request
//	load_bound   tier 4: some backend holds enough of the request, but load (the bound, or the
//	             scorer's load terms) sent it to a backend holding less than the threshold
//	imbalance    tier 4: the fleet was skewed; the imbalance guard chose the least-loaded backend
//	least_work   tier 4: no backend holds enough of the request (or it is shorter than a block);
//	             the backend with the least prefill work ahead of it took it
//	custom       a Router of your own chose by its own rule (NewDecision)
type Reason uint8

const (
	// ReasonPrefixHash: the backend that owns the request's prefix key on the CHWBL ring took it.
	ReasonPrefixHash Reason = iota + 1
	// ReasonOverflow: the owner was at its load bound; the next backend clockwise took it.
	ReasonOverflow
	// ReasonFallback: the request had no prefix key; the selection strategy chose.
	ReasonFallback
	// ReasonKVAware: the KV index and the scorer chose, and the chosen backend holds at least
	// MinOverlapThreshold of the request.
	ReasonKVAware
	// ReasonImbalance: the KV index had a match, but the fleet was skewed and the imbalance guard
	// chose the least-loaded backend.
	ReasonImbalance
	// ReasonLeastWork: tier 4 looked the request up, but no backend held enough of it (below the
	// threshold), or its prompt is shorter than one block; the backend with the least prefill
	// work ahead of this request took it.
	ReasonLeastWork
	// ReasonLoadBound: a backend holds enough of the request, but the scorer (its load terms, the
	// expected-TTFT scorer's wait or its discount of a backend taking more than its share of the
	// recent requests) or the load bound chose a backend holding less than MinOverlapThreshold
	// of it.
	ReasonLoadBound
	// ReasonStrategy: prefix routing is off; the selection strategy chose.
	ReasonStrategy
	// ReasonCustom: a Router of your own chose by a rule of its own (NewDecision); the default
	// Router never returns it.
	ReasonCustom
	numReasons
)

// allReasons lists every Reason in the order of their values.
var allReasons = [...]Reason{ReasonPrefixHash, ReasonOverflow, ReasonFallback, ReasonKVAware, ReasonImbalance,
	ReasonLeastWork, ReasonLoadBound, ReasonStrategy, ReasonCustom}

// String returns the reason's label (see Reason); "none" for the zero value.
func (r Reason) String() string {
	switch r {
	case ReasonPrefixHash:
		return "prefix_hash"
	case ReasonOverflow:
		return "overflow"
	case ReasonFallback:
		return "fallback"
	case ReasonKVAware:
		return "kv_aware"
	case ReasonImbalance:
		return "imbalance"
	case ReasonLeastWork:
		return "least_work"
	case ReasonLoadBound:
		return "load_bound"
	case ReasonStrategy:
		return "strategy"
	case ReasonCustom:
		return "custom"
	default:
		return "none"
	}
}

// FromKVIndex reports whether tier 4 made the decision (kv_aware, load_bound, imbalance or
// least_work): the KV index was asked, and Decision.ExpectedCachedTokens is what it said of the
// chosen backend.
func (r Reason) FromKVIndex() bool {
	return r == ReasonKVAware || r == ReasonLoadBound || r == ReasonImbalance || r == ReasonLeastWork
}

// MarshalText implements encoding.TextMarshaler with String's labels.
func (r Reason) MarshalText() ([]byte, error) { return []byte(r.String()), nil }

// Backend names a model-server replica and its relative capacity.
type Backend struct {
	Name   string
	Weight float64 // 0 means 1; scales the backend's ring share and its load bound
	// Role is the backend's part in disaggregated serving; the zero value, unified, serves whole
	// requests. Prefill and decode backends need Config.Disagg; they are routed by DisaggRouter.Route only
	// (Route never chooses them), each pool with its own load bound.
	Role disagg.Role
	// Storage is the backend's external storage for KV transfer (external_storage); nil means
	// Config.Disagg's DefaultStorage.
	Storage *disagg.ExternalStorage
}

// DefaultStrategy is the selection strategy for requests without a prefix key.
const DefaultStrategy = StrategyRoundRobin

// ewmaWeight is the weight of one observation in a backend's latency and success averages.
const ewmaWeight = 0.1

// Config configures the default Router. Its zero value is valid: prefix routing on with kvroute's
// defaults (max_prefix_length 1024, ε 0.25, 150 virtual nodes), round_robin for requests without a
// prefix key, no backends yet, no-op metrics, no spans, the wall clock.
type Config struct {
	// DisablePrefixRouting turns tier 1 off: every request tier 4 does not route goes through
	// Strategy (reason strategy).
	DisablePrefixRouting bool
	// MaxPrefixLength is the number of anchor bytes hashed into a prefix key; 0 means
	// prefixkey.DefaultMaxPrefixLength. Valid: 1 to 1 MiB.
	MaxPrefixLength int
	// LoadFactorEpsilon is CHWBL's load_factor_epsilon; 0 means chwbl.DefaultLoadFactorEpsilon. Valid: 0.01 to 10.
	LoadFactorEpsilon float64
	// VirtualNodes per backend of weight 1; 0 means chwbl.DefaultVirtualNodes.
	VirtualNodes int
	// Strategy chooses for requests without a prefix key; "" means DefaultStrategy.
	Strategy Strategy
	// Backends are the initial backends.
	Backends []Backend
	// MeterProvider receives the Router's metrics; nil means no metrics.
	MeterProvider metric.MeterProvider
	// TracerProvider receives the Router's spans (telemetry.SpanRoute and its children); nil means none.
	TracerProvider trace.TracerProvider
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// KV turns on tier 4 (precise KV-aware routing); nil leaves it off.
	KV *KVConfig
	// Disagg turns on disaggregated prefill/decode serving (DefaultRouter.Disagg) for backends with a
	// prefill or decode Role; nil leaves it off, and such backends are then refused.
	Disagg *disagg.Config
	// RefusalHold is how long a request that its backend refused for lack of capacity
	// (Outcome.Refused) keeps its in-flight slot there after Done, so that the refusal weighs on
	// the backend's load, in the ring's bound and in tier 4's scoring, while the engine drains;
	// 0 means DefaultRefusalHold, a negative value releases the slot at once. At most 1 minute.
	RefusalHold time.Duration
	// Peers, when set, receives this Router's decision events (Route's decisions, their
	// FirstToken and Done) to share with the other router replicas, which apply them with
	// ApplyPeerEvent; see "Router replicas" in the package documentation. nil shares nothing.
	// When Peers also has a method ReplicaID() string (natsync.Sync has), naming this replica as
	// its peers name it in ApplyPeerEvent, the replicas take different backends among those that
	// look equally idle to all of them.
	Peers PeerPublisher
	// PeerMaxAge is how long a peer's decision whose end never arrived keeps weighing on its
	// backend; 0 means DefaultPeerMaxAge (5 minutes). Set it above your longest request. At most
	// 24 hours.
	PeerMaxAge time.Duration
	// PeerDelay is how late this Router applies a peer's decision (ApplyPeerEvent) after the peer
	// made it: the sync's batching plus the network's one-way delay (with natsync, its
	// FlushInterval plus that delay). With tier 4 on (KV), the Router counts the prefill work the
	// peers route in twice that time — their decisions it has not seen yet, and those that will
	// not see its own — on the backends that look least busy, and, when at least one such
	// decision is expected, breaks ties among those backends apart from the other replicas (see
	// "Router replicas" in the package documentation). Without peers' decisions it changes
	// nothing. 0 means DefaultPeerDelay (5 ms, natsync's default batching); negative turns it
	// off. At most 1 minute.
	PeerDelay time.Duration
	// EngineLoadMaxAge is how long an engine's reported load (ReportEngineLoad) counts; 0 means
	// DefaultEngineLoadMaxAge (10 s). Set it to a few scrape intervals. At most 1 hour.
	EngineLoadMaxAge time.Duration
	// MaxDecisionAge is the safety net for a Decision (or DisaggDecision) whose Done never comes —
	// a forgotten call, a goroutine that died: once it is that old (from Route), the Router
	// releases what it holds (its in-flight slot, tier 4's prefill backlog and active sequence,
	// its peers' copy) as Done(Outcome{NotSent: true}) would, counts it (Stats.Decisions.Expired,
	// telemetry.MetricDecisionsExpired) and logs it once to Logger at Warn; a later Done does
	// nothing. The check runs in Route, DisaggRouter.Route, Stats and the metrics' collection (no
	// goroutine, no timer), by Now. 0 means DefaultMaxDecisionAge (30 minutes); a negative value
	// turns the net off. Set it above your longest request. At most 24 hours.
	MaxDecisionAge time.Duration
	// Logger receives the Router's rare events (a decision reclaimed by MaxDecisionAge) at Warn;
	// nil discards them.
	Logger *slog.Logger
}

// DefaultRefusalHold is Config.RefusalHold's default.
const DefaultRefusalHold = time.Second

func (c Config) withDefaults() Config {
	if c.MaxPrefixLength == 0 {
		c.MaxPrefixLength = prefixkey.DefaultMaxPrefixLength
	}
	if c.LoadFactorEpsilon == 0 {
		c.LoadFactorEpsilon = chwbl.DefaultLoadFactorEpsilon
	}
	if c.VirtualNodes == 0 {
		c.VirtualNodes = chwbl.DefaultVirtualNodes
	}
	if c.Strategy == "" {
		c.Strategy = DefaultStrategy
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.RefusalHold == 0 {
		c.RefusalHold = DefaultRefusalHold
	}
	if c.PeerMaxAge == 0 {
		c.PeerMaxAge = DefaultPeerMaxAge
	}
	if c.PeerDelay == 0 {
		c.PeerDelay = DefaultPeerDelay
	}
	if c.EngineLoadMaxAge == 0 {
		c.EngineLoadMaxAge = DefaultEngineLoadMaxAge
	}
	if c.MaxDecisionAge == 0 {
		c.MaxDecisionAge = DefaultMaxDecisionAge
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

func (c Config) validate() error {
	if c.RefusalHold > time.Minute {
		return fmt.Errorf("%w: RefusalHold %v is above 1m", ErrInvalidConfig, c.RefusalHold)
	}
	if c.PeerMaxAge < 0 || c.PeerMaxAge > 24*time.Hour {
		return fmt.Errorf("%w: PeerMaxAge %v not in (0, 24h]", ErrInvalidConfig, c.PeerMaxAge)
	}
	if c.PeerDelay > time.Minute {
		return fmt.Errorf("%w: PeerDelay %v is above 1m", ErrInvalidConfig, c.PeerDelay)
	}
	if c.MaxDecisionAge > 24*time.Hour {
		return fmt.Errorf("%w: MaxDecisionAge %v is above 24h", ErrInvalidConfig, c.MaxDecisionAge)
	}
	if c.EngineLoadMaxAge < 0 || c.EngineLoadMaxAge > time.Hour {
		return fmt.Errorf("%w: EngineLoadMaxAge %v not in (0, 1h]", ErrInvalidConfig, c.EngineLoadMaxAge)
	}
	if c.MaxPrefixLength < 1 || c.MaxPrefixLength > 1<<20 {
		return fmt.Errorf("%w: max_prefix_length %d not in [1, 1048576]", ErrInvalidConfig, c.MaxPrefixLength)
	}
	if math.IsNaN(c.LoadFactorEpsilon) || c.LoadFactorEpsilon < 0.01 || c.LoadFactorEpsilon > 10 {
		return fmt.Errorf("%w: load_factor_epsilon %v not in [0.01, 10]", ErrInvalidConfig, c.LoadFactorEpsilon)
	}
	if !c.Strategy.valid() {
		return fmt.Errorf("%w: selection_strategy %q is not one of round_robin, least_loaded, random, least_latency, prefix_aware_hash", ErrInvalidConfig, c.Strategy)
	}
	if c.Strategy == StrategyPrefixAwareHash && c.DisablePrefixRouting {
		return fmt.Errorf("%w: selection_strategy prefix_aware_hash routes by prefix key: it needs prefix routing (DisablePrefixRouting is set)", ErrInvalidConfig)
	}
	return nil
}

// backendState is what the Router keeps per backend beside the ring's in-flight count.
// Its fields are atomics: decisions update them without locks.
type backendState struct {
	name       string
	weight     float64
	healthy    atomic.Bool
	latencyNs  atomicFloat // EWMA of observed request latency, 0 until the first observation
	success    atomicFloat // EWMA of success (1) and failure (0); starts at 1
	observed   atomic.Uint64
	failures   atomic.Uint64
	successes  atomic.Uint64
	refusals   atomic.Uint64 // Outcome.Refused
	decisions  atomic.Uint64
	attrOption metric.MeasurementOption
	// backlog is the prompt tokens, not cached on the backend, of the requests routed to it
	// whose prefill has not ended (FirstToken or Done): the prefill work queued there. Only
	// requests tier 4 knows the length of count. prefill is the same requests' prefill work, in
	// the order they were routed (prefillq.go).
	backlog atomic.Int64
	prefill prefillQueue
	// recent is the logarithm of the backend's decayed count of decisions (see noteDecision),
	// 0 before the first.
	recent  atomicFloat
	role    disagg.Role
	storage *disagg.ExternalStorage // nil: the disaggregation default
	// peerInFlight counts the peers' decisions in flight here (ApplyPeerEvent); engine is the
	// latest engine report (ReportEngineLoad), and external the load last set on the ring
	// (updateExternalLocked). engine and external are guarded by DefaultRouter.peers.mu.
	peerInFlight atomic.Int64
	engine       *engineReport
	external     int
}

// backendSet is an immutable snapshot of the members, swapped whole on every change, so that
// Route reads it with one atomic load.
type backendSet struct {
	list   []*backendState // unified backends (the ring's members), in the order they were added
	pd     []*backendState // prefill and decode backends (on their pools' rings), in the same order
	byName map[string]*backendState
	// byData holds byName's backends by the address of their names' bytes (open addressing, a
	// power-of-two size above twice their number; shift takes a slot from the address's hash),
	// for lookup.
	byData []*backendState
	shift  uint8
}

// newBackendSet returns the set of the unified backends list and the prefill and decode
// backends pd.
func newBackendSet(list, pd []*backendState) *backendSet {
	s := &backendSet{list: list, pd: pd, byName: make(map[string]*backendState, len(list)+len(pd))}
	n, bits := 2, uint8(1)
	for n <= 2*(len(list)+len(pd)) {
		n, bits = 2*n, bits+1
	}
	s.byData, s.shift = make([]*backendState, n), 64-bits
	for _, sts := range [...][]*backendState{list, pd} {
		for _, st := range sts {
			s.byName[st.name] = st
			i := s.slot(st.name)
			for s.byData[i] != nil {
				i = (i + 1) & (n - 1)
			}
			s.byData[i] = st
		}
	}
	return s
}

// slot is the first slot of byData to look for name in.
func (s *backendSet) slot(name string) int {
	return int((uint64(uintptr(unsafe.Pointer(unsafe.StringData(name)))) * 0x9e3779b97f4a7c15) >> s.shift)
}

// lookup returns the backend named name, nil for none: byName[name], in fewer steps for a name
// that shares its bytes with the backend's own, as a chwbl.Handle's Backend does (the ring keeps
// the name AddBackend gave both). It compares addresses and lengths, not bytes; any other name
// ends at an empty slot and is looked up in byName.
func (s *backendSet) lookup(name string) *backendState {
	p, n := unsafe.StringData(name), len(s.byData)
	for i := s.slot(name); ; i = (i + 1) & (n - 1) {
		st := s.byData[i]
		if st == nil {
			return s.byName[name]
		}
		if unsafe.StringData(st.name) == p && len(st.name) == len(name) {
			return st
		}
	}
}

// DefaultRouter is the Router built by New: tier 1 (prefix-aware CHWBL routing) with a fallback
// selection strategy. It is safe for concurrent use; backends can be added, removed and marked
// unhealthy while requests are routed. Close releases its metric callbacks.
type DefaultRouter struct {
	cfg     Config
	ring    *chwbl.Ring
	mu      sync.Mutex // serialises membership changes (Add/Remove); Route never takes it
	set     atomic.Pointer[backendSet]
	rr      atomic.Uint64
	prefix  hyperLogLog
	counts  [numReasons]atomic.Uint64
	metrics *routerMetrics
	kv      *tier4       // nil when tier 4 is off
	dis     *disaggState // nil when disaggregation is off
	tracer  trace.Tracer // nil when tracing is off (Config.TracerProvider)
	peers   peers        // the other replicas' decisions and the engines' reports (peers.go)
	live    liveSet      // the decisions whose Done has not come (expire.go)
	peerSeq atomic.Uint64
	// epoch is Config.Now when New ran: tier 4's prefill queues and decision shares keep their
	// times as nanoseconds since it (since), on the monotonic clock when Now reads it.
	epoch time.Time
	// mono: Config.Now is the default, time.Now, so nowNanos reads the monotonic clock alone
	// (time.Since of epoch), half the cost of time.Now's wall and monotonic readings.
	mono bool

	disaggSide DisaggRouter // Disagg's answer
}

// New builds the default Router from cfg, after validating it (errors wrap ErrInvalidConfig).
func New(cfg Config) (*DefaultRouter, error) {
	mono := cfg.Now == nil
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	ring, err := chwbl.New(chwbl.Config{VirtualNodes: cfg.VirtualNodes, LoadFactorEpsilon: cfg.LoadFactorEpsilon})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	r := &DefaultRouter{cfg: cfg, ring: ring, tracer: newTracer(cfg.TracerProvider), epoch: cfg.Now(), mono: mono}
	r.live.init(cfg.MaxDecisionAge)
	// Decision ids shared with peers start at random, so that a Router built by a reload, sharing
	// its replica id with the one it replaces, does not reuse that one's ids.
	r.peerSeq.Store(rand.Uint64() >> 8)
	if n, ok := cfg.Peers.(replicaNamer); ok {
		r.peers.self = n.ReplicaID()
	}
	r.disaggSide.r = r
	if cfg.KV != nil {
		if r.kv, err = newTier4(*cfg.KV); err != nil {
			return nil, err
		}
	}
	if cfg.Disagg != nil {
		if r.dis, err = newDisaggState(*cfg.Disagg, cfg); err != nil {
			return nil, err
		}
	}
	r.set.Store(newBackendSet(nil, nil))
	if r.metrics, err = newRouterMetrics(cfg.MeterProvider, r); err != nil {
		return nil, err
	}
	if r.dis != nil {
		if r.dis.metrics, err = newDisaggMetrics(cfg.MeterProvider, r); err != nil {
			r.Close()
			return nil, err
		}
	}
	for _, b := range cfg.Backends {
		if err := r.AddBackend(b); err != nil {
			r.Close()
			return nil, err
		}
	}
	return r, nil
}

// Close unregisters the Router's metric callbacks. It is idempotent; routing keeps working after it.
func (r *DefaultRouter) Close() error {
	err := r.metrics.close()
	if r.dis != nil && r.dis.metrics != nil {
		err = errors.Join(err, r.dis.metrics.close())
	}
	return err
}

// AddBackend adds a healthy backend. It returns an error wrapping ErrDuplicateBackend when the name is
// taken, or ErrInvalidConfig for an empty name, a negative or non-finite weight, an invalid role,
// or a prefill or decode role on a Router without Config.Disagg. Safe for concurrent use.
func (r *DefaultRouter) AddBackend(b Backend) error {
	if b.Name == "" {
		return fmt.Errorf("%w: backend name is empty", ErrInvalidConfig)
	}
	if b.Weight < 0 || math.IsNaN(b.Weight) || math.IsInf(b.Weight, 0) {
		return fmt.Errorf("%w: backend %q weight %v", ErrInvalidConfig, b.Name, b.Weight)
	}
	if !b.Role.Valid() || (b.Role != disagg.RoleUnified && r.dis == nil) {
		return fmt.Errorf("%w: backend %q role %v needs Config.Disagg", ErrInvalidConfig, b.Name, b.Role)
	}
	ring := r.ringOf(b.Role)
	if b.Weight == 0 {
		b.Weight = 1
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	old := r.set.Load()
	if _, ok := old.byName[b.Name]; ok {
		return fmt.Errorf("%w: %q", ErrDuplicateBackend, b.Name)
	}
	if err := ring.Add(b.Name, b.Weight); err != nil {
		if errors.Is(err, chwbl.ErrDuplicate) {
			return fmt.Errorf("%w: %q", ErrDuplicateBackend, b.Name)
		}
		return err
	}
	st := &backendState{name: b.Name, weight: b.Weight, role: b.Role}
	if b.Storage != nil {
		s := *b.Storage
		st.storage = &s
	}
	st.healthy.Store(true)
	st.success.store(1)
	st.attrOption = r.metrics.backendOption(b.Name)
	list, pd := old.list, old.pd
	if b.Role == disagg.RoleUnified {
		list = append(append(make([]*backendState, 0, len(old.list)+1), old.list...), st)
	} else {
		pd = append(append(make([]*backendState, 0, len(old.pd)+1), old.pd...), st)
	}
	r.set.Store(newBackendSet(list, pd))
	return nil
}

// RemoveBackend removes a backend. Requests in flight on it finish normally; their Done calls
// release nothing twice. It returns an error wrapping ErrUnknownBackend when there is no such
// backend. Safe for concurrent use.
func (r *DefaultRouter) RemoveBackend(name string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	old := r.set.Load()
	gone, ok := old.byName[name]
	if !ok {
		return fmt.Errorf("%w: %q", ErrUnknownBackend, name)
	}
	if err := r.ringOf(gone.role).Remove(name); err != nil {
		return err
	}
	var list, pd []*backendState
	for _, st := range old.list {
		if st.name != name {
			list = append(list, st)
		}
	}
	for _, st := range old.pd {
		if st.name != name {
			pd = append(pd, st)
		}
	}
	r.set.Store(newBackendSet(list, pd))
	return nil
}

// SetHealthy marks a backend healthy or unhealthy; unhealthy backends receive no new requests.
// It returns an error wrapping ErrUnknownBackend when there is no such backend. Safe for
// concurrent use.
func (r *DefaultRouter) SetHealthy(name string, healthy bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	st, ok := r.set.Load().byName[name]
	if !ok {
		return fmt.Errorf("%w: %q", ErrUnknownBackend, name)
	}
	if err := r.ringOf(st.role).SetHealthy(name, healthy); err != nil {
		return err
	}
	st.healthy.Store(healthy)
	return nil
}

// Route chooses a backend for req and takes an in-flight slot on it. See Router for the contract.
// With tier 4 on (Config.KV), the KV index and the scorer choose first (kv_aware, load_bound,
// imbalance, least_work); otherwise, or when tier 4 leaves the request, the CHWBL ring chooses by
// prefix key (prefix_hash or overflow), or the configured Strategy without one (fallback, or
// strategy with prefix routing off). Tier 1 does no I/O and blocks on other requests no longer
// than the ring's bound check; tier 4 calls the KV index (a remote one does I/O) and, for a
// request without token IDs, KVConfig.Tokenizer, both bounded by ctx. With Config.TracerProvider,
// each call is a telemetry.SpanRoute span, child of ctx's. The backends ctx avoids (WithAvoid)
// are passed over in every tier as unhealthy ones are; the error is ErrNoBackend when every
// healthy backend is avoided.
func (r *DefaultRouter) Route(ctx context.Context, req *prefixkey.Request) (*Decision, error) {
	if r.tracer != nil {
		return r.routeTraced(ctx, req)
	}
	return r.route(ctx, req)
}

// route is Route without its span.
func (r *DefaultRouter) route(ctx context.Context, req *prefixkey.Request) (*Decision, error) {
	if req == nil {
		return nil, ErrNilRequest
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	at := r.nowNanos()
	d := &Decision{router: r, at: at}
	r.expireExternal(at)
	if r.live.due(at) {
		r.sweepDecisions(at)
	}
	if !r.cfg.DisablePrefixRouting {
		d.PrefixKey, d.HasPrefixKey = req.PrefixKey(r.cfg.MaxPrefixLength)
	}
	if d.HasPrefixKey {
		r.prefix.add(d.PrefixKey.Uint64())
	}
	avoid := Avoided(ctx)
	var s4 *scratch4
	if r.kv != nil {
		s4 = r.kv.scratch.Get().(*scratch4)
		defer r.kv.scratch.Put(s4)
		s4.avoid = avoid
		if r.routeKV(ctx, req, d, s4) {
			d = r.finish(ctx, d)
			r.addBacklog(d, s4)
			r.share(d, s4.keys)
			r.live.track(&d.live, d, at)
			return d, nil
		}
		r.kv.handedOff.Add(1)
	}
	var err error
	if d.HasPrefixKey {
		h := d.PrefixKey.Uint64()
		var why chwbl.Reason
		why, err = r.ring.AcquireAvoiding(&d.handle, h, avoid)
		if why == chwbl.ReasonOverflow {
			d.Reason = ReasonOverflow
		} else {
			d.Reason = ReasonPrefixHash
		}
	} else {
		d.Reason = ReasonFallback
		if r.cfg.DisablePrefixRouting {
			d.Reason = ReasonStrategy
		}
		err = r.acquireByStrategy(&d.handle, avoid)
	}
	if err != nil {
		if errors.Is(err, chwbl.ErrNoBackend) {
			return nil, ErrNoBackend
		}
		return nil, err
	}
	if s4 != nil {
		r.speculateTier1(ctx, d, s4)
	}
	d = r.finish(ctx, d)
	var keys []uint64
	if s4 != nil {
		r.addBacklog(d, s4)
		keys = s4.keys
	}
	r.share(d, keys)
	r.live.track(&d.live, d, at)
	return d, nil
}

// share publishes d, a decision Route made, to Config.Peers.
func (r *DefaultRouter) share(d *Decision, keys []uint64) {
	if r.cfg.Peers == nil {
		return
	}
	d.peerID = r.peerSeq.Add(1)
	r.publish(d, PeerRouted, keys)
}

// finish fills the decision's backend fields and counts it.
func (r *DefaultRouter) finish(ctx context.Context, d *Decision) *Decision {
	d.Backend = d.handle.Backend()
	d.state = r.set.Load().lookup(d.Backend)
	if d.state != nil {
		d.state.decisions.Add(1)
		if r.kv != nil {
			d.state.noteDecision(d.at)
		}
	}
	r.counts[d.Reason].Add(1)
	return d
}

// Decision is the outcome of Route: the chosen backend, why, and the request's prefix key. It holds
// an in-flight slot on the backend until Done. Done is safe for concurrent use and idempotent; the
// exported fields are read-only for the caller.
//
// Done is mandatory: call it once the request has ended, however it ended (defer it right after a
// successful Route). A Decision whose Done never comes keeps its backend loaded — with the default
// Router, until Config.MaxDecisionAge (30 minutes by default) reclaims it, counts it and logs it.
type Decision struct {
	Backend      string
	Reason       Reason
	PrefixKey    prefixkey.Key
	HasPrefixKey bool
	// Overlaps lists, for a KV-aware decision, every healthy backend the index was asked about
	// with the cached prefix it holds and its score; nil for other decisions.
	Overlaps []Overlap
	// ExpectedCachedTokens is how many of the prompt's tokens the chosen backend holds according
	// to the KV index when tier 4 decided (Reason.FromKVIndex); 0 otherwise.
	ExpectedCachedTokens int

	router   *DefaultRouter // nil for a Decision made by NewDecision
	hooks    *hookState     // NewDecision's and WrapDecision's
	live     liveNode       // ended: Done has run, or Config.MaxDecisionAge reclaimed it (expire.go)
	first    atomic.Bool    // FirstToken has run
	prefill  *kvPrefill     // its prefill on its backend's queue, nil when tier 4 put none there
	activeID uint64         // active-sequence id when tier 4 tracks sequences, else 0
	peerID   uint64         // the decision's id in its PeerEvents, 0 when it is not shared
	state    *backendState
	handle   chwbl.Handle
	at       int64 // when Route began, in nanoseconds since the Router's epoch (nowNanos)
}

// DecisionHooks are what a Decision made by NewDecision does when the gateway reports on it.
type DecisionHooks struct {
	// Done runs once, on the Decision's first Done: release what the Router held for the request
	// and record its outcome.
	Done func(Outcome)
	// FirstToken runs once, on the Decision's first FirstToken call, and not at all when Done
	// has begun first (the Decision's holder calls FirstToken when the first byte of a
	// successful answer goes out).
	FirstToken func()
}

// NewDecision returns a Decision for a Router of your own: backend and reason as the gateway
// will read them (ReasonCustom when your own rule chose), and hooks (nil: none) for what Done and
// FirstToken must do. A Router that adds a rule and then delegates uses WrapDecision instead.
//
// On the result, Done runs the Done hook once; FirstToken runs the FirstToken hook once, and
// never once Done has begun (a FirstToken racing Done either finishes before the Done hook starts
// or does not run). Both are safe to call from any goroutine. The hooks must not call the
// decision's own methods.
func NewDecision(backend string, reason Reason, hooks *DecisionHooks) *Decision {
	h := &hookState{}
	if hooks != nil {
		h.hooks = *hooks
	}
	return &Decision{Backend: backend, Reason: reason, hooks: h}
}

// WrapDecision returns a Decision that carries inner's exported fields (backend, reason, prefix
// key, overlaps, expected cached tokens) and whose Done and FirstToken run hooks' (nil: none)
// first and then inner's, with NewDecision's guarantees. A Router that adds a rule and delegates
// writes:
//
//	inner, err := next.Route(ctx, req)
//	if err != nil {
//		return nil, err
//	}
//	return kvroute.WrapDecision(inner, &kvroute.DecisionHooks{
//		Done: func(o kvroute.Outcome) { myStats.record(inner.Backend, o) },
//	}), nil
func WrapDecision(inner *Decision, hooks *DecisionHooks) *Decision {
	d := NewDecision(inner.Backend, inner.Reason, hooks)
	d.PrefixKey, d.HasPrefixKey = inner.PrefixKey, inner.HasPrefixKey
	d.Overlaps, d.ExpectedCachedTokens = inner.Overlaps, inner.ExpectedCachedTokens
	d.hooks.inner = inner
	return d
}

// hookState is what a Decision made by NewDecision or WrapDecision runs.
type hookState struct {
	hooks DecisionHooks
	inner *Decision  // WrapDecision's
	mu    sync.Mutex // orders the FirstToken hook before the Done hook
	first bool       // the FirstToken hook has run (under mu)
}

// Outcome reports how a routed request ended. The zero Outcome is a success whose latency is
// measured from Route's return to Done.
type Outcome struct {
	Err     error         // non-nil when the backend failed the request (counts against its health)
	Latency time.Duration // 0 means measured by the Router's clock
	// Refused reports that the backend declined the request for lack of capacity before answering
	// it (an engine's 429 or 503, or its error for a full KV cache): a sign of load, not of ill
	// health. The default Router counts it (BackendStats.Refusals), records neither a success nor
	// a failure, and keeps the request's in-flight slot on the backend for Config.RefusalHold.
	Refused bool
	// NotSent reports that the request never reached the backend (the gateway sent it elsewhere
	// or gave up first): the slot is released and nothing is recorded.
	NotSent bool
}

// Done releases the decision's in-flight slot and records the outcome (latency for least_latency,
// success or failure for the backend's health score; a refusal as Outcome.Refused says). Only the
// first call has an effect, and none once Config.MaxDecisionAge has reclaimed the decision. Safe
// to call from any goroutine; a nil Decision is a no-op.
func (d *Decision) Done(o Outcome) {
	if d != nil {
		d.end(o)
	}
}

// end is Done's work: unless d has ended already (Done has begun, or Config.MaxDecisionAge
// reclaimed it), it ends d with o and returns true.
func (d *Decision) end(o Outcome) bool {
	if !d.live.ended.CompareAndSwap(false, true) {
		return false
	}
	if d.router == nil {
		if h := d.hooks; h != nil {
			h.mu.Lock()
			if h.hooks.Done != nil {
				h.hooks.Done(o)
			}
			h.mu.Unlock()
			h.inner.Done(o)
		}
		return true
	}
	d.endPrefill(false)
	if d.activeID != 0 {
		d.router.kv.active.Done(d.activeID)
	}
	d.router.publish(d, PeerDone, nil)
	if o.Refused {
		if d.state != nil {
			d.state.refusals.Add(1)
		}
		d.router.holdRefused(&d.handle)
		return true
	}
	if !d.handle.Release() || d.state == nil || o.NotSent {
		return true
	}
	lat := o.Latency
	if lat <= 0 {
		lat = time.Duration(d.router.nowNanos() - d.at)
	}
	d.state.observe(lat, o.Err == nil)
	return true
}

// holdRefused releases h, a refused request's slot, after Config.RefusalHold.
func (r *DefaultRouter) holdRefused(h *chwbl.Handle) {
	if r.cfg.RefusalHold < 0 {
		h.Release()
		return
	}
	time.AfterFunc(r.cfg.RefusalHold, func() { h.Release() })
}

// FirstToken tells the Router the backend produced the request's first token: its prefill load
// ends (the backend's prefill backlog, and active-sequence tracking for cost scoring), and tier 4
// learns the backend's prefill rate from it. Call it for a successful response only: an error
// the engine returns at once is no prefill. Done does the same for a request whose first token
// was never reported (and teaches no rate). Safe to call from any goroutine; only the first call
// has an effect.
func (d *Decision) FirstToken() {
	if d == nil {
		return
	}
	if d.router == nil {
		h := d.hooks
		if h == nil {
			return
		}
		h.mu.Lock()
		defer h.mu.Unlock()
		if h.first || d.live.ended.Load() {
			return
		}
		h.first = true
		if h.hooks.FirstToken != nil {
			h.hooks.FirstToken()
		}
		h.inner.FirstToken()
		return
	}
	if d.live.ended.Load() || !d.first.CompareAndSwap(false, true) {
		return
	}
	d.endPrefill(true)
	if d.activeID != 0 {
		d.router.kv.active.FirstToken(d.activeID)
	}
	d.router.publish(d, PeerFirstToken, nil)
}

// endPrefill takes the request's tokens and work off its backend's prefill backlog, once;
// firstToken says its prefill ended with a first token (not an error), which the backend's
// prefill rate learns from.
func (d *Decision) endPrefill(firstToken bool) {
	p := d.prefill
	if p == nil || d.state == nil {
		return
	}
	if n := p.tokens.Swap(0); n != 0 {
		d.state.backlog.Add(-n)
		d.state.prefill.end(&p.node, firstToken, d.router.nowNanos())
	}
}

// observe folds one finished request into the backend's averages.
func (st *backendState) observe(lat time.Duration, ok bool) {
	n := st.observed.Add(1)
	if n == 1 {
		st.latencyNs.store(float64(lat))
	} else {
		st.latencyNs.update(func(v float64) float64 { return v + ewmaWeight*(float64(lat)-v) })
	}
	x := 0.0
	if ok {
		x = 1
		st.successes.Add(1)
	} else {
		st.failures.Add(1)
	}
	st.success.update(func(v float64) float64 { return v + ewmaWeight*(x-v) })
}

// atomicFloat is a float64 updated with compare-and-swap.
type atomicFloat struct{ bits atomic.Uint64 }

func (f *atomicFloat) load() float64   { return math.Float64frombits(f.bits.Load()) }
func (f *atomicFloat) store(v float64) { f.bits.Store(math.Float64bits(v)) }

// update sets f to fn of its value. It writes nothing when fn leaves the value as it is, as the
// success average of a backend that keeps succeeding does once it has reached 1: Done then
// spares a locked write.
func (f *atomicFloat) update(fn func(float64) float64) {
	for {
		old := f.bits.Load()
		v := math.Float64bits(fn(math.Float64frombits(old)))
		if v == old || f.bits.CompareAndSwap(old, v) {
			return
		}
	}
}
