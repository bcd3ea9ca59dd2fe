package replay

import (
	"cmp"
	"encoding/csv"
	"fmt"
	"io"
	"slices"
	"strconv"
)

// RequestRecord is what happened to one request of a run (RunRecords). Times are in seconds.
type RequestRecord struct {
	Arrival float64 `json:"arrival_s"`
	Prompt  int     `json:"prompt_tokens"`
	// Engine is the engine the request was routed to; Holder the one that held the most of its
	// prompt when it arrived (-1: none held any), and Reachable how much (as the engine counts a
	// hit: at most a block short of the whole prompt).
	Engine    int    `json:"engine"`
	Holder    int    `json:"holder"`
	Reachable int    `json:"reachable_tokens"`
	Cached    int    `json:"cached_tokens"`
	Rejected  bool   `json:"rejected"`
	Reason    string `json:"reason"` // the Decision's reason ("" for the global-LRU oracle)
	// Queued is the wait for admission and compute, Prefill the request's own prefill, TTFT
	// their sum.
	Queued  float64 `json:"queued_s"`
	Prefill float64 `json:"prefill_s"`
	TTFT    float64 `json:"ttft_s"`
	// Backlog is the prefill compute the chosen engine owed when the request arrived
	// (VirtualEngine.Backlog), HolderBacklog the holder's, MinBacklog the least of any engine's.
	Backlog       float64 `json:"backlog_s"`
	HolderBacklog float64 `json:"holder_backlog_s"`
	MinBacklog    float64 `json:"min_backlog_s"`
	// HolderPrefill is the request's prefill at the holder, with the hit it held there.
	HolderPrefill float64 `json:"holder_prefill_s"`
	// HolderTop reports that tier 4 scored the holder at least as well as the chosen engine (so
	// that the holder was passed over for its load bound); false also when the decision has no
	// scores.
	HolderTop bool `json:"holder_top"`
}

// records returns the requests' records, in the workload's order.
func (s *sim) records() []RequestRecord {
	out := make([]RequestRecord, len(s.reqs))
	for i := range s.reqs {
		r := &s.reqs[i]
		rec := RequestRecord{Arrival: r.arrival.Seconds(), Prompt: r.prompt, Engine: int(r.engine), Holder: int(r.holder),
			Reachable: r.reachable, Cached: r.cached, Rejected: r.rejected, Queued: r.queued.Seconds(),
			Prefill: r.prefill.Seconds(), Backlog: r.backlog.Seconds(), HolderBacklog: r.holderBacklog.Seconds(),
			MinBacklog: r.minBacklog.Seconds(), HolderPrefill: s.cfg.Latency.Prefill(r.prompt, r.reachable, 0).Seconds(),
			HolderTop: r.holderTop}
		if r.d != nil {
			rec.Reason = r.reason.String()
		}
		if r.rejected {
			rec.Engine = -1
		} else {
			rec.TTFT = (r.first - r.arrival).Seconds()
		}
		out[i] = rec
	}
	return out
}

// Dissection explains, request by request, where one policy's hit ratio and TTFT tail differ from
// another's on the same workload and fleet: Policy is the one dissected (kvroute), Other the one
// it is compared with.
//
// Both runs' hits are split the same way, over all requests (a rejected one has no hit): cached =
// reachable − turned away, where reachable is what the engine holding the most of the prompt held
// when it arrived and turned away is the rest, so that the gap between the two runs is exactly the
// gap of their reachable tokens minus the gap of their tokens turned away. The dissected policy's
// tokens turned away are broken down by cause (AwayCauses); they add up to TurnedAway.
//
// The tail is the requests whose TTFT is at or above the dissected policy's p99: each is put in
// one cause (TailCauses), and its TTFT under Other is given beside its own.
type Dissection struct {
	Policy, Other string
	Requests      int
	PromptTokens  int64 // of every request, rejected ones included
	// Hits, in tokens: cached = reachable − turned away, on each side.
	Cached, OtherCached       int64
	Reachable, OtherReachable int64
	TurnedAway, OtherAway     int64
	// Away breaks TurnedAway down by cause, in tokens and requests, most tokens first.
	Away []CauseCount
	// The tail: each side's p99 (0 when it admitted no request), and the dissected policy's tail
	// requests by cause.
	P99, OtherP99 float64
	Tail          []CauseCount
}

