package enginesim

import (
	"encoding/json"
	"net/http"
)

// SSE event names (kvroute's prefix-granular form).
const (
	sseCreated   = "cache_created"
	sseEvicted   = "cache_evicted"
	sseOffloaded = "cache_offloaded"
	sseReloaded  = "cache_reloaded"
	ssePurged    = "cache_purged"
)

// sseEvent is one prefix-granular event.
type sseEvent struct {
	name   string
	prefix string
	tokens int
}

// Prefix residency states.
const (
	prefixNone uint8 = iota
	prefixGPU
	prefixOffloaded
)

// prefixState tracks one prefix key: the block chain of the last request that had it, and what
// was last reported about it.
type prefixState struct {
	key    string
	chain  []uint64
	state  uint8
	tokens int
	dirty  bool
}

// sseSub is one subscriber of GET /v1/kv_events.
type sseSub struct {
	ch     chan sseEvent
	closed bool
}

// sseTracker turns cache operations into prefix-granular events. A prefix (kvroute's prefix key
// of a request) is reported with the number of leading tokens of its last request's full blocks
// that the engine still holds: cache_created when that count is on the GPU and changes (a request
// stored blocks, or eviction shortened it), cache_offloaded when only the CPU tier still holds
// its leading blocks, cache_reloaded when they come back to the GPU, cache_evicted when the GPU
// loses them and there is no CPU copy, cache_purged when the CPU tier loses them. It is not safe
// for concurrent use: the Engine's mutex guards it.
type sseTracker struct {
	bs       int
	buf      int
	prefixes map[string]*prefixState
	byBlock  map[uint64][]*prefixState
	dirty    []*prefixState
	subs     map[*sseSub]struct{}
	sent     uint64
	dropped  uint64 // subscribers disconnected for falling behind
}

func newSSETracker(bs, buf int) *sseTracker {
	return &sseTracker{bs: bs, buf: buf, prefixes: make(map[string]*prefixState),
		byBlock: make(map[uint64][]*prefixState), subs: make(map[*sseSub]struct{})}
}

func (t *sseTracker) markDirty(p *prefixState) {
	if !p.dirty {
		p.dirty = true
		t.dirty = append(t.dirty, p)
	}
}

func (t *sseTracker) unlink(p *prefixState) {
	for _, h := range p.chain {
		l := t.byBlock[h]
		for i, q := range l {
			if q == p {
				l[i] = l[len(l)-1]
				l = l[:len(l)-1]
				break
			}
		}
		if len(l) == 0 {
			delete(t.byBlock, h)
		} else {
			t.byBlock[h] = l
		}
	}
}

// setChain records that a request of prefix key stored (or holds) the blocks of chain.
func (t *sseTracker) setChain(key string, chain []uint64) {
	if key == "" || len(chain) == 0 {
		return
	}
	p := t.prefixes[key]
	if p == nil {
		p = &prefixState{key: key}
		t.prefixes[key] = p
	} else {
		t.unlink(p)
	}
	p.chain = append(p.chain[:0], chain...)
	for _, h := range p.chain {
		t.byBlock[h] = append(t.byBlock[h], p)
	}
	t.markDirty(p)
}

// onOps marks the prefixes whose blocks ops touched.
func (t *sseTracker) onOps(ops []op) {
	for i := range ops {
		if ops[i].kind == opCleared {
			for _, p := range t.prefixes {
				t.markDirty(p)
			}
			continue
		}
		for _, h := range ops[i].hashes {
			for _, p := range t.byBlock[h] {
				t.markDirty(p)
			}
		}
	}
}

