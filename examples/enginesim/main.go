// Command enginesim runs one simulated vLLM engine (package internal/enginesim) as its own
// process, for fleets of separate processes: the OpenAI, Anthropic, /tokenize and /metrics HTTP
// API with prefix caching and a latency model, and KV events over ZMQ (vLLM's wire format) and SSE.
//
//	go run ./examples/enginesim -addr 127.0.0.1:8001 -name vllm-1 \
//	    -zmq-endpoint 'tcp://*:5557' -replay-endpoint tcp://127.0.0.1:5558 -sse -speed 1
//
// Prefill/decode disaggregation through an S3 bucket (the credentials may come from
// AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY instead of the flags):
//
//	go run ./examples/enginesim -addr 127.0.0.1:8001 -name prefill-1 -role prefill \
//	    -s3-endpoint http://127.0.0.1:7070 -s3-bucket kv -kv-namespace inference/kv-cache
//	go run ./examples/enginesim -addr 127.0.0.1:8002 -name decode-1 -role decode \
//	    -s3-endpoint http://127.0.0.1:7070 -s3-bucket kv -kv-namespace inference/kv-cache
//
// SIGINT or SIGTERM stops it gracefully: new requests get 503, requests in flight finish (up to
// -shutdown-timeout), then the sockets close.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/kvroute/kvroute/internal/enginesim"
)

func main() {
	if err := run(os.Args[1:], os.Getenv); err != nil {
		fmt.Fprintln(os.Stderr, "enginesim:", err)
		os.Exit(1)
	}
}

// options are the settings of run beyond the engine's Config.
type options struct {
	addr    string
	timeout time.Duration
	verbose bool
}

