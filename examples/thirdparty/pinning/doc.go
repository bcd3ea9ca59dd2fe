// Package pinning shows a kvroute.Router written outside kvroute, with its exported API alone: it
// pins the requests of configured tenants or models to a subset of the fleet (dedicated replicas,
// a data-residency zone, a canary) and delegates every other request to another Router, normally
// a *kvroute.DefaultRouter.
//
// Within its subset a rule chooses by rendezvous (highest-random-weight) hashing of the request's
// prefix key among the backends whose in-flight requests are within Slack of the least loaded one,
// so that requests sharing a prefix stay on one replica while it keeps up; requests without a
// prefix key rotate. A rule whose backends are all unhealthy refuses its requests with
// kvroute.ErrNoBackend rather than spilling them onto the shared fleet.
//
// What it shows of the plug point: a Router returns a *kvroute.Decision; one of its own is made
// with kvroute.WrapDecision (delegated) and NewDecision (pinned), whose Done runs once (releasing the Router's own
// slot) and whose FirstToken runs until Done. A delegated request's Decision is wrapped the same
// way, its hooks calling the inner Decision's Done and FirstToken, so that the inner Router
// releases what it holds. The package passes kvroute's conformance suite, package routertest.
//
//	inner, _ := kvroute.New(kvroute.Config{Backends: shared})
//	r, err := pinning.New(pinning.Config{
//		Rules: []pinning.Rule{{Tenant: "acme", Backends: []string{"gpu-acme-1", "gpu-acme-2"}}},
//		Next:  inner,
//	})
//	if err != nil {
//		return err
//	}
//	d, err := r.Route(ctx, req) // req.Tenant == "acme": one of acme's replicas
//	…
//	d.Done(kvroute.Outcome{Err: upstreamErr})
package pinning
