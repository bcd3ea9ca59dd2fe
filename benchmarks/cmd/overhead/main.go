// Command overhead measures what the reference proxy (examples/proxy) adds to a request, against
// the engine alone and against a bare relay, and what kvroute-epp, the endpoint picker behind an
// Envoy ext_proc filter, adds, against a picker that does nothing, in one run, and prints the
// result as a markdown table that BENCHMARKS.md shows verbatim with the command that made it.
//
//	go run ./benchmarks/cmd/overhead                       # defaults: 3 rounds, 3 s per target
//	go run ./benchmarks/cmd/overhead -rounds 5 -rate 1500  # from the module root (or -repo DIR)
//
// # Targets
//
// One simulated vLLM engine (internal/enginesim, KV events over ZMQ, latency model off:
// Latency{SpeedFactor: 0} sleeps not at all) answers every request, whichever the path:
//
//	(a) engine direct: the engine's own HTTP server;
//	(b) bare relay: httputil.ReverseProxy over an http.Transport tuned for the load (keep-alive
//	    pool ≥ connections, no compression, no environment proxy), served by http.Server;
//	(c) the proxy with tier 1 only (prefix routing; no response cache, no KV index);
//	(d) the proxy with the in-memory response cache and the tier-4 in-memory KV index fed by the
//	    engine's ZMQ events (tokenizer "estimate" by default, -tokenizer engine for the
//	    engine's /tokenize), every request a cache MISS;
//	(e) the proxy of (d) answering a response-cache HIT (one request repeated);
//	(f) a Go stand-in for Envoy (envoysim.Forwarder on http.Server, full-duplex bodies both ways)
//	    asking a no-op picker over ext_proc: a gRPC server that names the engine in
//	    x-gateway-destination-endpoint and hands the bodies back, nothing else (what any
//	    picker's ext_proc round trips cost);
//	(g) an identical stand-in asking kvroute's extproc.Server, tier 1 only (composed as
//	    kvroute-epp composes it, from the configuration of (c));
//	(h) an identical stand-in asking kvroute's extproc.Server with the tier-4 in-memory KV index
//	    fed by the engine's ZMQ events (the configuration of (d) without the response cache,
//	    which an endpoint picker does not have).
//
// (f) to (h) are on by default; -epp=false leaves them out. (f) − (a) is what the ext_proc hop
// and the stand-in cost; (g) − (f) and (h) − (f) are what kvroute's picker adds to any picker.
//
// Each runs in a child process of this one, the load generator: the engine and the relay are
// this program re-executed ("overhead engine", "overhead relay -upstream URL", "overhead picker",
// "overhead gateway": one picker and one gateway per target of (f) to (h)), the proxy is
// built once (go build ./examples/proxy) and started per configuration with a YAML file written
// to a temporary directory, health checks off. So every target pays one process boundary and has
// a scheduler and a garbage collector of its own, as a deployed engine, relay or proxy does, and
// none shares them with the load generator. A picker and its gateway are separate processes, as
// kvroute-epp and Envoy are.
//
// Every request is a non-streamed POST /v1/chat/completions at temperature 0 with a 1 KiB system
// prompt and max_tokens 16; every target but (e) varies the user message per request, so that
// they ask the engine for the same work and (d) misses the cache; (e) repeats one.
//
// # Load
//
// Two loads, each over its own HTTP/1.1 keep-alive connections (one http.Client with a
// Transport of one connection per simulated client):
//
//   - 1 connection, closed loop: one request at a time, latency from send to the end of the body;
//   - -conns connections, open loop at -rate requests per second in total: connection k sends
//     requests k, k+conns, … at their scheduled times t₀ + i/rate. A request whose connection was
//     still busy at its scheduled time is timed from that time, so that a stall is charged in
//     full (no coordinated omission); one sent on time is timed from its send, so that the load
//     generator's timer slack is charged to nobody.
//
// After a warm-up (-warmup per target and load), each of -rounds rounds runs every target for
// -duration under each load, the targets interleaved and their order rotated each round, so that
// noise on the machine falls on all of them alike. The table gives, per target and load, the
// medians across rounds of p50, p90 and p99, of p50 minus (b)'s and (a)'s of the same round and
// of p50 over (b)'s, each with its min–max across rounds (and, for (f) to (h), a second table of
// p50 and p99 differences to (a) and (f)), and checks the targets:
//
//   - 1 connection: (c) − (b) ≤ 25 µs p50; (d) − (b) ≤ 60 µs p50; (e) ≤ (a) p50;
//   - -conns connections: (c) ≤ 1.25 × (b) p50.
//
// Each row also gives the CPU time per request of the process serving the target and of all the
// processes (from /proc/PID/stat, where there is one); the front process of (f) to (h) is the
// picker. -cpuprofile DIR records CPU profiles of the relay, the proxies and the pickers while
// they serve (b) to (h) (see profile.go); profiling slows them, so
// such a run's table is not the one to publish.
//
// Everything listens and connects on 127.0.0.1. The children are killed when the program ends,
// on an error and on SIGINT or SIGTERM too (and, on Linux, when it dies: Pdeathsig). A failed
// request or an unexpected X-Cache makes the program exit 1 after the table; a missed target
// does not.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, "overhead:", err)
		}
		os.Exit(1)
	}
}

