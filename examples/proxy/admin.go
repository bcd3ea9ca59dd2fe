package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/admin"
	"github.com/kvroute/kvroute/apierror"
	"github.com/kvroute/kvroute/chwbl"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/stack"
)

// adminTimeout bounds the store and index calls of one admin request.
const adminTimeout = 5 * time.Second

// routes returns the proxy's HTTP routes.
func (s *server) routes() http.Handler {
	s.llm, s.pass = s.newKVHTTP(s.route), s.newKVHTTP(s.passRoute)
	mux := http.NewServeMux()
	for _, path := range []string{"/v1/chat/completions", "/v1/completions", "/v1/messages"} {
		mux.Handle("POST "+path, s.llmHandler(path))
		mux.HandleFunc(path, methodNotAllowed)
	}
	mux.HandleFunc("GET /v1/models", s.models)
	mux.HandleFunc("GET /v1/models/{id...}", s.model) // ids have slashes: meta-llama/Llama-3.1-8B-Instruct
	mux.Handle("/v1/", s.pass)
	mux.HandleFunc("GET /healthz", s.healthz)
	if s.cfg.Admin.ProtectMetrics {
		mux.Handle("GET /metrics", s.admin(s.tel.handler))
	} else {
		mux.Handle("GET /metrics", s.tel.handler)
	}

	mux.Handle("GET /admin/backends", s.admin(http.HandlerFunc(s.backendsHealth)))
	mux.Handle("GET /admin/prefix-routing/stats", s.admin(http.HandlerFunc(s.prefixRoutingStats)))
	mux.Handle("GET /admin/response-cache/stats", s.admin(http.HandlerFunc(s.responseCacheStats)))
	mux.Handle("POST /admin/response-cache/invalidate", s.admin(http.HandlerFunc(s.responseCacheInvalidate)))
	mux.Handle("GET /admin/kv-index/stats", s.admin(http.HandlerFunc(s.kvIndexStats)))
	mux.Handle("GET /admin/kv-index/backends", s.admin(http.HandlerFunc(s.kvIndexBackends)))
	mux.Handle("POST /admin/kv-index/clear", s.admin(http.HandlerFunc(s.kvIndexClear)))
	mux.Handle("GET /admin/kv-index/dump", s.admin(s.knownBackend(admin.DumpHandler(kvindex.DumperFunc(s.dumpKVIndex)))))
	// The probe answers for the routing a request gets (forward): the plan with disaggregation on.
	probe := admin.ProbeHandler(s.router.Probe, s.cfg.Server.MaxBodyBytes)
	if s.disaggregated() {
		probe = admin.ProbeHandler(s.router.Disagg().Probe, s.cfg.Server.MaxBodyBytes)
	}
	mux.Handle("POST /admin/route/probe", s.admin(probe))
	mux.Handle("GET /admin/disaggregation/stats", s.admin(http.HandlerFunc(s.disaggregationStats)))
	mux.Handle("GET /admin/replicas/stats", s.admin(http.HandlerFunc(s.replicasStats)))
	mux.Handle("/admin/", s.admin(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusNotFound, map[string]any{"error": "no such admin endpoint"})
	})))
	return framingGuard(pathGuard(mux))
}

// admin puts h behind the admin access check (package admin): admin.auth_token, or without it a
// loopback operator's request that nothing marks as a web page's.
func (s *server) admin(h http.Handler) http.Handler {
	return admin.Guard(string(s.cfg.Admin.AuthToken), h)
}

// knownBackend answers a request whose backend query parameter names no configured backend with
// 404 backend_not_found (an OpenAI error body), rather than h's answer for a backend nothing is
// known of (the KV index's dump of it is empty); a request without one goes to h.
func (s *server) knownBackend(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if b := r.URL.Query().Get("backend"); b != "" && s.backends[b] == nil {
			apierror.Error{Status: http.StatusNotFound, Code: "backend_not_found", Param: "backend", Message: "no backend is named " + strconv.Quote(b)}.Write(w, prefixkey.FormatOpenAIChat)

			return
		}
		h.ServeHTTP(w, r)
	})
}

// writeJSON answers with v as indented JSON.
func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// healthz reports whether the proxy can serve: 200 with at least one backend in rotation, 503
// otherwise or while draining. It says nothing else: the backends' details are under
// /admin/backends.
func (s *server) healthz(w http.ResponseWriter, _ *http.Request) {
	status, code := "ok", http.StatusOK
	switch {
	case s.draining.Load():
		status, code = "draining", http.StatusServiceUnavailable
	case s.health.HealthyCount() == 0:
		status, code = "no_healthy_backend", http.StatusServiceUnavailable
		w.Header().Set("Retry-After", s.retryAfter())
	}
	writeJSON(w, code, map[string]any{"status": status})
}

