package redisindex

import (
	"context"
	"strconv"
	"time"

	"github.com/redis/rueidis"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
)

// redisDumpPage is the COUNT hint of Dump's ZSCANs: about the entries one round trip lists.
const redisDumpPage = 256

// Compile-time check that Index implements kvindex.Dumper.
var _ kvindex.Dumper = (*Index)(nil)

// Dump lists backend's live entries (kvindex.Dumper) from its membership sets, which every write
// keeps: ZSCAN of its confirmed blocks (P mb:<b>) and then of its speculative ones (P ms:<b>),
// each page followed by an MGET of the page's block strings, whose slot is what Lookup reads;
// then ZSCAN of its prefix entries (P mp:<b>), each page followed by the entries' tiers and token
// counts (HGET and ZSCORE, pipelined). Members whose expiry has passed are skipped unread. A block
// is listed once, with its confirmed tiers and its speculative entry alike.
//
// Every round trip is bounded by WriteTimeout and by ctx, which is checked between pages; a
// listing of limit entries costs about limit/256 round trips of each kind, plus one for the
// backend's id, and holds nothing in Redis between them (ZSCAN, not a script), so that it never
// blocks routing. Errors wrap kvindex.ErrUnavailable (and ctx.Err() when ctx ended); ErrClosed
// after Close. Safe for concurrent use.
func (x *Index) Dump(ctx context.Context, backend string, limit int, fn func(kvindex.DumpEntry) error) error {
	if x.closed.Load() {
		return kvindex.ErrClosed
	}
	if limit <= 0 {
		limit = kvindex.DefaultDumpLimit
	}
	res, err := x.do(ctx, x.writeTimeout, x.client.B().Hget().Key(x.idsKey).Field(backend).Build())
	if rueidis.IsRedisNil(err) {
		return nil
	}
	if err != nil {
		return redisUnavailable("dump", err)
	}
	id, err := res.AsInt64()
	if err != nil {
		return redisUnavailable("dump", err)
	}
	d := &redisDump{x: x, ctx: ctx, backend: backend, id: int(id), tag: redisTag(backend), left: limit,
		seen: map[string]bool{}, fn: fn}
	if id >= 0 {
		for _, set := range []string{x.prefix + "mb:" + backend, x.prefix + "ms:" + backend} {
			if err := d.scan(set, d.blocks); err != nil || d.left == 0 {
				return err
			}
		}
	}
	return d.scan(x.prefix+"mp:"+backend, d.prefixes)
}

// redisDump is one Dump call.
type redisDump struct {
	x       *Index
	ctx     context.Context
	backend string
	id      int
	tag     uint16
	left    int
	seen    map[string]bool // blocks listed (their hex keys)
	fn      func(kvindex.DumpEntry) error
}

// scan ZSCANs set and passes each page's live members, not yet seen, to list, until the set is
// exhausted or d.left reaches 0.
func (d *redisDump) scan(set string, list func(members []string, now time.Time) error) error {
	x := d.x
	var cursor uint64
	for {
		if err := d.ctx.Err(); err != nil {
			return redisUnavailable("dump", err)
		}
		res, err := x.do(d.ctx, x.writeTimeout, x.client.B().Zscan().Key(set).Cursor(cursor).Count(redisDumpPage).Build())
		if err != nil {
			return redisUnavailable("dump", err)
		}
		e, err := res.AsScanEntry()
		if err != nil || len(e.Elements)%2 != 0 {
			return redisUnavailable("dump", redisReplyErr(err))
		}
		now := x.now()
		var members []string
		for i := 0; i < len(e.Elements); i += 2 {
			m := e.Elements[i]
			exp, err := strconv.ParseFloat(e.Elements[i+1], 64)
			if err != nil || int64(exp) <= now.UnixMilli() || d.seen[m] {
				continue
			}
			members = append(members, m)
		}
		if len(members) > 0 {
			if err := list(members, now); err != nil || d.left == 0 {
				return err
			}
		}
		if cursor = e.Cursor; cursor == 0 {
			return nil
		}
	}
}

