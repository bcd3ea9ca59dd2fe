package main

import (
	"context"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"path"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/tidwall/gjson"

	"github.com/kvroute/kvroute/apierror"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/kvhttp"
	"github.com/kvroute/kvroute/prefixkey"
)

// What a gateway does besides routing the LLM endpoints: refuse ambiguous framing, list the
// fleet's models, pass the rest of the OpenAI-compatible API (embeddings, tokenize, …) to a
// backend that serves the request's model, and tell clients when to come back.

// RoutePassthrough is X-Kvroute-Route on a request the proxy passed to a backend without routing
// it by its prompt (the /v1 endpoints other than the three LLM ones).
const RoutePassthrough = "passthrough"

// modelsTimeout bounds GET /v1/models: the backends asked in parallel, each answer at most
// maxModelsResponse bytes.
const (
	modelsTimeout     = 3 * time.Second
	maxModelsResponse = 1 << 20
)

// framingGuard refuses a request whose body is framed by Transfer-Encoding, with 400 and a closed
// connection. net/http lets Transfer-Encoding override a Content-Length sent beside it (RFC 9112,
// section 6.3) and keeps the connection; a front proxy that trusted the Content-Length would then
// see the bytes past it as the next request, which is how requests are smuggled. net/http drops the
// Content-Length before a handler runs, so the two cannot be told apart here: every
// Transfer-Encoding body is refused, and clients send Content-Length, as the OpenAI and Anthropic
// SDKs do.
func framingGuard(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if len(r.TransferEncoding) == 0 {
			next.ServeHTTP(w, r)
			return
		}
		w.Header().Set("Connection", "close")
		apierror.Error{Status: http.StatusBadRequest, Code: "invalid_request_error", Message: "request bodies must be sent with Content-Length: Transfer-Encoding is not accepted"}.Write(w, prefixkey.FormatOfPath(r.URL.Path))

	})
}

// pathGuard refuses a request whose path has dot or empty segments, encoded or not
// ("/v1/%2e%2e/…", "/v1/../admin", "/v1//x"), with 400 invalid_path in the endpoint's API style,
// before the mux would redirect it to its cleaned form or a handler would see it: nothing is
// forwarded for such a path, and every form of it gets the same answer.
func pathGuard(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p := r.URL.Path
		clean := path.Clean(p)
		if strings.HasSuffix(p, "/") && clean != "/" {
			clean += "/"
		}
		if p == "" || p[0] != '/' || clean != p {
			apierror.Error{Status: http.StatusBadRequest, Code: "invalid_path",
				Message: "the request path has dot or empty segments"}.Write(w, prefixkey.FormatOfPath(p))
			return
		}
		if strings.ContainsFunc(p, func(c rune) bool { return c < 0x20 || c == 0x7f }) {
			// A control character, sent encoded (%00, %0a): no API path has one, and an engine
			// or a log behind the proxy should never be handed one.
			apierror.Error{Status: http.StatusBadRequest, Code: "invalid_path",
				Message: "the request path has a control character"}.Write(w, prefixkey.FormatOfPath(p))
			return
		}
		next.ServeHTTP(w, r)
	})
}

// methodNotAllowed answers a request to an LLM endpoint with another method than POST.
func methodNotAllowed(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Allow", http.MethodPost)
	apierror.Error{Status: http.StatusMethodNotAllowed, Code: "invalid_request_error", Message: r.Method + " " + r.URL.Path + ": use POST"}.Write(w, prefixkey.FormatOfPath(r.URL.Path))
}

// unavailable answers 503 with Retry-After: the time until the next health probe may bring a
// backend back (at least a second).
func (s *server) unavailable(w http.ResponseWriter, format prefixkey.Format, msg string) {
	w.Header().Set("Retry-After", s.retryAfter())
	apierror.Error{Status: http.StatusServiceUnavailable, Code: "no_healthy_backend", Message: msg}.Write(w, format)
}

// retryAfter is Retry-After in seconds: the health-check interval, or the circuit breaker's
// recovery timeout when probes are off, between 1 and 60.
func (s *server) retryAfter() string {
	d := time.Duration(s.cfg.CircuitBreaker.RecoveryTimeout)
	if *s.cfg.HealthChecks.Enabled {
		d = time.Duration(s.cfg.HealthChecks.Interval)
	}
	return strconv.Itoa(int(min(max(math.Ceil(d.Seconds()), 1), 60)))
}

