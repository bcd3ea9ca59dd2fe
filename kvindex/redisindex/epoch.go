package redisindex

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"math/rand/v2"
	"time"

	"github.com/redis/rueidis"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
)

// DefaultLossCheckInterval is how long a verdict on the registry epoch stays fresh for
// Index.BackendLost: a call finding none newer (no Lookup, Apply, Speculate or
// ClearBackend has read the epoch since) reads it from Redis, one GET shared by every backend.
const DefaultLossCheckInterval = time.Second

// Compile-time check that Index reports lost backends to the events consumers.
var _ events.LossReporter = (*Index)(nil)

// The registry epoch.
//
// P epoch is a random token that lives as long as the index's Redis state: a process that finds
// it missing, or different from the one it knew, knows that Redis lost what it held (a restart
// without persistence, a failover to a replica that had not seen the writes, FLUSHALL). Every
// write pipeline ends with SET P epoch <fresh random token> NX and GET P epoch, so that the epoch
// exists again after the first write that follows a loss; Lookup, LookupPrefix and BackendLost
// read it with a GET. A token is drawn per write round trip, so a write that recreates the epoch
// after a loss always reads a token no process knew, and a process that adopted another round
// trip's creation first reads its own token as the known one. The process keeps the epoch it
// knows and a loss generation: a verdict that finds the epoch missing or changed bumps the
// generation, and every backend with state of an older generation is lost until its next
// ClearBackend. The verdict of a round trip that was in flight while another detected a loss is
// moot and ignored.

// redisNewEpoch returns a fresh random epoch token (128 bits of the runtime's per-process seeded
// generator: unique among the writers sharing a Redis, not a secret).
func redisNewEpoch() string {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], rand.Uint64())
	binary.LittleEndian.PutUint64(b[8:], rand.Uint64())
	return hex.EncodeToString(b[:])
}

// epochWriteCmds returns the two commands a write pipeline ends with: SET P epoch <fresh token>
// NX and GET P epoch.
func (x *Index) epochWriteCmds() (set, get rueidis.Completed) {
	return x.client.B().Set().Key(x.epochKey).Value(redisNewEpoch()).Nx().Build(), x.epochGetCmd()
}

// epochGetCmd returns GET P epoch.
func (x *Index) epochGetCmd() rueidis.Completed {
	return x.client.B().Get().Key(x.epochKey).Build()
}

// redisStamp is the epoch state a round trip was sent in: the version of the known epoch and the
// loss generation.
type redisStamp struct{ ver, gen uint64 }

// stamp returns the current epoch state, to be passed to the verdict of a round trip sent now.
func (x *Index) stamp() redisStamp {
	v := x.epochVer.Load() // first: a change between the loads makes the stamp stale, not wrong
	return redisStamp{ver: v, gen: x.lossGen.Load()}
}

// epochWriteReply checks the replies of epochWriteCmds (set, get), made by a round trip sent at
// s, and returns the loss generation the round trip's writes belong to (see epochVerdict), or the
// error of an unexpected reply (the verdict is then skipped).
func (x *Index) epochWriteReply(s redisStamp, set, get rueidis.RedisResult) (uint64, error) {
	if err := set.Error(); err != nil && !rueidis.IsRedisNil(err) {
		return s.gen, err
	}
	got, err := get.ToString()
	if err != nil && !rueidis.IsRedisNil(err) {
		return s.gen, err
	}
	return x.epochVerdict(s, got), nil
}

// epochReadReply checks the reply of epochGetCmd made by a round trip sent at s.
func (x *Index) epochReadReply(s redisStamp, get rueidis.RedisResult) error {
	got, err := get.ToString()
	if err != nil && !rueidis.IsRedisNil(err) {
		return err
	}
	_ = x.epochVerdict(s, got)
	return nil
}

