package redisindex

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/rueidis"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
)

// redisWriter accumulates the commands of one Apply and the counts to add once they are written.
type redisWriter struct {
	cmds      []rueidis.Completed
	buf       []byte   // names and values of the event being written
	scratch   []uint64 // our keys of the event being written
	offs      []int    // offs[i]:offs[i+1] are the keys of engine block i
	hashes    []uint64 // engine hashes of the event being written
	tiers     []uint8  // per engine block: the tiers it is on after the event
	now       int64    // unix ms
	exp       int64    // expiry of written entries, unix ms
	expStr    string
	ttlMs     int64
	off       int64      // the backend's slot offset
	stamp     redisStamp // the epoch state when the batch (or its part after a clear) began
	blocks    bool       // block entries or engine mappings written: refresh the backend's keys
	prefixes  bool       // prefix entries written
	mutations [kvindex.NumMutations]uint64
}

// reset empties w for another batch, keeping its buffers (up to a bound).
func (w *redisWriter) reset() {
	const keep = 1 << 16
	clear(w.cmds[:cap(w.cmds)]) // unsent commands, or sent ones whose replies all came back
	w.cmds = w.cmds[:0]
	if cap(w.buf) > keep {
		w.buf = nil
	}
	if cap(w.scratch) > keep || cap(w.cmds) > keep {
		w.scratch, w.cmds = nil, nil
	}
	w.blocks, w.prefixes = false, false
	w.mutations = [kvindex.NumMutations]uint64{}
}

// redisZeroSlot is an empty slot.
const redisZeroSlot = "\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"

// Apply implements events.Sink: it applies b's events, in order, as coming from backend, by the
// rules package kvindex exports (kvindex.CheckStored, StoredRoot, AppendStoredKeys, PrefixRule):
//
//   - BlockStored (attention group 0): the event's blocks are re-keyed with prefixkey.NextBlockKey
//     — block 0 from its parent's key (the key this backend's earlier event gave that engine hash)
//     or, without a parent, from prefixkey.BlockRoot(LoRA name, else b.Model, else DefaultModel;
//     cache salt); block i from block i−1. An engine block of r × BlockSize tokens becomes r of our
//     blocks, each folding in the engine block's extra keys (exact when a multimodal item covers
//     the whole engine block). Each block is held on the event's tier until EntryTTL from now,
//     confirming any speculative entry. A BlockStored without tokens adds its tier to blocks the
//     backend stored before (vLLM's offloading connector announces CPU copies so). Events with an
//     unknown parent, a token count other than block_size × blocks, a block size not a multiple
//     of ours, unknown tokenless blocks or another attention group are counted in Stats.Dropped
//     and skipped.
//   - BlockRemoved (group 0): the blocks leave the event's tier only; a block on no tier any more
//     is forgotten with its engine hash.
//   - AllBlocksCleared: as ClearBackend, between the events before and after it.
//   - prefix events: cache_created and cache_reloaded put the entry on GPU (with the event's token
//     count when given); cache_offloaded moves it to the storage tier when StorageOffloading, else
//     removes it; cache_evicted does the same when StorageOffloading and TreatEvictionAsOffload,
//     else removes it; cache_purged removes it.
//
// Round trips: all writes of a batch go in one pipeline (commands in event order), preceded by
// one read (the engine-hash map, and the backend's id when this process has not used it lately)
// only when some parent or removed block is neither earlier in the batch nor in the in-process
// cache; an AllBlocksCleared splits the batch. Each round trip is bounded by WriteTimeout.
//
// It returns nil when every round trip succeeded (dropped events included), kvindex.ErrClosed after
// Close, kvindex.ErrBackendLost when the backend's entries were lost — Redis lost its state since
// the backend's last ClearBackend (the registry epoch changed: the batch is refused, writing
// nothing, until ClearBackend; this call's own write may be the one that noticed), or Redis no
// longer held the backend's id (this batch's block writes are ignored and the next call takes a new
// id) — or an error wrapping kvindex.ErrUnavailable: some of the batch's writes may then have been
// applied. After an error the backend's in-process cache is reset so that later events re-read the
// map. Safe for concurrent use; calls for one backend are serialised. b is not retained.
func (x *Index) Apply(ctx context.Context, backend string, b *events.Batch) error {
	if x.closed.Load() {
		return kvindex.ErrClosed
	}
	if b == nil || len(b.Events) == 0 {
		return nil
	}
	st := x.backend(backend)
	st.mu.Lock()
	defer st.mu.Unlock()
	if x.lostSince(st) {
		return kvindex.ErrBackendLost // until ClearBackend: what follows would build on a hole
	}
	stamp := x.stamp()
	now := x.now()
	if err := x.prepare(ctx, st, b.Events, now); err != nil {
		st.cache.reset()
		return redisUnavailable("apply", err)
	}
	model := b.Model
	if model == "" {
		model = x.defaultModel
	}
	w := &st.w
	w.reset()
	w.stamp = stamp
	w.now, w.exp = now.UnixMilli(), now.Add(x.entryTTL).UnixMilli()
	w.ttlMs = x.entryTTL.Milliseconds()
	w.off = int64(st.id.Load()) * redisSlotSize
	w.expStr = strconv.FormatInt(w.exp, 10)
	for i := range b.Events {
		ev := &b.Events[i]
		switch ev.Kind {
		case events.KindBlockStored, events.KindBlockRemoved:
			if ev.GroupIdx != 0 {
				x.counters.dropped[kvindex.DropGroup].Add(1)
				continue
			}
			if w.off < 0 {
				x.counters.dropped[kvindex.DropTooManyBackends].Add(1)
				continue
			}
			if ev.Kind == events.KindBlockStored {
				x.writeStored(w, st, model, ev)
			} else {
				x.writeRemoved(w, st, ev)
			}
		case events.KindAllBlocksCleared:
			if err := x.flush(ctx, st, w); err != nil {
				st.cache.reset()
				return err
			}
			gen, err := x.clearBackendLocked(ctx, st, w.stamp)
			if err != nil {
				return err
			}
			x.counters.mutations[kvindex.MutationCleared].Add(1)
			x.cleared(st, gen)
			if x.lostSince(st) {
				return kvindex.ErrBackendLost
			}
			w.stamp = x.stamp()
		case events.KindPrefix:
			x.writePrefix(w, st, ev)
		default:
			x.counters.dropped[kvindex.DropUnknownKind].Add(1)
		}
	}
	if err := x.flush(ctx, st, w); err != nil {
		st.cache.reset()
		return err
	}
	return nil
}

