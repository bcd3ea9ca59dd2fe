package replay

import (
	"bytes"
	"encoding/xml"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// smallShared is a shared-prefix workload whose prefixes (12 × 2,000 tokens) fit the fleet's
// cache (4 × 16,384 tokens) but not one engine's.
func smallShared(t testing.TB, seed uint64) *Workload {
	w, err := SharedPrefix(SharedPrefixConfig{Groups: 12, UsersPerGroup: 3, PrefixTokens: 2000, QuestionTokens: 300,
		OutputTokens: 40, Requests: 240, Seed: seed})
	require.NoError(t, err)
	return w
}

var smallFleet = Config{Engines: 4, CapacityTokens: 16_384, EventLag: 10 * time.Millisecond, Seed: 3}

func TestRunDeterministic(t *testing.T) {
	t.Parallel() // a simulation of its own: CPU-bound, it uses the second core
	w := smallShared(t, 1)
	for _, p := range []string{PolicyRandom, PolicyKVRoute, PolicyCost, OracleGlobalLRU} {
		t.Run(p, func(t *testing.T) {
			a, err := Run(w, smallFleet, p)
			require.NoError(t, err)
			b, err := Run(w, smallFleet, p)
			require.NoError(t, err)
			a.WallSec, b.WallSec = 0, 0
			require.Equal(t, a, b)
			require.Equal(t, 240, a.Requests)
			require.Positive(t, a.TTFTP99)
			require.Positive(t, a.Throughput)
		})
	}
	// A different seed changes the tokens and the random choices.
	other := smallFleet
	other.Seed = 4
	a, err := Run(w, smallFleet, PolicyRandom)
	require.NoError(t, err)
	b, err := Run(w, other, PolicyRandom)
	require.NoError(t, err)
	require.NotEqual(t, a.PerEngine, b.PerEngine)
}

// TestOraclesBound checks the order the oracles must keep: no policy beats the infinite cache's
// hit ratio, and the global LRU of the whole fleet's cache beats the policies that ignore the
// cache; the cache-aware policies beat those too.
func TestOraclesBound(t *testing.T) {
	t.Parallel() // a simulation of its own: CPU-bound, it uses the second core
	w := smallShared(t, 2)
	got := map[string]Result{}
	for _, p := range AllPolicies {
		r, err := Run(w, smallFleet, p)
		require.NoError(t, err, p)
		require.Zero(t, r.Rejected, p)
		got[p] = r
	}
	ceiling := got[OracleInfinite].HitRatio
	require.Greater(t, ceiling, 0.5)
	for p, r := range got {
		require.LessOrEqual(t, r.HitRatio, ceiling+1e-12, p)
	}
	for _, p := range []string{PolicyRandom, PolicyRoundRobin, PolicyLeastLoaded} {
		require.Greater(t, got[OracleGlobalLRU].HitRatio, got[p].HitRatio, p)
		for _, aware := range []string{PolicyCHWBL, PolicyPrecise, PolicyKVRoute} {
			require.Greater(t, got[aware].HitRatio, got[p].HitRatio, "%s vs %s", aware, p)
		}
	}
	require.Positive(t, got[PolicyKVRoute].KVAware)
	require.Zero(t, got[PolicyCHWBL].KVAware)
}

// TestSharedFirstBlock replays a bursty trace whose every request starts with the same block
// (one prefix key for all): kvroute's default must still spread the load. (Tier 1 alone does
// not: its overflow walk rarely reaches the last backends clockwise, so it is not checked here.)
// One engine taking everything would be max/mean 8; tier 4's expected-TTFT scorer weighs the
// prefill queued on the engine holding a popular document against what its cache saves (its
// count bound, KVConfig.LoadFactorEpsilon, never binds with 8 engines), so request counts over
// this short trace (30 documents of uneven popularity) may be uneven by a third, not more.
func TestSharedFirstBlock(t *testing.T) {
	t.Parallel() // a simulation of its own: CPU-bound, it uses the second core
	w, err := ReadTrace(strings.NewReader(burstyTrace(400, 7)), "bursty")
	require.NoError(t, err)
	for _, p := range []string{PolicyKVRoute, PolicyPrecise} {
		r, err := Run(w, Config{Engines: 8, CapacityTokens: 32_768, Seed: 1}, p)
		require.NoError(t, err)
		for i, n := range r.PerEngine {
			require.Positive(t, n, "%s: engine %d got nothing", p, i)
		}
		require.LessOrEqual(t, r.LoadMaxMean, 1.35, "%s: %v", p, r.PerEngine)
	}
}

func TestTimeScale(t *testing.T) {
	w := smallShared(t, 1)
	s80, err := TimeScale(w, Config{Utilisation: 0.8})
	require.NoError(t, err)
	s40, err := TimeScale(w, Config{Utilisation: 0.4})
	require.NoError(t, err)
	require.InDelta(t, 2*s80, s40, 1e-9, "half the load, twice the gaps")
	s16, err := TimeScale(w, Config{Utilisation: 0.8, Engines: 16})
	require.NoError(t, err)
	require.InDelta(t, s80/2, s16, 1e-9, "twice the engines, half the gaps")
	own, err := TimeScale(w, Config{Utilisation: -1})
	require.NoError(t, err)
	require.Equal(t, 1.0, own)
	_, err = Run(w, Config{Engines: 100}, PolicyKVRoute)
	require.ErrorIs(t, err, ErrInvalidConfig)
	_, err = Run(w, Config{}, "nope")
	require.ErrorIs(t, err, ErrInvalidConfig)
	_, err = ParsePolicies("kvroute,nope")
	require.ErrorIs(t, err, ErrInvalidConfig)
}

func TestReportAndChart(t *testing.T) {
	t.Parallel() // a simulation of its own: CPU-bound, it uses the second core
	w := smallShared(t, 1).Limit(60)
	var rs []Result
	for _, seed := range []uint64{1, 2} {
		for _, p := range AllPolicies {
			cfg := smallFleet
			cfg.Seed = seed
			r, err := Run(w, cfg, p)
			require.NoError(t, err)
			rs = append(rs, r)
		}
	}
	ss := Summarise(rs)
	require.Len(t, ss, len(AllPolicies))
	for _, s := range ss {
		require.Equal(t, 2, s.Seeds)
		require.LessOrEqual(t, s.HitMin, s.HitRatio)
		require.GreaterOrEqual(t, s.HitMax, s.HitRatio)
	}

	var table bytes.Buffer
	require.NoError(t, WriteTable(&table, ss))
	require.Equal(t, len(AllPolicies)+4, strings.Count(table.String(), "\n"), table.String())
	var csvOut, jsonOut bytes.Buffer
	require.NoError(t, WriteCSV(&csvOut, rs))
	require.Equal(t, len(rs)+1, strings.Count(csvOut.String(), "\n"))
	require.NoError(t, WriteJSON(&jsonOut, rs, ss))

	var svg bytes.Buffer
	require.NoError(t, WriteChart(&svg, `title <with> & "specials"`, ss))
	bars := map[string]map[string]int{"hit": {}, "p99": {}}
	dec := xml.NewDecoder(&svg)
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		require.NoError(t, err, "well-formed XML")
		if se, ok := tok.(xml.StartElement); ok && se.Name.Local == "rect" {
			var class, policy string
			for _, a := range se.Attr {
				switch a.Name.Local {
				case "class":
					class = a.Value
				case "data-policy":
					policy = a.Value
				}
			}
			if class != "" {
				bars[class][policy]++
			}
		}
	}
	for _, class := range []string{"hit", "p99"} {
		require.Len(t, bars[class], len(AllPolicies), class)
		for p, n := range bars[class] {
			require.Equal(t, 1, n, "%s bars of %s", class, p)
		}
	}
}

