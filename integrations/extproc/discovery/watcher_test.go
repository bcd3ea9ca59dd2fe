package discovery

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/kvroute/kvroute/config"
)

// poolName is the name the tests resolve; the final dot keeps the resolver from trying the
// machine's search domains.
const poolName = "vllm.pool.test."

// testConfig parses a configuration whose discovery resolves poolName on port 8000, with extra
// lines appended to the discovery section.
func testConfig(t *testing.T, extra string) *config.Config {
	t.Helper()
	cfg, err := config.Parse([]byte(`
kv_cache_index: {enabled: true}
endpoint_picker:
  discovery:
    dns_name: "`+poolName+`"
    port: 8000
    model: llama
`+extra), nil)
	require.NoError(t, err)
	return cfg
}

// recording is a Membership that records its changes, in order, and refuses those listed in
// refuse (by "add name" or "remove name") until they are taken off the list.
type recording struct {
	mu      sync.Mutex
	calls   []string
	sources map[string][]config.EventSourceConfig
	refuse  map[string]bool
}

func newRecording() *recording {
	return &recording{sources: map[string][]config.EventSourceConfig{}, refuse: map[string]bool{}}
}

func (r *recording) AddBackend(b config.BackendConfig, sources []config.EventSourceConfig) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	call := "add " + b.Name
	if r.refuse[call] {
		return errors.New("refused")
	}
	r.calls = append(r.calls, call)
	r.sources[b.Name] = sources
	return nil
}

func (r *recording) RemoveBackend(name string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	call := "remove " + name
	if r.refuse[call] {
		return errors.New("refused")
	}
	r.calls = append(r.calls, call)
	return nil
}

func (r *recording) setRefuse(call string, on bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.refuse[call] = on
}

// take returns the calls recorded since the last take.
func (r *recording) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.calls
	r.calls = nil
	return out
}

func newWatcher(t *testing.T, cfg *config.Config, m Membership, dns *dnsServer, o Options) *Watcher {
	t.Helper()
	o.Resolver = dns.resolver()
	w, err := New(cfg, m, o)
	require.NoError(t, err)
	t.Cleanup(w.Close)
	return w
}

// Added addresses are added, vanished ones removed; addresses are deduplicated and sorted, IPv6
// ones bracketed, and each endpoint gets its engine's event sources from the templates.
func TestSyncAddsAndRemoves(t *testing.T) {
	dns := newDNSServer(t)
	dns.set(poolName, "10.0.0.2", "10.0.0.10", "10.0.0.2", "fd00::1")
	cfg := testConfig(t, "    zmq_endpoint: tcp://{ip}:5557\n")
	rec := newRecording()
	w := newWatcher(t, cfg, rec, dns, Options{})

	require.NoError(t, w.Sync(t.Context()))
	assert.Equal(t, []string{"add 10.0.0.2:8000", "add 10.0.0.10:8000", "add [fd00::1]:8000"}, rec.take())
	assert.Equal(t, []string{"10.0.0.2:8000", "10.0.0.10:8000", "[fd00::1]:8000"}, w.Endpoints())
	assert.Equal(t, []config.EventSourceConfig{{BackendName: "[fd00::1]:8000", Endpoint: "tcp://[fd00::1]:5557", Model: "llama"}},
		rec.sources["[fd00::1]:8000"])

	// The same answer changes nothing.
	require.NoError(t, w.Sync(t.Context()))
	assert.Empty(t, rec.take())

	dns.set(poolName, "10.0.0.3", "10.0.0.2")
	require.NoError(t, w.Sync(t.Context()))
	assert.Equal(t, []string{"remove 10.0.0.10:8000", "remove [fd00::1]:8000", "add 10.0.0.3:8000"}, rec.take())
	assert.Equal(t, []string{"10.0.0.2:8000", "10.0.0.3:8000"}, w.Endpoints())

	st := w.Stats()
	assert.Equal(t, uint64(3), st.Resolves)
	assert.Equal(t, uint64(0), st.Failures)
	assert.Equal(t, uint64(4), st.Added)
	assert.Equal(t, uint64(2), st.Removed)
	assert.Equal(t, 2, st.Endpoints)
	assert.Equal(t, "vllm.pool.test.", st.DNSName)
	assert.False(t, st.LastChange.IsZero())
	assert.Empty(t, st.LastError)
}

