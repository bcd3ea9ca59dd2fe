package enginesim

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"time"
)

// Defaults of Config: the zero value of each field means the constant here.
const (
	DefaultName           = "enginesim-0"
	DefaultModel          = "meta-llama/Llama-3.1-8B-Instruct"
	DefaultBlockSize      = 16
	DefaultCapacityBlocks = 8192  // 131,072 tokens of KV cache at block size 16
	DefaultMaxModelLen    = 32768 // tokens: prompt plus completion
	DefaultMaxConcurrent  = 256   // vLLM's max_num_seqs
	DefaultOutputTokens   = 16    // completion tokens when the request sets no max_tokens
	DefaultReplayBuffer   = 10000 // batches kept for replay (vLLM's default)
	DefaultSubscriberHWM  = 1000  // messages queued per ZMQ subscriber (ZMQ's SNDHWM default)
	DefaultSSEBuffer      = 4096  // events queued per SSE subscriber
)

// DefaultLatency is the latency model used when Config.Latency sets none of its durations: roughly
// an 8B model on one data-centre GPU.
var DefaultLatency = Latency{
	Base:           10 * time.Millisecond,
	PerToken:       75 * time.Microsecond,
	Quadratic:      1.5, // ns per token²: 1.6 s of attention at 32k tokens
	PerOutputToken: 15 * time.Millisecond,
}

// ErrInvalidConfig is wrapped by the errors of New and StartFleet for a configuration they reject.
var ErrInvalidConfig = errors.New("enginesim: invalid config")

// Config configures an Engine. The zero value of each field means its Default* constant.
type Config struct {
	// Name is the engine's name: the <pod> of a kv@<pod>@<model> topic, and the value of the
	// engine label in /metrics. Default DefaultName.
	Name string
	// Model is the served model name; requests naming another model get 404, as from vLLM.
	// It roots the engine's block hashes. Default DefaultModel.
	Model string
	// BlockSize is the number of tokens per KV block (vLLM --block-size). Default 16.
	BlockSize int
	// CapacityBlocks is the GPU KV cache size in blocks. Default DefaultCapacityBlocks.
	CapacityBlocks int
	// CPUCapacityBlocks is the size in blocks of the CPU tier that blocks evicted from the GPU
	// move to (an offloading connector); 0 means no CPU tier.
	CPUCapacityBlocks int
	// MaxModelLen caps prompt plus completion tokens per request; longer requests get 400.
	// Default DefaultMaxModelLen.
	MaxModelLen int
	// Latency is the latency model; see Latency.
	Latency Latency
	// MaxConcurrent is the most requests running at once (vLLM --max-num-seqs); the others wait
	// in a first-come-first-served queue. Default DefaultMaxConcurrent.
	MaxConcurrent int
	// MaxQueue is the most requests waiting; a request arriving at a full queue gets 503.
	// 0 means unbounded (vLLM's behaviour); a negative value means no queue at all.
	MaxQueue int
	// OutputTokens is the number of completion tokens generated for a request that sets no
	// max_tokens (max_completion_tokens); a request that sets it gets exactly that many.
	// Default DefaultOutputTokens.
	OutputTokens int
	// HashSeed seeds the engine's block hashes; 0 means a random seed per Engine (and per
	// Restart), like vLLM's random NONE_HASH: the hashes are opaque to routers, which must re-key
	// blocks from token_ids and parent_block_hash.
	HashSeed uint64
	// Events configures the KV-event publishers.
	Events EventsConfig
	// Role is the engine's part in prefill/decode disaggregation (see the package doc's "Prefill
	// and decode disaggregation"); the zero value is RoleUnified.
	Role Role
	// Storage is the external KV storage (an S3 bucket) that a prefill engine writes a prompt's
	// blocks to and a decode engine reads them from; nil means none: kv_transfer_params are then
	// ignored. It is shared by the engines of a P/D fleet, which must use the same Model and
	// BlockSize to find each other's blocks.
	Storage *StorageConfig
	// Now is the clock for timestamps (created, event batches) and queue waits; nil means
	// time.Now.
	Now func() time.Time
	// Logger receives connection-level messages of the publishers at Debug; nil discards them.
	Logger *slog.Logger
}

