package respcache_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/respcache"
)

// Serve a repeated deterministic request from a MemoryStore: parse, check eligibility, key, look up.
func Example() {
	ctx := context.Background()
	store, err := respcache.NewMemory(respcache.MemoryConfig{Capacity: 5000, DefaultTTL: 30 * time.Minute})
	if err != nil {
		panic(err)
	}
	body := []byte(`{"model":"gpt-4o","temperature":0,"messages":[{"role":"user","content":"2+2?"}]}`)
	for range 2 {
		req, err := prefixkey.ParseOpenAIChat(body)
		if err != nil {
			panic(err)
		}
		req.Tenant = "acme" // tenants never share entries (the middleware sets it: see Config.Tenant)
		if ok, reason := respcache.Eligible(req); !ok {
			fmt.Println("BYPASS:", reason)
			continue
		}
		key := respcache.KeyOf(req).String()
		if resp, ok, _ := store.Get(ctx, key); ok {
			fmt.Printf("HIT: %s\n", resp)
			continue
		}
		resp := []byte(`{"choices":[{"message":{"content":"4"}}]}`) // from a backend
		fmt.Println("MISS")
		_ = store.Set(ctx, key, resp, 0) // 0: the store's default TTL
	}
	// Output:
	// MISS
	// HIT: {"choices":[{"message":{"content":"4"}}]}
}

// KeyOf ignores JSON key order but not values; an absent temperature differs from 0.
func ExampleKeyOf() {
	key := func(body string) respcache.Key {
		req, err := prefixkey.ParseOpenAIChat([]byte(body))
		if err != nil {
			panic(err)
		}
		return respcache.KeyOf(req)
	}
	a := key(`{"model":"m","temperature":0,"messages":[{"role":"user","content":"hi"}]}`)
	b := key(`{"messages":[{"content":"hi","role":"user"}],"temperature":0,"model":"m"}`)
	c := key(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	fmt.Println(a == b, a == c)
	fmt.Println(a)
	// Output:
	// true false
	// 34b49b14c18b0af1356ee5207ca5e046dd77f1575de5d621dcda753b037316aa
}

// A Policy decides what is cached; its reasons are metric labels.
func ExamplePolicy() {
	p := respcache.Policy{CacheStreaming: true, MaxResponseSize: 64 << 10}
	req := &prefixkey.Request{Model: "m", Params: prefixkey.Params{Temperature: prefixkey.Some(0.7)}}
	show := func(ok bool, reason string) { fmt.Printf("%v %q\n", ok, reason) }
	show(p.Request(req))
	req.Params.Temperature = prefixkey.Some(0.0)
	show(p.Request(req))
	req.Params.Temperature = prefixkey.Opt[float64]{} // absent: the providers sample at 1
	show(p.Request(req))
	p.AssumeGreedyDefault = true // a fleet that decodes greedily by default
	show(p.Request(req))
	show(p.CheckResponse(200, 100<<10, false))
	show(p.CheckResponse(200, 100<<10, true))
	show(p.CheckResponse(502, 10, false))
	// Output:
	// false "temperature"
	// true ""
	// false "temperature"
	// true ""
	// false "too_large"
	// true ""
	// false "status"
}

// A MemoryStore is an LRU with a TTL per entry; the clock is injectable.
func ExampleNewMemory() {
	ctx := context.Background()
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	store, err := respcache.NewMemory(respcache.MemoryConfig{
		Capacity: 2,
		Now:      func() time.Time { return now },
	})
	if err != nil {
		panic(err)
	}
	_ = store.Set(ctx, "a", []byte("A"), time.Minute)
	_ = store.Set(ctx, "b", []byte("B"), time.Hour)
	_ = store.Set(ctx, "c", []byte("C"), time.Hour) // evicts "a", the least recently used
	now = now.Add(2 * time.Hour)                    // "b" and "c" expire
	_, ok, _ := store.Get(ctx, "c")
	st := store.Stats(ctx)
	fmt.Println(ok, st.Entries, st.Evictions, st.Misses)
	// Output:
	// false 1 1 1
}

// By default the middleware keeps tenants apart by their credentials; a gateway that authenticates
// callers itself names the tenant by a header instead.
func ExampleHeaderTenant() {
	cache, err := respcache.New(respcache.Config{Tenant: respcache.HeaderTenant("X-Tenant-Id")})
	if err != nil {
		panic(err)
	}
	defer cache.Close()
	backend := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"message":{"content":"4"}}]}`)
	})
	h := cache.Middleware(backend)
	body := `{"model":"m","temperature":0,"messages":[{"role":"user","content":"2+2?"}]}`
	for _, tenant := range []string{"acme", "globex", "acme"} {
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
		r.Header.Set("X-Tenant-Id", tenant)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		fmt.Println(tenant, w.Header().Get(respcache.HeaderXCache))
	}
	// Output:
	// acme MISS
	// globex MISS
	// acme HIT
}
