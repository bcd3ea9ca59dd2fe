package prefixkey

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

// parseCase is a valid body and the Request it parses to.
type parseCase struct {
	name string
	body string
	want *Request
}

func raw(s string) json.RawMessage { return json.RawMessage(s) }

func textMsg(role, text string) Message {
	return Message{Role: role, Text: text, Parts: []Part{{Type: "text", Text: text}}}
}

var openAIChatCases = []parseCase{
	{
		name: "minimal",
		body: `{"model":"gpt-4o","messages":[{"role":"user","content":"Hello"}]}`,
		want: &Request{Format: FormatOpenAIChat, Model: "gpt-4o", Messages: []Message{textMsg("user", "Hello")}},
	},
	{
		name: "empty messages",
		body: `{"model":"m","messages":[]}`,
		want: &Request{Format: FormatOpenAIChat, Model: "m"},
	},
	{
		name: "system and developer joined in order, not in messages",
		body: `{"model":"m","messages":[
			{"role":"system","content":"You are terse."},
			{"role":"user","content":"hi"},
			{"role":"developer","content":[{"type":"text","text":"Use "},{"type":"text","text":"JSON."}],"name":"dev"},
			{"role":"assistant","content":"ok"}]}`,
		want: &Request{Format: FormatOpenAIChat, Model: "m", System: "You are terse.\nUse JSON.", HasSystem: true,
			Messages: []Message{textMsg("user", "hi"), textMsg("assistant", "ok")}},
	},
	{
		name: "empty system prompt is still a system prompt",
		body: `{"model":"m","messages":[{"role":"system","content":""},{"role":"user","content":"x"}]}`,
		want: &Request{Format: FormatOpenAIChat, Model: "m", HasSystem: true, Messages: []Message{textMsg("user", "x")}},
	},
	{
		name: "content parts text and non-text",
		body: `{"model":"m","messages":[{"role":"user","content":[
			{"type":"text","text":"What is "},
			{"image_url":{"url":"https://x/cat.png","detail":"high"},"type":"image_url"},
			{"type":"input_audio","input_audio":{"format":"wav","data":"UklGRg=="}},
			{"type":"file","file":{"file_id":"file-123"}},
			{"type":"text","text":"this?"}]}]}`,
		want: &Request{Format: FormatOpenAIChat, Model: "m", Messages: []Message{{
			Role: "user", Text: "What is this?",
			Parts: []Part{
				{Type: "text", Text: "What is "},
				{Type: "image_url", Data: `{"detail":"high","url":"https://x/cat.png"}`},
				{Type: "input_audio", Data: `{"data":"UklGRg==","format":"wav"}`},
				{Type: "file", Data: `{"file_id":"file-123"}`},
				{Type: "text", Text: "this?"},
			},
		}}, Media: []Media{
			{Kind: MediaImage, Message: 0, Part: 1, Offset: 8, Hash: MediaURLHash("https://x/cat.png")},
			{Kind: MediaAudio, Message: 0, Part: 2, Offset: 8, Hash: MediaDataHash("UklGRg==")},
		}},
	},
	{
		name: "unknown part type keeps the part without type",
		body: `{"model":"m","messages":[{"role":"user","content":[{"type":"video","b":2,"a":1}]}]}`,
		want: &Request{Format: FormatOpenAIChat, Model: "m", Messages: []Message{{
			Role: "user", Parts: []Part{{Type: "video", Data: `{"a":1,"b":2}`}},
		}}},
	},
	{
		name: "assistant refusal part",
		body: `{"model":"m","messages":[{"role":"assistant","content":[{"type":"refusal","refusal":"I can't."}]}]}`,
		want: &Request{Format: FormatOpenAIChat, Model: "m", Messages: []Message{{
			Role: "assistant", Text: "I can't.", Parts: []Part{{Type: "refusal", Text: "I can't."}},
		}}},
	},
	{
		name: "tool calls and tool message extras sorted, nulls dropped",
		body: `{"model":"m","messages":[
			{"role":"user","content":"weather?","name":"alice"},
			{"role":"assistant","content":null,"refusal":null,"tool_calls":[{"type":"function","id":"call_1","function":{"arguments":"{\"city\":\"Paris\"}","name":"get_weather"}}]},
			{"tool_call_id":"call_1","role":"tool","content":"18C"},
			{"role":"assistant"},
			{"role":"function","name":"f","content":"legacy"}]}`,
		want: &Request{Format: FormatOpenAIChat, Model: "m", Messages: []Message{
			{Role: "user", Text: "weather?", Parts: []Part{{Type: "text", Text: "weather?"}}, Extra: raw(`{"name":"alice"}`)},
			{Role: "assistant", Extra: raw(`{"tool_calls":[{"function":{"arguments":"{\"city\":\"Paris\"}","name":"get_weather"},"id":"call_1","type":"function"}]}`)},
			{Role: "tool", Text: "18C", Parts: []Part{{Type: "text", Text: "18C"}}, Extra: raw(`{"tool_call_id":"call_1"}`)},
			{Role: "assistant"},
			{Role: "function", Text: "legacy", Parts: []Part{{Type: "text", Text: "legacy"}}, Extra: raw(`{"name":"f"}`)},
		}},
	},
	{
		name: "all params",
		body: `{"model":"m","messages":[{"role":"user","content":"x"}],
			"temperature":0,"top_p":0.9,"max_tokens":100,"max_completion_tokens":200,"stream":true,"n":2,"seed":-7,
			"stop":["\n\n","END"],"presence_penalty":0.5,"frequency_penalty":-0.5,
			"response_format":{"type":"json_schema","json_schema":{"name":"r","schema":{"type":"object","properties":{"b":{},"a":{}}}}},
			"logit_bias":{"50256":-100,"1":  5},
			"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}],
			"tool_choice":"auto","user":"ignored","metadata":{"x":[1,2,{"y":null}]}}`,
		want: &Request{Format: FormatOpenAIChat, Model: "m", Messages: []Message{textMsg("user", "x")}, Params: Params{
			Temperature: Some(0.0), TopP: Some(0.9), MaxTokens: Some[int64](100), MaxCompletionTokens: Some[int64](200),
			Stream: true, N: Some[int64](2), Seed: Some[int64](-7), Stop: []string{"\n\n", "END"},
			PresencePenalty: Some(0.5), FrequencyPenalty: Some(-0.5),
			ResponseFormat: raw(`{"json_schema":{"name":"r","schema":{"properties":{"a":{},"b":{}},"type":"object"}},"type":"json_schema"}`),
			LogitBias:      raw(`{"1":5,"50256":-100}`),
			Tools:          raw(`[{"function":{"name":"f","parameters":{"type":"object"}},"type":"function"}]`),
			ToolChoice:     raw(`"auto"`),
		}},
	},
	{
		name: "null params are absent",
		body: `{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":null,"top_p":null,"max_tokens":null,
			"stream":null,"n":null,"seed":null,"stop":null,"response_format":null,"logit_bias":null,"tools":null,"tool_choice":null}`,
		want: &Request{Format: FormatOpenAIChat, Model: "m", Messages: []Message{textMsg("user", "x")}},
	},
	{
		name: "stop as a string, tool_choice as an object, integral float max_tokens",
		body: `{"model":"m","messages":[{"role":"user","content":"x"}],"stop":"###","max_tokens":64.0,"n":1e1,
			"tool_choice":{"type":"function","function":{"name":"f"}}}`,
		want: &Request{Format: FormatOpenAIChat, Model: "m", Messages: []Message{textMsg("user", "x")}, Params: Params{
			Stop: []string{"###"}, MaxTokens: Some[int64](64), N: Some[int64](10),
			ToolChoice: raw(`{"function":{"name":"f"},"type":"function"}`),
		}},
	},
	{
		name: "escapes, unicode and surrogate pairs decode like encoding/json",
		body: "{\"model\":\"m\\u002Dx\",\"messages\":[{\"role\":\"user\",\"content\":\"a\\\"b\\\\c\\/d\\n\\u00e9\\ud83d\\ude00 \\ufffd 日本\"}]}",
		want: &Request{Format: FormatOpenAIChat, Model: "m-x", Messages: []Message{textMsg("user", "a\"b\\c/d\né😀 \uFFFD 日本")}},
	},
	{
		name: "escaped keys are matched by value",
		body: `{"mod\u0065l":"m","m\u0065ssages":[{"r\u006Fle":"user","content":"x"}]}`,
		want: &Request{Format: FormatOpenAIChat, Model: "m", Messages: []Message{textMsg("user", "x")}},
	},
	{
		name: "duplicate keys: last wins",
		body: `{"model":"a","model":"b","messages":[{"role":"user","content":"one"}],"messages":[{"role":"system","content":"s"},{"role":"user","content":"two","content":"three"}],"temperature":1,"temperature":0.5}`,
		want: &Request{Format: FormatOpenAIChat, Model: "b", System: "s", HasSystem: true,
			Messages: []Message{textMsg("user", "three")}, Params: Params{Temperature: Some(0.5)}},
	},
	{
		name: "whitespace everywhere",
		body: " \t\r\n{ \"model\" : \"m\" ,\n \"messages\" : [ { \"role\" : \"user\" , \"content\" : [ { \"type\" : \"text\" , \"text\" : \"x\" } ] } ] , \"tools\" : [ { \"b\" : [ 1 , 2 ] , \"a\" : { } } ] } \n",
		want: &Request{Format: FormatOpenAIChat, Model: "m", Messages: []Message{textMsg("user", "x")}, Params: Params{Tools: raw(`[{"a":{},"b":[1,2]}]`)}},
	},
	{
		name: "canonical JSON re-encodes strings minimally and keeps numbers as sent",
		body: `{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"s":"\u0041\/\t\u001f\"","n":1.50E+3,"k\u00e9":true,"z":"<&>"}]}`,
		want: &Request{Format: FormatOpenAIChat, Model: "m", Messages: []Message{textMsg("user", "x")},
			Params: Params{Tools: raw(`[{"ké":true,"n":1.50E+3,"s":"A/\t\u001f\"","z":"<&>"}]`)}},
	},
	{
		name: "canonical JSON drops duplicate keys but the last",
		body: `{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"text","type":"json_object"}}`,
		want: &Request{Format: FormatOpenAIChat, Model: "m", Messages: []Message{textMsg("user", "x")},
			Params: Params{ResponseFormat: raw(`{"type":"json_object"}`)}},
	},
	{
		name: "cache_salt",
		body: `{"model":"m","cache_salt":"tenant-a","messages":[{"role":"user","content":"x"}]}`,
		want: &Request{Format: FormatOpenAIChat, Model: "m", CacheSalt: "tenant-a", Messages: []Message{textMsg("user", "x")}},
	},
	{
		name: "cache_salt null is absent, escapes decode",
		body: `{"model":"m","cache_salt":null,"messages":[{"role":"user","content":"x"}],"cache_s\u0061lt2":"other"}`,
		want: &Request{Format: FormatOpenAIChat, Model: "m", Messages: []Message{textMsg("user", "x")},
			Params: Params{Other: raw(`{"cache_salt2":"other"}`)}},
	},
	{
		name: "media: urls, data URIs, uuids, audio and video",
		body: `{"model":"m","messages":[
			{"role":"system","content":"s"},
			{"role":"user","content":[
				{"type":"text","text":"Compare "},
				{"type":"image_url","image_url":{"url":"https://x/a.png","detail":"low"}},
				{"type":"text","text":" and "},
				{"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgo="}},
				{"type":"image_url","image_url":"https://x/b.png"},
				{"type":"image_url","image_url":{"url":"https://x/c.png"},"uuid":"sku-1"},
				{"type":"image_url","image_url":null,"uuid":"sku-2"},
				{"type":"video_url","video_url":{"url":"https://x/v.mp4"}},
				{"type":"audio_url","audio_url":{"url":"DATA:audio/wav;BASE64,UklGRg=="}},
				{"type":"input_audio","input_audio":{"data":"UklGRg==","format":"wav"}},
				{"type":"image_url","image_url":{"detail":"auto"}}]},
			{"role":"assistant","content":"ok"},
			{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/a.png"}},{"type":"text","text":"again"}]}]}`,
		want: &Request{Format: FormatOpenAIChat, Model: "m", System: "s", HasSystem: true, Messages: []Message{
			{Role: "user", Text: "Compare  and ", Parts: []Part{
				{Type: "text", Text: "Compare "},
				{Type: "image_url", Data: `{"detail":"low","url":"https://x/a.png"}`},
				{Type: "text", Text: " and "},
				{Type: "image_url", Data: `{"url":"data:image/png;base64,iVBORw0KGgo="}`},
				{Type: "image_url", Data: `"https://x/b.png"`},
				{Type: "image_url", Data: `{"image_url":{"url":"https://x/c.png"},"uuid":"sku-1"}`},
				{Type: "image_url", Data: `{"image_url":null,"uuid":"sku-2"}`},
				{Type: "video_url", Data: `{"url":"https://x/v.mp4"}`},
				{Type: "audio_url", Data: `{"url":"DATA:audio/wav;BASE64,UklGRg=="}`},
				{Type: "input_audio", Data: `{"data":"UklGRg==","format":"wav"}`},
				{Type: "image_url", Data: `{"detail":"auto"}`},
			}},
			textMsg("assistant", "ok"),
			{Role: "user", Text: "again", Parts: []Part{
				{Type: "image_url", Data: `{"url":"https://x/a.png"}`},
				{Type: "text", Text: "again"},
			}},
		}, Media: []Media{
			{Kind: MediaImage, Message: 0, Part: 1, Offset: 8, Hash: MediaURLHash("https://x/a.png")},
			{Kind: MediaImage, Message: 0, Part: 3, Offset: 13, Hash: MediaDataHash("iVBORw0KGgo=")},
			{Kind: MediaImage, Message: 0, Part: 4, Offset: 13, Hash: MediaURLHash("https://x/b.png")},
			{Kind: MediaImage, Message: 0, Part: 5, Offset: 13, Hash: MediaUUIDHash("sku-1")},
			{Kind: MediaImage, Message: 0, Part: 6, Offset: 13, Hash: MediaUUIDHash("sku-2")},
			{Kind: MediaVideo, Message: 0, Part: 7, Offset: 13, Hash: MediaURLHash("https://x/v.mp4")},
			{Kind: MediaAudio, Message: 0, Part: 8, Offset: 13, Hash: MediaDataHash("UklGRg==")},
			{Kind: MediaAudio, Message: 0, Part: 9, Offset: 13, Hash: MediaDataHash("UklGRg==")},
			{Kind: MediaImage, Message: 0, Part: 10, Offset: 13, Hash: mediaOtherHash([]byte(`{"detail":"auto"}`))},
			{Kind: MediaImage, Message: 2, Part: 0, Offset: 0, Hash: MediaURLHash("https://x/a.png")},
		}},
	},
	{
		name: "duplicate content and messages keys: media of the last only",
		body: `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u0"}}]}],"messages":[
			{"role":"user","content":[{"type":"image_url","image_url":{"url":"u1"}}],
			 "content":[{"type":"text","text":"t"},{"type":"image_url","image_url":{"url":"u2"}}]}]}`,
		want: &Request{Format: FormatOpenAIChat, Model: "m", Messages: []Message{{Role: "user", Text: "t", Parts: []Part{
			{Type: "text", Text: "t"}, {Type: "image_url", Data: `{"url":"u2"}`},
		}}}, Media: []Media{{Kind: MediaImage, Message: 0, Part: 1, Offset: 1, Hash: MediaURLHash("u2")}}},
	},
}

