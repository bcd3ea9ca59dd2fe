package prefixkey

import "strconv"

// MaxAnthropicCacheBreakpoints is the number of cache_control breakpoints Anthropic accepts in one
// request; a request with more is rejected by the API.
const MaxAnthropicCacheBreakpoints = 4

const (
	ephemeralMarker = `"cache_control":{"type":"ephemeral"}`
	textBlockOpen   = `[{"type":"text","text":`
	textBlockClose  = `,` + ephemeralMarker + `}]`
)

// InjectAnthropicCacheControl rewrites an Anthropic messages body so that its system prompt ends
// with a prompt-caching breakpoint, `"cache_control":{"type":"ephemeral"}`. It is safe for
// concurrent use and never modifies body.
//
// kvroute never calls it: injecting breakpoints changes what the client sent (and what Anthropic
// bills for cache writes), so it is off unless the gateway calls it, typically only for requests it
// forwards to Anthropic's API.
//
// A breakpoint caches the whole prefix up to and including its block (tools, then the system
// blocks before it), so one marker on the last system block caches every system block; marking
// each block would only use up breakpoints, of which Anthropic accepts MaxAnthropicCacheBreakpoints
// per request. Therefore:
//
//   - a string system prompt becomes a one-block array, [{"type":"text","text":…,"cache_control":
//     {"type":"ephemeral"}}], with the string literal kept byte for byte;
//   - an array system prompt gets the marker appended to its last block, unless that block already
//     has a cache_control member (of any value), in which case nothing changes;
//   - every other byte of the body (unknown fields, whitespace, key order, escapes) is kept;
//   - nothing changes when there is no system prompt (absent, null, "" or []), or when the body
//     already holds MaxAnthropicCacheBreakpoints non-null cache_control members (at any depth:
//     a conservative count, so that the rewrite can never make a valid request exceed the limit).
//
// It returns body itself (not a copy) when nothing changes, a new slice otherwise, and a nil slice
// with a *FieldError (wrapping ErrMalformed) when body is not a JSON object or its system is not a
// string, null or an array of objects.
func InjectAnthropicCacheControl(body []byte) ([]byte, error) {
	d := decoder{buf: body, countCC: true}
	if err := d.begin(); err != nil {
		return nil, err
	}
	sysLo, sysHi := -1, -1
	first := true
	for {
		k, more, err := d.next(&first)
		if err != nil {
			return nil, err
		}
		if !more {
			break
		}
		key := d.strBytes(k)
		isSystem := string(key) == "system"
		if string(key) == "cache_control" && d.pos < len(d.buf) && d.buf[d.pos] != 'n' {
			d.ccCount++
		}
		lo := d.pos
		if err := d.skipValue(1); err != nil {
			return nil, atField(err, d.keyString(k))
		}
		if isSystem {
			sysLo, sysHi = lo, d.pos
		}
	}
	if err := d.end(); err != nil {
		return nil, err
	}
	if sysLo < 0 {
		return body, nil
	}
	var insertAt int
	var insert string
	switch body[sysLo] {
	case 'n':
		return body, nil
	case '"':
		if d.ccCount >= MaxAnthropicCacheBreakpoints || sysHi-sysLo == 2 {
			return body, nil
		}
		out := make([]byte, 0, len(body)+len(textBlockOpen)+len(textBlockClose))
		out = append(out, body[:sysLo]...)
		out = append(out, textBlockOpen...)
		out = append(out, body[sysLo:sysHi]...)
		out = append(out, textBlockClose...)
		return append(out, body[sysHi:]...), nil
	case '[':
		var err error
		d.countCC = false
		if insertAt, insert, err = d.lastSystemBlock(sysLo); err != nil {
			return nil, atField(err, "system")
		}
		if insertAt < 0 || d.ccCount >= MaxAnthropicCacheBreakpoints {
			return body, nil
		}
	default:
		return nil, fieldErr("system", "must be a string or an array of content blocks")
	}
	out := make([]byte, 0, len(body)+len(insert))
	out = append(out, body[:insertAt]...)
	out = append(out, insert...)
	return append(out, body[insertAt:]...), nil
}

// lastSystemBlock walks the system array at body offset lo (already validated) and returns where
// to insert the marker into its last block and what to insert; insertAt is -1 when the array is
// empty or its last block already has cache_control.
func (d *decoder) lastSystemBlock(lo int) (insertAt int, insert string, err error) {
	d.pos = lo + 1
	insertAt = -1
	first := true
	for i := 0; ; i++ {
		more, err := d.nextElem(&first)
		if err != nil {
			return -1, "", err
		}
		if !more {
			return insertAt, insert, nil
		}
		if d.peek() != '{' {
			return -1, "", fieldErr("["+strconv.Itoa(i)+"]", "must be a content block object")
		}
		d.pos++
		insertAt, insert = d.pos, ephemeralMarker
		firstMember, has := true, false
		for {
			k, more, err := d.next(&firstMember)
			if err != nil {
				return -1, "", err
			}
			if !more {
				break
			}
			if string(d.strBytes(k)) == "cache_control" {
				has = true
			}
			if err := d.skipValue(3); err != nil {
				return -1, "", err
			}
			insertAt, insert = d.pos, ","+ephemeralMarker
		}
		if has {
			insertAt = -1
		}
	}
}
