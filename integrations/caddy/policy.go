package kvroutecaddy

import (
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

// DefaultFallback is the policy's default fallback: Caddy's least_conn, which sends a request
// without a decision to the upstream with the fewest requests in flight.
const DefaultFallback = "least_conn"

// Policy is the http.reverse_proxy.selection_policies.kvroute module (lb_policy kvroute): it
// selects the upstream the kvroute handler's decision named. A request the handler did not route
// (another path, or no kvroute handler before the proxy) goes to the Fallback policy; so does one
// whose decisions fit no available upstream. On a retry it ends the failed attempt's decision and
// routes again (see "The decision's lifecycle" in the package documentation).
//
// Its zero value is not usable: Caddy provisions it. Select is safe for concurrent use.
type Policy struct {
	// FallbackRaw is the policy for requests without a usable decision; default least_conn.
	FallbackRaw json.RawMessage `json:"fallback,omitempty" caddy:"namespace=http.reverse_proxy.selection_policies inline_key=policy"`

	fallback reverseproxy.Selector
}

// CaddyModule returns the Caddy module information.
func (Policy) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.selection_policies.kvroute",
		New: func() caddy.Module { return new(Policy) },
	}
}

// Provision loads the fallback policy.
func (p *Policy) Provision(ctx caddy.Context) error {
	if p.FallbackRaw == nil {
		p.FallbackRaw = caddyconfig.JSONModuleObject(reverseproxy.LeastConnSelection{}, "policy", DefaultFallback, nil)
	}
	mod, err := ctx.LoadModule(p, "FallbackRaw")
	if err != nil {
		return fmt.Errorf("kvroute: loading the fallback selection policy: %w", err)
	}
	p.fallback = mod.(reverseproxy.Selector)
	return nil
}

// Select returns the upstream for r's current attempt, or nil when none is available.
func (p *Policy) Select(pool reverseproxy.UpstreamPool, r *http.Request, w http.ResponseWriter) *reverseproxy.Upstream {
	st, _ := r.Context().Value(stateKey{}).(*request)
	if st == nil {
		return p.fallback.Select(pool, r, w)
	}
	return st.selectUpstream(pool, r, w, p.fallback)
}

// UnmarshalCaddyfile sets up the policy from
//
//	lb_policy kvroute {
//		fallback <policy> [<options...>]
//	}
func (p *Policy) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the policy's name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		switch d.Val() {
		case "fallback":
			if !d.NextArg() {
				return d.ArgErr()
			}
			if p.FallbackRaw != nil {
				return d.Err("fallback selection policy already specified")
			}
			name := d.Val()
			modID := "http.reverse_proxy.selection_policies." + name
			unm, err := caddyfile.UnmarshalModule(d, modID)
			if err != nil {
				return err
			}
			sel, ok := unm.(reverseproxy.Selector)
			if !ok {
				return d.Errf("module %s (%T) is not a reverseproxy.Selector", modID, unm)
			}
			p.FallbackRaw = caddyconfig.JSONModuleObject(sel, "policy", name, nil)
		default:
			return d.Errf("unrecognized lb_policy kvroute option '%s'", d.Val())
		}
	}
	return nil
}

// Interface guards.
var (
	_ caddy.Provisioner     = (*Policy)(nil)
	_ reverseproxy.Selector = (*Policy)(nil)
	_ caddyfile.Unmarshaler = (*Policy)(nil)
)
