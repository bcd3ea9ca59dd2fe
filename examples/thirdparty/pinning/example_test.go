package pinning_test

import (
	"context"
	"fmt"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/prefixkey"

	"example.com/thirdparty/pinning"
)

// Tenant "acme" has replicas of its own; everyone else shares the default Router's fleet.
func Example() {
	shared, err := kvroute.New(kvroute.Config{Backends: []kvroute.Backend{{Name: "shared-1"}, {Name: "shared-2"}}})
	if err != nil {
		panic(err)
	}
	defer shared.Close()
	r, err := pinning.New(pinning.Config{
		Rules: []pinning.Rule{{Tenant: "acme", Backends: []string{"acme-1"}}},
		Next:  shared,
	})
	if err != nil {
		panic(err)
	}
	for _, tenant := range []string{"acme", "globex"} {
		req := &prefixkey.Request{Model: "llama", Tenant: tenant, System: "You are helpful.", HasSystem: true}
		d, err := r.Route(context.Background(), req)
		if err != nil {
			panic(err)
		}
		fmt.Printf("%s → %s (%s)\n", tenant, d.Backend[:len(d.Backend)-2], d.Reason)
		d.Done(kvroute.Outcome{}) // releases the pinned slot, or the default Router's
	}
	fmt.Println("in flight:", r.InFlight())
	// Output:
	// acme → acme (custom)
	// globex → shared (prefix_hash)
	// in flight: 0
}
