package respcache

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/prefixkey"
)

// referenceKey is the key layout of the package doc written the obvious way: build the whole input,
// then hash it. KeyOf must agree with it on every request.
func referenceKey(r *prefixkey.Request) Key {
	le64 := func(b []byte, v uint64) []byte { return binary.LittleEndian.AppendUint64(b, v) }
	str := func(b []byte, s string) []byte { return append(le64(b, uint64(len(s))), s...) }
	optStr := func(b []byte, some bool, s string) []byte {
		if !some {
			return append(b, 0)
		}
		return str(append(b, 1), s)
	}
	optF := func(b []byte, o prefixkey.Opt[float64]) []byte {
		if !o.Set {
			return append(b, 0)
		}
		v := o.V
		if v == 0 {
			v = 0
		}
		return le64(append(b, 1), math.Float64bits(v))
	}
	optI := func(b []byte, o prefixkey.Opt[int64]) []byte {
		if !o.Set {
			return append(b, 0)
		}
		return le64(append(b, 1), uint64(o.V))
	}

	var c []byte
	c = optStr(c, r.HasSystem, r.System)
	c = le64(c, uint64(len(r.Messages)))
	for _, m := range r.Messages {
		c = str(c, m.Role)
		parts := m.Parts
		if len(parts) == 0 {
			parts = []prefixkey.Part{{Type: "text", Text: m.Text}}
		}
		c = le64(c, uint64(len(parts)))
		for _, p := range parts {
			c = str(str(str(c, p.Type), p.Text), p.Data)
		}
		c = optStr(c, m.Extra != nil, string(m.Extra))
	}
	c = le64(c, uint64(len(r.Prompt)))
	for _, p := range r.Prompt {
		c = str(c, p)
	}
	c = le64(c, uint64(len(r.PromptTokens)))
	for _, t := range r.PromptTokens {
		c = binary.LittleEndian.AppendUint32(c, t)
	}
	conv := sha256.Sum256(c)

	o := []byte("kvroute/respcache/key/v2\x00")
	o = str(o, r.Model)
	o = append(o, 0)
	o = append(o, conv[:]...)
	o = append(o, 0, byte(r.Format))
	o = str(o, r.Adapter)
	o = optStr(o, r.Tenant != "", r.Tenant)
	o = str(o, r.CacheSalt)
	p := r.Params
	if p.Stream {
		o = append(o, 1)
	} else {
		o = append(o, 0)
	}
	o = optF(o, p.Temperature)
	o = optF(o, p.TopP)
	o = optI(o, p.MaxTokens)
	o = optI(o, p.MaxCompletionTokens)
	o = optI(o, p.N)
	o = optI(o, p.Seed)
	o = optF(o, p.PresencePenalty)
	o = optF(o, p.FrequencyPenalty)
	if p.Stop == nil {
		o = append(o, 0)
	} else {
		o = le64(append(o, 1), uint64(len(p.Stop)))
		for _, s := range p.Stop {
			o = str(o, s)
		}
	}
	for _, raw := range [][]byte{p.ResponseFormat, p.LogitBias, p.Tools, p.ToolChoice, p.Other} {
		o = optStr(o, raw != nil, string(raw))
	}
	o = le64(o, uint64(len(r.MultiModal)))
	for _, s := range r.MultiModal {
		o = le64(le64(le64(o, uint64(s.Offset)), uint64(s.Length)), s.Hash)
	}
	return sha256.Sum256(o)
}

// randString returns a string whose length is drawn to hit the scratch buffer's edges (directWrite,
// scratchFlush) as often as the common short and long cases.
func randString(rng *rand.Rand) string {
	var n int
	switch rng.IntN(6) {
	case 0:
		n = 0
	case 1:
		n = directWrite - 1 + rng.IntN(3)
	case 2:
		n = scratchFlush - 8 + rng.IntN(16)
	case 3:
		n = rng.IntN(2000)
	default:
		n = rng.IntN(40)
	}
	b := make([]byte, n)
	for i := range b {
		b[i] = byte('a' + rng.IntN(26))
	}
	return string(b)
}

func randJSON(rng *rand.Rand) json.RawMessage {
	if rng.IntN(3) == 0 {
		return nil
	}
	return json.RawMessage(fmt.Sprintf(`{"k":%q}`, randString(rng)))
}

