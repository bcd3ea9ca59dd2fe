package replay

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"strconv"
)

// Point identifies one fleet configuration of a run or sweep.
type Point struct {
	Workload       string  `json:"workload"`
	Engines        int     `json:"engines"`
	CapacityTokens int     `json:"capacity_tokens"`
	Utilisation    float64 `json:"utilisation"`
	EventLagSec    float64 `json:"event_lag_s"`
	// The router replicas, as in Result.
	Replicas        int     `json:"replicas"`
	Sync            string  `json:"sync"`
	SyncDelaySec    float64 `json:"sync_delay_s"`
	ScrapePeriodSec float64 `json:"scrape_period_s"`
	Spread          string  `json:"spread"`
}

func (r *Result) point() Point {
	return Point{Workload: r.Workload, Engines: r.Engines, CapacityTokens: r.CapacityTokens, Utilisation: r.Utilisation,
		EventLagSec: r.EventLagSec, Replicas: r.Replicas, Sync: r.Sync, SyncDelaySec: r.SyncDelaySec,
		ScrapePeriodSec: r.ScrapePeriodSec, Spread: r.Spread}
}

// String describes the point in one line; router replicas and their sync are named when there is
// more than one replica or they sync.
func (p Point) String() string {
	s := fmt.Sprintf("%s, %d engines × %d-token KV cache, utilisation %.0f%%, event lag %s",
		p.Workload, p.Engines, p.CapacityTokens, p.Utilisation*100, fmtSeconds(p.EventLagSec))
	if p.Replicas <= 1 && (p.Sync == "" || p.Sync == SyncNone) {
		return s
	}
	s += fmt.Sprintf(", %d router replica(s)", max(p.Replicas, 1))
	if p.Spread != "" {
		s += " (" + p.Spread + " spread)"
	}
	return s + ", sync " + p.syncString()
}

// syncString names the sync mode with its period and delay.
func (p Point) syncString() string {
	switch p.Sync {
	case SyncMetrics:
		return fmt.Sprintf("metrics (every %s)", fmtSeconds(p.ScrapePeriodSec))
	case SyncPeers:
		return fmt.Sprintf("peers (after %s)", fmtSeconds(p.SyncDelaySec))
	case SyncBoth:
		return fmt.Sprintf("both (metrics every %s, peers after %s)", fmtSeconds(p.ScrapePeriodSec), fmtSeconds(p.SyncDelaySec))
	case "":
		return SyncNone
	}
	return p.Sync
}

// Summary is one policy's results at one point, over its seeds: means, and the range over seeds of
// the hit ratio and TTFT p99.
type Summary struct {
	Point
	Policy      string  `json:"policy"`
	Seeds       int     `json:"seeds"`
	HitRatio    float64 `json:"hit_ratio"`
	HitMin      float64 `json:"hit_ratio_min"`
	HitMax      float64 `json:"hit_ratio_max"`
	Reachable   float64 `json:"reachable_hit_ratio"`
	LoadMaxMean float64 `json:"load_max_mean"`
	TTFTP50     float64 `json:"ttft_p50_s"`
	TTFTP90     float64 `json:"ttft_p90_s"`
	TTFTP99     float64 `json:"ttft_p99_s"`
	P99Min      float64 `json:"ttft_p99_min_s"`
	P99Max      float64 `json:"ttft_p99_max_s"`
	TTFTMean    float64 `json:"ttft_mean_s"`
	Throughput  float64 `json:"throughput_tok_s"`
	KVAware     float64 `json:"kv_aware"`
	Rejected    float64 `json:"rejected"`

	// RouterInstances is Result.RouterInstances (the same for every seed).
	RouterInstances int `json:"router_instances"`
}

// Summarise groups results by point and policy, in the order they first appear, and averages
// them over seeds.
func Summarise(rs []Result) []Summary {
	type key struct {
		p      Point
		policy string
	}
	idx := map[key]int{}
	var out []Summary
	for i := range rs {
		r := &rs[i]
		k := key{r.point(), r.Policy}
		j, ok := idx[k]
		if !ok {
			j = len(out)
			idx[k] = j
			out = append(out, Summary{Point: k.p, Policy: r.Policy, RouterInstances: r.RouterInstances, HitMin: math.Inf(1),
				HitMax: math.Inf(-1), P99Min: math.Inf(1), P99Max: math.Inf(-1)})
		}
		s := &out[j]
		s.Seeds++
		s.HitRatio += r.HitRatio
		s.HitMin, s.HitMax = min(s.HitMin, r.HitRatio), max(s.HitMax, r.HitRatio)
		s.Reachable += r.Reachable
		s.LoadMaxMean += r.LoadMaxMean
		s.TTFTP50 += r.TTFTP50
		s.TTFTP90 += r.TTFTP90
		s.TTFTP99 += r.TTFTP99
		s.P99Min, s.P99Max = min(s.P99Min, r.TTFTP99), max(s.P99Max, r.TTFTP99)
		s.TTFTMean += r.TTFTMean
		s.Throughput += r.Throughput
		s.KVAware += r.KVAware
		s.Rejected += float64(r.Rejected)
	}
	for i := range out {
		s := &out[i]
		n := float64(s.Seeds)
		for _, v := range []*float64{&s.HitRatio, &s.Reachable, &s.LoadMaxMean, &s.TTFTP50, &s.TTFTP90, &s.TTFTP99, &s.TTFTMean,
			&s.Throughput, &s.KVAware, &s.Rejected} {
			*v /= n
		}
	}
	return out
}

