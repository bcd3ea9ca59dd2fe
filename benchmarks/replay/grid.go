package replay

import (
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"sync"
)

// Grid is a grid of fleet configurations — every combination of Engines, CapacityTokens and
// Utilisations — over which each workload of Workloads is replayed under each of Policies, once
// per seed. RunGrid runs it; GridPoints judges one policy against the others at each point.
type Grid struct {
	// Workloads holds, for each workload of the grid, the instance each seed replays (a trace is
	// the same for every seed; a generator's output is not). Every map must hold every seed.
	Workloads []map[uint64]*Workload
	// Engines, CapacityTokens and Utilisations are the grid's values of the Config fields of the
	// same names.
	Engines        []int
	CapacityTokens []int
	Utilisations   []float64
	Seeds          []uint64
	Policies       []string
	// Base is the configuration every point starts from (block size, event lag, …); its Engines,
	// CapacityTokens, Utilisation and Seed are the grid's.
	Base Config
	// Parallel is the number of runs simulated at once (at least 1). Each run builds its own
	// engines, router and index; the workloads are only read, so the results do not depend on it.
	Parallel int
}

// Runs returns the number of runs of the grid.
func (g Grid) Runs() int {
	return len(g.Workloads) * len(g.Engines) * len(g.CapacityTokens) * len(g.Utilisations) * len(g.Seeds) * len(g.Policies)
}

// RunGrid runs every point of g, every seed and policy, and returns the results in a fixed
// order — workload, engines, capacity, utilisation, seed, policy — whatever g.Parallel. Errors
// wrap ErrInvalidConfig for a bad grid; a run's error is returned joined with the others.
func RunGrid(g Grid) ([]Result, error) {
	if g.Runs() == 0 {
		return nil, fmt.Errorf("%w: a grid needs a workload, engines, capacity, utilisation, seed and policy", ErrInvalidConfig)
	}
	type job struct {
		w      *Workload
		cfg    Config
		policy string
	}
	jobs := make([]job, 0, g.Runs())
	for i, ws := range g.Workloads {
		for _, seed := range g.Seeds {
			if ws[seed] == nil {
				return nil, fmt.Errorf("%w: grid workload %d has no instance for seed %d", ErrInvalidConfig, i, seed)
			}
		}
		for _, e := range g.Engines {
			for _, c := range g.CapacityTokens {
				for _, u := range g.Utilisations {
					for _, seed := range g.Seeds {
						for _, p := range g.Policies {
							cfg := g.Base
							cfg.Engines, cfg.CapacityTokens, cfg.Utilisation, cfg.Seed = e, c, u, seed
							jobs = append(jobs, job{ws[seed], cfg, p})
						}
					}
				}
			}
		}
	}
	out := make([]Result, len(jobs))
	errs := make([]error, len(jobs))
	next := make(chan int)
	var wg sync.WaitGroup
	for range max(g.Parallel, 1) {
		wg.Go(func() {
			for i := range next {
				out[i], errs[i] = Run(jobs[i].w, jobs[i].cfg, jobs[i].policy)
			}
		})
	}
	for i := range jobs {
		next <- i
	}
	close(next)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return out, nil
}

// Grid verdicts: how the judged policy compares with the best of the others at a point.
const (
	GridWin  = "W" // its mean is strictly better than every other non-oracle policy's
	GridTie  = "T" // equal to the best, or worse by less than the spread over random seeds (the ranges overlap)
	GridLoss = "L" // worse than the best, beyond the spread over random seeds
	GridNone = "—" // no other non-oracle policy ran at the point
)

// GridMargin compares the judged policy's value of one metric with the best other non-oracle
// policy's at a point. Values are means over seeds; Min and Max the range over seeds.
type GridMargin struct {
	// Best is the other non-oracle policy with the best mean ("" when none ran); the first in
	// the results' order wins a tie.
	Best     string  `json:"best"`
	BestMean float64 `json:"best_mean"`
	BestMin  float64 `json:"best_min"`
	BestMax  float64 `json:"best_max"`
	Mean     float64 `json:"mean"`
	Min      float64 `json:"min"`
	Max      float64 `json:"max"`
	// Margin is the judged policy's advantage over Best: its mean minus Best's for a metric
	// where more is better (the hit ratio), Best's minus its own where less is better (TTFT
	// p99). Negative is a loss.
	Margin  float64 `json:"margin"`
	Verdict string  `json:"verdict"`
}

