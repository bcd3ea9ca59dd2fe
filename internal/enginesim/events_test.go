package enginesim

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/events/zmqevents"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

// rawSub is a minimal ZMQ SUB client for tests: it sees the frames exactly as sent.
type rawSub struct {
	c net.Conn
	r *bufio.Reader
}

func dialZMTP(t *testing.T, ep string, typ zmq4.SocketType) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.DialTimeout("tcp", strings.TrimPrefix(ep, "tcp://"), 2*time.Second)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	require.NoError(t, handshake(c, typ, false))
	return c, bufio.NewReader(c)
}

func subscribeRaw(t *testing.T, e *Engine, topic string) *rawSub {
	t.Helper()
	c, r := dialZMTP(t, e.ZMQEndpoint(), zmq4.Sub)
	msg := append([]byte{0x00, byte(1 + len(topic)), 1}, topic...)
	_, err := c.Write(msg)
	require.NoError(t, err)
	eventually(t, func() bool { return e.Stats().ZMQSubscribers == 1 }, "subscription registered")
	return &rawSub{c: c, r: r}
}

type rawMsg struct {
	topic   string
	seq     uint64
	payload []byte
}

func (s *rawSub) next(t *testing.T) rawMsg {
	t.Helper()
	require.NoError(t, s.c.SetReadDeadline(time.Now().Add(3*time.Second)))
	f, cmd, err := readMsg(s.r)
	require.NoError(t, err)
	require.False(t, cmd)
	require.Len(t, f, 3)
	require.Len(t, f[1], 8)
	return rawMsg{string(f[0]), binary.BigEndian.Uint64(f[1]), f[2]}
}

func decode(t *testing.T, payload []byte) *events.Batch {
	t.Helper()
	var b events.Batch
	skipped, err := events.DecodeMsgpackBatch(payload, &b)
	require.NoError(t, err)
	require.Zero(t, skipped)
	return &b
}

// evView is an event in a comparable form.
type evView struct {
	Kind      events.Kind
	Hashes    []uint64
	Parent    uint64
	HasParent bool
	Tokens    []uint32
	BlockSize int
	Tier      events.Tier
}

func view(b *events.Batch) []evView {
	var out []evView
	for _, ev := range b.Events {
		out = append(out, evView{ev.Kind, append([]uint64(nil), ev.BlockHashes...), ev.Parent, ev.HasParent,
			append([]uint32(nil), ev.TokenIDs...), ev.BlockSize, ev.Tier})
	}
	return out
}

// eventScenario runs requests whose cache operations are known and returns the batches decoded.
func eventScenario(t *testing.T, ev EventsConfig) (batches [][]evView, msgs []rawMsg, e *Engine) {
	ev.ZMQEndpoint, ev.ZMQBind = "tcp://127.0.0.1:0", true
	ev.Topic = "kv@pod-a@m"
	e = newTestEngine(t, Config{Model: "m", BlockSize: 4, CapacityBlocks: 8, Events: ev})
	require.NoError(t, e.Start(context.Background()))
	sub := subscribeRaw(t, e, "kv@")

	a := seqTokens(1000, 16)
	gen(t, e, a, 0)                                                           // stores a0..a3
	gen(t, e, seqTokens(2000, 24), 0)                                         // evicts a3, a2; stores b0..b5
	gen(t, e, append(append([]uint32{}, a[:8]...), seqTokens(5000, 8)...), 0) // hits a0,a1; evicts b5, b4; stores c2,c3
	e.Reset()
	want := 4
	if ev.BatchSize == 1 {
		want = 8
	}
	for range want {
		m := sub.next(t)
		msgs = append(msgs, m)
		b := decode(t, m.payload)
		assert.Equal(t, ev.DataParallelRank, b.DPRank)
		assert.True(t, b.HasDPRank)
		batches = append(batches, view(b))
	}
	return batches, msgs, e
}

