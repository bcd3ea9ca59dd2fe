// Command replay measures kvroute's routing quality: it replays a Mooncake-format trace, or a
// generated workload, on a simulated fleet in virtual time under each routing policy and the two
// oracles, and writes the tables (Markdown text), CSV, JSON and an SVG chart.
//
//	go run ./benchmarks/cmd/replay                                    # the synthetic trace, defaults
//	go run ./benchmarks/cmd/replay -workload shared-prefix -out benchmarks/results
//	go run ./benchmarks/cmd/replay -sweep engines -seeds 1,2,3 -out /tmp/sweep
//	go run ./benchmarks/cmd/replay -trace my-trace.jsonl.gz -limit 300
//
// See package benchmarks/replay for the model, and BENCHMARKS.md for results.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/benchmarks/replay"
)

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "replay:", err)
		os.Exit(1)
	}
}

type options struct {
	trace, workload, policies, sweep, out, seeds string
	engines, capacity, limit, common, workers    int
	blockSize, requests                          int
	utilisation                                  float64
	lag                                          time.Duration
	parallelPrefill                              bool
	pd                                           string
	bytesPerToken                                int64
	bandwidth                                    float64
	pdSpecOff                                    bool
}

func run(args []string, stdout io.Writer) error {
	var o options
	fs := flag.NewFlagSet("replay", flag.ContinueOnError)
	fs.StringVar(&o.trace, "trace", "../shared/traces/mooncake_synthetic_trace.jsonl.gz", "Mooncake-format trace (JSON lines, plain or gzip) for -workload trace")
	fs.StringVar(&o.workload, "workload", "trace", "trace, shared-prefix or multi-turn")
	fs.IntVar(&o.requests, "requests", 0, "requests of a generated workload (0: the generator's default)")
	fs.IntVar(&o.engines, "engines", replay.DefaultEngines, "engines in the fleet")
	fs.IntVar(&o.capacity, "capacity-tokens", replay.DefaultCapacityTokens, "KV cache per engine, in tokens")
	fs.IntVar(&o.blockSize, "block-size", replay.DefaultBlockSize, "KV block size of the engines and of kvroute's index")
	fs.Float64Var(&o.utilisation, "utilisation", replay.DefaultUtilisation, "offered load the arrivals are scaled to (fraction of the fleet's capacity without cache hits); negative keeps the workload's own timing")
	fs.DurationVar(&o.lag, "event-lag", replay.DefaultEventLag, "delay before the router's index sees an engine's KV event")
	fs.BoolVar(&o.parallelPrefill, "parallel-prefill", false, "run every admitted prefill at once (internal/enginesim's model) instead of one at a time per engine")
	fs.StringVar(&o.seeds, "seeds", "1", "comma-separated seeds")
	fs.StringVar(&o.policies, "policies", "all", "comma-separated policies: "+strings.Join(replay.AllPolicies, ", "))
	fs.StringVar(&o.sweep, "sweep", "", "sweep one dimension: engines (4,8,16), capacity (131072,262144,524288), utilisation (0.5,0.7,0.8,0.9), lag (0,20ms,200ms,1s,5s), or all")
	fs.StringVar(&o.out, "out", "", "directory for the .txt, .csv, .json and .svg outputs (none when empty)")
	fs.IntVar(&o.limit, "limit", 0, "replay only the first N requests (0: all)")
	fs.IntVar(&o.common, "common-prefix-tokens", 0, "prepend this many tokens shared by every request (one first block and prefix key for all)")
	fs.IntVar(&o.workers, "workers", runtime.GOMAXPROCS(0), "policies simulated in parallel")
	fs.StringVar(&o.pd, "pd", "", "compare prefill/decode fleets (comma-separated prefill:decode, e.g. 2:6) with -policies (default kvroute) on unified fleets of as many engines, same arrivals")
	fs.Int64Var(&o.bytesPerToken, "bytes-per-token", replay.DefaultBytesPerToken, "with -pd: KV bytes per token moved through storage")
	fs.Float64Var(&o.bandwidth, "storage-bandwidth", replay.DefaultStorageBandwidth, "with -pd: bytes per second of each transfer between an engine and storage")
	fs.BoolVar(&o.pdSpecOff, "pd-speculation-off", false, "with -pd: turn tier 4's speculation off for the P/D router")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if o.pd != "" {
		return runPD(fs, o, stdout)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	policies, err := replay.ParsePolicies(o.policies)
	if err != nil {
		return err
	}
	seeds, err := parseSeeds(o.seeds)
	if err != nil {
		return err
	}
	base := replay.Config{Engines: o.engines, CapacityTokens: o.capacity, BlockSize: o.blockSize,
		Utilisation: o.utilisation, EventLag: o.lag, ParallelPrefill: o.parallelPrefill}
	points, err := sweepPoints(base, o.sweep)
	if err != nil {
		return err
	}

	// Generated workloads depend on the seed; a trace does not (the seed salts its tokens).
	workloads := map[uint64]*replay.Workload{}
	for _, seed := range seeds {
		w, err := load(o, seed)
		if err != nil {
			return err
		}
		workloads[seed] = w
	}
	name := workloads[seeds[0]].Name

	type job struct {
		w      *replay.Workload
		cfg    replay.Config
		policy string
	}
	var jobs []job
	for _, p := range points {
		for _, seed := range seeds {
			for _, pol := range policies {
				cfg := p
				cfg.Seed = seed
				jobs = append(jobs, job{workloads[seed], cfg, pol})
			}
		}
	}
	start := time.Now()
	results := make([]replay.Result, len(jobs))
	errs := make([]error, len(jobs))
	var wg sync.WaitGroup
	next := make(chan int)
	for range max(o.workers, 1) {
		wg.Go(func() {
			for i := range next {
				results[i], errs[i] = replay.Run(jobs[i].w, jobs[i].cfg, jobs[i].policy)
			}
		})
	}
	for i := range jobs {
		next <- i
	}
	close(next)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	wall := time.Since(start)

	sums := replay.Summarise(results)
	if err := replay.WriteTable(stdout, sums); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "\n%d requests × %d policies × %d seed(s) × %d point(s) in %.1f s wall (%d workers)\n",
		len(workloads[seeds[0]].Requests), len(policies), len(seeds), len(points), wall.Seconds(), o.workers)
	if o.out == "" {
		return nil
	}
	return writeOutputs(o, name, results, sums)
}

