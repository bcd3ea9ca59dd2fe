package replay

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"strconv"

	"github.com/kvroute/kvroute/disagg"
)

// PDSummary is a Summary with the P/D fleet's additions, averaged over seeds: requests per path,
// the mean storage write and read of a remote prefill, and the decode engines' threshold overruns.
type PDSummary struct {
	Summary
	Fleet               string             `json:"fleet"`
	Paths               map[string]float64 `json:"paths"`
	WriteMean           float64            `json:"storage_write_mean_s"`
	ReadMean            float64            `json:"storage_read_mean_s"`
	DecodeOverThreshold float64            `json:"decode_over_threshold"`
}

// SummarisePD groups results by point and policy, as Summarise does, and averages the P/D
// additions over seeds.
func SummarisePD(rs []PDResult) []PDSummary {
	plain := make([]Result, len(rs))
	for i := range rs {
		plain[i] = rs[i].Result
	}
	ss := Summarise(plain)
	out := make([]PDSummary, len(ss))
	idx := map[[2]string]int{}
	for i := range ss {
		out[i] = PDSummary{Summary: ss[i], Paths: map[string]float64{}}
		idx[[2]string{ss[i].Point.String(), ss[i].Policy}] = i
	}
	for i := range rs {
		r := &rs[i]
		s := &out[idx[[2]string{r.point().String(), r.Policy}]]
		s.Fleet = r.Fleet
		n := float64(s.Seeds)
		for _, p := range disagg.Paths() {
			s.Paths[p.String()] += float64(r.Paths[p.String()]) / n
		}
		s.WriteMean += r.WriteMean / n
		s.ReadMean += r.ReadMean / n
		s.DecodeOverThreshold += float64(r.DecodeOverThreshold) / n
	}
	return out
}

// WritePDTable writes P/D summaries as Markdown tables, one per point: TTFT, throughput, hit
// ratio, requests per path and the transfers of a remote prefill.
func WritePDTable(w io.Writer, ss []PDSummary) error {
	var last string
	for i := range ss {
		s := &ss[i]
		if p := s.Point.String(); p != last {
			if last != "" {
				if _, err := fmt.Fprintln(w); err != nil {
					return err
				}
			}
			last = p
			if _, err := fmt.Fprintf(w, "%s; %d seed(s)\n\n", p, s.Seeds); err != nil {
				return err
			}
			if _, err := fmt.Fprintln(w, "| policy | fleet | TTFT p50 | TTFT p90 | TTFT p99 | TTFT mean | throughput (tok/s) | token hit ratio | fast_decode | prefill_then_decode | unified | fallback | write + read per remote prefill | decode over threshold |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"); err != nil {
				return err
			}
		}
		p99, hit := fmtSeconds(s.TTFTP99), fmtPct(s.HitRatio)
		if s.Seeds > 1 {
			p99 += " (" + fmtSeconds(s.P99Min) + "–" + fmtSeconds(s.P99Max) + ")"
			hit += " (" + fmtPct(s.HitMin) + "–" + fmtPct(s.HitMax) + ")"
		}
		name := s.Policy
		if s.Rejected > 0 {
			name += fmt.Sprintf(" [%.0f rejected]", s.Rejected)
		}
		xfer := "—"
		if s.Paths[disagg.PathPrefillThenDecode.String()] > 0 {
			xfer = fmtSeconds(s.WriteMean) + " + " + fmtSeconds(s.ReadMean)
		}
		count := func(p disagg.Path) string { return strconv.FormatFloat(s.Paths[p.String()], 'f', 0, 64) }
		if _, err := fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", name, s.Fleet,
			fmtSeconds(s.TTFTP50), fmtSeconds(s.TTFTP90), p99, fmtSeconds(s.TTFTMean),
			strconv.FormatFloat(s.Throughput, 'f', 0, 64), hit, count(disagg.PathFastDecode),
			count(disagg.PathPrefillThenDecode), count(disagg.PathUnified), count(disagg.PathFallback), xfer,
			strconv.FormatFloat(s.DecodeOverThreshold, 'f', 0, 64)); err != nil {
			return err
		}
	}
	return nil
}

// WritePDCSV writes one row per result: WriteCSV's columns, then the fleet, the requests per path,
// the mean storage write and read of a remote prefill, and the decode engines' threshold overruns.
func WritePDCSV(w io.Writer, rs []PDResult) error {
	cw := csv.NewWriter(w)
	head := append([]string{}, csvHeader...)
	head = append(head, "fleet")
	for _, p := range disagg.Paths() {
		head = append(head, p.String())
	}
	head = append(head, "storage_write_mean_s", "storage_read_mean_s", "decode_over_threshold")
	if err := cw.Write(head); err != nil {
		return err
	}
	f := func(x float64) string { return strconv.FormatFloat(x, 'g', 6, 64) }
	for i := range rs {
		r := &rs[i]
		var b bytes.Buffer // WriteCSV's row for the Result, then the additions
		if err := WriteCSV(&b, []Result{r.Result}); err != nil {
			return err
		}
		recs, err := csv.NewReader(&b).ReadAll()
		if err != nil {
			return err
		}
		row := recs[len(recs)-1]
		row = append(row, r.Fleet)
		for _, p := range disagg.Paths() {
			row = append(row, strconv.Itoa(r.Paths[p.String()]))
		}
		row = append(row, f(r.WriteMean), f(r.ReadMean), strconv.Itoa(r.DecodeOverThreshold))
		if err := cw.Write(row); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

// WritePDJSON writes {"results": […], "summaries": […]}, indented.
func WritePDJSON(w io.Writer, rs []PDResult, ss []PDSummary) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(struct {
		Results   []PDResult  `json:"results"`
		Summaries []PDSummary `json:"summaries"`
	}{rs, ss})
}