// CauseCount is one cause's share of a dissection: requests, and tokens (hits) or seconds of TTFT
// and queue wait (tail). OtherTTFT sums the same requests' TTFT in the other run, over the
// OtherRequests of them it admitted.
type CauseCount struct {
	Cause         string  `json:"cause"`
	Requests      int     `json:"requests"`
	Tokens        int64   `json:"tokens,omitempty"`
	TTFT          float64 `json:"ttft_s,omitempty"`
	Queued        float64 `json:"queued_s,omitempty"`
	OtherTTFT     float64 `json:"other_ttft_s,omitempty"`
	OtherRequests int     `json:"other_requests,omitempty"`
}

// The causes of hits turned away. Routed past the holder: by the engines' true backlogs when the
// request arrived, the holder would have given its first token sooner than the chosen engine
// (holder_sooner: a loss of both hits and TTFT) or not (holder_later: the hit was traded for this
// request's TTFT); Dissect adds the Decision's reason and why tier 4 passed the holder over: it
// scored lower ("scored") or best but at its load bound ("bound"): "holder_sooner (load_bound,
// bound)". Routed to the holder, which evicted the blocks while the request waited for admission
// (evicted_at_holder). Rejected (its reachable tokens). And, counted negative, tokens an engine
// gained while the request waited (gained_while_queued: it was admitted with more cached than any
// engine held at its arrival).
var AwayCauses = []string{"holder_sooner", "holder_later", "evicted_at_holder", "rejected", "gained_while_queued"}

// The causes of a request in the tail: its own prefill alone reaches the other policy's p99
// (prefill_floor: routing could only help by a bigger hit); it queued at the engine holding its
// prompt (queued_at_holder) or elsewhere, with an engine owing less work at arrival
// (queued_elsewhere_idler_existed) or not (queued_elsewhere); or neither (slow_prefill: its
// prefill with the hit it got is what makes it slow).
var TailCauses = []string{"prefill_floor", "queued_at_holder", "queued_elsewhere_idler_existed", "queued_elsewhere", "slow_prefill"}

// split returns a record's reachable and cached tokens as Dissect counts them: a rejected request
// has no hit.
func (r *RequestRecord) split() (reachable, cached int64) {
	if r.Rejected {
		return int64(r.Reachable), 0
	}
	return int64(r.Reachable), int64(r.Cached)
}

// awayCause is the cause of r's tokens turned away, "" when it turned none away.
func (r *RequestRecord) awayCause() string {
	reach, cached := r.split()
	switch {
	case reach == cached:
		return ""
	case r.Rejected:
		return "rejected"
	case cached > reach:
		return "gained_while_queued"
	case r.Engine == r.Holder:
		return "evicted_at_holder"
	}
	cause := "holder_later"
	if r.HolderBacklog+r.HolderPrefill < r.Backlog+r.Prefill {
		cause = "holder_sooner"
	}
	if r.Reason != "" {
		why := "scored"
		if r.HolderTop {
			why = "bound"
		}
		cause += " (" + r.Reason + ", " + why + ")"
	}
	return cause
}

