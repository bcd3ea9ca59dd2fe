// Package yamlconf decodes YAML configuration strictly into Go structs: every mapping key must
// name a field (its yaml tag), scalars must parse as the field's type, ${NAME} and
// ${NAME:-default} references are expanded from the environment, and every error names the field
// path and the line ("response_cache.ttl: invalid duration "5x" (line 7)"). It also provides the
// configuration value types Duration (days allowed: "7d") and Secret (never printed).
//
// yaml.v3's own strict mode (Decoder.KnownFields) reports unknown fields by Go type name and
// cannot expand variables before a scalar is converted, hence this small reflective decoder.
package yamlconf

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// Decode decodes data into v, a pointer to a struct, strictly: every mapping key must name a field
// (its yaml tag), scalars must parse as the field's type, and every error names the field path
// and the line. Scalars have their ${NAME} and ${NAME:-default} references expanded with lookup
// first (an unset NAME without default is an error; ${NAME:-default} also replaces an empty
// value, as in sh). Null values leave fields at their zero values; pointer fields are allocated
// when present. Supported field types: structs, pointers, slices, maps with string keys, strings,
// bools, integers, floats, Duration, and interface values (decoded by yaml.v3 without expansion).
// Decode is safe for concurrent use.
func Decode(data []byte, v any, lookup func(string) (string, bool)) error {
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		// yaml.v3 gives a syntax error's line only sometimes (never on the first line, and one
		// less than the line in parser errors): the one mistake it cannot name, an environment
		// reference in a flow collection, is found here and located.
		if ref, kind, line, col, ok := flowEnvRef(data); ok {
			return fmt.Errorf("invalid YAML: %s inside a flow %s must be quoted, as \"%s\" (line %d, column %d): %w",
				ref, kind, ref, line, col, err)
		}
		return fmt.Errorf("invalid YAML: %w", err)
	}
	if doc.Kind == 0 { // empty document
		return nil
	}
	d := &nodeDecoder{lookup: lookup}
	return d.decode(&doc, reflect.ValueOf(v).Elem(), "")
}

type nodeDecoder struct {
	lookup func(string) (string, bool)
	depth  int
}

var (
	durationType = reflect.TypeFor[Duration]()
	envRef       = regexp.MustCompile(`\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}`)
)