var openAICompletionCases = []parseCase{
	{
		name: "string prompt",
		body: `{"model":"m","prompt":"Once upon a time","max_tokens":16,"temperature":0,"stop":"\n"}`,
		want: &Request{Format: FormatOpenAICompletion, Model: "m", Prompt: []string{"Once upon a time"},
			Params: Params{MaxTokens: Some[int64](16), Temperature: Some(0.0), Stop: []string{"\n"}}},
	},
	{
		name: "array of strings",
		body: `{"model":"m","prompt":["a","b\u00e9",""]}`,
		want: &Request{Format: FormatOpenAICompletion, Model: "m", Prompt: []string{"a", "bé", ""}},
	},
	{
		name: "token IDs",
		body: `{"model":"m","prompt":[1,0,4294967295]}`,
		want: &Request{Format: FormatOpenAICompletion, Model: "m", PromptTokens: []uint32{1, 0, 4294967295}},
	},
	{
		name: "arrays of token IDs keep the first",
		body: `{"prompt":[[5,6,7],[8],[]],"model":"m","seed":3}`,
		want: &Request{Format: FormatOpenAICompletion, Model: "m", PromptTokens: []uint32{5, 6, 7}, Params: Params{Seed: Some[int64](3)}},
	},
	{
		name: "empty first token array",
		body: `{"prompt":[[]],"model":"m"}`,
		want: &Request{Format: FormatOpenAICompletion, Model: "m", PromptTokens: []uint32{}},
	},
	{
		name: "duplicate prompt: last wins",
		body: `{"model":"m","prompt":[1,2],"prompt":"text"}`,
		want: &Request{Format: FormatOpenAICompletion, Model: "m", Prompt: []string{"text"}},
	},
	{
		name: "cache_salt",
		body: `{"model":"m","prompt":"p","cache_salt":"tenant-b"}`,
		want: &Request{Format: FormatOpenAICompletion, Model: "m", Prompt: []string{"p"}, CacheSalt: "tenant-b"},
	},
}

