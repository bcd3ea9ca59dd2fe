package pinning_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/health"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/routertest"

	"example.com/thirdparty/pinning"
)

var _ health.Target = (*pinning.Router)(nil)

// newDefault returns a default Router over backends, closed when the test ends.
func newDefault(t *testing.T, backends ...string) *kvroute.DefaultRouter {
	t.Helper()
	var bs []kvroute.Backend
	for _, b := range backends {
		bs = append(bs, kvroute.Backend{Name: b})
	}
	inner, err := kvroute.New(kvroute.Config{Backends: bs})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { inner.Close() })
	return inner
}

// innerInFlight is the default Router's in-flight requests, from its stats.
func innerInFlight(r *kvroute.DefaultRouter) int {
	st, _ := r.Stats(context.Background())
	n := 0
	for _, l := range st.Backends {
		n += l.InFlight
	}
	return n
}

// The suite's requests all name model "m" and no tenant: one run pins them all, one delegates
// them all.
func TestConformance(t *testing.T) {
	t.Run("pinned", func(t *testing.T) {
		routertest.Run(t, func(t *testing.T, backends []string) routertest.Subject {
			pinned := backends
			if len(pinned) == 0 { // no backend: a rule whose only backend is unhealthy
				pinned = []string{"engine-a"}
			}
			r, err := pinning.New(pinning.Config{
				Rules: []pinning.Rule{{Model: "m", Backends: pinned}},
				Next:  newDefault(t),
			})
			if err != nil {
				t.Fatal(err)
			}
			if len(backends) == 0 {
				if err := r.SetHealthy("engine-a", false); err != nil {
					t.Fatal(err)
				}
			}
			return routertest.Subject{Router: r, InFlight: r.InFlight}
		})
	})
	t.Run("delegated", func(t *testing.T) {
		routertest.Run(t, func(t *testing.T, backends []string) routertest.Subject {
			inner := newDefault(t, backends...)
			r, err := pinning.New(pinning.Config{
				Rules: []pinning.Rule{{Model: "other", Backends: []string{"dedicated"}}},
				Next:  inner,
			})
			if err != nil {
				t.Fatal(err)
			}
			// Both counts: the wrapper's, and what the inner Router still holds.
			return routertest.Subject{Router: r, InFlight: func() int {
				if n, m := r.InFlight(), innerInFlight(inner); n != m {
					t.Errorf("the pinning Router counts %d in flight, its Next %d", n, m)
				}
				return r.InFlight()
			}}
		})
	})
}

func chat(t *testing.T, model, system string) *prefixkey.Request {
	t.Helper()
	req, err := prefixkey.ParseOpenAIChat(fmt.Appendf(nil,
		`{"model":%q,"messages":[{"role":"system","content":%q},{"role":"user","content":"hi"}]}`, model, system))
	if err != nil {
		t.Fatal(err)
	}
	return req
}

