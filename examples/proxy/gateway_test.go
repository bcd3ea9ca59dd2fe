package main

import (
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/config"
)

// A request with both Content-Length and Transfer-Encoding is refused with 400 and the
// connection closed: a request pipelined behind it is never served.
func TestSmuggledRequestRefused(t *testing.T) {
	up := newFakeUpstream(t, "a")
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, nil))
	body := chatBody("system", "hi", "")
	chunked := "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
		"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n" + fwdChunk(body) + "0\r\n\r\n" +
		"GET /admin/kv-index/stats HTTP/1.1\r\nHost: x\r\n\r\n"
	c, br := dialRaw(t, strings.TrimPrefix(p.URL, "http://"))
	if _, err := io.WriteString(c, chunked); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusBadRequest || !resp.Close || !strings.Contains(string(b), "Content-Length") {
		t.Fatalf("got %d close=%v %s; want 400 and the connection closed", resp.StatusCode, resp.Close, b)
	}
	if n, err := br.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
		t.Errorf("the connection stayed open (read %d, %v): the pipelined request may be served", n, err)
	}
	if up.requests.Load() != 0 {
		t.Error("the refused request reached the backend")
	}
}

// GET /v1/models lists the union of the backends' models, by id, in the OpenAI list shape; a
// backend that cannot answer contributes its configured models.
func TestModels(t *testing.T) {
	list := func(ids ...string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/v1/models" {
				http.NotFound(w, r)
				return
			}
			var data []map[string]any
			for _, id := range ids {
				data = append(data, map[string]any{"id": id, "object": "model", "owned_by": "vllm"})
			}
			_ = json.NewEncoder(w).Encode(map[string]any{"object": "list", "data": data})
		}
	}
	a := httptest.NewServer(list("llama", "llama-lora"))
	defer a.Close()
	b := httptest.NewServer(list("llama", "qwen"))
	defer b.Close()
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: a.URL}, {Name: "b", URL: b.URL},
		{Name: "dead", URL: deadURL(t), Model: "mistral"}}, nil))
	var got struct {
		Object string `json:"object"`
		Data   []struct {
			ID      string `json:"id"`
			Object  string `json:"object"`
			OwnedBy string `json:"owned_by"`
		} `json:"data"`
	}
	if code := getJSON(t, p.URL+"/v1/models", &got); code != http.StatusOK {
		t.Fatalf("status %d", code)
	}
	var ids []string
	for _, m := range got.Data {
		ids = append(ids, m.ID)
		if m.Object != "model" {
			t.Errorf("%s: object %q", m.ID, m.Object)
		}
	}
	if want := "llama,llama-lora,qwen,mistral"; got.Object != "list" || strings.Join(ids, ",") != want {
		t.Errorf("got %s %v; want list %s", got.Object, ids, want)
	}
	var one struct {
		ID string `json:"id"`
	}
	if code := getJSON(t, p.URL+"/v1/models/qwen", &one); code != http.StatusOK || one.ID != "qwen" {
		t.Errorf("GET /v1/models/qwen: %d %+v", code, one)
	}
	if code := getJSON(t, p.URL+"/v1/models/nope", nil); code != http.StatusNotFound {
		t.Errorf("GET /v1/models/nope: %d", code)
	}
}

// Model ids contain slashes (meta-llama/Llama-3.1-8B-Instruct, the demo's own): GET
// /v1/models/{id} answers the model whether the slash comes as it is or escaped, and an unknown id,
// with a slash or not, gets the OpenAI error body with 404 model_not_found, never net/http's
// plain-text 404.
func TestModelIDWithSlash(t *testing.T) {
	const id = "meta-llama/Llama-3.1-8B-Instruct"
	// Backends that do not answer contribute their configured models.
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: deadURL(t), Model: id}, {Name: "b", URL: deadURL(t), Model: "qwen"}}, nil))
	for _, tc := range []struct {
		name, path string
		code       int
		id         string // the answered model's id; "" for the error
	}{
		{"slash", "/v1/models/" + id, http.StatusOK, id},
		{"escaped slash", "/v1/models/meta-llama%2FLlama-3.1-8B-Instruct", http.StatusOK, id},
		{"no slash", "/v1/models/qwen", http.StatusOK, "qwen"},
		{"unknown with a slash", "/v1/models/meta-llama/nope", http.StatusNotFound, ""},
		{"unknown", "/v1/models/nope", http.StatusNotFound, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := httpClient.Get(p.URL + tc.path)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			var got struct {
				ID    string `json:"id"`
				Error *struct {
					Type  string `json:"type"`
					Code  string `json:"code"`
					Param string `json:"param"`
				} `json:"error"`
			}
			if err := json.NewDecoder(resp.Body).Decode(&got); err != nil {
				t.Fatalf("%d %s: not JSON: %v", resp.StatusCode, resp.Header.Get("Content-Type"), err)
			}
			if resp.StatusCode != tc.code || resp.Header.Get("Content-Type") != "application/json" {
				t.Fatalf("%d %s, want %d application/json", resp.StatusCode, resp.Header.Get("Content-Type"), tc.code)
			}
			if tc.id != "" {
				if got.ID != tc.id || got.Error != nil {
					t.Errorf("got %+v, want the model %s", got, tc.id)
				}
				return
			}
			if got.Error == nil || got.Error.Code != "model_not_found" || got.Error.Type != "invalid_request_error" || got.Error.Param != "model" {
				t.Errorf("error body %+v, want model_not_found", got.Error)
			}
		})
	}
}

