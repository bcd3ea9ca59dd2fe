package extproc_test

import (
	"context"
	"io"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/integrations/extproc"
)

// memStream is an ext_proc stream in memory: the messages Envoy would send, and what the picker
// answered. It stands for the gRPC transport only, so that a fuzz run drives Process thousands
// of times a second.
type memStream struct {
	grpc.ServerStream
	ctx  context.Context
	in   []*extprocv3.ProcessingRequest
	sent []*extprocv3.ProcessingResponse
}

func (m *memStream) Context() context.Context { return m.ctx }

func (m *memStream) Recv() (*extprocv3.ProcessingRequest, error) {
	if len(m.in) == 0 {
		return nil, io.EOF
	}
	r := m.in[0]
	m.in = m.in[1:]
	return r, nil
}

func (m *memStream) Send(r *extprocv3.ProcessingResponse) error {
	m.sent = append(m.sent, r)
	return nil
}

func (m *memStream) SetHeader(metadata.MD) error  { return nil }
func (m *memStream) SendHeader(metadata.MD) error { return nil }
func (m *memStream) SetTrailer(metadata.MD)       {}

// FuzzProcess sends the picker a request of any path and body, in chunks of any size and in
// any body mode, followed by a response: it never panics, answers either with a destination of
// the pool or with its own 400, 413 or 503, and leaves no decision open.
func FuzzProcess(f *testing.F) {
	f.Add(uint8(0), uint8(4), `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, uint16(7))
	f.Add(uint8(1), uint8(2), `{"model":"m","prompt":"once upon"}`, uint16(100))
	f.Add(uint8(2), uint8(4), `{"model":"m","max_tokens":4,"messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}`, uint16(1))
	f.Add(uint8(0), uint8(4), `{"model":`, uint16(3))
	f.Add(uint8(3), uint8(0), ``, uint16(0))
	paths := []string{"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/models", "/v1/chat/completions?x=1"}
	modes := []filterv3.ProcessingMode_BodySendMode{filterv3.ProcessingMode_NONE, filterv3.ProcessingMode_STREAMED,
		filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_BUFFERED_PARTIAL, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED}
	eps := extproc.NewEndpoints()
	var backends []kvroute.Backend
	for i, ep := range []string{"127.0.0.1:9101", "127.0.0.1:9102", "127.0.0.1:9103"} {
		name := string(rune('a' + i))
		backends = append(backends, kvroute.Backend{Name: name})
		if err := eps.Set(name, ep); err != nil {
			f.Fatal(err)
		}
	}
	r, err := kvroute.New(kvroute.Config{Backends: backends, RefusalHold: -1})
	if err != nil {
		f.Fatal(err)
	}
	srv, err := extproc.New(extproc.Config{Router: r, Endpoints: eps, Fallbacks: 2, MaxBodyBytes: 1 << 16})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, pathSel, modeSel uint8, body string, chunk uint16) {
		mode := modes[int(modeSel)%len(modes)]
		path := paths[int(pathSel)%len(paths)]
		in := []*extprocv3.ProcessingRequest{{
			Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
				Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
					{Key: ":method", RawValue: []byte("POST")}, {Key: ":path", RawValue: []byte(path)}}},
				EndOfStream: body == ""}},
			ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: mode, ResponseBodyMode: mode},
		}}
		if body != "" && mode != filterv3.ProcessingMode_NONE {
			n := max(int(chunk), 1)
			if mode == filterv3.ProcessingMode_BUFFERED {
				n = len(body)
			}
			for i := 0; i < len(body); i += n {
				end := min(i+n, len(body))
				in = append(in, &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
					RequestBody: &extprocv3.HttpBody{Body: []byte(body[i:end]), EndOfStream: end == len(body)}}})
			}
		}
		in = append(in, responseMessages()...)
		ms := &memStream{ctx: context.Background(), in: in}
		if err := srv.Process(ms); err != nil {
			return // a protocol error ends the stream; nothing may be left open (checked below)
		}
		var picked, answered bool
		for _, m := range ms.sent {
			if im := m.GetImmediateResponse(); im != nil {
				if c := im.GetStatus().GetCode(); c != 400 && c != 413 && c != 503 {
					t.Fatalf("immediate answer %d", c)
				}
				answered = true
			}
			if dest := m.GetDynamicMetadata().GetFields()[extproc.DefaultDestinationNamespace]; dest != nil {
				picked = true
			}
		}
		if picked == answered {
			t.Fatalf("picked %v, answered %v: want exactly one (%d messages)", picked, answered, len(ms.sent))
		}
		st, err := r.Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range st.Backends {
			if b.InFlight != 0 {
				t.Fatalf("backend %s holds %d slots after the stream ended", b.Name, b.InFlight)
			}
		}
	})
}
