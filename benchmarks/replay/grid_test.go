package replay

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestVerdict(t *testing.T) {
	for _, c := range []struct {
		name                         string
		mean, lo, hi, best, blo, bhi float64
		higher                       bool
		want                         string
	}{
		{"hit ahead", 0.60, 0.59, 0.61, 0.58, 0.58, 0.58, true, GridWin},
		{"hit equal", 0.58, 0.58, 0.58, 0.58, 0.58, 0.58, true, GridTie},
		{"hit behind within the spread", 0.57, 0.55, 0.59, 0.58, 0.58, 0.585, true, GridTie},
		{"hit behind, ranges touch", 0.57, 0.56, 0.58, 0.59, 0.58, 0.60, true, GridTie},
		{"hit behind beyond the spread", 0.57, 0.565, 0.575, 0.58, 0.578, 0.582, true, GridLoss},
		{"hit behind, one seed", 0.579, 0.579, 0.579, 0.58, 0.58, 0.58, true, GridLoss},
		{"p99 faster", 9.0, 9.0, 9.0, 9.5, 9.5, 9.5, false, GridWin},
		{"p99 equal", 9.07, 9.07, 9.07, 9.07, 9.07, 9.07, false, GridTie},
		{"p99 slower within the spread", 9.9, 9.1, 10.7, 9.0, 8.0, 10.0, false, GridTie},
		{"p99 slower beyond the spread", 9.9, 9.8, 10.0, 9.0, 8.9, 9.1, false, GridLoss},
		{"p99 equal to rounding", 1.0 + 1e-12, 1, 1, 1, 1, 1, false, GridTie},
	} {
		t.Run(c.name, func(t *testing.T) {
			require.Equal(t, c.want, Verdict(c.mean, c.lo, c.hi, c.best, c.blo, c.bhi, c.higher))
		})
	}
}

// gridResult is a hand-built result at the point (w, 8 engines, 262,144 tokens, 80 %).
func gridResult(w, policy string, seed uint64, hit, p99 float64) Result {
	return Result{Workload: w, Policy: policy, Seed: seed, Engines: 8, CapacityTokens: 262_144, Utilisation: 0.8,
		Replicas: 1, Sync: SyncNone, HitRatio: hit, Reachable: hit + 0.01, TTFTP99: p99, LoadMaxMean: 1.1, QueueMean: 0.5}
}

