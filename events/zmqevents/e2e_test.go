package zmqevents_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/events/zmqevents"
	"github.com/kvroute/kvroute/internal/enginesim"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

// TestE2EZMQToMemoryIndex runs the whole event path: fake engines publishing the vLLM wire
// format over ZeroMQ → zmqevents.Consumer → MemoryIndex → Lookup with the router's own block keys.
// Then an engine restarts (sequence back to 0, its first batch lost in transit) and another
// loses a batch on a live connection: the index must not serve the stale chains.
func TestE2EZMQToMemoryIndex(t *testing.T) {
	for _, tc := range []struct {
		name   string
		replay bool // engine B has a replay endpoint
	}{
		{"lost batch reset", false},
		{"lost batch replayed", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const model, bs = "meta-llama/Llama-3.1-8B-Instruct", 16
			idx, err := kvindex.NewMemory(kvindex.MemoryConfig{BlockSize: bs, SweepInterval: -1})
			require.NoError(t, err)
			defer idx.Close()

			pubA := zmqevents.NewFakePublisher(t, zmqevents.FakePublisherConfig{Topic: "kv@vllm-a@" + model})
			pubB := zmqevents.NewFakePublisher(t, zmqevents.FakePublisherConfig{Topic: "kv@vllm-b@" + model, Replay: tc.replay})
			c, err := zmqevents.New(zmqevents.Config{
				Sink: idx,
				Endpoints: []zmqevents.Endpoint{
					{Backend: "vllm-a", Endpoint: pubA.Endpoint},
					{Backend: "vllm-b", Endpoint: pubB.Endpoint, ReplayEndpoint: pubB.ReplayEndpoint},
				},
				InitialBackoff: 10 * time.Millisecond,
				MaxBackoff:     100 * time.Millisecond,
			})
			require.NoError(t, err)
			require.NoError(t, c.Start(context.Background()))
			defer c.Close()
			pubA.WaitSubscribed()
			pubB.WaitSubscribed()

			// The request: 4 full blocks plus a partial one; the router keys it on its own.
			tokens := make([]uint32, 4*bs+5)
			for i := range tokens {
				tokens[i] = uint32(1000 + i*7)
			}
			keys := prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot(model, ""), tokens, bs, nil)
			require.Len(t, keys, 4)
			other := make([]uint32, 2*bs)
			for i := range other {
				other[i] = uint32(50000 + i)
			}
			otherKeys := prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot(model, ""), other, bs, nil)

			candidates := []string{"vllm-a", "vllm-b", "vllm-c"}
			lookup := func(keys []uint64) map[string]int {
				out, err := idx.Lookup(context.Background(), keys, candidates, make([]kvindex.Match, len(candidates)))
				require.NoError(t, err)
				got := map[string]int{}
				for _, m := range out {
					got[m.Backend] = m.Blocks
				}
				return got
			}
			expect := func(keys []uint64, want map[string]int, msg string) {
				t.Helper()
				require.Eventually(t, func() bool { return assert.ObjectsAreEqual(want, lookup(keys)) },
					10*time.Second, 5*time.Millisecond, "%s: got %v, want %v", msg, lookup(keys), want)
			}

			// Engine A stores the 4 blocks in one event; engine B the first 2 in two events
			// chained by the parent hash. Engine hashes are opaque to us.
			pubA.Publish(zmqevents.StoredEvent([]uint64{0xa1, 0xa2, 0xa3, 0xa4}, -1, tokens[:4*bs], bs, "GPU"))
			pubB.Publish(zmqevents.StoredEvent([]uint64{0xb1}, -1, tokens[:bs], bs, "GPU"))
			pubB.Publish(zmqevents.StoredEvent([]uint64{0xb2}, 0xb1, tokens[bs:2*bs], bs, "CPU"))
			expect(keys, map[string]int{"vllm-a": 4, "vllm-b": 2, "vllm-c": 0}, "initial")
			expect(keys[:3], map[string]int{"vllm-a": 3, "vllm-b": 2, "vllm-c": 0}, "shorter request")

			// Engine A restarts: its cache is empty, its sequence is back to 0 and its first
			// batch is lost in transit. The index must stop serving A's old chain at once…
			pubA.Restart()
			expect(keys, map[string]int{"vllm-a": 0, "vllm-b": 2, "vllm-c": 0}, "after A restarted")
			pubA.WaitSubscribed()
			pubA.Lose(zmqevents.StoredEvent([]uint64{0xa5}, -1, tokens[:bs], bs, "GPU"))
			pubA.Publish(zmqevents.StoredEvent([]uint64{0xa6, 0xa7}, -1, other, bs, "GPU"))
			expect(otherKeys, map[string]int{"vllm-a": 2, "vllm-b": 0, "vllm-c": 0}, "A's fresh events")
			expect(keys, map[string]int{"vllm-a": 0, "vllm-b": 2, "vllm-c": 0}, "A's old chain stays gone")
			// …until fresh events store the request's blocks again.
			pubA.Publish(zmqevents.StoredEvent([]uint64{0xa8, 0xa9, 0xaa}, -1, tokens[:3*bs], bs, "GPU"))
			expect(keys, map[string]int{"vllm-a": 3, "vllm-b": 2, "vllm-c": 0}, "A refilled")

			// Engine B evicts block 2 of the request, but that batch is lost on a live
			// connection. The next batch reveals the gap.
			pubB.Lose(zmqevents.RemovedEvent([]uint64{0xb2}, "CPU"))
			pubB.Publish(zmqevents.StoredEvent([]uint64{0xb3}, -1, other[:bs], bs, "GPU"))
			if tc.replay {
				// The eviction is replayed: B holds exactly block 1.
				expect(keys, map[string]int{"vllm-a": 3, "vllm-b": 1, "vllm-c": 0}, "B after replay")
			} else {
				// Without replay B is reset: its possibly stale chain is not served.
				expect(keys, map[string]int{"vllm-a": 3, "vllm-b": 0, "vllm-c": 0}, "B after reset")
			}
			expect(otherKeys, map[string]int{"vllm-a": 2, "vllm-b": 1, "vllm-c": 0}, "B's fresh block")

			st := map[string]events.SourceStatus{}
			for _, s := range c.Status() {
				st[s.Backend] = s
			}
			assert.Equal(t, uint64(1), st["vllm-a"].Connection.ReconnectCount)
			assert.Equal(t, uint64(1), st["vllm-a"].Sequence.Resets)
			assert.Equal(t, uint64(1), st["vllm-b"].Sequence.Gaps)
			if tc.replay {
				assert.Equal(t, uint64(1), st["vllm-b"].Sequence.Replays)
				assert.Zero(t, st["vllm-b"].Sequence.Resets)
			} else {
				assert.Equal(t, uint64(1), st["vllm-b"].Sequence.Resets)
			}
			for _, s := range st {
				assert.True(t, s.Connection.Connected, s.Backend)
				assert.Zero(t, s.Events.Dropped, s.Backend)
				assert.Zero(t, s.Events.Malformed, s.Backend)
			}
		})
	}
}

