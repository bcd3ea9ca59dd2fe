package zmqevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/events/internal/run"
	"github.com/kvroute/kvroute/telemetry"
)

// Defaults of Config.
const (
	DefaultQueueSize      = 1024             // batches per backend
	DefaultReplayTimeout  = 2 * time.Second  // one replay: dial, request, every missing batch
	DefaultCatchUpBatches = 10000            // vLLM's default buffer_steps
	DefaultCatchUpTimeout = 30 * time.Second // one catch-up: dial, request, every batch
	DefaultInitialBackoff = 100 * time.Millisecond
	DefaultMaxBackoff     = 30 * time.Second
	DefaultDialTimeout    = 5 * time.Second // TCP connect plus ZMTP handshake
	DefaultMaxMessageSize = 64 << 20        // bytes per ZMQ message
	DefaultMaxTopics      = 1024            // distinct topics accepted in bind mode
	// DefaultLossCheckInterval is how often a backend's worker asks an events.LossReporter sink
	// whether the backend's entries were lost.
	DefaultLossCheckInterval = time.Second

	// DefaultMaxFrameBytes is the default Config.MaxFrameBytes: the largest batch payload
	// decoded. vLLM's batches are a few KiB to a few MiB (one engine step).
	DefaultMaxFrameBytes = 16 << 20

	// DefaultMaxResetsPerMinute is the default Config.MaxResetsPerMinute: a healthy engine's
	// stream breaks a few times an hour (a restart, a dropped connection), far below it.
	DefaultMaxResetsPerMinute = 10
)

// ReplayEndSeq is the sequence number of the message that ends a replay (all ones, -1 as a
// signed integer), sent with an empty payload.
const ReplayEndSeq = ^uint64(0)

const (
	zmtpGreetingLen  = 64  // ZMTP 3 greeting
	zmtpMaxFrames    = 64  // frames per message (KV events use 3)
	maxChainsPerPipe = 256 // publisher chains (topic × data-parallel rank) tracked per backend
)

// Endpoint is one engine publisher to connect to (pod-discovery mode). A data-parallel engine
// publishes one stream per rank (TCP port + rank): list each rank as an endpoint with the same
// Backend.
type Endpoint struct {
	// Backend is the routing backend the events belong to. Required.
	Backend string
	// Endpoint is the engine's PUB socket, "tcp://host:port" (or "ipc:///path"). Required.
	Endpoint string
	// ReplayEndpoint is the engine's replay ROUTER socket ("tcp://host:port"), used to fill
	// sequence gaps and to catch up on what the engine published before we subscribed (see
	// Config.CatchUpBatches); "" disables both (a gap then resets the backend, and the first
	// batch is taken as is). It must be this publisher's own: vLLM offsets the replay port by
	// the data-parallel rank as it does the PUB port, and a replayed batch that names another
	// rank than the chain being repaired fails the replay.
	ReplayEndpoint string
	// Model roots the block keys of this publisher's events when they name no LoRA; "" uses the
	// model of a kv@<pod>@<model> topic, or the sink's default.
	Model string
}

// Listener is one address a consumer binds in centralized mode, and the rules that place the
// messages arriving on it on backends. The backend of a message comes from its topic:
// TopicBackend[topic], else DefaultBackend, else <pod> of "kv@<pod>@<model>" when Backends names
// it (or Backends is empty). Messages of any other topic are counted as unplaced on the listener
// (Consumer.Listeners), logged (at most once per 5 s) and dropped, never indexed under an
// invented name.
type Listener struct {
	// Bind is the address the SUB socket binds, e.g. "tcp://10.0.0.5:5557" (the pod's own
	// address), "tcp://127.0.0.1:0" (a free port; see Consumer.Addrs) or "ipc:///path".
	// Required. Without a host ("tcp://:5557") it binds loopback (127.0.0.1) only; every
	// interface takes an explicit "tcp://*:5557" or "tcp://0.0.0.0:5557", which Start logs at
	// Warn with the trust model: whoever can reach a bound address can feed, reset and poison the
	// index entries of every backend its rules can name (ZMTP's NULL mechanism authenticates no
	// one). See the package doc's Trust.
	Bind string
	// TopicBackend maps exact topics to backends. vLLM's topic is configurable and "" by
	// default: {"": "vllm-1"} names the backend of every engine that keeps the default.
	TopicBackend map[string]string
	// DefaultBackend receives the messages of every topic TopicBackend does not map: the backend
	// of the engine that connects to this address (one address per engine). "" leaves them to
	// the kv@<pod>@<model> form.
	DefaultBackend string
	// Backends are the backends a topic's <pod> may name (a gateway's configured backends,
	// without those another consumer feeds); empty accepts any pod. A pod is compared as is: a
	// pod given as host:port names a backend only if one has that name.
	Backends []string
	// Model roots block keys when the topic names no model.
	Model string
}

// Config configures a Consumer. Either Endpoints is set (pod-discovery mode: one SUB
// connection per engine), or Bind, Listeners or both (centralized mode: SUB sockets that engines
// connect to). Zero durations and sizes mean the Default* constants.
type Config struct {
	// Sink receives the decoded batches. Required.
	Sink events.Sink

	// Endpoints lists the engines to connect to (pod-discovery mode).
	Endpoints []Endpoint

	// Bind, TopicBackend, DefaultBackend, Backends and Model describe one bound address, as the
	// fields of a Listener do; with Listeners it is the first one.
	Bind           string
	TopicBackend   map[string]string
	DefaultBackend string
	Backends       []string
	Model          string
	// Listeners are bound addresses (after Bind's, when set), each with its own placement rules:
	// one per engine (an engine whose topic does not name it connects to an address of its own,
	// whose DefaultBackend is its backend), one per data-parallel rank (vLLM adds the rank to the
	// port of the endpoint it connects to, as to the one it binds), or one per group of engines.
	// All the listeners of a consumer share its per-backend queues and workers, so that a
	// backend fed through several of them (its ranks) still has one ordered writer to the sink.
	// Two listeners may not have the same address; addresses that overlap otherwise
	// (tcp://0.0.0.0:5557 and tcp://127.0.0.1:5557) make Start fail.
	Listeners []Listener
	// MaxTopics caps the distinct topics accepted in bind mode (each listener's counted, summed
	// over the listeners), so that a misbehaving peer cannot grow the consumer's state without
	// bound; messages of further topics are dropped. Open connections, all listeners together,
	// are capped at 4 × MaxTopics.
	MaxTopics int

	// Topic is the subscription prefix; "" subscribes to every topic.
	Topic string

	// QueueSize is the capacity, in batches, of each backend's queue between the socket readers
	// and the goroutine that applies batches to the sink. When it is full the incoming batch is
	// dropped and counted; the hole it leaves in the sequence is handled like any gap.
	QueueSize int
	// ReplayTimeout bounds one replay request that fills a gap.
	ReplayTimeout time.Duration
	// CatchUpBatches is how many batches before a publisher's first one (on every new
	// connection) the consumer requests from its ReplayEndpoint, so that the index learns what
	// the engine cached before the subscription: after a router restart or a reconnection, for
	// an engine added to the fleet, and the batches a PUB socket drops before a new
	// subscription reaches it. 0 means DefaultCatchUpBatches (vLLM keeps its last
	// buffer_steps = 10,000 batches for replay); a negative value disables catch-up (the first
	// batch is then the baseline, and the index knows nothing the engine cached before it).
	// Connect mode with a ReplayEndpoint only.
	CatchUpBatches int
	// CatchUpTimeout bounds one catch-up: dial, request, and applying every batch. 10,000
	// batches of 64 blocks (46 MB) take 0.43 s over loopback into the in-memory index on two
	// vCPUs, of 256 blocks (182 MB) 2.1 s (BenchmarkZMQCatchUp): the default leaves a margin of
	// ten or more for slower links and hosts. While it runs, the backend's live batches wait in
	// its queue (batches that overflow it are replayed afterwards, as any gap).
	CatchUpTimeout time.Duration
	// InitialBackoff and MaxBackoff bound the jittered exponential backoff between connection
	// attempts (connect mode).
	InitialBackoff time.Duration
	MaxBackoff     time.Duration
	// DialTimeout bounds a TCP connect plus the ZMTP handshake.
	DialTimeout time.Duration
	// MaxMessageSize caps the size of a received message (all frames); a peer that announces a
	// larger frame, or a message of more than 64 frames, is disconnected before anything is
	// allocated for it.
	MaxMessageSize int64
	// LossCheckInterval is how often each backend's worker asks the Sink, when it implements
	// events.LossReporter, whether it lost the backend's entries (a Redis index whose server
	// restarted empty); the same check retries a clear that a failed Apply left pending when no batch comes
	// to do it. A lost backend is healed at once, without waiting for its next batch: it is
	// cleared, and each of its publishers' chains catches up on the batches up to the last one
	// applied (connect mode with a ReplayEndpoint; counted in events.SequenceStats.Resets and CatchUps).
	// 0 means DefaultLossCheckInterval (1 s); negative disables the checks.
	LossCheckInterval time.Duration
	// MaxFrameBytes caps the payload (third frame) of a batch that is decoded; 0 means
	// DefaultMaxFrameBytes. A larger batch is dropped without being decoded, counted in the
	// source's Events.Malformed and LastError, logged at Warn (at most once per source every
	// few seconds), and handled as a lost batch (replayed, else the backend reset); the
	// connection stays up. Decoding takes at most 4 × the payload plus 1 MiB (see
	// events.DecodeMsgpackBatch), and a decoded batch waits in the backend's queue until applied,
	// so QueueSize × MaxFrameBytes × 4 bounds what one backend's queue can hold.
	MaxFrameBytes int
	// MaxResetsPerMinute is each backend's reset budget: the clears of its index entries that its
	// publishers may cause (a gap that cannot be replayed, a sequence that went back, a lost
	// connection), as a bucket of MaxResetsPerMinute resets refilled at that rate. A reset asked
	// for while the bucket is empty is not made: the batch is applied on the entries as they
	// are, and the reset is counted in the source's SequenceStats.ResetsLimited (and logged at
	// Warn, at most once per source every few seconds). It bounds what a publisher that breaks
	// its sequence at every batch, or anyone who can reach a bound address (random sequence
	// numbers, connections opened and closed), can wipe; the cost is an index that may keep
	// stale entries of that backend until they are evicted or the next reset. Clears that the
	// sink's own failures or losses require are not limited. 0 means DefaultMaxResetsPerMinute
	// (10); negative disables the budget.
	MaxResetsPerMinute int

	// MeterProvider supplies the instruments ("github.com/kvroute/kvroute/events"); nil means no metrics.
	MeterProvider metric.MeterProvider
	// Logger receives connection-level events at Debug and Warn, and completed catch-ups at
	// Info; nil discards them.
	Logger *slog.Logger
	// Now is the clock for the status timestamps; nil means time.Now.
	Now func() time.Time
}

