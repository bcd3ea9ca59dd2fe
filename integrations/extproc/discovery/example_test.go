package discovery_test

import (
	"context"
	"fmt"
	"net/netip"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/integrations/extproc/discovery"
)

// printing is a Membership that prints its changes.
type printing struct{}

func (printing) AddBackend(b config.BackendConfig, sources []config.EventSourceConfig) error {
	fmt.Println("add", b.Name, b.URL, sources[0].Endpoint)
	return nil
}

func (printing) RemoveBackend(name string) error {
	fmt.Println("remove", name)
	return nil
}

// A headless Service's pods, found in DNS, become endpoints named ip:port; a pod that leaves the
// answer leaves the membership. In kvroute-epp the Membership is a *discovery.Members and the
// Resolver the system's.
func ExampleWatcher() {
	cfg, err := config.Parse([]byte(`
kv_cache_index: {enabled: true}
endpoint_picker:
  discovery:
    dns_name: vllm-llama.default.svc.cluster.local
    port: 8000
    zmq_endpoint: "tcp://{ip}:5557"
`), nil)
	if err != nil {
		panic(err)
	}
	answers := [][]netip.Addr{
		{netip.MustParseAddr("10.0.0.8"), netip.MustParseAddr("10.0.0.7")},
		{netip.MustParseAddr("10.0.0.8")},
	}
	resolver := discovery.ResolverFunc(func(context.Context, string, string) ([]netip.Addr, error) {
		a := answers[0]
		answers = answers[1:]
		return a, nil
	})
	w, err := discovery.New(cfg, printing{}, discovery.Options{Resolver: resolver})
	if err != nil {
		panic(err)
	}
	defer w.Close()
	ctx := context.Background()
	_ = w.Sync(ctx)
	_ = w.Sync(ctx)
	fmt.Println(w.Endpoints())
	// Output:
	// add 10.0.0.7:8000 http://10.0.0.7:8000 tcp://10.0.0.7:5557
	// add 10.0.0.8:8000 http://10.0.0.8:8000 tcp://10.0.0.8:5557
	// remove 10.0.0.7:8000
	// [10.0.0.8:8000]
}