// idReuseAfter is how long a backend must be idle before another may take its id.
func (x *Index) idReuseAfter() time.Duration { return x.entryTTL + redisIDReuseMargin }

// idFresh reports whether st's cached id may be used at now: it was confirmed by a write less than
// half the reuse delay ago, so no replica can have handed it to another backend since.
func (x *Index) idFresh(st *redisBackend, now time.Time) bool {
	return st.id.Load() >= 0 && now.UnixMilli()-st.idAt.Load() < x.idReuseAfter().Milliseconds()/2
}

// assignCall returns the script call that gets or assigns st's id.
func (x *Index) assignCall(st *redisBackend, now time.Time) redisScriptCall {
	return redisScriptCall{
		keys: []string{x.idsKey, x.seenKey, x.idSeqKey},
		args: []string{st.name, strconv.FormatInt(now.UnixMilli(), 10),
			strconv.FormatInt(x.idReuseAfter().Milliseconds(), 10), strconv.Itoa(x.maxBackends)},
	}
}

// checkID compares the id Redis holds for st (the reply of an HGET pipelined after writes made
// with id) with id: when they agree the cached id is confirmed until the next reuse deadline;
// otherwise (the registry was lost or the id reassigned) it is dropped, the next call asks for an
// id again, and checkID reports false. The writes just made under a stale id are ignored by
// readers (the slot's tag).
func (x *Index) checkID(st *redisBackend, id int64, r rueidis.RedisResult, now time.Time) bool {
	s, err := r.ToString()
	if err == nil {
		if got, err := strconv.ParseInt(s, 10, 64); err == nil && got == id {
			st.idAt.Store(now.UnixMilli())
			return true
		}
	}
	st.id.CompareAndSwap(id, -1)
	return false
}

// setID records the reply of an assign call (-1: every id is taken).
func (x *Index) setID(st *redisBackend, r rueidis.RedisResult, now time.Time) error {
	id, err := r.AsInt64()
	if err != nil {
		return err
	}
	st.id.Store(id)
	st.idAt.Store(now.UnixMilli())
	return nil
}

// backendID returns st's id, asking Redis (one round trip) when the cached one is stale; -1 when
// every id is taken.
func (x *Index) backendID(ctx context.Context, st *redisBackend, timeout time.Duration, now time.Time) (int, error) {
	if x.idFresh(st, now) {
		return int(st.id.Load()), nil
	}
	res, err := x.runScript(ctx, timeout, &x.assignScript, []redisScriptCall{x.assignCall(st, now)})
	if err != nil {
		return -1, err
	}
	if err := x.setID(st, res[0], now); err != nil {
		return -1, err
	}
	return int(st.id.Load()), nil
}