// Consumer consumes vLLM/SGLang KV events published over ZeroMQ (frames [topic, seq as 8-byte
// big-endian, msgpack batch]) and applies them to an events.Sink. It speaks ZMTP 3 itself over
// its own TCP connections (the go-zeromq/zmq4 codec for the handshake and framing), so every connection
// has deadlines and is closed by Close.
//
// Goroutines, all started by Start and stopped by Close: one reader per endpoint (connect mode)
// or one accept loop per bound address plus one reader per engine connection (bind mode), and
// one worker per backend that applies the backend's batches to the sink in order (so the sink
// sees one goroutine per backend, however many endpoints, addresses and connections feed it).
// Between readers and workers sits a bounded queue per backend. Two consumers must not feed the
// same backend of one sink: each would clear it and repair its sequences without the other's
// knowledge (and the sink would see two goroutines for it).
//
// Sequence tracking, per publisher (connection, topic and data-parallel rank): the first
// message sets the baseline, and with a ReplayEndpoint it is preceded by a catch-up: the up to
// CatchUpBatches batches before it that the publisher still holds are requested and applied in
// order first, so that the sink knows what the engine cached before the subscription (a
// catch-up that fails after applying some of them clears the backend, Sink.ClearBackend).
// Then seq = last+1 is applied; seq > last+1 is a gap: with a ReplayEndpoint the missing batches are
// requested and applied in order first, otherwise (or if the replay fails) the backend is
// cleared and the chain re-baselined; seq ≤ last means the publisher restarted (and the
// engine's cache with it): the backend is cleared and re-baselined. A batch that cannot be
// decoded, and a batch dropped because the queue is full, leave such a gap; the worker repairs
// it (replay, else reset) as soon as it has applied what the same connection queued before the
// lost batch, without waiting for the publisher's next batch to reveal it (a publisher that
// goes quiet after a burst would otherwise leave the sink with the hole indefinitely). A failed
// Sink.Apply clears the backend before the next batch. A clear whose cause is not the chain's
// own batch (a sink outage, another chain's reset or lost connection) makes the chain catch up
// again on its next batch, once the clear has succeeded, so that a reset heals from the replay
// buffer; a chain whose catch-up failed does not try again before a new connection. A replay or
// catch-up stops at a batch the sink fails (the rest would fail too); the backend is cleared
// before the next batch, and a stopped catch-up is tried again on the chain's next batch.
//
// Lost connections: a PUB socket drops what it publishes while a subscriber is away, and an
// engine that restarts comes back with an empty cache (and a sequence that may by chance
// continue ours), so when a connection is lost its backend is cleared at once and the
// connection's sequences start over (with a catch-up, which restores what the engine still
// holds from its replay buffer). A lost or refused connect-mode connection is retried with
// jittered exponential backoff from InitialBackoff to MaxBackoff, reset after each successful
// handshake.
//
// All methods are safe for concurrent use.
type Consumer struct {
	cfg  Config
	now  func() time.Time
	log  *slog.Logger
	life run.Lifecycle
	srcs *events.SourceSet

	loss  events.LossReporter // cfg.Sink when it is one and checks are on; nil otherwise
	items sync.Pool           // *item
	topic []byte              // cfg.Topic

	// connect mode
	pubs []*publisher

	// bind mode
	lns      []*listener  // Bind's first, then Listeners
	conns    atomic.Int64 // open engine connections, all listeners
	connIDs  atomic.Uint64
	routesMu sync.RWMutex // guards every listener's routes and srcs, and nroutes
	nroutes  int          // routes of all listeners, capped at MaxTopics
	lnReg    metric.Registration

	backendsMu sync.Mutex
	backends   map[string]*backendQueue
}

// publisher is one connect-mode endpoint.
type publisher struct {
	idx                   int
	cfg                   Endpoint
	network, addr         string
	replayNet, replayAddr string
	src                   *events.Source
	be                    *backendQueue
	sent                  uint64 // items queued to be (stamps); owned by the reader goroutine
}

// listener is one bound address (bind mode).
type listener struct {
	cfg           Listener
	network, addr string
	src           *events.Source // the listener's state and last error (it has no backend)
	ln            atomic.Pointer[net.Listener]
	// Messages received, by outcome (events.ListenerMessages).
	placed, unplaced, malformed atomic.Uint64
	// bound is the bound endpoint (Bind with the port resolved), set by Start before any
	// connection is served.
	bound string
	// routes maps the topics seen on this listener to their backends; srcs holds the source of
	// each backend this listener feeds. Both guarded by Consumer.routesMu.
	routes map[string]*topicRoute
	srcs   map[string]*boundSource
}

// boundSource is the source of one backend on one listener (bind mode).
type boundSource struct {
	*events.Source
	liveConns atomic.Int64 // open connections that carried this backend
}

// topicRoute is where a bind-mode topic of one listener goes.
type topicRoute struct {
	topic string
	model string
	be    *backendQueue
	src   *boundSource // the backend's source on the listener
}

// backendQueue is one backend's queue and the state of its worker goroutine.
//
// A batch a reader could not queue (queue full, undecodable) is recorded in lost, and wake
// tells the worker, which repairs the hole once it has handled every item the reader queued
// before the loss: each reader stamps the items it queues to a backend 1, 2, 3, … (per
// connection), a lost batch carries the stamp of the reader's last queued item as its ticket,
// and done holds, per connection, the stamp of the last item the worker handled.
type backendQueue struct {
	queue chan *item
	wake  chan struct{}  // capacity 1: lost has news
	first *events.Source // the backend's first source, to count a reset no chain caused

	lostMu sync.Mutex
	lost   map[lostKey]lostBatch // guarded by lostMu; at most maxChainsPerPipe
	nlost  atomic.Int32          // len(lost), so that the worker skips the lock when it is empty

	// owned by the worker goroutine
	w         *events.BackendWriter
	chains    map[chainKey]*chain
	done      map[uint64]uint64 // connection → stamp of the last item handled
	ready     []lostEntry
	replayBuf events.Batch
	// healOwed: the sink stopped heal's catch-up (it refused a batch) after the backend was
	// cleared; the next check heals again, though the sink no longer reports the loss.
	healOwed bool
	// resetTokens is the backend's reset budget (Config.MaxResetsPerMinute) as of resetAt.
	resetTokens float64
	resetAt     time.Time
}

// lostKey is the chain of a lost batch; anyRank when the batch could not be decoded (its
// data-parallel rank is unknown: any chain of the connection and topic).
type lostKey struct {
	chain   chainKey
	anyRank bool
}

// lostBatch is the last batch of a chain that a reader could not queue (later losses of the
// chain replace it: the batches queued in between reveal the earlier hole).
type lostBatch struct {
	src    *events.Source
	pub    *publisher // nil in bind mode
	model  string
	seq    uint64
	ticket uint64 // stamp of the last item the reader had queued to the backend
}

type lostEntry struct {
	key lostKey
	lostBatch
}

