package kvhttp_test

import (
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/kvhttp"
)

// engine starts a stand-in for a vLLM engine that answers every request with usage.
func engine() *httptest.Server {
	return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"message":{"content":"Hi"}}],"usage":{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":8}}}`)
	}))
}

// A net/http gateway on kvroute: the Router, the backends' URLs, one Handler.
func ExampleHandler() {
	e1, e2 := engine(), engine()
	defer e1.Close()
	defer e2.Close()
	u1, _ := url.Parse(e1.URL)
	u2, _ := url.Parse(e2.URL)

	router, err := kvroute.New(kvroute.Config{Backends: []kvroute.Backend{{Name: "vllm-1"}, {Name: "vllm-2"}}})
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()
	mux := http.NewServeMux()
	mux.Handle("POST /v1/", &kvhttp.Handler{Router: router, Backends: map[string]*url.URL{"vllm-1": u1, "vllm-2": u2}})

	gw := httptest.NewServer(mux)
	defer gw.Close()
	body := `{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"hi"}]}`
	for range 2 {
		res, err := http.Post(gw.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			log.Fatal(err)
		}
		res.Body.Close()
		fmt.Println(res.StatusCode, res.Header.Get(kvhttp.HeaderRoute))
	}
	// Output:
	// 200 prefix_hash
	// 200 prefix_hash
}

// Handler.Attempt sees every attempt and its Result: here, the prompt tokens the engine reported
// reusing from its KV cache.
func ExampleHandler_attempt() {
	e := engine()
	defer e.Close()
	u, _ := url.Parse(e.URL)
	router, err := kvroute.New(kvroute.Config{Backends: []kvroute.Backend{{Name: "vllm-1"}}})
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()
	h := &kvhttp.Handler{Router: router, Backends: map[string]*url.URL{"vllm-1": u},
		Attempt: func(r *http.Request, t *kvhttp.Target) (func(kvhttp.Result), error) {
			return func(res kvhttp.Result) {
				fmt.Println(t.Backend, res.Status, "cached tokens:", res.CachedTokens)
			}, nil
		}}

	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("POST", "/v1/chat/completions",
		strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)))
	// Output: vllm-1 200 cached tokens: 8
}