// fail formats an error at path with the node's line.
func fail(n *yaml.Node, path, format string, args ...any) error {
	if path == "" {
		path = "(document)"
	}
	return fmt.Errorf("%s: %s (line %d)", path, fmt.Sprintf(format, args...), n.Line)
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

func (d *nodeDecoder) decode(n *yaml.Node, v reflect.Value, path string) error {
	d.depth++
	defer func() { d.depth-- }()
	if d.depth > 64 {
		return fail(n, path, "nested too deeply")
	}
	switch n.Kind {
	case yaml.DocumentNode:
		if len(n.Content) == 0 {
			return nil
		}
		return d.decode(n.Content[0], v, path)
	case yaml.AliasNode:
		return d.decode(n.Alias, v, path)
	}
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return nil // null leaves the field at its zero value (its default)
	}
	if v.Type() == durationType {
		s, err := d.scalar(n, path)
		if err != nil {
			return err
		}
		dur, err := ParseDuration(s)
		if err != nil {
			return fail(n, path, "%v", err)
		}
		if dur < 0 {
			return fail(n, path, "must not be negative")
		}
		v.SetInt(int64(dur))
		return nil
	}
	switch v.Kind() {
	case reflect.Pointer:
		p := reflect.New(v.Type().Elem())
		if err := d.decode(n, p.Elem(), path); err != nil {
			return err
		}
		v.Set(p)
		return nil
	case reflect.Struct:
		return d.decodeStruct(n, v, path)
	case reflect.Slice:
		if n.Kind != yaml.SequenceNode {
			return fail(n, path, "must be a list")
		}
		s := reflect.MakeSlice(v.Type(), len(n.Content), len(n.Content))
		for i, c := range n.Content {
			if err := d.decode(c, s.Index(i), fmt.Sprintf("%s[%d]", path, i)); err != nil {
				return err
			}
		}
		v.Set(s)
		return nil
	case reflect.Map:
		if n.Kind != yaml.MappingNode {
			return fail(n, path, "must be a mapping")
		}
		if v.Type().Key().Kind() != reflect.String {
			return fail(n, path, "unsupported map key type")
		}
		m := reflect.MakeMapWithSize(v.Type(), len(n.Content)/2)
		for i := 0; i+1 < len(n.Content); i += 2 {
			k := n.Content[i].Value
			e := reflect.New(v.Type().Elem()).Elem()
			if err := d.decode(n.Content[i+1], e, join(path, k)); err != nil {
				return err
			}
			m.SetMapIndex(reflect.ValueOf(k).Convert(v.Type().Key()), e)
		}
		v.Set(m)
		return nil
	case reflect.Interface:
		// Free-form values (disaggregated_serving.default_external_storage): decoded as yaml.v3
		// does, without expansion.
		var x any
		if err := n.Decode(&x); err != nil {
			return fail(n, path, "%v", err)
		}
		if x != nil {
			v.Set(reflect.ValueOf(x))
		}
		return nil
	}

	s, err := d.scalar(n, path)
	if err != nil {
		return err
	}
	switch v.Kind() {
	case reflect.String:
		v.SetString(s)
	case reflect.Bool:
		switch strings.ToLower(s) {
		case "true":
			v.SetBool(true)
		case "false":
			v.SetBool(false)
		default:
			return fail(n, path, "%q is not true or false", s)
		}
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		x, err := strconv.ParseInt(strings.ReplaceAll(s, "_", ""), 0, v.Type().Bits())
		if err != nil {
			return fail(n, path, "%q is not an integer", s)
		}
		v.SetInt(x)
	case reflect.Float32, reflect.Float64:
		x, err := strconv.ParseFloat(s, v.Type().Bits())
		if err != nil {
			return fail(n, path, "%q is not a number", s)
		}
		v.SetFloat(x)
	default:
		return fail(n, path, "unsupported field type %s", v.Type())
	}
	return nil
}

// scalar returns the node's scalar value with environment references expanded.
func (d *nodeDecoder) scalar(n *yaml.Node, path string) (string, error) {
	if n.Kind != yaml.ScalarNode {
		return "", fail(n, path, "must be a single value, not a %s", kindName(n.Kind))
	}
	var missing []string
	out := envRef.ReplaceAllStringFunc(n.Value, func(ref string) string {
		m := envRef.FindStringSubmatch(ref)
		hasDefault := strings.Contains(ref, ":-")
		if v, ok := d.lookup(m[1]); ok && (v != "" || !hasDefault) {
			return v
		}
		if hasDefault { // ${NAME:-default}: the default when NAME is unset or empty, as in sh
			return m[2]
		}
		missing = append(missing, m[1])
		return ""
	})
	if len(missing) > 0 {
		return "", fail(n, path, "environment variable %s is not set", strings.Join(missing, ", "))
	}
	return out, nil
}

func kindName(k yaml.Kind) string {
	switch k {
	case yaml.MappingNode:
		return "mapping"
	case yaml.SequenceNode:
		return "list"
	default:
		return "value"
	}
}

// decodeStruct decodes a mapping into a struct by the fields' yaml tags; an unknown key is an
// error that suggests the closest field name.
func (d *nodeDecoder) decodeStruct(n *yaml.Node, v reflect.Value, path string) error {
	if n.Kind != yaml.MappingNode {
		return fail(n, path, "must be a mapping, not a %s", kindName(n.Kind))
	}
	fields := map[string]int{}
	t := v.Type()
	for i := range t.NumField() {
		tag, _, _ := strings.Cut(t.Field(i).Tag.Get("yaml"), ",")
		if tag != "" && tag != "-" {
			fields[tag] = i
		}
	}
	seen := map[string]bool{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		kn, vn := n.Content[i], n.Content[i+1]
		key := kn.Value
		if kn.Kind == yaml.ScalarNode && kn.Tag == "!!merge" {
			return fail(kn, path, "merge keys (<<) are not supported")
		}
		fi, ok := fields[key]
		if !ok {
			msg := "unknown field"
			if s := closest(key, fields); s != "" {
				msg += fmt.Sprintf(" (did you mean %s?)", s)
			}
			return fail(kn, join(path, key), "%s", msg)
		}
		if seen[key] {
			return fail(kn, join(path, key), "duplicate field")
		}
		seen[key] = true
		if err := d.decode(vn, v.Field(fi), join(path, key)); err != nil {
			return err
		}
	}
	return nil
}

