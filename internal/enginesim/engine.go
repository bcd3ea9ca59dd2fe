package enginesim

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/kvroute/kvroute/prefixkey"
)

// Errors callers branch on.
var (
	// ErrClosed is returned after Close (and, until Restart, after Kill).
	ErrClosed = errors.New("enginesim: engine closed")
	// ErrDown is returned while SetDown(true) is in effect (HTTP 503).
	ErrDown = errors.New("enginesim: engine down")
	// ErrOverloaded is returned when the wait queue is full (HTTP 503).
	ErrOverloaded = errors.New("enginesim: queue full")
	// ErrTooLong is returned for a request longer than MaxModelLen or the whole KV cache (HTTP 400).
	ErrTooLong = errors.New("enginesim: request too long")
	// ErrStarted is returned by Start after a successful Start.
	ErrStarted = errors.New("enginesim: already started")
	// ErrStorageUnavailable is returned when a prefill could not write its blocks to external
	// storage (HTTP 503, so that a proxy falls back to a unified or decode-only path).
	ErrStorageUnavailable = errors.New("enginesim: external KV storage unavailable")
	// ErrBadTransferParams is returned for kv_transfer_params the engine cannot honour (HTTP 400).
	ErrBadTransferParams = errors.New("enginesim: bad kv_transfer_params")
)

// Input is one request as the engine processes it.
type Input struct {
	// Tokens are the prompt's token IDs (PromptTokens of a parsed request).
	Tokens []uint32
	// OutputTokens is the number of completion tokens to generate.
	OutputTokens int
	// PrefixKey is kvroute's prefix key of the request (req.PrefixKey(1024)), used by
	// the SSE events; the zero Key means none.
	PrefixKey prefixkey.Key
	// KVTransfer is the request's kv_transfer_params (prefill/decode disaggregation); nil means
	// none. See the package doc.
	KVTransfer *KVTransferParams
}

// InputOf returns the Input for a parsed request: PromptTokens(r), the completion length (max
// tokens when set, else Config.OutputTokens), and the request's prefix key.
func (e *Engine) InputOf(r *prefixkey.Request) Input {
	in := Input{Tokens: PromptTokens(r), OutputTokens: e.cfg.OutputTokens}
	switch {
	case r.Params.MaxCompletionTokens.Set:
		in.OutputTokens = int(max(r.Params.MaxCompletionTokens.V, 0))
	case r.Params.MaxTokens.Set:
		in.OutputTokens = int(max(r.Params.MaxTokens.V, 0))
	}
	in.PrefixKey, _ = r.PrefixKey(prefixkey.DefaultMaxPrefixLength)
	return in
}

// Result is what the engine did for one request.
type Result struct {
	PromptTokens int
	// CachedTokens is the prefix-cache hit (usage.prompt_tokens_details.cached_tokens): GPU hits
	// plus blocks loaded from the CPU tier and from external storage.
	CachedTokens int
	// CPUCachedTokens is the part of CachedTokens loaded from the CPU tier.
	CPUCachedTokens int
	// StorageTokens is the part of CachedTokens loaded from external storage for this request.
	StorageTokens    int
	CompletionTokens int
	// Queued is the wall-clock time (by Config.Now) spent waiting for admission.
	Queued time.Duration
	// Prefill and Decode are the latency model's virtual durations.
	Prefill time.Duration
	Decode  time.Duration
	// StorageLoad is the virtual transfer time of the blocks read from external storage (slept
	// before the prefill); StorageStore that of the blocks a prefill wrote (slept after it).
	StorageLoad  time.Duration
	StorageStore time.Duration
	// KVTransfer is set when this engine ran the prefill of a do_remote_decode request and wrote
	// its blocks: the kv_transfer_params of the response.
	KVTransfer *KVTransferParams
}

