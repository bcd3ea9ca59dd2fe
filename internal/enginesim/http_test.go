package enginesim

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func post(t *testing.T, url, body string) (*http.Response, []byte) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp, b
}

func longSystem() string {
	return strings.Repeat("You are a careful assistant that routes requests to warm caches. ", 12)
}

func TestHTTPChatCompletion(t *testing.T) {
	e := newTestEngine(t, Config{})
	srv := httptest.NewServer(e.Handler())
	defer srv.Close()
	body := `{"model":"` + DefaultModel + `","temperature":0,"max_tokens":5,"messages":[{"role":"system","content":"` + longSystem() + `"},{"role":"user","content":"hello"}]}`
	resp, b1 := post(t, srv.URL+"/v1/chat/completions", body)
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b1))
	assert.Equal(t, "application/json", resp.Header.Get("Content-Type"))
	assert.Equal(t, e.Name(), resp.Header.Get(HeaderEngine))

	var r struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Created int64  `json:"created"`
		Model   string `json:"model"`
		Choices []struct {
			Index   int `json:"index"`
			Message struct {
				Role    string `json:"role"`
				Content string `json:"content"`
			} `json:"message"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		Usage struct {
			PromptTokens        int `json:"prompt_tokens"`
			CompletionTokens    int `json:"completion_tokens"`
			TotalTokens         int `json:"total_tokens"`
			PromptTokensDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	require.NoError(t, json.Unmarshal(b1, &r))
	assert.True(t, strings.HasPrefix(r.ID, "chatcmpl-"))
	assert.Equal(t, "chat.completion", r.Object)
	assert.Equal(t, DefaultModel, r.Model)
	require.Len(t, r.Choices, 1)
	assert.Equal(t, "assistant", r.Choices[0].Message.Role)
	assert.Len(t, strings.Fields(r.Choices[0].Message.Content), 5)
	assert.Equal(t, "length", r.Choices[0].FinishReason)
	assert.Equal(t, 5, r.Usage.CompletionTokens)
	assert.Equal(t, r.Usage.PromptTokens+5, r.Usage.TotalTokens)
	assert.Zero(t, r.Usage.PromptTokensDetails.CachedTokens)

	// Same request at temperature 0: same id, created and content; the usage reports the hit.
	_, b2 := post(t, srv.URL+"/v1/chat/completions", body)
	var r2 = r
	require.NoError(t, json.Unmarshal(b2, &r2))
	assert.Equal(t, r.ID, r2.ID)
	assert.Equal(t, r.Created, r2.Created)
	assert.Equal(t, r.Choices, r2.Choices)
	assert.Equal(t, (r.Usage.PromptTokens-1)/16*16, r2.Usage.PromptTokensDetails.CachedTokens)
	assert.Equal(t, b1, bytes.Replace(b2, []byte(`"cached_tokens":`+itoa(r2.Usage.PromptTokensDetails.CachedTokens)), []byte(`"cached_tokens":0`), 1),
		"byte-identical but for cached_tokens")

	// Not at temperature 0: a fresh id each time.
	body3 := strings.Replace(body, `"temperature":0`, `"temperature":0.7`, 1)
	_, b3 := post(t, srv.URL+"/v1/chat/completions", body3)
	_, b4 := post(t, srv.URL+"/v1/chat/completions", body3)
	var r3, r4 struct{ ID string }
	require.NoError(t, json.Unmarshal(b3, &r3))
	require.NoError(t, json.Unmarshal(b4, &r4))
	assert.NotEqual(t, r3.ID, r4.ID)
}

func itoa(n int) string { b, _ := json.Marshal(n); return string(b) }

// sseLines reads a streamed body into its (event, data) pairs.
func sseLines(t *testing.T, body []byte) (names, datas []string) {
	t.Helper()
	sc := bufio.NewScanner(bytes.NewReader(body))
	name := ""
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "event: "):
			name = line[7:]
		case strings.HasPrefix(line, "data: "):
			names, datas = append(names, name), append(datas, line[6:])
			name = ""
		}
	}
	return names, datas
}

func TestHTTPChatStream(t *testing.T) {
	e := newTestEngine(t, Config{})
	srv := httptest.NewServer(e.Handler())
	defer srv.Close()
	body := `{"model":"` + DefaultModel + `","stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":4,"temperature":0,"messages":[{"role":"user","content":"stream please"}]}`
	resp, b := post(t, srv.URL+"/v1/chat/completions", body)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
	_, datas := sseLines(t, b)
	require.Len(t, datas, 1+4+1+1, string(b)) // role, 4 tokens, usage, [DONE]
	assert.Equal(t, "[DONE]", datas[len(datas)-1])
	var content strings.Builder
	var id string
	for i, d := range datas[:len(datas)-1] {
		var c struct {
			ID      string `json:"id"`
			Object  string `json:"object"`
			Choices []struct {
				Delta struct {
					Role    string `json:"role"`
					Content string `json:"content"`
				} `json:"delta"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
			Usage *struct {
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
		}
		require.NoError(t, json.Unmarshal([]byte(d), &c), d)
		assert.Equal(t, "chat.completion.chunk", c.Object)
		if id == "" {
			id = c.ID
		}
		assert.Equal(t, id, c.ID)
		switch {
		case i == 0:
			assert.Equal(t, "assistant", c.Choices[0].Delta.Role)
		case i == len(datas)-2:
			assert.Empty(t, c.Choices)
			require.NotNil(t, c.Usage)
			assert.Equal(t, 4, c.Usage.CompletionTokens)
		default:
			content.WriteString(c.Choices[0].Delta.Content)
			if i == 4 {
				require.NotNil(t, c.Choices[0].FinishReason)
				assert.Equal(t, "length", *c.Choices[0].FinishReason)
			} else {
				assert.Nil(t, c.Choices[0].FinishReason)
			}
		}
	}
	// The streamed content equals the non-streamed one.
	_, nb := post(t, srv.URL+"/v1/chat/completions", strings.Replace(body, `"stream":true,`, "", 1))
	var full struct {
		ID      string `json:"id"`
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
	}
	require.NoError(t, json.Unmarshal(nb, &full))
	assert.Equal(t, full.Choices[0].Message.Content, content.String())
}

