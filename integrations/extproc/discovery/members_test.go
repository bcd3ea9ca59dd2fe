package discovery

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/health"
	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

// engines serves a health endpoint on 127.0.0.1 and 127.0.0.2 with the same port, as two pods of
// a pool serve on theirs, and counts each one's probes.
type engines struct {
	port   int
	probes [2]atomic.Int32
}

func newEngines(t *testing.T) *engines {
	t.Helper()
	e := &engines{}
	l1, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	e.port = l1.Addr().(*net.TCPAddr).Port
	l2, err := net.Listen("tcp", "127.0.0.2:"+strconv.Itoa(e.port))
	if err != nil {
		l1.Close()
		testenv.SkipOrFail(t, "no second loopback address 127.0.0.2 with the port of 127.0.0.1 free: "+err.Error())
	}
	for i, l := range []net.Listener{l1, l2} {
		srv := &http.Server{Handler: http.HandlerFunc(func(http.ResponseWriter, *http.Request) { e.probes[i].Add(1) })}
		go func() { _ = srv.Serve(l) }()
		t.Cleanup(func() { _ = srv.Close() })
	}
	return e
}

func (e *engines) name(i int) string {
	return "127.0.0." + strconv.Itoa(i+1) + ":" + strconv.Itoa(e.port)
}

// consumers stands in for the engines' KV-event consumers: Start records the sources; the stop
// function delivers one last batch to the index before it returns, as a consumer draining its
// socket may, so that a removal that cleared the index before stopping the consumer would leave
// blocks behind.
type consumers struct {
	ix *kvindex.MemoryIndex

	mu      sync.Mutex
	started map[string][]config.EventSourceConfig
	stopped []string
}

func (c *consumers) Start(sources []config.EventSourceConfig) (func() error, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	name := sources[0].BackendName
	c.started[name] = sources
	return func() error {
		c.mu.Lock()
		c.stopped = append(c.stopped, name)
		c.mu.Unlock()
		return c.ix.Apply(context.Background(), name, storeBatch(90, 91))
	}, nil
}

// prompt is the request whose blocks the pods cache.
var prompt = func() []uint32 {
	out := make([]uint32, 64)
	for i := range out {
		out[i] = uint32(1000 + i)
	}
	return out
}()

// storeBatch is a BlockStored event of the first blocks of prompt, one engine hash each.
func storeBatch(hashes ...uint64) *events.Batch {
	return &events.Batch{Model: "llama", Events: []events.Event{{Kind: events.KindBlockStored, BlockHashes: hashes,
		TokenIDs: prompt[:16*len(hashes)], BlockSize: 16}}}
}

// cachedBlocks returns how many blocks of prompt each backend holds.
func cachedBlocks(t *testing.T, ix *kvindex.MemoryIndex, backends ...string) map[string]int {
	t.Helper()
	keys := (&prefixkey.Request{Model: "llama", TokenIDs: prompt}).BlockKeys(nil, kvindex.DefaultBlockSize)
	matches, err := ix.Lookup(t.Context(), keys, backends, make([]kvindex.Match, len(backends)))
	require.NoError(t, err)
	out := map[string]int{}
	for _, m := range matches {
		out[m.Backend] = m.Blocks
	}
	return out
}

func routerBackends(t *testing.T, r *kvroute.DefaultRouter) map[string]bool {
	t.Helper()
	st, err := r.Stats(t.Context())
	require.NoError(t, err)
	out := map[string]bool{}
	for _, b := range st.Backends {
		out[b.Name] = b.Healthy
	}
	return out
}

func monitorBackends(m *health.Monitor) []string {
	var out []string
	for _, s := range m.Statuses() {
		out = append(out, s.Name)
	}
	return out
}