// Latency is the latency model, in virtual time:
//
//	prefill = Base + PerToken·(n−p) + Quadratic·(n²−p²) + CPULoadPerToken·c
//	decode  = PerOutputToken · k
//
// with n the prompt tokens, p the cached ones (GPU and CPU tier), c those loaded from the CPU tier
// and k the completion tokens. The engine sleeps SpeedFactor wall-clock seconds per virtual second:
// SpeedFactor 0 (the zero value) sleeps not at all, 1 is real time, 0.01 a hundred times faster.
// The virtual durations are computed and reported (Result, response headers) whatever the speed.
//
// A Latency whose Base, PerToken, Quadratic, PerOutputToken and CPULoadPerToken are all zero
// means DefaultLatency (SpeedFactor is kept); set any of them to use the values as given.
type Latency struct {
	Base     time.Duration
	PerToken time.Duration
	// Quadratic is c in nanoseconds per token² (fractions allowed: 1.5 means 1.5 ns·(n²−p²)).
	Quadratic       float64
	PerOutputToken  time.Duration
	CPULoadPerToken time.Duration
	SpeedFactor     float64
}

// Prefill returns the virtual prefill time of a prompt of n tokens of which cached were cached
// (cpuLoaded of them on the CPU tier). It is a pure function.
func (l Latency) Prefill(n, cached, cpuLoaded int) time.Duration {
	un := max(n-cached, 0)
	q := l.Quadratic * (float64(n)*float64(n) - float64(cached)*float64(cached))
	return l.Base + time.Duration(un)*l.PerToken + time.Duration(math.Round(q)) +
		time.Duration(cpuLoaded)*l.CPULoadPerToken
}

// Decode returns the virtual decode time of k completion tokens. It is a pure function.
func (l Latency) Decode(k int) time.Duration { return time.Duration(k) * l.PerOutputToken }

// real converts a virtual duration to the wall-clock time slept.
func (l Latency) real(d time.Duration) time.Duration {
	if l.SpeedFactor <= 0 || d <= 0 {
		return 0
	}
	return time.Duration(float64(d) * l.SpeedFactor)
}

func (l Latency) isZeroModel() bool {
	return l.Base == 0 && l.PerToken == 0 && l.Quadratic == 0 && l.PerOutputToken == 0 && l.CPULoadPerToken == 0
}

// HashEncoding is how block hashes are written in ZMQ events.
type HashEncoding uint8

const (
	// HashUint writes a hash as a msgpack unsigned integer of the smallest width (vLLM's 64-bit
	// hash functions).
	HashUint HashEncoding = iota
	// HashInt writes a hash as a signed 64-bit integer of the smallest width, negative when its
	// top bit is set (Python's builtin hash()).
	HashInt
	// HashBytes writes a hash as a 32-byte digest whose last 8 bytes are the hash, big-endian
	// (vLLM's sha256 block hashes).
	HashBytes
)

// EventsConfig configures the KV-event publishers. With every field zero no events are published.
type EventsConfig struct {
	// ZMQEndpoint is the PUB socket's endpoint, "tcp://host:port"; "" disables ZMQ events.
	// The socket binds when ZMQBind is set or the host is "*" (vLLM's rule; "*" binds 0.0.0.0),
	// and connects otherwise (to a router that binds: centralized mode). Port 0 binds a free port:
	// see Engine.ZMQEndpoint.
	ZMQEndpoint string
	ZMQBind     bool
	// Topic is the first frame of every message: "" (vLLM's default) or kv@<pod>@<model>.
	Topic string
	// ReplayEndpoint is the replay ROUTER socket's endpoint, always bound ("tcp://127.0.0.1:0"
	// picks a free port); "" disables replay.
	ReplayEndpoint string
	// ReplayBuffer is the number of recent batches kept for replay. Default DefaultReplayBuffer.
	ReplayBuffer int
	// MapForm writes batches and events as msgpack maps (vLLM since 2026) instead of arrays.
	MapForm bool
	// Hashes selects the msgpack encoding of block hashes.
	Hashes HashEncoding
	// DataParallelRank is the batches' data_parallel_rank.
	DataParallelRank int
	// BatchSize caps the events per batch; 0 means no cap (one batch per engine step, as vLLM).
	BatchSize int
	// FlushInterval, when positive, holds events for up to this long (or until BatchSize are
	// pending) before publishing them as one batch; 0 publishes at the end of every engine step
	// (a request admitted, finished, a Reset).
	FlushInterval time.Duration
	// SubscriberHWM is the number of messages queued per ZMQ subscriber; further messages are
	// dropped for that subscriber (ZMQ's high-water mark), which then sees a sequence gap.
	// Default DefaultSubscriberHWM.
	SubscriberHWM int
	// SSE serves prefix-granular events at GET /v1/kv_events (kvroute's form).
	SSE bool
	// SSEBuffer is the number of events queued per SSE subscriber; a subscriber that falls
	// further behind is disconnected. Default DefaultSSEBuffer.
	SSEBuffer int
}

