package prefixkey

import "bytes"

// parseCostPerObject is what a parse holds per JSON object of the body, beyond its text: a
// Message, a Part and their bookkeeping, about ten times a one-word message's bytes.
const parseCostPerObject = 384

// parseCostBase is what a parse holds whatever the body: the Request, and the slack of the text
// arena, which is sized for the body's whole text.
const parseCostBase = 16 << 10

// EstimateParseCost returns an estimate of the heap bytes that a Request parsed from body holds
// beyond body itself, from one fast pass over body without parsing it: 16 KiB, plus 384 bytes
// per '{' of the body, plus the bytes of every string written with an escape ("\n", "\"",
// "\u00e9"), which Parse decodes into a copy. Strings written without escapes cost nothing
// there, as Parse keeps a long one as a view into body; the text of a message of several text
// parts, which Parse joins into a copy, is not counted when written without escapes. A gateway
// holding bodies against a memory budget (package kvhttp's Budget) holds this too while the
// Request lives. Safe for concurrent use; it allocates nothing.
func EstimateParseCost(body []byte) int64 {
	return parseCostBase + int64(bytes.Count(body, []byte{'{'}))*parseCostPerObject + int64(escapedStringBytes(body))
}

// escapedStringBytes returns the total length of body's JSON strings that hold a backslash. It
// takes quotes as alternately opening and closing strings, a quote after an odd run of
// backslashes being escaped, which is exact for valid JSON; for any body it returns at most
// len(body), in linear time.
func escapedStringBytes(body []byte) int {
	total := 0
	for i := 0; i < len(body); {
		q := bytes.IndexByte(body[i:], '"')
		if q < 0 {
			break
		}
		lo := i + q + 1
		end, escaped := len(body), false
		for j := lo; j < len(body); {
			k := bytes.IndexByte(body[j:], '"')
			if k < 0 {
				break
			}
			e := j + k
			run := 0 // the backslashes just before the quote (a run ends at the previous quote)
			for e-1-run >= j && body[e-1-run] == '\\' {
				run++
			}
			if run%2 == 0 {
				end = e
				break
			}
			escaped = true
			j = e + 1
		}
		if escaped || bytes.IndexByte(body[lo:end], '\\') >= 0 {
			total += end - lo
		}
		i = end + 1
	}
	return total
}