func randOptF(rng *rand.Rand) prefixkey.Opt[float64] {
	if rng.IntN(2) == 0 {
		return prefixkey.Opt[float64]{}
	}
	return prefixkey.Some(float64(rng.IntN(3)) / 2)
}

func randOptI(rng *rand.Rand) prefixkey.Opt[int64] {
	if rng.IntN(2) == 0 {
		return prefixkey.Opt[int64]{}
	}
	return prefixkey.Some(int64(rng.IntN(3)))
}

// randRequest returns a random request exercising every field KeyOf reads.
func randRequest(rng *rand.Rand) *prefixkey.Request {
	r := &prefixkey.Request{
		Format:    prefixkey.Format(1 + rng.IntN(3)),
		Model:     randString(rng),
		Adapter:   randString(rng),
		Tenant:    randString(rng),
		CacheSalt: randString(rng),
	}
	if rng.IntN(2) == 0 {
		r.System, r.HasSystem = randString(rng), true
	}
	for range rng.IntN(6) {
		m := prefixkey.Message{Role: []string{"user", "assistant", "tool"}[rng.IntN(3)], Extra: randJSON(rng)}
		if rng.IntN(4) == 0 {
			m.Text = randString(rng) // no parts: keyed as one text part
		}
		for range rng.IntN(4) {
			if rng.IntN(2) == 0 {
				t := randString(rng)
				m.Parts = append(m.Parts, prefixkey.Part{Type: "text", Text: t})
				m.Text += t
			} else {
				m.Parts = append(m.Parts, prefixkey.Part{Type: "image_url", Data: randString(rng)})
			}
		}
		r.Messages = append(r.Messages, m)
	}
	for range rng.IntN(3) {
		r.Prompt = append(r.Prompt, randString(rng))
	}
	for range rng.IntN(200) {
		r.PromptTokens = append(r.PromptTokens, rng.Uint32())
	}
	p := &r.Params
	p.Stream = rng.IntN(2) == 0
	p.Temperature, p.TopP, p.PresencePenalty, p.FrequencyPenalty = randOptF(rng), randOptF(rng), randOptF(rng), randOptF(rng)
	p.MaxTokens, p.MaxCompletionTokens, p.N, p.Seed = randOptI(rng), randOptI(rng), randOptI(rng), randOptI(rng)
	if rng.IntN(2) == 0 {
		p.Stop = []string{}
		for range rng.IntN(4) {
			p.Stop = append(p.Stop, randString(rng))
		}
	}
	p.ResponseFormat, p.LogitBias, p.Tools, p.ToolChoice = randJSON(rng), randJSON(rng), randJSON(rng), randJSON(rng)
	for range rng.IntN(3) {
		r.MultiModal = append(r.MultiModal, prefixkey.MultiModalSpan{Offset: rng.IntN(100), Length: rng.IntN(100), Hash: rng.Uint64()})
	}
	return r
}

func TestKeyOfMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	n := 2000
	if testing.Short() {
		n = 200
	}
	for i := range n {
		r := randRequest(rng)
		if got, want := KeyOf(r), referenceKey(r); got != want {
			t.Fatalf("request %d: KeyOf = %v, reference layout = %v\n%+v", i, got, want, r)
		}
	}
}

// TestKeyOfVectors pins keys: a change of layout must change keyVersion and these vectors together.
func TestKeyOfVectors(t *testing.T) {
	for _, tc := range []struct {
		name string
		req  prefixkey.Request
		want string
	}{
		{"zero request", prefixkey.Request{}, "f49e3e4b0cd9b7930cdad84930d9a4a196fe407bbf4e9e934967e6d3ca96ce8d"},
		{"chat", prefixkey.Request{
			Format: prefixkey.FormatOpenAIChat, Model: "gpt-4o", System: "You are terse.", HasSystem: true,
			Messages: []prefixkey.Message{{Role: "user", Text: "Hello", Parts: []prefixkey.Part{{Type: "text", Text: "Hello"}}}},
			Params:   prefixkey.Params{Temperature: prefixkey.Some(0.0), MaxTokens: prefixkey.Some[int64](64)},
		}, "ea5b30ebfce370c2dea432570d295f054df8ecd1569d4c24ba15a625354c7038"},
		{"completion with tenant", prefixkey.Request{
			Format: prefixkey.FormatOpenAICompletion, Model: "llama", Tenant: "acme", Prompt: []string{"Once upon"},
			Params: prefixkey.Params{Stream: true, Stop: []string{"\n"}},
		}, "cb1a9e3d9c97fe79ed7c5e83668eb20146d3c6719d574c168ed4bbb73e28c6d9"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := KeyOf(&tc.req).String(); got != tc.want {
				t.Errorf("KeyOf = %s, want %s", got, tc.want)
			}
		})
	}
}

