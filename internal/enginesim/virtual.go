package enginesim

import (
	"fmt"
	"time"

	"github.com/kvroute/kvroute/events"
)

// VirtualEngine is the Engine's cache and scheduler driven by a caller's virtual clock instead of
// goroutines and sleeps: the same paged block cache with prefix caching and LRU eviction, the same
// FIFO admission under MaxConcurrent and free blocks, the same latency model, and the KV events the
// Engine would publish, handed over as events.Batch values. It is for discrete-event simulations
// (the replay harness): the caller submits requests at virtual times, schedules each started
// request's first token and finish at the times VirtualStart gives, and calls Finish when a finish
// time comes.
//
// Only Config's cache, scheduler and latency fields are used (Name, Model, BlockSize,
// CapacityBlocks, CPUCapacityBlocks, MaxModelLen, MaxConcurrent, MaxQueue, Latency, HashSeed);
// SpeedFactor is ignored, nothing sleeps, and no goroutine or socket is started.
//
// With VirtualOptions.PrefillUnits the engine also models the GPU's compute: at most that many
// prefills run at once (1: one at a time), first come first served, each for its latency-model
// duration, while decodes of admitted requests overlap freely. The Engine's own model, and the
// zero VirtualOptions, run every admitted request's prefill at once, as if compute were unlimited.
//
// A VirtualEngine is not safe for concurrent use: a simulation drives it from one goroutine. Its
// methods must be called with non-decreasing times.
type VirtualEngine struct {
	cfg     Config
	opts    VirtualOptions
	units   []time.Time // PrefillUnits: when each unit's prefill under way ends
	cache   *blockCache
	queue   []*virtualWaiter
	running map[uint64]virtualRun
	seq     uint64
	stats   Stats
}

// virtualRun is a running request.
type virtualRun struct {
	lease     *lease
	outTokens int
}

// virtualWaiter is a queued request.
type virtualWaiter struct {
	id   uint64
	in   Input
	plan plan
	enq  time.Time
}

// VirtualOptions are a VirtualEngine's settings beyond Config.
type VirtualOptions struct {
	// PrefillUnits is the most prefills computed at once (1 models a compute-bound GPU); 0 means
	// no limit. See VirtualEngine.
	PrefillUnits int
}

// VirtualStart is a request the engine admitted: when it was admitted (its blocks allocated and
// its prefix-cache hit counted), when its prefill started, when its first and last tokens come,
// and what the engine did. Result.Queued is PrefillStart minus the submission time: the wait for
// admission plus, with PrefillUnits, the wait for the compute.
type VirtualStart struct {
	ID           uint64
	Start        time.Time
	PrefillStart time.Time
	FirstToken   time.Time
	Finish       time.Time
	Result       Result
}

// NewVirtual validates cfg as New does (errors wrap ErrInvalidConfig) and returns a virtual
// engine with an empty cache. A zero HashSeed is replaced by a fixed one, so that a simulation is
// reproducible.
func NewVirtual(cfg Config, opts VirtualOptions) (*VirtualEngine, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if cfg.HashSeed == 0 {
		cfg.HashSeed = 0x6b76726f757465 // "kvroute"
	}
	if opts.PrefillUnits < 0 {
		return nil, fmt.Errorf("%w: PrefillUnits %d", ErrInvalidConfig, opts.PrefillUnits)
	}
	v := &VirtualEngine{cfg: cfg, opts: opts, running: make(map[uint64]virtualRun), units: make([]time.Time, opts.PrefillUnits)}
	v.cache = newBlockCache(cfg.BlockSize, cfg.CapacityBlocks, cfg.CPUCapacityBlocks, cfg.HashSeed)
	v.stats.Name = cfg.Name
	return v, nil
}

// Config returns the configuration with defaults applied.
func (v *VirtualEngine) Config() Config { return v.cfg }

