package extproc_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/integrations/extproc"
	"github.com/kvroute/kvroute/integrations/extproc/app"
	"github.com/kvroute/kvroute/integrations/extproc/envoysim"
	"github.com/kvroute/kvroute/internal/enginesim"
	"github.com/kvroute/kvroute/prefixkey"
)

// bodyModes are the ways Envoy may send bodies that the picker reads.
var bodyModes = []struct {
	name string
	cfg  envoysim.Config
}{
	{"full_duplex", envoysim.Config{RequestBodyMode: extproc.BodyFullDuplex, ResponseBodyMode: extproc.BodyFullDuplex, ChunkSize: 64}},
	{"buffered", envoysim.Config{RequestBodyMode: extproc.BodyBuffered, ResponseBodyMode: extproc.BodyBuffered}},
	{"full_duplex_without_protocol_config", envoysim.Config{RequestBodyMode: extproc.BodyFullDuplex,
		ResponseBodyMode: extproc.BodyFullDuplex, OmitProtocolConfig: true, ChunkSize: 100}},
}

// simPool starts three simulated vLLM engines with their KV events over ZMQ and the picker's
// composition (package app) over them.
func simPool(t *testing.T) (*app.App, []enginesim.EngineInfo) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	fleet, err := enginesim.StartFleet(ctx, enginesim.FleetConfig{N: 3, ZMQ: true, Base: enginesim.Config{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fleet.Close() })
	info := fleet.Info()
	cfg := app.DemoConfig(info)
	cfg.EndpointPicker.FallbackEndpoints = 1
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	a, err := app.New(cfg, app.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close() })
	if err := a.Start(ctx); err != nil {
		t.Fatal(err)
	}
	return a, info
}

// TestPicksTheKVHolder: an engine that served a conversation holds its KV cache; the picker,
// in every body mode, sends the conversation's next turn there, names it in the destination
// header and the envoy.lb metadata, and Envoy (envoysim) forwards it there.
func TestPicksTheKVHolder(t *testing.T) {
	a, info := simPool(t)
	h := newHarness(t, extproc.Config{Router: a.Router, Endpoints: a.Endpoints, InRotation: a.Health.InRotation, Fallbacks: 1})
	for i, mode := range bodyModes {
		t.Run(mode.name, func(t *testing.T) {
			holder := info[(i+1)%len(info)]
			system := fmt.Sprintf("You are assistant %d. %s", i, strings.Repeat("Answer with care and cite your sources. ", 20))
			// The engine serves the first turn directly: only its KV events can tell the picker.
			// (A ZMQ subscription that is still being set up misses what the engine publishes;
			// the engine's next batch shows the gap and the replay fills it, so turns with new
			// blocks, hence new batches, are sent until the index knows.)
			next := chat(holder.Model, system, "second question", false)
			req, err := prefixkey.ParseOpenAIChat([]byte(next))
			if err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(10 * time.Second)
			for turn := 0; ; turn++ {
				first := fmt.Sprintf("first question, asked in turn %d, with words enough to fill a block of its own", turn)
				res, err := http.Post(holder.URL+"/v1/chat/completions", "application/json",
					strings.NewReader(chat(holder.Model, system, first, false)))
				if err != nil {
					t.Fatal(err)
				}
				res.Body.Close()
				p, err := a.Router.Probe(context.Background(), req)
				for wait := time.Now().Add(500 * time.Millisecond); err == nil && p.Reason != kvroute.ReasonKVAware && time.Now().Before(wait); {
					time.Sleep(20 * time.Millisecond)
					p, err = a.Router.Probe(context.Background(), req)
				}
				if err == nil && p.Backend == holder.Name && p.Reason == kvroute.ReasonKVAware {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the index never learned that %s holds the conversation: %+v %v", holder.Name, p, err)
				}
			}
			gw := h.gateway(mode.cfg)
			res, body := post(t, gw.URL, next)
			if res.StatusCode != 200 {
				t.Fatalf("status %d: %s", res.StatusCode, body)
			}
			if got := res.Header.Get(enginesim.HeaderEngine); got != holder.Name {
				t.Errorf("served by %s, want the KV holder %s", got, holder.Name)
			}
			if got := res.Header.Get("X-Kvroute-Route"); got != "kv_aware" {
				t.Errorf("X-Kvroute-Route %q, want kv_aware", got)
			}
			if got := res.Header.Get("X-Kvroute-Backend"); got != holder.Name {
				t.Errorf("X-Kvroute-Backend %q, want %s", got, holder.Name)
			}
		})
	}
	for _, rc := range h.router.waitAllDone(t) {
		if o := rc.Outcome(); o.Err != nil || o.NotSent || o.Refused || rc.first.Load() != 1 {
			t.Errorf("decision on %s ended %+v with %d first tokens, want a success with one", rc.backend, o, rc.first.Load())
		}
	}
}

