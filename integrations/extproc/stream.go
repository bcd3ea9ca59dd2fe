package extproc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"go.opentelemetry.io/otel/attribute"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/apierror"
	"github.com/kvroute/kvroute/kvhttp"
	"github.com/kvroute/kvroute/prefixkey"
)

// phase is where a stream is in its HTTP request's life.
type phase uint8

const (
	phaseHeaders  phase = iota // waiting for the request headers
	phaseBody                  // the headers came; reading the request body
	phaseUpstream              // the request went on (picked); waiting for the response
	phaseResponse              // the response headers came; the body passes
	phaseEnded                 // answered by the picker, or the response ended
)

// stream is one ext_proc stream: one HTTP request. Its methods run on the stream's goroutine.
type stream struct {
	s   *Server
	srv extprocv3.ExternalProcessor_ProcessServer
	ctx context.Context

	phase        phase
	reqMode      BodyMode
	respMode     BodyMode
	path, method string
	contentType  string
	subset       []string // the proxy's subset hint, nil when none
	hasSubset    bool

	body []byte
	held int64 // bytes of body held in the Server's BodyBudget

	d         *kvroute.Decision // nil until picked, and after Done
	endpoint  string            // the picked endpoint
	stream    bool              // the request asked for a streamed answer
	status    int               // the response's status, 0 before its headers
	firstSeen bool
	scan      kvhttp.AnswerScanner
}

func newStream(s *Server, srv extprocv3.ExternalProcessor_ProcessServer) *stream {
	return &stream{s: s, srv: srv, ctx: srv.Context(), reqMode: s.cfg.BodyMode, respMode: s.cfg.BodyMode}
}

// bodyChunk is the largest request-body chunk the picker hands back to Envoy in full duplex.
const bodyChunk = 64 << 10

// errServedElsewhere is the failure of a picked endpoint that Envoy passed over for a fallback.
var errServedElsewhere = errors.New("extproc: the picked endpoint failed the request")

// errProtocol marks a message the ext_proc protocol does not allow where it came.
var errProtocol = errors.New("extproc: message out of order")

// received is one Recv's result.
type received struct {
	req *extprocv3.ProcessingRequest
	err error
}

// run reads the stream's messages until Envoy closes it. A reader goroutine receives them, so
// that the request phase is bounded in time instead of holding its body and goroutines for ever:
// the request's headers and body must arrive within Config.ReadTimeout of the stream's start,
// and, but in buffered mode (where Envoy gathers the body before it sends it), no gap between two
// of its messages that carry something may exceed Config.BodyIdleTimeout; either failing is
// answered 408 (a stream without headers is just ended). The wait for the engine's answer and
// the answer itself have no such bound (a long prefill, a slow stream).
func (st *stream) run() error {
	msgs := make(chan received)
	done := make(chan struct{})
	defer close(done)
	go func() {
		for {
			req, err := st.srv.Recv()
			select {
			case msgs <- received{req, err}:
			case <-done:
				return
			}
			if err != nil {
				return
			}
		}
	}()
	cfg := &st.s.cfg
	start := time.Now()
	progress := start
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		var timeout <-chan time.Time
		var why string
		if st.phase == phaseHeaders || st.phase == phaseBody {
			var wake time.Time
			if cfg.ReadTimeout > 0 {
				wake, why = start.Add(cfg.ReadTimeout), fmt.Sprintf("the request did not arrive within %s", cfg.ReadTimeout)
			}
			if cfg.BodyIdleTimeout > 0 && (st.phase == phaseHeaders || st.reqMode != BodyBuffered) {
				if w := progress.Add(cfg.BodyIdleTimeout); wake.IsZero() || w.Before(wake) {
					wake, why = w, fmt.Sprintf("no byte of the request came for %s", cfg.BodyIdleTimeout)
				}
			}
			if !wake.IsZero() {
				timer.Reset(time.Until(wake))
				timeout = timer.C
			}
		}
		var r received
		select {
		case r = <-msgs:
		case <-timeout:
			st.s.stats.idleTimeouts.Add(1)
			if st.phase == phaseHeaders {
				return status.Error(codes.DeadlineExceeded, "extproc: "+why)
			}
			return st.answer(http.StatusRequestTimeout, "request_timeout", why)
		}
		if r.err != nil {
			if r.err == io.EOF || status.Code(r.err) == codes.Canceled || st.ctx.Err() != nil {
				return nil
			}
			return r.err
		}
		req := r.req
		if b := req.GetRequestBody(); b == nil || len(b.GetBody()) > 0 || b.GetEndOfStream() {
			progress = time.Now() // an empty chunk that does not end the body is no progress
		}
		if pc := req.GetProtocolConfig(); pc != nil {
			st.reqMode, st.respMode = bodyMode(pc.GetRequestBodyMode()), bodyMode(pc.GetResponseBodyMode())
		}
		if err := st.handle(req); err != nil {
			if errors.Is(err, errProtocol) {
				st.s.stats.protocolErrors.Add(1)
				return status.Error(codes.InvalidArgument, err.Error())
			}
			if st.ctx.Err() != nil {
				return nil
			}
			return err
		}
	}
}

