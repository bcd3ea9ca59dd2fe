package main

import (
	"bufio"
	"encoding/json"
	"io"
	"os"
	"regexp"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/internal/testenv"
)

// demoLongSystem is the README's long system prompt for -demo disagg: the shell's
// $(printf 'You are a careful assistant. %.0s' $(seq 150)), about 1,070 tokens.
var demoLongSystem = strings.Repeat("You are a careful assistant. ", 150)

// demoBody is the README's request body of -demo disagg with system as its system prompt.
func demoBody(system string) string {
	return `{"model":"meta-llama/Llama-3.1-8B-Instruct","max_tokens":8,"messages":[{"role":"system","content":"` + system +
		`"},{"role":"user","content":"Hello!"}]}`
}

// go run ./examples/proxy -demo disagg, in-process: a prefill engine, two decode engines and a
// unified one exchanging KV through an in-process S3. A cold long prompt is prefilled on the
// prefill engine then decoded (prefill_then_decode), the same prompt again is decoded where it is
// (fast_decode, local_hit), a short one is decoded without a prefill (fast_decode, short_prompt):
// the headers README.md shows. Before each, POST /admin/route/probe names the plan the request then
// gets, changing nothing. SIGHUP (no file to reload) is logged at INFO and does not stop it;
// SIGTERM does.
func TestDemoDisagg(t *testing.T) {
	if !canSendSIGTERM {
		t.Skip("the test stops the proxy with SIGTERM, which this system cannot send to itself")
	}
	t.Setenv("S3_ENDPOINT", "") // the in-process S3, whatever the environment says
	pr, pw := io.Pipe()
	var stderr testenv.LogBuffer
	errc := make(chan error, 1)
	go func() {
		errc <- mainErr([]string{"-demo", "disagg", "-addr", "127.0.0.1:0", "-engine-speed", "0"}, pw, &stderr)
		pw.Close()
	}()
	base, banner := "", ""
	sc := bufio.NewScanner(pr)
	for sc.Scan() {
		banner += sc.Text() + "\n"
		if m := regexp.MustCompile(`listening on (http://\S+)`).FindStringSubmatch(sc.Text()); m != nil {
			base = m[1]
		}
		if strings.Contains(sc.Text(), "Stop with Ctrl-C") {
			break
		}
	}
	go func() { _, _ = io.Copy(io.Discard, pr) }()
	if base == "" || !strings.Contains(banner, "prefill-0 decode-0 decode-1 unified-0") ||
		!strings.Contains(banner, "/admin/disaggregation/stats") {
		t.Fatalf("banner:\n%s\nstderr:\n%s", banner, stderr.String())
	}

	type headers struct{ path, prefill, decode, backend, route string }
	send := func(body string) headers {
		t.Helper()
		r, b := post(t, base+"/v1/chat/completions", body)
		if r.StatusCode != 200 {
			t.Fatalf("%d %s", r.StatusCode, b)
		}
		h := headers{r.Header.Get(disagg.HeaderRoutingPath), r.Header.Get(disagg.HeaderPrefillBackend),
			r.Header.Get(disagg.HeaderDecodeBackend), r.Header.Get(HeaderBackend), r.Header.Get(HeaderRoute)}
		t.Logf("%s: %s\n%s: %s\n%s: %s\n%s: %s\n%s: %s", disagg.HeaderRoutingPath, h.path, disagg.HeaderPrefillBackend, h.prefill,
			disagg.HeaderDecodeBackend, h.decode, HeaderBackend, h.backend, HeaderRoute, h.route)
		return h
	}
	// probe answers what the request would get, and checks that asking changed nothing.
	probe := func(body string) headers {
		t.Helper()
		var before, after disaggStatsBody
		getJSON(t, base+"/admin/disaggregation/stats", &before)
		code, b := adminDo(t, "POST", base+"/admin/route/probe", "", body)
		getJSON(t, base+"/admin/disaggregation/stats", &after)
		var res struct {
			Path    string `json:"path"`
			Reason  string `json:"reason"`
			Prefill string `json:"prefill_backend"`
			Decode  string `json:"decode_backend"`
			Why     string `json:"why"`
		}
		if code != 200 || json.Unmarshal(b, &res) != nil || res.Why == "" {
			t.Fatalf("probe: %d %s", code, b)
		}
		if !equalJSON(before, after) {
			t.Errorf("the probe changed the disaggregation stats:\nbefore %+v\nafter  %+v", before, after)
		}
		return headers{path: res.Path, prefill: res.Prefill, decode: res.Decode, backend: res.Decode, route: res.Reason}
	}
	probed := probe(demoBody(demoLongSystem))
	long := send(demoBody(demoLongSystem))
	if probed != long {
		t.Errorf("a cold long prompt: probed %+v, routed %+v", probed, long)
	}
	if long.path != "prefill_then_decode" || long.prefill != "prefill-0" || !strings.HasPrefix(long.decode, "decode-") ||
		long.backend != long.decode || long.route != "cache_miss" {
		t.Errorf("long prompt: %+v", long)
	}
	var again headers
	waitFor(t, 10*time.Second, "the decode engine's KV events", func() bool {
		again = send(demoBody(demoLongSystem))
		return again.path == "fast_decode"
	})
	if again.decode != long.decode || again.prefill != "" || again.route != "local_hit" {
		t.Errorf("the long prompt again: %+v, want fast_decode on %s (local_hit)", again, long.decode)
	}
	if probed, again := probe(demoBody(demoLongSystem)), send(demoBody(demoLongSystem)); probed != again || probed.route != "local_hit" {
		t.Errorf("the long prompt a third time: probed %+v, routed %+v", probed, again)
	}
	probed = probe(demoBody("You are a helpful assistant."))
	short := send(demoBody("You are a helpful assistant."))
	if probed != short {
		t.Errorf("a short prompt: probed %+v, routed %+v", probed, short)
	}
	if short.path != "fast_decode" || short.prefill != "" || !strings.HasPrefix(short.decode, "decode-") || short.route != "short_prompt" {
		t.Errorf("short prompt: %+v", short)
	}
	if code := getJSON(t, base+"/admin/disaggregation/stats", nil); code != 200 {
		t.Errorf("/admin/disaggregation/stats: %d", code)
	}

	if runtime.GOOS != "windows" {
		p, _ := os.FindProcess(os.Getpid())
		if err := p.Signal(syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 10*time.Second, "SIGHUP's log line", func() bool {
			return strings.Contains(stderr.String(), `level=INFO msg="SIGHUP ignored in demo mode`)
		})
		if strings.Contains(stderr.String(), "level=ERROR") {
			t.Errorf("an error logged:\n%s", stderr.String())
		}
		send(demoBody("Still there?"))
	}
	if err := sendSIGTERM(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		if err != nil {
			t.Fatalf("mainErr: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("SIGTERM did not stop the proxy")
	}
}