// A resolver error (SERVFAIL) keeps the last endpoints; it is counted and reported, and the next
// good answer is applied.
func TestResolverErrorKeepsEndpoints(t *testing.T) {
	dns := newDNSServer(t)
	dns.set(poolName, "10.0.0.1", "10.0.0.2")
	rec := newRecording()
	w := newWatcher(t, testConfig(t, ""), rec, dns, Options{})
	require.NoError(t, w.Sync(t.Context()))
	rec.take()

	dns.fail(true)
	for range 3 {
		err := w.Sync(t.Context())
		require.Error(t, err)
		assert.Contains(t, err.Error(), "resolving vllm.pool.test.")
	}
	assert.Empty(t, rec.take(), "a DNS failure changed the membership")
	assert.Equal(t, []string{"10.0.0.1:8000", "10.0.0.2:8000"}, w.Endpoints())
	st := w.Stats()
	assert.Equal(t, uint64(4), st.Resolves)
	assert.Equal(t, uint64(3), st.Failures)
	assert.Contains(t, st.LastError, "resolving vllm.pool.test.")
	assert.False(t, st.LastErrorAt.IsZero())

	// A DNS server that cannot be reached at all is a failure too.
	closed, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	gone := closed.LocalAddr().String()
	closed.Close()
	unreachable := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "udp", gone)
	}}
	wd, err := New(testConfig(t, ""), rec, Options{Resolver: unreachable, ResolveTimeout: 5 * time.Second})
	require.NoError(t, err)
	defer wd.Close()
	require.Error(t, wd.Sync(t.Context()))
	assert.Equal(t, uint64(1), wd.Stats().Failures)
	assert.Empty(t, rec.take())

	// A resolve the caller cancels says nothing about DNS: not counted, nothing changed.
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	require.ErrorIs(t, w.Sync(ctx), context.Canceled)
	assert.Equal(t, uint64(3), w.Stats().Failures)
	assert.Len(t, w.Endpoints(), 2)

	dns.fail(false)
	dns.set(poolName, "10.0.0.2")
	require.NoError(t, w.Sync(t.Context()))
	assert.Equal(t, []string{"remove 10.0.0.1:8000"}, rec.take())
}

// NXDOMAIN and an empty answer remove the endpoints only when the next resolve says the same; an
// answer with addresses in between starts the count again.
func TestEmptyAnswerNeedsConfirmation(t *testing.T) {
	for name, empty := range map[string]func(*dnsServer){
		"NXDOMAIN":     func(s *dnsServer) { s.unset(poolName) },
		"empty answer": func(s *dnsServer) { s.set(poolName) },
	} {
		t.Run(name, func(t *testing.T) {
			dns := newDNSServer(t)
			dns.set(poolName, "10.0.0.1", "10.0.0.2")
			rec := newRecording()
			w := newWatcher(t, testConfig(t, ""), rec, dns, Options{})
			require.NoError(t, w.Sync(t.Context()))
			rec.take()

			empty(dns)
			require.NoError(t, w.Sync(t.Context()))
			assert.Empty(t, rec.take(), "one empty answer removed endpoints")
			assert.Len(t, w.Endpoints(), 2)

			dns.set(poolName, "10.0.0.1", "10.0.0.2")
			require.NoError(t, w.Sync(t.Context()))
			empty(dns)
			require.NoError(t, w.Sync(t.Context()))
			assert.Empty(t, rec.take(), "an empty answer after a full one removed endpoints")

			require.NoError(t, w.Sync(t.Context()))
			assert.Equal(t, []string{"remove 10.0.0.1:8000", "remove 10.0.0.2:8000"}, rec.take())
			assert.Empty(t, w.Endpoints())
			st := w.Stats()
			assert.Equal(t, uint64(3), st.Empty)
			assert.Equal(t, uint64(0), st.Failures)

			// From an empty pool, the first addresses are added at once.
			dns.set(poolName, "10.0.0.3")
			require.NoError(t, w.Sync(t.Context()))
			assert.Equal(t, []string{"add 10.0.0.3:8000"}, rec.take())
		})
	}
}