// models serves GET /v1/models: the union, by id, of what the backends in rotation list, in
// configuration order; a backend that does not answer contributes the models its configuration
// declares.
func (s *server) models(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": s.modelList(r.Context())})
}

// model serves GET /v1/models/{id...}: that entry of the union, or 404 model_not_found. The id is
// the rest of the path, unescaped, so that a model id with a slash (meta-llama/Llama-3.1-8B-Instruct)
// may be sent as it is or with the slash escaped.
func (s *server) model(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	for _, m := range s.modelList(r.Context()) {
		if gjson.GetBytes(m, "id").String() == id {
			writeJSON(w, http.StatusOK, m)
			return
		}
	}
	apierror.Error{Status: http.StatusNotFound, Code: "model_not_found", Param: "model", Message: "no backend serves the model " + strconv.Quote(id)}.Write(w, prefixkey.FormatOpenAIChat)
}

// modelList asks the backends in rotation for their models, in parallel, within modelsTimeout.
func (s *server) modelList(ctx context.Context) []json.RawMessage {
	ctx, cancel := context.WithTimeout(ctx, modelsTimeout)
	defer cancel()
	lists := make([][]json.RawMessage, len(s.cfg.Backends))
	var wg sync.WaitGroup
	for i := range s.cfg.Backends {
		b := &s.cfg.Backends[i]
		if !s.health.InRotation(b.Name) {
			continue
		}
		wg.Go(func() {
			got, err := s.backendModels(ctx, b.Name)
			if err != nil {
				s.log.Debug("GET /v1/models failed", "backend", b.Name, "err", err)
				for _, m := range append([]string{b.Model}, b.Models...) {
					if m != "" {
						e, _ := json.Marshal(map[string]any{"id": m, "object": "model", "created": 0, "owned_by": "kvroute"})
						got = append(got, e)
					}
				}
			}
			lists[i] = got
		})
	}
	wg.Wait()
	data := []json.RawMessage{}
	seen := map[string]bool{}
	for _, l := range lists {
		for _, m := range l {
			id := gjson.GetBytes(m, "id").String()
			if id != "" && !seen[id] {
				seen[id] = true
				data = append(data, m)
			}
		}
	}
	return data
}

// backendModels returns the entries of one backend's GET /v1/models.
func (s *server) backendModels(ctx context.Context, backend string) ([]json.RawMessage, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.backends[backend].JoinPath("/v1/models").String(), nil)
	if err != nil {
		return nil, err
	}
	resp, err := s.transport.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, &kvhttp.StatusError{Code: resp.StatusCode}
	}
	var list struct {
		Data []json.RawMessage `json:"data"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, maxModelsResponse)).Decode(&list); err != nil {
		return nil, err
	}
	return list.Data, nil
}

// passRoute routes a /v1 request the proxy does not route by its prompt (embeddings, tokenize,
// audio, …; kvhttp.Handler.Route of s.pass) to a backend in rotation that serves its model
// ("model" of a JSON body or of the query; any backend when it names none), in turn; one that
// fails before answering is replaced once by the next. No such backend: 404 when none is
// configured for the model, 503 when none is in rotation.
func (s *server) passRoute(w http.ResponseWriter, r *http.Request, req *kvhttp.Request) (*kvhttp.Target, error) {
	model := r.URL.Query().Get("model")
	if m := gjson.GetBytes(req.Body, "model"); m.Type == gjson.String {
		model = m.Str
	}
	var configured, cands []string
	for _, b := range s.cfg.Backends {
		if (model != "" && !b.Serves(model)) || (s.cfg.DisaggregatedServing.Enabled && b.ParsedRole() == disagg.RolePrefill) {
			continue
		}
		configured = append(configured, b.Name)
		if s.health.InRotation(b.Name) {
			cands = append(cands, b.Name)
		}
	}
	switch {
	case len(configured) == 0:
		return nil, apierror.Error{Status: http.StatusNotFound, Code: "model_not_found", Param: "model", Message: "no backend serves the model " + strconv.Quote(model)}
	case len(cands) == 0:
		s.unavailable(w, req.Format, "no healthy backend is available")
		return nil, nil
	}
	next := int(s.passNext.Add(1))
	t := &kvhttp.Target{Backend: cands[next%len(cands)], Route: RoutePassthrough}
	if len(cands) > 1 {
		t.Retry = func(ctx context.Context, cause error) (*kvhttp.Target, error) {
			s.retrying(ctx, t.Backend, cause)
			return &kvhttp.Target{Backend: cands[(next+1)%len(cands)], Route: RoutePassthrough}, nil
		}
	}
	return t, nil
}
