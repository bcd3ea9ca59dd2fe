package enginesim

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/prefixkey"
)

// seqTokens returns n distinct tokens starting at from.
func seqTokens(from, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}

func gen(t *testing.T, e *Engine, tokens []uint32, out int) Result {
	t.Helper()
	res, err := e.Generate(context.Background(), Input{Tokens: tokens, OutputTokens: out})
	require.NoError(t, err)
	return res
}

func chatReq(t *testing.T, body string) *prefixkey.Request {
	t.Helper()
	r, err := prefixkey.ParseOpenAIChat([]byte(body))
	require.NoError(t, err)
	return r
}

func commonPrefix(a, b []uint32) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

func TestCacheHitSharedSystemPrompt(t *testing.T) {
	e := newTestEngine(t, Config{})
	system := strings.Repeat("You are a meticulous assistant who answers with care. ", 20)
	r1 := chatReq(t, `{"model":"`+DefaultModel+`","messages":[{"role":"system","content":"`+system+`"},{"role":"user","content":"first question"}]}`)
	r2 := chatReq(t, `{"model":"`+DefaultModel+`","messages":[{"role":"system","content":"`+system+`"},{"role":"user","content":"a different question"}]}`)
	in1, in2 := e.InputOf(r1), e.InputOf(r2)

	res1, err := e.Generate(context.Background(), in1)
	require.NoError(t, err)
	assert.Zero(t, res1.CachedTokens, "cold cache")
	res2, err := e.Generate(context.Background(), in2)
	require.NoError(t, err)
	shared := commonPrefix(in1.Tokens, in2.Tokens) / DefaultBlockSize * DefaultBlockSize
	require.Greater(t, shared, 100)
	assert.Equal(t, shared, res2.CachedTokens, "cached_tokens = the shared full blocks")
	assert.Equal(t, len(in2.Tokens), res2.PromptTokens)

	st := e.Stats()
	assert.Equal(t, uint64(len(in1.Tokens)+len(in2.Tokens)), st.PrefixCacheQueries)
	assert.Equal(t, uint64(shared), st.PrefixCacheHits)
	assert.Zero(t, st.Running)
	assert.Zero(t, st.Usage, "nothing running: cached blocks count as free")
}

func TestCacheHitNeverWholePrompt(t *testing.T) {
	e := newTestEngine(t, Config{BlockSize: 4})
	tok := seqTokens(1, 16) // exactly 4 blocks
	gen(t, e, tok, 2)
	res := gen(t, e, tok, 2)
	assert.Equal(t, 12, res.CachedTokens, "as vLLM, the last prompt token is always computed: (n−1)/B blocks hit")
	tok2 := seqTokens(1, 17)
	assert.Equal(t, 16, gen(t, e, tok2, 2).CachedTokens)
}

func TestEvictionLRUTailFirst(t *testing.T) {
	e := newTestEngine(t, Config{BlockSize: 4, CapacityBlocks: 8})
	a := seqTokens(1000, 16) // 4 blocks
	b := seqTokens(2000, 24) // 6 blocks
	gen(t, e, a, 0)
	g, c := e.Lookup(a)
	require.Equal(t, 4, g)
	require.Equal(t, 4, c)
	gen(t, e, b, 0) // 4 empty + 2 evicted: a's tail blocks 3 and 2
	g, _ = e.Lookup(a)
	assert.Equal(t, 2, g, "a's last two blocks evicted first")
	g, _ = e.Lookup(b)
	assert.Equal(t, 6, g)
	assert.Equal(t, uint64(2), e.Stats().Evictions)

	// LRU across requests: touch a's prefix again, then a new request evicts b's tail, not a.
	gen(t, e, a[:9], 0) // hits a's first 2 blocks (refreshes them)
	gen(t, e, seqTokens(3000, 8), 0)
	g, _ = e.Lookup(a)
	assert.Equal(t, 2, g)
	g, _ = e.Lookup(b)
	assert.Equal(t, 4, g, "b's tail evicted: least recently used")
}