// prepare makes sure, in at most one round trip (two the first time a script is loaded), that
// st's id is known when evs hold block events, and that st's engine-hash cache holds the mappings
// evs need that are neither cached nor stored earlier in evs. st.mu is held.
func (x *Index) prepare(ctx context.Context, st *redisBackend, evs []events.Event, now time.Time) error {
	var miss []uint64
	blockEvents := false
	need := func(i int, h uint64) {
		if st.cache.has(h) || redisStoredBefore(evs[:i], h) || slices.Contains(miss, h) {
			return
		}
		miss = append(miss, h)
	}
	for i := range evs {
		ev := &evs[i]
		if ev.GroupIdx != 0 {
			continue
		}
		switch ev.Kind {
		case events.KindBlockStored:
			blockEvents = true
			switch {
			case len(ev.BlockHashes) == 0:
			case len(ev.TokenIDs) == 0:
				for _, h := range ev.BlockHashes {
					need(i, h)
				}
			case ev.HasParent:
				need(i, ev.Parent)
			}
		case events.KindBlockRemoved:
			blockEvents = true
			for _, h := range ev.BlockHashes {
				need(i, h)
			}
		}
	}
	needID := blockEvents && !x.idFresh(st, now)
	if !needID && len(miss) == 0 {
		return nil
	}
	var cmds []rueidis.Completed
	var assign redisScriptCall
	if needID {
		assign = x.assignCall(st, now)
		cmds = append(cmds, x.evalsha(&x.assignScript, assign.keys, assign.args))
	}
	if len(miss) > 0 {
		fields := make([]string, len(miss))
		buf := make([]byte, 0, 16*len(miss))
		for _, h := range miss {
			buf = redisAppendHex16(buf, h)
		}
		all := string(buf)
		for i := range fields {
			fields[i] = all[16*i : 16*i+16]
		}
		cmds = append(cmds, x.client.B().Hmget().Key(st.engineKey).Field(fields...).Build())
	}
	res, err := x.doMulti(ctx, x.writeTimeout, cmds)
	if err != nil {
		return err
	}
	if needID {
		r := res[0]
		if redisIsNoScript(r.Error()) {
			if r, err = x.do(ctx, x.writeTimeout, x.eval(&x.assignScript, assign.keys, assign.args)); err != nil {
				return err
			}
		}
		if err := x.setID(st, r, now); err != nil {
			return err
		}
	}
	if len(miss) == 0 {
		return nil
	}
	vals, err := res[len(res)-1].ToArray()
	if err != nil {
		return err
	}
	for i, h := range miss {
		if i >= len(vals) {
			break
		}
		// "<tier mask digit><our keys' hex>"
		v, err := vals[i].ToString()
		if err != nil || len(v) < 17 || (len(v)-1)%16 != 0 || v[0] < '1' || v[0] > '7' {
			continue
		}
		keys := make([]uint64, (len(v)-1)/16)
		ok := true
		for j := range keys {
			if keys[j], ok = redisParseHex16(v[1+16*j : 17+16*j]); !ok {
				break
			}
		}
		if ok {
			st.cache.put(h, keys, v[0]-'0')
		}
	}
	return nil
}

// redisStoredBefore reports whether a BlockStored among evs holds engine hash h.
func redisStoredBefore(evs []events.Event, h uint64) bool {
	for i := range evs {
		if evs[i].Kind == events.KindBlockStored && slices.Contains(evs[i].BlockHashes, h) {
			return true
		}
	}
	return false
}

// writeStored adds the writes of a BlockStored event (group 0) to w. st.mu is held.
func (x *Index) writeStored(w *redisWriter, st *redisBackend, model string, ev *events.Event) {
	r, reason, ok := kvindex.CheckStored(ev, x.blockSize)
	if !ok {
		x.counters.dropped[reason].Add(1)
		return
	}
	tier := kvindex.EventTier(ev.Tier)
	if r == 0 {
		x.writeTierOfKnown(w, st, tier, ev.BlockHashes)
		return
	}
	var parent uint64
	if ev.HasParent {
		node := st.cache.get(ev.Parent)
		if node == nil {
			x.counters.dropped[kvindex.DropUnknownParent].Add(1)
			return
		}
		parent = node.tailKey()
	} else {
		parent = kvindex.StoredRoot(ev, model, x.defaultModel)
	}
	n := len(ev.BlockHashes)
	var keys []uint64
	if r == 1 {
		keys = kvindex.AppendStoredKeys(w.scratch[:0], ev, parent, x.blockSize, r)
		w.scratch = keys
	} else {
		// The engine-hash cache keeps subslices of these keys.
		keys = kvindex.AppendStoredKeys(make([]uint64, 0, n*r), ev, parent, x.blockSize, r)
	}
	w.offs, w.tiers = w.offs[:0], w.tiers[:0]
	for i, h := range ev.BlockHashes {
		w.offs = append(w.offs, i*r)
		st.cache.put(h, keys[i*r:(i+1)*r], 1<<tier)
		w.tiers = append(w.tiers, st.cache.get(h).tiers)
	}
	w.offs = append(w.offs, n*r)
	x.writeEntries(w, st, ev.BlockHashes, keys, true)
}