// flush recomputes the dirty prefixes against c and sends the resulting events.
func (t *sseTracker) flush(c *blockCache) {
	for _, p := range t.dirty {
		p.dirty = false
		gpu, cached := 0, 0
		for _, h := range p.chain {
			if _, ok := c.gpu[h]; ok {
				if gpu == cached {
					gpu++
				}
			} else if _, ok := c.cpu[h]; !ok {
				break
			}
			cached++
		}
		old := p.state
		switch {
		case gpu > 0:
			n := gpu * t.bs
			if old == prefixGPU && p.tokens == n {
				continue
			}
			name := sseCreated
			if old == prefixOffloaded {
				name = sseReloaded
			}
			p.state, p.tokens = prefixGPU, n
			t.send(sseEvent{name, p.key, n})
		case cached > 0:
			n := cached * t.bs
			if old == prefixOffloaded && p.tokens == n {
				continue
			}
			p.state, p.tokens = prefixOffloaded, n
			t.send(sseEvent{sseOffloaded, p.key, n})
		default:
			switch old {
			case prefixGPU:
				t.send(sseEvent{sseEvicted, p.key, 0})
			case prefixOffloaded:
				t.send(sseEvent{ssePurged, p.key, 0})
			}
			t.unlink(p)
			delete(t.prefixes, p.key)
		}
	}
	clear(t.dirty)
	t.dirty = t.dirty[:0]
}

func (t *sseTracker) send(ev sseEvent) {
	t.sent++
	for s := range t.subs {
		select {
		case s.ch <- ev:
		default: // fell behind: disconnect it rather than let it miss events silently
			t.dropped++
			t.closeSub(s)
		}
	}
}

// subscribe adds a subscriber whose channel starts with the current state of every prefix.
func (t *sseTracker) subscribe() *sseSub {
	s := &sseSub{ch: make(chan sseEvent, t.buf+len(t.prefixes))}
	for _, p := range t.prefixes {
		switch p.state {
		case prefixGPU:
			s.ch <- sseEvent{sseCreated, p.key, p.tokens}
		case prefixOffloaded:
			s.ch <- sseEvent{sseOffloaded, p.key, p.tokens}
		}
	}
	t.subs[s] = struct{}{}
	return s
}

func (t *sseTracker) closeSub(s *sseSub) {
	if !s.closed {
		s.closed = true
		close(s.ch)
		delete(t.subs, s)
	}
}

// reset forgets every prefix and disconnects every subscriber (an engine restart or Close).
func (t *sseTracker) reset() {
	for s := range t.subs {
		t.closeSub(s)
	}
	clear(t.prefixes)
	clear(t.byBlock)
	t.dirty = t.dirty[:0]
}

type sseData struct {
	Event      string `json:"event"`
	PrefixHash string `json:"prefix_hash"`
	TokenCount int    `json:"token_count"`
}

// handleKVEvents serves GET /v1/kv_events: text/event-stream, one event per cache change
// ("event: cache_created\ndata: {…}\n\n"), starting with the current state, until the client
// goes away or the engine closes.
func (e *Engine) handleKVEvents(w http.ResponseWriter, r *http.Request) {
	if e.sse == nil {
		writeOpenAIError(w, http.StatusNotFound, "NotFoundError", "KV events over SSE are not enabled")
		return
	}
	fl, ok := w.(http.Flusher)
	if !ok {
		writeOpenAIError(w, http.StatusInternalServerError, "InternalServerError", "streaming unsupported")
		return
	}
	e.mu.Lock()
	if e.closed || e.killed || e.draining {
		e.mu.Unlock()
		writeOpenAIError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", "engine is not running")
		return
	}
	s := e.sse.subscribe()
	e.mu.Unlock()
	defer func() {
		e.mu.Lock()
		e.sse.closeSub(s)
		e.mu.Unlock()
		for range s.ch { // drain: closeSub closed it
		}
	}()
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("Connection", "keep-alive")
	w.WriteHeader(http.StatusOK)
	fl.Flush()
	var buf []byte
	for {
		select {
		case <-r.Context().Done():
			return
		case ev, ok := <-s.ch:
			if !ok {
				return
			}
			buf = appendSSE(buf[:0], ev)
		drain: // batch what is already queued into one write
			for {
				select {
				case ev, ok = <-s.ch:
					if !ok {
						break drain
					}
					buf = appendSSE(buf, ev)
				default:
					break drain
				}
			}
			if _, err := w.Write(buf); err != nil {
				return
			}
			fl.Flush()
			if !ok {
				return
			}
		}
	}
}

func appendSSE(b []byte, ev sseEvent) []byte {
	b = append(b, "event: "...)
	b = append(b, ev.name...)
	b = append(b, "\ndata: "...)
	d, _ := json.Marshal(sseData{Event: ev.name, PrefixHash: ev.prefix, TokenCount: ev.tokens})
	b = append(b, d...)
	return append(b, "\n\n"...)
}
