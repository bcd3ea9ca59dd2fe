package kvroute_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/prefixkey"
)

// The two-phase flow a gateway runs for each request of a disaggregated fleet.
func ExampleDisaggRouter_Route() {
	router, err := kvroute.New(kvroute.Config{
		Backends: []kvroute.Backend{
			{Name: "prefill-1", Role: disagg.RolePrefill},
			{Name: "decode-1", Role: disagg.RoleDecode, Weight: 2},
			{Name: "decode-2", Role: disagg.RoleDecode, Weight: 2},
			{Name: "unified-fallback"},
		},
		Disagg: &disagg.Config{DefaultStorage: disagg.ExternalStorage{
			Endpoint: "http://kv-store:8080", Namespace: "inference/kv-cache"}},
		// KV: &kvroute.KVConfig{Index: ix, Tokenizer: tok} lets cached prefixes choose fast_decode.
	})
	if err != nil {
		panic(err)
	}
	defer router.Close()
	ctx := context.Background()
	prefill := func(string) error { return errors.New("prefill timed out") } // the gateway's call
	cfg, _ := router.Disagg().Config()                                       // cfg.PrefillTimeout bounds it

	req := &prefixkey.Request{Model: "llama-3-8b", TokenIDs: make([]uint32, 4096)}
	d, err := router.Disagg().Route(ctx, req)
	if err != nil {
		panic(err) // errors.Is(err, kvroute.ErrNoBackend): answer 503
	}
	fmt.Println(d.Plan.Path, d.Plan.Reason, d.Plan.Prefill, cfg.PrefillTimeout)
	if d.Plan.Path == disagg.PathPrefillThenDecode {
		if err := prefill(d.Plan.Prefill); err != nil {
			if d, err = d.PrefillFailed(ctx, err); err != nil {
				panic(err) // fallback to unified is off, or no unified backend is healthy
			}
		} else {
			d.PrefillDone(kvroute.Outcome{})
		}
	}
	h := http.Header{}
	d.Plan.SetHeaders(h) // X-Kvroute-Routing-Path, X-Kvroute-Prefill-Backend, X-Kvroute-Decode-Backend
	fmt.Println(h.Get(disagg.HeaderRoutingPath), h.Get(disagg.HeaderDecodeBackend), d.Plan.Reason)
	// … forward the request to d.Decode and stream the answer …
	d.Done(kvroute.Outcome{})
	st, _ := router.Stats(ctx)
	fmt.Println(st.Disagg.PrefillFailures)
	// Output:
	// prefill_then_decode cache_miss prefill-1 1m0s
	// fallback unified-fallback prefill_failed
	// 1
}
