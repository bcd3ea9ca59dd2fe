package replay

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/internal/enginesim"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

// PolicyPD routes a prefill/decode-disaggregated fleet with kvroute's DisaggRouter: the kvroute
// policy's setup (tier 1, tier 4 with an index fed by the engines' KV events, every default)
// plus Config.Disagg at its defaults with the fleet's shared storage as DefaultStorage. It runs
// with RunPD on a PDConfig fleet, not with Run.
const PolicyPD = "pd"

// Defaults of PDConfig: 2 prefill and 6 decode engines, and internal/enginesim's storage model
// (128 KiB of KV per token, Llama-3.1-8B in bf16; 10 GB/s per transfer).
const (
	DefaultPrefillEngines   = 2
	DefaultDecodeEngines    = 6
	DefaultBytesPerToken    = enginesim.DefaultBytesPerToken
	DefaultStorageBandwidth = enginesim.DefaultStorageBandwidth
)

// pdStorageEndpoint names the storage every engine of a P/D fleet shares. Without a location the
// planner cannot tell that a decode engine reads what a prefill engine left in storage (it then
// never takes the storage path).
const pdStorageEndpoint = "http://replay-kv-store"

// PDConfig is a prefill/decode fleet: Prefill engines compute prompts and write their KV blocks to
// shared storage, Decode engines read the blocks they lack and generate the tokens. The zero
// value of a field means its default.
type PDConfig struct {
	Prefill int // prefill engines (DefaultPrefillEngines)
	Decode  int // decode engines (DefaultDecodeEngines)
	// BytesPerToken is a token's KV size, BandwidthBytesPerSec the bandwidth of each transfer
	// between an engine and storage (DefaultBytesPerToken, DefaultStorageBandwidth).
	BytesPerToken        int64
	BandwidthBytesPerSec float64
	// Speculation is tier 4's speculation mode (kvroute.KVConfig.Speculation; the zero value is
	// kvroute's default, short speculation). For a remote prefill, DisaggRouter.Route speculates for the
	// prefill and decode engines when the prefill is done (PrefillDone), not when it routes.
	Speculation kvroute.Speculation
	// Disagg is the router's disaggregation configuration; its zero value is disagg's defaults.
	// A zero DefaultStorage is replaced by the fleet's shared storage location.
	Disagg disagg.Config
}

func (p PDConfig) withDefaults() (PDConfig, error) {
	if p.Prefill == 0 {
		p.Prefill = DefaultPrefillEngines
	}
	if p.Decode == 0 {
		p.Decode = DefaultDecodeEngines
	}
	if p.BytesPerToken == 0 {
		p.BytesPerToken = DefaultBytesPerToken
	}
	if p.BandwidthBytesPerSec == 0 {
		p.BandwidthBytesPerSec = DefaultStorageBandwidth
	}
	if p.Disagg.DefaultStorage.IsZero() {
		p.Disagg.DefaultStorage = disagg.ExternalStorage{Endpoint: pdStorageEndpoint, Namespace: enginesim.DefaultKVNamespace}
	}
	switch {
	case p.Prefill < 1 || p.Decode < 1 || p.Prefill+p.Decode > 64:
		return p, fmt.Errorf("%w: P/D fleet %d:%d (want ≥ 1 of each, ≤ 64 in all)", ErrInvalidConfig, p.Prefill, p.Decode)
	case p.BytesPerToken < 0:
		return p, fmt.Errorf("%w: bytes per token %d", ErrInvalidConfig, p.BytesPerToken)
	case !(p.BandwidthBytesPerSec > 0) || math.IsInf(p.BandwidthBytesPerSec, 1):
		return p, fmt.Errorf("%w: storage bandwidth %v", ErrInvalidConfig, p.BandwidthBytesPerSec)
	}
	return p, nil
}

// Fleet returns "P:D".
func (p PDConfig) Fleet() string { return strconv.Itoa(p.Prefill) + ":" + strconv.Itoa(p.Decode) }