// mutation changes one thing of a request that must change its key.
type mutation struct {
	name string
	f    func(r *prefixkey.Request)
}

func flipF(o *prefixkey.Opt[float64]) {
	if o.Set && o.V == 0 {
		o.Set = false
	} else if o.Set {
		o.V = 0
	} else {
		*o = prefixkey.Some(0.0) // absent → zero
	}
}

func flipI(o *prefixkey.Opt[int64]) {
	if o.Set && o.V == 0 {
		o.Set = false
	} else if o.Set {
		o.V = 0
	} else {
		*o = prefixkey.Some[int64](0)
	}
}

func flipJSON(j *json.RawMessage) {
	if *j == nil {
		*j = json.RawMessage(`{}`)
	} else {
		*j = append(append(json.RawMessage(nil), (*j)[:len(*j)-1]...), `,"z":1}`...)
	}
}

var mutations = []mutation{
	{"model", func(r *prefixkey.Request) { r.Model += "x" }},
	{"format", func(r *prefixkey.Request) { r.Format = r.Format%3 + 1 }},
	{"adapter", func(r *prefixkey.Request) { r.Adapter += "x" }},
	{"tenant", func(r *prefixkey.Request) { r.Tenant += "x" }},
	{"cache_salt", func(r *prefixkey.Request) { r.CacheSalt += "x" }},
	{"system", func(r *prefixkey.Request) { r.System += "x"; r.HasSystem = true }},
	{"system_presence", func(r *prefixkey.Request) {
		if r.HasSystem && r.System == "" {
			r.HasSystem = false
		} else {
			r.System, r.HasSystem = "", true
		}
	}},
	{"message_added", func(r *prefixkey.Request) {
		r.Messages = append(r.Messages, prefixkey.Message{Role: "user", Parts: []prefixkey.Part{{Type: "text"}}})
	}},
	{"message_role", func(r *prefixkey.Request) { msg(r).Role += "x" }},
	{"message_text", func(r *prefixkey.Request) {
		m := msg(r)
		m.Parts = append(m.Parts, prefixkey.Part{Type: "text", Text: "x"})
	}},
	{"message_part_text", func(r *prefixkey.Request) { part(r).Text += "x" }},
	{"message_part_type", func(r *prefixkey.Request) { part(r).Type += "x" }},
	{"message_part_data", func(r *prefixkey.Request) { part(r).Data += "x" }},
	{"message_extra", func(r *prefixkey.Request) { flipJSON(&msg(r).Extra) }},
	{"prompt", func(r *prefixkey.Request) { r.Prompt = append(r.Prompt, "") }},
	{"prompt_tokens", func(r *prefixkey.Request) { r.PromptTokens = append(r.PromptTokens, 0) }},
	{"multimodal", func(r *prefixkey.Request) { r.MultiModal = append(r.MultiModal, prefixkey.MultiModalSpan{}) }},
	{"stream", func(r *prefixkey.Request) { r.Params.Stream = !r.Params.Stream }},
	{"temperature", func(r *prefixkey.Request) { flipF(&r.Params.Temperature) }},
	{"top_p", func(r *prefixkey.Request) { flipF(&r.Params.TopP) }},
	{"presence_penalty", func(r *prefixkey.Request) { flipF(&r.Params.PresencePenalty) }},
	{"frequency_penalty", func(r *prefixkey.Request) { flipF(&r.Params.FrequencyPenalty) }},
	{"max_tokens", func(r *prefixkey.Request) { flipI(&r.Params.MaxTokens) }},
	{"max_completion_tokens", func(r *prefixkey.Request) { flipI(&r.Params.MaxCompletionTokens) }},
	{"n", func(r *prefixkey.Request) { flipI(&r.Params.N) }},
	{"seed", func(r *prefixkey.Request) { flipI(&r.Params.Seed) }},
	{"stop", func(r *prefixkey.Request) {
		if r.Params.Stop == nil {
			r.Params.Stop = []string{}
		} else {
			r.Params.Stop = append(r.Params.Stop[:len(r.Params.Stop):len(r.Params.Stop)], "")
		}
	}},
	{"response_format", func(r *prefixkey.Request) { flipJSON(&r.Params.ResponseFormat) }},
	{"logit_bias", func(r *prefixkey.Request) { flipJSON(&r.Params.LogitBias) }},
	{"tools", func(r *prefixkey.Request) { flipJSON(&r.Params.Tools) }},
	{"tool_choice", func(r *prefixkey.Request) { flipJSON(&r.Params.ToolChoice) }},
}

