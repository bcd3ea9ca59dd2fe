package events

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
	"go.opentelemetry.io/otel/metric"
)

// Defaults of ZMQConfig.
const (
	DefaultZMQQueueSize      = 1024             // batches per backend
	DefaultZMQReplayTimeout  = 2 * time.Second  // one replay: dial, request, every missing batch
	DefaultZMQCatchUpBatches = 10000            // vLLM's default buffer_steps
	DefaultZMQCatchUpTimeout = 30 * time.Second // one catch-up: dial, request, every batch
	DefaultZMQInitialBackoff = 100 * time.Millisecond
	DefaultZMQMaxBackoff     = 30 * time.Second
	DefaultZMQDialTimeout    = 5 * time.Second // TCP connect plus ZMTP handshake
	DefaultZMQMaxMessageSize = 64 << 20        // bytes per ZMQ message
	DefaultZMQMaxTopics      = 1024            // distinct topics accepted in bind mode
	// DefaultZMQLossCheckInterval is how often a backend's worker asks a LossReporter sink
	// whether the backend's entries were lost.
	DefaultZMQLossCheckInterval = time.Second

	// DefaultMaxFrameBytes is the default ZMQConfig.MaxFrameBytes: the largest batch payload
	// decoded. vLLM's batches are a few KiB to a few MiB (one engine step).
	DefaultMaxFrameBytes = 16 << 20
)

// ReplayEndSeq is the sequence number of the message that ends a replay (all ones, -1 as a
// signed integer), sent with an empty payload.
const ReplayEndSeq = ^uint64(0)

const (
	zmtpGreetingLen  = 64  // ZMTP 3 greeting
	zmtpMaxFrames    = 64  // frames per message (KV events use 3)
	maxChainsPerPipe = 256 // publisher chains (topic × data-parallel rank) tracked per backend
)

// ZMQEndpoint is one engine publisher to connect to (pod-discovery mode). A data-parallel engine
// publishes one stream per rank (TCP port + rank): list each rank as an endpoint with the same
// Backend.
type ZMQEndpoint struct {
	// Backend is the routing backend the events belong to. Required.
	Backend string
	// Endpoint is the engine's PUB socket, "tcp://host:port" (or "ipc:///path"). Required.
	Endpoint string
	// ReplayEndpoint is the engine's replay ROUTER socket ("tcp://host:port"), used to fill
	// sequence gaps and to catch up on what the engine published before we subscribed (see
	// ZMQConfig.CatchUpBatches); "" disables both (a gap then resets the backend, and the first
	// batch is taken as is). It must be this publisher's own: vLLM offsets the replay port by
	// the data-parallel rank as it does the PUB port, and a replayed batch that names another
	// rank than the chain being repaired fails the replay.
	ReplayEndpoint string
	// Model roots the block keys of this publisher's events when they name no LoRA; "" uses the
	// model of a kv@<pod>@<model> topic, or the sink's default.
	Model string
}