// Stats are an engine's counters and gauges.
type Stats struct {
	Name string
	// PrefixCacheHits and PrefixCacheQueries count tokens, as vLLM's prefix_cache_hits and
	// prefix_cache_queries: prompt tokens found on the GPU, and prompt tokens looked up.
	PrefixCacheHits    uint64
	PrefixCacheQueries uint64
	// ExternalCacheHits counts prompt tokens loaded from the CPU tier or from external storage
	// (vLLM's KV-connector hits).
	ExternalCacheHits uint64
	Running           int
	Waiting           int
	// Usage is the fraction of GPU blocks held by running requests (vLLM's gpu_cache_usage_perc,
	// 0 to 1): cached blocks that no request holds count as free.
	Usage        float64
	CachedBlocks int // hashed blocks on the GPU, held or evictable
	CPUBlocks    int
	Requests     uint64 // requests finished
	Rejected     uint64 // requests refused: queue full, too long, down
	Evictions    uint64 // GPU blocks evicted
	CPUEvictions uint64 // CPU-tier blocks dropped
	PromptTokens uint64
	OutputTokens uint64
	// Batches counts published KV-event batches (the next sequence number since the last
	// Restart is Batches minus the batches before it); DroppedMessages counts ZMQ messages dropped
	// at a subscriber's high-water mark.
	Batches         uint64
	DroppedMessages uint64
	ZMQSubscribers  int
	SSESubscribers  int
	SSEEvents       uint64

	// External KV storage (Config.Storage). Bytes and times are the simulated ones
	// (BytesPerToken, BandwidthBytesPerSec), not those of the small objects really moved.
	//
	// StorageBlocksWritten and StorageBytesWritten count blocks a prefill wrote;
	// StorageBlocksSkipped those it found already stored (not rewritten). StorageBlocksRead and
	// StorageBytesRead count blocks read (with kv_transfer_params or on the storage path).
	// StorageWriteTime and StorageReadTime sum the virtual transfer times. StorageMissingBlocks
	// counts blocks listed in kv_transfer_params that could not be loaded (absent, unreadable, not
	// matching the prompt, no storage configured) and were computed locally. StorageErrors counts
	// failed storage operations (unreachable, an error answer, a corrupt object, or skipped in
	// the cooldown after storage was found unreachable): at most one per request.
	// StorageLookups counts requests that queried storage for blocks. PrefillHandoffs counts prefills answered with
	// kv_transfer_params; DecodeHandoffs requests served with do_remote_prefill.
	StorageBlocksWritten uint64
	StorageBlocksSkipped uint64
	StorageBytesWritten  uint64
	StorageBlocksRead    uint64
	StorageBytesRead     uint64
	StorageWriteTime     time.Duration
	StorageReadTime      time.Duration
	StorageMissingBlocks uint64
	StorageErrors        uint64
	StorageLookups       uint64
	PrefillHandoffs      uint64
	DecodeHandoffs       uint64
}

// waiter is a request in the queue.
type waiter struct {
	in    Input
	plan  plan
	enq   time.Time
	ready chan struct{}
	job   *job
	err   error
}

// job is an admitted request.
type job struct {
	e     *Engine
	lease *lease
	gen   uint64
	ctx   context.Context // the engine generation's life: ends on Kill and Close
	res   Result
	debt  time.Duration // real sleep owed but not yet slept (sub-millisecond token times)
	done  bool
	// handoff: a do_remote_decode prefill that writes its blocks to storage after the prefill.
	handoff bool
}

// Engine is a simulated vLLM engine: a paged KV cache with prefix caching, a scheduler with a
// concurrency limit and a FIFO queue, a latency model, the OpenAI, Anthropic, /tokenize and
// /metrics HTTP API, and KV-event publishers (ZMQ in vLLM's wire format, SSE in kvroute's form).
//
// All methods are safe for concurrent use. New starts nothing; Start starts the event sockets'
// goroutines and Serve an HTTP server; Close stops them all and is idempotent.
type Engine struct {
	cfg   Config
	log   *slog.Logger
	enc   batchEncoder
	bus   *bus     // nil without ZMQ endpoint and replay
	store *kvStore // nil without Config.Storage

	mu         sync.Mutex
	cache      *blockCache
	sse        *sseTracker // nil unless Events.SSE
	queue      []*waiter
	running    int
	pending    []op // ops not yet published over ZMQ (FlushInterval > 0)
	flushArmed bool
	flushTimer *time.Timer
	stall      chan struct{} // non-nil while stalled; closed by SetStall(false)
	down       bool
	draining   bool // Shutdown in progress: new HTTP requests get 503
	killed     bool
	closed     bool
	started    bool
	gen        uint64
	life       context.Context
	endLife    context.CancelFunc
	tr         *transport
	handlers   sync.WaitGroup // in-flight HTTP handlers and flush callbacks
	stats      Stats
	written    map[uint64]struct{} // storage keys this process wrote or found stored (and announced)

	srvMu  sync.Mutex
	srv    *http.Server
	srvWG  sync.WaitGroup
	addr   string // HTTP address once Serve was called
	zmqEP  string // PUB endpoint as bound or dialled
	replEP string
}

