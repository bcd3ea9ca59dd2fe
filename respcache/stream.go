package respcache

import (
	"bytes"
	"net/http"
)

// This file holds the Server-Sent Events side of the middleware: a scanner that watches a live
// stream for its terminal event while the bytes pass through, and the replay of a stored stream.
//
// The scanner follows the WHATWG HTML "Server-sent events" parsing rules
// (https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation):
// lines end with CRLF, LF or CR (a CR and the LF after it may arrive in different writes); a line
// starting with ':' is a comment; "field:value" drops one space after the colon; an empty line
// dispatches the event; an event still pending when the stream ends is not dispatched. It keeps a
// fixed 64-byte window of each line, enough to recognise the fields it needs, and no more: the
// recorded copy of the stream lives in the recorder, the scanner only classifies it.
//
// A stream is complete when its terminal event was dispatched and no error event was:
//   - OpenAI (and vLLM, SGLang): an event whose data is exactly "[DONE]";
//   - Anthropic: an event of type "message_stop" ("event: message_stop").
//
// An error event ("event: error", or data that is a JSON object whose first member is "error", as
// OpenAI-compatible servers send mid-stream) marks the stream failed: it is relayed, never stored.

// sseLineWindow is how many leading bytes of a line the scanner keeps: "event: message_stop" and
// `data: {"error"` (with some white space) fit.
const sseLineWindow = 64

// sseScanner classifies an SSE byte stream fed to it in arbitrary pieces. The zero value is ready.
// It is not safe for concurrent use.
type sseScanner struct {
	line [sseLineWindow]byte
	n    int  // bytes of the current line held in line (≤ sseLineWindow)
	long bool // the current line is longer than the window
	cr   bool // the last byte fed was a CR: an LF right after it ends nothing

	// the event being accumulated
	evStop    bool // event type is "message_stop"
	evError   bool // event type is "error"
	dataLines int  // data lines seen
	dataDone  bool // the last data line is exactly "[DONE]"
	dataError bool // a data line is a JSON object whose first member is "error"

	done   bool // a terminal event was dispatched
	failed bool // an error event was dispatched
}

// complete reports whether the stream so far ends a successful response: a terminal event was
// dispatched and no error event was.
func (s *sseScanner) complete() bool { return s.done && !s.failed }

// feed scans the next piece of the stream.
func (s *sseScanner) feed(p []byte) {
	for len(p) > 0 {
		if s.cr {
			s.cr = false
			if p[0] == '\n' {
				p = p[1:]
				continue
			}
		}
		i := indexEOL(p)
		if i < 0 {
			s.appendLine(p)
			return
		}
		s.appendLine(p[:i])
		s.cr = p[i] == '\r'
		s.endLine()
		p = p[i+1:]
	}
}

// indexEOL returns the index of the first CR or LF in p, or -1.
func indexEOL(p []byte) int {
	i := bytes.IndexByte(p, '\n')
	end := i
	if end < 0 {
		end = len(p)
	}
	if j := bytes.IndexByte(p[:end], '\r'); j >= 0 {
		return j
	}
	return i
}

func (s *sseScanner) appendLine(p []byte) {
	if s.long {
		return
	}
	k := copy(s.line[s.n:], p)
	s.n += k
	if k < len(p) {
		s.long = true
	}
}

// endLine interprets the line held and starts a new one.
func (s *sseScanner) endLine() {
	line, long := s.line[:s.n], s.long
	s.n, s.long = 0, false
	if len(line) == 0 && !long {
		s.dispatch()
		return
	}
	if len(line) > 0 && line[0] == ':' {
		return // comment
	}
	field, value := line, []byte(nil)
	if i := bytes.IndexByte(line, ':'); i >= 0 {
		field, value = line[:i], line[i+1:]
		if len(value) > 0 && value[0] == ' ' {
			value = value[1:]
		}
	} else if long {
		return // a field name longer than the window: no field we know
	}
	switch string(field) {
	case "event":
		s.evStop = !long && string(value) == "message_stop"
		s.evError = !long && string(value) == "error"
	case "data":
		s.dataLines++
		s.dataDone = !long && string(value) == "[DONE]"
		if isErrorObject(value) {
			s.dataError = true
		}
	}
}

// isErrorObject reports whether v starts a JSON object whose first member is "error".
func isErrorObject(v []byte) bool {
	v = bytes.TrimLeft(v, " \t")
	if len(v) == 0 || v[0] != '{' {
		return false
	}
	v = bytes.TrimLeft(v[1:], " \t")
	return bytes.HasPrefix(v, []byte(`"error"`))
}

// dispatch ends the current event.
func (s *sseScanner) dispatch() {
	switch {
	case s.evError || s.dataError:
		s.failed = true
	case s.evStop, s.dataLines == 1 && s.dataDone:
		s.done = true
	}
	s.evStop, s.evError, s.dataLines, s.dataDone, s.dataError = false, false, 0, false, false
}

// nextEvent returns the length of the first event of b: up to and including the empty line that
// dispatches it, or all of b when no empty line follows. Replay writes one event per Write.
func nextEvent(b []byte) int {
	i := 0
	for i < len(b) {
		j := indexEOL(b[i:])
		if j < 0 {
			return len(b)
		}
		empty := j == 0
		i += j
		if b[i] == '\r' && i+1 < len(b) && b[i+1] == '\n' {
			i += 2
		} else {
			i++
		}
		if empty {
			return i
		}
	}
	return len(b)
}

// replayStream writes body, a stored SSE stream, one event per Write, flushing after each, so that
// the client sees the events as it would from the engine, only sooner. It stops at the first
// write error (the client left).
func replayStream(w http.ResponseWriter, body []byte) {
	f, _ := w.(http.Flusher)
	var rc *http.ResponseController
	if f == nil {
		rc = http.NewResponseController(w)
	}
	for len(body) > 0 {
		n := nextEvent(body)
		if _, err := w.Write(body[:n]); err != nil {
			return
		}
		if f != nil {
			f.Flush()
		} else if err := rc.Flush(); err != nil && err != http.ErrNotSupported {
			return
		}
		body = body[n:]
	}
}