// msg returns a random-but-present message of r (adding one when r has none).
func msg(r *prefixkey.Request) *prefixkey.Message {
	if len(r.Messages) == 0 {
		r.Messages = []prefixkey.Message{{Role: "user"}}
	}
	return &r.Messages[len(r.Messages)-1]
}

func part(r *prefixkey.Request) *prefixkey.Part {
	m := msg(r)
	if len(m.Parts) == 0 {
		m.Parts = []prefixkey.Part{{Type: "text", Text: m.Text}}
	}
	return &m.Parts[len(m.Parts)-1]
}

// cloneRequest deep-copies the parts of r that mutations change.
func cloneRequest(r *prefixkey.Request) *prefixkey.Request {
	c := *r
	c.Messages = make([]prefixkey.Message, len(r.Messages))
	for i, m := range r.Messages {
		m.Parts = append([]prefixkey.Part(nil), m.Parts...)
		c.Messages[i] = m
	}
	c.Prompt = append([]string(nil), r.Prompt...)
	c.PromptTokens = append([]uint32(nil), r.PromptTokens...)
	c.MultiModal = append([]prefixkey.MultiModalSpan(nil), r.MultiModal...)
	return &c
}

func TestKeyOfChangesWithEveryField(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	rounds := 300
	if testing.Short() {
		rounds = 50
	}
	for _, m := range mutations {
		t.Run(m.name, func(t *testing.T) {
			for i := range rounds {
				r := randRequest(rng)
				before := KeyOf(r)
				c := cloneRequest(r)
				m.f(c)
				if KeyOf(c) == before {
					t.Fatalf("round %d: key unchanged\nbefore %+v\nafter  %+v", i, r, c)
				}
				if KeyOf(r) != before {
					t.Fatalf("round %d: mutating the clone changed the original's key", i)
				}
			}
		})
	}
}

