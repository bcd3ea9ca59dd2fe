package extproc_test

import (
	"context"
	"strings"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/integrations/extproc"
	"github.com/kvroute/kvroute/kvhttp"
)

// expect408 reads the stream's next answer and fails unless it is the picker's own 408.
func expect408(t *testing.T, s *rawStream, what string) {
	t.Helper()
	if im := s.recv().GetImmediateResponse(); im == nil || im.GetStatus().GetCode() != 408 {
		t.Fatalf("%s: want an immediate 408, got %v", what, im)
	}
}

// TestStalledBodiesAreBounded: a body kept alive by empty chunks, or trickled a byte at a time
// past the read timeout, is answered 408; in buffered mode, where Envoy gathers the body before
// it sends it, a long wait for the body is no fault.
func TestStalledBodiesAreBounded(t *testing.T) {
	_, r, eps := staticPool(t, 2)
	h := newHarness(t, extproc.Config{Router: r, Endpoints: eps, BodyIdleTimeout: 200 * time.Millisecond, ReadTimeout: 600 * time.Millisecond})
	ctx := context.Background()

	s := h.open(ctx)
	s.headers("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, nil)
	s.body(`{"model":`, false)
	stop := make(chan struct{})
	go func(s *rawStream, stop chan struct{}) { // empty chunks, as often as a gateway might send them
		for {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
				if s.s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
					RequestBody: &extprocv3.HttpBody{}}}) != nil {
					return
				}
			}
		}
	}(s, stop)
	expect408(t, s, "empty chunks")
	close(stop)

	s = h.open(ctx)
	s.headers("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, nil)
	stop = make(chan struct{})
	go func(s *rawStream, stop chan struct{}) { // a byte every 100 ms: never idle, never done
		for {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
				if s.s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
					RequestBody: &extprocv3.HttpBody{Body: []byte(" ")}}}) != nil {
					return
				}
			}
		}
	}(s, stop)
	expect408(t, s, "a trickled body")
	close(stop)

	// Buffered: the picker's own harness without a read timeout, so that only the idle timeout,
	// which must not apply, could cut the wait.
	h = newHarness(t, extproc.Config{Router: r, Endpoints: eps, BodyIdleTimeout: 200 * time.Millisecond, ReadTimeout: -1})
	s = h.open(ctx)
	s.headers("/v1/chat/completions", false, filterv3.ProcessingMode_BUFFERED, nil)
	s.recv()
	time.Sleep(400 * time.Millisecond) // Envoy gathering a slow upload: longer than the idle timeout
	s.body(chat("m", "s", "u", false), true)
	if d := destination(t, s.recv()); d == "" {
		t.Fatal("buffered: no destination after a slow upload")
	}
	_ = s.s.CloseSend()
	h.router.waitAllDone(t)
}

// TestLargeBodiesLeaveRoomForSmall: bodies that stall while holding the body budget take at
// most three quarters of it; a small request still gets its pick.
func TestLargeBodiesLeaveRoomForSmall(t *testing.T) {
	_, r, eps := staticPool(t, 2)
	budget := kvhttp.NewBudget(1 << 20)
	h := newHarness(t, extproc.Config{Router: r, Endpoints: eps, BodyBudget: budget, MaxBodyBytes: 256 << 10})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	chunk := strings.Repeat("x", 128<<10)
	stall := func() *rawStream { // a 128 KiB body that never ends
		s := h.open(ctx)
		s.headers("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, nil)
		s.body(chunk, false)
		return s
	}
	for range 6 { // 768 KiB: three quarters of the budget, the most large bodies may hold
		stall()
	}
	deadline := time.Now().Add(5 * time.Second)
	for budget.TryAcquire(300 << 10) { // until the six hold their bytes
		budget.Release(300 << 10)
		if time.Now().After(deadline) {
			t.Fatal("the stalled bodies never held the budget")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if im := stall().recv().GetImmediateResponse(); im == nil || im.GetStatus().GetCode() != 503 {
		t.Fatalf("a seventh large body took the small bodies' reserve: %v", im)
	}
	s := h.open(context.Background())
	s.headers("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, nil)
	s.body(chat("m", "small", "request", false), true)
	if d := destination(t, s.recv()); d == "" {
		t.Fatal("a small request found no room")
	}
	_ = s.s.CloseSend()
}

// TestBufferedTrailers: in buffered mode a body followed by trailers is picked at the body, and
// trailers without a body are answered 400 (the endpoint cannot be named after the headers'
// answer).
func TestBufferedTrailers(t *testing.T) {
	_, r, eps := staticPool(t, 2)
	h := newHarness(t, extproc.Config{Router: r, Endpoints: eps})
	trailers := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{
		RequestTrailers: &extprocv3.HttpTrailers{}}}
	s := h.open(context.Background())
	s.headers("/v1/chat/completions", false, filterv3.ProcessingMode_BUFFERED, nil)
	s.recv()
	s.body(chat("m", "s", "u", false), false)
	if d := destination(t, s.recv()); d == "" {
		t.Fatal("no destination at the buffered body")
	}
	s.send(trailers)
	if s.recv().GetRequestTrailers() == nil {
		t.Fatal("the trailers got no answer")
	}
	_ = s.s.CloseSend()

	s = h.open(context.Background())
	s.headers("/v1/chat/completions", false, filterv3.ProcessingMode_BUFFERED, nil)
	s.recv()
	s.send(trailers)
	if im := s.recv().GetImmediateResponse(); im == nil || im.GetStatus().GetCode() != 400 {
		t.Fatalf("trailers without a body: %v", im)
	}
	h.router.waitAllDone(t)
}

// TestServedOutsideThePoolIsIgnored: a served endpoint the pool does not know does not count
// against the picked engine.
func TestServedOutsideThePoolIsIgnored(t *testing.T) {
	_, r, eps := staticPool(t, 2)
	h := newHarness(t, extproc.Config{Router: r, Endpoints: eps})
	s := h.open(context.Background())
	s.headers("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, nil)
	s.body(chat("m", "s", "u", false), true)
	s.recv()
	s.recv()
	s.responseHeaders(200, "10.9.9.9:1")
	s.recv()
	s.responseBody("{}", true)
	s.recv()
	_ = s.s.CloseSend()
	recs := h.router.waitAllDone(t)
	if len(recs) != 1 || recs[0].Outcome() != (kvroute.Outcome{}) || h.srv.Stats().ServedElsewhere != 0 {
		t.Fatalf("outcome %+v, served elsewhere %d: want a success on the picked engine", recs[0].Outcome(), h.srv.Stats().ServedElsewhere)
	}
}