// New validates cfg (errors wrap ErrInvalidConfig) and returns an engine with an empty cache.
// It starts no goroutine: call Start for the event sockets, Serve (or use Handler) for HTTP.
func New(cfg Config) (*Engine, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	e := &Engine{cfg: cfg, log: cfg.Logger}
	if e.log == nil {
		e.log = slog.New(slog.DiscardHandler)
	}
	e.enc = batchEncoder{mapForm: cfg.Events.MapForm, hashes: cfg.Events.Hashes, blockSize: cfg.BlockSize,
		dpRank: cfg.Events.DataParallelRank}
	if cfg.Events.ZMQEndpoint != "" || cfg.Events.ReplayEndpoint != "" {
		e.bus = newBus(cfg.Events.Topic, cfg.Events.ReplayBuffer, cfg.Events.SubscriberHWM)
	}
	if cfg.Events.SSE {
		e.sse = newSSETracker(cfg.BlockSize, cfg.Events.SSEBuffer)
	}
	if cfg.Storage != nil {
		e.store, err = newKVStore(*cfg.Storage, cfg.Model)
		if err != nil {
			return nil, fmt.Errorf("%w: Storage: %w", ErrInvalidConfig, err)
		}
		e.written = make(map[uint64]struct{})
	}
	e.cache = newBlockCache(cfg.BlockSize, cfg.CapacityBlocks, cfg.CPUCapacityBlocks, e.newSeed())
	e.life, e.endLife = context.WithCancel(context.Background())
	e.stats.Name = cfg.Name
	return e, nil
}

func (e *Engine) newSeed() uint64 {
	if e.cfg.HashSeed != 0 {
		return e.cfg.HashSeed
	}
	var b [8]byte
	_, _ = io.ReadFull(rand.Reader, b[:])
	return binary.LittleEndian.Uint64(b[:]) | 1
}

// Config returns the engine's configuration with defaults applied (Storage is a copy).
func (e *Engine) Config() Config {
	c := e.cfg
	if c.Storage != nil {
		sc := *c.Storage
		c.Storage = &sc
	}
	return c
}

// Name returns Config.Name.
func (e *Engine) Name() string { return e.cfg.Name }

// Model returns the served model.
func (e *Engine) Model() string { return e.cfg.Model }

// Start binds (or starts connecting) the ZMQ PUB socket and binds the replay socket, when
// configured. ctx bounds the binds only. It returns the bind error, ErrStarted after a
// successful Start and ErrClosed after Close. Without ZMQ events it only marks the engine started.
func (e *Engine) Start(ctx context.Context) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case e.closed:
		return ErrClosed
	case e.started:
		return ErrStarted
	}
	if e.bus != nil {
		tr, err := startTransport(ctx, e.bus, e.log, e.cfg.Events.ZMQEndpoint, e.cfg.Events.ZMQBind, e.cfg.Events.ReplayEndpoint)
		if err != nil {
			return err
		}
		e.tr, e.zmqEP, e.replEP = tr, tr.pubEP, tr.replyEP
	}
	e.started = true
	return nil
}

// ZMQEndpoint returns the PUB socket's endpoint once started ("tcp://127.0.0.1:port" as bound, or
// the endpoint it connects to); "" without ZMQ events or before Start.
func (e *Engine) ZMQEndpoint() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.zmqEP
}

// ReplayEndpoint returns the bound replay endpoint once started; "" without replay.
func (e *Engine) ReplayEndpoint() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.replEP
}

// Topic returns the ZMQ topic (Config.Events.Topic).
func (e *Engine) Topic() string { return e.cfg.Events.Topic }

// Serve serves the engine's HTTP API on ln in a goroutine and returns at once; Close (or Kill)
// stops it. It may be called once (Restart serves again on the same address).
func (e *Engine) Serve(ln net.Listener) error {
	e.srvMu.Lock()
	defer e.srvMu.Unlock()
	if e.srv != nil || e.addr != "" {
		ln.Close()
		return ErrStarted
	}
	e.mu.Lock()
	closed := e.closed
	e.mu.Unlock()
	if closed {
		ln.Close()
		return ErrClosed
	}
	e.addr = ln.Addr().String()
	e.serveLocked(ln)
	return nil
}

