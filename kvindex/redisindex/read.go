package redisindex

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/redis/rueidis"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
)

// Lookup implements Lookuper: for each candidate, the longest consecutive prefix of keys it holds
// (each block on its best live tier; a speculative entry counts as GPU), Tokens = Blocks ×
// BlockSize, Score the tier-weighted length, Tier the slowest tier among the matched blocks, and
// StoredBlocks the longest consecutive prefix it holds on TierStorage (on faster tiers too or
// not; StoredTokens = StoredBlocks × BlockSize). Unknown candidates, and candidates whose entries
// all expired, get a zero Match.
//
// It makes one round trip per DefaultLookupChunk blocks — HMGET of the candidates' ids
// pipelined with MGET of the chunk's block strings — and reads a further chunk only while some
// candidate has matched every block so far; no keys or no candidates cost no round trip. The
// whole call is bounded by CommandTimeout (or ctx's earlier deadline).
//
// Errors: kvindex.ErrClosed after Close; otherwise they wrap kvindex.ErrUnavailable (Redis
// unreachable, too slow, backing off after a failure, or an error reply) and, when ctx ended,
// ctx.Err(); out is then undefined. Safe for concurrent use.
func (x *Index) Lookup(ctx context.Context, keys []uint64, candidates []string, out []kvindex.Match) ([]kvindex.Match, error) {
	out = out[:len(candidates)]
	for i, c := range candidates {
		out[i] = kvindex.Match{Backend: c}
	}
	if x.closed.Load() {
		return out, kvindex.ErrClosed
	}
	x.counters.lookups.Add(1)
	if len(keys) == 0 || len(candidates) == 0 {
		return out, nil
	}
	cctx, cancel := redisWithTimeout(ctx, x.cmdTimeout)
	defer cancel()
	stamp := x.stamp()
	now := x.now().UnixMilli()
	ids := make([]int, len(candidates))
	tags := make([]uint16, len(candidates))
	alive := make([]int, 0, len(candidates)) // indexes of the candidates matching every block so far
	counts := make([][events.NumTiers]int, len(candidates))
	// stored[i] counts candidate i's blocks held on storage so far; storedOn[i] says that every
	// block so far was (the stored prefix has not ended).
	stored := make([]int, len(candidates))
	storedOn := make([]bool, len(candidates))
	for lo := 0; lo < len(keys); lo += DefaultLookupChunk {
		chunk := keys[lo:min(lo+DefaultLookupChunk, len(keys))]
		cmds := make([]rueidis.Completed, 0, 3)
		if lo == 0 {
			cmds = append(cmds, x.client.B().Hmget().Key(x.idsKey).Field(candidates...).Build(), x.epochGetCmd())
		}
		cmds = append(cmds, x.client.B().Mget().Key(x.blockKeyNames(chunk)...).Build())
		res, err := x.doMultiIn(ctx, cctx, cmds)
		if err != nil {
			return out, redisUnavailable("lookup", err)
		}
		if lo == 0 {
			// A lost Redis is noticed on the routing path too, so that the events consumers heal
			// the backends (BackendLost) even when none of them publishes.
			if err := x.epochReadReply(stamp, res[1]); err != nil {
				return out, redisUnavailable("lookup", err)
			}
			vals, err := res[0].ToArray()
			if err != nil || len(vals) != len(candidates) {
				return out, redisUnavailable("lookup", redisReplyErr(err))
			}
			for i := range vals {
				ids[i] = -1
				if s, err := vals[i].ToString(); err == nil {
					if id, err := strconv.Atoi(s); err == nil && id >= 0 {
						ids[i], tags[i] = id, redisTag(candidates[i])
						alive = append(alive, i)
						storedOn[i] = true
					}
				}
			}
			if len(alive) == 0 {
				return out, nil
			}
		}
		blocks, err := res[len(res)-1].ToArray()
		if err != nil || len(blocks) != len(chunk) {
			return out, redisUnavailable("lookup", redisReplyErr(err))
		}
		for _, b := range blocks {
			v, _ := b.ToString() // "" for a missing block
			n := 0
			for _, i := range alive {
				if t, sto, ok := redisSlotTier(v, ids[i], tags[i], now); ok {
					counts[i][t]++
					if storedOn[i] = storedOn[i] && sto; storedOn[i] {
						stored[i]++
					}
					alive[n] = i
					n++
				}
			}
			if alive = alive[:n]; n == 0 {
				break
			}
		}
		if len(alive) == 0 {
			break
		}
	}
	for i := range out {
		m := &out[i]
		for t, n := range counts[i] {
			if n > 0 {
				m.Blocks += n
				m.WeightedBlocks += float64(n) * x.weights[t]
				m.Tier = kvindex.Tier(t)
			}
		}
		m.Tokens = m.Blocks * x.blockSize
		m.StoredBlocks = stored[i]
		m.StoredTokens = m.StoredBlocks * x.blockSize
	}
	return out, nil
}

// redisReplyErr describes an unexpected reply.
func redisReplyErr(err error) error {
	if err != nil {
		return err
	}
	return fmt.Errorf("unexpected reply shape")
}

