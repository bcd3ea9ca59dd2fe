package health

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

func TestClassify(t *testing.T) {
	for _, tc := range []struct {
		code int
		body string
		want Answer
	}{
		{200, "ok", AnswerServed},
		{400, "bad", AnswerServed},
		{429, "", AnswerRefused},
		{503, "down", AnswerRefused},
		{502, "", AnswerFailed},
		{504, "", AnswerFailed},
		{500, `{"error":{"message":"Insufficient KV cache capacity"}}`, AnswerRefused},
		{500, `{"error":"CUDA out of memory"}`, AnswerRefused},
		{500, `{"error":"Server is busy, retry later"}`, AnswerRefused},
		{500, `{"error":"division by zero"}`, AnswerServed},
		{500, strings.Repeat("x", 4<<10) + "capacity", AnswerServed}, // past the sniffed prefix
	} {
		res := &http.Response{StatusCode: tc.code, Body: io.NopCloser(strings.NewReader(tc.body))}
		if got := Classify(res); got != tc.want {
			t.Errorf("%d %.40q: %s, want %s", tc.code, tc.body, got, tc.want)
		}
		// The body reaches the client whole, whatever was read of it.
		if b, _ := io.ReadAll(res.Body); string(b) != tc.body {
			t.Errorf("%d: body changed: %d bytes, want %d", tc.code, len(b), len(tc.body))
		}
	}
	if got := Classify(&http.Response{StatusCode: 500, Body: http.NoBody}); got != AnswerServed {
		t.Errorf("500 without a body: %s", got)
	}
}
