package kvhttp

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

// kvHolderRouter returns a default Router over engine-0..2 with tier 4 on, engine-0 holding the
// whole of the returned request's prompt in its KV cache, so that every Route picks engine-0.
func kvHolderRouter(t *testing.T) (*kvroute.DefaultRouter, *prefixkey.Request) {
	t.Helper()
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: "m"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ix.Close() })
	r, err := kvroute.New(kvroute.Config{
		Backends: []kvroute.Backend{{Name: "engine-0"}, {Name: "engine-1"}, {Name: "engine-2"}},
		KV:       &kvroute.KVConfig{Index: ix, Speculation: kvroute.SpeculationOff},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	toks := make([]uint32, 16*16)
	for i := range toks {
		toks[i] = uint32(i*7 + 3)
	}
	hashes := make([]uint64, 16)
	for i := range hashes {
		hashes[i] = uint64(i + 1)
	}
	if err := ix.Apply(context.Background(), "engine-0", &events.Batch{Model: "m", Events: []events.Event{{
		Kind: events.KindBlockStored, BlockHashes: hashes, TokenIDs: toks, BlockSize: 16, Tier: events.TierGPU}}}); err != nil {
		t.Fatal(err)
	}
	return r, &prefixkey.Request{Model: "m", TokenIDs: toks}
}

// countingRouter counts Route calls.
type countingRouter struct {
	kvroute.Router
	calls atomic.Int64
}

func (c *countingRouter) Route(ctx context.Context, req *prefixkey.Request) (*kvroute.Decision, error) {
	c.calls.Add(1)
	return c.Router.Route(ctx, req)
}

// With tier 4 on, every Route picks the KV holder: the old retry loop held 2n+2 decisions there
// and gave up (a 502 while two engines were healthy). Now one Route call goes elsewhere.
func TestRouteAvoidingKVHolder(t *testing.T) {
	r, req := kvHolderRouter(t)
	ctx := context.Background()
	d, err := r.Route(ctx, req)
	if err != nil || d.Backend != "engine-0" || d.Reason != kvroute.ReasonKVAware {
		t.Fatalf("first route: %v, %v; want engine-0 kv_aware", d, err)
	}
	d.Done(kvroute.Outcome{})
	c := &countingRouter{Router: r}
	d, err = RouteAvoiding(ctx, c, req, "engine-0", 8)
	if err != nil {
		t.Fatalf("RouteAvoiding: %v", err)
	}
	defer d.Done(kvroute.Outcome{})
	if d.Backend == "engine-0" {
		t.Fatal("RouteAvoiding chose the failed backend")
	}
	if n := c.calls.Load(); n != 1 {
		t.Fatalf("%d Route calls; want 1", n)
	}

	// A second retry avoids both failures: the one in ctx and the new one.
	d2, err := RouteAvoiding(kvroute.WithAvoid(ctx, "engine-0"), r, req, d.Backend, 8)
	if err != nil {
		t.Fatalf("second RouteAvoiding: %v", err)
	}
	defer d2.Done(kvroute.Outcome{})
	if d2.Backend == "engine-0" || d2.Backend == d.Backend {
		t.Fatalf("second retry chose %s after engine-0 and %s failed", d2.Backend, d.Backend)
	}
	_, err = RouteAvoiding(kvroute.WithAvoid(ctx, "engine-0", "engine-1"), r, req, "engine-2", 8)
	if !errors.Is(err, kvroute.ErrNoBackend) {
		t.Fatalf("every backend avoided: %v; want ErrNoBackend", err)
	}
}

// ignoringRouter is a third-party Router that ignores avoidance: it cycles through its backends
// in order.
type ignoringRouter struct {
	names []string
	next  atomic.Int64
	open  atomic.Int64
}

func (g *ignoringRouter) Route(ctx context.Context, req *prefixkey.Request) (*kvroute.Decision, error) {
	name := g.names[int(g.next.Add(1)-1)%len(g.names)]
	g.open.Add(1)
	return kvroute.NewDecision(name, kvroute.ReasonCustom, &kvroute.DecisionHooks{Done: func(kvroute.Outcome) { g.open.Add(-1) }}), nil
}

// For a Router that ignores kvroute.WithAvoid, the loop over Route remains, skipping every
// avoided backend and releasing what it held.
func TestRouteAvoidingFallbackForARouterThatIgnoresAvoidance(t *testing.T) {
	g := &ignoringRouter{names: []string{"a", "b", "c"}}
	ctx := kvroute.WithAvoid(context.Background(), "b")
	d, err := RouteAvoiding(ctx, g, &prefixkey.Request{}, "a", 5)
	if err != nil || d.Backend != "c" {
		t.Fatalf("got %v, %v; want c", d, err)
	}
	if n := g.open.Load(); n != 1 {
		t.Fatalf("%d decisions open; want only the one returned", n)
	}
	d.Done(kvroute.Outcome{})
	g.next.Store(0)
	_, err = RouteAvoiding(context.Background(), &ignoringRouter{names: []string{"a"}}, &prefixkey.Request{}, "a", 3)
	if !errors.Is(err, kvroute.ErrNoBackend) {
		t.Fatalf("only the failed backend: %v; want ErrNoBackend", err)
	}
}
