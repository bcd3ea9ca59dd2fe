// Command soak runs the reference proxy (examples/proxy) for a while under a realistic load and
// injects faults on a schedule, records what its clients and the proxy went through each second,
// and checks that the proxy recovered from each fault.
//
//	go run ./benchmarks/cmd/soak -duration 3m                    # every fault, Markdown on stdout
//	go run ./benchmarks/cmd/soak -duration 10m -out results/soak # with soak.csv, soak.svg, soak.md
//
// # Fleet
//
// Every part is a process of its own on 127.0.0.1, on ports chosen at start and kept across
// restarts: -engines simulated vLLM engines (go build ./examples/enginesim; OpenAI API, KV events
// over ZMQ with a replay socket, the default latency model), a Redis server (redis-server
// --save "", so a restart comes back empty), a NATS server with JetStream whose store directory
// survives its restarts (this program re-executed as "soak nats", the server of
// github.com/nats-io/nats-server/v2), and -replicas proxies (go build ./examples/proxy, its YAML
// written by this program): a Redis response cache shared by the replicas (fallback_to_memory
// on), a KV index (-index memory: fed from a JetStream event log, replicas.event_log; -index
// redis: one shared Redis index), the replicas sharing their decisions over NATS. Replica 0
// subscribes to the engines' events through a TCP relay of this program's, so that the event
// stream can be cut as a network would cut it.
//
// # Load
//
// An open loop at -rate requests per second, alternating between the replicas as a load balancer
// would: multi-turn chats over a few long shared system prompts (so KV-aware routing matters),
// streamed or not; deterministic requests (temperature 0) from a small pool, repeated, which the
// response cache serves; and, rarely, a malformed body (400 expected), a client that reads its
// stream slowly and one that sends its body slowly. A 4 MiB body goes every -huge-every, on a
// steady beat so that every window of the run holds as many: the engines refuse it as longer
// than their context (400, as vLLM does), which the proxy relays.
//
// # Faults
//
// -faults lists them (default all), spread evenly after -warmup, each lasting -downtime:
//
//	engine  an engine killed (SIGKILL) and restarted on its ports, empty
//	redis   Redis killed and restarted, empty
//	nats    the NATS server killed and restarted on its store
//	events  replica 0's event stream of one engine cut (ZMQ and replay relays drop every
//	        connection and refuse new ones), then restored
//	stall   -stall-conns connections announce an 8 MiB body, send one byte and stall for -stall-for
//
// # Records and pass criteria
//
// Each second: requests ok, expected rejections (the malformed bodies), failures before the first
// byte (no 2xx answer: a transport error or a 5xx) and failures mid-stream (a 2xx answer cut
// short), these split into those cut by their engine's death and the others; p50 and p99 latency
// of the ok requests; each proxy's resident set size and open files (from /proc) and goroutines
// (go_goroutines of its /metrics); the KV-aware share, kv_aware over every decision in
// kvroute_kv_index_routing_decisions_total summed over the replicas, over a 5 s window.
//
// The run fails (exit status 1, after the report) unless: no request failed before its first
// byte (one engine is down at most, so a healthy engine always exists); no request was cut
// mid-stream but by its engine's death; after each fault, each proxy's RSS (median), goroutines
// and open files (least: the floor a leak raises, not the requests in flight at a reading) over
// the last 5 s before the next fault (or the end) are within 10 % of the same over the 5 s before
// the fault (so that what the load itself grows, caches filling up, is not charged to the
// faults; the report shows the baseline before the first); the KV-aware share is back to 90 % of its baseline within
// 10 s of each fault's end; and the response cache lost nothing but what Redis held when it
// died: a deterministic request whose answer was stored (a MISS) while Redis was up must be a
// HIT when repeated at least a second later with Redis up and no Redis death in between.
//
// Outputs: the report as Markdown on stdout (and soak.md), soak.csv (one row a second) and
// soak.svg (the series over time, the faults shaded) in -out.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, "soak:", err)
		}
		os.Exit(1)
	}
}

// run is main without the exit: "nats" serves the NATS server; anything else is the soak.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == natsCommand {
		return natsMain(ctx, args[1:], stdout, stderr)
	}
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	return soak(ctx, o, stdout, stderr)
}

// options are the soak's flags.
type options struct {
	duration   time.Duration
	warmup     time.Duration
	downtime   time.Duration
	rate       float64
	hugeEvery  time.Duration
	engines    int
	replicas   int
	index      string
	faults     []string
	stallConns int
	stallFor   time.Duration
	connIdle   time.Duration // resources are judged only this long after a fault's end
	out        string
	repo       string
	seed       int64
	args       []string
}