func (e *Engine) serveLocked(ln net.Listener) {
	srv := &http.Server{Handler: e.Handler(), ReadHeaderTimeout: 10 * time.Second}
	e.srv = srv
	e.srvWG.Add(1)
	go func() {
		defer e.srvWG.Done()
		_ = srv.Serve(ln)
	}()
}

// URL returns "http://" + the address given to Serve, "" before Serve.
func (e *Engine) URL() string {
	e.srvMu.Lock()
	defer e.srvMu.Unlock()
	if e.addr == "" {
		return ""
	}
	return "http://" + e.addr
}

// Close stops everything the engine started: the HTTP server of Serve, the event sockets, the
// flush timer, SSE streams, and fails queued requests with ErrClosed; running requests end at
// their next sleep. It waits for the engine's goroutines and in-flight handlers. Idempotent.
func (e *Engine) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	tr := e.stopLocked(ErrClosed)
	e.mu.Unlock()
	if tr != nil {
		tr.close()
	}
	e.stopHTTP()
	e.handlers.Wait()
	if e.store != nil {
		e.store.close()
	}
	return nil
}

// Shutdown stops the engine gracefully: new HTTP requests get 503, SSE streams end, the HTTP
// server stops accepting and waits (until ctx ends) for the requests in flight to finish; then
// Close. It returns ctx's error if the requests did not finish in time (Close then aborts them).
func (e *Engine) Shutdown(ctx context.Context) error {
	e.mu.Lock()
	e.draining = true
	if e.sse != nil {
		e.sse.reset()
	}
	e.mu.Unlock()
	e.srvMu.Lock()
	srv := e.srv
	e.srvMu.Unlock()
	var err error
	if srv != nil {
		err = srv.Shutdown(ctx)
	}
	return errors.Join(err, e.Close())
}

// stopLocked ends the current generation: queued requests fail with err, sleeps abort, SSE
// streams end, the flush timer stops. It returns the transport to close (outside the lock).
func (e *Engine) stopLocked(err error) *transport {
	e.endLife()
	for _, w := range e.queue {
		w.err = err
		close(w.ready)
	}
	e.queue = nil
	if e.flushTimer != nil && e.flushTimer.Stop() && e.flushArmed {
		e.flushArmed = false
		e.handlers.Done()
	}
	if e.sse != nil {
		e.sse.reset()
	}
	if e.stall != nil {
		close(e.stall)
		e.stall = nil
	}
	tr := e.tr
	e.tr = nil
	return tr
}

func (e *Engine) stopHTTP() {
	e.srvMu.Lock()
	srv := e.srv
	e.srv = nil
	e.srvMu.Unlock()
	if srv != nil {
		_ = srv.Close()
	}
	e.srvWG.Wait()
}

// Kill simulates a crash: the HTTP listener and connections and the event sockets close
// (connections are refused), queued and running requests fail, and the cache is lost without
// events. Restart brings the engine back. Kill after Close does nothing.
func (e *Engine) Kill() {
	e.mu.Lock()
	if e.closed || e.killed {
		e.mu.Unlock()
		return
	}
	e.killed = true
	tr := e.stopLocked(ErrClosed)
	e.gen++
	e.running = 0
	e.pending = nil
	e.cache = newBlockCache(e.cfg.BlockSize, e.cfg.CapacityBlocks, e.cfg.CPUCapacityBlocks, e.cache.seed)
	e.mu.Unlock()
	if tr != nil {
		tr.close()
	}
	e.stopHTTP()
}