func TestHTTPCompletions(t *testing.T) {
	e := newTestEngine(t, Config{OutputTokens: 3})
	srv := httptest.NewServer(e.Handler())
	defer srv.Close()
	resp, b := post(t, srv.URL+"/v1/completions", `{"model":"`+DefaultModel+`","prompt":"Once upon a time there was a router"}`)
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
	var r struct {
		Object  string `json:"object"`
		Choices []struct {
			Text         string `json:"text"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	require.NoError(t, json.Unmarshal(b, &r))
	assert.Equal(t, "text_completion", r.Object)
	assert.Len(t, strings.Fields(r.Choices[0].Text), 3, "Config.OutputTokens without max_tokens")
	assert.Equal(t, "stop", r.Choices[0].FinishReason)

	resp, b = post(t, srv.URL+"/v1/completions", `{"model":"`+DefaultModel+`","prompt":[1,2,3],"stream":true,"max_tokens":2}`)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	_, datas := sseLines(t, b)
	require.Len(t, datas, 3)
	assert.Contains(t, datas[1], `"finish_reason":"length"`)
	assert.Equal(t, "[DONE]", datas[2])
}

func TestHTTPAnthropicMessages(t *testing.T) {
	e := newTestEngine(t, Config{})
	srv := httptest.NewServer(e.Handler())
	defer srv.Close()
	body := `{"model":"` + DefaultModel + `","max_tokens":3,"system":"` + longSystem() + `","messages":[{"role":"user","content":"hi"}]}`
	_, _ = post(t, srv.URL+"/v1/messages", body)
	resp, b := post(t, srv.URL+"/v1/messages", body)
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
	var r struct {
		ID         string `json:"id"`
		Type       string `json:"type"`
		Role       string `json:"role"`
		Content    []struct{ Type, Text string }
		StopReason string `json:"stop_reason"`
		Usage      struct {
			InputTokens          int `json:"input_tokens"`
			CacheReadInputTokens int `json:"cache_read_input_tokens"`
			OutputTokens         int `json:"output_tokens"`
		} `json:"usage"`
	}
	require.NoError(t, json.Unmarshal(b, &r))
	assert.True(t, strings.HasPrefix(r.ID, "msg_"))
	assert.Equal(t, "message", r.Type)
	assert.Equal(t, "assistant", r.Role)
	assert.Equal(t, "text", r.Content[0].Type)
	assert.Equal(t, "max_tokens", r.StopReason)
	assert.Positive(t, r.Usage.CacheReadInputTokens)
	assert.Positive(t, r.Usage.InputTokens)
	assert.Equal(t, 3, r.Usage.OutputTokens)
	assert.Equal(t, resp.Header.Get(HeaderCachedTokens), itoa(r.Usage.CacheReadInputTokens))

	resp, b = post(t, srv.URL+"/v1/messages", strings.Replace(body, `"max_tokens":3,`, `"max_tokens":3,"stream":true,`, 1))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	names, datas := sseLines(t, b)
	assert.Equal(t, []string{"message_start", "content_block_start", "ping", "content_block_delta", "content_block_delta",
		"content_block_delta", "content_block_stop", "message_delta", "message_stop"}, names)
	assert.Contains(t, datas[0], `"cache_read_input_tokens"`)
	assert.Contains(t, datas[7], `"stop_reason":"max_tokens"`)
}

func TestHTTPErrorsAndFaults(t *testing.T) {
	e := newTestEngine(t, Config{MaxModelLen: 64})
	srv := httptest.NewServer(e.Handler())
	defer srv.Close()
	resp, b := post(t, srv.URL+"/v1/chat/completions", `{"model":"other","messages":[{"role":"user","content":"x"}]}`)
	assert.Equal(t, http.StatusNotFound, resp.StatusCode)
	assert.Contains(t, string(b), "does not exist")
	resp, _ = post(t, srv.URL+"/v1/chat/completions", `{"model":`)
	assert.Equal(t, http.StatusBadRequest, resp.StatusCode)
	resp, b = post(t, srv.URL+"/v1/chat/completions", `{"model":"`+DefaultModel+`","max_tokens":100,"messages":[{"role":"user","content":"x"}]}`)
	assert.Equal(t, http.StatusBadRequest, resp.StatusCode)
	assert.Contains(t, string(b), "maximum context length")
	resp, b = post(t, srv.URL+"/v1/messages", `{"model":"other","max_tokens":1,"messages":[{"role":"user","content":"x"}]}`)
	assert.Equal(t, http.StatusNotFound, resp.StatusCode)
	assert.Contains(t, string(b), `"not_found_error"`)

	r, err := http.Get(srv.URL + "/health")
	require.NoError(t, err)
	r.Body.Close()
	assert.Equal(t, http.StatusOK, r.StatusCode)
	e.SetDown(true)
	r, err = http.Get(srv.URL + "/health")
	require.NoError(t, err)
	r.Body.Close()
	assert.Equal(t, http.StatusServiceUnavailable, r.StatusCode)
	e.SetDown(false)
}

func TestHTTPMetrics(t *testing.T) {
	e := newTestEngine(t, Config{Model: "m1"})
	srv := httptest.NewServer(e.Handler())
	defer srv.Close()
	post(t, srv.URL+"/v1/completions", `{"model":"m1","prompt":"`+longSystem()+`"}`)
	post(t, srv.URL+"/v1/completions", `{"model":"m1","prompt":"`+longSystem()+`"}`)
	r, err := http.Get(srv.URL + "/metrics")
	require.NoError(t, err)
	b, _ := io.ReadAll(r.Body)
	r.Body.Close()
	s := e.Stats()
	text := string(b)
	for _, want := range []string{
		`vllm:prefix_cache_hits_total{engine="0",model_name="m1"} ` + itoa(int(s.PrefixCacheHits)),
		`vllm:prefix_cache_queries_total{engine="0",model_name="m1"} ` + itoa(int(s.PrefixCacheQueries)),
		`vllm:num_requests_running{engine="0",model_name="m1"} 0`,
		`vllm:num_requests_waiting{engine="0",model_name="m1"} 0`,
		`vllm:gpu_cache_usage_perc{engine="0",model_name="m1"} 0`,
		"# TYPE vllm:prefix_cache_hits_total counter",
	} {
		assert.Contains(t, text, want)
	}
	assert.Positive(t, s.PrefixCacheHits)
}

func TestHTTPTokenize(t *testing.T) {
	e := newTestEngine(t, Config{MaxModelLen: 1000})
	srv := httptest.NewServer(e.Handler())
	defer srv.Close()
	resp, b := post(t, srv.URL+"/tokenize", `{"prompt":"Hello world"}`)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var r struct {
		Count       int      `json:"count"`
		MaxModelLen int      `json:"max_model_len"`
		Tokens      []uint32 `json:"tokens"`
	}
	require.NoError(t, json.Unmarshal(b, &r))
	assert.Equal(t, append([]uint32{BOS}, Tokenize("Hello world")...), r.Tokens)
	assert.Equal(t, 3, r.Count)
	assert.Equal(t, 1000, r.MaxModelLen)
	_, b = post(t, srv.URL+"/tokenize", `{"prompt":"Hello world","add_special_tokens":false}`)
	require.NoError(t, json.Unmarshal(b, &r))
	assert.Equal(t, Tokenize("Hello world"), r.Tokens)
	_, b = post(t, srv.URL+"/tokenize", `{"messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false}`)
	require.NoError(t, json.Unmarshal(b, &r))
	assert.Equal(t, []uint32{BOS, tokUser, pieceID("\n"), pieceID("hi"), pieceID("\n")}, r.Tokens)
	resp, _ = post(t, srv.URL+"/tokenize", `{}`)
	assert.Equal(t, http.StatusBadRequest, resp.StatusCode)
}