// Dissect compares two runs' records of the same workload (RunRecords with the same Config but
// the policy). It returns an error when the records do not belong to the same requests.
func Dissect(policy string, recs []RequestRecord, other string, otherRecs []RequestRecord) (Dissection, error) {
	if len(recs) != len(otherRecs) {
		return Dissection{}, fmt.Errorf("replay: dissect: %d records against %d", len(recs), len(otherRecs))
	}
	d := Dissection{Policy: policy, Other: other, Requests: len(recs)}
	away := make(map[string]*CauseCount, len(AwayCauses))
	var ttft, otherTTFT []float64
	for i := range recs {
		r, o := &recs[i], &otherRecs[i]
		if r.Prompt != o.Prompt {
			return Dissection{}, fmt.Errorf("replay: dissect: request %d has %d prompt tokens against %d", i, r.Prompt, o.Prompt)
		}
		d.PromptTokens += int64(r.Prompt)
		reach, cached := r.split()
		d.Reachable += reach
		d.Cached += cached
		oreach, ocached := o.split()
		d.OtherReachable += oreach
		d.OtherCached += ocached
		if !r.Rejected {
			ttft = append(ttft, r.TTFT)
		}
		if !o.Rejected {
			otherTTFT = append(otherTTFT, o.TTFT)
		}
		if cause := r.awayCause(); cause != "" {
			c := away[cause]
			if c == nil {
				c = &CauseCount{Cause: cause}
				away[cause] = c
			}
			c.Requests++
			c.Tokens += reach - cached
		}
	}
	d.TurnedAway, d.OtherAway = d.Reachable-d.Cached, d.OtherReachable-d.OtherCached
	for _, c := range away {
		d.Away = append(d.Away, *c)
	}
	slices.SortFunc(d.Away, func(a, b CauseCount) int {
		return cmp.Or(cmp.Compare(b.Tokens, a.Tokens), cmp.Compare(a.Cause, b.Cause))
	})
	if len(otherTTFT) > 0 {
		slices.Sort(otherTTFT)
		d.OtherP99 = quantile(otherTTFT, 0.99)
	}
	if len(ttft) == 0 {
		return d, nil
	}
	slices.Sort(ttft)
	d.P99 = quantile(ttft, 0.99)
	tail := make(map[string]*CauseCount, len(TailCauses))
	for _, c := range TailCauses {
		tail[c] = &CauseCount{Cause: c}
	}
	for i := range recs {
		r, o := &recs[i], &otherRecs[i]
		if r.Rejected || r.TTFT < d.P99 {
			continue
		}
		cause := "slow_prefill"
		switch {
		case d.OtherP99 > 0 && r.Prefill >= d.OtherP99:
			cause = "prefill_floor"
		case r.Queued > 0 && r.Engine == r.Holder:
			cause = "queued_at_holder"
		case r.Queued > 0 && r.MinBacklog < r.Backlog:
			cause = "queued_elsewhere_idler_existed"
		case r.Queued > 0:
			cause = "queued_elsewhere"
		}
		c := tail[cause]
		c.Requests++
		c.TTFT += r.TTFT
		c.Queued += r.Queued
		if !o.Rejected {
			c.OtherTTFT += o.TTFT
			c.OtherRequests++
		}
	}
	for _, c := range TailCauses {
		d.Tail = append(d.Tail, *tail[c])
	}
	return d, nil
}