// policy returns the results' policy name: "pd-P:D", with "/spec-off" when speculation is off.
func (p PDConfig) policy() string {
	n := PolicyPD + "-" + p.Fleet()
	if p.Speculation == kvroute.SpeculationOff {
		n += "/spec-off"
	}
	return n
}

// ParsePD parses a comma-separated list of P/D fleets, each "P:D" (prefill:decode engines).
func ParsePD(s string) ([]PDConfig, error) {
	var out []PDConfig
	for _, f := range strings.Split(s, ",") {
		a, b, ok := strings.Cut(strings.TrimSpace(f), ":")
		p, err1 := strconv.Atoi(a)
		d, err2 := strconv.Atoi(b)
		if !ok || err1 != nil || err2 != nil || p < 1 || d < 1 {
			return nil, fmt.Errorf("%w: P/D fleet %q: want prefill:decode, e.g. 2:6", ErrInvalidConfig, f)
		}
		out = append(out, PDConfig{Prefill: p, Decode: d})
	}
	return out, nil
}

// PDResult is a Result with what disaggregation adds. For a P/D fleet, Policy is "pd-P:D", Engines
// is P+D, PerEngine counts the phases each engine ran (prefill engines first), LoadMaxMean is
// over the decode engines, and the hit ratio counts, per request, the prompt tokens the engine
// that computed the prompt did not compute: the prefill engine's prefix-cache hit for
// prefill_then_decode, the decode engine's hit (own cache plus blocks read from storage) for
// fast_decode. TTFT is arrival to the decode engine's first token. KVAware is the share of
// requests whose plan found a cached prefix (ExpectedCachedTokens > 0). For the unified baseline
// (UnifiedPDResult) every request counts as path unified.
type PDResult struct {
	Result
	Fleet          string `json:"fleet"`
	PrefillEngines int    `json:"prefill_engines"`
	DecodeEngines  int    `json:"decode_engines"`
	// Paths and Reasons count the requests by routing path and reason (disagg's labels).
	Paths   map[string]int `json:"paths"`
	Reasons map[string]int `json:"reasons"`
	// WriteMean and ReadMean are the mean storage write (prefill engine) and read (decode engine)
	// times over the prefill_then_decode requests, in seconds; StorageReadTokens the tokens decode
	// engines read from storage, on any path.
	WriteMean         float64 `json:"storage_write_mean_s"`
	ReadMean          float64 `json:"storage_read_mean_s"`
	StorageReadTokens int64   `json:"storage_read_tokens"`
	BytesWritten      int64   `json:"storage_bytes_written"`
	BytesRead         int64   `json:"storage_bytes_read"`
	// DecodeComputedMax is the most prompt tokens a decode engine computed for one request;
	// DecodeOverThreshold counts the requests for which a decode engine computed an uncached part
	// longer than conditional disaggregation allows (the index promised more than the engine
	// held: events in flight, speculation, eviction).
	DecodeComputedMax   int `json:"decode_computed_max"`
	DecodeOverThreshold int `json:"decode_over_threshold"`
	// InFlightMax is the most phases the router counted in flight at an arrival; InFlightEnd what
	// it counts when the replay is over (0 when every slot was released).
	InFlightMax int `json:"in_flight_max"`
	InFlightEnd int `json:"in_flight_end"`
	// Engines' own counters: requests finished and output tokens generated, per engine.
	EngineRequests []uint64 `json:"engine_requests"`
	EngineOutput   []uint64 `json:"engine_output_tokens"`
}

// UnifiedPDResult presents a unified fleet's Result (from Run) as a PDResult: every admitted
// request on path unified.
func UnifiedPDResult(r Result) PDResult {
	n := r.Requests - r.Rejected
	return PDResult{Result: r, Fleet: strconv.Itoa(r.Engines) + " unified", Paths: map[string]int{disagg.PathUnified.String(): n},
		Reasons: map[string]int{}}
}

