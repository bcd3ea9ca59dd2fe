package enginesim

import (
	"encoding/binary"

	"github.com/zeebo/xxh3"
)

// Tier names where a cached block lives.
type Tier uint8

const (
	TierGPU Tier = iota // GPU KV cache (event medium "GPU")
	TierCPU             // CPU offload tier (event medium "CPU")
	// TierStorage is external storage (event medium "STORAGE"): only BlockStored events of a
	// prefill engine's writes use it; the block cache itself holds GPU and CPU blocks.
	TierStorage
)

// String returns the event medium: "GPU", "CPU" or "STORAGE".
func (t Tier) String() string {
	switch t {
	case TierCPU:
		return "CPU"
	case TierStorage:
		return "STORAGE"
	}
	return "GPU"
}

// block is one full, hashed KV block (or, while detached, a held block that Reset un-cached).
type block struct {
	hash      uint64
	parent    uint64
	hasParent bool
	tokens    []uint32
	refs      int // running requests holding it (GPU only)
	tier      Tier
	detached  bool // un-cached by Reset while held: freed to the empty pool on release
	remote    bool // loaded from external storage and not yet part of an admitted request's hit
	inList    bool
	prev      *block
	next      *block
}

// blockList is an intrusive doubly linked list, least recently used first.
type blockList struct {
	head, tail *block
	n          int
}

func (l *blockList) pushBack(b *block) {
	b.prev, b.next, b.inList = l.tail, nil, true
	if l.tail != nil {
		l.tail.next = b
	} else {
		l.head = b
	}
	l.tail = b
	l.n++
}

func (l *blockList) remove(b *block) {
	if !b.inList {
		return
	}
	if b.prev != nil {
		b.prev.next = b.next
	} else {
		l.head = b.next
	}
	if b.next != nil {
		b.next.prev = b.prev
	} else {
		l.tail = b.prev
	}
	b.prev, b.next, b.inList = nil, nil, false
	l.n--
}

func (l *blockList) popFront() *block {
	b := l.head
	if b != nil {
		l.remove(b)
	}
	return b
}

// opKind is the type of a cache operation, the source of KV events.
type opKind uint8

const (
	opStored opKind = iota + 1
	opRemoved
	opCleared
)

// op is one cache operation, in the order it happened: a BlockStored of a chain run (hashes,
// the parent of the first, the run's tokens), a BlockRemoved, or an AllBlocksCleared.
type op struct {
	kind      opKind
	tier      Tier
	hashes    []uint64
	parent    uint64
	hasParent bool
	tokens    []uint32
}

// blockCache is the paged KV cache with prefix caching: GPU blocks (held by running requests,
// cached and evictable in LRU order, or empty) and an optional CPU tier that evicted blocks move to.
// Every block lives on one tier at a time. It is not safe for concurrent use: the Engine's mutex
// guards it. Its operations are appended to ops for the event publishers.
type blockCache struct {
	bs             int
	capacity       int
	cpuCap         int
	seed           uint64
	gpu            map[uint64]*block
	cpu            map[uint64]*block
	free           blockList // GPU blocks with refs 0, evicted from the front
	cpuLRU         blockList
	empty          int // GPU blocks holding nothing
	ops            []op
	gpuEvictions   uint64
	cpuEvictions   uint64
	storedBlocks   uint64
	reloadedBlocks uint64
}

func newBlockCache(bs, capacity, cpuCap int, seed uint64) *blockCache {
	return &blockCache{
		bs: bs, capacity: capacity, cpuCap: cpuCap, seed: seed,
		gpu: make(map[uint64]*block), cpu: make(map[uint64]*block), empty: capacity,
	}
}

// blockHash is the engine's own block hash: xxh3-64 over le64(seed) ‖ le64(parent) ‖ le32 tokens,
// with parent = seed ^ a constant for block 0. It is opaque outside the engine (the seed is
// random per process unless configured), like vLLM's.
func (c *blockCache) blockHash(parent uint64, hasParent bool, tokens []uint32) uint64 {
	var h xxh3.Hasher
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], c.seed)
	_, _ = h.Write(b[:])
	if !hasParent {
		parent = c.seed ^ 0x9e3779b97f4a7c15
	}
	binary.LittleEndian.PutUint64(b[:], parent)
	_, _ = h.Write(b[:])
	for _, t := range tokens {
		binary.LittleEndian.PutUint32(b[:4], t)
		_, _ = h.Write(b[:4])
	}
	return h.Sum64()
}