func BenchmarkReplay(b *testing.B) {
	w := smallShared(b, 1)
	if testing.Short() {
		w = w.Limit(80)
	}
	for _, p := range []string{PolicyRoundRobin, PolicyKVRoute} {
		b.Run("policy="+p, func(b *testing.B) {
			for b.Loop() {
				if _, err := Run(w, smallFleet, p); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(len(w.Requests)), "requests/op")
		})
	}
}

// TestBurstArrivals: the burst compression keeps every arrival in its period and in order, puts it
// in the period's first BurstDuty fraction, and makes the queues longer than the workload's own
// arrivals at the same mean rate; bad settings are refused.
func TestBurstArrivals(t *testing.T) {
	c := Config{BurstPeriod: 10 * time.Second, BurstDuty: 0.25}
	prev := time.Duration(-1)
	for at := time.Duration(0); at < 100*time.Second; at += 370 * time.Millisecond {
		got := c.burst(at)
		start := at / c.BurstPeriod * c.BurstPeriod
		require.GreaterOrEqual(t, got, start, "%v", at)
		require.Less(t, got, start+c.BurstPeriod/4, "%v", at)
		require.Greater(t, got, prev, "order kept at %v", at)
		prev = got
	}
	require.Equal(t, 7*time.Second, Config{}.burst(7*time.Second), "no burst: unchanged")

	w := smallShared(t, 1)
	base, err := Run(w, smallFleet, PolicyRoundRobin)
	require.NoError(t, err)
	bursty := smallFleet
	bursty.BurstPeriod, bursty.BurstDuty = 2*time.Second, 0.2
	b, err := Run(w, bursty, PolicyRoundRobin)
	require.NoError(t, err)
	require.Equal(t, w.Name+"+burst2sx5", b.Workload)
	require.Equal(t, base.Requests, b.Requests)
	require.Greater(t, b.QueueMean, base.QueueMean, "bursts queue more than the same load spread out")

	for _, bad := range []Config{{BurstPeriod: time.Second}, {BurstPeriod: time.Second, BurstDuty: 1.5},
		{BurstDuty: 0.5}, {BurstPeriod: -time.Second, BurstDuty: 0.5}} {
		_, err := Run(w, bad, PolicyRoundRobin)
		require.ErrorIs(t, err, ErrInvalidConfig, "%+v", bad)
	}
}
