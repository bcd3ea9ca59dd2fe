package main

import (
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/internal/enginesim"
	"github.com/kvroute/kvroute/prefixkey"
)

// multimodalBody returns an OpenAI chat body whose only message opens with media (an image_url
// part holding url) followed by a long question about topic, so that the engine caches many
// blocks of it. (The simulated engines tokenize the text only: a new topic gives new blocks.)
func multimodalBody(topic, url, extra string) string {
	content := []map[string]any{
		{"type": "text", "text": "Look at this picture: "},
		{"type": "image_url", "image_url": map[string]string{"url": url}},
		{"type": "text", "text": longSystemPrompt(topic, 200)},
	}
	b, _ := json.Marshal(map[string]any{"model": testModel, "max_tokens": 4,
		"messages": []map[string]any{{"role": "user", "content": content}}})
	if extra != "" {
		b = append(b[:len(b)-1], ","+extra+"}"...)
	}
	return string(b)
}

// anthropicImageBody is multimodalBody for POST /v1/messages with a base64 image source.
func anthropicImageBody(topic, data, extra string) string {
	content := []map[string]any{
		{"type": "text", "text": "Look at this picture: "},
		{"type": "image", "source": map[string]string{"type": "base64", "media_type": "image/png", "data": data}},
		{"type": "text", "text": longSystemPrompt(topic, 200)},
	}
	b, _ := json.Marshal(map[string]any{"model": testModel, "max_tokens": 4,
		"messages": []map[string]any{{"role": "user", "content": content}}})
	if extra != "" {
		b = append(b[:len(b)-1], ","+extra+"}"...)
	}
	return string(b)
}

// predictedHit reports whether the proxy said the chosen backend holds part of the prompt: a
// kv_aware route, or a positive X-Kvroute-Cached-Tokens.
func predictedHit(r *http.Response) bool {
	n, _ := strconv.Atoi(r.Header.Get(HeaderCachedTokens))
	return n > 0 || r.Header.Get(HeaderRoute) == "kv_aware"
}

// awaitAllEvents makes sure the proxy receives every engine's KV events.
func awaitAllEvents(t *testing.T, p *testProxy, f *enginesim.Fleet) {
	t.Helper()
	for _, in := range f.Info() {
		awaitEvents(t, p, in.URL, in.Name, 10*time.Second)
	}
}

// postIndexed sends body to path and waits until the backend that served it has published the KV
// events of its blocks and the proxy has indexed them.
func postIndexed(t *testing.T, p *testProxy, f *enginesim.Fleet, path, body string) *http.Response {
	t.Helper()
	before := map[string]uint64{}
	for _, in := range f.Info() {
		before[in.Name] = indexCreated(t, p, in.Name)
	}
	r, b := post(t, p.URL+path, body)
	if r.StatusCode != 200 {
		t.Fatalf("POST %s: %d %s", path, r.StatusCode, b)
	}
	backend := r.Header.Get(HeaderBackend)
	waitFor(t, 10*time.Second, "the KV events of "+backend, func() bool { return indexCreated(t, p, backend) > before[backend] })
	return r
}

// Two requests that differ only in an image are not cache hits on each other: neither the KV
// index (block keys of the text alone would match the other image's blocks) nor the response
// cache report one; the same image still hits the response cache and sticks to its backend.
func TestMultimodalImagesDoNotShareHits(t *testing.T) {
	f := startFleet(t, 4, true)
	p := startProxy(t, fleetConfig(t, f, nil))
	awaitAllEvents(t, p, f)

	for _, tc := range []struct {
		name, path string
		body       func(topic, img, extra string) string
		a, b       string
	}{
		{"openai url", "/v1/chat/completions", multimodalBody, "https://img.example/cat.png", "https://img.example/dog.png"},
		{"openai data URI", "/v1/chat/completions", multimodalBody, "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAE=", "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAI="},
		{"anthropic base64", "/v1/messages", anthropicImageBody, "iVBORw0KGgoAAAANSUhEUgAAAAE=", "iVBORw0KGgoAAAANSUhEUgAAAAI="},
	} {
		t.Run(tc.name, func(t *testing.T) {
			greedyA, greedyB := tc.body(tc.name, tc.a, `"temperature":0`), tc.body(tc.name, tc.b, `"temperature":0`)
			format := prefixkey.FormatOfPath(tc.path)
			ka, _ := mustParseReq(t, format, greedyA).PrefixKey(0)
			kb, _ := mustParseReq(t, format, greedyB).PrefixKey(0)
			if ka == kb {
				t.Errorf("the two images share prefix key %v", ka)
			}

			ra := postIndexed(t, p, f, tc.path, greedyA)
			if got := ra.Header.Get("X-Cache"); got != "MISS" {
				t.Errorf("image A: X-Cache %q, want MISS", got)
			}
			rb, body := post(t, p.URL+tc.path, greedyB)
			if rb.StatusCode != 200 {
				t.Fatalf("image B: %d %s", rb.StatusCode, body)
			}
			t.Logf("image A: %s %s; image B: %s %s (cached %q)", ra.Header.Get(HeaderBackend), ra.Header.Get(HeaderRoute),
				rb.Header.Get(HeaderBackend), rb.Header.Get(HeaderRoute), rb.Header.Get(HeaderCachedTokens))
			if got := rb.Header.Get("X-Cache"); got == "HIT" {
				t.Errorf("image B answered from image A's cached response")
			}
			if predictedHit(rb) {
				t.Errorf("image B routed as a KV-cache hit on image A's blocks: %s %s, cached tokens %q",
					rb.Header.Get(HeaderBackend), rb.Header.Get(HeaderRoute), rb.Header.Get(HeaderCachedTokens))
			}

			// The same image: a response-cache hit, and by its prefix key to the same backend.
			if again, _ := post(t, p.URL+tc.path, greedyA); again.Header.Get("X-Cache") != "HIT" {
				t.Errorf("image A again: X-Cache %q, want HIT", again.Header.Get("X-Cache"))
			}
			sampled, body := post(t, p.URL+tc.path, tc.body(tc.name, tc.a, `"temperature":0.7`))
			if sampled.StatusCode != 200 {
				t.Fatalf("image A sampled: %d %s", sampled.StatusCode, body)
			}
			if got, want := sampled.Header.Get(HeaderBackend), ra.Header.Get(HeaderBackend); got != want {
				t.Errorf("image A sampled went to %s (%s), want %s", got, sampled.Header.Get(HeaderRoute), want)
			}
		})
	}
}