// RunPD replays w on the P/D fleet pd under PolicyPD. cfg configures the engines as for Run
// (capacity, block size, slots, latency, compute, event lag, seed); its Engines is replaced by
// pd's total, and the arrivals are scaled by TimeScale of that total, so that a unified fleet of
// as many engines (Run with Config.Engines = P+D) sees the same arrival times. Deterministic for
// its inputs (WallSec aside). Errors wrap ErrInvalidConfig for a bad configuration.
func RunPD(w *Workload, cfg Config, pd PDConfig) (PDResult, error) {
	wall := time.Now()
	s, err := newPDSim(w, cfg, pd)
	if err != nil {
		return PDResult{}, err
	}
	defer s.close()
	if err := s.run(); err != nil {
		return PDResult{}, err
	}
	res := s.result()
	res.WallSec = time.Since(wall).Seconds()
	return res, nil
}

// Event kinds of the P/D simulation.
const (
	pdArrive uint8 = iota
	pdPrefillFirst
	pdPrefillEnd
	pdFirst
	pdFinish
	pdDeliver
)

// pdReq is one request's progress through its phases.
type pdReq struct {
	arrival  time.Duration
	d        *kvroute.DisaggDecision
	prefill  int32 // -1 without a prefill phase
	decode   int32
	tokens   []uint32
	prompt   int
	rejected bool
	cached   int // tokens the engine computing the prompt reused
	loaded   int // tokens the decode engine read from storage
	computed int // prompt tokens the decode engine computed
	write    time.Duration
	read     time.Duration
	first    time.Duration
	finish   time.Duration
}

// pdSim is one P/D replay: a single goroutine drains a heap of timestamped events.
type pdSim struct {
	w     *Workload
	cfg   Config
	pd    PDConfig
	scale float64
	eventQueue
	engines []*enginesim.VirtualEngine
	store   *enginesim.VirtualStorage
	names   []string
	byN     map[string]int
	r       *kvroute.DefaultRouter
	ix      *kvindex.MemoryIndex
	dcfg    disagg.Config
	ctx     context.Context
	reqs    []pdReq
	starts  []enginesim.VirtualStart
	inMax   int
}

func newPDSim(w *Workload, cfg Config, pd PDConfig) (*pdSim, error) {
	pd, err := pd.withDefaults()
	if err != nil {
		return nil, err
	}
	cfg.Engines = pd.Prefill + pd.Decode
	cfg, err = cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	scale, err := TimeScale(w, cfg)
	if err != nil {
		return nil, err
	}
	s := &pdSim{w: w, cfg: cfg, pd: pd, scale: scale, reqs: make([]pdReq, len(w.Requests)), byN: map[string]int{},
		ctx: context.Background()}
	if s.store, err = enginesim.NewVirtualStorage(DefaultModel, cfg.BlockSize, pd.BytesPerToken, pd.BandwidthBytesPerSec); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	ecfg := enginesim.Config{Model: DefaultModel, BlockSize: cfg.BlockSize, CapacityBlocks: cfg.capacityBlocks(),
		MaxModelLen: math.MaxInt32, MaxConcurrent: cfg.MaxConcurrent, Latency: cfg.Latency, HashSeed: cfg.Seed | 1}
	opts := enginesim.VirtualOptions{PrefillUnits: 1}
	if cfg.ParallelPrefill {
		opts.PrefillUnits = 0
	}
	backends := make([]kvroute.Backend, 0, cfg.Engines)
	for i := range cfg.Engines {
		name, role := "prefill-"+strconv.Itoa(i), disagg.RolePrefill
		if i >= pd.Prefill {
			name, role = "decode-"+strconv.Itoa(i-pd.Prefill), disagg.RoleDecode
		}
		ecfg.Name, ecfg.Role = name, role
		e, err := enginesim.NewVirtual(ecfg, opts)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
		}
		s.engines = append(s.engines, e)
		s.names = append(s.names, name)
		s.byN[name] = i
		backends = append(backends, kvroute.Backend{Name: name, Role: role})
	}
	if s.ix, err = kvindex.NewMemory(kvindex.MemoryConfig{BlockSize: cfg.BlockSize, DefaultModel: DefaultModel,
		SweepInterval: -1, Now: s.clock}); err != nil {
		return nil, err
	}
	dcfg := pd.Disagg
	rcfg := kvroute.Config{Strategy: kvroute.StrategyLeastLoaded, Backends: backends, Now: s.clock,
		KV: &kvroute.KVConfig{Index: s.ix, BlockSize: cfg.BlockSize, Speculation: pd.Speculation}, Disagg: &dcfg}
	if s.r, err = kvroute.New(rcfg); err != nil {
		_ = s.ix.Close()
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	s.dcfg, _ = s.r.Disagg().Config()
	s.heap = make(eventHeap, 0, len(w.Requests))
	var t0 time.Duration
	if len(w.Requests) > 0 {
		t0 = w.Requests[0].Arrival
	}
	for i := range w.Requests {
		at := cfg.burst(time.Duration(float64(w.Requests[i].Arrival-t0) * scale))
		s.reqs[i] = pdReq{arrival: at, prefill: -1, decode: -1}
		s.push(simEvent{at: at, kind: pdArrive, req: int32(i)})
	}
	return s, nil
}