func TestEvictionSparesRunningRequests(t *testing.T) {
	e := newTestEngine(t, Config{BlockSize: 4, CapacityBlocks: 8})
	a := seqTokens(1000, 16)
	e.SetStall(true)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, err := e.Generate(context.Background(), Input{Tokens: a, OutputTokens: 0})
		assert.NoError(t, err)
	}()
	eventually(t, func() bool { return e.Stats().Running == 1 }, "a admitted")
	assert.InDelta(t, 0.5, e.Stats().Usage, 1e-9)

	bDone := make(chan Result, 1)
	wg.Add(1)
	go func() {
		defer wg.Done()
		res, err := e.Generate(context.Background(), Input{Tokens: seqTokens(2000, 20), OutputTokens: 0}) // 5 blocks
		assert.NoError(t, err)
		bDone <- res
	}()
	eventually(t, func() bool { return e.Stats().Waiting == 1 }, "b waits: a's blocks are held")
	g, _ := e.Lookup(a)
	assert.Equal(t, 4, g, "held blocks are not evicted")
	e.SetStall(false)
	wg.Wait()
	res := <-bDone
	assert.Positive(t, res.Queued+time.Nanosecond)
	g, _ = e.Lookup(a)
	assert.Equal(t, 3, g, "after a finished, b evicted a's tail block")
}

func TestCPUTier(t *testing.T) {
	e := newTestEngine(t, Config{BlockSize: 4, CapacityBlocks: 4, CPUCapacityBlocks: 4,
		Latency: Latency{Base: time.Millisecond, PerToken: time.Microsecond, CPULoadPerToken: 100 * time.Nanosecond}})
	a := seqTokens(1000, 16)
	b := seqTokens(2000, 16)
	gen(t, e, a, 0)
	gen(t, e, b, 0) // a moves to the CPU tier
	g, c := e.Lookup(a)
	assert.Equal(t, 0, g)
	assert.Equal(t, 4, c, "a is on the CPU tier")
	st := e.Stats()
	assert.Equal(t, 4, st.CPUBlocks)
	assert.Equal(t, 4, st.CachedBlocks)

	res := gen(t, e, a, 0)
	assert.Equal(t, 12, res.CachedTokens, "(n−1)/B blocks hit, loaded from the CPU tier")
	assert.Equal(t, 12, res.CPUCachedTokens)
	assert.Equal(t, time.Millisecond+4*time.Microsecond+12*100*time.Nanosecond, res.Prefill)
	g, _ = e.Lookup(a)
	assert.Equal(t, 4, g, "a is back on the GPU")
	g, c = e.Lookup(b)
	assert.Equal(t, 0, g)
	assert.Equal(t, 4, c, "b went to the CPU tier")
	assert.Equal(t, uint64(12), e.Stats().ExternalCacheHits)

	// The CPU tier is LRU too: a third chain pushes the oldest CPU blocks out.
	gen(t, e, seqTokens(3000, 16), 0)
	_, c = e.Lookup(b)
	assert.Equal(t, 0, c, "b dropped from the full CPU tier (its blocks were the oldest)")
	_, c = e.Lookup(a)
	assert.Equal(t, 4, c)
}

func TestLatencyModel(t *testing.T) {
	l := Latency{Base: time.Millisecond, PerToken: 10 * time.Microsecond, Quadratic: 2, PerOutputToken: 3 * time.Millisecond}
	e := newTestEngine(t, Config{BlockSize: 16, Latency: l})
	tok := seqTokens(1, 200)
	res := gen(t, e, tok, 7)
	assert.Equal(t, time.Millisecond+200*10*time.Microsecond+time.Duration(2*200*200), res.Prefill)
	assert.Equal(t, 21*time.Millisecond, res.Decode)
	res = gen(t, e, tok, 7)
	p := 192 // 12 blocks: (200−1)/16
	assert.Equal(t, p, res.CachedTokens)
	assert.Equal(t, time.Millisecond+time.Duration(200-p)*10*time.Microsecond+time.Duration(2*(200*200-p*p)), res.Prefill)
	assert.Equal(t, l.Prefill(200, p, 0), res.Prefill)

	// SpeedFactor scales the real time slept, not the virtual one.
	fast := newTestEngine(t, Config{Latency: Latency{Base: 200 * time.Millisecond, SpeedFactor: 0.05}})
	start := time.Now()
	res = gen(t, fast, seqTokens(1, 10), 0)
	took := time.Since(start)
	assert.Equal(t, 200*time.Millisecond, res.Prefill)
	assert.GreaterOrEqual(t, took, 10*time.Millisecond)
	assert.Less(t, took, 2*time.Second)

	// Zero latency fields mean the defaults, SpeedFactor kept.
	d := newTestEngine(t, Config{Latency: Latency{SpeedFactor: 0.5}})
	assert.Equal(t, DefaultLatency.Base, d.Config().Latency.Base)
	assert.Equal(t, 0.5, d.Config().Latency.SpeedFactor)
}

