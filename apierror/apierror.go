// Package apierror writes a gateway's own errors in the style of the API the request came in on,
// so that the official OpenAI and Anthropic SDKs read them as they read the providers' errors:
//
//	OpenAI     {"error":{"message":"…","type":"invalid_request_error","param":"messages","code":null}}
//	Anthropic  {"type":"error","error":{"type":"invalid_request_error","message":"…"}}
//
// The OpenAI type is invalid_request_error below 500 and server_error from 500; the Anthropic
// type is request_too_large for 413, overloaded_error for 503, api_error for other 5xx and
// invalid_request_error otherwise.
package apierror

import (
	"encoding/json"
	"net/http"

	"github.com/kvroute/kvroute/prefixkey"
)

// Write answers with status and an error body in format's style (OpenAI's for any format but
// Anthropic messages, the zero Format included). code is the OpenAI "code" (left
// null when it is "" or invalid_request_error); param the OpenAI "param", the request field at
// fault (null when ""); msg the message, for people. Write drops a Content-Length the handler may
// have set and sets Content-Type and X-Content-Type-Options: nosniff.
func Write(w http.ResponseWriter, format prefixkey.Format, status int, code, param, msg string) {
	h := w.Header()
	h.Del("Content-Length")
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(Body(format, status, code, param, msg))
}

// Body returns the error body Write writes, for a gateway that sends it otherwise.
func Body(format prefixkey.Format, status int, code, param, msg string) any {
	if format == prefixkey.FormatAnthropicMessages {
		typ := "invalid_request_error"
		switch {
		case status == http.StatusRequestEntityTooLarge:
			typ = "request_too_large"
		case status == http.StatusServiceUnavailable:
			typ = "overloaded_error"
		case status >= 500:
			typ = "api_error"
		}
		return anthropicBody{Type: "error", Error: anthropicError{Type: typ, Message: msg}}
	}
	e := openAIError{Message: msg, Type: "invalid_request_error"}
	if status >= 500 {
		e.Type = "server_error"
	}
	if param != "" {
		e.Param = &param
	}
	if code != "" && code != "invalid_request_error" {
		e.Code = &code
	}
	return openAIBody{Error: e}
}

type openAIBody struct {
	Error openAIError `json:"error"`
}

type openAIError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

type anthropicBody struct {
	Type  string         `json:"type"`
	Error anthropicError `json:"error"`
}

type anthropicError struct {
	Type    string `json:"type"`
	Message string `json:"message"`
}