// hashes appends the hashes of the full blocks of tokens to dst.
func (c *blockCache) hashes(dst []uint64, tokens []uint32) []uint64 {
	var parent uint64
	for i := 0; i+c.bs <= len(tokens); i += c.bs {
		h := c.blockHash(parent, i > 0, tokens[i:i+c.bs])
		dst = append(dst, h)
		parent = h
	}
	return dst
}

// Block classes in a plan.
const (
	classMissing uint8 = iota
	classGPU
	classCPU
)

// plan is what admitting a request would do, computed without changing the cache.
type plan struct {
	tokens    []uint32
	hashes    []uint64
	class     []uint8
	gpuHit    int // leading blocks on the GPU (local prefix-cache hit), capped
	hit       int // leading blocks on any tier, capped: gpuHit plus the CPU-tier part
	cpuLoaded int // blocks of the hit on the CPU tier
	total     int // GPU blocks the request needs: prompt plus completion
}

// private is the number of unhashed blocks (partial prompt tail and completion).
func (p *plan) private() int { return p.total - len(p.hashes) }

// makePlan classifies the full blocks of tokens and sizes the request. As in vLLM, at most
// (n−1)/B blocks count as hit, so that the last prompt token is always computed.
func (c *blockCache) makePlan(tokens []uint32, outTokens int) plan {
	p := plan{tokens: tokens}
	p.hashes = c.hashes(make([]uint64, 0, len(tokens)/c.bs), tokens)
	p.class = make([]uint8, len(p.hashes))
	p.total = (len(tokens) + outTokens + c.bs - 1) / c.bs
	c.classify(&p)
	return p
}

// classify (re)computes p's block classes and hits from the cache's current state.
func (c *blockCache) classify(p *plan) {
	p.gpuHit, p.hit, p.cpuLoaded = 0, 0, 0
	for i, h := range p.hashes {
		p.class[i] = classMissing
		if _, ok := c.gpu[h]; ok {
			p.class[i] = classGPU
		} else if _, ok := c.cpu[h]; ok {
			p.class[i] = classCPU
		}
	}
	maxHit := 0
	if len(p.tokens) > 0 {
		maxHit = (len(p.tokens) - 1) / c.bs
	}
	for p.gpuHit < maxHit && p.class[p.gpuHit] == classGPU {
		p.gpuHit++
	}
	p.hit = p.gpuHit
	for p.hit < maxHit && p.class[p.hit] != classMissing {
		if p.class[p.hit] == classCPU {
			p.cpuLoaded++
		}
		p.hit++
	}
}

// fits reports whether the cache can admit p now.
func (c *blockCache) fits(p *plan) bool {
	need := p.private() // blocks taken from the empty or evictable ones
	for _, h := range p.hashes {
		if b := c.gpu[h]; b == nil || b.refs == 0 {
			need++
		}
	}
	return need <= c.empty+c.free.n
}

// lease is what a running request holds: its prompt's full blocks in order and a number of
// private blocks.
type lease struct {
	blocks  []*block
	private int
}