// Restart brings a killed engine back as a new process would come: an empty cache, a new block
// hash seed (unless Config.HashSeed is set), event sequence numbers from 0 and an empty replay
// buffer, the event sockets on the same endpoints, and the HTTP server on the same address. It
// returns ErrClosed after Close, and nil without effect when the engine is not killed.
func (e *Engine) Restart(ctx context.Context) error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return ErrClosed
	}
	if !e.killed {
		e.mu.Unlock()
		return nil
	}
	e.cache = newBlockCache(e.cfg.BlockSize, e.cfg.CapacityBlocks, e.cfg.CPUCapacityBlocks, e.newSeed())
	e.life, e.endLife = context.WithCancel(context.Background())
	if e.written != nil {
		clear(e.written) // a new process knows nothing of what is stored: it asks storage again
	}
	if e.bus != nil {
		e.bus.restart()
	}
	if e.started && e.bus != nil {
		pub := e.cfg.Events.ZMQEndpoint
		if e.cfg.Events.ZMQEndpoint != "" && e.zmqEP != "" {
			pub = e.zmqEP
		}
		repl := e.cfg.Events.ReplayEndpoint
		if repl != "" && e.replEP != "" {
			repl = e.replEP
		}
		tr, err := startTransport(ctx, e.bus, e.log, pub, e.cfg.Events.ZMQBind, repl)
		if err != nil {
			e.mu.Unlock()
			return err
		}
		e.tr = tr
	}
	e.killed = false
	e.mu.Unlock()

	e.srvMu.Lock()
	defer e.srvMu.Unlock()
	if e.addr != "" && e.srv == nil {
		var lc net.ListenConfig
		ln, err := lc.Listen(ctx, "tcp", e.addr)
		if err != nil {
			return fmt.Errorf("enginesim: listen %s again: %w", e.addr, err)
		}
		e.serveLocked(ln)
	}
	return nil
}

// SetDown makes every HTTP endpoint answer 503 (and Generate return ErrDown) while down is true;
// running requests finish normally.
func (e *Engine) SetDown(down bool) {
	e.mu.Lock()
	e.down = down
	e.mu.Unlock()
}

// SetStall holds admitted requests before their prefill while stall is true (a hung engine);
// they go on when it is set false, or fail when their context ends.
func (e *Engine) SetStall(stall bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case stall && e.stall == nil:
		e.stall = make(chan struct{})
	case !stall && e.stall != nil:
		close(e.stall)
		e.stall = nil
	}
}

// Reset drops the whole prefix cache (vLLM's reset_prefix_cache) and publishes AllBlocksCleared.
// Blocks held by running requests stay allocated to them but are no longer cached.
func (e *Engine) Reset() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed || e.killed {
		return
	}
	e.cache.reset()
	e.stepLocked()
}

// Lookup returns how many leading full blocks of tokens the engine holds on the GPU, and on any
// tier (GPU then CPU): the ground truth a KV index should report for this engine.
func (e *Engine) Lookup(tokens []uint32) (gpuBlocks, cachedBlocks int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.cache.lookup(tokens)
}

// Stats returns a snapshot of the engine's counters.
func (e *Engine) Stats() Stats {
	e.mu.Lock()
	s := e.stats
	s.Running, s.Waiting = e.running, len(e.queue)
	s.Usage = float64(e.cache.held()) / float64(e.cache.capacity)
	s.CachedBlocks, s.CPUBlocks = len(e.cache.gpu), len(e.cache.cpu)
	if e.sse != nil {
		s.SSESubscribers, s.SSEEvents = len(e.sse.subs), e.sse.sent
	}
	e.mu.Unlock()
	if e.bus != nil {
		s.Batches, s.DroppedMessages = e.bus.published.Load(), e.bus.dropped.Load()
		s.ZMQSubscribers = e.bus.subscribers()
	}
	return s
}

// Generate runs one request through the engine — reads from external storage (kv_transfer_params
// or the storage path), admission (queueing at MaxConcurrent or when the cache is full),
// prefix-cache lookup and allocation, transfer and prefill sleeps, the writes of a
// do_remote_decode prefill, decode sleeps, all scaled by SpeedFactor, release — as the HTTP
// handlers do, and returns what happened. ctx cancels the storage requests, the wait and the
// sleeps. Errors: ErrDown, ErrOverloaded, ErrTooLong, ErrClosed, ErrStorageUnavailable, or ctx's
// error.
func (e *Engine) Generate(ctx context.Context, in Input) (Result, error) {
	j, err := e.begin(ctx, in)
	if err != nil {
		return Result{}, err
	}
	defer j.finish()
	if err := j.sleep(ctx, j.res.StorageLoad+j.res.Prefill, true); err != nil {
		return j.res, err
	}
	if err := j.handOff(ctx, in.Tokens); err != nil {
		return j.res, err
	}
	if err := j.sleep(ctx, j.res.Decode, false); err != nil {
		return j.res, err
	}
	return j.res, j.flushDebt(ctx)
}

