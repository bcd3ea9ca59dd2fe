package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"github.com/kvroute/kvroute/benchmarks/replay"
)

// runDissect replays one workload at the point the flags give with kvroute and the policies of
// -dissect, recording every request, and prints kvroute's dissection against each of them per
// seed (replay.Dissect). With -out it also writes the records side by side
// (dissect-<workload>-e<engines>-c<cache>-u<utilisation>-seed<N>.csv) and the dissections (the
// same name without the seed, .md).
func runDissect(fs *flag.FlagSet, o options, stdout io.Writer) error {
	others, err := replay.ParsePolicies(o.dissect)
	if err != nil {
		return err
	}
	if slices.Contains(others, replay.OracleInfinite) {
		return fmt.Errorf("-dissect: %s has no engines and no requests to compare", replay.OracleInfinite)
	}
	others = slices.DeleteFunc(others, func(p string) bool { return p == replay.PolicyKVRoute })
	if len(others) == 0 {
		return fmt.Errorf("-dissect %q: name at least one policy other than kvroute", o.dissect)
	}
	switch {
	case strings.Contains(o.workload, ",") || o.sweep != "":
		return errors.New("-dissect takes one workload and no -sweep: it dissects one point")
	case o.pd != "":
		return errors.New("-dissect and -pd are two different runs: give one")
	case flagSet(fs, "policies"):
		return errors.New("-dissect names the policies itself: drop -policies")
	case o.replicas < 1:
		return fmt.Errorf("-replicas %d: want at least 1", o.replicas)
	}
	seeds, err := parseSeeds(o.seeds)
	if err != nil {
		return err
	}
	policies := append([]string{replay.PolicyKVRoute}, others...)
	cfg := o.config()
	stopProfile, err := startCPUProfile(o.cpuProfile)
	if err != nil {
		return err
	}
	defer stopProfile()
	var md strings.Builder
	var mdName string // the workload (with its burst) and the point: runs at other settings do not overwrite it
	for _, seed := range seeds {
		w, err := load(o, strings.TrimSpace(o.workload), seed)
		if err != nil {
			return err
		}
		c := cfg
		c.Seed = seed
		results := make([]replay.Result, len(policies))
		recs := make([][]replay.RequestRecord, len(policies))
		errs := make([]error, len(policies))
		var wg sync.WaitGroup
		sem := make(chan struct{}, max(o.workers, 1))
		for i, p := range policies {
			wg.Go(func() {
				sem <- struct{}{}
				defer func() { <-sem }()
				results[i], recs[i], errs[i] = replay.RunRecords(w, c, p)
			})
		}
		wg.Wait()
		for _, err := range errs { // the same configuration error comes once per policy: say it once
			if err != nil {
				return err
			}
		}
		fmt.Fprintf(&md, "### %s, seed %d\n\n", pointOf(results[0]), seed)
		mdName = fmt.Sprintf("%s-e%d-c%d-u%g", results[0].Workload, results[0].Engines, results[0].CapacityTokens, results[0].Utilisation)
		for i := 1; i < len(policies); i++ {
			d, err := replay.Dissect(policies[0], recs[0], policies[i], recs[i])
			if err != nil {
				return err
			}
			if err := replay.WriteDissection(&md, d); err != nil {
				return err
			}
			md.WriteString("\n")
		}
		if o.out != "" {
			if err := os.MkdirAll(o.out, 0o755); err != nil {
				return err
			}
			f, err := os.Create(filepath.Join(o.out, fmt.Sprintf("dissect-%s-seed%d.csv", mdName, seed)))
			if err != nil {
				return err
			}
			if err := replay.WriteRecordsCSV(f, policies, recs); err != nil {
				f.Close()
				return err
			}
			if err := f.Close(); err != nil {
				return err
			}
		}
	}
	if _, err := io.WriteString(stdout, md.String()); err != nil {
		return err
	}
	if o.out == "" {
		return nil
	}
	return os.WriteFile(filepath.Join(o.out, "dissect-"+mdName+".md"), []byte(md.String()), 0o644)
}

// pointOf describes a result's point in one line.
func pointOf(r replay.Result) string {
	return fmt.Sprintf("%s, %d engines × %d-token KV cache, utilisation %.0f %%", r.Workload, r.Engines, r.CapacityTokens, r.Utilisation*100)
}