func TestQueueAtMaxConcurrent(t *testing.T) {
	e := newTestEngine(t, Config{MaxConcurrent: 2, MaxQueue: 2})
	e.SetStall(true)
	var wg sync.WaitGroup
	results := make(chan Result, 4)
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := e.Generate(context.Background(), Input{Tokens: seqTokens(100*i, 40), OutputTokens: 1})
			assert.NoError(t, err)
			results <- res
		}()
	}
	eventually(t, func() bool { s := e.Stats(); return s.Running == 2 && s.Waiting == 2 }, "2 running, 2 waiting")
	_, err := e.Generate(context.Background(), Input{Tokens: seqTokens(9000, 4)})
	assert.ErrorIs(t, err, ErrOverloaded, "queue full")

	// A queued request whose context ends leaves the queue.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	e2 := newTestEngine(t, Config{MaxConcurrent: 1})
	e2.SetStall(true)
	go func() { _, _ = e2.Generate(context.Background(), Input{Tokens: seqTokens(1, 4)}) }()
	eventually(t, func() bool { return e2.Stats().Running == 1 }, "e2 busy")
	_, err = e2.Generate(ctx, Input{Tokens: seqTokens(50, 4)})
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Zero(t, e2.Stats().Waiting)

	e.SetStall(false)
	wg.Wait()
	close(results)
	queued := 0
	for r := range results {
		if r.Queued > 0 {
			queued++
		}
	}
	assert.Equal(t, 2, queued)
	s := e.Stats()
	assert.Zero(t, s.Running)
	assert.Zero(t, s.Waiting)
	assert.Equal(t, uint64(4), s.Requests)
}

func TestRejections(t *testing.T) {
	e := newTestEngine(t, Config{BlockSize: 4, CapacityBlocks: 4, MaxModelLen: 100})
	_, err := e.Generate(context.Background(), Input{Tokens: seqTokens(1, 90), OutputTokens: 20})
	assert.ErrorIs(t, err, ErrTooLong)
	_, err = e.Generate(context.Background(), Input{Tokens: seqTokens(1, 17)})
	assert.ErrorIs(t, err, ErrTooLong, "more blocks than the whole cache")
	e.SetDown(true)
	_, err = e.Generate(context.Background(), Input{Tokens: seqTokens(1, 4)})
	assert.ErrorIs(t, err, ErrDown)
	e.SetDown(false)
	gen(t, e, seqTokens(1, 4), 0)
	require.NoError(t, e.Close())
	_, err = e.Generate(context.Background(), Input{Tokens: seqTokens(1, 4)})
	assert.True(t, errors.Is(err, ErrClosed))
}

func TestResetClearsCache(t *testing.T) {
	e := newTestEngine(t, Config{BlockSize: 4})
	a := seqTokens(1, 16)
	gen(t, e, a, 0)
	e.Reset()
	g, c := e.Lookup(a)
	assert.Zero(t, g+c)
	assert.Zero(t, gen(t, e, a, 0).CachedTokens)

	// Reset while a request holds blocks: they stay allocated, uncached, and are freed later.
	e.SetStall(true)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = e.Generate(context.Background(), Input{Tokens: seqTokens(500, 16)})
	}()
	eventually(t, func() bool { return e.Stats().Running == 1 }, "running")
	e.Reset()
	e.SetStall(false)
	<-done
	s := e.Stats()
	assert.Zero(t, s.CachedBlocks)
	assert.Zero(t, s.Usage)
	assert.Equal(t, e.cache.capacity, e.cache.empty)
}

func TestConfigValidation(t *testing.T) {
	for _, cfg := range []Config{
		{BlockSize: -1},
		{Latency: Latency{SpeedFactor: -1}},
		{Events: EventsConfig{ZMQEndpoint: "ipc:///tmp/x"}},
		{Events: EventsConfig{ReplayEndpoint: "tcp://:1"}},
		{Events: EventsConfig{Hashes: 9}},
	} {
		_, err := New(cfg)
		assert.ErrorIs(t, err, ErrInvalidConfig, "%+v", cfg)
	}
}
