package main

import (
	"encoding/json"
	"errors"
)

// The proxy edits request and response bodies at the top level of their JSON object only, by
// splicing bytes: the members it does not touch are copied as they came (same bytes, same order,
// same whitespace), and nothing is decoded beyond the top-level keys. One pass, one output
// allocation.

// jsonEdit is one change to a top-level member of a JSON object: value replaces the member's
// value (the member is appended when absent); a nil value deletes the member.
type jsonEdit struct {
	key   string
	value []byte
}

// errNotObject is returned for a body that is not a JSON object.
var errNotObject = errors.New("not a JSON object")

// editTopLevel returns body with edits applied to its top-level members. Every member whose key
// matches an edit is replaced or deleted (duplicates included); an edit whose key is absent and
// whose value is non-nil is appended, in edits' order. body must be a JSON object; an error means
// it is not (or is truncated).
func editTopLevel(body []byte, edits ...jsonEdit) ([]byte, error) {
	extra := 0
	for _, e := range edits {
		extra += len(e.key) + len(e.value) + 4
	}
	out := make([]byte, 0, len(body)+extra)
	used := make([]bool, len(edits))
	wrote := false // a member has been written to out
	err := scanObject(body, func(open int) {
		out = append(out, body[:open+1]...)
	}, func(m member) {
		i := editIndex(edits, body[m.keyStart:m.keyEnd])
		if i >= 0 {
			used[i] = true
			if edits[i].value == nil {
				return
			}
		}
		if wrote {
			out = append(out, ',')
		}
		wrote = true
		if i < 0 {
			out = append(out, body[m.start:m.end]...)
			return
		}
		out = append(out, body[m.start:m.valStart]...)
		out = append(out, edits[i].value...)
		out = append(out, body[m.valEnd:m.end]...)
	}, func(close int) {
		for i, e := range edits {
			if used[i] || e.value == nil {
				continue
			}
			if wrote {
				out = append(out, ',')
			}
			wrote = true
			out = appendJSONString(out, e.key)
			out = append(out, ':')
			out = append(out, e.value...)
		}
		out = append(out, body[close:]...)
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// appendJSONString appends s as a JSON string.
func appendJSONString(dst []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= 0x7f || c == '"' || c == '\\' {
			b, _ := json.Marshal(s) // a string always marshals
			return append(dst, b...)
		}
	}
	dst = append(dst, '"')
	dst = append(dst, s...)
	return append(dst, '"')
}

// topLevelValue returns the raw value of the last top-level member named key of the JSON object
// body (JSON decoders keep the last of duplicate keys), and false when there is none. The result
// aliases body.
func topLevelValue(body []byte, key string) ([]byte, bool, error) {
	var v []byte
	found := false
	err := scanObject(body, func(int) {}, func(m member) {
		if keyEquals(body[m.keyStart:m.keyEnd], key) {
			v, found = body[m.valStart:m.valEnd], true
		}
	}, func(int) {})
	if err != nil {
		return nil, false, err
	}
	return v, found, nil
}

// editIndex returns the index of the edit whose key is rawKey (a quoted JSON string), or -1.
func editIndex(edits []jsonEdit, rawKey []byte) int {
	for i := range edits {
		if keyEquals(rawKey, edits[i].key) {
			return i
		}
	}
	return -1
}

// keyEquals reports whether the quoted JSON string rawKey denotes key. Keys without escapes (all
// of them in practice) are compared without allocating.
func keyEquals(rawKey []byte, key string) bool {
	inner := rawKey[1 : len(rawKey)-1]
	escaped := false
	for _, c := range inner {
		if c == '\\' {
			escaped = true
			break
		}
	}
	if !escaped {
		return string(inner) == key
	}
	var s string
	if err := json.Unmarshal(rawKey, &s); err != nil {
		return false
	}
	return s == key
}

// member locates one top-level member in a body: start is just after the '{' or ',' before it
// (leading whitespace included), the key spans [keyStart, keyEnd) with its quotes, the value
// [valStart, valEnd), and end is the index of the ',' or '}' after it (trailing whitespace
// included before it).
type member struct {
	start, keyStart, keyEnd, valStart, valEnd, end int
}

// scanObject walks the top-level members of the JSON object body: open is called with the index
// of '{', each member in order, then close with the index of the closing '}'. Values are skipped,
// not validated beyond their nesting and strings.
func scanObject(body []byte, open func(int), each func(member), close func(int)) error {
	i := skipSpace(body, 0)
	if i >= len(body) || body[i] != '{' {
		return errNotObject
	}
	open(i)
	i++
	first := true
	for {
		start := i
		i = skipSpace(body, i)
		if i >= len(body) {
			return errNotObject
		}
		if body[i] == '}' && first {
			close(i)
			return nil
		}
		if body[i] != '"' {
			return errNotObject
		}
		m := member{start: start, keyStart: i}
		var err error
		if i, err = skipString(body, i); err != nil {
			return err
		}
		m.keyEnd = i
		i = skipSpace(body, i)
		if i >= len(body) || body[i] != ':' {
			return errNotObject
		}
		m.valStart = skipSpace(body, i+1)
		if m.valEnd, err = skipValue(body, m.valStart); err != nil {
			return err
		}
		i = skipSpace(body, m.valEnd)
		if i >= len(body) || (body[i] != ',' && body[i] != '}') {
			return errNotObject
		}
		m.end = i
		each(m)
		first = false
		switch body[i] {
		case ',':
			i++
		default:
			close(i)
			return nil
		}
	}
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// skipString returns the index just after the string that starts at b[i] == '"'.
func skipString(b []byte, i int) (int, error) {
	for i++; i < len(b); i++ {
		switch b[i] {
		case '\\':
			i++
		case '"':
			return i + 1, nil
		}
	}
	return 0, errNotObject
}

// skipValue returns the index just after the JSON value that starts at b[i].
func skipValue(b []byte, i int) (int, error) {
	if i >= len(b) {
		return 0, errNotObject
	}
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for ; i < len(b); i++ {
			switch b[i] {
			case '"':
				j, err := skipString(b, i)
				if err != nil {
					return 0, err
				}
				i = j - 1
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1, nil
				}
			}
		}
		return 0, errNotObject
	}
	j := i
	for j < len(b) {
		switch b[j] {
		case ',', '}', ']', ' ', '\t', '\n', '\r':
			if j == i {
				return 0, errNotObject
			}
			return j, nil
		}
		j++
	}
	return 0, errNotObject
}
