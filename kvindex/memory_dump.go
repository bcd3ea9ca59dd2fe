package kvindex

import (
	"context"
	"time"
)

// dumpSlice is the most block bodies Dump reads under one hold of a shard's lock: a whole shard
// at the default sizes (MaxEntries / 256 shards is 4,096 blocks), a few hundred microseconds of
// holding it at most.
const dumpSlice = 1 << 16

// dumpBlock is a block Dump found, copied out of its shard.
type dumpBlock struct {
	h       uint64 // mixed key, flag bits cleared
	tiers   uint8  // the backend's confirmed tiers (live)
	spec    bool   // the backend's speculative entry (live)
	stamp   uint32 // evidence epoch
	specExp uint32 // speculative expiry tick
	low     uint64 // the flag bits of the block's mixed key when its shard gives them, else 4
}

// Dump lists backend's live entries (Dumper): its blocks, shard by shard, then its prefix
// entries. Each shard is read under its lock, dumpSlice (65,536) blocks at a time in key order
// (so that at the default sizes a shard's listing is consistent), and the blocks found are passed to fn after
// the lock is released; Lookup takes no lock and never waits for it, Apply and Speculate wait for
// one slice's reading at most. Confirmed entries expire on the index's epochs (EntryTTL/64), so
// Expires is exact to that. ctx is checked between slices. It returns ErrClosed after Close.
//
// The table keys blocks by a mix of the block key without its two lowest bits; with four shards
// or more (MaxEntries ≥ 16,384) the shard gives those bits back, and a smaller index finds its
// keys in the backend's engine-hash map and speculative queue, read once per call (both small in
// an index that small); a block found in neither, if any, is listed with Key 0.
func (m *MemoryIndex) Dump(ctx context.Context, backend string, limit int, fn func(DumpEntry) error) error {
	if m.closed.Load() {
		return ErrClosed
	}
	if limit <= 0 {
		limit = DefaultDumpLimit
	}
	bs := m.reg.lookup(backend)
	if bs == nil {
		return nil
	}
	var keys map[uint64]uint64 // few shards: mixed key without the flag bits → block key
	if len(m.shards) < minKeyedShards {
		keys = m.dumpKeys(bs)
	}
	bit := uint64(1) << bs.id
	buf := make([]dumpBlock, 0, min(limit, 1024))
	left := limit
	for i := range m.shards {
		sh := &m.shards[i]
		for after := uint64(0); left > 0; {
			if err := ctx.Err(); err != nil {
				return err
			}
			var more, gone bool
			var now time.Time
			buf, after, more, gone, now = m.dumpShard(sh, i, bs, bit, after, left, buf[:0])
			if gone {
				return nil // cleared meanwhile
			}
			c := m.clockAt(now)
			for _, b := range buf {
				e := DumpEntry{Backend: backend, Tiers: tiersOf(b.tiers), Speculative: b.spec}
				switch {
				case b.low <= flagMask:
					e.Key = unmix(b.h | b.low)
				default:
					e.Key = keys[b.h]
				}
				if b.tiers != 0 {
					e.Expires = m.epochTime(now, c, b.stamp+c.ttl+1)
				}
				if b.spec {
					e.SpeculativeExpires = m.tickTime(now, c, b.specExp)
				}
				if err := fn(e); err != nil {
					return err
				}
				left--
			}
			if !more {
				break
			}
		}
	}
	if left == 0 {
		return nil
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return m.dumpPrefixes(bs, left, fn)
}

// dumpShard copies, under sh's lock, the live entries of bs (bit) among the next dumpSlice
// blocks of sh in key order after probe word after (0: from the first), at most left of them,
// into buf. It returns the last probe word it read and whether blocks may follow, whether bs was
// cleared, and the time the entries were judged at.
func (m *MemoryIndex) dumpShard(sh *shard, i int, bs *backendState, bit uint64, after uint64, left int,
	buf []dumpBlock) (_ []dumpBlock, last uint64, more, gone bool, now time.Time) {
	low := m.lowBits(i)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if m.reg.retired.Load()&bit != 0 || m.reg.lookup(bs.name) != bs {
		return buf, after, false, true, now
	}
	now = m.cfg.Now()
	c := m.clockAt(now)
	t := sh.tab.Load()
	read := 0
	for w, b := range t.blocks(after) {
		if len(buf) == left || read == dumpSlice {
			return buf, after, true, false, now
		}
		read++
		after = w
		v := b.load()
		if (v.confirmed()|v.spec)&bit == 0 {
			continue
		}
		d := dumpBlock{h: fullKey(w, b), stamp: v.stamp(), specExp: v.specExp(), low: low}
		if v.confirmed()&bit != 0 && c.fresh(&v) {
			for tier, holders := range v.tiers {
				if holders&bit != 0 {
					d.tiers |= 1 << tier
				}
			}
		}
		d.spec = v.spec&bit != 0 && c.specLive(&v)
		if d.tiers != 0 || d.spec {
			buf = append(buf, d)
		}
	}
	return buf, after, false, false, now
}

// dumpPrefixes lists bs's live prefix entries, at most left of them, one prefix shard at a time
// (read-locked while its entries are copied).
func (m *MemoryIndex) dumpPrefixes(bs *backendState, left int, fn func(DumpEntry) error) error {
	if m.prefix.count.Load() == 0 {
		return nil
	}
	var buf []DumpEntry
	for i := range m.prefix.shards {
		sh := &m.prefix.shards[i]
		now := m.cfg.Now()
		c := m.clockAt(now)
		buf = buf[:0]
		sh.mu.RLock()
		for prefix, e := range sh.m {
			if len(buf) == left {
				break
			}
			for _, h := range e.holders {
				if h.id == bs.id && int32(c.now-h.stamp) < int32(c.ttlTick) {
					buf = append(buf, DumpEntry{Backend: bs.name, Prefix: prefix, Tokens: h.tokens,
						Tiers: []Tier{h.tier}, Expires: m.tickTime(now, c, h.stamp+c.ttlTick)})
					break
				}
			}
		}
		sh.mu.RUnlock()
		if m.reg.lookup(bs.name) != bs {
			return nil // cleared meanwhile
		}
		for _, e := range buf {
			if err := fn(e); err != nil {
				return err
			}
		}
		if left -= len(buf); left == 0 {
			return nil
		}
	}
	return nil
}

// dumpKeys returns, for a table of fewer than minKeyedShards shards, the block keys bs's
// engine-hash map and speculative queue know, by their mixed key without the flag bits.
func (m *MemoryIndex) dumpKeys(bs *backendState) map[uint64]uint64 {
	keys := map[uint64]uint64{}
	for _, s := range m.engineSlots(bs) {
		keys[mix(s.key)&^flagMask] = s.key
	}
	bs.specMu.Lock()
	q := &bs.spec
	for i := range q.keys.n {
		h := *q.keys.at(i)
		keys[h&^flagMask] = unmix(h)
	}
	for _, e := range q.late {
		keys[e.h&^flagMask] = unmix(e.h)
	}
	bs.specMu.Unlock()
	return keys
}

// minKeyedShards is the fewest shards that give back the flag bits of their blocks' mixed keys
// (a block's shard is the low bits of its mixed key).
const minKeyedShards = flagMask + 1

// lowBits returns the flag bits of the mixed keys of shard i's blocks, or flagMask+1 when the
// table has too few shards to tell.
func (m *MemoryIndex) lowBits(i int) uint64 {
	if len(m.shards) < minKeyedShards {
		return flagMask + 1
	}
	return uint64(i) & flagMask
}

// clockAt is the index's clock at now (retired ids not loaded).
func (m *MemoryIndex) clockAt(now time.Time) clock {
	d := int64(now.Sub(m.epoch))
	return clock{now: uint32(d >> tickShift), epoch: uint32(d / m.epochNs), ttl: m.ttlEpochs, ttlTick: m.ttlTicks}
}

// epochTime returns the start of evidence epoch e (which wraps), near now (c = clockAt(now)).
func (m *MemoryIndex) epochTime(now time.Time, c clock, e uint32) time.Time {
	cur := int64(now.Sub(m.epoch)) / m.epochNs
	return m.epoch.Add(time.Duration((cur + int64(int32(e-c.epoch))) * m.epochNs))
}

// tickTime returns the start of tick k (which wraps), near now (c = clockAt(now)).
func (m *MemoryIndex) tickTime(now time.Time, c clock, k uint32) time.Time {
	cur := int64(now.Sub(m.epoch)) >> tickShift
	return m.epoch.Add(time.Duration((cur + int64(int32(k-c.now))) << tickShift))
}

// unmix inverts mix (except for the two keys mix moves to another constant).
func unmix(h uint64) uint64 {
	h ^= h >> 33
	h *= 0x9cb4b2f8129337db // the inverse of 0xc4ceb9fe1a85ec53 modulo 2⁶⁴
	h ^= h >> 33
	h *= 0x4f74430c22a54005 // the inverse of 0xff51afd7ed558ccd
	h ^= h >> 33
	return h
}
