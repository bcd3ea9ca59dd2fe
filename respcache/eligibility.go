package respcache

import "github.com/kvroute/kvroute/prefixkey"

// Defaults of Policy, from kvroute's response_cache section.
const (
	// DefaultMaxResponseSize is the largest non-streaming response body cached, in bytes
	// (response_cache.max_response_size, 1 MiB).
	DefaultMaxResponseSize = 1 << 20
	// DefaultMaxStreamBufferSize is the largest streamed (SSE) response buffered for caching, in
	// bytes (response_cache.max_stream_buffer_size, 10 MiB).
	DefaultMaxStreamBufferSize = 10 << 20
)

// Reasons a request or response is not cached. They are short and stable: use them as metric
// label values (the "skip" results of kvroute_response_cache_requests_total).
const (
	ReasonTemperature       = "temperature"        // temperature is not 0, or absent without AssumeGreedyDefault
	ReasonN                 = "n"                  // n > 1: several choices are sampled
	ReasonStreamingDisabled = "streaming_disabled" // a streaming request or response, and Policy.CacheStreaming is false
	ReasonStatus            = "status"             // the response status is not 200
	ReasonTooLarge          = "too_large"          // the response exceeds the size limit
)

// Policy decides which requests and responses the response cache takes: kvroute's eligibility
// rules. A Policy is a plain value, safe for concurrent use by its methods, which only read it.
//
// The zero value caches non-streaming requests with an explicit temperature 0 whose responses
// fit DefaultMaxResponseSize; streaming requests are skipped unless CacheStreaming is set (the
// kvroute's default deployment sets it: streams are buffered up to DefaultMaxStreamBufferSize and
// replayed as SSE).
type Policy struct {
	// CacheStreaming makes streaming requests eligible: their SSE stream is buffered (up to
	// MaxStreamBufferSize) and stored, and replayed as SSE on a hit.
	CacheStreaming bool

	// MaxResponseSize is the largest non-streaming response body stored, in bytes; ≤ 0 means
	// DefaultMaxResponseSize.
	MaxResponseSize int

	// MaxStreamBufferSize is the largest buffered stream stored, in bytes; ≤ 0 means
	// DefaultMaxStreamBufferSize.
	MaxStreamBufferSize int

	// AssumeGreedyDefault makes a request without a temperature eligible, as if it had asked for
	// temperature 0 (the former "0 or absent" rule). By default it is not: OpenAI and Anthropic both
	// default an absent temperature to 1, so such a request samples and caching it would replay
	// one sample forever. Set it only for a fleet whose engines decode greedily by default.
	AssumeGreedyDefault bool
}

// Eligible reports whether r may be served from and stored into the response cache under the
// default Cache's policy: Policy{CacheStreaming: true}.Request(r), so an absent temperature is
// ineligible. It is safe for concurrent use; r is only read. reason is "" when ok, otherwise one
// of the Reason constants.
func Eligible(r *prefixkey.Request) (ok bool, reason string) {
	return Policy{CacheStreaming: true}.Request(r)
}

// Request reports whether r is eligible for the response cache: its temperature is 0 (or absent,
// under AssumeGreedyDefault), it asks for at most one choice (n absent or ≤ 1), and it does not
// stream unless CacheStreaming is set. When not, reason names the first rule broken, in
// that order (ReasonTemperature, ReasonN, ReasonStreamingDisabled); when ok, reason is "". It does
// not allocate; r is only read.
//
// Eligibility is about determinism only: what a request's key covers is KeyOf's business.
func (p Policy) Request(r *prefixkey.Request) (ok bool, reason string) {
	t := r.Params.Temperature
	if (t.Set && t.V != 0) || (!t.Set && !p.AssumeGreedyDefault) {
		return false, ReasonTemperature
	}
	if n := r.Params.N; n.Set && n.V > 1 {
		return false, ReasonN
	}
	if r.Params.Stream && !p.CacheStreaming {
		return false, ReasonStreamingDisabled
	}
	return true, ""
}

// Response reports whether a response may be stored: CheckResponse without the reason.
func (p Policy) Response(status int, size int, streaming bool) bool {
	ok, _ := p.CheckResponse(status, size, streaming)
	return ok
}

// CheckResponse reports whether a response of the given status and size (the body's bytes, or
// the buffered SSE stream's when streaming) may be stored. The status must be 200 (else
// ReasonStatus); a stream needs CacheStreaming (else ReasonStreamingDisabled); the size must be
// within MaxSize(streaming) (else ReasonTooLarge). reason is "" when ok.
func (p Policy) CheckResponse(status int, size int, streaming bool) (ok bool, reason string) {
	switch {
	case status != 200:
		return false, ReasonStatus
	case streaming && !p.CacheStreaming:
		return false, ReasonStreamingDisabled
	case size < 0 || size > p.MaxSize(streaming):
		return false, ReasonTooLarge
	}
	return true, ""
}

// MaxSize returns the size limit of a response in bytes, with defaults applied: MaxStreamBufferSize
// for a stream, MaxResponseSize otherwise. A recorder stops buffering past it.
func (p Policy) MaxSize(streaming bool) int {
	if streaming {
		if p.MaxStreamBufferSize > 0 {
			return p.MaxStreamBufferSize
		}
		return DefaultMaxStreamBufferSize
	}
	if p.MaxResponseSize > 0 {
		return p.MaxResponseSize
	}
	return DefaultMaxResponseSize
}