// WriteDissection writes d as Markdown: the hit decomposition, the hits turned away by cause, and
// the tail by cause.
func WriteDissection(w io.Writer, d Dissection) error {
	pt := func(x int64) string {
		if d.PromptTokens == 0 {
			return "0"
		}
		return strconv.FormatFloat(100*float64(x)/float64(d.PromptTokens), 'f', 2, 64)
	}
	_, err := fmt.Fprintf(w, "**%s against %s, %d requests.** Cached %s %% of the prompt tokens against %s %% (%+.2f pt) = reachable %s %% against %s %% (%+.2f pt: what the engine holding the most held at arrival) − turned away %s %% against %s %% (%+.2f pt: the rest).\n\n",
		d.Policy, d.Other, d.Requests, pt(d.Cached), pt(d.OtherCached), pct(d.Cached-d.OtherCached, d.PromptTokens),
		pt(d.Reachable), pt(d.OtherReachable), pct(d.Reachable-d.OtherReachable, d.PromptTokens),
		pt(d.TurnedAway), pt(d.OtherAway), pct(d.TurnedAway-d.OtherAway, d.PromptTokens))
	if err != nil {
		return err
	}
	if _, err := fmt.Fprintf(w, "| %s's hits turned away, by cause | requests | tokens | pt of the prompt tokens |\n|---|--:|--:|--:|\n", d.Policy); err != nil {
		return err
	}
	for _, c := range d.Away {
		if _, err := fmt.Fprintf(w, "| %s | %d | %d | %s |\n", c.Cause, c.Requests, c.Tokens, pt(c.Tokens)); err != nil {
			return err
		}
	}
	if d.P99 == 0 {
		_, err := fmt.Fprintf(w, "\n%s admitted no request: no tail.\n", d.Policy)
		return err
	}
	vs := "(" + d.Other + " admitted no request)"
	if d.OtherP99 > 0 {
		vs = fmt.Sprintf("against %s (%+.1f %%)", fmtSeconds(d.OtherP99), 100*(d.P99/d.OtherP99-1))
	}
	if _, err := fmt.Fprintf(w, "\nTTFT p99 %s %s. %s's requests at or above its p99, by cause:\n\n| cause | requests | mean TTFT | mean queued | the same requests' mean TTFT under %s |\n|---|--:|--:|--:|--:|\n",
		fmtSeconds(d.P99), vs, d.Policy, d.Other); err != nil {
		return err
	}
	for _, c := range d.Tail {
		mean := func(x float64, n int) string {
			if n == 0 {
				return "—"
			}
			return fmtSeconds(x / float64(n))
		}
		if _, err := fmt.Fprintf(w, "| %s | %d | %s | %s | %s |\n", c.Cause, c.Requests, mean(c.TTFT, c.Requests), mean(c.Queued, c.Requests),
			mean(c.OtherTTFT, c.OtherRequests)); err != nil {
			return err
		}
	}
	return nil
}

// pct is 100·x/n in points.
func pct(x, n int64) float64 {
	if n == 0 {
		return 0
	}
	return 100 * float64(x) / float64(n)
}

// WriteRecordsCSV writes runs' records side by side, a row per request: for each policy (in
// order) every field of its RequestRecord but the arrival and the prompt, which lead the row. The
// runs must have as many records as policies are named, each of the same length.
func WriteRecordsCSV(w io.Writer, policies []string, recs [][]RequestRecord) error {
	if len(recs) != len(policies) {
		return fmt.Errorf("replay: %d runs of records for %d policies", len(recs), len(policies))
	}
	for i := range recs {
		if len(recs[i]) != len(recs[0]) {
			return fmt.Errorf("replay: %s has %d records, %s %d", policies[i], len(recs[i]), policies[0], len(recs[0]))
		}
	}
	cw := csv.NewWriter(w)
	head := []string{"request", "arrival_s", "prompt_tokens"}
	for _, p := range policies {
		for _, f := range []string{"engine", "holder", "reachable_tokens", "cached_tokens", "rejected", "reason", "queued_s", "prefill_s",
			"ttft_s", "backlog_s", "holder_backlog_s", "min_backlog_s", "holder_prefill_s", "holder_top"} {
			head = append(head, p+"_"+f)
		}
	}
	if err := cw.Write(head); err != nil {
		return err
	}
	f := func(x float64) string { return strconv.FormatFloat(x, 'g', 6, 64) }
	n := 0
	if len(recs) > 0 {
		n = len(recs[0])
	}
	for i := range n {
		row := []string{strconv.Itoa(i), f(recs[0][i].Arrival), strconv.Itoa(recs[0][i].Prompt)}
		for _, rs := range recs {
			r := &rs[i]
			row = append(row, strconv.Itoa(r.Engine), strconv.Itoa(r.Holder), strconv.Itoa(r.Reachable), strconv.Itoa(r.Cached),
				strconv.FormatBool(r.Rejected), r.Reason, f(r.Queued), f(r.Prefill), f(r.TTFT), f(r.Backlog), f(r.HolderBacklog),
				f(r.MinBacklog), f(r.HolderPrefill), strconv.FormatBool(r.HolderTop))
		}
		if err := cw.Write(row); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}
