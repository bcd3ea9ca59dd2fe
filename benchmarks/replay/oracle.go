package replay

// infinite fills res for the infinite-cache oracle: every prompt token ever seen stays cached on
// every engine, so a request hits the longest prefix of it that any earlier request sent (in
// whole blocks, and at most (n−1)/BlockSize blocks, as the engines count). Its hit ratio is the
// ceiling of the workload's reuse. Its TTFT is the latency model's prefill at that hit with no
// queueing: a floor, not a fleet's. It has no engines, so no load or throughput.
func infinite(w *Workload, cfg Config, res *Result) {
	// seen maps a chain key — the segments before, with their lengths, and this segment's ID —
	// to the most tokens of this segment seen after that exact prefix.
	seen := make(map[uint64]int, len(w.Requests)*4)
	ttft := make([]float64, 0, len(w.Requests))
	var sum float64
	bs := cfg.BlockSize
	for i := range w.Requests {
		r := &w.Requests[i]
		n := r.InputTokens()
		matched, stop := 0, false
		var prev uint64 = 0x6f7261636c65
		for _, sg := range r.Segments {
			key := splitmix(prev ^ sg.ID*0x9e3779b97f4a7c15)
			have := seen[key]
			if !stop {
				m := min(have, sg.Tokens)
				matched += m
				stop = m < sg.Tokens
			}
			if have < sg.Tokens {
				seen[key] = sg.Tokens
			}
			prev = splitmix(key ^ uint64(sg.Tokens))
		}
		hit := 0
		if n > 0 {
			hit = min(matched/bs, (n-1)/bs) * bs
		}
		res.Requests++
		res.PromptTokens += int64(n)
		res.CachedTokens += int64(hit)
		res.OutputTokens += int64(r.OutputTokens)
		t := cfg.Latency.Prefill(n, hit, 0).Seconds()
		ttft = append(ttft, t)
		sum += t
	}
	if res.PromptTokens > 0 {
		res.HitRatio = float64(res.CachedTokens) / float64(res.PromptTokens)
	}
	res.ReachableTokens, res.Reachable = res.CachedTokens, res.HitRatio
	fillTTFT(res, ttft, sum)
}