// chainKey identifies one publisher's sequence.
type chainKey struct {
	conn  uint64 // the connection: connect mode, the endpoint's index; bind mode, a connection id
	topic string
	rank  int // data-parallel rank, -1 when the batch names none
}

func chainKeyOf(conn uint64, topic string, b *events.Batch) chainKey {
	k := chainKey{conn: conn, topic: topic, rank: -1}
	if b.HasDPRank {
		k.rank = b.DPRank
	}
	return k
}

type chain struct {
	// src, pub and model are those of the chain's last batch: a catch-up that no batch prompts
	// (the sink lost the backend) uses them.
	src   *events.Source
	pub   *publisher
	model string
	last  uint64
	// clears is the backend's clear count (backendWriter.clears) after the chain's last batch:
	// when another cause has cleared the backend since, the chain catches up again.
	clears uint64
	// caught is how the chain's last catch-up ended.
	caught catchUpOutcome
}

// catchUpOutcome is how a catch-up ended.
type catchUpOutcome uint8

const (
	// caughtUp: done, or nothing to do.
	caughtUp catchUpOutcome = iota
	// catchUpFailed: the publisher's replay failed; the chain does not try again before a new
	// connection (a replay buffer that keeps failing would otherwise reset the backend again
	// and again).
	catchUpFailed
	// catchUpStopped: stopped at a batch the sink did not take (the backend is cleared before
	// the next batch); the chain catches up again on its next batch.
	catchUpStopped
)

// item is a decoded batch on its way from a reader to a worker, or (reset) the news that a
// connection was lost.
type item struct {
	src   *events.Source
	pub   *publisher // nil in bind mode
	conn  uint64     // see chainKey
	stamp uint64     // the reader's count of items queued to this backend, this one included
	topic string
	reset bool
	b     events.Batch
}

// feed is a reader's stream of items into one backend's queue; owned by the reader goroutine.
type feed struct {
	be   *backendQueue
	src  *boundSource // the backend's source on the reader's listener
	sent uint64       // stamp of the last item queued
}

// New validates cfg and returns a consumer that does nothing until Start.
//
// Errors wrap events.ErrInvalidConfig: no Sink, both or neither of Endpoints and a bound address
// (Bind or Listeners), an endpoint without Backend or with an address that is not "tcp://host:port"
// (connect mode cannot use "*") or "ipc://path", bind-mode options in connect mode, Bind's
// options without Bind, two listeners with the same address, or negative durations and sizes
// (CatchUpBatches excepted: negative disables catch-up). The metric instruments are registered
// here; an error from the MeterProvider is returned as is.
func New(cfg Config) (*Consumer, error) {
	if cfg.Sink == nil {
		return nil, fmt.Errorf("%w: Sink is required", events.ErrInvalidConfig)
	}
	bind := cfg.Bind != "" || len(cfg.Listeners) > 0
	if (len(cfg.Endpoints) == 0) == !bind {
		return nil, fmt.Errorf("%w: set exactly one of Endpoints (connect mode) and Bind or Listeners (bind mode)", events.ErrInvalidConfig)
	}
	if cfg.QueueSize < 0 || cfg.ReplayTimeout < 0 || cfg.CatchUpTimeout < 0 || cfg.InitialBackoff < 0 ||
		cfg.MaxBackoff < 0 || cfg.DialTimeout < 0 || cfg.MaxMessageSize < 0 || cfg.MaxTopics < 0 || cfg.MaxFrameBytes < 0 {
		return nil, fmt.Errorf("%w: negative size or duration", events.ErrInvalidConfig)
	}
	bindOpts := len(cfg.TopicBackend) > 0 || cfg.DefaultBackend != "" || len(cfg.Backends) > 0 || cfg.Model != ""
	switch {
	case !bind && (bindOpts || cfg.MaxTopics != 0):
		return nil, fmt.Errorf("%w: TopicBackend, DefaultBackend, Backends, Model and MaxTopics apply to bind mode only", events.ErrInvalidConfig)
	case cfg.Bind == "" && bindOpts:
		return nil, fmt.Errorf("%w: TopicBackend, DefaultBackend, Backends and Model describe Bind's address; without Bind, set them in Listeners", events.ErrInvalidConfig)
	}
	setDefault(&cfg.QueueSize, DefaultQueueSize)
	setDefault(&cfg.ReplayTimeout, DefaultReplayTimeout)
	setDefault(&cfg.CatchUpBatches, DefaultCatchUpBatches)
	setDefault(&cfg.CatchUpTimeout, DefaultCatchUpTimeout)
	setDefault(&cfg.InitialBackoff, DefaultInitialBackoff)
	setDefault(&cfg.MaxBackoff, DefaultMaxBackoff)
	setDefault(&cfg.DialTimeout, DefaultDialTimeout)
	setDefault(&cfg.MaxMessageSize, DefaultMaxMessageSize)
	setDefault(&cfg.MaxTopics, DefaultMaxTopics)
	setDefault(&cfg.MaxFrameBytes, DefaultMaxFrameBytes)
	setDefault(&cfg.LossCheckInterval, DefaultLossCheckInterval)
	setDefault(&cfg.MaxResetsPerMinute, DefaultMaxResetsPerMinute)
	if cfg.MaxBackoff < cfg.InitialBackoff {
		return nil, fmt.Errorf("%w: MaxBackoff %v < InitialBackoff %v", events.ErrInvalidConfig, cfg.MaxBackoff, cfg.InitialBackoff)
	}
	c := &Consumer{cfg: cfg, now: cfg.Now, log: discardLogger(cfg.Logger), backends: make(map[string]*backendQueue)}
	if lr, ok := cfg.Sink.(events.LossReporter); ok && cfg.LossCheckInterval > 0 {
		c.loss = lr
	}
	if c.now == nil {
		c.now = time.Now
	}
	c.srcs = events.NewSourceSet(c.now)
	c.items.New = func() any { return new(item) }
	c.topic = []byte(cfg.Topic)

	if bind {
		lcfgs := cfg.Listeners
		if cfg.Bind != "" {
			lcfgs = append([]Listener{{Bind: cfg.Bind, TopicBackend: cfg.TopicBackend,
				DefaultBackend: cfg.DefaultBackend, Backends: cfg.Backends, Model: cfg.Model}}, lcfgs...)
		}
		seen := make(map[string]int, len(lcfgs))
		for i, lc := range lcfgs {
			name := "Bind"
			if cfg.Bind == "" {
				name = fmt.Sprintf("Listeners[%d]", i)
			} else if i > 0 {
				name = fmt.Sprintf("Listeners[%d]", i-1)
			}
			if lc.Bind == "" {
				return nil, fmt.Errorf("%w: %s.Bind is required", events.ErrInvalidConfig, name)
			}
			for topic, backend := range lc.TopicBackend {
				if backend == "" {
					return nil, fmt.Errorf("%w: %s.TopicBackend[%q] is empty", events.ErrInvalidConfig, name, topic)
				}
			}
			l := &listener{cfg: lc, routes: make(map[string]*topicRoute), srcs: make(map[string]*boundSource),
				src: events.NewSource(events.SourceInfo{Transport: "zmq", Endpoint: lc.Bind, Topic: cfg.Topic}, c.now)}
			var err error
			if l.network, l.addr, err = parseEndpoint(lc.Bind, true); err != nil {
				return nil, fmt.Errorf("%w: %s.Bind: %w", events.ErrInvalidConfig, name, err)
			}
			if _, port, _ := net.SplitHostPort(l.addr); port != "0" || l.network != "tcp" {
				key := l.network + " " + l.addr
				if j, dup := seen[key]; dup {
					return nil, fmt.Errorf("%w: %s.Bind: %q has the address of an earlier listener (%q)", events.ErrInvalidConfig, name, lc.Bind, lcfgs[j].Bind)
				}
				seen[key] = i
			}
			c.lns = append(c.lns, l)
		}
	} else {
		seen := make(map[Endpoint]bool, len(cfg.Endpoints))
		for i, ep := range cfg.Endpoints {
			if ep.Backend == "" {
				return nil, fmt.Errorf("%w: Endpoints[%d]: Backend is required", events.ErrInvalidConfig, i)
			}
			if seen[ep] {
				return nil, fmt.Errorf("%w: Endpoints[%d]: duplicate of an earlier endpoint", events.ErrInvalidConfig, i)
			}
			seen[ep] = true
			p := &publisher{idx: i, cfg: ep}
			var err error
			if p.network, p.addr, err = parseEndpoint(ep.Endpoint, false); err != nil {
				return nil, fmt.Errorf("%w: Endpoints[%d].Endpoint: %w", events.ErrInvalidConfig, i, err)
			}
			if ep.ReplayEndpoint != "" {
				if p.replayNet, p.replayAddr, err = parseEndpoint(ep.ReplayEndpoint, false); err != nil {
					return nil, fmt.Errorf("%w: Endpoints[%d].ReplayEndpoint: %w", events.ErrInvalidConfig, i, err)
				}
			}
			p.src = c.srcs.Add(events.SourceInfo{Backend: ep.Backend, Transport: "zmq", Endpoint: ep.Endpoint, Topic: cfg.Topic})
			p.be, _ = c.backend(ep.Backend)
			if p.be.first == nil {
				p.be.first = p.src
			}
			c.pubs = append(c.pubs, p)
		}
	}
	if err := c.srcs.RegisterMetrics(cfg.MeterProvider); err != nil {
		return nil, err
	}
	if err := c.registerListenerMetrics(); err != nil {
		_ = c.srcs.Close()
		return nil, err
	}
	c.life.Init()
	return c, nil
}