func run(args []string, getenv func(string) string) error {
	cfg, opts, err := parseFlags(args, getenv)
	if err != nil {
		return err
	}
	level := slog.LevelInfo
	if opts.verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	cfg.Logger = log

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	e, err := enginesim.New(cfg)
	if err != nil {
		return err
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", opts.addr)
	if err != nil {
		return errors.Join(err, e.Close())
	}
	if err := e.Serve(ln); err != nil {
		return errors.Join(err, e.Close())
	}
	if err := e.Start(ctx); err != nil {
		return errors.Join(err, e.Close())
	}
	attrs := []any{"name", e.Name(), "model", e.Model(), "url", e.URL(), "zmq", e.ZMQEndpoint(), "topic", e.Topic(),
		"replay", e.ReplayEndpoint(), "sse", cfg.Events.SSE, "role", cfg.Role.String()}
	if sc := e.Config().Storage; sc != nil {
		attrs = append(attrs, "storage", *sc) // credentials redacted
	}
	log.Info("enginesim serving", attrs...)

	<-ctx.Done()
	stop()
	log.Info("enginesim shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), opts.timeout)
	defer cancel()
	if err := e.Shutdown(sctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return nil
}

// parseFlags maps the command line onto the engine's Config; getenv supplies the S3 credentials
// that the flags leave empty (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY).
func parseFlags(args []string, getenv func(string) string) (enginesim.Config, options, error) {
	fs := flag.NewFlagSet("enginesim", flag.ContinueOnError)
	var (
		cfg      enginesim.Config
		addr     = fs.String("addr", "127.0.0.1:8000", "HTTP listen address")
		hashes   = fs.String("hashes", "uint", "block hash encoding in ZMQ events: uint, int (signed) or bytes (32-byte digest)")
		timeout  = fs.Duration("shutdown-timeout", 30*time.Second, "how long SIGTERM waits for requests in flight")
		verbose  = fs.Bool("v", false, "debug logging")
		seed     = fs.Uint64("hash-seed", 0, "block hash seed (0: random per process, like vLLM)")
		latBase  = fs.Duration("latency-base", enginesim.DefaultLatency.Base, "prefill: fixed cost a")
		latTok   = fs.Duration("latency-per-token", enginesim.DefaultLatency.PerToken, "prefill: cost b per uncached token")
		latQuad  = fs.Float64("latency-quadratic-ns", enginesim.DefaultLatency.Quadratic, "prefill: c in ns per token² (n²−p²)")
		latOut   = fs.Duration("latency-per-output-token", enginesim.DefaultLatency.PerOutputToken, "decode time per completion token")
		latCPU   = fs.Duration("latency-cpu-load-per-token", 0, "prefill: cost per token loaded from the CPU tier")
		speed    = fs.Float64("speed", 1, "wall-clock seconds slept per virtual second (0: no sleeping)")
		mapForm  = fs.Bool("map-form", false, "KV-event batches as msgpack maps (vLLM 2026) instead of arrays")
		zmqBind  = fs.Bool("zmq-bind", false, "bind the PUB socket (also implied by a '*' host); otherwise connect to a router's bound SUB socket")
		flushInt = fs.Duration("flush-interval", 0, "hold KV events up to this long before publishing (0: every engine step)")
		role     = fs.String("role", "unified", "disaggregation role: unified, prefill or decode")
		s3       enginesim.StorageConfig
		lookup   = fs.String("storage-lookup", "auto", "look prompts up in storage without kv_transfer_params: auto (decode role only), on or off")
	)
	fs.StringVar(&s3.Endpoint, "s3-endpoint", "", "external KV storage: S3 endpoint, http(s)://host:port ('' disables storage)")
	fs.StringVar(&s3.Bucket, "s3-bucket", "", "external KV storage: bucket")
	fs.StringVar(&s3.Namespace, "kv-namespace", enginesim.DefaultKVNamespace, "external KV storage: key prefix of the blocks")
	fs.StringVar(&s3.Region, "s3-region", enginesim.DefaultStorageRegion, "external KV storage: signing region")
	fs.StringVar(&s3.AccessKey, "s3-access-key", "", "external KV storage: access key (default $AWS_ACCESS_KEY_ID)")
	fs.StringVar(&s3.SecretKey, "s3-secret-key", "", "external KV storage: secret key (default $AWS_SECRET_ACCESS_KEY)")
	fs.Int64Var(&s3.BytesPerToken, "kv-bytes-per-token", enginesim.DefaultBytesPerToken, "simulated KV size of one token, bytes")
	fs.Float64Var(&s3.BandwidthBytesPerSec, "storage-bandwidth", enginesim.DefaultStorageBandwidth, "simulated storage bandwidth, bytes per second")
	fs.StringVar(&cfg.Name, "name", enginesim.DefaultName, "engine name (the <pod> of kv@<pod>@<model>)")
	fs.StringVar(&cfg.Model, "model", enginesim.DefaultModel, "served model name")
	fs.IntVar(&cfg.BlockSize, "block-size", enginesim.DefaultBlockSize, "tokens per KV block")
	fs.IntVar(&cfg.CapacityBlocks, "capacity-blocks", enginesim.DefaultCapacityBlocks, "GPU KV cache size in blocks")
	fs.IntVar(&cfg.CPUCapacityBlocks, "cpu-capacity-blocks", 0, "CPU offload tier size in blocks (0: none)")
	fs.IntVar(&cfg.MaxModelLen, "max-model-len", enginesim.DefaultMaxModelLen, "prompt plus completion tokens per request")
	fs.IntVar(&cfg.MaxConcurrent, "max-concurrent", enginesim.DefaultMaxConcurrent, "requests running at once (max_num_seqs)")
	fs.IntVar(&cfg.MaxQueue, "max-queue", 0, "requests waiting (0: unbounded, <0: none); beyond it 503")
	fs.IntVar(&cfg.OutputTokens, "output-tokens", enginesim.DefaultOutputTokens, "completion tokens when a request sets no max_tokens")
	fs.StringVar(&cfg.Events.ZMQEndpoint, "zmq-endpoint", "", "ZMQ PUB endpoint, e.g. tcp://*:5557 ('' disables ZMQ events)")
	fs.StringVar(&cfg.Events.Topic, "topic", "", "ZMQ topic: '' or kv@<pod>@<model>")
	fs.StringVar(&cfg.Events.ReplayEndpoint, "replay-endpoint", "", "ZMQ replay ROUTER endpoint to bind, e.g. tcp://127.0.0.1:5558")
	fs.IntVar(&cfg.Events.BatchSize, "batch-size", 0, "most events per batch (0: no cap)")
	fs.IntVar(&cfg.Events.DataParallelRank, "dp-rank", 0, "data_parallel_rank of the batches")
	fs.BoolVar(&cfg.Events.SSE, "sse", false, "serve SSE KV events at GET /v1/kv_events")
	if err := fs.Parse(args); err != nil {
		return cfg, options{}, err
	}
	opts := options{addr: *addr, timeout: *timeout, verbose: *verbose}
	cfg.HashSeed = *seed
	cfg.Latency = enginesim.Latency{Base: *latBase, PerToken: *latTok, Quadratic: *latQuad, PerOutputToken: *latOut,
		CPULoadPerToken: *latCPU, SpeedFactor: *speed}
	cfg.Events.MapForm, cfg.Events.ZMQBind, cfg.Events.FlushInterval = *mapForm, *zmqBind, *flushInt
	switch *hashes {
	case "uint":
		cfg.Events.Hashes = enginesim.HashUint
	case "int":
		cfg.Events.Hashes = enginesim.HashInt
	case "bytes":
		cfg.Events.Hashes = enginesim.HashBytes
	default:
		return cfg, opts, fmt.Errorf("-hashes %q: want uint, int or bytes", *hashes)
	}
	var err error
	if cfg.Role, err = enginesim.ParseRole(*role); err != nil {
		return cfg, opts, err
	}
	if s3.Lookup, err = enginesim.ParseStorageLookup(*lookup); err != nil {
		return cfg, opts, err
	}
	if s3.Endpoint != "" || s3.Bucket != "" {
		if s3.AccessKey == "" {
			s3.AccessKey = getenv("AWS_ACCESS_KEY_ID")
		}
		if s3.SecretKey == "" {
			s3.SecretKey = getenv("AWS_SECRET_ACCESS_KEY")
		}
		cfg.Storage = &s3
	}
	return cfg, opts, nil
}
