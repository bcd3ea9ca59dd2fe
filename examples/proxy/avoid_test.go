package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/enginesim"
	"github.com/kvroute/kvroute/prefixkey"
)

// The engine holding a prompt's KV cache is killed while tier 4 sends the prompt there: every
// request for it still succeeds, on another engine, and so it does after the engine's restart,
// while its circuit breaker is half-open with its trial taken, and another engine dies too. Before kvroute.WithAvoid the retry
// asked the Router again and again, held the decisions it kept placing on the KV holder, and
// answered 502 "no other healthy backend" with two engines healthy (the soak's pre-first-byte
// failures); a breaker's refusal cost the request its one retry.
func TestKVHolderKilledRequestsGoElsewhere(t *testing.T) {
	f := startFleet(t, 3, true)
	p := startProxy(t, fleetConfig(t, f, func(c *config.Config) {
		// Approximate mode: the Router's decisions are the index's only source, so the engine's
		// death does not clear what the index says it holds (with events the gap is shorter, not gone).
		c.KVCacheIndex.EventSources = nil
		c.KVCacheIndex.Tokenizer = config.TokenizerEstimate
		// No probes: the killed engine stays in rotation until its circuit breaker opens.
		c.HealthChecks.Enabled = ptr(false)
		c.CircuitBreaker.FailureThreshold = 3
		c.CircuitBreaker.RecoveryTimeout = config.Duration(300 * time.Millisecond)
	}))
	sys := longSystemPrompt("avoid-holder", 120)
	body := func(i int) string {
		return chatBody(sys, fmt.Sprintf("Question %d.", i), `"temperature":0.5,"max_tokens":2`)
	}
	url := p.URL + "/v1/chat/completions"
	r, b := post(t, url, body(0))
	if r.StatusCode != 200 {
		t.Fatalf("first request: %d %s", r.StatusCode, b)
	}
	holder := r.Header.Get(HeaderBackend)
	expectKVRouted(t, p, body(1), holder, "the prompt's second request")
	var eng *enginesim.Engine
	for _, e := range f.Engines() {
		if e.Name() == holder {
			eng = e
		}
	}

	// Requests in flight on the other engines, as under traffic: tier 4's bound on the holder
	// grows with them, so that decisions held there never overflow it (2n+2 = 8 tries).
	for range 24 {
		d, err := p.router.Route(kvroute.WithAvoid(context.Background(), holder), &prefixkey.Request{Model: testModel})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Done(kvroute.Outcome{NotSent: true}) })
	}

	eng.Kill()
	for i := 2; i < 10; i++ {
		r, b := post(t, url, body(i))
		if r.StatusCode != 200 {
			t.Fatalf("request %d after the kill: %d %s", i, r.StatusCode, b)
		}
		if got := r.Header.Get(HeaderBackend); got == holder {
			t.Fatalf("request %d answered by the killed engine", i)
		}
		if i == 2 && r.Header.Get(HeaderRetriedFrom) != holder {
			t.Fatalf("request 2: %s %q, want %s (tier 4 sends the prompt to its holder first)", HeaderRetriedFrom, r.Header.Get(HeaderRetriedFrom), holder)
		}
	}

	if err := eng.Restart(t.Context()); err != nil {
		t.Fatal(err)
	}
	// Back in rotation (half-open after recovery_timeout), its one trial slot taken by a request
	// that has not ended: the breaker refuses every other request for the holder.
	waitFor(t, 10*time.Second, "the restarted holder in rotation", func() bool { return p.health.InRotation(holder) })
	trial, ok := p.health.Admit(holder)
	if !ok {
		t.Fatal("a half-open circuit refused its first trial")
	}
	for i := 10; i < 16; i++ {
		r, b := post(t, url, body(i))
		if r.StatusCode != 200 {
			t.Fatalf("request %d while the holder's breaker is half-open: %d %s", i, r.StatusCode, b)
		}
		if got := r.Header.Get(HeaderBackend); got == holder {
			t.Fatalf("request %d answered by %s past its breaker", i, got)
		}
	}
	// Another engine dies meanwhile: a request the breaker turned away from the holder and the
	// Router then sent to it is retried on the third (the refusal cost it no attempt).
	var other *enginesim.Engine
	for _, e := range f.Engines() {
		if e.Name() != holder && other == nil {
			other = e
		}
	}
	other.Kill()
	for i := 16; i < 24; i++ {
		r, b := post(t, url, body(i))
		if r.StatusCode != 200 {
			t.Fatalf("request %d with %s dead and the holder's breaker half-open: %d %s", i, other.Name(), r.StatusCode, b)
		}
		if got := r.Header.Get(HeaderBackend); got == holder || got == other.Name() {
			t.Fatalf("request %d answered by %s", i, got)
		}
	}
	// The trial ends well: the circuit closes, and the Router's choice for the prompt (which the
	// breaker turned away above) is the holder again.
	trial.Done(nil)
	r, b = post(t, url, body(24))
	if r.StatusCode != 200 || r.Header.Get(HeaderBackend) != holder {
		t.Fatalf("after the trial: %d from %s, want 200 from %s: %s", r.StatusCode, r.Header.Get(HeaderBackend), holder, b)
	}
}
