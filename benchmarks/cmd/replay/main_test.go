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

func TestSweepPointsOnce(t *testing.T) {
	pts, err := sweepPoints(replay.Config{Engines: 8, CapacityTokens: 262_144, Utilisation: 0.8, EventLag: 20 * time.Millisecond}, "all")
	require.NoError(t, err)
	require.Len(t, pts, 3+3+4+5-3, "the base point appears once")
}

func TestRunRejectsBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-workload", "nope"},
		{"-policies", "kvroute,nope"},
		{"-sweep", "nope"},
		{"-seeds", "x"},
		{"-trace", filepath.Join(t.TempDir(), "missing.jsonl")},
	} {
		require.Error(t, run(args, &bytes.Buffer{}), "%v", args)
	}
}