// bodyMode maps Envoy's body send mode.
func bodyMode(m filterv3.ProcessingMode_BodySendMode) BodyMode {
	switch m {
	case filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		return BodyFullDuplex
	case filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_BUFFERED_PARTIAL:
		return BodyBuffered
	case filterv3.ProcessingMode_STREAMED, filterv3.ProcessingMode_GRPC:
		return BodyStreamed
	}
	return BodyNone
}

// handle serves one message.
func (st *stream) handle(req *extprocv3.ProcessingRequest) error {
	switch r := req.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return st.requestHeaders(req, r.RequestHeaders)
	case *extprocv3.ProcessingRequest_RequestBody:
		return st.requestBody(r.RequestBody)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return st.requestTrailers()
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return st.responseHeaders(req, r.ResponseHeaders)
	case *extprocv3.ProcessingRequest_ResponseBody:
		return st.responseBody(r.ResponseBody)
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return st.responseTrailers()
	}
	return fmt.Errorf("%w: a message without a request", errProtocol)
}

// requestHeaders reads the request's headers and the subset hint. Without a body to read (none,
// or a mode that sends it after the headers' answer) it picks now.
func (st *stream) requestHeaders(req *extprocv3.ProcessingRequest, h *extprocv3.HttpHeaders) error {
	if st.phase != phaseHeaders {
		return fmt.Errorf("%w: request headers twice", errProtocol)
	}
	for _, hv := range h.GetHeaders().GetHeaders() {
		switch strings.ToLower(hv.GetKey()) {
		case ":path":
			st.path = headerValue(hv)
		case ":method":
			st.method = headerValue(hv)
		case "content-type":
			st.contentType = headerValue(hv)
		}
	}
	st.subset, st.hasSubset = subsetHint(req.GetMetadataContext(), st.s.cfg.SubsetNamespace)
	st.phase = phaseBody
	switch {
	case h.GetEndOfStream() || st.reqMode == BodyNone || st.reqMode == BodyStreamed:
		return st.pick(nil, func(c *extprocv3.CommonResponse, md *structpb.Struct) []*extprocv3.ProcessingResponse {
			return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_RequestHeaders{
				RequestHeaders: &extprocv3.HeadersResponse{Response: c}}, DynamicMetadata: md}}
		})
	case st.reqMode == BodyBuffered:
		// Envoy waits for this answer before it sends the body, and holds the headers until the
		// body's answer, which carries the endpoint. A destination the client sent is removed
		// now, so that it never survives, whatever ends the request.
		return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
			RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
				HeaderMutation: &extprocv3.HeaderMutation{RemoveHeaders: []string{HeaderDestination}}}}}})
	}
	return nil // full duplex: the headers' answer waits for the body
}

// headerValue returns a header's value: Envoy sends raw_value, older versions value.
func headerValue(hv *corev3.HeaderValue) string {
	if raw := hv.GetRawValue(); len(raw) > 0 {
		return string(raw)
	}
	return hv.GetValue()
}

