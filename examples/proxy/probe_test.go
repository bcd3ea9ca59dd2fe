package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/admin"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/kvindex"
)

// routingState is what routing changes in the proxy's admin stats and a probe must not.
type routingState struct {
	Decisions   admin.RoutingDecisions
	InFlight    map[string]int
	PerBackend  map[string]uint64
	KVDecisions admin.KVRoutingDecisions
	Lookups     uint64 // the Router's (query_latency_count); the index's own count sees probes too
	Speculative int
	entries     int // not compared: an engine's late events may change it
}

func routingStateOf(t *testing.T, p *testProxy, token string) routingState {
	t.Helper()
	var prs admin.PrefixRoutingStats
	code, b := adminDo(t, "GET", p.URL+"/admin/prefix-routing/stats", token, "")
	if code != 200 || json.Unmarshal(b, &prs) != nil {
		t.Fatalf("prefix-routing/stats: %d %s", code, b)
	}
	var kv admin.KVIndexStats
	code, b = adminDo(t, "GET", p.URL+"/admin/kv-index/stats", token, "")
	if code != 200 || json.Unmarshal(b, &kv) != nil {
		t.Fatalf("kv-index/stats: %d %s", code, b)
	}
	s := routingState{Decisions: prs.RoutingDecisions, InFlight: map[string]int{}, PerBackend: map[string]uint64{},
		KVDecisions: kv.RoutingDecisions, Lookups: kv.Lookups, Speculative: kv.Index.SpeculativeCount, entries: kv.Index.Entries}
	for _, l := range prs.BackendDistribution {
		s.InFlight[l.Backend], s.PerBackend[l.Backend] = l.InFlightRequests, l.Decisions
	}
	return s
}

// probe POSTs body to /admin/route/probe (query q) and decodes the answer.
func probe(t *testing.T, p *testProxy, token, q, body string) (int, kvroute.ProbeResult, []byte) {
	t.Helper()
	code, b := adminDo(t, "POST", p.URL+"/admin/route/probe"+q, token, body)
	var res kvroute.ProbeResult
	if code == 200 {
		if err := json.Unmarshal(b, &res); err != nil {
			t.Fatalf("probe answer %s: %v", b, err)
		}
	}
	return code, res, b
}

