package kvindex

import (
	"strings"
	"sync"
	"sync/atomic"

	"github.com/zeebo/xxh3"

	"github.com/kvroute/kvroute/events"
)

// prefixStore holds the prefix-granular entries of kvroute's SSE events: prefix hex → backend →
// (token count, tier, stamp). Sharded maps under RWMutexes: prefix traffic is one probe per
// request, far from the block table's rates.
type prefixStore struct {
	shards  [prefixShards]prefixShard
	count   atomic.Int64 // prefixes
	evictMu sync.Mutex
	stamps  []uint32 // under evictMu
}

const prefixShards = 16

type prefixShard struct {
	mu sync.RWMutex
	m  map[string]*prefixEntry
	_  [40]byte
}

type prefixEntry struct {
	stamp   uint32 // last update of any holder, for eviction
	holders []prefixHolder
}

type prefixHolder struct {
	id     uint8
	tier   events.Tier
	stamp  uint32
	tokens int
}

func (p *prefixStore) init() {
	for i := range p.shards {
		p.shards[i].m = make(map[string]*prefixEntry)
	}
}

func (p *prefixStore) shard(prefix string) *prefixShard {
	return &p.shards[xxh3.HashString(prefix)%prefixShards]
}

// applyPrefix applies one prefix-granular event of backend id, following kvroute's tier table.
func (m *MemoryIndex) applyPrefix(id uint8, ev *events.Event, now uint32) {
	if ev.PrefixHash == "" {
		m.drop(DropBadPrefix, 1)
		return
	}
	change, ok := PrefixRule(ev.PrefixOp, m.cfg.StorageOffloading, m.cfg.TreatEvictionAsOffload)
	if !ok {
		m.drop(DropBadPrefix, 1)
		return
	}
	remove, tier := change.Remove, change.Tier
	m.mut[change.Mutation].Add(1)
	p := &m.prefix
	if remove {
		m.prefixRemove(id, ev.PrefixHash)
		return
	}
	sh := p.shard(ev.PrefixHash)
	sh.mu.RLock()
	_, exists := sh.m[ev.PrefixHash]
	sh.mu.RUnlock()
	if !exists && int(p.count.Load()) >= m.cfg.MaxPrefixEntries {
		m.evictPrefixes(now)
	}
	sh.mu.Lock()
	e := sh.m[ev.PrefixHash]
	if e == nil {
		e = &prefixEntry{}
		sh.m[strings.Clone(ev.PrefixHash)] = e
		p.count.Add(1)
	}
	e.stamp = now
	for i := range e.holders {
		h := &e.holders[i]
		if h.id == id {
			h.tier, h.stamp = tier, now
			if ev.TokenCount > 0 {
				h.tokens = ev.TokenCount
			}
			sh.mu.Unlock()
			return
		}
	}
	e.holders = append(e.holders, prefixHolder{id: id, tier: tier, stamp: now, tokens: max(ev.TokenCount, 0)})
	sh.mu.Unlock()
	m.ids[id].prefix.Add(1)
}

// prefixRemove drops backend id's entry for prefix.
func (m *MemoryIndex) prefixRemove(id uint8, prefix string) {
	sh := m.prefix.shard(prefix)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.m[prefix]
	if e == nil {
		return
	}
	for i := range e.holders {
		if e.holders[i].id == id {
			e.holders = append(e.holders[:i], e.holders[i+1:]...)
			m.ids[id].prefix.Add(-1)
			break
		}
	}
	if len(e.holders) == 0 {
		delete(sh.m, prefix)
		m.prefix.count.Add(-1)
	}
}

// evictPrefixes drops the least recently updated tenth of the prefixes (kvroute's policy).
func (m *MemoryIndex) evictPrefixes(now uint32) {
	p := &m.prefix
	p.evictMu.Lock()
	defer p.evictMu.Unlock()
	if int(p.count.Load()) < m.cfg.MaxPrefixEntries {
		return // another writer evicted meanwhile
	}
	ages := p.stamps[:0]
	for i := range p.shards {
		sh := &p.shards[i]
		sh.mu.RLock()
		for _, e := range sh.m {
			ages = append(ages, tickAge(now, e.stamp))
		}
		sh.mu.RUnlock()
	}
	p.stamps = ages[:0]
	if len(ages) == 0 {
		return
	}
	k := max(1, len(ages)/10)
	thr := kthLargest(ages, k)
	evicted := 0
	for i := range p.shards {
		sh := &p.shards[i]
		sh.mu.Lock()
		for key, e := range sh.m {
			if evicted >= k {
				break
			}
			if tickAge(now, e.stamp) >= thr {
				for _, h := range e.holders {
					m.ids[h.id].prefix.Add(-1)
				}
				delete(sh.m, key)
				p.count.Add(-1)
				evicted++
			}
		}
		sh.mu.Unlock()
	}
	m.evictions.Add(uint64(evicted))
}

// sweepPrefixes drops expired holders and holders of retired ids; it returns the expired count.
func (m *MemoryIndex) sweepPrefixes(c clock) (expired int) {
	p := &m.prefix
	for i := range p.shards {
		sh := &p.shards[i]
		sh.mu.Lock()
		for key, e := range sh.m {
			kept := e.holders[:0]
			for _, h := range e.holders {
				switch {
				case c.retired&(1<<h.id) != 0:
				case int32(c.now-h.stamp) >= int32(c.ttlTick):
					expired++
					m.ids[h.id].prefix.Add(-1)
				default:
					kept = append(kept, h)
				}
			}
			e.holders = kept
			if len(kept) == 0 {
				delete(sh.m, key)
				p.count.Add(-1)
			}
		}
		sh.mu.Unlock()
	}
	return expired
}

// clearPrefixes drops every prefix entry and returns how many (prefix, backend) entries there were
// (retired ids excluded).
func (m *MemoryIndex) clearPrefixes(retired uint64) int {
	p := &m.prefix
	n := 0
	for i := range p.shards {
		sh := &p.shards[i]
		sh.mu.Lock()
		for _, e := range sh.m {
			for _, h := range e.holders {
				if retired&(1<<h.id) == 0 {
					n++
					m.ids[h.id].prefix.Add(-1)
				}
			}
		}
		p.count.Add(-int64(len(sh.m)))
		sh.m = make(map[string]*prefixEntry)
		sh.mu.Unlock()
	}
	return n
}

// prefixBytes estimates the memory of the prefix entries: map overhead, key, entry and holders.
func (m *MemoryIndex) prefixBytes() int64 {
	var n int64
	for i := range m.prefix.shards {
		sh := &m.prefix.shards[i]
		sh.mu.RLock()
		for k, e := range sh.m {
			n += int64(len(k)) + 16 + 8 + 48 + int64(cap(e.holders))*24
		}
		sh.mu.RUnlock()
	}
	return n
}

// tickAge is the number of ticks from stamp to now (0 for a stamp in the future).
func tickAge(now, stamp uint32) uint32 {
	if a := int32(now - stamp); a > 0 {
		return uint32(a)
	}
	return 0
}
