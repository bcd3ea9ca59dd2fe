package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/kvroute/kvroute/benchmarks/replay"
)

// gridWorkloads are -sweep grid's workloads when -workload is not given: issue 21's four.
const gridWorkloads = "trace,trace-common,multi-turn,shared-prefix"

// gridCommonPrefix is trace-common's -common-prefix-tokens when the flag is not given.
const gridCommonPrefix = 512

// gridStem is the file stem of -sweep grid's outputs.
const gridStem = "sweep-grid"

// runGrid runs -sweep grid: every point of -grid-engines × -grid-capacity × -grid-utilisation ×
// -workload, each seed, each policy; it prints one table judging kvroute's default at every point
// and writes sweep-grid.txt, .csv (one row per run), -points.csv (one row per point) and .json
// into -out.
func runGrid(fs *flag.FlagSet, o options, stdout io.Writer) error {
	if !flagSet(fs, "workload") {
		o.workload = gridWorkloads
	}
	if !flagSet(fs, "policies") {
		var ps []string
		for _, p := range replay.AllPolicies {
			if p != replay.OracleInfinite {
				ps = append(ps, p)
			}
		}
		o.policies = strings.Join(ps, ",")
	}
	common := o.common
	if !flagSet(fs, "common-prefix-tokens") {
		common = gridCommonPrefix
	}
	policies, err := replay.ParsePolicies(o.policies)
	if err != nil {
		return err
	}
	seeds, err := parseSeeds(o.seeds)
	if err != nil {
		return err
	}
	g := replay.Grid{Seeds: seeds, Policies: policies, Parallel: o.parallel, Base: o.config()}
	if g.Parallel <= 0 {
		g.Parallel = o.workers
	}
	if g.Engines, err = parseInts("-grid-engines", o.gridEngines); err != nil {
		return err
	}
	if g.CapacityTokens, err = parseInts("-grid-capacity", o.gridCapacity); err != nil {
		return err
	}
	for _, f := range strings.Split(o.gridUtilisation, ",") {
		u, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
		if err != nil || !(u > 0) {
			return fmt.Errorf("-grid-utilisation %q: want positive numbers", o.gridUtilisation)
		}
		g.Utilisations = append(g.Utilisations, u)
	}
	var reqs []string
	for _, kind := range strings.Split(o.workload, ",") {
		kind = strings.TrimSpace(kind)
		ko := o
		ko.common = 0
		switch kind {
		case "trace", "multi-turn", "shared-prefix":
		case "trace-common":
			kind, ko.common = "trace", common
		default:
			return fmt.Errorf("-workload %q: -sweep grid wants %s", kind, gridWorkloads)
		}
		ws := map[uint64]*replay.Workload{}
		for _, seed := range seeds {
			if ws[seed], err = load(ko, kind, seed); err != nil {
				return err
			}
		}
		g.Workloads = append(g.Workloads, ws)
		reqs = append(reqs, strconv.Itoa(len(ws[seeds[0]].Requests)))
	}
	stopProfile, err := startCPUProfile(o.cpuProfile)
	if err != nil {
		return err
	}
	defer stopProfile()
	start := time.Now()
	rs, err := replay.RunGrid(g)
	if err != nil {
		return err
	}
	wall := time.Since(start)
	gps := replay.GridPoints(rs, replay.PolicyKVRoute)
	if err := replay.WriteGridTable(stdout, gps); err != nil {
		return err
	}
	points := len(g.Engines) * len(g.CapacityTokens) * len(g.Utilisations) * len(g.Workloads)
	fmt.Fprintf(stdout, "\n%s requests × %d policies × %d seed(s) × %d point(s) = %d runs in %.1f s wall (%d parallel)\n",
		strings.Join(reqs, " + "), len(policies), len(seeds), points, len(rs), wall.Seconds(), g.Parallel)
	if o.out == "" {
		return nil
	}
	return writeGridOutputs(o.out, rs, gps)
}

// writeGridOutputs writes the grid's table, per-run CSV, per-point CSV and JSON into dir.
func writeGridOutputs(dir string, rs []replay.Result, gps []replay.GridPoint) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	ss := replay.Summarise(rs)
	for _, f := range []struct {
		file string
		fn   func(io.Writer) error
	}{
		{gridStem + ".txt", func(w io.Writer) error { return replay.WriteGridTable(w, gps) }},
		{gridStem + ".csv", func(w io.Writer) error { return replay.WriteCSV(w, rs) }},
		{gridStem + "-points.csv", func(w io.Writer) error { return replay.WriteGridCSV(w, gps) }},
		{gridStem + ".json", func(w io.Writer) error { return replay.WriteGridJSON(w, gps, rs, ss) }},
	} {
		fh, err := os.Create(filepath.Join(dir, f.file))
		if err != nil {
			return err
		}
		if err := f.fn(fh); err != nil {
			return errors.Join(err, fh.Close())
		}
		if err := fh.Close(); err != nil {
			return err
		}
	}
	return nil
}

// parseInts parses a comma-separated list of positive integers given by flag name.
func parseInts(name, s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || v < 1 {
			return nil, fmt.Errorf("%s %q: want positive integers", name, s)
		}
		out = append(out, v)
	}
	return out, nil
}
