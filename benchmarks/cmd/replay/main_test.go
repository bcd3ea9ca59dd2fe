package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/benchmarks/replay"
)

func TestRunSweepWritesOutputs(t *testing.T) {
	t.Parallel() // a simulation of its own: CPU-bound, it uses the second core
	dir := t.TempDir()
	var out bytes.Buffer
	err := run([]string{"-workload", "shared-prefix", "-requests", "40", "-engines", "2", "-capacity-tokens", "32768",
		"-policies", "round_robin,kvroute,oracle_infinite", "-sweep", "lag", "-seeds", "1,2", "-out", dir}, &out)
	require.NoError(t, err)
	require.Equal(t, 5, strings.Count(out.String(), "| policy |"), "one table per lag")
	for _, f := range []string{".txt", ".csv", ".json"} {
		_, err := os.Stat(filepath.Join(dir, "shared-prefix-150x5-6000+1200-sweep-lag"+f))
		require.NoError(t, err, f)
	}
	svgs, _ := filepath.Glob(filepath.Join(dir, "*.svg"))
	require.Len(t, svgs, 5)
}

func TestRunReplicaSweep(t *testing.T) {
	t.Parallel() // a simulation of its own: CPU-bound, it uses the second core
	dir := t.TempDir()
	var out bytes.Buffer
	err := run([]string{"-sweep", "replicas", "-sweep-replicas", "1,2", "-workload", "shared-prefix,multi-turn", "-requests", "16",
		"-engines", "2", "-capacity-tokens", "32768", "-out", dir}, &out)
	require.NoError(t, err)
	require.Equal(t, 1, strings.Count(out.String(), "| workload | policy | replicas |"), "one table:\n%s", out.String())
	require.Equal(t, 2*2*4, strings.Count(out.String(), "| kvroute |"), "kvroute by default, 2 workloads × 2 replica counts × 4 syncs")
	require.Contains(t, out.String(), "| multi-turn-2x8 | kvroute | 2 | both 2.00 s / 5 ms |")
	for _, f := range []string{".txt", ".csv", ".json"} {
		_, err := os.Stat(filepath.Join(dir, "shared-prefix-150x5-6000+1200+multi-turn-2x8-sweep-replicas"+f))
		require.NoError(t, err, f)
	}
	svgs, _ := filepath.Glob(filepath.Join(dir, "*.svg"))
	require.Empty(t, svgs)

	out.Reset()
	err = run([]string{"-workload", "shared-prefix", "-requests", "40", "-engines", "2", "-capacity-tokens", "32768",
		"-policies", "kvroute,random", "-replicas", "3", "-sync", "metrics", "-spread", "round_robin"}, &out)
	require.NoError(t, err)
	require.Contains(t, out.String(), "3 router replica(s) (round_robin spread), sync metrics (every 2.00 s)")
	require.Contains(t, out.String(), "| random (no router state: one instance for all replicas) |")
}

func TestSweepPointsOnce(t *testing.T) {
	pts, err := sweepPoints(replay.Config{Engines: 8, CapacityTokens: 262_144, Utilisation: 0.8, EventLag: 20 * time.Millisecond}, "all", "1,2,4,8")
	require.NoError(t, err)
	require.Len(t, pts, 3+3+4+5-3, "the base point appears once")
}

func TestRunRejectsBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-workload", "nope"},
		{"-policies", "kvroute,nope"},
		{"-sweep", "nope"},
		{"-seeds", "x"},
		{"-workload", "shared-prefix", "-requests", "8", "-sync", "gossip"},
		{"-workload", "shared-prefix", "-requests", "8", "-spread", "hash"},
		{"-workload", "shared-prefix", "-requests", "8", "-replicas", "0"},
		{"-workload", "shared-prefix", "-requests", "8", "-sweep", "replicas", "-sweep-replicas", "1,x"},
		{"-workload", "shared-prefix", "-requests", "8", "-pd", "1:1", "-replicas", "2"},
		{"-workload", "shared-prefix,nope", "-requests", "8"},
		{"-trace", filepath.Join(t.TempDir(), "missing.jsonl")},
	} {
		require.Error(t, run(args, &bytes.Buffer{}), "%v", args)
	}
}

