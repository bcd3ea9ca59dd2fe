// Package envoysim is a stand-in for Envoy in front of an endpoint picker: an http.Handler that
// does, in Go, what Envoy's ext_proc filter and an ORIGINAL_DST cluster do with a request. It
// sends the request's headers and body over an ext_proc stream as Envoy does in the body mode
// given (full duplex, buffered, streamed or none, naming the mode in protocol_config), applies
// the picker's header mutations, answers the picker's immediate responses, forwards the request
// to the endpoint the x-gateway-destination-endpoint header names (the next one listed when a
// connection fails, as Envoy's retries go down the list), reports the endpoint that served in
// the response's metadata, and streams the response back through the picker.
//
// It exists so that kvroute-epp can be tried, tested and measured where no Envoy runs: the
// demo's gateway, the protocol tests, the SDK end-to-end test and the overhead benchmark use it.
// It is not a production proxy: no TLS to upstreams, no connection limits, no retry budget.
package envoysim

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvroute/kvroute/integrations/extproc"
)

// Config configures a Forwarder. Client is required.
type Config struct {
	// Client is the endpoint picker's ext_proc client.
	Client extprocv3.ExternalProcessorClient
	// RequestBodyMode and ResponseBodyMode are the ext_proc filter's body modes (default full
	// duplex, the mode the Endpoint Picker Protocol requires).
	RequestBodyMode, ResponseBodyMode extproc.BodyMode
	// OmitProtocolConfig leaves protocol_config out of the first message, as Envoy before 1.35
	// does.
	OmitProtocolConfig bool
	// ChunkSize is the size of the body chunks sent in the streamed modes (default 16 KiB).
	ChunkSize int
	// Subset, when set, gives a request's subset hint (nil: none); the hint is sent under
	// extproc.DefaultSubsetNamespace.
	Subset func(r *http.Request) []string
	// Transport carries the requests to the endpoints (default http.DefaultTransport).
	Transport http.RoundTripper
	// MaxBodyBytes caps the request bodies it reads from clients (default 64 MiB; a longer one
	// is answered 413 without asking the picker), as Envoy's buffer limits do.
	MaxBodyBytes int64
}

// Forwarder is the stand-in's http.Handler. Safe for concurrent use.
type Forwarder struct {
	cfg Config
}

// New returns a Forwarder.
func New(cfg Config) (*Forwarder, error) {
	if cfg.Client == nil {
		return nil, errors.New("envoysim: Config.Client is required")
	}
	if cfg.ChunkSize <= 0 {
		cfg.ChunkSize = 16 << 10
	}
	if cfg.Transport == nil {
		cfg.Transport = http.DefaultTransport
	}
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = 64 << 20
	}
	return &Forwarder{cfg: cfg}, nil
}

// sendMode maps a BodyMode to Envoy's.
func sendMode(m extproc.BodyMode) filterv3.ProcessingMode_BodySendMode {
	switch m {
	case extproc.BodyBuffered:
		return filterv3.ProcessingMode_BUFFERED
	case extproc.BodyStreamed:
		return filterv3.ProcessingMode_STREAMED
	case extproc.BodyNone:
		return filterv3.ProcessingMode_NONE
	}
	return filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
}

// exchange is one request's ext_proc stream.
type exchange struct {
	f      *Forwarder
	stream extprocv3.ExternalProcessor_ProcessClient
}

// ServeHTTP implements http.Handler.
func (f *Forwarder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, f.cfg.MaxBodyBytes))
	if err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			http.Error(w, "request body too large", http.StatusRequestEntityTooLarge)
		}
		return
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel() // ends the ext_proc stream as Envoy does when the request ends
	stream, err := f.cfg.Client.Process(ctx)
	if err != nil {
		http.Error(w, "ext_proc unavailable: "+err.Error(), http.StatusInternalServerError)
		return
	}
	x := &exchange{f: f, stream: stream}
	out, immediate, err := x.request(r, body)
	if err != nil {
		http.Error(w, "ext_proc: "+err.Error(), http.StatusInternalServerError)
		return
	}
	if immediate != nil {
		writeImmediate(w, immediate)
		return
	}
	x.forward(ctx, w, r, out)
	_ = stream.CloseSend()
}

// upstreamRequest is what the picker made of the request: its headers and body.
type upstreamRequest struct {
	header http.Header
	body   []byte
}

