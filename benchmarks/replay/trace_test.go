package replay

import (
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const sampleTrace = `{"timestamp": 0, "input_length": 1100, "output_length": 6, "hash_ids": [0, 1, 2]}

{"timestamp": 40, "input_length": 700, "output_length": 4, "hash_ids": [0, 3], "extra": "ignored"}
{"timestamp": 40.5, "input_length": 2000, "output_length": 0, "hash_ids": [0]}
`

func TestReadTrace(t *testing.T) {
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	_, _ = zw.Write([]byte(sampleTrace))
	require.NoError(t, zw.Close())

	for name, input := range map[string][]byte{"plain": []byte(sampleTrace), "gzip": gz.Bytes()} {
		t.Run(name, func(t *testing.T) {
			w, err := ReadTrace(bytes.NewReader(input), "sample")
			require.NoError(t, err)
			require.Len(t, w.Requests, 3)
			r0, r1, r2 := w.Requests[0], w.Requests[1], w.Requests[2]
			require.Equal(t, []Segment{{0, 512}, {1, 512}, {2, 76}}, r0.Segments, "last block partial")
			require.Equal(t, 1100, r0.InputTokens())
			require.Equal(t, []Segment{{0, 512}, {3, 188}}, r1.Segments)
			require.Equal(t, 40*time.Millisecond, r1.Arrival)
			require.Equal(t, 40500*time.Microsecond, r2.Arrival)
			// Tokens beyond the hash ids are the request's own.
			require.Len(t, r2.Segments, 2)
			require.Equal(t, Segment{0, 512}, r2.Segments[0])
			require.Equal(t, 2000-512, r2.Segments[1].Tokens)
			require.GreaterOrEqual(t, r2.Segments[1].ID, privateSpace)
			require.Equal(t, 0, r2.OutputTokens)
		})
	}
}

func TestReadTraceSortsAndRebases(t *testing.T) {
	in := `{"timestamp": 500, "input_length": 10, "output_length": 1, "hash_ids": [7]}
{"timestamp": 200, "input_length": 10, "output_length": 2, "hash_ids": [8]}
{"timestamp": 200, "input_length": 10, "output_length": 3, "hash_ids": [9]}`
	w, err := ReadTrace(strings.NewReader(in), "t")
	require.NoError(t, err)
	var got []uint64
	for _, r := range w.Requests {
		got = append(got, r.Segments[0].ID)
	}
	require.Equal(t, []uint64{8, 9, 7}, got, "by timestamp, ties in file order")
	require.Equal(t, time.Duration(0), w.Requests[0].Arrival)
	require.Equal(t, 300*time.Millisecond, w.Requests[2].Arrival)
	require.Equal(t, 300*time.Millisecond, w.Span())
}

func TestReadTraceMalformed(t *testing.T) {
	good := `{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}` + "\n"
	for _, tc := range []struct {
		name, line, want string
	}{
		{"not json", `{"timestamp": 0,`, "line 2"},
		{"missing timestamp", `{"input_length": 10, "output_length": 1, "hash_ids": []}`, "missing timestamp"},
		{"missing input_length", `{"timestamp": 1, "output_length": 1}`, "missing input_length"},
		{"missing output_length", `{"timestamp": 1, "input_length": 1}`, "missing output_length"},
		{"negative timestamp", `{"timestamp": -1, "input_length": 10, "output_length": 1}`, "timestamp -1"},
		{"zero input", `{"timestamp": 1, "input_length": 0, "output_length": 1}`, "input_length 0"},
		{"fractional input", `{"timestamp": 1, "input_length": 1.5, "output_length": 1}`, "input_length"},
		{"negative hash", `{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [3, -2]}`, "hash_ids[1]"},
		{"hash not a number", `{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}`, "hash_ids"},
		{"array", `[1, 2]`, "line 2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ReadTrace(strings.NewReader(good+tc.line+"\n"+good), "bad.jsonl")
			require.Error(t, err)
			require.True(t, errors.Is(err, ErrMalformedTrace), "%v", err)
			require.Contains(t, err.Error(), "bad.jsonl line 2")
			require.Contains(t, err.Error(), tc.want)
		})
	}
	t.Run("corrupt gzip", func(t *testing.T) {
		_, err := ReadTrace(bytes.NewReader([]byte{0x1f, 0x8b, 0, 0}), "x.gz")
		require.Error(t, err)
	})
}

func FuzzParseTraceLine(f *testing.F) {
	for _, l := range strings.Split(sampleTrace, "\n") {
		f.Add([]byte(l))
	}
	f.Add([]byte(`{"timestamp": 1e300, "input_length": 9223372036854775807, "output_length": 1}`))
	f.Add([]byte(`{"timestamp": 0, "input_length": 5, "output_length": 0, "hash_ids": null}`))
	f.Fuzz(func(t *testing.T, line []byte) {
		r, err := ParseTraceLine(line)
		if err != nil {
			if !errors.Is(err, ErrMalformedTrace) {
				t.Fatalf("error %v does not wrap ErrMalformedTrace", err)
			}
			return
		}
		if r.Timestamp < 0 || r.InputLength <= 0 || r.OutputLength < 0 {
			t.Fatalf("accepted out-of-range record %+v", r)
		}
		req := r.Request(0)
		if req.InputTokens() != r.InputLength || req.Arrival < 0 {
			t.Fatalf("request %+v does not match record %+v", req, r)
		}
	})
}

// burstyTrace returns a Mooncake-format trace of n requests in bursts of 20 with equal timestamps,
// every one starting with hash id 0 (a system prompt shared by all), then one of 30 documents of 4
// blocks, then a private question block.
func burstyTrace(n int, seed uint64) string {
	rng := rand.New(rand.NewPCG(seed, 1))
	var b strings.Builder
	next := uint64(1000)
	for i := range n {
		doc := 1 + rng.Uint64N(30)*10
		ids := []uint64{0, doc, doc + 1, doc + 2, doc + 3, next}
		next++
		fmt.Fprintf(&b, `{"timestamp": %d, "input_length": %d, "output_length": %d, "hash_ids": [%d, %d, %d, %d, %d, %d]}`+"\n",
			(i/20)*3000, 5*512+1+int(rng.Uint64N(511)), 20+rng.Uint64N(100), ids[0], ids[1], ids[2], ids[3], ids[4], ids[5])
	}
	return b.String()
}