// Requests with different cache_salt values (vLLM's KV-cache isolation) share neither a cached
// response nor predicted KV-cache blocks, even with identical prompts and temperature 0.
func TestMultimodalCacheSaltIsolates(t *testing.T) {
	f := startFleet(t, 4, true)
	p := startProxy(t, fleetConfig(t, f, nil))
	awaitAllEvents(t, p, f)

	sys := longSystemPrompt("salted tenant", 200)
	salted := func(salt, extra string) string {
		if salt != "" {
			extra = `"cache_salt":"` + salt + `",` + extra
		}
		return chatBody(sys, "What is the refund policy?", strings.TrimSuffix(extra, ","))
	}
	a, b := salted("tenant-a", `"temperature":0,"max_tokens":4`), salted("tenant-b", `"temperature":0,"max_tokens":4`)
	ka, _ := mustParseReq(t, prefixkey.FormatOpenAIChat, a).PrefixKey(0)
	kb, _ := mustParseReq(t, prefixkey.FormatOpenAIChat, b).PrefixKey(0)
	k0, _ := mustParseReq(t, prefixkey.FormatOpenAIChat, salted("", `"temperature":0`)).PrefixKey(0)
	if ka == kb || ka == k0 {
		t.Errorf("prefix keys: tenant-a %v, tenant-b %v, unsalted %v: salts must not share", ka, kb, k0)
	}

	ra := postIndexed(t, p, f, "/v1/chat/completions", a)
	if got := ra.Header.Get("X-Cache"); got != "MISS" {
		t.Errorf("tenant-a: X-Cache %q, want MISS", got)
	}
	rb, body := post(t, p.URL+"/v1/chat/completions", b)
	if rb.StatusCode != 200 {
		t.Fatalf("tenant-b: %d %s", rb.StatusCode, body)
	}
	t.Logf("tenant-a: %s %s; tenant-b: %s %s (cached %q)", ra.Header.Get(HeaderBackend), ra.Header.Get(HeaderRoute),
		rb.Header.Get(HeaderBackend), rb.Header.Get(HeaderRoute), rb.Header.Get(HeaderCachedTokens))
	if got := rb.Header.Get("X-Cache"); got == "HIT" {
		t.Errorf("tenant-b answered from tenant-a's cached response")
	}
	if predictedHit(rb) {
		t.Errorf("tenant-b routed as a KV-cache hit on tenant-a's blocks: %s %s, cached tokens %q",
			rb.Header.Get(HeaderBackend), rb.Header.Get(HeaderRoute), rb.Header.Get(HeaderCachedTokens))
	}
	// (An unsalted request may match: the simulated engines ignore cache_salt and publish the
	// blocks unsalted, where vLLM would put the salt in their extra keys.)
	// The same salt still shares.
	if again, _ := post(t, p.URL+"/v1/chat/completions", a); again.Header.Get("X-Cache") != "HIT" {
		t.Errorf("tenant-a again: X-Cache %q, want HIT", again.Header.Get("X-Cache"))
	}
	// A wrongly typed cache_salt is the client's error.
	bad, body := post(t, p.URL+"/v1/chat/completions", chatBody(sys, "q", `"cache_salt":7`))
	if bad.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "cache_salt") {
		t.Errorf("cache_salt 7: %d %s, want 400 naming cache_salt", bad.StatusCode, body)
	}
}

func mustParseReq(t *testing.T, f prefixkey.Format, body string) *prefixkey.Request {
	t.Helper()
	r, err := prefixkey.Parse(f, []byte(body))
	if err != nil {
		t.Fatalf("%v: %s", err, body)
	}
	return r
}