// A change the Membership refuses is counted, reported by Sync and retried at the next resolve;
// an address whose removal failed is not added back before the removal succeeds.
func TestMembershipErrorsAreRetried(t *testing.T) {
	dns := newDNSServer(t)
	dns.set(poolName, "10.0.0.1", "10.0.0.2")
	rec := newRecording()
	rec.setRefuse("add 10.0.0.2:8000", true)
	w := newWatcher(t, testConfig(t, ""), rec, dns, Options{})

	err := w.Sync(t.Context())
	require.ErrorIs(t, err, ErrMembership)
	assert.Contains(t, err.Error(), "add 10.0.0.2:8000: refused")
	assert.Equal(t, []string{"add 10.0.0.1:8000"}, rec.take())
	assert.Equal(t, []string{"10.0.0.1:8000"}, w.Endpoints())
	assert.Equal(t, uint64(1), w.Stats().MembershipErrors)

	rec.setRefuse("add 10.0.0.2:8000", false)
	require.NoError(t, w.Sync(t.Context()))
	assert.Equal(t, []string{"add 10.0.0.2:8000"}, rec.take())

	// A failed removal is retried first, even when the address is back.
	rec.setRefuse("remove 10.0.0.1:8000", true)
	dns.set(poolName, "10.0.0.2")
	require.ErrorIs(t, w.Sync(t.Context()), ErrMembership)
	assert.Equal(t, []string{"10.0.0.2:8000"}, w.Endpoints())
	assert.Equal(t, 1, w.Stats().Pending)
	dns.set(poolName, "10.0.0.1", "10.0.0.2")
	require.ErrorIs(t, w.Sync(t.Context()), ErrMembership)
	assert.Empty(t, rec.take(), "added back before its removal completed")
	rec.setRefuse("remove 10.0.0.1:8000", false)
	require.NoError(t, w.Sync(t.Context()))
	assert.Equal(t, []string{"remove 10.0.0.1:8000", "add 10.0.0.1:8000"}, rec.take())
	st := w.Stats()
	assert.Equal(t, 0, st.Pending)
	assert.Equal(t, uint64(3), st.MembershipErrors)
	assert.Equal(t, []string{"10.0.0.1:8000", "10.0.0.2:8000"}, w.Endpoints())
}

// More addresses than MaxEndpoints is an error, and the endpoints stay.
func TestTooManyEndpoints(t *testing.T) {
	dns := newDNSServer(t)
	dns.set(poolName, "10.0.0.1")
	rec := newRecording()
	w := newWatcher(t, testConfig(t, ""), rec, dns, Options{MaxEndpoints: 2})
	require.NoError(t, w.Sync(t.Context()))
	rec.take()
	dns.set(poolName, "10.0.0.1", "10.0.0.2", "10.0.0.3")
	err := w.Sync(t.Context())
	require.ErrorIs(t, err, ErrTooManyEndpoints)
	assert.Contains(t, err.Error(), "3 addresses, more than 2")
	assert.Empty(t, rec.take())
	assert.Equal(t, []string{"10.0.0.1:8000"}, w.Endpoints())
	assert.Equal(t, uint64(1), w.Stats().Failures)

	// The default bound is DefaultMaxEndpoints.
	many := make([]netip.Addr, DefaultMaxEndpoints+1)
	for i := range many {
		many[i] = netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)})
	}
	wm, err := New(testConfig(t, ""), newRecording(), Options{Resolver: ResolverFunc(func(context.Context, string, string) ([]netip.Addr, error) {
		return many, nil
	})})
	require.NoError(t, err)
	defer wm.Close()
	require.ErrorIs(t, wm.Sync(t.Context()), ErrTooManyEndpoints)
	many = many[:DefaultMaxEndpoints]
	require.NoError(t, wm.Sync(t.Context()))
	assert.Len(t, wm.Endpoints(), DefaultMaxEndpoints)
}