// run is main without the exit and the signals: "relay" runs the relay (b) alone, "engine" the
// engine, "picker" and "gateway" a picker and its stand-in for Envoy; anything else is the
// measurement, which starts them as its children.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 {
		switch args[0] {
		case relayCommand:
			return relayMain(ctx, args[1:], stdout, stderr)
		case engineCommand:
			return engineMain(ctx, args[1:], stdout, stderr)
		case pickerCommand:
			return pickerMain(ctx, args[1:], stdout, stderr)
		case gatewayCommand:
			return gatewayMain(ctx, args[1:], stdout, stderr)
		}
	}
	opts, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	return measure(ctx, opts, stdout, stderr)
}

// options are the measurement's flags.
type options struct {
	rounds    int
	duration  time.Duration
	warmup    time.Duration
	rate      float64
	conns     int
	maxTokens int
	tokenizer string
	repo      string
	proxy     string
	profDir   string
	epp       bool
	args      []string // as given, for the table's header
}

// Defaults of the flags. DefaultRate leaves every target unsaturated at 64 connections on
// 2 vCPUs: measured there, the costliest targets, (b) to (d), take about 500 µs of CPU per request
// over all the processes (load generator included), so 2,000 req/s keep about one of the two CPUs
// busy.
const (
	DefaultRounds    = 3
	DefaultDuration  = 3 * time.Second
	DefaultWarmup    = time.Second
	DefaultRate      = 2000
	DefaultConns     = 64
	DefaultMaxTokens = 16
)

func parseFlags(args []string, stderr io.Writer) (options, error) {
	fs := flag.NewFlagSet("overhead", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := options{args: args}
	fs.IntVar(&o.rounds, "rounds", DefaultRounds, "rounds; each runs every target under each load")
	fs.DurationVar(&o.duration, "duration", DefaultDuration, "measurement per target, load and round")
	fs.DurationVar(&o.warmup, "warmup", DefaultWarmup, "warm-up per target and load, before the first round")
	fs.Float64Var(&o.rate, "rate", DefaultRate, "open-loop load: requests per second in total over -conns connections")
	fs.IntVar(&o.conns, "conns", DefaultConns, "open-loop load: connections")
	fs.IntVar(&o.maxTokens, "max-tokens", DefaultMaxTokens, "max_tokens of every request (the engine generates exactly that many)")
	fs.StringVar(&o.tokenizer, "tokenizer", "estimate", "kv_cache_index.tokenizer of proxy (d) and picker (h): estimate or engine (a /tokenize call per request)")
	fs.StringVar(&o.repo, "repo", "", "the kvroute module's root (default: the module of the working directory, go env GOMOD)")
	fs.StringVar(&o.proxy, "proxy", "", "a proxy binary built from ./examples/proxy to measure (default: build it from -repo)")
	fs.StringVar(&o.profDir, "cpuprofile", "", "record CPU profiles of the relay, the proxies and the pickers during targets (b) to (h) into this directory (costs them CPU)")
	fs.BoolVar(&o.epp, "epp", true, "also measure kvroute-epp: targets (f) to (h), envoysim in front of a no-op picker and of kvroute's")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: overhead [flags]\n\nMeasures the reference proxy's overhead; see go doc ./benchmarks/cmd/overhead.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	switch {
	case fs.NArg() > 0:
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	case o.rounds < 1 || o.rounds > 100:
		return o, fmt.Errorf("-rounds %d: want 1 to 100", o.rounds)
	case o.duration < 10*time.Millisecond || o.duration > 10*time.Minute:
		return o, fmt.Errorf("-duration %v: want 10ms to 10m", o.duration)
	case o.warmup < 0 || o.warmup > 10*time.Minute:
		return o, fmt.Errorf("-warmup %v: want 0 to 10m", o.warmup)
	case !(o.rate >= 1 && o.rate <= 1e6):
		return o, fmt.Errorf("-rate %v: want 1 to 1e6", o.rate)
	case o.conns < 1 || o.conns > 4096:
		return o, fmt.Errorf("-conns %d: want 1 to 4096", o.conns)
	case o.maxTokens < 1 || o.maxTokens > 4096:
		return o, fmt.Errorf("-max-tokens %d: want 1 to 4096", o.maxTokens)
	case o.tokenizer != "estimate" && o.tokenizer != "engine":
		return o, fmt.Errorf("-tokenizer %q: want estimate or engine", o.tokenizer)
	}
	return o, nil
}
