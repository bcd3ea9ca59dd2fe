package extproc_test

import (
	"context"
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/integrations/extproc"
)

// BenchmarkProcess is the picker's own work for one whole request, over a stream in memory (no
// gRPC): headers, a 1 KiB chat body in full duplex, the pick with tier 1 over three backends,
// the body handed back, the response's headers and body, Done.
func BenchmarkProcess(b *testing.B) {
	eps := extproc.NewEndpoints()
	var backends []kvroute.Backend
	for i, ep := range []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"} {
		name := string(rune('a' + i))
		backends = append(backends, kvroute.Backend{Name: name})
		if err := eps.Set(name, ep); err != nil {
			b.Fatal(err)
		}
	}
	r, err := kvroute.New(kvroute.Config{Backends: backends})
	if err != nil {
		b.Fatal(err)
	}
	defer r.Close()
	srv, err := extproc.New(extproc.Config{Router: r, Endpoints: eps})
	if err != nil {
		b.Fatal(err)
	}
	body := []byte(chat("m", strings.Repeat("You are a careful assistant. ", 36), "What is the capital of France?", false))
	msgs := []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
				{Key: ":method", RawValue: []byte("POST")}, {Key: ":path", RawValue: []byte("/v1/chat/completions")},
				{Key: "content-type", RawValue: []byte("application/json")}}}}},
			ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
				ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED}},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}}},
	}
	msgs = append(msgs, responseMessages()...)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	ctx := context.Background()
	for b.Loop() {
		ms := &memStream{ctx: ctx, in: msgs}
		if err := srv.Process(ms); err != nil || len(ms.sent) != 4 {
			b.Fatalf("%v, %d answers", err, len(ms.sent))
		}
	}
}
