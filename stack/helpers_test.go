package stack_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/enginesim"
)

// parse is config.Parse of yaml (defaults applied, validated), failing the test on error.
func parse(t *testing.T, yaml string) *config.Config {
	t.Helper()
	cfg, err := config.Parse([]byte(yaml), nil)
	if err != nil {
		t.Fatalf("config: %v\n%s", err, yaml)
	}
	return cfg
}

// backendsYAML is the backends section of the engines at urls, named b0, b1, ..., serving model.
func backendsYAML(model string, urls ...string) string {
	var b strings.Builder
	b.WriteString("backends:\n")
	for i, u := range urls {
		fmt.Fprintf(&b, "  - {name: b%d, url: %q, model: %q}\n", i, u, model)
	}
	return b.String()
}

// countingEngine is a simulated vLLM engine behind a loopback HTTP server that counts the
// requests to each path.
type countingEngine struct {
	URL   string
	calls map[string]*atomic.Int64
}

// startEngine starts a simulated engine of model behind a counting server; both stop at the end
// of the test.
func startEngine(t *testing.T, name, model string) *countingEngine {
	t.Helper()
	e, err := enginesim.New(enginesim.Config{Name: name, Model: model, BlockSize: 16, CapacityBlocks: 256})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := e.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	ce := &countingEngine{calls: map[string]*atomic.Int64{"/tokenize": {}, "/health": {}, "/metrics": {}}}
	h := e.Handler()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if c := ce.calls[r.URL.Path]; c != nil {
			c.Add(1)
		}
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	ce.URL = srv.URL
	return ce
}

// waitFor polls cond every 20 ms until it holds, failing the test after timeout.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