func TestRouting(t *testing.T) {
	ctx := context.Background()
	inner := newDefault(t, "shared-1", "shared-2")
	r, err := pinning.New(pinning.Config{
		Rules: []pinning.Rule{
			{Tenant: "acme", Backends: []string{"acme-1", "acme-2"}},
			{Model: "big-model", Backends: []string{"big-1"}},
		},
		Next: inner,
	})
	if err != nil {
		t.Fatal(err)
	}
	tenantReq := func(tenant, model, system string) *prefixkey.Request {
		req := chat(t, model, system)
		req.Tenant = tenant
		return req
	}

	t.Run("tenant pinned, sticky by prefix", func(t *testing.T) {
		first, err := r.Route(ctx, tenantReq("acme", "m", "You are acme's assistant."))
		if err != nil {
			t.Fatal(err)
		}
		if first.Backend != "acme-1" && first.Backend != "acme-2" {
			t.Fatalf("acme's request went to %s", first.Backend)
		}
		if !first.HasPrefixKey || first.Reason != kvroute.ReasonCustom {
			t.Errorf("pinned decision: prefix key %v, reason %v", first.HasPrefixKey, first.Reason)
		}
		first.Done(kvroute.Outcome{})
		for range 10 {
			d, err := r.Route(ctx, tenantReq("acme", "m", "You are acme's assistant."))
			if err != nil {
				t.Fatal(err)
			}
			if d.Backend != first.Backend {
				t.Errorf("same prefix went to %s, then %s", first.Backend, d.Backend)
			}
			d.Done(kvroute.Outcome{})
		}
	})

	t.Run("load spills within the rule, never outside it", func(t *testing.T) {
		seen := map[string]int{}
		var held []*kvroute.Decision
		for range 12 {
			d, err := r.Route(ctx, tenantReq("acme", "m", "One long shared system prompt."))
			if err != nil {
				t.Fatal(err)
			}
			seen[d.Backend]++
			held = append(held, d)
		}
		if len(seen) != 2 || seen["acme-1"] == 0 || seen["acme-2"] == 0 {
			t.Errorf("12 held requests of one prefix spread %v; want both of acme's backends", seen)
		}
		if got := r.InFlight(); got != 12 {
			t.Errorf("InFlight = %d, want 12", got)
		}
		for _, d := range held {
			d.Done(kvroute.Outcome{})
		}
		if got := r.InFlight(); got != 0 {
			t.Errorf("InFlight after Done = %d", got)
		}
	})

	t.Run("model pinned", func(t *testing.T) {
		d, err := r.Route(ctx, tenantReq("someone", "big-model", "x"))
		if err != nil || d.Backend != "big-1" {
			t.Fatalf("Route = %v, %v; want big-1", d, err)
		}
		d.Done(kvroute.Outcome{})
	})

	t.Run("the rest delegated, inner slot released by Done", func(t *testing.T) {
		d, err := r.Route(ctx, tenantReq("someone", "m", "Be brief."))
		if err != nil {
			t.Fatal(err)
		}
		if d.Backend != "shared-1" && d.Backend != "shared-2" {
			t.Fatalf("delegated request went to %s", d.Backend)
		}
		if d.Reason != kvroute.ReasonPrefixHash || !d.HasPrefixKey {
			t.Errorf("delegated decision lost the inner one's fields: reason %v, prefix key %v", d.Reason, d.HasPrefixKey)
		}
		if n := innerInFlight(inner); n != 1 {
			t.Errorf("inner Router holds %d, want 1", n)
		}
		d.FirstToken()
		d.Done(kvroute.Outcome{Err: errors.New("upstream 500")})
		d.Done(kvroute.Outcome{})
		if n := innerInFlight(inner); n != 0 {
			t.Errorf("inner Router holds %d after Done, want 0", n)
		}
		st, err := inner.Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range st.Backends {
			if l.Name == d.Backend && l.SuccessRate == 1 {
				t.Errorf("the outcome did not reach the inner Router: %+v", l)
			}
		}
	})

	t.Run("unhealthy backends", func(t *testing.T) {
		if err := r.SetHealthy("acme-1", false); err != nil {
			t.Fatal(err)
		}
		for range 5 {
			d, err := r.Route(ctx, tenantReq("acme", "m", fmt.Sprint("prompt ", t.Name())))
			if err != nil || d.Backend != "acme-2" {
				t.Fatalf("with acme-1 down: %v, %v", d, err)
			}
			d.Done(kvroute.Outcome{})
		}
		if err := r.SetHealthy("acme-2", false); err != nil {
			t.Fatal(err)
		}
		if d, err := r.Route(ctx, tenantReq("acme", "m", "x")); d != nil || !errors.Is(err, kvroute.ErrNoBackend) {
			t.Errorf("every pinned backend down: %v, %v; want kvroute.ErrNoBackend, not the shared fleet", d, err)
		}
		// Forwarded to the inner Router too.
		if err := r.SetHealthy("shared-1", false); err != nil {
			t.Fatal(err)
		}
		for range 5 {
			d, err := r.Route(ctx, tenantReq("", "m", fmt.Sprint("p", t.Name())))
			if err != nil || d.Backend != "shared-2" {
				t.Fatalf("with shared-1 down: %v, %v", d, err)
			}
			d.Done(kvroute.Outcome{})
		}
		if err := r.SetHealthy("nowhere", true); !errors.Is(err, kvroute.ErrUnknownBackend) {
			t.Errorf("SetHealthy(unknown) = %v", err)
		}
	})

	if s := r.Stats(); s.Pinned == 0 || s.Delegated == 0 {
		t.Errorf("Stats = %+v", s)
	}
}

func TestConfig(t *testing.T) {
	next := newDefault(t)
	for _, cfg := range []pinning.Config{
		{},
		{Next: next, Rules: []pinning.Rule{{Backends: []string{"a"}}}},
		{Next: next, Rules: []pinning.Rule{{Model: "m"}}},
		{Next: next, Rules: []pinning.Rule{{Model: "m", Backends: []string{"a", "a"}}}},
		{Next: next, Rules: []pinning.Rule{{Model: "m", Backends: []string{""}}}},
	} {
		if _, err := pinning.New(cfg); !errors.Is(err, kvroute.ErrInvalidConfig) {
			t.Errorf("New(%+v) = %v, want kvroute.ErrInvalidConfig", cfg, err)
		}
	}
}

// Route and SetHealthy at once, under -race.
func TestConcurrentHealth(t *testing.T) {
	r, err := pinning.New(pinning.Config{
		Rules: []pinning.Rule{{Model: "m", Backends: []string{"a", "b"}}},
		Next:  newDefault(t, "c"),
	})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := range 500 {
			_ = r.SetHealthy("a", i%2 == 0)
		}
	})
	for g := range 4 {
		wg.Go(func() {
			for i := range 200 {
				d, err := r.Route(context.Background(), &prefixkey.Request{Model: []string{"m", "x"}[(g+i)%2]})
				if err != nil {
					t.Error(err)
					return
				}
				d.Done(kvroute.Outcome{})
			}
		})
	}
	wg.Wait()
	if n := r.InFlight(); n != 0 {
		t.Errorf("InFlight = %d", n)
	}
}
