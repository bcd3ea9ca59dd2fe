// Package disagg plans disaggregated prefill/decode serving: for each LLM request it chooses a
// routing path and the backends that run its two phases, from per-backend facts that the caller
// gathers (role, health, phases in flight, and a KV-cache index's answer for the prompt).
//
// Backends have a Role: prefill backends compute prompts' KV cache and write it to external
// storage, decode backends load it and generate tokens, unified backends do both. Each backend
// has an ExternalStorage (or the configuration's default); two backends exchange KV through
// storage when their storage is at the same location. Credentials in an ExternalStorage are
// redacted whenever it is printed, logged (slog) or marshalled.
//
// # Paths
//
// Planner.Plan returns one of four paths, the values of the X-Kvroute-Routing-Path header:
//
//   - fast_decode: a decode backend serves the request alone. It holds the prompt's prefix in its
//     own memory (reason local_hit), or loads it from storage where any backend left it (reason
//     storage_hit: the least-loaded decode backend that reads that storage; a prefix is there when
//     a backend holds it on the storage tier, or keeps it in memory and has written it to storage
//     too, Candidate.StoredTokens), or computes the short uncached part itself (reason
//     short_prompt).
//   - prefill_then_decode: a prefill backend, chosen by its cached prefix and its prefill load
//     only, computes the prompt; a decode backend, chosen by its decode load only (it loads the
//     whole KV, so a cached prefix earns it nothing), generates the tokens.
//   - unified: disaggregation is off, or the fleet has no prefill/decode pools.
//   - fallback: a pool the request needs has no healthy backend, or its prefill failed, and
//     fallback to unified is on.
//
// # Conditional disaggregation
//
// A remote prefill costs a KV transfer; for a short uncached part the decode backend is faster
// computing it itself. The remote prefill is skipped when the part of the prompt the best decode
// backend cannot reuse is at most Config.MaxUncachedTokens tokens (default 512) or at most
// Config.MaxUncachedRatio of the prompt (default 0.1): the prompt goes to a prefill backend only
// when its uncached part is long by both measures. The absolute test is the usual remote-prefill
// decision of disaggregated serving (prefill remotely only when the prompt's length minus its
// prefix hit exceeds a threshold); the relative test keeps long prompts that are almost entirely
// cached on the decode backend, where a transfer of the whole KV would cost more than the
// remainder. With Config.DisableConditional the plain rule applies: any reusable prefix means
// fast_decode, none means prefill_then_decode.
//
// # Load
//
// Prefill and decode phases are counted separately per backend, and each pool keeps the bound of
// consistent hashing with bounded loads (V. Mirrokni, M. Thorup, M. Zadimoghaddam, SODA 2018): a
// backend of weight w takes a phase only while its phases in flight + 1 ≤ ceil((1+ε)·(T+1)·w/W)
// over its pool (ε = Config.LoadFactorEpsilon, default 0.25). A decode backend at its bound loses the credit
// for the prefix it holds, so a popular prefix cannot pile every request onto one backend. The
// planner only reads the loads; the caller takes and releases the slots (package kvroute does so
// atomically with the same bound).
//
// # Concurrency and state
//
// A Planner is immutable and safe for concurrent use; Plan is a pure function of its Input and
// allocates nothing in steady state. Counters are atomic. The package holds no package-level
// mutable state, starts no goroutine, does no I/O and imports only package scorer from kvroute.
//
// # Use
//
//	planner, err := disagg.New(disagg.Config{DefaultStorage: disagg.ExternalStorage{
//		Endpoint: "http://kv-store:8080", Namespace: "inference/kv-cache"}})
//	if err != nil { … }
//	plan, err := planner.Plan(disagg.Input{Candidates: snapshot(req), PromptTokens: n})
//	if err != nil { … } // errors.Is(err, disagg.ErrNoBackend): answer 503
//	plan.SetHeaders(w.Header())
//	if plan.Path == disagg.PathPrefillThenDecode {
//		err = prefill(ctx, plan.Prefill) // bounded by Config.PrefillTimeout
//		if err != nil { plan, err = planner.Fallback(disagg.Input{Candidates: snapshot(req)}) }
//	}
//	serve(ctx, plan.Decode)
package disagg
