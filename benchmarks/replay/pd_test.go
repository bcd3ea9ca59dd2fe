package replay

import (
	"bytes"
	"strings"
	"testing"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/disagg"
	"github.com/stretchr/testify/require"
)

// pdFleet is smallFleet's engines as 1 prefill and 3 decode engines.
var pdFleet = PDConfig{Prefill: 1, Decode: 3}

// runPDSim runs a P/D replay and returns the simulation, for its per-request state.
func runPDSim(t *testing.T, w *Workload, cfg Config, pd PDConfig) (*pdSim, PDResult) {
	t.Helper()
	s, err := newPDSim(w, cfg, pd)
	require.NoError(t, err)
	t.Cleanup(s.close)
	require.NoError(t, s.run())
	return s, s.result()
}

func TestRunPDCompletesAndAccounts(t *testing.T) {
	t.Parallel() // a simulation of its own: CPU-bound, it uses the second core
	w := smallShared(t, 1)
	s, res := runPDSim(t, w, smallFleet, pdFleet)
	require.Equal(t, len(w.Requests), res.Requests)
	require.Zero(t, res.Rejected)
	require.Equal(t, "pd-1:3", res.Policy)
	require.Equal(t, 4, res.Engines)

	// Every request reached its decode engine's first token and finished, after its transfers.
	pt, twins := 0, 0
	for i := range s.reqs {
		r := &s.reqs[i]
		require.NotNil(t, r.d, "request %d", i)
		require.Positive(t, r.finish, "request %d never finished", i)
		require.GreaterOrEqual(t, r.finish, r.first)
		require.GreaterOrEqual(t, r.first-r.arrival, r.write+r.read, "request %d: TTFT shorter than its transfers", i)
		switch r.d.Plan.Path {
		case disagg.PathPrefillThenDecode:
			pt++
			require.GreaterOrEqual(t, int(r.prefill), 0)
			if r.write+r.read == 0 {
				// A twin of a request whose prefill was still running when it was routed: its KV
				// was already in storage and at the decode engine when its own prefill ended.
				twins++
			}
		case disagg.PathFastDecode:
			require.Equal(t, int32(-1), r.prefill)
		default:
			t.Fatalf("request %d took path %v on a fleet without unified engines", i, r.d.Plan.Path)
		}
		require.GreaterOrEqual(t, int(r.decode), pdFleet.Prefill, "request %d decoded on a prefill engine", i)
	}
	require.Positive(t, pt, "no request took the remote prefill")
	t.Logf("%d remote prefills, %d of them twins with nothing to transfer", pt, twins)
	require.Less(t, twins, pt, "some remote prefills transfer their KV")
	require.Equal(t, pt, res.Paths["prefill_then_decode"])
	require.Equal(t, len(w.Requests)-pt, res.Paths["fast_decode"])
	require.Positive(t, res.Paths["fast_decode"], "no request reused a cached prefix")

	// Prefill engines generate one token per prefill and decode nothing; decode engines generate
	// every output token.
	var prefills, decodeOut uint64
	for e := range res.Engines {
		if e < pdFleet.Prefill {
			require.Equal(t, res.EngineRequests[e], res.EngineOutput[e], "prefill engine %d decoded", e)
			prefills += res.EngineRequests[e]
		} else {
			decodeOut += res.EngineOutput[e]
		}
	}
	require.Equal(t, uint64(pt), prefills)
	require.Equal(t, uint64(res.OutputTokens), decodeOut)

	// The router's phases in flight went up and came back to zero.
	require.Positive(t, res.InFlightMax)
	require.Zero(t, res.InFlightEnd)
	require.Positive(t, res.BytesWritten)
	require.Positive(t, res.TTFTP50)
	require.Positive(t, res.Throughput)
}

// TestRunPDConditionalThreshold checks that decode engines compute no more of a prompt than
// conditional disaggregation allows when the index is exact (no event lag, no speculation, every
// prefix fits the caches), and that a lower threshold sends more prompts to the prefill engine.
func TestRunPDConditionalThreshold(t *testing.T) {
	t.Parallel() // a simulation of its own: CPU-bound, it uses the second core
	w := smallShared(t, 2).Limit(120)
	cfg := smallFleet
	cfg.EventLag = 0
	cfg.CapacityTokens = 262_144
	exact := pdFleet
	exact.Speculation = kvroute.SpeculationOff
	s, res := runPDSim(t, w, cfg, exact)
	require.Equal(t, "pd-1:3/spec-off", res.Policy)
	require.Zero(t, res.DecodeOverThreshold)
	for i := range s.reqs {
		r := &s.reqs[i]
		require.False(t, s.overThreshold(r.computed, r.prompt), "request %d: decode engine computed %d of %d tokens", i, r.computed, r.prompt)
		if r.d.Plan.Path == disagg.PathPrefillThenDecode {
			require.LessOrEqual(t, r.computed, DefaultBlockSize, "request %d: the decode engine recomputed a prefilled prompt", i)
		}
	}
	require.LessOrEqual(t, res.DecodeComputedMax, disagg.DefaultMaxUncachedTokens)

	strict := exact
	strict.Disagg = disagg.Config{MaxUncachedTokens: 16, MaxUncachedRatio: 0.001}
	_, res2 := runPDSim(t, w, cfg, strict)
	require.Zero(t, res2.DecodeOverThreshold)
	require.Greater(t, res2.Paths["prefill_then_decode"], res.Paths["prefill_then_decode"])
	require.LessOrEqual(t, res2.DecodeComputedMax, 300)

	// With kvroute's default speculation the same holds but for local hits on entries the router
	// recorded for a decode engine (after a prefill was done, while the transfer runs): a decode
	// engine may then compute part of a prompt it was expected to hold.
	s3, res3 := runPDSim(t, w, cfg, pdFleet)
	for i := range s3.reqs {
		r := &s3.reqs[i]
		if s3.overThreshold(r.computed, r.prompt) {
			require.Equal(t, disagg.PathFastDecode, r.d.Plan.Path, "request %d", i)
			require.Equal(t, disagg.ReasonLocalHit, r.d.Plan.Reason, "request %d", i)
		}
	}
	require.Equal(t, res.Requests, res3.Requests)
}