func (s *pdSim) close() {
	_ = s.r.Close()
	_ = s.ix.Close()
}

func (s *pdSim) run() error {
	for {
		e, ok := s.next()
		if !ok {
			return nil
		}
		i := int(e.req)
		var err error
		switch e.kind {
		case pdArrive:
			err = s.arrive(i)
		case pdPrefillFirst:
			s.prefillFirst(i)
		case pdPrefillEnd:
			err = s.prefillEnd(i)
		case pdFirst:
			s.reqs[i].d.FirstToken()
		case pdFinish:
			s.finish(i)
		case pdDeliver:
			if err = s.ix.Apply(s.ctx, s.names[e.engine], e.batch); err != nil {
				err = fmt.Errorf("replay: applying events: %w", err)
			}
		}
		if err != nil {
			return err
		}
	}
}

// inFlight returns the phases the router counts in flight (prefills and decodes on the pools' backends).
func (s *pdSim) inFlight() int {
	st := routerCounts(s.r)
	n := 0
	for _, b := range st.Backends {
		if b.Role != disagg.RoleUnified {
			n += b.InFlight
		}
	}
	return n
}

func (s *pdSim) arrive(i int) error {
	wr := &s.w.Requests[i]
	r := &s.reqs[i]
	r.tokens = appendTokens(make([]uint32, 0, wr.InputTokens()), wr, s.cfg.Seed)
	r.prompt = len(r.tokens)
	req := &prefixkey.Request{Format: prefixkey.FormatOpenAIChat, Model: DefaultModel, System: anchorText(wr, s.cfg.Seed),
		HasSystem: len(wr.Segments) > 0, TokenIDs: r.tokens}
	d, err := s.r.Disagg().Route(s.ctx, req)
	if err != nil {
		return fmt.Errorf("replay: routing request %d: %w", i, err)
	}
	r.d = d
	s.inMax = max(s.inMax, s.inFlight())
	r.decode = int32(s.engine(d.Plan.Decode))
	if d.Plan.Path != disagg.PathPrefillThenDecode {
		return s.submitDecode(i)
	}
	p := s.engine(d.Plan.Prefill)
	r.prefill = int32(p)
	// The prefill phase is the request with max_tokens 1, as a gateway sends it.
	s.starts, err = s.engines[p].Submit(s.clock(), uint64(i), enginesim.Input{Tokens: r.tokens, OutputTokens: 1}, s.starts[:0])
	if err != nil {
		return s.reject(i, err)
	}
	s.prefillStarted()
	s.flush(p)
	return nil
}

