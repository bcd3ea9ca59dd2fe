package pinning

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"sync/atomic"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/prefixkey"
)

// DefaultSlack is Config.Slack when it is 0.
const DefaultSlack = 2

// Rule pins the requests it matches to Backends. A request matches when every field set (Tenant,
// Model) equals the request's; a rule must set at least one.
type Rule struct {
	// Tenant matches prefixkey.Request.Tenant, which the gateway sets from its authentication.
	Tenant string
	// Model matches prefixkey.Request.Model.
	Model string
	// Backends are the names the matching requests go to: at least one, no duplicates. They may
	// also be members of Next's fleet, but Next does not see the load this Router puts on them
	// (see the package README).
	Backends []string
}

// Config configures a Router. Next is required; the rest has defaults.
type Config struct {
	// Rules are tried in order; the first that matches a request decides.
	Rules []Rule
	// Next routes the requests no rule matches.
	Next kvroute.Router
	// Slack is how many more in-flight requests than the least loaded backend of its rule a
	// backend may carry and still take a request by its prefix key; 0 means DefaultSlack, a
	// negative value always picks a least-loaded backend.
	Slack int
}

// Router pins the requests its rules match and delegates the rest to Config.Next. It is safe for
// concurrent use; its rules are fixed at New, the health of its backends changes with SetHealthy.
// It starts no goroutine and needs no Close. Make one with New.
type Router struct {
	rules    []rule
	byName   map[string]*backend // the pinned backends, fixed at New
	next     kvroute.Router
	slack    int
	seed     maphash.Seed
	turn     atomic.Uint64 // rotates requests without a prefix key
	inFlight atomic.Int64  // every Decision handed out and not yet Done, delegated ones included
	pinned   atomic.Uint64
	passed   atomic.Uint64
}

type rule struct {
	Rule
	backends []*backend
}

// backend is one pinned backend's state.
type backend struct {
	name     string
	hash     uint64 // maphash of name, for rendezvous hashing
	healthy  atomic.Bool
	inFlight atomic.Int64
}

var _ kvroute.Router = (*Router)(nil)

// New validates cfg and returns its Router. The error wraps kvroute.ErrInvalidConfig when Next is
// nil, a rule sets neither Tenant nor Model, or names no backend, an empty one or one twice.
func New(cfg Config) (*Router, error) {
	if cfg.Next == nil {
		return nil, fmt.Errorf("%w: pinning: Next is nil", kvroute.ErrInvalidConfig)
	}
	r := &Router{next: cfg.Next, slack: cfg.Slack, seed: maphash.MakeSeed(), byName: map[string]*backend{}}
	if r.slack == 0 {
		r.slack = DefaultSlack
	}
	for i, ru := range cfg.Rules {
		if ru.Tenant == "" && ru.Model == "" {
			return nil, fmt.Errorf("%w: pinning: rule %d matches every request (no Tenant, no Model)", kvroute.ErrInvalidConfig, i)
		}
		if len(ru.Backends) == 0 {
			return nil, fmt.Errorf("%w: pinning: rule %d names no backend", kvroute.ErrInvalidConfig, i)
		}
		nr := rule{Rule: ru}
		nr.Backends = append([]string(nil), ru.Backends...)
		seen := map[string]bool{}
		for _, name := range ru.Backends {
			if name == "" || seen[name] {
				return nil, fmt.Errorf("%w: pinning: rule %d: backend %q empty or named twice", kvroute.ErrInvalidConfig, i, name)
			}
			seen[name] = true
			b := r.byName[name]
			if b == nil {
				b = &backend{name: name, hash: maphash.String(r.seed, name)}
				b.healthy.Store(true)
				r.byName[name] = b
			}
			nr.backends = append(nr.backends, b)
		}
		r.rules = append(r.rules, nr)
	}
	return r, nil
}

