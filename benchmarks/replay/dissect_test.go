package replay

import (
	"bytes"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestDissectSplitsTheHitGap: the hit gap between two runs is exactly the difference of their
// reachable tokens minus that of their tokens turned away, each turned-away request lands in the
// cause its backlogs say, and the tail is the requests at or above the p99.
func TestDissectSplitsTheHitGap(t *testing.T) {
	rec := func(prompt, engine, holder, reachable, cached int, backlog, holderBacklog, prefill, holderPrefill, ttft float64) RequestRecord {
		return RequestRecord{Prompt: prompt, Engine: engine, Holder: holder, Reachable: reachable, Cached: cached,
			Reason: "kv_aware", Backlog: backlog, HolderBacklog: holderBacklog, Prefill: prefill, HolderPrefill: holderPrefill,
			TTFT: ttft, Queued: ttft - prefill}
	}
	mine := []RequestRecord{
		rec(1000, 0, 0, 800, 800, 0, 0, 1, 1, 1),   // at the holder
		rec(1000, 1, 0, 600, 0, 0, 5, 3, 1, 3),     // away: the holder owed 5 s, +1 s > 3 s here: right for its TTFT
		rec(1000, 1, 0, 600, 0, 2, 0.5, 3, 1, 5),   // away: the holder would have been sooner
		rec(1000, 2, -1, 0, 0, 0, 0, 20, 20, 20),   // cold, the slowest: its own prefill
		rec(1000, 2, 2, 100, 100, 0, 0, 1, 1, 1.5), // at the holder
	}
	mine[1].HolderTop = true // passed over at its bound
	other := []RequestRecord{
		rec(1000, 0, 0, 800, 800, 0, 0, 1, 1, 1),
		rec(1000, 0, 0, 600, 600, 5, 5, 1, 1, 6),
		rec(1000, 0, 0, 500, 500, 0.5, 0.5, 1, 1, 1.5),
		rec(1000, 1, -1, 0, 0, 0, 0, 20, 20, 20),
		rec(1000, 2, 2, 100, 100, 0, 0, 1, 1, 1.5),
	}
	d, err := Dissect("kvroute", mine, "precise", other)
	require.NoError(t, err)
	require.Equal(t, int64(5000), d.PromptTokens)
	require.Equal(t, int64(900), d.Cached)
	require.Equal(t, int64(2000), d.OtherCached)
	require.Equal(t, d.Cached-d.OtherCached, (d.Reachable-d.OtherReachable)-(d.TurnedAway-d.OtherAway), "the split is exact")
	require.Equal(t, int64(1200), d.TurnedAway)
	require.Equal(t, []CauseCount{
		{Cause: "holder_later (kv_aware, bound)", Requests: 1, Tokens: 600},
		{Cause: "holder_sooner (kv_aware, scored)", Requests: 1, Tokens: 600},
	}, sortedAway(d.Away))
	require.InDelta(t, 20.0, d.P99, 1e-9)
	var floor CauseCount
	for _, c := range d.Tail {
		if c.Cause == "prefill_floor" {
			floor = c
		}
	}
	require.Equal(t, 1, floor.Requests, "%+v", d.Tail)

	var b bytes.Buffer
	require.NoError(t, WriteDissection(&b, d))
	require.Contains(t, b.String(), "holder_sooner (kv_aware, scored) | 1 | 600 | 12.00 |")

	_, err = Dissect("kvroute", mine, "precise", other[:4])
	require.Error(t, err, "records of different workloads")
	var csv bytes.Buffer
	require.NoError(t, WriteRecordsCSV(&csv, []string{"kvroute", "precise"}, [][]RequestRecord{mine, other}))
	require.Equal(t, 6, strings.Count(csv.String(), "\n"), "a header and a row per request")
}

// sortedAway orders causes by name, for comparison (Dissect orders them by tokens).
func sortedAway(cs []CauseCount) []CauseCount {
	out := slices.Clone(cs)
	slices.SortFunc(out, func(a, b CauseCount) int { return strings.Compare(a.Cause, b.Cause) })
	return out
}

// TestRunRecordsMatchResult: the records of a run add up to its Result.
func TestRunRecordsMatchResult(t *testing.T) {
	t.Parallel() // a simulation of its own
	w := smallShared(t, 1)
	res, recs, err := RunRecords(w, smallFleet, PolicyKVRoute)
	require.NoError(t, err)
	require.Len(t, recs, res.Requests)
	var cached, reachable int64
	for _, r := range recs {
		if r.Rejected {
			continue
		}
		cached += int64(r.Cached)
		reachable += int64(r.Reachable)
		require.InDelta(t, r.TTFT, r.Queued+r.Prefill, 1e-6)
		require.GreaterOrEqual(t, r.Backlog, r.MinBacklog)
	}
	require.Equal(t, res.CachedTokens, cached)
	require.Equal(t, res.ReachableTokens, reachable)
	plain, err := Run(w, smallFleet, PolicyKVRoute)
	require.NoError(t, err)
	plain.WallSec, res.WallSec = 0, 0
	require.Equal(t, plain, res, "recording changes nothing")
}

// TestDissectCountsBothSidesAlike: identical runs show no gap; a hit lost at the holder, tokens
// gained while queued and a rejected request each get their cause, and the causes add up to the
// tokens turned away; a tail request the other run rejected does not count in its mean.
func TestDissectCountsBothSidesAlike(t *testing.T) {
	recs := []RequestRecord{
		{Prompt: 1000, Engine: 0, Holder: 0, Reachable: 800, Cached: 0, TTFT: 9, Prefill: 0.5, Queued: 8.5, Backlog: 8}, // evicted at the holder
		{Prompt: 1000, Engine: 1, Holder: 0, Reachable: 0, Cached: 300, TTFT: 1, Prefill: 1},                            // gained while queued
		{Prompt: 1000, Engine: -1, Holder: 2, Reachable: 500, Rejected: true},                                           // rejected
		{Prompt: 1000, Engine: 2, Holder: 2, Reachable: 200, Cached: 200, TTFT: 0.5, Prefill: 0.5},
	}
	d, err := Dissect("kvroute", recs, "same", recs)
	require.NoError(t, err)
	require.Equal(t, d.Cached, d.OtherCached)
	require.Equal(t, d.TurnedAway, d.OtherAway, "the same records give no gap")
	require.Equal(t, int64(500), d.Cached)
	require.Equal(t, int64(1500), d.Reachable)
	var sum int64
	got := map[string]int64{}
	for _, c := range d.Away {
		sum += c.Tokens
		got[c.Cause] = c.Tokens
	}
	require.Equal(t, d.TurnedAway, sum, "the causes add up")
	require.Equal(t, map[string]int64{"evicted_at_holder": 800, "gained_while_queued": -300, "rejected": 500}, got)

	other := slices.Clone(recs)
	other[0].Rejected, other[0].TTFT = true, 0
	d, err = Dissect("kvroute", recs, "other", other)
	require.NoError(t, err)
	for _, c := range d.Tail {
		if c.Requests > 0 {
			require.Equal(t, "queued_at_holder", c.Cause)
			require.Zero(t, c.OtherRequests, "the other rejected it")
		}
	}
	none := slices.Clone(recs)
	for i := range none {
		none[i].Rejected = true
	}
	d, err = Dissect("kvroute", recs, "none", none)
	require.NoError(t, err)
	require.Zero(t, d.OtherP99)
	var b bytes.Buffer
	require.NoError(t, WriteDissection(&b, d))
	require.Contains(t, b.String(), "(none admitted no request)")
	require.Error(t, WriteRecordsCSV(&b, []string{"a", "b"}, [][]RequestRecord{recs, recs[:2]}))
}