// GET /admin/backends: each backend's probes and circuit breaker.
func (s *server) backendsHealth(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"healthy_backends": s.health.HealthyCount(), "backends": s.health.Statuses()})
}

// routerCounters returns the Router's stats without its KV index's, for the endpoints that do not
// show them: a context already done skips the index's call (a remote index's round trip).
func (s *server) routerCounters() kvroute.Stats {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	st, _ := s.router.Stats(ctx)
	return st
}

// GET /admin/replicas/stats: the replica sync, the event log, the engines' scraped load and what
// the Router knows of its peers.
func (s *server) replicasStats(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, s.fleet.Stats())
}

// GET /admin/prefix-routing/stats: tier 1's configuration (the Router's defaults filled in) and
// the Router's decisions and unified backends.
func (s *server) prefixRoutingStats(w http.ResponseWriter, _ *http.Request) {
	st := s.routerCounters()
	pr := s.cfg.PrefixRouting
	strategy, _ := config.ParseStrategy(s.cfg.SelectionStrategy)
	writeJSON(w, http.StatusOK, admin.NewPrefixRoutingStats(st, *pr.Enabled, admin.PrefixRoutingConfig{
		MaxPrefixLength:                cmp.Or(pr.MaxPrefixLength, prefixkey.DefaultMaxPrefixLength),
		LoadFactorEpsilon:              cmp.Or(pr.LoadFactorEpsilon, chwbl.DefaultLoadFactorEpsilon),
		VirtualNodes:                   cmp.Or(pr.VirtualNodes, chwbl.DefaultVirtualNodes),
		AnthropicCacheControlInjection: pr.AnthropicCacheControlInjection,
		SelectionStrategy:              string(cmp.Or(strategy, kvroute.DefaultStrategy)),
	}))
}

// GET /admin/disaggregation/stats: the configuration in force (credentials redacted), requests by
// routing path and reason, each prefill and decode backend's phases in flight and storage.
func (s *server) disaggregationStats(w http.ResponseWriter, _ *http.Request) {
	dc, ok := s.router.Disagg().Config()
	if !s.cfg.DisaggregatedServing.Enabled || !ok {
		writeJSON(w, http.StatusOK, map[string]any{"enabled": false})
		return
	}
	storage := map[string]*disagg.ExternalStorage{}
	for _, b := range s.cfg.Backends {
		if b.ExternalStorage != nil {
			loc := b.ExternalStorage.Location()
			storage[b.Name] = &loc
		}
	}
	writeJSON(w, http.StatusOK, admin.NewDisaggStats(s.routerCounters(), dc, storage))
}

// GET /admin/response-cache/stats.
func (s *server) responseCacheStats(w http.ResponseWriter, r *http.Request) {
	if s.cache == nil {
		writeJSON(w, http.StatusOK, map[string]any{"enabled": false})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	writeJSON(w, http.StatusOK, s.cache.Stats(ctx))
}

// POST /admin/response-cache/invalidate with {"clear_all": true} or {"key": "<64 hex>"}.
func (s *server) responseCacheInvalidate(w http.ResponseWriter, r *http.Request) {
	if s.cache == nil {
		writeJSON(w, http.StatusNotFound, map[string]any{"success": false, "error": "the response cache is disabled"})
		return
	}
	var req respcache.InvalidateRequest
	dec := json.NewDecoder(io.LimitReader(r.Body, 64<<10))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]any{"success": false,
			"error": `body must be {"clear_all": true} or {"key": "<cache key>"}: ` + err.Error()})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	res, err := s.cache.Invalidate(ctx, req)
	if err != nil {
		code := http.StatusInternalServerError
		if errors.Is(err, respcache.ErrEmptyInvalidate) || errors.Is(err, respcache.ErrBadKey) {
			code = http.StatusBadRequest
		}
		writeJSON(w, code, map[string]any{"success": false, "error": err.Error()})
		return
	}
	s.log.Info("response cache invalidated", "action", res.Action, "cleared_entries", res.ClearedEntries)
	writeJSON(w, http.StatusOK, res)
}