func setDefault[T int | int64 | time.Duration](v *T, def T) {
	if *v == 0 {
		*v = def
	}
}

// discardLogger returns l, or a logger that drops everything when l is nil.
func discardLogger(l *slog.Logger) *slog.Logger {
	if l != nil {
		return l
	}
	return slog.New(slog.DiscardHandler)
}

// parseEndpoint maps "tcp://host:port" to ("tcp", "host:port") and "ipc://path" to
// ("unix", "path"). A bind address may use "*" for every interface, an empty host for loopback
// (127.0.0.1) and port 0 for a free port; a connect address needs a host and a port.
func parseEndpoint(ep string, bind bool) (network, addr string, err error) {
	scheme, rest, ok := strings.Cut(ep, "://")
	if !ok {
		return "", "", fmt.Errorf("%q: want tcp://host:port or ipc://path", ep)
	}
	switch scheme {
	case "ipc":
		if rest == "" {
			return "", "", fmt.Errorf("%q: empty ipc path", ep)
		}
		return "unix", rest, nil
	case "tcp":
		host, port, err := net.SplitHostPort(rest)
		if err != nil {
			return "", "", fmt.Errorf("%q: %w", ep, err)
		}
		if bind && (port == "*" || port == "") {
			port = "0"
		}
		n, err := strconv.ParseUint(port, 10, 16)
		if err != nil {
			return "", "", fmt.Errorf("%q: bad port %q", ep, port)
		}
		switch {
		case host == "*" && bind:
			host = ""
		case host == "" && bind:
			host = "127.0.0.1" // every interface only when asked for
		case host == "*" || (host == "" && !bind):
			return "", "", fmt.Errorf("%q: a connect endpoint needs a host (a * endpoint is bound by the engine: connect to its address)", ep)
		case n == 0 && !bind:
			return "", "", fmt.Errorf("%q: a connect endpoint needs a port", ep)
		}
		return "tcp", net.JoinHostPort(host, port), nil
	default:
		return "", "", fmt.Errorf("%q: unsupported transport %q (want tcp or ipc)", ep, scheme)
	}
}

// ParseTopic splits an llm-d topic "kv@<pod>@<model>" into pod and model (model may contain '@'
// and may be absent: "kv@<pod>"). ok is false for any other topic, including an empty pod.
func ParseTopic(topic string) (pod, model string, ok bool) {
	rest, found := strings.CutPrefix(topic, "kv@")
	if !found {
		return "", "", false
	}
	pod, model, _ = strings.Cut(rest, "@")
	if pod == "" {
		return "", "", false
	}
	return pod, model, true
}

// backend returns the backend's queue, creating it on first use and reporting whether it did;
// the caller sets the first source of a new backend and starts its worker.
func (c *Consumer) backend(name string) (be *backendQueue, created bool) {
	c.backendsMu.Lock()
	defer c.backendsMu.Unlock()
	if be := c.backends[name]; be != nil {
		return be, false
	}
	be = &backendQueue{
		queue:  make(chan *item, c.cfg.QueueSize),
		wake:   make(chan struct{}, 1),
		lost:   make(map[lostKey]lostBatch),
		w:      events.NewBackendWriter(c.cfg.Sink, name),
		chains: make(map[chainKey]*chain),
		done:   make(map[uint64]uint64),
	}
	c.backends[name] = be
	return be, true
}

// Start starts the consumer's goroutines and returns. In bind mode it binds every address first
// and returns the first bind error, if any, having closed the addresses it bound (ctx bounds the
// binds; Start may then be called again); in connect mode it does not wait for any connection:
// unreachable engines are retried in the background (see Status). Cancelling ctx after Start
// returns has no effect: stop the consumer with Close. It returns events.ErrStarted after a successful
// Start and events.ErrClosed after Close.
func (c *Consumer) Start(ctx context.Context) error {
	return c.life.Start(func() error {
		if len(c.lns) > 0 {
			lns := make([]net.Listener, 0, len(c.lns))
			for _, l := range c.lns {
				var lc net.ListenConfig
				ln, err := lc.Listen(ctx, l.network, l.addr)
				if err != nil {
					for i, ln := range lns {
						ln.Close()
						c.lns[i].ln.Store(nil)
						c.lns[i].src.SetState(events.StateDisconnected)
					}
					l.src.SetError(err)
					l.src.SetState(events.StateDisconnected)
					return fmt.Errorf("events: zmq bind %s: %w", l.cfg.Bind, err)
				}
				lns = append(lns, ln)
				l.bound = l.cfg.Bind
				if a, ok := ln.Addr().(*net.TCPAddr); ok {
					l.bound = "tcp://" + a.String()
				}
				l.ln.Store(&ln)
				l.src.SetState(events.StateConnected)
				if a, ok := ln.Addr().(*net.TCPAddr); ok && a.IP.IsUnspecified() {
					c.log.Warn("kvroute events: zmq endpoint bound on every interface: anyone who can reach it can feed, reset "+
						"and poison the KV index of the backends its messages may name (ZMQ's NULL mechanism authenticates no one); "+
						"bind the pod's own address or loopback, and let only the engines reach the port (a NetworkPolicy, a firewall)",
						"bind", l.cfg.Bind, "bound", l.bound)
				}
			}
			for i, l := range c.lns {
				ln := lns[i]
				context.AfterFunc(c.life.Context(), func() { ln.Close() })
				c.life.Go(func() { c.acceptLoop(l, ln) })
			}
			return nil
		}
		c.backendsMu.Lock()
		for _, be := range c.backends {
			c.life.Go(func() { c.work(be) })
		}
		c.backendsMu.Unlock()
		for _, p := range c.pubs {
			c.life.Go(func() { c.runPublisher(p) })
		}
		return nil
	})
}

// Close stops every goroutine and closes every connection, waiting for them; a batch being
// applied is finished first (the sink sees a cancelled ctx). Queued batches are discarded.
// Close is idempotent; it returns the error of unregistering the metric callback, if any.
func (c *Consumer) Close() error {
	if !c.life.Shutdown() {
		return nil
	}
	err := c.srcs.Close()
	if c.lnReg != nil {
		err = errors.Join(err, c.lnReg.Unregister())
	}
	for _, l := range c.lns {
		l.src.SetState(events.StateClosed)
	}
	return err
}

// Status returns a snapshot of every source: one per endpoint in connect mode (in
// configuration order), one per bound address and backend seen on it in bind mode (in order of
// first message; its Endpoint is the bound address, port resolved). Safe for concurrent use; it
// never blocks on the network.
func (c *Consumer) Status() []events.SourceStatus { return c.srcs.Status() }

// Listener returns the status of the first bound socket in bind mode (ok false in connect mode);
// see Listeners.
func (c *Consumer) Listener() (st events.ListenerStatus, ok bool) {
	if len(c.lns) == 0 {
		return events.ListenerStatus{}, false
	}
	return c.lns[0].status(), true
}

// Listeners returns the status of each bound socket in bind mode, Bind's first and then those of
// Listeners in order (nil in connect mode): its connection state (connected while it is bound),
// and its messages by outcome: placed on a backend, unplaced (a topic that maps to no backend,
// or over MaxTopics) and malformed (bad framing, before the topic is known). The last two are
// dropped, and belong to no backend's source. Safe for concurrent use.
func (c *Consumer) Listeners() []events.ListenerStatus {
	if len(c.lns) == 0 {
		return nil
	}
	out := make([]events.ListenerStatus, len(c.lns))
	for i, l := range c.lns {
		out[i] = l.status()
	}
	return out
}

// status returns the listener's events.ListenerStatus.
func (l *listener) status() events.ListenerStatus {
	st := l.src.Status()
	out := events.ListenerStatus{Transport: "zmq", Endpoint: l.cfg.Bind, Connection: st.Connection,
		LastError: st.LastError, LastErrorAt: st.LastErrorAt}
	if a := l.addrOf(); a != nil {
		out.Bound = l.network + "://" + a.String()
		if l.network == "unix" {
			out.Bound = "ipc://" + a.String()
		}
	}
	m := &out.Messages
	m.Placed, m.Unplaced, m.Malformed = l.placed.Load(), l.unplaced.Load(), l.malformed.Load()
	m.Received = m.Placed + m.Unplaced + m.Malformed
	return out
}