// admit admits the request now or queues it until it fits. The blocks of ld (read from storage)
// are placed in the cache first.
func (e *Engine) admit(ctx context.Context, in Input, ld *storageLoad) (*job, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	e.mu.Lock()
	switch {
	case e.closed || e.killed:
		e.mu.Unlock()
		return nil, ErrClosed
	case e.down:
		e.stats.Rejected++
		e.mu.Unlock()
		return nil, ErrDown
	}
	if n := len(in.Tokens) + in.OutputTokens; n > e.cfg.MaxModelLen {
		e.stats.Rejected++
		e.mu.Unlock()
		return nil, fmt.Errorf("%w: this model's maximum context length is %d tokens; however, you requested %d tokens (%d in the prompt, %d in the completion)",
			ErrTooLong, e.cfg.MaxModelLen, n, len(in.Tokens), in.OutputTokens)
	}
	p := e.cache.makePlan(in.Tokens, in.OutputTokens)
	if p.total > e.cache.capacity {
		e.stats.Rejected++
		e.mu.Unlock()
		return nil, fmt.Errorf("%w: %d blocks needed, the KV cache holds %d", ErrTooLong, p.total, e.cache.capacity)
	}
	placed := ld != nil && ld.n > 0 && e.cache.insertLoaded(in.Tokens, ld.from, ld.from+ld.n) > 0
	if placed {
		e.cache.classify(&p)
	}
	now := e.cfg.Now()
	if len(e.queue) == 0 && e.running < e.cfg.MaxConcurrent && e.cache.fits(&p) {
		j := e.startLocked(&p, in, 0)
		e.stepLocked()
		e.mu.Unlock()
		return j, nil
	}
	if placed {
		e.stepLocked() // the loaded blocks are cached whether the request waits or not
	}
	if e.cfg.MaxQueue < 0 || (e.cfg.MaxQueue > 0 && len(e.queue) >= e.cfg.MaxQueue) {
		e.stats.Rejected++
		e.mu.Unlock()
		return nil, ErrOverloaded
	}
	w := &waiter{in: in, plan: p, enq: now, ready: make(chan struct{})}
	e.queue = append(e.queue, w)
	e.mu.Unlock()

	select {
	case <-w.ready:
		return w.job, w.err
	case <-ctx.Done():
	}
	e.mu.Lock()
	select {
	case <-w.ready: // admitted or failed meanwhile
		e.mu.Unlock()
		if w.job != nil {
			w.job.finish()
		}
		return nil, ctx.Err()
	default:
	}
	for i, q := range e.queue {
		if q == w {
			e.queue = append(e.queue[:i], e.queue[i+1:]...)
			break
		}
	}
	e.scheduleLocked() // the head may have changed
	e.stepLocked()
	e.mu.Unlock()
	return nil, ctx.Err()
}

// startLocked admits a classified plan that fits.
func (e *Engine) startLocked(p *plan, in Input, queued time.Duration) *job {
	l := e.cache.admit(p)
	e.running++
	n := len(in.Tokens)
	bs := e.cfg.BlockSize
	// Blocks placed from storage count as external hits (vLLM's connector hits), not local ones.
	remote, remoteGPU := 0, 0
	for i, b := range l.blocks[:p.hit] {
		if b.remote {
			b.remote = false
			remote++
			if i < p.gpuHit {
				remoteGPU++
			}
		}
	}
	e.stats.PrefixCacheQueries += uint64(n)
	e.stats.PrefixCacheHits += uint64((p.gpuHit - remoteGPU) * bs)
	e.stats.ExternalCacheHits += uint64((p.hit - p.gpuHit + remoteGPU) * bs)
	e.stats.PromptTokens += uint64(n)
	if e.sse != nil && !in.PrefixKey.IsZero() {
		e.sse.setChain(in.PrefixKey.String(), p.hashes)
	}
	cached := p.hit * bs
	res := Result{
		PromptTokens:     n,
		CachedTokens:     cached,
		CPUCachedTokens:  (p.hit - p.gpuHit - (remote - remoteGPU)) * bs,
		StorageTokens:    remote * bs,
		CompletionTokens: in.OutputTokens,
		Queued:           queued,
		Prefill:          e.cfg.Latency.Prefill(n, cached, p.cpuLoaded*bs),
		Decode:           e.cfg.Latency.Decode(in.OutputTokens),
	}
	return &job{e: e, lease: l, gen: e.gen, ctx: e.life, res: res}
}

