package redisindex

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/rueidis"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

// ---- helpers (shared with redis_bench_test.go and redis_conformance_test.go) ----

// redisTestPrefix returns a fresh key prefix "kvroute:test:<random>:" and deletes every key under
// it when the test ends.
func redisTestPrefix(tb testing.TB, addr string) string {
	tb.Helper()
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		tb.Fatal(err)
	}
	prefix := "kvroute:test:" + hex.EncodeToString(b[:]) + ":"
	tb.Cleanup(func() { redisDeleteKeys(tb, addr, prefix) })
	return prefix
}

// redisDeleteKeys deletes every key under prefix (SCAN MATCH prefix* + DEL), with its own client.
func redisDeleteKeys(tb testing.TB, addr, prefix string) {
	c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{addr}, DisableCache: true})
	if err != nil {
		tb.Errorf("cleanup of %s*: %v", prefix, err)
		return
	}
	defer c.Close()
	ctx := context.Background()
	var cursor uint64
	for {
		e, err := c.Do(ctx, c.B().Scan().Cursor(cursor).Match(prefix+"*").Count(1000).Build()).AsScanEntry()
		if err != nil {
			tb.Errorf("cleanup scan: %v", err)
			return
		}
		if len(e.Elements) > 0 {
			if err := c.Do(ctx, c.B().Del().Key(e.Elements...).Build()).Error(); err != nil {
				tb.Errorf("cleanup del: %v", err)
			}
		}
		if cursor = e.Cursor; cursor == 0 {
			return
		}
	}
}

// redisCountKeys returns the number of keys under prefix.
func redisCountKeys(tb testing.TB, c rueidis.Client, prefix string) int {
	tb.Helper()
	n := 0
	var cursor uint64
	for {
		e, err := c.Do(context.Background(), c.B().Scan().Cursor(cursor).Match(prefix+"*").Count(1000).Build()).AsScanEntry()
		if err != nil {
			tb.Fatal(err)
		}
		n += len(e.Elements)
		if cursor = e.Cursor; cursor == 0 {
			return n
		}
	}
}

// redisTestClock is a settable clock.
type redisTestClock struct{ ns atomic.Int64 }

func newRedisTestClock() *redisTestClock {
	c := &redisTestClock{}
	c.ns.Store(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	return c
}
func (c *redisTestClock) Now() time.Time          { return time.Unix(0, c.ns.Load()) }
func (c *redisTestClock) Advance(d time.Duration) { c.ns.Add(int64(d)) }

// redisCountingClient counts the round trips (Do and DoMulti calls) made through it.
type redisCountingClient struct {
	rueidis.Client
	dos, multis atomic.Int64
}

func (c *redisCountingClient) Do(ctx context.Context, cmd rueidis.Completed) rueidis.RedisResult {
	c.dos.Add(1)
	return c.Client.Do(ctx, cmd)
}

func (c *redisCountingClient) DoMulti(ctx context.Context, cmds ...rueidis.Completed) []rueidis.RedisResult {
	c.multis.Add(1)
	return c.Client.DoMulti(ctx, cmds...)
}

func (c *redisCountingClient) roundTrips() int64 { return c.dos.Load() + c.multis.Load() }
func (c *redisCountingClient) reset()            { c.dos.Store(0); c.multis.Store(0) }

// redisFixture is an index on a fresh prefix, with a counting shared client and a fake clock.
type redisFixture struct {
	idx    *Index
	client *redisCountingClient
	clock  *redisTestClock
	prefix string
	addr   string
}

// newRedisFixture returns an index on REDIS_ADDR through a counting client, configured by cfg
// (KeyPrefix, Now and CommandTimeout filled in when unset).
func newRedisFixture(tb testing.TB, cfg Config) *redisFixture {
	tb.Helper()
	addr := testenv.RedisAddr(tb)
	f := &redisFixture{addr: addr, clock: newRedisTestClock()}
	if cfg.KeyPrefix == "" {
		cfg.KeyPrefix = redisTestPrefix(tb, addr)
	}
	f.prefix = cfg.KeyPrefix
	raw, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{addr}, DisableCache: true})
	if err != nil {
		tb.Fatalf("connect to %s: %v", addr, err)
	}
	tb.Cleanup(raw.Close)
	f.client = &redisCountingClient{Client: raw}
	if cfg.Now == nil {
		cfg.Now = f.clock.Now
	}
	if cfg.CommandTimeout == 0 {
		cfg.CommandTimeout = 2 * time.Second // -race on a shared machine: not a timing test
	}
	f.idx, err = NewWithClient(f.client, cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { f.idx.Close() })
	return f
}

// replica returns a second index on the same prefix and clock (another router replica).
func (f *redisFixture) replica(tb testing.TB) *Index {
	tb.Helper()
	idx, err := NewWithClient(f.client.Client, Config{KeyPrefix: f.prefix, Now: f.clock.Now, CommandTimeout: 2 * time.Second})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { idx.Close() })
	return idx
}

const redisTestModel = "m"

// redisTokens returns n tokens derived from seed.
func redisTokens(seed, n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(seed*1_000_003 + i)
	}
	return t
}

// redisReqKeys returns the request block keys of tokens for redisTestModel.
func redisReqKeys(tokens []uint32, blockSize int) []uint64 {
	return prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot(redisTestModel, ""), tokens, blockSize, nil)
}

// redisStored returns a BlockStored of the engine blocks hashes holding tokens.
func redisStored(hashes []uint64, parent uint64, hasParent bool, tokens []uint32, blockSize int, tier events.Tier) events.Event {
	return events.Event{Kind: events.KindBlockStored, BlockHashes: hashes, Parent: parent, HasParent: hasParent,
		TokenIDs: tokens, BlockSize: blockSize, Tier: tier}
}

func redisRemoved(hashes []uint64, tier events.Tier) events.Event {
	return events.Event{Kind: events.KindBlockRemoved, BlockHashes: hashes, Tier: tier}
}

func redisBatch(evs ...events.Event) *events.Batch {
	return &events.Batch{Model: redisTestModel, Events: evs}
}

func redisApply(tb testing.TB, idx *Index, backend string, evs ...events.Event) {
	tb.Helper()
	if err := idx.Apply(context.Background(), backend, redisBatch(evs...)); err != nil {
		tb.Fatalf("Apply(%s): %v", backend, err)
	}
}

func redisLookup(tb testing.TB, idx *Index, keys []uint64, cands ...string) []kvindex.Match {
	tb.Helper()
	out, err := idx.Lookup(context.Background(), keys, cands, make([]kvindex.Match, len(cands)))
	if err != nil {
		tb.Fatalf("Lookup: %v", err)
	}
	return out
}

func redisHashes(base uint64, n int) []uint64 {
	h := make([]uint64, n)
	for i := range h {
		h[i] = base + uint64(i)
	}
	return h
}

func approx(a, b float64) bool { d := a - b; return d < 1e-9 && d > -1e-9 }

// ---- tests without Redis ----