// registerListenerMetrics registers telemetry.MetricConsumerListenerMessages, observed from the
// listeners' counts, in bind mode.
func (c *Consumer) registerListenerMetrics() error {
	if len(c.lns) == 0 || c.cfg.MeterProvider == nil {
		return nil
	}
	meter := c.cfg.MeterProvider.Meter("github.com/kvroute/kvroute/events")
	ctr, err := meter.Int64ObservableCounter(telemetry.MetricConsumerListenerMessages,
		metric.WithDescription("Messages a bound address received, by outcome: placed on a backend, unplaced (no backend for the topic: dropped), malformed (bad framing: dropped)."),
		metric.WithUnit("{message}"))
	if err != nil {
		return fmt.Errorf("events: metric %s: %w", telemetry.MetricConsumerListenerMessages, err)
	}
	type obs struct {
		n   *atomic.Uint64
		opt metric.ObserveOption
	}
	var all []obs
	for _, l := range c.lns {
		for _, o := range []struct {
			outcome string
			n       *atomic.Uint64
		}{{"placed", &l.placed}, {"unplaced", &l.unplaced}, {"malformed", &l.malformed}} {
			all = append(all, obs{o.n, metric.WithAttributeSet(attribute.NewSet(
				attribute.String("endpoint", l.cfg.Bind), attribute.String("outcome", o.outcome)))})
		}
	}
	c.lnReg, err = meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		for _, a := range all {
			o.ObserveInt64(ctr, int64(a.n.Load()), a.opt)
		}
		return nil
	}, ctr)
	if err != nil {
		return fmt.Errorf("events: metric callback: %w", err)
	}
	return nil
}

// Addr returns the first bound address in bind mode once Start succeeded, nil otherwise; see
// Addrs.
func (c *Consumer) Addr() net.Addr {
	if len(c.lns) == 0 {
		return nil
	}
	return c.lns[0].addrOf()
}

// Addrs returns the bound addresses in bind mode, in the order of Listeners (Bind's first), once
// Start succeeded; nil in connect mode or before Start.
func (c *Consumer) Addrs() []net.Addr {
	if len(c.lns) == 0 || c.lns[0].addrOf() == nil {
		return nil
	}
	out := make([]net.Addr, len(c.lns))
	for i, l := range c.lns {
		out[i] = l.addrOf()
	}
	return out
}

// addrOf returns the listener's bound address, nil when it is not bound.
func (l *listener) addrOf() net.Addr {
	if ln := l.ln.Load(); ln != nil {
		return (*ln).Addr()
	}
	return nil
}

// runPublisher is the connect-mode reader of one endpoint: dial, subscribe, read until the
// connection fails, back off, repeat until Close.
func (c *Consumer) runPublisher(p *publisher) {
	ctx := c.life.Context()
	bo := run.Backoff{Initial: c.cfg.InitialBackoff, Max: c.cfg.MaxBackoff}
	for attempt := 0; ; attempt++ {
		if attempt > 0 {
			p.src.Reconnects.Add(1)
		}
		p.src.SetState(events.StateConnecting)
		connected := false
		raw, zc, err := c.dialZMTP(ctx, p.network, p.addr, zmq4.Sub)
		if err == nil {
			err = subscribe(zc, c.cfg.Topic)
			if err == nil {
				connected = true
				bo.Reset()
				p.src.SetState(events.StateConnected)
				c.log.Debug("kvroute events: zmq connected", "backend", p.cfg.Backend, "endpoint", p.cfg.Endpoint)
				err = c.readPublisher(ctx, raw, zc, p)
			}
			raw.Close()
		}
		if ctx.Err() != nil {
			return
		}
		p.src.SetError(err)
		p.src.SetState(events.StateDisconnected)
		if connected {
			c.queueReset(ctx, p.be, &p.sent, p.src, uint64(p.idx))
			c.log.Warn("kvroute events: zmq connection lost", "backend", p.cfg.Backend, "endpoint", p.cfg.Endpoint, "err", err)
		} else {
			c.log.Debug("kvroute events: zmq connect failed", "backend", p.cfg.Backend, "endpoint", p.cfg.Endpoint, "err", err)
		}
		if !run.Sleep(ctx, bo.Next()) {
			return
		}
	}
}

// queueReset tells the backend's worker, in order with the batches, that connection conn was
// lost: what the engine publishes until it is back is lost too (a PUB socket drops messages for
// absent subscribers), and an engine that restarts comes back with an empty cache, so the
// backend is cleared now rather than left stale, and the connection's chains are forgotten. It
// waits for room in the queue (or Close). sent is the reader's stamp counter for be.
func (c *Consumer) queueReset(ctx context.Context, be *backendQueue, sent *uint64, src *events.Source, conn uint64) {
	it := c.items.Get().(*item)
	stamp := *sent + 1
	it.src, it.conn, it.reset, it.stamp = src, conn, true, stamp
	select {
	case be.queue <- it: // the worker's now
		*sent = stamp
	case <-ctx.Done():
		c.putItem(it)
	}
}

// readPublisher reads one connect-mode connection until it fails or ctx ends.
func (c *Consumer) readPublisher(ctx context.Context, raw net.Conn, zc *zmq4.Conn, p *publisher) error {
	stop := context.AfterFunc(ctx, func() { raw.Close() })
	defer stop()
	var topic, model string
	haveTopic := false
	for {
		msg, err := zc.RecvMsg()
		if err != nil {
			return err
		}
		if msg.Type == zmq4.CmdMsg {
			continue
		}
		f := msg.Frames
		if len(f) != 3 || len(f[1]) != 8 {
			p.src.Malformed.Add(1)
			p.src.SetError(fmt.Errorf("%w: zmq message of %d frames (want [topic, 8-byte seq, payload])", events.ErrMalformed, len(f)))
			continue
		}
		if !bytes.HasPrefix(f[0], c.topic) {
			continue
		}
		if !haveTopic || string(f[0]) != topic {
			topic, model, haveTopic = string(f[0]), p.cfg.Model, true
			if _, m, ok := ParseTopic(topic); ok && model == "" {
				model = m
			}
		}
		c.ingest(p.src, p.be, &p.sent, p, uint64(p.idx), topic, model, f[1], f[2])
	}
}

// acceptLoop accepts engine connections on one bound address.
func (c *Consumer) acceptLoop(l *listener, ln net.Listener) {
	ctx := c.life.Context()
	maxConns := int64(4 * c.cfg.MaxTopics)
	for {
		raw, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			l.src.SetError(err)
			if !run.Sleep(ctx, 50*time.Millisecond) {
				return
			}
			continue
		}
		if c.conns.Add(1) > maxConns {
			c.conns.Add(-1)
			l.src.SetError(fmt.Errorf("connection from %s refused: %d connections open", raw.RemoteAddr(), maxConns))
			raw.Close()
			continue
		}
		c.life.Go(func() {
			defer c.conns.Add(-1)
			c.serveBound(ctx, l, raw)
		})
	}
}

// serveBound reads one engine connection of listener l.
func (c *Consumer) serveBound(ctx context.Context, l *listener, raw net.Conn) {
	stop := context.AfterFunc(ctx, func() { raw.Close() })
	defer stop()
	defer raw.Close()
	zc, err := c.handshake(ctx, raw, zmq4.Sub, true)
	if err == nil {
		err = subscribe(zc, c.cfg.Topic)
	}
	if err != nil {
		if ctx.Err() == nil {
			l.src.SetError(fmt.Errorf("zmq handshake with %s: %w", raw.RemoteAddr(), err))
		}
		return
	}
	c.log.Debug("kvroute events: zmq publisher connected", "remote", raw.RemoteAddr().String(), "bound", l.bound)
	conn := c.connIDs.Add(1)
	var seen []*feed // backends this connection carried: connected while it is open
	defer func() {
		if ctx.Err() != nil {
			return
		}
		for _, f := range seen {
			if f.src.liveConns.Add(-1) == 0 {
				f.src.SetState(events.StateDisconnected)
			}
			c.queueReset(ctx, f.be, &f.sent, f.src.Source, conn)
		}
	}()
	var last *topicRoute
	var lastFeed *feed
	for {
		msg, err := zc.RecvMsg()
		if err != nil {
			if ctx.Err() == nil && !errors.Is(err, io.EOF) {
				l.src.SetError(fmt.Errorf("zmq connection from %s: %w", raw.RemoteAddr(), err))
			}
			return
		}
		if msg.Type == zmq4.CmdMsg {
			continue
		}
		f := msg.Frames
		if len(f) != 3 || len(f[1]) != 8 {
			l.malformed.Add(1)
			l.src.SetError(fmt.Errorf("%w: zmq message of %d frames from %s (want [topic, 8-byte seq, payload])", events.ErrMalformed, len(f), raw.RemoteAddr()))
			continue
		}
		if !bytes.HasPrefix(f[0], c.topic) {
			continue
		}
		r := last
		if r == nil || string(f[0]) != r.topic {
			if r = c.route(l, f[0]); r == nil {
				l.unplaced.Add(1)
				l.src.SetError(fmt.Errorf("topic %q maps to no backend", f[0]))
				continue
			}
			last = r
			i := slices.IndexFunc(seen, func(f *feed) bool { return f.be == r.be })
			if i >= 0 {
				lastFeed = seen[i]
			} else {
				lastFeed = &feed{be: r.be, src: r.src}
				seen = append(seen, lastFeed)
				if r.src.liveConns.Add(1) == 1 {
					if r.src.EverConnected() {
						r.src.Reconnects.Add(1)
					}
					r.src.SetState(events.StateConnected)
				}
			}
		}
		l.placed.Add(1)
		c.ingest(r.src.Source, r.be, &lastFeed.sent, nil, conn, r.topic, r.model, f[1], f[2])
	}
}

