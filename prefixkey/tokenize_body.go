package prefixkey

import (
	"io"
	"unicode/utf8"
)

// jsonPiece is one piece of a /tokenize body: raw JSON as is, or a string to write quoted.
type jsonPiece struct {
	s      string
	quoted bool
}

// jsonStream is an io.Reader of a JSON document given as pieces, which quotes each string as it
// is read: a /tokenize body of a large prompt is never held whole. Strings are escaped as JSON
// requires ('"', '\\' and control characters; invalid UTF-8 as \ufffd, as encoding/json does).
type jsonStream struct {
	pieces []jsonPiece
	i, off int     // the piece being read, and the offset in its string
	open   bool    // the current quoted piece's opening quote is written
	esc    [6]byte // an escape that did not fit in the caller's buffer
	escN   int     // its bytes not yet read, at the end of esc
}

// newJSONStream returns the stream of pieces and its length in bytes.
func newJSONStream(pieces []jsonPiece) (*jsonStream, int64) {
	var n int64
	for _, p := range pieces {
		if !p.quoted {
			n += int64(len(p.s))
			continue
		}
		n += 2
		for i := 0; i < len(p.s); {
			c := p.s[i]
			if c < utf8.RuneSelf {
				n += int64(len(escapeASCII(c)))
				i++
				continue
			}
			r, size := utf8.DecodeRuneInString(p.s[i:])
			if r == utf8.RuneError && size == 1 {
				n += 6 // \ufffd
			} else {
				n += int64(size)
			}
			i += size
		}
	}
	return &jsonStream{pieces: pieces}, n
}

// escapeASCII returns the JSON encoding of the ASCII byte c inside a string.
func escapeASCII(c byte) string {
	switch c {
	case '"':
		return `\"`
	case '\\':
		return `\\`
	case '\n':
		return `\n`
	case '\r':
		return `\r`
	case '\t':
		return `\t`
	}
	if c < 0x20 {
		const hex = "0123456789abcdef"
		return `\u00` + string(hex[c>>4]) + string(hex[c&0xf])
	}
	return asciiStrings[c : c+1]
}

// asciiStrings holds every ASCII byte at its own offset, so that escapeASCII returns a plain byte
// without allocating.
var asciiStrings = func() string {
	b := make([]byte, utf8.RuneSelf)
	for i := range b {
		b[i] = byte(i)
	}
	return string(b)
}()

// Read implements io.Reader.
func (j *jsonStream) Read(p []byte) (int, error) {
	n := 0
	for n < len(p) {
		if j.escN > 0 { // the rest of an escape
			c := copy(p[n:], j.esc[len(j.esc)-j.escN:])
			n += c
			j.escN -= c
			continue
		}
		if j.i >= len(j.pieces) {
			if n == 0 {
				return 0, io.EOF
			}
			return n, nil
		}
		pc := &j.pieces[j.i]
		if !pc.quoted {
			c := copy(p[n:], pc.s[j.off:])
			n += c
			if j.off += c; j.off == len(pc.s) {
				j.i, j.off = j.i+1, 0
			}
			continue
		}
		if !j.open {
			p[n] = '"'
			n++
			j.open = true
			continue
		}
		if j.off == len(pc.s) {
			p[n] = '"'
			n++
			j.i, j.off, j.open = j.i+1, 0, false
			continue
		}
		// The run of bytes that need no escaping, in one copy.
		s, run := pc.s[j.off:], 0
		for run < len(s) && run < len(p)-n {
			c := s[run]
			if c < 0x20 || c == '"' || c == '\\' {
				break
			}
			if c >= utf8.RuneSelf {
				if r, size := utf8.DecodeRuneInString(s[run:]); r == utf8.RuneError && size == 1 {
					break
				} else if run+size > len(p)-n {
					if run == 0 { // a character that does not fit: write it through esc
						copy(j.esc[len(j.esc)-size:], s[:size])
						j.escN, j.off = size, j.off+size
					}
					break
				} else {
					run += size
					continue
				}
			}
			run++
		}
		if run > 0 {
			n += copy(p[n:], s[:run])
			j.off += run
			continue
		}
		if j.escN > 0 {
			continue
		}
		var e string
		if c := s[0]; c < utf8.RuneSelf {
			e = escapeASCII(c)
		} else {
			e = `\ufffd` // an invalid byte
		}
		j.off++
		copy(j.esc[len(j.esc)-len(e):], e)
		j.escN = len(e)
	}
	return n, nil
}