func TestRunPDDeterministic(t *testing.T) {
	t.Parallel() // a simulation of its own: CPU-bound, it uses the second core
	w := smallShared(t, 3).Limit(100)
	a, err := RunPD(w, smallFleet, pdFleet)
	require.NoError(t, err)
	b, err := RunPD(w, smallFleet, pdFleet)
	require.NoError(t, err)
	a.WallSec, b.WallSec = 0, 0
	require.Equal(t, a, b)
	var ta, tb bytes.Buffer
	require.NoError(t, WritePDTable(&ta, SummarisePD([]PDResult{a})))
	require.NoError(t, WritePDTable(&tb, SummarisePD([]PDResult{b})))
	require.Equal(t, ta.String(), tb.String())

	other := smallFleet
	other.Seed = 4
	c, err := RunPD(w, other, pdFleet)
	require.NoError(t, err)
	require.NotEqual(t, a.TTFTMean, c.TTFTMean)
}

// TestRunPDSameArrivals checks that the P/D fleet and a unified fleet of as many engines are
// offered the same arrival times.
func TestRunPDSameArrivals(t *testing.T) {
	t.Parallel() // a simulation of its own: CPU-bound, it uses the second core
	w := smallShared(t, 1).Limit(100)
	u, err := Run(w, smallFleet, PolicyKVRoute)
	require.NoError(t, err)
	p, err := RunPD(w, smallFleet, pdFleet)
	require.NoError(t, err)
	require.Equal(t, u.TimeScale, p.TimeScale)
	require.Equal(t, u.Engines, p.Engines)
	_, err = RunPD(w, smallFleet, PDConfig{Prefill: 0, Decode: -1})
	require.ErrorIs(t, err, ErrInvalidConfig)
}

// TestRunPDTransferCost checks that a slower storage costs TTFT on the remote-prefill path.
func TestRunPDTransferCost(t *testing.T) {
	t.Parallel() // a simulation of its own: CPU-bound, it uses the second core
	w := smallShared(t, 1).Limit(100)
	fast, err := RunPD(w, smallFleet, pdFleet)
	require.NoError(t, err)
	slow := pdFleet
	slow.BandwidthBytesPerSec = DefaultStorageBandwidth / 20
	s, err := RunPD(w, smallFleet, slow)
	require.NoError(t, err)
	require.InDelta(t, 20*fast.WriteMean, s.WriteMean, 20*fast.WriteMean*0.5+1e-9)
	require.Greater(t, s.TTFTMean, fast.TTFTMean)
}

func TestParsePD(t *testing.T) {
	got, err := ParsePD("2:6, 3:5")
	require.NoError(t, err)
	require.Equal(t, []PDConfig{{Prefill: 2, Decode: 6}, {Prefill: 3, Decode: 5}}, got)
	for _, bad := range []string{"", "2", "2:0", "a:b", "2:6,"} {
		_, err := ParsePD(bad)
		require.ErrorIs(t, err, ErrInvalidConfig, bad)
	}
}

func TestPDReports(t *testing.T) {
	w := smallShared(t, 1).Limit(60)
	u, err := Run(w, smallFleet, PolicyKVRoute)
	require.NoError(t, err)
	p, err := RunPD(w, smallFleet, pdFleet)
	require.NoError(t, err)
	rs := []PDResult{UnifiedPDResult(u), p}
	ss := SummarisePD(rs)
	require.Len(t, ss, 2)
	require.Equal(t, float64(60), ss[0].Paths["unified"])
	var b bytes.Buffer
	require.NoError(t, WritePDTable(&b, ss))
	require.Contains(t, b.String(), "| pd-1:3 |")
	require.Contains(t, b.String(), "| kvroute |")
	b.Reset()
	require.NoError(t, WritePDCSV(&b, rs))
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	require.Len(t, lines, 3)
	require.True(t, strings.HasSuffix(lines[0], "fast_decode,prefill_then_decode,unified,fallback,storage_write_mean_s,storage_read_mean_s,decode_over_threshold"))
	b.Reset()
	require.NoError(t, WritePDJSON(&b, rs, ss))
	require.Contains(t, b.String(), `"prefill_then_decode"`)
}