func TestRunGridSweep(t *testing.T) {
	t.Parallel() // a simulation of its own: CPU-bound, it uses the second core
	dir := t.TempDir()
	var out bytes.Buffer
	err := run([]string{"-sweep", "grid", "-workload", "shared-prefix", "-requests", "40", "-grid-engines", "2",
		"-grid-capacity", "32768", "-grid-utilisation", "0.8", "-policies", "precise,kvroute", "-limit", "30", "-seeds", "1,2",
		"-parallel", "2", "-out", dir}, &out)
	require.NoError(t, err)
	s := out.String()
	require.Equal(t, 1, strings.Count(s, "| workload | engines |"), "one table:\n%s", s)
	require.Contains(t, s, "| shared-prefix-150x5-6000+1200 | 2 | 32768 | 80 % | precise ")
	require.Contains(t, s, "kvroute at 1 point(s), 2 seed(s): hit W/T/L ")
	require.Contains(t, s, "30 requests × 2 policies × 2 seed(s) × 1 point(s) = 4 runs in ")
	for _, f := range []string{".txt", ".csv", "-points.csv", ".json"} {
		_, err := os.Stat(filepath.Join(dir, "sweep-grid"+f))
		require.NoError(t, err, f)
	}
	txt, err := os.ReadFile(filepath.Join(dir, "sweep-grid.txt"))
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(s, string(txt)), "the file holds the printed table")

	// trace-common is the trace with -common-prefix-tokens (512 unless given).
	out.Reset()
	err = run([]string{"-sweep", "grid", "-workload", "trace-common", "-trace", writeTinyTrace(t), "-grid-engines", "2",
		"-grid-capacity", "32768", "-grid-utilisation", "0.8", "-policies", "kvroute,oracle_global_lru"}, &out)
	require.NoError(t, err)
	require.Contains(t, out.String(), "| tiny+common512 | 2 | 32768 | 80 % | — |")
}

// writeTinyTrace writes a three-request Mooncake trace and returns its path.
func writeTinyTrace(t *testing.T) string {
	p := filepath.Join(t.TempDir(), "tiny.jsonl")
	require.NoError(t, os.WriteFile(p, []byte(`{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]}
{"timestamp": 50, "input_length": 1024, "output_length": 8, "hash_ids": [1, 3]}
{"timestamp": 90, "input_length": 600, "output_length": 8, "hash_ids": [1, 2]}
`), 0o644))
	return p
}

func TestRunGridRejectsBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-workload", "trace,nope"},
		{"-grid-engines", "8,x"},
		{"-grid-capacity", "0"},
		{"-grid-utilisation", "-1"},
		{"-workload", "shared-prefix", "-policies", "nope"},
	} {
		require.Error(t, run(append([]string{"-sweep", "grid", "-requests", "8"}, args...), &bytes.Buffer{}), "%v", args)
	}
}

func TestRunDissect(t *testing.T) {
	t.Parallel() // a simulation of its own: CPU-bound, it uses the second core
	dir := t.TempDir()
	var out bytes.Buffer
	err := run([]string{"-dissect", "precise,cost", "-workload", "shared-prefix", "-requests", "60", "-engines", "2",
		"-capacity-tokens", "32768", "-seeds", "1,2", "-burst-period", "2s", "-burst-duty", "0.5", "-out", dir}, &out)
	require.NoError(t, err)
	require.Equal(t, 2, strings.Count(out.String(), "**kvroute against precise"), "one per seed:\n%s", out.String())
	require.Equal(t, 2, strings.Count(out.String(), "**kvroute against cost"))
	require.Contains(t, out.String(), "+burst2sx2")
	const stem = "dissect-shared-prefix-150x5-6000+1200+burst2sx2-e2-c32768-u0.8"
	for _, f := range []string{stem + ".md", stem + "-seed1.csv", stem + "-seed2.csv"} {
		_, err := os.Stat(filepath.Join(dir, f))
		require.NoError(t, err, f)
	}
	for _, bad := range [][]string{{"-dissect", "kvroute"}, {"-dissect", "nope"}, {"-dissect", "cost", "-sweep", "lag"},
		{"-dissect", "cost", "-workload", "trace,multi-turn"}, {"-dissect", "cost", "-policies", "precise"},
		{"-dissect", "oracle_infinite,cost"}, {"-dissect", "cost", "-pd", "1:1"}, {"-dissect", "cost", "-replicas", "0"},
		{"-burst-duty", "0.5"}, {"-burst-period", "1s", "-burst-duty", "1.5", "-limit", "10"}} {
		require.Error(t, run(bad, &bytes.Buffer{}), "%q", bad)
	}
}
