package yamlconf

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"
)

type inner struct {
	Name  string            `yaml:"name"`
	Tags  map[string]string `yaml:"tags"`
	Ratio float64           `yaml:"ratio"`
}

type sample struct {
	Port    int            `yaml:"port"`
	On      *bool          `yaml:"on"`
	TTL     Duration       `yaml:"ttl"`
	Token   Secret         `yaml:"token"`
	Inner   inner          `yaml:"inner"`
	Items   []inner        `yaml:"items"`
	Ptr     *inner         `yaml:"ptr"`
	Free    map[string]any `yaml:"free"`
	Skipped string         `yaml:"-"`
}

func env(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

func TestDecode(t *testing.T) {
	var s sample
	err := Decode([]byte(`
port: ${PORT}
on: true
ttl: 7d
token: "${TOKEN}"
inner: {name: "${NAME:-anon}", tags: {a: "1"}, ratio: 0.5}
items:
  - name: x
  - name: y
ptr: {name: p}
free: {k: [1, 2]}
`), &s, env(map[string]string{"PORT": "8081", "TOKEN": "t0k"}))
	if err != nil {
		t.Fatal(err)
	}
	if s.Port != 8081 || !*s.On || time.Duration(s.TTL) != 7*24*time.Hour || s.Token != "t0k" || s.Inner.Name != "anon" ||
		s.Inner.Tags["a"] != "1" || len(s.Items) != 2 || s.Items[1].Name != "y" || s.Ptr.Name != "p" || s.Free["k"] == nil {
		t.Errorf("%+v", s)
	}
}

func TestDecodeErrors(t *testing.T) {
	for in, want := range map[string]string{
		"prot: 1":                    "prot: unknown field (did you mean port?) (line 1)",
		"port: x":                    `port: "x" is not an integer (line 1)`,
		"inner: {nmae: a}":           "inner.nmae: unknown field (did you mean name?)",
		"items: [{name: a}, {x: 1}]": "items[1].x: unknown field",
		"items: {name: a}":           "items: must be a list",
		"inner: [1]":                 "inner: must be a mapping, not a list",
		"ttl: 5x":                    `ttl: invalid duration "5x"`,
		"token: ${MISSING}":          "token: environment variable MISSING is not set",
		"port: 1\nport: 2":           "port: duplicate field",
		"on: maybe":                  `on: "maybe" is not true or false`,
		"inner: {ratio: fast}":       `inner.ratio: "fast" is not a number`,
		"port: [1]":                  "port: must be a single value, not a list",
		"{":                          "invalid YAML",
	} {
		var s sample
		err := Decode([]byte(in), &s, env(nil))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: err %v, want %q", in, err, want)
		}
	}
	var s sample
	if err := Decode(nil, &s, env(nil)); err != nil {
		t.Errorf("empty document: %v", err)
	}
	if err := Decode([]byte("a: &x [*x, *x]\nitems: *x\n"), &s, env(nil)); err == nil {
		t.Error("recursive alias accepted")
	}
}

func TestParseDuration(t *testing.T) {
	for in, want := range map[string]time.Duration{
		"5m": 5 * time.Minute, "30m": 30 * time.Minute, "24h": 24 * time.Hour, "7d": 7 * 24 * time.Hour,
		"1d12h": 36 * time.Hour, "90s": 90 * time.Second, "1h30m": 90 * time.Minute, "300": 300 * time.Second,
		"0.5d": 12 * time.Hour, "100ms": 100 * time.Millisecond,
	} {
		got, err := ParseDuration(in)
		if err != nil || time.Duration(got) != want {
			t.Errorf("ParseDuration(%q) = %v, %v; want %v", in, time.Duration(got), err, want)
		}
	}
	for _, in := range []string{"", "5x", "d", "-3d", "7days", "1d-2h", "-5m"} {
		if d, err := ParseDuration(in); err == nil {
			t.Errorf("ParseDuration(%q) = %v, want an error", in, d)
		}
	}
	for d, want := range map[Duration]string{Duration(5 * time.Minute): "5m", Duration(24 * time.Hour): "1d",
		Duration(90 * time.Minute): "1h30m", Duration(10 * time.Second): "10s", Duration(2 * time.Hour): "2h"} {
		if d.String() != want {
			t.Errorf("%v.String() = %q, want %q", time.Duration(d), d.String(), want)
		}
	}
}