// subsetHint reads the proxy's subset hint: a list of endpoints (or one comma-separated string) at
// namespace/KeySubset of the request's filter metadata. ok is false when the key is absent.
func subsetHint(md *corev3.Metadata, namespace string) (subset []string, ok bool) {
	v, ok := md.GetFilterMetadata()[namespace].GetFields()[KeySubset]
	if !ok {
		return nil, false
	}
	add := func(s string) {
		for part := range strings.SplitSeq(s, ",") {
			if part = strings.TrimSpace(part); part != "" {
				subset = append(subset, part)
			}
		}
	}
	switch k := v.GetKind().(type) {
	case *structpb.Value_ListValue:
		for _, e := range k.ListValue.GetValues() {
			add(e.GetStringValue())
		}
	case *structpb.Value_StringValue:
		add(k.StringValue)
	}
	return subset, true
}

// requestBody gathers the body; at its end, it picks.
func (st *stream) requestBody(b *extprocv3.HttpBody) error {
	switch st.phase {
	case phaseBody:
	case phaseEnded:
		return nil // the chunks Envoy sent before it read the picker's own answer
	case phaseUpstream:
		// The pick was made from the headers (STREAMED): each chunk gets its empty answer.
		if st.reqMode == BodyStreamed {
			return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
				RequestBody: &extprocv3.BodyResponse{}}})
		}
		return fmt.Errorf("%w: request body after the request ended", errProtocol)
	default:
		return fmt.Errorf("%w: request body before its headers", errProtocol)
	}
	chunk := b.GetBody()
	if int64(len(st.body))+int64(len(chunk)) > st.s.cfg.MaxBodyBytes {
		return st.answer(http.StatusRequestEntityTooLarge, "request_too_large",
			fmt.Sprintf("the request body exceeds %d bytes", st.s.cfg.MaxBodyBytes))
	}
	if err := st.hold(int64(len(chunk))); err != nil {
		if st.ctx.Err() != nil {
			return st.ctx.Err()
		}
		return st.answer(http.StatusServiceUnavailable, "server_busy", "the gateway holds too many request bodies; retry")
	}
	st.body = append(st.body, chunk...)
	if !b.GetEndOfStream() && st.reqMode != BodyBuffered {
		return nil
	}
	// In buffered mode the one body message is the body (BUFFERED_PARTIAL: as much of it as
	// Envoy buffers), whether trailers follow or not, and Envoy waits for its answer.
	return st.pickBody(b.GetEndOfStream() || st.reqMode == BodyBuffered)
}

// requestTrailers: trailers end a body whose last chunk did not say so.
func (st *stream) requestTrailers() error {
	if st.phase == phaseHeaders {
		return fmt.Errorf("%w: request trailers before its headers", errProtocol)
	}
	if st.phase == phaseBody {
		if st.reqMode == BodyBuffered {
			// Headers, then trailers, and no body: the headers' answer is gone, and a trailers'
			// answer cannot name the endpoint.
			return st.answer(http.StatusBadRequest, "invalid_request_error",
				"a request with trailers must have a body for the endpoint picker to read in buffered mode")
		}
		if err := st.pickBody(false); err != nil || st.phase == phaseEnded {
			return err
		}
	}
	if st.phase == phaseEnded {
		return nil
	}
	return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
		RequestTrailers: &extprocv3.TrailersResponse{}}})
}

// hold takes n more bytes of the body budget.
func (st *stream) hold(n int64) error {
	b := st.s.cfg.BodyBudget
	if b == nil || n == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(st.ctx, budgetWait)
	defer cancel()
	if err := b.AcquireBody(ctx, st.held, n, st.s.cfg.MaxBodyBytes); err != nil {
		return err
	}
	st.held += n
	return nil
}

// release gives the body's bytes back to the budget and drops the body.
func (st *stream) release() {
	if st.held > 0 {
		st.s.cfg.BodyBudget.Release(st.held)
		st.held = 0
	}
	st.body = nil
}

