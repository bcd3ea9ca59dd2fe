package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/apierror"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/kvhttp"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/telemetry"
)

// The two-phase flow of disaggregated serving. Router.Disagg().Route chooses a path:
//
//   - fast_decode, unified, fallback: the client's request goes to the chosen backend as it came
//     (a decode backend whose cache, or storage, holds the prefix loads it by itself);
//   - prefill_then_decode: a prefill request (the client's body with max_tokens 1, not streamed,
//     and kv_transfer_params {"do_remote_decode": true, "do_remote_prefill": false}) goes to the
//     prefill backend under prefill_timeout; the kv_transfer_params of its answer are added to the
//     client's body, which goes to the decode backend, whose response headers must arrive within
//     kv_transfer_timeout (it loads the KV first); its answer is streamed to the client.
//
// A failed prefill (connection error, timeout, 408, 429, 5xx, an answer without
// kv_transfer_params) re-plans the request onto a unified backend (DisaggDecision.PrefillFailed);
// a decode backend that fails before answering is replaced by a unified backend. Both need
// fallback_to_unified.

// headerRequestID is the request-id header; the prefill and decode requests of one client request
// carry the same value, so that engines can match the two phases.
const headerRequestID = "X-Request-Id"

// prefillTransferParams asks the prefill engine to compute the prompt's KV for a remote decode.
const prefillTransferParams = `{"do_remote_decode":true,"do_remote_prefill":false}`

// maxPrefillResponse caps the prefill answer read (one generated token and the transfer
// parameters: a few KiB).
const maxPrefillResponse = 4 << 20

// Errors of a remote prefill.
var (
	errPrefillTimeout   = fmt.Errorf("no answer within prefill_timeout (%w)", context.DeadlineExceeded)
	errNoTransferParams = errors.New("the prefill answer has no kv_transfer_params object")
	errCircuitOpen      = errors.New("circuit breaker open")
)

// prefillResult is the outcome of a remote prefill: the kv_transfer_params object of its answer,
// or an answer to relay to the client (the backend refused the request itself: a 4xx), or the
// failure.
type prefillResult struct {
	params []byte
	relay  *relayedResponse
	err    error
}

// relayedResponse is an upstream answer passed to the client as it is (hop-by-hop headers
// aside).
type relayedResponse struct {
	status int
	header http.Header
	body   []byte
}

// routeDisagg routes one request with disaggregation on (kvhttp.Handler.Route): it runs the
// remote prefill of prefill_then_decode here, and returns the decode (or unified) Target, which
// a failure before answering sends on to a unified backend.
func (s *server) routeDisagg(w http.ResponseWriter, r *http.Request, req *kvhttp.Request) (*kvhttp.Target, error) {
	ctx := r.Context()
	d, err := s.router.Disagg().Route(ctx, req.Parsed)
	if err != nil {
		return nil, s.routeError(w, req.Format, err)
	}
	t := disaggTarget(req, d)
	if d.Plan.Path == disagg.PathPrefillThenDecode {
		reqID := r.Header.Get(headerRequestID)
		if reqID == "" {
			reqID = newRequestID()
		}
		res := s.prefill(ctx, r, req, d.Plan.Prefill, reqID)
		switch {
		case ctx.Err() != nil: // the client left: nobody reads an answer
			d.Done(kvroute.Outcome{})
			return nil, nil
		case res.relay != nil:
			// The prefill backend refused the request itself: no KV was computed (PrefillDone
			// would record speculative entries for it); Done ends both phases.
			d.Done(kvroute.Outcome{})
			s.relay(w, d, res.relay)
			return nil, nil
		case res.err != nil:
			prefillBackend := d.Plan.Prefill
			s.log.Warn("prefill failed; falling back to a unified backend", "backend", prefillBackend, "err", res.err)
			nd, err := d.PrefillFailed(ctx, res.err)
			if err != nil {
				if errors.Is(err, kvroute.ErrNoBackend) {
					s.unavailable(w, req.Format,
						"the prefill on "+prefillBackend+" failed ("+res.err.Error()+") and no unified backend can serve the request")
					return nil, nil
				}
				return nil, s.routeError(w, req.Format, err)
			}
			d, t = nd, disaggTarget(req, nd)
		default:
			d.PrefillDone(kvroute.Outcome{})
			body, err := sjson.SetRawBytes(req.Body, "kv_transfer_params", res.params)
			if err != nil { // the body parsed as an object: not reached
				d.Done(kvroute.Outcome{})
				s.log.Error("cannot add kv_transfer_params to the request", "err", err)
				return nil, apierror.Error{Status: http.StatusInternalServerError, Code: "internal_error", Message: "cannot build the decode request"}
			}
			t.Body, t.RequestHeader = body, http.Header{headerRequestID: {reqID}}
			t.HeaderTimeout = time.Duration(s.cfg.DisaggregatedServing.KVTransferTimeout)
		}
	}
	if s.canFallback(d) {
		t.Retry = func(ctx context.Context, cause error) (*kvhttp.Target, error) {
			// The second attempt goes to a unified backend: the whole request, as the client sent it.
			s.retrying(ctx, t.Backend, cause)
			if d.Unified == nil {
				// A decode backend failed: the library releases its slots, counts the failure and
				// re-plans (fallback, decode_failed); kvhttp's Done after this is a no-op.
				nd, err := d.DecodeFailed(ctx, cause)
				if err != nil {
					return nil, err
				}
				return s.target(req, nd.Unified, &nd.Plan), nil
			}
			// Another unified backend, not the one that failed, whose circuit breaker admits it.
			d2, tk, err := s.routeAdmitted(ctx, func(ctx context.Context) (*kvroute.Decision, error) {
				return kvhttp.RouteAvoiding(ctx, s.router, req.Parsed, t.Backend, 2*len(s.cfg.Backends)+2)
			})
			if err != nil {
				return nil, err
			}
			path := disagg.PathFallback
			if d.Plan.Path == disagg.PathUnified { // no pools to fall back from: another unified backend
				path = disagg.PathUnified
			}
			return admitted(req, d2, &disagg.Plan{Path: path}, tk), nil
		}
	}
	return t, nil
}

