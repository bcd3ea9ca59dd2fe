package main

import (
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
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/respcache"
)

// adminTimeout bounds the store and index calls of one admin request.
const adminTimeout = 5 * time.Second

// routes returns the proxy's HTTP routes.
func (s *server) routes() http.Handler {
	s.rp = s.newReverseProxy()
	mux := http.NewServeMux()
	mux.Handle("POST /v1/chat/completions", s.llmHandler(prefixkey.FormatOpenAIChat, "/v1/chat/completions"))
	mux.Handle("POST /v1/completions", s.llmHandler(prefixkey.FormatOpenAICompletion, "/v1/completions"))
	mux.Handle("POST /v1/messages", s.llmHandler(prefixkey.FormatAnthropicMessages, "/v1/messages"))
	for _, path := range []string{"/v1/chat/completions", "/v1/completions", "/v1/messages"} {
		mux.HandleFunc(path, methodNotAllowed)
	}
	mux.HandleFunc("GET /v1/models", s.models)
	mux.HandleFunc("GET /v1/models/{id...}", s.model) // ids have slashes: meta-llama/Llama-3.1-8B-Instruct
	mux.HandleFunc("/v1/", s.passthrough)
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
	mux.Handle("GET /admin/kv-index/dump", s.admin(s.knownBackend(admin.DumpHandler(kvindex.DumperFunc(s.router.DumpKVIndex)))))
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
	return framingGuard(mux)
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
			apierror.Write(w, prefixkey.FormatOpenAIChat, http.StatusNotFound, "backend_not_found", "backend",
				"no backend is named "+strconv.Quote(b))
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

// GET /admin/replicas/stats: the replica sync, the event log, the engines' scraped load and what
// the Router knows of its peers.
func (s *server) replicasStats(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, s.fleet.stats(s.router))
}

// GET /admin/prefix-routing/stats: the Router's tier-1 stats.
func (s *server) prefixRoutingStats(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, s.router.Stats())
}

