package kvroutecaddy

import (
	"context"
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/kvroute/kvroute/admin"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/respcache"
)

// AdminAPI is the admin.api.kvroute module: GET /kvroute/stats on Caddy's admin endpoint
// answers the state of every kvroute Router of the running configuration (StatsBody). Caddy
// loads every admin.api module by itself; the admin endpoint's own access rules apply (by
// default it listens on localhost:2019 only).
type AdminAPI struct{}

// CaddyModule returns the Caddy module information.
func (AdminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.kvroute",
		New: func() caddy.Module { return new(AdminAPI) },
	}
}

// Routes returns the admin endpoint's routes.
func (AdminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{Pattern: "/kvroute/stats", Handler: caddy.AdminHandlerFunc(serveStats)}}
}

// StatsBody is the body of GET /kvroute/stats: one RouterStats per Router, by ID.
type StatsBody struct {
	Routers []RouterStats `json:"routers"`
}

// RouterStats is one Router's state, in the bodies of kvroute's admin endpoints.
type RouterStats struct {
	// ID is a digest of the handler configuration that built the Router (the "router" field of
	// its log lines); it stays the same across reloads that keep the configuration.
	ID string `json:"id"`
	// Backends are its backends' names: the upstreams' dial addresses.
	Backends []string `json:"backends"`
	// PrefixRouting is GET /admin/prefix-routing/stats's body: decisions by reason, each
	// backend's load and health.
	PrefixRouting admin.PrefixRoutingStats `json:"prefix_routing"`
	// KVIndex is GET /admin/kv-index/stats's body when tier 4 is on.
	KVIndex *admin.KVIndexStats `json:"kv_index,omitempty"`
	// ResponseCache is the response cache's stats when it is on.
	ResponseCache *respcache.Stats `json:"response_cache,omitempty"`
}

// serveStats answers GET /kvroute/stats.
func serveStats(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Message: "GET only"}
	}
	var entries []*entry
	routers.Range(func(_, v any) bool {
		entries = append(entries, v.(*entry))
		return true
	})
	slices.SortFunc(entries, func(a, b *entry) int { return strings.Compare(a.id, b.id) })
	body := StatsBody{Routers: make([]RouterStats, 0, len(entries))}
	for _, e := range entries {
		body.Routers = append(body.Routers, e.stats(r))
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(body)
}

// stats builds the entry's RouterStats.
func (e *entry) stats(r *http.Request) RouterStats {
	ctx, cancel := context.WithTimeout(r.Context(), statsTimeout)
	defer cancel()
	st, err := e.router.Stats(ctx)
	c := e.cfg
	rs := RouterStats{ID: e.id}
	for _, b := range c.Backends {
		rs.Backends = append(rs.Backends, b.Name)
	}
	rs.PrefixRouting = admin.NewPrefixRoutingStats(st, *c.PrefixRouting.Enabled, admin.PrefixRoutingConfig{
		MaxPrefixLength: c.PrefixRouting.MaxPrefixLength, LoadFactorEpsilon: c.PrefixRouting.LoadFactorEpsilon,
		VirtualNodes: c.PrefixRouting.VirtualNodes, SelectionStrategy: c.SelectionStrategy})
	if e.kvOn {
		kv := c.KVCacheIndex
		var sources []events.SourceStatus
		for _, cons := range e.consumers {
			sources = append(sources, cons.Status()...)
		}
		s := admin.NewKVIndexStats(st, err, admin.KVIndexConfig{
			MinOverlapThreshold: kv.Scoring.MinOverlapThreshold, LoadFactorEpsilon: kv.Scoring.LoadFactorEpsilon,
			Speculation: kv.Speculation, MaxEntries: kv.MaxEntries, EntryTTLSeconds: kv.EntryTTLSeconds,
			EventSourcesCount: len(kv.EventSources), Tokenizer: kv.Tokenizer}, sources)
		rs.KVIndex = &s
	}
	if e.cache != nil {
		s := e.cache.Stats(ctx)
		rs.ResponseCache = &s
	}
	return rs
}

// statsTimeout bounds the KV index's stats call (a Redis index answers over the network).
const statsTimeout = 2 * time.Second

// Interface guards.
var _ caddy.AdminRouter = AdminAPI{}