// Pods found by DNS join the Router, the health Monitor, the metrics targets and get their event
// consumer; a pod that leaves DNS leaves all of them, and its blocks leave the KV index while the
// survivor keeps its own.
func TestMembersFollowDNS(t *testing.T) {
	eng := newEngines(t)
	dns := newDNSServer(t)
	dns.set(poolName, "127.0.0.1", "127.0.0.2")
	cfg, err := config.Parse([]byte(`
backends:
  - {name: static, url: "http://127.0.0.1:1", metrics_url: "http://127.0.0.1:1/prom"}
kv_cache_index: {enabled: true}
engine_metrics: {enabled: true, path: /engine-metrics}
endpoint_picker:
  discovery:
    dns_name: "`+poolName+`"
    port: `+strconv.Itoa(eng.port)+`
    model: llama
    zmq_endpoint: "tcp://{ip}:5557"
    zmq_replay_endpoint: "tcp://{ip}:5558"
`), nil)
	require.NoError(t, err)

	router, err := kvroute.New(kvroute.Config{})
	require.NoError(t, err)
	defer router.Close()
	monitor, err := health.New(health.Config{Target: router, Probe: health.ProbeConfig{UnhealthyThreshold: 1, HealthyThreshold: 1}})
	require.NoError(t, err)
	defer monitor.Close()
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: "llama"})
	require.NoError(t, err)
	defer ix.Close()
	cons := &consumers{ix: ix, started: map[string][]config.EventSourceConfig{}}
	var targets []map[string]string
	members := &Members{Config: cfg, Router: router, Health: monitor, Index: ix, Events: cons.Start,
		Metrics: func(t map[string]string) error { targets = append(targets, t); return nil }}
	w, err := New(cfg, members, Options{Resolver: dns.resolver()})
	require.NoError(t, err)
	defer w.Close()

	pod1, pod2 := eng.name(0), eng.name(1)
	require.NoError(t, w.Sync(t.Context()))
	assert.Equal(t, []string{pod1, pod2}, w.Endpoints())
	assert.Equal(t, map[string]bool{pod1: true, pod2: true}, routerBackends(t, router))
	assert.Equal(t, []string{pod1, pod2}, monitorBackends(monitor))
	assert.Equal(t, []config.EventSourceConfig{{BackendName: pod2, Endpoint: "tcp://127.0.0.2:5557", ReplayEndpoint: "tcp://127.0.0.2:5558",
		Model: "llama"}}, cons.started[pod2])
	require.Len(t, targets, 2, "one target set per change")
	assert.Equal(t, map[string]string{"static": "http://127.0.0.1:1/prom", pod1: "http://" + pod1 + "/engine-metrics",
		pod2: "http://" + pod2 + "/engine-metrics"}, targets[1])
	assert.Equal(t, targets[1], members.MetricsTargets())

	// The Monitor probes the pods at their discovered URLs.
	monitor.Probe(t.Context())
	assert.Equal(t, int32(1), eng.probes[0].Load())
	assert.Equal(t, int32(1), eng.probes[1].Load())

	// Both pods cache the prompt's first blocks.
	require.NoError(t, ix.Apply(t.Context(), pod1, storeBatch(11, 12, 13)))
	require.NoError(t, ix.Apply(t.Context(), pod2, storeBatch(21, 22)))
	require.Equal(t, map[string]int{pod1: 3, pod2: 2}, cachedBlocks(t, ix, pod1, pod2))

	// pod2 leaves the pool.
	dns.set(poolName, "127.0.0.1")
	require.NoError(t, w.Sync(t.Context()))
	assert.Equal(t, []string{pod1}, w.Endpoints())
	assert.Equal(t, map[string]bool{pod1: true}, routerBackends(t, router))
	assert.Equal(t, []string{pod1}, monitorBackends(monitor))
	assert.Equal(t, []string{pod2}, cons.stopped)
	assert.Equal(t, map[string]int{pod1: 3, pod2: 0}, cachedBlocks(t, ix, pod1, pod2), "the removed pod's blocks stayed in the index")
	assert.Equal(t, map[string]string{"static": "http://127.0.0.1:1/prom", pod1: "http://" + pod1 + "/engine-metrics"}, targets[len(targets)-1])
	monitor.Probe(t.Context())
	assert.Equal(t, int32(2), eng.probes[0].Load())
	assert.Equal(t, int32(1), eng.probes[1].Load(), "the removed pod is still probed")

	// It comes back: in rotation again, with a new consumer and an empty index entry.
	dns.set(poolName, "127.0.0.1", "127.0.0.2")
	require.NoError(t, w.Sync(t.Context()))
	assert.Equal(t, map[string]bool{pod1: true, pod2: true}, routerBackends(t, router))
	assert.Equal(t, map[string]int{pod1: 3, pod2: 0}, cachedBlocks(t, ix, pod1, pod2))
	d, err := router.Route(t.Context(), &prefixkey.Request{Model: "llama", TokenIDs: prompt})
	require.NoError(t, err)
	assert.Contains(t, []string{pod1, pod2}, d.Backend)
	d.Done(kvroute.Outcome{})
}

