package kvroute

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

// A retry's Route with the KV holder avoided goes elsewhere in every tier, however far the
// holder scores above the others; with every healthy backend avoided it fails with ErrNoBackend.
func TestRouteWithAvoid(t *testing.T) {
	toks := promptTokens(41, 32*16+5)
	kvCfg := func(c *Config, ix *kvindex.MemoryIndex) {
		c.KV = &KVConfig{Index: ix}
	}
	tests := []struct {
		name   string
		cfg    func(c *Config, ix *kvindex.MemoryIndex)
		req    func() *prefixkey.Request
		reason Reason // of the first, unavoided decision
	}{
		{name: "tier 4 kv_aware", cfg: kvCfg, req: kvReq(toks), reason: ReasonKVAware},
		{name: "tier 4 kv_aware, speculation off", cfg: func(c *Config, ix *kvindex.MemoryIndex) {
			c.KV = &KVConfig{Index: ix, Speculation: SpeculationOff}
		}, req: kvReq(toks), reason: ReasonKVAware},
		{name: "tier 4 least_work", cfg: func(c *Config, ix *kvindex.MemoryIndex) {
			c.KV = &KVConfig{Index: ix, Speculation: SpeculationOff}
		}, req: kvReq(promptTokens(42, 32*16)), reason: ReasonLeastWork},
		{name: "tier 1 prefix_hash", req: plainReq("system avoid", "hello"), reason: ReasonPrefixHash},
		{name: "tier 1 prefix_hash, tier 4 handing off", cfg: func(c *Config, ix *kvindex.MemoryIndex) {
			c.KV = &KVConfig{Index: ix, RingFallback: true, Speculation: SpeculationOff}
		}, req: kvReq(promptTokens(43, 32*16)), reason: ReasonPrefixHash},
		{name: "fallback round_robin", req: plainReq("", ""), reason: ReasonFallback},
		{name: "strategy round_robin", cfg: strategy(StrategyRoundRobin), req: plainReq("s", "u"), reason: ReasonStrategy},
		{name: "strategy least_loaded", cfg: strategy(StrategyLeastLoaded), req: plainReq("s", "u"), reason: ReasonStrategy},
		{name: "strategy least_latency", cfg: strategy(StrategyLeastLatency), req: plainReq("s", "u"), reason: ReasonStrategy},
		{name: "strategy random", cfg: strategy(StrategyRandom), req: plainReq("s", "u"), reason: ReasonStrategy},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ix := newMemIndex(t)
			cfg := Config{Backends: backends(3)}
			if tt.cfg != nil {
				tt.cfg(&cfg, ix)
			}
			r := newRouter(t, cfg)
			// vllm-2 holds all of the prompt, the others nothing: tier 4 scores it far above them.
			storeBlocks(t, ix, "vllm-2", toks, 32, events.TierGPU)
			ctx := context.Background()
			for range 20 {
				first, err := r.Route(ctx, tt.req())
				require.NoError(t, err)
				require.Equal(t, tt.reason, first.Reason)
				held := first.Backend
				if tt.reason == ReasonKVAware {
					require.Equal(t, "vllm-2", held)
				}
				first.Done(Outcome{NotSent: true})

				d, err := r.Route(WithAvoid(ctx, held), tt.req())
				require.NoError(t, err)
				assert.NotEqual(t, held, d.Backend, "the avoided backend")
				second := d.Backend
				d.Done(Outcome{NotSent: true})

				d, err = r.Route(WithAvoid(WithAvoid(ctx, held), second), tt.req())
				require.NoError(t, err)
				assert.NotContains(t, []string{held, second}, d.Backend, "avoidance adds up")
				d.Done(Outcome{NotSent: true})

				_, err = r.Route(WithAvoid(ctx, "vllm-1", "vllm-2", "vllm-3"), tt.req())
				require.ErrorIs(t, err, ErrNoBackend)
			}
			// The holder is unhealthy and the others avoided: nothing is left.
			require.NoError(t, r.SetHealthy("vllm-2", false))
			_, err := r.Route(WithAvoid(ctx, "vllm-1", "vllm-3", "not-a-backend"), tt.req())
			require.ErrorIs(t, err, ErrNoBackend)
			for _, b := range r.ring.Loads(nil) {
				assert.Zero(t, b.InFlight, b.Name)
			}
		})
	}
}

