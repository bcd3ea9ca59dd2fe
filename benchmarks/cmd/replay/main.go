// Command replay measures kvroute's routing quality: it replays a Mooncake-format trace, or a
// generated workload, on a simulated fleet in virtual time under each routing policy and the two
// oracles, and writes the tables (Markdown text), CSV, JSON and an SVG chart.
//
//	go run ./benchmarks/cmd/replay                                    # the synthetic trace, defaults
//	go run ./benchmarks/cmd/replay -workload shared-prefix -out benchmarks/results
//	go run ./benchmarks/cmd/replay -sweep engines -seeds 1,2,3 -out /tmp/sweep
//	go run ./benchmarks/cmd/replay -trace my-trace.jsonl.gz -limit 300
//	go run ./benchmarks/cmd/replay -replicas 4 -sync peers -policies kvroute
//	go run ./benchmarks/cmd/replay -sweep replicas -workload trace,multi-turn -seeds 1,2,3
//	go run ./benchmarks/cmd/replay -sweep grid -seeds 1,2,3 -out /tmp/grid   # issue 21's grid
//
// See package benchmarks/replay for the model, and BENCHMARKS.md for results.
package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/benchmarks/replay"
	"github.com/kvroute/kvroute/benchmarks/traces"
	"github.com/kvroute/kvroute/internal/enginesim"
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
	engineAttention                              float64
	pd                                           string
	bytesPerToken                                int64
	bandwidth                                    float64
	pdSpecOff                                    bool
	replicas                                     int
	sweepReplicas                                string
	sync, spread, cpuProfile                     string
	syncDelay, peerDelay, scrapePeriod           time.Duration
	gridEngines, gridCapacity, gridUtilisation   string
	parallel                                     int
	burstPeriod                                  time.Duration
	burstDuty                                    float64
	dissect                                      string
}

