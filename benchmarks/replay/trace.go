package replay

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"time"
)

// TraceBlockTokens is the number of tokens one hash id of a Mooncake trace stands for.
const TraceBlockTokens = 512

// maxTraceLine bounds one line of a trace (a 1M-token request's hash ids take about 14 KiB).
const maxTraceLine = 64 << 20

// ErrMalformedTrace is wrapped by every error ReadTrace and ParseTraceLine return for input that
// is not a Mooncake trace.
var ErrMalformedTrace = errors.New("replay: malformed trace")

// TraceRecord is one line of a Mooncake trace.
type TraceRecord struct {
	Timestamp    float64 // ms from the trace's start
	InputLength  int     // prompt tokens
	OutputLength int     // completion tokens
	HashIDs      []uint64
}

// traceLine is the JSON form; pointers tell a missing field from a zero one.
type traceLine struct {
	Timestamp    *float64 `json:"timestamp"`
	InputLength  *int64   `json:"input_length"`
	OutputLength *int64   `json:"output_length"`
	HashIDs      []int64  `json:"hash_ids"`
}

// ParseTraceLine parses one line of a Mooncake trace: a JSON object with timestamp (ms, ≥ 0),
// input_length (> 0), output_length (≥ 0) and hash_ids (integers ≥ 0; may be empty or absent);
// other fields are ignored. The error wraps ErrMalformedTrace and says which field is wrong.
func ParseTraceLine(line []byte) (TraceRecord, error) {
	var l traceLine
	if err := json.Unmarshal(line, &l); err != nil {
		return TraceRecord{}, fmt.Errorf("%w: %v", ErrMalformedTrace, err)
	}
	switch {
	case l.Timestamp == nil:
		return TraceRecord{}, fmt.Errorf("%w: missing timestamp", ErrMalformedTrace)
	case l.InputLength == nil:
		return TraceRecord{}, fmt.Errorf("%w: missing input_length", ErrMalformedTrace)
	case l.OutputLength == nil:
		return TraceRecord{}, fmt.Errorf("%w: missing output_length", ErrMalformedTrace)
	case !(*l.Timestamp >= 0) || math.IsInf(*l.Timestamp, 1) || *l.Timestamp > float64(math.MaxInt64/int64(time.Millisecond)):
		return TraceRecord{}, fmt.Errorf("%w: timestamp %v: want a finite number of ms ≥ 0", ErrMalformedTrace, *l.Timestamp)
	case *l.InputLength <= 0 || *l.InputLength > 1<<30:
		return TraceRecord{}, fmt.Errorf("%w: input_length %d: want 1 to 2^30", ErrMalformedTrace, *l.InputLength)
	case *l.OutputLength < 0 || *l.OutputLength > 1<<30:
		return TraceRecord{}, fmt.Errorf("%w: output_length %d: want 0 to 2^30", ErrMalformedTrace, *l.OutputLength)
	}
	r := TraceRecord{Timestamp: *l.Timestamp, InputLength: int(*l.InputLength), OutputLength: int(*l.OutputLength),
		HashIDs: make([]uint64, len(l.HashIDs))}
	for i, h := range l.HashIDs {
		if h < 0 || uint64(h) >= generatedSpace {
			return TraceRecord{}, fmt.Errorf("%w: hash_ids[%d] = %d: want 0 to 2^61", ErrMalformedTrace, i, h)
		}
		r.HashIDs[i] = uint64(h)
	}
	return r, nil
}

// Request converts a record into a workload request; index numbers the request's private segment
// (prompt tokens beyond its hash ids, which no other request shares). Each hash id covers
// TraceBlockTokens tokens, the last as many as input_length leaves; hash ids past input_length
// are dropped.
func (r TraceRecord) Request(index int) Request {
	req := Request{Arrival: time.Duration(r.Timestamp * float64(time.Millisecond)), OutputTokens: r.OutputLength}
	left := r.InputLength
	req.Segments = make([]Segment, 0, min(len(r.HashIDs), (left+TraceBlockTokens-1)/TraceBlockTokens)+1)
	for _, h := range r.HashIDs {
		if left == 0 {
			break
		}
		n := min(left, TraceBlockTokens)
		req.Segments = append(req.Segments, Segment{ID: h, Tokens: n})
		left -= n
	}
	if left > 0 {
		req.Segments = append(req.Segments, Segment{ID: privateSpace | uint64(index), Tokens: left})
	}
	return req
}

// ReadTrace reads a Mooncake trace — one JSON object per line, see ParseTraceLine; blank lines are
// skipped — plain or gzip-compressed (detected by its magic bytes, whatever the file's name).
// Requests are returned in timestamp order (a stable sort: lines with equal timestamps keep their
// order), with arrivals relative to the first. The error names the line; it wraps
// ErrMalformedTrace for bad content, or is the reader's or gzip's error.
func ReadTrace(r io.Reader, name string) (*Workload, error) {
	br := bufio.NewReaderSize(r, 1<<16)
	if magic, err := br.Peek(2); err == nil && magic[0] == 0x1f && magic[1] == 0x8b {
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, fmt.Errorf("replay: %s: %w", name, err)
		}
		defer zr.Close()
		br = bufio.NewReaderSize(zr, 1<<16)
	}
	sc := bufio.NewScanner(br)
	sc.Buffer(make([]byte, 0, 1<<16), maxTraceLine)
	w := &Workload{Name: name}
	for lineNo := 1; sc.Scan(); lineNo++ {
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 {
			continue
		}
		rec, err := ParseTraceLine(line)
		if err != nil {
			return nil, fmt.Errorf("replay: %s line %d: %w", name, lineNo, err)
		}
		w.Requests = append(w.Requests, rec.Request(len(w.Requests)))
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return nil, fmt.Errorf("replay: %s: %w: a line longer than %d bytes", name, ErrMalformedTrace, maxTraceLine)
		}
		return nil, fmt.Errorf("replay: %s: %w", name, err)
	}
	sortByArrival(w.Requests)
	if len(w.Requests) > 0 {
		t0 := w.Requests[0].Arrival
		for i := range w.Requests {
			w.Requests[i].Arrival -= t0
		}
	}
	return w, nil
}

// ReadTraceFile reads the trace at path with ReadTrace.
func ReadTraceFile(path string) (*Workload, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("replay: %w", err)
	}
	defer f.Close()
	return ReadTrace(f, path)
}

func sortByArrival(rs []Request) {
	slices.SortStableFunc(rs, func(a, b Request) int {
		switch {
		case a.Arrival < b.Arrival:
			return -1
		case a.Arrival > b.Arrival:
			return 1
		}
		return 0
	})
}