// request runs the request phases: headers, then the body as the mode sends it.
func (x *exchange) request(r *http.Request, body []byte) (*upstreamRequest, *extprocv3.ImmediateResponse, error) {
	cfg := &x.f.cfg
	out := &upstreamRequest{header: r.Header.Clone(), body: body}
	hdrs := []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte(r.Method)},
		{Key: ":path", RawValue: []byte(r.URL.RequestURI())},
		{Key: ":authority", RawValue: []byte(r.Host)},
		{Key: ":scheme", RawValue: []byte("http")},
	}
	for k, vs := range r.Header {
		for _, v := range vs {
			hdrs = append(hdrs, &corev3.HeaderValue{Key: strings.ToLower(k), RawValue: []byte(v)})
		}
	}
	noBody := len(body) == 0
	first := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: hdrs}, EndOfStream: noBody}}}
	if !cfg.OmitProtocolConfig {
		first.ProtocolConfig = &extprocv3.ProtocolConfiguration{
			RequestBodyMode: sendMode(cfg.RequestBodyMode), ResponseBodyMode: sendMode(cfg.ResponseBodyMode)}
	}
	if cfg.Subset != nil {
		if subset := cfg.Subset(r); subset != nil {
			list := make([]any, len(subset))
			for i, s := range subset {
				list[i] = s
			}
			v, err := structpb.NewStruct(map[string]any{extproc.KeySubset: list})
			if err != nil {
				return nil, nil, err
			}
			first.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{extproc.DefaultSubsetNamespace: v}}
		}
	}
	if err := x.stream.Send(first); err != nil {
		return nil, nil, err
	}
	mode := cfg.RequestBodyMode
	if noBody {
		mode = extproc.BodyNone
	}
	switch mode {
	case extproc.BodyFullDuplex:
		// Envoy streams the body without waiting; the picker answers the headers, then sends the
		// body back.
		if err := x.sendChunks(body); err != nil {
			return nil, nil, err
		}
		resp, im, err := x.answer(out.header)
		if im != nil || err != nil {
			return nil, im, err
		}
		if resp.GetRequestHeaders() == nil {
			return nil, nil, fmt.Errorf("want the request headers' answer, got %T", resp.Response)
		}
		var back bytes.Buffer
		for {
			resp, im, err := x.answer(out.header)
			if im != nil || err != nil {
				return nil, im, err
			}
			sb := resp.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
			if sb == nil {
				return nil, nil, fmt.Errorf("want a streamed body answer, got %T", resp.Response)
			}
			back.Write(sb.GetBody())
			if sb.GetEndOfStream() {
				break
			}
		}
		out.body = back.Bytes()
	case extproc.BodyBuffered:
		// Envoy waits for the headers' answer, sends the body whole, and holds the headers until
		// the body's answer.
		if _, im, err := x.answer(out.header); im != nil || err != nil {
			return nil, im, err
		}
		if err := x.stream.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
			RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}}}); err != nil {
			return nil, nil, err
		}
		if _, im, err := x.answer(out.header); im != nil || err != nil {
			return nil, im, err
		}
	default: // none, streamed: the picker answers the headers alone
		if _, im, err := x.answer(out.header); im != nil || err != nil {
			return nil, im, err
		}
		if mode == extproc.BodyStreamed {
			for i := 0; i < len(body); i += cfg.ChunkSize {
				end := min(i+cfg.ChunkSize, len(body))
				if err := x.stream.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
					RequestBody: &extprocv3.HttpBody{Body: body[i:end], EndOfStream: end == len(body)}}}); err != nil {
					return nil, nil, err
				}
				if _, im, err := x.answer(out.header); im != nil || err != nil {
					return nil, im, err
				}
			}
		}
	}
	return out, nil, nil
}

// answer receives the picker's next answer to a request phase: an immediate response, or one
// whose header mutation (in the headers' or the body's common response) it applies to h.
func (x *exchange) answer(h http.Header) (*extprocv3.ProcessingResponse, *extprocv3.ImmediateResponse, error) {
	resp, err := x.stream.Recv()
	if err != nil {
		return nil, nil, err
	}
	if im := resp.GetImmediateResponse(); im != nil {
		return nil, im, nil
	}
	common := resp.GetRequestHeaders().GetResponse()
	if common == nil {
		common = resp.GetRequestBody().GetResponse()
	}
	applyHeaders(h, common.GetHeaderMutation())
	return resp, nil, nil
}

// sendChunks sends body in ChunkSize chunks, the last with end_of_stream.
func (x *exchange) sendChunks(body []byte) error {
	n := x.f.cfg.ChunkSize
	for i := 0; i < len(body); i += n {
		end := min(i+n, len(body))
		if err := x.stream.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
			RequestBody: &extprocv3.HttpBody{Body: body[i:end], EndOfStream: end == len(body)}}}); err != nil {
			return err
		}
	}
	return nil
}

// applyHeaders applies a header mutation to h.
func applyHeaders(h http.Header, m *extprocv3.HeaderMutation) {
	for _, o := range m.GetSetHeaders() {
		v := o.GetHeader().GetRawValue()
		if len(v) == 0 {
			v = []byte(o.GetHeader().GetValue())
		}
		h.Set(o.GetHeader().GetKey(), string(v))
	}
	for _, k := range m.GetRemoveHeaders() {
		h.Del(k)
	}
}