var anthropicCases = []parseCase{
	{
		name: "minimal",
		body: `{"model":"claude-sonnet-4-5","max_tokens":1024,"messages":[{"role":"user","content":"Hello, Claude"}]}`,
		want: &Request{Format: FormatAnthropicMessages, Model: "claude-sonnet-4-5", Params: Params{MaxTokens: Some[int64](1024)},
			Messages: []Message{textMsg("user", "Hello, Claude")}},
	},
	{
		name: "string system",
		body: `{"model":"c","system":"Be brief.","messages":[{"role":"user","content":"x"}]}`,
		want: &Request{Format: FormatAnthropicMessages, Model: "c", System: "Be brief.", HasSystem: true, Messages: []Message{textMsg("user", "x")}},
	},
	{
		name: "block system joined by newline, cache_control ignored",
		body: `{"model":"c","system":[{"type":"text","text":"Part one."},{"type":"text","text":"Part two.","cache_control":{"type":"ephemeral"}}],"messages":[{"role":"user","content":"x"}]}`,
		want: &Request{Format: FormatAnthropicMessages, Model: "c", System: "Part one.\nPart two.", HasSystem: true, Messages: []Message{textMsg("user", "x")}},
	},
	{
		name: "null system is absent",
		body: `{"model":"c","system":null,"messages":[{"role":"user","content":"x"}]}`,
		want: &Request{Format: FormatAnthropicMessages, Model: "c", Messages: []Message{textMsg("user", "x")}},
	},
	{
		name: "all block types",
		body: `{"model":"c","messages":[
			{"role":"user","content":[
				{"type":"text","text":"Look: ","cache_control":{"type":"ephemeral"}},
				{"type":"image","source":{"type":"base64","media_type":"image/png","data":"iVBORw=="}},
				{"type":"document","source":{"type":"url","url":"https://x/a.pdf"},"title":"A","cache_control":{"type":"ephemeral"}}]},
			{"role":"assistant","content":[
				{"type":"thinking","thinking":"Let me think.","signature":"sig"},
				{"type":"redacted_thinking","data":"EmwKAhgB"},
				{"type":"text","text":"Calling."},
				{"type":"tool_use","name":"get_weather","id":"toolu_1","input":{"unit":"c","city":"Paris"}}]},
			{"role":"user","content":[
				{"type":"tool_result","tool_use_id":"toolu_1","content":"18C","cache_control":{"type":"ephemeral"}},
				{"type":"tool_result","tool_use_id":"toolu_2","is_error":true,"content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
				{"type":"tool_result","tool_use_id":"toolu_3","content":[{"type":"text","text":"see"},{"type":"image","source":{"type":"url","url":"u"}}]},
				{"type":"tool_result","tool_use_id":"toolu_4"}]}]}`,
		want: &Request{Format: FormatAnthropicMessages, Model: "c", Messages: []Message{
			{Role: "user", Text: "Look: ", Parts: []Part{
				{Type: "text", Text: "Look: "},
				{Type: "image", Data: `{"data":"iVBORw==","media_type":"image/png","type":"base64"}`},
				{Type: "document", Data: `{"source":{"type":"url","url":"https://x/a.pdf"},"title":"A"}`},
			}},
			{Role: "assistant", Text: "Let me think.Calling.", Parts: []Part{
				{Type: "thinking", Text: "Let me think."},
				{Type: "redacted_thinking", Data: `{"data":"EmwKAhgB"}`},
				{Type: "text", Text: "Calling."},
				{Type: "tool_use", Data: `{"id":"toolu_1","input":{"city":"Paris","unit":"c"},"name":"get_weather"}`},
			}},
			{Role: "user", Text: "18Cabsee", Parts: []Part{
				{Type: "tool_result", Text: "18C", Data: `{"tool_use_id":"toolu_1"}`},
				{Type: "tool_result", Text: "ab", Data: `{"is_error":true,"tool_use_id":"toolu_2"}`},
				{Type: "tool_result", Text: "see", Data: `{"content":[{"text":"see","type":"text"},{"source":{"type":"url","url":"u"},"type":"image"}],"tool_use_id":"toolu_3"}`},
				{Type: "tool_result", Data: `{"tool_use_id":"toolu_4"}`},
			}},
		}, Media: []Media{
			{Kind: MediaImage, Message: 0, Part: 1, Offset: 6, Hash: MediaDataHash("iVBORw==")},
			{Kind: MediaImage, Message: 2, Part: 2, Offset: 8, Hash: MediaURLHash("u")},
		}},
	},
	{
		name: "params",
		body: `{"model":"c","messages":[{"role":"user","content":"x"}],"max_tokens":10,"temperature":0.7,"top_p":0.95,"top_k":40,
			"stop_sequences":["\n\nHuman:"],"stream":true,"tools":[{"name":"t","input_schema":{"type":"object"}}],
			"tool_choice":{"type":"auto"},"metadata":{"user_id":"u"},"thinking":{"type":"enabled","budget_tokens":1024},"stop":"ignored"}`,
		want: &Request{Format: FormatAnthropicMessages, Model: "c", Messages: []Message{textMsg("user", "x")}, Params: Params{
			MaxTokens: Some[int64](10), Temperature: Some(0.7), TopP: Some(0.95), Stop: []string{"\n\nHuman:"}, Stream: true,
			Tools: raw(`[{"input_schema":{"type":"object"},"name":"t"}]`), ToolChoice: raw(`{"type":"auto"}`),
			Other: raw(`{"stop":"ignored","thinking":{"budget_tokens":1024,"type":"enabled"},"top_k":40}`),
		}},
	},
	{
		name: "image sources, images in tool results, cache_salt kept as an other field",
		body: `{"model":"c","system":"s","cache_salt":"t","messages":[
			{"role":"user","content":[
				{"type":"image","source":{"type":"url","url":"https://x/a.png"}},
				{"type":"text","text":"What differs from "},
				{"type":"image","source":{"type":"base64","media_type":"image/png","data":"iVBORw0KGgo="},"cache_control":{"type":"ephemeral"}},
				{"type":"image","source":{"type":"file","file_id":"file_1"}}]},
			{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"shot","input":{}}]},
			{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":[
				{"type":"text","text":"shot:"},{"type":"image","source":{"type":"base64","media_type":"image/jpeg","data":"/9j/4AAQ"}}]}]}]}`,
		want: &Request{Format: FormatAnthropicMessages, Model: "c", System: "s", HasSystem: true, Messages: []Message{
			{Role: "user", Text: "What differs from ", Parts: []Part{
				{Type: "image", Data: `{"type":"url","url":"https://x/a.png"}`},
				{Type: "text", Text: "What differs from "},
				{Type: "image", Data: `{"data":"iVBORw0KGgo=","media_type":"image/png","type":"base64"}`},
				{Type: "image", Data: `{"file_id":"file_1","type":"file"}`},
			}},
			{Role: "assistant", Parts: []Part{{Type: "tool_use", Data: `{"id":"t1","input":{},"name":"shot"}`}}},
			{Role: "user", Text: "shot:", Parts: []Part{{Type: "tool_result", Text: "shot:",
				Data: `{"content":[{"text":"shot:","type":"text"},{"source":{"data":"/9j/4AAQ","media_type":"image/jpeg","type":"base64"},"type":"image"}],"tool_use_id":"t1"}`}}},
		}, Media: []Media{
			{Kind: MediaImage, Message: 0, Part: 0, Offset: 0, Hash: MediaURLHash("https://x/a.png")},
			{Kind: MediaImage, Message: 0, Part: 2, Offset: 18, Hash: MediaDataHash("iVBORw0KGgo=")},
			{Kind: MediaImage, Message: 0, Part: 3, Offset: 18, Hash: mediaOtherHash([]byte(`{"file_id":"file_1","type":"file"}`))},
			{Kind: MediaImage, Message: 2, Part: 0, Offset: 5, Hash: MediaDataHash("/9j/4AAQ")},
		}, Params: Params{Other: raw(`{"cache_salt":"t"}`)}},
	},
}