// GridPoint is the judgement of one policy at one point of a grid.
type GridPoint struct {
	Point
	Policy string `json:"policy"`
	Seeds  int    `json:"seeds"`
	// Hit is the token hit ratio, P99 the TTFT p99 in seconds.
	Hit GridMargin `json:"hit_ratio"`
	P99 GridMargin `json:"ttft_p99_s"`
	// OracleHit is the global-LRU oracle's mean hit ratio (0 when it did not run) and OracleShare
	// the judged policy's mean hit ratio over it (0 when it did not run).
	OracleHit   float64 `json:"oracle_global_lru_hit_ratio"`
	OracleShare float64 `json:"oracle_share"`
	// Reachable, LoadMaxMean, KVAware, QueueMean and TTFTMean are the judged policy's means
	// (Result's fields of the same names).
	Reachable   float64 `json:"reachable_hit_ratio"`
	LoadMaxMean float64 `json:"load_max_mean"`
	KVAware     float64 `json:"kv_aware"`
	QueueMean   float64 `json:"queue_mean_s"`
	TTFTMean    float64 `json:"ttft_mean_s"`
}

// isOracle reports whether p is one of the oracles.
func isOracle(p string) bool { return p == OracleGlobalLRU || p == OracleInfinite }

// GridPoints judges policy at every point of rs where it ran against the other non-oracle
// policies that ran there, on the token hit ratio and the TTFT p99, in the order the points first
// appear in rs.
func GridPoints(rs []Result, policy string) []GridPoint {
	ss := Summarise(rs)
	queue := map[Point]float64{} // policy's summed queue means
	for i := range rs {
		if rs[i].Policy == policy {
			queue[rs[i].point()] += rs[i].QueueMean
		}
	}
	var out []GridPoint
	for i := 0; i < len(ss); {
		j := i
		for j < len(ss) && ss[j].Point == ss[i].Point {
			j++
		}
		if gp, ok := judge(ss[i:j], policy); ok {
			gp.QueueMean = queue[gp.Point] / float64(gp.Seeds)
			out = append(out, gp)
		}
		i = j
	}
	return out
}

// judge judges policy among ss, the summaries of one point.
func judge(ss []Summary, policy string) (GridPoint, bool) {
	var me *Summary
	for i := range ss {
		if ss[i].Policy == policy {
			me = &ss[i]
		}
	}
	if me == nil {
		return GridPoint{}, false
	}
	gp := GridPoint{Point: me.Point, Policy: policy, Seeds: me.Seeds, Reachable: me.Reachable,
		LoadMaxMean: me.LoadMaxMean, KVAware: me.KVAware, TTFTMean: me.TTFTMean}
	gp.Hit = GridMargin{Mean: me.HitRatio, Min: me.HitMin, Max: me.HitMax}
	gp.P99 = GridMargin{Mean: me.TTFTP99, Min: me.P99Min, Max: me.P99Max}
	for i := range ss {
		s := &ss[i]
		switch {
		case s.Policy == OracleGlobalLRU:
			gp.OracleHit = s.HitRatio
		case s.Policy == policy || isOracle(s.Policy):
		default:
			if gp.Hit.Best == "" || s.HitRatio > gp.Hit.BestMean {
				gp.Hit.Best, gp.Hit.BestMean, gp.Hit.BestMin, gp.Hit.BestMax = s.Policy, s.HitRatio, s.HitMin, s.HitMax
			}
			if gp.P99.Best == "" || s.TTFTP99 < gp.P99.BestMean {
				gp.P99.Best, gp.P99.BestMean, gp.P99.BestMin, gp.P99.BestMax = s.Policy, s.TTFTP99, s.P99Min, s.P99Max
			}
		}
	}
	if gp.OracleHit > 0 {
		gp.OracleShare = me.HitRatio / gp.OracleHit
	}
	gp.Hit.judge(true)
	gp.P99.judge(false)
	return gp, true
}