// With speculation on, the backend chosen instead of the avoided holder is the one speculated
// for: the next request for the prompt (not avoiding anything) may follow it there, but never
// to a backend the retry did not use.
func TestRouteWithAvoidSpeculatesTheChosen(t *testing.T) {
	ix := newMemIndex(t)
	r := newRouter(t, Config{Backends: backends(3), KV: &KVConfig{Index: ix, Speculation: SpeculationOn}})
	toks := promptTokens(44, 32*16)
	storeBlocks(t, ix, "vllm-2", toks, 32, events.TierGPU)
	d, err := r.Route(WithAvoid(context.Background(), "vllm-2"), tokReq("s", toks))
	require.NoError(t, err)
	defer d.Done(Outcome{})
	require.NotEqual(t, "vllm-2", d.Backend)
	for _, o := range d.Overlaps {
		assert.NotEqual(t, "vllm-2", o.Backend, "an avoided backend is no candidate")
	}
}

func TestDisaggRouteWithAvoid(t *testing.T) {
	long := dgTokens(45, 64*16+5)
	ix := dgIndex(t)
	r := dgRouter(t, ix, disagg.Config{}, func(c *Config) { c.KV.Speculation = SpeculationOff })
	dgHold(t, ix, "decode-2", long, 64, events.TierGPU)
	ctx := context.Background()
	d, err := r.Disagg().Route(ctx, dgReq(long))
	require.NoError(t, err)
	require.Equal(t, "decode-2", d.Plan.Decode)
	d.Done(Outcome{NotSent: true})

	d, err = r.Disagg().Route(WithAvoid(ctx, "decode-2"), dgReq(long))
	require.NoError(t, err)
	assert.NotEqual(t, "decode-2", d.Plan.Decode)
	d.Done(Outcome{NotSent: true})

	// Every decode backend avoided: the unified fallback, which Route serves, avoided too.
	all := WithAvoid(ctx, "decode-1", "decode-2", "decode-3")
	d, err = r.Disagg().Route(all, dgReq(long))
	require.NoError(t, err)
	assert.Equal(t, disagg.PathFallback, d.Plan.Path)
	assert.Equal(t, "unified-fallback", d.Plan.Decode)
	d.Done(Outcome{NotSent: true})
	_, err = r.Disagg().Route(WithAvoid(all, "unified-fallback"), dgReq(long))
	require.ErrorIs(t, err, ErrNoBackend)

	// Without Config.Disagg, the unified path is Route's, which avoids as well.
	plain := newRouter(t, Config{Backends: backends(2)})
	d, err = plain.Disagg().Route(WithAvoid(ctx, "vllm-1"), chatReq("s", "u"))
	require.NoError(t, err)
	assert.Equal(t, "vllm-2", d.Plan.Decode)
	d.Done(Outcome{})
}

func TestWithAvoid(t *testing.T) {
	ctx := context.Background()
	assert.Nil(t, Avoided(ctx))
	assert.Equal(t, ctx, WithAvoid(ctx), "no names: ctx itself")
	a := WithAvoid(ctx, "x")
	b := WithAvoid(a, "y", "z")
	assert.Equal(t, []string{"x"}, Avoided(a), "a later WithAvoid leaves its parent alone")
	assert.Equal(t, []string{"x", "y", "z"}, Avoided(b))
}

// Route without avoidance allocates no more than before WithAvoid existed; with it, no more
// than without.
func TestRouteWithAvoidAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts differ under -race")
	}
	r := newRouter(t, Config{Backends: backends(3)})
	req := chatReq("system allocs", "u")
	ctx := context.Background()
	actx := WithAvoid(ctx, "vllm-1")
	route := func(ctx context.Context) func() {
		return func() {
			d, err := r.Route(ctx, req)
			if err != nil {
				t.Fatal(err)
			}
			d.Done(Outcome{})
		}
	}
	plain := testing.AllocsPerRun(200, route(ctx))
	avoiding := testing.AllocsPerRun(200, route(actx))
	assert.Equal(t, plain, avoiding)
	assert.LessOrEqual(t, plain, 1.0)
}

// kvReq, plainReq and strategy build TestRouteWithAvoid's rows.

func kvReq(toks []uint32) func() *prefixkey.Request {
	return func() *prefixkey.Request { return tokReq("system A", toks) }
}

func plainReq(system, user string) func() *prefixkey.Request {
	return func() *prefixkey.Request { return chatReq(system, user) }
}

func strategy(s Strategy) func(c *Config, ix *kvindex.MemoryIndex) {
	return func(c *Config, _ *kvindex.MemoryIndex) { c.DisablePrefixRouting, c.Strategy = true, s }
}