// TestKeyOfFieldSplits checks pairs that a concatenation without length prefixes would confuse.
func TestKeyOfFieldSplits(t *testing.T) {
	text := func(s ...string) []prefixkey.Part {
		var ps []prefixkey.Part
		for _, x := range s {
			ps = append(ps, prefixkey.Part{Type: "text", Text: x})
		}
		return ps
	}
	for _, tc := range []struct {
		name string
		a, b prefixkey.Request
	}{
		{"model/system", prefixkey.Request{Model: "ab", System: "c", HasSystem: true}, prefixkey.Request{Model: "a", System: "bc", HasSystem: true}},
		{"system absent/empty", prefixkey.Request{}, prefixkey.Request{HasSystem: true}},
		{"parts split", prefixkey.Request{Messages: []prefixkey.Message{{Role: "user", Parts: text("ab")}}},
			prefixkey.Request{Messages: []prefixkey.Message{{Role: "user", Parts: text("a", "b")}}}},
		{"messages split", prefixkey.Request{Messages: []prefixkey.Message{{Role: "user", Parts: text("a", "b")}}},
			prefixkey.Request{Messages: []prefixkey.Message{{Role: "user", Parts: text("a")}, {Role: "user", Parts: text("b")}}}},
		{"text/data", prefixkey.Request{Messages: []prefixkey.Message{{Role: "user", Parts: []prefixkey.Part{{Type: "x", Text: "a"}}}}},
			prefixkey.Request{Messages: []prefixkey.Message{{Role: "user", Parts: []prefixkey.Part{{Type: "x", Data: "a"}}}}}},
		{"stop split", prefixkey.Request{Params: prefixkey.Params{Stop: []string{"ab"}}}, prefixkey.Request{Params: prefixkey.Params{Stop: []string{"a", "b"}}}},
		{"stop absent/empty", prefixkey.Request{}, prefixkey.Request{Params: prefixkey.Params{Stop: []string{}}}},
		{"prompt split", prefixkey.Request{Prompt: []string{"ab"}}, prefixkey.Request{Prompt: []string{"a", "b"}}},
		{"tenant/adapter", prefixkey.Request{Adapter: "a", Tenant: "b"}, prefixkey.Request{Adapter: "ab"}},
		{"tenant/salt", prefixkey.Request{Tenant: "ab"}, prefixkey.Request{Tenant: "a", CacheSalt: "b"}},
		{"tools/tool_choice", prefixkey.Request{Params: prefixkey.Params{Tools: json.RawMessage(`[1]`)}},
			prefixkey.Request{Params: prefixkey.Params{ToolChoice: json.RawMessage(`[1]`)}}},
		{"temperature absent/0", prefixkey.Request{}, prefixkey.Request{Params: prefixkey.Params{Temperature: prefixkey.Some(0.0)}}},
		{"max_tokens absent/0", prefixkey.Request{}, prefixkey.Request{Params: prefixkey.Params{MaxTokens: prefixkey.Some[int64](0)}}},
		{"max_tokens/max_completion_tokens", prefixkey.Request{Params: prefixkey.Params{MaxTokens: prefixkey.Some[int64](5)}},
			prefixkey.Request{Params: prefixkey.Params{MaxCompletionTokens: prefixkey.Some[int64](5)}}},
		{"prompt/prompt tokens", prefixkey.Request{Prompt: []string{"\x01\x00\x00\x00"}}, prefixkey.Request{PromptTokens: []uint32{1}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if KeyOf(&tc.a) == KeyOf(&tc.b) {
				t.Errorf("same key for\n%+v\n%+v", tc.a, tc.b)
			}
		})
	}
}

func TestKeyOfEquivalences(t *testing.T) {
	for _, tc := range []struct {
		name string
		a, b prefixkey.Request
	}{
		{"temperature -0 and 0", prefixkey.Request{Params: prefixkey.Params{Temperature: prefixkey.Some(math.Copysign(0, -1))}},
			prefixkey.Request{Params: prefixkey.Params{Temperature: prefixkey.Some(0.0)}}},
		{"message without parts is one text part", prefixkey.Request{Messages: []prefixkey.Message{{Role: "user", Text: "hi"}}},
			prefixkey.Request{Messages: []prefixkey.Message{{Role: "user", Text: "hi", Parts: []prefixkey.Part{{Type: "text", Text: "hi"}}}}}},
		{"TokenIDs are not keyed", prefixkey.Request{Model: "m"}, prefixkey.Request{Model: "m", TokenIDs: []uint32{1, 2}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if KeyOf(&tc.a) != KeyOf(&tc.b) {
				t.Errorf("different keys for\n%+v\n%+v", tc.a, tc.b)
			}
		})
	}
}