// Submit hands a request to the engine at virtual time now. id names the request in the returned
// VirtualStart and in Finish; it must be unique among the engine's unfinished requests. When the
// request can start at once it is appended to dst; otherwise it waits in the queue and a later
// Finish starts it. The error wraps ErrTooLong for a request longer than MaxModelLen or the whole
// cache, and is ErrOverloaded when the queue is full; the request is then not admitted and dst is
// returned unchanged.
func (v *VirtualEngine) Submit(now time.Time, id uint64, in Input, dst []VirtualStart) ([]VirtualStart, error) {
	if n := len(in.Tokens) + in.OutputTokens; n > v.cfg.MaxModelLen {
		v.stats.Rejected++
		return dst, fmt.Errorf("%w: %d tokens, the maximum context length is %d", ErrTooLong, n, v.cfg.MaxModelLen)
	}
	p := v.cache.makePlan(in.Tokens, in.OutputTokens)
	if p.total > v.cache.capacity {
		v.stats.Rejected++
		return dst, fmt.Errorf("%w: %d blocks needed, the KV cache holds %d", ErrTooLong, p.total, v.cache.capacity)
	}
	if len(v.queue) == 0 && len(v.running) < v.cfg.MaxConcurrent && v.cache.fits(&p) {
		return append(dst, v.start(now, id, &p, in, now)), nil
	}
	if v.cfg.MaxQueue < 0 || (v.cfg.MaxQueue > 0 && len(v.queue) >= v.cfg.MaxQueue) {
		v.stats.Rejected++
		return dst, ErrOverloaded
	}
	v.queue = append(v.queue, &virtualWaiter{id: id, in: in, plan: p, enq: now})
	return dst, nil
}

// Finish ends request id at virtual time now (its VirtualStart.Finish): its blocks are released,
// tail first, and the queued requests that now fit start, appended to dst in order. An id that is
// not running is ignored.
func (v *VirtualEngine) Finish(now time.Time, id uint64, dst []VirtualStart) []VirtualStart {
	r, ok := v.running[id]
	if !ok {
		return dst
	}
	delete(v.running, id)
	v.cache.release(r.lease)
	v.stats.Requests++
	v.stats.OutputTokens += uint64(r.outTokens)
	for len(v.queue) > 0 && len(v.running) < v.cfg.MaxConcurrent {
		w := v.queue[0]
		v.cache.classify(&w.plan)
		if !v.cache.fits(&w.plan) {
			break
		}
		v.queue[0] = nil
		v.queue = v.queue[1:]
		dst = append(dst, v.start(now, w.id, &w.plan, w.in, w.enq))
	}
	return dst
}

// start admits a classified plan that fits.
func (v *VirtualEngine) start(now time.Time, id uint64, p *plan, in Input, enq time.Time) VirtualStart {
	v.running[id] = virtualRun{lease: v.cache.admit(p), outTokens: in.OutputTokens}
	n, bs := len(in.Tokens), v.cfg.BlockSize
	v.stats.PrefixCacheQueries += uint64(n)
	v.stats.PrefixCacheHits += uint64(p.gpuHit * bs)
	v.stats.ExternalCacheHits += uint64((p.hit - p.gpuHit) * bs)
	v.stats.PromptTokens += uint64(n)
	cached := p.hit * bs
	res := Result{
		PromptTokens:     n,
		CachedTokens:     cached,
		CPUCachedTokens:  (p.hit - p.gpuHit) * bs,
		CompletionTokens: in.OutputTokens,
		Prefill:          v.cfg.Latency.Prefill(n, cached, p.cpuLoaded*bs),
		Decode:           v.cfg.Latency.Decode(in.OutputTokens),
	}
	pre := now
	if len(v.units) > 0 {
		u := 0 // the unit that frees first
		for i := range v.units {
			if v.units[i].Before(v.units[u]) {
				u = i
			}
		}
		if v.units[u].After(pre) {
			pre = v.units[u]
		}
		v.units[u] = pre.Add(res.Prefill)
	}
	res.Queued = pre.Sub(enq)
	first := pre.Add(res.Prefill)
	return VirtualStart{ID: id, Start: now, PrefillStart: pre, FirstToken: first, Finish: first.Add(res.Decode), Result: res}
}