func TestGridPoints(t *testing.T) {
	var rs []Result
	add := func(w, p string, hits, p99s [2]float64) {
		for i, seed := range []uint64{1, 2} {
			rs = append(rs, gridResult(w, p, seed, hits[i], p99s[i]))
		}
	}
	// a: kvroute wins the hit ratio, loses the p99 within the spread (its 9.2–9.8 s overlaps
	// cost's 9.0–9.4 s).
	add("a", PolicyCost, [2]float64{0.40, 0.42}, [2]float64{9.0, 9.4})
	add("a", PolicyPrecise, [2]float64{0.58, 0.58}, [2]float64{9.6, 9.6})
	add("a", PolicyKVRoute, [2]float64{0.59, 0.60}, [2]float64{9.2, 9.8})
	add("a", OracleGlobalLRU, [2]float64{0.65, 0.65}, [2]float64{7.0, 7.0})
	add("a", OracleInfinite, [2]float64{0.90, 0.90}, [2]float64{1.0, 1.0}) // never the best
	// b: kvroute ties precise on the hit ratio and loses the p99 beyond the spread; no oracle ran.
	add("b", PolicyPrecise, [2]float64{0.30, 0.30}, [2]float64{5.0, 5.1})
	add("b", PolicyKVRoute, [2]float64{0.30, 0.30}, [2]float64{6.0, 6.2})
	// c: kvroute alone.
	add("c", PolicyKVRoute, [2]float64{0.30, 0.30}, [2]float64{6.0, 6.2})
	// d: kvroute did not run.
	add("d", PolicyPrecise, [2]float64{0.30, 0.30}, [2]float64{6.0, 6.2})

	gps := GridPoints(rs, PolicyKVRoute)
	require.Len(t, gps, 3)
	a, b, c := gps[0], gps[1], gps[2]
	require.Equal(t, "a", a.Workload)
	require.Equal(t, 2, a.Seeds)
	require.Equal(t, PolicyPrecise, a.Hit.Best)
	require.InDelta(t, 0.015, a.Hit.Margin, 1e-12)
	require.Equal(t, GridWin, a.Hit.Verdict)
	require.Equal(t, PolicyCost, a.P99.Best)
	require.InDelta(t, 9.2, a.P99.BestMean, 1e-12)
	require.InDelta(t, -0.3, a.P99.Margin, 1e-12)
	require.Equal(t, GridTie, a.P99.Verdict)
	require.InDelta(t, 0.65, a.OracleHit, 1e-12)
	require.InDelta(t, 0.595/0.65, a.OracleShare, 1e-12)
	require.InDelta(t, 0.605, a.Reachable, 1e-12)
	require.InDelta(t, 0.5, a.QueueMean, 1e-12)

	require.Equal(t, GridTie, b.Hit.Verdict)
	require.Zero(t, b.Hit.Margin)
	require.Equal(t, GridLoss, b.P99.Verdict)
	require.InDelta(t, -1.05, b.P99.Margin, 1e-12)
	require.Zero(t, b.OracleHit)
	require.Zero(t, b.OracleShare)

	require.Equal(t, GridNone, c.Hit.Verdict)
	require.Equal(t, GridNone, c.P99.Verdict)

	var buf bytes.Buffer
	require.NoError(t, WriteGridTable(&buf, gps))
	out := buf.String()
	require.Equal(t, 1, strings.Count(out, "| workload |"), out)
	require.Contains(t, out, "| a | 8 | 262144 | 80 % | precise 58.0 % | 59.5 % (59.0 %–60.0 %) | +1.50 | W | cost 9.20 s | 9.50 s (9.20 s–9.80 s) | −300 ms (−3.3 %) | T | 91.5 % | 60.5 % | 1.10 |")
	require.Contains(t, out, "| b | 8 | 262144 | 80 % | precise 30.0 % | 30.0 % (30.0 %–30.0 %) | 0.00 | T | precise 5.05 s | 6.10 s (6.00 s–6.20 s) | −1.05 s (−20.8 %) | L | — |")
	require.Contains(t, out, "| c | 8 | 262144 | 80 % | — | 30.0 % (30.0 %–30.0 %) | — | — | — |")
	require.Contains(t, out, "kvroute at 3 point(s), 2 seed(s): hit W/T/L 1/1/0, TTFT p99 W/T/L 0/1/1; ≥ 90 % of the global LRU's hit ratio at 1 of 1; load max/mean ≤ 1.3 at 3 of 3.")

	buf.Reset()
	require.NoError(t, WriteGridCSV(&buf, gps))
	require.Equal(t, 4, strings.Count(buf.String(), "\n"))
	buf.Reset()
	require.NoError(t, WriteGridJSON(&buf, gps, rs, Summarise(rs)))
	var doc struct {
		Grid []map[string]any `json:"grid"`
	}
	require.NoError(t, json.Unmarshal(buf.Bytes(), &doc))
	require.Len(t, doc.Grid, 3)
	require.Equal(t, "a", doc.Grid[0]["workload"])
}

// TestRunGridParallel checks that RunGrid's results do not depend on how many runs it simulates
// at once: each run has its own engines, router and index.
func TestRunGridParallel(t *testing.T) {
	t.Parallel() // a simulation of its own: CPU-bound, it uses the second core
	w1, w2 := smallShared(t, 1), smallShared(t, 2)
	mt, err := MultiTurn(MultiTurnConfig{Conversations: 6, Turns: 3, Seed: 1})
	require.NoError(t, err)
	g := Grid{Workloads: []map[uint64]*Workload{{1: w1.Limit(80), 2: w2.Limit(80)}, {1: mt, 2: mt}},
		Engines: []int{2, 4}, CapacityTokens: []int{16_384}, Utilisations: []float64{0.8}, Seeds: []uint64{1, 2},
		Policies: []string{PolicyPrecise, PolicyKVRoute, OracleGlobalLRU}}
	seq, err := RunGrid(g)
	require.NoError(t, err)
	require.Len(t, seq, g.Runs())
	g.Parallel = 4
	par, err := RunGrid(g)
	require.NoError(t, err)
	for i := range seq {
		seq[i].WallSec, par[i].WallSec = 0, 0
	}
	require.Equal(t, seq, par)
	// The fixed order: workload, engines, capacity, utilisation, seed, policy.
	require.Equal(t, 2, seq[0].Engines)
	require.Equal(t, uint64(1), seq[0].Seed)
	require.Equal(t, PolicyKVRoute, seq[1].Policy)
	require.Equal(t, uint64(2), seq[3].Seed)
	require.Equal(t, 4, seq[6].Engines)
	require.Equal(t, mt.Name, seq[12].Workload)

	_, err = RunGrid(Grid{})
	require.ErrorIs(t, err, ErrInvalidConfig)
	g.Seeds = []uint64{3}
	_, err = RunGrid(g)
	require.ErrorIs(t, err, ErrInvalidConfig)
}