// writeTierOfKnown adds tier to the blocks that hashes map to (a BlockStored without tokens);
// unknown hashes are dropped as unknown_block. st.mu is held.
func (x *Index) writeTierOfKnown(w *redisWriter, st *redisBackend, tier kvindex.Tier, hashes []uint64) {
	keys := w.scratch[:0]
	w.offs, w.hashes, w.tiers = w.offs[:0], w.hashes[:0], w.tiers[:0]
	for _, h := range hashes {
		node := st.cache.get(h)
		if node == nil {
			x.counters.dropped[kvindex.DropUnknownBlock].Add(1)
			continue
		}
		node.tiers |= 1 << tier
		w.offs = append(w.offs, len(keys))
		w.hashes = append(w.hashes, h)
		w.tiers = append(w.tiers, node.tiers)
		keys = append(keys, node.key)
		keys = append(keys, node.rest...)
	}
	w.scratch = keys
	if len(w.hashes) == 0 {
		return
	}
	w.offs = append(w.offs, len(keys))
	x.writeEntries(w, st, w.hashes, keys, false)
}

// writeEntries adds the writes that make st hold keys until w.exp: engine block hashes[i] maps to
// keys[w.offs[i]:w.offs[i+1]] and is on the tiers w.tiers[i]. Per key, SETRANGE of its slot (the
// whole slot when confirm, which drops a speculative entry; else the confirmed half) and PEXPIRE;
// per event, one ZADD of the memberships, a ZREM of the speculative ones (when confirm) and one
// HSET of the engine-hash map.
func (x *Index) writeEntries(w *redisWriter, st *redisBackend, hashes, keys []uint64, confirm bool) {
	// One string holds, per key, "P b:<k>" (its last 16 bytes are the membership member); per
	// engine block its slot value, then "<h>" and "<tiers><keys' hex>" for the engine-hash map.
	kl := x.redisBlockKeyLen()
	buf := w.buf[:0]
	for _, k := range keys {
		buf = x.appendRedisBlockKey(buf, k)
	}
	// A confirming write replaces the whole slot (dropping a speculative entry); a tokenless one
	// only its tag and confirmed half.
	lo := redisTagOff
	if confirm {
		lo = 0
	}
	slotLen, valOff := redisSlotSize-lo, w.off+int64(lo)
	for i, h := range hashes {
		slot := redisSlot(0, st.tag, w.tiers[i], w.exp)
		buf = append(buf, slot[lo:]...)
		buf = redisAppendHex16(buf, h)
		buf = append(buf, '0'+w.tiers[i])
		for _, k := range keys[w.offs[i]:w.offs[i+1]] {
			buf = redisAppendHex16(buf, k)
		}
	}
	w.buf = buf
	s := string(buf)
	pos := len(keys) * kl
	e := x.client.B().Hset().Key(st.engineKey).FieldValue()
	z := x.client.B().Zadd().Key(st.blocksKey).ScoreMember()
	for i := range hashes {
		value := s[pos : pos+slotLen]
		pos += slotLen
		nk := w.offs[i+1] - w.offs[i]
		mapping := s[pos+16 : pos+16+1+16*nk]
		e = e.FieldValue(s[pos:pos+16], mapping)
		pos += 16 + 1 + 16*nk
		for j := w.offs[i]; j < w.offs[i+1]; j++ {
			name := s[j*kl : (j+1)*kl]
			w.cmds = append(w.cmds,
				x.client.B().Setrange().Key(name).Offset(valOff).Value(value).Build(),
				x.client.B().Pexpire().Key(name).Milliseconds(w.ttlMs).Build())
			z = z.ScoreMember(float64(w.exp), name[kl-16:])
		}
	}
	w.cmds = append(w.cmds, z.Build(), e.Build())
	if confirm {
		w.cmds = append(w.cmds, x.zremMembers(st.specKey, s, len(keys)))
	}
	w.blocks = true
	w.mutations[kvindex.MutationStored] += uint64(len(keys))
}

// zremMembers returns a ZREM from key of the members of the first n block key names in s (each
// name's last 16 bytes).
func (x *Index) zremMembers(key, s string, n int) rueidis.Completed {
	kl := x.redisBlockKeyLen()
	mem := make([]string, n)
	for i := range mem {
		mem[i] = s[(i+1)*kl-16 : (i+1)*kl]
	}
	return x.client.B().Zrem().Key(key).Member(mem...).Build()
}

