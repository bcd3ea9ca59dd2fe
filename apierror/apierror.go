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

// Error is one error a gateway answers with. It is also an error value (Error returns Message).
type Error struct {
	// Status is the HTTP status code.
	Status int
	// Code is the OpenAI "code", left null when it is "" or invalid_request_error.
	Code string
	// Param is the OpenAI "param", the request field at fault; null when "".
	Param string
	// Message is the message, for people.
	Message string
}

// Error returns e.Message.
func (e Error) Error() string { return e.Message }

// Write answers with e.Status and e's body in format's style (OpenAI's for any format but
// Anthropic messages, the zero Format included). It drops a Content-Length the handler may have
// set and sets Content-Type and X-Content-Type-Options: nosniff.
func (e Error) Write(w http.ResponseWriter, format prefixkey.Format) {
	h := w.Header()
	h.Del("Content-Length")
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(e.Status)
	_ = json.NewEncoder(w).Encode(e.Body(format))
}

// Body returns the error body Write writes, for a gateway that sends it otherwise.
func (e Error) Body(format prefixkey.Format) any {
	status, code, param, msg := e.Status, e.Code, e.Param, e.Message
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
	o := openAIError{Message: msg, Type: "invalid_request_error"}
	if status >= 500 {
		o.Type = "server_error"
	}
	if param != "" {
		o.Param = &param
	}
	if code != "" && code != "invalid_request_error" {
		o.Code = &code
	}
	return openAIBody{Error: o}
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