// statuses returns the status of every event source of every consumer.
func (s *server) statuses() []events.SourceStatus {
	var out []events.SourceStatus
	for _, c := range s.cons {
		out = append(out, c.Status()...)
	}
	return out
}

// listeners returns the status of every address the event consumers bind (ZMQ bind mode), nil
// when none binds.
func (s *server) listeners() []events.ListenerStatus {
	var out []events.ListenerStatus
	for _, c := range s.cons {
		if lc, ok := c.(interface {
			Listeners() []events.ListenerStatus
		}); ok {
			out = append(out, lc.Listeners()...)
		}
	}
	return out
}

// GET /admin/kv-index/stats: the Router's tier-4 stats, the index's, the configuration and the event
// sources.
func (s *server) kvIndexStats(w http.ResponseWriter, r *http.Request) {
	if s.index == nil {
		writeJSON(w, http.StatusOK, map[string]any{"enabled": false})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	st, err := s.router.Stats(ctx)
	kc := s.cfg.KVCacheIndex
	sc := kc.Scoring
	body := admin.NewKVIndexStats(st, err, admin.KVIndexConfig{
		MinOverlapThreshold: sc.MinOverlapThreshold, LoadFactorEpsilon: sc.LoadFactorEpsilon, Speculation: kc.Speculation,
		MaxEntries: kc.MaxEntries, EntryTTLSeconds: kc.EntryTTLSeconds, EventSourcesCount: len(kc.EventSources),
		Tokenizer: kc.Tokenizer,
		Scoring: admin.Scoring{OverlapWeight: sc.OverlapWeight, LoadWeight: sc.LoadWeight, HealthWeight: sc.HealthWeight,
			MinOverlapThreshold: sc.MinOverlapThreshold, LoadFactorEpsilon: sc.LoadFactorEpsilon,
			GPUTierWeight: *sc.GPUTierWeight, CPUTierWeight: *sc.CPUTierWeight, StorageTierWeight: *sc.StorageTierWeight},
	}, s.statuses())
	body.EventListeners = s.listeners()
	if et, ok := s.tok.(*stack.EngineTokenizer); ok {
		ts := et.Stats()
		body.Tokenizer = &ts
	}
	writeJSON(w, http.StatusOK, body)
}

// GET /admin/kv-index/backends: per backend, its event sources' connection and event counts and
// the index mutations its events caused; then the bound addresses' messages, those dropped for
// want of a backend included ("listeners", absent without bound addresses).
func (s *server) kvIndexBackends(w http.ResponseWriter, r *http.Request) {
	if s.index == nil {
		writeJSON(w, http.StatusOK, map[string]any{"enabled": false, "backends": []admin.BackendSummary{}})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	ist, _ := s.index.Stats(ctx)
	names := make([]string, 0, len(s.cfg.Backends))
	for _, b := range s.cfg.Backends {
		names = append(names, b.Name)
	}
	body := map[string]any{"enabled": true,
		"backends": admin.SummarizeBackends(names, s.statuses(), s.sink.Counts(), ist.PerBackend)}
	if ls := s.listeners(); ls != nil {
		body["listeners"] = ls
	}
	writeJSON(w, http.StatusOK, body)
}

// POST /admin/kv-index/clear.
func (s *server) kvIndexClear(w http.ResponseWriter, r *http.Request) {
	if s.index == nil {
		writeJSON(w, http.StatusNotFound, map[string]any{"success": false, "error": "the KV cache index is disabled"})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	before, _ := s.index.Stats(ctx)
	n, err := s.index.Clear(ctx)
	if err != nil {
		writeJSON(w, http.StatusInternalServerError, map[string]any{"success": false, "error": err.Error()})
		return
	}
	s.log.Info("KV index cleared", "entries_before_clear", before.Entries, "cleared_entries", n)
	writeJSON(w, http.StatusOK, map[string]any{"success": true, "entries_before_clear": before.Entries, "cleared_entries": n})
}

// dumpKVIndex is GET /admin/kv-index/dump's kvindex.Dumper: the index's own, or an empty dump when
// tier 4 is off.
func (s *server) dumpKVIndex(ctx context.Context, backend string, limit int, fn func(kvindex.DumpEntry) error) error {
	if s.index == nil {
		return nil
	}
	d, ok := s.index.(kvindex.Dumper)
	if !ok {
		return errors.New("the KV index cannot list its entries (kvindex.Dumper)")
	}
	return d.Dump(ctx, backend, limit, fn)
}