// pickBody parses the whole body and picks; its answers carry the endpoint (the headers' answer
// in full duplex, the body's in buffered mode). eos is whether the body's last chunk said so
// (false when trailers end it).
func (st *stream) pickBody(eos bool) error {
	body := st.body
	req, err := st.parse(body)
	if err != nil {
		st.release()
		return st.answer(http.StatusBadRequest, "invalid_request_error", err.Error())
	}
	if st.reqMode == BodyBuffered {
		return st.pick(req, func(c *extprocv3.CommonResponse, md *structpb.Struct) []*extprocv3.ProcessingResponse {
			st.release()
			return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_RequestBody{
				RequestBody: &extprocv3.BodyResponse{Response: c}}, DynamicMetadata: md}}
		})
	}
	return st.pick(req, func(c *extprocv3.CommonResponse, md *structpb.Struct) []*extprocv3.ProcessingResponse {
		headers := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
			RequestHeaders: &extprocv3.HeadersResponse{Response: c}}, DynamicMetadata: md}
		// Full duplex: the body goes back unchanged now that the endpoint is known, in chunks no
		// larger than those Envoy streams (no message of the answer holds a whole large prompt).
		out := []*extprocv3.ProcessingResponse{headers}
		for i := 0; i == 0 || i < len(body); i += bodyChunk {
			end := min(i+bodyChunk, len(body))
			out = append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
				RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
					BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
						StreamedResponse: &extprocv3.StreamedBodyResponse{Body: body[i:end], EndOfStream: eos && end == len(body)}}}}}}})
		}
		st.release() // the messages hold the body; the budget no longer does
		return out
	})
}

// parse reads the request for the Router: an LLM endpoint's body by its path's format; any other
// request (or an empty body) routes without a prefix key.
func (st *stream) parse(body []byte) (*prefixkey.Request, error) {
	path := st.path
	if i := strings.IndexAny(path, "?#"); i >= 0 {
		path = path[:i]
	}
	f := prefixkey.FormatOfPath(path)
	if f == 0 || len(body) == 0 {
		return &prefixkey.Request{}, nil
	}
	if ct := st.contentType; ct != "" && !strings.HasPrefix(strings.ToLower(strings.TrimSpace(ct)), "application/json") {
		return nil, fmt.Errorf("the request body must be application/json, not %q", ct)
	}
	req, err := prefixkey.Parse(f, body)
	if err != nil {
		return nil, err
	}
	st.stream = req.Params.Stream
	return req, nil
}

// pick routes req (nil: no body, a request without prefix key) to an endpoint of the subset, and
// sends the answers build makes of the endpoint's header and metadata. An endpoint it cannot find
// is an immediate 503 answer.
func (st *stream) pick(req *prefixkey.Request, build func(*extprocv3.CommonResponse, *structpb.Struct) []*extprocv3.ProcessingResponse) error {
	if req == nil {
		req = &prefixkey.Request{}
	}
	cfg := &st.s.cfg
	ctx, eligible, err := st.restrict()
	if err != nil {
		st.release()
		return st.answer(http.StatusServiceUnavailable, "no_healthy_backend", err.Error())
	}
	d, err := cfg.Router.Route(ctx, req)
	var primary string
	switch {
	case err == nil:
		ep, ok := cfg.Endpoints.Endpoint(d.Backend)
		if !ok || (eligible != nil && !eligible[d.Backend]) {
			// A Router that knows a backend the pool does not, or that ignores the subset.
			d.Done(kvroute.Outcome{NotSent: true})
			st.s.countOutcome(kvroute.Outcome{NotSent: true})
			if ep, ok = st.firstEligible(eligible); !ok {
				st.release()
				return st.answer(http.StatusServiceUnavailable, "no_healthy_backend",
					fmt.Sprintf("the Router chose backend %s, which is not an eligible endpoint of the pool", d.Backend))
			}
			st.s.stats.failedOpen.Add(1)
			primary = ep
			break
		}
		st.d, primary = d, ep
		st.s.stats.picked.Add(1)
	case errors.Is(err, kvroute.ErrNoBackend):
		st.release()
		return st.answer(http.StatusServiceUnavailable, "no_healthy_backend", "no eligible endpoint is healthy")
	case st.ctx.Err() != nil:
		return st.ctx.Err()
	case cfg.FailureMode == FailOpen:
		ep, ok := st.firstEligible(eligible)
		if !ok {
			st.release()
			return st.answer(http.StatusServiceUnavailable, "no_healthy_backend", "no eligible endpoint")
		}
		st.s.log.Warn("kvroute could not route; sending the request to an endpoint in turn (failure_mode fail_open)",
			"path", st.path, "endpoint", ep, "error", err)
		st.s.stats.failedOpen.Add(1)
		primary = ep
	default:
		st.s.log.Warn("kvroute could not route; answering 503 (failure_mode fail_closed)", "path", st.path, "error", err)
		st.release()
		return st.answer(http.StatusServiceUnavailable, "routing_failed", "the gateway could not choose an endpoint")
	}
	st.endpoint = primary
	value := primary
	if cfg.Fallbacks > 0 {
		value = strings.Join(append([]string{primary}, st.fallbacks(req, eligible)...), ",")
	}
	common := &extprocv3.CommonResponse{
		ClearRouteCache: true,
		HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{
			Header:       &corev3.HeaderValue{Key: HeaderDestination, RawValue: []byte(value)},
			AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
		}}},
	}
	md := &structpb.Struct{Fields: map[string]*structpb.Value{
		cfg.DestinationNamespace: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			HeaderDestination: structpb.NewStringValue(value),
		}}),
	}}
	st.phase = phaseUpstream
	for _, resp := range build(common, md) {
		if err := st.send(resp); err != nil {
			return err
		}
	}
	return nil
}