// The /v1 endpoints the proxy does not route by prompt go to a backend that serves the request's
// model, with the body and query as they came; an unknown model is 404.
func TestPassthrough(t *testing.T) {
	type seen struct{ path, query, body string }
	rec := func(name string, got chan<- seen) *httptest.Server {
		s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			got <- seen{r.URL.Path, r.URL.RawQuery, string(b)}
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"object":"list","served_by":"`+name+`"}`)
		}))
		t.Cleanup(s.Close)
		return s
	}
	gotA, gotB := make(chan seen, 8), make(chan seen, 8)
	a, b := rec("a", gotA), rec("b", gotB)
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: a.URL, Model: "chat"},
		{Name: "b", URL: b.URL, Model: "embed"}}, nil))

	const body = `{"model":"embed","input":["hello"]}`
	resp, rb := post(t, p.URL+"/v1/embeddings?x=1", body)
	if resp.StatusCode != http.StatusOK || resp.Header.Get(HeaderBackend) != "b" || resp.Header.Get(HeaderRoute) != RoutePassthrough {
		t.Fatalf("got %d %q %q %s", resp.StatusCode, resp.Header.Get(HeaderBackend), resp.Header.Get(HeaderRoute), rb)
	}
	select {
	case s := <-gotB:
		if s.path != "/v1/embeddings" || s.query != "x=1" || s.body != body {
			t.Errorf("backend b got %+v", s)
		}
	case <-time.After(testIOTimeout):
		t.Fatal("backend b got nothing")
	}

	resp, rb = post(t, p.URL+"/v1/embeddings", `{"model":"nope","input":"x"}`)
	var eb errorBody
	if err := json.Unmarshal(rb, &eb); resp.StatusCode != http.StatusNotFound || err != nil || eb.Error == nil ||
		eb.Error.Code == nil || *eb.Error.Code != "model_not_found" {
		t.Errorf("unknown model: %d %s", resp.StatusCode, rb)
	}
	if len(gotA) != 0 {
		t.Errorf("backend a, which serves another model, got %d requests", len(gotA))
	}
	// A request that names no model goes to any backend.
	if resp, b := post(t, p.URL+"/v1/tokenize", `{"prompt":"hi"}`); resp.StatusCode != http.StatusOK {
		t.Errorf("no model: %d %s", resp.StatusCode, b)
	}
}

// A 503 tells the client when to come back.
func TestRetryAfterOn503(t *testing.T) {
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: deadURL(t)}}, func(c *config.Config) {
		c.CircuitBreaker.FailureThreshold = 1
		c.CircuitBreaker.RecoveryTimeout = config.Duration(7 * time.Second)
	}))
	// The first request fails (502) and opens the circuit; the next finds no backend.
	resp, _ := post(t, p.URL+"/v1/chat/completions", chatBody("s", "u", ""))
	if resp.StatusCode != http.StatusBadGateway {
		t.Fatalf("first request: %d", resp.StatusCode)
	}
	resp, b := post(t, p.URL+"/v1/chat/completions", chatBody("s", "u", ""))
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "7" {
		t.Errorf("got %d, Retry-After %q, %s; want 503 with Retry-After 7", resp.StatusCode, resp.Header.Get("Retry-After"), b)
	}
	resp, _ = post(t, p.URL+"/v1/embeddings", `{"model":"m","input":"x"}`)
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "7" {
		t.Errorf("passthrough: %d, Retry-After %q", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
}

// The banner promises a response-cache hit only when the response cache is on.
func TestBannerCacheHint(t *testing.T) {
	addr := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 8080}
	for _, on := range []bool{false, true} {
		cfg := fakeConfig(t, []config.BackendConfig{{Name: "a", URL: "http://127.0.0.1:1"}}, func(c *config.Config) {
			c.ResponseCache.Enabled = on
		})
		var b strings.Builder
		printBanner(&b, cfg, addr, false)
		if got := strings.Contains(b.String(), "X-Cache: HIT"); got != on {
			t.Errorf("response cache %v: the banner promises a hit: %v\n%s", on, got, b.String())
		}
	}
}
