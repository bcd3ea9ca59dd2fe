// Package routertest is a conformance suite for implementations of kvroute.Router, in the manner
// of testing/slogtest: call Run from a test with a constructor for your Router.
//
//	func TestMyRouter(t *testing.T) {
//		routertest.Run(t, func(t *testing.T, backends []string) routertest.Subject {
//			r := myrouter.New(backends)
//			return routertest.Subject{Router: r, InFlight: r.InFlight}
//		})
//	}
//
// The suite checks the contract documented on kvroute.Router and kvroute.Decision: Route returns a
// Decision for one of the backends with a reason, or nil and an error (kvroute.ErrNilRequest for a
// nil request, the context's error once it has ended, kvroute.ErrNoBackend with no backend);
// Done and FirstToken are safe to call more than once, in any order and from any goroutine; and,
// when the Subject reports its in-flight requests, every Decision holds one until its first Done.
// Run it with -race: the suite routes from many goroutines at once.
package routertest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/prefixkey"
)

// Subject is the Router under test and what the suite may observe of it.
type Subject struct {
	Router kvroute.Router
	// InFlight, when set, returns the requests the Router counts as in flight (decisions not yet
	// Done); the suite then checks that each Decision holds one until its first Done.
	InFlight func() int
}

// NewSubject builds the Router under test over backends, all healthy (none: a Router with no backend),
// and releases it through t.Cleanup.
type NewSubject func(t *testing.T, backends []string) Subject

// Run runs the suite, one subtest per behaviour, each with a Router of its own.
func Run(t *testing.T, newSubject NewSubject) {
	t.Helper()
	backends := []string{"engine-a", "engine-b", "engine-c"}
	tests := []struct {
		name string
		fn   func(*testing.T, NewSubject, []string)
	}{
		{"DecisionNamesABackend", testDecision},
		{"NilRequest", testNilRequest},
		{"EndedContext", testEndedContext},
		{"NoBackend", testNoBackend},
		{"DoneIsIdempotent", testDoneIdempotent},
		{"DecisionHoldsUntilDone", testHolds},
		{"Concurrent", testConcurrent},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { tc.fn(t, newSubject, backends) })
	}
}

// requests are the requests the suite routes: each API format, with and without a prefix key.
func requests(t *testing.T) []*prefixkey.Request {
	t.Helper()
	bodies := []struct {
		f    prefixkey.Format
		body string
	}{
		{prefixkey.FormatOpenAIChat, `{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"hi"}]}`},
		{prefixkey.FormatOpenAICompletion, `{"model":"m","prompt":"Once upon a time"}`},
		{prefixkey.FormatAnthropicMessages, `{"model":"m","max_tokens":8,"system":"Be brief.","messages":[{"role":"user","content":"hello"}]}`},
	}
	var out []*prefixkey.Request
	for _, b := range bodies {
		r, err := prefixkey.Parse(b.f, []byte(b.body))
		if err != nil {
			t.Fatalf("parsing the suite's request %s: %v", b.body, err)
		}
		out = append(out, r)
	}
	return append(out, &prefixkey.Request{Model: "m"}) // no prefix key at all
}

func testDecision(t *testing.T, newSubject NewSubject, backends []string) {
	s := newSubject(t, backends)
	for i, req := range requests(t) {
		d, err := s.Router.Route(context.Background(), req)
		if err != nil || d == nil {
			t.Fatalf("request %d: Route = %v, %v; want a Decision and no error", i, d, err)
		}
		if !slices.Contains(backends, d.Backend) {
			t.Errorf("request %d: Decision.Backend %q is not one of %q", i, d.Backend, backends)
		}
		if d.Reason.String() == "none" {
			t.Errorf("request %d: Decision.Reason is the zero Reason; a Decision says why it chose", i)
		}
		d.Done(kvroute.Outcome{})
	}
}

func testNilRequest(t *testing.T, newSubject NewSubject, backends []string) {
	s := newSubject(t, backends)
	d, err := s.Router.Route(context.Background(), nil)
	if d != nil || !errors.Is(err, kvroute.ErrNilRequest) {
		t.Errorf("Route(nil request) = %v, %v; want nil, an error wrapping kvroute.ErrNilRequest", d, err)
	}
}

func testEndedContext(t *testing.T, newSubject NewSubject, backends []string) {
	s := newSubject(t, backends)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	d, err := s.Router.Route(ctx, requests(t)[0])
	if d != nil || !errors.Is(err, context.Canceled) {
		t.Errorf("Route(canceled ctx) = %v, %v; want nil, an error wrapping context.Canceled", d, err)
	}
	if s.InFlight != nil && s.InFlight() != 0 {
		t.Errorf("%d requests in flight after a refused Route", s.InFlight())
	}
}

func testNoBackend(t *testing.T, newSubject NewSubject, _ []string) {
	s := newSubject(t, nil)
	d, err := s.Router.Route(context.Background(), requests(t)[0])
	if d != nil || !errors.Is(err, kvroute.ErrNoBackend) {
		t.Errorf("Route with no backend = %v, %v; want nil, an error wrapping kvroute.ErrNoBackend", d, err)
	}
}

func testDoneIdempotent(t *testing.T, newSubject NewSubject, backends []string) {
	s := newSubject(t, backends)
	req := requests(t)[0]
	outcomes := []kvroute.Outcome{{}, {Err: errors.New("upstream 500")}, {Refused: true}, {NotSent: true}}
	for _, o := range outcomes {
		d, err := s.Router.Route(context.Background(), req)
		if err != nil {
			t.Fatalf("Route: %v", err)
		}
		d.FirstToken()
		d.FirstToken()
		d.Done(o)
		d.Done(kvroute.Outcome{})
		d.Done(kvroute.Outcome{Err: errors.New("late")})
		d.FirstToken() // after Done: nothing
	}
	var nilDecision *kvroute.Decision
	nilDecision.Done(kvroute.Outcome{})
	nilDecision.FirstToken()
}

func testHolds(t *testing.T, newSubject NewSubject, backends []string) {
	s := newSubject(t, backends)
	if s.InFlight == nil {
		t.Skip("the Subject reports no in-flight count")
	}
	var held []*kvroute.Decision
	for i, req := range requests(t) {
		d, err := s.Router.Route(context.Background(), req)
		if err != nil {
			t.Fatalf("Route: %v", err)
		}
		held = append(held, d)
		if n := s.InFlight(); n != i+1 {
			t.Errorf("%d decisions held, %d in flight", i+1, n)
		}
	}
	for i, d := range held {
		d.FirstToken()
		d.Done(kvroute.Outcome{})
		d.Done(kvroute.Outcome{})
		if n, want := s.InFlight(), len(held)-i-1; n != want {
			t.Errorf("after %d Done calls: %d in flight, want %d", i+1, n, want)
		}
	}
}

func testConcurrent(t *testing.T, newSubject NewSubject, backends []string) {
	s := newSubject(t, backends)
	reqs := requests(t)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Go(func() {
			for i := range 200 {
				d, err := s.Router.Route(context.Background(), reqs[(g+i)%len(reqs)])
				if err != nil {
					errs <- fmt.Errorf("goroutine %d, request %d: %w", g, i, err)
					return
				}
				// Done from another goroutine than Route's, twice at once.
				var done sync.WaitGroup
				for range 2 {
					done.Go(func() { d.FirstToken(); d.Done(kvroute.Outcome{}) })
				}
				done.Wait()
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if s.InFlight != nil && s.InFlight() != 0 {
		t.Errorf("%d requests in flight after every Decision was Done", s.InFlight())
	}
}