// allFaults are the faults, in the order the schedule runs them.
var allFaults = []string{faultEngine, faultRedis, faultNATS, faultEvents, faultStall}

const (
	faultEngine = "engine"
	faultRedis  = "redis"
	faultNATS   = "nats"
	faultEvents = "events"
	faultStall  = "stall"
)

func parseFlags(args []string, stderr io.Writer) (options, error) {
	fs := flag.NewFlagSet("soak", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := options{args: args}
	var faults string
	fs.DurationVar(&o.duration, "duration", 3*time.Minute, "length of the load, warm-up included")
	fs.DurationVar(&o.warmup, "warmup", 20*time.Second, "load before the first fault; its last 5 s are the baseline")
	fs.DurationVar(&o.downtime, "downtime", 5*time.Second, "how long each fault lasts (a process down, the stream cut)")
	fs.Float64Var(&o.rate, "rate", 30, "requests per second, open loop")
	fs.DurationVar(&o.hugeEvery, "huge-every", 10*time.Second, "send a 4 MiB chat body this often (0: never)")
	fs.IntVar(&o.engines, "engines", 3, "simulated engines")
	fs.IntVar(&o.replicas, "replicas", 2, "proxy replicas (1 or 2); with 2 they share over NATS")
	fs.StringVar(&o.index, "index", "memory", "KV index: memory (fed by a JetStream event log with 2 replicas) or redis")
	fs.StringVar(&faults, "faults", strings.Join(allFaults, ","), "faults to inject, comma-separated: "+strings.Join(allFaults, ", ")+" (none: \"\")")
	fs.IntVar(&o.stallConns, "stall-conns", 16, "stall fault: connections announcing an 8 MiB body")
	fs.DurationVar(&o.connIdle, "conn-idle", 90*time.Second, "the proxies' idle-connection timeout (kvhttp's transport): RSS, goroutines and open files are judged "+
		"only over a window this long after a fault's end, when the connections opened for the fault's retries have closed (0: always)")
	fs.DurationVar(&o.stallFor, "stall-for", 15*time.Second, "stall fault: how long each stalled connection holds on unless the proxy closes it")
	fs.StringVar(&o.out, "out", "", "directory for soak.csv, soak.svg and soak.md (default: none, the report on stdout only)")
	fs.StringVar(&o.repo, "repo", "", "the kvroute module's root (default: the module of the working directory)")
	fs.Int64Var(&o.seed, "seed", 1, "seed of the load's random choices")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: soak [flags]\n\nA soak of the reference proxy with faults; see go doc ./benchmarks/cmd/soak.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if faults != "" {
		for f := range strings.SplitSeq(faults, ",") {
			f = strings.TrimSpace(f)
			known := false
			for _, k := range allFaults {
				known = known || f == k
			}
			if !known {
				return o, fmt.Errorf("-faults: unknown fault %q (want %s)", f, strings.Join(allFaults, ", "))
			}
			o.faults = append(o.faults, f)
		}
	}
	switch {
	case fs.NArg() > 0:
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	case o.engines < 2 || o.engines > 16:
		return o, fmt.Errorf("-engines %d: want 2 to 16 (an engine fault leaves the others serving)", o.engines)
	case o.replicas < 1 || o.replicas > 2:
		return o, fmt.Errorf("-replicas %d: want 1 or 2", o.replicas)
	case o.index != "memory" && o.index != "redis":
		return o, fmt.Errorf("-index %q: want memory or redis", o.index)
	case !(o.rate >= 1 && o.rate <= 1000):
		return o, fmt.Errorf("-rate %v: want 1 to 1000", o.rate)
	case o.warmup < 10*time.Second:
		return o, fmt.Errorf("-warmup %v: want at least 10s (the baseline is its last 5 s)", o.warmup)
	case o.downtime < time.Second:
		return o, fmt.Errorf("-downtime %v: want at least 1s", o.downtime)
	case o.stallConns < 1 || o.stallConns > 1024:
		return o, fmt.Errorf("-stall-conns %d: want 1 to 1024", o.stallConns)
	}
	if _, err := newSchedule(o.faults, o.warmup, o.duration, o.longestFault()); err != nil {
		return o, err
	}
	return o, nil
}

// longestFault is the longest a fault of o lasts: -downtime, or -stall-for with the stall fault.
func (o options) longestFault() time.Duration {
	d := o.downtime
	for _, f := range o.faults {
		if f == faultStall {
			d = max(d, o.stallFor)
		}
	}
	return d
}