func TestConfigValidation(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"no address", Config{}},
		{"addr and url", Config{Addr: "127.0.0.1:1", URL: "redis://127.0.0.1:1"}},
		{"glob star", Config{Addr: "127.0.0.1:1", KeyPrefix: "kv*:"}},
		{"glob question", Config{Addr: "127.0.0.1:1", KeyPrefix: "kv?:"}},
		{"glob bracket", Config{Addr: "127.0.0.1:1", KeyPrefix: "kv[a]:"}},
		{"backslash", Config{Addr: "127.0.0.1:1", KeyPrefix: `kv\:`}},
		{"negative block size", Config{Addr: "127.0.0.1:1", BlockSize: -1}},
		{"negative ttl", Config{Addr: "127.0.0.1:1", EntryTTL: -time.Second}},
		{"negative timeout", Config{Addr: "127.0.0.1:1", CommandTimeout: -1}},
		{"tier weight above 1", Config{Addr: "127.0.0.1:1", TierWeights: kvindex.TierWeights{1, 2, 0}}},
		{"bad url", Config{URL: "http://x"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			idx, err := New(tc.cfg)
			if !errors.Is(err, kvindex.ErrInvalidConfig) {
				if idx != nil {
					idx.Close()
				}
				t.Fatalf("New: err = %v, want kvindex.ErrInvalidConfig", err)
			}
		})
	}
}

// modeClient is a client that answers Mode and nothing else: NewWithClient does no I/O.
type modeClient struct {
	rueidis.Client
	mode rueidis.ClientMode
}

func (c modeClient) Mode() rueidis.ClientMode { return c.mode }

func TestNewWithClientValidation(t *testing.T) {
	single := modeClient{mode: rueidis.ClientModeStandalone}
	for _, tc := range []struct {
		name   string
		client rueidis.Client
		cfg    Config
		ok     bool
	}{
		{"zero config", single, Config{}, true},
		{"nil client", nil, Config{}, false},
		{"addr", single, Config{Addr: "127.0.0.1:1"}, false},
		{"url", single, Config{URL: "redis://127.0.0.1:1"}, false},
		{"password", single, Config{Password: "secret"}, false},
		{"tls", single, Config{TLS: &tls.Config{}}, false},
		{"connect timeout", single, Config{ConnectTimeout: time.Second}, false},
		{"glob prefix", single, Config{KeyPrefix: "kv*:"}, false},
		{"cluster without hash tag", modeClient{mode: rueidis.ClientModeCluster}, Config{}, false},
		{"cluster with hash tag", modeClient{mode: rueidis.ClientModeCluster}, Config{KeyPrefix: "kvroute:{kvidx}:"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			idx, err := NewWithClient(tc.client, tc.cfg)
			if tc.ok {
				if err != nil {
					t.Fatalf("NewWithClient: %v", err)
				}
				if err := idx.Close(); err != nil { // leaves the caller's client alone
					t.Fatalf("Close: %v", err)
				}
				return
			}
			if !errors.Is(err, kvindex.ErrInvalidConfig) {
				t.Fatalf("NewWithClient: err = %v, want ErrInvalidConfig", err)
			}
		})
	}
}

func TestHashTag(t *testing.T) {
	for s, want := range map[string]bool{
		"kvroute:{kvidx}:": true, "{a}": true, "kvroute:kvidx:": false, "{}x": false, "}{": false, "{x": false,
	} {
		if got := redisHasHashTag(s); got != want {
			t.Errorf("redisHasHashTag(%q) = %v, want %v", s, got, want)
		}
	}
}

func TestEngineCache(t *testing.T) {
	c := newRedisEngineCache(3)
	c.put(1, []uint64{10}, 1)
	c.put(2, []uint64{20, 21}, 1)
	c.put(3, []uint64{30}, 2)
	if n := c.get(1); n == nil || n.tailKey() != 10 {
		t.Fatalf("get(1) = %+v", n)
	}
	c.put(4, []uint64{40}, 1) // evicts 2, the least recently used
	if c.has(2) || !c.has(1) || !c.has(3) || !c.has(4) || c.len() != 3 {
		t.Fatalf("after eviction: has(2)=%v len=%d", c.has(2), c.len())
	}
	c.put(1, []uint64{10}, 2) // adds a tier
	c.clearTier(1, events.TierGPU)
	if !c.has(1) {
		t.Fatal("clearTier(GPU) dropped an entry still on CPU")
	}
	c.clearTier(1, events.TierCPU)
	if c.has(1) || c.len() != 2 {
		t.Fatal("clearTier of the last tier kept the entry")
	}
	// The list stays consistent after the hole was filled: fill and evict through it.
	c.put(5, []uint64{50}, 1)
	c.put(6, []uint64{60}, 1)
	if c.len() != 3 || c.has(3) {
		t.Fatalf("len=%d has(3)=%v, want 3 entries without 3", c.len(), c.has(3))
	}
	if n := c.get(6); n == nil || n.tailKey() != 60 {
		t.Fatalf("get(6) = %+v", n)
	}
	c.reset()
	if c.len() != 0 || c.has(6) {
		t.Fatal("reset kept entries")
	}
	c.put(7, []uint64{70, 71, 72}, 4)
	if n := c.get(7); n == nil || n.tailKey() != 72 || n.key != 70 {
		t.Fatalf("multi-key entry = %+v", n)
	}
}

// ---- Redis down ----

// redisClosedAddr returns a loopback address nothing listens on.
func redisClosedAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