// closest returns the known field name nearest to key by edit distance, if it is near enough.
func closest(key string, fields map[string]int) string {
	names := make([]string, 0, len(fields))
	for f := range fields {
		names = append(names, f)
	}
	sort.Strings(names)
	best, bestD := "", 1<<30
	for _, f := range names {
		if dd := editDistance(key, f); dd < bestD {
			best, bestD = f, dd
		}
	}
	if bestD <= max(2, len(key)/3) {
		return best
	}
	return ""
}

func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			c := prev[j-1]
			if a[i-1] != b[j-1] {
				c++
			}
			cur[j] = min(c, prev[j]+1, cur[j-1]+1)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// Secret is a configuration string that is never printed: String, GoString, LogValue and
// MarshalText (hence fmt, slog and JSON) show "[REDACTED]" (or "" when empty). Use string(s) for
// the value.
type Secret string

// String returns "[REDACTED]" for a non-empty secret, "" otherwise.
func (s Secret) String() string {
	if s == "" {
		return ""
	}
	return "[REDACTED]"
}

// GoString is String, so that %#v redacts too.
func (s Secret) GoString() string { return s.String() }

// LogValue is String, so that slog redacts too.
func (s Secret) LogValue() slog.Value { return slog.StringValue(s.String()) }

// MarshalText is String, so that JSON and YAML encodings redact too.
func (s Secret) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// Duration is a time.Duration read from YAML as Go duration text ("90s", "5m", "1h30m") with a
// days unit added ("7d", "1d12h"), or as a bare integer number of seconds.
type Duration time.Duration

// String formats the duration compactly ("5m", "24h", "7d").
func (d Duration) String() string {
	td := time.Duration(d)
	if td > 0 && td%(24*time.Hour) == 0 {
		return strconv.FormatInt(int64(td/(24*time.Hour)), 10) + "d"
	}
	s := td.String()
	if strings.HasSuffix(s, "m0s") {
		s = s[:len(s)-2]
	}
	if strings.HasSuffix(s, "h0m") {
		s = s[:len(s)-2]
	}
	return s
}

// ParseDuration parses the Duration text forms: Go duration text ("90s", "5m", "1h30m") with a
// leading days unit ("7d", "1d12h", "0.5d"), or a bare number of seconds ("300"). Negative
// durations are errors.
func ParseDuration(s string) (Duration, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return 0, errors.New("empty duration")
	}
	if n, err := strconv.ParseInt(s, 10, 64); err == nil {
		if n < 0 || n > math.MaxInt64/int64(time.Second) {
			return 0, fmt.Errorf("duration %q out of range", s)
		}
		return Duration(time.Duration(n) * time.Second), nil
	}
	var days time.Duration
	if i := strings.IndexByte(s, 'd'); i > 0 {
		n, err := strconv.ParseFloat(s[:i], 64)
		if err != nil || n < 0 || n > 100_000 {
			return 0, fmt.Errorf("invalid duration %q (use e.g. 90s, 5m, 24h, 7d)", s)
		}
		days = time.Duration(n * float64(24*time.Hour))
		s = s[i+1:]
		if s == "" {
			return Duration(days), nil
		}
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 {
		return 0, fmt.Errorf("invalid duration %q (use e.g. 90s, 5m, 24h, 7d)", s)
	}
	return Duration(days + d), nil
}