// writeRemoved adds the writes of a BlockRemoved event (group 0) to w: each block leaves the
// event's tier (a removal from GPU also drops a speculative entry); a block on no tier any more
// loses its membership and its engine-hash mapping. st.mu is held.
func (x *Index) writeRemoved(w *redisWriter, st *redisBackend, ev *events.Event) {
	tier := kvindex.EventTier(ev.Tier)
	keys := w.scratch[:0]
	w.offs, w.hashes, w.tiers = w.offs[:0], w.hashes[:0], w.tiers[:0]
	for _, h := range ev.BlockHashes {
		node := st.cache.get(h)
		if node == nil {
			x.counters.dropped[kvindex.DropUnknownBlock].Add(1)
			continue
		}
		if node.tiers&(1<<tier) == 0 {
			continue // not on that tier: nothing changes
		}
		w.offs = append(w.offs, len(keys))
		w.hashes = append(w.hashes, h)
		w.tiers = append(w.tiers, node.tiers&^(1<<tier))
		keys = append(keys, node.key)
		keys = append(keys, node.rest...)
		st.cache.clearTier(h, tier) // node is invalid from here
	}
	w.scratch = keys
	if len(w.hashes) == 0 {
		return
	}
	w.offs = append(w.offs, len(keys))
	kl := x.redisBlockKeyLen()
	buf := w.buf[:0]
	for _, k := range keys {
		buf = x.appendRedisBlockKey(buf, k)
	}
	// A removal from GPU replaces the whole slot (dropping a speculative entry too); from another
	// tier only its tag and confirmed half.
	lo := redisTagOff
	if tier == events.TierGPU {
		lo = 0
	}
	slotLen, valOff := redisSlotSize-lo, w.off+int64(lo)
	for i, h := range w.hashes {
		slot := redisSlot(0, st.tag, w.tiers[i], w.exp)
		buf = append(buf, slot[lo:]...)
		buf = redisAppendHex16(buf, h)
		buf = append(buf, '0'+w.tiers[i])
		for _, k := range keys[w.offs[i]:w.offs[i+1]] {
			buf = redisAppendHex16(buf, k)
		}
	}
	w.buf = buf
	s := string(buf)
	pos := len(keys) * kl
	var gone []string // memberships and engine hashes of blocks on no tier any more
	var goneHashes []string
	z := x.client.B().Zadd().Key(st.blocksKey).ScoreMember()
	kept := 0
	e := x.client.B().Hset().Key(st.engineKey).FieldValue()
	for i := range w.hashes {
		value := s[pos : pos+slotLen]
		pos += slotLen
		nk := w.offs[i+1] - w.offs[i]
		field, mapping := s[pos:pos+16], s[pos+16:pos+16+1+16*nk]
		pos += 16 + 1 + 16*nk
		if w.tiers[i] == 0 {
			goneHashes = append(goneHashes, field)
		} else {
			e = e.FieldValue(field, mapping)
		}
		for j := w.offs[i]; j < w.offs[i+1]; j++ {
			name := s[j*kl : (j+1)*kl]
			w.cmds = append(w.cmds,
				x.client.B().Setrange().Key(name).Offset(valOff).Value(value).Build(),
				x.client.B().Pexpire().Key(name).Milliseconds(w.ttlMs).Build())
			if w.tiers[i] == 0 {
				gone = append(gone, name[kl-16:])
			} else {
				z = z.ScoreMember(float64(w.exp), name[kl-16:])
				kept++
			}
		}
	}
	if len(gone) > 0 {
		w.cmds = append(w.cmds,
			x.client.B().Zrem().Key(st.blocksKey).Member(gone...).Build(),
			x.client.B().Hdel().Key(st.engineKey).Field(goneHashes...).Build())
	}
	if kept > 0 {
		w.cmds = append(w.cmds, z.Build(), e.Build())
	}
	if tier == events.TierGPU {
		w.cmds = append(w.cmds, x.zremMembers(st.specKey, s, len(keys)))
	}
	w.blocks = true
	w.mutations[kvindex.MutationRemoved] += uint64(len(keys))
}

// writePrefix adds the writes of a prefix-granular event to w.
func (x *Index) writePrefix(w *redisWriter, st *redisBackend, ev *events.Event) {
	h := ev.PrefixHash
	if h == "" || strings.ContainsAny(h, "*?[]\\") {
		x.counters.dropped[kvindex.DropBadPrefix].Add(1)
		return
	}
	h = strings.ToLower(h)
	c, ok := kvindex.PrefixRule(ev.PrefixOp, x.offloading, x.evictOffload)
	if !ok {
		x.counters.dropped[kvindex.DropBadPrefix].Add(1)
		return
	}
	w.mutations[c.Mutation]++
	tier, remove := c.Tier, c.Remove
	pk, tk := x.prefix+"p:"+h, x.prefix+"pt:"+h
	w.prefixes = true
	if remove {
		w.cmds = append(w.cmds,
			x.client.B().Zrem().Key(pk).Member(st.name).Build(),
			x.client.B().Hdel().Key(tk).Field(st.name).Build(),
			x.client.B().Zrem().Key(st.prefixesKey).Member(h).Build())
		return
	}
	if ev.TokenCount > 0 {
		w.cmds = append(w.cmds, x.client.B().Zadd().Key(pk).ScoreMember().ScoreMember(float64(ev.TokenCount), st.name).Build())
	} else {
		// Keep the count the entry has; create nothing when there is none.
		w.cmds = append(w.cmds, x.client.B().Zadd().Key(pk).Xx().Incr().ScoreMember().ScoreMember(0, st.name).Build())
	}
	w.cmds = append(w.cmds,
		x.client.B().Hset().Key(tk).FieldValue().FieldValue(st.name, strconv.Itoa(int(tier))+":"+w.expStr).Build(),
		x.client.B().Pexpire().Key(pk).Milliseconds(w.ttlMs).Build(),
		x.client.B().Pexpire().Key(tk).Milliseconds(w.ttlMs).Build(),
		x.client.B().Zadd().Key(st.prefixesKey).ScoreMember().ScoreMember(float64(w.exp), h).Build())
}