// Route implements kvroute.Router. A request a rule matches gets one of the rule's healthy
// backends, with Reason kvroute.ReasonCustom, or kvroute.ErrNoBackend when none is healthy; any other request goes to
// Next, whose Decision is wrapped so that the Router counts it in InFlight until Done. It returns
// kvroute.ErrNilRequest for a nil request and ctx.Err() when ctx has ended. Route does no I/O of
// its own; Next may.
func (r *Router) Route(ctx context.Context, req *prefixkey.Request) (*kvroute.Decision, error) {
	if req == nil {
		return nil, kvroute.ErrNilRequest
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	for i := range r.rules {
		if ru := &r.rules[i]; ru.matches(req) {
			return r.routePinned(ru, req)
		}
	}
	inner, err := r.next.Route(ctx, req)
	if err != nil {
		return nil, err
	}
	r.passed.Add(1)
	r.inFlight.Add(1)
	// WrapDecision keeps what the inner Router said and runs our hook, then the inner Done.
	return kvroute.WrapDecision(inner, &kvroute.DecisionHooks{
		Done: func(kvroute.Outcome) { r.inFlight.Add(-1) },
	}), nil
}

func (ru *rule) matches(req *prefixkey.Request) bool {
	return (ru.Tenant == "" || ru.Tenant == req.Tenant) && (ru.Model == "" || ru.Model == req.Model)
}

// routePinned chooses among the rule's healthy backends and takes a slot on it.
func (r *Router) routePinned(ru *rule, req *prefixkey.Request) (*kvroute.Decision, error) {
	key, hasKey := req.PrefixKey(prefixkey.DefaultMaxPrefixLength)
	h := key.Uint64()
	if !hasKey {
		h = r.turn.Add(1) * 0x9e3779b97f4a7c15
	}
	least := int64(-1)
	for _, b := range ru.backends {
		if n := b.inFlight.Load(); b.healthy.Load() && (least < 0 || n < least) {
			least = n
		}
	}
	if least < 0 {
		return nil, fmt.Errorf("pinning: every backend of the rule for tenant %q, model %q is unhealthy: %w",
			ru.Tenant, ru.Model, kvroute.ErrNoBackend)
	}
	// Rendezvous hashing among the backends within the slack of the least loaded: a prefix keeps
	// its replica while that replica keeps up, and moves to the same second choice when it does not.
	var best *backend
	var bestScore uint64
	for _, b := range ru.backends {
		if !b.healthy.Load() || b.inFlight.Load() > least+int64(max(r.slack, 0)) {
			continue
		}
		if s := mix(h ^ b.hash); best == nil || s > bestScore {
			best, bestScore = b, s
		}
	}
	best.inFlight.Add(1)
	r.inFlight.Add(1)
	r.pinned.Add(1)
	d := kvroute.NewDecision(best.name, kvroute.ReasonCustom, &kvroute.DecisionHooks{
		Done: func(kvroute.Outcome) {
			best.inFlight.Add(-1)
			r.inFlight.Add(-1)
		},
	})
	d.PrefixKey, d.HasPrefixKey = key, hasKey
	return d, nil
}

// mix is SplitMix64's finaliser: the rendezvous weight of a (request, backend) pair.
func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// SetHealthy marks a backend healthy or unhealthy, in the Router's rules and in Next when Next has
// a SetHealthy method of this signature (as *kvroute.DefaultRouter has), so that a health.Monitor
// can keep both informed: *Router satisfies health.Target. The error wraps
// kvroute.ErrUnknownBackend when neither knows the backend, and is Next's other errors. Safe for
// concurrent use.
func (r *Router) SetHealthy(name string, healthy bool) error {
	b := r.byName[name]
	if b != nil {
		b.healthy.Store(healthy)
	}
	if n, ok := r.next.(interface{ SetHealthy(string, bool) error }); ok {
		err := n.SetHealthy(name, healthy)
		if err == nil || (b != nil && errors.Is(err, kvroute.ErrUnknownBackend)) {
			return nil
		}
		return err
	}
	if b == nil {
		return fmt.Errorf("pinning: %w: %q", kvroute.ErrUnknownBackend, name)
	}
	return nil
}

// InFlight returns the Decisions the Router handed out whose Done has not run, pinned and
// delegated: a gateway draining before shutdown waits for it to reach 0. Safe for concurrent use.
func (r *Router) InFlight() int { return int(r.inFlight.Load()) }

// Stats counts the Router's decisions since New.
type Stats struct {
	Pinned    uint64 // chosen by a rule
	Delegated uint64 // routed by Next
}

// Stats returns the decision counts. Safe for concurrent use.
func (r *Router) Stats() Stats { return Stats{Pinned: r.pinned.Load(), Delegated: r.passed.Load()} }
