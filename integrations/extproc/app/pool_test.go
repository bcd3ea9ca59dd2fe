package app

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"testing"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/integrations/extproc/discovery"
	"github.com/kvroute/kvroute/internal/testenv"
)

// TestDiscoveredPodsJoinAndLeave: the pool's pods come from DNS; they join the Router, the
// picker's endpoints and the health monitor as the name resolves to them, and leave when it no
// longer does.
func TestDiscoveredPodsJoinAndLeave(t *testing.T) {
	// Two engines on one port of two loopback addresses, as two pods of a headless Service.
	first, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		testenv.SkipOrFail(t, "needs the loopback address 127.0.0.2: "+err.Error())
	}
	_, port, _ := net.SplitHostPort(first.Addr().String())
	second, err := net.Listen("tcp", "127.0.0.3:"+port)
	if err != nil {
		first.Close()
		testenv.SkipOrFail(t, "needs 127.0.0.3 on the port of 127.0.0.2: "+err.Error())
	}
	for _, ln := range []net.Listener{first, second} {
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("ok")) })}
		go func() { _ = srv.Serve(ln) }()
		t.Cleanup(func() { _ = srv.Close() })
	}
	var mu sync.Mutex
	answer := []netip.Addr{netip.MustParseAddr("127.0.0.2"), netip.MustParseAddr("127.0.0.3")}
	resolver := discovery.ResolverFunc(func(_ context.Context, _, host string) ([]netip.Addr, error) {
		mu.Lock()
		defer mu.Unlock()
		if host != "vllm.pool.test" {
			return nil, fmt.Errorf("unexpected name %q", host)
		}
		return append([]netip.Addr(nil), answer...), nil
	})
	p, _ := strconv.Atoi(port)
	cfg, err := config.Parse(fmt.Appendf(nil, "endpoint_picker:\n  discovery:\n    dns_name: vllm.pool.test\n    port: %d\n    interval: 1s\n", p),
		func(string) (string, bool) { return "", false })
	if err != nil {
		t.Fatal(err)
	}
	a, err := New(cfg, Options{Resolver: resolver})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close() })
	if err := a.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	want := []string{"127.0.0.2:" + port, "127.0.0.3:" + port}
	if got := a.Endpoints.Backends(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("endpoints after the first resolve: %v, want %v", got, want)
	}
	for _, name := range want {
		if ep, ok := a.Endpoints.Endpoint(name); !ok || ep != name {
			t.Errorf("backend %s has endpoint %q", name, ep)
		}
		if !a.Health.InRotation(name) {
			t.Errorf("%s is not in the health monitor's rotation", name)
		}
	}
	st, err := a.Router.Stats(context.Background())
	if err != nil || len(st.Backends) != 2 {
		t.Fatalf("the Router has %d backends (%v), want 2", len(st.Backends), err)
	}

	mu.Lock()
	answer = answer[:1]
	mu.Unlock()
	waitFor(t, func() bool { return a.Endpoints.Len() == 1 })
	st, err = a.Router.Stats(context.Background())
	if err != nil || len(st.Backends) != 1 || st.Backends[0].Name != want[0] {
		t.Fatalf("after the pod left the Router has %+v (%v), want only %s", st.Backends, err, want[0])
	}
}
