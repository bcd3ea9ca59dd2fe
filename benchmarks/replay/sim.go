package replay

import (
	"container/heap"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/internal/enginesim"
	"github.com/kvroute/kvroute/prefixkey"
)

// Defaults of Config.
const (
	DefaultEngines        = 8
	DefaultCapacityTokens = 262_144 // KV cache per engine: 16,384 blocks of 16 tokens
	DefaultBlockSize      = 16
	DefaultUtilisation    = 0.8
	DefaultEventLag       = 20 * time.Millisecond
	DefaultModel          = "replay-model"
	DefaultScrapePeriod   = 2 * time.Second
)

// Config configures one simulated fleet and its router replicas. The zero value of a field means
// its default, except EventLag and SyncDelay (0 is no delay) and Utilisation (0 means
// DefaultUtilisation; a negative value keeps the workload's own timing).
type Config struct {
	// Engines is the number of engines (DefaultEngines).
	Engines int
	// CapacityTokens is each engine's KV cache, in tokens (DefaultCapacityTokens); it is rounded
	// down to whole blocks.
	CapacityTokens int
	// BlockSize is the engines' KV block size and kvroute's index block size (DefaultBlockSize).
	BlockSize int
	// MaxConcurrent is each engine's running-request limit (enginesim.DefaultMaxConcurrent).
	MaxConcurrent int
	// Latency is the engines' latency model; the zero value means enginesim.DefaultLatency.
	Latency enginesim.Latency
	// Utilisation is the offered load the arrivals are scaled to, as a fraction of the fleet's
	// capacity when no request reuses any cache (see TimeScale).
	Utilisation float64
	// EventLag is the delay between an engine's cache operation and the router's index applying
	// the KV event.
	EventLag time.Duration
	// ParallelPrefill runs every admitted request's prefill at once, as internal/enginesim's Engine
	// does (compute is unlimited; only KV-cache blocks and MaxConcurrent slots are scarce). The
	// default, false, models a compute-bound GPU: each engine runs one prefill at a time, first
	// come first served, while decodes overlap (enginesim.VirtualOptions.PrefillUnits 1).
	ParallelPrefill bool
	// Seed salts the synthesized tokens (and so the prefix keys' places on the ring) and seeds the
	// random policy and the random spread of arrivals over replicas.
	Seed uint64

	// Replicas is the number of router replicas (1): a policy with router state runs as that many
	// independent instances, each routing the arrivals Spread gives it and seeing only what Sync
	// shares (see "Router replicas" in the package documentation). random and the oracles keep
	// one instance: they have no router state.
	Replicas int
	// Spread is how arrivals are spread over the replicas: SpreadRandom (the default: a uniform
	// choice seeded by Seed, as an L4 load balancer makes) or SpreadRoundRobin.
	Spread string
	// Sync is what the replicas share beyond the engines' KV events, which every replica's index
	// receives: SyncNone (the default), SyncMetrics, SyncPeers or SyncBoth.
	Sync string
	// SyncDelay is the time from a replica's decision event (kvroute.PeerEvent) to the other
	// replicas applying it, under SyncPeers and SyncBoth.
	SyncDelay time.Duration
	// PeerDelay is the replicas' kvroute.Config.PeerDelay (how late they expect peers'
	// decisions); 0 means SyncDelay, as an operator who measured it would set; negative turns
	// the Router's estimate of peers' unseen work off.
	PeerDelay time.Duration
	// ScrapePeriod is the interval between a replica's reports of the engines' load
	// (kvroute.DefaultRouter.ReportEngineLoad) under SyncMetrics and SyncBoth
	// (DefaultScrapePeriod).
	ScrapePeriod time.Duration

	// BurstPeriod and BurstDuty make the arrivals burstier than the workload's own: in each
	// BurstPeriod of virtual time (after the scaling to Utilisation) the period's arrivals are
	// compressed, in order, into its first BurstDuty fraction. The mean rate is kept; inside a
	// burst it is 1/BurstDuty times the workload's, and nothing arrives in the rest of the
	// period. A zero BurstPeriod (the default) keeps the arrivals as they are; BurstDuty must then
	// be 0 too, and otherwise in (0, 1]. The workload's name in the Result says so
	// ("+burst<period>x<1/duty>").
	BurstPeriod time.Duration
	BurstDuty   float64
}