// judge sets m's Margin and Verdict; higher says whether more is better.
func (m *GridMargin) judge(higher bool) {
	if m.Best == "" {
		m.Verdict = GridNone
		return
	}
	m.Margin = m.Mean - m.BestMean
	if !higher {
		m.Margin = -m.Margin
	}
	m.Verdict = Verdict(m.Mean, m.Min, m.Max, m.BestMean, m.BestMin, m.BestMax, higher)
}

// Verdict classifies a mean over seeds, with its range [lo, hi] over seeds, against the best
// other's mean and range: GridWin when strictly better, GridTie when equal (to within 1e-9 of
// the larger magnitude) or worse but with the two ranges overlapping (a loss within the random seeds'
// spread), GridLoss otherwise. higher says whether more is better.
func Verdict(mean, lo, hi, best, bestLo, bestHi float64, higher bool) string {
	if math.Abs(mean-best) <= 1e-9*max(math.Abs(mean), math.Abs(best)) {
		return GridTie
	}
	if (mean > best) == higher {
		return GridWin
	}
	if lo <= bestHi && bestLo <= hi {
		return GridTie
	}
	return GridLoss
}

// WriteGridTable writes the grid's judgements as one Markdown table, a row per point, followed by
// a line of totals. Each row gives the best other non-oracle policy on the token hit ratio and
// on the TTFT p99, the judged policy's values (with their range over seeds when there is more
// than one seed), its margin (hit: percentage points, positive when ahead; p99: the best's p99
// minus its own, so positive when faster) and its verdict (GridWin, GridTie, GridLoss); then its
// hit ratio over the global-LRU oracle's, its reachable hit ratio and its max/mean load.
func WriteGridTable(w io.Writer, gps []GridPoint) error {
	if len(gps) == 0 {
		_, err := fmt.Fprintln(w, "(no point of the grid ran the judged policy)")
		return err
	}
	me := gps[0].Policy
	if _, err := fmt.Fprintf(w, "| workload | engines | KV cache (tokens) | util. | best other hit | %[1]s hit | Δ hit (pt) | hit | best other p99 | %[1]s p99 | Δ p99 | p99 | %[1]s ÷ LRU hit | reachable | load max/mean |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n", me); err != nil {
		return err
	}
	var hitW, hitT, hitL, p99W, p99T, p99L, oracleOK, oracleN, loadOK int
	for _, g := range gps {
		hit, p99 := fmtPct(g.Hit.Mean), fmtSeconds(g.P99.Mean)
		if g.Seeds > 1 {
			hit += " (" + fmtPct(g.Hit.Min) + "–" + fmtPct(g.Hit.Max) + ")"
			p99 += " (" + fmtSeconds(g.P99.Min) + "–" + fmtSeconds(g.P99.Max) + ")"
		}
		bestHit, bestP99, dHit, dP99 := "—", "—", "—", "—"
		if g.Hit.Best != "" {
			bestHit = g.Hit.Best + " " + fmtPct(g.Hit.BestMean)
			dHit = fmtSignedFloat(100*g.Hit.Margin, 2)
		}
		if g.P99.Best != "" {
			bestP99 = g.P99.Best + " " + fmtSeconds(g.P99.BestMean)
			dP99 = fmtSigned(g.P99.Margin)
			if g.P99.Margin != 0 && g.P99.BestMean > 0 {
				dP99 += " (" + fmtSignedPct(g.P99.Margin/g.P99.BestMean) + ")"
			}
		}
		share := "—"
		if g.OracleHit > 0 {
			share = fmtPct(g.OracleShare)
			oracleN++
			if g.OracleShare >= 0.9 {
				oracleOK++
			}
		}
		if g.LoadMaxMean <= 1.3 {
			loadOK++
		}
		for _, c := range []struct {
			v       string
			w, t, l *int
		}{{g.Hit.Verdict, &hitW, &hitT, &hitL}, {g.P99.Verdict, &p99W, &p99T, &p99L}} {
			switch c.v {
			case GridWin:
				*c.w++
			case GridTie:
				*c.t++
			case GridLoss:
				*c.l++
			}
		}
		if _, err := fmt.Fprintf(w, "| %s | %d | %d | %.0f %% | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %.2f |\n",
			g.Workload, g.Engines, g.CapacityTokens, 100*g.Utilisation, bestHit, hit, dHit, g.Hit.Verdict, bestP99, p99, dP99,
			g.P99.Verdict, share, fmtPct(g.Reachable), g.LoadMaxMean); err != nil {
			return err
		}
	}
	_, err := fmt.Fprintf(w, "\n%s at %d point(s), %d seed(s): hit W/T/L %d/%d/%d, TTFT p99 W/T/L %d/%d/%d; ≥ 90 %% of the global LRU's hit ratio at %d of %d; load max/mean ≤ 1.3 at %d of %d.\n",
		me, len(gps), gps[0].Seeds, hitW, hitT, hitL, p99W, p99T, p99L, oracleOK, oracleN, loadOK, len(gps))
	return err
}

