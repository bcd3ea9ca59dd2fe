package yamlconf

import (
	"strings"
	"unicode/utf8"
)

// flowEnvRef finds the first ${NAME} or ${NAME:-default} reference written unquoted inside a
// YAML flow collection ({...} or [...]), where its braces end the collection or open another
// (port: ${PORT:-18080} inside {...} is a syntax error yaml.v3 reports without a line). It
// returns the reference, the collection's kind ("mapping {...}" or "sequence [...]"), and its
// 1-based line and column (in characters); ok is false when there is none. It reads the text
// with a light scanner of YAML's lexical rules (comments, quoted scalars, block scalars, where
// a flow collection may start), enough to tell such a reference from one in a block scalar, a
// quoted string or a comment.
func flowEnvRef(data []byte) (ref, kind string, line, col int, ok bool) {
	src := string(data)
	lines := strings.SplitAfter(src, "\n")
	var flow []byte   // the open flow collections' brackets, innermost last
	var quote byte    // the open quoted scalar's quote, 0 when none
	blockIndent := -1 // indentation of the line that opened a block scalar, -1 when none
	for li, text := range lines {
		indent := len(text) - len(strings.TrimLeft(text, " \t"))
		if blockIndent >= 0 {
			if strings.TrimSpace(text) == "" || indent > blockIndent {
				continue // a block scalar's content
			}
			blockIndent = -1
		}
		start := quote == 0 && len(flow) == 0 // a node may start here (block context)
		for i := 0; i < len(text); i++ {
			c := text[i]
			if quote != 0 {
				switch {
				case quote == '"' && c == '\\':
					i++
				case quote == '\'' && c == '\'' && i+1 < len(text) && text[i+1] == '\'':
					i++
				case c == quote:
					quote = 0
				}
				continue
			}
			prevSpace := i == 0 || text[i-1] == ' ' || text[i-1] == '\t'
			switch {
			case c == ' ' || c == '\t' || c == '\r' || c == '\n':
				continue
			case c == '#' && prevSpace:
				i = len(text) // a comment
				continue
			}
			if len(flow) == 0 { // block context
				switch {
				case start && (c == '{' || c == '['):
					flow = append(flow, c)
				case start && (c == '"' || c == '\''):
					quote = c
				case start && (c == '|' || c == '>'):
					blockIndent = indent
					i = len(text)
				case (c == '-' || c == '?' || c == ':') && (i+1 == len(text) || strings.ContainsRune(" \t\r\n", rune(text[i+1]))):
					start = true // a sequence entry, a complex key or a value: a node may follow
					continue
				}
				start = false
				continue
			}
			// Flow context.
			switch c {
			case '{', '[':
				flow = append(flow, c)
			case '}', ']':
				flow = flow[:len(flow)-1]
			case '"', '\'':
				if p := prevNonSpace(text[:i]); p == 0 || strings.IndexByte("{[,:", p) >= 0 {
					quote = c
				}
			case '$':
				if m := envRef.FindString(text[i:]); m != "" && strings.HasPrefix(text[i:], m) {
					kind = "mapping {...}"
					if flow[len(flow)-1] == '[' {
						kind = "sequence [...]"
					}
					return m, kind, li + 1, utf8.RuneCountInString(text[:i]) + 1, true
				}
			}
		}
	}
	return "", "", 0, 0, false
}

// prevNonSpace returns the last byte of s that is not a space or tab, 0 when none.
func prevNonSpace(s string) byte {
	t := strings.TrimRight(s, " \t")
	if t == "" {
		return 0
	}
	return t[len(t)-1]
}