// Start resolves every interval until Close; after Close, Sync refuses.
func TestStartResolvesEveryInterval(t *testing.T) {
	dns := newDNSServer(t)
	dns.set(poolName, "10.0.0.1")
	rec := newRecording()
	w := newWatcher(t, testConfig(t, "    interval: 1s\n"), rec, dns, Options{})
	require.NoError(t, w.Sync(t.Context()))
	w.Start(t.Context())
	w.Start(t.Context()) // idempotent
	dns.set(poolName, "10.0.0.1", "10.0.0.2")
	require.Eventually(t, func() bool { return len(w.Endpoints()) == 2 }, 30*time.Second, 10*time.Millisecond)
	w.Close()
	w.Close()
	require.ErrorIs(t, w.Sync(t.Context()), ErrClosed)
	n := w.Stats().Resolves
	dns.set(poolName, "10.0.0.3")
	assert.Equal(t, n, w.Stats().Resolves)
	assert.Equal(t, []string{"add 10.0.0.1:8000", "add 10.0.0.2:8000"}, rec.take())
}

func TestNewErrors(t *testing.T) {
	cfg := testConfig(t, "")
	noDisc, err := config.Parse([]byte("backends: [{name: a, url: \"http://127.0.0.1:1\"}]"), nil)
	require.NoError(t, err)
	for name, f := range map[string]func() (*Watcher, error){
		"nil config":      func() (*Watcher, error) { return New(nil, newRecording(), Options{}) },
		"no discovery":    func() (*Watcher, error) { return New(noDisc, newRecording(), Options{}) },
		"nil membership":  func() (*Watcher, error) { return New(cfg, nil, Options{}) },
		"negative max":    func() (*Watcher, error) { return New(cfg, newRecording(), Options{MaxEndpoints: -1}) },
		"negative timout": func() (*Watcher, error) { return New(cfg, newRecording(), Options{ResolveTimeout: -time.Second}) },
	} {
		w, err := f()
		assert.Nil(t, w, name)
		assert.ErrorIs(t, err, ErrInvalidConfig, name)
	}
}

// The Watcher's metrics count resolves by result and show the number of endpoints.
func TestWatcherMetrics(t *testing.T) {
	dns := newDNSServer(t)
	dns.set(poolName, "10.0.0.1", "10.0.0.2")
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	w := newWatcher(t, testConfig(t, ""), newRecording(), dns, Options{MeterProvider: mp})
	require.NoError(t, w.Sync(t.Context()))
	dns.fail(true)
	require.Error(t, w.Sync(t.Context()))

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(t.Context(), &rm))
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					for _, kv := range p.Attributes.ToSlice() {
						got[m.Name+"/"+string(kv.Value.AsString())] = p.Value
					}
				}
			case metricdata.Gauge[int64]:
				for _, p := range d.DataPoints {
					got[m.Name] = p.Value
				}
			}
		}
	}
	assert.Equal(t, map[string]int64{MetricResolves + "/ok": 1, MetricResolves + "/error": 1, MetricEndpoints: 2}, got)
}

// Sync, Start's loop, Endpoints and Stats at once: run with -race.
func TestWatcherConcurrentUse(t *testing.T) {
	dns := newDNSServer(t)
	rec := newRecording()
	w := newWatcher(t, testConfig(t, "    interval: 1s\n"), rec, dns, Options{})
	w.Start(t.Context())
	var wg sync.WaitGroup
	for g := range 3 {
		wg.Go(func() {
			for i := range 10 {
				addrs := []string{fmt.Sprintf("10.0.%d.%d", g, i%3), "10.9.9.9"}
				dns.set(poolName, addrs...)
				_ = w.Sync(t.Context())
				_ = w.Endpoints()
				_ = w.Stats()
			}
		})
	}
	wg.Wait()
	dns.set(poolName, "10.9.9.9")
	require.NoError(t, w.Sync(t.Context()))
	assert.Equal(t, []string{"10.9.9.9:8000"}, w.Endpoints())
	// Every endpoint added was removed but the survivor, whatever the interleaving.
	adds, removes := 0, 0
	for _, c := range rec.take() {
		if strings.HasPrefix(c, "add ") {
			adds++
		} else {
			removes++
		}
	}
	assert.Equal(t, adds-1, removes)
	assert.True(t, slices.Contains(w.Endpoints(), "10.9.9.9:8000"))
}