// blocks lists the blocks of members (hex keys) that the backend's slots say it holds.
func (d *redisDump) blocks(members []string, now time.Time) error {
	x := d.x
	keys := make([]uint64, 0, len(members))
	hexes := members[:0]
	for _, m := range members {
		if k, ok := redisParseHex16(m); ok {
			keys = append(keys, k)
			hexes = append(hexes, m)
		}
	}
	res, err := x.do(d.ctx, x.writeTimeout, x.client.B().Mget().Key(x.blockKeyNames(keys)...).Build())
	if err != nil {
		return redisUnavailable("dump", err)
	}
	vals, err := res.ToArray()
	if err != nil || len(vals) != len(keys) {
		return redisUnavailable("dump", redisReplyErr(err))
	}
	ms := now.UnixMilli()
	for i, v := range vals {
		s, _ := v.ToString() // "" for a block gone meanwhile
		tiers, confExp, specExp := redisSlotEntries(s, d.id, d.tag, ms)
		if tiers == 0 && specExp == 0 {
			continue
		}
		d.seen[hexes[i]] = true
		e := kvindex.DumpEntry{Backend: d.backend, Key: keys[i], Tiers: make([]kvindex.Tier, 0, events.NumTiers)}
		for t := range kvindex.Tier(events.NumTiers) {
			if tiers&(1<<t) != 0 {
				e.Tiers = append(e.Tiers, t)
			}
		}
		if tiers != 0 {
			e.Expires = time.UnixMilli(confExp)
		}
		if specExp != 0 {
			e.Speculative, e.SpeculativeExpires = true, time.UnixMilli(specExp)
		}
		if err := d.fn(e); err != nil {
			return err
		}
		if d.left--; d.left == 0 {
			return nil
		}
	}
	return nil
}

// prefixes lists the prefix entries of members (prefix hexes) that are live.
func (d *redisDump) prefixes(members []string, now time.Time) error {
	x := d.x
	cmds := make([]rueidis.Completed, 0, 2*len(members))
	for _, h := range members {
		cmds = append(cmds,
			x.client.B().Hget().Key(x.prefix+"pt:"+h).Field(d.backend).Build(),
			x.client.B().Zscore().Key(x.prefix+"p:"+h).Member(d.backend).Build())
	}
	res, err := x.doMulti(d.ctx, x.writeTimeout, cmds)
	if err != nil {
		return redisUnavailable("dump", err)
	}
	for i, h := range members {
		tv, _ := res[2*i].ToString()
		tokens, err := res[2*i+1].AsFloat64()
		t, exp, ok := redisParsePrefixTier(tv)
		if !ok || err != nil || tokens <= 0 || exp <= now.UnixMilli() {
			continue // removed or expired meanwhile
		}
		e := kvindex.DumpEntry{Backend: d.backend, Prefix: h, Tokens: int(tokens), Tiers: []kvindex.Tier{t},
			Expires: time.UnixMilli(exp)}
		if err := d.fn(e); err != nil {
			return err
		}
		if d.left--; d.left == 0 {
			return nil
		}
	}
	return nil
}

// redisSlotEntries decodes the slot of backend id (tag tag) in block string v at time now (ms):
// the tiers of its live confirmed entry (bit t: Tier(t)) and that entry's expiry, and the expiry
// of its live speculative entry (0 when none).
func redisSlotEntries(v string, id int, tag uint16, now int64) (tiers uint8, confExp, specExp int64) {
	off := id * redisSlotSize
	if id < 0 || len(v) < off+redisConfOff ||
		uint16(v[off+redisTagOff])<<8|uint16(v[off+redisTagOff+1]) != tag {
		return 0, 0, 0
	}
	if len(v) >= off+redisSlotSize {
		w := redisGet48(v, off+redisConfOff)
		if t := uint8(w>>redisTierShift) & 7; t != 0 && int64(w&redisExpMask) > now {
			tiers, confExp = t, int64(w&redisExpMask)
		}
	}
	if s := int64(redisGet48(v, off)); s > now {
		specExp = s
	}
	return tiers, confExp, specExp
}
