package events

import (
	"io"
	"strings"
	"testing"
	"testing/iotest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// parsed is what the parser reported for a stream.
type parsed struct {
	events    []string // "type|data"
	oversized int
	id        string
	retry     time.Duration
}

func (p *parsed) dispatch(typ string, data []byte) {
	p.events = append(p.events, typ+"|"+string(data))
}

// parsedHooks records the parser's other callbacks into a parsed.
type parsedHooks struct{ p *parsed }

func (h parsedHooks) oversized(int)            { h.p.oversized++ }
func (h parsedHooks) setID(id []byte)          { h.p.id = string(id) }
func (h parsedHooks) setRetry(d time.Duration) { h.p.retry = d }

func TestSSEParser(t *testing.T) {
	big := strings.Repeat("x", 100)
	for _, tc := range []struct {
		name   string
		stream string
		max    int
		want   parsed
	}{
		{name: "seeds' form", stream: "event: cache_created\ndata: {\"a\":1}\n\n",
			want: parsed{events: []string{"cache_created|{\"a\":1}"}}},
		{name: "no event field", stream: "data: {}\n\n", want: parsed{events: []string{"|{}"}}},
		{name: "data lines joined by newline", stream: "data: a\ndata: b\ndata:c\n\n", want: parsed{events: []string{"|a\nb\nc"}}},
		{name: "only one leading space is stripped", stream: "data:  a\n\n", want: parsed{events: []string{"| a"}}},
		{name: "comments ignored", stream: ": keepalive\nevent: e\n: more\ndata: d\n\n:bye\n\n", want: parsed{events: []string{"e|d"}}},
		{name: "CRLF", stream: "event: e\r\ndata: d\r\n\r\n", want: parsed{events: []string{"e|d"}}},
		{name: "lone CR", stream: "event: e\rdata: d\r\r", want: parsed{events: []string{"e|d"}}},
		{name: "event type resets after dispatch", stream: "event: e\ndata: 1\n\ndata: 2\n\n", want: parsed{events: []string{"e|1", "|2"}}},
		{name: "event without data is not dispatched", stream: "event: e\n\ndata: 2\n\n", want: parsed{events: []string{"|2"}}},
		{name: "empty data line dispatches empty data", stream: "data\n\n", want: parsed{events: []string{"|"}}},
		{name: "unknown fields ignored", stream: "foo: bar\ndata: d\n\n", want: parsed{events: []string{"|d"}}},
		{name: "unterminated last event discarded", stream: "data: a\n\ndata: b\n", want: parsed{events: []string{"|a"}}},
		{name: "id and retry", stream: "id: 42\nretry: 1500\ndata: d\n\n", want: parsed{events: []string{"|d"}, id: "42", retry: 1500 * time.Millisecond}},
		{name: "bad retry ignored", stream: "retry: soon\ndata: d\n\n", want: parsed{events: []string{"|d"}}},
		{name: "oversized line dropped, stream resyncs", max: 64,
			stream: "event: e\ndata: " + big + "\ndata: more\n\nevent: f\ndata: ok\n\n",
			want:   parsed{events: []string{"f|ok"}, oversized: 1}},
		{name: "oversized event from many lines", max: 64,
			stream: strings.Repeat("data: 0123456789\n", 10) + "\ndata: ok\n\n",
			want:   parsed{events: []string{"|ok"}, oversized: 1}},
		{name: "line at the cap accepted", max: 16, stream: "data: 0123456789\n\n", want: parsed{events: []string{"|0123456789"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			max := tc.max
			if max == 0 {
				max = DefaultSSEMaxEventSize
			}
			for name, rd := range map[string]func() io.Reader{
				"whole":        func() io.Reader { return strings.NewReader(tc.stream) },
				"byte by byte": func() io.Reader { return iotest.OneByteReader(strings.NewReader(tc.stream)) },
				"half":         func() io.Reader { return iotest.HalfReader(strings.NewReader(tc.stream)) },
			} {
				t.Run(name, func(t *testing.T) {
					var got parsed
					p := sseParser{max: max, rd: rd(), buf: make([]byte, 7)}
					err := p.run(got.dispatch, parsedHooks{&got})
					require.ErrorIs(t, err, io.EOF)
					assert.Equal(t, tc.want, got)
				})
			}
		})
	}
}
