package redisindex

import "github.com/kvroute/kvroute/kvindex"

// redisEngineCache is a bounded LRU map from one backend's engine block hashes to the kvroute block
// keys they were re-keyed to, and the tiers the backend holds them on. Index keeps one per backend
// so that applying a BlockStored whose parent was stored recently, or a BlockRemoved of a recently
// stored block, needs no read round trip to Redis.
//
// Nodes live in one slice and link by index, so the cache holds no pointers besides the slices of
// keys of engine blocks that span several of ours (engine block size a multiple > 1 of ours).
//
// It is not safe for concurrent use: redisBackend's mutex guards it. The zero value is not usable;
// call newRedisEngineCache.
type redisEngineCache struct {
	capacity int
	index    map[uint64]int32
	nodes    []redisEngineNode
	head     int32 // most recently used, -1 when empty
	tail     int32 // least recently used, -1 when empty
}

// redisEngineNode is one engine block: its hash, our key(s) in chain order, and a bit per tier.
type redisEngineNode struct {
	hash       uint64
	key        uint64   // our first (usually only) key
	rest       []uint64 // our further keys when the engine block spans several of ours
	tiers      uint8    // bit t set: held on Tier(t)
	prev, next int32
}

// tail returns the last of the node's keys: the parent of the next engine block's first key.
func (n *redisEngineNode) tailKey() uint64 {
	if len(n.rest) > 0 {
		return n.rest[len(n.rest)-1]
	}
	return n.key
}

// newRedisEngineCache returns an empty cache holding at most capacity (≥ 1) entries.
func newRedisEngineCache(capacity int) *redisEngineCache {
	if capacity < 1 {
		capacity = 1
	}
	return &redisEngineCache{
		capacity: capacity,
		index:    make(map[uint64]int32, min(capacity, 1024)),
		head:     -1,
		tail:     -1,
	}
}

// len returns the number of entries.
func (c *redisEngineCache) len() int { return len(c.index) }

// has reports whether hash is cached, without touching its recency.
func (c *redisEngineCache) has(hash uint64) bool {
	_, ok := c.index[hash]
	return ok
}

// get returns hash's node and marks it most recently used, or nil when hash is not cached. The
// pointer is valid until the next put or reset.
func (c *redisEngineCache) get(hash uint64) *redisEngineNode {
	i, ok := c.index[hash]
	if !ok {
		return nil
	}
	c.moveToFront(i)
	return &c.nodes[i]
}

// put records that hash maps to keys (len ≥ 1; the slice is kept when len > 1) and is held on the
// tiers in tierBits (or-ed into the tiers already recorded), marking it most recently used; it
// evicts the least recently used entry when the cache is full.
func (c *redisEngineCache) put(hash uint64, keys []uint64, tierBits uint8) {
	if i, ok := c.index[hash]; ok {
		n := &c.nodes[i]
		n.key, n.rest = keys[0], nil
		if len(keys) > 1 {
			n.rest = keys[1:]
		}
		n.tiers |= tierBits
		c.moveToFront(i)
		return
	}
	var i int32
	if len(c.nodes) < c.capacity {
		c.nodes = append(c.nodes, redisEngineNode{})
		i = int32(len(c.nodes) - 1)
	} else {
		i = c.tail
		c.unlink(i)
		delete(c.index, c.nodes[i].hash)
	}
	n := &c.nodes[i]
	*n = redisEngineNode{hash: hash, key: keys[0], tiers: tierBits, prev: -1, next: -1}
	if len(keys) > 1 {
		n.rest = keys[1:]
	}
	c.index[hash] = i
	c.pushFront(i)
}

// clearTier records that hash left tier t; it drops the entry when no tier holds it any more.
func (c *redisEngineCache) clearTier(hash uint64, t kvindex.Tier) {
	i, ok := c.index[hash]
	if !ok {
		return
	}
	n := &c.nodes[i]
	n.tiers &^= 1 << t
	if n.tiers != 0 {
		return
	}
	c.unlink(i)
	delete(c.index, hash)
	// Move the last node into the hole so that the slice stays dense.
	last := int32(len(c.nodes) - 1)
	if i != last {
		c.nodes[i] = c.nodes[last]
		m := &c.nodes[i]
		c.index[m.hash] = i
		if m.prev >= 0 {
			c.nodes[m.prev].next = i
		} else {
			c.head = i
		}
		if m.next >= 0 {
			c.nodes[m.next].prev = i
		} else {
			c.tail = i
		}
	}
	c.nodes[last] = redisEngineNode{}
	c.nodes = c.nodes[:last]
}

// reset empties the cache and releases its memory.
func (c *redisEngineCache) reset() {
	if len(c.index) == 0 && c.nodes == nil {
		return
	}
	c.index = make(map[uint64]int32)
	c.nodes = nil
	c.head, c.tail = -1, -1
}

func (c *redisEngineCache) moveToFront(i int32) {
	if c.head == i {
		return
	}
	c.unlink(i)
	c.pushFront(i)
}

func (c *redisEngineCache) pushFront(i int32) {
	n := &c.nodes[i]
	n.prev, n.next = -1, c.head
	if c.head >= 0 {
		c.nodes[c.head].prev = i
	}
	c.head = i
	if c.tail < 0 {
		c.tail = i
	}
}

func (c *redisEngineCache) unlink(i int32) {
	n := &c.nodes[i]
	if n.prev >= 0 {
		c.nodes[n.prev].next = n.next
	} else if c.head == i {
		c.head = n.next
	}
	if n.next >= 0 {
		c.nodes[n.next].prev = n.prev
	} else if c.tail == i {
		c.tail = n.prev
	}
	n.prev, n.next = -1, -1
}
