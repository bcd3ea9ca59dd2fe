package main

import (
	"encoding/csv"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// markdown writes the report: how the run was made, the totals, one row per fault and the
// verdict.
func (a *analysis) markdown(w io.Writer) {
	o := a.o
	fmt.Fprintf(w, "## Soak with faults\n\n")
	fmt.Fprintf(w, "- command: `%s`\n", a.env.command)
	fmt.Fprintf(w, "- %s; %s; CPU: %s (%d logical CPUs)\n", a.env.commit, a.env.goVersion, a.env.cpu, runtime.NumCPU())
	index := "memory index fed by the JetStream event log"
	if o.index == "redis" || o.replicas == 1 {
		index = o.index + " index"
	}
	fmt.Fprintf(w, "- %v at %v req/s: %d engines (enginesim), %d proxy replicas (%s, Redis response cache); faults every %s after a %v warm-up, each lasting %v (stalled bodies: %d for up to %v)\n\n",
		o.duration, o.rate, o.engines, o.replicas, index, faultSpacing(a), o.warmup, o.downtime, o.stallConns, o.stallFor)
	t := a.totals
	fmt.Fprintf(w, "| requests | ok | rejected as expected (malformed; huge: over the context) | failed before the first byte | cut mid-stream by an engine's death | cut mid-stream otherwise | response-cache hits | p50 / p99 latency |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	fmt.Fprintf(w, "| %d | %d | %d | %d | %d | %d | %d | %s / %s ms |\n\n", t.ok+t.rejected+t.failPre+t.failMid+t.failMidDead, t.ok, t.rejected, t.failPre, t.failMidDead, t.failMid, t.hits,
		num(a.p50, "%.0f"), num(a.p99, "%.0f"))
	fmt.Fprintf(w, "Baseline (the %v before the first fault): RSS %s MB (median), goroutines %s, open files %s (least), per replica; KV-aware share %s.\n\n",
		a.baseWindow, join(a.baseline[0], "%.0f"), join(a.baseline[1], "%.0f"), join(a.baseline[2], "%.0f"), pct(a.baseKV))
	if len(a.faults) > 0 {
		fmt.Fprintf(w, "| at | fault | over after | recovered after | failed before first byte | cut by engine death / otherwise | RSS MB after (vs before) | goroutines after (vs before) | open files after (vs before) | KV-aware share back after | note |\n")
		fmt.Fprintf(w, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
		for _, f := range a.faults {
			note := f.note
			if !f.judged {
				note = strings.TrimPrefix(note+"; resources not judged: the slot ends within -conn-idle of the fault's end", "; ")
			}
			fmt.Fprintf(w, "| %.0f s | %s | %.1f s | %s | %d | %d / %d | %s | %s | %s | %s | %s |\n",
				f.start.Seconds(), f.label, (f.end - f.start).Seconds(), dur(f.recovered), f.failPre, f.failMidDead, f.failMid,
				vsBase(f.after[0], f.before[0], "%.0f"), vsBase(f.after[1], f.before[1], "%.0f"), vsBase(f.after[2], f.before[2], "%.0f"),
				dur(f.kvBack), note)
		}
		fmt.Fprintf(w, "\n\"Over after\": from the fault to its end (the process back, the stream restored, the stalled connections gone). "+
			"\"Recovered after\": from its end to its own sign of recovery (the engine answers again, Redis holds a key, the replicas see each other over NATS, "+
			"the events flow again) followed by %d seconds without a failed request. Failures count from the fault to the next one. "+
			"RSS (median) over the last half of the fault's slot, goroutines and open files (least) over its last %v to %v, per replica, against the same over as long before it; "+
			"judged only when that window starts %v or more after the fault's end (-conn-idle: the proxies' idle connections opened for the fault's retries close by then). "+
			"Latency: the chats and deterministic requests (not the slow clients, huge bodies or malformed ones), send to the end of the answer.\n\n",
			stableSeconds, settleWindow, resourceWindow, o.connIdle)
	}
	fmt.Fprintf(w, "Response cache across Redis restarts: %d of %d answers stored while Redis was up and asked for again were lost.\n\n", a.cacheLost, a.cacheCheck)
	for _, l := range a.cacheLog {
		fmt.Fprintf(w, "- %s\n", l)
	}
	if len(a.cacheLog) > 0 {
		fmt.Fprintln(w)
	}
	if fs := a.failures(); len(fs) == 0 {
		fmt.Fprintf(w, "**PASS**: every criterion held.\n")
	} else {
		fmt.Fprintf(w, "**FAIL**:\n\n")
		for _, f := range fs {
			fmt.Fprintf(w, "- %s\n", f)
		}
		if len(a.lost) > 0 {
			fmt.Fprintf(w, "\nFirst failed requests:\n\n")
			for _, l := range a.lost {
				fmt.Fprintf(w, "- %s\n", strings.ReplaceAll(l, "\n", " "))
			}
		}
	}
}

func faultSpacing(a *analysis) string {
	if len(a.faults) < 2 {
		return "—"
	}
	return fmt.Sprintf("%v", (a.faults[1].at - a.faults[0].at).Round(time.Second))
}

func dur(d time.Duration) string {
	if d < 0 {
		return "not seen"
	}
	return fmt.Sprintf("%.0f s", d.Seconds())
}

func pct(v float64) string {
	if math.IsNaN(v) {
		return "n/a"
	}
	return fmt.Sprintf("%.0f %%", v*100)
}

func join(v []float64, format string) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = num(x, format)
	}
	return strings.Join(s, " / ")
}