// WriteTable writes summaries as Markdown tables, one per point, each under a line naming the
// point. Ranges over seeds follow the hit ratio and TTFT p99 when there is more than one seed.
// "reachable" is Result.Reachable: the hit ratio had each request gone to the engine that held
// the most of its prompt. With more than one router replica, the policies without router state
// say that the replicas change nothing for them.
func WriteTable(w io.Writer, ss []Summary) error {
	var last *Point
	for i := range ss {
		s := &ss[i]
		if last == nil || *last != s.Point {
			if last != nil {
				if _, err := fmt.Fprintln(w); err != nil {
					return err
				}
			}
			last = &s.Point
			if _, err := fmt.Fprintf(w, "%s; %d seed(s)\n\n", s.Point, s.Seeds); err != nil {
				return err
			}
			if _, err := fmt.Fprintln(w, "| policy | token hit ratio | reachable | load max/mean | TTFT p50 | TTFT p90 | TTFT p99 | TTFT mean | throughput (tok/s) | tier-4 decisions |\n|---|---|---|---|---|---|---|---|---|---|"); err != nil {
				return err
			}
		}
		hit := fmtPct(s.HitRatio)
		p99 := fmtSeconds(s.TTFTP99)
		if s.Seeds > 1 {
			hit += " (" + fmtPct(s.HitMin) + "–" + fmtPct(s.HitMax) + ")"
			p99 += " (" + fmtSeconds(s.P99Min) + "–" + fmtSeconds(s.P99Max) + ")"
		}
		load, thr, kv := strconv.FormatFloat(s.LoadMaxMean, 'f', 2, 64), strconv.FormatFloat(s.Throughput, 'f', 0, 64), fmtPct(s.KVAware)
		name := s.Policy
		switch s.Policy {
		case OracleInfinite:
			load, thr, kv = "—", "—", "—"
			name += " (ceiling; TTFT without queueing)"
		case OracleGlobalLRU:
			kv = "—"
		case PolicyRandom, PolicyRoundRobin, PolicyLeastLoaded, PolicyCHWBL:
			kv = "—"
		}
		if s.Replicas > 1 && s.RouterInstances <= 1 {
			name += " (no router state: one instance for all replicas)"
		}
		if s.Rejected > 0 {
			name += fmt.Sprintf(" [%.0f rejected]", s.Rejected)
		}
		if _, err := fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", name, hit, fmtPct(s.Reachable), load,
			fmtSeconds(s.TTFTP50), fmtSeconds(s.TTFTP90), p99, fmtSeconds(s.TTFTMean), thr, kv); err != nil {
			return err
		}
	}
	return nil
}

func fmtPct(x float64) string { return strconv.FormatFloat(100*x, 'f', 1, 64) + " %" }

func fmtSeconds(s float64) string {
	switch {
	case s == 0:
		return "0 s"
	case s < 1:
		return strconv.FormatFloat(s*1000, 'f', 0, 64) + " ms"
	case s < 100: // two decimals up to 100 s: policies' TTFT p99 often differ only there
		return strconv.FormatFloat(s, 'f', 2, 64) + " s"
	default:
		return strconv.FormatFloat(s, 'f', 1, 64) + " s"
	}
}

// csvHeader is the header of WriteCSV.
var csvHeader = []string{"workload", "policy", "seed", "engines", "capacity_tokens", "utilisation", "event_lag_s",
	"time_scale", "requests", "rejected", "prompt_tokens", "cached_tokens", "hit_ratio", "reachable_hit_ratio", "load_max_mean",
	"ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s", "queue_mean_s", "throughput_tok_s", "makespan_s",
	"kv_aware", "wall_s", "replicas", "sync", "sync_delay_s", "scrape_period_s", "spread", "router_instances",
	"peer_events_applied", "peer_events_ignored", "peer_decisions_expired", "engine_reports", "engine_reports_stale"}

