package main

import (
	"bytes"
	"context"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/internal/testenv"
)

// TestMain lets the test binary be the measurement's children: the measurement re-executes its
// own program (here, this binary) as "engine", "relay", "picker" and "gateway".
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && slices.Contains([]string{engineCommand, relayCommand, pickerCommand, gatewayCommand}, os.Args[1]) {
		main()
		return
	}
	os.Exit(m.Run())
}

// The whole tool in a tiny configuration: the proxy built, every child started (the pickers and
// their gateways too), both loads run on every target, and a table with every row, plausible
// numbers and no failed request. Nothing is asserted on the values themselves: they depend on
// the machine.
func TestOverheadTiny(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the proxy (over a minute from a cold build cache) and runs eight targets")
	}
	testenv.SkipUnlessLong(t, "builds the proxy with a nested go build (over a minute from a cold build cache) and runs eight targets")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	args := []string{"-rounds", "1", "-duration", "200ms", "-warmup", "100ms", "-conns", "4", "-rate", "200"}
	var stdout, stderr bytes.Buffer
	if err := run(ctx, args, &stdout, &stderr); err != nil {
		t.Fatalf("run: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
	}
	out := stdout.String()
	t.Logf("\n%s", out)

	for _, want := range []string{"## Reference proxy overhead", "Command: `", strings.Join(args, " ") + "`",
		"Go: `go version go1.", "GOOS/GOARCH ", "CPU: ", "### 1 connection, closed loop",
		"### 4 connections, open loop at 200 req/s", "### kvroute-epp: differences", "### Targets",
		"(f) envoysim.Forwarder"} {
		if !strings.Contains(out, want) {
			t.Errorf("the output lacks %q", want)
		}
	}

	// Each load's table has the eight targets, in order, with positive, ordered percentiles.
	const targets = 8
	row := regexp.MustCompile(`(?m)^\| \(([a-h])\) [^|]+\|` + strings.Repeat(`([^|]*)\|`, 10) + `$`)
	rows := row.FindAllStringSubmatch(out, -1)
	if len(rows) != 2*targets {
		t.Fatalf("%d target rows, want %d (%d targets × 2 loads)", len(rows), 2*targets, targets)
	}
	num := func(cell string) float64 {
		f, err := strconv.ParseFloat(strings.TrimSpace(cell), 64)
		if err != nil {
			t.Errorf("cell %q: %v", cell, err)
		}
		return f
	}
	for i, r := range rows {
		if want := string(rune('a' + i%targets)); r[1] != want {
			t.Errorf("row %d is (%s), want (%s)", i, r[1], want)
		}
		p50, p90, p99 := num(r[2]), num(r[3]), num(r[4])
		if !(p50 > 0 && p50 <= p90 && p90 <= p99 && p99 < 5e6) {
			t.Errorf("(%s): p50 %v, p90 %v, p99 %v µs: want 0 < p50 ≤ p90 ≤ p99 < 5 s", r[1], p50, p90, p99)
		}
		if ratio := num(r[7]); !(ratio > 0) {
			t.Errorf("(%s): p50 ÷ (b) %v, want > 0", r[1], ratio)
		}
		if rps := num(r[8]); !(rps > 0) {
			t.Errorf("(%s): %v req/s, want > 0", r[1], rps)
		}
		if errs := num(r[11]); errs != 0 {
			t.Errorf("(%s): %v errors", r[1], errs)
		}
		if r[1] == "b" && strings.TrimSpace(r[5]) != "+0.0" {
			t.Errorf("(b) − (b) = %q, want +0.0", r[5])
		}
	}

	// kvroute-epp's differences: four per load, each with a p50 and a p99, and the pickers' CPU
	// for the two over the no-op picker.
	diff := regexp.MustCompile(`(?m)^\| [^|]+ \| \(([fgh])\) − \(([abf])\) \| [^|]+ \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$`)
	diffs := diff.FindAllStringSubmatch(out, -1)
	if len(diffs) != 8 {
		t.Errorf("%d kvroute-epp differences, want 8 (4 × 2 loads)", len(diffs))
	}
	for _, d := range diffs {
		num(d[3])
		num(d[4])
		if d[2] == "f" && strings.TrimSpace(d[5]) == "–" {
			t.Errorf("(%s) − (f): no picker CPU difference", d[1])
		}
	}

	// The four targets, each judged.
	verdicts := regexp.MustCompile(`(?m)^\| [^|]+ \| \([a-e]\) [−÷] \([ab]\) p50 \| [^|]+ \| ≤ [^|]+ \| (pass|\*\*FAIL\*\*) \|$`)
	if n := len(verdicts.FindAllString(out, -1)); n != 4 {
		t.Errorf("%d judged targets, want 4", n)
	}
}