// flush sends w's commands in one round trip, with the refresh of the backend's own keys' TTLs
// and the pruning of its expired memberships, then adds w's counts. st.mu is held.
func (x *Index) flush(ctx context.Context, st *redisBackend, w *redisWriter) error {
	if len(w.cmds) == 0 {
		return nil
	}
	nWrites := len(w.cmds)
	now := strconv.FormatInt(w.now, 10)
	prune := -1
	if w.blocks {
		w.cmds = append(w.cmds,
			x.client.B().Zremrangebyscore().Key(st.blocksKey).Min("-inf").Max(now).Build(),
			x.client.B().Zremrangebyscore().Key(st.specKey).Min("-inf").Max(now).Build(),
			x.client.B().Pexpire().Key(st.blocksKey).Milliseconds(w.ttlMs).Build(),
			x.client.B().Pexpire().Key(st.specKey).Milliseconds(w.ttlMs).Build(),
			x.client.B().Pexpire().Key(st.engineKey).Milliseconds(w.ttlMs).Build(),
			x.client.B().Zadd().Key(x.seenKey).ScoreMember().ScoreMember(float64(w.now), st.name).Build(),
			x.client.B().Hget().Key(x.idsKey).Field(st.name).Build())
		prune = nWrites
	}
	if w.prefixes {
		w.cmds = append(w.cmds,
			x.client.B().Zremrangebyscore().Key(st.prefixesKey).Min("-inf").Max(now).Build(),
			x.client.B().Pexpire().Key(st.prefixesKey).Milliseconds(w.ttlMs).Build(),
			// Prefix entries need no slot, but Stats lists backends by their ids.
			x.client.B().Hsetnx().Key(x.idsKey).Field(st.name).Value("-1").Build())
	}
	set, get := x.epochWriteCmds()
	w.cmds = append(w.cmds, set, get)
	clean := x.beginWrite(st, w.stamp.gen)
	res, err := x.doMulti(ctx, x.writeTimeout, w.cmds)
	if err != nil {
		// A call that gave up on its deadline may leave the commands queued in rueidis, which
		// still reads them: let it keep this array and build the next batch in a new one.
		w.cmds = nil
	} else {
		clear(w.cmds[:cap(w.cmds)])
		w.cmds = w.cmds[:0]
	}
	if err != nil {
		return redisUnavailable("apply", err)
	}
	epoch := len(res) - 2
	for i := range res[:epoch] {
		if err := res[i].Error(); err != nil && (prune < 0 || i != prune+6) {
			return redisUnavailable("apply", err)
		}
	}
	got, err := x.epochWriteReply(w.stamp, res[epoch], res[epoch+1])
	if err != nil {
		return redisUnavailable("apply", err)
	}
	x.endWrite(st, w.stamp.gen, got, clean)
	// Lost: Redis lost its state since the backend's last clear (this round trip may be the one
	// that noticed), or the backend's id was not the registry's.
	lost := x.lostSince(st)
	if prune >= 0 {
		for _, i := range []int{prune, prune + 1} {
			if n, err := res[i].AsInt64(); err == nil {
				x.counters.expired.Add(uint64(n))
			}
		}
		if !x.checkID(st, w.off/redisSlotSize, res[prune+6], time.UnixMilli(w.now)) {
			lost = true
		}
	}
	for i := range w.mutations {
		if w.mutations[i] > 0 && !lost {
			x.counters.mutations[i].Add(w.mutations[i])
		}
		w.mutations[i] = 0
	}
	w.blocks, w.prefixes = false, false
	if lost {
		return kvindex.ErrBackendLost
	}
	return nil
}

// ClearBackend implements events.Sink: it removes every entry of backend (all tiers, speculative
// and prefix entries included) and its engine-hash map; the backend keeps the id the registry holds
// for it (a cached id the registry no longer holds is dropped, and the next Apply takes a new one),
// and stops being lost (BackendLost) unless another loss is detected meanwhile. Its last round trip
// checks the registry epoch. It pops the backend's membership sets 512 entries per round trip
// (ZPOPMIN, pipelined with the zeroing of the previous page's slots): the cost is proportional to
// the backend's entries, never a keyspace scan. Round trips are bounded by WriteTimeout; errors
// wrap kvindex.ErrUnavailable and leave the entries not yet reached in place. Safe for concurrent
// use; serialised with the backend's Apply.
func (x *Index) ClearBackend(ctx context.Context, backend string) error {
	if x.closed.Load() {
		return kvindex.ErrClosed
	}
	st := x.backend(backend)
	st.mu.Lock()
	defer st.mu.Unlock()
	gen, err := x.clearBackendLocked(ctx, st, x.stamp())
	if err != nil {
		return err
	}
	x.counters.mutations[kvindex.MutationCleared].Add(1)
	x.cleared(st, gen)
	return nil
}

