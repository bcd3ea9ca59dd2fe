package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/xml"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvroute/kvroute/internal/testenv"
)

// TestMain makes the test binary the NATS server when the soak starts it as one (os.Executable
// is the test binary in TestSoakShort).
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == natsCommand {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		err := natsMain(ctx, os.Args[2:], os.Stdout, os.Stderr)
		stop()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func TestSchedule(t *testing.T) {
	s, err := newSchedule([]string{faultEngine, faultRedis, faultEvents, faultEngine}, 20*time.Second, 100*time.Second, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	want := []slot{
		{fault: faultEngine, at: 20 * time.Second, slotEnd: 40 * time.Second, target: 0},
		{fault: faultRedis, at: 40 * time.Second, slotEnd: 60 * time.Second},
		{fault: faultEvents, at: 60 * time.Second, slotEnd: 80 * time.Second, target: 1},
		{fault: faultEngine, at: 80 * time.Second, slotEnd: 100 * time.Second, target: 2},
	}
	if len(s) != len(want) {
		t.Fatalf("got %d slots, want %d", len(s), len(want))
	}
	for i := range want {
		if s[i] != want[i] {
			t.Errorf("slot %d: got %+v, want %+v", i, s[i], want[i])
		}
	}
	if s, err := newSchedule(nil, 20*time.Second, 30*time.Second, time.Second); err != nil || s != nil {
		t.Errorf("no faults: %v, %v", s, err)
	}
	for _, tt := range []struct {
		name              string
		warmup, duration  time.Duration
		downtime          time.Duration
		faults            []string
		wantErrSubstrings string
	}{
		{"too short for the faults", 20 * time.Second, 40 * time.Second, 5 * time.Second, allFaults, "leaves each"},
		{"no room after the warm-up", 20 * time.Second, 20 * time.Second, time.Second, nil, "more than -warmup"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := newSchedule(tt.faults, tt.warmup, tt.duration, tt.downtime); err == nil || !strings.Contains(err.Error(), tt.wantErrSubstrings) {
				t.Errorf("got %v, want an error with %q", err, tt.wantErrSubstrings)
			}
		})
	}
}

func TestParseFlags(t *testing.T) {
	o, err := parseFlags([]string{"-duration", "60s", "-warmup", "10s", "-downtime", "2s", "-stall-for", "4s"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(o.faults, ",") != strings.Join(allFaults, ",") || o.longestFault() != 4*time.Second {
		t.Errorf("faults %v, longest %v", o.faults, o.longestFault())
	}
	for _, args := range [][]string{
		{"-faults", "engine,flood"},
		{"-engines", "1"},
		{"-duration", "60s", "-warmup", "10s"}, // the 15 s stalls do not fit in 10 s slots
		{"-index", "s3"},
	} {
		if _, err := parseFlags(args, io.Discard); err == nil {
			t.Errorf("%q: no error", args)
		}
	}
	if o, err := parseFlags([]string{"-faults", "", "-duration", "30s"}, io.Discard); err != nil || len(o.faults) != 0 {
		t.Errorf("no faults: %v %v", o.faults, err)
	}
}

func TestParseMetrics(t *testing.T) {
	page := `# HELP go_goroutines Number of goroutines that currently exist.
# TYPE go_goroutines gauge
go_goroutines 87
kvroute_kv_index_routing_decisions_total{decision="fallback",otel_scope_name="github.com/kvroute/kvroute"} 5
kvroute_kv_index_routing_decisions_total{decision="kv_aware",otel_scope_name="github.com/kvroute/kvroute"} 90
kvroute_kv_index_routing_decisions_total{decision="least_work",otel_scope_name="github.com/kvroute/kvroute"} 5
kvroute_prefix_routing_requests_total{strategy="kv_aware"} 90
`
	var ps proxySample
	if err := parseMetrics(strings.NewReader(page), &ps); err != nil {
		t.Fatal(err)
	}
	if ps.goroutines != 87 || ps.kvAware != 90 || ps.kvTotal != 100 {
		t.Errorf("got %+v", ps)
	}
	if err := parseMetrics(strings.NewReader("up 1\n"), &ps); err == nil {
		t.Error("a page without go_goroutines: no error")
	}
}

// synthetic builds a run of 40 s: one engine fault at 10 s (over at 13 s) and one Redis fault at
// 25 s (over at 27 s), a steady second-by-second load, and samples whose values the cases edit.
func synthetic() (options, []slot, []faultRecord, []outcome, []sample) {
	o := options{duration: 40 * time.Second, warmup: 10 * time.Second, downtime: 3 * time.Second, rate: 4, engines: 3, replicas: 1}
	sched := []slot{{fault: faultEngine, at: 10 * time.Second, slotEnd: 25 * time.Second}, {fault: faultRedis, at: 25 * time.Second, slotEnd: 40 * time.Second}}
	recs := []faultRecord{
		{slot: sched[0], label: "engine engine-0 killed", start: 10 * time.Second, end: 13 * time.Second, ready: -1},
		{slot: sched[1], label: "Redis killed", start: 25 * time.Second, end: 27 * time.Second, ready: 28 * time.Second},
	}
	var outs []outcome
	var samples []sample
	kv := 0.0
	for sec := range 40 {
		at := time.Duration(sec) * time.Second
		for k := range 3 {
			outs = append(outs, outcome{kind: kindChat, start: at + 100*time.Millisecond, end: at + time.Duration(200+100*k)*time.Millisecond,
				class: classOK, status: 200, backend: []string{"engine-0", "engine-1", "engine-2"}[(sec+k)%3], determ: -1})
		}
		kv += 10
		samples = append(samples, sample{at: at + 10*time.Millisecond, proxies: []proxySample{{up: true, rss: 50e6, fds: 40, goroutines: 80, kvAware: kv, kvTotal: kv}}})
	}
	return o, sched, recs, outs, samples
}

func TestAnalyze(t *testing.T) {
	t.Run("a clean run passes", func(t *testing.T) {
		o, sched, recs, outs, samples := synthetic()
		a := analyze(o, sched, recs, outs, samples, 1)
		if f := a.failures(); len(f) != 0 {
			t.Fatalf("failures %q", f)
		}
		if a.totals.ok != 120 || a.seconds[5].ok != 3 || a.seconds[5].p50 != 200 || a.seconds[5].p99 != 300 {
			t.Errorf("totals %+v, second 5 %+v", a.totals, a.seconds[5])
		}
		if a.baseKV != 1 || a.baseline[1][0] != 80 {
			t.Errorf("baseline KV %v, goroutines %v", a.baseKV, a.baseline[1])
		}
		e := a.faults[0]
		// the engine's own sign: engine-0 answered from 13 s (it ends at 13.3 s or 13.4 s)
		if e.ready < 13*time.Second || e.ready > 14*time.Second || e.recovered != 0 || e.kvBack != 0 {
			t.Errorf("engine fault %+v", e)
		}
		if r := a.faults[1]; r.recovered != time.Second || !r.resourcesPass {
			t.Errorf("redis fault %+v", r)
		}
	})
	t.Run("failures are split and attributed", func(t *testing.T) {
		o, sched, recs, outs, samples := synthetic()
		outs = append(outs,
			outcome{kind: kindChatStream, start: 9500 * time.Millisecond, end: 10200 * time.Millisecond, class: classFailMid, backend: "engine-0", determ: -1},
			outcome{kind: kindChatStream, start: 30 * time.Second, end: 31 * time.Second, class: classFailMid, backend: "engine-1", determ: -1},
			outcome{kind: kindChat, start: 11 * time.Second, end: 11 * time.Second, class: classFailPre, status: 502, determ: -1})
		a := analyze(o, sched, recs, outs, samples, 1)
		if a.totals.failMidDead != 1 || a.totals.failMid != 1 || a.totals.failPre != 1 {
			t.Errorf("totals %+v", a.totals)
		}
		if a.faults[0].failPre != 1 || a.faults[0].failMidDead != 1 || a.faults[1].failMid != 1 {
			t.Errorf("per fault %+v / %+v", a.faults[0], a.faults[1])
		}
		if a.faults[0].recovered != 0 || len(a.failures()) != 2 {
			t.Errorf("recovered %v, failures %q", a.faults[0].recovered, a.failures())
		}
	})
	t.Run("resources not back", func(t *testing.T) {
		o, sched, recs, outs, samples := synthetic()
		for i := range samples[15:] {
			samples[15+i].proxies[0].goroutines = 89 // +11 % after the engine fault, and on
		}
		a := analyze(o, sched, recs, outs, samples, 1)
		if a.faults[0].resourcesPass || !a.faults[1].resourcesPass || a.pass() {
			t.Errorf("resources %v %v, failures %q", a.faults[0].resourcesPass, a.faults[1].resourcesPass, a.failures())
		}
	})
	t.Run("resources not judged within the idle-connection timeout", func(t *testing.T) {
		o, sched, recs, outs, samples := synthetic()
		for i := range samples[15:] {
			samples[15+i].proxies[0].goroutines = 89
		}
		o.connIdle = time.Hour
		a := analyze(o, sched, recs, outs, samples, 1)
		if a.faults[0].judged || !a.faults[0].resourcesPass || !a.pass() {
			t.Errorf("judged %v, resources %v, failures %q", a.faults[0].judged, a.faults[0].resourcesPass, a.failures())
		}
		var b strings.Builder
		a.markdown(&b)
		if !strings.Contains(b.String(), "resources not judged") {
			t.Errorf("the report does not say the resources were not judged:\n%s", b.String())
		}
	})
	t.Run("KV-aware share late", func(t *testing.T) {
		o, sched, recs, outs, samples := synthetic()
		kv := samples[9].proxies[0].kvAware
		for i := range samples[10:] {
			// every decision goes on counting, none kv_aware until 25 s: 12 s after the fault's end
			if i < 15 {
				samples[10+i].proxies[0].kvAware = kv
			} else {
				samples[10+i].proxies[0].kvAware = kv + float64(i-14)*10
			}
		}
		a := analyze(o, sched, recs, outs, samples, 1)
		if a.faults[0].kvBack >= 0 && a.faults[0].kvBack <= kvShareWithin {
			t.Errorf("kvBack %v", a.faults[0].kvBack)
		}
		if a.pass() {
			t.Error("passed")
		}
	})
}

func TestCacheLosses(t *testing.T) {
	redis := []faultRecord{{slot: slot{fault: faultRedis}, start: 20 * time.Second, end: 25 * time.Second}}
	s := time.Second
	d := func(id int, start, end time.Duration, cache string) outcome {
		return outcome{kind: kindDeterm, determ: id, start: start, end: end, class: classOK, cache: cache}
	}
	for _, tt := range []struct {
		name          string
		outs          []outcome
		lost, checked int
	}{
		{"stored, then hit", []outcome{d(1, 1*s, 2*s, "MISS"), d(1, 5*s, 5*s, "HIT")}, 0, 1},
		{"stored, then missed", []outcome{d(1, 1*s, 2*s, "MISS"), d(1, 5*s, 6*s, "MISS"), d(1, 8*s, 8*s, "HIT")}, 1, 2},
		{"too soon after the store", []outcome{d(1, 1*s, 2*s, "MISS"), d(1, 2500*time.Millisecond, 3*s, "MISS")}, 0, 0},
		{"lost with Redis: what Redis held", []outcome{d(1, 1*s, 2*s, "MISS"), d(1, 30*s, 31*s, "MISS"), d(1, 35*s, 35*s, "HIT")}, 0, 1},
		{"stored while Redis was down is not expected", []outcome{d(1, 21*s, 22*s, "MISS"), d(1, 30*s, 31*s, "MISS")}, 0, 0},
		{"stored after the restart must stay", []outcome{d(1, 30*s, 31*s, "MISS"), d(1, 35*s, 36*s, "MISS")}, 1, 1},
		{"other requests differ", []outcome{d(1, 1*s, 2*s, "MISS"), d(2, 5*s, 6*s, "MISS")}, 0, 0},
		{"asked as Redis was killed is not expected", []outcome{d(1, 1*s, 2*s, "MISS"), d(1, 19990*time.Millisecond, 20050*time.Millisecond, "MISS")}, 0, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			lost, checked, log := cacheLosses(tt.outs, redis)
			if lost != tt.lost || checked != tt.checked || len(log) != lost {
				t.Errorf("lost %d of %d (%q), want %d of %d", lost, checked, log, tt.lost, tt.checked)
			}
		})
	}
}

func TestReportFiles(t *testing.T) {
	o, sched, recs, outs, samples := synthetic()
	a := analyze(o, sched, recs, outs, samples, 1)
	dir := t.TempDir()
	var md strings.Builder
	a.markdown(&md)
	for _, want := range []string{"| 10 s | engine engine-0 killed | 3.0 s | 0 s |", "| 25 s | Redis killed |", "**PASS**"} {
		if !strings.Contains(md.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, md.String())
		}
	}
	if err := a.writeFiles(dir, md.String()); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(filepath.Join(dir, "soak.csv"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	rows, err := csv.NewReader(f).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != len(a.seconds)+1 || rows[0][0] != "second" || rows[12][len(rows[12])-1] != faultEngine || rows[6][1] != "3" {
		t.Errorf("csv: %d rows, header %v, row 12 %v", len(rows), rows[0], rows[12])
	}
	svg, err := os.ReadFile(filepath.Join(dir, "soak.svg"))
	if err != nil {
		t.Fatal(err)
	}
	// Well-formed XML, a shaded rectangle and a label per fault, a line per series.
	dec := xml.NewDecoder(bytes.NewReader(svg))
	counts := map[string]int{}
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("svg: %v", err)
		}
		if se, ok := tok.(xml.StartElement); ok {
			counts[se.Name.Local]++
			for _, at := range se.Attr {
				if at.Name.Local == "fill" && at.Value == "#fdd" {
					counts["fault"]++
				}
			}
		}
	}
	series := 0
	for _, p := range a.panels() {
		series += len(p.series)
	}
	if counts["svg"] != 1 || counts["fault"] != 2 || counts["polyline"] < series {
		t.Errorf("svg elements %v, want 2 faults and at least %d polylines", counts, series)
	}
	if !bytes.Contains(svg, []byte(">redis</text>")) {
		t.Error("svg: no label of the Redis fault")
	}
}

func TestQuantileAndNice(t *testing.T) {
	if q := quantile([]float64{5, 1, 3, 2, 4}, 0.5); q != 3 {
		t.Errorf("median %v", q)
	}
	if q := quantile([]float64{5, 1}, 0); q != 1 {
		t.Errorf("q0 %v", q)
	}
	if !math.IsNaN(quantile(nil, 0.5)) {
		t.Error("quantile of nothing")
	}
	for in, want := range map[float64]float64{0: 1, 0.7: 1, 3: 5, 12: 20, 87: 100, 100: 100} {
		if got := niceCeil(in); got != want {
			t.Errorf("niceCeil(%v) = %v, want %v", in, got, want)
		}
	}
}

// The relay forwards, drops everything when cut, refuses while cut and forwards again when
// restored.
func TestRelay(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() { // echo
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); c.Close() }()
		}
	}()
	r, err := newRelay(ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	echo := func(c net.Conn) error {
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte("ping")); err != nil {
			return err
		}
		b := make([]byte, 4)
		_, err := io.ReadFull(c, b)
		return err
	}
	c, err := net.Dial("tcp", r.addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := echo(c); err != nil {
		t.Fatalf("through the relay: %v", err)
	}
	r.setCut(true)
	if err := echo(c); err == nil {
		t.Fatal("the connection survived the cut")
	}
	c2, err := net.Dial("tcp", r.addr())
	if err == nil {
		if err := echo(c2); err == nil {
			t.Fatal("a new connection went through while cut")
		}
		c2.Close()
	}
	r.setCut(false)
	c3, err := net.Dial("tcp", r.addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c3.Close()
	if err := echo(c3); err != nil {
		t.Fatalf("after the restore: %v", err)
	}
}

// TestSoakShort runs the whole soak briefly: builds, fleet, load, an engine and a Redis fault,
// report and files. It checks that the measurement works, not the proxy's verdict.
func TestSoakShort(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the proxy and runs a fleet")
	}
	testenv.SkipUnlessLong(t, "builds the proxy and enginesim and runs a fleet with faults for about 30 s")
	if runtime.GOOS != "linux" {
		t.Skip("RSS and open files are read from /proc")
	}
	if _, err := exec.LookPath("redis-server"); err != nil {
		testenv.SkipOrFail(t, "redis-server is not on PATH")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dir := t.TempDir()
	args := []string{"-duration", "26s", "-warmup", "10s", "-downtime", "1s", "-faults", "engine,redis", "-rate", "15", "-out", dir}
	o, err := parseFlags(args, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	var out, progress bytes.Buffer
	err = soak(ctx, o, &out, &progress)
	if err != nil && !strings.HasPrefix(err.Error(), "failed: ") {
		t.Fatalf("soak: %v\n%s", err, progress.String())
	}
	t.Logf("verdict: %v\n%s", err, out.String())
	for _, want := range []string{"engine engine-0 killed", "Redis killed", "| requests | ok |"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q", want)
		}
	}
	for _, name := range []string{"soak.md", "soak.csv", "soak.svg"} {
		if fi, err := os.Stat(filepath.Join(dir, name)); err != nil || fi.Size() == 0 {
			t.Errorf("%s: %v", name, err)
		}
	}
	b, err := os.ReadFile(filepath.Join(dir, "soak.csv"))
	if err != nil {
		t.Fatal(err)
	}
	rows, err := csv.NewReader(bytes.NewReader(b)).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	ok, kv, rss := 0, 0, 0
	for _, row := range rows[1:] {
		if row[1] != "0" {
			ok++
		}
		if row[9] != "" {
			kv++
		}
		if row[10] != "" {
			rss++
		}
	}
	if ok < 20 || kv < 15 || rss < 20 {
		t.Errorf("seconds with answers %d, with a KV-aware share %d, with an RSS reading %d of %d", ok, kv, rss, len(rows)-1)
	}
}
