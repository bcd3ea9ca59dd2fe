// Package kvroutecaddy is kvroute in Caddy (v2.11): KV-cache-aware routing of LLM requests by
// Caddy's own reverse_proxy. It registers three Caddy modules:
//
//   - http.handlers.kvroute (Caddyfile directive kvroute, ordered before reverse_proxy): reads
//     an OpenAI chat/completions or Anthropic messages body (up to max_body_size, then restores
//     it for the proxy), parses it by its path (prefixkey.FormatOfPath, prefixkey.Parse), and
//     routes it with a kvroute Router built from its configuration: tier 1 (prefix-aware CHWBL)
//     over the backends by default, tier 4 (a KV-block index fed by the engines' KV events over
//     ZMQ) when a backend names its events endpoint or kv_index is set, the response cache
//     (respcache) when response_cache is set. A malformed body gets 400, a body over the limit
//     413, and no healthy backend 503, each in the API's error style (package apierror). Other
//     requests pass through untouched.
//   - http.reverse_proxy.selection_policies.kvroute (Caddyfile lb_policy kvroute): picks the
//     upstream the handler's decision named, and falls back to another Caddy policy (least_conn
//     by default) for requests without a decision.
//   - admin.api.kvroute: GET /kvroute/stats on Caddy's admin endpoint, each Router's decisions,
//     backends and KV index as kvroute's admin endpoints report them (package admin).
//
// The Caddyfile users copy:
//
//	:8080 {
//		kvroute {
//			backend 10.0.0.1:8000 {
//				zmq tcp://10.0.0.1:5557 tcp://10.0.0.1:5558
//			}
//			backend 10.0.0.2:8000 {
//				zmq tcp://10.0.0.2:5557 tcp://10.0.0.2:5558
//			}
//		}
//		reverse_proxy 10.0.0.1:8000 10.0.0.2:8000 {
//			lb_policy kvroute
//			lb_retries 2
//		}
//	}
//
// A backend's name is the address reverse_proxy dials (an upstream's Dial, "host:port"): the
// policy matches the decision's backend against the pool's upstreams by it.
//
// # The decision's lifecycle
//
// The handler takes the Decision before the proxy runs and ends it when the request ends,
// with the true outcome of the attempt that answered: FirstToken at the first body byte of a
// 2xx answer (its ResponseWriter wrapper keeps Flush and Unwrap for streaming), then Done once:
// a failure (Outcome.Err) for a 5xx answer, a transport error or an answer that broke off,
// a refusal (Outcome.Refused) for 429 or 503, a success otherwise, and nothing recorded
// (Outcome.NotSent) when the client left before the answer was complete or the request never
// reached the decided backend.
//
// reverse_proxy retries (lb_retries, lb_try_duration, lb_retry_match) ask the policy again for
// the same request. The policy then knows the previous attempt failed before anything reached
// the client: it ends the decision in force with that attempt's outcome (Refused when
// lb_retry_match retried a 429 or 503 answer, a failure for any other 5xx or a transport error),
// routes the request again avoiding every upstream already tried and those Caddy's health checks
// hold down, and sends the attempt where the new decision says; the handler ends that decision
// when the request ends. The body is restored for every attempt. Each Select also hands Caddy's
// view of the upstreams' health (active and passive health checks) to the Router, so that a
// backend Caddy holds down gets no new decisions. When no decision fits an available upstream,
// the fallback policy picks among the upstreams not yet tried, and no decision holds a slot
// for that attempt.
//
// # Reloads
//
// Caddy provisions a new instance of every module on each config load. The Router, its KV
// index, event consumers, tokenizer and response cache live in a caddy.UsagePool keyed by the
// handler's configuration: a reload whose kvroute settings are unchanged reuses them (their
// index, in-flight counts and counters survive), and the old handler's Cleanup only drops its
// reference. The last reference's release closes them. The pool is package state because Caddy's
// module model needs one (modules are created by name and reloaded in place); nothing else in
// this package is.
package kvroutecaddy