// engine returns the index of a backend the router named (the router knows no other).
func (s *pdSim) engine(name string) int { return s.byN[name] }

func (s *pdSim) reject(i int, err error) error {
	if !errors.Is(err, enginesim.ErrTooLong) && !errors.Is(err, enginesim.ErrOverloaded) {
		return err
	}
	r := &s.reqs[i]
	r.rejected, r.tokens = true, nil
	r.d.Done(kvroute.Outcome{Err: err, Latency: 1})
	return nil
}

// prefillStarted schedules the end of the prefills in s.starts (their first token).
func (s *pdSim) prefillStarted() {
	for _, st := range s.starts {
		s.reqs[st.ID].cached = st.Result.CachedTokens
		s.push(simEvent{at: st.FirstToken.Sub(simEpoch), kind: pdPrefillFirst, req: int32(st.ID)})
	}
}

// prefillFirst: the prefill engine has computed the prompt; it writes the KV blocks to storage,
// then generates its one token, and answers.
func (s *pdSim) prefillFirst(i int) {
	r := &s.reqs[i]
	t := s.store.Write(s.engines[r.prefill], r.tokens)
	r.write = t.Time
	s.flush(int(r.prefill))
	s.push(simEvent{at: s.now + t.Time + s.cfg.Latency.Decode(1), kind: pdPrefillEnd, req: int32(i)})
}

// prefillEnd: the prefill answered; its slot and blocks are freed and the decode phase begins.
func (s *pdSim) prefillEnd(i int) error {
	r := &s.reqs[i]
	p := int(r.prefill)
	r.d.PrefillDone(kvroute.Outcome{Latency: max(s.now-r.arrival, 1)})
	s.starts = s.engines[p].Finish(s.clock(), uint64(i), s.starts[:0])
	s.prefillStarted()
	s.flush(p)
	return s.submitDecode(i)
}

func (s *pdSim) submitDecode(i int) error {
	r := &s.reqs[i]
	e := int(r.decode)
	in := enginesim.Input{Tokens: r.tokens, OutputTokens: s.w.Requests[i].OutputTokens}
	var t enginesim.VirtualTransfer
	var err error
	s.starts, t, err = s.store.Submit(s.engines[e], s.clock(), uint64(i), in, s.starts[:0])
	if err != nil {
		return s.reject(i, err)
	}
	r.read, r.loaded = t.Time, t.Blocks*s.cfg.BlockSize
	s.decodeStarted()
	s.flush(e)
	return nil
}

// decodeStarted schedules the first token and the finish of the decodes in s.starts.
func (s *pdSim) decodeStarted() {
	for _, st := range s.starts {
		r := &s.reqs[st.ID]
		r.computed = st.Result.PromptTokens - st.Result.CachedTokens
		if r.prefill < 0 {
			r.cached = st.Result.CachedTokens
		}
		r.first = st.FirstToken.Sub(simEpoch)
		r.finish = st.Finish.Sub(simEpoch)
		s.push(simEvent{at: r.first, kind: pdFirst, req: int32(st.ID)})
		s.push(simEvent{at: r.finish, kind: pdFinish, req: int32(st.ID)})
	}
}

func (s *pdSim) finish(i int) {
	r := &s.reqs[i]
	r.d.Done(kvroute.Outcome{Latency: max(r.finish-r.arrival, 1)})
	r.tokens = nil
	e := int(r.decode)
	s.starts = s.store.Finish(s.engines[e], s.clock(), uint64(i), s.starts[:0])
	s.decodeStarted()
	s.flush(e)
}

// flush takes engine i's KV events of this step and schedules their delivery after the lag.
func (s *pdSim) flush(i int) {
	b, ok := s.engines[i].TakeEvents(s.clock())
	if !ok {
		return
	}
	s.push(simEvent{at: s.now + s.cfg.EventLag, kind: pdDeliver, engine: int32(i), batch: &b})
}

