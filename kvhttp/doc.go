// Package kvhttp is the HTTP lifecycle of one LLM request that a net/http gateway routes with
// kvroute and forwards with httputil.ReverseProxy: read the body within a limit and a deadline,
// parse it by API, Route, forward to the chosen backend, mark its first token, retry on another
// backend before the first byte, and end the Decision once with the Outcome the request had.
//
// Handler does all of it for the three LLM endpoints (POST /v1/chat/completions,
// /v1/completions, /v1/messages):
//
//	router, err := kvroute.New(kvroute.Config{Backends: []kvroute.Backend{{Name: "vllm-1"}, {Name: "vllm-2"}}})
//	if err != nil {
//		return err
//	}
//	backends := map[string]*url.URL{"vllm-1": u1, "vllm-2": u2}
//	mux.Handle("POST /v1/", &kvhttp.Handler{Router: router, Backends: backends})
//
// # Lifecycle
//
// For each request Handler
//
//  1. reads the body (ReadRequest): at most MaxBodyBytes (413 beyond), within ReadTimeout and
//     without a pause of BodyIdleTimeout (408), its bytes, as they arrive, optionally held
//     against a Budget shared by the requests in flight, which keeps a reserve for small bodies
//     and bounds what one client holds (503 when none is left),
//     and parses it by the endpoint's format (400 for a malformed body, in the style of the API:
//     package apierror);
//  2. routes it (Forward): Router.Route, or Handler.Route for a flow of one's own; ErrNoBackend is
//     answered 503;
//  3. forwards it to the Target's backend through one httputil.ReverseProxy: the client's body,
//     without Accept-Encoding (identity answers, which kvhttp reads) and Expect, with
//     X-Forwarded-For, -Host and -Proto; the response gets the X-Kvroute-* headers;
//  4. calls the Lease's FirstToken when the first byte of a 2xx answer's body goes to the
//     client, streamed (text/event-stream) or not, and reads usage's cached_tokens (OpenAI,
//     vLLM: prompt_tokens_details.cached_tokens; Anthropic: cache_read_input_tokens) as the body
//     passes (Result.CachedTokens);
//  5. retries on another backend, at most Retries times, an attempt that failed before anything
//     reached the client: a connection error or a timeout, a 502 or 504 (failure), a 429, 503,
//     or a 500 that speaks of capacity (refusal; see health.Classify);
//  6. ends the Lease once, on every path, with the Outcome of the attempt.
//
// The Outcomes:
//
//	the answer went out whole (2xx, 4xx)                Outcome{}                   success
//	the backend answered 5xx (relayed)                  Outcome{Err: *StatusError}  failure
//	the backend refused (429, 503, capacity; relayed)   Outcome{Refused: true}      load, not ill health
//	connection error, timeout, before the answer        Outcome{Err: err}           502 when not retried
//	the answer broke off (the backend died mid-body)    Outcome{Err: ErrAborted}    failure
//	the client left (before or during the answer)       Outcome{NotSent: true}      upstream call cancelled
//	retried elsewhere                                   Refused or Err, as above
//
// When the client leaves, the upstream call is cancelled at once, except that a stream whose
// terminal event (OpenAI's "data: [DONE]", Anthropic's "event: message_stop") has already gone
// out is let finish for up to two seconds: SDK clients close the connection as soon as they read
// it, and the backend's complete answer should not be counted as cut.
//
// # Pieces
//
// A gateway that needs more than Handler composes its pieces: ReadRequest, then anything
// (a response cache, spans, metrics), then Forward. Handler.Route replaces Router.Route and
// returns a Target (a backend, its Lease, the response headers, a body of its own, a header
// timeout, where to go when it fails); Handler.Attempt sees every attempt before it is sent
// (a circuit breaker may refuse it; a tracer may add headers) and its Result when it ended.
// kvroute's reference proxy (examples/proxy) builds its response cache, its two-phase
// prefill/decode flow, its circuit breakers, spans and metrics this way.
//
// # Concurrency
//
// A Handler is safe for concurrent use once its fields are set; they must not change after its
// first request. Nothing it starts outlives a request: the upstream call runs on the request's
// goroutine, and the cancellation that follows a client's departure (context.AfterFunc), a
// stream's end grace and a Target's HeaderTimeout are stopped when the request ends. The
// connections are its Transport's (NewTransport's when left nil, whose idle connections close
// after 90 s unused).
package kvhttp