// route returns where a topic of listener l goes, creating the backend and its source on the
// listener on first sight; nil when the topic maps to no backend or MaxTopics is reached.
func (c *Consumer) route(l *listener, topic []byte) *topicRoute {
	c.routesMu.RLock()
	r := l.routes[string(topic)]
	c.routesMu.RUnlock()
	if r != nil {
		return r
	}
	t := string(topic)
	backend, model := l.cfg.TopicBackend[t], l.cfg.Model
	if backend == "" {
		pod, m, ok := ParseTopic(t)
		if ok && m != "" {
			model = m
		}
		switch {
		case l.cfg.DefaultBackend != "":
			backend = l.cfg.DefaultBackend
		case ok && (len(l.cfg.Backends) == 0 || slices.Contains(l.cfg.Backends, pod)):
			backend = pod
		}
	}
	if backend == "" {
		if l.src.WarnDue() {
			c.log.Warn("kvroute events: zmq topic maps to no known backend; its events are dropped (set topic_backends or the source's backend_name)",
				"topic", t, "bound", l.bound)
		}
		return nil
	}
	c.routesMu.Lock()
	defer c.routesMu.Unlock()
	if r = l.routes[t]; r != nil {
		return r
	}
	if c.nroutes >= c.cfg.MaxTopics {
		return nil
	}
	be, created := c.backend(backend)
	src := l.srcs[backend]
	if src == nil {
		src = &boundSource{Source: c.srcs.Add(events.SourceInfo{Backend: backend, Transport: "zmq", Endpoint: l.bound, Topic: t})}
		l.srcs[backend] = src
	}
	if created {
		be.first = src.Source
		c.life.Go(func() { c.work(be) })
	}
	r = &topicRoute{topic: t, model: model, be: be, src: src}
	l.routes[t] = r
	c.nroutes++
	return r
}

// ingest decodes one message and queues it for the backend's worker; sent is the reader's
// stamp counter for be. A batch that cannot be queued (undecodable, queue full) is recorded as
// lost, for the worker to replay or reset.
func (c *Consumer) ingest(src *events.Source, be *backendQueue, sent *uint64, p *publisher, conn uint64, topic, model string, seqFrame, payload []byte) {
	seq := binary.BigEndian.Uint64(seqFrame)
	src.Batches.Add(1)
	src.LastSeq.Store(seq)
	lose := func(err error) {
		src.Malformed.Add(1)
		src.SetError(fmt.Errorf("batch %d: %w", seq, err))
		if src.WarnDue() {
			c.log.Warn("kvroute events: batch dropped", "backend", src.Info().Backend, "endpoint", src.Info().Endpoint, "seq", seq, "bytes", len(payload), "err", err)
		}
		c.loseBatch(be, lostKey{chain: chainKey{conn: conn, topic: topic}, anyRank: true},
			lostBatch{src: src, pub: p, model: model, seq: seq, ticket: *sent})
	}
	if err := c.checkFrameSize(payload); err != nil {
		lose(err)
		return
	}
	it := c.items.Get().(*item)
	skipped, err := events.DecodeMsgpackBatch(payload, &it.b)
	if err != nil {
		c.putItem(it)
		lose(err)
		return
	}
	n := uint64(len(it.b.Events))
	if skipped > 0 {
		src.Malformed.Add(uint64(skipped))
		src.Dropped.Add(uint64(skipped))
	}
	src.Received.Add(n + uint64(skipped))
	src.Touch()
	it.b.Seq, it.b.Model = seq, model
	stamp := *sent + 1
	it.src, it.pub, it.conn, it.topic, it.stamp = src, p, conn, topic, stamp
	select {
	case be.queue <- it: // the worker's now
		*sent = stamp
	default:
		src.QueueOverflows.Add(1)
		src.Dropped.Add(n)
		key := lostKey{chain: chainKeyOf(conn, topic, &it.b)}
		c.putItem(it)
		c.loseBatch(be, key, lostBatch{src: src, pub: p, model: model, seq: seq, ticket: *sent})
	}
}

// checkFrameSize returns an error wrapping events.ErrMalformed when payload exceeds MaxFrameBytes.
func (c *Consumer) checkFrameSize(payload []byte) error {
	if len(payload) > c.cfg.MaxFrameBytes {
		return fmt.Errorf("%w: payload of %d bytes exceeds MaxFrameBytes (%d), dropped undecoded", events.ErrMalformed, len(payload), c.cfg.MaxFrameBytes)
	}
	return nil
}

// loseBatch records a batch the reader could not queue and wakes the worker. A later loss on
// the same chain replaces the earlier one. When lost is full (maxChainsPerPipe chains) the loss
// is not recorded: the publisher's next batch reveals it.
func (c *Consumer) loseBatch(be *backendQueue, k lostKey, l lostBatch) {
	be.lostMu.Lock()
	if _, ok := be.lost[k]; ok || len(be.lost) < maxChainsPerPipe {
		be.lost[k] = l
		be.nlost.Store(int32(len(be.lost)))
	}
	be.lostMu.Unlock()
	select {
	case be.wake <- struct{}{}:
	default: // the worker has a wake-up pending already
	}
}

func (c *Consumer) putItem(it *item) {
	it.src, it.pub, it.topic, it.reset, it.stamp = nil, nil, "", false, 0
	c.items.Put(it)
}

// work is a backend's worker: it applies the queued batches in order, repairs the holes lost
// batches left, and heals the backend when the sink lost it, until Close.
func (c *Consumer) work(be *backendQueue) {
	ctx := c.life.Context()
	var tick <-chan time.Time
	if c.loss != nil {
		t := time.NewTicker(c.cfg.LossCheckInterval)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick:
			c.checkLost(ctx, be)
		case it := <-be.queue:
			c.handle(ctx, be, it)
			if it.reset && it.pub == nil {
				delete(be.done, it.conn) // a bind-mode connection's reset is its last item
			} else {
				be.done[it.conn] = it.stamp
			}
			c.putItem(it)
		case <-be.wake:
		}
		if be.nlost.Load() > 0 {
			c.handleLost(ctx, be)
		}
	}
}

// handle checks the batch's sequence against its publisher's chain, catches up before a new
// chain's first batch, repairs a gap (replay) or requests a reset, then applies the batch.
func (c *Consumer) handle(ctx context.Context, be *backendQueue, it *item) {
	src, seq := it.src, it.b.Seq
	if it.reset {
		// The connection's chains start over with its next batch; the batches it lost before
		// (queued before this item) are moot: the backend is cleared.
		for k := range be.chains {
			if k.conn == it.conn {
				delete(be.chains, k)
			}
		}
		if be.nlost.Load() > 0 {
			be.lostMu.Lock()
			for k, l := range be.lost {
				if k.chain.conn == it.conn && l.ticket < it.stamp {
					delete(be.lost, k)
				}
			}
			be.nlost.Store(int32(len(be.lost)))
			be.lostMu.Unlock()
		}
		c.requestReset(be, src)
		var empty events.Batch
		be.w.Apply(ctx, src, &empty)
		return
	}
	key := chainKeyOf(it.conn, it.topic, &it.b)
	ch := be.chains[key]
	if ch != nil && ch.caught != catchUpFailed && (be.w.ResetPending() || ch.clears != be.w.Clears() || ch.caught == catchUpStopped) {
		// The backend was cleared, or is to be, since this chain's last batch, for a cause not its
		// own (a sink failure, a reset on another of the backend's chains): once the clear has
		// been done, the chain catches up again, so that the sink relearns what the engine still
		// holds in its replay buffer instead of waiting for the blocks to be stored again. While
		// the sink cannot even be cleared (it is down) nothing is replayed. A catch-up that the
		// sink stopped is tried again. When the clear fails and the publisher can replay, the
		// batch is dropped with it (and taken as seen: the catch-up after the next clear covers
		// it): were it applied, its own Apply would retry the clear, and a sink that came back in
		// between would be cleared without the catch-up (a Redis index just out of its backoff,
		// say). Without a catch-up to come, the batch's own Apply retries the clear, as after a
		// gap.
		var empty events.Batch
		switch {
		case be.w.Apply(ctx, src, &empty):
			ok, applied, caught := c.catchUp(ctx, be, src, it.pub, it.b.Model, key.rank, seq)
			if !ok {
				return
			}
			ch.caught = caught
			if applied > 0 && caught != catchUpFailed && seq > ch.last {
				ch.last = seq - 1
			}
			ch.clears = be.w.Clears()
		case c.canCatchUp(it.pub):
			src.Dropped.Add(uint64(len(it.b.Events)))
			ch.last, ch.src, ch.pub, ch.model = max(ch.last, seq), src, it.pub, it.b.Model
			return
		}
	}
	switch {
	case ch == nil: // first batch of this publisher: catch up on what came before, then the baseline
		if len(be.chains) >= maxChainsPerPipe {
			clear(be.chains)
		}
		ch = &chain{src: src, pub: it.pub, model: it.b.Model}
		be.chains[key] = ch
		ok, _, caught := c.catchUp(ctx, be, src, it.pub, it.b.Model, key.rank, seq)
		if !ok {
			return
		}
		ch.caught = caught
	case seq == ch.last+1:
	case seq > ch.last+1:
		if !c.fillGap(ctx, be, src, it.pub, replayRange{model: it.b.Model, rank: key.rank, from: ch.last + 1, until: seq}) {
			return
		}
	default: // seq ≤ last: the publisher restarted, and its engine's cache with it
		c.log.Debug("kvroute events: sequence went back, resetting backend", "backend", be.w.Backend(), "last", ch.last, "seq", seq)
		c.requestReset(be, src)
	}
	ch.last, ch.src, ch.pub, ch.model = seq, src, it.pub, it.b.Model
	be.w.Apply(ctx, src, &it.b)
	ch.clears = be.w.Clears() // a reset this batch's own handling caused is no cause to catch up
}