func TestDown(t *testing.T) {
	const timeout = 50 * time.Millisecond
	idx, err := New(Config{Addr: redisClosedAddr(t), CommandTimeout: timeout, ConnectTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatalf("New on a closed port: %v (a router must start while Redis is down)", err)
	}
	defer idx.Close()
	ctx := context.Background()
	keys := redisReqKeys(redisTokens(1, 64), 16)
	for i := range 3 { // the first call dials; the next ones back off
		start := time.Now()
		_, err := idx.Lookup(ctx, keys, []string{"a", "b"}, make([]kvindex.Match, 2))
		took := time.Since(start)
		if !errors.Is(err, kvindex.ErrUnavailable) {
			t.Fatalf("Lookup %d: err = %v, want kvindex.ErrUnavailable", i, err)
		}
		// Generous bound (loaded CI machine, -race): what matters is "not ConnectTimeout or more".
		if took > timeout+150*time.Millisecond {
			t.Errorf("Lookup %d took %v with CommandTimeout %v", i, took, timeout)
		}
	}
	if _, err := idx.LookupPrefix(ctx, "abcd", []string{"a"}, make([]kvindex.Match, 1)); !errors.Is(err, kvindex.ErrUnavailable) {
		t.Errorf("LookupPrefix: err = %v", err)
	}
	if err := idx.Speculate(ctx, "a", keys, 0); !errors.Is(err, kvindex.ErrUnavailable) {
		t.Errorf("Speculate: err = %v", err)
	}
	b := redisBatch(redisStored([]uint64{1}, 0, false, redisTokens(1, 16), 16, events.TierGPU))
	if err := idx.Apply(ctx, "a", b); !errors.Is(err, kvindex.ErrUnavailable) {
		t.Errorf("Apply: err = %v", err)
	}
	if err := idx.ClearBackend(ctx, "a"); !errors.Is(err, kvindex.ErrUnavailable) {
		t.Errorf("ClearBackend: err = %v", err)
	}
	if s, err := idx.Stats(ctx); !errors.Is(err, kvindex.ErrUnavailable) || s.Backend != "redis" {
		t.Errorf("Stats: %+v, %v", s, err)
	}
	if _, err := idx.Clear(ctx); !errors.Is(err, kvindex.ErrUnavailable) {
		t.Errorf("Clear: err = %v", err)
	}
}

// redisProxy forwards TCP connections to a Redis server; Stop cuts it (Redis "goes away") and
// Start brings it back on the same address.
type redisProxy struct {
	target string
	addr   string
	mu     sync.Mutex
	l      net.Listener
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
}

func newRedisProxy(t *testing.T, target string) *redisProxy {
	p := &redisProxy{target: target, conns: map[net.Conn]struct{}{}}
	p.start(t, "127.0.0.1:0")
	t.Cleanup(p.stop)
	return p
}

func (p *redisProxy) start(t *testing.T, addr string) {
	var l net.Listener
	var err error
	for range 50 { // the port may linger for a moment after stop
		if l, err = net.Listen("tcp", addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	p.l, p.addr = l, l.Addr().String()
	p.mu.Unlock()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", p.target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns[c], p.conns[u] = struct{}{}, struct{}{}
			p.mu.Unlock()
			p.wg.Add(2)
			go func() { defer p.wg.Done(); io.Copy(u, c); u.Close() }()
			go func() { defer p.wg.Done(); io.Copy(c, u); c.Close() }()
		}
	}()
}

func (p *redisProxy) stop() {
	p.mu.Lock()
	if p.l != nil {
		p.l.Close()
		p.l = nil
	}
	for c := range p.conns {
		c.Close()
	}
	clear(p.conns)
	p.mu.Unlock()
	p.wg.Wait()
}

func TestGoesAwayAndComesBack(t *testing.T) {
	addr := testenv.RedisAddr(t)
	prefix := redisTestPrefix(t, addr)
	proxy := newRedisProxy(t, addr)
	clock := newRedisTestClock()
	idx, err := New(Config{Addr: proxy.addr, KeyPrefix: prefix, Now: clock.Now,
		CommandTimeout: time.Second, UnavailableBackoff: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer idx.Close()
	tokens := redisTokens(7, 64)
	keys := redisReqKeys(tokens, 16)
	redisApply(t, idx, "a", redisStored(redisHashes(100, 4), 0, false, tokens, 16, events.TierGPU))
	if m := redisLookup(t, idx, keys, "a"); m[0].Blocks != 4 {
		t.Fatalf("before the outage: %+v", m)
	}

	proxy.stop()
	ctx := context.Background()
	for i := range 5 {
		if _, err := idx.Lookup(ctx, keys, []string{"a"}, make([]kvindex.Match, 1)); !errors.Is(err, kvindex.ErrUnavailable) {
			t.Fatalf("Lookup %d during the outage: err = %v, want kvindex.ErrUnavailable", i, err)
		}
	}
	if err := idx.Apply(ctx, "a", redisBatch(redisRemoved(redisHashes(100, 1), events.TierGPU))); !errors.Is(err, kvindex.ErrUnavailable) {
		t.Fatalf("Apply during the outage: err = %v", err)
	}

	proxy.start(t, proxy.addr)
	deadline := time.Now().Add(10 * time.Second)
	for {
		out, err := idx.Lookup(ctx, keys, []string{"a"}, make([]kvindex.Match, 1))
		if err == nil {
			if out[0].Blocks != 4 {
				t.Fatalf("after the outage: %+v", out)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("index did not recover: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The failed Apply reset the engine-hash cache: the next removal re-reads the map from Redis.
	redisApply(t, idx, "a", redisRemoved(redisHashes(100, 1), events.TierGPU))
	if m := redisLookup(t, idx, keys, "a"); m[0].Blocks != 0 {
		t.Fatalf("after removing block 0: %+v", m)
	}
}

// ---- integration ----

func TestStoreAndLookup(t *testing.T) {
	f := newRedisFixture(t, Config{})
	tokens := redisTokens(1, 6*16+5) // 6 full blocks and a partial one
	keys := redisReqKeys(tokens, 16)
	redisApply(t, f.idx, "a", redisStored(redisHashes(1000, 4), 0, false, tokens[:64], 16, events.TierGPU))
	redisApply(t, f.idx, "b", redisStored(redisHashes(2000, 2), 0, false, tokens[:32], 16, events.TierGPU))

	out := redisLookup(t, f.idx, keys, "a", "b", "unknown")
	want := []kvindex.Match{
		{Backend: "a", Blocks: 4, Tokens: 64, WeightedBlocks: 4, Tier: events.TierGPU},
		{Backend: "b", Blocks: 2, Tokens: 32, WeightedBlocks: 2, Tier: events.TierGPU},
		{Backend: "unknown"},
	}
	for i := range want {
		if out[i] != want[i] {
			t.Errorf("out[%d] = %+v, want %+v", i, out[i], want[i])
		}
	}
	// A request sharing only the first block.
	other := append(append([]uint32(nil), tokens[:16]...), redisTokens(99, 48)...)
	if out := redisLookup(t, f.idx, redisReqKeys(other, 16), "a", "b"); out[0].Blocks != 1 || out[1].Blocks != 1 {
		t.Errorf("shared first block only: %+v", out)
	}
	// Another model roots another chain.
	otherModel := prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot("other", ""), tokens, 16, nil)
	if out := redisLookup(t, f.idx, otherModel, "a"); out[0].Blocks != 0 {
		t.Errorf("other model: %+v", out)
	}
	// No keys, no candidates: no I/O.
	f.client.reset()
	if out := redisLookup(t, f.idx, nil, "a"); out[0] != (kvindex.Match{Backend: "a"}) {
		t.Errorf("no keys: %+v", out)
	}
	if out := redisLookup(t, f.idx, keys); len(out) != 0 {
		t.Errorf("no candidates: %+v", out)
	}
	if n := f.client.roundTrips(); n != 0 {
		t.Errorf("empty lookups made %d round trips", n)
	}
}

func TestChainAcrossEvents(t *testing.T) {
	f := newRedisFixture(t, Config{})
	tokens := redisTokens(2, 5*16)
	keys := redisReqKeys(tokens, 16)
	redisApply(t, f.idx, "a", redisStored([]uint64{1, 2}, 0, false, tokens[:32], 16, events.TierGPU))
	redisApply(t, f.idx, "a",
		redisStored([]uint64{3}, 2, true, tokens[32:48], 16, events.TierGPU),
		redisStored([]uint64{4, 5}, 3, true, tokens[48:80], 16, events.TierGPU)) // parent stored earlier in the batch
	if out := redisLookup(t, f.idx, keys, "a"); out[0].Blocks != 5 {
		t.Fatalf("chain of 3 events: %+v", out)
	}
	// An unknown parent drops the event.
	redisApply(t, f.idx, "b", redisStored([]uint64{9}, 12345, true, tokens[:16], 16, events.TierGPU))
	if out := redisLookup(t, f.idx, keys, "b"); out[0].Blocks != 0 {
		t.Fatalf("event with unknown parent was placed: %+v", out)
	}
	s, err := f.idx.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if s.Dropped["unknown_parent"] != 1 || s.Mutations["stored"] != 5 {
		t.Errorf("stats: dropped %v, mutations %v", s.Dropped, s.Mutations)
	}
}

func TestEngineBlocksLargerThanOurs(t *testing.T) {
	f := newRedisFixture(t, Config{})
	tokens := redisTokens(3, 4*32)
	keys := redisReqKeys(tokens, 16)
	redisApply(t, f.idx, "a", redisStored([]uint64{1, 2}, 0, false, tokens[:64], 32, events.TierGPU))
	redisApply(t, f.idx, "a", redisStored([]uint64{3, 4}, 2, true, tokens[64:], 32, events.TierGPU))
	if out := redisLookup(t, f.idx, keys, "a"); out[0].Blocks != 8 || out[0].Tokens != 128 {
		t.Fatalf("4 engine blocks of 32 tokens: %+v, want 8 blocks", out)
	}
	// Removing engine block 2 removes both of our blocks 2 and 3.
	redisApply(t, f.idx, "a", redisRemoved([]uint64{2}, events.TierGPU))
	if out := redisLookup(t, f.idx, keys, "a"); out[0].Blocks != 2 {
		t.Fatalf("after removing engine block 2: %+v, want 2", out)
	}
	// A block size that is not a multiple of ours is dropped.
	redisApply(t, f.idx, "b", redisStored([]uint64{7}, 0, false, tokens[:24], 24, events.TierGPU))
	s, _ := f.idx.Stats(context.Background())
	if s.Dropped["bad_block_size"] != 1 {
		t.Errorf("dropped = %v", s.Dropped)
	}
	redisApply(t, f.idx, "b", redisStored([]uint64{7, 8}, 0, false, tokens[:20], 16, events.TierGPU))
	s, _ = f.idx.Stats(context.Background())
	if s.Dropped["bad_tokens"] != 1 {
		t.Errorf("dropped = %v", s.Dropped)
	}
}

func TestTiers(t *testing.T) {
	f := newRedisFixture(t, Config{})
	tokens := redisTokens(4, 3*16)
	keys := redisReqKeys(tokens, 16)
	hs := []uint64{1, 2, 3}
	redisApply(t, f.idx, "a", redisStored(hs, 0, false, tokens, 16, events.TierGPU))
	// The offloading connector announces CPU copies without tokens.
	redisApply(t, f.idx, "a", events.Event{Kind: events.KindBlockStored, BlockHashes: hs[1:], Tier: events.TierCPU})
	redisApply(t, f.idx, "a", redisRemoved(hs[1:], events.TierGPU))
	out := redisLookup(t, f.idx, keys, "a")
	if out[0].Blocks != 3 || out[0].Tier != events.TierCPU || !approx(out[0].WeightedBlocks, 1+0.8+0.8) {
		t.Fatalf("GPU+CPU+CPU: %+v", out[0])
	}
	// Back on GPU: the best tier counts.
	redisApply(t, f.idx, "a", redisStored(hs[2:], 2, true, tokens[32:], 16, events.TierGPU))
	if out := redisLookup(t, f.idx, keys, "a"); !approx(out[0].WeightedBlocks, 2.8) || out[0].Tier != events.TierCPU {
		t.Fatalf("block 2 back on GPU: %+v", out[0])
	}
	redisApply(t, f.idx, "a", redisRemoved(hs[1:2], events.TierCPU))
	if out := redisLookup(t, f.idx, keys, "a"); out[0].Blocks != 1 {
		t.Fatalf("block 1 gone from every tier: %+v, want 1 block", out[0])
	}
	// Storage tier ("disk" and other media).
	redisApply(t, f.idx, "b", redisStored(hs, 0, false, tokens, 16, events.TierStorage))
	if out := redisLookup(t, f.idx, keys, "b"); out[0].Tier != events.TierStorage || !approx(out[0].WeightedBlocks, 3*0.6) {
		t.Fatalf("storage: %+v", out[0])
	}
	// Custom weights.
	g := newRedisFixture(t, Config{TierWeights: kvindex.TierWeights{1, 0.5, 0.25}})
	redisApply(t, g.idx, "b", redisStored(hs, 0, false, tokens, 16, events.TierCPU))
	if out := redisLookup(t, g.idx, keys, "b"); !approx(out[0].WeightedBlocks, 1.5) {
		t.Fatalf("custom weights: %+v", out[0])
	}
}

func TestConsecutiveOnly(t *testing.T) {
	f := newRedisFixture(t, Config{})
	tokens := redisTokens(5, 6*16)
	keys := redisReqKeys(tokens, 16)
	redisApply(t, f.idx, "a", redisStored(redisHashes(10, 6), 0, false, tokens, 16, events.TierGPU))
	redisApply(t, f.idx, "b", redisStored(redisHashes(20, 6), 0, false, tokens, 16, events.TierGPU))
	redisApply(t, f.idx, "a", redisRemoved([]uint64{12}, events.TierGPU)) // a's block 2
	out := redisLookup(t, f.idx, keys, "a", "b", "a")
	if out[0].Blocks != 2 || out[1].Blocks != 6 || out[2].Blocks != 2 {
		t.Fatalf("%+v, want a=2 b=6 a=2", out)
	}
}

func TestManyCandidates(t *testing.T) {
	f := newRedisFixture(t, Config{})
	tokens := redisTokens(6, 2*16)
	keys := redisReqKeys(tokens, 16)
	cands := make([]string, 600) // more than one script call's worth
	for i := range cands {
		cands[i] = "pod-" + string(rune('a'+i%26)) + "-" + hex.EncodeToString([]byte{byte(i >> 8), byte(i)})
	}
	redisApply(t, f.idx, cands[3], redisStored([]uint64{1, 2}, 0, false, tokens, 16, events.TierGPU))
	redisApply(t, f.idx, cands[599], redisStored([]uint64{1}, 0, false, tokens[:16], 16, events.TierGPU))
	f.client.reset()
	out := redisLookup(t, f.idx, keys, cands...)
	if n := f.client.roundTrips(); n != 1 {
		t.Errorf("600 candidates took %d round trips, want 1", n)
	}
	for i, m := range out {
		want := 0
		switch i {
		case 3:
			want = 2
		case 599:
			want = 1
		}
		if m.Blocks != want || m.Backend != cands[i] {
			t.Fatalf("out[%d] = %+v, want %d blocks", i, m, want)
		}
	}
}

func TestOneRoundTrip(t *testing.T) {
	f := newRedisFixture(t, Config{})
	ctx := context.Background()
	tokens := redisTokens(8, 512*16)
	keys := redisReqKeys(tokens, 16)
	cands := make([]string, 16)
	for i := range cands {
		cands[i] = "backend-" + string(rune('a'+i))
	}
	// Backend i holds the first 32(i+1) blocks, stored as chained events of 32 blocks.
	for i, c := range cands {
		for e := 0; e <= i; e++ {
			base := uint64(i*10_000 + e*32)
			ev := redisStored(redisHashes(base, 32), base-1, e > 0, tokens[e*512:(e+1)*512], 16, events.TierGPU)
			f.client.reset()
			redisApply(t, f.idx, c, ev)
			// One write round trip; the first Apply of a backend also gets its id (one more, and
			// one more again for the script's NOSCRIPT fallback the very first time).
			if n := f.client.roundTrips(); n != 1 && !(e == 0 && n <= 3) {
				t.Fatalf("Apply %d of %s took %d round trips", e, c, n)
			}
		}
	}
	f.client.reset()
	out := redisLookup(t, f.idx, keys, cands...)
	if n := f.client.roundTrips(); n != 1 {
		t.Fatalf("Lookup of 512 blocks × 16 backends took %d round trips, want 1", n)
	}
	for i, m := range out {
		if m.Blocks != 32*(i+1) {
			t.Errorf("%s: %d blocks, want %d", m.Backend, m.Blocks, 32*(i+1))
		}
	}
	if err := f.idx.Speculate(ctx, "x", keys[:10], 0); err != nil { // gets x's id
		t.Fatal(err)
	}
	f.client.reset()
	if err := f.idx.Speculate(ctx, "x", keys[:20], 0); err != nil {
		t.Fatal(err)
	}
	if err := f.idx.Speculate(ctx, cands[3], keys, 0); err != nil {
		t.Fatal(err)
	}
	if n := f.client.roundTrips(); n != 2 {
		t.Errorf("2 Speculates took %d round trips, want 2", n)
	}
	f.client.reset()
	if _, err := f.idx.LookupPrefix(ctx, "abcd", cands, make([]kvindex.Match, len(cands))); err != nil {
		t.Fatal(err)
	}
	if n := f.client.roundTrips(); n != 1 {
		t.Errorf("LookupPrefix took %d round trips", n)
	}
}

func TestReplicasShareTheIndex(t *testing.T) {
	f := newRedisFixture(t, Config{})
	other := f.replica(t)
	tokens := redisTokens(9, 4*16)
	keys := redisReqKeys(tokens, 16)
	redisApply(t, f.idx, "a", redisStored([]uint64{1, 2}, 0, false, tokens[:32], 16, events.TierGPU))
	if out := redisLookup(t, other, keys, "a"); out[0].Blocks != 2 {
		t.Fatalf("replica sees %+v, want 2 blocks", out[0])
	}
	// The replica continues the chain: the parent is not in its own engine-hash cache, so it
	// reads the mapping from Redis (one extra round trip).
	f.client.reset()
	redisApply(t, other, "a", redisStored([]uint64{3, 4}, 2, true, tokens[32:], 16, events.TierGPU))
	if out := redisLookup(t, f.idx, keys, "a"); out[0].Blocks != 4 {
		t.Fatalf("chain continued by the replica: %+v, want 4", out[0])
	}
	// Both replicas apply the same events (each subscribes to every engine): idempotent.
	redisApply(t, f.idx, "a", redisStored([]uint64{3, 4}, 2, true, tokens[32:], 16, events.TierGPU))
	redisApply(t, other, "a", redisRemoved([]uint64{4}, events.TierGPU))
	redisApply(t, f.idx, "a", redisRemoved([]uint64{4}, events.TierGPU))
	for _, idx := range []*Index{f.idx, other} {
		if out := redisLookup(t, idx, keys, "a"); out[0].Blocks != 3 {
			t.Fatalf("after a duplicated removal: %+v, want 3", out[0])
		}
	}
	s, err := other.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if s.PerBackend["a"] != 3 || s.Entries != 3 || s.Blocks != 3 {
		t.Errorf("stats from the replica: entries %d blocks %d per backend %v", s.Entries, s.Blocks, s.PerBackend)
	}
}

func TestSpeculate(t *testing.T) {
	f := newRedisFixture(t, Config{SpeculativeTTL: 2 * time.Second})
	ctx := context.Background()
	tokens := redisTokens(10, 4*16)
	keys := redisReqKeys(tokens, 16)
	if err := f.idx.Speculate(ctx, "a", keys, 0); err != nil {
		t.Fatal(err)
	}
	if out := redisLookup(t, f.idx, keys, "a"); out[0].Blocks != 4 || out[0].Tier != events.TierGPU {
		t.Fatalf("speculative: %+v", out[0])
	}
	s, _ := f.idx.Stats(ctx)
	if s.SpeculativeCount != 4 || s.Mutations["speculated"] != 4 || s.PerBackend["a"] != 4 {
		t.Errorf("stats: spec %d mutations %v per backend %v", s.SpeculativeCount, s.Mutations, s.PerBackend)
	}
	// Two blocks are confirmed by the engine; the speculation on the others expires.
	redisApply(t, f.idx, "a", redisStored([]uint64{1, 2}, 0, false, tokens[:32], 16, events.TierGPU))
	f.clock.Advance(3 * time.Second)
	if out := redisLookup(t, f.idx, keys, "a"); out[0].Blocks != 2 {
		t.Fatalf("after the speculative TTL: %+v, want the 2 confirmed blocks", out[0])
	}
	// A confirmed CPU block is not turned into a speculative GPU one.
	redisApply(t, f.idx, "b", redisStored([]uint64{1}, 0, false, tokens[:16], 16, events.TierCPU))
	if err := f.idx.Speculate(ctx, "b", keys[:1], time.Minute); err != nil {
		t.Fatal(err)
	}
	if out := redisLookup(t, f.idx, keys, "b"); out[0].Tier != events.TierCPU {
		t.Fatalf("speculation over a CPU block: %+v", out[0])
	}
	// A custom ttl.
	if err := f.idx.Speculate(ctx, "c", keys, time.Minute); err != nil {
		t.Fatal(err)
	}
	f.clock.Advance(30 * time.Second)
	if out := redisLookup(t, f.idx, keys, "c"); out[0].Blocks != 4 {
		t.Fatalf("speculation with a 1m ttl after 30s: %+v", out[0])
	}
	// ClearBackend drops speculative entries too.
	if err := f.idx.ClearBackend(ctx, "c"); err != nil {
		t.Fatal(err)
	}
	if out := redisLookup(t, f.idx, keys, "c"); out[0].Blocks != 0 {
		t.Fatalf("after ClearBackend: %+v", out[0])
	}
}

func TestExpiryAndPruning(t *testing.T) {
	f := newRedisFixture(t, Config{EntryTTL: time.Minute})
	ctx := context.Background()
	tokens := redisTokens(11, 4*16)
	keys := redisReqKeys(tokens, 16)
	redisApply(t, f.idx, "a", redisStored([]uint64{1, 2, 3, 4}, 0, false, tokens, 16, events.TierGPU))
	redisApply(t, f.idx, "b", redisStored([]uint64{1, 2}, 0, false, tokens[:32], 16, events.TierGPU))
	f.clock.Advance(30 * time.Second)
	// b refreshes its blocks.
	redisApply(t, f.idx, "b", redisStored([]uint64{1, 2}, 0, false, tokens[:32], 16, events.TierGPU))
	f.clock.Advance(45 * time.Second)
	out := redisLookup(t, f.idx, keys, "a", "b")
	if out[0].Blocks != 0 || out[1].Blocks != 2 {
		t.Fatalf("after a's TTL: %+v", out)
	}
	s, _ := f.idx.Stats(ctx)
	if s.PerBackend["a"] != 0 || s.PerBackend["b"] != 2 || s.Blocks != 2 {
		t.Errorf("live entries: per backend %v, blocks %d", s.PerBackend, s.Blocks)
	}
	// a's next Apply prunes its expired memberships.
	redisApply(t, f.idx, "a", redisStored([]uint64{9}, 0, false, redisTokens(12, 16), 16, events.TierGPU))
	s, _ = f.idx.Stats(ctx)
	if s.Expired != 4 {
		t.Errorf("Expired = %d, want 4", s.Expired)
	}
	n, err := f.client.Do(ctx, f.client.B().Zcard().Key(f.prefix+keySpaceTag+"mb:a").Build()).AsInt64()
	if err != nil || n != 1 {
		t.Errorf("a's memberships after pruning: %d, %v; want 1", n, err)
	}
	// Keys carry a Redis TTL of EntryTTL from their last write.
	k := f.prefix + keySpaceTag + "b:" + string(redisAppendHex16(nil, keys[0]))
	ttl, err := f.client.Do(ctx, f.client.B().Pttl().Key(k).Build()).AsInt64()
	if err != nil || ttl <= 0 || ttl > time.Minute.Milliseconds() {
		t.Errorf("PTTL of a block key = %d, %v", ttl, err)
	}
	// Both backends have slots in block 0: 12 bytes each.
	v, err := f.client.Do(ctx, f.client.B().Get().Key(k).Build()).ToString()
	if err != nil || len(v) != 2*redisSlotSize {
		t.Errorf("block 0 string: %d bytes, %v; want %d", len(v), err, 2*redisSlotSize)
	}
}

func TestBackendIDs(t *testing.T) {
	f := newRedisFixture(t, Config{EntryTTL: time.Minute, MaxBackends: 2})
	ctx := context.Background()
	tokens := redisTokens(20, 16)
	keys := redisReqKeys(tokens, 16)
	ev := redisStored([]uint64{1}, 0, false, tokens, 16, events.TierGPU)
	redisApply(t, f.idx, "a", ev)
	redisApply(t, f.idx, "b", ev)
	redisApply(t, f.idx, "c", ev) // no id left
	out := redisLookup(t, f.idx, keys, "a", "b", "c")
	if out[0].Blocks != 1 || out[1].Blocks != 1 || out[2].Blocks != 0 {
		t.Fatalf("%+v", out)
	}
	if s, _ := f.idx.Stats(ctx); s.Dropped["too_many_backends"] != 1 {
		t.Errorf("dropped: %v", s.Dropped)
	}
	// Once a has been idle for longer than EntryTTL (and the margin), c takes its id; a's old
	// entries, all expired, do not show up as c's.
	f.clock.Advance(time.Minute + redisIDReuseMargin + time.Second)
	redisApply(t, f.idx, "b", ev) // b stays active
	other := redisStored([]uint64{2}, 0, false, redisTokens(21, 16), 16, events.TierGPU)
	redisApply(t, f.idx, "c", other)
	out = redisLookup(t, f.idx, keys, "a", "b", "c")
	if out[0].Blocks != 0 || out[1].Blocks != 1 || out[2].Blocks != 0 {
		t.Fatalf("after id reuse: %+v", out)
	}
	if out := redisLookup(t, f.idx, redisReqKeys(redisTokens(21, 16), 16), "a", "c"); out[0].Blocks != 0 || out[1].Blocks != 1 {
		t.Fatalf("c's own block: %+v", out)
	}
	// A replica that cached a's id long ago asks again instead of writing into c's slot.
	st := f.idx.backend("a")
	if f.idx.idFresh(st, f.clock.Now()) {
		t.Fatal("a's cached id is still considered fresh")
	}
}

func TestClearBackendAndAllBlocksCleared(t *testing.T) {
	f := newRedisFixture(t, Config{})
	ctx := context.Background()
	tokens := redisTokens(13, 1100*16) // more than two pages of ClearBackend
	keys := redisReqKeys(tokens, 16)
	var evs []events.Event
	for e := 0; e < 1100/100; e++ {
		evs = append(evs, redisStored(redisHashes(uint64(e*100+1), 100), uint64(e*100), e > 0, tokens[e*1600:(e+1)*1600], 16, events.TierGPU))
	}
	redisApply(t, f.idx, "a", evs...)
	redisApply(t, f.idx, "b", redisStored([]uint64{1, 2}, 0, false, tokens[:32], 16, events.TierGPU))
	redisApply(t, f.idx, "a", events.Event{Kind: events.KindPrefix, PrefixOp: events.PrefixCreated, PrefixHash: "ab12", TokenCount: 100})
	if out := redisLookup(t, f.idx, keys, "a", "b"); out[0].Blocks != 1100 || out[1].Blocks != 2 {
		t.Fatalf("before: %+v", out)
	}
	if err := f.idx.ClearBackend(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	out := redisLookup(t, f.idx, keys, "a", "b")
	if out[0].Blocks != 0 || out[1].Blocks != 2 {
		t.Fatalf("after ClearBackend(a): %+v", out)
	}
	if out, _ := f.idx.LookupPrefix(ctx, "ab12", []string{"a"}, make([]kvindex.Match, 1)); out[0].Tokens != 0 {
		t.Fatalf("prefix entry survived ClearBackend: %+v", out)
	}
	for _, k := range []string{"e:a", "mb:a", "ms:a", "mp:a"} {
		if n, _ := f.client.Do(ctx, f.client.B().Exists().Key(f.prefix+keySpaceTag+k).Build()).AsInt64(); n != 0 {
			t.Errorf("%s survived ClearBackend", k)
		}
	}
	// Its engine-hash map went too: a continuation has an unknown parent.
	redisApply(t, f.idx, "a", redisStored([]uint64{5000}, 1100, true, tokens[:16], 16, events.TierGPU))
	s, _ := f.idx.Stats(ctx)
	if s.Dropped["unknown_parent"] != 1 || s.Mutations["cleared"] != 1 {
		t.Errorf("stats: %v %v", s.Dropped, s.Mutations)
	}

	// AllBlocksCleared inside a batch: events before it are cleared, events after it stay.
	redisApply(t, f.idx, "b",
		redisStored([]uint64{3}, 2, true, tokens[32:48], 16, events.TierGPU),
		events.Event{Kind: events.KindAllBlocksCleared},
		redisStored([]uint64{7}, 0, false, tokens[:16], 16, events.TierGPU))
	if out := redisLookup(t, f.idx, keys, "b"); out[0].Blocks != 1 {
		t.Fatalf("after AllBlocksCleared + 1 block: %+v", out[0])
	}
}

func TestPrefixEntries(t *testing.T) {
	ctx := context.Background()
	prefixEv := func(op events.PrefixOp, hash string, tokens int) events.Event {
		return events.Event{Kind: events.KindPrefix, PrefixOp: op, PrefixHash: hash, TokenCount: tokens}
	}
	lookup := func(t *testing.T, idx *Index, hash string, cands ...string) []kvindex.Match {
		t.Helper()
		out, err := idx.LookupPrefix(ctx, hash, cands, make([]kvindex.Match, len(cands)))
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	t.Run("offloading", func(t *testing.T) {
		f := newRedisFixture(t, Config{StorageOffloading: true, TreatEvictionAsOffload: true})
		redisApply(t, f.idx, "a", prefixEv(events.PrefixCreated, "ABCD", 2048))
		redisApply(t, f.idx, "b", prefixEv(events.PrefixCreated, "abcd", 512))
		out := lookup(t, f.idx, "abcd", "a", "b", "c")
		if out[0].Tokens != 2048 || out[0].Blocks != 128 || out[0].WeightedBlocks != 2048 || out[1].Tokens != 512 || out[2].Tokens != 0 {
			t.Fatalf("created: %+v", out)
		}
		redisApply(t, f.idx, "a", prefixEv(events.PrefixOffloaded, "abcd", 0))
		out = lookup(t, f.idx, "abcd", "a")
		if out[0].Tokens != 2048 || out[0].Tier != events.TierStorage || !approx(out[0].WeightedBlocks, 2048*0.6) {
			t.Fatalf("offloaded: %+v", out)
		}
		redisApply(t, f.idx, "a", prefixEv(events.PrefixReloaded, "abcd", 0))
		if out := lookup(t, f.idx, "abcd", "a"); out[0].Tier != events.TierGPU || out[0].Tokens != 2048 {
			t.Fatalf("reloaded: %+v", out)
		}
		redisApply(t, f.idx, "b", prefixEv(events.PrefixEvicted, "abcd", 0))
		if out := lookup(t, f.idx, "abcd", "b"); out[0].Tier != events.TierStorage || out[0].Tokens != 512 {
			t.Fatalf("evicted as offload: %+v", out)
		}
		redisApply(t, f.idx, "b", prefixEv(events.PrefixPurged, "abcd", 0))
		if out := lookup(t, f.idx, "abcd", "b"); out[0].Tokens != 0 {
			t.Fatalf("purged: %+v", out)
		}
		s, _ := f.idx.Stats(ctx)
		if s.PerBackend["a"] != 1 || s.PrefixCount != 1 || s.Mutations["prefix_created"] != 2 {
			t.Errorf("stats: %+v", s)
		}
		f.clock.Advance(kvindex.DefaultEntryTTL + time.Second)
		if out := lookup(t, f.idx, "abcd", "a"); out[0].Tokens != 0 {
			t.Fatalf("expired: %+v", out)
		}
	})
	t.Run("no offloading", func(t *testing.T) {
		f := newRedisFixture(t, Config{TreatEvictionAsOffload: true})
		redisApply(t, f.idx, "a", prefixEv(events.PrefixCreated, "01", 64))
		redisApply(t, f.idx, "b", prefixEv(events.PrefixCreated, "01", 64))
		redisApply(t, f.idx, "a", prefixEv(events.PrefixOffloaded, "01", 0))
		redisApply(t, f.idx, "b", prefixEv(events.PrefixEvicted, "01", 0))
		if out := lookup(t, f.idx, "01", "a", "b"); out[0].Tokens != 0 || out[1].Tokens != 0 {
			t.Fatalf("offloaded/evicted without offloading: %+v", out)
		}
	})
	t.Run("bad", func(t *testing.T) {
		f := newRedisFixture(t, Config{})
		redisApply(t, f.idx, "a", prefixEv(events.PrefixCreated, "", 64), prefixEv(events.PrefixCreated, "a*", 64))
		s, _ := f.idx.Stats(ctx)
		if s.Dropped["bad_prefix"] != 2 {
			t.Errorf("dropped: %v", s.Dropped)
		}
	})
}

func TestClear(t *testing.T) {
	f := newRedisFixture(t, Config{})
	ctx := context.Background()
	tokens := redisTokens(14, 3*16)
	keys := redisReqKeys(tokens, 16)
	redisApply(t, f.idx, "a", redisStored([]uint64{1, 2, 3}, 0, false, tokens, 16, events.TierGPU))
	redisApply(t, f.idx, "b", redisStored([]uint64{1, 2}, 0, false, tokens[:32], 16, events.TierGPU),
		events.Event{Kind: events.KindPrefix, PrefixOp: events.PrefixCreated, PrefixHash: "ff", TokenCount: 10})
	// A key of another index on the same server must survive.
	outside := f.prefix[:len(f.prefix)-1] + "x:keep"
	if err := f.client.Do(ctx, f.client.B().Set().Key(outside).Value("1").Build()).Error(); err != nil {
		t.Fatal(err)
	}
	defer f.client.Do(ctx, f.client.B().Del().Key(outside).Build())
	n, err := f.idx.Clear(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != 6 {
		t.Errorf("Clear dropped %d entries, want 6", n)
	}
	if left := redisCountKeys(t, f.client, f.prefix); left != 4 { // ids, seen, idseq, epoch
		t.Errorf("%d keys left under the prefix, want the 4 of the id registry", left)
	}
	if out := redisLookup(t, f.idx, keys, "a", "b"); out[0].Blocks != 0 || out[1].Blocks != 0 {
		t.Fatalf("after Clear: %+v", out)
	}
	if v, err := f.client.Do(ctx, f.client.B().Get().Key(outside).Build()).ToString(); err != nil || v != "1" {
		t.Errorf("Clear deleted a key outside its prefix: %q %v", v, err)
	}
	// The engine-hash cache was reset: a continuation is unplaceable.
	redisApply(t, f.idx, "a", redisStored([]uint64{4}, 3, true, tokens[:16], 16, events.TierGPU))
	if s, _ := f.idx.Stats(ctx); s.Dropped["unknown_parent"] != 1 || s.Entries != 0 {
		t.Errorf("after Clear: %+v", s)
	}
}

func TestSharedClientAndClose(t *testing.T) {
	f := newRedisFixture(t, Config{})
	ctx := context.Background()
	if err := f.idx.Close(); err != nil {
		t.Fatal(err)
	}
	if err := f.idx.Close(); err != nil {
		t.Fatal("second Close:", err)
	}
	// The shared client stays open.
	if err := f.client.Do(ctx, f.client.B().Ping().Build()).Error(); err != nil {
		t.Fatalf("shared client closed by the index: %v", err)
	}
	if _, err := f.idx.Lookup(ctx, []uint64{1}, []string{"a"}, make([]kvindex.Match, 1)); !errors.Is(err, kvindex.ErrClosed) {
		t.Errorf("Lookup after Close: %v", err)
	}
	if err := f.idx.Apply(ctx, "a", redisBatch(redisRemoved([]uint64{1}, 0))); !errors.Is(err, kvindex.ErrClosed) {
		t.Errorf("Apply after Close: %v", err)
	}
	if err := f.idx.Speculate(ctx, "a", []uint64{1}, 0); !errors.Is(err, kvindex.ErrClosed) {
		t.Errorf("Speculate after Close: %v", err)
	}
	if _, err := f.idx.Clear(ctx); !errors.Is(err, kvindex.ErrClosed) {
		t.Errorf("Clear after Close: %v", err)
	}
	// An index with its own client closes it.
	own, err := New(Config{Addr: f.addr, KeyPrefix: f.prefix})
	if err != nil {
		t.Fatal(err)
	}
	own.Close()
	own.Close()
	if err := own.client.Do(ctx, own.client.B().Ping().Build()).Error(); err == nil {
		t.Error("own client still open after Close")
	}
}

func TestConcurrent(t *testing.T) {
	f := newRedisFixture(t, Config{})
	other := f.replica(t)
	ctx := context.Background()
	tokens := redisTokens(15, 64*16)
	keys := redisReqKeys(tokens, 16)
	cands := []string{"a", "b", "c", "d"}
	var wg sync.WaitGroup
	for bi, b := range cands {
		wg.Add(1)
		go func() {
			defer wg.Done()
			idx := f.idx
			if bi%2 == 1 {
				idx = other
			}
			for e := 0; e < 8; e++ {
				base := uint64(e * 8)
				ev := redisStored(redisHashes(base+1, 8), base, e > 0, tokens[e*128:(e+1)*128], 16, events.TierGPU)
				if err := idx.Apply(ctx, b, redisBatch(ev)); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out := make([]kvindex.Match, len(cands))
			for range 20 {
				if _, err := f.idx.Lookup(ctx, keys, cands, out); err != nil {
					t.Error(err)
					return
				}
				if err := other.Speculate(ctx, "e", keys[:4], 0); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	for _, m := range redisLookup(t, f.idx, keys, cands...) {
		if m.Blocks != 64 {
			t.Errorf("%+v, want 64 blocks", m)
		}
	}
	if _, err := f.idx.Stats(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestNewWithURL(t *testing.T) {
	addr := testenv.RedisAddr(t)
	prefix := redisTestPrefix(t, addr)
	idx, err := New(Config{URL: "redis://" + addr + "/0", KeyPrefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	defer idx.Close()
	tokens := redisTokens(16, 16)
	redisApply(t, idx, "a", redisStored([]uint64{1}, 0, false, tokens, 16, events.TierGPU))
	if out := redisLookup(t, idx, redisReqKeys(tokens, 16), "a"); out[0].Blocks != 1 {
		t.Fatalf("%+v", out)
	}
	if !strings.HasPrefix(prefix, "kvroute:test:") {
		t.Fatal(prefix)
	}
}

func TestContextEnded(t *testing.T) {
	f := newRedisFixture(t, Config{})
	tokens := redisTokens(30, 32)
	keys := redisReqKeys(tokens, 16)
	redisApply(t, f.idx, "a", redisStored([]uint64{1, 2}, 0, false, tokens, 16, events.TierGPU))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := f.idx.Lookup(ctx, keys, []string{"a"}, make([]kvindex.Match, 1))
	if !errors.Is(err, kvindex.ErrUnavailable) || !errors.Is(err, context.Canceled) {
		t.Fatalf("Lookup with an ended ctx: %v, want kvindex.ErrUnavailable and context.Canceled", err)
	}
	// The caller's ended ctx is not Redis's fault: the next call is not backed off.
	if out := redisLookup(t, f.idx, keys, "a"); out[0].Blocks != 2 {
		t.Fatalf("after an ended ctx: %+v", out)
	}
}

func TestBreaker(t *testing.T) {
	idx, err := New(Config{Addr: redisClosedAddr(t), UnavailableBackoff: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer idx.Close()
	ctx := context.Background()
	if _, err := idx.Lookup(ctx, []uint64{1}, []string{"a"}, make([]kvindex.Match, 1)); !errors.Is(err, kvindex.ErrUnavailable) {
		t.Fatal(err)
	}
	// Backing off: no dial at all.
	_, err = idx.Lookup(ctx, []uint64{1}, []string{"a"}, make([]kvindex.Match, 1))
	if !errors.Is(err, kvindex.ErrUnavailable) || !errors.Is(err, errRedisBackingOff) {
		t.Fatalf("second Lookup: %v, want a fail-fast kvindex.ErrUnavailable", err)
	}
}

// Redis lost the index (a restart without persistence, say) and the events consumer clears the
// backend before it replays the engine's buffer: the clear drops the stale cached id, so that
// the replayed batches are written under a new one and are readable at once.
func TestClearAfterLostRegistry(t *testing.T) {
	f := newRedisFixture(t, Config{})
	ctx := context.Background()
	tok := redisTokens(50, 32)
	keys := redisReqKeys(tok, 16)
	ev := redisStored([]uint64{1, 2}, 0, false, tok, 16, events.TierGPU)
	redisApply(t, f.idx, "a", ev)
	if _, err := f.idx.Clear(ctx); err != nil { // the entries…
		t.Fatal(err)
	}
	if err := f.client.Do(ctx, f.client.B().Del().Key(f.prefix+"ids", f.prefix+"seen", f.prefix+"idseq").Build()).Error(); err != nil {
		t.Fatal(err) // …and the id registry
	}
	if err := f.idx.ClearBackend(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	redisApply(t, f.idx, "a", ev) // the replay
	if out := redisLookup(t, f.idx, keys, "a"); out[0].Blocks != 2 {
		t.Fatalf("after the clear and the replay: %+v, want a on both blocks", out)
	}
}

func TestLostIDRegistry(t *testing.T) {
	f := newRedisFixture(t, Config{})
	ctx := context.Background()
	shared := redisTokens(40, 16) // a block both backends hold
	tokA := append(append([]uint32(nil), shared...), redisTokens(41, 16)...)
	tokB := append(append([]uint32(nil), shared...), redisTokens(42, 16)...)
	keysA, keysB := redisReqKeys(tokA, 16), redisReqKeys(tokB, 16)
	evA := redisStored([]uint64{1, 2}, 0, false, tokA, 16, events.TierGPU)
	evB := redisStored([]uint64{7, 8}, 0, false, tokB, 16, events.TierGPU)
	redisApply(t, f.idx, "a", evA) // a gets id 0
	// The id registry is lost (a Redis restart without persistence, say); this process still
	// caches a's id 0, and another replica registers b, which gets id 0 too.
	if err := f.client.Do(ctx, f.client.B().Del().Key(f.prefix+"ids", f.prefix+"seen", f.prefix+"idseq").Build()).Error(); err != nil {
		t.Fatal(err)
	}
	other := f.replica(t)
	redisApply(t, other, "b", evB)
	// b's slot 0 in a's second block was written by a: not credited to b.
	if out := redisLookup(t, f.idx, keysA, "a", "b"); out[0].Blocks != 0 || out[1].Blocks != 1 {
		t.Fatalf("after the registry loss: %+v, want a unknown and b on the shared block only", out)
	}
	// a's next write goes to the stale id once, notices and says so (its entries are gone: the
	// caller should replay them), and the one after gets a new id.
	if err := f.idx.Apply(ctx, "a", redisBatch(evA)); !errors.Is(err, kvindex.ErrBackendLost) {
		t.Fatalf("Apply(a) with a stale id: %v, want kvindex.ErrBackendLost", err)
	}
	if id := f.idx.backend("a").id.Load(); id != -1 {
		t.Fatalf("a's stale id %d was kept", id)
	}
	redisApply(t, f.idx, "a", evA)
	redisApply(t, other, "b", evB) // b repairs the shared block a overwrote
	outA := redisLookup(t, other, keysA, "a", "b")
	outB := redisLookup(t, other, keysB, "a", "b")
	if outA[0].Blocks != 2 || outA[1].Blocks != 1 || outB[0].Blocks != 1 || outB[1].Blocks != 2 {
		t.Fatalf("after recovery: a's chain %+v, b's chain %+v", outA, outB)
	}
}

// A router of another block-key version (prefixkey.KeySpace) sharing the server during an upgrade:
// its entries, under KeyPrefix without this version's tag (as version 1 wrote them), are neither
// read nor counted, and Clear removes them with the rest.
func TestOtherKeySpaceIsNotRead(t *testing.T) {
	f := newRedisFixture(t, Config{})
	ctx := context.Background()
	tokens := redisTokens(21, 2*16)
	keys := redisReqKeys(tokens, 16)
	redisApply(t, f.idx, "a", redisStored([]uint64{1, 2}, 0, false, tokens, 16, events.TierGPU))
	if out := redisLookup(t, f.idx, keys, "a"); out[0].Blocks != 2 {
		t.Fatalf("before the move: %+v", out)
	}
	// Move every entry to the untagged layout: what another version's router would have written.
	moved := 0
	var cursor uint64
	for {
		e, err := f.client.Do(ctx, f.client.B().Scan().Cursor(cursor).Match(f.prefix+keySpaceTag+"*").Count(1000).Build()).AsScanEntry()
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range e.Elements {
			old := f.prefix + strings.TrimPrefix(k, f.prefix+keySpaceTag)
			if err := f.client.Do(ctx, f.client.B().Rename().Key(k).Newkey(old).Build()).Error(); err != nil {
				t.Fatal(err)
			}
			moved++
		}
		if cursor = e.Cursor; cursor == 0 {
			break
		}
	}
	if moved < 2 {
		t.Fatalf("moved %d keys, want the blocks and the backend's sets", moved)
	}
	if out := redisLookup(t, f.idx, keys, "a"); out[0].Blocks != 0 {
		t.Errorf("another key space's blocks were read: %+v", out)
	}
	if s, err := f.idx.Stats(ctx); err != nil || s.Entries != 0 {
		t.Errorf("another key space's entries were counted: %+v, %v", s, err)
	}
	if _, err := f.idx.Clear(ctx); err != nil {
		t.Fatal(err)
	}
	if left := redisCountKeys(t, f.client, f.prefix); left != 4 { // ids, seen, idseq, epoch
		t.Errorf("%d keys left under the prefix after Clear, want the 4 of the id registry", left)
	}
}
