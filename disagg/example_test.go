package disagg_test

import (
	"fmt"
	"net/http"

	"github.com/kvroute/kvroute/disagg"
)

func Example() {
	planner, err := disagg.New(disagg.Config{
		DefaultStorage: disagg.ExternalStorage{Endpoint: "http://kv-store:8080", Namespace: "inference/kv-cache"},
	})
	if err != nil {
		panic(err)
	}
	// One snapshot per request: roles, health, phases in flight, and the KV index's answer.
	fleet := func(decode1Cached int, tier disagg.Tier) []disagg.Candidate {
		return []disagg.Candidate{
			{Name: "prefill-1", Role: disagg.RolePrefill, Healthy: true, Health: 1, PrefillLoad: 1},
			{Name: "prefill-2", Role: disagg.RolePrefill, Healthy: true, Health: 1},
			{Name: "decode-1", Role: disagg.RoleDecode, Healthy: true, Health: 1, DecodeLoad: 2,
				CachedTokens: decode1Cached, Tier: tier},
			{Name: "decode-2", Role: disagg.RoleDecode, Healthy: true, Health: 1, DecodeLoad: 1},
			{Name: "unified-fallback", Role: disagg.RoleUnified, Healthy: true, Health: 1},
		}
	}
	for _, c := range []struct {
		cached int
		tier   disagg.Tier
		prompt int
	}{
		{4000, disagg.TierGPU, 4096},     // decode-1 holds the prefix on its GPU
		{4000, disagg.TierStorage, 4096}, // decode-1 offloaded it to the shared storage
		{0, disagg.TierGPU, 4096},        // nothing cached: remote prefill
		{0, disagg.TierGPU, 200},         // short prompt: the decode backend computes it
	} {
		plan, err := planner.Plan(disagg.Input{Candidates: fleet(c.cached, c.tier), PromptTokens: c.prompt})
		if err != nil {
			panic(err) // errors.Is(err, disagg.ErrNoBackend): answer 503
		}
		fmt.Printf("%s/%s prefill=%q decode=%q\n", plan.Path, plan.Reason, plan.Prefill, plan.Decode)
	}

	h := http.Header{}
	disagg.Plan{Path: disagg.PathPrefillThenDecode, Prefill: "prefill-2", Decode: "decode-2"}.SetHeaders(h)
	fmt.Println(h.Get(disagg.HeaderRoutingPath), h.Get(disagg.HeaderPrefillBackend), h.Get(disagg.HeaderDecodeBackend))
	// Output:
	// fast_decode/local_hit prefill="" decode="decode-1"
	// fast_decode/storage_hit prefill="" decode="decode-2"
	// prefill_then_decode/cache_miss prefill="prefill-2" decode="decode-2"
	// fast_decode/short_prompt prefill="" decode="decode-2"
	// prefill_then_decode prefill-2 decode-2
}

// Credentials never appear when a storage location is printed, logged or marshalled.
func ExampleExternalStorage_String() {
	s := disagg.ExternalStorage{Endpoint: "http://kv-store:8080", Namespace: "inference/kv-cache", SecretKey: "s3cr3t"}
	fmt.Println(s)
	// Output: endpoint="http://kv-store:8080" namespace="inference/kv-cache" secret_key=[REDACTED]
}