// requestReset asks the backend's writer to clear it before its next batch, on src's behalf
// (a gap, a sequence that went back, a lost connection), within the backend's reset budget
// (Config.MaxResetsPerMinute): a bucket of MaxResetsPerMinute tokens refilled at that rate. A
// reset already pending takes the request in, at no cost; one over the budget is not made, and
// is counted on src (ResetsLimited). Called by the backend's worker.
func (c *Consumer) requestReset(be *backendQueue, src *events.Source) {
	if be.w.ResetPending() {
		return
	}
	if n := float64(c.cfg.MaxResetsPerMinute); n > 0 {
		now := c.now()
		switch {
		case be.resetAt.IsZero():
			be.resetTokens = n
		case now.After(be.resetAt):
			be.resetTokens = min(n, be.resetTokens+now.Sub(be.resetAt).Minutes()*n)
		}
		be.resetAt = now
		if be.resetTokens < 1 {
			src.ResetsLimited.Add(1)
			if src.WarnDue() {
				c.log.Warn("kvroute events: reset refused, the backend's reset budget is spent; its index entries are kept as they are",
					"backend", be.w.Backend(), "endpoint", src.Info().Endpoint, "max_resets_per_minute", c.cfg.MaxResetsPerMinute,
					"resets_limited", src.ResetsLimited.Load())
			}
			return
		}
		be.resetTokens--
	}
	be.w.RequestReset()
}

// checkLost heals the backend when the sink reports it lost (events.LossReporter), or when a clear is
// pending and no batch has come to do it (a failed Apply of a publisher that went quiet).
func (c *Consumer) checkLost(ctx context.Context, be *backendQueue) {
	if !be.w.ResetPending() && !be.healOwed {
		lost, err := c.loss.BackendLost(ctx, be.w.Backend())
		if err != nil || !lost {
			return // not known: asked again at the next tick
		}
	}
	c.heal(ctx, be)
}

// heal clears the backend, then catches each chain up on the batches through the last one it
// applied, from its publisher's replay endpoint: what the engine still holds is learnt again
// without waiting for its next batch. A clear that fails is tried again at the next check (and
// before the next batch). When a catch-up fails part-way, the backend is cleared again and the
// chains catch up on their next batch, as after any reset; when the sink stops it (a refused
// batch), the backend is cleared again and healed again at the next check (healOwed), since an
// engine whose requests all hit its cache publishes no batch to catch up on.
func (c *Consumer) heal(ctx context.Context, be *backendQueue) {
	src := be.first
	for _, ch := range be.chains {
		src = ch.src
		break
	}
	if src == nil {
		return
	}
	c.log.Info("kvroute events: the sink lost the backend's entries: clearing it and catching up", "backend", be.w.Backend())
	be.healOwed = false
	var empty events.Batch
	be.w.RequestReset()
	if !be.w.Apply(ctx, src, &empty) {
		return
	}
	for key, ch := range be.chains {
		ok, _, caught := c.catchUp(ctx, be, ch.src, ch.pub, ch.model, key.rank, ch.last+1)
		if !ok {
			return
		}
		ch.caught = caught
		if be.w.ResetPending() {
			be.healOwed = caught == catchUpStopped
			break
		}
		ch.clears = be.w.Clears()
	}
	if be.w.ResetPending() && ctx.Err() == nil {
		be.w.Apply(ctx, src, &empty)
	}
}

// handleLost repairs the holes of the lost batches whose connection's earlier items have all
// been handled (the others wait for those items, which are still queued).
func (c *Consumer) handleLost(ctx context.Context, be *backendQueue) {
	be.lostMu.Lock()
	ready := be.ready[:0]
	for k, l := range be.lost {
		if be.done[k.chain.conn] >= l.ticket {
			ready = append(ready, lostEntry{k, l})
			delete(be.lost, k)
		}
	}
	be.nlost.Store(int32(len(be.lost)))
	be.lostMu.Unlock()
	for i := range ready {
		if ctx.Err() != nil {
			break
		}
		c.repairLost(ctx, be, ready[i].key, &ready[i].lostBatch)
	}
	clear(ready) // drop the references to sources and publishers
	be.ready = ready[:0]
}

// repairLost handles batch l, lost on chain k, as if the publisher's next batch had revealed the
// hole: the missing batches through l.seq are replayed, or the backend is reset, now. A loss
// before the chain's baseline is ignored (the chain starts after it), and so is one a later
// batch already revealed. An undecodable batch belongs to the connection and topic's only chain;
// when several data-parallel ranks share them the hole cannot be placed, and the backend is
// reset (the chain's next batch still sees the gap).
func (c *Consumer) repairLost(ctx context.Context, be *backendQueue, k lostKey, l *lostBatch) {
	var empty events.Batch
	ch, rank := be.chains[k.chain], k.chain.rank
	if k.anyRank {
		ch = nil
		n := 0
		for ck, cc := range be.chains {
			if ck.conn == k.chain.conn && ck.topic == k.chain.topic {
				ch, rank, n = cc, ck.rank, n+1
			}
		}
		if n > 1 {
			l.src.Gaps.Add(1)
			c.log.Debug("kvroute events: undecodable batch of an unknown rank, resetting backend", "backend", be.w.Backend(), "seq", l.seq)
			c.requestReset(be, l.src)
			be.w.Apply(ctx, l.src, &empty)
			return
		}
	}
	if ch == nil || l.seq <= ch.last {
		return
	}
	owed := be.w.ResetPending() // a clear for another cause, which the chain must catch up after
	if !c.fillGap(ctx, be, l.src, l.pub, replayRange{model: l.model, rank: rank, from: ch.last + 1, until: l.seq + 1}) {
		return
	}
	ch.last = l.seq
	be.w.Apply(ctx, l.src, &empty) // a reset fillGap requested happens now
	if !owed {
		ch.clears = be.w.Clears()
	}
}

// replayRange is a request to a publisher's replay endpoint: the batches [from, until) of the
// chain of data-parallel rank rank (-1: the batches name none), whose block keys model roots.
type replayRange struct {
	model       string
	rank        int
	from, until uint64
	// catchUp accepts a replay that starts after from (the publisher no longer holds the
	// start), and bounds it by CatchUpTimeout instead of ReplayTimeout.
	catchUp bool
}

// fillGap repairs the hole [r.from, r.until) in a publisher's sequence: it replays the missing
// batches when the publisher (connect mode) has a replay endpoint, and otherwise, or when the
// replay fails, requests a reset. It reports false when ctx ended during the replay.
func (c *Consumer) fillGap(ctx context.Context, be *backendQueue, src *events.Source, p *publisher, r replayRange) bool {
	src.Gaps.Add(1)
	if p == nil || p.replayAddr == "" {
		c.log.Debug("kvroute events: sequence gap, resetting backend", "backend", be.w.Backend(), "from", r.from, "to", r.until)
		c.requestReset(be, src)
		return true
	}
	if _, err := c.replay(ctx, be, src, p, r); err != nil {
		if ctx.Err() != nil {
			return false
		}
		if errors.Is(err, errSinkFailed) {
			return true // the backend is cleared before the next batch
		}
		src.ReplayFailures.Add(1)
		src.SetError(fmt.Errorf("replay %d..%d: %w", r.from, r.until-1, err))
		c.log.Warn("kvroute events: replay failed, resetting backend", "backend", be.w.Backend(), "err", err)
		c.requestReset(be, src)
		return true
	}
	src.Replays.Add(1)
	return true
}

