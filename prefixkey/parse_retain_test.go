package prefixkey

import (
	"runtime"
	"strings"
	"testing"
)

// retained returns the heap bytes that parsing body leaves live while the Request is kept:
// HeapAlloc after a collection with the Request alive, less HeapAlloc after one without it.
func retained(t *testing.T, f Format, body []byte) (int64, *Request) {
	t.Helper()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	r, err := Parse(f, body)
	if err != nil {
		t.Fatal(err)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	runtime.KeepAlive(body)
	return int64(after.HeapAlloc) - int64(before.HeapAlloc), r
}

// A parsed Request holds no copy of a long text written in the body without escapes: its
// strings refer to the body, which the caller holds anyway (kvhttp until the request is done).
// What it keeps is bounded in bytes, not by the body's size.
func TestParseHoldsNoCopyOfPlainText(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector's allocations blur the heap measure")
	}
	doc := strings.Repeat("The proxy routes this long pasted document by its prefix. ", (8<<20)/59)
	bodies := map[Format]string{
		FormatOpenAIChat: `{"model":"m","messages":[{"role":"system","content":"` + doc[:4096] + `"},` +
			`{"role":"user","content":"` + doc + `"},{"role":"user","content":[{"type":"text","text":"` + doc[:1<<20] + `"}]}]}`,
		FormatOpenAICompletion:  `{"model":"m","prompt":"` + doc + `"}`,
		FormatAnthropicMessages: `{"model":"m","max_tokens":1,"system":"` + doc[:4096] + `","messages":[{"role":"user","content":"` + doc + `"}]}`,
	}
	for f, body := range bodies {
		held, r := retained(t, f, []byte(body))
		if held > 256<<10 {
			t.Errorf("%v: a parsed body of %d bytes holds %d bytes beyond it, want ≤ 256 KiB", f, len(body), held)
		}
		// The views read what a copy would.
		if tag, anchor, _ := r.Anchor(); f != FormatOpenAICompletion && (tag != 'S' || anchor != doc[:4096]) {
			t.Errorf("%v: anchor %c %.40q…", f, tag, anchor)
		}
		switch f {
		case FormatOpenAICompletion:
			if r.Prompt[0] != doc {
				t.Errorf("prompt differs")
			}
		default:
			if r.Messages[0].Text != doc || r.Messages[0].Parts[0].Text != doc {
				t.Errorf("%v: message text differs", f)
			}
		}
		if f == FormatOpenAIChat && (r.Messages[1].Text != doc[:1<<20] || r.Messages[1].Parts[0].Text != doc[:1<<20]) {
			t.Errorf("text part differs")
		}
	}
}

// A text with escapes is decoded, hence copied, once: the Request holds about its decoded size,
// not the arena's capacity.
func TestParseHoldsEscapedTextOnce(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector's allocations blur the heap measure")
	}
	doc := strings.Repeat(`A line of a pasted document.\n`, (4<<20)/30)
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"` + doc + `"}]}`)
	held, r := retained(t, FormatOpenAIChat, body)
	decoded := len(r.Messages[0].Text)
	if held > int64(decoded)+256<<10 {
		t.Errorf("a body of %d bytes whose text decodes to %d holds %d bytes", len(body), decoded, held)
	}
}

func TestEscapedStringBytes(t *testing.T) {
	for in, want := range map[string]int{
		``:                               0,
		`{"a":"plain"}`:                  0,
		`{"a":"x\ny"}`:                   4,
		`{"a":"say \"hi\"","b":"plain"}`: 10,
		`{"a":"ends in \\","b":"c"}`:     10,
		`{"a":"q\\\"q"}`:                 6,
		`{"k\t":1}`:                      3,
		`"unterminated \n`:               len(`unterminated \n`),
		`"x\"`:                           3,
	} {
		if got := escapedStringBytes([]byte(in)); got != want {
			t.Errorf("escapedStringBytes(%s) = %d, want %d", in, got, want)
		}
	}
}

// EstimateParseCost covers what a parse holds: the decoded copy of escaped text, and per
// object; a long text written without escapes costs nothing.
func TestEstimateParseCost(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector's allocations blur the heap measure")
	}
	plain := strings.Repeat("The proxy routes this long pasted document by its prefix. ", (8<<20)/59)
	escaped := strings.Repeat(`A line of a pasted document.\n`, (8<<20)/30)
	many := strings.Repeat(`{"role":"user","content":"word"},`, 100000)
	for name, body := range map[string]string{
		"plain":   `{"model":"m","messages":[{"role":"user","content":"` + plain + `"}]}`,
		"escaped": `{"model":"m","messages":[{"role":"user","content":"` + escaped + `"}]}`,
		"many":    `{"model":"m","messages":[` + many + `{"role":"user","content":"end"}]}`,
	} {
		est := EstimateParseCost([]byte(body))
		held, _ := retained(t, FormatOpenAIChat, []byte(body))
		if held > est {
			t.Errorf("%s: parsing holds %d bytes, above the estimate %d", name, held, est)
		}
		if name != "many" && est > held+int64(len(body))/10 {
			t.Errorf("%s: estimate %d far above the %d bytes held", name, est, held)
		}
	}
}
