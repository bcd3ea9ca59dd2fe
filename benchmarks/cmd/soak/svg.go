package main

import (
	"fmt"
	"html"
	"io"
	"math"
	"strings"
)

// series is one line of a panel: a value per second, NaN where there is none.
type series struct {
	name, color string
	values      []float64
}

// panel is one chart of the plot, sharing the time axis with the others.
type panel struct {
	title  string
	series []series
}

// Layout of the plot, in SVG user units.
const (
	svgWidth   = 980
	svgLeft    = 64
	svgRight   = 16
	svgTop     = 40
	panelH     = 110
	panelGap   = 34
	legendStep = 130
)

var replicaColors = []string{"#1f77b4", "#ff7f0e", "#9467bd", "#8c564b"}

// panels returns the plot's charts from the analysis.
func (a *analysis) panels() []panel {
	col := func(get func(second) float64) []float64 {
		v := make([]float64, len(a.seconds))
		for i, s := range a.seconds {
			v[i] = get(s)
		}
		return v
	}
	perReplica := func(title string, get func(second, int) float64) panel {
		p := panel{title: title}
		for r := range a.proxies {
			p.series = append(p.series, series{name: fmt.Sprintf("replica %d", r), color: replicaColors[r%len(replicaColors)],
				values: col(func(s second) float64 { return get(s, r) })})
		}
		return p
	}
	return []panel{
		{title: "requests per second", series: []series{
			{"ok", "#2ca02c", col(func(s second) float64 { return float64(s.ok) })},
			{"cache hits", "#17becf", col(func(s second) float64 { return float64(s.hits) })},
			{"failed before first byte", "#d62728", col(func(s second) float64 { return float64(s.failPre) })},
			{"cut mid-stream", "#e377c2", col(func(s second) float64 { return float64(s.failMid + s.failMidDead) })},
		}},
		{title: "latency (ms)", series: []series{
			{"p50", "#1f77b4", col(func(s second) float64 { return s.p50 })},
			{"p99", "#d62728", col(func(s second) float64 { return s.p99 })},
		}},
		perReplica("proxy RSS (MB)", func(s second, r int) float64 { return s.rss[r] }),
		perReplica("proxy goroutines", func(s second, r int) float64 { return s.goroutines[r] }),
		perReplica("proxy open files", func(s second, r int) float64 { return s.fds[r] }),
		{title: "KV-aware share (%, 5 s window)", series: []series{
			{"kv_aware", "#2ca02c", col(func(s second) float64 { return s.kvShare * 100 })},
		}},
	}
}

// writeSVG draws the panels over time, the faults shaded and labelled across all of them.
func (a *analysis) writeSVG(w io.Writer) {
	ps := a.panels()
	height := svgTop + len(ps)*(panelH+panelGap) + 10
	plotW := float64(svgWidth - svgLeft - svgRight)
	n := max(1, len(a.seconds)-1)
	x := func(sec float64) float64 { return svgLeft + sec/float64(n)*plotW }
	fmt.Fprintf(w, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="11">`+"\n",
		svgWidth, height, svgWidth, height)
	fmt.Fprintf(w, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(w, `<text x="%d" y="16" font-size="13" font-weight="bold">kvroute soak: %v at %v req/s, %d engines, %d replicas (faults shaded)</text>`+"\n",
		svgLeft, a.o.duration, a.o.rate, a.o.engines, a.o.replicas)
	bottom := float64(svgTop + len(ps)*(panelH+panelGap) - panelGap)
	for _, f := range a.faults {
		x0, x1 := x(f.start.Seconds()), x(f.end.Seconds())
		if x1-x0 < 2 {
			x1 = x0 + 2
		}
		fmt.Fprintf(w, `<rect x="%.1f" y="%d" width="%.1f" height="%.1f" fill="#fdd" opacity="0.7"/>`+"\n", x0, svgTop-8, x1-x0, bottom-svgTop+8)
		fmt.Fprintf(w, `<text x="%.1f" y="%d" fill="#a00">%s</text>`+"\n", x0+2, svgTop-10, html.EscapeString(f.fault))
	}
	for i, p := range ps {
		top := float64(svgTop + i*(panelH+panelGap))
		ymax := 0.0
		for _, s := range p.series {
			for _, v := range s.values {
				if !math.IsNaN(v) {
					ymax = math.Max(ymax, v)
				}
			}
		}
		ymax = niceCeil(ymax)
		y := func(v float64) float64 { return top + panelH - v/ymax*panelH }
		fmt.Fprintf(w, `<text x="%d" y="%.1f" font-weight="bold">%s</text>`+"\n", svgLeft, top-4, html.EscapeString(p.title))
		fmt.Fprintf(w, `<rect x="%d" y="%.1f" width="%.1f" height="%d" fill="none" stroke="#999"/>`+"\n", svgLeft, top, plotW, panelH)
		for _, frac := range []float64{0, 0.5, 1} {
			fmt.Fprintf(w, `<text x="%d" y="%.1f" text-anchor="end">%s</text>`+"\n", svgLeft-4, y(frac*ymax)+4, trimNum(frac*ymax))
		}
		for k, s := range p.series {
			var pts []string
			flush := func() {
				if len(pts) > 0 {
					fmt.Fprintf(w, `<polyline fill="none" stroke="%s" stroke-width="1.2" points="%s"/>`+"\n", s.color, strings.Join(pts, " "))
				}
				pts = pts[:0]
			}
			for sec, v := range s.values {
				if math.IsNaN(v) {
					flush()
					continue
				}
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(float64(sec)), y(v)))
			}
			flush()
			lx := float64(svgLeft + 200 + k*legendStep)
			fmt.Fprintf(w, `<line x1="%.0f" y1="%.1f" x2="%.0f" y2="%.1f" stroke="%s" stroke-width="2"/><text x="%.0f" y="%.1f">%s</text>`+"\n",
				lx, top-8, lx+14, top-8, s.color, lx+18, top-4, html.EscapeString(s.name))
		}
	}
	for sec := 0; sec <= n; sec += tickStep(n) {
		fmt.Fprintf(w, `<text x="%.1f" y="%.1f" text-anchor="middle">%d s</text>`+"\n", x(float64(sec)), bottom+14, sec)
	}
	fmt.Fprintln(w, "</svg>")
}

// niceCeil rounds v up to 1, 2 or 5 times a power of ten (1 for 0).
func niceCeil(v float64) float64 {
	if v <= 0 || math.IsNaN(v) {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}

func trimNum(v float64) string {
	if v == math.Trunc(v) {
		return fmt.Sprintf("%.0f", v)
	}
	return fmt.Sprintf("%.2g", v)
}

// tickStep is the time axis's tick spacing in seconds: about ten ticks.
func tickStep(n int) int {
	for _, s := range []int{5, 10, 15, 30, 60, 120, 300} {
		if n/s <= 12 {
			return s
		}
	}
	return 600
}