// restrict returns the context to route with: the subset hint as kvroute.WithAvoid of every
// backend outside it, and the eligible backends (nil when every backend is). An empty subset, or
// one naming no endpoint of the pool, is an error.
func (st *stream) restrict() (context.Context, map[string]bool, error) {
	if !st.hasSubset {
		return st.ctx, nil, nil
	}
	eps := st.s.cfg.Endpoints
	eligible := make(map[string]bool, len(st.subset))
	for _, ep := range st.subset {
		if name, ok := eps.Backend(ep); ok {
			eligible[name] = true
		}
	}
	if len(eligible) == 0 {
		if len(st.subset) == 0 {
			return nil, nil, errors.New("the proxy's endpoint subset is empty")
		}
		return nil, nil, fmt.Errorf("none of the proxy's %d subset endpoints is an endpoint of the pool", len(st.subset))
	}
	var avoid []string
	for _, name := range eps.Backends() {
		if !eligible[name] {
			avoid = append(avoid, name)
		}
	}
	return kvroute.WithAvoid(st.ctx, avoid...), eligible, nil
}

// usable reports whether backend may take the request: in the subset (eligible nil: any) and in
// rotation.
func (st *stream) usable(backend string, eligible map[string]bool) bool {
	if eligible != nil && !eligible[backend] {
		return false
	}
	return st.s.cfg.InRotation == nil || st.s.cfg.InRotation(backend)
}

// firstEligible returns an endpoint in turn among the usable ones.
func (st *stream) firstEligible(eligible map[string]bool) (string, bool) {
	names := st.s.cfg.Endpoints.Backends()
	if len(names) == 0 {
		return "", false
	}
	start := int(st.s.turn.Add(1) % uint64(len(names)))
	for i := range names {
		name := names[(start+i)%len(names)]
		if st.usable(name, eligible) {
			if ep, ok := st.s.cfg.Endpoints.Endpoint(name); ok {
				return ep, true
			}
		}
	}
	return "", false
}

// fallbacks returns up to Config.Fallbacks endpoints after the picked one: the backends the
// decision found holding the most of the request's KV cache, then the others, starting at a place
// the request's prefix key sets (in turn without one).
func (st *stream) fallbacks(req *prefixkey.Request, eligible map[string]bool) []string {
	n := st.s.cfg.Fallbacks
	out := make([]string, 0, n)
	seen := map[string]bool{st.endpoint: true}
	add := func(name string) {
		if len(out) == n || !st.usable(name, eligible) {
			return
		}
		if ep, ok := st.s.cfg.Endpoints.Endpoint(name); ok && !seen[ep] {
			seen[ep] = true
			out = append(out, ep)
		}
	}
	if st.d != nil && len(st.d.Overlaps) > 0 {
		ranked := append([]kvroute.Overlap(nil), st.d.Overlaps...)
		sortOverlaps(ranked)
		for _, o := range ranked {
			if o.CachedBlocks > 0 {
				add(o.Backend)
			}
		}
	}
	if len(out) == n {
		return out
	}
	names := st.s.cfg.Endpoints.Backends()
	if len(names) == 0 {
		return out
	}
	var start uint64
	if st.d != nil && st.d.HasPrefixKey {
		k := st.d.PrefixKey
		for _, b := range k[:8] {
			start = start<<8 | uint64(b)
		}
	} else {
		start = st.s.turn.Add(1)
	}
	first := int(start % uint64(len(names)))
	for i := range names {
		add(names[(first+i)%len(names)])
	}
	return out
}