// withDefaults returns cfg with defaults applied, or an error wrapping ErrInvalidConfig.
func (cfg Config) withDefaults() (Config, error) {
	bad := func(format string, a ...any) (Config, error) {
		return cfg, fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, a...)...)
	}
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	if cfg.Name == "" {
		cfg.Name = DefaultName
	}
	if cfg.Model == "" {
		cfg.Model = DefaultModel
	}
	def(&cfg.BlockSize, DefaultBlockSize)
	def(&cfg.CapacityBlocks, DefaultCapacityBlocks)
	def(&cfg.MaxModelLen, DefaultMaxModelLen)
	def(&cfg.MaxConcurrent, DefaultMaxConcurrent)
	def(&cfg.OutputTokens, DefaultOutputTokens)
	def(&cfg.Events.ReplayBuffer, DefaultReplayBuffer)
	def(&cfg.Events.SubscriberHWM, DefaultSubscriberHWM)
	def(&cfg.Events.SSEBuffer, DefaultSSEBuffer)
	if cfg.Latency.isZeroModel() {
		sf := cfg.Latency.SpeedFactor
		cfg.Latency = DefaultLatency
		cfg.Latency.SpeedFactor = sf
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	switch {
	case cfg.BlockSize < 0, cfg.CapacityBlocks < 0, cfg.CPUCapacityBlocks < 0, cfg.MaxModelLen < 0,
		cfg.MaxConcurrent < 0, cfg.OutputTokens < 0:
		return bad("negative size in %+v", cfg)
	case cfg.Events.ReplayBuffer < 0, cfg.Events.SubscriberHWM < 0, cfg.Events.SSEBuffer < 0,
		cfg.Events.BatchSize < 0, cfg.Events.FlushInterval < 0:
		return bad("negative size in Events %+v", cfg.Events)
	case cfg.Latency.Base < 0, cfg.Latency.PerToken < 0, cfg.Latency.Quadratic < 0, cfg.Latency.PerOutputToken < 0,
		cfg.Latency.CPULoadPerToken < 0, cfg.Latency.SpeedFactor < 0, math.IsNaN(cfg.Latency.Quadratic),
		math.IsNaN(cfg.Latency.SpeedFactor), math.IsInf(cfg.Latency.SpeedFactor, 0), math.IsInf(cfg.Latency.Quadratic, 0):
		return bad("latency %+v: want finite values ≥ 0", cfg.Latency)
	case cfg.Events.Hashes > HashBytes:
		return bad("Events.Hashes %d unknown", cfg.Events.Hashes)
	case strings.ContainsRune(cfg.Model, 0):
		return bad("model name holds a NUL byte")
	case cfg.Role > RoleDecode:
		return bad("Role %d unknown", cfg.Role)
	}
	if cfg.Storage != nil {
		sc, err := cfg.Storage.withDefaults()
		if err != nil {
			return bad("Storage: %v", err)
		}
		cfg.Storage = &sc
	}
	if cfg.Events.ZMQEndpoint != "" {
		if _, _, err := splitTCP(cfg.Events.ZMQEndpoint); err != nil {
			return bad("Events.ZMQEndpoint: %v", err)
		}
	}
	if cfg.Events.ReplayEndpoint != "" {
		if _, _, err := splitTCP(cfg.Events.ReplayEndpoint); err != nil {
			return bad("Events.ReplayEndpoint: %v", err)
		}
	}
	return cfg, nil
}

// splitTCP parses "tcp://host:port" into a dialable or listenable address; wildcard reports a
// "*" host (mapped to 0.0.0.0).
func splitTCP(ep string) (addr string, wildcard bool, err error) {
	rest, ok := strings.CutPrefix(ep, "tcp://")
	if !ok {
		return "", false, fmt.Errorf("%q: want tcp://host:port", ep)
	}
	i := strings.LastIndexByte(rest, ':')
	if i < 0 || i == len(rest)-1 {
		return "", false, fmt.Errorf("%q: want tcp://host:port", ep)
	}
	host := rest[:i]
	if host == "*" {
		return "0.0.0.0" + rest[i:], true, nil
	}
	if host == "" {
		return "", false, fmt.Errorf("%q: empty host", ep)
	}
	return rest, false, nil
}
