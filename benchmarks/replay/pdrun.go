package replay

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/kvroute/kvroute"
)

// PDComparison is a comparison of P/D fleets against unified fleets of as many engines: for every
// seed, each Baseline policy on Base (Run, Engines = the fleets' total) and each fleet (RunPD on
// Base), all offered the same arrival times. Workloads gives each seed's workload.
type PDComparison struct {
	Workloads map[uint64]*Workload
	Base      Config
	Seeds     []uint64
	Baseline  []string
	Fleets    []PDConfig
	// Workers is the number of runs simulated in parallel (at least 1).
	Workers int
}

// Run runs the comparison and returns the results, baselines first, in seed order. Every fleet
// must have the same total number of engines; Base.Engines is set to it.
func (c PDComparison) Run() ([]PDResult, error) {
	if len(c.Fleets) == 0 || len(c.Seeds) == 0 {
		return nil, fmt.Errorf("%w: a P/D comparison needs a fleet and a seed", ErrInvalidConfig)
	}
	total := 0
	for _, f := range c.Fleets {
		f, err := f.withDefaults()
		if err != nil {
			return nil, err
		}
		if total != 0 && f.Prefill+f.Decode != total {
			return nil, fmt.Errorf("%w: P/D fleets of different sizes (%d and %d engines)", ErrInvalidConfig, total, f.Prefill+f.Decode)
		}
		total = f.Prefill + f.Decode
	}
	base := c.Base
	base.Engines = total
	type job struct {
		w      *Workload
		cfg    Config
		policy string
		fleet  *PDConfig
	}
	var jobs []job
	for _, seed := range c.Seeds {
		cfg := base
		cfg.Seed = seed
		for _, p := range c.Baseline {
			jobs = append(jobs, job{w: c.Workloads[seed], cfg: cfg, policy: p})
		}
	}
	for _, seed := range c.Seeds {
		cfg := base
		cfg.Seed = seed
		for i := range c.Fleets {
			jobs = append(jobs, job{w: c.Workloads[seed], cfg: cfg, fleet: &c.Fleets[i]})
		}
	}
	out := make([]PDResult, len(jobs))
	errs := make([]error, len(jobs))
	next := make(chan int)
	var wg sync.WaitGroup
	for range max(c.Workers, 1) {
		wg.Go(func() {
			for i := range next {
				j := jobs[i]
				if j.fleet != nil {
					out[i], errs[i] = RunPD(j.w, j.cfg, *j.fleet)
					continue
				}
				var r Result
				r, errs[i] = Run(j.w, j.cfg, j.policy)
				out[i] = UnifiedPDResult(r)
			}
		})
	}
	for i := range jobs {
		next <- i
	}
	close(next)
	wg.Wait()
	return out, errors.Join(errs...)
}

// PDStem returns the file stem of a comparison's outputs: the workload's name, "-pd-" and the
// fleets as PxD joined by "-" (e.g. trace-pd-2x6).
func PDStem(workload string, fleets []PDConfig) string {
	tags := make([]string, len(fleets))
	for i, f := range fleets {
		f, _ = f.withDefaults()
		tags[i] = fmt.Sprintf("%dx%d", f.Prefill, f.Decode)
		if f.Speculation == kvroute.SpeculationOff {
			tags[i] += "-specoff"
		}
	}
	return workload + "-pd-" + strings.Join(tags, "-")
}

// WritePDOutputs writes stem.txt (WritePDTable), stem.csv, stem.json and stem.svg (WriteChart of
// the first point) into dir, creating it.
func WritePDOutputs(dir, stem string, rs []PDResult, ss []PDSummary) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	write := func(file string, f func(io.Writer) error) error {
		fh, err := os.Create(filepath.Join(dir, file))
		if err != nil {
			return err
		}
		if err := f(fh); err != nil {
			fh.Close()
			return err
		}
		return fh.Close()
	}
	plain := make([]Summary, 0, len(ss))
	for _, s := range ss {
		if s.Point == ss[0].Point {
			plain = append(plain, s.Summary)
		}
	}
	title := "P/D vs unified: " + ss[0].Point.String()
	for _, f := range []struct {
		ext string
		fn  func(io.Writer) error
	}{
		{".txt", func(w io.Writer) error { return WritePDTable(w, ss) }},
		{".csv", func(w io.Writer) error { return WritePDCSV(w, rs) }},
		{".json", func(w io.Writer) error { return WritePDJSON(w, rs, ss) }},
		{".svg", func(w io.Writer) error { return WriteChart(w, title, plain) }},
	} {
		if err := write(stem+f.ext, f.fn); err != nil {
			return err
		}
	}
	return nil
}