// WriteCSV writes one row per result.
func WriteCSV(w io.Writer, rs []Result) error {
	cw := csv.NewWriter(w)
	if err := cw.Write(csvHeader); err != nil {
		return err
	}
	f := func(x float64) string { return strconv.FormatFloat(x, 'g', 6, 64) }
	u := func(x uint64) string { return strconv.FormatUint(x, 10) }
	for _, r := range rs {
		row := []string{r.Workload, r.Policy, strconv.FormatUint(r.Seed, 10), strconv.Itoa(r.Engines),
			strconv.Itoa(r.CapacityTokens), f(r.Utilisation), f(r.EventLagSec), f(r.TimeScale), strconv.Itoa(r.Requests),
			strconv.Itoa(r.Rejected), strconv.FormatInt(r.PromptTokens, 10), strconv.FormatInt(r.CachedTokens, 10),
			f(r.HitRatio), f(r.Reachable), f(r.LoadMaxMean), f(r.TTFTP50), f(r.TTFTP90), f(r.TTFTP99), f(r.TTFTMean), f(r.QueueMean),
			f(r.Throughput), f(r.MakespanSec), f(r.KVAware), f(r.WallSec), strconv.Itoa(r.Replicas), r.Sync, f(r.SyncDelaySec),
			f(r.ScrapePeriodSec), r.Spread, strconv.Itoa(r.RouterInstances), u(r.Peers.Applied), u(r.Peers.Ignored),
			u(r.Peers.Expired), u(r.Peers.EngineReports), u(r.Peers.EngineStale)}
		if err := cw.Write(row); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

// WriteJSON writes {"results": […], "summaries": […]}, indented.
func WriteJSON(w io.Writer, rs []Result, ss []Summary) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(struct {
		Results   []Result  `json:"results"`
		Summaries []Summary `json:"summaries"`
	}{rs, ss})
}

// WriteReplicaTable writes summaries of runs with router replicas as one Markdown table, a row per
// workload, policy, replica count and sync mode, in the order given. Each row is compared with the
// single router's row of the same workload, policy and fleet (Replicas 1, SyncNone), when there
// is one: "hit ÷ K=1" is the row's token hit ratio over the single router's, "p99 ÷ K=1" its TTFT
// p99 over the single router's. Ranges over seeds follow the hit ratio and TTFT p99 when there is
// more than one seed.
func WriteReplicaTable(w io.Writer, ss []Summary) error {
	type key struct {
		p      Point
		policy string
	}
	single := map[key]*Summary{}
	for i := range ss {
		s := &ss[i]
		if s.Replicas <= 1 && (s.Sync == "" || s.Sync == SyncNone) {
			single[key{s.fleet(), s.Policy}] = s
		}
	}
	if _, err := fmt.Fprintln(w, "| workload | policy | replicas | sync | token hit ratio | hit ÷ K=1 | TTFT p50 | TTFT p99 | p99 ÷ K=1 | load max/mean | tier-4 decisions |\n|---|---|---|---|---|---|---|---|---|---|---|"); err != nil {
		return err
	}
	for i := range ss {
		s := &ss[i]
		hit, p99 := fmtPct(s.HitRatio), fmtSeconds(s.TTFTP99)
		if s.Seeds > 1 {
			hit += " (" + fmtPct(s.HitMin) + "–" + fmtPct(s.HitMax) + ")"
			p99 += " (" + fmtSeconds(s.P99Min) + "–" + fmtSeconds(s.P99Max) + ")"
		}
		hitRel, p99Rel := "—", "—"
		if b := single[key{s.fleet(), s.Policy}]; b != nil {
			if b.HitRatio > 0 {
				hitRel = fmtPct(s.HitRatio / b.HitRatio)
			}
			if b.TTFTP99 > 0 {
				p99Rel = fmtPct(s.TTFTP99 / b.TTFTP99)
			}
		}
		sync := s.Sync
		switch s.Sync {
		case SyncMetrics:
			sync += " " + fmtSeconds(s.ScrapePeriodSec)
		case SyncPeers:
			sync += " " + fmtSeconds(s.SyncDelaySec)
		case SyncBoth:
			sync += " " + fmtSeconds(s.ScrapePeriodSec) + " / " + fmtSeconds(s.SyncDelaySec)
		}
		replicas := strconv.Itoa(max(s.Replicas, 1))
		if s.Replicas > 1 && s.RouterInstances <= 1 {
			replicas += " (no router state)"
		}
		if _, err := fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", s.Workload, s.Policy, replicas,
			sync, hit, hitRel, fmtSeconds(s.TTFTP50), p99, p99Rel, strconv.FormatFloat(s.LoadMaxMean, 'f', 2, 64),
			fmtPct(s.KVAware)); err != nil {
			return err
		}
	}
	return nil
}

// fleet is the point without its router replicas.
func (p Point) fleet() Point {
	return Point{Workload: p.Workload, Engines: p.Engines, CapacityTokens: p.CapacityTokens, Utilisation: p.Utilisation,
		EventLagSec: p.EventLagSec}
}