// scheduleLocked admits queued requests in order while the head fits.
func (e *Engine) scheduleLocked() {
	for len(e.queue) > 0 && e.running < e.cfg.MaxConcurrent {
		w := e.queue[0]
		e.cache.classify(&w.plan)
		if !e.cache.fits(&w.plan) {
			return
		}
		e.queue[0] = nil
		e.queue = e.queue[1:]
		w.job = e.startLocked(&w.plan, w.in, e.cfg.Now().Sub(w.enq))
		close(w.ready)
	}
}

// stepLocked ends an engine step: the cache's operations go to the SSE tracker and to the ZMQ
// publisher (now, or when FlushInterval or BatchSize says).
func (e *Engine) stepLocked() {
	ops := e.cache.ops
	e.cache.ops = nil
	if e.closed || e.killed {
		return
	}
	e.stats.Evictions, e.stats.CPUEvictions = e.cache.gpuEvictions, e.cache.cpuEvictions
	if e.sse != nil {
		e.sse.onOps(ops)
		e.sse.flush(e.cache) // also for a request that only hit: its prefix was (re)recorded
	}
	if e.bus == nil || len(ops) == 0 {
		return
	}
	e.pending = append(e.pending, ops...)
	bs := e.cfg.Events.BatchSize
	if e.cfg.Events.FlushInterval <= 0 {
		e.publishLocked(len(e.pending))
		return
	}
	if bs > 0 && len(e.pending) >= bs {
		e.publishLocked(len(e.pending) - len(e.pending)%bs)
	}
	if len(e.pending) > 0 && !e.flushArmed {
		e.flushArmed = true
		e.handlers.Add(1)
		if e.flushTimer == nil {
			e.flushTimer = time.AfterFunc(e.cfg.Events.FlushInterval, e.flushTick)
		} else {
			e.flushTimer.Reset(e.cfg.Events.FlushInterval)
		}
	}
}

// flushTick publishes what the flush interval held back.
func (e *Engine) flushTick() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if !e.flushArmed {
		return
	}
	e.flushArmed = false
	defer e.handlers.Done()
	if e.closed || e.killed {
		return
	}
	e.publishLocked(len(e.pending))
}

// publishLocked publishes the first n pending ops, in batches of at most BatchSize events.
func (e *Engine) publishLocked(n int) {
	bs := e.cfg.Events.BatchSize
	if bs <= 0 {
		bs = n
	}
	ts := float64(e.cfg.Now().UnixNano()) / 1e9
	for i := 0; i < n; i += bs {
		end := min(i+bs, n)
		e.bus.publish(e.enc.appendBatch(nil, ts, e.pending[i:end]))
	}
	rest := copy(e.pending, e.pending[n:])
	clear(e.pending[rest:])
	e.pending = e.pending[:rest]
}

// sleep waits the real time of a virtual duration d (prefill when first: the stall switch is
// honoured there). Sub-millisecond real times are accumulated and slept together.
func (j *job) sleep(ctx context.Context, d time.Duration, first bool) error {
	e := j.e
	if first {
		e.mu.Lock()
		st := e.stall
		e.mu.Unlock()
		if st != nil {
			select {
			case <-st:
			case <-ctx.Done():
				return ctx.Err()
			case <-j.ctx.Done():
				return ErrClosed
			}
		}
	}
	j.debt += e.cfg.Latency.real(d)
	if j.debt < time.Millisecond {
		if err := ctx.Err(); err != nil {
			return err
		}
		if j.ctx.Err() != nil {
			return ErrClosed
		}
		return nil
	}
	return j.flushDebt(ctx)
}

func (j *job) flushDebt(ctx context.Context) error {
	d := j.debt
	j.debt = 0
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-j.ctx.Done():
		return ErrClosed
	}
}

// finish releases the request's blocks and admits what now fits. Idempotent.
func (j *job) finish() {
	if j.done {
		return
	}
	j.done = true
	e := j.e
	e.mu.Lock()
	defer e.mu.Unlock()
	if j.gen != e.gen { // killed since: its cache is gone
		return
	}
	e.cache.release(j.lease)
	e.running--
	e.stats.Requests++
	e.stats.OutputTokens += uint64(j.res.CompletionTokens)
	e.scheduleLocked()
	e.stepLocked()
}