func load(o options, seed uint64) (*replay.Workload, error) {
	var w *replay.Workload
	var err error
	switch o.workload {
	case "trace":
		w, err = replay.ReadTraceFile(o.trace)
		if err == nil {
			w.Name = strings.TrimSuffix(strings.TrimSuffix(filepath.Base(o.trace), ".gz"), ".jsonl")
		}
	case "shared-prefix":
		w, err = replay.SharedPrefix(replay.SharedPrefixConfig{Requests: o.requests, Seed: seed})
	case "multi-turn":
		conv := 0
		if o.requests > 0 {
			conv = max(o.requests/8, 1)
		}
		w, err = replay.MultiTurn(replay.MultiTurnConfig{Conversations: conv, Seed: seed})
	default:
		return nil, fmt.Errorf("-workload %q: want trace, shared-prefix or multi-turn", o.workload)
	}
	if err != nil {
		return nil, err
	}
	if len(w.Requests) == 0 {
		return nil, fmt.Errorf("workload %s has no request", w.Name)
	}
	return w.WithCommonPrefix(o.common).Limit(o.limit), nil
}

func parseSeeds(s string) ([]uint64, error) {
	var out []uint64
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.ParseUint(strings.TrimSpace(f), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("-seeds %q: %w", s, err)
		}
		out = append(out, v)
	}
	return out, nil
}

// sweepPoints returns the fleet configurations of a sweep (just base without one).
func sweepPoints(base replay.Config, sweep string) ([]replay.Config, error) {
	var out []replay.Config
	add := func(f func(*replay.Config)) { // each configuration once: the sweeps share the base point
		c := base
		f(&c)
		for _, o := range out {
			if o == c {
				return
			}
		}
		out = append(out, c)
	}
	dims := map[string]func(){
		"engines": func() {
			for _, n := range []int{4, 8, 16} {
				add(func(c *replay.Config) { c.Engines = n })
			}
		},
		"capacity": func() {
			for _, n := range []int{131_072, 262_144, 524_288} {
				add(func(c *replay.Config) { c.CapacityTokens = n })
			}
		},
		"utilisation": func() {
			for _, u := range []float64{0.5, 0.7, 0.8, 0.9} {
				add(func(c *replay.Config) { c.Utilisation = u })
			}
		},
		"lag": func() {
			for _, d := range []time.Duration{0, 20 * time.Millisecond, 200 * time.Millisecond, time.Second, 5 * time.Second} {
				add(func(c *replay.Config) { c.EventLag = d })
			}
		},
	}
	switch sweep {
	case "":
		return []replay.Config{base}, nil
	case "all":
		for _, d := range []string{"engines", "capacity", "utilisation", "lag"} {
			dims[d]()
		}
		return out, nil
	}
	f, ok := dims[sweep]
	if !ok {
		return nil, fmt.Errorf("-sweep %q: want engines, capacity, utilisation, lag or all", sweep)
	}
	f()
	return out, nil
}

