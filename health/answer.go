package health

import (
	"bytes"
	"io"
	"net/http"
)

// Answer is what an engine's HTTP answer says of the engine, for a gateway deciding whether to
// send the request elsewhere (before anything reached its client) and what to tell the Router and
// the circuit breaker.
type Answer uint8

const (
	// AnswerServed: the engine answered the request (successfully or with the client's error, or
	// an error of its own that another engine would repeat); relay it.
	AnswerServed Answer = iota
	// AnswerFailed: the engine failed (502, 504): another engine may serve the request; the
	// failure counts against the engine's health and its circuit breaker.
	AnswerFailed
	// AnswerRefused: the engine declined the request for lack of room (429, 503, or a 500 whose
	// body speaks of capacity): another engine may serve it; it is load, not ill health
	// (kvroute.Outcome.Refused; no circuit-breaker failure).
	AnswerRefused
)

// String returns "served", "failed" or "refused".
func (a Answer) String() string {
	switch a {
	case AnswerFailed:
		return "failed"
	case AnswerRefused:
		return "refused"
	default:
		return "served"
	}
}

// capacitySniff bounds how much of a 500's body Classify reads.
const capacitySniff = 2 << 10

// capacityPhrases are the words (lower case) in which engines answer a 500 for lack of room:
// vLLM-compatible engines, SGLang and TGI phrase it so.
var capacityPhrases = [][]byte{[]byte("capacity"), []byte("kv cache"), []byte("out of memory"),
	[]byte("overloaded"), []byte("too many requests"), []byte("queue is full"), []byte("server is busy"),
	[]byte("no available"), []byte("insufficient")}

// Classify sorts an engine's answer by its status: 429 and 503 are refusals, 502 and 504
// failures, and a 500 is a refusal when the first 2 KiB of its body speak of capacity, the KV
// cache, memory, overload or a full queue (it then reads those bytes and puts them back in front
// of res.Body); every other answer is served.
func Classify(res *http.Response) Answer {
	switch res.StatusCode {
	case http.StatusTooManyRequests, http.StatusServiceUnavailable:
		return AnswerRefused
	case http.StatusBadGateway, http.StatusGatewayTimeout:
		return AnswerFailed
	case http.StatusInternalServerError:
		if res.Body == nil || res.Body == http.NoBody {
			return AnswerServed
		}
		head, err := io.ReadAll(io.LimitReader(res.Body, capacitySniff))
		res.Body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(head), res.Body), res.Body}
		if err != nil {
			return AnswerServed
		}
		low := bytes.ToLower(head)
		for _, p := range capacityPhrases {
			if bytes.Contains(low, p) {
				return AnswerRefused
			}
		}
	}
	return AnswerServed
}