// epochVerdict judges the epoch got ("" when missing) that a round trip sent at s read. The first
// epoch seen is adopted (nothing of this process can have been lost before it). Afterwards an epoch
// missing or changed is a loss: the generation is bumped, every backend is lost until its next
// ClearBackend, and the ids this process caches are re-read before their next use.
//
// A verdict of a round trip sent before the known epoch last changed is moot: its reply may
// predate the change (a read from before the first write created the epoch, say), and a loss it
// might have seen is seen again by the next round trip.
//
// It returns the loss generation the round trip's commands belong to: the new one when this
// verdict detected the loss (the round trip ran wholly on the new state, since it read the new
// epoch), otherwise s.gen (older than the current generation when a loss was detected while the
// round trip was in flight: its commands may have run before the loss).
func (x *Index) epochVerdict(s redisStamp, got string) uint64 {
	x.epochCheckedAt.Store(time.Now().UnixNano())
	if k := x.epochKnown.Load(); k != nil && got == *k && x.epochVer.Load() == s.ver {
		return s.gen // the common case, without the lock
	}
	x.epochMu.Lock()
	if x.epochVer.Load() != s.ver {
		x.epochMu.Unlock()
		return s.gen
	}
	k := x.epochKnown.Load()
	switch {
	case k == nil || *k == "":
		// First contact, or the first writer after a loss a reader detected: adopt.
		if got != "" {
			x.epochKnown.Store(&got)
			x.epochVer.Add(1)
		}
		x.epochMu.Unlock()
		return s.gen
	case got == *k:
		x.epochMu.Unlock()
		return s.gen
	}
	gen := x.lossGen.Add(1)
	x.epochKnown.Store(&got)
	x.epochVer.Add(1)
	x.epochMu.Unlock()
	x.mu.RLock()
	for _, st := range x.backends {
		st.idAt.Store(0) // the registry was lost with the rest: ask for the id again
	}
	x.mu.RUnlock()
	return gen
}

// lostSince reports whether st has state in Redis that belongs to a loss generation older than the
// current one.
func (x *Index) lostSince(st *redisBackend) bool {
	return st.dirty.Load() && st.gen.Load() < x.lossGen.Load()
}

// beginWrite is called before a round trip, sent at loss generation gen, that writes st's
// entries. A backend without state in Redis takes gen as its generation; it reports whether the
// backend had none.
func (x *Index) beginWrite(st *redisBackend, gen uint64) (clean bool) {
	clean = !st.dirty.Load()
	if clean {
		st.gen.Store(gen)
	}
	st.dirty.Store(true)
	return clean
}

// endWrite is called after such a round trip whose epoch verdict says its commands belong to
// generation got (epochVerdict): a backend that had no state before, written by the very round
// trip that detected a loss, has its whole state in the new generation.
func (x *Index) endWrite(st *redisBackend, gen, got uint64, clean bool) {
	if clean && got > gen {
		st.gen.Store(got)
	}
}

// cleared records that st's entries were cleared by a clear whose epoch verdict says it belongs to
// generation got: the backend has no state, unless a loss another round trip detected meanwhile
// leaves the clear in doubt (it may have run partly before the loss): it is then still lost.
func (x *Index) cleared(st *redisBackend, got uint64) {
	st.gen.Store(got)
	st.dirty.Store(got < x.lossGen.Load())
}

// BackendLost implements events.LossReporter: it reports whether Redis lost what this process
// wrote for backend since backend's last ClearBackend (the index's first write for it, if none) —
// Redis restarted without persistence, failed over to a replica that had not seen the writes, or
// was flushed. A lost backend stays lost until ClearBackend; Apply refuses its batches with
// kvindex.ErrBackendLost meanwhile. A backend this process never wrote for is never lost.
//
// The loss is detected from the registry epoch (see Index), which every Lookup, Apply, Speculate
// and ClearBackend reads in the round trip it makes anyway; when no call has read it for
// DefaultLossCheckInterval, BackendLost reads it itself (one GET, bounded by CommandTimeout, shared
// by concurrent callers, whose answer is the last verdict). Errors: kvindex.ErrClosed after Close,
// or an error wrapping kvindex.ErrUnavailable when that GET failed (lost is then false: not known).
// Safe for concurrent use; ctx bounds the GET.
func (x *Index) BackendLost(ctx context.Context, backend string) (lost bool, err error) {
	if x.closed.Load() {
		return false, kvindex.ErrClosed
	}
	x.mu.RLock()
	st := x.backends[backend]
	x.mu.RUnlock()
	if st == nil {
		return false, nil
	}
	if x.lostSince(st) {
		return true, nil
	}
	last := x.epochCheckedAt.Load()
	now := time.Now().UnixNano()
	if now-last < int64(DefaultLossCheckInterval) || !x.epochCheckedAt.CompareAndSwap(last, now) {
		return false, nil
	}
	stamp := x.stamp()
	res, err := x.do(ctx, x.cmdTimeout, x.epochGetCmd())
	if err != nil && !rueidis.IsRedisNil(err) {
		return false, redisUnavailable("backend lost", err)
	}
	if err := x.epochReadReply(stamp, res); err != nil {
		return false, redisUnavailable("backend lost", err)
	}
	return x.lostSince(st), nil
}