func writeOutputs(o options, name string, rs []replay.Result, ss []replay.Summary) error {
	if err := os.MkdirAll(o.out, 0o755); err != nil {
		return err
	}
	stem := name
	if o.sweep != "" {
		stem += "-sweep-" + o.sweep
	}
	write := func(file string, f func(io.Writer) error) error {
		fh, err := os.Create(filepath.Join(o.out, file))
		if err != nil {
			return err
		}
		if err := f(fh); err != nil {
			fh.Close()
			return err
		}
		return fh.Close()
	}
	if err := write(stem+".txt", func(w io.Writer) error { return replay.WriteTable(w, ss) }); err != nil {
		return err
	}
	if err := write(stem+".csv", func(w io.Writer) error { return replay.WriteCSV(w, rs) }); err != nil {
		return err
	}
	if err := write(stem+".json", func(w io.Writer) error { return replay.WriteJSON(w, rs, ss) }); err != nil {
		return err
	}
	// One chart per point.
	for i := 0; i < len(ss); {
		j := i
		for j < len(ss) && ss[j].Point == ss[i].Point {
			j++
		}
		file := stem + ".svg"
		if o.sweep != "" {
			p := ss[i].Point
			file = fmt.Sprintf("%s-e%d-c%d-u%g-lag%gs.svg", stem, p.Engines, p.CapacityTokens, p.Utilisation, p.EventLagSec)
		}
		title := ss[i].Point.String()
		if err := write(file, func(w io.Writer) error { return replay.WriteChart(w, title, ss[i:j]) }); err != nil {
			return err
		}
		i = j
	}
	return nil
}

// runPD runs the -pd comparison and writes its outputs as <workload>-pd-<P>x<D>.*.
func runPD(fs *flag.FlagSet, o options, stdout io.Writer) error {
	fleets, err := replay.ParsePD(o.pd)
	if err != nil {
		return err
	}
	baseline := []string{replay.PolicyKVRoute}
	fs.Visit(func(f *flag.Flag) {
		if f.Name == "policies" {
			baseline = nil
		}
	})
	if baseline == nil {
		if baseline, err = replay.ParsePolicies(o.policies); err != nil {
			return err
		}
	}
	for i := range fleets {
		fleets[i].BytesPerToken, fleets[i].BandwidthBytesPerSec = o.bytesPerToken, o.bandwidth
		if o.pdSpecOff {
			fleets[i].Speculation = kvroute.SpeculateOff
		}
	}
	if o.sweep != "" {
		return errors.New("-pd does not combine with -sweep")
	}
	seeds, err := parseSeeds(o.seeds)
	if err != nil {
		return err
	}
	c := replay.PDComparison{Workloads: map[uint64]*replay.Workload{}, Seeds: seeds, Baseline: baseline, Fleets: fleets,
		Workers: o.workers, Base: replay.Config{CapacityTokens: o.capacity, BlockSize: o.blockSize,
			Utilisation: o.utilisation, EventLag: o.lag, ParallelPrefill: o.parallelPrefill}}
	for _, seed := range seeds {
		if c.Workloads[seed], err = load(o, seed); err != nil {
			return err
		}
	}
	start := time.Now()
	rs, err := c.Run()
	if err != nil {
		return err
	}
	ss := replay.SummarisePD(rs)
	if err := replay.WritePDTable(stdout, ss); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "\n%d requests × %d runs in %.1f s wall (%d workers)\n", len(c.Workloads[seeds[0]].Requests), len(rs),
		time.Since(start).Seconds(), o.workers)
	if o.out == "" {
		return nil
	}
	return replay.WritePDOutputs(o.out, replay.PDStem(c.Workloads[seeds[0]].Name, fleets), rs, ss)
}