// overThreshold reports whether a decode engine's computing u of an n-token prompt exceeds what
// conditional disaggregation lets it compute.
func (s *pdSim) overThreshold(u, n int) bool {
	c := s.dcfg
	if c.DisableConditional {
		return false
	}
	short := (c.MaxUncachedTokens >= 0 && u <= c.MaxUncachedTokens) || (c.MaxUncachedRatio >= 0 && float64(u) <= c.MaxUncachedRatio*float64(n))
	return !short
}

func (s *pdSim) result() PDResult {
	cfg, pd := s.cfg, s.pd
	res := PDResult{Result: Result{Workload: s.w.Name + cfg.burstName(), Policy: pd.policy(), Seed: cfg.Seed, Engines: cfg.Engines,
		CapacityTokens: cfg.CapacityTokens, Utilisation: cfg.Utilisation, EventLagSec: cfg.EventLag.Seconds(), TimeScale: s.scale},
		Fleet: pd.Fleet(), PrefillEngines: pd.Prefill, DecodeEngines: pd.Decode, Paths: map[string]int{}, Reasons: map[string]int{}}
	res.PerEngine = make([]int, len(s.engines))
	ttft := make([]float64, 0, len(s.reqs))
	var ttftSum, writes, reads float64
	var last time.Duration
	pt, expected := 0, 0
	for i := range s.reqs {
		r := &s.reqs[i]
		res.Requests++
		if r.d != nil {
			res.Paths[r.d.Plan.Path.String()]++
			res.Reasons[r.d.Plan.Reason.String()]++
			if r.d.Plan.ExpectedCachedTokens > 0 {
				expected++
			}
		}
		if r.rejected {
			res.Rejected++
			continue
		}
		if r.prefill >= 0 {
			res.PerEngine[r.prefill]++
			pt++
			writes += r.write.Seconds()
			reads += r.read.Seconds()
		}
		res.PerEngine[r.decode]++
		res.PromptTokens += int64(r.prompt)
		res.CachedTokens += int64(r.cached)
		res.OutputTokens += int64(s.w.Requests[i].OutputTokens)
		res.StorageReadTokens += int64(r.loaded)
		res.DecodeComputedMax = max(res.DecodeComputedMax, r.computed)
		if s.overThreshold(r.computed, r.prompt) {
			res.DecodeOverThreshold++
		}
		t := (r.first - r.arrival).Seconds()
		ttft = append(ttft, t)
		ttftSum += t
		last = max(last, r.finish)
	}
	if res.PromptTokens > 0 {
		res.HitRatio = float64(res.CachedTokens) / float64(res.PromptTokens)
	}
	if pt > 0 {
		res.WriteMean, res.ReadMean = writes/float64(pt), reads/float64(pt)
	}
	if n := res.Requests - res.Rejected; n > 0 {
		res.KVAware = float64(expected) / float64(res.Requests)
	}
	res.LoadMaxMean = maxOverMean(res.PerEngine[pd.Prefill:])
	fillTTFT(&res.Result, ttft, ttftSum)
	var first time.Duration
	if len(s.reqs) > 0 {
		first = s.reqs[0].arrival
	}
	res.MakespanSec = (last - first).Seconds()
	if res.MakespanSec > 0 {
		res.Throughput = float64(res.OutputTokens) / res.MakespanSec
	}
	st := s.store.Stats()
	res.BytesWritten, res.BytesRead = st.BytesWritten, st.BytesRead
	for _, e := range s.engines {
		es := e.Stats()
		res.EngineRequests = append(res.EngineRequests, es.Requests)
		res.EngineOutput = append(res.EngineOutput, es.OutputTokens)
	}
	res.InFlightMax, res.InFlightEnd = s.inMax, s.inFlight()
	return res
}