// TestDestinationHeaderAndMetadata reads the picker's answers message by message: in full duplex
// the headers' answer carries the endpoint and the body follows it whole; in buffered mode the
// headers' answer is empty and the body's carries it; with fallbacks the header lists the picked
// endpoint first, then others, each an endpoint of the pool, none twice.
func TestDestinationHeaderAndMetadata(t *testing.T) {
	_, r, eps := staticPool(t, 3)
	h := newHarness(t, extproc.Config{Router: r, Endpoints: eps, Fallbacks: 2})
	ctx := context.Background()
	body := chat("m", "sys", "hello", false)

	s := h.open(ctx)
	s.headers("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, nil)
	s.body(body[:10], false)
	s.body(body[10:], true)
	dest := destination(t, s.recv())
	list := strings.Split(dest, ",")
	if len(list) != 3 {
		t.Fatalf("destination %q: want the pick and two fallbacks", dest)
	}
	seen := map[string]bool{}
	for _, ep := range list {
		if _, ok := eps.Backend(ep); !ok || seen[ep] {
			t.Fatalf("destination %q: %s is not a distinct endpoint of the pool", dest, ep)
		}
		seen[ep] = true
	}
	back := s.recv().GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
	if string(back.GetBody()) != body || !back.GetEndOfStream() {
		t.Fatalf("full duplex: the body came back as %q (end %v), want it whole", back.GetBody(), back.GetEndOfStream())
	}
	s.responseHeaders(200, "")
	if got := s.recv().GetResponseHeaders().GetResponse().GetHeaderMutation().GetSetHeaders(); len(got) == 0 {
		t.Error("the response headers' answer sets no X-Kvroute-Backend")
	}
	s.responseBody(`{"usage":{"prompt_tokens_details":{"cached_tokens":3}}}`, true)
	if got := s.recv().GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse(); !got.GetEndOfStream() {
		t.Error("the response body did not come back with its end")
	}
	_ = s.s.CloseSend()

	s = h.open(ctx)
	s.headers("/v1/chat/completions", false, filterv3.ProcessingMode_BUFFERED, nil)
	if m := s.recv(); m.GetRequestHeaders() == nil || len(m.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders()) != 0 ||
		fmt.Sprint(m.GetRequestHeaders().GetResponse().GetHeaderMutation().GetRemoveHeaders()) != "["+extproc.HeaderDestination+"]" {
		t.Fatalf("buffered: the headers' answer must come at once, set nothing and remove a client's destination: %v", m)
	}
	s.body(body, true)
	if d := destination(t, s.recv()); d == "" {
		t.Fatal("buffered: no destination")
	}
	_ = s.s.CloseSend()

	// A request without a body (GET) is picked at its headers.
	s = h.open(ctx)
	s.headers("/v1/models", true, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, nil)
	if d := destination(t, s.recv()); d == "" {
		t.Fatal("bodiless: no destination")
	}
	_ = s.s.CloseSend()
	for _, rc := range h.router.waitAllDone(t) {
		_ = rc
	}
}

// TestSubsetHintIsObeyed: with the proxy's subset hint the picker chooses only from it, even away
// from the ring's owner, for every request; an empty subset or one of unknown endpoints is the
// protocol's 503.
func TestSubsetHintIsObeyed(t *testing.T) {
	engines, r, eps := staticPool(t, 3)
	h := newHarness(t, extproc.Config{Router: r, Endpoints: eps, Fallbacks: 2})
	only := engines[1].endpoint()
	gw := h.gateway(envoysim.Config{Subset: func(*http.Request) []string { return []string{only} }})
	for i := range 12 {
		res, body := post(t, gw.URL, chat("m", fmt.Sprintf("system %d", i), "hi", false))
		if res.StatusCode != 200 || res.Header.Get("X-Engine") != engines[1].name {
			t.Fatalf("request %d: status %d, engine %q, want engine-1 (the subset): %s", i, res.StatusCode, res.Header.Get("X-Engine"), body)
		}
	}
	ctx := context.Background()
	s := h.open(ctx)
	s.headers("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, []string{only, engines[2].endpoint()})
	s.body(chat("m", "s", "u", false), true)
	list := strings.Split(destination(t, s.recv()), ",")
	for _, ep := range list {
		if ep != only && ep != engines[2].endpoint() {
			t.Errorf("destination %v goes outside the subset", list)
		}
	}
	_ = s.s.CloseSend()

	for name, subset := range map[string][]string{"empty": {}, "unknown": {"10.255.0.1:8000"}} {
		s := h.open(ctx)
		s.headers("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, subset)
		s.body(chat("m", "s", "u", false), true)
		im := s.recv().GetImmediateResponse()
		if im == nil || im.GetStatus().GetCode() != 503 {
			t.Errorf("%s subset: want an immediate 503, got %v", name, im)
		}
		_ = s.s.CloseSend()
	}
	h.router.waitAllDone(t)
}

// TestMalformedGetsImmediateError: a body that is not the endpoint's JSON gets the immediate 400
// with an OpenAI-style error body, at once, and the Router is never asked; a body over the limit
// gets 413; the engines see nothing.
func TestMalformedGetsImmediateError(t *testing.T) {
	engines, r, eps := staticPool(t, 2)
	h := newHarness(t, extproc.Config{Router: r, Endpoints: eps, MaxBodyBytes: 4096})
	for _, mode := range bodyModes {
		gw := h.gateway(mode.cfg)
		for name, c := range map[string]struct {
			body string
			code int
		}{
			"not json":       {`{"model":`, 400},
			"messages wrong": {`{"model":"m","messages":"hi"}`, 400},
			"too large":      {chat("m", strings.Repeat("x", 5000), "u", false), 413},
		} {
			res, body := post(t, gw.URL, c.body)
			var e struct {
				Error struct {
					Message string `json:"message"`
					Type    string `json:"type"`
				} `json:"error"`
			}
			if res.StatusCode != c.code || json.Unmarshal([]byte(body), &e) != nil || e.Error.Message == "" || e.Error.Type != "invalid_request_error" {
				t.Errorf("%s/%s: status %d body %s; want %d with an OpenAI error", mode.name, name, res.StatusCode, body, c.code)
			}
		}
	}
	if n := len(h.router.all()); n != 0 {
		t.Errorf("the Router was asked %d times for malformed requests", n)
	}
	for _, e := range engines {
		if n := e.served.Load(); n != 0 {
			t.Errorf("%s served %d malformed requests", e.name, n)
		}
	}
	if st := h.srv.Stats(); st.Answered[400] != 6 || st.Answered[413] != 3 {
		t.Errorf("answered %v, want 6 × 400 and 3 × 413", st.Answered)
	}
}

// TestOutOfOrderIsAProtocolError: a body before any headers ends the stream with InvalidArgument.
func TestOutOfOrderIsAProtocolError(t *testing.T) {
	_, r, eps := staticPool(t, 1)
	h := newHarness(t, extproc.Config{Router: r, Endpoints: eps})
	s := h.open(context.Background())
	s.body("{}", true)
	if _, err := s.s.Recv(); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("want InvalidArgument, got %v", err)
	}
	if h.srv.Stats().ProtocolErrors != 1 {
		t.Error("the protocol error was not counted")
	}
}

// TestDoneOnceOnEveryPath: every request the picker routed ends in exactly one Done, with the
// outcome its path means: success (whole answers, streams), the engine's failure (500), its
// refusal (429), Envoy serving on a fallback after the picked endpoint refused connections,
// the client leaving mid-stream, the stream cancelled mid-body (no decision yet), and the
// picker restarting under a stream.
func TestDoneOnceOnEveryPath(t *testing.T) {
	engines, r, eps := staticPool(t, 3)
	h := newHarness(t, extproc.Config{Router: r, Endpoints: eps, Fallbacks: 2})
	gw := h.gateway(envoysim.Config{})
	outcome := func(rc *rec) string {
		o := rc.Outcome()
		switch {
		case o.NotSent:
			return "not_sent"
		case o.Refused:
			return "refused"
		case o.Err != nil:
			return "failure"
		}
		return "success"
	}
	last := func() *rec {
		recs := h.router.all()
		return recs[len(recs)-1]
	}
	check := func(name, want string, wantFirst int32) {
		t.Helper()
		h.router.waitAllDone(t)
		rc := last()
		if got := outcome(rc); got != want || rc.first.Load() != wantFirst {
			t.Errorf("%s: outcome %s with %d first tokens, want %s with %d", name, got, rc.first.Load(), want, wantFirst)
		}
	}

	if res, body := post(t, gw.URL, chat("m", "a", "b", false)); res.StatusCode != 200 {
		t.Fatalf("success: %d %s", res.StatusCode, body)
	}
	check("whole answer", "success", 1)
	if res, body := post(t, gw.URL, chat("m", "a", "b", true)); res.StatusCode != 200 || !strings.Contains(body, "[DONE]") {
		t.Fatalf("stream: %d %s", res.StatusCode, body)
	}
	check("stream", "success", 1)
	if res, _ := post(t, gw.URL, chat("fail", "a", "b", false)); res.StatusCode != 500 {
		t.Fatalf("engine failure: status %d", res.StatusCode)
	}
	check("engine failure", "failure", 0)
	if res, _ := post(t, gw.URL, chat("full", "a", "b", false)); res.StatusCode != 429 {
		t.Fatalf("engine refusal: status %d", res.StatusCode)
	}
	check("engine refusal", "refused", 0)

	// The client leaves while the answer streams.
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", gw.URL+"/v1/chat/completions", strings.NewReader(chat("slow", "a", "b", true)))
	req.Header.Set("Content-Type", "application/json")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 16)
	if _, err := res.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	cancel()
	res.Body.Close()
	check("client left mid-stream", "not_sent", 1)

	// The stream is cancelled mid-body: no decision was made, none is left open.
	before := len(h.router.all())
	ctx, cancel = context.WithCancel(context.Background())
	s := h.open(ctx)
	s.headers("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, nil)
	s.body(`{"model":"m","messages":[`, false)
	cancel()
	waitStreams(t, h.srv, 0)
	if after := len(h.router.all()); after != before {
		t.Errorf("a stream cancelled mid-body made %d decisions", after-before)
	}

	// The picked endpoint refuses connections: Envoy goes down the list, tells the picker where
	// it served, and the decision moves there.
	down := engines[0]
	down.Close()
	for i := range 8 {
		res, body := post(t, gw.URL, chat("m", fmt.Sprintf("moved %d", i), "b", false))
		if res.StatusCode != 200 {
			t.Fatalf("with %s down: %d %s", down.name, res.StatusCode, body)
		}
	}
	h.router.waitAllDone(t)
	if h.srv.Stats().ServedElsewhere == 0 {
		t.Error("no request was served on a fallback although engine-0 is down")
	}
	for _, rc := range h.router.all() {
		if rc.backend == down.name && outcome(rc) == "success" {
			t.Errorf("a decision on the dead %s ended as a success", down.name)
		}
	}

	// The picker restarts under a stream: the stream is cut, its decision ends; the next request
	// goes through the restarted picker.
	ctx, cancel = context.WithCancel(context.Background())
	defer cancel()
	req, _ = http.NewRequestWithContext(ctx, "POST", gw.URL+"/v1/chat/completions", strings.NewReader(chat("slow", "restart", "b", true)))
	req.Header.Set("Content-Type", "application/json")
	res, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := res.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	h.restart()
	res.Body.Close()
	h.router.waitAllDone(t)
	var ok bool
	for range 50 { // the client connection reconnects to the restarted server
		res, _ := post(t, gw.URL, chat("m", "after restart", "b", false))
		if ok = res.StatusCode == 200; ok {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !ok {
		t.Fatal("no request went through the restarted picker")
	}
	h.router.waitAllDone(t)
	st := h.srv.Stats()
	var ends uint64
	for _, n := range st.Outcomes {
		ends += n
	}
	if want := uint64(len(h.router.all())); ends != want {
		t.Errorf("the picker reported %d ends for %d decisions: %+v", ends, want, st)
	}
	for _, b := range mustStats(t, r).Backends {
		if b.InFlight != 0 {
			t.Errorf("backend %s still holds %d in-flight slots", b.Name, b.InFlight)
			for _, rc := range h.router.all() {
				t.Log(rc.backend, rc.done.Load(), rc.Outcome())
			}
		}
	}
}

func mustStats(t *testing.T, r *kvroute.DefaultRouter) kvroute.Stats {
	t.Helper()
	st, err := r.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// waitStreams waits until the picker has n streams open.
func waitStreams(t *testing.T, s *extproc.Server, n int64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for s.Stats().Streams != n {
		if time.Now().After(deadline) {
			t.Fatalf("%d streams open, want %d", s.Stats().Streams, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestFailureModes: a Router that fails (not for want of a backend) gets the request answered
// 503 with fail_closed, and sent to an endpoint in turn with fail_open; no backend at all is a
// 503 either way.
func TestFailureModes(t *testing.T) {
	for _, mode := range []extproc.FailureMode{extproc.FailClosed, extproc.FailOpen} {
		engines, r, eps := staticPool(t, 2)
		h := newHarness(t, extproc.Config{Router: r, Endpoints: eps, FailureMode: mode})
		gw := h.gateway(envoysim.Config{})
		broken := errors.New("index unreachable")
		h.router.fail.Store(&broken)
		res, body := post(t, gw.URL, chat("m", "s", "u", false))
		want := map[extproc.FailureMode]int{extproc.FailClosed: 503, extproc.FailOpen: 200}[mode]
		if res.StatusCode != want {
			t.Errorf("mode %d: status %d (%s), want %d", mode, res.StatusCode, body, want)
		}
		noBackend := kvroute.ErrNoBackend
		h.router.fail.Store(&noBackend)
		if res, _ := post(t, gw.URL, chat("m", "s", "u", false)); res.StatusCode != 503 {
			t.Errorf("mode %d, no backend: status %d, want 503", mode, res.StatusCode)
		}
		_ = engines
	}
}

// TestThousandConcurrentStreams: 1,000 ext_proc streams at once, each a whole request and
// response, all picked, all ended once, nothing left in flight.
func TestThousandConcurrentStreams(t *testing.T) {
	_, r, eps := staticPool(t, 3)
	h := newHarness(t, extproc.Config{Router: r, Endpoints: eps, Fallbacks: 1})
	const n = 1000
	var wg sync.WaitGroup
	errs := make(chan error, n)
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			s, err := h.client.Process(context.Background())
			if err != nil {
				errs <- err
				return
			}
			rs := &rawStream{t: t, s: s}
			body := chat("m", fmt.Sprintf("conversation %d", i%50), "u", false)
			if err := sendAll(rs, body); err != nil {
				errs <- err
				return
			}
			m, err := s.Recv()
			if err != nil {
				errs <- err
				return
			}
			if m.GetRequestHeaders() == nil {
				errs <- fmt.Errorf("stream %d: got %v", i, m)
				return
			}
			if _, err := s.Recv(); err != nil { // the body back
				errs <- err
				return
			}
			for _, msg := range responseMessages() {
				if err := s.Send(msg); err != nil {
					errs <- err
					return
				}
				if _, err := s.Recv(); err != nil {
					errs <- err
					return
				}
			}
			errs <- s.CloseSend()
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	recs := h.router.waitAllDone(t)
	if len(recs) != n {
		t.Fatalf("%d decisions for %d streams", len(recs), n)
	}
	if st := h.srv.Stats(); st.Outcomes["success"] != n || st.Picked != n {
		t.Errorf("stats %+v, want %d picked and succeeded", st, n)
	}
	waitStreams(t, h.srv, 0)
	for _, b := range mustStats(t, r).Backends {
		if b.InFlight != 0 {
			t.Errorf("backend %s still holds %d in-flight slots", b.Name, b.InFlight)
		}
	}
}

// TestLargeBodyRoundTrip: a prompt of several hundred KiB goes through the picker in every body
// mode (in full duplex it comes back in chunks) and reaches the engine byte for byte.
func TestLargeBodyRoundTrip(t *testing.T) {
	_, r, eps := staticPool(t, 2)
	h := newHarness(t, extproc.Config{Router: r, Endpoints: eps})
	body := chat("m", strings.Repeat("a long system prompt ", 20000), "u", false)
	for _, mode := range bodyModes {
		mode.cfg.ChunkSize = 0 // envoysim's default chunks
		gw := h.gateway(mode.cfg)
		res, answer := post(t, gw.URL, body)
		if res.StatusCode != 200 || res.Header.Get("X-Body-Bytes") != fmt.Sprint(len(body)) {
			t.Errorf("%s: status %d, the engine read %s bytes of %d: %.200s", mode.name, res.StatusCode,
				res.Header.Get("X-Body-Bytes"), len(body), answer)
		}
	}
	h.router.waitAllDone(t)
}

// TestBodyIdleTimeout: a stream whose headers never come is ended, and one whose body stops
// coming is answered 408, both after Config.BodyIdleTimeout, holding nothing afterwards; the wait
// for the engine's answer, however long, is not cut.
func TestBodyIdleTimeout(t *testing.T) {
	_, r, eps := staticPool(t, 2)
	h := newHarness(t, extproc.Config{Router: r, Endpoints: eps, BodyIdleTimeout: 200 * time.Millisecond})
	ctx := context.Background()

	s := h.open(ctx)
	s.headers("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, nil)
	s.body(`{"model":"m","messages":[`, false)
	im := s.recv().GetImmediateResponse()
	if im == nil || im.GetStatus().GetCode() != 408 {
		t.Fatalf("a stalled body: want an immediate 408, got %v", im)
	}

	idle, err := h.client.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := idle.Recv(); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("a stream without headers: %v, want DeadlineExceeded", err)
	}

	s = h.open(ctx)
	s.headers("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, nil)
	s.body(chat("m", "s", "u", false), true)
	s.recv()
	s.recv()
	time.Sleep(500 * time.Millisecond) // a long prefill: no timeout applies
	for _, m := range responseMessages() {
		s.send(m)
		s.recv()
	}
	_ = s.s.CloseSend()
	recs := h.router.waitAllDone(t)
	if len(recs) != 1 || recs[0].Outcome() != (kvroute.Outcome{}) {
		t.Fatalf("the slow answer's decision: %d decisions, %+v", len(recs), recs)
	}
	waitStreams(t, h.srv, 0)
	if st := h.srv.Stats(); st.IdleTimeouts != 2 || st.Answered[408] != 1 {
		t.Errorf("stats %+v: want 2 idle timeouts, one answered 408", st)
	}
}