func num(x float64, format string) string {
	if math.IsNaN(x) {
		return "n/a"
	}
	return fmt.Sprintf(format, x)
}

// vsBase formats after-values per replica with their change from the baseline.
func vsBase(after, base []float64, format string) string {
	s := make([]string, len(after))
	for i := range after {
		s[i] = num(after[i], format)
		if !math.IsNaN(after[i]) && base[i] > 0 {
			s[i] += fmt.Sprintf(" (%+.0f %%)", (after[i]/base[i]-1)*100)
		}
	}
	return strings.Join(s, " / ")
}

// writeCSV writes one row per second.
func (a *analysis) writeCSV(w io.Writer) error {
	cw := csv.NewWriter(w)
	head := []string{"second", "ok", "rejected", "failed_before_first_byte", "cut_by_engine_death", "cut_otherwise",
		"cache_hits", "p50_ms", "p99_ms", "kv_aware_share"}
	for p := range a.proxies {
		head = append(head, fmt.Sprintf("rss_mb_%d", p), fmt.Sprintf("goroutines_%d", p), fmt.Sprintf("open_files_%d", p))
	}
	head = append(head, "faults")
	if err := cw.Write(head); err != nil {
		return err
	}
	f := func(x float64) string {
		if math.IsNaN(x) {
			return ""
		}
		return strconv.FormatFloat(x, 'f', -1, 64)
	}
	for i, s := range a.seconds {
		row := []string{strconv.Itoa(i), strconv.Itoa(s.ok), strconv.Itoa(s.rejected), strconv.Itoa(s.failPre),
			strconv.Itoa(s.failMidDead), strconv.Itoa(s.failMid), strconv.Itoa(s.hits), f(round(s.p50, 1)), f(round(s.p99, 1)), f(round(s.kvShare, 3))}
		for p := range a.proxies {
			row = append(row, f(round(s.rss[p], 1)), f(s.goroutines[p]), f(s.fds[p]))
		}
		row = append(row, strings.Join(s.faults, " "))
		if err := cw.Write(row); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

func round(x float64, digits int) float64 {
	p := math.Pow(10, float64(digits))
	return math.Round(x*p) / p
}

// writeFiles writes soak.md, soak.csv and soak.svg into dir.
func (a *analysis) writeFiles(dir, md string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "soak.md"), []byte(md), 0o644); err != nil {
		return err
	}
	var b strings.Builder
	if err := a.writeCSV(&b); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "soak.csv"), []byte(b.String()), 0o644); err != nil {
		return err
	}
	b.Reset()
	a.writeSVG(&b)
	return os.WriteFile(filepath.Join(dir, "soak.svg"), []byte(b.String()), 0o644)
}
