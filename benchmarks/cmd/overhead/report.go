package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/kvroute/kvroute/benchmarks/internal/benchenv"
)

// results holds every run: samples[load][target][round].
type results struct {
	targets []*target
	loads   []load
	samples [][][]*sample
}

func newResults(ts []*target, ls []load, rounds int) *results {
	r := &results{targets: ts, loads: ls, samples: make([][][]*sample, len(ls))}
	for li := range ls {
		r.samples[li] = make([][]*sample, len(ts))
		for ti := range ts {
			r.samples[li][ti] = make([]*sample, rounds)
		}
	}
	return r
}

func (r *results) add(li, ti, round int, s *sample) { r.samples[li][ti][round] = s }

// errors returns the failed requests of every run.
func (r *results) errors() int {
	n := 0
	r.each(func(s *sample) { n += s.errors })
	return n
}

// firstErr returns the first failure recorded, if any.
func (r *results) firstErr() error {
	var err error
	r.each(func(s *sample) {
		if err == nil {
			err = s.firstErr
		}
	})
	return err
}

func (r *results) each(f func(*sample)) {
	for _, byTarget := range r.samples {
		for _, byRound := range byTarget {
			for _, s := range byRound {
				if s != nil {
					f(s)
				}
			}
		}
	}
}

// spread is a statistic's median across rounds and its range.
type spread struct{ med, lo, hi float64 }

func spreadOf(v []float64) spread {
	v = slices.Clone(v)
	slices.Sort(v)
	n := len(v)
	med := v[n/2]
	if n%2 == 0 {
		med = (v[n/2-1] + v[n/2]) / 2
	}
	return spread{med: med, lo: v[0], hi: v[n-1]}
}

