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
// (dissect-<workload>-seed<N>.csv) and the dissections (dissect-<workload>.md).
func runDissect(fs *flag.FlagSet, o options, stdout io.Writer) error {
	others, err := replay.ParsePolicies(o.dissect)
	if err != nil {
		return err
	}
	others = slices.DeleteFunc(others, func(p string) bool { return p == replay.PolicyKVRoute || p == replay.OracleInfinite })
	if len(others) == 0 {
		return fmt.Errorf("-dissect %q: name at least one policy other than kvroute and %s", o.dissect, replay.OracleInfinite)
	}
	if strings.Contains(o.workload, ",") || o.sweep != "" {
		return errors.New("-dissect takes one workload and no -sweep: it dissects one point")
	}
	if flagSet(fs, "policies") {
		return errors.New("-dissect names the policies itself: drop -policies")
	}
	seeds, err := parseSeeds(o.seeds)
	if err != nil {
		return err
	}
	policies := append([]string{replay.PolicyKVRoute}, others...)
	cfg := o.config()
	var md strings.Builder
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
		if err := errors.Join(errs...); err != nil {
			return err
		}
		fmt.Fprintf(&md, "### %s, seed %d\n\n", pointOf(results[0]), seed)
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
			f, err := os.Create(filepath.Join(o.out, fmt.Sprintf("dissect-%s-seed%d.csv", results[0].Workload, seed)))
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
	name := strings.TrimSpace(o.workload)
	return os.WriteFile(filepath.Join(o.out, "dissect-"+name+".md"), []byte(md.String()), 0o644)
}

// pointOf describes a result's point in one line.
func pointOf(r replay.Result) string {
	return fmt.Sprintf("%s, %d engines × %d-token KV cache, utilisation %.0f %%", r.Workload, r.Engines, r.CapacityTokens, r.Utilisation*100)
}