// ZMQListener is one address a consumer binds in centralized mode, and the rules that place the
// messages arriving on it on backends. The backend of a message comes from its topic:
// TopicBackend[topic], else DefaultBackend, else <pod> of "kv@<pod>@<model>" when Backends names
// it (or Backends is empty). Messages of any other topic are counted on the listener's status
// (ZMQConsumer.Listeners), logged (at most once per 5 s) and dropped, never indexed under an
// invented name.
type ZMQListener struct {
	// Bind is the address the SUB socket binds, e.g. "tcp://0.0.0.0:5557" ("tcp://127.0.0.1:0"
	// picks a free port; see ZMQConsumer.Addrs) or "ipc:///path". Required.
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

// ZMQConfig configures a ZMQConsumer. Either Endpoints is set (pod-discovery mode: one SUB
// connection per engine), or Bind, Listeners or both (centralized mode: SUB sockets that engines
// connect to). Zero durations and sizes mean the Default* constants.
type ZMQConfig struct {
	// Sink receives the decoded batches. Required.
	Sink Sink

	// Endpoints lists the engines to connect to (pod-discovery mode).
	Endpoints []ZMQEndpoint

	// Bind, TopicBackend, DefaultBackend, Backends and Model describe one bound address, as the
	// fields of a ZMQListener do; with Listeners it is the first one.
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
	Listeners []ZMQListener
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
	// subscription reaches it. 0 means DefaultZMQCatchUpBatches (vLLM keeps its last
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
	// LossReporter, whether it lost the backend's entries (a Redis index whose server restarted
	// empty); the same check retries a clear that a failed Apply left pending when no batch comes
	// to do it. A lost backend is healed at once, without waiting for its next batch: it is
	// cleared, and each of its publishers' chains catches up on the batches up to the last one
	// applied (connect mode with a ReplayEndpoint; counted in SequenceStats.Resets and CatchUps).
	// 0 means DefaultZMQLossCheckInterval (1 s); negative disables the checks.
	LossCheckInterval time.Duration
	// MaxFrameBytes caps the payload (third frame) of a batch that is decoded; 0 means
	// DefaultMaxFrameBytes. A larger batch is dropped without being decoded, counted in the
	// source's Events.Malformed and LastError, logged at Warn (at most once per source every
	// few seconds), and handled as a lost batch (replayed, else the backend reset); the
	// connection stays up. Decoding takes at most 4 × the payload plus 1 MiB (see
	// DecodeMsgpackBatch), and a decoded batch waits in the backend's queue until applied, so
	// QueueSize × MaxFrameBytes × 4 bounds what one backend's queue can hold.
	MaxFrameBytes int

	// MeterProvider supplies the instruments (ScopeName); nil means no metrics.
	MeterProvider metric.MeterProvider
	// Logger receives connection-level events at Debug and Warn, and completed catch-ups at
	// Info; nil discards them.
	Logger *slog.Logger
	// Now is the clock for the status timestamps; nil means time.Now.
	Now func() time.Time
}

// ZMQConsumer consumes vLLM/SGLang KV events published over ZeroMQ (frames [topic, seq as 8-byte
// big-endian, msgpack batch]) and applies them to a Sink. It speaks ZMTP 3 itself over its own
// TCP connections (the go-zeromq/zmq4 codec for the handshake and framing), so every connection
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
// catch-up that fails after applying some of them clears the backend, Sink.ClearBackend). Then
// seq = last+1 is applied; seq > last+1 is a gap: with a ReplayEndpoint the missing batches are
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
type ZMQConsumer struct {
	cfg  ZMQConfig
	now  func() time.Time
	log  *slog.Logger
	life lifecycle
	reg  registry

	metrics *consumerMetrics
	loss    LossReporter // cfg.Sink when it is one and checks are on; nil otherwise
	items   sync.Pool    // *zmqItem
	topic   []byte       // cfg.Topic

	// connect mode
	pubs []*zmqPublisher

	// bind mode
	lns      []*zmqListener // Bind's first, then Listeners
	conns    atomic.Int64   // open engine connections, all listeners
	connIDs  atomic.Uint64
	routesMu sync.RWMutex // guards every listener's routes and srcs, and nroutes
	nroutes  int          // routes of all listeners, capped at MaxTopics

	backendsMu sync.Mutex
	backends   map[string]*zmqBackend
}

// zmqPublisher is one connect-mode endpoint.
type zmqPublisher struct {
	idx                   int
	cfg                   ZMQEndpoint
	network, addr         string
	replayNet, replayAddr string
	src                   *source
	be                    *zmqBackend
	sent                  uint64 // items queued to be (stamps); owned by the reader goroutine
}

// zmqListener is one bound address (bind mode).
type zmqListener struct {
	cfg           ZMQListener
	network, addr string
	src           *source // the listener's own status: not reported as metrics (no backend)
	ln            atomic.Pointer[net.Listener]
	// bound is the bound endpoint (Bind with the port resolved), set by Start before any
	// connection is served.
	bound string
	// routes maps the topics seen on this listener to their backends; srcs holds the source of
	// each backend this listener feeds. Both guarded by ZMQConsumer.routesMu.
	routes map[string]*zmqRoute
	srcs   map[string]*source
}

// zmqRoute is where a bind-mode topic of one listener goes.
type zmqRoute struct {
	topic string
	model string
	be    *zmqBackend
	src   *source // the backend's source on the listener
}

// zmqBackend is one backend's queue and the state of its worker goroutine.
//
// A batch a reader could not queue (queue full, undecodable) is recorded in lost, and wake
// tells the worker, which repairs the hole once it has handled every item the reader queued
// before the loss: each reader stamps the items it queues to a backend 1, 2, 3, … (per
// connection), a lost batch carries the stamp of the reader's last queued item as its ticket,
// and done holds, per connection, the stamp of the last item the worker handled.
type zmqBackend struct {
	queue chan *zmqItem
	wake  chan struct{} // capacity 1: lost has news
	first *source       // the backend's first source, to count a reset no chain caused

	lostMu sync.Mutex
	lost   map[lostKey]lostBatch // guarded by lostMu; at most maxChainsPerPipe
	nlost  atomic.Int32          // len(lost), so that the worker skips the lock when it is empty

	// owned by the worker goroutine
	w         backendWriter
	chains    map[chainKey]*chain
	done      map[uint64]uint64 // connection → stamp of the last item handled
	ready     []lostEntry
	replayBuf Batch
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
	src    *source
	pub    *zmqPublisher // nil in bind mode
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

func chainKeyOf(conn uint64, topic string, b *Batch) chainKey {
	k := chainKey{conn: conn, topic: topic, rank: -1}
	if b.HasDPRank {
		k.rank = b.DPRank
	}
	return k
}

type chain struct {
	// src, pub and model are those of the chain's last batch: a catch-up that no batch prompts
	// (the sink lost the backend) uses them.
	src   *source
	pub   *zmqPublisher
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

// zmqItem is a decoded batch on its way from a reader to a worker, or (reset) the news that a
// connection was lost.
type zmqItem struct {
	src   *source
	pub   *zmqPublisher // nil in bind mode
	conn  uint64        // see chainKey
	stamp uint64        // the reader's count of items queued to this backend, this one included
	topic string
	reset bool
	b     Batch
}

// feed is a reader's stream of items into one backend's queue; owned by the reader goroutine.
type feed struct {
	be   *zmqBackend
	src  *source // the backend's source on the reader's listener
	sent uint64  // stamp of the last item queued
}

// NewZMQConsumer validates cfg and returns a consumer that does nothing until Start.
//
// Errors wrap ErrInvalidConfig: no Sink, both or neither of Endpoints and a bound address (Bind
// or Listeners), an endpoint without Backend or with an address that is not "tcp://host:port"
// (connect mode cannot use "*") or "ipc://path", bind-mode options in connect mode, Bind's
// options without Bind, two listeners with the same address, or negative durations and sizes
// (CatchUpBatches excepted: negative disables catch-up). The metric instruments are registered
// here; an error from the MeterProvider is returned as is.
func NewZMQConsumer(cfg ZMQConfig) (*ZMQConsumer, error) {
	if cfg.Sink == nil {
		return nil, fmt.Errorf("%w: Sink is required", ErrInvalidConfig)
	}
	bind := cfg.Bind != "" || len(cfg.Listeners) > 0
	if (len(cfg.Endpoints) == 0) == !bind {
		return nil, fmt.Errorf("%w: set exactly one of Endpoints (connect mode) and Bind or Listeners (bind mode)", ErrInvalidConfig)
	}
	if cfg.QueueSize < 0 || cfg.ReplayTimeout < 0 || cfg.CatchUpTimeout < 0 || cfg.InitialBackoff < 0 ||
		cfg.MaxBackoff < 0 || cfg.DialTimeout < 0 || cfg.MaxMessageSize < 0 || cfg.MaxTopics < 0 || cfg.MaxFrameBytes < 0 {
		return nil, fmt.Errorf("%w: negative size or duration", ErrInvalidConfig)
	}
	bindOpts := len(cfg.TopicBackend) > 0 || cfg.DefaultBackend != "" || len(cfg.Backends) > 0 || cfg.Model != ""
	switch {
	case !bind && (bindOpts || cfg.MaxTopics != 0):
		return nil, fmt.Errorf("%w: TopicBackend, DefaultBackend, Backends, Model and MaxTopics apply to bind mode only", ErrInvalidConfig)
	case cfg.Bind == "" && bindOpts:
		return nil, fmt.Errorf("%w: TopicBackend, DefaultBackend, Backends and Model describe Bind's address; without Bind, set them in Listeners", ErrInvalidConfig)
	}
	setDefault(&cfg.QueueSize, DefaultZMQQueueSize)
	setDefault(&cfg.ReplayTimeout, DefaultZMQReplayTimeout)
	setDefault(&cfg.CatchUpBatches, DefaultZMQCatchUpBatches)
	setDefault(&cfg.CatchUpTimeout, DefaultZMQCatchUpTimeout)
	setDefault(&cfg.InitialBackoff, DefaultZMQInitialBackoff)
	setDefault(&cfg.MaxBackoff, DefaultZMQMaxBackoff)
	setDefault(&cfg.DialTimeout, DefaultZMQDialTimeout)
	setDefault(&cfg.MaxMessageSize, DefaultZMQMaxMessageSize)
	setDefault(&cfg.MaxTopics, DefaultZMQMaxTopics)
	setDefault(&cfg.MaxFrameBytes, DefaultMaxFrameBytes)
	setDefault(&cfg.LossCheckInterval, DefaultZMQLossCheckInterval)
	if cfg.MaxBackoff < cfg.InitialBackoff {
		return nil, fmt.Errorf("%w: MaxBackoff %v < InitialBackoff %v", ErrInvalidConfig, cfg.MaxBackoff, cfg.InitialBackoff)
	}
	c := &ZMQConsumer{cfg: cfg, now: cfg.Now, log: discardLogger(cfg.Logger), backends: make(map[string]*zmqBackend)}
	if lr, ok := cfg.Sink.(LossReporter); ok && cfg.LossCheckInterval > 0 {
		c.loss = lr
	}
	if c.now == nil {
		c.now = time.Now
	}
	c.items.New = func() any { return new(zmqItem) }
	c.topic = []byte(cfg.Topic)

	if bind {
		lcfgs := cfg.Listeners
		if cfg.Bind != "" {
			lcfgs = append([]ZMQListener{{Bind: cfg.Bind, TopicBackend: cfg.TopicBackend,
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
				return nil, fmt.Errorf("%w: %s.Bind is required", ErrInvalidConfig, name)
			}
			for topic, backend := range lc.TopicBackend {
				if backend == "" {
					return nil, fmt.Errorf("%w: %s.TopicBackend[%q] is empty", ErrInvalidConfig, name, topic)
				}
			}
			l := &zmqListener{cfg: lc, routes: make(map[string]*zmqRoute), srcs: make(map[string]*source),
				src: newSource("", "zmq", lc.Bind, cfg.Topic, c.now, nil)}
			var err error
			if l.network, l.addr, err = parseZMQEndpoint(lc.Bind, true); err != nil {
				return nil, fmt.Errorf("%w: %s.Bind: %w", ErrInvalidConfig, name, err)
			}
			if _, port, _ := net.SplitHostPort(l.addr); port != "0" || l.network != "tcp" {
				key := l.network + " " + l.addr
				if j, dup := seen[key]; dup {
					return nil, fmt.Errorf("%w: %s.Bind: %q has the address of an earlier listener (%q)", ErrInvalidConfig, name, lc.Bind, lcfgs[j].Bind)
				}
				seen[key] = i
			}
			c.lns = append(c.lns, l)
		}
	} else {
		seen := make(map[ZMQEndpoint]bool, len(cfg.Endpoints))
		for i, ep := range cfg.Endpoints {
			if ep.Backend == "" {
				return nil, fmt.Errorf("%w: Endpoints[%d]: Backend is required", ErrInvalidConfig, i)
			}
			if seen[ep] {
				return nil, fmt.Errorf("%w: Endpoints[%d]: duplicate of an earlier endpoint", ErrInvalidConfig, i)
			}
			seen[ep] = true
			p := &zmqPublisher{idx: i, cfg: ep}
			var err error
			if p.network, p.addr, err = parseZMQEndpoint(ep.Endpoint, false); err != nil {
				return nil, fmt.Errorf("%w: Endpoints[%d].Endpoint: %w", ErrInvalidConfig, i, err)
			}
			if ep.ReplayEndpoint != "" {
				if p.replayNet, p.replayAddr, err = parseZMQEndpoint(ep.ReplayEndpoint, false); err != nil {
					return nil, fmt.Errorf("%w: Endpoints[%d].ReplayEndpoint: %w", ErrInvalidConfig, i, err)
				}
			}
			p.src = c.reg.add(ep.Backend, "zmq", ep.Endpoint, cfg.Topic, c.now)
			p.be, _ = c.backend(ep.Backend)
			if p.be.first == nil {
				p.be.first = p.src
			}
			c.pubs = append(c.pubs, p)
		}
	}
	m, err := newConsumerMetrics(cfg.MeterProvider, &c.reg)
	if err != nil {
		return nil, err
	}
	c.metrics = m
	c.life.init()
	return c, nil
}

func setDefault[T int | int64 | time.Duration](v *T, def T) {
	if *v == 0 {
		*v = def
	}
}

// parseZMQEndpoint maps "tcp://host:port" to ("tcp", "host:port") and "ipc://path" to
// ("unix", "path"). A bind address may use "*" or an empty host for every interface and port 0
// for a free port; a connect address needs a host and a port.
func parseZMQEndpoint(ep string, bind bool) (network, addr string, err error) {
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
func (c *ZMQConsumer) backend(name string) (be *zmqBackend, created bool) {
	c.backendsMu.Lock()
	defer c.backendsMu.Unlock()
	if be := c.backends[name]; be != nil {
		return be, false
	}
	be = &zmqBackend{
		queue:  make(chan *zmqItem, c.cfg.QueueSize),
		wake:   make(chan struct{}, 1),
		lost:   make(map[lostKey]lostBatch),
		w:      backendWriter{sink: c.cfg.Sink, backend: name},
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
// returns has no effect: stop the consumer with Close. It returns ErrStarted after a successful
// Start and ErrClosed after Close.
func (c *ZMQConsumer) Start(ctx context.Context) error {
	return c.life.start(func() error {
		if len(c.lns) > 0 {
			lns := make([]net.Listener, 0, len(c.lns))
			for _, l := range c.lns {
				var lc net.ListenConfig
				ln, err := lc.Listen(ctx, l.network, l.addr)
				if err != nil {
					for i, ln := range lns {
						ln.Close()
						c.lns[i].ln.Store(nil)
						c.lns[i].src.setState(StateDisconnected)
					}
					l.src.setError(err)
					l.src.setState(StateDisconnected)
					return fmt.Errorf("events: zmq bind %s: %w", l.cfg.Bind, err)
				}
				lns = append(lns, ln)
				l.bound = l.cfg.Bind
				if a, ok := ln.Addr().(*net.TCPAddr); ok {
					l.bound = "tcp://" + a.String()
				}
				l.ln.Store(&ln)
				l.src.setState(StateConnected)
			}
			for i, l := range c.lns {
				ln := lns[i]
				context.AfterFunc(c.life.ctx, func() { ln.Close() })
				c.life.goTracked(func() { c.acceptLoop(l, ln) })
			}
			return nil
		}
		c.backendsMu.Lock()
		for _, be := range c.backends {
			c.life.goTracked(func() { c.work(be) })
		}
		c.backendsMu.Unlock()
		for _, p := range c.pubs {
			c.life.goTracked(func() { c.runPublisher(p) })
		}
		return nil
	})
}

// Close stops every goroutine and closes every connection, waiting for them; a batch being
// applied is finished first (the sink sees a cancelled ctx). Queued batches are discarded.
// Close is idempotent; it returns the error of unregistering the metric callback, if any.
func (c *ZMQConsumer) Close() error {
	if !c.life.shutdown() {
		return nil
	}
	c.reg.closeAll()
	for _, l := range c.lns {
		l.src.setState(StateClosed)
	}
	return c.metrics.close()
}

// Status returns a snapshot of every source: one per endpoint in connect mode (in
// configuration order), one per bound address and backend seen on it in bind mode (in order of
// first message; its Endpoint is the bound address, port resolved). Safe for concurrent use; it
// never blocks on the network.
func (c *ZMQConsumer) Status() []SourceStatus { return c.reg.statuses() }

// Listener returns the status of the first bound socket in bind mode (ok false in connect mode);
// see Listeners.
func (c *ZMQConsumer) Listener() (st SourceStatus, ok bool) {
	if len(c.lns) == 0 {
		return SourceStatus{}, false
	}
	return c.lns[0].src.status(), true
}

// Listeners returns the status of each bound socket in bind mode, Bind's first and then those of
// Listeners in order (nil in connect mode): its connection state (connected while it is bound),
// and the messages that could not be placed on a backend (bad framing before the topic is
// known, topics that map to no backend, over MaxTopics), counted as Malformed. Safe for
// concurrent use.
func (c *ZMQConsumer) Listeners() []SourceStatus {
	if len(c.lns) == 0 {
		return nil
	}
	out := make([]SourceStatus, len(c.lns))
	for i, l := range c.lns {
		out[i] = l.src.status()
	}
	return out
}

// Addr returns the first bound address in bind mode once Start succeeded, nil otherwise; see
// Addrs.
func (c *ZMQConsumer) Addr() net.Addr {
	if len(c.lns) == 0 {
		return nil
	}
	return c.lns[0].addrOf()
}

// Addrs returns the bound addresses in bind mode, in the order of Listeners (Bind's first), once
// Start succeeded; nil in connect mode or before Start.
func (c *ZMQConsumer) Addrs() []net.Addr {
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
func (l *zmqListener) addrOf() net.Addr {
	if ln := l.ln.Load(); ln != nil {
		return (*ln).Addr()
	}
	return nil
}

// runPublisher is the connect-mode reader of one endpoint: dial, subscribe, read until the
// connection fails, back off, repeat until Close.
func (c *ZMQConsumer) runPublisher(p *zmqPublisher) {
	ctx := c.life.ctx
	bo := backoff{initial: c.cfg.InitialBackoff, max: c.cfg.MaxBackoff}
	for attempt := 0; ; attempt++ {
		if attempt > 0 {
			p.src.reconnects.Add(1)
		}
		p.src.setState(StateConnecting)
		connected := false
		raw, zc, err := c.dialZMTP(ctx, p.network, p.addr, zmq4.Sub)
		if err == nil {
			err = subscribe(zc, c.cfg.Topic)
			if err == nil {
				connected = true
				bo.reset()
				p.src.setState(StateConnected)
				c.log.Debug("kvroute events: zmq connected", "backend", p.cfg.Backend, "endpoint", p.cfg.Endpoint)
				err = c.readPublisher(ctx, raw, zc, p)
			}
			raw.Close()
		}
		if ctx.Err() != nil {
			return
		}
		p.src.setError(err)
		p.src.setState(StateDisconnected)
		if connected {
			c.queueReset(ctx, p.be, &p.sent, p.src, uint64(p.idx))
			c.log.Warn("kvroute events: zmq connection lost", "backend", p.cfg.Backend, "endpoint", p.cfg.Endpoint, "err", err)
		} else {
			c.log.Debug("kvroute events: zmq connect failed", "backend", p.cfg.Backend, "endpoint", p.cfg.Endpoint, "err", err)
		}
		if !sleepCtx(ctx, bo.next()) {
			return
		}
	}
}

// queueReset tells the backend's worker, in order with the batches, that connection conn was
// lost: what the engine publishes until it is back is lost too (a PUB socket drops messages for
// absent subscribers), and an engine that restarts comes back with an empty cache, so the
// backend is cleared now rather than left stale, and the connection's chains are forgotten. It
// waits for room in the queue (or Close). sent is the reader's stamp counter for be.
func (c *ZMQConsumer) queueReset(ctx context.Context, be *zmqBackend, sent *uint64, src *source, conn uint64) {
	it := c.items.Get().(*zmqItem)
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
func (c *ZMQConsumer) readPublisher(ctx context.Context, raw net.Conn, zc *zmq4.Conn, p *zmqPublisher) error {
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
			p.src.malformed.Add(1)
			p.src.setError(fmt.Errorf("%w: zmq message of %d frames (want [topic, 8-byte seq, payload])", ErrMalformed, len(f)))
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
func (c *ZMQConsumer) acceptLoop(l *zmqListener, ln net.Listener) {
	ctx := c.life.ctx
	maxConns := int64(4 * c.cfg.MaxTopics)
	for {
		raw, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			l.src.setError(err)
			if !sleepCtx(ctx, 50*time.Millisecond) {
				return
			}
			continue
		}
		if c.conns.Add(1) > maxConns {
			c.conns.Add(-1)
			l.src.setError(fmt.Errorf("connection from %s refused: %d connections open", raw.RemoteAddr(), maxConns))
			raw.Close()
			continue
		}
		c.life.goTracked(func() {
			defer c.conns.Add(-1)
			c.serveBound(ctx, l, raw)
		})
	}
}

// serveBound reads one engine connection of listener l.
func (c *ZMQConsumer) serveBound(ctx context.Context, l *zmqListener, raw net.Conn) {
	stop := context.AfterFunc(ctx, func() { raw.Close() })
	defer stop()
	defer raw.Close()
	zc, err := c.handshake(ctx, raw, zmq4.Sub, true)
	if err == nil {
		err = subscribe(zc, c.cfg.Topic)
	}
	if err != nil {
		if ctx.Err() == nil {
			l.src.setError(fmt.Errorf("zmq handshake with %s: %w", raw.RemoteAddr(), err))
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
				f.src.setState(StateDisconnected)
			}
			c.queueReset(ctx, f.be, &f.sent, f.src, conn)
		}
	}()
	var last *zmqRoute
	var lastFeed *feed
	for {
		msg, err := zc.RecvMsg()
		if err != nil {
			if ctx.Err() == nil && !errors.Is(err, io.EOF) {
				l.src.setError(fmt.Errorf("zmq connection from %s: %w", raw.RemoteAddr(), err))
			}
			return
		}
		if msg.Type == zmq4.CmdMsg {
			continue
		}
		f := msg.Frames
		if len(f) != 3 || len(f[1]) != 8 {
			l.src.malformed.Add(1)
			l.src.setError(fmt.Errorf("%w: zmq message of %d frames from %s (want [topic, 8-byte seq, payload])", ErrMalformed, len(f), raw.RemoteAddr()))
			continue
		}
		if !bytes.HasPrefix(f[0], c.topic) {
			continue
		}
		r := last
		if r == nil || string(f[0]) != r.topic {
			if r = c.route(l, f[0]); r == nil {
				l.src.malformed.Add(1)
				l.src.setError(fmt.Errorf("topic %q maps to no backend", f[0]))
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
					if r.src.everConnected.Load() {
						r.src.reconnects.Add(1)
					}
					r.src.setState(StateConnected)
				}
			}
		}
		c.ingest(r.src, r.be, &lastFeed.sent, nil, conn, r.topic, r.model, f[1], f[2])
	}
}

// route returns where a topic of listener l goes, creating the backend and its source on the
// listener on first sight; nil when the topic maps to no backend or MaxTopics is reached.
func (c *ZMQConsumer) route(l *zmqListener, topic []byte) *zmqRoute {
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
		if l.src.warnDue() {
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
		src = c.reg.add(backend, "zmq", l.bound, t, c.now)
		l.srcs[backend] = src
	}
	if created {
		be.first = src
		c.life.goTracked(func() { c.work(be) })
	}
	r = &zmqRoute{topic: t, model: model, be: be, src: src}
	l.routes[t] = r
	c.nroutes++
	return r
}

// ingest decodes one message and queues it for the backend's worker; sent is the reader's
// stamp counter for be. A batch that cannot be queued (undecodable, queue full) is recorded as
// lost, for the worker to replay or reset.
func (c *ZMQConsumer) ingest(src *source, be *zmqBackend, sent *uint64, p *zmqPublisher, conn uint64, topic, model string, seqFrame, payload []byte) {
	seq := binary.BigEndian.Uint64(seqFrame)
	src.batches.Add(1)
	src.lastSeq.Store(seq)
	lose := func(err error) {
		src.malformed.Add(1)
		src.setError(fmt.Errorf("batch %d: %w", seq, err))
		if src.warnDue() {
			c.log.Warn("kvroute events: batch dropped", "backend", src.backend, "endpoint", src.endpoint, "seq", seq, "bytes", len(payload), "err", err)
		}
		c.loseBatch(be, lostKey{chain: chainKey{conn: conn, topic: topic}, anyRank: true},
			lostBatch{src: src, pub: p, model: model, seq: seq, ticket: *sent})
	}
	if err := c.checkFrameSize(payload); err != nil {
		lose(err)
		return
	}
	it := c.items.Get().(*zmqItem)
	skipped, err := DecodeMsgpackBatch(payload, &it.b)
	if err != nil {
		c.putItem(it)
		lose(err)
		return
	}
	n := uint64(len(it.b.Events))
	if skipped > 0 {
		src.malformed.Add(uint64(skipped))
		src.dropped.Add(uint64(skipped))
	}
	src.received.Add(n + uint64(skipped))
	src.touch()
	it.b.Seq, it.b.Model = seq, model
	stamp := *sent + 1
	it.src, it.pub, it.conn, it.topic, it.stamp = src, p, conn, topic, stamp
	select {
	case be.queue <- it: // the worker's now
		*sent = stamp
	default:
		src.overflows.Add(1)
		src.dropped.Add(n)
		key := lostKey{chain: chainKeyOf(conn, topic, &it.b)}
		c.putItem(it)
		c.loseBatch(be, key, lostBatch{src: src, pub: p, model: model, seq: seq, ticket: *sent})
	}
}

// checkFrameSize returns an error wrapping ErrMalformed when payload exceeds MaxFrameBytes.
func (c *ZMQConsumer) checkFrameSize(payload []byte) error {
	if len(payload) > c.cfg.MaxFrameBytes {
		return fmt.Errorf("%w: payload of %d bytes exceeds MaxFrameBytes (%d), dropped undecoded", ErrMalformed, len(payload), c.cfg.MaxFrameBytes)
	}
	return nil
}

// loseBatch records a batch the reader could not queue and wakes the worker. A later loss on
// the same chain replaces the earlier one. When lost is full (maxChainsPerPipe chains) the loss
// is not recorded: the publisher's next batch reveals it.
func (c *ZMQConsumer) loseBatch(be *zmqBackend, k lostKey, l lostBatch) {
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

func (c *ZMQConsumer) putItem(it *zmqItem) {
	it.src, it.pub, it.topic, it.reset, it.stamp = nil, nil, "", false, 0
	c.items.Put(it)
}

// work is a backend's worker: it applies the queued batches in order, repairs the holes lost
// batches left, and heals the backend when the sink lost it, until Close.
func (c *ZMQConsumer) work(be *zmqBackend) {
	ctx := c.life.ctx
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
func (c *ZMQConsumer) handle(ctx context.Context, be *zmqBackend, it *zmqItem) {
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
		be.w.requestReset()
		var empty Batch
		be.w.apply(ctx, src, &empty)
		return
	}
	key := chainKeyOf(it.conn, it.topic, &it.b)
	ch := be.chains[key]
	if ch != nil && ch.caught != catchUpFailed && (be.w.needClear || ch.clears != be.w.clears || ch.caught == catchUpStopped) {
		// The backend was cleared, or is to be, since this chain's last batch, for a cause not its
		// own (a sink failure, a reset on another of the backend's chains): once the clear has
		// been done, the chain catches up again, so that the sink relearns what the engine still
		// holds in its replay buffer instead of waiting for the blocks to be stored again. While
		// the sink cannot even be cleared (it is down) nothing is replayed. A catch-up that the
		// sink stopped is tried again.
		var empty Batch
		if be.w.apply(ctx, src, &empty) {
			ok, applied, caught := c.catchUp(ctx, be, src, it.pub, it.b.Model, key.rank, seq)
			if !ok {
				return
			}
			ch.caught = caught
			if applied > 0 && caught != catchUpFailed && seq > ch.last {
				ch.last = seq - 1
			}
			ch.clears = be.w.clears
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
		c.log.Debug("kvroute events: sequence went back, resetting backend", "backend", be.w.backend, "last", ch.last, "seq", seq)
		be.w.requestReset()
	}
	ch.last, ch.src, ch.pub, ch.model = seq, src, it.pub, it.b.Model
	be.w.apply(ctx, src, &it.b)
	ch.clears = be.w.clears // a reset this batch's own handling caused is no cause to catch up
}

// checkLost heals the backend when the sink reports it lost (LossReporter), or when a clear is
// pending and no batch has come to do it (a failed Apply of a publisher that went quiet).
func (c *ZMQConsumer) checkLost(ctx context.Context, be *zmqBackend) {
	if !be.w.needClear {
		lost, err := c.loss.BackendLost(ctx, be.w.backend)
		if err != nil || !lost {
			return // not known: asked again at the next tick
		}
	}
	c.heal(ctx, be)
}

// heal clears the backend, then catches each chain up on the batches through the last one it
// applied, from its publisher's replay endpoint: what the engine still holds is learnt again
// without waiting for its next batch. A clear that fails is tried again at the next check (and
// before the next batch). When a catch-up fails part-way or the sink stops it, the backend is
// cleared again and the chains catch up on their next batch, as after any reset.
func (c *ZMQConsumer) heal(ctx context.Context, be *zmqBackend) {
	src := be.first
	for _, ch := range be.chains {
		src = ch.src
		break
	}
	if src == nil {
		return
	}
	c.log.Info("kvroute events: the sink lost the backend's entries: clearing it and catching up", "backend", be.w.backend)
	var empty Batch
	be.w.requestReset()
	if !be.w.apply(ctx, src, &empty) {
		return
	}
	for key, ch := range be.chains {
		ok, _, caught := c.catchUp(ctx, be, ch.src, ch.pub, ch.model, key.rank, ch.last+1)
		if !ok {
			return
		}
		ch.caught = caught
		if be.w.needClear {
			break
		}
		ch.clears = be.w.clears
	}
	if be.w.needClear && ctx.Err() == nil {
		be.w.apply(ctx, src, &empty)
	}
}

// handleLost repairs the holes of the lost batches whose connection's earlier items have all
// been handled (the others wait for those items, which are still queued).
func (c *ZMQConsumer) handleLost(ctx context.Context, be *zmqBackend) {
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
func (c *ZMQConsumer) repairLost(ctx context.Context, be *zmqBackend, k lostKey, l *lostBatch) {
	var empty Batch
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
			l.src.gaps.Add(1)
			c.log.Debug("kvroute events: undecodable batch of an unknown rank, resetting backend", "backend", be.w.backend, "seq", l.seq)
			be.w.requestReset()
			be.w.apply(ctx, l.src, &empty)
			return
		}
	}
	if ch == nil || l.seq <= ch.last {
		return
	}
	if !c.fillGap(ctx, be, l.src, l.pub, replayRange{model: l.model, rank: rank, from: ch.last + 1, until: l.seq + 1}) {
		return
	}
	ch.last = l.seq
	be.w.apply(ctx, l.src, &empty) // a reset fillGap requested happens now
	ch.clears = be.w.clears
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
func (c *ZMQConsumer) fillGap(ctx context.Context, be *zmqBackend, src *source, p *zmqPublisher, r replayRange) bool {
	src.gaps.Add(1)
	if p == nil || p.replayAddr == "" {
		c.log.Debug("kvroute events: sequence gap, resetting backend", "backend", be.w.backend, "from", r.from, "to", r.until)
		be.w.requestReset()
		return true
	}
	if _, err := c.replay(ctx, be, src, p, r); err != nil {
		if ctx.Err() != nil {
			return false
		}
		if errors.Is(err, errSinkFailed) {
			return true // the backend is cleared before the next batch
		}
		src.replayFailures.Add(1)
		src.setError(fmt.Errorf("replay %d..%d: %w", r.from, r.until-1, err))
		c.log.Warn("kvroute events: replay failed, resetting backend", "backend", be.w.backend, "err", err)
		be.w.requestReset()
		return true
	}
	src.replays.Add(1)
	return true
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
func (c *ZMQConsumer) catchUp(ctx context.Context, be *zmqBackend, src *source, p *zmqPublisher, model string, rank int, seq uint64) (ok bool, applied int, caught catchUpOutcome) {
	if seq == 0 || c.cfg.CatchUpBatches < 0 || p == nil || p.replayAddr == "" {
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
		src.catchUpFailures.Add(1)
		src.setError(fmt.Errorf("catch-up %d..%d: %w", r.from, r.until-1, err))
		if n > 0 {
			c.log.Warn("kvroute events: catch-up failed, resetting backend", "backend", be.w.backend, "applied", n, "err", err)
			be.w.requestReset()
		} else {
			c.log.Warn("kvroute events: catch-up failed, starting from the live batch", "backend", be.w.backend, "seq", seq, "err", err)
		}
		return true, n, catchUpFailed
	}
	src.catchUps.Add(1)
	src.caughtUpBatches.Add(uint64(n))
	c.log.Info("kvroute events: caught up", "backend", be.w.backend, "endpoint", p.cfg.Endpoint, "batches", n, "seq", seq)
	return true, n, caughtUp
}

// replay requests the batches [r.from, r.until) from the publisher's replay endpoint and applies
// them in order; it returns how many it applied. It fails when the publisher no longer holds
// one of them (for a catch-up: one after the first it sends), on a malformed answer or a batch
// of another data-parallel rank than r.rank (the endpoint serves another publisher: vLLM has
// one replay socket per rank, and the answer names no topic), and after ReplayTimeout
// (CatchUpTimeout). A catch-up whose answer starts at or after r.until, or is empty, applies
// nothing and succeeds.
func (c *ZMQConsumer) replay(ctx context.Context, be *zmqBackend, src *source, p *zmqPublisher, r replayRange) (applied int, err error) {
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
			return applied, fmt.Errorf("%w: replay message of %d frames (want [\"\", seq, payload])", ErrMalformed, len(msg.Frames))
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
		src.batches.Add(1)
		if err := c.checkFrameSize(f[1]); err != nil {
			src.malformed.Add(1)
			return applied, fmt.Errorf("replayed batch %d: %w", seq, err)
		}
		skipped, err := DecodeMsgpackBatch(f[1], b)
		if err != nil {
			src.malformed.Add(1)
			return applied, fmt.Errorf("replayed batch %d: %w", seq, err)
		}
		if skipped > 0 {
			src.malformed.Add(uint64(skipped))
			src.dropped.Add(uint64(skipped))
		}
		src.received.Add(uint64(len(b.Events) + skipped))
		if r.rank >= 0 && b.HasDPRank && b.DPRank != r.rank {
			src.dropped.Add(uint64(len(b.Events)))
			return applied, fmt.Errorf("replayed batch %d is of data-parallel rank %d, not %d: the replay endpoint serves another publisher", seq, b.DPRank, r.rank)
		}
		b.Seq, b.Model = seq, r.model
		if !be.w.apply(ctx, src, b) {
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
func (c *ZMQConsumer) dialZMTP(ctx context.Context, network, addr string, typ zmq4.SocketType) (net.Conn, *zmq4.Conn, error) {
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
func (c *ZMQConsumer) handshake(ctx context.Context, raw net.Conn, typ zmq4.SocketType, server bool) (*zmq4.Conn, error) {
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

// errFrameTooLarge is returned by frameGuard for a message above the size cap.
var errFrameTooLarge = errors.New("zmq message exceeds MaxMessageSize")

// frameGuard follows the ZMTP 3 framing of the bytes read through it and fails the read that
// announces a frame (or a multi-frame message) larger than max, or a message of more than
// zmtpMaxFrames frames — before the codec allocates a buffer of the announced size.
type frameGuard struct {
	net.Conn
	max      uint64
	greeting int // greeting bytes still to pass through

	state  uint8 // 0 flags, 1 size, 2 body
	long   bool
	more   bool
	size   [8]byte
	sizeN  int
	remain uint64
	total  uint64 // bytes of the current message so far
	frames int    // frames of the current message so far
	err    error  // sticky: the cap was exceeded
}

// Read reads from the connection and checks the frame headers it saw. Once a header is over
// the cap every read fails, returning no bytes (io.ReadFull would drop an error that came with
// a full buffer).
func (g *frameGuard) Read(p []byte) (int, error) {
	if g.err != nil {
		return 0, g.err
	}
	n, err := g.Conn.Read(p)
	if g.err = g.scan(p[:n]); g.err != nil {
		return 0, g.err
	}
	return n, err
}

func (g *frameGuard) scan(b []byte) error {
	for len(b) > 0 {
		switch {
		case g.greeting > 0:
			k := min(g.greeting, len(b))
			g.greeting -= k
			b = b[k:]
		case g.state == 0:
			flags := b[0]
			g.long, g.more = flags&0x02 != 0, flags&0x01 != 0 && flags&0x04 == 0
			g.state, g.sizeN = 1, 0
			if g.frames++; g.frames > zmtpMaxFrames {
				return fmt.Errorf("%w: more than %d frames", errFrameTooLarge, zmtpMaxFrames)
			}
			b = b[1:]
		case g.state == 1:
			need := 1
			if g.long {
				need = 8
			}
			k := copy(g.size[g.sizeN:need], b)
			g.sizeN += k
			b = b[k:]
			if g.sizeN < need {
				continue
			}
			size := uint64(g.size[0])
			if g.long {
				size = binary.BigEndian.Uint64(g.size[:])
			}
			if size > g.max || g.total+size > g.max {
				return fmt.Errorf("%w: frame of %d bytes (cap %d)", errFrameTooLarge, size, g.max)
			}
			g.total += size
			g.remain, g.state = size, 2
			if size == 0 {
				g.endFrame()
			}
		default:
			k := min(g.remain, uint64(len(b)))
			g.remain -= k
			b = b[k:]
			if g.remain == 0 {
				g.endFrame()
			}
		}
	}
	return nil
}

func (g *frameGuard) endFrame() {
	g.state = 0
	if !g.more {
		g.total, g.frames = 0, 0
	}
}