// perRound returns f of each round's samples of load li (f gets them by target index).
func (r *results) perRound(li int, f func(byTarget []*sample) float64) spread {
	rounds := len(r.samples[li][0])
	v := make([]float64, rounds)
	for round := range rounds {
		byTarget := make([]*sample, len(r.targets))
		for ti := range r.targets {
			byTarget[ti] = r.samples[li][ti][round]
		}
		v[round] = f(byTarget)
	}
	return spreadOf(v)
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// index returns the index of the target with id.
func (r *results) index(id string) int {
	return slices.IndexFunc(r.targets, func(t *target) bool { return t.id == id })
}

// p50Diff is target ti's p50 minus target base's, in µs, per round.
func (r *results) p50Diff(li, ti, base int) spread { return r.pDiff(li, ti, base, 50) }

// pDiff is target ti's p-th percentile minus target base's, in µs, per round.
func (r *results) pDiff(li, ti, base int, p float64) spread {
	return r.perRound(li, func(s []*sample) float64 { return us(s[ti].percentile(p)) - us(s[base].percentile(p)) })
}

// p50Ratio is target ti's p50 over target base's, per round.
func (r *results) p50Ratio(li, ti, base int) spread {
	return r.perRound(li, func(s []*sample) float64 { return us(s[ti].percentile(50)) / us(s[base].percentile(50)) })
}

// write prints the table in markdown.
func (r *results) write(w io.Writer, env []string, o options) {
	bw := bufio.NewWriter(w)
	defer bw.Flush()
	fmt.Fprintf(bw, "## Reference proxy overhead\n\n")
	for _, line := range env {
		fmt.Fprintf(bw, "%s  \n", line)
	}
	fmt.Fprintf(bw, "\nEach cell: the median across %d round(s), (min–max) across rounds; latencies in µs. "+
		"Differences and ratios are taken within each round, then summarised. CPU µs/req: CPU time (user + system, "+
		"/proc/PID/stat, 10 ms ticks) per request of the process serving the target (front: engine, relay, proxy or picker) and of "+
		"all of them, load generator included.\n", o.rounds)
	a, b := r.index("a"), r.index("b")
	for li, l := range r.loads {
		fmt.Fprintf(bw, "\n### %s\n\n", l.name)
		fmt.Fprintf(bw, "| target | p50 | p90 | p99 | p50 − (b) | p50 − (a) | p50 ÷ (b) | req/s | CPU µs/req, front | CPU µs/req, all | errors |\n")
		fmt.Fprintf(bw, "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n")
		for ti, t := range r.targets {
			pct := func(p float64) spread {
				return r.perRound(li, func(s []*sample) float64 { return us(s[ti].percentile(p)) })
			}
			tput := r.perRound(li, func(s []*sample) float64 { return s[ti].throughput() })
			errs := 0
			for _, s := range r.samples[li][ti] {
				errs += s.errors
			}
			cpuFront, cpuAll := "–", "–"
			if r.haveCPU(li, ti) {
				cpuFront = fmtSpread(r.perRound(li, func(s []*sample) float64 { return s[ti].cpuPerRequest(t.front) }), "%.0f")
				cpuAll = fmtSpread(r.perRound(li, func(s []*sample) float64 { return s[ti].cpuPerRequest(-1) }), "%.0f")
			}
			fmt.Fprintf(bw, "| (%s) %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %d |\n", t.id, t.name,
				fmtSpread(pct(50), "%.1f"), fmtSpread(pct(90), "%.1f"), fmtSpread(pct(99), "%.1f"),
				fmtSpread(r.p50Diff(li, ti, b), "%+.1f"), fmtSpread(r.p50Diff(li, ti, a), "%+.1f"),
				fmtSpread(r.p50Ratio(li, ti, b), "%.2f"), fmtSpread(tput, "%.0f"), cpuFront, cpuAll, errs)
		}
	}
	r.writeEPP(bw)
	fmt.Fprintf(bw, "\n### Targets\n\n| load | target | measured | limit | result |\n|---|---|--:|--:|---|\n")
	for _, c := range r.checks() {
		verdict := "**FAIL**"
		if c.pass {
			verdict = "pass"
		}
		fmt.Fprintf(bw, "| %s | %s | %s | %s | %s |\n", r.loads[c.load].name, c.what, c.measured, c.limit, verdict)
	}
}

// eppDiffs are the differences the kvroute-epp table gives: target, base, and what it measures.
var eppDiffs = []struct{ ti, base, what string }{
	{"f", "a", "the ext_proc hop and the stand-in for Envoy, over the engine direct"},
	{"f", "b", "the same, over a bare relay"},
	{"g", "f", "kvroute's picker, tier 1, over a no-op picker"},
	{"h", "f", "kvroute's picker with the KV index, over a no-op picker"},
}

// writeEPP prints, when the run measured (f) to (h), their p50 and p99 differences within each
// round, and the difference of the pickers' CPU time per request.
func (r *results) writeEPP(w io.Writer) {
	if r.index("f") < 0 || r.index("g") < 0 || r.index("h") < 0 {
		return
	}
	fmt.Fprintf(w, "\n### kvroute-epp: differences\n\n")
	fmt.Fprintf(w, "Within each round, then summarised as above; CPU: the picker processes' CPU µs per request.\n\n")
	fmt.Fprintf(w, "| load | difference | what | p50 | p99 | CPU µs/req, picker |\n|---|---|---|--:|--:|--:|\n")
	for li, l := range r.loads {
		for _, d := range eppDiffs {
			ti, base := r.index(d.ti), r.index(d.base)
			cpu := "–"
			if d.base == "f" && r.haveCPU(li, ti) && r.haveCPU(li, base) {
				front, baseFront := r.targets[ti].front, r.targets[base].front
				cpu = fmtSpread(r.perRound(li, func(s []*sample) float64 {
					return s[ti].cpuPerRequest(front) - s[base].cpuPerRequest(baseFront)
				}), "%+.0f")
			}
			fmt.Fprintf(w, "| %s | (%s) − (%s) | %s | %s | %s | %s |\n", l.name, d.ti, d.base, d.what,
				fmtSpread(r.pDiff(li, ti, base, 50), "%+.1f"), fmtSpread(r.pDiff(li, ti, base, 99), "%+.1f"), cpu)
		}
	}
}

// haveCPU reports whether every round of target ti under load li has CPU readings.
func (r *results) haveCPU(li, ti int) bool {
	for _, s := range r.samples[li][ti] {
		if s.cpu == nil || len(s.lat) == 0 {
			return false
		}
	}
	return true
}

// cpuPerRequest returns the CPU time per completed request, in µs, of process i of the run's
// meter, or of all of them (i < 0).
func (s *sample) cpuPerRequest(i int) float64 {
	var d time.Duration
	for j, c := range s.cpu {
		if i < 0 || i == j {
			d += c
		}
	}
	return us(d) / float64(len(s.lat))
}

// check is one of the targets, judged on the median across rounds.
type check struct {
	load            int
	what            string
	measured, limit string
	pass            bool
}

func (r *results) checks() []check {
	a, b, c, d, e := r.index("a"), r.index("b"), r.index("c"), r.index("d"), r.index("e")
	cb, db, ea := r.p50Diff(0, c, b), r.p50Diff(0, d, b), r.p50Diff(0, e, a)
	ratio := r.p50Ratio(1, c, b)
	return []check{
		{0, "(c) − (b) p50", fmtSpread(cb, "%+.1f µs"), "≤ 25 µs", cb.med <= 25},
		{0, "(d) − (b) p50", fmtSpread(db, "%+.1f µs"), "≤ 60 µs", db.med <= 60},
		{0, "(e) − (a) p50", fmtSpread(ea, "%+.1f µs"), "≤ 0 µs", ea.med <= 0},
		{1, "(c) ÷ (b) p50", fmtSpread(ratio, "%.2f"), "≤ 1.25", ratio.med <= 1.25},
	}
}

// fmtSpread formats s as "med (lo–hi)", or "med" when the range is one value.
func fmtSpread(s spread, verb string) string {
	m := fmt.Sprintf(verb, s.med)
	lo, hi := fmt.Sprintf(verb, s.lo), fmt.Sprintf(verb, s.hi)
	if lo == hi {
		return m
	}
	unit := ""
	if i := strings.IndexByte(verb, ' '); i >= 0 { // "%+.1f µs": the unit once, at the end
		unit = verb[i:]
		lo, hi = strings.TrimSuffix(lo, unit), strings.TrimSuffix(hi, unit)
		m = strings.TrimSuffix(m, unit)
	}
	return fmt.Sprintf("%s (%s – %s)%s", m, lo, hi, unit)
}

// describeEnv returns the header lines: command, Go, platform, CPU and settings.
func describeEnv(goVersion string, o options, proxy, loadBefore string) []string {
	cmd := "go run ./benchmarks/cmd/overhead"
	if exe, err := os.Executable(); err == nil && !strings.Contains(exe, "go-build") {
		cmd = filepath.Base(os.Args[0]) // a built binary (or the test)
	}
	for _, a := range o.args {
		cmd += " " + shellQuote(a)
	}
	return []string{
		fmt.Sprintf("Command: `%s`", cmd),
		fmt.Sprintf("Go: `%s` (this program: %s); GOOS/GOARCH %s/%s", goVersion, runtime.Version(), runtime.GOOS, runtime.GOARCH),
		fmt.Sprintf("CPU: %s; %d logical CPUs, GOMAXPROCS %d; load average (1, 5, 15 min) at the start %s, at the end %s",
			benchenv.CPUModel(), runtime.NumCPU(), runtime.GOMAXPROCS(0), loadBefore, loadAverage()),
		fmt.Sprintf("Settings: %d round(s) × %v per target and load, after %v of warm-up per target and load; "+
			"%d B system prompt, max_tokens %d, temperature 0; proxy (d) tokenizer %s", o.rounds, o.duration, o.warmup,
			len(systemPrompt), o.maxTokens, o.tokenizer),
		fmt.Sprintf("Proxy: %s", proxy),
		"Targets, each a child process of the load generator: (a) one enginesim engine, direct (no simulated latency; " +
			"behind every other target too); (b) httputil.ReverseProxy + http.Server; (c) examples/proxy, tier 1 only; " +
			"(d) examples/proxy, in-memory response cache + memory KV index fed by the engine's ZMQ events, every request a MISS; " +
			"(e) the proxy of (d), a response-cache HIT" + eppTargets(o),
	}
}

// eppTargets describes targets (f) to (h) when the run has them.
func eppTargets(o options) string {
	if !o.epp {
		return ""
	}
	return "; (f) envoysim.Forwarder (a Go stand-in for Envoy's ext_proc filter, full-duplex bodies both ways) + http.Server, " +
		"asking a no-op ext_proc picker (gRPC, its own process) that names the engine and hands the bodies back; " +
		"(g) an identical stand-in asking kvroute's extproc.Server, tier 1 only; (h) the same with the memory KV index fed by " +
		"the engine's ZMQ events, tokenizer " + o.tokenizer
}

// loadAverage returns the first three fields of /proc/loadavg, or "unknown".
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if f := strings.Fields(string(b)); err == nil && len(f) >= 3 {
		return strings.Join(f[:3], " ")
	}
	return "unknown"
}

// shellQuote quotes s for a POSIX shell when it needs it.
func shellQuote(s string) string {
	if s != "" && regexp.MustCompile(`^[A-Za-z0-9_./:=@%+,-]+$`).MatchString(s) {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
