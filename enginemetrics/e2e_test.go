package enginemetrics_test

import (
	"context"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/enginemetrics"
	"github.com/kvroute/kvroute/internal/enginesim"
)

// A Router fed by a Scraper: a simulated vLLM engine and an SGLang endpoint report their running
// plus waiting requests, which become the backends' external load; when an endpoint fails, its
// last report ages out after EngineLoadMaxAge and the backend's external load drops to 0.
func TestRouterExternalLoadEndToEnd(t *testing.T) {
	const maxAge = 400 * time.Millisecond
	router, err := kvroute.New(kvroute.Config{
		Backends:         []kvroute.Backend{{Name: "vllm-a"}, {Name: "sglang-b"}},
		EngineLoadMaxAge: maxAge,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = router.Close() })

	// vllm-a: the simulated engine runs one request at a time; three are held before their
	// prefill, so it reports one running and two waiting.
	engine, err := enginesim.New(enginesim.Config{Model: "sim-model", MaxConcurrent: 1, HashSeed: 1})
	require.NoError(t, err)
	t.Cleanup(func() { _ = engine.Close() })
	a := httptest.NewServer(engine.Handler())
	t.Cleanup(a.Close)
	stallRequests(t, engine, 3)

	// sglang-b: two running, three queued.
	b := &switchable{}
	b.set(sglangBody("sim-model", 2, 3, 0.4), false)
	bSrv := serve(t, b.ServeHTTP)

	s := start(t, enginemetrics.Config{
		Targets:  map[string]string{"vllm-a": a.URL + "/metrics", "sglang-b": bSrv.URL + "/metrics"},
		Interval: 50 * time.Millisecond,
		Model:    "sim-model",
	}, router)

	external := func(backend string) (int, *kvroute.EngineLoad) {
		st, err := router.Stats(context.Background())
		require.NoError(t, err)
		for _, bl := range st.Backends {
			if bl.Name == backend {
				return bl.ExternalLoad, bl.Engine
			}
		}
		t.Fatalf("no backend %q", backend)
		return 0, nil
	}
	require.Eventually(t, func() bool {
		na, _ := external("vllm-a")
		nb, _ := external("sglang-b")
		return na == 3 && nb == 5
	}, waitFor, tick)
	_, la := external("vllm-a")
	require.NotNil(t, la)
	assert.Equal(t, 1, la.Running)
	assert.Equal(t, 2, la.Waiting)
	assert.Positive(t, la.KVCacheUsage)
	assert.Equal(t, enginemetrics.EngineVLLM, statsOf(t, s, "vllm-a").Engine)
	assert.Equal(t, enginemetrics.EngineSGLang, statsOf(t, s, "sglang-b").Engine)

	// sglang-b fails: its report ages out; vllm-a's stays fresh.
	b.set("", true)
	require.Eventually(t, func() bool {
		nb, lb := external("sglang-b")
		return nb == 0 && lb == nil
	}, waitFor, tick)
	na, _ := external("vllm-a")
	assert.Equal(t, 3, na)
	st, err := router.Stats(context.Background())
	require.NoError(t, err)
	assert.Positive(t, st.Peers.EngineStale)
	assert.Positive(t, statsOf(t, s, "sglang-b").ConsecutiveFailures)

	// vllm-a's engine goes down (503) too.
	engine.SetDown(true)
	require.Eventually(t, func() bool {
		na, la := external("vllm-a")
		return na == 0 && la == nil
	}, waitFor, tick)
	assert.Contains(t, statsOf(t, s, "vllm-a").LastError, "503")

	// Both come back.
	engine.SetDown(false)
	b.set(sglangBody("sim-model", 1, 0, 0.1), false)
	require.Eventually(t, func() bool {
		na, _ := external("vllm-a")
		nb, _ := external("sglang-b")
		return na == 3 && nb == 1
	}, waitFor, tick)
}