func TestZMQEventsMatchCacheOperations(t *testing.T) {
	batches, msgs, _ := eventScenario(t, EventsConfig{})
	for i, m := range msgs {
		assert.Equal(t, "kv@pod-a@m", m.topic)
		assert.Equal(t, uint64(i), m.seq, "sequence numbers from 0")
	}
	require.Len(t, batches, 4)
	a, b1, c, r := batches[0], batches[1], batches[2], batches[3]

	require.Len(t, a, 1)
	assert.Equal(t, events.KindBlockStored, a[0].Kind)
	assert.Len(t, a[0].Hashes, 4)
	assert.False(t, a[0].HasParent)
	assert.Equal(t, seqTokens(1000, 16), a[0].Tokens)
	assert.Equal(t, 4, a[0].BlockSize)
	assert.Equal(t, events.TierGPU, a[0].Tier)

	require.Len(t, b1, 3)
	assert.Equal(t, evView{Kind: events.KindBlockRemoved, Hashes: []uint64{a[0].Hashes[3]}}, b1[0], "tail first")
	assert.Equal(t, evView{Kind: events.KindBlockRemoved, Hashes: []uint64{a[0].Hashes[2]}}, b1[1])
	assert.Equal(t, events.KindBlockStored, b1[2].Kind)
	assert.Len(t, b1[2].Hashes, 6)

	require.Len(t, c, 3)
	assert.Equal(t, []uint64{b1[2].Hashes[5]}, c[0].Hashes)
	assert.Equal(t, []uint64{b1[2].Hashes[4]}, c[1].Hashes)
	assert.Equal(t, events.KindBlockStored, c[2].Kind)
	assert.True(t, c[2].HasParent)
	assert.Equal(t, a[0].Hashes[1], c[2].Parent, "chained to the cached prefix")
	assert.Equal(t, seqTokens(5000, 8), c[2].Tokens)

	assert.Equal(t, []evView{{Kind: events.KindAllBlocksCleared}}, r)
}

func TestZMQEventEncodingsAgree(t *testing.T) {
	ref, _, _ := eventScenario(t, EventsConfig{})
	for _, tc := range []struct {
		name string
		ev   EventsConfig
	}{
		{"map", EventsConfig{MapForm: true}},
		{"signed hashes", EventsConfig{Hashes: HashInt}},
		{"digest hashes map", EventsConfig{Hashes: HashBytes, MapForm: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, _, _ := eventScenario(t, tc.ev)
			assert.Equal(t, ref, got)
		})
	}
	t.Run("batch size 1", func(t *testing.T) {
		got, msgs, _ := eventScenario(t, EventsConfig{BatchSize: 1, DataParallelRank: 3})
		var flat, want []evView
		for _, b := range got {
			require.Len(t, b, 1)
			flat = append(flat, b...)
		}
		for _, b := range ref {
			want = append(want, b...)
		}
		assert.Equal(t, want, flat)
		assert.Equal(t, uint64(7), msgs[7].seq)
	})
}

func TestZMQFlushInterval(t *testing.T) {
	e := newTestEngine(t, Config{BlockSize: 4, Events: EventsConfig{ZMQEndpoint: "tcp://127.0.0.1:0", ZMQBind: true,
		FlushInterval: 300 * time.Millisecond}})
	require.NoError(t, e.Start(context.Background()))
	sub := subscribeRaw(t, e, "")
	gen(t, e, seqTokens(1, 8), 0)
	gen(t, e, seqTokens(100, 8), 0)
	m := sub.next(t)
	assert.Len(t, decode(t, m.payload).Events, 2, "both steps' events in one batch")
	assert.Equal(t, uint64(0), m.seq)
}

func TestZMQReplay(t *testing.T) {
	_, msgs, e := eventScenario(t, EventsConfig{ReplayEndpoint: "tcp://127.0.0.1:0"})
	require.NotEmpty(t, e.ReplayEndpoint())
	c, r := dialZMTP(t, e.ReplayEndpoint(), zmq4.Dealer)
	for _, start := range []uint64{1, 0, 3, 99} {
		req := []byte{0x01, 0x00, 0x00, 0x08} // "" (MORE), then 8 bytes
		req = binary.BigEndian.AppendUint64(req, start)
		_, err := c.Write(req)
		require.NoError(t, err)
		require.NoError(t, c.SetReadDeadline(time.Now().Add(3*time.Second)))
		for want := start; ; want++ {
			f, _, err := readMsg(r)
			require.NoError(t, err)
			require.Len(t, f, 3)
			assert.Empty(t, f[0], "delimiter")
			seq := binary.BigEndian.Uint64(f[1])
			if seq == zmqevents.ReplayEndSeq {
				assert.Empty(t, f[2])
				assert.Equal(t, max(start, uint64(len(msgs))), want, "every batch ≥ start replayed")
				break
			}
			require.Less(t, int(want), len(msgs))
			assert.Equal(t, want, seq)
			assert.Equal(t, msgs[want].payload, f[2])
		}
	}
}