// fmtSignedFloat formats x with prec decimals and an explicit sign ("+", "−", none for zero at
// that precision).
func fmtSignedFloat(x float64, prec int) string {
	v := strconv.FormatFloat(math.Abs(x), 'f', prec, 64)
	switch {
	case strings.Trim(v, "0.") == "":
		return v
	case x > 0:
		return "+" + v
	}
	return "−" + v
}

// fmtSignedPct formats a fraction as a signed percentage with one decimal.
func fmtSignedPct(x float64) string { return fmtSignedFloat(100*x, 1) + " %" }

// fmtSigned formats a duration in seconds with fmtSeconds and an explicit sign.
func fmtSigned(s float64) string {
	switch {
	case s > 0:
		return "+" + fmtSeconds(s)
	case s < 0:
		return "−" + fmtSeconds(-s)
	}
	return "0 s"
}

// gridCSVHeader is the header of WriteGridCSV.
var gridCSVHeader = []string{"workload", "engines", "capacity_tokens", "utilisation", "event_lag_s", "policy", "seeds",
	"hit_best", "hit_best_mean", "hit_best_min", "hit_best_max", "hit_mean", "hit_min", "hit_max", "hit_margin", "hit_verdict",
	"p99_best", "p99_best_mean_s", "p99_best_min_s", "p99_best_max_s", "p99_mean_s", "p99_min_s", "p99_max_s", "p99_margin_s",
	"p99_verdict", "oracle_global_lru_hit_ratio", "oracle_share", "reachable_hit_ratio", "load_max_mean", "kv_aware",
	"queue_mean_s", "ttft_mean_s"}

// WriteGridCSV writes one row per grid point.
func WriteGridCSV(w io.Writer, gps []GridPoint) error {
	cw := csv.NewWriter(w)
	if err := cw.Write(gridCSVHeader); err != nil {
		return err
	}
	f := func(x float64) string { return strconv.FormatFloat(x, 'g', 6, 64) }
	for _, g := range gps {
		row := []string{g.Workload, strconv.Itoa(g.Engines), strconv.Itoa(g.CapacityTokens), f(g.Utilisation), f(g.EventLagSec),
			g.Policy, strconv.Itoa(g.Seeds),
			g.Hit.Best, f(g.Hit.BestMean), f(g.Hit.BestMin), f(g.Hit.BestMax), f(g.Hit.Mean), f(g.Hit.Min), f(g.Hit.Max),
			f(g.Hit.Margin), g.Hit.Verdict,
			g.P99.Best, f(g.P99.BestMean), f(g.P99.BestMin), f(g.P99.BestMax), f(g.P99.Mean), f(g.P99.Min), f(g.P99.Max),
			f(g.P99.Margin), g.P99.Verdict,
			f(g.OracleHit), f(g.OracleShare), f(g.Reachable), f(g.LoadMaxMean), f(g.KVAware), f(g.QueueMean), f(g.TTFTMean)}
		if err := cw.Write(row); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

// WriteGridJSON writes {"grid": […], "results": […], "summaries": […]}, indented.
func WriteGridJSON(w io.Writer, gps []GridPoint, rs []Result, ss []Summary) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(struct {
		Grid      []GridPoint `json:"grid"`
		Results   []Result    `json:"results"`
		Summaries []Summary   `json:"summaries"`
	}{gps, rs, ss})
}