// disaggTarget is the Target of d's decode (or unified) backend with the client's body.
// X-Kvroute-Route is the plan's reason on the disaggregated paths (local_hit, storage_hit,
// short_prompt, cache_miss) and the unified decision's label on the others.
func disaggTarget(req *kvhttp.Request, d *kvroute.DisaggDecision) *kvhttp.Target {
	t := &kvhttp.Target{Backend: d.Plan.Decode, Route: d.Plan.Reason.String(), Lease: lease(req, d), Header: planHeader(nil, &d.Plan)}
	if d.Unified != nil {
		t.Route = d.Unified.Reason.String()
	}
	return t
}

// planHeader adds to h (nil: a new one) the routing-path headers of plan (disagg.Plan.SetHeaders),
// those it has none for as deletions.
func planHeader(h http.Header, plan *disagg.Plan) http.Header {
	if h == nil {
		h = http.Header{}
	}
	h[disagg.HeaderRoutingPath] = []string{plan.Path.String()}
	h[disagg.HeaderPrefillBackend], h[disagg.HeaderDecodeBackend] = nil, nil
	if plan.Prefill != "" {
		h[disagg.HeaderPrefillBackend] = []string{plan.Prefill}
	}
	if plan.Decode != "" {
		h[disagg.HeaderDecodeBackend] = []string{plan.Decode}
	}
	return h
}

// canFallback reports whether a decode or unified attempt of d that fails before answering may be
// retried: on a unified backend (another one when d is already on one), with fallback_to_unified.
func (s *server) canFallback(d *kvroute.DisaggDecision) bool {
	if !*s.cfg.DisaggregatedServing.FallbackToUnified && d.Plan.Path != disagg.PathUnified {
		return false
	}
	n := 0
	for _, b := range s.cfg.Backends {
		if b.ParsedRole() == disagg.RoleUnified && b.Name != d.Plan.Decode && s.health.InRotation(b.Name) {
			n++
		}
	}
	return n > 0
}

// prefill runs the remote prefill of the request on backend, under prefill_timeout (and the
// client's context), and records its outcome in the backend's circuit breaker.
func (s *server) prefill(ctx context.Context, r *http.Request, req *kvhttp.Request, backend, reqID string) prefillResult {
	tk, ok := s.health.Admit(backend)
	if !ok {
		return prefillResult{err: errCircuitOpen}
	}
	res := s.doPrefill(ctx, r, req, backend, reqID)
	switch {
	case ctx.Err() != nil:
		tk.Cancel()
	case res.err != nil:
		tk.Done(res.err)
		s.tel.upstreamError(ctx, backend, prefillErrKind(res.err))
	default:
		tk.Done(nil)
	}
	return res
}