// canCatchUp reports whether a catch-up from publisher p can run: connect mode with a replay
// endpoint, and catch-up not disabled.
func (c *Consumer) canCatchUp(p *publisher) bool {
	return p != nil && p.replayAddr != "" && c.cfg.CatchUpBatches >= 0
}

// catchUp runs before the first batch of a chain, seq, is applied: it requests the up to
// CatchUpBatches batches before seq from the publisher's replay endpoint (connect mode) and
// applies them in order, so that the sink learns what the engine cached before this
// subscription. It does nothing for seq 0, without a replay endpoint, or with catch-up disabled.
//
// The replay may start later than asked (the publisher's buffer is shorter, or it restarted):
// what it holds is applied from its first batch on, as long as it is contiguous up to seq-1.
// A window that starts in the middle of the engine's history is safe: a BlockStored whose
// parent block the sink never saw is dropped by the index (kvindex.MemoryIndex.Apply counts it
// as unknown_parent), and a BlockRemoved of a block it does not hold is a no-op
// (unknown_block), so the window under-reports the blocks stored before it and never invents
// a chain.
//
// A catch-up that fails after applying some batches (timeout, a hole, a malformed batch, a lost
// connection) may have applied stores whose later removals are missing: the backend is reset
// before seq is applied. One that fails before applying any (typically: nothing listens on the
// replay endpoint) added nothing stale, and seq is simply the baseline. One that the sink
// stopped (an Apply failed: the backend is cleared before the next batch) is neither: it is
// tried again on the chain's next batch. It reports false when ctx ended (ok false), how many
// batches it applied, and how it ended.
func (c *Consumer) catchUp(ctx context.Context, be *backendQueue, src *events.Source, p *publisher, model string, rank int, seq uint64) (ok bool, applied int, caught catchUpOutcome) {
	if seq == 0 || !c.canCatchUp(p) {
		return true, 0, caughtUp
	}
	r := replayRange{model: model, rank: rank, from: seq - min(seq, uint64(c.cfg.CatchUpBatches)), until: seq, catchUp: true}
	n, err := c.replay(ctx, be, src, p, r)
	if errors.Is(err, errSinkFailed) {
		return true, n, catchUpStopped
	}
	if err != nil {
		if ctx.Err() != nil {
			return false, n, catchUpFailed
		}
		src.CatchUpFailures.Add(1)
		src.SetError(fmt.Errorf("catch-up %d..%d: %w", r.from, r.until-1, err))
		if n > 0 {
			c.log.Warn("kvroute events: catch-up failed, resetting backend", "backend", be.w.Backend(), "applied", n, "err", err)
			c.requestReset(be, src)
		} else {
			c.log.Warn("kvroute events: catch-up failed, starting from the live batch", "backend", be.w.Backend(), "seq", seq, "err", err)
		}
		return true, n, catchUpFailed
	}
	src.CatchUps.Add(1)
	src.CaughtUpBatches.Add(uint64(n))
	c.log.Info("kvroute events: caught up", "backend", be.w.Backend(), "endpoint", p.cfg.Endpoint, "batches", n, "seq", seq)
	return true, n, caughtUp
}

// replay requests the batches [r.from, r.until) from the publisher's replay endpoint and applies
// them in order; it returns how many it applied. It fails when the publisher no longer holds
// one of them (for a catch-up: one after the first it sends), on a malformed answer or a batch
// of another data-parallel rank than r.rank (the endpoint serves another publisher: vLLM has
// one replay socket per rank, and the answer names no topic), and after ReplayTimeout
// (CatchUpTimeout). A catch-up whose answer starts at or after r.until, or is empty, applies
// nothing and succeeds.
func (c *Consumer) replay(ctx context.Context, be *backendQueue, src *events.Source, p *publisher, r replayRange) (applied int, err error) {
	timeout := c.cfg.ReplayTimeout
	if r.catchUp {
		timeout = c.cfg.CatchUpTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	raw, zc, err := c.dialZMTP(ctx, p.replayNet, p.replayAddr, zmq4.Dealer)
	if err != nil {
		return 0, err
	}
	defer raw.Close()
	stop := context.AfterFunc(ctx, func() { raw.Close() })
	defer stop()
	var start [8]byte
	binary.BigEndian.PutUint64(start[:], r.from)
	if err := zc.SendMsg(zmq4.NewMsgFrom([]byte{}, start[:])); err != nil {
		return 0, err
	}
	b := &be.replayBuf
	for next := r.from; next < r.until; {
		msg, err := zc.RecvMsg()
		if err != nil {
			if ctx.Err() != nil {
				return applied, fmt.Errorf("no answer in %v: %w", timeout, ctx.Err())
			}
			return applied, err
		}
		if msg.Type == zmq4.CmdMsg {
			continue
		}
		f := msg.Frames
		if len(f) == 3 && len(f[0]) == 0 {
			f = f[1:] // the DEALER sees the ROUTER's empty delimiter
		}
		if len(f) != 2 || len(f[0]) != 8 {
			return applied, fmt.Errorf("%w: replay message of %d frames (want [\"\", seq, payload])", events.ErrMalformed, len(msg.Frames))
		}
		seq := binary.BigEndian.Uint64(f[0])
		switch {
		case seq == ReplayEndSeq && r.catchUp && applied == 0:
			return 0, nil // the publisher holds nothing before r.until
		case seq == ReplayEndSeq:
			return applied, fmt.Errorf("publisher no longer holds batch %d", next)
		case seq < next:
			continue
		case seq > next && (!r.catchUp || applied > 0):
			return applied, fmt.Errorf("publisher no longer holds batch %d (replay starts at %d)", next, seq)
		case seq >= r.until:
			return 0, nil // a catch-up: the publisher holds nothing before r.until
		}
		next = seq // a catch-up may start after r.from
		src.Batches.Add(1)
		if err := c.checkFrameSize(f[1]); err != nil {
			src.Malformed.Add(1)
			return applied, fmt.Errorf("replayed batch %d: %w", seq, err)
		}
		skipped, err := events.DecodeMsgpackBatch(f[1], b)
		if err != nil {
			src.Malformed.Add(1)
			return applied, fmt.Errorf("replayed batch %d: %w", seq, err)
		}
		if skipped > 0 {
			src.Malformed.Add(uint64(skipped))
			src.Dropped.Add(uint64(skipped))
		}
		src.Received.Add(uint64(len(b.Events) + skipped))
		if r.rank >= 0 && b.HasDPRank && b.DPRank != r.rank {
			src.Dropped.Add(uint64(len(b.Events)))
			return applied, fmt.Errorf("replayed batch %d is of data-parallel rank %d, not %d: the replay endpoint serves another publisher", seq, b.DPRank, r.rank)
		}
		b.Seq, b.Model = seq, r.model
		if !be.w.Apply(ctx, src, b) {
			// The sink failed, and the backend is to be cleared before its next batch: the rest
			// would be dropped as well.
			return applied, errSinkFailed
		}
		applied++
		next++
	}
	return applied, nil
}

// errSinkFailed ends a replay whose batch the sink did not take. It is not the publisher's
// failure: the backend is cleared before its next batch, and the chain catches up then.
var errSinkFailed = errors.New("the sink failed")

// dialZMTP connects to addr and performs the ZMTP handshake as typ.
func (c *Consumer) dialZMTP(ctx context.Context, network, addr string, typ zmq4.SocketType) (net.Conn, *zmq4.Conn, error) {
	d := net.Dialer{Timeout: c.cfg.DialTimeout}
	raw, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, nil, err
	}
	zc, err := c.handshake(ctx, raw, typ, false)
	if err != nil {
		raw.Close()
		return nil, nil, err
	}
	return raw, zc, nil
}

// handshake runs the ZMTP 3 greeting and NULL handshake on raw within DialTimeout (and ctx),
// reading through a guard that refuses frames above MaxMessageSize.
func (c *Consumer) handshake(ctx context.Context, raw net.Conn, typ zmq4.SocketType, server bool) (*zmq4.Conn, error) {
	if err := raw.SetDeadline(time.Now().Add(c.cfg.DialTimeout)); err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { raw.SetDeadline(time.Unix(1, 0)) })
	g := &frameGuard{Conn: raw, max: uint64(c.cfg.MaxMessageSize), greeting: zmtpGreetingLen}
	zc, err := zmq4.Open(g, null.Security(), typ, nil, server, nil)
	if !stop() {
		return nil, ctx.Err()
	}
	if err != nil {
		return nil, err
	}
	if err := raw.SetDeadline(time.Time{}); err != nil {
		return nil, err
	}
	return zc, nil
}

// subscribe sends a SUB subscription (ZMTP 3.0: a message whose first byte is 1).
func subscribe(zc *zmq4.Conn, topic string) error {
	return zc.SendMsg(zmq4.NewMsg(append([]byte{1}, topic...)))
}