// LookupPrefix implements PrefixLookuper in one round trip (ZREVRANGEBYSCORE +inf -inf WITHSCORES
// of the prefix's sorted set, pipelined with HGETALL of its tiers). For each candidate holding a
// live entry: Tokens is its token count, Blocks = Tokens / BlockSize, Score = Tokens × the weight
// of its tier; StoredTokens and StoredBlocks equal Tokens and Blocks for an entry on TierStorage.
// prefix is compared case-insensitively. Timeouts and errors as Lookup.
func (x *Index) LookupPrefix(ctx context.Context, prefix string, candidates []string, out []kvindex.Match) ([]kvindex.Match, error) {
	out = out[:len(candidates)]
	for i, c := range candidates {
		out[i] = kvindex.Match{Backend: c}
	}
	if x.closed.Load() {
		return out, kvindex.ErrClosed
	}
	x.counters.lookups.Add(1)
	if prefix == "" || len(candidates) == 0 {
		return out, nil
	}
	prefix = strings.ToLower(prefix)
	stamp := x.stamp()
	cmds := []rueidis.Completed{
		x.client.B().Zrevrangebyscore().Key(x.prefix + "p:" + prefix).Max("+inf").Min("-inf").Withscores().Build(),
		x.client.B().Hgetall().Key(x.prefix + "pt:" + prefix).Build(),
		x.epochGetCmd(),
	}
	res, err := x.doMulti(ctx, x.cmdTimeout, cmds)
	if err != nil {
		return out, redisUnavailable("lookup prefix", err)
	}
	if err := x.epochReadReply(stamp, res[2]); err != nil {
		return out, redisUnavailable("lookup prefix", err)
	}
	scores, err := res[0].AsZScores()
	if err != nil {
		return out, redisUnavailable("lookup prefix", err)
	}
	tiers, err := res[1].AsStrMap()
	if err != nil {
		return out, redisUnavailable("lookup prefix", err)
	}
	now := x.now().UnixMilli()
	for i := range out {
		m := &out[i]
		for _, z := range scores {
			if z.Member != m.Backend {
				continue
			}
			t, exp, ok := redisParsePrefixTier(tiers[z.Member])
			if !ok || exp <= now || z.Score <= 0 {
				break
			}
			m.Tokens = int(z.Score)
			m.Blocks = m.Tokens / x.blockSize
			m.Tier = t
			m.WeightedBlocks = float64(m.Tokens) * x.weights[t]
			if t == events.TierStorage {
				m.StoredTokens, m.StoredBlocks = m.Tokens, m.Blocks
			}
			break
		}
	}
	return out, nil
}

// redisParsePrefixTier parses a prefix entry's "<t>:<expiry ms>".
func redisParsePrefixTier(v string) (kvindex.Tier, int64, bool) {
	if len(v) < 3 || v[1] != ':' || v[0] < '0' || v[0] >= '0'+events.NumTiers {
		return 0, 0, false
	}
	exp, err := strconv.ParseInt(v[2:], 10, 64)
	if err != nil {
		return 0, 0, false
	}
	return kvindex.Tier(v[0] - '0'), exp, true
}

// Stats returns this process's counters and the shared index's sizes, read in two round trips
// (HGETALL of the backend ids, then a read-only script counting each backend's live memberships).
// Entries and PerBackend count live (block, backend) memberships, speculative ones included, plus
// (prefix, backend) entries; SpeculativeCount the live speculative memberships not confirmed
// since; PrefixCount the distinct prefixes held; Blocks the distinct blocks held. All are exact
// while the backends hold at most DefaultStatsExactLimit block memberships in all (the script
// then reads them all, blocking Redis for a few milliseconds); above that, Blocks is the largest
// backend's count and a block both confirmed and speculative counts twice. Lookups, Mutations,
// Dropped and Expired (memberships pruned by this process's Applies) are per process; Evictions is
// 0 (Redis expires entries, counted in Expired; its maxmemory evictions are invisible to the
// index). Each round trip is bounded by WriteTimeout; errors wrap kvindex.ErrUnavailable, and the
// per-process counters are returned with them.
func (x *Index) Stats(ctx context.Context) (kvindex.Stats, error) {
	s := kvindex.Stats{
		Backend:    "redis",
		Lookups:    x.counters.lookups.Load(),
		Expired:    x.counters.expired.Load(),
		Mutations:  make(map[string]uint64, kvindex.NumMutations),
		Dropped:    make(map[string]uint64, kvindex.NumDropReasons),
		PerBackend: make(map[string]int),
	}
	for m := range kvindex.NumMutations {
		s.Mutations[m.String()] = x.counters.mutations[m].Load()
	}
	for r := range kvindex.NumDropReasons {
		s.Dropped[r.String()] = x.counters.dropped[r].Load()
	}
	if x.closed.Load() {
		return s, kvindex.ErrClosed
	}
	res, err := x.do(ctx, x.writeTimeout, x.client.B().Hkeys().Key(x.idsKey).Build())
	if err != nil {
		return s, redisUnavailable("stats", err)
	}
	names, err := res.AsStrSlice()
	if err != nil {
		return s, redisUnavailable("stats", err)
	}
	if len(names) == 0 {
		return s, nil
	}
	keys := make([]string, 0, 3*len(names))
	for _, b := range names {
		keys = append(keys, x.prefix+"mb:"+b, x.prefix+"ms:"+b, x.prefix+"mp:"+b)
	}
	args := []string{strconv.FormatInt(x.now().UnixMilli(), 10), strconv.Itoa(DefaultStatsExactLimit)}
	rs, err := x.runScript(ctx, x.writeTimeout, &x.statsScript, []redisScriptCall{{keys: keys, args: args}})
	if err != nil {
		return s, redisUnavailable("stats", err)
	}
	counts, err := rs[0].AsIntSlice()
	if err != nil || len(counts) != 3+3*len(names) {
		return s, redisUnavailable("stats", redisReplyErr(err))
	}
	s.Blocks, s.PrefixCount = int(counts[0]), int(counts[2])
	for i, b := range names {
		n, spec, np := int(counts[3+3*i]), int(counts[4+3*i]), int(counts[5+3*i])
		if n+np == 0 {
			continue
		}
		s.PerBackend[b] = n + np
		s.Entries += n + np
		s.SpeculativeCount += spec
	}
	return s, nil
}
