package kvroute_test

import (
	"context"
	"fmt"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/prefixkey"
)

// A gateway parses the body, routes, forwards to the chosen backend and reports the outcome.
func ExampleDefaultRouter_Route() {
	router, err := kvroute.New(kvroute.Config{
		Backends: []kvroute.Backend{{Name: "vllm-1"}, {Name: "vllm-2"}, {Name: "vllm-3"}},
	})
	if err != nil {
		panic(err)
	}
	defer router.Close()

	body := []byte(`{"model":"llama-3-8b","messages":[
		{"role":"system","content":"You are the ACME support assistant."},
		{"role":"user","content":"Where is my order?"}]}`)
	req, err := prefixkey.ParseOpenAIChat(body)
	if err != nil {
		panic(err) // a gateway answers 400 here
	}
	d, err := router.Route(context.Background(), req)
	if err != nil {
		panic(err) // ErrNoBackend: a gateway answers 503
	}
	// … forward body to d.Backend …
	d.Done(kvroute.Outcome{})

	// A second request with the same system prompt meets the same, now warm, backend.
	req2, _ := prefixkey.ParseOpenAIChat([]byte(`{"model":"llama-3-8b","messages":[
		{"role":"system","content":"You are the ACME support assistant."},
		{"role":"user","content":"Can I change my address?"}]}`))
	d2, _ := router.Route(context.Background(), req2)
	defer d2.Done(kvroute.Outcome{})
	fmt.Println(d.Reason, d2.Reason, d.Backend == d2.Backend)
	// Output: prefix_hash prefix_hash true
}