func TestZMQReplayBufferBound(t *testing.T) {
	e := newTestEngine(t, Config{BlockSize: 4, Events: EventsConfig{ReplayEndpoint: "tcp://127.0.0.1:0", ReplayBuffer: 2}})
	require.NoError(t, e.Start(context.Background()))
	for i := range 5 {
		gen(t, e, seqTokens(1000*i, 4), 0)
	}
	recs := e.bus.since(0)
	require.Len(t, recs, 2)
	assert.Equal(t, []uint64{3, 4}, []uint64{recs[0].seq, recs[1].seq})
}

// indexView returns what idx says backend holds of tokens: the matched blocks and slowest tier.
func indexView(t *testing.T, idx *kvindex.MemoryIndex, model, backend string, tokens []uint32, bs int) (int, events.Tier) {
	t.Helper()
	keys := prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot(model, ""), tokens, bs, nil)
	out, err := idx.Lookup(context.Background(), keys, []string{backend}, make([]kvindex.Match, 1))
	require.NoError(t, err)
	return out[0].Blocks, out[0].Tier
}

// interopWorkload sends chat requests sharing system prompts through e, with a cache small enough
// to evict, and returns their prompt tokens.
func interopWorkload(t *testing.T, e *Engine) [][]uint32 {
	var all [][]uint32
	for i := range 24 {
		sys := fmt.Sprintf("System prompt number %d. ", i%3) + strings.Repeat("Keep answers short and precise. ", 8)
		body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"system","content":%q},{"role":"user","content":"question %d about routing and caches"}],"max_tokens":3}`,
			e.Model(), sys, i)
		in := e.InputOf(chatReq(t, body))
		_, err := e.Generate(context.Background(), in)
		require.NoError(t, err)
		all = append(all, in.Tokens)
	}
	for _, tok := range all[len(all)-10 : len(all)-4] { // repeats: hits on the CPU tier reload blocks
		_, err := e.Generate(context.Background(), Input{Tokens: tok, OutputTokens: 3})
		require.NoError(t, err)
	}
	return all
}

// checkConverges waits until idx shows, for every request, exactly the leading blocks e holds
// and their tier.
func checkConverges(t *testing.T, e *Engine, idx *kvindex.MemoryIndex, backend string, reqs [][]uint32) {
	t.Helper()
	bs := e.Config().BlockSize
	var last string
	ok := func() bool {
		for i, tok := range reqs {
			gpu, cached := e.Lookup(tok)
			want := events.TierGPU
			if gpu < cached {
				want = events.TierCPU
			}
			got, tier := indexView(t, idx, e.Model(), backend, tok, bs)
			if got != cached || (cached > 0 && tier != want) {
				last = fmt.Sprintf("request %d: index %d blocks (%v), engine %d cached (%d on GPU)", i, got, tier, cached, gpu)
				return false
			}
		}
		return true
	}
	deadline := time.Now().Add(5 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("index did not converge: %s", last)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func newIndex(t *testing.T) *kvindex.MemoryIndex {
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{SweepInterval: -1})
	require.NoError(t, err)
	t.Cleanup(func() { _ = idx.Close() })
	return idx
}

// TestInteropZMQConsumerIndex: engine PUB (binds) → zmqevents.Consumer (connects) →
// kvindex.MemoryIndex; a lookup of each request's block keys shows exactly the blocks the
// engine holds, on the right tier, through evictions, CPU offload and reloads.
func TestInteropZMQConsumerIndex(t *testing.T) {
	for _, mapForm := range []bool{false, true} {
		t.Run(fmt.Sprintf("map=%v", mapForm), func(t *testing.T) {
			e := newTestEngine(t, Config{Model: "llama", CapacityBlocks: 16, CPUCapacityBlocks: 8, HashSeed: 7,
				Events: EventsConfig{ZMQEndpoint: "tcp://127.0.0.1:0", ZMQBind: true, ReplayEndpoint: "tcp://127.0.0.1:0",
					MapForm: mapForm, Hashes: HashBytes}})
			require.NoError(t, e.Start(context.Background()))
			idx := newIndex(t)
			c, err := zmqevents.New(zmqevents.Config{Sink: idx, Endpoints: []zmqevents.Endpoint{{
				Backend: "engine-0", Endpoint: e.ZMQEndpoint(), ReplayEndpoint: e.ReplayEndpoint(), Model: "llama"}}})
			require.NoError(t, err)
			require.NoError(t, c.Start(context.Background()))
			t.Cleanup(func() { _ = c.Close() })
			eventually(t, func() bool { return e.Stats().ZMQSubscribers == 1 }, "consumer subscribed")

			reqs := interopWorkload(t, e)
			require.Positive(t, e.Stats().Evictions, "the workload must evict")
			require.Positive(t, e.Stats().ExternalCacheHits, "and reload from the CPU tier")
			checkConverges(t, e, idx, "engine-0", reqs)

			st := c.Status()[0]
			assert.Zero(t, st.Events.Malformed)
			assert.Zero(t, st.Events.Dropped)
			assert.Zero(t, st.Sequence.Gaps)

			e.Reset()
			checkConverges(t, e, idx, "engine-0", reqs)
		})
	}
}

// TestInteropZMQGapReplay: a batch the subscriber misses (as at a high-water mark) is fetched by
// kvroute's consumer from the engine's replay socket, with no reset of the backend.
func TestInteropZMQGapReplay(t *testing.T) {
	e := newTestEngine(t, Config{Model: "llama", CapacityBlocks: 64, Events: EventsConfig{
		ZMQEndpoint: "tcp://127.0.0.1:0", ZMQBind: true, ReplayEndpoint: "tcp://127.0.0.1:0"}})
	require.NoError(t, e.Start(context.Background()))
	idx := newIndex(t)
	c, err := zmqevents.New(zmqevents.Config{Sink: idx, Endpoints: []zmqevents.Endpoint{{
		Backend: "e", Endpoint: e.ZMQEndpoint(), ReplayEndpoint: e.ReplayEndpoint(), Model: "llama"}}})
	require.NoError(t, err)
	require.NoError(t, c.Start(context.Background()))
	t.Cleanup(func() { _ = c.Close() })
	eventually(t, func() bool { return e.Stats().ZMQSubscribers == 1 }, "subscribed")

	a, b, d := seqTokens(1, 40), seqTokens(1000, 40), seqTokens(2000, 40)
	gen(t, e, a, 0) // seq 0: the baseline
	checkConverges(t, e, idx, "e", [][]uint32{a})
	// seq 1 is published while the subscriber's subscription is hidden: it never receives it.
	e.bus.mu.Lock()
	var saved [][][]byte
	for s := range e.bus.subs {
		s.mu.Lock()
		saved = append(saved, s.prefixes)
		s.prefixes = nil
		s.mu.Unlock()
	}
	e.bus.mu.Unlock()
	gen(t, e, b, 0)
	e.bus.mu.Lock()
	for s := range e.bus.subs {
		s.mu.Lock()
		s.prefixes, saved = saved[0], saved[1:]
		s.mu.Unlock()
	}
	e.bus.mu.Unlock()
	gen(t, e, d, 0) // seq 2: the gap is seen, seq 1 replayed
	checkConverges(t, e, idx, "e", [][]uint32{a, b, d})
	st := c.Status()[0].Sequence
	assert.Equal(t, uint64(1), st.Gaps)
	assert.Equal(t, uint64(1), st.Replays)
	assert.Zero(t, st.Resets)
}

// TestInteropZMQConsumerBinds: the router's SUB socket binds, the engine's PUB connects
// (centralized mode); the backend comes from the kv@<pod>@<model> topic.
func TestInteropZMQConsumerBinds(t *testing.T) {
	idx := newIndex(t)
	c, err := zmqevents.New(zmqevents.Config{Sink: idx, Bind: "tcp://127.0.0.1:0"})
	require.NoError(t, err)
	require.NoError(t, c.Start(context.Background()))
	t.Cleanup(func() { _ = c.Close() })

	e := newTestEngine(t, Config{Name: "pod-7", Model: "llama", CapacityBlocks: 30, Events: EventsConfig{
		ZMQEndpoint: "tcp://" + c.Addr().String(), Topic: "kv@pod-7@llama"}})
	require.NoError(t, e.Start(context.Background()))
	eventually(t, func() bool { return e.Stats().ZMQSubscribers == 1 }, "engine connected and subscribed")
	reqs := interopWorkload(t, e)
	checkConverges(t, e, idx, "pod-7", reqs)

	// A crash and restart: the connection drops, the sequence restarts at 0, the cache is empty.
	e.Kill()
	require.NoError(t, e.Restart(context.Background()))
	eventually(t, func() bool { return e.Stats().ZMQSubscribers == 1 }, "reconnected")
	reqs2 := interopWorkload(t, e)[:3]
	checkConverges(t, e, idx, "pod-7", append(reqs, reqs2...))
}

func TestSSEKVEvents(t *testing.T) {
	e := newTestEngine(t, Config{Model: "llama", BlockSize: 4, CapacityBlocks: 12, CPUCapacityBlocks: 4,
		Events: EventsConfig{SSE: true}})
	srv := httptest.NewServer(e.Handler())
	defer srv.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/v1/kv_events", nil)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	assert.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
	rd := bufio.NewReader(resp.Body)
	next := func() (string, string) {
		t.Helper()
		var name, data string
		for {
			line, err := rd.ReadString('\n')
			require.NoError(t, err)
			line = strings.TrimRight(line, "\n")
			switch {
			case strings.HasPrefix(line, "event: "):
				name = line[len("event: "):]
			case strings.HasPrefix(line, "data: "):
				data = line[len("data: "):]
			case line == "" && name != "":
				return name, data
			}
		}
	}
	eventually(t, func() bool { return e.Stats().SSESubscribers == 1 }, "subscribed")

	r := chatReq(t, `{"model":"llama","messages":[{"role":"system","content":"Short system prompt for the test."},{"role":"user","content":"hi"}]}`)
	in := e.InputOf(r)
	key, ok := r.PrefixKey(1024)
	require.True(t, ok)
	_, err = e.Generate(context.Background(), in)
	require.NoError(t, err)
	full := len(in.Tokens) / 4 * 4
	name, data := next()
	assert.Equal(t, "cache_created", name)
	assert.JSONEq(t, fmt.Sprintf(`{"event":"cache_created","prefix_hash":%q,"token_count":%d}`, key.String(), full), data)

	// Another chain pushes part of it to the CPU tier: the GPU run shrinks.
	gen(t, e, seqTokens(90000, 40), 0)
	name, data = next()
	assert.Equal(t, "cache_created", name)
	gpu, _ := e.Lookup(in.Tokens)
	assert.JSONEq(t, fmt.Sprintf(`{"event":"cache_created","prefix_hash":%q,"token_count":%d}`, key.String(), gpu*4), data)

	e.Reset()
	name, data = next()
	assert.Equal(t, "cache_evicted", name)
	assert.Contains(t, data, key.String())

	// Through kvroute's SSE consumer into the index.
	idx := newIndex(t)
	sc, err := events.NewSSEConsumer(events.SSEConfig{Sink: idx, Sources: []events.SSESource{{Backend: "e", URL: srv.URL + "/v1/kv_events"}}})
	require.NoError(t, err)
	require.NoError(t, sc.Start(context.Background()))
	defer sc.Close()
	eventually(t, func() bool { return e.Stats().SSESubscribers == 2 }, "consumer subscribed")
	_, err = e.Generate(context.Background(), in)
	require.NoError(t, err)
	eventually(t, func() bool {
		out, err := idx.LookupPrefix(context.Background(), key.String(), []string{"e"}, make([]kvindex.Match, 1))
		return err == nil && out[0].Tokens == full
	}, "index holds the prefix with its token count")
}

func TestSSEOffloadAndPurge(t *testing.T) {
	e := newTestEngine(t, Config{BlockSize: 4, CapacityBlocks: 4, CPUCapacityBlocks: 4, Events: EventsConfig{SSE: true}})
	e.mu.Lock()
	s := e.sse.subscribe()
	e.mu.Unlock()
	r := chatReq(t, `{"model":"`+DefaultModel+`","messages":[{"role":"user","content":"one two"}]}`)
	in := e.InputOf(r) // 8 tokens: BOS <|user|> \n one two \n <|assistant|> \n = 2 blocks
	in.OutputTokens = 0
	require.Len(t, in.Tokens, 8)
	gen(t, e, in.Tokens, 0)
	// in.PrefixKey was not passed through gen: use Generate with it.
	_, err := e.Generate(context.Background(), in)
	require.NoError(t, err)
	got := func() sseEvent {
		t.Helper()
		select {
		case ev := <-s.ch:
			return ev
		case <-time.After(time.Second):
			t.Fatal("no event")
			return sseEvent{}
		}
	}
	assert.Equal(t, sseEvent{sseCreated, in.PrefixKey.String(), 8}, got())
	gen(t, e, seqTokens(100, 16), 0) // everything else moves to the CPU tier
	assert.Equal(t, sseEvent{sseOffloaded, in.PrefixKey.String(), 8}, got())
	_, err = e.Generate(context.Background(), in) // reloaded
	require.NoError(t, err)
	assert.Equal(t, sseEvent{sseReloaded, in.PrefixKey.String(), 8}, got())
	gen(t, e, seqTokens(200, 16), 0) // offloaded again
	assert.Equal(t, sseEvent{sseOffloaded, in.PrefixKey.String(), 8}, got())
	gen(t, e, seqTokens(300, 16), 0) // pushed out of the CPU tier
	assert.Equal(t, sseEvent{ssePurged, in.PrefixKey.String(), 0}, got())
}
