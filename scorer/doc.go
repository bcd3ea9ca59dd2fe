// Package scorer ranks the backends that could serve one LLM request, from what a KV-cache index
// knows of their cached prefix and what the router knows of their load and health.
//
// A caller builds one Candidate per backend (cached prefix from package kvindex, in-flight count and
// health from its own accounting), scores them with a BackendScorer, and picks one:
//
//   - ExpectedTTFT is kvroute's default tier-4 scorer: it prefers the backend where the request's
//     first token is expected soonest (the prefill work queued there, then the request's own,
//     divided by the backend's weight), plus CacheWeight times the request's own prefill work,
//     the compute a cache miss costs the rest of the fleet. With the other backends idle, the one
//     holding the prefix keeps the request until the work queued on it exceeds
//     (1 + CacheWeight) times the prefill the prefix saves (at weight 1), or would keep the
//     request waiting past WaitLimit (10 s at the backend's learned prefill rate), beyond which
//     the queue weighs 1 + WaitPenalty times as much. A backend taking more
//     than its share of the recent requests (Candidate.RecentShare) has its cached prefix
//     discounted, so that a hot prefix family gets warmed on a second backend.
//   - PrefillWork is the prefill cost model ExpectedTTFT and kvroute's router share, in
//     token-equivalents: (tokens − cached) + AttentionCost·(tokens² − cached²), a linear term
//     for the weights and a quadratic one for attention over the context, so that the tail of a
//     long prompt costs more than a short prompt of the same length.
//   - Composite is kvroute's kv_overlap scorer (its KvOverlapScorer), KVConfig.Scorer set to
//     NewComposite's: OverlapWeight·overlap + LoadWeight·(1 − load) +
//     HealthWeight·health, with a minimum-overlap threshold (Composite.Active) below which the
//     caller falls back to its consistent-hash ring.
//   - Cost is Dynamo's KV router cost: PrefillWeight·prefill_blocks + decode_blocks, in blocks,
//     where the load comes from Active, a tracker of the blocks of requests in flight (counted once
//     per backend) and of those still being prefilled.
//   - PickBest takes the argmax with a deterministic tie-break; Softmax samples with a temperature
//     (Dynamo's --router-temperature).
//   - Guard detects a skewed fleet (SGLang's balance thresholds), to hand the decision to the
//     least-loaded backend.
//   - PrepareCache is the first phase of kvroute's two-phase prepare/score for remote indexes: one
//     fetch per key in flight, its result reused for 100 ms.
//
// # Overlap ratio: a fraction of the request, not of the best backend
//
// kvroute's KvOverlapScorer normalises each backend's overlap by the largest overlap of any backend
// (raw_overlap = token_count / max_token_count). The best backend then always has overlap 1.0, so
// its min_overlap_threshold can only fail when no backend holds anything: a backend holding 1 block
// of a 500-block prompt passes a 0.3 threshold and pulls the request off the consistent-hash ring for
// almost no reuse. Composite instead divides by the request's own length (Request.Blocks):
// overlap_ratio is the tier-weighted fraction of the request the backend holds, so the threshold
// means what it says ("route by cache when some backend holds at least 30% of the prompt"), and the
// overlap signal is comparable across requests. Only when the request's length is unknown
// (Request.Blocks == 0) does Composite fall back to kvroute's max-normalisation.
//
// # References
//
//   - kvroute's design: overlap scoring and the backend selection pipeline.
//   - NVIDIA Dynamo, "KV Cache Routing": cost = overlap_score_weight·prefill_blocks + decode_blocks,
//     active-block tracking (AddRequest, MarkPrefillCompleted, Free), softmax temperature.
//   - SGLang model gateway, cache-aware policy: balance_abs_threshold and balance_rel_threshold.
//
// # Concurrency and allocation
//
// Scorers, pickers and guards are immutable values, safe for concurrent use; scoring and picking
// allocate nothing when the caller's out slice is large enough. Active and PrepareCache are safe
// for concurrent use and start no goroutine. The package holds no mutable package-level state and
// imports nothing from kvroute.
//
// # Use
//
//	comp, _ := scorer.NewComposite(scorer.CompositeConfig{}) // 0.6 / 0.3 / 0.1, threshold 0.3
//	req := scorer.Request{Blocks: len(blockKeys)}
//	cands := snapshot(backends, match) // one Candidate per backend
//	if !comp.Active(req, cands) {
//		return chwblPick // too little cached anywhere: consistent hashing decides
//	}
//	if guard.Skewed(cands) {
//		return cands[guard.LeastLoaded(cands)].Backend
//	}
//	scores := comp.Score(req, cands, buf[:0])
//	return cands[scorer.PickBest(scores, cands)].Backend
package scorer
