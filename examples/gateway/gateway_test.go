package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute"
)

// Requests sharing a system prompt meet the same backend; a malformed body gets a 400 in the
// OpenAI style; a dead backend gets a 502 and its decision is released as a failure.
func TestGateway(t *testing.T) {
	urls := map[string]*url.URL{}
	var cfg kvroute.Config
	for _, name := range []string{"a", "b", "c"} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(map[string]any{"backend": name, "bytes": len(b)})
		}))
		t.Cleanup(srv.Close)
		urls[name], _ = url.Parse(srv.URL)
		cfg.Backends = append(cfg.Backends, kvroute.Backend{Name: name})
	}
	dead := httptest.NewServer(http.NotFoundHandler())
	urls["dead"], _ = url.Parse(dead.URL)
	dead.Close()
	router, err := kvroute.New(cfg)
	require.NoError(t, err)
	defer router.Close()
	gw := httptest.NewServer(NewGateway(router, urls))
	defer gw.Close()

	post := func(path, body string) (*http.Response, map[string]any) {
		res, err := http.Post(gw.URL+path, "application/json", strings.NewReader(body))
		require.NoError(t, err)
		defer res.Body.Close()
		var doc map[string]any
		require.NoError(t, json.NewDecoder(res.Body).Decode(&doc))
		return res, doc
	}
	chat := func(system, user string) string {
		return `{"model":"m","messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"` + user + `"}]}`
	}
	first, doc := post("/v1/chat/completions", chat("You are the ACME assistant.", "hi"))
	require.Equal(t, 200, first.StatusCode)
	assert.Equal(t, len(chat("You are the ACME assistant.", "hi")), int(doc["bytes"].(float64)), "the body reaches the backend whole")
	for _, q := range []string{"where is my order?", "change my address", "thanks"} {
		res, doc := post("/v1/chat/completions", chat("You are the ACME assistant.", q))
		assert.Equal(t, first.Header.Get("X-Kvroute-Backend"), doc["backend"], "same prefix, same backend")
		assert.Equal(t, doc["backend"], res.Header.Get("X-Kvroute-Backend"))
	}

	res, doc := post("/v1/chat/completions", `{"model":"m","messages":"not a list"}`)
	assert.Equal(t, 400, res.StatusCode)
	assert.Equal(t, "invalid_request_error", doc["error"].(map[string]any)["type"])
	res, doc = post("/v1/messages", `{"model":`)
	assert.Equal(t, 400, res.StatusCode)
	assert.Equal(t, "error", doc["type"], "Anthropic's error style on its endpoint")

	only, err := kvroute.New(kvroute.Config{Backends: []kvroute.Backend{{Name: "dead"}}})
	require.NoError(t, err)
	defer only.Close()
	gw2 := httptest.NewServer(NewGateway(only, urls))
	defer gw2.Close()
	r2, err := http.Post(gw2.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hi"}`))
	require.NoError(t, err)
	r2.Body.Close()
	assert.Equal(t, 502, r2.StatusCode)
	rs, err := only.Stats(context.Background())
	require.NoError(t, err)
	st := rs.Backends[0]
	assert.Zero(t, st.InFlight, "the decision is released")
	assert.Less(t, st.SuccessRate, 1.0, "as a failure")
}