// admit pins and allocates what p needs; p must have been classified against the cache's current
// state and fits(p) must hold. It records the operations in c.ops.
func (c *blockCache) admit(p *plan) *lease {
	l := &lease{blocks: make([]*block, len(p.hashes)), private: p.private()}
	claimed := make([]*block, len(p.hashes))
	var cpuRemoved []uint64
	// Pin what the GPU holds and claim what the CPU tier holds first, so that no allocation below
	// evicts them.
	for i, h := range p.hashes {
		if b := c.gpu[h]; b != nil {
			if b.refs == 0 {
				c.free.remove(b)
			}
			b.refs++
			l.blocks[i] = b
		} else if b := c.cpu[h]; b != nil {
			c.cpuLRU.remove(b)
			delete(c.cpu, h)
			claimed[i] = b
			cpuRemoved = append(cpuRemoved, h)
		}
	}
	runStart := -1
	flush := func(end int) {
		if runStart < 0 {
			return
		}
		o := op{kind: opStored, tier: TierGPU, tokens: p.tokens[runStart*c.bs : end*c.bs]}
		o.hashes = append([]uint64(nil), p.hashes[runStart:end]...)
		if runStart > 0 {
			o.parent, o.hasParent = p.hashes[runStart-1], true
		}
		c.ops = append(c.ops, o)
		c.storedBlocks += uint64(end - runStart)
		runStart = -1
	}
	for i, h := range p.hashes {
		if l.blocks[i] != nil {
			flush(i)
			continue
		}
		c.allocSlot()
		b := claimed[i]
		if b == nil {
			b = &block{hash: h, tokens: append([]uint32(nil), p.tokens[i*c.bs:(i+1)*c.bs]...)}
			if i > 0 {
				b.parent, b.hasParent = p.hashes[i-1], true
			}
		} else {
			c.reloadedBlocks++
		}
		b.tier, b.refs = TierGPU, 1
		c.gpu[h] = b
		l.blocks[i] = b
		if runStart < 0 {
			runStart = i
		}
	}
	flush(len(p.hashes))
	if len(cpuRemoved) > 0 {
		c.ops = append(c.ops, op{kind: opRemoved, tier: TierCPU, hashes: cpuRemoved})
	}
	for range l.private {
		c.allocSlot()
	}
	return l
}

// allocSlot takes one GPU block: an empty one, else the least recently used evictable one.
func (c *blockCache) allocSlot() {
	if c.empty > 0 {
		c.empty--
		return
	}
	b := c.free.popFront()
	if b == nil {
		panic("enginesim: block cache over-committed") // fits was not checked
	}
	c.evictGPU(b)
}

// evictGPU drops b from the GPU, moving it to the CPU tier when there is one.
func (c *blockCache) evictGPU(b *block) {
	delete(c.gpu, b.hash)
	c.gpuEvictions++
	if c.cpuCap > 0 {
		if c.cpuLRU.n >= c.cpuCap {
			v := c.cpuLRU.popFront()
			delete(c.cpu, v.hash)
			c.cpuEvictions++
			c.ops = append(c.ops, op{kind: opRemoved, tier: TierCPU, hashes: []uint64{v.hash}})
		}
		b.tier = TierCPU
		c.cpu[b.hash] = b
		c.cpuLRU.pushBack(b)
		// Stored on the CPU before removed from the GPU, so that a consumer never sees the block
		// on no tier (and forgets its engine hash) in between.
		c.ops = append(c.ops, op{kind: opStored, tier: TierCPU, hashes: []uint64{b.hash},
			parent: b.parent, hasParent: b.hasParent, tokens: b.tokens})
	}
	c.ops = append(c.ops, op{kind: opRemoved, tier: TierGPU, hashes: []uint64{b.hash}})
}

// release frees a lease: its blocks' references are dropped tail first, so that a request's last
// blocks are the first to be evicted (vLLM's order), and its private blocks become empty.
func (c *blockCache) release(l *lease) {
	for i := len(l.blocks) - 1; i >= 0; i-- {
		b := l.blocks[i]
		b.refs--
		if b.refs > 0 {
			continue
		}
		if b.detached {
			c.empty++
		} else {
			c.free.pushBack(b)
		}
	}
	c.empty += l.private
	l.blocks, l.private = nil, 0
}

// reset drops every cached block (AllBlocksCleared). Blocks held by running requests stay
// allocated but are no longer cached.
func (c *blockCache) reset() {
	for h, b := range c.gpu {
		delete(c.gpu, h)
		if b.refs == 0 {
			c.free.remove(b)
			c.empty++
		} else {
			b.detached = true
		}
	}
	for h, b := range c.cpu {
		delete(c.cpu, h)
		c.cpuLRU.remove(b)
	}
	c.ops = append(c.ops, op{kind: opCleared})
}