func (s *server) doPrefill(ctx context.Context, r *http.Request, pr *kvhttp.Request, backend, reqID string) (res prefillResult) {
	body, err := prefillBody(pr)
	if err != nil {
		return prefillResult{err: fmt.Errorf("prefill request: %w", err)}
	}
	pctx, cancel := context.WithTimeoutCause(ctx, time.Duration(s.cfg.DisaggregatedServing.PrefillTimeout), errPrefillTimeout)
	defer cancel()
	u := s.backends[backend].JoinPath(r.URL.Path)
	u.RawQuery = r.URL.RawQuery
	req, err := http.NewRequestWithContext(pctx, http.MethodPost, u.String(), bytes.NewReader(body))
	if err != nil {
		return prefillResult{err: err}
	}
	req.Header = kvhttp.UpstreamHeader(r.Header)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json")
	req.Header.Set(headerRequestID, reqID)
	if s.tracer != nil { // the prefill call's span, whose trace context goes to the prefill backend
		var span trace.Span
		pctx, span = s.tracer.Start(pctx, "prefill", trace.WithSpanKind(trace.SpanKindClient),
			trace.WithAttributes(attribute.String(telemetry.AttrBackend, backend)))
		req = req.WithContext(pctx)
		propagation.TraceContext{}.Inject(pctx, propagation.HeaderCarrier(req.Header))
		defer func() {
			if res.err != nil {
				span.SetStatus(codes.Error, res.err.Error())
			}
			span.End()
		}()
	}
	resp, err := s.transport.RoundTrip(req)
	if err != nil {
		if errors.Is(context.Cause(pctx), errPrefillTimeout) {
			err = errPrefillTimeout
		}
		return prefillResult{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxPrefillResponse+1))
	if err != nil {
		if errors.Is(context.Cause(pctx), errPrefillTimeout) {
			err = errPrefillTimeout
		}
		return prefillResult{err: fmt.Errorf("reading the prefill answer: %w", err)}
	}
	code := resp.StatusCode
	switch {
	case code >= 500 || code == http.StatusRequestTimeout || code == http.StatusTooManyRequests:
		return prefillResult{err: &kvhttp.StatusError{Code: code}}
	case code >= 400:
		return prefillResult{relay: &relayedResponse{status: code, header: kvhttp.UpstreamHeader(resp.Header), body: b}}
	case code < 200 || code > 299:
		return prefillResult{err: &kvhttp.StatusError{Code: code}}
	case len(b) > maxPrefillResponse:
		return prefillResult{err: fmt.Errorf("the prefill answer exceeds %d bytes", maxPrefillResponse)}
	}
	if !gjson.ValidBytes(b) {
		return prefillResult{err: errNoTransferParams}
	}
	params := gjson.GetBytes(b, "kv_transfer_params")
	if !params.IsObject() {
		return prefillResult{err: errNoTransferParams}
	}
	return prefillResult{params: []byte(params.Raw)}
}

// prefillErrKind classifies a prefill failure for metrics.
func prefillErrKind(err error) string {
	if se, ok := errors.AsType[*kvhttp.StatusError](err); ok && se.Code >= 500 {
		return "status_5xx"
	}
	if errors.Is(err, errNoTransferParams) {
		return "no_kv_transfer_params"
	}
	return errKind(err)
}

// prefillBody returns the prefill request's body: the client's body with max_tokens 1
// (max_completion_tokens for a chat request that uses it), stream false, no stream_options or
// min_tokens, and kv_transfer_params asking for a remote decode. Every other member is kept as it
// came.
func prefillBody(pr *kvhttp.Request) ([]byte, error) {
	type edit struct {
		key   string
		value string // raw JSON; "" deletes the member
	}
	edits := []edit{{"stream", "false"}, {"stream_options", ""}, {"min_tokens", ""},
		{"kv_transfer_params", prefillTransferParams}}
	p := pr.Parsed.Params
	if pr.Format == prefixkey.FormatOpenAIChat && p.MaxCompletionTokens.Set {
		edits = append(edits, edit{"max_completion_tokens", "1"})
		if p.MaxTokens.Set {
			edits = append(edits, edit{"max_tokens", "1"})
		}
	} else {
		edits = append(edits, edit{"max_tokens", "1"})
	}
	body := pr.Body
	for _, e := range edits {
		var err error
		if e.value == "" {
			body, err = sjson.DeleteBytes(body, e.key)
		} else {
			body, err = sjson.SetRawBytes(body, e.key, []byte(e.value))
		}
		if err != nil {
			return nil, err
		}
	}
	return body, nil
}

// relay answers the client with a prefill backend's refusal of the request.
func (s *server) relay(w http.ResponseWriter, d *kvroute.DisaggDecision, res *relayedResponse) {
	h := w.Header()
	for k, v := range res.header {
		h[k] = v
	}
	d.Plan.SetHeaders(h)
	h.Set(HeaderBackend, d.Plan.Prefill)
	h.Set(HeaderRoute, d.Plan.Reason.String())
	h.Set("Content-Length", strconv.Itoa(len(res.body)))
	w.WriteHeader(res.status)
	_, _ = w.Write(res.body)
}

// newRequestID returns 16 random bytes in hex.
func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
