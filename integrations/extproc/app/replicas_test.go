package app

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/natsync/natstest"
)

// TestReplicasShareDecisions: two kvroute-epp replicas with the replicas section on, over a real
// NATS server, as the reference proxy's replicas: a request in flight at one is in flight at the
// other's Router until it ends.
func TestReplicasShareDecisions(t *testing.T) {
	nats := natstest.Start(t)
	var backends string
	for i := range 2 {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("ok")) }))
		t.Cleanup(srv.Close)
		backends += fmt.Sprintf("  - name: b%d\n    url: %s\n", i, srv.URL)
	}
	apps := map[string]*App{}
	var grpcAddr string
	for _, id := range []string{"a", "b"} {
		yaml := fmt.Sprintf("backends:\n%sreplicas:\n  enabled: true\n  nats_url: %s\n  replica_id: %s\n", backends, nats.URL(), id)
		cfg, err := config.Parse([]byte(yaml), func(string) (string, bool) { return "", false })
		if err != nil {
			t.Fatal(err)
		}
		a, err := New(cfg, Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = a.Close() })
		if err := a.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		apps[id] = a
		if id == "a" {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			h, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			t.Cleanup(cancel)
			go func() { _ = a.Serve(ctx, Listeners{GRPC: ln, Health: h}) }()
			grpcAddr = ln.Addr().String()
		}
	}
	peerInFlight := func() int {
		st, err := apps["b"].Router.Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return st.Peers.InFlight
	}
	s := pickedStream(t, grpcAddr)
	waitFor(t, func() bool { return peerInFlight() == 1 })
	_ = s.CloseSend() // the stream ends: the decision too, at both replicas
	waitFor(t, func() bool { return peerInFlight() == 0 })
}
