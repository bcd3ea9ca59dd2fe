package apierror_test

import (
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/kvroute/kvroute/apierror"
	"github.com/kvroute/kvroute/prefixkey"
)

func TestWrite(t *testing.T) {
	for _, tc := range []struct {
		format            prefixkey.Format
		status            int
		code, param, want string
	}{
		{prefixkey.FormatOpenAIChat, 400, "invalid_request_error", "messages",
			`{"error":{"message":"m","type":"invalid_request_error","param":"messages","code":null}}`},
		{prefixkey.FormatOpenAICompletion, 503, "no_healthy_backend", "",
			`{"error":{"message":"m","type":"server_error","param":null,"code":"no_healthy_backend"}}`},
		{prefixkey.FormatAnthropicMessages, 413, "request_too_large", "",
			`{"type":"error","error":{"type":"request_too_large","message":"m"}}`},
		{prefixkey.FormatAnthropicMessages, 503, "overloaded", "", `{"type":"error","error":{"type":"overloaded_error","message":"m"}}`},
		{prefixkey.FormatAnthropicMessages, 502, "upstream_error", "", `{"type":"error","error":{"type":"api_error","message":"m"}}`},
		{prefixkey.FormatAnthropicMessages, 400, "invalid_request_error", "model",
			`{"type":"error","error":{"type":"invalid_request_error","message":"m"}}`},
	} {
		w := httptest.NewRecorder()
		w.Header().Set("Content-Length", "99")
		apierror.Error{Status: tc.status, Code: tc.code, Param: tc.param, Message: "m"}.Write(w, tc.format)
		assert.Equal(t, tc.status, w.Code)
		assert.JSONEq(t, tc.want, w.Body.String())
		assert.Equal(t, "application/json", w.Header().Get("Content-Type"))
		assert.Equal(t, "nosniff", w.Header().Get("X-Content-Type-Options"))
		assert.Empty(t, w.Header().Get("Content-Length"))
	}
}