// Backlog returns the prefill compute the engine owes at virtual time now, before a request
// submitted now could start its own: what is left of the prefill under way on the unit that
// frees first, plus the prefills of the queued requests (at the cache hits they were classified
// with at submission) shared among the PrefillUnits. Without PrefillUnits it is the queued
// requests' prefills alone. It is a measure for reports, not a prediction: admission also waits
// for slots and blocks.
func (v *VirtualEngine) Backlog(now time.Time) time.Duration {
	var first, queued time.Duration
	if len(v.units) > 0 {
		u := v.units[0]
		for _, t := range v.units[1:] {
			if t.Before(u) {
				u = t
			}
		}
		first = max(u.Sub(now), 0)
	}
	bs := v.cfg.BlockSize
	for _, w := range v.queue {
		queued += v.cfg.Latency.Prefill(len(w.in.Tokens), w.plan.hit*bs, w.plan.cpuLoaded*bs)
	}
	return first + queued/time.Duration(max(len(v.units), 1))
}

// TakeBatch returns the KV events of the cache operations since the last call as one batch, as
// the Engine publishes one batch per step: Model is Config.Model, Seq counts batches from 0, TS is
// now in seconds since the Unix epoch. ok is false, and no sequence number is used, when nothing
// happened. The events' TokenIDs alias the submitted requests' Tokens: the caller must not modify
// those while it holds the batch.
func (v *VirtualEngine) TakeBatch(now time.Time) (b events.Batch, ok bool) {
	ops := v.cache.ops
	v.cache.ops = nil
	v.stats.Evictions, v.stats.CPUEvictions = v.cache.gpuEvictions, v.cache.cpuEvictions
	if len(ops) == 0 {
		return events.Batch{}, false
	}
	b = events.Batch{Model: v.cfg.Model, Seq: v.seq, TS: float64(now.UnixNano()) / 1e9,
		Events: make([]events.Event, len(ops))}
	v.seq++
	v.stats.Batches++
	for i := range ops {
		o := &ops[i]
		ev := &b.Events[i]
		ev.Tier = events.TierGPU
		if o.tier == TierCPU {
			ev.Tier = events.TierCPU
		}
		switch o.kind {
		case opStored:
			ev.Kind = events.KindBlockStored
			ev.BlockHashes, ev.Parent, ev.HasParent = o.hashes, o.parent, o.hasParent
			ev.TokenIDs, ev.BlockSize = o.tokens, v.cfg.BlockSize
		case opRemoved:
			ev.Kind = events.KindBlockRemoved
			ev.BlockHashes = o.hashes
		default:
			ev.Kind = events.KindAllBlocksCleared
		}
	}
	return b, true
}

// Lookup returns how many leading full blocks of tokens the engine holds on the GPU, and on any
// tier: the ground truth an index should report.
func (v *VirtualEngine) Lookup(tokens []uint32) (gpuBlocks, cachedBlocks int) {
	return v.cache.lookup(tokens)
}

// Stats returns the engine's counters: Running and Waiting now, Usage (blocks held by running
// requests), CachedBlocks and CPUBlocks, token counts and evictions. ZMQ and SSE fields are zero.
func (v *VirtualEngine) Stats() Stats {
	s := v.stats
	s.Running, s.Waiting = len(v.running), len(v.queue)
	s.Usage = float64(v.cache.held()) / float64(v.cache.capacity)
	s.CachedBlocks, s.CPUBlocks = len(v.cache.gpu), len(v.cache.cpu)
	s.Evictions, s.CPUEvictions = v.cache.gpuEvictions, v.cache.cpuEvictions
	return s
}