// dumpLines GETs /admin/kv-index/dump with query q and returns the status, Content-Type and the
// decoded lines (for a 200).
func dumpLines(t *testing.T, p *testProxy, token, q string) (int, string, []kvindex.DumpEntry, []byte) {
	t.Helper()
	req, _ := http.NewRequest("GET", p.URL+"/admin/kv-index/dump"+q, nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	code := resp.StatusCode
	var out []kvindex.DumpEntry
	if code == 200 {
		sc := bufio.NewScanner(bytes.NewReader(b))
		for sc.Scan() {
			var e kvindex.DumpEntry
			if err := json.Unmarshal(sc.Bytes(), &e); err != nil || strings.Contains(sc.Text(), `"error"`) {
				t.Fatalf("dump line %s: %v", sc.Text(), err)
			}
			out = append(out, e)
		}
	}
	return code, resp.Header.Get("Content-Type"), out, b
}

// Through the proxy, with KV events from a fleet: POST /admin/route/probe names the backend and
// reason the next request gets, in each API's body, and changes nothing; GET /admin/kv-index/dump
// lists the entries the events made, bounded by limit; both refuse bad input with 400 JSON and
// everything without the admin token once one is set.
func TestProbeAndDumpThroughProxy(t *testing.T) {
	f := startFleet(t, 3, true)
	p := startProxy(t, fleetConfig(t, f, nil))
	const token = "" // a loopback operator; the token's check is the auth subtest's
	for _, e := range f.Info() {
		awaitEvents(t, p, e.URL, e.Name, 10*time.Second)
	}

	// Not cacheable (temperature 0.7): every request is routed.
	body := chatBody(longSystemPrompt("probe", 120), "What is the refund policy?", `"temperature":0.7,"max_tokens":4`)
	r, b := post(t, p.URL+"/v1/chat/completions", body)
	if r.StatusCode != 200 {
		t.Fatalf("%d %s", r.StatusCode, b)
	}
	holder := r.Header.Get(HeaderBackend)
	// The engine's events arrive, and the decision's speculation is confirmed or lapses.
	waitFor(t, 10*time.Second, "the prompt indexed, no speculation left", func() bool {
		s := routingStateOf(t, p, token)
		return s.entries > 0 && s.Speculative == 0
	})

	t.Run("probe", func(t *testing.T) {
		before := routingStateOf(t, p, token)
		code, res, raw := probe(t, p, token, "", body)
		if code != 200 {
			t.Fatalf("probe: %d %s", code, raw)
		}
		if after := routingStateOf(t, p, token); !equalJSON(before, after) {
			t.Fatalf("the probe changed the routing state:\nbefore %+v\nafter  %+v", before, after)
		}
		if res.Backend != holder || res.Reason != kvroute.ReasonKVAware || res.RoutingTier != 4 || res.KV == nil || !res.KV.ThresholdMet {
			t.Fatalf("probe %s, want kv_aware to %s", raw, holder)
		}
		if len(res.Backends) != 3 || res.ExpectedCachedTokens <= 0 || res.PrefixKey == "" {
			t.Errorf("probe %s", raw)
		}
		for _, be := range res.Backends {
			if be.Backend == holder && (be.CachedBlocks == 0 || be.CacheTier != "gpu" || be.Score == nil) {
				t.Errorf("the holder as probed: %+v", be)
			}
		}
		// The request itself goes where the probe said.
		r, b := post(t, p.URL+"/v1/chat/completions", body)
		if r.StatusCode != 200 || r.Header.Get(HeaderBackend) != res.Backend || r.Header.Get(HeaderRoute) != res.Reason.String() ||
			r.Header.Get(HeaderCachedTokens) != strconv.Itoa(res.ExpectedCachedTokens) {
			t.Fatalf("routed %d %s %s %s, probed %s %s %d: %s", r.StatusCode, r.Header.Get(HeaderBackend), r.Header.Get(HeaderRoute),
				r.Header.Get(HeaderCachedTokens), res.Backend, res.Reason, res.ExpectedCachedTokens, b)
		}
	})

	t.Run("probe-apis", func(t *testing.T) {
		messages := `{"model":"` + testModel + `","max_tokens":8,"system":"You are terse.","messages":[{"role":"user","content":"hi"}]}`
		completions := `{"model":"` + testModel + `","prompt":"Once upon a time","max_tokens":4}`
		for _, tc := range []struct{ q, body string }{
			{"?api=messages", messages}, {"", messages}, {"?api=completions", completions}, {"", completions}, {"?api=chat", body},
		} {
			code, res, raw := probe(t, p, token, tc.q, tc.body)
			if code != 200 || res.Backend == "" || res.Reason == 0 || res.Why == "" {
				t.Errorf("probe%s: %d %s", tc.q, code, raw)
			}
		}
		for _, tc := range []struct{ q, body string }{
			{"?api=embeddings", body}, {"", "not json"}, {"?api=completions", body}, {"?api=chat", `{"model":"m","messages":"x"}`},
		} {
			code, _, raw := probe(t, p, token, tc.q, tc.body)
			var e struct{ Error string }
			if code != 400 || json.Unmarshal(raw, &e) != nil || e.Error == "" {
				t.Errorf("probe%s %.40q: %d %s, want a 400 JSON error", tc.q, tc.body, code, raw)
			}
		}
		big := chatBody(strings.Repeat("x", int(p.cfg.Server.MaxBodyBytes)), "hi", "")
		if code, _, raw := probe(t, p, token, "", big); code != http.StatusRequestEntityTooLarge {
			t.Errorf("a body over server.max_body_bytes: %d %.200s", code, raw)
		}
	})

	t.Run("dump", func(t *testing.T) {
		code, ct, entries, raw := dumpLines(t, p, token, "?backend="+holder)
		if code != 200 || ct != "application/x-ndjson" || len(entries) < 4 {
			t.Fatalf("dump of %s: %d %s, %d entries: %.500s", holder, code, ct, len(entries), raw)
		}
		for _, e := range entries {
			if e.Backend != holder || e.Key == 0 || len(e.Tiers) == 0 || e.Expires.IsZero() {
				t.Errorf("entry %+v", e)
			}
		}
		if _, _, two, _ := dumpLines(t, p, token, "?backend="+holder+"&limit=2"); len(two) != 2 {
			t.Errorf("limit=2: %d entries", len(two))
		}
		// An unknown backend is no empty dump: 404 with the OpenAI error body.
		if code, ct, _, raw := dumpLines(t, p, token, "?backend=nobody"); code != http.StatusNotFound || ct != "application/json" ||
			!strings.Contains(string(raw), `"code":"backend_not_found"`) || !strings.Contains(string(raw), `"param":"backend"`) {
			t.Errorf("unknown backend: %d %s %s, want 404 backend_not_found", code, ct, raw)
		}
		for _, q := range []string{"", "?limit=5", "?backend=" + holder + "&limit=0", "?backend=" + holder + "&limit=-3",
			"?backend=" + holder + "&limit=ten", "?backend=" + holder + "&limit=100001"} {
			code, ct, _, raw := dumpLines(t, p, token, q)
			var e struct{ Error string }
			if code != 400 || ct != "application/json" || json.Unmarshal(raw, &e) != nil || e.Error == "" {
				t.Errorf("dump%s: %d %s %s, want a 400 JSON error", q, code, ct, raw)
			}
		}
	})

	t.Run("auth", func(t *testing.T) {
		const secret = "probe-secret"
		pt := startProxy(t, fleetConfig(t, f, func(c *config.Config) { c.Admin.AuthToken = secret }))
		for _, tok := range []string{"", "wrong", secret} {
			want := http.StatusUnauthorized
			if tok == secret {
				want = http.StatusOK
			}
			if code, b := adminDo(t, "POST", pt.URL+"/admin/route/probe", tok, body); code != want {
				t.Errorf("probe with token %q: %d %s, want %d", tok, code, b, want)
			}
			if code, b := adminDo(t, "GET", pt.URL+"/admin/kv-index/dump?backend="+holder, tok, ""); code != want {
				t.Errorf("dump with token %q: %d %s, want %d", tok, code, b, want)
			}
		}
	})
}

// equalJSON compares two values by their JSON encodings.
func equalJSON(a, b any) bool {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return bytes.Equal(ja, jb)
}