// redisClearPage is the number of memberships ClearBackend pops per set and round trip.
const redisClearPage = 512

// clearBackendLocked removes st's entries; its last round trip checks the registry epoch. stamp
// is the epoch state when the clear began; it returns the loss generation the cleared state
// belongs to (epochVerdict). st.mu is held.
func (x *Index) clearBackendLocked(ctx context.Context, st *redisBackend, stamp redisStamp) (uint64, error) {
	st.cache.reset()
	// The id the registry holds, read without assigning one, rather than the cached id: a clear
	// often follows an outage, and the registry may have been lost since (a restart) or the id
	// given to another backend. A stale cached id is dropped, so that what is applied after the
	// clear (a catch-up, typically) does not go under it, and another backend's slots are not
	// zeroed.
	r, err := x.do(ctx, x.writeTimeout, x.client.B().Hget().Key(x.idsKey).Field(st.name).Build())
	if err != nil && !rueidis.IsRedisNil(err) {
		return stamp.gen, redisUnavailable("clear backend", err)
	}
	off, registered := int64(-1), int64(-1)
	if s, err := r.ToString(); err == nil {
		if id, err := strconv.ParseInt(s, 10, 64); err == nil && id >= 0 {
			off, registered = id*redisSlotSize, id
		}
	}
	if cached := st.id.Load(); cached >= 0 && cached != registered {
		st.id.CompareAndSwap(cached, -1)
	}
	ttl := x.entryTTL.Milliseconds()
	var pending []rueidis.Completed  // deletions of the last page's entries
	pop := [3]bool{true, true, true} // blocks, speculative, prefixes
	sets := [3]string{st.blocksKey, st.specKey, st.prefixesKey}
	for {
		cmds := pending
		var at [3]int
		final := true
		for s := range sets {
			at[s] = -1
			if pop[s] {
				cmds = append(cmds, x.client.B().Zpopmin().Key(sets[s]).Count(redisClearPage).Build())
				at[s] = len(cmds) - 1
				final = false
			}
		}
		if final {
			set, get := x.epochWriteCmds()
			cmds = append(cmds, x.client.B().Unlink().Key(st.engineKey, st.blocksKey, st.specKey, st.prefixesKey).Build(), set, get)
		}
		res, err := x.doMulti(ctx, x.writeTimeout, cmds)
		if err != nil {
			return stamp.gen, redisUnavailable("clear backend", err)
		}
		n := len(res)
		if final {
			n -= 2
		}
		for i := range res[:n] {
			if err := res[i].Error(); err != nil {
				return stamp.gen, redisUnavailable("clear backend", err)
			}
		}
		if final {
			g, err := x.epochWriteReply(stamp, res[n], res[n+1])
			if err != nil {
				return stamp.gen, redisUnavailable("clear backend", err)
			}
			return g, nil
		}
		pending = nil
		for s := range sets {
			if at[s] < 0 {
				continue
			}
			zs, err := res[at[s]].AsZScores()
			if err != nil {
				return stamp.gen, redisUnavailable("clear backend", err)
			}
			for _, z := range zs {
				if s == 2 {
					pending = append(pending,
						x.client.B().Zrem().Key(x.prefix+"p:"+z.Member).Member(st.name).Build(),
						x.client.B().Hdel().Key(x.prefix+"pt:"+z.Member).Field(st.name).Build())
				} else if off >= 0 {
					k := x.prefix + "b:" + z.Member
					pending = append(pending,
						x.client.B().Setrange().Key(k).Offset(off).Value(redisZeroSlot).Build(),
						x.client.B().Pexpire().Key(k).Milliseconds(ttl).Build())
				}
			}
			pop[s] = len(zs) == redisClearPage
		}
	}
}