func TestSecretRedacted(t *testing.T) {
	s := Secret("hunter2")
	var buf bytes.Buffer
	slog.New(slog.NewTextHandler(&buf, nil)).Info("x", "s", s)
	slog.New(slog.NewJSONHandler(&buf, nil)).Info("x", "s", s)
	j, _ := json.Marshal(map[string]Secret{"s": s})
	buf.Write(j)
	fmt.Fprintf(&buf, "%v %s %#v %+v", s, s, s, struct{ S Secret }{s})
	if strings.Contains(buf.String(), "hunter2") {
		t.Errorf("leaked: %s", buf.String())
	}
	if Secret("").String() != "" {
		t.Error("empty secret not empty")
	}
}

// FuzzDecode: no input makes Decode panic or hang.
func FuzzDecode(f *testing.F) {
	for _, s := range []string{"port: 1\non: true\nttl: 7d\ntoken: ${T:-x}\n", "inner: {name: a, tags: {a: b}}\nitems: [{name: x}]\n",
		"a: &x [*x, *x]\nitems: *x\n", "free: {a: &y [*y]}\n", "ptr: ~\nport: 0x1F\n",
		"inner: {name: ${N:-x}}\n", "note: |\n  {x: ${Y}}\nitems: [a, '${Z}', \"q\\\" ${W}\"]\n"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var s sample
		_ = Decode(data, &s, func(k string) (string, bool) { return "v-" + k, len(k)%2 == 0 })
	})
}

// FuzzParseDuration: never panics; accepted durations are not negative.
func FuzzParseDuration(f *testing.F) {
	for _, s := range []string{"5m", "7d", "1d12h", "300", "0.5d", "-1s", "d", "1e400d"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if d, err := ParseDuration(s); err == nil && d < 0 {
			t.Fatalf("ParseDuration(%q) = %v", s, d)
		}
	})
}

// Issue 28: an environment reference unquoted in a flow mapping (port: ${PORT:-18080} inside
// {...}) is a YAML syntax error that yaml.v3 reports without a line on the first line and with
// the wrong one elsewhere; the error names the reference, the fix, the line and the column.
func TestFlowEnvRefLocated(t *testing.T) {
	type S struct {
		Server struct {
			Port int    `yaml:"port"`
			Host string `yaml:"host"`
		} `yaml:"server"`
		Hosts []string `yaml:"hosts"`
		Note  string   `yaml:"note"`
	}
	unset := func(string) (string, bool) { return "", false }
	for _, tc := range []struct{ name, in, want string }{
		{"first line", "server: {port: ${PORT:-18080}}\n",
			`invalid YAML: ${PORT:-18080} inside a flow mapping {...} must be quoted, as "${PORT:-18080}" (line 1, column 16): yaml: `},
		{"later line", "# proxy\nnote: \"{a: ${B}}\" # {c: ${D}}\nserver: {host: x,\n   port: ${PORT:-18080}}\n",
			`${PORT:-18080} inside a flow mapping {...} must be quoted, as "${PORT:-18080}" (line 4, column 10)`},
		{"after a block scalar", "note: |\n  {x: ${NOT_THIS}}\nhosts: [a, ${HOST}]\n",
			`${HOST} inside a flow sequence [...] must be quoted, as "${HOST}" (line 3, column 12)`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var s S
			err := Decode([]byte(tc.in), &s, unset)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Decode(%q) = %v, want an error containing %q", tc.in, err, tc.want)
			}
		})
	}
	// Quoted, the reference is fine; a syntax error of another kind keeps yaml.v3's message.
	var s S
	if err := Decode([]byte("server: {port: \"${PORT:-18080}\", host: '${H:-x}'}\n"), &s, unset); err != nil || s.Server.Port != 18080 || s.Server.Host != "x" {
		t.Errorf("quoted: %v, %+v", err, s)
	}
	err := Decode([]byte("note: \"${A}\"\nserver: {port: 1\n"), &s, unset)
	if err == nil || strings.Contains(err.Error(), "must be quoted") {
		t.Errorf("unclosed flow mapping: %v", err)
	}
}
