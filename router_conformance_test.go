package kvroute_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/routertest"
)

// inFlightOf counts the requests r holds.
func inFlightOf(r *kvroute.DefaultRouter) func() int {
	return func() int {
		st, _ := r.Stats(context.Background())
		n := 0
		for _, l := range st.Backends {
			n += l.InFlight
		}
		return n
	}
}

// backendStats is r's Stats().Backends; Stats must not fail.
func backendStats(t testing.TB, r *kvroute.DefaultRouter) []kvroute.BackendStats {
	t.Helper()
	st, err := r.Stats(context.Background())
	require.NoError(t, err)
	return st.Backends
}

func newDefault(t *testing.T, backends []string, kv bool) *kvroute.DefaultRouter {
	cfg := kvroute.Config{}
	for _, b := range backends {
		cfg.Backends = append(cfg.Backends, kvroute.Backend{Name: b})
	}
	if kv {
		ix, err := kvindex.NewMemory(kvindex.MemoryConfig{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ix.Close() })
		cfg.KV = &kvroute.KVConfig{Index: ix}
	}
	r, err := kvroute.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// The default Router, with and without tier 4, passes the Router suite.
func TestDefaultRouterConformance(t *testing.T) {
	for _, kv := range []bool{false, true} {
		t.Run(map[bool]string{false: "tier1", true: "tier4"}[kv], func(t *testing.T) {
			routertest.Run(t, func(t *testing.T, backends []string) routertest.Subject {
				r := newDefault(t, backends, kv)
				return routertest.Subject{Router: r, InFlight: inFlightOf(r)}
			})
		})
	}
}

// A wrapper built with a func type of its own and NewDecision, as a third party writes one, passes it too.
func TestWrappingRouterConformance(t *testing.T) {
	routertest.Run(t, func(t *testing.T, backends []string) routertest.Subject {
		inner := newDefault(t, backends, false)
		var wrapped atomic.Int64
		rt := routerFunc(func(ctx context.Context, req *prefixkey.Request) (*kvroute.Decision, error) {
			d, err := inner.Route(ctx, req)
			if err != nil {
				return nil, err
			}
			wrapped.Add(1)
			return kvroute.NewDecision(d.Backend, d.Reason, &kvroute.DecisionHooks{
				Done:       func(o kvroute.Outcome) { wrapped.Add(-1); d.Done(o) },
				FirstToken: d.FirstToken,
			}), nil
		})
		return routertest.Subject{Router: rt, InFlight: func() int { return int(wrapped.Load()) }}
	})
}

// routerFunc adapts a function to kvroute.Router, as a caller wrapping the Router writes it.
type routerFunc func(ctx context.Context, req *prefixkey.Request) (*kvroute.Decision, error)

func (f routerFunc) Route(ctx context.Context, req *prefixkey.Request) (*kvroute.Decision, error) {
	return f(ctx, req)
}