func run(args []string, stdout io.Writer) error {
	var o options
	fs := flag.NewFlagSet("replay", flag.ContinueOnError)
	fs.StringVar(&o.trace, "trace", "", "Mooncake-format trace (JSON lines, plain or gzip) for -workload trace; empty: the synthetic trace shipped in benchmarks/traces")
	fs.StringVar(&o.workload, "workload", "trace", "trace, shared-prefix or multi-turn, or a comma-separated list of them")
	fs.IntVar(&o.requests, "requests", 0, "requests of a generated workload (0: the generator's default)")
	fs.IntVar(&o.engines, "engines", replay.DefaultEngines, "engines in the fleet")
	fs.IntVar(&o.capacity, "capacity-tokens", replay.DefaultCapacityTokens, "KV cache per engine, in tokens")
	fs.IntVar(&o.blockSize, "block-size", replay.DefaultBlockSize, "KV block size of the engines and of kvroute's index")
	fs.Float64Var(&o.utilisation, "utilisation", replay.DefaultUtilisation, "offered load the arrivals are scaled to (fraction of the fleet's capacity without cache hits); negative keeps the workload's own timing")
	fs.DurationVar(&o.lag, "event-lag", replay.DefaultEventLag, "delay before the router's index sees an engine's KV event")
	fs.Float64Var(&o.engineAttention, "engine-attention", 0, "the simulated engines' attention cost in ns per token² (0: enginesim's default 1.5, which with its 75 µs per token is kvroute's default attention_cost of 2e-5); the router keeps its default, so other values measure a router whose cost model is off")
	fs.BoolVar(&o.parallelPrefill, "parallel-prefill", false, "run every admitted prefill at once (internal/enginesim's model) instead of one at a time per engine")
	fs.StringVar(&o.seeds, "seeds", "1", "comma-separated seeds")
	fs.StringVar(&o.policies, "policies", "all", "comma-separated policies: "+strings.Join(replay.AllPolicies, ", "))
	fs.StringVar(&o.sweep, "sweep", "", "sweep one dimension: engines (4,8,16), capacity (131072,262144,524288), utilisation (0.5,0.7,0.8,0.9), lag (0,20ms,200ms,1s,5s), or all; or replicas (1,2,4,8 router replicas × sync none, metrics, peers, both; -policies defaults to kvroute, one table); or grid (issue 21: -grid-engines × -grid-capacity × -grid-utilisation × -workload, default trace,trace-common,multi-turn,shared-prefix; -policies defaults to every non-oracle policy and oracle_global_lru; one table judging kvroute)")
	fs.StringVar(&o.out, "out", "", "directory for the .txt, .csv, .json and .svg outputs (with -dissect: the dissection's .md and the per-request .csv); none when empty")
	fs.IntVar(&o.limit, "limit", 0, "replay only the first N requests (0: all)")
	fs.IntVar(&o.common, "common-prefix-tokens", 0, "prepend this many tokens shared by every request (one first block and prefix key for all)")
	fs.IntVar(&o.workers, "workers", runtime.GOMAXPROCS(0), "policies simulated in parallel")
	fs.StringVar(&o.pd, "pd", "", "compare prefill/decode fleets (comma-separated prefill:decode, e.g. 2:6) with -policies (default kvroute) on unified fleets of as many engines, same arrivals")
	fs.Int64Var(&o.bytesPerToken, "bytes-per-token", replay.DefaultBytesPerToken, "with -pd: KV bytes per token moved through storage")
	fs.Float64Var(&o.bandwidth, "storage-bandwidth", replay.DefaultStorageBandwidth, "with -pd: bytes per second of each transfer between an engine and storage")
	fs.BoolVar(&o.pdSpecOff, "pd-speculation-off", false, "with -pd: turn tier 4's speculation off for the P/D router")
	fs.IntVar(&o.replicas, "replicas", 1, "router replicas: each policy with router state runs as that many instances, arrivals spread over them")
	fs.StringVar(&o.sync, "sync", replay.SyncNone, "what router replicas share beyond the engines' KV events: none, metrics (engine load every -scrape-period), peers (decision events after -sync-delay) or both")
	fs.DurationVar(&o.syncDelay, "sync-delay", 5*time.Millisecond, "with -sync peers or both: delay before the other replicas apply a replica's decision event")
	fs.DurationVar(&o.peerDelay, "peer-delay", 0, "with -sync peers or both: the replicas' kvroute.Config.PeerDelay, how late they expect peers' decisions (0: -sync-delay, as an operator who measured it sets; negative: their estimate of peers' unseen work off)")
	fs.DurationVar(&o.scrapePeriod, "scrape-period", replay.DefaultScrapePeriod, "with -sync metrics or both: interval of each replica's engine-load reports")
	fs.StringVar(&o.spread, "spread", replay.SpreadRandom, "how arrivals are spread over router replicas: random (seeded, as an L4 load balancer) or round_robin")
	fs.StringVar(&o.sweepReplicas, "sweep-replicas", "1,2,4,8", "with -sweep replicas: the comma-separated replica counts")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of the runs to this file")
	fs.StringVar(&o.gridEngines, "grid-engines", "8,16", "with -sweep grid: the comma-separated engine counts")
	fs.StringVar(&o.gridCapacity, "grid-capacity", "262144,1048576,3000000", "with -sweep grid: the comma-separated KV cache sizes per engine, in tokens")
	fs.StringVar(&o.gridUtilisation, "grid-utilisation", "0.7,0.8,0.9", "with -sweep grid: the comma-separated utilisations")
	fs.DurationVar(&o.burstPeriod, "burst-period", 0, "make the arrivals burstier: in each period of virtual time, compress its arrivals into the first -burst-duty of it (0: the workload's own arrivals)")
	fs.Float64Var(&o.burstDuty, "burst-duty", 0.25, "with -burst-period: the fraction of each period its arrivals are compressed into (the rate inside a burst is 1/duty times the mean)")
	fs.StringVar(&o.dissect, "dissect", "", "dissect kvroute's routing request by request against these policies (comma-separated, e.g. precise,cost,oracle_global_lru) at the one point the other flags give: its hits turned away and its TTFT tail by cause")
	fs.IntVar(&o.parallel, "parallel", 0, "with -sweep grid: runs simulated at once (0: -workers); each run has its own engines, router and index")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if flagSet(fs, "burst-duty") && o.burstPeriod == 0 {
		return errors.New("-burst-duty needs -burst-period")
	}
	if o.dissect != "" {
		return runDissect(fs, o, stdout)
	}
	if o.pd != "" {
		return runPD(fs, o, stdout)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if o.sweep == "grid" {
		return runGrid(fs, o, stdout)
	}
	if o.sweep == "replicas" {
		// One kvroute run of the whole synthetic trace with 8 replicas takes about a minute of CPU:
		// the sweep's default is the first replicaSweepLimit requests of each workload.
		if !flagSet(fs, "policies") {
			o.policies = replay.PolicyKVRoute
		}
		if !flagSet(fs, "limit") {
			o.limit = replicaSweepLimit
		}
	}
	policies, err := replay.ParsePolicies(o.policies)
	if err != nil {
		return err
	}
	seeds, err := parseSeeds(o.seeds)
	if err != nil {
		return err
	}
	base := o.config()
	if o.replicas < 1 {
		return fmt.Errorf("-replicas %d: want at least 1", o.replicas)
	}
	if !slices.Contains(replay.SyncModes, o.sync) {
		return fmt.Errorf("-sync %q: want %s", o.sync, strings.Join(replay.SyncModes, ", "))
	}
	if o.spread != replay.SpreadRandom && o.spread != replay.SpreadRoundRobin {
		return fmt.Errorf("-spread %q: want %s or %s", o.spread, replay.SpreadRandom, replay.SpreadRoundRobin)
	}
	points, err := sweepPoints(base, o.sweep, o.sweepReplicas)
	if err != nil {
		return err
	}

	// Generated workloads depend on the seed; a trace does not (the seed salts its tokens).
	kinds := strings.Split(o.workload, ",")
	workloads := make([]map[uint64]*replay.Workload, len(kinds))
	var names []string
	for i, kind := range kinds {
		workloads[i] = map[uint64]*replay.Workload{}
		for _, seed := range seeds {
			w, err := load(o, strings.TrimSpace(kind), seed)
			if err != nil {
				return err
			}
			workloads[i][seed] = w
		}
		names = append(names, workloads[i][seeds[0]].Name)
	}

	type job struct {
		w      *replay.Workload
		cfg    replay.Config
		policy string
	}
	var jobs []job
	for i := range kinds {
		for _, p := range points {
			for _, seed := range seeds {
				for _, pol := range policies {
					cfg := p
					cfg.Seed = seed
					jobs = append(jobs, job{workloads[i][seed], cfg, pol})
				}
			}
		}
	}
	stopProfile, err := startCPUProfile(o.cpuProfile)
	if err != nil {
		return err
	}
	defer stopProfile()
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
	table := replay.WriteTable
	if o.sweep == "replicas" {
		table = replay.WriteReplicaTable
	}
	if err := table(stdout, sums); err != nil {
		return err
	}
	reqs := make([]string, len(kinds))
	for i := range kinds {
		reqs[i] = strconv.Itoa(len(workloads[i][seeds[0]].Requests))
	}
	fmt.Fprintf(stdout, "\n%s requests × %d policies × %d seed(s) × %d point(s) in %.1f s wall (%d workers)\n",
		strings.Join(reqs, " + "), len(policies), len(seeds), len(points), wall.Seconds(), o.workers)
	if o.sweep == "replicas" {
		fmt.Fprintln(stdout, replicaNote(policies))
	}
	if o.out == "" {
		return nil
	}
	return writeOutputs(o, strings.Join(names, "+"), results, sums)
}

// replicaNote says which of policies run as one instance whatever the replicas.
func replicaNote(policies []string) string {
	var one []string
	for _, p := range policies {
		if p == replay.PolicyRandom || p == replay.OracleGlobalLRU || p == replay.OracleInfinite {
			one = append(one, p)
		}
	}
	note := "Each replica has its own router and KV index (fed by every engine's KV events)."
	if len(one) > 0 {
		note += " " + strings.Join(one, ", ") + ": no router state, so the replicas change nothing for them."
	}
	return note
}

// flagSet reports whether the flag name was given.
func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

func load(o options, kind string, seed uint64) (*replay.Workload, error) {
	var w *replay.Workload
	var err error
	switch kind {
	case "trace":
		name := traces.MooncakeSyntheticName
		if o.trace == "" {
			w, err = replay.ReadTrace(bytes.NewReader(traces.MooncakeSynthetic), name)
		} else {
			name = filepath.Base(o.trace)
			w, err = replay.ReadTraceFile(o.trace)
		}
		if err == nil {
			w.Name = strings.TrimSuffix(strings.TrimSuffix(name, ".gz"), ".jsonl")
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
		return nil, fmt.Errorf("-workload %q: want trace, shared-prefix or multi-turn", kind)
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

// replicaSweepLimit is -sweep replicas' default -limit.
const replicaSweepLimit = 2000

// sweepPoints returns the fleet configurations of a sweep (just base without one); replicas is
// the comma-separated replica counts of the replicas sweep.
func sweepPoints(base replay.Config, sweep, replicas string) ([]replay.Config, error) {
	var counts []int
	for _, f := range strings.Split(replicas, ",") {
		k, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || k < 1 {
			return nil, fmt.Errorf("-sweep-replicas %q: want positive integers", replicas)
		}
		counts = append(counts, k)
	}
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
		"replicas": func() {
			for _, k := range counts {
				for _, m := range replay.SyncModes {
					add(func(c *replay.Config) { c.Replicas, c.Sync = k, m })
				}
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
		return nil, fmt.Errorf("-sweep %q: want engines, capacity, utilisation, lag, all, replicas or grid", sweep)
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
	table := replay.WriteTable
	if o.sweep == "replicas" {
		table = replay.WriteReplicaTable
	}
	if err := write(stem+".txt", func(w io.Writer) error { return table(w, ss) }); err != nil {
		return err
	}
	if err := write(stem+".csv", func(w io.Writer) error { return replay.WriteCSV(w, rs) }); err != nil {
		return err
	}
	if err := write(stem+".json", func(w io.Writer) error { return replay.WriteJSON(w, rs, ss) }); err != nil {
		return err
	}
	if o.sweep == "replicas" { // the table is the result: one chart per point would be 16 per workload
		return nil
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
		} else if strings.Contains(o.workload, ",") {
			file = ss[i].Point.Workload + ".svg"
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
	if flagSet(fs, "policies") {
		if baseline, err = replay.ParsePolicies(o.policies); err != nil {
			return err
		}
	}
	for i := range fleets {
		fleets[i].BytesPerToken, fleets[i].BandwidthBytesPerSec = o.bytesPerToken, o.bandwidth
		if o.pdSpecOff {
			fleets[i].Speculation = kvroute.SpeculationOff
		}
	}
	if o.sweep != "" {
		return errors.New("-pd does not combine with -sweep")
	}
	if o.replicas != 1 || o.sync != replay.SyncNone || strings.Contains(o.workload, ",") {
		return errors.New("-pd does not combine with -replicas, -sync or several workloads")
	}
	seeds, err := parseSeeds(o.seeds)
	if err != nil {
		return err
	}
	c := replay.PDComparison{Workloads: map[uint64]*replay.Workload{}, Seeds: seeds, Baseline: baseline, Fleets: fleets,
		Workers: o.workers, Base: replay.Config{CapacityTokens: o.capacity, BlockSize: o.blockSize,
			Utilisation: o.utilisation, EventLag: o.lag, ParallelPrefill: o.parallelPrefill, Latency: o.latency()}}
	for _, seed := range seeds {
		if c.Workloads[seed], err = load(o, o.workload, seed); err != nil {
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

// startCPUProfile starts writing a CPU profile to path (nothing when path is empty) and returns
// the function that stops it.
func startCPUProfile(path string) (stop func(), err error) {
	if path == "" {
		return func() {}, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}

// config is the fleet and router-replica configuration the flags give (a grid sets its points'
// engines, capacity, utilisation and seed over it).
func (o options) config() replay.Config {
	c := replay.Config{Engines: o.engines, CapacityTokens: o.capacity, BlockSize: o.blockSize,
		Utilisation: o.utilisation, EventLag: o.lag, ParallelPrefill: o.parallelPrefill, Replicas: o.replicas,
		Sync: o.sync, SyncDelay: o.syncDelay, PeerDelay: o.peerDelay, ScrapePeriod: o.scrapePeriod, Spread: o.spread, Latency: o.latency()}
	if o.burstPeriod != 0 {
		c.BurstPeriod, c.BurstDuty = o.burstPeriod, o.burstDuty
	}
	return c
}

// latency is the engines' latency model: enginesim's default, with -engine-attention's quadratic
// term when it is set (the zero value, which replay.Config reads as the default, otherwise).
func (o options) latency() enginesim.Latency {
	if o.engineAttention <= 0 {
		return enginesim.Latency{}
	}
	l := enginesim.DefaultLatency
	l.Quadratic = o.engineAttention
	return l
}