// sortOverlaps orders overlaps by score, highest first (insertion sort: a pool's few backends).
func sortOverlaps(o []kvroute.Overlap) {
	for i := 1; i < len(o); i++ {
		for j := i; j > 0 && o[j].Score > o[j-1].Score; j-- {
			o[j], o[j-1] = o[j-1], o[j]
		}
	}
}

// answer ends the request with the picker's own answer: an ImmediateResponse with an OpenAI- or
// Anthropic-style error body (the request path's format).
func (st *stream) answer(code int, errCode, msg string) error {
	st.s.countAnswer(code)
	f := prefixkey.FormatOfPath(st.path)
	e := apierror.Error{Status: code, Code: errCode, Message: msg}
	body, err := json.Marshal(e.Body(f))
	if err != nil {
		return err
	}
	st.phase = phaseEnded
	return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
		ImmediateResponse: &extprocv3.ImmediateResponse{
			Status: &typev3.HttpStatus{Code: typev3.StatusCode(code)},
			Headers: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{
				Header:       &corev3.HeaderValue{Key: "content-type", RawValue: []byte("application/json")},
				AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
			}}},
			Body:    body,
			Details: "kvroute_" + errCode,
		}}})
}

// responseHeaders notes the response's status and the endpoint that served it: when Envoy served
// the request on a fallback, the picked backend failed it, and the decision moves to the one that
// serves.
func (st *stream) responseHeaders(req *extprocv3.ProcessingRequest, h *extprocv3.HttpHeaders) error {
	if st.phase != phaseUpstream && st.phase != phaseBody {
		return fmt.Errorf("%w: response headers where none were expected", errProtocol)
	}
	// A response before the body's end (phaseBody): the upstream answered early; the stream
	// goes on as a response.
	for _, hv := range h.GetHeaders().GetHeaders() {
		if hv.GetKey() == ":status" {
			code, err := strconv.Atoi(headerValue(hv))
			if err != nil || code < 100 || code > 999 {
				code = -1 // an answer came, but no status: a failure
			}
			st.status = code
		}
	}
	st.phase = phaseResponse
	if served, ok := servedEndpoint(req.GetMetadataContext(), st.s.cfg.DestinationNamespace); ok && st.d != nil && served != st.endpoint {
		// Only an endpoint of the pool moves the decision: a served endpoint the pool does not
		// know (a misconfigured gateway) is no sign that the picked engine failed.
		if _, known := st.s.cfg.Endpoints.Backend(served); known {
			st.movedTo(served)
		} else {
			st.s.log.Debug("the gateway reports a served endpoint outside the pool; ignored", "served", served, "picked", st.endpoint)
		}
	}
	resp := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
		ResponseHeaders: &extprocv3.HeadersResponse{}}}
	if st.d != nil {
		resp.GetResponseHeaders().Response = &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{
			SetHeaders: []*corev3.HeaderValueOption{
				{Header: &corev3.HeaderValue{Key: "x-kvroute-backend", RawValue: []byte(st.d.Backend)},
					AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD},
				{Header: &corev3.HeaderValue{Key: "x-kvroute-route", RawValue: []byte(st.d.Reason.String())},
					AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD},
			}}}
	}
	if err := st.send(resp); err != nil {
		return err
	}
	if h.GetEndOfStream() {
		st.end(false)
	}
	return nil
}

// servedEndpoint reads the endpoint that served the request from the response's metadata.
func servedEndpoint(md *corev3.Metadata, namespace string) (string, bool) {
	v, ok := md.GetFilterMetadata()[namespace].GetFields()[KeyServed]
	if !ok || v.GetStringValue() == "" {
		return "", false
	}
	return strings.TrimSpace(v.GetStringValue()), true
}

