// Package costscore shows a scorer.BackendScorer written outside kvroute: a score in prompt tokens,
// the tokens a backend already holds of the request minus a penalty for the work queued ahead of
// it, so that a warm cache wins until the queue in front of it costs more than the prefill it
// saves.
//
// For candidate c of request r, with w = c.Weight (1 when ≤ 0):
//
//	cached  = c.CachedTokens × c.Overlap / c.CachedBlocks   (tier-weighted: a CPU copy saves less)
//	queue   = (c.PendingPrefillTokens + RequestCost × c.InFlight) / w
//	score   = cached − QueueWeight × queue − ErrorPenalty × (1 − c.Health)
//
// and −Inf for an unhealthy candidate. PendingPrefillTokens is the prefill backlog the default
// Router keeps per backend (prompt tokens routed there, not cached there, whose first token has not
// come); RequestCost stands for the decode work of requests past their prefill, which the backlog
// does not show.
//
// What it shows of the plug point: a BackendScorer writes one score per candidate into out,
// allocates nothing, keeps no state and so is safe for concurrent use; a kvroute.DefaultRouter
// uses it through KVConfig.Scorer (and calls it through scorer.ScoreSafely, so a faulty scorer
// costs a fallback decision, not the process). The package passes kvroute's conformance suite,
// package scorer/scorertest.
//
//	s, err := costscore.New(costscore.Config{RequestCost: 512})
//	if err != nil {
//		return err
//	}
//	r, err := kvroute.New(kvroute.Config{Backends: backends, KV: &kvroute.KVConfig{Index: ix, Scorer: s}})
package costscore
