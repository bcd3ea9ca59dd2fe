package respcache

import (
	"math"
	"testing"

	"github.com/kvroute/kvroute/prefixkey"
)

func TestPolicyRequest(t *testing.T) {
	some := prefixkey.Some[float64]
	somei := prefixkey.Some[int64]
	req := func(p prefixkey.Params) *prefixkey.Request { return &prefixkey.Request{Model: "m", Params: p} }
	for _, tc := range []struct {
		name       string
		policy     Policy
		req        *prefixkey.Request
		wantOK     bool
		wantReason string
	}{
		{"temperature absent", Policy{}, req(prefixkey.Params{}), false, ReasonTemperature},
		{"temperature 0", Policy{}, req(prefixkey.Params{Temperature: some(0)}), true, ""},
		{"temperature -0", Policy{}, req(prefixkey.Params{Temperature: some(math.Copysign(0, -1))}), true, ""},
		{"temperature 0.7", Policy{}, req(prefixkey.Params{Temperature: some(0.7)}), false, ReasonTemperature},
		{"temperature negative", Policy{}, req(prefixkey.Params{Temperature: some(-1)}), false, ReasonTemperature},
		{"temperature absent, seed set", Policy{}, req(prefixkey.Params{Seed: somei(7)}), false, ReasonTemperature},
		{"temperature absent, top_p 1", Policy{}, req(prefixkey.Params{TopP: some(1)}), false, ReasonTemperature},
		{"temperature absent, greedy default", Policy{AssumeGreedyDefault: true}, req(prefixkey.Params{}), true, ""},
		{"temperature 0, greedy default", Policy{AssumeGreedyDefault: true}, req(prefixkey.Params{Temperature: some(0)}), true, ""},
		{"temperature 0.7, greedy default", Policy{AssumeGreedyDefault: true}, req(prefixkey.Params{Temperature: some(0.7)}), false, ReasonTemperature},
		{"n absent", Policy{}, req(prefixkey.Params{Temperature: some(0)}), true, ""},
		{"n 0", Policy{}, req(prefixkey.Params{Temperature: some(0), N: somei(0)}), true, ""},
		{"n 1", Policy{}, req(prefixkey.Params{Temperature: some(0), N: somei(1)}), true, ""},
		{"n 2", Policy{}, req(prefixkey.Params{Temperature: some(0), N: somei(2)}), false, ReasonN},
		{"n 2, greedy default", Policy{AssumeGreedyDefault: true}, req(prefixkey.Params{N: somei(2)}), false, ReasonN},
		{"streaming, disabled", Policy{}, req(prefixkey.Params{Temperature: some(0), Stream: true}), false, ReasonStreamingDisabled},
		{"streaming, enabled", Policy{CacheStreaming: true}, req(prefixkey.Params{Temperature: some(0), Stream: true}), true, ""},
		{"temperature before n before stream", Policy{}, req(prefixkey.Params{Temperature: some(1), N: somei(3), Stream: true}), false, ReasonTemperature},
		{"n before stream", Policy{}, req(prefixkey.Params{Temperature: some(0), N: somei(3), Stream: true}), false, ReasonN},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ok, reason := tc.policy.Request(tc.req)
			if ok != tc.wantOK || reason != tc.wantReason {
				t.Errorf("Request = (%v, %q), want (%v, %q)", ok, reason, tc.wantOK, tc.wantReason)
			}
		})
	}
}

func TestEligible(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    prefixkey.Params
		want bool
	}{
		{"deterministic", prefixkey.Params{Temperature: prefixkey.Some(0.0)}, true},
		{"streaming is buffered by default", prefixkey.Params{Temperature: prefixkey.Some(0.0), Stream: true}, true},
		{"sampled", prefixkey.Params{Temperature: prefixkey.Some(0.2)}, false},
		{"temperature absent samples at the providers' default 1", prefixkey.Params{}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if ok, _ := Eligible(&prefixkey.Request{Params: tc.p}); ok != tc.want {
				t.Errorf("Eligible = %v, want %v", ok, tc.want)
			}
		})
	}
}

func TestPolicyResponse(t *testing.T) {
	for _, tc := range []struct {
		name       string
		policy     Policy
		status     int
		size       int
		streaming  bool
		wantReason string // "" means ok
	}{
		{"200 small", Policy{}, 200, 100, false, ""},
		{"200 at the default limit", Policy{}, 200, DefaultMaxResponseSize, false, ""},
		{"200 over the default limit", Policy{}, 200, DefaultMaxResponseSize + 1, false, ReasonTooLarge},
		{"custom limit", Policy{MaxResponseSize: 10}, 200, 11, false, ReasonTooLarge},
		{"negative size", Policy{}, 200, -1, false, ReasonTooLarge},
		{"empty body", Policy{}, 200, 0, false, ""},
		{"201", Policy{}, 201, 10, false, ReasonStatus},
		{"500", Policy{}, 500, 10, false, ReasonStatus},
		{"status before size", Policy{}, 404, 1 << 30, false, ReasonStatus},
		{"stream, disabled", Policy{}, 200, 10, true, ReasonStreamingDisabled},
		{"stream over the response limit, under the stream limit", Policy{CacheStreaming: true}, 200, 2 << 20, true, ""},
		{"stream at the default limit", Policy{CacheStreaming: true}, 200, DefaultMaxStreamBufferSize, true, ""},
		{"stream over the default limit", Policy{CacheStreaming: true}, 200, DefaultMaxStreamBufferSize + 1, true, ReasonTooLarge},
		{"stream custom limit", Policy{CacheStreaming: true, MaxStreamBufferSize: 100}, 200, 101, true, ReasonTooLarge},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ok, reason := tc.policy.CheckResponse(tc.status, tc.size, tc.streaming)
			if ok != (tc.wantReason == "") || reason != tc.wantReason {
				t.Errorf("CheckResponse = (%v, %q), want reason %q", ok, reason, tc.wantReason)
			}
			if got := tc.policy.Response(tc.status, tc.size, tc.streaming); got != ok {
				t.Errorf("Response = %v, CheckResponse = %v", got, ok)
			}
		})
	}
}

func TestPolicyMaxSize(t *testing.T) {
	for _, tc := range []struct {
		p         Policy
		streaming bool
		want      int
	}{
		{Policy{}, false, DefaultMaxResponseSize},
		{Policy{}, true, DefaultMaxStreamBufferSize},
		{Policy{MaxResponseSize: -5}, false, DefaultMaxResponseSize},
		{Policy{MaxResponseSize: 5, MaxStreamBufferSize: 7}, false, 5},
		{Policy{MaxResponseSize: 5, MaxStreamBufferSize: 7}, true, 7},
	} {
		if got := tc.p.MaxSize(tc.streaming); got != tc.want {
			t.Errorf("%+v.MaxSize(%v) = %d, want %d", tc.p, tc.streaming, got, tc.want)
		}
	}
}
