package enginesim_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"

	"github.com/kvroute/kvroute/internal/enginesim"
	"github.com/kvroute/kvroute/prefixkey"
)

// An engine reports the prefix-cache hit of a request that shares a long system prompt with an
// earlier one.
func ExampleEngine_Generate() {
	e, err := enginesim.New(enginesim.Config{Model: "llama", HashSeed: 1})
	if err != nil {
		panic(err)
	}
	defer e.Close()
	system := strings.Repeat("You are a helpful assistant. ", 20)
	for _, q := range []string{"first question", "second question"} {
		req, _ := prefixkey.ParseOpenAIChat([]byte(fmt.Sprintf(
			`{"model":"llama","max_tokens":8,"messages":[{"role":"system","content":%q},{"role":"user","content":%q}]}`, system, q)))
		res, err := e.Generate(context.Background(), e.InputOf(req))
		if err != nil {
			panic(err)
		}
		fmt.Println(res.PromptTokens, res.CachedTokens)
	}
	// Output:
	// 153 0
	// 153 144
}

// A fleet serves the HTTP API on loopback ports.
func ExampleStartFleet() {
	f, err := enginesim.StartFleet(context.Background(), enginesim.FleetConfig{N: 2, Base: enginesim.Config{Model: "llama"}})
	if err != nil {
		panic(err)
	}
	defer f.Close()
	resp, err := http.Post(f.URLs()[1]+"/tokenize", "application/json", strings.NewReader(`{"prompt":"Hello world"}`))
	if err != nil {
		panic(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	fmt.Println(f.Info()[1].Name, string(body))
	// Output:
	// enginesim-1 {"count":3,"max_model_len":32768,"tokens":[128000,50710,10545],"token_strs":null}
}