// writeImmediate writes the picker's own answer to the client.
func writeImmediate(w http.ResponseWriter, im *extprocv3.ImmediateResponse) {
	applyHeaders(w.Header(), im.GetHeaders())
	code := int(im.GetStatus().GetCode())
	if code == 0 {
		code = http.StatusOK
	}
	w.WriteHeader(code)
	_, _ = w.Write(im.GetBody())
}

// forward sends the request to the destination's endpoints in order until one answers, then runs
// the response phases.
func (x *exchange) forward(ctx context.Context, w http.ResponseWriter, r *http.Request, out *upstreamRequest) {
	dest := out.header.Get(extproc.HeaderDestination)
	out.header.Del(extproc.HeaderDestination)
	var res *http.Response
	served := ""
	var lastErr error
	for ep := range strings.SplitSeq(dest, ",") {
		ep = strings.TrimSpace(ep)
		if ep == "" {
			continue
		}
		req, err := http.NewRequestWithContext(ctx, r.Method, "http://"+ep+r.URL.RequestURI(), bytes.NewReader(out.body))
		if err != nil {
			lastErr = err
			continue
		}
		req.Header = out.header.Clone()
		req.ContentLength = int64(len(out.body))
		if res, lastErr = x.f.cfg.Transport.RoundTrip(req); lastErr == nil {
			served = ep
			break
		}
		if ctx.Err() != nil {
			return
		}
	}
	if res == nil {
		// Envoy's own answer when no endpoint could be reached; it too goes through the filter.
		msg := "no endpoint could be reached"
		if lastErr != nil {
			msg += ": " + lastErr.Error()
		}
		res = &http.Response{StatusCode: http.StatusServiceUnavailable, Header: http.Header{"Content-Type": {"text/plain"}},
			Body: io.NopCloser(strings.NewReader(msg))}
	}
	defer res.Body.Close()
	x.response(w, res, served)
}

// response runs the response phases: headers (with the served endpoint), then the body as the
// response mode sends it, to the client as the picker hands it back.
func (x *exchange) response(w http.ResponseWriter, res *http.Response, served string) {
	cfg := &x.f.cfg
	hdrs := []*corev3.HeaderValue{{Key: ":status", RawValue: []byte(strconv.Itoa(res.StatusCode))}}
	for k, vs := range res.Header {
		for _, v := range vs {
			hdrs = append(hdrs, &corev3.HeaderValue{Key: strings.ToLower(k), RawValue: []byte(v)})
		}
	}
	msg := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: hdrs}}}}
	if served != "" {
		md, _ := structpb.NewStruct(map[string]any{extproc.KeyServed: served})
		msg.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{extproc.DefaultDestinationNamespace: md}}
	}
	if err := x.stream.Send(msg); err != nil {
		return
	}
	resp, err := x.stream.Recv()
	if err != nil {
		return
	}
	for k, vs := range res.Header {
		w.Header()[k] = vs
	}
	applyHeaders(w.Header(), resp.GetResponseHeaders().GetResponse().GetHeaderMutation())
	w.WriteHeader(res.StatusCode)
	flush := func() { _ = http.NewResponseController(w).Flush() }
	flush()
	mode := cfg.ResponseBodyMode
	if mode == extproc.BodyBuffered {
		body, err := io.ReadAll(res.Body)
		if err != nil {
			return
		}
		if err := x.stream.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
			ResponseBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}}}); err != nil {
			return
		}
		if _, err := x.stream.Recv(); err != nil {
			return
		}
		_, _ = w.Write(body)
		return
	}
	buf := make([]byte, 32<<10)
	for {
		n, rerr := res.Body.Read(buf)
		if rerr != nil && rerr != io.EOF {
			return // the engine broke off: Envoy resets the stream, and so does the return
		}
		eos := rerr == io.EOF
		if mode == extproc.BodyNone {
			if n > 0 {
				if _, err := w.Write(buf[:n]); err != nil {
					return
				}
				flush()
			}
			if eos {
				return
			}
			continue
		}
		if n == 0 && !eos {
			continue
		}
		if err := x.stream.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
			ResponseBody: &extprocv3.HttpBody{Body: bytes.Clone(buf[:n]), EndOfStream: eos}}}); err != nil {
			return
		}
		resp, err := x.stream.Recv()
		if err != nil {
			return
		}
		chunk := buf[:n]
		if mode == extproc.BodyFullDuplex {
			chunk = resp.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody()
		}
		if len(chunk) > 0 {
			if _, err := w.Write(chunk); err != nil {
				return
			}
			flush()
		}
		if eos {
			return
		}
	}
}
