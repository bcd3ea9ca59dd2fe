package replay

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"io"
	"math"
)

// Chart geometry, in SVG user units.
const (
	chartLabelW = 150 // policy names
	chartPanelW = 330 // one panel's bar area
	chartGap    = 70  // between the panels
	chartRowH   = 26
	chartTop    = 64
	chartBottom = 40
)

// WriteChart writes an SVG bar chart of one point's summaries: token hit ratio (left) and TTFT
// p99 (right), one bar of each per policy, kvroute's default highlighted and the oracles grey.
// With several seeds, a whisker shows the range over seeds. The bars carry class "hit" or "p99"
// and a data-policy attribute.
func WriteChart(w io.Writer, title string, ss []Summary) error {
	var b bytes.Buffer
	width := chartLabelW + 2*chartPanelW + chartGap + 60
	height := chartTop + len(ss)*chartRowH + chartBottom
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n",
		width, height, width, height)
	fmt.Fprintf(&b, `<rect x="0" y="0" width="%d" height="%d" fill="#ffffff"/>`+"\n", width, height)
	fmt.Fprintf(&b, `<text x="10" y="20" font-size="14" font-weight="bold">%s</text>`+"\n", esc(title))

	maxP99 := 0.0
	for _, s := range ss {
		maxP99 = max(maxP99, s.TTFTP99, s.P99Max)
	}
	maxP99 = niceCeil(maxP99)
	x0 := float64(chartLabelW)
	x1 := x0 + chartPanelW + chartGap
	fmt.Fprintf(&b, `<text x="%.0f" y="48" font-weight="bold">token hit ratio</text>`+"\n", x0)
	fmt.Fprintf(&b, `<text x="%.0f" y="48" font-weight="bold">TTFT p99 (s), lower is better</text>`+"\n", x1)
	axis := func(x, maxV float64, unit func(float64) string) {
		yb := float64(chartTop + len(ss)*chartRowH)
		for k := 0; k <= 4; k++ {
			xx := x + float64(k)*chartPanelW/4
			fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%.1f" stroke="#dddddd"/>`+"\n", xx, chartTop-4, xx, yb)
			fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" fill="#555555">%s</text>`+"\n", xx, yb+16, esc(unit(maxV*float64(k)/4)))
		}
	}
	axis(x0, 1, func(v float64) string { return fmt.Sprintf("%.0f%%", v*100) })
	axis(x1, maxP99, func(v float64) string { return fmt.Sprintf("%.3g", v) })

	for i, s := range ss {
		y := float64(chartTop + i*chartRowH)
		fill := "#4c78a8"
		switch s.Policy {
		case PolicyKVRoute:
			fill = "#e45756"
		case OracleGlobalLRU, OracleInfinite:
			fill = "#9d9d9d"
		}
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%s</text>`+"\n", chartLabelW-8, y+15, esc(s.Policy))
		bar := func(class string, x, v, lo, hi, maxV float64, label string) {
			wv := 0.0
			if maxV > 0 {
				wv = math.Max(0, v/maxV*chartPanelW)
			}
			fmt.Fprintf(&b, `<rect class="%s" data-policy="%s" x="%.1f" y="%.1f" width="%.1f" height="%d" fill="%s"/>`+"\n",
				class, esc(s.Policy), x, y+4, wv, chartRowH-8, fill)
			if s.Seeds > 1 && maxV > 0 {
				fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#222222"/>`+"\n",
					x+lo/maxV*chartPanelW, y+chartRowH/2, x+hi/maxV*chartPanelW, y+chartRowH/2)
			}
			fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" fill="#222222">%s</text>`+"\n", x+math.Max(wv, hi/math.Max(maxV, 1e-12)*chartPanelW)+4, y+15, esc(label))
		}
		bar("hit", x0, s.HitRatio, s.HitMin, s.HitMax, 1, fmtPct(s.HitRatio))
		bar("p99", x1, s.TTFTP99, s.P99Min, s.P99Max, maxP99, fmtSeconds(s.TTFTP99))
	}
	fmt.Fprintf(&b, `<text x="10" y="%d" fill="#555555">red: kvroute's default; grey: oracles (global LRU of the whole fleet's cache; infinite cache, TTFT without queueing)</text>`+"\n",
		height-10)
	b.WriteString("</svg>\n")
	_, err := w.Write(b.Bytes())
	return err
}

// niceCeil rounds v up to 1, 2 or 5 times a power of ten (1 for v ≤ 0).
func niceCeil(v float64) float64 {
	if !(v > 0) || math.IsInf(v, 1) {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= v {
			return m * p
		}
	}
	return 10 * p
}

func esc(s string) string {
	var b bytes.Buffer
	_ = xml.EscapeText(&b, []byte(s))
	return b.String()
}