// movedTo ends the decision on the picked backend as failed (Envoy went on to a fallback) and
// takes one on the backend that served, so that its load and the answer's timing count there.
func (st *stream) movedTo(served string) {
	failed := st.d
	st.d = nil
	o := kvroute.Outcome{Err: fmt.Errorf("%w: Envoy served the request on %s after %s", errServedElsewhere, served, st.endpoint)}
	failed.Done(o)
	st.s.countOutcome(o)
	st.s.stats.servedElsewhere.Add(1)
	name, ok := st.s.cfg.Endpoints.Backend(served)
	if !ok {
		return
	}
	var avoid []string
	for _, b := range st.s.cfg.Endpoints.Backends() {
		if b != name {
			avoid = append(avoid, b)
		}
	}
	d, err := st.s.cfg.Router.Route(kvroute.WithAvoid(st.ctx, avoid...), &prefixkey.Request{})
	if err != nil {
		return
	}
	if d.Backend != name {
		d.Done(kvroute.Outcome{NotSent: true})
		return
	}
	st.d, st.endpoint = d, served
}

// responseBody watches the answer go by: its first byte (a 2xx's first token), its usage and its
// end. In full duplex the chunk goes back to Envoy as it came.
func (st *stream) responseBody(b *extprocv3.HttpBody) error {
	if st.phase != phaseResponse {
		return fmt.Errorf("%w: response body before its headers", errProtocol)
	}
	chunk := b.GetBody()
	ok := st.status >= 200 && st.status < 300
	if ok && len(chunk) > 0 {
		if !st.firstSeen {
			st.firstSeen = true
			if st.d != nil {
				st.d.FirstToken()
			}
		}
		st.scan.Write(chunk)
	}
	var resp *extprocv3.BodyResponse
	if st.respMode == BodyFullDuplex {
		resp = &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
			BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
				StreamedResponse: &extprocv3.StreamedBodyResponse{Body: chunk, EndOfStream: b.GetEndOfStream()}}}}}
	} else {
		resp = &extprocv3.BodyResponse{}
	}
	if err := st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: resp}}); err != nil {
		return err
	}
	if b.GetEndOfStream() {
		st.end(false)
	}
	return nil
}

// responseTrailers end the response.
func (st *stream) responseTrailers() error {
	if st.phase != phaseResponse && st.phase != phaseEnded {
		return fmt.Errorf("%w: response trailers before the response", errProtocol)
	}
	if err := st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
		ResponseTrailers: &extprocv3.TrailersResponse{}}}); err != nil {
		return err
	}
	st.end(false)
	return nil
}

// end reports how the request ended to the Router, once. cut is whether the stream closed before
// the response did (Envoy's reset, the client leaving, the picker stopping).
func (st *stream) end(cut bool) {
	st.phase = phaseEnded
	d := st.d
	if d == nil {
		return
	}
	st.d = nil
	var o kvroute.Outcome
	switch {
	case st.status == 0:
		// No response came: the client left, or Envoy gave up before the engine answered.
		o.NotSent = true
	case st.status < 0:
		o.Err = errors.New("extproc: the answer's status could not be read")
	case st.status == http.StatusTooManyRequests || st.status == http.StatusServiceUnavailable:
		o.Refused = true
	case st.status >= 500:
		o.Err = fmt.Errorf("extproc: the engine answered %d", st.status)
	case cut && st.stream && st.respMode != BodyNone && !st.scan.Terminal():
		// The stream broke off before its last event: the client left mid-answer (or Envoy lost
		// the engine); as kvhttp does for a client that leaves, nothing is held against the engine.
		o.NotSent = true
	}
	if st.status >= 200 && st.status < 300 && !st.firstSeen {
		d.FirstToken() // an answer whose body the picker did not see (response body mode NONE)
	}
	d.Done(o)
	st.s.countOutcome(o)
}

// finish runs when the stream's goroutine returns: a request still in flight ends as cut, and
// the body's bytes go back to the budget.
func (st *stream) finish() {
	st.release()
	if st.d != nil {
		st.end(true)
	}
}

// send sends resp on the stream.
func (st *stream) send(resp *extprocv3.ProcessingResponse) error {
	return st.srv.Send(resp)
}

func attrResult(v string) attribute.KeyValue  { return attribute.String("result", v) }
func attrOutcome(v string) attribute.KeyValue { return attribute.String("outcome", v) }