// TestKeyOfParsedBodies parses bodies and compares their keys: key order in JSON objects never
// matters, values always do.
func TestKeyOfParsedBodies(t *testing.T) {
	const base = `{"model":"gpt-4o","temperature":0,"max_tokens":64,
		"messages":[{"role":"system","content":"Be terse."},
			{"role":"user","content":[{"type":"text","text":"What is"},{"type":"image_url","image_url":{"url":"https://x/a.png","detail":"low"}}]},
			{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},
			{"role":"tool","tool_call_id":"c1","content":"42"}],
		"tools":[{"type":"function","function":{"name":"f","description":"d","parameters":{"type":"object","properties":{"a":{"type":"string"},"b":{"type":"integer"}}}}}],
		"tool_choice":{"type":"function","function":{"name":"f"}},
		"response_format":{"type":"json_schema","json_schema":{"name":"s","schema":{"type":"object","required":["a"]}}},
		"logit_bias":{"50256":-100,"1":2},
		"stop":["\n\n"],"seed":7,"top_p":1,"n":1}`
	const reordered = `{"n":1,"top_p":1,"seed":7,"stop":["\n\n"],
		"logit_bias":{"1":2,"50256":-100},
		"response_format":{"json_schema":{"schema":{"required":["a"],"type":"object"},"name":"s"},"type":"json_schema"},
		"tool_choice":{"function":{"name":"f"},"type":"function"},
		"tools":[{"function":{"parameters":{"properties":{"b":{"type":"integer"},"a":{"type":"string"}},"type":"object"},"description":"d","name":"f"},"type":"function"}],
		"messages":[{"content":"Be terse.","role":"system"},
			{"content":[{"text":"What is","type":"text"},{"image_url":{"detail":"low","url":"https://x/a.png"},"type":"image_url"}],"role":"user"},
			{"tool_calls":[{"function":{"arguments":"{}","name":"f"},"type":"function","id":"c1"}],"content":null,"role":"assistant"},
			{"content":"42","tool_call_id":"c1","role":"tool"}],
		"max_tokens":64,"temperature":0,"model":"gpt-4o"}`
	parse := func(t *testing.T, body string) Key {
		t.Helper()
		r, err := prefixkey.ParseOpenAIChat([]byte(body))
		if err != nil {
			t.Fatal(err)
		}
		return KeyOf(r)
	}
	want := parse(t, base)
	if got := parse(t, reordered); got != want {
		t.Fatalf("reordered body: key %v, want %v", got, want)
	}
	for _, tc := range []struct{ name, old, new string }{
		{"temperature absent", `"temperature":0,`, ``},
		{"max_tokens 65", `"max_tokens":64`, `"max_tokens":65`},
		{"max_tokens absent", `"max_tokens":64,`, ``},
		{"stream", `"n":1}`, `"n":1,"stream":true}`},
		{"system", `Be terse.`, `Be terse!`},
		{"image detail", `"detail":"low"`, `"detail":"high"`},
		{"tool call arguments", `"arguments":"{}"`, `"arguments":"{\"x\":1}"`},
		{"tool call id", `"tool_call_id":"c1"`, `"tool_call_id":"c2"`},
		{"nested tool schema", `"b":{"type":"integer"}`, `"b":{"type":"number"}`},
		{"response_format schema", `"required":["a"]`, `"required":[]`},
		{"logit_bias", `"1":2`, `"1":3`},
		{"tool_choice", `"function":{"name":"f"}}`, `"function":{"name":"g"}}`},
		{"seed", `"seed":7`, `"seed":8`},
		{"model", `"gpt-4o"`, `"gpt-4o-mini"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := strings.Replace(base, tc.old, tc.new, 1)
			if body == base {
				t.Fatalf("replacement %q not found", tc.old)
			}
			if parse(t, body) == want {
				t.Errorf("changing %s kept the key", tc.name)
			}
		})
	}
}

func TestKeyString(t *testing.T) {
	var k Key
	for i := range k {
		k[i] = byte(i * 7)
	}
	s := k.String()
	if len(s) != 64 || strings.ToLower(s) != s {
		t.Fatalf("String() = %q: want 64 lowercase hex digits", s)
	}
	b, _ := k.MarshalText()
	if string(b) != s {
		t.Fatalf("MarshalText = %q, String = %q", b, s)
	}
	b, _ = k.AppendText([]byte("cr:resp:"))
	if string(b) != "cr:resp:"+s {
		t.Fatalf("AppendText = %q", b)
	}
}

func TestKeyOfAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates")
	}
	r := benchRequest(8 << 10)
	if n := testing.AllocsPerRun(100, func() { _ = KeyOf(r) }); n != 0 {
		t.Errorf("KeyOf allocates %v times per call, want 0", n)
	}
}

// Fields prefixkey does not model still split the cache: two bodies that differ only in logprobs
// must not share an entry, while output-neutral ones (user) do.
func TestKeyCoversUnmodelledFields(t *testing.T) {
	base := `{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0`
	parse := func(extra string) Key {
		r, err := prefixkey.ParseOpenAIChat([]byte(base + extra + `}`))
		if err != nil {
			t.Fatal(err)
		}
		return KeyOf(r)
	}
	if parse(``) == parse(`,"logprobs":true`) {
		t.Error("logprobs does not change the key")
	}
	if parse(`,"top_logprobs":2,"logprobs":true`) != parse(`,"logprobs":true,"top_logprobs":2`) {
		t.Error("the order of unmodelled fields changes the key")
	}
	if parse(``) != parse(`,"user":"alice"`) {
		t.Error("user splits the cache")
	}
}

// vLLM's cache_salt and the media of a request split the cache: two tenants' salted requests never
// share an answer, nor do requests that differ only in an image, audio clip or its uuid; the same
// salt and the same media do share.
func TestKeyOfCacheSaltAndMedia(t *testing.T) {
	chat := func(t *testing.T, content, extra string) Key {
		t.Helper()
		r, err := prefixkey.ParseOpenAIChat([]byte(`{"model":"m","temperature":0,` + extra +
			`"messages":[{"role":"user","content":` + content + `}]}`))
		if err != nil {
			t.Fatal(err)
		}
		return KeyOf(r)
	}
	img := func(url, more string) string {
		return `[{"type":"text","text":"What is this?"},{"type":"image_url","image_url":{"url":"` + url + `"}` + more + `}]`
	}
	t.Run("cache_salt", func(t *testing.T) {
		plain, a, b := chat(t, `"hi"`, ``), chat(t, `"hi"`, `"cache_salt":"tenant-a",`), chat(t, `"hi"`, `"cache_salt":"tenant-b",`)
		if plain == a || a == b || plain == b {
			t.Errorf("salts share keys: none %v, tenant-a %v, tenant-b %v", plain, a, b)
		}
		if a != chat(t, `"hi"`, `"cache_salt":"tenant-a",`) {
			t.Error("the same salt gave two keys")
		}
		r, _ := prefixkey.ParseOpenAIChat([]byte(`{"model":"m","cache_salt":"tenant-a","messages":[{"role":"user","content":"hi"}]}`))
		if r.CacheSalt != "tenant-a" || r.Params.Other != nil {
			t.Fatalf("cache_salt parsed to CacheSalt %q, Other %s", r.CacheSalt, r.Params.Other)
		}
	})
	t.Run("media", func(t *testing.T) {
		a := chat(t, img("https://x/a.png", ``), ``)
		for name, other := range map[string]Key{
			"other url":       chat(t, img("https://x/b.png", ``), ``),
			"other data":      chat(t, img("data:image/png;base64,QUJE", ``), ``),
			"uuid":            chat(t, img("https://x/a.png", `,"uuid":"sku-1"`), ``),
			"no image":        chat(t, `[{"type":"text","text":"What is this?"}]`, ``),
			"input_audio":     chat(t, `[{"type":"text","text":"What is this?"},{"type":"input_audio","input_audio":{"data":"QUJD","format":"wav"}}]`, ``),
			"image and salt":  chat(t, img("https://x/a.png", ``), `"cache_salt":"s",`),
			"other uuid":      chat(t, img("https://x/a.png", `,"uuid":"sku-2"`), ``),
			"data vs data":    chat(t, img("data:image/png;base64,QUJD", ``), ``),
			"audio data diff": chat(t, `[{"type":"text","text":"What is this?"},{"type":"input_audio","input_audio":{"data":"QUJE","format":"wav"}}]`, ``),
		} {
			if other == a {
				t.Errorf("%s: same key as the image at https://x/a.png", name)
			}
		}
		if a != chat(t, img("https://x/a.png", ``), ``) {
			t.Error("the same image gave two keys")
		}
		if chat(t, img("https://x/a.png", `,"uuid":"sku-1"`), ``) == chat(t, img("https://x/a.png", `,"uuid":"sku-2"`), ``) {
			t.Error("two uuids share a key")
		}
		an := func(src string) Key {
			r, err := prefixkey.ParseAnthropicMessages([]byte(`{"model":"m","max_tokens":8,"temperature":0,"messages":[{"role":"user","content":[{"type":"image","source":` + src + `}]}]}`))
			if err != nil {
				t.Fatal(err)
			}
			return KeyOf(r)
		}
		if an(`{"type":"url","url":"https://x/a.png"}`) == an(`{"type":"url","url":"https://x/b.png"}`) ||
			an(`{"type":"base64","media_type":"image/png","data":"QUJD"}`) == an(`{"type":"base64","media_type":"image/png","data":"QUJE"}`) {
			t.Error("anthropic images share keys")
		}
	})
}