func TestParseFlags(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		ok   bool
	}{
		{"defaults", nil, true},
		{"all set", []string{"-rounds", "5", "-duration", "1s", "-warmup", "0s", "-rate", "500", "-conns", "8", "-tokenizer", "engine"}, true},
		{"no rounds", []string{"-rounds", "0"}, false},
		{"tiny duration", []string{"-duration", "1ms"}, false},
		{"no rate", []string{"-rate", "0"}, false},
		{"NaN rate", []string{"-rate", "NaN"}, false},
		{"no connections", []string{"-conns", "0"}, false},
		{"unknown tokenizer", []string{"-tokenizer", "none"}, false},
		{"stray argument", []string{"extra"}, false},
		{"without kvroute-epp", []string{"-epp=false"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseFlags(tc.args, &bytes.Buffer{})
			if (err == nil) != tc.ok {
				t.Errorf("parseFlags(%q): %v, want ok %v", tc.args, err, tc.ok)
			}
		})
	}
}

func TestPercentile(t *testing.T) {
	s := &sample{}
	for i := 1; i <= 100; i++ {
		s.lat = append(s.lat, time.Duration(i)*time.Microsecond)
	}
	for _, tc := range []struct {
		p    float64
		want time.Duration
	}{{50, 50 * time.Microsecond}, {90, 90 * time.Microsecond}, {99, 99 * time.Microsecond}, {100, 100 * time.Microsecond}, {0.5, time.Microsecond}} {
		if got := s.percentile(tc.p); got != tc.want {
			t.Errorf("p%v = %v, want %v", tc.p, got, tc.want)
		}
	}
	if got := (&sample{}).percentile(50); got != 0 {
		t.Errorf("p50 of nothing = %v, want 0", got)
	}
}

func TestFmtSpread(t *testing.T) {
	for _, tc := range []struct {
		s    spread
		verb string
		want string
	}{
		{spread{12.34, 12.34, 12.34}, "%.1f", "12.3"},
		{spread{12.34, 10, 15.5}, "%.1f", "12.3 (10.0 – 15.5)"},
		{spread{-3, -5, 2}, "%+.1f µs", "-3.0 (-5.0 – +2.0) µs"},
	} {
		if got := fmtSpread(tc.s, tc.verb); got != tc.want {
			t.Errorf("fmtSpread(%v, %q) = %q, want %q", tc.s, tc.verb, got, tc.want)
		}
	}
}

func TestShellQuote(t *testing.T) {
	for in, want := range map[string]string{"-rate": "-rate", "2000": "2000", "a b": "'a b'", "it's": `'it'\''s'`, "": "''"} {
		if got := shellQuote(in); got != want {
			t.Errorf("shellQuote(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestChatBody(t *testing.T) {
	vary := chatBody("m", "x", 16, true)
	if a, b := vary(), vary(); bytes.Equal(a, b) {
		t.Errorf("varying bodies are equal: %s", a)
	}
	fixed := chatBody("m", "x", 16, false)
	if a, b := fixed(), fixed(); !bytes.Equal(a, b) {
		t.Errorf("fixed bodies differ: %s, %s", a, b)
	}
	if n := len(systemPrompt); n < 1024 || n > 1200 {
		t.Errorf("system prompt of %d bytes, want about 1 KiB", n)
	}
}

func TestPprofAddrRE(t *testing.T) {
	for _, tc := range []struct{ log, want string }{
		{`time=2026-11-25T18:04:56.348Z level=INFO msg=pprof addr=127.0.0.1:40123` + "\n", "127.0.0.1:40123"},
		{`{"time":"2026-11-25T18:04:56.348Z","level":"INFO","msg":"pprof","addr":"127.0.0.1:40123"}` + "\n", "127.0.0.1:40123"},
		{`time=2026-11-25T18:04:56.348Z level=INFO msg=serving addr=127.0.0.1:40123` + "\n", ""},
	} {
		got := ""
		if m := pprofAddrRE.FindStringSubmatch(tc.log); m != nil {
			got = m[1]
		}
		if got != tc.want {
			t.Errorf("in %q: %q, want %q", tc.log, got, tc.want)
		}
	}
}

func TestProxyConfig(t *testing.T) {
	e := engineInfo{Name: "enginesim-0", Model: "m/x", URL: "http://127.0.0.1:1", ZMQEndpoint: "tcp://127.0.0.1:2",
		ReplayEndpoint: "tcp://127.0.0.1:3", BlockSize: 16}
	tier1, all := proxyConfig(e, false, "estimate"), proxyConfig(e, true, "estimate")
	for _, want := range []string{"prefix_routing:\n  enabled: true", `url: "http://127.0.0.1:1"`, "health_checks:\n  enabled: false"} {
		if !strings.Contains(tier1, want) || !strings.Contains(all, want) {
			t.Errorf("a configuration lacks %q", want)
		}
	}
	for _, want := range []string{"response_cache:\n  enabled: true\n  backend: memory", "kv_cache_index:\n  enabled: true\n  backend: memory",
		"tokenizer: estimate", `endpoint: "tcp://127.0.0.1:2"`, `replay_endpoint: "tcp://127.0.0.1:3"`} {
		if strings.Contains(tier1, want) || !strings.Contains(all, want) {
			t.Errorf("%q: want it in the all-tiers configuration only", want)
		}
	}
}