// burst returns arrival time at (virtual, scaled) moved by the burst compression.
func (c Config) burst(at time.Duration) time.Duration {
	if c.BurstPeriod <= 0 {
		return at
	}
	start := at / c.BurstPeriod * c.BurstPeriod
	return start + time.Duration(float64(at-start)*c.BurstDuty)
}

// burstName is the suffix the burst compression adds to the workload's name, "" without one.
func (c Config) burstName() string {
	if c.BurstPeriod <= 0 {
		return ""
	}
	return "+burst" + c.BurstPeriod.String() + "x" + strconv.FormatFloat(1/c.BurstDuty, 'g', 3, 64)
}

func (c Config) withDefaults() (Config, error) {
	if c.Engines == 0 {
		c.Engines = DefaultEngines
	}
	if c.CapacityTokens == 0 {
		c.CapacityTokens = DefaultCapacityTokens
	}
	if c.BlockSize == 0 {
		c.BlockSize = DefaultBlockSize
	}
	if c.MaxConcurrent == 0 {
		c.MaxConcurrent = enginesim.DefaultMaxConcurrent
	}
	if c.Latency == (enginesim.Latency{}) {
		c.Latency = enginesim.DefaultLatency
	}
	if c.Utilisation == 0 {
		c.Utilisation = DefaultUtilisation
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	if c.Spread == "" {
		c.Spread = SpreadRandom
	}
	if c.Sync == "" {
		c.Sync = SyncNone
	}
	if c.ScrapePeriod == 0 {
		c.ScrapePeriod = DefaultScrapePeriod
	}
	switch {
	case c.Engines < 1 || c.Engines > 64:
		return c, fmt.Errorf("%w: engines %d not in [1, 64]", ErrInvalidConfig, c.Engines)
	case c.BlockSize < 1:
		return c, fmt.Errorf("%w: block size %d", ErrInvalidConfig, c.BlockSize)
	case c.CapacityTokens < c.BlockSize:
		return c, fmt.Errorf("%w: capacity %d tokens is less than one block", ErrInvalidConfig, c.CapacityTokens)
	case c.MaxConcurrent < 1:
		return c, fmt.Errorf("%w: max concurrent %d", ErrInvalidConfig, c.MaxConcurrent)
	case math.IsNaN(c.Utilisation) || c.Utilisation > 100:
		return c, fmt.Errorf("%w: utilisation %v", ErrInvalidConfig, c.Utilisation)
	case c.EventLag < 0:
		return c, fmt.Errorf("%w: event lag %v", ErrInvalidConfig, c.EventLag)
	case c.Replicas < 1 || c.Replicas > 64:
		return c, fmt.Errorf("%w: replicas %d not in [1, 64]", ErrInvalidConfig, c.Replicas)
	case c.Spread != SpreadRandom && c.Spread != SpreadRoundRobin:
		return c, fmt.Errorf("%w: spread %q (want %s or %s)", ErrInvalidConfig, c.Spread, SpreadRandom, SpreadRoundRobin)
	case !slices.Contains(SyncModes, c.Sync):
		return c, fmt.Errorf("%w: sync %q (want %s)", ErrInvalidConfig, c.Sync, strings.Join(SyncModes, ", "))
	case c.SyncDelay < 0:
		return c, fmt.Errorf("%w: sync delay %v", ErrInvalidConfig, c.SyncDelay)
	case c.ScrapePeriod < 0:
		return c, fmt.Errorf("%w: scrape period %v", ErrInvalidConfig, c.ScrapePeriod)
	case c.BurstPeriod < 0 || (c.BurstPeriod > 0 && !(c.BurstDuty > 0 && c.BurstDuty <= 1)) || (c.BurstPeriod == 0 && c.BurstDuty != 0):
		return c, fmt.Errorf("%w: burst period %v with duty %v (want a period > 0 and a duty in (0, 1], or neither)",
			ErrInvalidConfig, c.BurstPeriod, c.BurstDuty)
	}
	return c, nil
}

func (c Config) capacityBlocks() int { return c.CapacityTokens / c.BlockSize }

// TimeScale returns the factor the workload's arrival times are multiplied by so that its offered
// load is c.Utilisation of the fleet's capacity (1 when Utilisation is negative or the workload
// has no span). A request's demand is what it would cost with no cache hit: P = prefill(n, 0) of
// the engine's compute (unless ParallelPrefill), its service time S = P + decode(k) on one of the
// engine's MaxConcurrent slots, and S × its blocks (prompt plus completion) of the engine's KV
// cache, which admission reserves for its whole run. The offered load is the largest of the
// three resources' demand per second over the fleet's supply (Engines compute, Engines ×
// MaxConcurrent slots, Engines × capacity blocks). Scaling by one factor keeps the shape of the
// arrivals: a burst stays a burst, requests with equal timestamps stay simultaneous, only the
// gaps stretch or shrink.
func TimeScale(w *Workload, c Config) (float64, error) {
	c, err := c.withDefaults()
	if err != nil {
		return 0, err
	}
	span := w.Span()
	if c.Utilisation < 0 || span <= 0 {
		return 1, nil
	}
	var computeSec, slotSec, blockSec float64
	for i := range w.Requests {
		r := &w.Requests[i]
		n := r.InputTokens()
		p := c.Latency.Prefill(n, 0, 0).Seconds()
		s := p + c.Latency.Decode(r.OutputTokens).Seconds()
		computeSec += p
		slotSec += s
		blockSec += s * float64((n+r.OutputTokens+c.BlockSize-1)/c.BlockSize)
	}
	need := max(slotSec/float64(c.Engines*c.MaxConcurrent), blockSec/float64(c.Engines*c.capacityBlocks()))
	if !c.ParallelPrefill {
		need = max(need, computeSec/float64(c.Engines))
	}
	return need / c.Utilisation / span.Seconds(), nil
}

// Result is what one policy did on one workload and fleet. Times are in seconds.
type Result struct {
	Workload       string  `json:"workload"`
	Policy         string  `json:"policy"`
	Seed           uint64  `json:"seed"`
	Engines        int     `json:"engines"`
	CapacityTokens int     `json:"capacity_tokens"`
	Utilisation    float64 `json:"utilisation"`
	EventLagSec    float64 `json:"event_lag_s"`
	TimeScale      float64 `json:"time_scale"`
	// Replicas and Sync are Config's; SyncDelaySec is Config.SyncDelay when peers sync (else 0),
	// ScrapePeriodSec Config.ScrapePeriod when metrics sync (else 0), Spread Config.Spread with
	// more than one replica (else ""). RouterInstances is how many router instances ran: Replicas
	// for a policy with router state, 1 for random, 0 for the oracles.
	Replicas        int     `json:"replicas"`
	Sync            string  `json:"sync"`
	SyncDelaySec    float64 `json:"sync_delay_s"`
	ScrapePeriodSec float64 `json:"scrape_period_s"`
	Spread          string  `json:"spread"`
	RouterInstances int     `json:"router_instances"`

	Requests     int   `json:"requests"`
	Rejected     int   `json:"rejected"`
	PromptTokens int64 `json:"prompt_tokens"`
	CachedTokens int64 `json:"cached_tokens"`
	OutputTokens int64 `json:"output_tokens"`
	// HitRatio is CachedTokens / PromptTokens over the admitted requests.
	HitRatio float64 `json:"hit_ratio"`
	// ReachableTokens counts, for each admitted request, the prompt tokens cached on the engine
	// that held the most of its prompt when it arrived; Reachable is their share of
	// PromptTokens: the hit ratio had every request gone to that engine, on the caches this
	// policy's own routing built. Its distance to HitRatio is what routing turned away (for load,
	// or because the index did not know); its distance to the global LRU's is what the caches'
	// contents cost (duplicates, flushes by long prompts).
	ReachableTokens int64   `json:"reachable_tokens"`
	Reachable       float64 `json:"reachable_hit_ratio"`
	// PerEngine counts the requests routed to each engine; LoadMaxMean is its max over its mean
	// (1 for the global-LRU oracle, whose one pooled engine spreads load ideally; 0 for the
	// infinite-cache oracle, which has no engines).
	PerEngine   []int   `json:"per_engine"`
	LoadMaxMean float64 `json:"load_max_mean"`
	TTFTP50     float64 `json:"ttft_p50_s"`
	TTFTP90     float64 `json:"ttft_p90_s"`
	TTFTP99     float64 `json:"ttft_p99_s"`
	TTFTMean    float64 `json:"ttft_mean_s"`
	QueueMean   float64 `json:"queue_mean_s"`
	// Throughput is output tokens per second of makespan (first arrival to last finish); 0 for
	// the infinite-cache oracle.
	Throughput  float64 `json:"throughput_tok_s"`
	MakespanSec float64 `json:"makespan_s"`
	// KVAware is the fraction of decisions taken by tier 4 (kv_aware or imbalance).
	KVAware float64 `json:"kv_aware"`
	WallSec float64 `json:"wall_s"`
	// Peers sums the replicas' kvroute.Stats.Peers at the end of the run (zero with one replica and
	// no sync).
	Peers PeerCounts `json:"peers"`
}

// PeerCounts are the replicas' kvroute.PeerStats counters (Stats.Peers), summed.
type PeerCounts struct {
	Applied       uint64 `json:"applied"`
	Ignored       uint64 `json:"ignored"`
	Expired       uint64 `json:"expired"`
	EngineReports uint64 `json:"engine_reports"`
	EngineStale   uint64 `json:"engine_stale"`
}

// Run replays w on a simulated fleet configured by cfg under policy (one of AllPolicies) and
// returns the measurements. It is deterministic: the same inputs give the same Result (WallSec
// aside). Errors wrap ErrInvalidConfig for a bad configuration or policy name.
func Run(w *Workload, cfg Config, policy string) (Result, error) {
	res, _, err := run(w, cfg, policy, false)
	return res, err
}

// RunRecords is Run that also returns what happened to each request, in the workload's order
// (Dissect compares two policies' records). The infinite-cache oracle has no engines and no
// records.
func RunRecords(w *Workload, cfg Config, policy string) (Result, []RequestRecord, error) {
	return run(w, cfg, policy, true)
}

func run(w *Workload, cfg Config, policy string, record bool) (Result, []RequestRecord, error) {
	wall := time.Now()
	cfg, err := cfg.withDefaults()
	if err != nil {
		return Result{}, nil, err
	}
	scale, err := TimeScale(w, cfg)
	if err != nil {
		return Result{}, nil, err
	}
	res := Result{Workload: w.Name + cfg.burstName(), Policy: policy, Seed: cfg.Seed, Engines: cfg.Engines, CapacityTokens: cfg.CapacityTokens,
		Utilisation: cfg.Utilisation, EventLagSec: cfg.EventLag.Seconds(), TimeScale: scale, Replicas: cfg.Replicas,
		Sync: cfg.Sync}
	if cfg.peerSync() {
		res.SyncDelaySec = cfg.SyncDelay.Seconds()
	}
	if cfg.metricsSync() {
		res.ScrapePeriodSec = cfg.ScrapePeriod.Seconds()
	}
	if cfg.Replicas > 1 {
		res.Spread = cfg.Spread
	}
	switch policy {
	case OracleInfinite, OracleGlobalLRU:
	case PolicyRandom:
		res.RouterInstances = 1
	default:
		res.RouterInstances = cfg.Replicas
	}
	var recs []RequestRecord
	if policy == OracleInfinite {
		infinite(w, cfg, &res)
	} else {
		s, err := newSim(w, cfg, policy, scale)
		if err != nil {
			return Result{}, nil, err
		}
		s.record = record
		defer s.pol.close()
		if err := s.run(); err != nil {
			return Result{}, nil, err
		}
		s.result(&res)
		if record {
			recs = s.records()
		}
	}
	res.WallSec = time.Since(wall).Seconds()
	return res, recs, nil
}

// simEpoch is the virtual clock's origin: what the router, index and engines see as the time of
// the workload's first arrival.
var simEpoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// Event kinds of the simulation, in the order they are handled when their times are equal and
// they were scheduled together.
const (
	evArrive uint8 = iota
	evFirstToken
	evFinish
	evDeliver
	evPeer   // a replica's decision event reaches the other replicas
	evScrape // a replica reads the engines' load
)

type simEvent struct {
	at      time.Duration
	seq     uint64
	kind    uint8
	engine  int32
	req     int32
	replica int32
	batch   *events.Batch
	peer    *kvroute.PeerEvent
}

type eventHeap []simEvent

func (h eventHeap) Len() int { return len(h) }
func (h eventHeap) Less(i, j int) bool {
	if h[i].at != h[j].at {
		return h[i].at < h[j].at
	}
	return h[i].seq < h[j].seq
}
func (h eventHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *eventHeap) Push(x any)   { *h = append(*h, x.(simEvent)) }
func (h *eventHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// eventQueue is a simulation's virtual clock and its pending events, in time order (ties in the
// order they were scheduled). Not safe for concurrent use: one goroutine runs a simulation.
type eventQueue struct {
	now  time.Duration
	seq  uint64
	heap eventHeap
}

// clock is the virtual time as a time.Time, for the router's and the index's Now.
func (q *eventQueue) clock() time.Time { return simEpoch.Add(q.now) }

func (q *eventQueue) push(e simEvent) {
	e.seq = q.seq
	q.seq++
	heap.Push(&q.heap, e)
}

// next pops the earliest event and moves the clock to it; false when none is left.
func (q *eventQueue) next() (simEvent, bool) {
	if q.heap.Len() == 0 {
		return simEvent{}, false
	}
	e := heap.Pop(&q.heap).(simEvent)
	q.now = e.at
	return e, true
}

// reqState is one request's progress.
type reqState struct {
	arrival   time.Duration
	engine    int32
	holder    int32 // the engine holding the most of the prompt at arrival, -1 for none
	rejected  bool
	d         *kvroute.Decision
	tokens    []uint32
	cached    int
	reachable int // the most of the prompt any engine held at arrival, in tokens
	prompt    int
	queued    time.Duration
	prefill   time.Duration
	first     time.Duration
	finish    time.Duration
	// With sim.record: the chosen and the holder's prefill backlogs at arrival, and the least of
	// any engine (VirtualEngine.Backlog).
	backlog, holderBacklog, minBacklog time.Duration
	reason                             kvroute.Reason
	holderTop                          bool // the holder scored at least as well as the chosen engine
}

// sim is one replay: a single goroutine drains a heap of timestamped events.
type sim struct {
	w     *Workload
	cfg   Config
	scale float64
	eventQueue
	engines []*enginesim.VirtualEngine
	pol     router
	reps    *replicaSet // pol when it is a policy's replicas, else nil
	reqs    []reqState
	starts  []enginesim.VirtualStart
	left    int      // requests neither finished nor rejected: scrapes stop at 0
	names   []string // the engines' backend names
	record  bool
	backlog []time.Duration // with record: each engine's at the arrival being routed
}

func newSim(w *Workload, cfg Config, policy string, scale float64) (*sim, error) {
	s := &sim{w: w, cfg: cfg, scale: scale, reqs: make([]reqState, len(w.Requests)), left: len(w.Requests)}
	ecfg := enginesim.Config{Model: DefaultModel, BlockSize: cfg.BlockSize, CapacityBlocks: cfg.capacityBlocks(),
		MaxModelLen: math.MaxInt32, MaxConcurrent: cfg.MaxConcurrent, Latency: cfg.Latency, HashSeed: cfg.Seed | 1}
	n := cfg.Engines
	names := make([]string, n)
	for i := range names {
		names[i] = "engine-" + strconv.Itoa(i)
	}
	s.names = names
	opts := enginesim.VirtualOptions{PrefillUnits: 1}
	if cfg.ParallelPrefill {
		opts.PrefillUnits = 0
	}
	if policy == OracleGlobalLRU {
		// One engine with the whole fleet's cache, slots and compute: every block is reachable
		// from every request, and load is spread ideally.
		ecfg.CapacityBlocks *= n
		ecfg.MaxConcurrent *= n
		opts.PrefillUnits *= n
		n = 1
	}
	for i := range n {
		ecfg.Name = names[i]
		e, err := enginesim.NewVirtual(ecfg, opts)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
		}
		s.engines = append(s.engines, e)
	}
	env := policyEnv{names: names, now: s.clock, blockSize: cfg.BlockSize, capacityBlocks: cfg.capacityBlocks(),
		model: DefaultModel, seed: cfg.Seed}
	switch {
	case policy == OracleGlobalLRU:
		s.pol = &oneRouter{}
	case policy != PolicyRandom && (cfg.Replicas > 1 || cfg.Sync != SyncNone):
		reps, err := newReplicaSet(s, policy, env)
		if err != nil {
			return nil, err
		}
		s.pol, s.reps = reps, reps
	default:
		pol, err := newRouter(policy, env)
		if err != nil {
			return nil, err
		}
		s.pol = pol
	}
	s.heap = make(eventHeap, 0, len(w.Requests))
	var t0 time.Duration
	if len(w.Requests) > 0 {
		t0 = w.Requests[0].Arrival
	}
	for i := range w.Requests {
		at := cfg.burst(time.Duration(float64(w.Requests[i].Arrival-t0) * scale))
		s.reqs[i].arrival = at
		s.push(simEvent{at: at, kind: evArrive, req: int32(i)})
	}
	if s.reps != nil {
		s.reps.startScrapes()
	}
	return s, nil
}

func (s *sim) run() error {
	for {
		e, ok := s.next()
		if !ok {
			return nil
		}
		if err := s.handle(e); err != nil {
			return err
		}
	}
}

// handle handles e, the event just taken from the queue.
func (s *sim) handle(e simEvent) error {
	switch e.kind {
	case evArrive:
		return s.arrive(int(e.req))
	case evFirstToken:
		r := &s.reqs[e.req]
		r.d.FirstToken()
	case evFinish:
		r := &s.reqs[e.req]
		r.d.Done(kvroute.Outcome{Latency: max(r.finish-r.arrival, 1)})
		r.tokens = nil
		s.left--
		s.starts = s.engines[r.engine].Finish(s.clock(), uint64(e.req), s.starts[:0])
		s.started()
		s.flush(int(r.engine))
	case evDeliver:
		if err := s.pol.apply(int(e.engine), e.batch); err != nil {
			return fmt.Errorf("replay: applying events: %w", err)
		}
	case evPeer:
		s.reps.deliver(int(e.replica), e.peer)
	case evScrape:
		s.reps.scrape(int(e.replica))
	}
	return nil
}

func (s *sim) arrive(i int) error {
	wr := &s.w.Requests[i]
	r := &s.reqs[i]
	r.tokens = appendTokens(make([]uint32, 0, wr.InputTokens()), wr, s.cfg.Seed)
	r.prompt = len(r.tokens)
	req := &prefixkey.Request{Format: prefixkey.FormatOpenAIChat, Model: DefaultModel, System: anchorText(wr, s.cfg.Seed),
		HasSystem: len(wr.Segments) > 0, TokenIDs: r.tokens}
	// An engine computes at least the prompt's last token: what it reports cached stops a block
	// short of a prompt it holds whole.
	most := (r.prompt - 1) / s.cfg.BlockSize * s.cfg.BlockSize
	r.holder = -1
	for j, e := range s.engines {
		gpu, _ := e.Lookup(r.tokens)
		if held := min(gpu*s.cfg.BlockSize, most); held > r.reachable {
			r.reachable, r.holder = held, int32(j)
		}
	}
	if s.record {
		s.backlog = s.backlog[:0]
		for _, e := range s.engines {
			s.backlog = append(s.backlog, e.Backlog(s.clock()))
		}
		r.minBacklog = slices.Min(s.backlog)
		if r.holder >= 0 {
			r.holderBacklog = s.backlog[r.holder]
		}
	}
	eng, d, err := s.pol.route(req)
	if err != nil {
		return fmt.Errorf("replay: routing request %d: %w", i, err)
	}
	r.engine, r.d = int32(eng), d
	if s.record {
		r.backlog = s.backlog[eng]
		if d != nil {
			r.reason = d.Reason
			if r.holder >= 0 {
				r.holderTop = holderScoredTop(d, s.names[r.holder], s.names[eng])
			}
		}
	}
	s.starts, err = s.engines[eng].Submit(s.clock(), uint64(i), enginesim.Input{Tokens: r.tokens, OutputTokens: wr.OutputTokens}, s.starts[:0])
	if err != nil {
		if !errors.Is(err, enginesim.ErrTooLong) && !errors.Is(err, enginesim.ErrOverloaded) {
			return err
		}
		r.rejected = true
		r.tokens = nil
		s.left--
		d.Done(kvroute.Outcome{Err: err, Latency: 1})
		return nil
	}
	s.started()
	s.flush(eng)
	return nil
}

// holderScoredTop reports whether tier 4 scored the holder at least as well as the chosen backend;
// false when the decision has no scores for both.
func holderScoredTop(d *kvroute.Decision, holder, chosen string) bool {
	hs, cs, found := 0.0, 0.0, 0
	for _, o := range d.Overlaps {
		switch o.Backend {
		case holder:
			hs, found = o.Score, found+1
		case chosen:
			cs, found = o.Score, found+1
		}
	}
	return found == 2 && hs >= cs
}

// started schedules the first token and the finish of the requests in s.starts.
func (s *sim) started() {
	for _, st := range s.starts {
		r := &s.reqs[st.ID]
		r.cached = st.Result.CachedTokens
		r.queued = st.Result.Queued
		r.prefill = st.Result.Prefill
		r.first = st.FirstToken.Sub(simEpoch)
		r.finish = st.Finish.Sub(simEpoch)
		s.push(simEvent{at: r.first, kind: evFirstToken, req: int32(st.ID)})
		s.push(simEvent{at: r.finish, kind: evFinish, req: int32(st.ID)})
	}
}

// flush takes engine i's KV events of this step and schedules their delivery after the lag.
func (s *sim) flush(i int) {
	b, ok := s.engines[i].TakeBatch(s.clock())
	if !ok {
		return
	}
	s.push(simEvent{at: s.now + s.cfg.EventLag, kind: evDeliver, engine: int32(i), batch: &b})
}

func (s *sim) result(res *Result) {
	res.PerEngine = make([]int, len(s.engines))
	ttft := make([]float64, 0, len(s.reqs))
	var queued, ttftSum float64
	var last time.Duration
	for i := range s.reqs {
		r := &s.reqs[i]
		res.Requests++
		if r.rejected {
			res.Rejected++
			continue
		}
		res.PerEngine[r.engine]++
		res.PromptTokens += int64(r.prompt)
		res.CachedTokens += int64(r.cached)
		res.ReachableTokens += int64(r.reachable)
		res.OutputTokens += int64(s.w.Requests[i].OutputTokens)
		t := (r.first - r.arrival).Seconds()
		ttft = append(ttft, t)
		ttftSum += t
		queued += r.queued.Seconds()
		last = max(last, r.finish)
	}
	if res.PromptTokens > 0 {
		res.HitRatio = float64(res.CachedTokens) / float64(res.PromptTokens)
		res.Reachable = float64(res.ReachableTokens) / float64(res.PromptTokens)
	}
	res.LoadMaxMean = maxOverMean(res.PerEngine)
	if len(s.engines) == 1 && s.cfg.Engines > 1 { // the global-LRU oracle: spread ideally
		res.PerEngine = nil
		res.LoadMaxMean = 1
	}
	fillTTFT(res, ttft, ttftSum)
	if n := len(ttft); n > 0 {
		res.QueueMean = queued / float64(n)
	}
	var first time.Duration
	if len(s.reqs) > 0 {
		first = s.reqs[0].arrival
	}
	res.MakespanSec = (last - first).Seconds()
	if res.MakespanSec > 0 {
		res.Throughput = float64(res.OutputTokens) / res.MakespanSec
	}
	st := s.pol.stats()
	if st.decisions > 0 {
		res.KVAware = float64(st.kvAware) / float64(st.decisions)
	}
	if s.reps != nil {
		res.Peers = s.reps.peerCounts()
	}
}

func fillTTFT(res *Result, ttft []float64, sum float64) {
	if len(ttft) == 0 {
		return
	}
	slices.Sort(ttft)
	res.TTFTP50 = quantile(ttft, 0.50)
	res.TTFTP90 = quantile(ttft, 0.90)
	res.TTFTP99 = quantile(ttft, 0.99)
	res.TTFTMean = sum / float64(len(ttft))
}

// quantile returns the q-quantile of sorted xs by the nearest-rank method.
func quantile(xs []float64, q float64) float64 {
	i := int(math.Ceil(q*float64(len(xs)))) - 1
	return xs[min(max(i, 0), len(xs)-1)]
}

func maxOverMean(xs []int) float64 {
	if len(xs) == 0 {
		return 0
	}
	sum, hi := 0, 0
	for _, x := range xs {
		sum += x
		hi = max(hi, x)
	}
	if sum == 0 {
		return 0
	}
	return float64(hi) * float64(len(xs)) / float64(sum)
}

// oneRouter sends everything to engine 0 (the global-LRU oracle's single pooled engine).
type oneRouter struct{ n uint64 }

func (o *oneRouter) route(*prefixkey.Request) (int, *kvroute.Decision, error) {
	o.n++
	return 0, nil, nil
}
func (o *oneRouter) apply(int, *events.Batch) error { return nil }
func (o *oneRouter) stats() routerStats             { return routerStats{decisions: o.n} }
func (o *oneRouter) close()                         {}