// lookup returns the leading full blocks of tokens held on the GPU, and on any tier.
func (c *blockCache) lookup(tokens []uint32) (gpu, cached int) {
	var parent uint64
	inGPU := true
	for i := 0; i+c.bs <= len(tokens); i += c.bs {
		h := c.blockHash(parent, i > 0, tokens[i:i+c.bs])
		parent = h
		_, g := c.gpu[h]
		_, cp := c.cpu[h]
		if !g && !cp {
			break
		}
		if g && inGPU {
			gpu++
		} else {
			inGPU = false
		}
		cached++
	}
	return gpu, cached
}

// held returns the GPU blocks allocated to running requests.
func (c *blockCache) held() int { return c.capacity - c.empty - c.free.n }

// insertLoaded places blocks from to to−1 of tokens, read from external storage, on the GPU as
// cached, evictable blocks, and records their BlockStored (GPU) operations. The blocks before
// from must be cached (GPU or CPU tier), else nothing is placed: the loaded run would not
// continue a prefix. Blocks already cached are left as they are; placement takes empty blocks,
// then evicts the least recently used evictable ones, but never this prompt's own blocks, and
// stops when no block is free. Placed blocks are marked remote until an admission counts them.
// It returns the number of blocks placed.
func (c *blockCache) insertLoaded(tokens []uint32, from, to int) int {
	if from >= to || to*c.bs > len(tokens) {
		return 0
	}
	hashes := c.hashes(make([]uint64, 0, to), tokens[:to*c.bs])
	var pinned []*block // this prompt's GPU blocks, held while placing so that nothing evicts them
	pin := func(b *block) {
		if b.refs == 0 {
			c.free.remove(b)
		}
		b.refs++
		pinned = append(pinned, b)
	}
	unpin := func() {
		for i := len(pinned) - 1; i >= 0; i-- { // tail first, as release
			b := pinned[i]
			b.refs--
			if b.refs == 0 {
				c.free.pushBack(b)
			}
		}
	}
	for _, h := range hashes[:from] {
		if b := c.gpu[h]; b != nil {
			pin(b)
		} else if c.cpu[h] == nil {
			unpin()
			return 0
		}
	}
	placed, runStart := 0, -1
	flush := func(end int) {
		if runStart < 0 {
			return
		}
		o := op{kind: opStored, tier: TierGPU, tokens: tokens[runStart*c.bs : end*c.bs]}
		o.hashes = append([]uint64(nil), hashes[runStart:end]...)
		if runStart > 0 {
			o.parent, o.hasParent = hashes[runStart-1], true
		}
		c.ops = append(c.ops, o)
		c.storedBlocks += uint64(end - runStart)
		runStart = -1
	}
	end := from
	for i := from; i < to; i++ {
		h := hashes[i]
		if b := c.gpu[h]; b != nil {
			flush(i)
			pin(b)
			end = i + 1
			continue
		}
		if c.cpu[h] != nil { // admission reloads it from the CPU tier
			flush(i)
			end = i + 1
			continue
		}
		if c.empty == 0 && c.free.n == 0 {
			break
		}
		c.allocSlot()
		b := &block{hash: h, tokens: append([]uint32(nil), tokens[i*c.bs:(i+1)*c.bs]...), tier: TierGPU, remote: true}
		if i > 0 {
			b.parent, b.hasParent = hashes[i-1], true
		}
		c.gpu[h] = b
		pin(b)
		placed++
		if runStart < 0 {
			runStart = i
		}
		end = i + 1
	}
	flush(end)
	unpin()
	return placed
}

// storageOps records storage-tier BlockStored ops for the prompt's blocks idx (increasing block
// indexes): one op per run of consecutive blocks, with the engine's own hashes, each run chained to
// its parent's hash.
func (c *blockCache) storageOps(tokens []uint32, idx []int) {
	if len(idx) == 0 {
		return
	}
	hashes := c.hashes(make([]uint64, 0, len(tokens)/c.bs), tokens)
	for a := 0; a < len(idx); {
		b := a + 1
		for b < len(idx) && idx[b] == idx[b-1]+1 {
			b++
		}
		first, last := idx[a], idx[b-1]+1
		o := op{kind: opStored, tier: TierStorage, tokens: tokens[first*c.bs : last*c.bs],
			hashes: append([]uint64(nil), hashes[first:last]...)}
		if first > 0 {
			o.parent, o.hasParent = hashes[first-1], true
		}
		c.ops = append(c.ops, o)
		a = b
	}
}
