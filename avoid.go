package kvroute

import "context"

// avoidKey is the context key of WithAvoid's list.
type avoidKey struct{}

// WithAvoid returns a copy of ctx asking the Router to choose any backend but the named ones for
// the Route calls made with it: a gateway's retry after those backends failed the request, which
// must not land on them again however much of the request's KV cache they hold or however the
// ring places its prefix key. Names add to those ctx already avoids, so a second retry writes
// WithAvoid(ctx, secondFailure) and avoids both:
//
//	d, err := router.Route(kvroute.WithAvoid(ctx, failed.Backend), req)
//
// DefaultRouter.Route passes over the avoided backends in every tier as it passes over unhealthy
// ones — tier 4's candidates (so the scorer, the imbalance guard and the least-work rule see only
// the others, and speculation records the backend chosen instead), the CHWBL walk
// (chwbl.Ring.AcquireAvoiding), every selection strategy — and returns ErrNoBackend when every
// healthy backend is avoided. DisaggRouter.Route, PrefillFailed and DecodeFailed treat them as
// unhealthy candidates in every pool. Names that are not backends are ignored. Probe ignores
// avoidance: it answers for a first try. A Router of your own reads the list with Avoided; one
// that ignores it stays correct, and a caller that must not land on a backend checks the
// decision's Backend (kvhttp.RouteAvoiding does). With no names it returns ctx.
func WithAvoid(ctx context.Context, names ...string) context.Context {
	if len(names) == 0 {
		return ctx
	}
	prev := Avoided(ctx)
	all := make([]string, 0, len(prev)+len(names))
	all = append(append(all, prev...), names...)
	return context.WithValue(ctx, avoidKey{}, all)
}

// Avoided returns the backends ctx asks the Router to avoid (WithAvoid), nil for none. The
// slice is shared: do not modify it. A context without WithAvoid costs one ctx.Value lookup and
// no allocation.
func Avoided(ctx context.Context) []string {
	names, _ := ctx.Value(avoidKey{}).([]string)
	return names
}