func runParseCases(t *testing.T, parse func([]byte) (*Request, error), cases []parseCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parse([]byte(tc.body))
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestParseOpenAIChat(t *testing.T) { runParseCases(t, ParseOpenAIChat, openAIChatCases) }
func TestParseOpenAICompletion(t *testing.T) {
	runParseCases(t, ParseOpenAICompletion, openAICompletionCases)
}
func TestParseAnthropicMessages(t *testing.T) {
	runParseCases(t, ParseAnthropicMessages, anthropicCases)
}

func TestParseDispatch(t *testing.T) {
	for _, tc := range []struct {
		f    Format
		body string
	}{
		{FormatOpenAIChat, openAIChatCases[0].body},
		{FormatOpenAICompletion, openAICompletionCases[0].body},
		{FormatAnthropicMessages, anthropicCases[0].body},
	} {
		t.Run(tc.f.String(), func(t *testing.T) {
			r, err := Parse(tc.f, []byte(tc.body))
			require.NoError(t, err)
			require.Equal(t, tc.f, r.Format)
		})
	}
	t.Run("unknown format", func(t *testing.T) {
		r, err := Parse(Format(0), []byte(`{}`))
		require.Nil(t, r)
		require.ErrorIs(t, err, ErrUnknownFormat)
		require.NotErrorIs(t, err, ErrMalformed)
	})
}

// TestParseDoesNotAliasBody checks that a Request stays valid after the body buffer is reused.
func TestParseDoesNotAliasBody(t *testing.T) {
	for _, tc := range openAIChatCases {
		t.Run(tc.name, func(t *testing.T) {
			body := []byte(tc.body)
			got, err := ParseOpenAIChat(body)
			require.NoError(t, err)
			for i := range body {
				body[i] = 'X'
			}
			require.Equal(t, tc.want, got)
		})
	}
}

// errCase is a malformed body, the field its error must name and a substring of the reason.
type errCase struct {
	name   string
	body   string
	field  string
	reason string
}

// commonErrCases are malformed for every format (the body shape, the model, JSON syntax).
var commonErrCases = []errCase{
	{"empty body", ``, "", "body is empty"},
	{"whitespace only", " \n", "", "body is empty"},
	{"not JSON", `hello`, "", "must be a JSON object"},
	{"array body", `[{"model":"m"}]`, "", "must be a JSON object"},
	{"string body", `"x"`, "", "must be a JSON object"},
	{"null body", `null`, "", "must be a JSON object"},
	{"truncated", `{"model":"m"`, "", "unexpected end of input"},
	{"truncated in key", `{"mod`, "", "unexpected end of input in string"},
	{"trailing garbage", `{"model":"m"} x`, "", "want end of input"},
	{"two objects", `{"model":"m"}{}`, "", "want end of input"},
	{"trailing comma", `{"model":"m",}`, "", "want an object key"},
	{"missing colon", `{"model" "m"}`, "", "want ':'"},
	{"missing comma", `{"model":"m" "x":1}`, "", "want ',' or '}'"},
	{"single quotes", `{'model':'m'}`, "", "want an object key"},
	{"unquoted key", `{model:"m"}`, "", "want an object key"},
	{"model missing", `{}`, "model", "is required"},
	{"model null", `{"model":null}`, "model", "is required"},
	{"model empty", `{"model":""}`, "model", "is required"},
	{"model number", `{"model":7}`, "model", "must be a string"},
	{"control char in string", "{\"model\":\"a\nb\"}", "model", "control character"},
	{"bad escape", `{"model":"a\xb"}`, "model", "invalid escape"},
	{"bad unicode escape", `{"model":"a\u12G4"}`, "model", "invalid \\u escape"},
	{"bad literal in unknown field", `{"model":"m","x":tru}`, "x", "invalid literal"},
	{"bad number in unknown field", `{"model":"m","x":01}`, "", "want ',' or '}'"},
	{"leading plus", `{"model":"m","x":+1}`, "x", "want a value"},
	{"bare minus", `{"model":"m","x":-}`, "x", "want a digit"},
	{"dot without digits", `{"model":"m","x":1.}`, "x", "want a digit"},
	{"exponent without digits", `{"model":"m","x":1e+}`, "x", "want a digit"},
	{"deep unknown field error is located", `{"model":"m","metadata":{"a":[1,2,}]}}`, "metadata", "want a value"},
	{"too deep", `{"model":"m","x":` + strings.Repeat("[", maxJSONDepth+1) + strings.Repeat("]", maxJSONDepth+1) + `}`, "x", "nesting too deep"},
	{"temperature string", `{"model":"m","temperature":"0"}`, "temperature", "must be a number"},
	{"temperature out of range", `{"model":"m","temperature":1e999}`, "temperature", "out of range"},
	{"max_tokens fraction", `{"model":"m","max_tokens":1.5}`, "max_tokens", "must be an integer"},
	{"max_tokens out of range", `{"model":"m","max_tokens":9223372036854775808}`, "max_tokens", "out of range"},
	{"max_tokens float out of range", `{"model":"m","max_tokens":1e19}`, "max_tokens", "out of range"},
	{"stream string", `{"model":"m","stream":"yes"}`, "stream", "must be a boolean"},
	{"tools object", `{"model":"m","tools":{}}`, "tools", "must be an array"},
	{"tools invalid JSON inside", `{"model":"m","tools":[{"a":}]}`, "tools", "want a value"},
}

var openAIChatErrCases = []errCase{
	{"messages missing", `{"model":"m"}`, "messages", "is required"},
	{"messages null", `{"model":"m","messages":null}`, "messages", "is required"},
	{"messages object", `{"model":"m","messages":{}}`, "messages", "must be an array"},
	{"message not an object", `{"model":"m","messages":["hi"]}`, "messages[0]", "must be an object"},
	{"role missing", `{"model":"m","messages":[{"content":"x"}]}`, "messages[0].role", "is required"},
	{"role unknown", `{"model":"m","messages":[{"role":"user","content":"x"},{"role":"robot","content":"x"}]}`, "messages[1].role", `unknown role "robot"`},
	{"role number", `{"model":"m","messages":[{"role":1,"content":"x"}]}`, "messages[0].role", "must be a string"},
	{"content missing for user", `{"model":"m","messages":[{"role":"user"}]}`, "messages[0].content", "is required"},
	{"content null for tool", `{"model":"m","messages":[{"role":"tool","content":null,"tool_call_id":"c"}]}`, "messages[0].content", "is required"},
	{"content number", `{"model":"m","messages":[{"role":"user","content":42}]}`, "messages[0].content", "must be a string, null or an array"},
	{"content object", `{"model":"m","messages":[{"role":"user","content":{"type":"text"}}]}`, "messages[0].content", "must be a string, null or an array"},
	{"part not an object", `{"model":"m","messages":[{"role":"user","content":["x"]}]}`, "messages[0].content[0]", "must be a content part object"},
	{"part type missing", `{"model":"m","messages":[{"role":"user","content":[{"text":"x"}]}]}`, "messages[0].content[0].type", "is required"},
	{"part type number", `{"model":"m","messages":[{"role":"user","content":[{"type":1}]}]}`, "messages[0].content[0].type", "must be a string"},
	{"text part without text", `{"model":"m","messages":[{"role":"user","content":[{"type":"text"}]}]}`, "messages[0].content[0].text", "is required"},
	{"text part with number text", `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":1}]}]}`, "messages[0].content[0].text", "must be a string"},
	{"image in system", `{"model":"m","messages":[{"role":"system","content":[{"type":"image_url","image_url":{"url":"u"}}]}]}`, "messages[0].content[0]", "text parts only"},
	{"syntax error in tool_calls", `{"model":"m","messages":[{"role":"assistant","tool_calls":[{]}]}`, "messages[0].tool_calls", "want an object key"},
	{"stop number", `{"model":"m","messages":[],"stop":1}`, "stop", "must be a string or an array of strings"},
	{"stop array with number", `{"model":"m","messages":[],"stop":["a",2]}`, "stop[1]", "must be a string"},
	{"response_format string", `{"model":"m","messages":[],"response_format":"json"}`, "response_format", "must be an object"},
	{"logit_bias array", `{"model":"m","messages":[],"logit_bias":[]}`, "logit_bias", "must be an object"},
	{"tool_choice number", `{"model":"m","messages":[],"tool_choice":1}`, "tool_choice", "must be a string or an object"},
	{"seed float", `{"model":"m","messages":[],"seed":0.5}`, "seed", "must be an integer"},
	{"n string", `{"model":"m","messages":[],"n":"2"}`, "n", "must be an integer"},
	{"escaped key names the field", `{"model":"m","messages":[],"st\u006fp":["\u0041",1]}`, "stop[1]", "must be a string"},
	{"escaped unknown key names the field", `{"model":"m","messages":[],"m\u0065ta":[1,]}`, "meta", "want a value"},
	{"cache_salt number", `{"model":"m","messages":[],"cache_salt":1}`, "cache_salt", "must be a string"},
	{"cache_salt object", `{"model":"m","messages":[],"cache_s\u0061lt":{"a":"b"}}`, "cache_salt", "must be a string"},
	{"cache_salt empty", `{"model":"m","messages":[],"cache_salt":""}`, "cache_salt", "must be a non-empty string"},
	{"cache_salt too long", `{"model":"m","messages":[],"cache_salt":"` + strings.Repeat("s", MaxCacheSaltLength+1) + `"}`, "cache_salt", "at most 1024 bytes"},
	{"cache_salt bad string", `{"model":"m","messages":[],"cache_salt":"a\x"}`, "cache_salt", "invalid escape"},
}

var openAICompletionErrCases = []errCase{
	{"prompt missing", `{"model":"m"}`, "prompt", "is required"},
	{"prompt null", `{"model":"m","prompt":null}`, "prompt", "is required"},
	{"prompt number", `{"model":"m","prompt":1}`, "prompt", "must be a string, an array"},
	{"prompt empty array", `{"model":"m","prompt":[]}`, "prompt", "must not be empty"},
	{"prompt mixed strings and tokens", `{"model":"m","prompt":["a",1]}`, "prompt[1]", "must be a string"},
	{"prompt mixed tokens and strings", `{"model":"m","prompt":[1,"a"]}`, "prompt[1]", "must be a token ID"},
	{"prompt array of objects", `{"model":"m","prompt":[{}]}`, "prompt[0]", "must be a string, a token ID or an array of token IDs"},
	{"negative token", `{"model":"m","prompt":[1,-1]}`, "prompt[1]", "token ID in [0, 4294967295]"},
	{"token too large", `{"model":"m","prompt":[4294967296]}`, "prompt[0]", "token ID in [0, 4294967295]"},
	{"token fraction", `{"model":"m","prompt":[1.5]}`, "prompt[0]", "token ID in [0, 4294967295]"},
	{"token huge", `{"model":"m","prompt":[99999999999999999999999]}`, "prompt[0]", "out of range"},
	{"token in nested array too large", `{"model":"m","prompt":[[1],[2,4294967296]]}`, "prompt[1][1]", "token ID in [0, 4294967295]"},
	{"nested token is a string", `{"model":"m","prompt":[[1,"2"]]}`, "prompt[0][1]", "token ID in [0, 4294967295]"},
	{"nested token null", `{"model":"m","prompt":[[null]]}`, "prompt[0][0]", "token ID in [0, 4294967295]"},
	{"token arrays then a string", `{"model":"m","prompt":[[1],"a"]}`, "prompt[1]", "must be an array of token IDs"},
	{"cache_salt array", `{"model":"m","prompt":"p","cache_salt":["a"]}`, "cache_salt", "must be a string"},
	{"cache_salt empty", `{"model":"m","prompt":"p","cache_salt":""}`, "cache_salt", "must be a non-empty string"},
}

var anthropicErrCases = []errCase{
	{"messages missing", `{"model":"c"}`, "messages", "is required"},
	{"messages string", `{"model":"c","messages":"hi"}`, "messages", "must be an array"},
	{"role system", `{"model":"c","messages":[{"role":"system","content":"x"}]}`, "messages[0].role", `unknown role "system"`},
	{"role missing", `{"model":"c","messages":[{"content":"x"}]}`, "messages[0].role", "is required"},
	{"content missing", `{"model":"c","messages":[{"role":"user"}]}`, "messages[0].content", "is required"},
	{"content null", `{"model":"c","messages":[{"role":"assistant","content":null}]}`, "messages[0].content", "is required"},
	{"content number", `{"model":"c","messages":[{"role":"user","content":1}]}`, "messages[0].content", "must be a string or an array of content blocks"},
	{"block not an object", `{"model":"c","messages":[{"role":"user","content":[1]}]}`, "messages[0].content[0]", "must be a content block object"},
	{"block type missing", `{"model":"c","messages":[{"role":"user","content":[{"text":"x"}]}]}`, "messages[0].content[0].type", "is required"},
	{"text block without text", `{"model":"c","messages":[{"role":"user","content":[{"type":"text"}]}]}`, "messages[0].content[0].text", "is required"},
	{"thinking block without thinking", `{"model":"c","messages":[{"role":"assistant","content":[{"type":"thinking","signature":"s"}]}]}`, "messages[0].content[0].thinking", "is required"},
	{"image without source", `{"model":"c","messages":[{"role":"user","content":[{"type":"image"}]}]}`, "messages[0].content[0].source", "is required"},
	{"image source string", `{"model":"c","messages":[{"role":"user","content":[{"type":"image","source":"u"}]}]}`, "messages[0].content[0].source", "must be an object"},
	{"tool_result content number", `{"model":"c","messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":5}]}]}`, "messages[0].content[0].content", "must be a string or an array"},
	{"tool_result nested text not a string", `{"model":"c","messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":5}]}]}]}`, "messages[0].content[0].content[0].text", "must be a string"},
	{"tool_result nested block not an object", `{"model":"c","messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":["x"]}]}]}`, "messages[0].content[0].content[0]", "must be a content block object"},
	{"system number", `{"model":"c","system":1,"messages":[]}`, "system", "must be a string or an array of text blocks"},
	{"system block not text", `{"model":"c","system":[{"type":"image","source":{}}],"messages":[]}`, "system[0].type", `must be "text"`},
	{"system block without text", `{"model":"c","system":[{"type":"text","text":"a"},{"type":"text"}],"messages":[]}`, "system[1].text", "is required"},
	{"system block not an object", `{"model":"c","system":["a"],"messages":[]}`, "system[0]", "must be a text block object"},
	{"stop_sequences string", `{"model":"c","messages":[],"stop_sequences":"x"}`, "stop_sequences", "must be an array of strings"},
	{"tool_choice string", `{"model":"c","messages":[],"tool_choice":"auto"}`, "tool_choice", "must be an object"},
	{"syntax error deep in a block", `{"model":"c","messages":[{"role":"user","content":[{"type":"tool_use","input":{"a":[1 2]}}]}]}`, "messages[0].content[0].input", "want ',' or ']'"},
}

func runErrCases(t *testing.T, parse func([]byte) (*Request, error), cases ...[]errCase) {
	t.Helper()
	for _, cs := range cases {
		for _, tc := range cs {
			t.Run(tc.name, func(t *testing.T) {
				got, err := parse([]byte(tc.body))
				require.Nil(t, got)
				require.ErrorIs(t, err, ErrMalformed)
				var fe *FieldError
				require.ErrorAs(t, err, &fe)
				require.Equal(t, tc.field, fe.Field, "error: %v", err)
				require.Contains(t, fe.Reason, tc.reason, "error: %v", err)
				require.True(t, strings.HasPrefix(err.Error(), "prefixkey: malformed request: "), err.Error())
			})
		}
	}
}

// withMessages completes the common error cases whose model is valid so that only the intended
// field is wrong (messages or prompt present).
func withBodyFor(f Format, cases []errCase) []errCase {
	out := make([]errCase, 0, len(cases))
	for _, c := range cases {
		if strings.HasPrefix(c.body, `{"model":"m",`) && !strings.Contains(c.body, "messages") {
			switch f {
			case FormatOpenAICompletion:
				c.body = `{"model":"m","prompt":"p",` + c.body[len(`{"model":"m",`):]
			default:
				c.body = `{"model":"m","messages":[],` + c.body[len(`{"model":"m",`):]
			}
		}
		out = append(out, c)
	}
	return out
}

func TestParseOpenAIChatErrors(t *testing.T) {
	runErrCases(t, ParseOpenAIChat, withBodyFor(FormatOpenAIChat, commonErrCases), openAIChatErrCases)
}

func TestParseOpenAICompletionErrors(t *testing.T) {
	runErrCases(t, ParseOpenAICompletion, withBodyFor(FormatOpenAICompletion, commonErrCases), openAICompletionErrCases)
}

func TestParseAnthropicMessagesErrors(t *testing.T) {
	runErrCases(t, ParseAnthropicMessages, withBodyFor(FormatAnthropicMessages, commonErrCases), anthropicErrCases)
}

// ---- key-order invariance ----

// jsonNode is a JSON value that keeps object member order.
type jsonNode struct {
	kind    byte // '{', '[', or 'v'
	keys    []string
	kids    []*jsonNode
	literal json.RawMessage // for 'v': the value as sent
}

func parseJSONNode(t testing.TB, b []byte) *jsonNode {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var read func() *jsonNode
	read = func() *jsonNode {
		// Read the value's raw bytes for scalars via the offset before and after the token.
		start := dec.InputOffset()
		tok, err := dec.Token()
		require.NoError(t, err)
		switch tok {
		case json.Delim('{'):
			n := &jsonNode{kind: '{'}
			for dec.More() {
				k, err := dec.Token()
				require.NoError(t, err)
				n.keys = append(n.keys, k.(string))
				n.kids = append(n.kids, read())
			}
			_, err := dec.Token()
			require.NoError(t, err)
			return n
		case json.Delim('['):
			n := &jsonNode{kind: '['}
			for dec.More() {
				n.kids = append(n.kids, read())
			}
			_, err := dec.Token()
			require.NoError(t, err)
			return n
		default:
			lit := bytes.TrimLeft(b[start:dec.InputOffset()], " \t\r\n,:")
			return &jsonNode{kind: 'v', literal: lit}
		}
	}
	return read()
}

// write emits n with every object's members permuted by rng and random whitespace.
func (n *jsonNode) write(buf *bytes.Buffer, rng *rand.Rand) {
	ws := func() {
		if rng.IntN(4) == 0 {
			buf.WriteString([]string{" ", "\n", "\t", "\r\n  "}[rng.IntN(4)])
		}
	}
	switch n.kind {
	case '{':
		buf.WriteByte('{')
		for i, j := range rng.Perm(len(n.keys)) {
			if i > 0 {
				buf.WriteByte(',')
			}
			ws()
			k, _ := json.Marshal(n.keys[j])
			buf.Write(k)
			ws()
			buf.WriteByte(':')
			ws()
			n.kids[j].write(buf, rng)
			ws()
		}
		buf.WriteByte('}')
	case '[':
		buf.WriteByte('[')
		for i, k := range n.kids {
			if i > 0 {
				buf.WriteByte(',')
			}
			ws()
			k.write(buf, rng)
			ws()
		}
		buf.WriteByte(']')
	default:
		buf.Write(n.literal)
	}
}

// TestParseKeyOrderInvariance checks the property that permuting object members (at every depth)
// and changing insignificant whitespace gives an identical Request.
func TestParseKeyOrderInvariance(t *testing.T) {
	type group struct {
		name  string
		parse func([]byte) (*Request, error)
		cases []parseCase
	}
	groups := []group{
		{"openai_chat", ParseOpenAIChat, append(slicesClone(openAIChatCases), parseCase{name: "bench 8KiB", body: string(parseBenchChatBody(8 << 10))})},
		{"openai_completion", ParseOpenAICompletion, openAICompletionCases},
		{"anthropic", ParseAnthropicMessages, append(slicesClone(anthropicCases), parseCase{name: "bench 8KiB", body: string(parseBenchAnthropicBody(8 << 10))})},
	}
	for _, g := range groups {
		for _, tc := range g.cases {
			if strings.Contains(tc.name, "duplicate") {
				continue // member order is meaningful for duplicate keys
			}
			t.Run(g.name+"/"+tc.name, func(t *testing.T) {
				want, err := g.parse([]byte(tc.body))
				require.NoError(t, err)
				root := parseJSONNode(t, []byte(tc.body))
				rng := rand.New(rand.NewPCG(1, uint64(len(tc.body))))
				for i := range 20 {
					var buf bytes.Buffer
					root.write(&buf, rng)
					got, err := g.parse(buf.Bytes())
					require.NoError(t, err, "permutation %d: %s", i, buf.Bytes())
					require.Equal(t, want, got, "permutation %d: %s", i, buf.Bytes())
				}
			})
		}
	}
}

func slicesClone(c []parseCase) []parseCase { return append([]parseCase(nil), c...) }

// ---- the JSON reader against encoding/json ----

// TestJSONReaderAgreesWithEncodingJSON checks validity and string decoding on tricky inputs.
func TestJSONReaderAgreesWithEncodingJSON(t *testing.T) {
	inputs := []string{
		`"plain"`, `"a\"b"`, `"\u00e9\u4e2d"`, `"\ud83d\ude00"`, `"\ud83d"`, `"\ude00"`, `"\ud83dx"`,
		`"\ud83d\u0041"`, `"\ud83d\ud83d\ude00"`, "\"\xff\xfe\"", "\"\xe6\x97\"", "\"ok\xc0\xafok\"",
		`"\/\b\f\n\r\t"`, `"0123456789abcdef0123456789abcdef\"0123456789"`, "\"\x7f\"",
		`"1234567\\"`, `"12345678\u0000"`, `""`, `"\u"`, `"\x"`, "\"a\x01\"", `"abc`, `"abcdefgh\`,
		`0`, `-0`, `-0.0e-0`, `1E+2`, `01`, `1.`, `.5`, `-`, `1e`, `true`, `truex`, `nul`, `[1,]`, `[,1]`, `{"a":1,}`,
		`{"a" 1}`, `[1 2]`, `{"a":[{"b":{}}]}`, ` [ ] `, `{}`, `[]`, `[[[[]]]]`, `{"a":1}}`,
	}
	for _, in := range inputs {
		t.Run(fmt.Sprintf("%q", in), func(t *testing.T) {
			parseCheckAgainstStdlib(t, []byte(in))
		})
	}
}

// parseCheckAgainstStdlib fails t when the reader and encoding/json disagree on b's validity,
// on a decoded top-level string, or on the canonical form's meaning.
func parseCheckAgainstStdlib(t testing.TB, b []byte) {
	d := decoder{buf: b}
	err := d.skipValue(0)
	if err == nil {
		err = d.end()
	}
	if err != nil && !errors.Is(err, ErrMalformed) {
		t.Fatalf("error %v does not wrap ErrMalformed", err)
	}
	if valid := json.Valid(b); valid != (err == nil) {
		t.Fatalf("json.Valid = %v, reader error = %v", valid, err)
	}
	if err != nil {
		return
	}
	d = decoder{buf: b}
	canon, err := d.appendCanonical(nil, 0)
	if err != nil {
		// Canonicalising is strict where encoding/json is not: a string that is not valid
		// UTF-8, or holds an unpaired surrogate escape, is refused rather than decoded with
		// U+FFFD (distinct inputs must not read the same).
		if fe, ok := err.(*FieldError); ok && hasBadUnicode(b) &&
			(fe.Reason == errBadUTF8().Reason || strings.Contains(fe.Reason, "unpaired UTF-16 surrogate")) {
			return
		}
		t.Fatalf("canonical: %v", err)
	}
	want, err := decodeJSONNumbers(b)
	if err != nil {
		t.Fatal(err)
	}
	got, err := decodeJSONNumbers(canon)
	if err != nil {
		t.Fatalf("canonical form %q is not valid JSON: %v", canon, err)
	}
	if !jsonEqual(want, got) {
		t.Fatalf("canonical form %q means %#v, want %#v", canon, got, want)
	}
	d = decoder{buf: canon}
	again, err := d.appendCanonical(nil, 0)
	if err != nil || !bytes.Equal(again, canon) {
		t.Fatalf("canonical form is not a fixed point: %q -> %q (%v)", canon, again, err)
	}
}

// hasBadUnicode reports whether the valid JSON text b holds invalid UTF-8 or a \u escape of an
// unpaired surrogate: the texts that decode, lossily, to U+FFFD.
func hasBadUnicode(b []byte) bool {
	if !utf8.Valid(b) {
		return true
	}
	for i := 0; i+6 <= len(b); i++ {
		if b[i] != '\\' {
			continue
		}
		if b[i+1] != 'u' {
			i++ // skip the escaped character, which may be a backslash
			continue
		}
		r, _ := strconv.ParseUint(string(b[i+2:i+6]), 16, 32)
		switch {
		case 0xd800 <= r && r < 0xdc00:
			var lo uint64
			if i+12 <= len(b) && b[i+6] == '\\' && b[i+7] == 'u' {
				lo, _ = strconv.ParseUint(string(b[i+8:i+12]), 16, 32)
			}
			if lo < 0xdc00 || lo > 0xdfff {
				return true
			}
			i += 11
		case 0xdc00 <= r && r <= 0xdfff:
			return true
		default:
			i += 5
		}
	}
	return false
}

// decodeJSONNumbers decodes b keeping numbers as json.Number (so that 1e400 is no error).
func decodeJSONNumbers(b []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	err := dec.Decode(&v)
	return v, err
}

// jsonEqual compares decoded JSON values by their encoding (maps encode with sorted keys).
func jsonEqual(a, b any) bool {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return bytes.Equal(ja, jb)
}

// TestParseLargeBodies runs shapes that would expose super-linear work (each is a few MB at
// most); a quadratic step would take minutes instead of milliseconds.
func TestParseLargeBodies(t *testing.T) {
	if testing.Short() {
		t.Skip("large bodies")
	}
	const n = 50000
	nested := func(open, close string, depth int) string {
		return strings.Repeat(open, depth) + "0" + strings.Repeat(close, depth)
	}
	var msgs, dupContent, manyKeys, unsortedDeep strings.Builder
	for i := range n {
		if i > 0 {
			msgs.WriteByte(',')
			manyKeys.WriteByte(',')
		}
		part := `{"type":"text","text":"t%d"}`
		if i < MaxMediaItems {
			part = `{"type":"image_url","image_url":{"url":"u%d"}}`
		}
		fmt.Fprintf(&msgs, `{"role":"user","content":[{"type":"text","text":"m%d"},`+part+`],"name":"n%d"}`, i, i, i)
		fmt.Fprintf(&dupContent, `"content":"c%d",`, i)
		fmt.Fprintf(&manyKeys, `"k%08d":%d`, n-i, i)
	}
	for range maxJSONDepth - 10 {
		unsortedDeep.WriteString(`{"b":0,"a":`)
	}
	unsortedDeep.WriteString("0" + strings.Repeat("}", maxJSONDepth-10))
	cases := []struct {
		name  string
		parse func([]byte) (*Request, error)
		body  string
	}{
		{"many messages", ParseOpenAIChat, `{"model":"m","messages":[` + msgs.String() + `]}`},
		{"many duplicate content keys", ParseOpenAIChat, `{"model":"m","messages":[{"role":"user",` + dupContent.String() + `"name":"x"}]}`},
		{"tools object with many keys in reverse order", ParseOpenAIChat, `{"model":"m","messages":[],"tools":[{` + manyKeys.String() + `}]}`},
		{"tools nested arrays at the depth limit", ParseOpenAIChat, `{"model":"m","messages":[],"tools":[` + nested("[", "]", maxJSONDepth-3) + `]}`},
		{"tools nested unsorted objects", ParseOpenAIChat, `{"model":"m","messages":[],"tools":[` + unsortedDeep.String() + `]}`},
		{"unknown field nested at the depth limit", ParseOpenAIChat, `{"model":"m","messages":[],"x":` + nested("[", "]", maxJSONDepth-1) + `}`},
		{"long escaped string", ParseOpenAICompletion, `{"model":"m","prompt":"` + strings.Repeat(`a\n\u00e9\"`, 200000) + `"}`},
		{"many token IDs", ParseOpenAICompletion, `{"model":"m","prompt":[` + strings.Repeat("4294967295,", 200000) + `0]}`},
		{"anthropic tool_use inputs", ParseAnthropicMessages, `{"model":"c","messages":[{"role":"assistant","content":[` +
			strings.Repeat(`{"type":"tool_use","id":"t","name":"f","input":{"z":1,"a":[1,2,3]}},`, n) + `{"type":"text","text":"x"}]}]}`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			_, err := tc.parse([]byte(tc.body))
			require.NoError(t, err)
			elapsed := time.Since(start)
			t.Logf("%d bytes in %v", len(tc.body), elapsed)
			require.Less(t, elapsed, 20*time.Second)
		})
	}
}

// TestParseAllocs pins the allocation count of parsing the 8 KiB benchmark body.
func TestParseAllocs(t *testing.T) {
	if testing.Short() || raceEnabled {
		t.Skip("allocation counts")
	}
	body := parseBenchChatBody(8 << 10)
	n := testing.AllocsPerRun(20, func() {
		if _, err := ParseOpenAIChat(body); err != nil {
			t.Fatal(err)
		}
	})
	t.Logf("ParseOpenAIChat(8 KiB): %v allocs", n)
	if n > 34 { // the message text, system prompt, part data and extra arenas are four of them
		t.Errorf("ParseOpenAIChat(8 KiB) allocates %v times, want <= 34", n)
	}
}