// TestE2ECatchUp: an engine (internal/enginesim, with vLLM's replay ROUTER socket) serves
// requests, evicting some blocks, before the router subscribes; the consumer's catch-up on the
// first live batch replays that history from the engine's buffer into a MemoryIndex, which then
// shows exactly what the engine holds. A window shorter than the history starts in the middle
// of it: blocks whose parents came before the window are left out (the index drops a stored
// block with an unknown parent), so the index under-reports and never over-reports.
func TestE2ECatchUp(t *testing.T) {
	for _, tc := range []struct {
		name    string
		batches int // Config.CatchUpBatches
	}{
		{"whole history", 0},
		{"window of 3 batches", 3},
		{"disabled", -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const model = "llama"
			e, err := enginesim.New(enginesim.Config{Model: model, CapacityBlocks: 12, HashSeed: 3,
				Events: enginesim.EventsConfig{ZMQEndpoint: "tcp://127.0.0.1:0", ZMQBind: true, ReplayEndpoint: "tcp://127.0.0.1:0"}})
			require.NoError(t, err)
			defer e.Close()
			require.NoError(t, e.Start(context.Background()))
			bs := e.Config().BlockSize
			prompt := func(sys, user int) []uint32 { // 3 blocks of system prompt, 2 of user turn
				tok := make([]uint32, 0, 5*bs)
				for i := range 3 * bs {
					tok = append(tok, uint32(1000*(sys+1)+i))
				}
				for i := range 2 * bs {
					tok = append(tok, uint32(100000+100*user+i))
				}
				return tok
			}
			generate := func(tok []uint32) {
				_, err := e.Generate(context.Background(), enginesim.Input{Tokens: tok, OutputTokens: bs})
				require.NoError(t, err)
			}
			var history [][]uint32
			for i := range 8 { // 3 system prompts reused, in 12 blocks: hits and evictions
				history = append(history, prompt(i%3, i))
				generate(history[i])
			}
			require.Positive(t, e.Stats().Evictions)
			published := e.Stats().Batches

			idx, err := kvindex.NewMemory(kvindex.MemoryConfig{BlockSize: bs, SweepInterval: -1})
			require.NoError(t, err)
			defer idx.Close()
			c, err := zmqevents.New(zmqevents.Config{Sink: idx, CatchUpBatches: tc.batches,
				Endpoints: []zmqevents.Endpoint{{Backend: "e", Endpoint: e.ZMQEndpoint(), ReplayEndpoint: e.ReplayEndpoint(), Model: model}}})
			require.NoError(t, err)
			require.NoError(t, c.Start(context.Background()))
			defer c.Close()
			require.Eventually(t, func() bool { return e.Stats().ZMQSubscribers == 1 }, 10*time.Second, 5*time.Millisecond)
			live := prompt(7, 99) // shares no block with the history
			generate(live)

			indexed := func(tok []uint32) int {
				keys := prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot(model, ""), tok, bs, nil)
				out, err := idx.Lookup(context.Background(), keys, []string{"e"}, make([]kvindex.Match, 1))
				require.NoError(t, err)
				return out[0].Blocks
			}
			_, want := e.Lookup(live)
			require.Eventually(t, func() bool { return indexed(live) == want }, 10*time.Second, 5*time.Millisecond)
			known, total := 0, 0
			for i, tok := range history {
				_, cached := e.Lookup(tok)
				got := indexed(tok)
				total += cached
				switch tc.batches {
				case 0:
					assert.Equal(t, cached, got, "request %d", i)
				case -1:
					assert.Zero(t, got, "request %d", i)
				default:
					assert.LessOrEqual(t, got, cached, "request %d", i)
				}
				known += got
			}
			st := c.Status()[0].Sequence
			switch tc.batches {
			case 0:
				assert.Positive(t, known)
				assert.Equal(t, total, known)
				assert.Equal(t, uint64(1), st.CatchUps)
				assert.Equal(t, published, st.CaughtUpBatches)
			case -1:
				assert.Zero(t, st.CatchUps)
			default:
				assert.Less(t, known, total, "the window left out blocks whose parents came before it")
				assert.Equal(t, uint64(1), st.CatchUps)
				assert.Equal(t, uint64(tc.batches), st.CaughtUpBatches)
			}
			assert.Zero(t, st.CatchUpFailures)
			assert.Zero(t, st.Resets)
		})
	}
}