// Speculate implements Speculator in one round trip (two commands per key, SETRANGE of the
// speculative half of the backend's slot and PEXPIRE): keys become GPU entries of backend until
// ttl from now (0 means SpeculativeTTL; at most EntryTTL) unless a BlockStored confirms them. A
// block the backend holds confirmed keeps its tier (a live confirmed entry wins in lookups); one
// speculated again keeps the later expiry only if the later call asks for it (the last write
// wins). The first call for a backend in a while costs one more round trip (its id). Bounded by
// CommandTimeout; errors as Lookup. Safe for concurrent use; never waits for Apply.
func (x *Index) Speculate(ctx context.Context, backend string, keys []uint64, ttl time.Duration) error {
	if x.closed.Load() {
		return kvindex.ErrClosed
	}
	if len(keys) == 0 {
		return nil
	}
	if ttl <= 0 {
		ttl = x.specTTL
	}
	ttl = min(max(ttl, time.Millisecond), x.entryTTL)
	st := x.backend(backend)
	now := x.now()
	stamp := x.stamp()
	cctx, cancel := redisWithTimeout(ctx, x.cmdTimeout)
	defer cancel()
	id, err := x.backendID(cctx, st, x.cmdTimeout, now)
	if err != nil {
		return redisUnavailable("speculate", err)
	}
	if id < 0 {
		x.counters.dropped[kvindex.DropTooManyBackends].Add(1)
		return nil
	}
	exp := now.Add(ttl).UnixMilli()
	names := x.blockKeyNames(keys)
	slot := redisSlot(exp, st.tag, 0, 0)
	value := string(slot[:redisConfOff]) // the speculative half and the tag
	off := int64(id) * redisSlotSize
	ttlMs := x.entryTTL.Milliseconds()
	cmds := make([]rueidis.Completed, 0, 2*len(keys)+3)
	z := x.client.B().Zadd().Key(st.specKey).ScoreMember()
	kl := x.redisBlockKeyLen()
	for _, name := range names {
		cmds = append(cmds,
			x.client.B().Setrange().Key(name).Offset(off).Value(value).Build(),
			x.client.B().Pexpire().Key(name).Milliseconds(ttlMs).Build())
		z = z.ScoreMember(float64(exp), name[kl-16:])
	}
	set, get := x.epochWriteCmds()
	cmds = append(cmds, z.Build(),
		x.client.B().Pexpire().Key(st.specKey).Milliseconds(ttlMs).Build(),
		x.client.B().Zadd().Key(x.seenKey).ScoreMember().ScoreMember(float64(now.UnixMilli()), st.name).Build(),
		x.client.B().Hget().Key(x.idsKey).Field(st.name).Build(), set, get)
	clean := x.beginWrite(st, stamp.gen)
	res, err := x.doMultiIn(ctx, cctx, cmds)
	if err != nil {
		return redisUnavailable("speculate", err)
	}
	hget := len(res) - 3
	for i := range res[:hget] {
		if err := res[i].Error(); err != nil {
			return redisUnavailable("speculate", err)
		}
	}
	// A lost speculation needs no answer, but a lost Redis does: the epoch verdict marks every
	// backend lost, whichever write comes first after the loss.
	got, err := x.epochWriteReply(stamp, res[hget+1], res[hget+2])
	if err != nil {
		return redisUnavailable("speculate", err)
	}
	x.endWrite(st, stamp.gen, got, clean)
	_ = x.checkID(st, int64(id), res[hget], now)
	x.counters.mutations[kvindex.MutationSpeculated].Add(uint64(len(keys)))
	return nil
}

// redisClearScanCount is the COUNT hint of Clear's SCAN.
const redisClearScanCount = 1000

// Clear deletes every entry under KeyPrefix: it counts them as Stats.Entries does, then deletes
// every key matching KeyPrefix* (SCAN MATCH COUNT 1000 and UNLINK per page, on every node of a
// cluster) except the backend id registry (ids, seen, idseq: replicas cache ids) and its epoch
// (a Clear is no loss: no backend is reported lost), and forgets this
// process's engine-hash mappings. No other index's prefix may start with this one. It costs a full
// keyspace scan: use it for resets, not routinely. Entries written concurrently may survive. Each
// round trip is bounded by WriteTimeout; errors wrap kvindex.ErrUnavailable.
func (x *Index) Clear(ctx context.Context) (int, error) {
	if x.closed.Load() {
		return 0, kvindex.ErrClosed
	}
	before, err := x.Stats(ctx)
	if err != nil {
		return 0, err
	}
	x.mu.RLock()
	for _, st := range x.backends {
		st.mu.Lock()
		st.cache.reset()
		st.mu.Unlock()
	}
	x.mu.RUnlock()
	nodes := []rueidis.Client{x.client}
	if x.client.Mode() == rueidis.ClientModeCluster {
		nodes = nodes[:0]
		for _, n := range x.client.Nodes() {
			nodes = append(nodes, n)
		}
	}
	match := x.base + "*"
	for _, node := range nodes {
		var cursor uint64
		for {
			if err := x.admit(); err != nil {
				return 0, err
			}
			cctx, cancel := redisWithTimeout(ctx, x.writeTimeout)
			r := node.Do(cctx, node.B().Scan().Cursor(cursor).Match(match).Count(redisClearScanCount).Build())
			cancel()
			x.observe(ctx, r.NonRedisError())
			entry, err := r.AsScanEntry()
			if err != nil {
				return 0, redisUnavailable("clear", err)
			}
			del := slices.DeleteFunc(entry.Elements, func(k string) bool {
				return k == x.idsKey || k == x.seenKey || k == x.idSeqKey || k == x.epochKey
			})
			if len(del) > 0 {
				if err := x.admit(); err != nil {
					return 0, err
				}
				cctx, cancel := redisWithTimeout(ctx, x.writeTimeout)
				r := node.Do(cctx, node.B().Unlink().Key(del...).Build())
				cancel()
				x.observe(ctx, r.NonRedisError())
				if err := r.Error(); err != nil {
					return 0, redisUnavailable("clear", err)
				}
			}
			if cursor = entry.Cursor; cursor == 0 {
				break
			}
		}
	}
	x.counters.mutations[kvindex.MutationCleared].Add(1)
	return before.Entries, nil
}