// failingSink is the memory index with a ClearBackend that fails while fail is set, as a remote
// index does while unreachable.
type failingSink struct {
	*kvindex.MemoryIndex
	fail atomic.Bool
}

func (s *failingSink) ClearBackend(ctx context.Context, backend string) error {
	if s.fail.Load() {
		return errors.New("index unreachable")
	}
	return s.MemoryIndex.ClearBackend(ctx, backend)
}

// AddBackend is all or nothing; a removal that fails half-way is completed by the next call.
func TestMembersFailures(t *testing.T) {
	cfg := testConfig(t, "")
	router, err := kvroute.New(kvroute.Config{})
	require.NoError(t, err)
	defer router.Close()
	monitor, err := health.New(health.Config{Target: router})
	require.NoError(t, err)
	defer monitor.Close()
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: "llama"})
	require.NoError(t, err)
	defer ix.Close()
	sink := &failingSink{MemoryIndex: ix}
	startErr := errors.New("no ZMQ")
	var failStart atomic.Bool
	members := &Members{Config: cfg, Router: router, Health: monitor, Index: sink,
		Events: func([]config.EventSourceConfig) (func() error, error) {
			if failStart.Load() {
				return nil, startErr
			}
			return func() error { return nil }, nil
		}}
	b, _ := cfg.DiscoveredBackend("10.0.0.1")
	sources := []config.EventSourceConfig{{BackendName: b.Name, Endpoint: "tcp://10.0.0.1:5557"}}

	// The consumer cannot start: the Router and the Monitor are left as they were.
	failStart.Store(true)
	require.ErrorIs(t, members.AddBackend(b, sources), startErr)
	assert.Empty(t, routerBackends(t, router))
	assert.Empty(t, monitorBackends(monitor))
	failStart.Store(false)

	// The Router already has the name (a static backend): nothing is added.
	require.NoError(t, router.AddBackend(kvroute.Backend{Name: b.Name}))
	require.ErrorIs(t, members.AddBackend(b, sources), kvroute.ErrDuplicateBackend)
	assert.Empty(t, monitorBackends(monitor))
	require.NoError(t, router.RemoveBackend(b.Name))

	require.NoError(t, members.AddBackend(b, sources))
	require.ErrorIs(t, members.AddBackend(b, sources), kvroute.ErrDuplicateBackend)
	require.NoError(t, ix.Apply(t.Context(), b.Name, storeBatch(1, 2)))

	// The index is unreachable: the pod is out of rotation, but its removal is not complete.
	sink.fail.Store(true)
	err = members.RemoveBackend(b.Name)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "index unreachable")
	assert.Empty(t, routerBackends(t, router))
	assert.Empty(t, monitorBackends(monitor))
	assert.Empty(t, members.MetricsTargets())
	assert.Equal(t, map[string]int{b.Name: 2}, cachedBlocks(t, ix, b.Name))
	// Adding it back first completes the removal, which still fails.
	require.Error(t, members.AddBackend(b, sources))
	assert.Empty(t, routerBackends(t, router))

	sink.fail.Store(false)
	require.NoError(t, members.RemoveBackend(b.Name))
	assert.Equal(t, map[string]int{b.Name: 0}, cachedBlocks(t, ix, b.Name))
	require.NoError(t, members.RemoveBackend(b.Name), "removing a name that is gone is not an error")
	require.NoError(t, members.RemoveBackend("never-added"))
	require.NoError(t, members.AddBackend(b, sources))
	assert.Equal(t, map[string]bool{b.Name: true}, routerBackends(t, router))

	// Without Config and Router, Members refuses.
	require.Error(t, (&Members{}).AddBackend(b, nil))
}