// GET /admin/disaggregation/stats: the Router's DisaggStats (configuration, requests by routing
// path and reason, each prefill and decode backend's phases in flight; credentials redacted).
func (s *server) disaggregationStats(w http.ResponseWriter, _ *http.Request) {
	if !s.cfg.DisaggregatedServing.Enabled {
		writeJSON(w, http.StatusOK, map[string]any{"enabled": false})
		return
	}
	writeJSON(w, http.StatusOK, s.router.Disagg().Stats())
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

// kvStatsConfig is the "config" section of GET /admin/kv-index/stats: the index's settings plus the
// Router's.
type kvStatsConfig struct {
	kvroute.KVIndexStatsConfig
	MaxEntries        int           `json:"max_entries"`
	EntryTTLSeconds   int           `json:"entry_ttl_seconds"`
	EventSourcesCount int           `json:"event_sources_count"`
	Tokenizer         string        `json:"tokenizer"`
	Scoring           scoringConfig `json:"scoring"`
}

type scoringConfig struct {
	OverlapWeight       float64 `json:"overlap_weight"`
	LoadWeight          float64 `json:"load_weight"`
	HealthWeight        float64 `json:"health_weight"`
	MinOverlapThreshold float64 `json:"min_overlap_threshold"`
	LoadFactorEpsilon   float64 `json:"load_factor_epsilon"`
	GPUTierWeight       float64 `json:"gpu_tier_weight"`
	CPUTierWeight       float64 `json:"cpu_tier_weight"`
	StorageTierWeight   float64 `json:"storage_tier_weight"`
}

// eventSourceSummary is one entry of "event_sources" in GET /admin/kv-index/stats: a source's
// status in a flat form, with its transport details.
type eventSourceSummary struct {
	BackendName    string    `json:"backend_name"`
	Transport      string    `json:"transport"`
	Endpoint       string    `json:"endpoint"`
	Status         string    `json:"status"`
	Connected      bool      `json:"connected"`
	EventsReceived uint64    `json:"events_received"`
	EventsDropped  uint64    `json:"events_dropped"`
	LastEventAt    time.Time `json:"last_event_at,omitzero"`
	ReconnectCount uint64    `json:"reconnect_count"`
	SequenceGaps   uint64    `json:"sequence_gaps"`
	LastError      string    `json:"last_error,omitempty"`
}

// kvStatsBody is the body of GET /admin/kv-index/stats.
type kvStatsBody struct {
	Enabled          bool                       `json:"enabled"`
	Config           kvStatsConfig              `json:"config"`
	Index            kvindex.Stats              `json:"index"`
	EventSources     []eventSourceSummary       `json:"event_sources"`
	RoutingDecisions kvroute.KVRoutingDecisions `json:"routing_decisions"`
	QueryLatency     uint64                     `json:"query_latency_count"`
	OverlapScores    uint64                     `json:"overlap_score_count"`
	LookupErrors     uint64                     `json:"lookup_errors"`
	TokenizeErrors   uint64                     `json:"tokenize_errors"`
	NoBlockKeys      uint64                     `json:"requests_without_block_keys"`
	Tokenizer        *prefixkey.TokenizerStats  `json:"tokenizer_stats,omitempty"`
	IndexError       string                     `json:"index_error,omitempty"`
}

// statuses returns the status of every event source of every consumer.
func (s *server) statuses() []events.SourceStatus {
	var out []events.SourceStatus
	for _, c := range s.cons {
		out = append(out, c.Status()...)
	}
	return out
}

// GET /admin/kv-index/stats: Router.KVStats plus the event sources.
func (s *server) kvIndexStats(w http.ResponseWriter, r *http.Request) {
	if s.index == nil {
		writeJSON(w, http.StatusOK, map[string]any{"enabled": false})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	st, err := s.router.KVStats(ctx)
	kc := s.cfg.KVCacheIndex
	sc := kc.Scoring
	body := kvStatsBody{
		Enabled: st.Enabled,
		Config: kvStatsConfig{KVIndexStatsConfig: st.Config, MaxEntries: kc.MaxEntries, EntryTTLSeconds: kc.EntryTTLSeconds,
			EventSourcesCount: len(kc.EventSources), Tokenizer: kc.Tokenizer,
			Scoring: scoringConfig{OverlapWeight: *sc.OverlapWeight, LoadWeight: *sc.LoadWeight, HealthWeight: *sc.HealthWeight,
				MinOverlapThreshold: sc.MinOverlapThreshold, LoadFactorEpsilon: sc.LoadFactorEpsilon, GPUTierWeight: *sc.GPUTierWeight, CPUTierWeight: *sc.CPUTierWeight,
				StorageTierWeight: *sc.StorageTierWeight}},
		Index:            st.Index,
		EventSources:     []eventSourceSummary{},
		RoutingDecisions: st.RoutingDecisions,
		QueryLatency:     st.Lookups,
		OverlapScores:    st.OverlapScores,
		LookupErrors:     st.LookupErrors,
		TokenizeErrors:   st.TokenizeErrors,
		NoBlockKeys:      st.NoTokens,
	}
	if err != nil {
		body.IndexError = err.Error()
	}
	if et, ok := s.tok.(*engineTokenizer); ok {
		ts := et.stats()
		body.Tokenizer = &ts
	}
	for _, ss := range s.statuses() {
		body.EventSources = append(body.EventSources, eventSourceSummary{
			BackendName: ss.Backend, Transport: ss.Transport, Endpoint: ss.Endpoint, Status: string(ss.Connection.State),
			Connected: ss.Connection.Connected, EventsReceived: ss.Events.Received, EventsDropped: ss.Events.Dropped,
			LastEventAt: ss.Connection.LastEventAt, ReconnectCount: ss.Connection.ReconnectCount,
			SequenceGaps: ss.Sequence.Gaps, LastError: ss.LastError,
		})
	}
	writeJSON(w, http.StatusOK, body)
}

// GET /admin/kv-index/backends: per backend, its event sources' connection and event counts and
// the index mutations its events caused.
func (s *server) kvIndexBackends(w http.ResponseWriter, r *http.Request) {
	if s.index == nil {
		writeJSON(w, http.StatusOK, map[string]any{"enabled": false, "backends": []events.BackendSummary{}})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	ist, _ := s.index.Stats(ctx)
	names := make([]string, 0, len(s.cfg.Backends))
	for _, b := range s.cfg.Backends {
		names = append(names, b.Name)
	}
	writeJSON(w, http.StatusOK, map[string]any{"enabled": true,
		"backends": events.SummarizeBackends(names, s.statuses(), s.sink.Counts(), ist.PerBackend)})
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
	n, err := s.router.ClearKVIndex(ctx)
	if err != nil {
		writeJSON(w, http.StatusInternalServerError, map[string]any{"success": false, "error": err.Error()})
		return
	}
	s.log.Info("KV index cleared", "entries_before_clear", before.Entries, "cleared_entries", n)
	writeJSON(w, http.StatusOK, map[string]any{"success": true, "entries_before_clear": before.Entries, "cleared_entries": n})
}
